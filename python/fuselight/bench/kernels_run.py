"""Run side of the kernel suite: load each case's libraries, check them, time them against PyTorch.

Runtime-only TVM and PyTorch (imported when the suite runs). For every case and sweep point:
fresh random inputs on the device (scaled so fp16 stays finite), a float64 PyTorch reference, poisoned
calls per library first (NaN inputs, so an output element a kernel never writes stays NaN in
the reused output buffer and fails the check), then the checked call and the timing. PyTorch's
own kernels (cuBLAS ``F.linear``, ``F.rms_norm``, ``softmax``, ``scaled_dot_product_attention``
limited to the flash and memory-efficient backends) run the same inputs. A 4-bit case (``gemm_q4``)
has two PyTorch anchors: its GEMM in the case's dtype on the dequantized weight (``torch``), and
``_weight_int4pack_mm`` (``torch-int4pack``), timed only; where that op is missing or fails, the
error goes into the results' ``meta.anchor_errors``. A CUDA build runs on the GPU; an llvm build runs
the same way on the CPU (for tests).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import quantization
from ..errors import FuselightError
from ..library import device_label
from ..runtime import DEVICE_OF_TARGET, init_tvm, load_library, release_memory
from . import bench_config
from .kernels import PIPELINES, SUITE, Case, load_suite, read_manifest, select
from .results import TORCH_INT4PACK, default_path, git_commit, make_record, merged_with, write_results
from .timing import device_name, synchronizer, time_fn

# Float64 error sums over chunks of at most this many elements, to bound the reference's memory.
_ERROR_CHUNK_ELEMENTS = 1 << 26
# The VM keeps its last result alive until the next call, so its outputs alternate between two
# pooled buffers: poisoning both takes two calls.
_POISON_CALLS = 2
# Input distributions: RMSNorm weights near 1 as trained ones are; softmax rows with the spread of
# real logits (a few dominant entries). Everything else is N(0, 1), weights N(0, 1/K).
_NORM_WEIGHT_STD = 0.1
_LOGIT_STD = 3.0
# PyTorch's int4 weight-only matmul per device: (the op packing its [N, K] weight, that op's inner
# K tiles, the matmul). CUDA's (tinygemm) packs two 4-bit values a byte; the CPU's takes them in int32.
_INT4PACK_OPS = {
    "cuda": ("_convert_weight_to_int4pack", 8, "_weight_int4pack_mm"),
    "cpu": ("_convert_weight_to_int4pack_for_cpu", 1, "_weight_int4pack_mm_for_cpu"),
}
INT4PACK_NOTE = (
    "torch.ops.aten._weight_int4pack_mm: its own random 4-bit words, groups as q4f16_1's, bf16 scales and "
    "zeros, the tokens cast to bf16; timed only (another packing and precision); bytes and flops as q4f16_1's"
)


class _Random:
    """Seeded normal tensors on one device, drawn in float32 and cast."""

    def __init__(self, torch: Any, device: Any, seed: int) -> None:
        self.torch = torch
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def normal(self, shape: tuple[int, ...], dtype: str, std: float = 1.0, mean: float = 0.0) -> Any:
        t = self.torch.randn(shape, generator=self.gen, device=self.device, dtype=self.torch.float32)
        return (t * std + mean).to(getattr(self.torch, dtype))


# --- per operator: inputs, float64 reference, PyTorch's implementation ---------------------------
# Inputs are listed in the Relax function's parameter order (kernels_build); inputs that do not
# depend on the sweep value (weights) are drawn once per case and kept in ``fixed``.


def _gemm_weight(case: Case, rnd: _Random, fixed: dict) -> list:
    """The [N, K] weight, drawn once a case: std 1/sqrt(K), outputs of unit scale, far from fp16's limit."""
    if "w" not in fixed:
        fixed["w"] = rnd.normal((case.dims["n"], case.dims["k"]), case.dtype, std=case.dims["k"] ** -0.5)
    return [fixed["w"]]


