"""The paged-KV-cache attention suite: TVM's built-in kernels vs fuselight's, and PyTorch SDPA.

These are the kernels the KV cache runtime calls (``batch_decode_paged_kv`` for decode,
``batch_prefill_ragged_kv`` for a prefill's own tokens), so they are compiled and called as bare
PrimFuncs with the runtime's arguments: pages shuffled in memory, ragged batches, base-2 lse.
``baseline`` is TVM's kernel as every MLC-LLM build has it; ``fuselight`` is what the
``PagedAttention`` rule gives for it; ``torch`` is ``scaled_dot_product_attention`` (flash backend)
where the batch is one sequence, on contiguous K/V. ``rope_decode`` is a whole decode step of the
cache from the fused qkv: ``baseline`` launches TVM's split-rotary, append and decode kernels in
turn, ``fuselight`` the one kernel ``fuselight.passes.fuse_rope_append`` gives the cache in their
place. Outputs and lse (and for ``rope_decode`` the new K/V rows in the pages) are checked against
a float64 reference on fresh random inputs, poisoned (NaN) before each of two checked calls (the
second runs on what the first left: ``rope_decode``'s counters, which its kernel must leave at zero).

Points come from ``paged_attention`` in ``configs/bench.json``. ``build_suite`` runs on the build
host (TVM's compiler), ``run_suite`` on the GPU host (runtime-only TVM and PyTorch).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import FuselightError
from ..jsonfile import read_json_object
from . import bench_config

SUITE = "paged_attention"
MANIFEST_NAME = "manifest.json"
KINDS = ("decode", "prefill", "rope_decode")
BUILT_IMPLS = ("baseline", "fuselight")
_ITEMSIZE = {"float16": 2, "bfloat16": 2}
_BASELINE_SOURCE = "tvm-builtin-kv-cache-kernels"


@dataclasses.dataclass(frozen=True)
class Layout:
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    rope_theta: float


@dataclasses.dataclass(frozen=True)
class Point:
    kind: str
    lengths: tuple[int, ...]  # KV length of each sequence (decode) / tokens of each sequence (prefill)
    causal: bool = False

    @property
    def name(self) -> str:
        lengths = self.lengths
        same = len(set(lengths)) == 1
        what = f"b{len(lengths)}x{lengths[0]}" if same else "ragged-" + "-".join(map(str, lengths))
        return f"{self.kind}-{what}" + ("-causal" if self.causal else "")

    def shape(self) -> dict[str, int]:
        return {"batch": len(self.lengths), "tokens": sum(self.lengths), "max_len": max(self.lengths)}

    def cost(self, layout: Layout) -> tuple[int, int]:
        """(bytes, flops): K/V and Q/O traffic, and 2 flops per multiply-add of QK^T and PV."""
        h, kvh, d, item = layout.q_heads, layout.kv_heads, layout.head_dim, _ITEMSIZE[layout.dtype]
        if self.kind in ("decode", "rope_decode"):
            kv = sum(self.lengths)
            return (2 * kv * kvh * d + 2 * len(self.lengths) * h * d) * item, 4 * kv * d * h
        pairs = sum(n * (n + 1) // 2 if self.causal else n * n for n in self.lengths)
        tokens = sum(self.lengths)
        return (2 * tokens * h * d + 2 * tokens * kvh * d) * item, 4 * pairs * d * h


def load_points(points: str | None = None) -> tuple[Layout, list[Point]]:
    """The layout and points of ``paged_attention`` in ``configs/bench.json`` (``points="gpu"``: the
    GPU test tier's points, its ``gpu`` section)."""
    cfg = bench_config().get(SUITE)
    if not isinstance(cfg, dict):
        raise FuselightError(f"configs/bench.json: no {SUITE!r} section")
    try:
        layout = Layout(*(cfg[f.name] for f in dataclasses.fields(Layout)))
    except KeyError as err:
        raise FuselightError(f"configs/bench.json: {SUITE}.{err.args[0]} missing") from None
    _check_dtype(layout, SUITE)
    section, where = cfg, SUITE
    if points is not None:
        if points not in cfg or not isinstance(cfg[points], dict):
            raise FuselightError(f"configs/bench.json: no {SUITE}.{points} section")
        section, where = cfg[points], f"{SUITE}.{points}"
    found = []
    for kind in KINDS:
        for i, entry in enumerate(section.get(kind, [])):
            at = f"configs/bench.json: {where}.{kind}[{i}]"
            if "lengths" in entry:
                groups = [entry["lengths"]]
            elif "batch" in entry and "contexts" in entry:
                groups = [[c] * entry["batch"] for c in entry["contexts"]]
            else:
                raise FuselightError(f"{at}: give 'lengths', or 'batch' and 'contexts'")
            for lengths in groups:
                if not lengths or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in lengths):
                    raise FuselightError(f"{at}: lengths must be positive integers, got {lengths!r}")
                found.append(Point(kind, tuple(lengths), bool(entry.get("causal", False))))
    return layout, found


