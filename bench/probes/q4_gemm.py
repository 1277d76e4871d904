"""Probe: the quantized (q4f16_1) prefill GEMMs, fuselight's kernel vs DLight's and our fp16 GEMM, on Llama-3-8B shapes.

Two halves, one file:

  build (CPU host, full TVM + nvcc; from the project root, fuselight's rules importable):
      python3 bench/probes/q4_gemm.py build .build/q4_gemm
  writes ``ours.so`` (the Matmul rule's kernels of each case: the dequantize in the mma.sync
  template's mainloop, symbolic M), ``dlight.so`` (DLight's schedule of the same PrimFuncs, as
  MLC-LLM builds them), ``fp16.so`` (the Matmul rule on an fp16 NT matmul of the same N and K:
  fuselight's fp16 GEMM, the throughput to compare with), their AOT cubins, CUDA sources
  (``*.cu.gz``), ptxas -v reports (``*_ptxas.txt``: registers and spills of every kernel) and ``manifest.json``.

  With the config sweep (``--no-sweep`` leaves it out) also ``sweep.so``: each Llama shape's
  q4 function under every plan of ``SWEEP_TILES`` (one plan a function, split-K 2 where N is
  small), for picking ``configs/gemm/mma_sync_q4.json``'s ranges from measurements.

  run (GPU host, runtime-only TVM: the TVM runtime on PYTHONPATH, TVM_USE_RUNTIME_LIB=1):
      python3 bench/probes/q4_gemm.py run .build/q4_gemm/manifest.json -o q4_gemm.json [--cases qkv ...] [--m 512 ...]
  for each case and M fills random packed words (never all zeros), scales and tokens, checks our
  kernel and DLight's against a float64 reference of the function (the weight dequantized as the
  function computes it, in fp16/bf16, then the product in float64; relative error of the whole
  output; outputs poisoned with NaN first), and times ours, DLight's, our fp16 GEMM and torch's fp16
  matmul of the dequantized weight with L2 flushed between calls (``fuselight.bench.timing``:
  medians). Prints a table (TFLOP/s, ours / fp16 GEMM) and writes JSON.
      python3 bench/probes/q4_gemm.py run .build/q4_gemm/manifest.json --sweep -o q4_sweep.json [--cases ...] [--m ...] [--plans q4rs- ...]
  checks and times every sweep plan at M 512..4095 and marks the fastest correct one per case and M
  (``--plans``: only the plans whose names start with these; ``q4rs-``: the weight-in-registers
  template's, ``wgmma-``: the dequantizing producer's).

Batch decode (M = 2..16), its own build and run:
      python3 bench/probes/q4_gemm.py build .build/q4_batch --batch-decode
  writes, for each Llama shape of ``BATCH_CASES`` (MLC-LLM's batch functions: tokens ``x[M, 1, k]``,
  symbolic M; the LM head at a static 128256 rows for the template, which needs a static N), one
  library ``batch_<case>.so``: the weight-in-registers template under each tile of
  ``BATCH_RS_TILES`` (token tiles of 16 and 32) and the shipped kernel of the same function (the
  GEMV buckets, as ``q4_gemv.py`` builds them), with ptxas -v reports and ``manifest.json``.
      python3 bench/probes/q4_gemm.py run .build/q4_batch/manifest.json -o q4_batch.json [--cases ...] [--m 2 16]
  (a batch-decode manifest runs this mode) checks every kernel against float64 at each M of
  ``BATCH_M``, times it, torch's fp16 matmul and ``_weight_int4pack_mm`` (L2 flushed, medians), and
  prints per case and M the shipped kernel, the best tile, their ratio and the speedups over both
  anchors, then the geomean and minimum over the cases at M = 2..16.

The cases are MLC-LLM's prefill functions (``fuselight.quant_prim_funcs.q4_linear``, ``prefill``:
tokens ``x[1, seq_len, k]``): dequantize in two stages, NT_matmul accumulating in float32, the cast epilogue (o_proj and
down also the residual add, the LM head the second cast to float32 and a symbolic vocabulary, run
at 128256). TVM 0.26's DLight Matmul asserts on these functions here ("consumers of the
cache-write stage ... not properly inlined"), with or without its tensor-core path: the build then
records ``dlight_error`` for the case and the run reports DLight's kernel as missing.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

# beside this script (its folder is on sys.path)
from q4_common import (CASES, command_line, gemv_target, int4pack_weight, kernel_args, linear_args, measure_gemv,
                       measure_int4pack, q4_tokens, q4_weights, rel_error, tensor_to_tvm)
from q4_gemv import gemv_rule_kernel

M_VALUES = (17, 128, 512, 1000, 1024, 2048, 4095)

# Config sweep of the 4-bit plans at prefill M (the lead's GPU run picks the best plan per M range
# for configs/gemm/mma_sync_q4.json): every tile below on the static-N Llama shapes (fp16, group
# 32), one plan a function (symbolic M, the last tile row predicated), split-K 2 too for a few
# tiles where N is small (4096, 6144: few column tiles at M 512). Kept small: the library holds each
# function's CUDA source (~0.4 MB), and the folder stays under 40 MB. Left out: the LM head (a
# symbolic N: mma.sync only, its plans those of the static shapes) and the mma.sync tiles that
# spill (256 x 128 with 64 x 64 warp tiles; 128 x 128 with 4 warps spills on the LM head).
SWEEP_CASES = ("qkv", "o_proj", "gate_up", "down")
SWEEP_M = (512, 1024, 2048, 4095)
SWEEP_TILES = (
    # mma.sync: block_m, block_n, block_k, warps_m, warps_n, stages
    (128, 256, 64, 2, 4, 4),
    (128, 128, 64, 2, 4, 4),
    (64, 256, 64, 2, 4, 4),
)
SWEEP_WGMMA_TILES = (
    # wgmma: block_n, warpgroups, stages, q4_staging (group_m 8, a persistent block on each SM)
    (256, 2, 3, 3),
    (256, 2, 3, 4),
    (128, 2, 5, 3),
    (128, 2, 5, 5),
    (128, 2, 4, 7),
    (192, 2, 4, 3),
    (192, 2, 3, 6),
)
SWEEP_RS_TILES = (
    # the weight as wgmma's register operand (rules/gemm/wgmma_q4.py): block_t (tokens), warpgroups
    # (64 weight rows each), stages (group_m 8, a persistent block on each SM)
    (256, 2, 4, "rs"),
    (256, 2, 5, "rs"),
    (192, 2, 5, "rs"),
    (128, 2, 6, "rs"),
)
# ``build --small-m``: the weight-in-registers template at prefill M up to 512 instead, with token
# tiles of 64 and 128, one or two warpgroups, and a fifth field: persistent blocks an SM.
SMALL_SWEEP_M = (17, 64, 128, 256, 512)
SMALL_SWEEP_RS_TILES = (
    (64, 1, 8, "rs", 1),
    (64, 1, 8, "rs", 2),
    (64, 1, 4, "rs", 3),
    (64, 2, 8, "rs", 1),
    (128, 1, 6, "rs", 1),
    (128, 2, 6, "rs", 1),
    (128, 2, 4, "rs", 1),
)
# ``build --batch-decode``: batch decode's M on the five Llama shapes, token tiles of 16 and 32 (a 16-token
# tile wastes nothing at M = 16; 32 halves the weight tiles' count where the grid is short), one or
# two warpgroups, 6-12 stages, one or two persistent blocks an SM (two only with one warpgroup: two
# blocks of 384 threads do not fit the registers). Fields: block_t, warpgroups, stages, blocks an SM.
BATCH_M = (2, 4, 8, 11, 16)
BATCH_CASES = ("qkv", "o_proj", "gate_up", "down", "lm_head")
BATCH_RS_TILES = (
    (16, 1, 8, 1), (16, 1, 12, 1), (16, 1, 8, 2), (16, 1, 12, 2),
    (16, 2, 6, 1), (16, 2, 8, 1), (16, 2, 12, 1),
    (32, 1, 8, 1), (32, 1, 8, 2), (32, 2, 6, 1), (32, 2, 8, 1),
)
SWEEP_SPLIT_N = 6144  # split-K 2 is swept where N is at most this, for these tiles:
SWEEP_SPLIT_TILES = ((128, 256, 64, 2, 4, 4), (256, 2, 3, 4), (128, 2, 5, 5))


def _fp16_name(n: int, k: int, dtype: str) -> str:
    return f"fp16_gemm_{n}x{k}_{dtype}"


# ---- build ------------------------------------------------------------------------------------


def build(out: Path, sweep: bool = True, small_m: bool = False) -> None:
    import tvm
    from fuselight.compile import library_metadata, write_library
    from fuselight.quant_prim_funcs import q4_linear
    from fuselight.rules import dlight_defaults
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemm.dispatch import q4_plan_ranges
    from fuselight.rules.matmul import Matmul
    from fuselight.runtime import cuda_sources
    from fuselight.target import resolve, to_tvm
    from fuselight.tune.gemm import matmul_prim_func
    from tvm.s_tir import dlight as dl

    spec = resolve("cuda", "sm_90")
    target = to_tvm(spec)
    ours, base, fp16, manifest = {}, {}, {}, {"cases": {}, "target": spec.options, "m": list(M_VALUES)}
    for name, case in CASES.items():
        func = q4_linear(**linear_args(case), m=None, prefill=True).with_attr("target", target)
        sch = Matmul().apply(func, target, False)
        if sch is None:
            raise SystemExit(f"{name}: the Matmul rule does not take it")
        ops = analyze_matmul(func, dequant=True).operands
        ranges = [(upper, _q4_name(plan)) for upper, plan in q4_plan_ranges(ops, "sm_90")]
        ours[name] = sch.mod["main"].with_attr("global_symbol", name)
        base[name] = func.with_attr("global_symbol", name)
        n, k, dtype = case["n"] or case["vocab"], case["k"], case.get("dtype", "float16")
        fname = _fp16_name(n, k, dtype)
        if fname not in fp16:
            f16 = matmul_prim_func(n, k, dtype).with_attr("target", target)
            f16_sch = Matmul().apply(f16, target, False)
            if f16_sch is None:
                raise SystemExit(f"{name}: the Matmul rule does not take the fp16 matmul {n}x{k}")
            fp16[fname] = f16_sch.mod["main"].with_attr("global_symbol", fname)
        manifest["cases"][name] = {**case, "function": name, "params": [p.name for p in func.params],
                                   "fp16_function": fname, "ranges": ranges}
    if sweep:
        sweep_funcs = _sweep(target, manifest, small_m)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    base_funcs = {}
    no_tc = tvm.target.Target(dict(spec.options, arch="sm_60", host={"kind": "llvm"}))
    for name, func in base.items():
        # One function at a time: DLight's Matmul asserts on some epilogues (recorded, then skipped).
        # TVM 0.26's MatmulTensorization asserts on these functions ("consumers of the cache-write
        # stage ... not properly inlined"); then DLight's Matmul is asked without its tensor-core
        # path (the target's arch below sm_70 while scheduling; compiled for sm_90 all the same).
        for sched_target, note in ((target, None), (no_tc, "DLight's Matmul without tensor cores (its tensorization asserts)")):
            try:
                with sched_target:
                    mod = dl.ApplyDefaultSchedule(*dlight_defaults(sched_target))(tvm.IRModule({name: func.with_attr("target", sched_target)}))
                base_funcs[name] = mod[name].with_attr("target", target)
                if note:
                    manifest["cases"][name]["dlight_note"] = note
                break
            except Exception as err:  # noqa: BLE001
                manifest["cases"][name]["dlight_error"] = f"{type(err).__name__}: {err}"[:300]
        if name in base_funcs:
            manifest["cases"][name].pop("dlight_error", None)
        print(f"{name}: DLight: {manifest['cases'][name].get('dlight_note') or manifest['cases'][name].get('dlight_error') or 'ok'}", flush=True)
    base_mod = tvm.IRModule(base_funcs)
    # One library a dtype for our kernels: the templates' dynamic shared buffers of fp16 and bf16
    # kernels in one CUDA source would be declared twice with two types.
    bf16 = {nm for nm, c in CASES.items() if c.get("dtype", "float16") == "bfloat16"}
    libs = {
        "ours": ("ours.so", tvm.IRModule({nm: f for nm, f in ours.items() if nm not in bf16})),
        "ours_bf16": ("ours_bf16.so", tvm.IRModule({nm: f for nm, f in ours.items() if nm in bf16})),
        "dlight": ("dlight.so", base_mod),
        "fp16": ("fp16.so", tvm.IRModule({nm: f for nm, f in fp16.items() if not nm.endswith("bfloat16")})),
        "fp16_bf16": ("fp16_bf16.so", tvm.IRModule({nm: f for nm, f in fp16.items() if nm.endswith("bfloat16")})),
    }
    if sweep:
        libs["sweep"] = ("sweep.so", tvm.IRModule(sweep_funcs))
    libs = {key: v for key, v in libs.items() if len(v[1].functions)}
    for nm in manifest["cases"]:
        manifest["cases"][nm]["suffix"] = "_bf16" if nm in bf16 else ""
    for key, (fname, mod) in libs.items():
        lib = tvm.compile(mod, target=target)
        meta = library_metadata(spec, "dlight" if key == "dlight" else "fuselight", "dlight (MLC-LLM's GPU rules)",
                                probe="q4_gemm")
        write_library(lib, out / fname, meta, spec)
        source = "\n".join(cuda_sources(lib))
        if key != "dlight":
            _ptxas_report(source, out / fname.replace(".so", "_ptxas.txt"))
        if key != "sweep":  # (the sweep's source is in sweep.so; its ptxas report is written)
            # To read (zless): gzip keeps the folder small (the libraries hold the sources too).
            with gzip.open(out / fname.replace(".so", ".cu.gz"), "wt") as f:
                f.write(source)
        print(f"{fname}: {len(mod.functions)} functions, {time.time() - t0:.0f} s", flush=True)
    manifest["libraries"] = {key: fname for key, (fname, _) in libs.items()}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out}/manifest.json")


def build_batch_decode(out: Path) -> None:
    """``build --batch-decode`` (the module docstring): a library a case, the manifest."""
    import tvm
    from fuselight.compile import library_metadata, write_library
    from fuselight.device import require_device
    from fuselight.errors import FuselightError
    from fuselight.quant_prim_funcs import q4_linear
    from fuselight.rules.base import host_branch, with_kernels
    from fuselight.rules.gemm import gemm_body
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemm.wgmma_q4 import WgmmaQ4Plan, WgmmaQ4Tile, check_tile
    from fuselight.runtime import cuda_sources

    spec, target = gemv_target()
    sms = require_device("sm_90").sms
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"batch_decode": {"m": list(BATCH_M)}, "target": spec.options, "cases": {}, "libraries": {}}
    t0 = time.time()
    for name in BATCH_CASES:
        case = CASES[name]
        batch = q4_linear(**linear_args(case), m=None).with_attr("target", target)
        funcs = {f"{name}__shipped": gemv_rule_kernel(batch, target, f"{name}__shipped")}
        func = q4_linear(**dict(linear_args(case), n=case["n"] or case["vocab"]), m=None)
        ops = analyze_matmul(func, dequant=True).operands
        entries = []
        for bt, wg, stages, per_sm in BATCH_RS_TILES:
            plan = WgmmaQ4Plan(WgmmaQ4Tile(bt, wg, stages, group_m=8, max_blocks=sms * per_sm))
            try:
                check_tile(plan.tile, ops)
            except FuselightError as err:  # a tile this shape cannot take: recorded
                print(f"batch {name} {_q4_name(plan)}: {err}", flush=True)
                continue
            fname = f"{name}__{_q4_name(plan).replace('-', '_')}"
            body = host_branch(ops.m > 0, gemm_body(ops, plan))
            funcs[fname] = with_kernels(func, body).with_attr("target", target).with_attr("global_symbol", fname)
            entries.append({"plan": _q4_name(plan), "function": fname})
        lib = tvm.compile(tvm.IRModule(funcs), target=target)
        fname = f"batch_{name}.so"
        write_library(lib, out / fname, library_metadata(spec, "fuselight", "dlight (MLC-LLM's GPU rules)", probe="q4_gemm"), spec)
        _ptxas_report("\n".join(cuda_sources(lib)), out / f"batch_{name}_ptxas.txt")
        manifest["cases"][name] = {**case, "params": [p.name for p in batch.params], "shipped": f"{name}__shipped",
                                   "rs": entries}
        manifest["libraries"][name] = fname
        print(f"{fname}: {len(funcs)} functions, {(out / fname).stat().st_size / 2**20:.1f} MiB, {time.time() - t0:.0f} s",
              flush=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out}/manifest.json")


def _ptxas_report(source: str, path: Path) -> None:
    """ptxas -v of ``source`` for sm_90a (each kernel: registers, spills, shared memory) into ``path``."""
    import subprocess
    import tempfile

    from fuselight.cuda_compile import TVM_FLAGS, gencode, nvcc_path

    nvcc = nvcc_path()
    if nvcc is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp, "k.cu")
        cu.write_text(source)
        proc = subprocess.run(
            [nvcc, "-O3", "-cubin", f"-gencode={gencode('sm_90')}", "--use_fast_math", *TVM_FLAGS,
             "-Xptxas", "-v", "-diag-suppress", "177", str(cu), "-o", str(Path(tmp, "k.cubin"))],
            capture_output=True, text=True, check=False,
        )
    lines = [ln for ln in proc.stderr.splitlines()
             if "Compiling entry" in ln or "registers" in ln or "spill" in ln or "error" in ln]
    path.write_text("\n".join(lines) + "\n")


def _sweep(target: Any, manifest: dict[str, Any], small_m: bool = False) -> dict[str, Any]:
    """The sweep's functions (one plan each, no GEMV buckets, no M ranges), recorded in ``manifest``;
    ``small_m``: the small-M set of weight-in-registers tiles instead."""
    from fuselight.device import require_device
    from fuselight.quant_prim_funcs import q4_linear
    from fuselight.rules.base import host_branch, with_kernels
    from fuselight.rules.gemm import gemm_body
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemm.plan import GemmPlan, GemmTile, check_plan
    from fuselight.rules.gemm.wgmma import WgmmaPlan, WgmmaTile, check_tile
    from fuselight.rules.gemm.wgmma_q4 import WgmmaQ4Plan, WgmmaQ4Tile
    from fuselight.rules.gemm.wgmma_q4 import check_tile as check_rs_tile

    sms = require_device("sm_90").sms  # one persistent wgmma block on each SM, as configs/gemm/wgmma.json
    funcs: dict[str, Any] = {}
    tiles = SMALL_SWEEP_RS_TILES if small_m else SWEEP_TILES + SWEEP_WGMMA_TILES + SWEEP_RS_TILES
    manifest["sweep"] = {"m": list(SMALL_SWEEP_M if small_m else SWEEP_M), "cases": {}}
    for name in SWEEP_CASES:
        case = CASES[name]
        func = q4_linear(**linear_args(case), m=None, prefill=True)
        ops = analyze_matmul(func, dequant=True).operands
        plans = []
        for fields in tiles:
            for split in (1, 2):
                if split > 1 and (not isinstance(ops.n, int) or ops.n > SWEEP_SPLIT_N or fields not in SWEEP_SPLIT_TILES):
                    continue
                if "rs" in fields:
                    bt, wg, stages, _, *per_sm = fields
                    plan = WgmmaQ4Plan(WgmmaQ4Tile(bt, wg, stages, group_m=8, max_blocks=sms * (per_sm or [1])[0]))
                elif len(fields) == 4:
                    bn, wg, stages, staging = fields
                    plan = WgmmaPlan(WgmmaTile(bn, wg, stages, group_m=8, max_blocks=sms, q4_staging=staging), split)
                else:
                    plan = GemmPlan(main=GemmTile(*fields), split_k=split)
                try:
                    if isinstance(plan, WgmmaQ4Plan):
                        check_rs_tile(plan.tile, ops, plan.split_k)
                    elif isinstance(plan, WgmmaPlan):
                        check_tile(plan.tile, ops, plan.split_k)
                    else:
                        check_plan(plan, ops)
                except Exception as err:  # noqa: BLE001 - a tile this shape cannot take: recorded
                    print(f"sweep {name} {_q4_name(plan)}: {err}", flush=True)
                    continue
                plans.append(plan)
        entries = []
        for plan in plans:
            fname = f"sweep_{name}_{_q4_name(plan).replace('/', '_').replace('-', '_')}"
            body = host_branch(ops.m > 0, gemm_body(ops, plan))
            funcs[fname] = with_kernels(func, body).with_attr("target", target).with_attr("global_symbol", fname)
            entries.append({"plan": _q4_name(plan), "function": fname})
        manifest["sweep"]["cases"][name] = entries
    return funcs


def _q4_name(plan: Any) -> str:
    from fuselight.device import require_device
    from fuselight.rules.gemm.wgmma import WgmmaPlan
    from fuselight.rules.gemm.wgmma_q4 import RS_PREFIX, WgmmaQ4Plan

    if isinstance(plan, WgmmaQ4Plan):
        t = plan.tile
        per_sm = t.max_blocks // require_device("sm_90").sms
        return f"{RS_PREFIX}t{t.block_t}f{t.block_f}s{t.stages}" + (f"b{per_sm}" if per_sm > 1 else "")
    if isinstance(plan, WgmmaPlan):
        t = plan.tile
        return f"wgmma-m{t.block_m}n{t.block_n}s{t.stages}q{t.q4_staging}" + (f"/sk{plan.split_k}" if plan.split_k > 1 else "")

    def tile(t: Any) -> str:
        return f"m{t.block_m}n{t.block_n}k{t.block_k}w{t.warps_m}x{t.warps_n}s{t.stages}"

    name = tile(plan.main) + (f"+{tile(plan.rest)}" if plan.rest is not None else "")
    return name + (f"/sk{plan.split_k}" if plan.split_k > 1 else "")


# ---- run --------------------------------------------------------------------------------------


def run(manifest_path: Path, out_json: Path, only: list[str] | None, ms: list[int] | None) -> None:
    import torch
    from fuselight.bench.timing import device_name, time_fn
    from fuselight.runtime import load_module

    root = manifest_path.parent
    manifest = json.loads(manifest_path.read_text())
    libs = {key: load_module(root / name)[0] for key, name in manifest["libraries"].items()}
    import tvm

    def to_tvm(t: Any) -> Any:
        return tensor_to_tvm(tvm, torch, t)

    results = {"device": device_name("cuda"), "torch": torch.__version__, "manifest": str(manifest_path), "cases": {}}
    rows = []
    for idx, (name, case) in enumerate(manifest["cases"].items()):
        if only and name not in only:
            continue
        dtype = case.get("dtype", "float16")
        tolerance = 1e-3 if dtype == "float16" else 8e-3
        results["cases"][name] = {"ranges": case["ranges"], "by_m": {}}
        for m in ms or manifest["m"]:
            wd = q4_weights(case, torch, seed=1234 + idx * 10007 + m)
            data = q4_tokens(case, wd, (1, m), torch)
            n, k = wd["n"], wd["k"]
            flop = 2 * m * n * k
            rec: dict[str, Any] = {"shape": {"m": m, "n": n, "k": k, "dtype": dtype, "group": case.get("group", 32),
                                             "epilogue": case.get("epilogue", "cast")}, "kernels": {}}

            def measure(label: str, fn: Any, out: Any | None, check: bool = True) -> None:
                entry: dict[str, Any] = {}
                try:
                    fn()
                    torch.cuda.synchronize()
                    if out is not None and check:
                        entry["rel_err"] = rel_error(out, data["ref"])
                        entry["correct"] = bool(entry["rel_err"] < tolerance)
                    st = time_fn(fn)
                    entry.update(median_us=st.median_us, p10_us=st.p10_us, p90_us=st.p90_us, n=st.n,
                                 tflops=flop / st.median_us / 1e6)
                except Exception as err:  # noqa: BLE001 - record and go on
                    entry["error"] = f"{type(err).__name__}: {err}"[:500]
                rec["kernels"][label] = entry

            def q4_kernel(lib_key: str) -> tuple[Any, Any]:
                out = torch.full((1, m, n), float("nan"), dtype=data["out_dtype"], device="cuda")
                args = kernel_args(case["params"], wd, data, out, tvm, torch)
                f = libs[lib_key + ("" if lib_key == "dlight" else case.get("suffix", ""))][case["function"]]
                return (lambda: f(*args)), out

            fn, out = q4_kernel("ours")
            measure("fuselight", fn, out)
            ours_out = out.clone()
            if "dlight_error" in case:
                rec["kernels"]["dlight"] = {"error": "build: " + case["dlight_error"]}
            else:
                fn, out = q4_kernel("dlight")
                measure("dlight", fn, out)
            if "error" not in rec["kernels"]["dlight"]:
                rec["kernels"]["dlight"]["rel_to_fuselight"] = rel_error(ours_out, out)
            # Our fp16 GEMM on the dequantized weight (its numerics: against the same reference, before the epilogue).
            w16 = wd["w"]
            x3 = data["x"].reshape(1, m, k)
            o16 = torch.full((1, m, n), float("nan"), dtype=w16.dtype, device="cuda")
            f16 = libs["fp16" + case.get("suffix", "")][case["fp16_function"]]
            a16 = [to_tvm(x3), to_tvm(w16), to_tvm(o16)]
            measure("fuselight_fp16_gemm", lambda: f16(*a16), o16, check=False)
            x2 = data["x"].reshape(m, k)
            measure("torch_fp16_linear", lambda: torch.nn.functional.linear(x2, w16), None)
            del wd, data, w16, o16, a16
            torch.cuda.empty_cache()
            ours, f16e = rec["kernels"]["fuselight"], rec["kernels"]["fuselight_fp16_gemm"]
            if "tflops" in ours and "tflops" in f16e:
                rec["ours_over_fp16_gemm"] = ours["tflops"] / f16e["tflops"]
            results["cases"][name]["by_m"][str(m)] = rec
            for lbl in ("fuselight", "dlight", "fuselight_fp16_gemm", "torch_fp16_linear"):
                e = rec["kernels"].get(lbl, {})
                rows.append((name, m, lbl, e.get("median_us"), e.get("tflops"), e.get("rel_err"), e.get("error"),
                             rec.get("ours_over_fp16_gemm") if lbl == "fuselight" else None))
            print(f"{name} m={m} done", file=sys.stderr, flush=True)
    print(f"{'case':<12} {'m':>5} {'kernel':<22} {'us':>9} {'TFLOP/s':>8} {'rel_err':>9} {'/fp16':>6}")
    for name, m, lbl, us, tf, err, error, ratio in rows:
        if error:
            print(f"{name:<12} {m:>5} {lbl:<22} error: {error[:80]}")
            continue
        print(f"{name:<12} {m:>5} {lbl:<22} {us:9.2f} {tf:8.1f} {'' if err is None else f'{err:9.2e}'}"
              f" {'' if ratio is None else f'{ratio:6.2f}'}")
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out_json}")


def run_sweep(manifest_path: Path, out_json: Path, only: list[str] | None, ms: list[int] | None,
              plans: list[str] | None = None) -> None:
    """Time every sweep plan (those whose names start with one of ``plans``, if given; checked
    against float64 first) at each M; the best plan per case and M."""
    import torch
    import tvm
    from fuselight.bench.timing import device_name, time_fn
    from fuselight.runtime import load_module

    root = manifest_path.parent
    manifest = json.loads(manifest_path.read_text())
    if "sweep" not in manifest.get("libraries", {}):
        raise SystemExit(f"{manifest_path}: built without the sweep")
    lib = load_module(root / manifest["libraries"]["sweep"])[0]
    fp16 = load_module(root / manifest["libraries"]["fp16"])[0]

    def to_tvm(t: Any) -> Any:
        return tensor_to_tvm(tvm, torch, t)

    results: dict[str, Any] = {"device": device_name("cuda"), "manifest": str(manifest_path), "cases": {}}
    lines = []
    for idx, (name, entries) in enumerate(manifest["sweep"]["cases"].items()):
        if only and name not in only:
            continue
        case = manifest["cases"][name]
        results["cases"][name] = {}
        for m in ms or manifest["sweep"]["m"]:
            wd = q4_weights(case, torch, seed=4321 + idx * 10007 + m)
            data = q4_tokens(case, wd, (1, m), torch)
            n, k = wd["n"], wd["k"]
            flop = 2 * m * n * k
            o16 = torch.empty((1, m, n), dtype=wd["w"].dtype, device="cuda")
            f16 = fp16[case["fp16_function"]]
            a16 = [to_tvm(data["x"].reshape(1, m, k)), to_tvm(wd["w"]), to_tvm(o16)]
            f16_us = time_fn(lambda: f16(*a16)).median_us
            rows = []
            for entry in entries:
                if plans and not entry["plan"].startswith(tuple(plans)):
                    continue
                out = torch.full((1, m, n), float("nan"), dtype=data["out_dtype"], device="cuda")
                args = kernel_args(case["params"], wd, data, out, tvm, torch)
                f = lib[entry["function"]]
                rec: dict[str, Any] = {"plan": entry["plan"]}
                try:
                    f(*args)
                    torch.cuda.synchronize()
                    rec["rel_err"] = rel_error(out, data["ref"])
                    rec["correct"] = bool(rec["rel_err"] < 1e-3)
                    st = time_fn(lambda: f(*args))
                    rec.update(median_us=st.median_us, tflops=flop / st.median_us / 1e6, over_fp16=f16_us / st.median_us)
                except Exception as err:  # noqa: BLE001 - record and go on
                    rec["error"] = f"{type(err).__name__}: {err}"[:300]
                rows.append(rec)
            ok = [r for r in rows if r.get("correct")]
            best = min(ok, key=lambda r: r["median_us"]) if ok else None
            results["cases"][name][str(m)] = {"fp16_gemm_us": f16_us, "plans": rows,
                                              "best": best["plan"] if best else None}
            for r in sorted(rows, key=lambda r: r.get("median_us", 1e30)):
                mark = "*" if best is r else " "
                if "error" in r:
                    lines.append(f"{name:<8} {m:>5} {r['plan']:<26} error: {r['error'][:70]}")
                else:
                    lines.append(f"{name:<8} {m:>5} {r['plan']:<26}{mark}{r['median_us']:9.2f} {r['tflops']:7.1f} "
                                 f"{r['over_fp16']:6.2f} {r['rel_err']:9.2e}{'' if r['correct'] else ' WRONG'}")
            del wd, data, o16, a16
            torch.cuda.empty_cache()
            print(f"sweep {name} m={m} done", file=sys.stderr, flush=True)
    print(f"{'case':<8} {'m':>5} {'plan':<26} {'us':>9} {'TFLOP/s':>7} {'/fp16':>6} {'rel_err':>9}   (* best correct)")
    print("\n".join(lines))
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out_json}")


def run_batch_decode(manifest_path: Path, out_json: Path, only: list[str] | None, ms: list[int] | None) -> None:
    """A batch-decode manifest's run (the module docstring): every kernel checked, then timed, with the anchors."""
    import torch
    import tvm
    from fuselight.bench.timing import device_name
    from fuselight.runtime import load_module

    manifest = json.loads(manifest_path.read_text())
    results: dict[str, Any] = {"device": device_name("cuda"), "torch": torch.__version__, "manifest": str(manifest_path),
                               "cases": {}}
    rows = []
    for idx, (name, case) in enumerate(manifest["cases"].items()):
        if only and name not in only:
            continue
        lib = load_module(manifest_path.parent / manifest["libraries"][name])[0]
        wd = q4_weights(case, torch, seed=2468 + idx)
        n, k = wd["n"], wd["k"]
        weight_bytes = n * k // 2 + n * (k // case.get("group", 32)) * 2  # packed words + scales
        anchor = int4pack_weight(n, k, torch)
        rec: dict[str, Any] = {"n": n, "k": k, "epilogue": case.get("epilogue", "cast"), "weight_bytes": weight_bytes, "m": {}}
        for m in ms or manifest["batch_decode"]["m"]:
            data = q4_tokens(case, wd, (m, 1), torch)
            ks: dict[str, Any] = {}
            for label, fname in [("shipped", case["shipped"])] + [(e["plan"], e["function"]) for e in case["rs"]]:
                out = torch.full((m, 1, n), float("nan"), dtype=data["out_dtype"], device="cuda")
                args = kernel_args(case["params"], wd, data, out, tvm, torch)
                f = lib[fname]
                ks[label] = measure_gemv(lambda f=f, args=args: f(*args), out, data["ref"], 1e-3, weight_bytes, torch)
                del out, args
            x2 = data["x"].reshape(m, k)
            ks["torch_fp16_linear"] = measure_gemv(lambda: torch.nn.functional.linear(x2, wd["w"]), None, None, 0.0,
                                                   weight_bytes, torch)
            ks["torch_int4pack_mm"] = measure_int4pack(anchor, x2, weight_bytes, torch)
            tiles = [(e["median_us"], p["plan"]) for p in case["rs"] if (e := ks[p["plan"]]).get("correct")]
            best = min(tiles, default=None)
            rec["m"][str(m)] = {"shape": {"n": n, "k": k, "m": m, "quantization": "q4f16_1"}, "kernels": ks,
                                "best_tile": best[1] if best else None}
            rows.append((name, m, ks, best))
            del data
        results["cases"][name] = rec
        del wd, anchor
        torch.cuda.empty_cache()
        print(f"{name} done", file=sys.stderr, flush=True)
    _batch_table(rows)
    bad = [(name, m, lbl, e.get("rel_err"), e.get("error")) for name, m, ks, _ in rows for lbl, e in ks.items()
           if "error" in e or e.get("correct") is False]
    for err in bad:
        print("NOT CORRECT / ERROR:", *err)
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out_json}")


