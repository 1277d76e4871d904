"""Build side of the kernel suite: each case as a small Relax module, compiled with both pipelines.

The modules state each operator the way LLaMA (as MLC-LLM compiles it) uses it: the linear layer as
``x @ W^T`` with ``W`` [N, K] (MLC fuses the transpose into an NT matmul), ``R.nn.rms_norm``,
softmax along rows, and attention written out plainly (QK^T * scale, causal mask, softmax in
float32, P @ V; GQA by repeating K/V heads). The swept dimension is a symbolic variable, so one
library serves every point. Each library gets the metadata sidecar ``runtime.load_library`` reads
and, for CUDA, cubins compiled ahead of time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import quantization
from ..compile import library_metadata, lower, pipeline_pass, write_library
from ..target import TargetSpec, resolve, to_tvm
from .kernels import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    PIPELINES,
    Case,
    library_name,
    load_suite,
)
from .results import git_commit

_FUNC = "main"


def _gemm(case: Case, n: Any, relax: Any) -> tuple[list, Callable]:
    x = relax.Var("x", relax.TensorType([n, case.dims["k"]], case.dtype))
    w = relax.Var("w", relax.TensorType([case.dims["n"], case.dims["k"]], case.dtype))
    return [x, w], lambda bb: relax.op.matmul(x, relax.op.permute_dims(w))


def _gemm_residual(case: Case, n: Any, relax: Any) -> tuple[list, Callable]:
    (x, w), gemm = _gemm(case, n, relax)
    r = relax.Var("residual", relax.TensorType([n, case.dims["n"]], case.dtype))
    return [x, w, r], lambda bb: relax.op.add(gemm(bb), r)


def _gemm_gate_up_silu(case: Case, n: Any, relax: Any) -> tuple[list, Callable]:
    (x, w), gemm = _gemm(case, n, relax)

    def body(bb: Any) -> Any:
        halves = bb.emit(relax.op.split(gemm(bb), 2, axis=-1))
        gate, up = bb.emit(relax.TupleGetItem(halves, 0)), bb.emit(relax.TupleGetItem(halves, 1))
        return relax.op.multiply(relax.op.nn.silu(gate), up)

    return [x, w], body


def _q4_weight(case: Case, relax: Any) -> tuple[list, Callable]:
    """The packed words and scales of a q4 [N, K] weight, and ``emit(bb)`` of its dequantize as MLC-LLM's
    q4 linear layer writes it (``model.llama.QuantLinear``)."""
    s = quantization.SCHEMES[case.quantization]
    q_shape, s_shape = s.packed_shapes(case.dims["n"], case.dims["k"])
    q = relax.Var("q", relax.TensorType(list(q_shape), quantization.STORAGE_DTYPE))
    scale = relax.Var("scale", relax.TensorType(list(s_shape), case.dtype))
    return [q, scale], lambda bb: bb.emit_te(lambda qt, st: quantization.te_dequantize((qt, st), s), q, scale,
                                             primfunc_name_hint="dequantize")


def _as_kn(case: Case, weight: Any, relax: Any) -> Any:
    """The (dequantized) weight as the matmul's ``[K, N]`` operand: a float weight's and NK's
    transposed, KN's as stored (``model.llama.QuantLinear``)."""
    if case.quantization is None or quantization.SCHEMES[case.quantization].layout == "NK":
        return relax.op.permute_dims(weight)
    return weight


def _gemm_q4(case: Case, n: Any, relax: Any) -> tuple[list, Callable]:
    """``x @ dequantize(q, scale)^T``."""
    x = relax.Var("x", relax.TensorType([n, case.dims["k"]], case.dtype))
    packed, dequantize = _q4_weight(case, relax)
    return [x, *packed], lambda bb: relax.op.matmul(x, _as_kn(case, dequantize(bb), relax))