def _q4_weight(case: Case, rnd: _Random, fixed: dict) -> list:
    """Packed words and scales, drawn once a case: a weight of std 1/sqrt(K) quantized as MLC quantizes
    (nibbles and per-group scales that vary)."""
    if "q" not in fixed:
        w = rnd.normal((case.dims["n"], case.dims["k"]), case.dtype, std=case.dims["k"] ** -0.5)
        fixed["q"], fixed["scale"] = quantization.quantize_torch(w, _q4_scheme(case))
    return [fixed["q"], fixed["scale"]]


def _gemm_inputs(case: Case, m: int, rnd: _Random, fixed: dict) -> list:
    w = _gemm_weight(case, rnd, fixed)
    return [rnd.normal((m, case.dims["k"]), case.dtype), *w]


def _gemm_residual_inputs(case: Case, m: int, rnd: _Random, fixed: dict) -> list:
    return [*_gemm_inputs(case, m, rnd, fixed), rnd.normal((m, case.dims["n"]), case.dtype)]


def _gemm_q4_inputs(case: Case, m: int, rnd: _Random, fixed: dict) -> list:
    packed = _q4_weight(case, rnd, fixed)
    return [rnd.normal((m, case.dims["k"]), case.dtype), *packed]


def _norm_gemm_inputs(case: Case, m: int, rnd: _Random, fixed: dict) -> list:
    """x, residual ([M, 1, K]), the norm weight, then the GEMM's weight (float, or packed words and scales)."""
    k = case.dims["k"]
    weights = (_gemm_weight if case.op == "norm_gemm" else _q4_weight)(case, rnd, fixed)
    if "norm_weight" not in fixed:
        fixed["norm_weight"] = rnd.normal((k,), case.dtype, std=_NORM_WEIGHT_STD, mean=1.0)
    return [rnd.normal((m, 1, k), case.dtype), rnd.normal((m, 1, k), case.dtype), fixed["norm_weight"], *weights]


def _q4_scheme(case: Case) -> quantization.QuantScheme:
    return quantization.SCHEMES[case.quantization]


def _add_rmsnorm_inputs(case: Case, m: int, rnd: _Random, fixed: dict) -> list:
    """x, residual ([1, M, hidden]), the norm weight."""
    x, w = _rmsnorm_inputs(case, m, rnd, fixed)
    return [x.reshape(1, m, -1), rnd.normal((1, m, case.dims["hidden"]), case.dtype), w]


def _rmsnorm_inputs(case: Case, m: int, rnd: _Random, fixed: dict) -> list:
    h = case.dims["hidden"]
    if "weight" not in fixed:
        fixed["weight"] = rnd.normal((h,), case.dtype, std=_NORM_WEIGHT_STD, mean=1.0)
    return [rnd.normal((m, h), case.dtype), fixed["weight"]]


def _softmax_inputs(case: Case, rows: int, rnd: _Random, fixed: dict) -> list:
    return [rnd.normal((rows, case.dims["cols"]), case.dtype, std=_LOGIT_STD)]


def _attention_inputs(case: Case, q_len: int, kv_len: int, rnd: _Random) -> list:
    h, kvh, d = case.dims["q_heads"], case.dims["kv_heads"], case.dims["head_dim"]
    return [
        rnd.normal((q_len, h, d), case.dtype),
        rnd.normal((kv_len, kvh, d), case.dtype),
        rnd.normal((kv_len, kvh, d), case.dtype),
    ]


_INPUTS: dict[str, Callable[[Case, int, _Random, dict], list]] = {
    "gemm": _gemm_inputs,
    "gemm_residual": _gemm_residual_inputs,
    "gemm_gate_up_silu": _gemm_inputs,
    "gemm_q4": _gemm_q4_inputs,
    "norm_gemm": _norm_gemm_inputs,
    "norm_gemm_q4": _norm_gemm_inputs,
    "rmsnorm": _rmsnorm_inputs,
    "add_rmsnorm": _add_rmsnorm_inputs,
    "softmax": _softmax_inputs,
    "attention_prefill": lambda case, n, rnd, fixed: _attention_inputs(case, n, n, rnd),
    "attention_decode": lambda case, n, rnd, fixed: _attention_inputs(case, 1, n, rnd),
}


