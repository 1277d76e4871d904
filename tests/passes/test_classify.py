"""Classify: mapping types, TVM patterns, FLOPs and bytes of hand-built graphs and of our LLaMA."""

from collections import Counter

import pytest
import tvm
from fuselight import config
from fuselight.errors import FuselightError
from fuselight.passes import Classify, classify_module
from fuselight.passes.classify import MAPPINGS, OPS, TVM_PATTERNS
from tvm import relax, te, tirx
from tvm.relax import op as O


def _module(params, make, num_input=None):
    """A one-function module ``main(params)`` whose dataflow block emits ``make(bb, *params)``."""
    bb = relax.BlockBuilder()
    with bb.function("main", params, attrs={"num_input": num_input} if num_input is not None else None):
        with bb.dataflow():
            out = bb.emit_output(make(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def _tensor(name, shape, dtype="float16"):
    return relax.Var(name, relax.TensorType(shape, dtype))


def _by_op(mod):
    return {info.op: info for info in classify_module(mod)["main"]}


def _chain(bb, x, w, b, idx):
    y = bb.emit(O.matmul(x, w))
    z = bb.emit(O.add(y, b))
    r = bb.emit(O.reshape(z, [z.ty.shape.values[0], 3, 11]))
    t = bb.emit(O.permute_dims(z))
    g = bb.emit(O.take(w, idx, axis=0))
    s = bb.emit(O.sum(t, axis=[1]))
    m = bb.emit(O.nn.softmax(z))
    c = bb.emit(O.strided_slice(z, axes=[1], begin=[2], end=[12]))
    k = bb.emit(O.broadcast_to(b, [5, 33]))
    return relax.Tuple([r, g, s, m, c, k])


def _static():
    params = [_tensor("x", [7, 127]), _tensor("w", [127, 33]), _tensor("b", [33]), _tensor("idx", [5], "int32")]
    return _module(params, _chain)


def _symbolic():
    n = tirx.Var("n", "int64")
    params = [_tensor("x", [n, 127]), _tensor("w", [127, 33]), _tensor("b", [33]), _tensor("idx", [5], "int32")]
    return _module(params, _chain)


def test_static_mappings_and_costs():
    ops = _by_op(_static())
    expected = {
        "relax.matmul": ("many-to-many", "OutEWiseFusable", 2 * 7 * 33 * 127, 2 * (7 * 127 + 127 * 33), 2 * 7 * 33),
        "relax.add": ("one-to-one", "ElemWise", 7 * 33, 2 * (7 * 33 + 33), 2 * 7 * 33),
        "relax.reshape": ("reorganize", "Injective", 0, 0, 0),
        "relax.permute_dims": ("shuffle", "Injective", 0, 2 * 7 * 33, 2 * 7 * 33),
        # A gather reads the indices and the 5 rows it copies, not the whole table.
        "relax.take": ("one-to-many", "Opaque", 0, 4 * 5 + 2 * 5 * 33, 2 * 5 * 33),
        "relax.sum": ("many-to-many", "CommReduce", 7 * 33, 2 * 7 * 33, 2 * 33),
        "relax.nn.softmax": ("many-to-many", "OutEWiseFusable", 5 * 7 * 33, 2 * 7 * 33, 2 * 7 * 33),
        "relax.strided_slice": ("one-to-one", "ElemWise", 7 * 10, 2 * 7 * 10, 2 * 7 * 10),
        "relax.broadcast_to": ("one-to-many", "Broadcast", 0, 2 * 33, 2 * 5 * 33),
    }
    for op, (mapping, pattern, flops, read, written) in expected.items():
        info = ops[op]
        assert (info.mapping, info.tvm_pattern) == (mapping, pattern), op
        assert (info.flops, info.bytes_read, info.bytes_written) == (str(flops), str(read), str(written)), op
        assert info.cost({}) == (flops, read + written), op
    assert ops["relax.matmul"].shape == [7, 33] and ops["relax.matmul"].dtype == "float16"
    assert ops["relax.matmul"].inputs == ["x", "w"]


def test_symbolic_dims_stay_symbolic():
    static, symbolic = _by_op(_static()), _by_op(_symbolic())
    mm = symbolic["relax.matmul"]
    assert mm.shape == ["n", 33]
    assert mm.flops == f"n * {2 * 33 * 127}"
    assert symbolic["relax.permute_dims"].shape == [33, "n"]
    for op, info in symbolic.items():
        assert info.cost({"n": 7}) == static[op].cost({}), op
    assert mm.cost({"n": 1}) == (2 * 33 * 127, 2 * (127 + 127 * 33 + 33))
    with pytest.raises(FuselightError, match="n"):
        mm.cost({"seq_len": 7})


def test_broadcast_binary_is_one_to_one_and_elementwise_flops_count_elements():
    x, y = _tensor("x", [3, 1, 127], "float32"), _tensor("y", [1, 7, 127], "float32")
    ops = _by_op(_module([x, y], lambda bb, x, y: bb.emit(O.nn.silu(O.multiply(x, y)))))
    for op in ("relax.multiply", "relax.nn.silu"):
        assert ops[op].mapping == "one-to-one"
        assert ops[op].cost({})[0] == 3 * 7 * 127
    assert ops["relax.multiply"].bytes_read == str(4 * (3 * 127 + 7 * 127))


def test_a_tensor_read_twice_by_one_op_is_read_once():
    """x * x loads x once, as ``fusion_plan.estimate`` counts a kernel's inputs: with x counted twice,
    PropertyRewrite took x*x + x*x for a tie with x * (x + x), which moves a tensor more (issue 28)."""
    x = _tensor("x", [5, 127], "float32")
    ops = _by_op(_module([x], lambda bb, x: bb.emit(O.multiply(x, x))))
    assert (ops["relax.multiply"].bytes_read, ops["relax.multiply"].bytes_written) == (str(4 * 5 * 127), str(4 * 5 * 127))


def test_unknown_ops_are_opaque():
    x = _tensor("x", [7, 127])

    def make(bb, x):
        sorted_x = bb.emit(O.sort(x, axis=1))  # a real Relax op that is not in the table
        return relax.call_dps_packed("my.unknown.kernel", [sorted_x], relax.TensorType([7, 127], "float16"))

    infos = classify_module(_module([x], make))["main"]
    assert [(i.op, i.mapping, i.tvm_pattern, i.flops) for i in infos] == [
        ("relax.sort", "opaque", None, None),
        ("call_dps_packed:my.unknown.kernel", "opaque", None, None),
    ]
    assert infos[1].cost({}) == (None, None)
    assert "relax.sort" not in OPS


def test_dynamic_rank_has_unknown_cost():
    x = relax.Var("x", relax.TensorType(ndim=-1, dtype="float32"))
    w = _tensor("w", [127, 7], "float32")
    ops = _by_op(_module([x, w], lambda bb, x, w: bb.emit(O.matmul(O.exp(x), w))))
    assert ops["relax.exp"].mapping == "one-to-one" and ops["relax.exp"].shape is None
    assert ops["relax.matmul"].mapping == "many-to-many"
    for info in ops.values():
        assert (info.flops, info.bytes_read) == (None, None)
        assert info.cost({}) == (None, None)


def test_weights_and_constants_are_marked():
    x = _tensor("x", [7, 127], "float32")
    params = relax.Var("params", relax.TupleType([relax.TensorType([127, 5], "float32")]))

    def make(bb, x, params):
        w = bb.emit(relax.TupleGetItem(params, 0))
        y = bb.emit(O.matmul(x, w))
        return O.add(y, relax.const(1.5, "float32"))

    ops = _by_op(_module([x, params], make, num_input=1))
    assert ops["relax.matmul"].inputs_param == [1] and ops["relax.matmul"].inputs_const == []
    assert ops["relax.add"].inputs_const == [1] and ops["relax.add"].inputs_param == []
    assert ops["relax.add"].inputs[1] == "<const>"


def _call_te(compute, *shapes):
    params = [_tensor(f"a{i}", s, "float32") for i, s in enumerate(shapes)]
    mod = _module(params, lambda bb, *args: bb.call_te(compute, *args))
    (info,) = [i for i in classify_module(mod)["main"] if i.op.startswith("call_tir:")]
    return info


def test_call_tir_classes_from_indexing():
    ew = _call_te(lambda a: te.compute(a.shape, lambda i, j: a[i, j] * 2.0 + 1.0, name="ew"), [7, 127])
    assert (ew.mapping, ew.tvm_pattern, ew.cost({})[0]) == ("one-to-one", "ElemWise", 2 * 7 * 127)
    tr = _call_te(lambda a: te.compute((127, 7), lambda i, j: a[j, i], name="tr"), [7, 127])
    assert (tr.mapping, tr.cost({})[0]) == ("shuffle", 0)
    bc = _call_te(lambda a: te.compute((7, 127), lambda i, j: a[j], name="bc"), [127])
    assert bc.mapping == "one-to-many"

    def mm(a, b):
        k = te.reduce_axis((0, 127), name="k")
        return te.compute((7, 33), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="mm")

    assert _call_te(mm, [7, 127], [127, 33]).cost({})[0] == 2 * 7 * 33 * 127
    assert _call_te(mm, [7, 127], [127, 33]).mapping == "many-to-many"
    # Indices read from another tensor: a gather we can't prove a class for.
    gather = _call_te(lambda a, i: te.compute((5,), lambda j: a[i[j].astype("int64")], name="g"), [127], [5])
    assert gather.mapping == "opaque"


# Each op as built in a small graph, for checking the table's TVM pattern against TVM's own analysis.
_PATTERN_CASES = {
    "relax.add": lambda x, b, w: O.add(x, b),
    "relax.exp": lambda x, b, w: O.exp(x),
    "relax.nn.silu": lambda x, b, w: O.nn.silu(x),
    "relax.astype": lambda x, b, w: O.astype(x, "float16"),
    "relax.reshape": lambda x, b, w: O.reshape(x, [127, 7]),
    "relax.expand_dims": lambda x, b, w: O.expand_dims(x, 0),
    "relax.permute_dims": lambda x, b, w: O.permute_dims(x),
    "relax.split": lambda x, b, w: O.split(x, [3], axis=0),
    "relax.concat": lambda x, b, w: O.concat([x, x], 0),
    "relax.strided_slice": lambda x, b, w: O.strided_slice(x, [1], [0], [2]),
    "relax.broadcast_to": lambda x, b, w: O.broadcast_to(b, [7, 127]),
    "relax.repeat": lambda x, b, w: O.repeat(x, 2, 0),
    "relax.zeros": lambda x, b, w: O.zeros([7, 127], "float32"),
    "relax.matmul": lambda x, b, w: O.matmul(x, w),
    "relax.sum": lambda x, b, w: O.sum(x, axis=[1]),
    "relax.mean": lambda x, b, w: O.mean(x, axis=[1]),
    "relax.nn.softmax": lambda x, b, w: O.nn.softmax(x),
    "relax.nn.rms_norm": lambda x, b, w: O.nn.rms_norm(x, b),
    "relax.nn.layer_norm": lambda x, b, w: O.nn.layer_norm(x, b, b, axes=[-1]),
}


@pytest.mark.parametrize("op", sorted(_PATTERN_CASES))
def test_table_patterns_match_tvm(op):
    params = [_tensor("x", [7, 127], "float32"), _tensor("b", [127], "float32"), _tensor("w", [127, 5], "float32")]
    mod = _module(params, lambda bb, *args: _PATTERN_CASES[op](*args))
    assert _by_op(mod)[op].op == op
    lowered = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(mod))
    patterns = [
        TVM_PATTERNS[int(f.attrs["op_pattern"])] for _, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)
    ]
    assert patterns == [OPS[op].tvm_pattern]


