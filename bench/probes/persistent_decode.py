"""Probe: a decode layer's GEMV stages as one persistent kernel with grid barriers vs the shipped kernels one after another.

Two halves, one file:

  build (CPU host, full TVM + nvcc; from the project root):
      python3 bench/probes/persistent_decode.py build .build/persist
  writes ``persistent.so`` (TVM's fuselight pipeline with programmatic launch, as sm_90 builds launch
  kernels) holding, for each case, (a) the chain: each stage's function scheduled by the shipped Gemv
  rule, as the model gets it, and (b) the persistent kernel (``rules/gemm/gemv_persistent.py``) for a
  few plans (``PLANS``), its AOT cubins, and ``manifest.json`` (the cases, the functions' parameters,
  which buffers feed which, each plan's grid and ptxas registers).

  run (GPU host, runtime-only TVM):
      python3 bench/probes/persistent_decode.py run .build/persist/manifest.json -o persistent.json [--cases ...]
  for each case, L = ``LAYERS`` layers of distinct random weights (std 1 / sqrt(fan-in); q4f16_1:
  those quantized) and inputs (never zeros): checks layer 0's outputs (h1, act, h2, qkv) of the chain
  and of every plan against a float64 reference of the block (``reference``; max and norm-wise
  relative error), and that two launches of a persistent kernel in a row give identical outputs (its
  barrier resets itself); then times the L layers (``fuselight.bench.timing``: L2 flushed before each
  timed sequence, medians), launched from Python one by one and, where TVM's stream can be set to
  torch's, replayed as one CUDA graph (the chain's small kernels may be host-bound from Python).
  Before it launches a persistent kernel it compares the kernel's grid with what the GPU holds at once
  (the driver's occupancy query on the kernel's cubin, blocks an SM x the SM count): a larger grid
  would deadlock at the first barrier, so such a plan is refused (recorded, not run). Prints a table
  last (us a layer, persistent / chain) and writes JSON.

Cases: a layer's stages after its attention (``fuselight.layer_prim_funcs.decode_layer``), ``mlp``
(o_proj + residual, RMSNorm + gate_up + SiLU-mul, down + residual) and ``mlp_qkv`` (and the next
layer's RMSNorm + QKV), at SmolLM2-135M, Llama-3.2-1B and Llama-3-8B shapes in fp16, Llama-3-8B also
in q4f16_1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

LAYERS = 8  # layers of distinct weights a timed sequence runs (Llama-3-8B fp16: 3.5 GB, past L2)
EPS = 1e-5
# model -> (hidden, intermediate, qkv width): qkv = (heads + 2 kv heads) x head dim
MODELS = {
    "smollm2-135m": (576, 1536, (9 + 2 * 3) * 64),
    "llama-3.2-1b": (2048, 8192, (32 + 2 * 8) * 64),
    "llama-3-8b": (4096, 14336, (32 + 2 * 8) * 128),
}
SCHEMES = {"smollm2-135m": (None,), "llama-3.2-1b": (None,), "llama-3-8b": (None, "q4f16_1")}
FORMS = {"mlp": False, "mlp_qkv": True}  # form -> with the next layer's QKV
# Persistent plans tried (``gemv_persistent.PersistentConfig`` fields), by weights; the first of each
# is the config's (``configs/gemm/gemv_persistent.json``, analytic: for q4 the one of 8 warps, since
# 16 warps a block cap ptxas at 128 registers, and the q4 mlp kernel then spills 24 bytes).
PLANS = {
    "float": [None,
              dict(blocks_per_sm=1, warps=8, rows_per_warp=1, unroll=4, double_buffer=True),
              dict(blocks_per_sm=2, warps=8, rows_per_warp=1, unroll=4, double_buffer=True),
              dict(blocks_per_sm=2, warps=4, rows_per_warp=2, unroll=4, double_buffer=True),
              dict(blocks_per_sm=1, warps=16, rows_per_warp=2, unroll=2, double_buffer=True)],
    "q4": [None,
           dict(blocks_per_sm=1, warps=16, rows_per_warp=2, unroll=2, double_buffer=True, half_sums=True),
           dict(blocks_per_sm=2, warps=8, rows_per_warp=2, unroll=2, double_buffer=True, half_sums=True),
           dict(blocks_per_sm=2, warps=4, rows_per_warp=2, unroll=4, double_buffer=True, half_sums=True),
           dict(blocks_per_sm=1, warps=16, rows_per_warp=1, unroll=4, double_buffer=True, half_sums=True)],
}
ARCH = "sm_90"
NAMES = ("h1", "act", "h2", "qkv")  # the stages' outputs


def case_names() -> dict[str, dict[str, Any]]:
    """name -> case: every model x its schemes x form."""
    cases = {}
    for model, (hidden, inter, qkv) in MODELS.items():
        for scheme in SCHEMES[model]:
            for form, next_qkv in FORMS.items():
                cases[f"{model}-{scheme or 'fp16'}-{form}"] = dict(
                    model=model, hidden=hidden, intermediate=inter, qkv=qkv, scheme=scheme, form=form,
                    stages=4 if next_qkv else 3, eps=EPS)
    return cases


def stage_dims(case: dict[str, Any]) -> list[tuple[int, int]]:
    """(N, K) of each stage's weight."""
    h, i = case["hidden"], case["intermediate"]
    return [(h, h), (2 * i, h), (h, i), (case["qkv"], h)][:case["stages"]]