def _check_dtype(layout: Layout, where: str) -> None:
    if layout.dtype not in _ITEMSIZE:
        raise FuselightError(f"configs/bench.json: {where}.dtype {layout.dtype!r} is not one of {', '.join(_ITEMSIZE)}")


def gpu_layouts() -> list[Layout]:
    """The GPU test tier's head layouts (``paged_attention.gpu.layouts``), with the suite's page size
    and RoPE base."""
    base, _ = load_points()
    raw = bench_config()[SUITE].get("gpu", {}).get("layouts", [])
    layouts = []
    for i, entry in enumerate(raw):
        where = f"{SUITE}.gpu.layouts[{i}]"
        try:
            layout = dataclasses.replace(base, **{f: entry[f] for f in ("q_heads", "kv_heads", "head_dim", "dtype")})
        except (KeyError, TypeError):
            raise FuselightError(f"configs/bench.json: {where}: give q_heads, kv_heads, head_dim and dtype") from None
        _check_dtype(layout, where)
        if layout.q_heads % layout.kv_heads:
            raise FuselightError(f"configs/bench.json: {where}: kv_heads must divide q_heads")
        layouts.append(layout)
    return layouts


def layout_name(layout: Layout) -> str:
    return f"{layout.q_heads}x{layout.kv_heads}x{layout.head_dim}-{layout.dtype}"


# --- build host ------------------------------------------------------------------------------------


def builtin_kernel(kind: str, layout: Layout, target: Any) -> Any:
    """TVM's own kernel of ``kind`` (``rope_decode``: its decode kernel), generated as
    ``TIRPagedKVCache`` generates it."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_ragged

    h, kvh, d, dt = layout.q_heads, layout.kv_heads, layout.head_dim, layout.dtype
    if kind in ("decode", "rope_decode"):
        return _attention_decode(kvh, h, d, dt, False, {}, target, page_size=layout.page_size)
    return _attention_prefill_ragged(kvh, h, d, d, dt, {}, target)


def rope_append_kernels(layout: Layout) -> tuple[Any, Any]:
    """TVM's split-rotary (default RoPE, ``layout.rope_theta``) and transpose-append kernels, unscheduled."""
    from tvm.relax.frontend.nn.llm.kv_cache import _kv_cache_transpose_append
    from tvm.relax.frontend.nn.llm.position_embedding import (
        llama_rope_with_position_map,
    )

    h, kvh, d, dt = layout.q_heads, layout.kv_heads, layout.head_dim, layout.dtype
    split = llama_rope_with_position_map(layout.rope_theta, 1.0, d, h, kvh, dt, {}, d)
    return split, _kv_cache_transpose_append(kvh, d, dt)


