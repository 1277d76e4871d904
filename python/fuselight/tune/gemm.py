"""Measure the GEMM plans on the GPU and turn the timings into the dispatch table and a dataset.

``build`` (build host) compiles, for each LLaMA weight shape of the kernel suite, one function per
candidate plan of ``rules.gemm.estimate`` (the wgmma tiles, and every mma.sync tile with every
split-K; no rest tiles: their gain is left to the estimate) over a symbolic M. ``run`` (GPU host)
checks every plan at every M of the dispatch grid against PyTorch and times it, L2 flushed, and
writes a dataset: the device, the versions, and one row per (shape, M, plan) with the plan's tile
parameters and its median time (the form of ``configs/gemm/measured-<arch>.json``, which the cost
model of ``tune.cost_model`` learns from). ``table`` picks the fastest plan per M, merges
neighbours into ranges as the dispatcher does, and reports how close the analytic function's
choices come to the measured best (the ratio of their measured times), so both stay measurable;
with ``write`` it stores the ranges as the ``measured`` entries of ``configs/gemm/dispatch.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from ..errors import FuselightError
from ..jsonfile import read_json_object
from ..paths import config_dir

SUITE = "gemm_tune"
MANIFEST_NAME = "manifest.json"
DTYPE = "float16"


def matmul_prim_func(n: int, k: int, dtype: str, m: int | None = None) -> Any:
    """``out[1, m, n] = cast(x[1, m, k] @ w[n, k]^T)`` with fp32 accumulation, as our LLaMA's linear
    layers reach the rules; M symbolic (``seq_len``) unless given."""
    from tvm.script import tirx as T

    # fmt: off
    @T.macro
    def linear(A, W, O, C, rows):
        for i0, i1, i2, kk in T.grid(T.int64(1), rows, T.int64(n), T.int64(k)):
            with T.sblock("NT_matmul"):
                v0, v1, v2, vk = T.axis.remap("SSSR", [i0, i1, i2, kk])
                with T.init():
                    C[v0, v1, v2] = T.float32(0)
                C[v0, v1, v2] = C[v0, v1, v2] + T.Cast("float32", A[v0, v1, vk]) * T.Cast("float32", W[v2, vk])
        for i0, i1, i2 in T.grid(T.int64(1), rows, T.int64(n)):
            with T.sblock("cast"):
                v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
                O[v0, v1, v2] = T.Cast(dtype, C[v0, v1, v2])

    @T.prim_func(private=True, s_tir=True)
    def dynamic(a: T.handle, w: T.Buffer((T.int64(n), T.int64(k)), dtype), o: T.handle):
        seq_len = T.int64()
        A = T.match_buffer(a, (T.int64(1), seq_len, T.int64(k)), dtype)
        O = T.match_buffer(o, (T.int64(1), seq_len, T.int64(n)), dtype)
        C = T.sblock_alloc_buffer((T.int64(1), seq_len, T.int64(n)))
        linear(A, w, O, C, seq_len)

    @T.prim_func(private=True, s_tir=True)
    def static(A: T.Buffer((T.int64(1), T.int64(m or 1), T.int64(k)), dtype),
               w: T.Buffer((T.int64(n), T.int64(k)), dtype),
               O: T.Buffer((T.int64(1), T.int64(m or 1), T.int64(n)), dtype)):
        C = T.sblock_alloc_buffer((T.int64(1), T.int64(m or 1), T.int64(n)))
        linear(A, w, O, C, T.int64(m or 1))
    # fmt: on
    return dynamic if m is None else static


def _plans(ops: Any, d: Any) -> list[Any]:
    """The plans timed: every candidate but those with a rest tile (the estimate prices those)."""
    from fuselight.rules.gemm.estimate import candidates

    return [p for p in candidates(ops, d) if getattr(p, "rest", None) is None]


def plan_record(plan: Any, name: str) -> dict[str, Any]:
    """What a dataset row says about a plan: its table name, template and tile parameters (of the
    main tile for mma.sync; ``rest_block_m`` 0 when it has no rest tile)."""
    from fuselight.rules.gemm.wgmma import BLOCK_K, WgmmaPlan

    if isinstance(plan, WgmmaPlan):
        tile = plan.tile
        return {"plan": name, "template": "wgmma", "block_m": tile.block_m, "block_n": tile.block_n,
                "block_k": BLOCK_K, "threads": tile.threads, "stages": tile.stages, "split_k": plan.split_k,
                "rest_block_m": 0}
    tile = plan.main
    return {"plan": name, "template": "mma_sync", "block_m": tile.block_m, "block_n": tile.block_n,
            "block_k": tile.block_k, "threads": tile.threads, "stages": tile.stages, "split_k": plan.split_k,
            "rest_block_m": plan.rest.block_m if plan.rest is not None else 0}


def _shapes() -> list[tuple[int, int]]:
    from ..bench.kernels import load_suite

    return [(c.dims["n"], c.dims["k"]) for c in load_suite("full") if c.op == "gemm"]


def build(
    out_dir: Path,
    arch: str = "sm_90",
    shapes: list[tuple[int, int]] | None = None,
    m_grid: list[int] | None = None,
    plans: list[str] | None = None,
) -> Path:
    """Compile every candidate plan for each shape into ``out_dir``; returns the manifest path.

    m_grid: the M values ``run`` measures (default: the dispatch grid); plans: only the candidates
    of these table names (default: all), e.g. to re-measure one M range among its likely winners.
    """
    import tvm
    from fuselight.rules.gemm import gemm_body
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemm.estimate import load_dispatch, plan_name

    from ..compile import library_metadata
    from ..library import git_commit, write_library
    from ..target import resolve, to_tvm

    spec = resolve("cuda", arch)
    target = to_tvm(spec)
    d = load_dispatch(arch)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    libraries = {}
    for n, k in shapes or _shapes():
        start = time.perf_counter()
        funcs, records = {}, {}
        chosen = [p for p in _plans(analyze_matmul(matmul_prim_func(n, k, DTYPE)).operands, d)
                  if plans is None or plan_name(p, d) in plans]
        for i, plan in enumerate(chosen):
            func = matmul_prim_func(n, k, DTYPE)  # fresh buffers for each kernel
            ops = analyze_matmul(func).operands
            body = gemm_body(ops, plan)
            name = f"plan{i}"
            funcs[name] = tvm.tirx.PrimFunc(func.params, body, func.ret_type, func.attrs).with_attr(
                "global_symbol", name
            )
            records[name] = plan_record(plan, plan_name(plan, d))
        lib = tvm.compile(tvm.IRModule(funcs), target=target)
        file = f"gemm-{n}x{k}.so"
        write_library(lib, out_dir / file, library_metadata(spec, "fuselight", "none"), spec)
        libraries[f"{n}x{k}"] = {"library": file, "plans": records}
        print(f"{n}x{k}: {len(records)} plans in {time.perf_counter() - start:.0f} s", flush=True)
    manifest = out_dir / MANIFEST_NAME
    manifest.write_text(json.dumps({"suite": SUITE, "arch": arch, "dtype": DTYPE, "m_grid": list(m_grid or d.m_grid),
                                    "versions": {"tvm": tvm.__version__, "git_commit": git_commit()},
                                    "libraries": libraries}, indent=1))
    return manifest


def run(manifest: Path, out_json: Path) -> dict[str, Any]:
    """Check and time every plan at every M on the GPU; write the dataset to ``out_json`` and return it."""
    from ..bench import bench_config
    from ..bench.kernels_run import relative_error
    from ..bench.timing import device_name, time_fn
    from ..runtime import init_tvm, load_module

    manifest = Path(manifest)
    raw = read_json_object(manifest, missing=f"gemm tuning manifest not found: {manifest}")
    if raw.get("suite") != SUITE:
        raise FuselightError(f"{manifest}: not a {SUITE} manifest")
    tvm = init_tvm()
    import torch

    dev = torch.device("cuda:0")
    gen = torch.Generator(device=dev).manual_seed(bench_config()["seed"])
    tolerance = bench_config()["relerr_tolerance"][raw["dtype"]]
    grid = [int(m) for m in raw["m_grid"]]
    rows: list[dict[str, Any]] = []
    reference: list[dict[str, Any]] = []
    failures = []
    for shape, entry in raw["libraries"].items():
        n, k = (int(x) for x in shape.split("x"))
        lib = load_module(manifest.parent / entry["library"], "cuda")[0]
        a = torch.randn((1, max(grid), k), generator=gen, device=dev).to(torch.float16)
        w = (torch.randn((n, k), generator=gen, device=dev) * k**-0.5).to(torch.float16)
        out = torch.empty((1, max(grid), n), dtype=torch.float16, device=dev)
        for m in grid:
            a_m, out_m = a[:, :m], out[:, :m]  # leading rows: contiguous, same (aligned) base
            ref = (a_m[0].double() @ w.double().T)
            args = [tvm.runtime.from_dlpack(x) for x in (a_m, w, out_m)]
            timed = []
            for name, record in entry["plans"].items():
                func = lib[name]
                out_m.fill_(float("nan"))
                func(*args)
                torch.cuda.synchronize()
                err = relative_error(torch, out_m[0], ref)
                if not err <= tolerance:
                    failures.append(f"{shape} m={m} {record['plan']}: error {err:.1e}")
                    continue
                median = time_fn(lambda f=func: f(*args), device="cuda").median_us
                timed.append({"n": n, "k": k, "m": m, **record, "median_us": round(median, 3)})
            torch_us = round(time_fn(lambda: torch.matmul(a_m, w.T), device="cuda").median_us, 3)
            reference.append({"n": n, "k": k, "m": m, "median_us": torch_us})
            rows += timed
            best = min(timed, key=lambda r: r["median_us"], default=None)
            if best is not None:
                print(f"{shape} m={m}: best {best['plan']} {best['median_us']:.1f} us, torch {torch_us:.1f} us",
                      flush=True)
    versions = {**raw.get("versions", {}), "torch": torch.__version__}
    result = {"suite": SUITE, "arch": raw.get("arch"), "dtype": raw["dtype"], "device": device_name("cuda"),
              "versions": versions, "rows": rows, "torch": reference, "failures": failures}
    write_dataset(result, Path(out_json))
    for failure in failures:
        print(f"MISMATCH {failure}")
    return result


DATASET_DOC = (
    "Measured GEMM plan times ('fuselight tune gemm-run'): the device and versions they were taken with; "
    "'rows': one per (n, k, m, plan): the plan's table name (rules/gemm/estimate.py plan_name), template "
    "(wgmma or mma_sync), tile (block_m, block_n, block_k, threads, stages; mma.sync: the main tile), split_k, "
    "rest_block_m (0: no rest tile) and the median microseconds, L2 flushed; 'torch': torch.matmul at the "
    "same shapes. The learned cost model (python/fuselight/tune/cost_model.py) trains on the rows."
)


def write_dataset(dataset: dict[str, Any], path: Path) -> None:
    """Write ``dataset`` with one row a line (readable diffs of a re-measured dataset)."""
    head = {"_doc": DATASET_DOC, **{k: v for k, v in dataset.items() if k not in ("_doc", "rows", "torch")}}
    fields = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in head.items()]
    for key in ("rows", "torch"):
        items = ",\n".join(f"  {json.dumps(item)}" for item in dataset.get(key, []))
        fields.append(f' "{key}": [\n{items}\n ]')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{\n" + ",\n".join(fields) + "\n}\n")


def read_dataset(path: Path, arch: str = "sm_90") -> dict[str, Any]:
    """The dataset in ``path`` (written by ``run``). A file of the earlier form (``timings``: shape
    -> M -> plan name -> microseconds) is converted, its plans described from ``arch``'s config."""
    raw = read_json_object(Path(path), missing=f"gemm tuning results not found: {path}")
    if raw.get("suite") != SUITE:
        raise FuselightError(f"{path}: not a {SUITE} dataset")
    if "rows" in raw:
        return raw
    if not isinstance(raw.get("timings"), dict):
        raise FuselightError(f"{path}: has neither 'rows' nor 'timings'")
    from fuselight.rules.gemm.estimate import candidates, load_dispatch, plan_name
    from fuselight.rules.gemm.operands import GemmOperands

    d = load_dispatch(arch)
    rows, reference = [], []
    for shape, by_m in raw["timings"].items():
        n, k = (int(x) for x in shape.split("x"))
        ops = GemmOperands(a=None, b=None, m=d.m_grid[-1], n=n, k=k, b_layout="NT", dtype=DTYPE, out=None)
        plans = {plan_name(p, d): p for p in candidates(ops, d)}
        for m_text, row in by_m.items():
            m = int(m_text)
            for name, median in row.items():
                if name == "torch":
                    reference.append({"n": n, "k": k, "m": m, "median_us": round(median, 3)})
                elif name in plans:
                    rows.append({"n": n, "k": k, "m": m, **plan_record(plans[name], name),
                                 "median_us": round(median, 3)})
                else:
                    raise FuselightError(f"{path}: plan {name!r} ({shape}) is not a candidate of {arch}'s config")
    return {"suite": SUITE, "arch": arch, "dtype": DTYPE, "device": raw.get("device"),
            "versions": {"git_commit": raw.get("git_commit")}, "rows": rows, "torch": reference,
            "failures": raw.get("failures", [])}