def plan_name(plan: dict[str, Any]) -> str:
    return (f"b{plan['blocks_per_sm']}_w{plan['warps']}_r{plan['rows_per_warp']}_u{plan['unroll']}"
            + ("_db" if plan.get("double_buffer") else "") + ("_hs" if plan.get("half_sums") else ""))


# ---- build ------------------------------------------------------------------------------------


def build(out: Path, only: list[str] | None) -> None:
    import dataclasses

    import tvm
    from fuselight import tir_pipeline
    from fuselight.compile import library_metadata
    from fuselight.device import require_device
    from fuselight.layer_prim_funcs import decode_layer
    from fuselight.library import write_library
    from fuselight.rules.gemm import gemv_persistent as gp
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemv import Gemv
    from fuselight.target import resolve, to_tvm

    spec = resolve("cuda", ARCH)
    target = to_tvm(spec)
    sms = require_device(ARCH).sms
    funcs_out: dict[str, Any] = {}
    manifest: dict[str, Any] = {"arch": ARCH, "sms": sms, "layers": LAYERS, "cases": {}}
    t0 = time.time()
    for name, case in case_names().items():
        if only and name not in only:
            continue
        funcs, feeds = decode_layer(case["hidden"], case["intermediate"], case["qkv"], case["eps"],
                                    scheme=case["scheme"], next_qkv=case["stages"] == 4)
        entry = {**case, "params": [[p.name for p in f.params] for f in funcs],
                 "feeds": [[i, p, j, q] for (i, p), (j, q) in feeds.items()], "chain": [], "persistent": {}}
        for i, func in enumerate(funcs):  # (a) the shipped rule's kernel of each stage
            sch = Gemv().apply(func.with_attr("target", target), target, False)
            if sch is None:
                raise SystemExit(f"{name}: the Gemv rule does not take stage {i}")
            fname = f"{name}__stage{i}".replace("-", "_").replace(".", "_")
            funcs_out[fname] = sch.mod["main"].with_attr("global_symbol", fname)
            entry["chain"].append(fname)
        linked = gp.link(funcs, feeds)
        ops = [analyze_matmul(f, prologue=True, dequant=True).operands for f in linked]
        weights = "float" if case["scheme"] is None else "q4"
        for fields in PLANS[weights]:  # (b) the persistent kernel, a few plans
            plan = gp.load_persistent_config(ARCH, weights) if fields is None else gp.PersistentConfig(**fields)
            vname = plan_name(dataclasses.asdict(plan))
            if vname in entry["persistent"]:
                continue  # (the config's plan is also one of the list's)
            fname = f"{name}__persistent_{vname}".replace("-", "_").replace(".", "_")
            stages = [(o, gp.stage_config(plan, o)) for o in ops]
            try:
                body = gp.persistent_body(stages, ARCH, fname)
            except Exception as err:  # noqa: BLE001 - a plan the guard refuses is recorded
                entry["persistent"][vname] = {"plan": dataclasses.asdict(plan), "refused": str(err)}
                continue
            funcs_out[fname] = gp.kernel_func(linked, body, fname)
            entry["persistent"][vname] = {
                "function": fname, "plan": dataclasses.asdict(plan), "shipped": fields is None,
                "grid": sms * plan.blocks_per_sm, "threads": plan.warps * 32,
                "shared_bytes": gp.shared_bytes(stages),
                # each kernel parameter as (stage, parameter name) of the unlinked functions
                "args": [_origin(p, linked, funcs) for p in funcs_out[fname].params]}
        manifest["cases"][name] = entry
        print(f"{name}: {len(entry['persistent'])} plans, {time.time() - t0:.0f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    mod = tvm.IRModule({k: f.with_attr("target", target) for k, f in funcs_out.items()})
    lib = tvm.compile(mod, target=target, tir_pipeline=tir_pipeline.register(every_kernel=True))
    meta = library_metadata(spec, "fuselight", "fuselight rows template (chain) vs gemv_persistent", probe="persistent_decode")
    write_library(lib, out / "persistent.so", meta, spec)
    print(f"persistent.so: {len(funcs_out)} functions, {time.time() - t0:.0f} s", flush=True)
    # ptxas's registers of every kernel, for the run's occupancy fallback and the record.
    regs = ptxas_registers(lib, ARCH)
    for entry in manifest["cases"].values():
        for v in entry["persistent"].values():
            if "function" in v:
                v.update(regs.get(v["function"] + "_kernel", {}))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out}/manifest.json; {total / 2**20:.1f} MiB under {out}")


