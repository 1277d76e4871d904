"""MergeSiblingMatmuls: separate Q/K/V and gate/up projections merged into one matmul, the merged
weights computed by the lifted parameter transform; same results; refused where not cheaper or not
provably weights."""

import numpy as np
import pytest
import tvm
from fuselight.errors import FuselightError
from fuselight.passes.merge_sibling_matmuls import MERGED_ATTR, MergeSiblingMatmuls
from fuselight.passes.weight_transform import launch_bytes, lift_and_transform
from tvm import relax, tirx
from tvm.relax import op as O

HIDDEN = 16
QKV_ROWS = (("wq", 16), ("wk", 8), ("wv", 8))


def _qkv(rows, bounds=None, packed=False, dtype="float32"):
    """Attention-style projections of one input with three separate weights (a model that does not
    fuse them), then a small function of q, k, v so that every output is used."""
    x = relax.Var("x", relax.TensorType([rows, HIDDEN], dtype))
    types = [relax.TensorType([r, HIDDEN], dtype) for _, r in QKV_ROWS]
    if packed:
        params = [relax.Var("packed_params", relax.TupleType(types))]
    else:
        params = [relax.Var(n, t) for (n, _), t in zip(QKV_ROWS, types)]
    attrs = {"num_input": 1, **({"tir_var_upper_bound": bounds} if bounds else {})}
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *params], attrs=attrs):
        with bb.dataflow():
            ws = [bb.emit(relax.TupleGetItem(params[0], i)) for i in range(3)] if packed else params
            q, k, v = (bb.emit(O.matmul(x, bb.emit(O.permute_dims(w)))) for w in ws)
            kv = bb.emit(O.multiply(k, O.nn.silu(v)))
            out = bb.emit_output(relax.Tuple([q, kv]))
        bb.emit_func_output(out)
    return bb.get()


def _gate_up(rows=1):
    x = relax.Var("x", relax.TensorType([rows, HIDDEN], "float32"))
    gate, up = (relax.Var(n, relax.TensorType([24, HIDDEN], "float32")) for n in ("w_gate", "w_up"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, gate, up], attrs={"num_input": 1}):
        with bb.dataflow():
            g = bb.emit(O.matmul(x, bb.emit(O.permute_dims(gate))))
            u = bb.emit(O.matmul(x, bb.emit(O.permute_dims(up))))
            out = bb.emit_output(O.multiply(O.nn.silu(g), u))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, x, weights):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())

    def runtime(w):
        return tvm.runtime.tensor(w) if isinstance(w, np.ndarray) else tuple(runtime(f) for f in w)

    out = vm["main"](tvm.runtime.tensor(x), *[runtime(w) for w in weights])
    return [t.numpy() for t in out] if not hasattr(out, "numpy") else [out.numpy()]


def _ops(mod):
    return [b.value.op.name for blk in mod["main"].body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)]


def _check_same(mod, weights, rows=1):
    p = MergeSiblingMatmuls()
    merged = p(mod)
    assert len(p.merged) == 1
    assert _ops(merged).count("relax.matmul") == 1 and "relax.split" in _ops(merged)
    lifted, new_weights = lift_and_transform(merged, "main", weights)
    x = np.random.default_rng(2).uniform(-1, 1, (rows, HIDDEN)).astype("float32")
    for got, ref in zip(_run(lifted, x, new_weights), _run(mod, x, weights)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)  # the same dot products
    return p, merged, lifted, new_weights


def _weights(rows, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (r, HIDDEN)).astype("float32") for r in rows]


def test_qkv_merged_for_decode():
    p, merged, lifted, new_weights = _check_same(_qkv(1), _weights([r for _, r in QKV_ROWS]))
    assert p.merged == [("main", ["wq", "wk", "wv"])]
    assert [list(g) for g in merged.attrs[MERGED_ATTR]] == [["main", ["wq", "wk", "wv"]]]
    # One merged weight (the transform also lifts the transpose): [HIDDEN, 16 + 8 + 8].
    assert [w.shape for w in new_weights] == [(HIDDEN, 32)]
    assert len(lifted["main"].params) == 2


def test_packed_params_as_mlc_packs_them():
    weights = _weights([r for _, r in QKV_ROWS])
    _check_same(_qkv(1, packed=True), [weights])


def test_gate_up_not_cheaper_unfused():
    """Two siblings: the merged matmul plus its split launch as many kernels as the two matmuls and
    move more bytes, in Classify's unfused costs (FuseOps does fold this split into silu * up; the
    fusion planner is where that saving belongs)."""
    p = MergeSiblingMatmuls()
    p(_gate_up())
    assert p.merged == []


def test_symbolic_rows_need_a_bound():
    """The split writes the outputs again: for unbounded rows that outgrows the launches saved."""
    n = tirx.Var("n", "int64")
    p = MergeSiblingMatmuls()
    assert p(_qkv(n)) is not None and p.merged == []
    # Up to 64 rows the extra bytes stay below two launches' worth.
    _check_same(_qkv(n, bounds={"n": 64}), _weights([r for _, r in QKV_ROWS]), rows=5)
    huge = 10 * launch_bytes("sm_90") // (HIDDEN * 4)
    p = MergeSiblingMatmuls()
    p(_qkv(n, bounds={"n": huge}))
    assert p.merged == []


def test_not_merged():
    # Different inputs; a right operand that is an activation, not a weight; no num_input.
    x, y = (relax.Var(n, relax.TensorType([1, HIDDEN], "float32")) for n in "xy")
    w1, w2 = (relax.Var(n, relax.TensorType([8, HIDDEN], "float32")) for n in ("w1", "w2"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y, w1, w2], attrs={"num_input": 2}):
        with bb.dataflow():
            a = bb.emit(O.matmul(x, bb.emit(O.permute_dims(w1))))
            b = bb.emit(O.matmul(y, bb.emit(O.permute_dims(w2))))
            c = bb.emit(O.matmul(x, bb.emit(O.permute_dims(y))))
            out = bb.emit_output(relax.Tuple([a, b, c]))
        bb.emit_func_output(out)
    mod = bb.get()
    p = MergeSiblingMatmuls()
    assert p(mod)["main"].same_as(mod["main"]) and p.merged == []
    p(_drop_num_input(_qkv(1)))
    assert p.merged == []


def _drop_num_input(mod):
    func = mod["main"]
    return tvm.IRModule({"main": relax.Function(func.params, func.body, func.ret_ty, func.is_pure)})


def test_tiny_llama_already_fused():
    from fuselight import config
    from fuselight.model.llama import export_module
    from fuselight.target import resolve, to_tvm

    mod, _ = export_module(config.load("tiny-llama"), to_tvm(resolve("llvm")))
    p = MergeSiblingMatmuls()
    p(mod)
    assert p.merged == []  # qkv_proj and gate_up_proj are fused in the model already


def test_bad_input():
    with pytest.raises(FuselightError, match="sm_00"):
        MergeSiblingMatmuls("sm_00")
    with pytest.raises(FuselightError, match="no weight parameters"):
        lift_and_transform(_drop_num_input(_qkv(1)), "main", [])