def _batch_table(rows: list[tuple[str, int, dict[str, Any], tuple[float, str] | None]]) -> None:
    """Print the batch-decode run's table and, over its points, the geomean and minimum speedups over
    both anchors of the shipped kernel and of the faster of it and the best tile."""
    def us(e: dict[str, Any]) -> float | None:
        return e["median_us"] if "median_us" in e and e.get("correct", True) else None

    print(f"{'case':<8} {'M':>3} {'shipped':>8} {'best tile':<18} {'us':>8} {'tile/shp':>8} {'torch16':>8} {'int4pk':>8}"
          f" {'x16 shp':>7} {'x16 best':>8} {'xint4 best':>10}")
    ratios: dict[str, list[float]] = {"x16 shipped": [], "x16 best": [], "xint4 shipped": [], "xint4 best": []}
    for name, m, ks, best in rows:
        shipped, t16, i4 = us(ks["shipped"]), us(ks["torch_fp16_linear"]), us(ks["torch_int4pack_mm"])
        tile_us = best[0] if best else None
        fastest = min((t for t in (shipped, tile_us) if t is not None), default=None)

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}" if a is not None and b is not None else "-"
        for key, anchor, ours in (("x16 shipped", t16, shipped), ("x16 best", t16, fastest),
                                  ("xint4 shipped", i4, shipped), ("xint4 best", i4, fastest)):
            if anchor is not None and ours is not None:
                ratios[key].append(anchor / ours)
        print(f"{name:<8} {m:>3} {shipped or float('nan'):8.2f} {best[1] if best else '-':<18} {tile_us or float('nan'):8.2f}"
              f" {ratio(tile_us, shipped):>8} {t16 or float('nan'):8.2f} {i4 or float('nan'):8.2f} {ratio(t16, shipped):>7}"
              f" {ratio(t16, fastest):>8} {ratio(i4, fastest):>10}")
    for key, values in ratios.items():
        if values:
            gm = math.exp(sum(map(math.log, values)) / len(values))
            print(f"{key}: geomean x{gm:.2f}, min x{min(values):.2f} over {len(values)} points")