def ptxas_registers(lib: Any, arch: str) -> dict[str, dict[str, int]]:
    """ptxas's registers and spill stores of every kernel of the compiled module ``lib`` for ``arch``
    (its CUDA compiled once more with ``--resource-usage``); empty without nvcc."""
    import subprocess
    import tempfile

    from fuselight.cuda_compile import TVM_FLAGS, gencode, nvcc_path
    from fuselight.library import cuda_sources

    if nvcc_path() is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.cu")
        src.write_text("\n".join(cuda_sources(lib)))
        proc = subprocess.run([nvcc_path(), "-O3", "-cubin", f"-gencode={gencode(arch)}", *TVM_FLAGS, "--use_fast_math",
                               "--resource-usage", "-o", str(Path(tmp, "k.cubin")), str(src)],
                              capture_output=True, text=True)
    return parse_registers(proc.stderr + proc.stdout)


def _origin(param: Any, linked: list[Any], funcs: list[Any]) -> list[Any]:
    """(stage, parameter name) of the first function whose linked parameter ``param`` is."""
    for i, f in enumerate(linked):
        for j, p in enumerate(f.params):
            if p.same_as(param):
                return [i, funcs[i].params[j].name]
    raise SystemExit(f"parameter {param.name} of no stage")


def parse_registers(report: str) -> dict[str, dict[str, int]]:
    """ptxas's registers and spill stores (bytes) of each kernel in a ``--resource-usage`` report."""
    found: dict[str, dict[str, int]] = {}
    current = None
    for line in report.splitlines():
        if "Compiling entry function" in line:
            current = line.split("'")[1]
            found[current] = {}
        elif current and "bytes spill stores" in line:
            found[current]["spill_stores"] = int(line.split("bytes spill stores")[0].split(",")[-1].split()[-1])
        elif current and "Used" in line and "registers" in line:
            found[current]["registers"] = int(line.split("Used")[1].split("registers")[0])
    return found


# ---- the reference ------------------------------------------------------------------------------


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + eps) * w