def _dlight_scheduled(func: Any, target: Any) -> Any:
    """``func`` as a build schedules it with DLight's default rules (the baseline's)."""
    import tvm
    from tvm.s_tir import dlight as dl

    from fuselight.rules import dlight_defaults

    with target:
        return dl.ApplyDefaultSchedule(*dlight_defaults(target))(tvm.IRModule({"main": func}))["main"]


def _suite_kernels(kind: str, layout: Layout, target: Any, arch: str) -> dict[str, Any]:
    """The PrimFuncs a point of ``kind`` calls, by name: ``baseline`` and ``fuselight`` (and TVM's
    ``split_rotary`` and ``append`` that ``rope_decode``'s baseline launches before its decode)."""
    from fuselight.passes.fuse_rope_append import analyze as analyze_rope_append
    from fuselight.rules.flash.decode import (
        flash_decode_paged_rotary,
        load_decode_config,
    )
    from fuselight.rules.paged_attention import kernel_for

    builtin = builtin_kernel(kind, layout, target)
    if kind != "rope_decode":
        ours = kernel_for(builtin, target)
        if ours is None:
            raise FuselightError(f"the PagedAttention rule declined TVM's {kind} kernel for {layout}")
        return {"baseline": builtin, "fuselight": ours}
    split, append = rope_append_kernels(layout)
    desc = analyze_rope_append(split, append)
    if desc is None:
        raise FuselightError(f"fuse_rope_append declined TVM's split-rotary and append kernels for {layout}")
    fused = flash_decode_paged_rotary(desc.rotary, layout.page_size, load_decode_config(arch))
    return {"baseline": builtin, "fuselight": fused, "split_rotary": _dlight_scheduled(split, target),
            "append": _dlight_scheduled(append, target)}


def build_suite(
    out_dir: Path, arch: str = "sm_90", layout: Layout | None = None, points: str | None = None, *, ptx: bool = False
) -> Path:
    """Compile every kernel of each kind for ``arch`` (``ptx``: carried as its PTX) and ``layout``
    (default: the suite's) into ``out_dir``; returns the manifest path. ``points`` names the points
    ``run_suite`` checks (``gpu``: the GPU test tier's; default the suite's own)."""
    import tvm

    from .. import tir_pipeline
    from ..compile import library_metadata, write_library
    from ..target import resolve, to_tvm
    from .results import git_commit

    spec = resolve("cuda", arch, ptx=ptx)
    target = to_tvm(spec)
    layout = layout or load_points()[0]
    out_dir = Path(out_dir)
    libraries: dict[str, dict[str, str]] = {}
    for kind in KINDS:
        libraries[kind] = {}
        for impl, func in _suite_kernels(kind, layout, target, arch).items():
            mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
            executable = tvm.compile(mod, target=target, tir_pipeline=tir_pipeline.register())
            name = f"{kind}-{impl}.so"
            meta = library_metadata(spec, impl, _BASELINE_SOURCE, kernel=kind)
            write_library(executable, out_dir / name, meta, spec)
            libraries[kind][impl] = name
            print(f"built {name}", flush=True)
    manifest = out_dir / MANIFEST_NAME
    body = {"suite": SUITE, "arch": arch, "ptx": ptx, "layout": dataclasses.asdict(layout), "libraries": libraries,
            "git_commit": git_commit(), "points": points}
    manifest.write_text(json.dumps(body, indent=1) + "\n")
    return manifest


def build_gpu_tier(out_dir: Path, arch: str = "sm_90", *, ptx: bool = False) -> list[Path]:
    """The suite for each of the GPU test tier's layouts, ``out_dir/paged-<layout>/``: their manifests."""
    return [build_suite(Path(out_dir) / f"paged-{layout_name(layout)}", arch, layout, "gpu", ptx=ptx)
            for layout in gpu_layouts()]


# --- GPU host --------------------------------------------------------------------------------------


