"""Probe: the M = 1 GEMV configs swept at the decode GEMVs of small models (SmolLM2-135M, Llama-3.2-1B; Llama-3-8B as a check).

Two halves, one file:

  build (CPU host, full TVM + nvcc; from the project root):
      python3 bench/probes/gemv_decode_sweep.py build .build/smallk [--model smollm2-135m llama-3.2-1b llama-3-8b]
  for each model preset (``configs/models``, fp16): our model through the fuselight pipeline's
  phases 1-3 (graph passes, legalisation, fusion: the functions as the rules get them), the PrimFuncs
  of its ``decode`` function that the Gemv rule takes at a static M = 1 (``fused_rms_norm_gemv*``: the
  norm prologue, QKV, gate_up with its paired SiLU-mul, the LM head; ``fused_NT_matmul*_astype*``:
  o_proj, down), deduplicated by structure. Each function's shipped kernel (the Gemv rule with
  ``configs/gemm/gemv.json``) and the row template's configs of ``variants`` (``GemvConfig`` with
  ``rows_per_warp``), compiled with the sm_90 TIR pipeline with programmatic launch (every kernel
  waits for the grid before it, as builds launch them), one library a model (``<model>.so``, AOT
  cubins beside it), ptxas's registers and spills, and ``manifest.json``.

  With ``--quantization q4f16_1`` (or ``q4bf16_1``) the models have our 4-bit weights (``fuselight compile
  --quantization``): the functions are the dequantize-fused GEMVs (``fused_rms_norm_gemv*``,
  ``fused_dequantize*_NT_matmul*``), the shipped bucket is ``configs/gemm/gemv_q4.json``'s, swept
  beside it with and without half sums and its L2 prefetch, and the sweep is the 4-bit one
  (``variants(quantized=True)``: half sums on); a model's key and library are ``<model>-q4f16_1``.

  run (GPU host, runtime-only TVM + torch):
      python3 bench/probes/gemv_decode_sweep.py run .build/smallk/manifest.json -o sweep.json [--models ...]
  random inputs (never zeros; weights N(0, 1/K), norm weights 1 + N(0, 0.01); 4-bit: packed words and
  scales as the q4 probes draw them, ``q4_common.q4_weights``), every kernel checked against a float64
  reference of its function (``reference``; 4-bit: of the weight as its dequantize rounds it), then
  timed with L2 flushed (``fuselight.bench.timing``, medians) isolated, and in a chain: the kernel launched ``CHAIN`` times
  back to back on distinct weight copies inside one CUDA graph (in the model the GEMVs run back to
  back, launched early: isolated times carry each launch's ramp and tail). A device copy of 256 MB
  is the bandwidth anchor. Prints per model and function the shipped kernel, the best variant
  (isolated, chained), the ratio and the share of the copy rate, then a suggested M = 1 bucket per
  model, K and the bucket serving the functions now (``suggest``: the config with the best geometric
  mean of chained time over those functions, against each function's best); writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from fuselight.device import require_device
from fuselight.quantization import dequantize, scheme

# beside this script (its folder is on sys.path)
from persistent_decode import graph_of, ptxas_registers
from q4_common import q4_weights

ARCH = "sm_90"
MODELS = ("smollm2-135m", "llama-3.2-1b", "llama-3-8b")
QUANTIZATIONS = ("q4f16_1", "q4bf16_1")  # 4-bit schemes the build takes (``--quantization``; the row template's NK words)
CHAIN = 8  # launches of one kernel on distinct weight copies a timed graph replays
ROW_BYTES = 512  # a warp's load of one weight row (32 lanes x 16 bytes): the row template's K step
# The sweep (``GemvConfig`` fields of the row template), pruned by ``variants``: fp16 weights, and
# 4-bit ones (a lane's 16-byte piece is 4 words, 32 values: a 512-byte step of a row holds 1024 values,
# so K 4096 is 4 steps and unroll 1 already has a quarter of a row in flight).
WARPS = (2, 4, 8, 16)
ROWS_PER_WARP = (1, 2)
UNROLL = (2, 4, 8)
Q4_WARPS = (4, 8, 16)
Q4_ROWS_PER_WARP = (1, 2, 4)
Q4_UNROLL = (1, 2, 4)
MIN_BLOCKS = (1, 2, 3, 4)
_SM = require_device(ARCH)
MAX_WARPS_PER_SM = _SM.max_threads_per_sm // _SM.warp_size
# 4-bit: registers a thread keeps at least (ptxas gave session 21's row-template q4 kernels 60-84 and
# spilled at 80: docs/experiments/q4-gemv.md), which bounds the warps resident an SM (32 on sm_90).
Q4_MIN_REGISTERS = 64
# 4-bit, a grid of at least 4 blocks an SM: resident warps an SM at least, in place of twice
# ``MIN_WARPS_PER_SM`` (which the register bound meets exactly): the shipped m1_k4096's 8 x 3.
Q4_LARGE_GRID_WARPS = 24
MIN_WARPS_PER_SM = 16  # fewer resident warps than this leave too few loads in flight to stream
MAX_ROWS_IN_FLIGHT = 8  # unroll x rows_per_warp (x2 double-buffered): 512-byte steps a warp holds in registers
MIN_ROWS_IN_FLIGHT = 2  # ... and at least this many (one 512-byte step a warp leaves too few bytes in flight)
REDUCED = {"warps": (8, 16), "unroll": (4, 8)}  # --reduced (Llama-3-8B's check)
# fp16 outputs of float32 sums: norm-wise error of the output's rounding and a last-bit difference
# in the normed row carried through a matmul stay well below this; so do 4-bit half sums (fp16 sums of
# each word's products: 4.2-4.9e-4 against float64 at K 4096-14336 in session 21).
TOLERANCE = 5e-3
_FIELDS = ("warps", "rows_per_warp", "unroll", "min_blocks_per_sm", "double_buffer", "prefetch_l2_percent")
_Q4_FIELDS = (*_FIELDS, "half_sums")


def variant_name(cfg: dict[str, Any]) -> str:
    """A row-template config's short name: ``w16_r1_u4_b1[_db][_hs][_pf25]``."""
    return (f"w{cfg['warps']}_r{cfg['rows_per_warp']}_u{cfg['unroll']}_b{cfg['min_blocks_per_sm']}"
            + ("_db" if cfg.get("double_buffer") else "") + ("_hs" if cfg.get("half_sums") else "")
            + (f"_pf{cfg['prefetch_l2_percent']}" if cfg.get("prefetch_l2_percent") else ""))


