"""ResidualStreamFP32: a bfloat16 residual stream added and normalised in float32 on CPU targets, and on sm_90
through prefill's add+RMSNorm kernels and decode's norm-GEMVs (with FuseNormIntoGemv); the numbers against
float64 (a hand-built stream, our LLaMA, the float32-stream add+RMSNorm function, a decode chain of fused
norm-GEMVs run on llvm), what it leaves alone (float16, plain ops on GPUs, broadcasts)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402
from conftest import compare_with_reference, relative_error  # noqa: E402
from fuselight import config, kv_hooks  # noqa: E402
from fuselight import pipeline as pl  # noqa: E402
from fuselight.compile import build  # noqa: E402
from fuselight.computations import plain_add_rms_norm  # noqa: E402
from fuselight.contracts import RULE_ATTR  # noqa: E402
from fuselight.model.llama import export_module  # noqa: E402
from fuselight.model.weights import hf_config, random_weights  # noqa: E402
from fuselight.options import Options  # noqa: E402
from fuselight.passes import DEFAULT, ResidualStreamFP32  # noqa: E402
from fuselight.passes.add_rms_norm_kernels import add_rms_norm_eps  # noqa: E402
from fuselight.passes.residual_stream_fp32 import stream_adds  # noqa: E402
from fuselight.rules.gemm.analysis import analyze_matmul  # noqa: E402
from fuselight.target import resolve, to_tvm  # noqa: E402
from tvm import relax, te, topi  # noqa: E402

LLVM = to_tvm(resolve("llvm"))
SM90 = to_tvm(resolve("cuda", "sm_90"))
EPS = 1e-5
# Rows, hidden (odd: no vector width divides it), residual additions.
ROWS, HIDDEN, ADDS = 3, 97, 48


def _stream_module(dtype: str, rows=ROWS, adds: int = ADDS, broadcast: bool = False) -> tvm.IRModule:
    """``main(x, c, w)``: ``adds`` times ``h = h + rms_norm(h, w) * c[i]`` (a branch read from the norm, as a
    LLaMA layer's), then ``rms_norm(h, w)``. ``broadcast``: each branch a ``[hidden]`` row instead."""
    x = relax.Var("x", relax.TensorType([rows, HIDDEN], dtype))
    c = relax.Var("c", relax.TensorType([adds, 1, HIDDEN], dtype))
    w = relax.Var("w", relax.TensorType([HIDDEN], dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, c, w]):
        with bb.dataflow():
            h = x
            for i in range(adds):
                normed = bb.emit(relax.op.nn.rms_norm(h, w, axes=[-1], epsilon=EPS))
                ci = bb.emit(relax.op.reshape(relax.op.take(c, relax.const(i, "int64"), axis=0), [1, HIDDEN]))
                if broadcast:  # one row for every row of the stream
                    normed = bb.emit(relax.op.sum(normed, axis=[0], keepdims=True))
                branch = bb.emit(relax.op.multiply(normed, ci))
                h = bb.emit(relax.op.add(h, branch))
            out = bb.emit_output(relax.op.nn.rms_norm(h, w, axes=[-1], epsilon=EPS))
        bb.emit_func_output(out)
    return bb.get()


def _inputs(dtype: str, seed: int, rows=ROWS, adds: int = ADDS) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    # Branches at 1/sqrt(2 adds) of the stream, as the model's weight init keeps its stream O(1).
    return [rng.standard_normal((rows, HIDDEN)).astype(np_dtype),
            (rng.standard_normal((adds, 1, HIDDEN)) / np.sqrt(2 * adds)).astype(np_dtype),
            (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np_dtype)]


def _reference(x: np.ndarray, c: np.ndarray, w: np.ndarray) -> np.ndarray:
    x, c, w = (a.astype(np.float64) for a in (x, c, w))

    def norm(h: np.ndarray) -> np.ndarray:
        return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * w

    for ci in c:
        x = x + norm(x) * ci
    return norm(x)


def _run(mod: tvm.IRModule, inputs: list[np.ndarray]) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy().astype(np.float64)


def _rewrite(mod: tvm.IRModule, target: tvm.target.Target = LLVM) -> tvm.IRModule:
    with target:
        return ResidualStreamFP32()(mod)


def _ops(mod: tvm.IRModule, name: str, fn: str = "main") -> list[relax.Call]:
    op = tvm.ir.Op.get(name)
    found: list[relax.Call] = []
    relax.analysis.post_order_visit(mod[fn], lambda e: found.append(e) if isinstance(e, relax.Call) and e.op == op else None)
    return found


@pytest.mark.parametrize("rows", [ROWS, tvm.tirx.Var("n", "int64")], ids=["static", "symbolic"])
def test_the_stream_adds_and_norms_in_float32(rows):
    mod = _stream_module("bfloat16", rows=rows, adds=5)
    out = _rewrite(mod)
    adds = _ops(out, "relax.add")
    assert len(adds) == 5 and all(str(a.ty.dtype) == "float32" for a in adds)
    norms = _ops(out, "relax.nn.rms_norm")
    assert len(norms) == 6 and all(str(n.ty.dtype) == "float32" for n in norms)
    # What the branches read and what the function returns stay in the model dtype.
    assert all(str(m.ty.dtype) == "bfloat16" for m in _ops(out, "relax.multiply"))
    assert str(out["main"].ret_ty.dtype) == "bfloat16"
    # the stream's shape, symbolic rows included, is kept
    assert tvm_ffi.structural_equal(out["main"].ret_ty, mod["main"].ret_ty)


def test_a_long_bf16_stream_is_closer_to_float64():
    mod = _stream_module("bfloat16")
    inputs = _inputs("bfloat16", seed=3)
    ref = _reference(*inputs)
    before, after = _run(mod, inputs), _run(_rewrite(mod), inputs)
    err_before, err_after = relative_error(before, ref), relative_error(after, ref)
    # after: the roundings of the normed output and the branches (about 2e-3); before: 48 more of the
    # sum, a random walk (about 1.2e-2)
    assert err_after < 3e-3, err_after
    assert err_before > 3 * err_after, (err_before, err_after)
    # and the rewrite computes the unrewritten function, to bf16's accuracy
    assert relative_error(after, before) < 2e-2


def test_float16_plain_ops_on_a_gpu_and_broadcasts_are_left_alone():
    fp16 = _stream_module("float16", adds=3)
    assert tvm_ffi.structural_equal(_rewrite(fp16), fp16)
    bf16 = _stream_module("bfloat16", adds=3)
    # on a GPU only FuseAddRMSNorm's kernels change (below), not plain adds and norms
    assert tvm_ffi.structural_equal(_rewrite(bf16, SM90), bf16)
    # h + row: not a residual add (the branch is no tensor of the stream's shape)
    bcast = _stream_module("bfloat16", adds=3, broadcast=True)
    assert stream_adds(bcast["main"]) == {}
    assert tvm_ffi.structural_equal(_rewrite(bcast), bcast)


def _llama(layers: int) -> config.ModelConfig:
    raw = {**hf_config(config.load("tiny-llama")), "intermediate_size": 352, "num_hidden_layers": layers,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576,
           "vocab_size": 1021}
    cfg = config.from_dict(raw, name="bf16-stream")
    return cfg.with_quantization("q4bf16_1")


def test_our_llama_streams_in_float32_and_keeps_its_interface():
    cfg = _llama(2)
    mod, _ = export_module(cfg, LLVM)
    out = _rewrite(mod)
    layers = cfg.num_hidden_layers
    # decode_attend stops after the last layer's attention; decode_greedy is that layer's MLP
    adds = {"prefill": 2 * layers, "decode": 2 * layers, "decode_attend": 2 * layers - 1, "decode_greedy": 1}
    for fn, count in adds.items():
        assert tvm_ffi.structural_equal(out[fn].ret_ty, mod[fn].ret_ty), fn
        assert len(stream_adds(mod[fn])) == count, fn
        assert [str(a.ty.dtype) for a in _ops(out, "relax.add", fn)] == ["float32"] * count, fn


@pytest.mark.slow
def test_our_bf16_llama_is_closer_to_float64():
    # 12 layers, so the 24 roundings of the stream dominate; decode steps see the prefill's cache.
    cfg = _llama(12)
    weights = random_weights(cfg, seed=11)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, cfg.vocab_size, 19)
    decode = [int(t) for t in rng.integers(0, cfg.vocab_size, 2)]
    passes = {"bf16": tuple(p for p in DEFAULT if p != "residual_stream_fp32"), "fp32": DEFAULT}
    kv_hooks.register()  # the fuselight build calls them
    errors = {}
    for name, chosen in passes.items():
        vm = relax.VirtualMachine(build(cfg, resolve("llvm"), "fuselight", options=Options(passes=chosen)).executable,
                                  tvm.cpu())
        errors[name] = compare_with_reference(vm, tvm.cpu(), cfg, weights, prompt, decode, max_total_seq_len=32,
                                              prefill_chunk_size=32)
    assert max(errors["fp32"]) < 4e-3, errors
    assert all(a < 0.75 * b for a, b in zip(errors["fp32"], errors["bf16"])), errors


