"""ResidualStreamFP32: a bfloat16 residual stream added and normalised in float32 on CPU targets; the numbers
against float64 (a hand-built stream and our LLaMA), what it leaves alone (float16, GPU targets, broadcasts)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402
from conftest import compare_with_reference, relative_error  # noqa: E402
from fuselight import config, kv_hooks  # noqa: E402
from fuselight.compile import build  # noqa: E402
from fuselight.model.llama import export_module  # noqa: E402
from fuselight.model.weights import hf_config, random_weights  # noqa: E402
from fuselight.options import Options  # noqa: E402
from fuselight.passes import DEFAULT, ResidualStreamFP32  # noqa: E402
from fuselight.passes.residual_stream_fp32 import stream_adds  # noqa: E402
from fuselight.target import resolve, to_tvm  # noqa: E402
from tvm import relax  # noqa: E402

LLVM = to_tvm(resolve("llvm"))
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


def test_float16_gpu_targets_and_broadcasts_are_left_alone():
    fp16 = _stream_module("float16", adds=3)
    assert tvm_ffi.structural_equal(_rewrite(fp16), fp16)
    bf16 = _stream_module("bfloat16", adds=3)
    assert tvm_ffi.structural_equal(_rewrite(bf16, to_tvm(resolve("cuda", "sm_90"))), bf16)
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
    passes = {"bf16": DEFAULT, "fp32": (*DEFAULT, "residual_stream_fp32")}
    kv_hooks.register()  # the fuselight build calls them
    errors = {}
    for name, chosen in passes.items():
        vm = relax.VirtualMachine(build(cfg, resolve("llvm"), "fuselight", options=Options(passes=chosen)).executable,
                                  tvm.cpu())
        errors[name] = compare_with_reference(vm, tvm.cpu(), cfg, weights, prompt, decode, max_total_seq_len=32,
                                              prefill_chunk_size=32)
    assert max(errors["fp32"]) < 4e-3, errors
    assert all(a < 0.75 * b for a, b in zip(errors["fp32"], errors["bf16"])), errors