def main() -> None:
    def build_options(b: Any) -> None:
        b.add_argument("--small-m", action="store_true", help="sweep the weight-in-registers tiles at M up to 512 instead")
        b.add_argument("--batch-decode", action="store_true",
                       help="batch decode's M = 2..16 instead: token tiles of 16 and 32 against the GEMV buckets")

    ap, r = command_line(__doc__, "leave out the config sweep (sweep.so)", build_options)
    r.add_argument("--m", nargs="*", type=int)
    r.add_argument("--sweep", action="store_true", help="time the config sweep (sweep.so) instead")
    r.add_argument("--plans", nargs="*", help="with --sweep: only the plans whose names start with these (e.g. q4rs- wgmma-)")
    a = ap.parse_args()
    if a.cmd == "build" and a.batch_decode:
        build_batch_decode(a.out)
    elif a.cmd == "build":
        build(a.out, sweep=not a.no_sweep, small_m=a.small_m)
    elif "batch_decode" in json.loads(a.manifest.read_text()):
        run_batch_decode(a.manifest, a.output, a.cases, a.m)
    elif a.sweep:
        run_sweep(a.manifest, a.output, a.cases, a.m, a.plans)
    else:
        run(a.manifest, a.output, a.cases, a.m)


if __name__ == "__main__":
    main()