def _pages_for(torch: Any, lengths: tuple[int, ...], layout: Layout, rnd: Any, dev: Any) -> dict[str, Any]:
    """A paged cache holding random K/V for ``lengths``, its pages in shuffled order."""
    ps = layout.page_size
    num_pages = [math.ceil(n / ps) for n in lengths]
    total = sum(num_pages)
    shape = (total, 2, layout.kv_heads, ps, layout.head_dim)
    pages = torch.randn(shape, generator=rnd, device=dev, dtype=torch.float32).to(getattr(torch, layout.dtype))
    order = torch.randperm(total, generator=rnd, device=dev).to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(num_pages).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(lengths, num_pages)], dtype=torch.int32, device=dev)
    return {"pages": pages, "values": order, "indptr": indptr, "last": last}


def _gather_kv(torch: Any, cache: dict[str, Any], lengths: tuple[int, ...], b: int) -> tuple[Any, Any]:
    """Sequence ``b``'s K and V [len, H_kv, D] in order, out of the shuffled pages."""
    start, end = int(cache["indptr"][b]), int(cache["indptr"][b + 1])
    pages = cache["pages"][cache["values"][start:end].long()]  # [n_pages, 2, H_kv, page, D]
    kv = pages.permute(1, 0, 3, 2, 4).reshape(2, -1, pages.shape[2], pages.shape[4])[:, : lengths[b]]
    return kv[0], kv[1]