def reference(layer: dict[str, np.ndarray], eps: float, stages: int) -> dict[str, np.ndarray]:
    """The block's outputs in float64 from a layer's inputs (``x`` the attention's output, ``h`` the
    residual stream, ``wo``, ``wgu``, ``wd``, ``wqkv`` the [N, K] weights as the functions compute them,
    ``norm2``, ``norm1`` the norms' weights), each stage rounded to fp16 where the function stores or
    casts (its outputs, the normed rows, the matmul before an add), and reading the rounded outputs
    of the stages before, as the kernels do."""
    f = {k: v.astype(np.float64).reshape(v.shape[-2:] if v.ndim >= 2 and k.startswith("w") else -1)
         for k, v in layer.items()}
    h1 = _f16(_f16(f["wo"] @ f["x"]) + f["h"])
    gu = _f16(f["wgu"] @ _f16(_rms_norm(h1, f["norm2"], eps)))
    gate, up = gu[: gu.size // 2], gu[gu.size // 2:]
    act = _f16(gate / (1 + np.exp(-gate)) * up)
    h2 = _f16(_f16(f["wd"] @ act) + h1)
    out = {"h1": h1, "act": act, "h2": h2}
    if stages == 4:
        out["qkv"] = _f16(f["wqkv"] @ _f16(_rms_norm(h2, f["norm1"], eps)))
    return out


def errors(out: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Max and norm-wise relative error of ``out`` against ``ref`` (float64, flattened)."""
    out, ref = out.astype(np.float64).reshape(-1), ref.astype(np.float64).reshape(-1)
    return {"max_rel": float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))),
            "rel": float(np.linalg.norm(out - ref) / np.linalg.norm(ref))}


# fp16 outputs of float32 sums: the output's rounding (~3e-4 rms) and a last-bit difference of an
# input propagated through a norm and a matmul stay well below this (norm-wise).
TOLERANCE = 5e-3


# ---- run --------------------------------------------------------------------------------------


STAGE_WEIGHTS = ("wo", "wgu", "wd", "wqkv")
STAGE_NORMS = (None, "norm2", None, "norm1")


def layer_tensors(case: dict[str, Any], torch: Any, gen: Any, device: str = "cuda") -> tuple[dict[tuple[int, str], Any], dict[str, Any]]:
    """One layer's random tensors by (stage, parameter name) of the unlinked functions (outputs NaN),
    the linked ones shared (``feeds``), and the dense weights and inputs ``reference`` reads."""
    from fuselight.quantization import SCHEMES, dequantize_torch, quantize_torch

    scheme = SCHEMES[case["scheme"]] if case["scheme"] else None
    feeds = {(i, p): (j, q) for i, p, j, q in case["feeds"]}
    tensors: dict[tuple[int, str], Any] = {}
    dense: dict[str, Any] = {}
    for i, ((n, k), params) in enumerate(zip(stage_dims(case), case["params"])):
        weight_params = [p for p in params[:-1] if p not in ("x", "residual", "norm_weight")]
        w = (torch.randn((n, k), device=device, generator=gen) / math.sqrt(k)).half()
        stored = (w,) if scheme is None else quantize_torch(w, scheme)
        dense[STAGE_WEIGHTS[i]] = w if scheme is None else dequantize_torch(stored, scheme)
        for p, t in zip(weight_params, stored):
            tensors[(i, p)] = t
        if "norm_weight" in params:
            tensors[(i, "norm_weight")] = (1 + 0.1 * torch.randn((k,), device=device, generator=gen)).half()
            dense[STAGE_NORMS[i]] = tensors[(i, "norm_weight")]
        for p in ("x", "residual"):
            if p in params and (i, p) not in feeds:
                tensors[(i, p)] = torch.randn((1, 1, k if p == "x" else n), device=device, generator=gen).half()
        tensors[(i, params[-1])] = torch.full((1, 1, n // 2 if i == 1 else n), float("nan"), device=device,
                                              dtype=torch.float16)
    for (i, p), (j, q) in feeds.items():
        tensors[(i, p)] = tensors[(j, q)]
    dense["x"], dense["h"] = tensors[(0, "x")], tensors[(0, "residual")]
    return tensors, dense


def outputs(case: dict[str, Any], tensors: dict[tuple[int, str], Any]) -> dict[str, Any]:
    return {NAMES[i]: tensors[(i, params[-1])] for i, params in enumerate(case["params"])}


def max_active_blocks(cubins: list[Path], kernel: str, threads: int) -> int | None:
    """The driver's occupancy query (blocks an SM) for ``kernel`` in one of the fatbins ``cubins``
    (loaded into torch's current context); None where the driver API is not reachable."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for path in cubins:
        data = path.read_bytes()
        mod, fn, n = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()
        if cuda.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(data)) != 0:
            continue
        try:
            if cuda.cuModuleGetFunction(ctypes.byref(fn), mod, kernel.encode()) == 0:
                if cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), fn, threads, ctypes.c_size_t(0)) == 0:
                    return n.value
        finally:
            cuda.cuModuleUnload(mod)
    return None


def wait_or_abort(torch: Any, seconds: float, what: str, results: dict[str, Any], out_json: Path) -> None:
    """Wait for the GPU; a kernel still running after ``seconds`` (a barrier that never returns) ends
    the run with the results so far written (the process cannot cancel the kernel)."""
    import os

    done = torch.cuda.Event()
    done.record()
    start = time.time()
    while not done.query():
        if time.time() - start > seconds:
            results["aborted"] = f"{what} did not finish in {seconds} s (a grid barrier that never returns?)"
            out_json.write_text(json.dumps(results, indent=1) + "\n")
            print(results["aborted"], file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.01)