# ---- GPU targets: the prefill add+RMSNorm kernels ------------------------------------------------------


def _around_the_pass(scheme: str) -> tuple[tvm.IRModule, tvm.IRModule]:
    """A 2-layer LLaMA at hidden 1024 (FuseAddRMSNorm applies) for sm_90, just before and after the pass."""
    raw = {**hf_config(config.load("tiny-llama")), "hidden_size": 1024, "intermediate_size": 2816,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 2000}
    mod, _ = export_module(config.from_dict(raw, name="stream-gpu").with_quantization(scheme), SM90)
    with SM90:
        for stage in pl.stages(SM90, use_mlc=False, graph_passes=DEFAULT,
                               rules=pl.fuselight_rules()):
            if stage.name == "residual_stream_fp32":
                return mod, stage.pass_(mod)
            mod = stage.pass_(mod)
    raise AssertionError("the pipeline has no residual_stream_fp32 stage")


def _called(mod: tvm.IRModule, fn: str) -> list[tvm.tirx.PrimFunc]:
    call_tir = tvm.ir.Op.get("relax.call_tir")
    found: list = []
    relax.analysis.post_order_visit(
        mod[fn], lambda e: found.append(mod[e.args[0]]) if isinstance(e, relax.Call) and e.op == call_tir else None)
    return found