def variants(out_n: int, k: int, elem_bytes: float, sms: int, reduced: bool = False,
             quantized: bool = False) -> list[dict[str, Any]]:
    """The row-template configs swept for a GEMV of ``out_n`` output columns and rows of ``k``
    elements of ``elem_bytes`` (0.5: 4-bit) on ``sms`` SMs: every combination of ``WARPS``,
    ``ROWS_PER_WARP``, ``UNROLL`` (``quantized``: ``Q4_WARPS``, ``Q4_ROWS_PER_WARP``, ``Q4_UNROLL``,
    with half sums, which won at every shape in session 21; ``extra_configs`` adds the float32 dot at
    the shipped settings), ``MIN_BLOCKS`` and double buffering that
    - fits an SM (warps x blocks <= ``MAX_WARPS_PER_SM``; 4-bit: and ``Q4_MIN_REGISTERS`` a thread of
      the SM's registers) and keeps ``MIN_WARPS_PER_SM`` warps resident
      (twice that in a grid of at least 4 blocks an SM, 4-bit ``Q4_LARGE_GRID_WARPS``; a smaller
      grid: as many as it gives);
    - asks for no more resident blocks than the grid has an SM (``min_blocks_per_sm`` only budgets
      registers for blocks that exist);
    - holds ``MIN_ROWS_IN_FLIGHT`` to ``MAX_ROWS_IN_FLIGHT`` rows' steps in registers (unroll x
      rows_per_warp, twice that double-buffered), and unrolls no more steps than a row has (at
      least 2: K 576 is 2.25 steps);
    - double-buffers only where a row takes more than one round of ``unroll`` steps.
    ``reduced``: only the warps and unrolls of ``REDUCED`` (fp16)."""
    steps = math.ceil(k * elem_bytes / ROW_BYTES)
    if quantized:
        axes = (Q4_WARPS, Q4_ROWS_PER_WARP, Q4_UNROLL, MIN_BLOCKS, (False, True), (True,))
    else:
        axes = (REDUCED["warps"] if reduced else WARPS, ROWS_PER_WARP, REDUCED["unroll"] if reduced else UNROLL,
                MIN_BLOCKS, (False, True), (False,))
    max_warps = MAX_WARPS_PER_SM
    if quantized:
        max_warps = min(max_warps, _SM.regs_per_sm // (Q4_MIN_REGISTERS * _SM.warp_size))
    out = []
    for warps, rows, unroll, blocks, db, half in itertools.product(*axes):
        grid_per_sm = -(-(-(-out_n // (warps * rows))) // sms)
        if warps * blocks > max_warps or blocks > max(1, grid_per_sm):
            continue
        # warps resident an SM: at least the floor (twice it where the grid has blocks for every
        # MIN_BLOCKS), or, in a smaller grid, as many as the grid gives
        large = grid_per_sm >= len(MIN_BLOCKS)
        floor = (Q4_LARGE_GRID_WARPS if quantized else 2 * MIN_WARPS_PER_SM) if large else MIN_WARPS_PER_SM
        reachable = warps * min(grid_per_sm, len(MIN_BLOCKS), MAX_WARPS_PER_SM // warps)
        if warps * blocks < (floor if large else min(floor, reachable)):
            continue
        in_flight = (1 + db) * unroll * rows
        if not MIN_ROWS_IN_FLIGHT <= in_flight <= MAX_ROWS_IN_FLIGHT or (unroll > 2 and unroll // 2 >= steps):
            continue
        if db and -(-steps // unroll) < 2:
            continue
        cfg = {"warps": warps, "rows_per_warp": rows, "unroll": unroll, "min_blocks_per_sm": blocks,
               "double_buffer": db, "prefetch_l2_percent": None}
        out.append({**cfg, "half_sums": half} if quantized else cfg)
    return out


# ---- the reference ------------------------------------------------------------------------------


def _round(a: np.ndarray, dtype: str) -> np.ndarray:
    # NumPy has no bfloat16: ml_dtypes' (TVM ships it).
    return a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype).astype(np.float64)


def reference(desc: dict[str, Any], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The function's outputs in float64 (by role: ``out``, and ``total`` where the norm prologue
    adds a residual first) from its inputs by role (``x``, ``weight`` [N, K], ``norm_weight``,
    ``residual`` (the prologue's), ``out_residual`` (the epilogue's add); with ``desc["quantization"]``
    ``weight`` the packed words [N, K / 8] and ``scale`` their scales), ``desc`` its analysis
    (``norm``, ``eps``, ``paired``, ``dtype``, ``out_dtype``): rounded where the function stores or
    casts (``x + residual``, the normed row, the dequantized weight, the matmul's cast before SiLU-mul
    or an add, the output)."""
    dt, inputs = desc["dtype"], dict(inputs)
    if desc.get("quantization"):  # the dequantize's (value - zero) * scale, rounded to dt as it is computed
        stored = (np.asarray(inputs.pop("weight"), dtype=np.uint32), inputs.pop("scale"))
        inputs["weight"] = _round(dequantize(stored, scheme(desc["quantization"])), dt)
    f = {k: np.asarray(v, dtype=np.float64) for k, v in inputs.items()}
    x = f["x"].reshape(-1)
    got: dict[str, np.ndarray] = {}
    if desc["norm"]:
        if "residual" in f:
            x = _round(x + f["residual"].reshape(-1), dt)
            got["total"] = x
        x = _round(x / np.sqrt(np.mean(x * x) + desc["eps"]) * f["norm_weight"].reshape(-1), dt)
    w = f["weight"].reshape(-1, x.size)
    y = w @ x
    if desc["paired"]:
        g, u = _round(y[: y.size // 2], dt), _round(y[y.size // 2:], dt)
        y = g / (1 + np.exp(-g)) * u
    elif "out_residual" in f:
        y = _round(y, dt) + f["out_residual"].reshape(-1)
    got["out"] = _round(y, desc["out_dtype"])
    return got


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref||, flattened, in float64."""
    out, ref = np.asarray(out, np.float64).reshape(-1), np.asarray(ref, np.float64).reshape(-1)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ---- build ------------------------------------------------------------------------------------


def decode_gemvs(model: Any, target: Any, dtype: str = "float16", quantization: str | None = None) -> dict[str, Any]:
    """Name -> PrimFunc: the functions of our model's ``decode`` (``model``: a preset's name, in
    ``dtype`` or with the 4-bit scheme ``quantization``; or a ``ModelConfig``) that the Gemv rule takes
    at a static M = 1, as phases 1-3 of the fuselight pipeline hand them to the rules, one of each
    structure (with 4-bit weights, the dequantize fused into each: ``fused_rms_norm_gemv*``,
    ``fused_dequantize*_NT_matmul*``)."""
    import tvm
    import tvm_ffi
    from fuselight import pipeline as pl
    from fuselight.config import load
    from fuselight.model.llama import export_module
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemm.gemv_common import static_m
    from fuselight.rules.gemv import Gemv
    from tvm import relax, tirx

    config = load(model).with_dtype(dtype).with_quantization(quantization) if isinstance(model, str) else model
    mod = export_module(config, target)[0]
    stages = pl.stages(target, graph_passes=pl.graph_passes(None, None), rules=pl.fuselight_rules())
    with target:
        mod = tvm.transform.Sequential([s.pass_ for s in stages if s.phase <= 3])(mod)
    called = {gv.name_hint for gv in relax.analysis.all_global_vars(mod["decode"])}
    found: dict[str, Any] = {}
    for gv, func in sorted(mod.functions.items(), key=lambda kv: kv[0].name_hint):
        if (gv.name_hint not in called or not isinstance(func, tirx.PrimFunc)
                or "tirx.is_scheduled" in (func.attrs or {})):
            continue
        desc = analyze_matmul(func, prologue=True, dequant=True)
        if desc is None or static_m(desc.operands) != 1 or Gemv().apply(func.with_attr("target", target), target, False) is None:
            continue
        bare = func.without_attr("global_symbol")
        if not any(tvm_ffi.structural_equal(bare, f.without_attr("global_symbol")) for f in found.values()):
            found[gv.name_hint] = func.with_attr("target", target)
    return found


def describe(func: Any, quantization: str | None = None) -> dict[str, Any]:
    """What the run half needs of a GEMV function: its parameters' roles, shapes and dtypes (4-bit
    weights: ``weight`` the packed words, ``scale`` their scales), the analysis the reference reads,
    and the bytes of weights (and scales) it streams."""
    from fuselight.rules.gemm.analysis import analyze_matmul

    ops = analyze_matmul(func, prologue=True, dequant=True).operands
    norm, deq = ops.prologue, ops.dequant
    named = {"weight": ops.b, "x": norm.x if norm else ops.a, "out": ops.out.buffer,
             "scale": deq.scale if deq is not None else None}
    if norm is not None:
        named.update(norm_weight=norm.weight, residual=norm.residual, total=norm.total)
    params = []
    for p in func.params:
        role = next((r for r, b in named.items() if b is not None and b.same_as(p)), "out_residual")
        params.append({"name": p.name, "role": role, "shape": [int(s) for s in p.ty.shape], "dtype": str(p.ty.dtype)})
    return {"params": params, "n": ops.n, "k": ops.k, "out_n": ops.out_n, "dtype": ops.dtype,
            "out_dtype": str(ops.out.buffer.dtype), "norm": norm is not None, "eps": norm.eps if norm else None,
            "paired": ops.paired, "quantization": quantization,
            "weight_bytes": sum(math.prod(p["shape"]) * np.dtype(p["dtype"]).itemsize
                                for p in params if p["role"] in ("weight", "scale"))}


def shipped_bucket(func: Any, target: Any) -> tuple[str, dict[str, Any], int | None, int]:
    """The bucket of ``configs/gemm/gemv.json`` (4-bit weights: ``gemv_q4.json``; sm_90) serving
    ``func`` now: its name, fields (4-bit: with ``half_sums``), its ``max_blocks`` (None: any grid),
    and the grid size (16-row blocks) that ``max_blocks`` bounds."""
    from fuselight.rules.gemm import gemv
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemv import gemv_config

    ops = analyze_matmul(func, prologue=True, dequant=True).operands
    cfg = gemv_config(ops, 1, target)
    quantized = ops.dequant is not None
    buckets, _ = gemv.read_buckets(gemv.CONFIG_NAME_Q4 if quantized else gemv.CONFIG_NAME, ARCH,
                                   gemv.arch_config.as_written if quantized else gemv.arch_config.gemv,
                                   gemv.GemvConfig, gemv.check_gemv_config)
    name = next((at.rsplit("[", 1)[1].strip("'[]") for c, at in buckets if c == cfg), "?")
    return name, {f: getattr(cfg, f) for f in (_Q4_FIELDS if quantized else _FIELDS)}, cfg.max_blocks, gemv.grid_blocks(ops)


def extra_configs(shipped: dict[str, Any]) -> list[dict[str, Any]]:
    """Beside the sweep: the shipped bucket without its L2 prefetch (where it has one) and, with 4-bit
    weights, with the float32 dot instead of half sums (or the other way round), with and without."""
    out = [shipped]
    if "half_sums" in shipped:
        out.append({**shipped, "half_sums": not shipped["half_sums"]})
    if shipped["prefetch_l2_percent"] is not None:
        out += [{**c, "prefetch_l2_percent": None} for c in out]
    return out[1:]


def manifest_key(model: str, quantization: str | None) -> str:
    """A model's key in the manifest and its library's name: ``llama-3-8b``, ``llama-3-8b-q4f16_1``."""
    return f"{model}-{quantization}" if quantization else model


def build(out: Path, models: list[str], reduced: list[str], quantization: str | None = None) -> None:
    import tvm
    from fuselight import tir_pipeline
    from fuselight.compile import library_metadata
    from fuselight.library import write_library
    from fuselight.rules.base import with_kernels
    from fuselight.rules.gemm import gemv
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemv import Gemv
    from fuselight.target import resolve, to_tvm

    spec = resolve("cuda", ARCH)
    target = to_tvm(spec)
    sms = _SM.sms
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"arch": ARCH, "sms": sms, "chain": CHAIN, "models": {}}
    t0 = time.time()
    for model in models:
        key = manifest_key(model, quantization)
        funcs = decode_gemvs(model, target, quantization=quantization)
        entry: dict[str, Any] = {"library": f"{key}.so", "quantization": quantization, "functions": {}}
        kernels: dict[str, Any] = {}
        for fname, func in funcs.items():
            rec = describe(func, quantization)
            rec["bucket"], shipped, rec["bucket_max_blocks"], rec["grid_blocks"] = shipped_bucket(func, target)
            sym = f"{key}__{fname}".replace("-", "_").replace(".", "_")
            kernels[f"{sym}__shipped"] = Gemv().apply(func, target, False).mod["main"].with_attr("global_symbol", f"{sym}__shipped")
            rec["kernels"] = {"shipped": {"function": f"{sym}__shipped", "config": shipped}}
            ops = analyze_matmul(func, prologue=True, dequant=True).operands
            quantized = ops.dequant is not None
            sweep = variants(rec["out_n"], rec["k"], ops.dequant.bits / 8 if quantized else 2, sms,
                             reduced=model in reduced, quantized=quantized) + extra_configs(shipped)
            if quantized and ops.dtype != "float16":  # half sums are fp16's: bf16 keeps the float32 dot
                sweep = [{**f, "half_sums": False} for f in sweep]
            for fields in sweep:
                vname = variant_name(fields)
                if fields == shipped or vname in rec["kernels"]:
                    continue
                kname = f"{sym}__{vname}"
                cfg = gemv.GemvConfig(max_m=1, **fields)
                kernels[kname] = with_kernels(func, gemv.gemv_body(ops, cfg, sms)).with_attr("global_symbol", kname)
                rec["kernels"][vname] = {"function": kname, "config": fields}
            entry["functions"][fname] = rec
            print(f"{model} {fname}: N {rec['n']} K {rec['k']} grid {rec['grid_blocks']} bucket {rec['bucket']}, "
                  f"{len(rec['kernels'])} kernels", flush=True)
        mod = tvm.IRModule(kernels)
        lib = tvm.compile(mod, target=target, tir_pipeline=tir_pipeline.register(every_kernel=True))
        meta = library_metadata(spec, "fuselight", "fuselight rows template: shipped vs swept configs",
                                probe="gemv_decode_sweep")
        write_library(lib, out / entry["library"], meta, spec)
        regs = ptxas_registers(lib, ARCH)
        for rec in entry["functions"].values():
            for v in rec["kernels"].values():
                v.update(regs.get(v["function"] + "_kernel", {}))
        manifest["models"][key] = entry
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"{key}: {len(kernels)} kernels, {time.time() - t0:.0f} s", flush=True)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {manifest_path}; {total / 2**20:.1f} MiB under {out}")


# ---- run --------------------------------------------------------------------------------------


def make_inputs(rec: dict[str, Any], torch: Any, gen: Any, copies: int, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``copies`` argument sets by role (distinct weights, the other inputs and the outputs shared),
    outputs NaN; and the first set's inputs as numpy for ``reference`` (float64; packed words uint32).
    4-bit weights: random packed words and scales as the q4 probes draw them (``q4_weights``, seeded
    ``seed`` + copy)."""
    shared: dict[str, Any] = {}
    for p in rec["params"]:
        dtype, shape = getattr(torch, p["dtype"]), p["shape"]
        if p["role"] in ("out", "total"):
            shared[p["role"]] = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
        elif p["role"] == "norm_weight":
            shared[p["role"]] = (1 + 0.01 * torch.randn(shape, device="cuda", generator=gen)).to(dtype)
        elif p["role"] not in ("weight", "scale"):
            shared[p["role"]] = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    weight = next(p for p in rec["params"] if p["role"] == "weight")
    if rec.get("quantization"):
        scale = next(p for p in rec["params"] if p["role"] == "scale")
        case = {"n": rec["n"], "k": rec["k"], "dtype": scale["dtype"], "group": rec["k"] // scale["shape"][-1]}
        sets = []
        for c in range(copies):
            wd = q4_weights(case, torch, seed + c)
            sets.append({**shared, "weight": wd["q"], "scale": wd["scale"]})
            del wd
    else:
        sets = [{**shared, "weight": (torch.randn(weight["shape"], device="cuda", generator=gen)
                                      / math.sqrt(rec["k"])).to(getattr(torch, weight["dtype"]))} for _ in range(copies)]
    ref_in = {r: t.view(torch.int32).cpu().numpy().view(np.uint32) if t.dtype == torch.uint32 else t.double().cpu().numpy()
              for r, t in sets[0].items() if r not in ("out", "total")}
    return sets, ref_in


def copy_anchor(torch: Any, time_fn: Any, nbytes: int = 256 << 20) -> dict[str, float]:
    """A device-to-device copy of ``nbytes``: GB/s counting bytes read + written."""
    src = torch.randn(nbytes // 2, device="cuda").half()
    dst = torch.empty_like(src)
    st = time_fn(lambda: dst.copy_(src))
    return {"bytes": nbytes, "median_us": st.median_us, "gbps": 2 * nbytes / st.median_us / 1e3}


def run(manifest_path: Path, out_json: Path, models: list[str] | None) -> None:
    import torch
    import tvm
    import tvm_ffi
    from fuselight.bench.kernels_run import tensor_to_tvm
    from fuselight.bench.timing import device_name, time_fn
    from fuselight.runtime import load_module

    manifest = json.loads(manifest_path.read_text())
    results: dict[str, Any] = {"device": device_name("cuda"), "torch": torch.__version__, "manifest": str(manifest_path),
                               "chain": manifest["chain"], "copy": copy_anchor(torch, time_fn), "models": {}}
    rate = results["copy"]["gbps"]
    print(f"copy anchor: {rate:.0f} GB/s", flush=True)
    for mi, (model, entry) in enumerate(manifest["models"].items()):
        if models and model not in models:
            continue
        lib = load_module(manifest_path.parent / entry["library"])[0]
        results["models"][model] = {}
        for fi, (fname, rec) in enumerate(entry["functions"].items()):
            gen = torch.Generator(device="cuda").manual_seed(100 * mi + fi)
            try:
                sets, ref_in = make_inputs(rec, torch, gen, manifest["chain"], seed=1000 * (100 * mi + fi))
                ref = reference(rec, ref_in)
            except Exception as err:  # noqa: BLE001 - a function whose inputs or reference fail: recorded
                results["models"].setdefault(model, {})[fname] = {"error": f"{type(err).__name__}: {err}"[:300]}
                continue
            targs = [[tensor_to_tvm(tvm, torch, s[p["role"]]) for p in rec["params"]] for s in sets]
            frec: dict[str, Any] = {k: rec.get(k) for k in ("n", "k", "out_n", "grid_blocks", "bucket", "bucket_max_blocks",
                                                            "weight_bytes", "norm", "paired", "quantization")}
            frec["kernels"] = {}
            for vname, v in rec["kernels"].items():
                kern = lib[v["function"]]
                e: dict[str, Any] = {"config": v["config"], "registers": v.get("registers"), "spill_stores": v.get("spill_stores")}
                try:
                    for t in (sets[0]["out"], sets[0].get("total")):
                        if t is not None:
                            t.fill_(float("nan"))
                    kern(*targs[0])
                    torch.cuda.synchronize()
                    e["rel_err"] = max(rel_error(sets[0][r].double().cpu().numpy(), ref[r]) for r in ref)
                    e["correct"] = bool(e["rel_err"] < TOLERANCE)
                    e["isolated_us"] = time_fn(lambda kern=kern, args=targs[0]: kern(*args)).median_us

                    def chain(kern: Any = kern, calls: list = targs) -> None:
                        for args in calls:
                            kern(*args)

                    e["chained_us"] = time_fn(graph_of(chain, torch, tvm_ffi).replay).median_us / len(targs)
                except Exception as err:  # noqa: BLE001 - record and go on
                    e["error"] = f"{type(err).__name__}: {err}"[:300]
                frec["kernels"][vname] = e
            results["models"][model][fname] = frec
            del sets, targs
            torch.cuda.empty_cache()
            print(f"{model} {fname} done", file=sys.stderr, flush=True)
            out_json.write_text(json.dumps(results, indent=1) + "\n")
    results["suggested_buckets"] = suggest(results)
    print_table(results, rate)
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out_json}")


def _best(frec: dict[str, Any], mode: str) -> tuple[str | None, float | None]:
    good = [(e[mode], v) for v, e in frec["kernels"].items() if e.get("correct") and mode in e]
    t, v = min(good, default=(None, None))
    return v, t


def suggest(results: dict[str, Any]) -> dict[str, Any]:
    """Per model, K and the bucket serving a function now: the swept config (no prefetch) with the best
    geometric mean over those functions of its chained time against each function's best, as a
    candidate bucket (``max_k`` K, the serving bucket's ``max_blocks``: ``config_for`` orders buckets
    by ``max_blocks`` before ``max_k``, so a ``max_k`` bucket must bound the grid as the one it
    would replace)."""
    out: dict[str, Any] = {}
    for model, funcs in results["models"].items():
        funcs = {n: f for n, f in funcs.items() if "kernels" in f}  # (not those whose inputs failed)
        for k, bucket in sorted({(f["k"], f["bucket"]) for f in funcs.values()}):
            group = {n: f for n, f in funcs.items() if (f["k"], f["bucket"]) == (k, bucket)}
            scores: dict[str, list[float]] = {}
            for f in group.values():
                _, best = _best(f, "chained_us")
                for v, e in f["kernels"].items():
                    if v != "shipped" and e.get("correct") and "chained_us" in e and best:
                        scores.setdefault(v, []).append(e["chained_us"] / best)
            full = {v: s for v, s in scores.items() if len(s) == len(group)}
            if not full:
                continue
            v = min(full, key=lambda name: sum(map(math.log, full[name])))
            cfg = next(f["kernels"][v]["config"] for f in group.values())
            max_blocks = next(iter(group.values())).get("bucket_max_blocks")
            out[f"{model}/k{k}/{bucket}"] = {
                "bucket": {"max_m": 1, **({"max_blocks": max_blocks} if max_blocks else {}), "max_k": k,
                           **{f: x for f, x in cfg.items() if x is not None and x is not False}},
                "geomean_vs_best": math.exp(sum(map(math.log, full[v])) / len(full[v])),
                "functions": {n: {"bucket_now": f["bucket"], "grid_blocks": f["grid_blocks"],
                                  "shipped_chained_us": f["kernels"]["shipped"].get("chained_us"),
                                  "suggested_chained_us": f["kernels"][v].get("chained_us")} for n, f in group.items()}}
    return out


def print_table(results: dict[str, Any], rate: float) -> None:
    print(f"{'model':<18} {'function':<28} {'N x K':>12} {'grid':>5} {'bucket':<14} {'shipped iso/chain':>18} "
          f"{'best iso':>22} {'best chain':>22} {'ratio':>6} {'%copy':>6}")
    for model, funcs in results["models"].items():
        for fname, f in funcs.items():
            if "kernels" not in f:
                print(f"{model:<18} {fname:<28} {f['error']}")
                continue
            s = f["kernels"]["shipped"]
            vi, ti = _best(f, "isolated_us")
            vc, tc = _best(f, "chained_us")
            sc = s.get("chained_us")
            ship = f"{s.get('isolated_us', float('nan')):8.2f}/{sc or float('nan'):8.2f}"
            ratio = f"{sc / tc:6.3f}" if sc and tc else f"{'-':>6}"
            pct = f"{100 * f['weight_bytes'] / tc / 1e3 / rate:6.1f}" if tc else f"{'-':>6}"
            print(f"{model:<18} {fname:<28} {f['n']:>6}x{f['k']:<5} {f['grid_blocks']:>5} {f['bucket']:<14} {ship:>18} "
                  f"{(ti or float('nan')):7.2f} {vi or '-':<14} {(tc or float('nan')):7.2f} {vc or '-':<14} {ratio} {pct}")
            bad = [v for v, e in f["kernels"].items() if not e.get("correct")]
            if bad:
                print(f"  NOT CORRECT or failed: {', '.join(bad)}")
    print("suggested M = 1 buckets (best geometric mean of chained time per model, K and serving bucket):")
    for key, s in results.get("suggested_buckets", {}).items():
        now = ", ".join(f"{n}: {x['bucket_now']} {x['shipped_chained_us'] or float('nan'):.2f} -> "
                        f"{x['suggested_chained_us'] or float('nan'):.2f} us" for n, x in s["functions"].items())
        print(f"  {key}: {json.dumps(s['bucket'])} (x{s['geomean_vs_best']:.3f} of each best; {now})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The probe's command line: ``build OUT [--model ...] [--reduced ...] [--quantization q4f16_1]`` or
    ``run MANIFEST -o JSON [--models ...]`` (a model with 4-bit weights is named ``manifest_key``'s way)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--model", nargs="+", choices=MODELS, default=list(MODELS))
    b.add_argument("--reduced", nargs="*", choices=MODELS, default=[],
                   help="models swept with the reduced variant set (REDUCED; fp16)")
    b.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="4-bit weights of this scheme (the row template's 4-bit sweep, configs/gemm/gemv_q4.json)")
    r = sub.add_parser("run")
    r.add_argument("manifest", type=Path)
    r.add_argument("-o", "--output", type=Path, required=True)
    r.add_argument("--models", nargs="*", choices=[manifest_key(m, q) for m in MODELS for q in (None, *QUANTIZATIONS)])
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.cmd == "build":
        build(a.out, a.model, a.reduced, a.quantization)
    else:
        run(a.manifest, a.output, a.models)


if __name__ == "__main__":
    main()