def graph_of(fn: Any, torch: Any, tvm_ffi: Any) -> Any:
    """``fn`` captured as a CUDA graph, TVM's launches on the capturing stream."""
    dev = tvm_ffi.device("cuda", 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), tvm_ffi.use_raw_stream(dev, side.cuda_stream):
        fn()  # warm up on the side stream, as torch's capture wants
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with tvm_ffi.use_raw_stream(dev, torch.cuda.current_stream().cuda_stream):
            fn()
    return graph


def run(manifest_path: Path, out_json: Path, only: list[str] | None) -> None:
    import torch
    from fuselight.bench.timing import device_name
    from fuselight.runtime import load_module, read_metadata

    manifest = json.loads(manifest_path.read_text())
    lib_path = manifest_path.parent / "persistent.so"
    lib = load_module(lib_path)[0]
    meta = read_metadata(lib_path)
    cubins = [Path(str(lib_path) + ".cuda") / f for f in meta.get("cuda_sources", {}).values()]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results: dict[str, Any] = {"device": device_name("cuda"), "sms": sms, "manifest": str(manifest_path),
                               "layers": manifest["layers"], "torch": torch.__version__, "cases": {}}
    if sms != manifest["sms"]:
        print(f"this GPU has {sms} SMs, the kernels were built for {manifest['sms']}", flush=True)
    for idx, (name, case) in enumerate(manifest["cases"].items()):
        if only and name not in only:
            continue
        results["cases"][name] = run_case(name, case, idx, lib, cubins, results, out_json)
        torch.cuda.empty_cache()
        print(f"{name} done", file=sys.stderr, flush=True)
        out_json.write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out_json}")