def _attention_reference(torch: Any, case: Case, q: Any, k: Any, v: Any, causal: bool) -> Any:
    """Float64, one head at a time (a [seq, seq] float64 score matrix per head at most)."""
    group = case.dims["q_heads"] // case.dims["kv_heads"]
    scale = case.dims["head_dim"] ** -0.5
    q64, k64, v64 = q.double(), k.double(), v.double()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    q_len, kv_len = q.shape[0], k.shape[0]
    mask = None
    if causal:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).triu(1 + kv_len - q_len)
    for head in range(case.dims["q_heads"]):
        scores = (q64[:, head] @ k64[:, head // group].T) * scale
        if mask is not None:
            scores.masked_fill_(mask, float("-inf"))
        out[:, head] = torch.softmax(scores, dim=-1) @ v64[:, head // group]
    return out


def _rmsnorm64(torch: Any, x: Any, w: Any, eps: float) -> Any:
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def _reference(torch: Any, case: Case, inputs: list) -> Any:
    """Float64; a tuple where the function returns several tensors."""
    if case.op == "gemm":
        x, w = inputs
        return x.double() @ w.double().T
    if case.op == "gemm_residual":
        x, w, r = inputs
        return x.double() @ w.double().T + r.double()
    if case.op == "gemm_gate_up_silu":
        x, w = inputs
        gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    if case.op == "gemm_q4":
        x, q, scale = inputs
        return x.double() @ quantization.dequantize_torch((q, scale.double()), _q4_scheme(case)).T
    if case.op in ("norm_gemm", "norm_gemm_q4"):
        x, r, w, *weight = inputs
        matrix = weight[0].double() if case.op == "norm_gemm" else quantization.dequantize_torch(
            (weight[0], weight[1].double()), _q4_scheme(case))
        total = x.double() + r.double()
        return _rmsnorm64(torch, total, w.double(), case.attrs["eps"]) @ matrix.T, total
    if case.op == "rmsnorm":
        x, w = (t.double() for t in inputs)
        return _rmsnorm64(torch, x, w, case.attrs["eps"])
    if case.op == "add_rmsnorm":
        x, r, w = (t.double() for t in inputs)
        return x + r, _rmsnorm64(torch, x + r, w, case.attrs["eps"])
    if case.op == "softmax":
        return torch.softmax(inputs[0].double(), dim=-1)
    return _attention_reference(torch, case, *inputs, causal=case.op == "attention_prefill")


def sdpa_backends(device: str) -> list:
    """The SDPA backends PyTorch may use on ``device`` (``sdpa_backends`` in bench.json)."""
    from torch.nn.attention import SDPBackend

    return [getattr(SDPBackend, name) for name in bench_config()["sdpa_backends"][device]]


def _torch_attention(torch: Any, case: Case, inputs: list, device: str) -> Callable[[], Any]:
    """SDPA on [1, H, S, D] views of the [S, H, D] inputs; output viewed back as [S, H, D]."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    backends = sdpa_backends(device)
    causal = case.op == "attention_prefill"
    scale = case.dims["head_dim"] ** -0.5
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in inputs)

    def gqa() -> Any:
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    try:
        gqa()
        return gqa
    except RuntimeError as err:
        # A backend without native GQA: repeat K/V heads once, outside the timed call.
        print(f"  torch: SDPA without enable_gqa ({str(err).splitlines()[0][:80]})", flush=True)
    group = case.dims["q_heads"] // case.dims["kv_heads"]
    k_rep, v_rep = (t.repeat_interleave(group, dim=1) for t in (k, v))

    def repeated() -> Any:
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=causal, scale=scale)
        return out.squeeze(0).transpose(0, 1)

    return repeated


def _torch_rmsnorm(torch: Any, x: Any, w: Any, eps: float) -> Any:
    import torch.nn.functional as F

    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).mean(dim=-1, keepdim=True) + eps)).to(x.dtype) * w


def _torch_fn(torch: Any, case: Case, inputs: list, device: str) -> Callable[[], Any]:
    import torch.nn.functional as F

    if case.op == "gemm":
        x, w = inputs
        return lambda: F.linear(x, w)
    if case.op == "gemm_residual":
        x, w, r = inputs  # the GEMM, then the add as its own kernel
        return lambda: F.linear(x, w) + r
    if case.op == "gemm_gate_up_silu":
        x, w = inputs  # the GEMM, then silu(gate) * up as PyTorch's own kernels

        def gate_up() -> Any:
            gate, up = F.linear(x, w).chunk(2, dim=-1)
            return F.silu(gate) * up

        return gate_up
    if case.op == "gemm_q4":
        # PyTorch has no q4f16_1 kernel: its GEMM at the same shape, on the weight dequantized once, untimed.
        x, q, scale = inputs
        w = quantization.dequantize_torch((q, scale), _q4_scheme(case))
        return lambda: F.linear(x, w)
    if case.op in ("norm_gemm", "norm_gemm_q4"):
        # The add, the norm and the GEMM as PyTorch's own kernels (a q4 weight dequantized once, untimed).
        x, r, w, *weight = inputs
        matrix = weight[0] if case.op == "norm_gemm" else quantization.dequantize_torch((weight[0], weight[1]), _q4_scheme(case))

        def norm_gemm() -> Any:
            total = x + r
            return F.linear(_torch_rmsnorm(torch, total, w, case.attrs["eps"]), matrix), total

        return norm_gemm
    if case.op == "add_rmsnorm":
        x, r, w = inputs

        def add_norm() -> Any:
            total = x + r
            return total, _torch_rmsnorm(torch, total, w, case.attrs["eps"])

        return add_norm
    if case.op == "rmsnorm":
        x, w = inputs
        return lambda: _torch_rmsnorm(torch, x, w, case.attrs["eps"])
    if case.op == "softmax":
        x = inputs[0]
        return lambda: torch.softmax(x, dim=-1)
    return _torch_attention(torch, case, inputs, device)


def _int4pack_fn(torch: Any, case: Case, x: Any, rnd: _Random, device: str, fixed: dict) -> Callable[[], Any]:
    """``_weight_int4pack_mm`` on the tokens ``x`` in bf16, over random packed weights drawn once per
    case; called once here, so an op this torch or device lacks raises before anything is timed."""
    pack, inner_k_tiles, matmul = _INT4PACK_OPS[device]
    group = _q4_scheme(case).group_size
    if "int4pack" not in fixed:
        n, k = case.dims["n"], case.dims["k"]
        values = torch.randint(0, 16, (n, k), generator=rnd.gen, device=rnd.device, dtype=torch.int32)
        if device == "cuda":
            values = (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8)
        scales_zeros = (torch.rand((k // group, n, 2), generator=rnd.gen, device=rnd.device) + 0.01).to(torch.bfloat16)
        fixed["int4pack"] = getattr(torch.ops.aten, pack)(values, inner_k_tiles), scales_zeros
    w4, scales_zeros = fixed["int4pack"]
    op, xb = getattr(torch.ops.aten, matmul), x.to(torch.bfloat16)

    def fn() -> Any:
        return op(xb, w4, group, scales_zeros)

    fn()
    return fn


# --- checking --------------------------------------------------------------------------------------


def relative_error(torch: Any, out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| in float64 (Frobenius norm), in chunks of rows; NaN if out has NaN."""
    if tuple(out.shape) != tuple(ref.shape):
        raise FuselightError(f"output shape {tuple(out.shape)} differs from the reference's {tuple(ref.shape)}")
    rows = out.reshape(out.shape[0], -1) if out.dim() else out.reshape(1, 1)
    ref_rows = ref.reshape(rows.shape)
    step = max(1, _ERROR_CHUNK_ELEMENTS // max(1, rows.shape[1]))
    num = den = 0.0
    for start in range(0, rows.shape[0], step):
        r = ref_rows[start : start + step]
        d = rows[start : start + step].double() - r
        num += float((d * d).sum())
        den += float((r * r).sum())
    if den == 0.0:
        raise FuselightError("reference is all zeros: the relative error is undefined")
    return math.sqrt(num / den)


def tensor_to_tvm(tvm: Any, torch: Any, t: Any) -> Any:
    """``t`` as a TVM tensor (no copy); uint32 through int32 where torch's DLPack lacks uint32."""
    if t.dtype == torch.uint32:
        try:
            return tvm.runtime.from_dlpack(t)
        except Exception:  # noqa: BLE001 - a torch without uint32 DLPack: same bits as int32
            return tvm.runtime.from_dlpack(t.view(torch.int32))._create_view(tuple(t.shape), "uint32")
    return tvm.runtime.from_dlpack(t)


def _outputs(torch: Any, out: Any, impl: str) -> tuple:
    """A call's result as a tuple of torch tensors (a function may return several)."""
    many = isinstance(out, (tuple, list)) or (not hasattr(out, "shape") and hasattr(out, "__len__"))
    outs = tuple(out) if many else (out,)
    return outs if impl == "torch" else tuple(torch.from_dlpack(o) for o in outs)


def _tvm_fn(tvm: Any, torch: Any, vm: Any, inputs: list) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(timed call, poisoned call) of the library's ``main`` on the inputs."""
    func = vm["main"]
    args = [tensor_to_tvm(tvm, torch, t) for t in inputs]
    poison = inputs[0].clone().fill_(float("nan"))
    poisoned_args = [tvm.runtime.from_dlpack(poison), *args[1:]]
    return (lambda: func(*args)), (lambda: func(*poisoned_args))


def _run_case(
    torch: Any,
    tvm: Any,
    case: Case,
    vms: dict[str, Any],
    sources: dict[str, str],
    rnd: _Random,
    device: str,
    common: dict,
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Every sweep point of one case: (records, descriptions of results above tolerance, anchors that
    could not run)."""
    tolerance = bench_config()["relerr_tolerance"][case.dtype]
    records, failures, anchor_errors = [], [], []
    fixed: dict = {}
    for n in case.sweep:
        inputs = _INPUTS[case.op](case, n, rnd, fixed)
        ref = _reference(torch, case, inputs)
        nbytes, flops = case.cost(n)
        fns: dict[str, Callable[[], Any]] = {}
        for pipeline, vm in vms.items():
            call, poisoned = _tvm_fn(tvm, torch, vm, inputs)
            for _ in range(_POISON_CALLS):
                poisoned()
            fns[pipeline] = call
        fns["torch"] = _torch_fn(torch, case, inputs, device)
        point = f"{case.name} {case.spec.sweep_var}={n}"
        if case.op == "gemm_q4":  # tinygemm's matmul anchors the plain 4-bit GEMM
            try:
                fns[TORCH_INT4PACK] = _int4pack_fn(torch, case, inputs[0], rnd, device, fixed)
            except Exception as err:  # noqa: BLE001 - an anchor this torch lacks is recorded, not fatal
                reason = (str(err).splitlines() or [""])[0][:200]
                anchor_errors.append(f"{point} {TORCH_INT4PACK}: {type(err).__name__}: {reason}")
                print(f"  {anchor_errors[-1]}", flush=True)
        line = []
        for impl, fn in fns.items():
            relerr = None
            if impl != TORCH_INT4PACK:
                out = fn()
                synchronizer(device)()
                refs = ref if isinstance(ref, tuple) else (ref,)
                errors = [relative_error(torch, o, r) for o, r in zip(_outputs(torch, out, impl), refs, strict=True)]
                relerr = max(errors, key=lambda e: math.inf if math.isnan(e) else e)  # a NaN is the worst
                del out
                if not relerr <= tolerance:
                    failures.append(f"{point} {impl}: relerr {relerr:.2e} > {tolerance:g}")
            stats = time_fn(fn, device=device)
            records.append(
                make_record(
                    **common,
                    case=case.name,
                    shape=case.shape(n),
                    impl=impl,
                    metric=case.spec.metric,
                    stats=stats,
                    nbytes=nbytes,
                    flops=flops,
                    relerr=relerr,
                    baseline_source=sources.get(impl),
                    note=INT4PACK_NOTE if impl == TORCH_INT4PACK else None,
                )
            )
            checked = "timed only" if relerr is None else f"err {relerr:.1e}"
            line.append(f"{impl} {stats.median_us:.1f} us ({checked})")
        print(f"  {case.spec.sweep_var}={n}: " + ", ".join(line), flush=True)
        del inputs, ref, fns
    return records, failures, anchor_errors


def results_name(suite: str) -> str:
    """The kernel suite's results name: ``kernels`` for the full suite, else ``kernels-<suite>``."""
    return SUITE if suite == "full" else f"{SUITE}-{suite}"


def run_suite(
    manifest: Path, out_json: Path | None = None, cases: list[str] | None = None, sweep: list[int] | None = None,
    *, accept_ptx: bool = False,
) -> list[dict[str, Any]]:
    """Check and time every case of ``manifest`` (or the named ``cases``); write ``out_json``.

    ``accept_ptx``: run a suite built as PTX for an older GPU (``runtime.load_module``); the records'
    device says so. ``sweep`` replaces the swept values of every case whose swept dimension is symbolic in its
    libraries (e.g. only the low-batch M of the GEMM cases); a case built for one value keeps it.
    Without ``out_json`` the results go to ``bench/results/<device>/<results_name(suite)>.json``; a
    partial run there (``cases``, ``sweep``, or a manifest built for some of the suite's cases)
    replaces the points it measured and keeps the file's others. Returns this run's records.
    """
    from ..report import text_table

    raw, all_cases = read_manifest(manifest)
    entries = {e["name"]: e for e in raw["cases"]}
    selected = select(all_cases, cases)
    if sweep is not None:
        if not sweep or not all(v > 0 for v in sweep):
            raise FuselightError(f"--sweep must be positive integers, got {sweep}")
        selected = [c if c.static else dataclasses.replace(c, sweep=tuple(sweep)) for c in selected]
    target = raw.get("target")
    if target not in DEVICE_OF_TARGET:
        raise FuselightError(f"{manifest}: field 'target' {target!r} is not one of {', '.join(DEVICE_OF_TARGET)}")
    device = DEVICE_OF_TARGET[target]
    tvm = init_tvm()
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise FuselightError("PyTorch sees no CUDA device")
    rnd = _Random(torch, torch.device("cuda:0" if device == "cuda" else "cpu"), bench_config()["seed"])
    common = {
        "suite": SUITE,
        "device": device_label(device_name(device), raw),
        "tvm_version": tvm.__version__,
        "git_commit": raw.get("git_commit") or git_commit(),
    }
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    anchor_errors: list[str] = []
    for i, case in enumerate(selected, 1):
        libs = entries[case.name]["libraries"]
        vms, sources = {}, {}
        for pipeline in PIPELINES:
            if pipeline in libs:
                vms[pipeline], _, meta = load_library(Path(manifest).parent / libs[pipeline], device, accept_ptx=accept_ptx)
                sources[pipeline] = meta.get("baseline_source") or raw.get("baseline_source") or "unknown"
        print(
            f"[{i}/{len(selected)}] {case.name} ({case.op}, {case.dtype}): {case.spec.sweep_var} in {list(case.sweep)}",
            flush=True,
        )
        with torch.no_grad():
            case_records, case_failures, case_anchor_errors = _run_case(
                torch, tvm, case, vms, sources, rnd, device, common
            )
        records += case_records
        failures += case_failures
        anchor_errors += case_anchor_errors
        # Cases differ in size: hand both caching allocators' memory back before the next one.
        del vms
        release_memory()
        if device == "cuda":
            torch.cuda.empty_cache()
    meta = {"suite": SUITE, "manifest": str(manifest), "target": target, "arch": raw.get("arch"),
            "ptx": bool(raw.get("ptx")), "failures": failures, "anchor_errors": anchor_errors}
    written = records
    if out_json:
        out_json = Path(out_json)
    else:
        suite = raw.get("suite", "full")
        out_json = default_path(common["device"], results_name(suite))
        partial = cases is not None or sweep is not None or set(entries) != {c.name for c in load_suite(suite)}
        if partial:
            written = merged_with(out_json, records)
    write_results(out_json, written, meta)
    print(text_table(records))
    for failure in failures:
        print(f"MISMATCH {failure}")
    print(
        f"{len(records)} measurements, {len(failures)} above tolerance, {len(anchor_errors)} anchors not run; "
        f"results: {out_json}",
        flush=True,
    )
    return records