def test_prefill_carries_a_float32_stream_through_its_norm_kernels_on_sm90():
    before, after = _around_the_pass("q4bf16_1")
    # (x, total) dtypes of each add+RMSNorm: the embedding enters in bf16, the stream is float32 after
    links = [(str(f.params[0].dtype), str(f.params[4].dtype)) for f in _called(after, "prefill")
             if (f.attrs or {}).get(RULE_ATTR) == "row_reduction"]
    assert links == [("bfloat16", "float32")] + [("float32", "float32")] * 3
    assert not [f for f in _called(after, "prefill") if add_rms_norm_eps(f) is not None]  # none left to FuseAddRMSNorm
    assert len(_called(after, "prefill")) == len(_called(before, "prefill"))
    # decode's links too (then fused into the GEMVs: below); decode_attend ends in the last layer's
    # attention, whose residual add reads the stream rounded back to bf16: it returns the hidden state as before
    for fn, count in (("decode", 4), ("decode_attend", 2)):
        links = [(str(f.params[0].dtype), str(f.params[4].dtype)) for f in _called(after, fn)
                 if (f.attrs or {}).get(RULE_ATTR) == "row_reduction"]
        assert links == [("bfloat16", "float32")] + [("float32", "float32")] * (count - 1), fn
        assert tvm_ffi.structural_equal(after[fn].ret_ty, before[fn].ret_ty), fn
    values = relax.analysis.get_var2val(after["decode_attend"])
    narrowed = [e for e in _ops(after, "relax.astype", "decode_attend")
                if isinstance(values.get(e.args[0]), relax.TupleGetItem) and str(e.args[0].ty.dtype) == "float32"]
    assert len(narrowed) == 1 and str(narrowed[0].ty.dtype) == "bfloat16"  # the last link's total