def run_case(name: str, case: dict[str, Any], idx: int, lib: Any, cubins: list[Path], results: dict[str, Any],
             out_json: Path) -> dict[str, Any]:
    """One case on the GPU (see the module docstring): the chain, then each persistent plan the GPU
    holds at once; ``idx`` seeds its inputs."""
    import torch
    import tvm_ffi
    from fuselight.bench.kernels_run import tensor_to_tvm
    from fuselight.bench.timing import time_fn

    import tvm

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(1000 + idx)
    layers = [layer_tensors(case, torch, gen) for _ in range(results["layers"])]
    tvm_layers = [{key: tensor_to_tvm(tvm, torch, t) for key, t in tensors.items()} for tensors, _ in layers]
    ref = reference({k: v.double().cpu().numpy() for k, v in layers[0][1].items()}, case["eps"], case["stages"])
    rec: dict[str, Any] = {k: case[k] for k in ("model", "scheme", "form", "hidden", "intermediate", "qkv", "stages")}

    def check() -> dict[str, Any]:
        got = {k: v.double().cpu().numpy() for k, v in outputs(case, layers[0][0]).items()}
        errs = {k: errors(got[k], ref[k]) for k in ref}
        return {"errors": errs, "correct": all(e["rel"] < TOLERANCE for e in errs.values())}

    def reset_outputs() -> None:
        for tensors, _ in layers:
            for t in outputs(case, tensors).values():
                t.fill_(float("nan"))

    # (a) the chain: the stages' kernels one after another, every layer.
    chain = [lib[f] for f in case["chain"]]
    chain_calls = [(chain[i], [tl[(i, p)] for p in params]) for tl in tvm_layers
                   for i, params in enumerate(case["params"])]

    def run_chain() -> None:
        for f, args in chain_calls:
            f(*args)

    reset_outputs()
    for f, args in chain_calls[:case["stages"]]:  # layer 0's
        f(*args)
    wait_or_abort(torch, 30, f"{name} chain", results, out_json)
    rec["chain"] = check()
    chain_out = {k: v.clone() for k, v in outputs(case, layers[0][0]).items()}
    rec["chain"]["eager"] = _timed(run_chain, time_fn)
    rec["chain"]["graph"] = _graphed(run_chain, time_fn, torch, tvm_ffi)
    # (b) the persistent kernel, each plan the GPU holds at once.
    rec["persistent"] = {}
    for vname, v in case["persistent"].items():
        if "function" not in v:
            rec["persistent"][vname] = {"refused": v["refused"]}
            continue
        entry: dict[str, Any] = {"plan": v["plan"], "grid": v["grid"], "registers": v.get("registers"),
                                 "spill_stores": v.get("spill_stores")}
        per_sm = max_active_blocks(cubins, v["function"] + "_kernel", v["threads"])
        entry["resident_blocks_per_sm"] = per_sm
        regs_per_sm = getattr(props, "regs_per_multiprocessor", None)
        if per_sm is None and v.get("registers") and regs_per_sm:  # no driver API: ptxas's registers
            per_sm = min(props.max_threads_per_multi_processor // v["threads"],
                         regs_per_sm // (v["registers"] * v["threads"]))
            entry["resident_blocks_per_sm"], entry["occupancy_from"] = per_sm, "registers"
        if per_sm is None or v["grid"] > per_sm * sms:
            entry["refused"] = f"grid {v['grid']} > {per_sm} blocks an SM x {sms} SMs: not resident at once"
            rec["persistent"][vname] = entry
            continue
        kern = lib[v["function"]]
        calls = [[tl[tuple(a)] for a in v["args"]] for tl in tvm_layers]

        def run_persistent(kern: Any = kern, calls: list = calls) -> None:
            for args in calls:
                kern(*args)

        reset_outputs()
        kern(*calls[0])
        wait_or_abort(torch, 30, f"{name} {vname}", results, out_json)
        entry.update(check())
        first = {k: t.clone() for k, t in outputs(case, layers[0][0]).items()}
        kern(*calls[0])  # again: the barrier left as the first launch found it
        wait_or_abort(torch, 30, f"{name} {vname} (second launch)", results, out_json)
        entry["repeat_identical"] = all(torch.equal(first[k], t) for k, t in outputs(case, layers[0][0]).items())
        entry["max_abs_vs_chain"] = max(float((first[k].double() - chain_out[k].double()).abs().max()) for k in first)
        entry["eager"] = _timed(run_persistent, time_fn)
        entry["graph"] = _graphed(run_persistent, time_fn, torch, tvm_ffi)
        rec["persistent"][vname] = entry
    return rec


def _timed(fn: Any, time_fn: Any) -> dict[str, Any]:
    """Median us of ``fn`` (the L layers), and a layer's share."""
    try:
        st = time_fn(fn)
    except Exception as err:  # noqa: BLE001 - record and go on
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    return {"median_us": st.median_us, "p10_us": st.p10_us, "p90_us": st.p90_us, "n": st.n}


def _graphed(fn: Any, time_fn: Any, torch: Any, tvm_ffi: Any) -> dict[str, Any]:
    try:
        graph = graph_of(fn, torch, tvm_ffi)
    except Exception as err:  # noqa: BLE001 - no capture: the eager times stand (host-bound caveat)
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    return _timed(graph.replay, time_fn)


def per_layer(entry: dict[str, Any], mode: str, layers: int) -> float | None:
    t = entry.get(mode, {})
    return t["median_us"] / layers if "median_us" in t else None


def print_table(results: dict[str, Any]) -> None:
    """us a layer of the chain and the best correct persistent plan, eager and graph-replayed."""
    layers = results["layers"]
    print(f"{'case':<30} {'mode':<6} {'chain':>8} {'persist':>8} {'ratio':>6}  best plan, max rel err (chain / persistent)")
    for name, rec in results["cases"].items():
        for mode in ("eager", "graph"):
            chain = per_layer(rec["chain"], mode, layers)
            good = [(per_layer(e, mode, layers), v) for v, e in rec["persistent"].items()
                    if e.get("correct") and e.get("repeat_identical") and per_layer(e, mode, layers) is not None]
            best = min(good, default=(None, None), key=lambda t: t[0])
            err_c = max(e["max_rel"] for e in rec["chain"]["errors"].values())
            err_p = (max(e["max_rel"] for e in rec["persistent"][best[1]]["errors"].values()) if best[1] else float("nan"))
            ratio = f"{best[0] / chain:6.3f}" if best[0] and chain else f"{'':>6}"
            cells = " ".join(f"{x:8.2f}" if x is not None else f"{'-':>8}" for x in (chain, best[0]))
            print(f"{name:<30} {mode:<6} {cells} {ratio}  {best[1] or '-'}, {err_c:.1e} / {err_p:.1e}")
    bad = [(n, v) for n, rec in results["cases"].items() for v, e in rec["persistent"].items()
           if "correct" in e and not (e["correct"] and e.get("repeat_identical"))]
    for n, v in bad:
        print("NOT CORRECT or not repeatable:", n, v)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--cases", nargs="*", help=f"of {', '.join(case_names())}")
    r = sub.add_parser("run")
    r.add_argument("manifest", type=Path)
    r.add_argument("-o", "--output", type=Path, required=True)
    r.add_argument("--cases", nargs="*")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        build(a.out, a.cases)
    else:
        run(a.manifest, a.output, a.cases)


if __name__ == "__main__":
    main()