def _norm_gemm(case: Case, n: Any, relax: Any) -> tuple[list, Callable]:
    """``(rms_norm(x + residual) @ W^T, x + residual)``, W a float weight or (``norm_gemm_q4``) a
    q4 one: a decode step's QKV after the attention's residual add ([M, 1, K] tokens, as decode's)."""
    k = case.dims["k"]
    x = relax.Var("x", relax.TensorType([n, 1, k], case.dtype))
    r = relax.Var("residual", relax.TensorType([n, 1, k], case.dtype))
    w = relax.Var("norm_weight", relax.TensorType([k], case.dtype))
    if case.op == "norm_gemm":
        weight = relax.Var("w", relax.TensorType([case.dims["n"], k], case.dtype))
        packed, matrix = [weight], (lambda bb: weight)
    else:
        packed, matrix = _q4_weight(case, relax)

    def body(bb: Any) -> Any:
        total = bb.emit(relax.op.add(x, r))
        normed = bb.emit(relax.op.nn.rms_norm(total, w, axes=[-1], epsilon=case.attrs["eps"]))
        y = bb.emit(relax.op.matmul(normed, _as_kn(case, matrix(bb), relax)))
        return relax.Tuple([y, total])

    return [x, r, w, *packed], body


def _add_rmsnorm(case: Case, n: Any, relax: Any) -> tuple[list, Callable]:
    """``(x + residual, rms_norm(x + residual))``: the residual stream and the next layer's input, as a
    model's ``[1, rows, hidden]`` (MLC-LLM's FuseAddRMSNorm takes three dims: it fails on two)."""
    h = case.dims["hidden"]
    x = relax.Var("x", relax.TensorType([1, n, h], case.dtype))
    r = relax.Var("residual", relax.TensorType([1, n, h], case.dtype))
    w = relax.Var("weight", relax.TensorType([h], case.dtype))

    def body(bb: Any) -> Any:
        total = bb.emit(relax.op.add(x, r))
        normed = bb.emit(relax.op.nn.rms_norm(total, w, axes=[-1], epsilon=case.attrs["eps"]))
        return relax.Tuple([total, normed])

    return [x, r, w], body


def _rmsnorm(case: Case, n: Any, relax: Any) -> tuple[list, Callable]:
    h = case.dims["hidden"]
    x = relax.Var("x", relax.TensorType([n, h], case.dtype))
    w = relax.Var("weight", relax.TensorType([h], case.dtype))
    return [x, w], lambda bb: relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=case.attrs["eps"])


def _softmax(case: Case, n: Any, relax: Any) -> tuple[list, Callable]:
    x = relax.Var("x", relax.TensorType([n, case.dims["cols"]], case.dtype))
    return [x], lambda bb: relax.op.nn.softmax(x, axis=-1)


def _attention(case: Case, q_len: Any, kv_len: Any, causal: bool, relax: Any) -> tuple[list, Callable]:
    """Plain attention, ``q`` [q_len, H, D], ``k``/``v`` [kv_len, H_kv, D] -> [q_len, H, D]."""
    heads, kv_heads, dim = case.dims["q_heads"], case.dims["kv_heads"], case.dims["head_dim"]
    q = relax.Var("q", relax.TensorType([q_len, heads, dim], case.dtype))
    k = relax.Var("k", relax.TensorType([kv_len, kv_heads, dim], case.dtype))
    v = relax.Var("v", relax.TensorType([kv_len, kv_heads, dim], case.dtype))
    op = relax.op
    group = heads // kv_heads

    def body(bb: Any) -> Any:
        kr = bb.emit(op.repeat(k, group, axis=1)) if group > 1 else k
        vr = bb.emit(op.repeat(v, group, axis=1)) if group > 1 else v
        qt = bb.emit(op.permute_dims(q, [1, 0, 2]))  # [H, q_len, D]
        kt = bb.emit(op.permute_dims(kr, [1, 2, 0]))  # [H, D, kv_len]
        vt = bb.emit(op.permute_dims(vr, [1, 0, 2]))  # [H, kv_len, D]
        scores = bb.emit(op.multiply(op.matmul(qt, kt), relax.const(dim**-0.5, case.dtype)))
        if causal:
            # As Hugging Face's eager attention: the dtype's lowest value above the diagonal.
            lowest = _lowest(case.dtype)
            mask = bb.emit(op.triu(op.full((q_len, kv_len), relax.const(lowest, case.dtype)), 1))
            scores = bb.emit(op.add(scores, mask))
        probs = bb.emit(op.astype(op.nn.softmax(op.astype(scores, "float32"), axis=-1), case.dtype))
        return op.permute_dims(op.matmul(probs, vt), [1, 0, 2])

    return [q, k, v], body


