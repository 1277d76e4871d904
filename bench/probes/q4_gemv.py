"""Probe: the quantized (q4f16_1) GEMVs of decode and batch decode, fuselight's kernels vs DLight's, on Llama-3-8B shapes.

Two halves, one file:

  build (CPU host, full TVM + nvcc; from the project root, fuselight's rules importable):
      python3 bench/probes/q4_gemv.py build .build/q4_gemv [--no-sweep]
  writes ``ours.so`` (the Gemv rule's kernels of each case: the decode function, M = 1 static, and
  the batch-decode function, M symbolic, with the shipped configs; plus the configs of ``SWEEP`` at
  M = 1, 2, 4, 8 and 16, and the shipped bucket at each static M), ``dlight.so`` (DLight's schedules of the same
  PrimFuncs as MLC-LLM builds them: its GEMV rule for M = 1, LowBatchGemvSpecialize's LowBatchGEMV
  buckets for the batch), their AOT cubins, CUDA sources and ``manifest.json``.

  run (GPU host, runtime-only TVM: the TVM runtime on PYTHONPATH, TVM_USE_RUNTIME_LIB=1):
      python3 bench/probes/q4_gemv.py run .build/q4_gemv/manifest.json -o q4_gemv.json [--cases qkv ...] [--ms 1 16]
  fills random packed words, scales and tokens (never zeros), checks every kernel against a float64
  reference of the function (the weight dequantized as the function computes it, in fp16/bf16, then
  the product in float64; relative error of the whole output), and times each kernel at each M of
  ``MS``, DLight's, torch's fp16 matmul of the same weight and ``torch.ops.aten._weight_int4pack_mm``
  (tinygemm, bf16) with L2 flushed between calls (``fuselight.bench.timing``: medians). Prints a
  table, each M's variants against the shipped kernel (``summary``), and writes JSON.

The cases are MLC-LLM's functions (``fuselight.quant_prim_funcs.q4_linear``): dequantize in two
stages, NT_matmul accumulating in float32, the cast epilogue (o_proj and down also the residual add,
the LM head the second cast to float32 and a symbolic vocabulary, run at 128256).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

# beside this script (its folder is on sys.path)
from q4_common import (CASES, TARGET, chosen_cases, command_line, gemv_target, int4pack_weight, kernel_args, linear_args,
                       measure_gemv, measure_int4pack, open_gemv_run, q4_tokens, q4_weights, write_gemv_libraries)

# Token rows timed: decode (1) and batch decode up to the GEMV buckets' 16.
MS = (1, 2, 3, 4, 5, 7, 8, 11, 13, 16)

SWEPT = ("qkv", "o_proj", "gate_up", "down", "lm_head")
# Configs tried besides the shipped ones, by M (``GemvConfig`` fields beside max_m). M = 1: the row
# template's shipped settings of both M = 1 buckets (K up to 4096, and above: double-buffered), then
# with a grid of resident blocks looping over the column groups (``grid_blocks_per_sm``: no partial
# last wave, the token row staged once a block, double buffering across groups), and with fp16 partial
# sums (``half_sums``: fewer instructions a weight). M = 2..16: the mma
# template with 2, 4 or 8 row tiles a block (``row_tiles``: the token rows read from L2 once per
# tiles, not once per 16 weight rows).
_ROWS = {"warps": 8, "rows_per_warp": 2}
_MMA = {"warps": 8, "unroll": 1, "lane_run": 1}
SWEEP: dict[int, list[dict[str, Any]]] = {
    1: [{**_ROWS, "unroll": 4, "min_blocks_per_sm": 3},
        {**_ROWS, "unroll": 2, "min_blocks_per_sm": 2, "double_buffer": True},
        {**_ROWS, "unroll": 4, "min_blocks_per_sm": 2, "grid_blocks_per_sm": 2},
        {**_ROWS, "unroll": 4, "min_blocks_per_sm": 3, "grid_blocks_per_sm": 3},
        {**_ROWS, "unroll": 2, "min_blocks_per_sm": 2, "grid_blocks_per_sm": 2, "double_buffer": True},
        {**_ROWS, "unroll": 4, "min_blocks_per_sm": 2, "grid_blocks_per_sm": 2, "double_buffer": True},
        {**_ROWS, "unroll": 2, "min_blocks_per_sm": 3, "grid_blocks_per_sm": 3, "double_buffer": True},
        {**_ROWS, "warps": 4, "unroll": 2, "min_blocks_per_sm": 4, "grid_blocks_per_sm": 4, "double_buffer": True},
        {**_ROWS, "unroll": 4, "min_blocks_per_sm": 3, "half_sums": True},
        {**_ROWS, "unroll": 2, "min_blocks_per_sm": 2, "double_buffer": True, "half_sums": True},
        {**_ROWS, "unroll": 2, "min_blocks_per_sm": 2, "grid_blocks_per_sm": 2, "double_buffer": True, "half_sums": True}],
    **{m: [{**_MMA, "min_blocks_per_sm": 2, "row_tiles": 2},
           {**_MMA, "min_blocks_per_sm": 2 if m <= 8 else 1, "row_tiles": 4},
           {**_MMA, "warps": 4, "min_blocks_per_sm": 4 if m <= 8 else 2, "row_tiles": 4},
           {**_MMA, "unroll": 2, "min_blocks_per_sm": 2 if m <= 8 else 1, "row_tiles": 2},
           {**_MMA, "min_blocks_per_sm": 1, "row_tiles": 8}] for m in (2, 4, 8, 16)},
}
# The fields that make a variant (the rest pick the bucket).
_FIELDS = ("warps", "rows_per_warp", "unroll", "min_blocks_per_sm", "lane_run", "double_buffer", "prefetch_l2_percent",
           "grid_blocks_per_sm", "half_sums", "row_tiles")


def _cfg_dict(cfg: Any) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in _FIELDS}


def _vname(cfg: Any) -> str:
    c = cfg
    name = (f"w{c.warps}_r{c.rows_per_warp}_u{c.unroll}_b{c.min_blocks_per_sm}" if c.rows_per_warp is not None
            else f"mma_w{c.warps}_u{c.unroll}_b{c.min_blocks_per_sm}_l{c.lane_run}")
    return (name + ("_db" if c.double_buffer else "") + (f"_g{c.grid_blocks_per_sm}" if c.grid_blocks_per_sm else "")
            + ("_hs" if c.half_sums else "") + (f"_t{c.row_tiles}" if c.row_tiles > 1 else ""))


# ---- build ------------------------------------------------------------------------------------


# DLight's batch-decode schedules (MLC-LLM's LowBatchGemvSpecialize), by the largest M each serves.
DLIGHT_BATCH = (("lb2", 2), ("lb4", 8), ("gemm", None))


def _dlight_batch(func: Any, target: Any) -> dict[str, tuple[Any, str]]:
    """DLight's schedules of a batch-decode function as MLC-LLM's LowBatchGemvSpecialize picks them:
    LowBatchGEMV(2) for M <= 2, LowBatchGEMV(4) for M <= 8, its Matmul above (``DLIGHT_BATCH``), as
    separate functions (the run picks one by M, as the pass's host branch would); where a rule fails
    on the function (Matmul's tensor-core path asserts on the fp32-accumulating form with a cast; the
    low-batch rule takes no symbolic vocabulary), the first of LowBatchGEMV(4), GEMV, Fallback that
    applies instead. Returns key -> (scheduled function, the rule used)."""
    import tvm
    import tvm_ffi
    from tvm.s_tir import dlight as dl

    def sched(*rules: Any) -> tuple[Any, str]:
        for rule in rules:
            try:
                with target:
                    out = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({"main": func}))["main"]
            except Exception:  # noqa: BLE001 - the rule fails on this function
                continue
            if not tvm_ffi.structural_equal(out, func):
                return out, type(rule).__name__ + (f"({rule.bucket})" if hasattr(rule, "bucket") else "")
        raise SystemExit("no DLight rule schedules the batch function")

    rest = (dl.gpu.LowBatchGEMV(4), dl.gpu.GEMV(), dl.gpu.Fallback())
    return {"lb2": sched(dl.gpu.LowBatchGEMV(2), *rest), "lb4": sched(*rest), "gemm": sched(dl.gpu.Matmul(), *rest)}


def gemv_rule_kernel(func: Any, target: Any, fname: str) -> Any:
    """``func`` as the Gemv rule schedules it with the shipped configs (a static M: its bucket; a
    symbolic M: every bucket behind host branches on M), named ``fname``."""
    from fuselight.rules.gemv import Gemv

    sch = Gemv().apply(func, target, False)
    if sch is None:
        raise SystemExit(f"{fname}: the Gemv rule does not take it")
    return sch.mod["main"].with_attr("global_symbol", fname)


def build(out: Path, sweep: bool) -> None:
    from fuselight.device import require_device
    from fuselight.quant_prim_funcs import q4_linear
    from fuselight.rules.base import with_kernels
    from fuselight.rules.gemm import gemv
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemv import gemv_config, symbolic_m_buckets

    _, target = gemv_target()
    sms = require_device(TARGET["arch"]).sms
    ours, base, base_batch, manifest = {}, {}, {}, {"cases": {}, "target": TARGET, "ms": list(MS)}
    for name, case in CASES.items():
        entry: dict[str, Any] = {**case, "functions": {"decode": f"{name}__m1", "batch": f"{name}__batch"}, "variants": {}}
        funcs = {m: q4_linear(**linear_args(case), m=m).with_attr("target", target) for m in (1, None)}
        for m, fname in ((1, f"{name}__m1"), (None, f"{name}__batch")):
            ours[fname] = gemv_rule_kernel(funcs[m], target, fname)
        entry["params"] = [p.name for p in funcs[1].params]
        ops1 = analyze_matmul(funcs[1], dequant=True).operands
        entry["config"] = _cfg_dict(gemv_config(ops1, 1, target))
        ops_b = analyze_matmul(funcs[None], dequant=True).operands
        entry["batch_buckets"] = {str(top): _cfg_dict(c) for top, c in symbolic_m_buckets(ops_b, target)}
        if sweep and name in SWEPT:
            for m, configs in SWEEP.items():
                f = funcs[1] if m == 1 else q4_linear(**linear_args(case), m=m).with_attr("target", target)
                ops = analyze_matmul(f, dequant=True).operands
                shipped = gemv_config(ops, m, target)
                for fields in configs:
                    c = gemv.GemvConfig(max_m=m, **fields)
                    if _cfg_dict(c) == _cfg_dict(shipped):
                        continue
                    vname = f"{name}__m{m}__{_vname(c)}"
                    ours[vname] = with_kernels(f, gemv.gemv_body(ops, c, sms)).with_attr("global_symbol", vname)
                    entry["variants"].setdefault(str(m), {})[vname] = _cfg_dict(c)
                if m != 1:  # the shipped bucket at this static M, for reference beside the sweep
                    vname = f"{name}__m{m}__shipped"
                    ours[vname] = with_kernels(f, gemv.gemv_body(ops, shipped, sms)).with_attr("global_symbol", vname)
                    entry["variants"][str(m)][vname] = _cfg_dict(shipped)
        base[f"{name}__m1"] = funcs[1].with_attr("global_symbol", f"{name}__m1")
        entry["dlight_batch"] = {}
        for key, (f, rule) in _dlight_batch(funcs[None], target).items():
            base_batch[f"{name}__batch_{key}"] = f.with_attr("global_symbol", f"{name}__batch_{key}")
            entry["dlight_batch"][key] = {"function": f"{name}__batch_{key}", "rule": rule}
        manifest["cases"][name] = entry
    write_gemv_libraries(out, "q4_gemv", ours, base, manifest, scheduled_base=base_batch, sources=True)


# ---- run --------------------------------------------------------------------------------------


def run(manifest_path: Path, out_json: Path, only: list[str] | None, ms: list[int] | None) -> None:
    import torch

    manifest, libs, results = open_gemv_run(manifest_path, torch)
    import tvm

    rows = []
    for idx, name, case in chosen_cases(manifest, only):
        wd = q4_weights(case, torch, seed=1234 + idx)
        n, k = wd["n"], wd["k"]
        group = case.get("group", 32)
        weight_bytes = n * k // 2 + n * (k // group) * 2  # packed words + scales
        # The output's rounding dominates (float32 sums): fp16 ~1.5e-4, bf16 ~1.2e-3 relative (rms).
        tolerance = 1e-3 if case.get("dtype", "float16") == "float16" else 8e-3
        quant = "q4f16_1" if case.get("dtype", "float16") == "float16" else "q4bf16_1"
        rec: dict[str, Any] = {"n": n, "k": k, "dtype": case.get("dtype", "float16"), "group": group,
                               "epilogue": case.get("epilogue", "cast"), "weight_bytes": weight_bytes,
                               "config": case["config"], "batch_buckets": case.get("batch_buckets"),
                               "dlight_batch": case.get("dlight_batch"), "m": {}}
        w4 = int4pack_weight(n, k, torch)  # tinygemm's packed weight (timing only)
        for m in ms or manifest.get("ms", [1]):
            data = q4_tokens(case, wd, (m, 1), torch)
            mrec: dict[str, Any] = {"shape": {"n": n, "k": k, "m": m, "quantization": quant}, "kernels": {}}

            def measure(label: str, fn: Any, out: Any | None) -> None:
                mrec["kernels"][label] = measure_gemv(fn, out, data["ref"], tolerance, weight_bytes, torch)

            def tvm_kernel(lib_key: str, fname: str) -> tuple[Any, Any]:
                out = torch.full((m, 1, n), float("nan"), dtype=data["out_dtype"], device="cuda")
                f = libs[lib_key][fname]
                args = kernel_args(case["params"], wd, data, out, tvm, torch)
                return (lambda: f(*args)), out

            kinds = [("fuselight", "batch"), ("dlight", "batch")]
            if m == 1:
                kinds = [("fuselight_decode", "decode"), ("dlight_decode", "decode")] + kinds
            dl_key = next(key for key, top in DLIGHT_BATCH if top is None or m <= top)
            for label, fkey in kinds:
                if label == "dlight":  # the batch schedule LowBatchGemvSpecialize's branch picks at this M
                    fn, out = tvm_kernel("dlight", case["dlight_batch"][dl_key]["function"])
                else:
                    fn, out = tvm_kernel("ours" if label.startswith("fuselight") else "dlight", case["functions"][fkey])
                measure(label, fn, out)
            if "dlight" in mrec["kernels"]:
                mrec["kernels"]["dlight"]["rule"] = case["dlight_batch"][dl_key]["rule"]
            for vname, vcfg in case.get("variants", {}).get(str(m), {}).items():
                fn, out = tvm_kernel("ours", vname)
                measure(vname.split("__")[-1], fn, out)
                mrec["kernels"][vname.split("__")[-1]]["config"] = vcfg
            # Anchors: torch's fp16 matmul of the dequantized weight, tinygemm's int4 matmul (bf16).
            x2 = data["x"].reshape(m, k)
            measure("torch_fp16_linear", lambda: torch.nn.functional.linear(x2, wd["w"]), None)
            mrec["kernels"]["torch_int4pack_mm"] = measure_int4pack(w4, x2, weight_bytes, torch)
            rec["m"][str(m)] = mrec
            ks = mrec["kernels"]
            best = min(((lbl, e["median_us"]) for lbl, e in ks.items() if lbl.startswith(("w", "mma_", "shipped"))
                        and e.get("correct")), key=lambda t: t[1], default=(None, None))
            rows.append((name, m, *(ks.get(lbl, {}) for lbl in
                         ("fuselight_decode", "fuselight", "dlight_decode", "dlight", "torch_fp16_linear", "torch_int4pack_mm")),
                         best[0], best[1]))
            del data
        del wd, w4
        torch.cuda.empty_cache()
        results["cases"][name] = rec
        print(f"{name} done", file=sys.stderr, flush=True)

    def cell(e: dict[str, Any]) -> str:
        if not e:
            return f"{'':>9}"
        if "error" in e:
            return f"{'error':>9}"
        bad = "" if e.get("correct", True) else "!"
        return f"{e['median_us']:8.2f}{bad or ' '}"

    print(f"{'case':<12} {'M':>3} {'ours dec':>9} {'ours':>9} {'DL dec':>9} {'DLight':>9} {'torch16':>9} {'int4pk':>9}  "
          f"{'%copy':>6}  best sweep (%copy, x torch16)")
    for name, m, *cells, best, best_us in rows:
        ours = cells[0] if m == 1 else cells[1]
        pct = f"{ours['copy_rate_pct']:6.1f}" if "copy_rate_pct" in ours else f"{'':>6}"
        best_e = results["cases"][name]["m"][str(m)]["kernels"].get(best, {})
        t16 = cells[4].get("median_us")
        sweep = (f"{best} {best_us:.2f} ({best_e['copy_rate_pct']:.1f}%, x{t16 / best_us:.2f})" if best and t16 else "")
        print(f"{name:<12} {m:>3} " + " ".join(cell(c) for c in cells) + f"  {pct}  {sweep}")
    summary(results)
    errs = [(name, m, lbl, e.get("rel_err"), e.get("error")) for name, rec in results["cases"].items()
            for m, mrec in rec["m"].items() for lbl, e in mrec["kernels"].items()
            if "error" in e or e.get("correct") is False]
    for err in errs:
        print("NOT CORRECT / ERROR:", *err)
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out_json}")


def _us(e: dict[str, Any]) -> float | None:
    return e["median_us"] if "median_us" in e and e.get("correct", True) else None


def summary(results: dict[str, Any]) -> None:
    """Print, from a run's results: for each M, each variant's time against the shipped kernel's
    (geomean over the cases, and the worst case; M = 1 the decode function's, else the static-M
    ``shipped`` entry), best first; and the shipped kernel's and each point's best speedup over
    torch's fp16 matmul at M = 2..16 (geomean, minimum)."""
    by_m: dict[int, dict[str, list[float]]] = {}
    vs_torch: dict[str, list[float]] = {"shipped": [], "best": []}
    for rec in results["cases"].values():
        for m_key, mrec in rec["m"].items():
            ks, m = mrec["kernels"], int(m_key)
            shipped = _us(ks.get("fuselight_decode" if m == 1 else "shipped", {}))
            if shipped is None:
                continue
            times = {lbl: _us(e) for lbl, e in ks.items() if lbl.startswith(("w", "mma_"))}
            for lbl, us in times.items():
                if us is not None:
                    by_m.setdefault(m, {}).setdefault(lbl, []).append(us / shipped)
            t16 = _us(ks.get("torch_fp16_linear", {}))
            if m > 1 and t16 is not None:
                vs_torch["shipped"].append(t16 / shipped)
                vs_torch["best"].append(t16 / min([shipped, *(us for us in times.values() if us is not None)]))
    n_cases = len(results["cases"])
    for m, labels in sorted(by_m.items()):
        print(f"M = {m}: variant / shipped, geomean (worst) over the cases")
        ranked = sorted(((math.exp(sum(map(math.log, r)) / len(r)), max(r), lbl, len(r)) for lbl, r in labels.items()))
        for gm, worst, lbl, count in ranked:
            note = "" if count == n_cases else f"  ({count} of {n_cases} cases)"
            print(f"  {lbl:<28} {gm:6.3f} ({worst:.3f}){note}")
    for key, ratios in vs_torch.items():
        if ratios:
            gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
            print(f"M = 2..16, {key} vs torch fp16: geomean x{gm:.2f}, min x{min(ratios):.2f} over {len(ratios)} points")


def main() -> None:
    ap, r = command_line(__doc__, "leave out the config sweep")
    r.add_argument("--ms", nargs="*", type=int, help=f"token rows to time (default: the manifest's, {MS})")
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.out, not a.no_sweep)
    else:
        run(a.manifest, a.output, a.cases, a.ms)


if __name__ == "__main__":
    main()
