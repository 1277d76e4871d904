"""Probe: the quantized (q4f16_1) decode GEMVs, fuselight's kernel vs DLight's, on Llama-3-8B shapes.

Two halves, one file:

  build (CPU host, full TVM + nvcc; from the project root, fuselight's rules importable):
      python3 bench/probes/q4_gemv.py build .build/q4_gemv [--no-sweep]
  writes ``ours.so`` (the Gemv rule's kernel of each case with the shipped config, plus a sweep of
  row-template configs), ``dlight.so`` (DLight's schedule of the same PrimFuncs, as MLC-LLM builds
  them), their AOT cubins and ``manifest.json``.

  run (GPU host, runtime-only TVM: ``source .gpu/setup.sh`` first):
      python3 bench/probes/q4_gemv.py run .build/q4_gemv/manifest.json -o q4_gemv.json [--cases qkv ...]
  fills random packed words, scales and tokens (never zeros), checks every kernel against a float64
  reference of the function (the weight dequantized as the function computes it, in fp16/bf16, then
  the product in float64; relative error of the whole output), and times each kernel, DLight's,
  torch's fp16 matmul of the same weight and ``torch.ops.aten._weight_int4pack_mm`` (tinygemm, bf16)
  with L2 flushed between calls (``fuselight.bench.timing``: medians). Prints a table and writes JSON.

The cases are MLC-LLM's decode functions (``fuselight.quant_prim_funcs.q4_linear``): dequantize in two
stages, NT_matmul accumulating in float32, the cast epilogue (o_proj and down also the residual add,
the LM head the second cast to float32 and a symbolic vocabulary, run at 128256).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

COPY_RATE_GBPS = 3000.0  # H100 device-to-device copy (bytes read + written), shared/device/README.md
TARGET = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
          "thread_warp_size": 32}

# name -> q4_linear arguments (n None: symbolic, run at ``vocab``)
CASES: dict[str, dict[str, Any]] = {
    "qkv": dict(n=6144, k=4096),
    "o_proj": dict(n=4096, k=4096, epilogue="residual"),
    "gate_up": dict(n=28672, k=4096),
    "down": dict(n=4096, k=14336, epilogue="residual"),
    "lm_head": dict(n=None, k=4096, epilogue="cast_fp32", vocab=128256),
    "o_proj_bf16": dict(n=4096, k=4096, dtype="bfloat16"),
    "o_proj_g128": dict(n=4096, k=4096, group=128),
}
SWEPT = ("qkv", "o_proj", "gate_up", "down", "lm_head")
# Row-template configs tried besides the shipped one: (warps, rows_per_warp, unroll, min_blocks_per_sm).
SWEEP = [
    (4, 1, 4, 4), (4, 2, 4, 4), (4, 4, 4, 4), (4, 2, 8, 4),
    (8, 1, 4, 2), (8, 1, 8, 2), (8, 2, 4, 2), (8, 2, 8, 2), (8, 4, 4, 2),
    (16, 1, 4, 1), (16, 2, 4, 1), (16, 1, 8, 1),
]


def _args(case: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in case.items() if k != "vocab"}


# ---- build ------------------------------------------------------------------------------------


def build(out: Path, sweep: bool) -> None:
    import tvm
    from fuselight.compile import library_metadata, write_library
    from fuselight.quant_prim_funcs import q4_linear
    from fuselight.rules import dlight_defaults
    from fuselight.rules.base import with_kernels
    from fuselight.rules.gemm import gemv
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemv import Gemv, gemv_config
    from fuselight.runtime import cuda_sources
    from fuselight.target import resolve
    from tvm.s_tir import dlight as dl

    spec = resolve("cuda", "sm_90")
    target = tvm.target.Target(dict(TARGET, host={"kind": "llvm"}))
    assert {k: str(v) for k, v in TARGET.items()}.items() <= {k: str(v) for k, v in spec.options.items()}.items(), spec.options
    ours, base, manifest = {}, {}, {"cases": {}, "target": TARGET}
    for name, case in CASES.items():
        func = q4_linear(**_args(case)).with_attr("target", target)
        sch = Gemv().apply(func, target, False)
        if sch is None:
            raise SystemExit(f"{name}: the Gemv rule does not take it")
        ops = analyze_matmul(func, dequant=True).operands
        cfg = gemv_config(ops, 1, target)
        ours[name] = sch.mod["main"].with_attr("global_symbol", name)
        variants = {}
        if sweep and name in SWEPT:
            for w, r, u, b in SWEEP:
                c = gemv.GemvConfig(max_m=1, warps=w, unroll=u, min_blocks_per_sm=b, rows_per_warp=r)
                if (w, r, u, b) == (cfg.warps, cfg.rows_per_warp, cfg.unroll, cfg.min_blocks_per_sm):
                    continue
                vname = f"{name}__w{w}_r{r}_u{u}_b{b}"
                ours[vname] = with_kernels(func, gemv.gemv_body(ops, c)).with_attr("global_symbol", vname)
                variants[vname] = {"warps": w, "rows_per_warp": r, "unroll": u, "min_blocks_per_sm": b}
        base[name] = func.with_attr("global_symbol", name)
        manifest["cases"][name] = {
            **case, "function": name, "params": [p.name for p in func.params],
            "config": {"warps": cfg.warps, "rows_per_warp": cfg.rows_per_warp, "unroll": cfg.unroll,
                       "min_blocks_per_sm": cfg.min_blocks_per_sm},
            "variants": variants,
        }
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with target:
        base_mod = dl.ApplyDefaultSchedule(*dlight_defaults(target))(tvm.IRModule(base))
    for fname, mod in (("ours.so", tvm.IRModule(ours)), ("dlight.so", base_mod)):
        lib = tvm.compile(mod, target=target)
        meta = library_metadata(spec, "fuselight" if fname == "ours.so" else "dlight", "dlight (MLC-LLM's GPU rules)",
                                probe="q4_gemv")
        write_library(lib, out / fname, meta, spec)
        (out / fname.replace(".so", ".cu")).write_text("\n".join(cuda_sources(lib)))  # to read, and ptxas -v
        print(f"{fname}: {len(mod.functions)} functions, {time.time() - t0:.0f} s", flush=True)
    manifest["libraries"] = {"ours": "ours.so", "dlight": "dlight.so"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out}/manifest.json")


# ---- run --------------------------------------------------------------------------------------


def _data(case: dict[str, Any], torch: Any, seed: int) -> dict[str, Any]:
    """Random inputs (never zeros), the float64 reference and the fp16 weight for torch."""
    n, k = case["n"] or case["vocab"], case["k"]
    dtype = getattr(torch, case.get("dtype", "float16"))
    group = case.get("group", 32)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=g)
    scale = (torch.rand((n, k // group), device="cuda", generator=g) * 0.018 + 0.002).to(dtype)
    x = (torch.randn((1, 1, k), device="cuda", generator=g)).to(dtype)
    shifts = torch.arange(0, 32, 4, device="cuda", dtype=torch.int32)
    values = ((q[:, :, None] >> shifts) & 15).reshape(n, k)  # element e of a word in bits 4e..4e+3
    # The function's weight: (dtype(e) - dtype(7)) * scale, each op rounded in dtype (torch rounds
    # half/bfloat16 arithmetic once per op, as the CUDA of the dequantize does).
    w = (values.to(dtype) - torch.tensor(7, dtype=dtype, device="cuda")) * scale.repeat_interleave(group, dim=1)
    ref = (x.reshape(1, k).double() @ w.double().T).reshape(1, 1, n)
    data = {"q": q.view(torch.uint32), "scale": scale, "x": x, "w": w, "ref": ref, "n": n, "k": k}
    epilogue = case.get("epilogue", "cast")
    if epilogue == "residual":
        r = torch.randn((1, 1, n), device="cuda", generator=g).to(dtype)
        data["r"] = r
        data["ref"] = ref.to(dtype).double() + r.double()  # cast, then the add in dtype (ref: exact add)
    out_dtype = torch.float32 if epilogue == "cast_fp32" else dtype
    data["out_dtype"] = out_dtype
    return data


def _rel(out: Any, ref: Any) -> float:
    out, ref = out.double().reshape(-1), ref.double().reshape(-1)
    return float((out - ref).norm() / ref.norm())


def run(manifest_path: Path, out_json: Path, only: list[str] | None) -> None:
    import torch
    from fuselight.bench.timing import device_name, time_fn
    from fuselight.runtime import load_module

    root = manifest_path.parent
    manifest = json.loads(manifest_path.read_text())
    libs = {key: load_module(root / name)[0] for key, name in manifest["libraries"].items()}
    import tvm

    def to_tvm(t: Any) -> Any:
        if t.dtype == torch.uint32:
            try:
                return tvm.runtime.from_dlpack(t)
            except Exception:  # noqa: BLE001 - a torch without uint32 DLPack: same bits as int32
                return tvm.runtime.from_dlpack(t.view(torch.int32))._create_view(tuple(t.shape), "uint32")
        return tvm.runtime.from_dlpack(t)

    def tvm_args(case: dict[str, Any], data: dict[str, Any], out: Any) -> list[Any]:
        by_name = {"q_weight": data["q"], "q_scale": data["scale"], "x": data["x"], "r": data.get("r")}
        tensors = [by_name[p] for p in case["params"][:-1]] + [out]
        return [to_tvm(t) for t in tensors]

    results = {"device": device_name("cuda"), "torch": torch.__version__, "manifest": str(manifest_path),
               "copy_rate_gbps": COPY_RATE_GBPS, "cases": {}}
    rows = []
    for idx, (name, case) in enumerate(manifest["cases"].items()):
        if only and name not in only:
            continue
        data = _data(case, torch, seed=1234 + idx)
        n, k = data["n"], data["k"]
        group = case.get("group", 32)
        weight_bytes = n * k // 2 + n * (k // group) * 2  # packed words + scales
        # The output's rounding dominates (float32 sums): fp16 ~1.5e-4, bf16 ~1.2e-3 relative (rms).
        tolerance = 1e-3 if case.get("dtype", "float16") == "float16" else 8e-3
        rec: dict[str, Any] = {"n": n, "k": k, "dtype": case.get("dtype", "float16"), "group": group,
                               "epilogue": case.get("epilogue", "cast"), "weight_bytes": weight_bytes,
                               "shape": {"n": n, "k": k, "m": 1, "quantization": "q4f16_1" if case.get("dtype", "float16") == "float16" else "q4bf16_1"},
                               "config": case["config"], "kernels": {}}

        def measure(label: str, fn: Any, out: Any | None) -> None:
            entry: dict[str, Any] = {}
            try:
                fn()
                torch.cuda.synchronize()
                if out is not None:
                    entry["rel_err"] = _rel(out, data["ref"])
                    entry["correct"] = bool(entry["rel_err"] < tolerance)
                st = time_fn(fn)
                entry.update(median_us=st.median_us, p10_us=st.p10_us, p90_us=st.p90_us, n=st.n,
                             gbps=weight_bytes / st.median_us / 1e3)
                entry["copy_rate_pct"] = 100 * entry["gbps"] / COPY_RATE_GBPS
            except Exception as err:  # noqa: BLE001 - record and go on
                entry["error"] = f"{type(err).__name__}: {err}"[:500]
            rec["kernels"][label] = entry

        def tvm_kernel(lib_key: str, fname: str) -> tuple[Any, Any]:
            out = torch.full((1, 1, n), float("nan"), dtype=data["out_dtype"], device="cuda")
            f = libs[lib_key][fname]
            args = tvm_args(case, data, out)
            return (lambda: f(*args)), out

        fn, out = tvm_kernel("ours", case["function"])
        measure("fuselight", fn, out)
        ours_out = out.clone()
        fn, out = tvm_kernel("dlight", case["function"])
        measure("dlight", fn, out)
        if "error" not in rec["kernels"]["dlight"]:
            rec["kernels"]["dlight"]["rel_to_fuselight"] = _rel(ours_out, out)
        for vname, vcfg in case.get("variants", {}).items():
            fn, out = tvm_kernel("ours", vname)
            measure(vname, fn, out)
            rec["kernels"][vname]["config"] = vcfg
        # Anchors: torch's fp16 matmul of the dequantized weight, tinygemm's int4 matmul (bf16).
        w16 = data["w"]
        x2 = data["x"].reshape(1, k)
        measure("torch_fp16_linear", lambda: torch.nn.functional.linear(x2, w16), None)
        try:
            packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            w4 = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
            sz = torch.rand((k // 32, n, 2), device="cuda").to(torch.bfloat16) + 0.01
            xb = x2.to(torch.bfloat16)
            measure("torch_int4pack_mm", lambda: torch.ops.aten._weight_int4pack_mm(xb, w4, 32, sz), None)
            rec["kernels"]["torch_int4pack_mm"]["note"] = "tinygemm, bf16 tokens, group 32 (timing only)"
        except Exception as err:  # noqa: BLE001
            rec["kernels"]["torch_int4pack_mm"] = {"error": f"{type(err).__name__}: {err}"[:300]}
        del data, w16
        torch.cuda.empty_cache()
        results["cases"][name] = rec
        best = min(((lbl, e["median_us"]) for lbl, e in rec["kernels"].items()
                    if lbl.startswith(name + "__") and e.get("correct")), key=lambda t: t[1], default=(None, None))
        for lbl in ("fuselight", "dlight", "torch_fp16_linear", "torch_int4pack_mm"):
            e = rec["kernels"].get(lbl, {})
            rows.append((name, lbl, e.get("median_us"), e.get("copy_rate_pct"), e.get("rel_err"), e.get("error")))
        if best[0]:
            e = rec["kernels"][best[0]]
            rows.append((name, best[0].split("__")[1] + " (best sweep)", e["median_us"], e["copy_rate_pct"], e["rel_err"], None))
        print(f"{name} done", file=sys.stderr, flush=True)
    print(f"{'case':<13} {'kernel':<26} {'us':>9} {'%copy':>7} {'rel_err':>9}")
    for name, lbl, us, pct, err, error in rows:
        if error:
            print(f"{name:<13} {lbl:<26} error: {error[:80]}")
            continue
        print(f"{name:<13} {lbl:<26} {us:9.2f} {pct:7.1f} {'' if err is None else f'{err:9.2e}'}")
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out_json}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--no-sweep", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("manifest", type=Path)
    r.add_argument("-o", "--output", type=Path, required=True)
    r.add_argument("--cases", nargs="*")
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.out, not a.no_sweep)
    else:
        run(a.manifest, a.output, a.cases)


if __name__ == "__main__":
    main()
