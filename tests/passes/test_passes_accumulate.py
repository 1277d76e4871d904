"""AccumulateMatmulFP32: half-precision matmuls accumulate in float32, nothing else changes."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402
from fuselight import quantization  # noqa: E402
from fuselight.passes import AccumulateMatmulFP32  # noqa: E402
from fuselight.target import resolve, to_tvm  # noqa: E402
from tvm import relax  # noqa: E402

# (rows, K, N): odd sizes so no reduction length is a power of two.
SHAPES = [(7, 127, 33), (33, 33, 7), (1, 127, 127), (127, 7, 33)]


def _matmul_module(rows, k: int, n: int, dtype: str, *, transposed_weight: bool, batch: int | None = None,
                   out_dtype: str | None = None) -> tvm.IRModule:
    """``main(x, w) = matmul(x, w)`` (or ``matmul(x, permute_dims(w))``, a linear layer)."""
    x_shape = ([batch] if batch else []) + [rows, k]
    w_shape = [n, k] if transposed_weight else [k, n]
    x = relax.Var("x", relax.TensorType(x_shape, dtype))
    w = relax.Var("w", relax.TensorType(w_shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            rhs = bb.emit(relax.op.permute_dims(w)) if transposed_weight else w
            out = bb.emit_output(relax.op.matmul(x, rhs, out_dtype=out_dtype))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod: tvm.IRModule, *inputs: np.ndarray) -> np.ndarray:
    executable = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()


def _inputs(rng: np.random.Generator, x_shape: tuple, w_shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal(x_shape).astype("float16"), rng.standard_normal(w_shape).astype("float16"))


def _matmuls(mod: tvm.IRModule) -> list:
    matmul = tvm.ir.Op.get("relax.matmul")
    found = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: found.append(e) if isinstance(e, relax.Call) and e.op == matmul else None
    )
    return found


@pytest.mark.parametrize("rows, k, n", SHAPES)
@pytest.mark.parametrize("symbolic_rows", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("transposed_weight", [False, True], ids=["matmul", "linear"])
def test_rewrite_is_closer_to_float64(rows: int, k: int, n: int, symbolic_rows: bool, transposed_weight: bool) -> None:
    rng = np.random.default_rng(rows * 1000 + k * 10 + n)
    mod = _matmul_module(tvm.tirx.Var("m", "int64") if symbolic_rows else rows, k, n, "float16",
                         transposed_weight=transposed_weight)
    rewritten = AccumulateMatmulFP32()(mod)
    (matmul,) = _matmuls(rewritten)
    assert matmul.ty.dtype == "float32"
    assert rewritten["main"].ret_ty.dtype == "float16"

    x, w = _inputs(rng, (rows, k), (n, k) if transposed_weight else (k, n))
    w64 = w.astype(np.float64).T if transposed_weight else w.astype(np.float64)
    ref = x.astype(np.float64) @ w64
    before = _run(mod, x, w).astype(np.float64)
    after = _run(rewritten, x, w).astype(np.float64)
    err_before, err_after = np.abs(before - ref), np.abs(after - ref)
    # float32 accumulation rounds once to float16: within one float16 ulp of the exact result.
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    assert np.all(err_after <= ulp + 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(w64)))
    assert err_after.max() <= err_before.max()
    if k >= 127:
        # Long reductions are where float16 accumulation loses digits: the rewrite must show it.
        assert err_after.mean() < err_before.mean()


def test_batched_lhs() -> None:
    rng = np.random.default_rng(3)
    mod = _matmul_module(7, 33, 7, "float16", transposed_weight=True, batch=3)
    x, w = _inputs(rng, (3, 7, 33), (7, 33))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    after = _run(AccumulateMatmulFP32()(mod), x, w).astype(np.float64)
    assert np.abs(after - ref).max() <= np.spacing(np.abs(ref).astype(np.float16)).max()


def test_bfloat16_rewritten() -> None:
    mod = _matmul_module(7, 33, 7, "bfloat16", transposed_weight=True)
    (matmul,) = _matmuls(AccumulateMatmulFP32()(mod))
    assert matmul.ty.dtype == "float32"


def test_float32_graph_unchanged() -> None:
    mod = _matmul_module(7, 33, 7, "float32", transposed_weight=True)
    assert tvm_ffi.structural_equal(AccumulateMatmulFP32()(mod), mod)


def test_float32_output_unchanged() -> None:
    mod = _matmul_module(7, 33, 7, "float16", transposed_weight=False, out_dtype="float32")
    assert tvm_ffi.structural_equal(AccumulateMatmulFP32()(mod), mod)


def _q4_module(rows, k: int, n: int, scheme: str) -> tvm.IRModule:
    """``main(x, q, s) = matmul(x, dequantize(q, s))`` as our model writes a 4-bit linear layer
    (``model.llama.QuantLinear``: ``permute_dims`` of the ``[N, K]`` weight for NK, KN's as stored)."""
    s = quantization.SCHEMES[scheme]
    q_shape, s_shape = s.packed_shapes(n, k)
    x = relax.Var("x", relax.TensorType([rows, k], s.model_dtype))
    q = relax.Var("q", relax.TensorType(list(q_shape), quantization.STORAGE_DTYPE))
    scale = relax.Var("s", relax.TensorType(list(s_shape), s.model_dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, q, scale]):
        with bb.dataflow():
            w = bb.emit_te(lambda qt, st: quantization.te_dequantize((qt, st), s), q, scale, primfunc_name_hint="dequantize")
            rhs = bb.emit(relax.op.permute_dims(w)) if s.layout == "NK" else w
            out = bb.emit_output(relax.op.matmul(x, rhs))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("symbolic_rows", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("scheme", ["q4f16_0", "q4f16_1"])
def test_a_dequantize_matmul_no_rule_takes_stays_the_baselines_on_a_gpu(scheme: str, symbolic_rows: bool) -> None:
    # On sm_90 a KN (q4f16_0) matmul accumulates in float32 only where a fuselight rule takes the
    # fused function (M = 1: the KN GEMV); prefill's symbolic M goes to DLight and stays float16
    # accumulating, as the baseline's. NK (q4f16_1) is taken at every M. Without a GPU target
    # (CPU numerics) every half matmul is rewritten.
    rows = tvm.tirx.Var("seq_len", "int64") if symbolic_rows else 1
    mod = _q4_module(rows, 256, 96, scheme)
    with to_tvm(resolve("cuda", "sm_90")):
        on_gpu = AccumulateMatmulFP32()(mod)
    kept = scheme == "q4f16_0" and symbolic_rows
    assert [m.ty.dtype for m in _matmuls(on_gpu)] == ["float16" if kept else "float32"]
    assert not kept or tvm_ffi.structural_equal(on_gpu, mod)
    assert [m.ty.dtype for m in _matmuls(AccumulateMatmulFP32()(mod))] == ["float32"]
    with to_tvm(resolve("llvm")):
        assert [m.ty.dtype for m in _matmuls(AccumulateMatmulFP32()(mod))] == ["float32"]