def _lowest(dtype: str) -> float:
    """The lowest finite value of ``dtype`` (NumPy has no bfloat16: ``ml_dtypes``, shipped with TVM, does)."""
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes

        return float(ml_dtypes.finfo(ml_dtypes.bfloat16).min)
    return float(np.finfo(dtype).min)


_BUILDERS: dict[str, Callable[[Case, Any, Any], tuple[list, Callable]]] = {
    "gemm": _gemm,
    "gemm_residual": _gemm_residual,
    "gemm_gate_up_silu": _gemm_gate_up_silu,
    "gemm_q4": _gemm_q4,
    "norm_gemm": _norm_gemm,
    "norm_gemm_q4": _norm_gemm,
    "rmsnorm": _rmsnorm,
    "add_rmsnorm": _add_rmsnorm,
    "softmax": _softmax,
    "attention_prefill": lambda case, n, relax: _attention(case, n, n, True, relax),
    "attention_decode": lambda case, n, relax: _attention(case, 1, n, False, relax),
}


def relax_module(case: Case) -> Any:
    """The case as an IRModule with one function ``main``; the swept dimension is symbolic (a
    constant for a ``static`` case)."""
    from tvm import relax, tirx

    n = case.sweep[0] if case.static else tirx.Var(case.spec.sweep_var, "int64")
    params, body = _BUILDERS[case.op](case, n, relax)
    bb = relax.BlockBuilder()
    with bb.function(_FUNC, params):
        with bb.dataflow():
            out = bb.emit_output(body(bb))
        bb.emit_func_output(out)
    return bb.get()


def compile_case(case: Case, pipeline: str, spec: TargetSpec) -> Any:
    """``relax_module(case)`` through ``pipeline``, compiled for ``spec``: a VM executable."""
    target = to_tvm(spec)
    # Upper bound of the swept dimension, as MLC-LLM attaches its sequence-length bounds: memory
    # planning then allocates intermediates once, at the largest point.
    passes = pipeline_pass(pipeline, target, {case.spec.sweep_var: max(case.sweep)})
    return lower(relax_module(case), target, passes)[1]


def export_case(case: Case, pipeline: str, spec: TargetSpec, out_dir: Path) -> Path:
    """Compile and write ``<case>-<pipeline>.so``, its ``.json`` sidecar and (CUDA) its cubins."""
    from .. import pipeline as pl

    executable = compile_case(case, pipeline, spec)
    meta = library_metadata(spec, pipeline, pl.baseline_source(), case=case.to_dict())
    return write_library(executable, Path(out_dir) / library_name(case, pipeline), meta, spec)


def build_suite(
    out_dir: Path,
    target_arch: str | None = "sm_90",
    cases: list[str] | None = None,
    *,
    target: str = "cuda",
    suite: str = "full",
    ptx: bool = False,
) -> Path:
    """Build ``suite`` (or the named ``cases``) for ``target``; writes and returns ``out_dir/manifest.json``.

    ``ptx``: the CUDA carried as ``target_arch``'s PTX (``fuselight.target.resolve``)."""
    import tvm

    from .. import pipeline as pl

    spec = resolve(target, target_arch if target == "cuda" else None, ptx=ptx)
    selected = load_suite(suite, cases)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, case in enumerate(selected, 1):
        libs = {}
        for pipeline in PIPELINES:
            start = time.perf_counter()
            path = export_case(case, pipeline, spec, out_dir)
            libs[pipeline] = path.name
            size_kb = path.stat().st_size / 1024
            print(
                f"[{i}/{len(selected)}] {path.name}: {size_kb:.0f} KiB, {time.perf_counter() - start:.1f} s", flush=True
            )
        entries.append({**case.to_dict(), "libraries": libs})
    manifest = {
        "format": MANIFEST_FORMAT,
        "suite": suite,
        "target": spec.kind,
        "arch": spec.arch,
        "ptx": spec.ptx,
        "tvm_version": tvm.__version__,
        "git_commit": git_commit(),
        "baseline_source": pl.baseline_source(),
        "cases": entries,
    }
    path = out_dir / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path