def timings(dataset: dict[str, Any]) -> dict[tuple[int, int], dict[int, dict[str, float]]]:
    """(N, K) -> M -> plan name -> median microseconds."""
    out: dict[tuple[int, int], dict[int, dict[str, float]]] = {}
    for row in dataset["rows"]:
        out.setdefault((row["n"], row["k"]), {}).setdefault(row["m"], {})[row["plan"]] = row["median_us"]
    return out


def table(results_json: Path, arch: str = "sm_90", write: bool = False) -> dict[str, list[list[Any]]]:
    """Measured ranges per shape from a ``run`` dataset; prints the analytic choice vs the measured best."""
    from fuselight.rules.gemm.dispatch import best_plan, extend_ranges
    from fuselight.rules.gemm.estimate import load_dispatch, plan_name
    from fuselight.rules.gemm.operands import GemmOperands

    raw = read_dataset(Path(results_json), arch)
    torch_us = {(r["n"], r["k"], r["m"]): r["median_us"] for r in raw.get("torch", [])}
    d = load_dispatch(arch)
    analytic = dataclasses.replace(d, measured={}, cost_model="analytic")  # the function, not the learned model
    measured: dict[str, list[list[Any]]] = {}
    ratios = []
    print(f"{'shape':>12} {'M':>6} {'measured best':>28} {'us':>8} {'analytic':>28} {'us':>8} {'torch us':>8}")
    for (n, k), by_m in timings(raw).items():
        shape = f"{n}x{k}"
        ranges: list[tuple[int, str]] = []
        for m, timed in sorted(by_m.items()):
            extend_ranges(ranges, m, min(timed, key=timed.get), lambda p, t=timed: t.get(p, math.inf), d.keep_within)
            best = ranges[-1][1]
            ops = GemmOperands(a=None, b=None, m=m, n=n, k=k, b_layout="NT", dtype=DTYPE, out=None)
            choice = plan_name(best_plan(ops, m, analytic), d)
            if choice in timed:
                ratios.append(timed[choice] / min(timed.values()))
            print(f"{shape:>12} {m:>6} {best:>28} {timed[best]:8.1f} {choice:>28} "
                  f"{timed.get(choice, math.nan):8.1f} {torch_us.get((n, k, m), math.nan):8.1f}")
        measured[shape] = [list(r) for r in ranges]
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"analytic choice vs measured best: geometric mean {geo:.3f}x the best time, worst {max(ratios):.2f}x")
    if write:
        path = config_dir() / "gemm" / "dispatch.json"
        data = read_json_object(path, missing=f"gemm dispatch config not found: {path}")
        data[arch]["measured"] = measured
        commit = raw.get("versions", {}).get("git_commit")
        data[arch]["measured_on"] = f"{raw.get('device')}, fuselight tune gemm-run at {commit}"
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote measured ranges to {path}")
    return measured