def test_a_default_pass_for_bfloat16():
    # after accumulate_matmul_fp32, before the norm fusions that read the stream
    assert DEFAULT.index("accumulate_matmul_fp32") < DEFAULT.index("residual_stream_fp32") < DEFAULT.index("fuse_norm_gemv")


def test_float16_keeps_its_kernels_on_sm90():
    # prefill's and decode's: the whole module
    before, after = _around_the_pass("q4f16_1")
    assert tvm_ffi.structural_equal(after, before)


@pytest.mark.parametrize("x_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("rows", [1, 7])
def test_the_float32_stream_function_against_float64(x_dtype, rows):
    n = tvm.tirx.Var("n", "int64")
    x, r = (te.placeholder((n, HIDDEN), "bfloat16", name) for name in ("x", "r"))
    w = te.placeholder((HIDDEN,), "bfloat16", "w")
    base = te.create_prim_func([x, r, w, topi.add(x, r)])
    func = plain_add_rms_norm(base, EPS, x_dtype, "float32")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    rng = np.random.default_rng(rows)
    xs = rng.standard_normal((rows, HIDDEN)).astype(ml_dtypes.bfloat16 if x_dtype == "bfloat16" else np.float32)
    rs = (0.2 * rng.standard_normal((rows, HIDDEN))).astype(ml_dtypes.bfloat16)
    ws = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(ml_dtypes.bfloat16)
    normed = tvm.runtime.empty((rows, HIDDEN), "bfloat16", tvm.cpu())
    total = tvm.runtime.empty((rows, HIDDEN), "float32", tvm.cpu())
    lib(*(tvm.runtime.tensor(a) for a in (xs, rs, ws)), normed, total)
    t64 = xs.astype(np.float64) + rs.astype(np.float64)
    n64 = t64 / np.sqrt(np.mean(t64 * t64, axis=-1, keepdims=True) + EPS) * ws.astype(np.float64)
    assert relative_error(total.numpy(), t64) < 1e-7  # the sum of two bf16 values, in float32
    assert relative_error(normed.numpy().astype(np.float64), n64) < 2e-3  # one bf16 rounding


# ---- GPU targets: decode, the add+RMSNorm in the GEMV's norm prologue ----------------------------------

# A decode step's stream: a row of hidden 1024 (FuseAddRMSNorm applies on cuda), GEMV branches.
DECODE_HIDDEN, DECODE_ADDS = 1024, 24


def _decode_chain() -> tvm.IRModule:
    """``main(x, w_0, W_0, ...)``: ``DECODE_ADDS`` times ``h = h + rms_norm(h, w_i) @ W_i^T`` on one bf16
    row, then ``rms_norm(h, w) @ W^T`` (the LM head), as a decode step lays them out."""
    ty = lambda *shape: relax.TensorType(list(shape), "bfloat16")  # noqa: E731
    x = relax.Var("x", ty(1, 1, DECODE_HIDDEN))
    params = [x]
    for i in range(DECODE_ADDS + 1):
        params += [relax.Var(f"w{i}", ty(DECODE_HIDDEN)), relax.Var(f"W{i}", ty(DECODE_HIDDEN, DECODE_HIDDEN))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            h = x
            for i in range(DECODE_ADDS + 1):
                normed = bb.emit(relax.op.nn.rms_norm(h, params[1 + 2 * i], axes=[-1], epsilon=EPS))
                y = bb.emit(relax.op.matmul(normed, bb.emit(relax.op.permute_dims(params[2 + 2 * i]))))
                h = bb.emit(relax.op.add(h, y)) if i < DECODE_ADDS else y
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()


def _decode_inputs(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    out = [rng.standard_normal((1, 1, DECODE_HIDDEN)).astype(bf16)]
    for _ in range(DECODE_ADDS + 1):
        # Branches at 1/sqrt(2 adds) of the stream (as our model's weight init).
        scale = 1 / np.sqrt(DECODE_HIDDEN * 2 * DECODE_ADDS)
        out += [(1 + 0.1 * rng.standard_normal(DECODE_HIDDEN)).astype(bf16),
                (scale * rng.standard_normal((DECODE_HIDDEN, DECODE_HIDDEN))).astype(bf16)]
    return out


def _decode_reference(x: np.ndarray, *weights: np.ndarray) -> np.ndarray:
    h = x.astype(np.float64)
    for i in range(DECODE_ADDS + 1):
        w, big = weights[2 * i].astype(np.float64), weights[2 * i + 1].astype(np.float64)
        y = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * w @ big.T
        h = h + y if i < DECODE_ADDS else y
    return h


@pytest.fixture(scope="module")
def decode_modules() -> dict[str, tvm.IRModule]:
    """``_decode_chain`` through sm_90's graph passes, then FuseNormIntoGemv: without and with the pass."""
    from fuselight.baseline.fuse_add_rms_norm import FuseAddRMSNorm
    from fuselight.baseline.fuse_transpose_matmul import FuseTransposeMatmul
    from fuselight.passes import AccumulateMatmulFP32, FuseNormIntoGemv

    out = {}
    with SM90:
        mod = FuseTransposeMatmul()(AccumulateMatmulFP32()(FuseAddRMSNorm(SM90)(_decode_chain())))
        out["bf16"] = FuseNormIntoGemv()(mod)
        out["fp32"] = FuseNormIntoGemv()(ResidualStreamFP32()(mod))
    # (the replaced FuseAddRMSNorm kernels, scheduled for the GPU, go)
    return {name: relax.transform.DeadCodeElimination(["main"])(m) for name, m in out.items()}


def test_decode_carries_a_float32_stream_through_its_norm_gemvs_on_sm90(decode_modules):
    for name, mod in decode_modules.items():
        called = _called(mod, "main")
        # every norm (the first alone, then each add+norm) went into its GEMV, for the Gemv rule
        assert len(called) == DECODE_ADDS + 1 and all(f.attrs[RULE_ATTR] == "gemv" for f in called), name
        stream = "float32" if name == "fp32" else "bfloat16"
        # (x, total) of each add+norm GEMV: the first x is the bf16 row, the stream float32 after
        links = [(str(f.params[0].dtype), str(f.params[-1].dtype)) for f in called[1:]]
        assert links == [("bfloat16", stream)] + [(stream, stream)] * (DECODE_ADDS - 1), name
        # the rule analyses each with its prologue's stream
        pro = [analyze_matmul(f, prologue=True).operands.prologue for f in called]
        assert [p.stream_dtype for p in pro[2:]] == [stream] * (DECODE_ADDS - 1)


def test_decode_float32_stream_against_float64_on_llvm(decode_modules):
    # The fused functions are plain TIR (the Gemv rule schedules them in phase 4): llvm runs them.
    inputs = _decode_inputs(seed=5)
    ref = _decode_reference(*inputs)
    got = {name: _run(mod, inputs) for name, mod in decode_modules.items()}
    err = {name: relative_error(g, ref) for name, g in got.items()}
    assert np.abs(ref).mean() > 0.1
    # float32 stream: the roundings of the normed rows and the branches; bf16: 24 more of the sum
    assert err["fp32"] < 4e-3 and err["bf16"] > 2 * err["fp32"], err
    assert relative_error(got["fp32"], got["bf16"]) < 2e-2