def test_pass_leaves_module_unchanged():
    mod = _symbolic()
    before = mod.script()
    classify = Classify()
    out = tvm.transform.Sequential([classify])(mod)
    tvm.ir.assert_structural_equal(out, mod)
    assert out.script() == before
    assert [i.op for i in classify.result["main"]] == [i.op for i in classify_module(mod)["main"]]


@pytest.fixture(scope="module")
def tiny_llama():
    from fuselight.model.llama import export_module
    from fuselight.target import resolve, to_tvm

    cfg = config.load("tiny-llama")
    mod, _ = export_module(cfg, to_tvm(resolve("llvm")))
    return cfg, classify_module(mod)


def test_tiny_llama_every_binding_classified(tiny_llama):
    cfg, result = tiny_llama
    assert set(result) == {
        "embed", "prefill", "decode", "decode_attend", "decode_greedy", "greedy", "create_tir_paged_kv_cache"
    }
    for infos in result.values():
        assert all(i.mapping in MAPPINGS for i in infos)
    opaque = [(fn, i.op) for fn, infos in result.items() for i in infos if i.mapping == "opaque"]
    # Only the KV cache's constructor: it builds a runtime object, no tensor computation.
    assert opaque == [("create_tir_paged_kv_cache", "call_pure_packed:vm.builtin.paged_attention_kv_cache_create")]
    last = next(i for i in result["prefill"] if i.op == "call_tir:last_position")
    assert last.mapping == "one-to-one" and last.shape == [1, 1, cfg.hidden_size]