def _reference(torch: Any, q: Any, k: Any, v: Any, scale: float, causal: bool) -> tuple[Any, Any]:
    """float64 attention of q [n, H, D] over k/v [m, H_kv, D] (bottom-right causal): (out, base-2 lse)."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("nhd,mhd->hnm", qd, kd) * scale
    if causal:
        n, m = q.shape[0], k.shape[0]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, n]
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), vd)
    return out, (lse / math.log(2)).T


def _max_error(torch: Any, got: Any, ref: Any) -> float:
    """max |got - ref| / max |ref| (NaN stays NaN)."""
    err = (got.double() - ref).abs().max()
    return float(err / ref.abs().max())


def _decode_case(torch, tvm, fns, point, layout, rnd, dev):
    h, d = layout.q_heads, layout.head_dim
    b = len(point.lengths)
    dt = getattr(torch, layout.dtype)
    cache = _pages_for(torch, point.lengths, layout, rnd, dev)
    q = torch.randn((b, h, d), generator=rnd, device=dev, dtype=torch.float32).to(dt)
    zeros = torch.zeros(b, dtype=torch.int32, device=dev)
    scale = d**-0.5
    refs = [_reference(torch, q[i : i + 1], *_gather_kv(torch, cache, point.lengths, i), scale, False) for i in range(b)]
    ref_out = torch.cat([r[0] for r in refs])
    ref_lse = torch.cat([r[1] for r in refs])
    out = torch.empty((b, h, d), dtype=dt, device=dev)
    lse = torch.empty((b, h), dtype=torch.float32, device=dev)
    args = [q, cache["pages"], cache["indptr"], cache["values"], cache["last"], zeros, zeros, out, lse]
    calls = {impl: _bind(tvm, f, args, (0, 1.0, 1e4, scale)) for impl, f in fns.items()}
    torch_call = None
    if b == 1:
        k, v = _gather_kv(torch, cache, point.lengths, 0)
        torch_call = _sdpa(torch, q, k.contiguous(), v.contiguous(), scale, False)
    return calls, torch_call, _written((out, lse), (ref_out, ref_lse))


def _prefill_case(torch, tvm, fns, point, layout, rnd, dev):
    h, kvh, d = layout.q_heads, layout.kv_heads, layout.head_dim
    dt = getattr(torch, layout.dtype)
    n = sum(point.lengths)
    q = torch.randn((n, h, d), generator=rnd, device=dev, dtype=torch.float32).to(dt)
    k = torch.randn((n, kvh, d), generator=rnd, device=dev, dtype=torch.float32).to(dt)
    v = torch.randn((n, kvh, d), generator=rnd, device=dev, dtype=torch.float32).to(dt)
    indptr = torch.tensor([0, *torch.tensor(point.lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    positions = torch.cat([torch.arange(m, dtype=torch.int32, device=dev) for m in point.lengths])
    offsets = torch.zeros(len(point.lengths), dtype=torch.int32, device=dev)
    scale = d**-0.5
    refs = []
    for i in range(len(point.lengths)):
        s, e = int(indptr[i]), int(indptr[i + 1])
        refs.append(_reference(torch, q[s:e], k[s:e], v[s:e], scale, point.causal))
    ref_out = torch.cat([r[0] for r in refs])
    ref_lse = torch.cat([r[1] for r in refs])
    out = torch.empty((n, h, d), dtype=dt, device=dev)
    lse = torch.empty((n, h), dtype=torch.float32, device=dev)
    args = [q, indptr, k, v, indptr, positions, offsets, out, lse]
    calls = {impl: _bind(tvm, f, args, (int(point.causal), 0, 1.0, 1e4, scale)) for impl, f in fns.items()}
    torch_call = _sdpa(torch, q, k, v, scale, point.causal) if len(point.lengths) == 1 else None
    return calls, torch_call, _written((out, lse), (ref_out, ref_lse))


def _rope64(torch: Any, x: Any, positions: Any, theta: float) -> Any:
    """float64 rotate-half RoPE of x [n, H, D] at positions [n] (TVM's default frequencies)."""
    d = x.shape[-1]
    half = d // 2
    i = torch.arange(d, device=x.device, dtype=torch.float64) % half
    angle = positions.double()[:, None] / theta ** (2 * i / d)[None, :]  # [n, D]
    xd = x.double()
    rotated = torch.cat([-xd[..., half:], xd[..., :half]], -1)
    return xd * angle.cos()[:, None, :] + rotated * angle.sin()[:, None, :]


def _rope_decode_case(torch, tvm, fns, point, layout, rnd, dev):
    h, kvh, d, ps = layout.q_heads, layout.kv_heads, layout.head_dim, layout.page_size
    b = len(point.lengths)
    dt = getattr(torch, layout.dtype)
    cache = _pages_for(torch, point.lengths, layout, rnd, dev)
    qkv = torch.randn((b, h + 2 * kvh, d), generator=rnd, device=dev, dtype=torch.float32).to(dt)
    positions = torch.tensor([n - 1 for n in point.lengths], dtype=torch.int32, device=dev)
    # the new token's slot: its sequence's last row, in whichever page holds it
    slots = [int(cache["values"][int(cache["indptr"][i]) + (n - 1) // ps]) * ps + (n - 1) % ps for i, n in enumerate(point.lengths)]
    append_positions = torch.tensor(slots, dtype=torch.int32, device=dev)
    scale = d**-0.5
    q_ref = _rope64(torch, qkv[:, :h], positions, layout.rope_theta)
    k_new = _rope64(torch, qkv[:, h : h + kvh], positions, layout.rope_theta)
    v_new = qkv[:, h + kvh :].double()
    refs = []
    for i in range(b):
        k, v = _gather_kv(torch, cache, point.lengths, i)
        k, v = k.double().clone(), v.double().clone()
        k[-1], v[-1] = k_new[i], v_new[i]
        refs.append(_reference(torch, q_ref[i : i + 1], k, v, scale, False))
    q, k_out, v_out = (torch.empty((b, n, d), dtype=dt, device=dev) for n in (h, kvh, kvh))
    out = torch.empty((b, h, d), dtype=dt, device=dev)
    lse = torch.empty((b, h), dtype=torch.float32, device=dev)
    zeros = torch.zeros(b, dtype=torch.int32, device=dev)
    page_no, slot = (append_positions // ps).long(), (append_positions % ps).long()

    def new_rows() -> tuple[Any, Any]:
        return cache["pages"][page_no, 0, :, slot], cache["pages"][page_no, 1, :, slot]  # [b, H_kv, D]

    def poison() -> None:
        for x in (out, lse, q, k_out, v_out):
            x.fill_(float("nan"))
        cache["pages"][page_no, :, :, slot] = float("nan")

    split = [qkv, positions, q, k_out, v_out]
    attention = [cache["indptr"], cache["values"], cache["last"], zeros, zeros, out, lse]
    # the fused kernel's last argument, as fuselight.kv_hooks owns it: zero, one a sequence x KV head
    counters = torch.zeros(b * kvh, dtype=torch.int32, device=dev)
    scalars = (0, 1.0, layout.rope_theta, scale)
    tensors = {name: [tvm.runtime.from_dlpack(t) for t in group] for name, group in (
        ("split", split), ("append", [cache["pages"], k_out, v_out, append_positions]),
        ("decode", [q, cache["pages"], *attention]),
        ("fused_rest", [cache["pages"], append_positions, *attention]), ("counters", [counters]))}

    def baseline() -> None:
        fns["split_rotary"](*tensors["split"], 1)  # apply_rope = 1
        fns["append"](*tensors["append"])
        fns["baseline"](*tensors["decode"], *scalars)

    def fused() -> None:  # split-rotary's arguments, then the append's, the decode kernel's, the counters
        fns["fuselight"](*tensors["split"], 1, *tensors["fused_rest"], *scalars, *tensors["counters"])

    ref_out = torch.cat([r[0] for r in refs])
    ref_lse = torch.cat([r[1] for r in refs])
    checked = Checked(lambda: (out, lse, q, k_out, v_out, *new_rows()), (ref_out, ref_lse, q_ref, k_new, v_new, k_new, v_new), poison,
                      lambda: int(counters.count_nonzero()) == 0)
    return {"baseline": baseline, "fuselight": fused}, None, checked


@dataclasses.dataclass(frozen=True)
class Checked:
    """A case's float64 references, what its call writes (``read()``, in the references' order)
    and ``poison()``, which NaN-fills all of that before a checked call; ``settled()``: whether the
    call left the state it keeps between calls as the next call needs it (an infinite error if not)."""

    read: Callable[[], tuple]
    refs: tuple
    poison: Callable[[], None]
    settled: Callable[[], bool] = lambda: True

    def error(self, torch: Any) -> float:
        errors = [_max_error(torch, got, ref) for got, ref in zip(self.read(), self.refs, strict=True)]
        if not self.settled():
            return math.inf
        return math.nan if any(math.isnan(e) for e in errors) else max(errors)  # max() may drop a NaN


def _written(outputs: tuple, refs: tuple) -> Checked:
    """``Checked`` for a call that writes ``outputs``, against ``refs``."""

    def poison() -> None:
        for x in outputs:
            x.fill_(float("nan"))

    return Checked(lambda: outputs, refs, poison)


def _bind(tvm: Any, func: Any, tensors: list, scalars: tuple) -> Any:
    args = [tvm.runtime.from_dlpack(t) for t in tensors]
    return lambda: func(*args, *scalars)


def _sdpa(torch: Any, q: Any, k: Any, v: Any, scale: float, causal: bool) -> Any:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))

    def call() -> Any:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, enable_gqa=True)

    return call


def _copy_gbps(torch: Any, dev: Any) -> float:
    """Device-to-device copy bandwidth (bytes read + written / s): the ceiling decode is rated against."""
    from .timing import time_fn

    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    stats = time_fn(lambda: dst.copy_(src), device="cuda", flush_l2=False)
    return 2 * src.numel() / stats.median_us / 1e3


def run_suite(manifest: Path, out_json: Path | None = None, *, accept_ptx: bool = False) -> list[dict[str, Any]]:
    """Check and time every point for the manifest's libraries on the GPU; write ``out_json``
    (default ``bench/results/<device>/paged-attention.json``).

    ``accept_ptx``: run a suite built as PTX for an older GPU; the records' device says so."""
    from ..library import device_label
    from ..report import text_table
    from ..runtime import init_tvm, load_module, release_memory
    from .results import default_path, make_record, write_results
    from .timing import device_name, time_fn

    manifest = Path(manifest)
    raw = read_json_object(manifest, missing=f"paged-attention manifest not found: {manifest}")
    if raw.get("suite") != SUITE:
        raise FuselightError(f"{manifest}: not a {SUITE} manifest")
    layout = Layout(**raw["layout"])
    _, points = load_points(raw.get("points"))
    tvm = init_tvm()
    import torch

    if not torch.cuda.is_available():
        raise FuselightError("PyTorch sees no CUDA device")
    dev = torch.device("cuda:0")
    rnd = torch.Generator(device=dev).manual_seed(bench_config()["seed"])
    kernels = {
        kind: {impl: load_module(manifest.parent / name, "cuda", accept_ptx=accept_ptx)[0]["main"]
               for impl, name in libs.items()}
        for kind, libs in raw["libraries"].items()
    }
    tolerance = bench_config()["relerr_tolerance"][layout.dtype]
    common = {"suite": SUITE, "device": device_label(device_name("cuda"), raw), "tvm_version": tvm.__version__,
              "git_commit": raw.get("git_commit") or "unknown"}
    records, failures = [], []
    copy_gbps = _copy_gbps(torch, dev)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    make_case = {"decode": _decode_case, "prefill": _prefill_case, "rope_decode": _rope_decode_case}
    with torch.no_grad():
        for point in points:
            calls, torch_call, checked = make_case[point.kind](torch, tvm, kernels[point.kind], point, layout, rnd, dev)
            nbytes, flops = point.cost(layout)
            line = []
            for impl, call in [*calls.items(), ("torch", torch_call)]:
                if call is None:
                    continue
                if impl == "torch":
                    err = _max_error(torch, call().transpose(1, 2)[0], checked.refs[0])
                else:
                    errors = []
                    for _ in range(2):  # the second call on what the first left
                        checked.poison()
                        call()
                        torch.cuda.synchronize()
                        errors.append(checked.error(torch))
                    err = next((e for e in errors if not e <= tolerance), max(errors))  # a NaN is not <=
                if not err <= tolerance:
                    failures.append(f"{point.name} {impl}: max error {err:.2e} > {tolerance:g}")
                stats = time_fn(call, device="cuda")
                metric = "tflops" if point.kind == "prefill" else "gbps"
                records.append(make_record(**common, case=point.name, shape=point.shape(), impl=impl, metric=metric,
                                           stats=stats, nbytes=nbytes, flops=flops, relerr=err,
                                           baseline_source=_BASELINE_SOURCE if impl != "torch" else None))
                rate = (f"{nbytes / stats.median_us / 1e3:.0f} GB/s" if metric == "gbps"
                        else f"{flops / stats.median_us / 1e6:.1f} TFLOP/s")
                line.append(f"{impl} {stats.median_us:.1f} us {rate} (err {err:.1e})")
            print(f"{point.name}: " + ", ".join(line), flush=True)
            del calls, torch_call, checked
            torch.cuda.empty_cache()
    del kernels
    release_memory()
    meta = {"suite": SUITE, "manifest": str(manifest), "arch": raw.get("arch"), "layout": raw["layout"],
            "copy_gbps": copy_gbps, "failures": failures}
    out_json = Path(out_json) if out_json else default_path(common["device"], "paged-attention")
    write_results(out_json, records, meta)
    print(text_table(records))
    for failure in failures:
        print(f"MISMATCH {failure}")
    print(f"{len(records)} measurements; results: {out_json}", flush=True)
    return records