def test_tiny_llama_split_decode_is_decode_plus_greedy(tiny_llama):
    # decode_attend + decode_greedy (the generation loop's halves) compute decode, then the argmax.
    _, result = tiny_llama

    def ops(fn: str) -> Counter:
        # Each function unpacks the params it uses: weight lookups differ, computations must not.
        return Counter(i.op for i in result[fn] if i.op != "tuple_get_item")

    assert ops("decode_attend") + ops("decode_greedy") == ops("decode") + ops("greedy")
    assert [i.op for i in result["greedy"]] == ["call_tir:greedy_chunks", "call_tir:greedy1", "alias"]


def test_tiny_llama_decode_counts_and_flops(tiny_llama):
    cfg, result = tiny_llama
    layers = cfg.num_hidden_layers
    decode = Counter(i.op for i in result["decode"])
    assert decode["relax.matmul"] == 4 * layers + 1  # qkv, o, gate_up, down per layer, lm_head
    assert decode["relax.nn.rms_norm"] == 2 * layers + 1
    assert decode["call_dps_packed:vm.builtin.attention_kv_cache_attention_with_fused_qkv"] == layers
    assert decode["relax.nn.silu"] == decode["relax.multiply"] == decode["relax.split"] == layers
    # One token through every linear layer: 2 FLOPs per weight element of the matmul weights.
    linear = sum(s[0] * s[1] for n, s in cfg.weight_shapes().items() if len(s) == 2 and "embed_tokens" not in n)
    assert sum(i.cost({})[0] for i in result["decode"] if i.op == "relax.matmul") == 2 * linear
    attention = [i for i in result["decode"] if i.op.startswith("call_dps_packed:")]
    q = cfg.num_attention_heads * cfg.head_dim
    assert all(i.mapping == "many-to-many" and i.cost({"kv_len": 37})[0] == 4 * q * 37 for i in attention)
    # The prefill's symbolic length stays symbolic and scales the layers' matmuls.
    prefill_mm = [i for i in result["prefill"] if i.op == "relax.matmul"]
    assert all("seq_len" in i.flops for i in prefill_mm[:-1]) and prefill_mm[-1].shape == [1, 1, cfg.vocab_size]
    assert sum(i.cost({"seq_len": 7})[0] for i in prefill_mm[:-1]) == 7 * 2 * (
        linear - cfg.vocab_size * cfg.hidden_size
    )
