"""What the q4 probes (``q4_gemv.py``, ``q4_gemm.py``, ``q4_kn_gemv.py``, ``q4_awq_gemv.py``) share: the
Llama-3-8B cases, the command line, and on the GPU host their inputs (random packed words, scales
and tokens, never all zeros, with the float64 reference), the kernels' arguments, the error measure
and torch -> TVM tensors (packed words are uint32); the GEMV probes' target, their libraries, the
check and timing of one kernel, its row of the table, and the run of the M = 1 probes' cases."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fuselight.bench.kernels_run import tensor_to_tvm
from fuselight.bench.timing import device_name, time_fn

# The GEMV probes' bound: an H100's device-to-device copy rate (bytes read + written).
COPY_RATE_GBPS = 3000.0
# The GEMV probes' target (sm_90), within the options ``fuselight.target.resolve`` gives it.
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


def linear_args(case: dict[str, Any]) -> dict[str, Any]:
    """``case``'s ``q4_linear`` arguments (all but the vocabulary a symbolic N runs at)."""
    return {k: v for k, v in case.items() if k != "vocab"}


def q4_weights(case: dict[str, Any], torch: Any, seed: int) -> dict[str, Any]:
    """Random packed words (none zero) and scales, the function's fp16/bf16 weight, and the
    generator (``gen``) that ``q4_tokens`` draws on next."""
    n, k = case["n"] or case["vocab"], case["k"]
    dtype = getattr(torch, case.get("dtype", "float16"))
    group = case.get("group", 32)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=g)
    q[q == 0] = 0x12345678
    scale = (torch.rand((n, k // group), device="cuda", generator=g) * 0.018 + 0.002).to(dtype)
    shifts = torch.arange(0, 32, 4, device="cuda", dtype=torch.int32)
    values = ((q[:, :, None] >> shifts) & 15).reshape(n, k)  # element e of a word in bits 4e..4e+3
    # The function's weight: (dtype(e) - dtype(7)) * scale, each op rounded in dtype (torch rounds
    # half/bfloat16 arithmetic once per op, as the CUDA of the dequantize does).
    w = (values.to(dtype) - torch.tensor(7, dtype=dtype, device="cuda")) * scale.repeat_interleave(group, dim=1)
    return {"q": q.view(torch.uint32), "scale": scale, "w": w, "n": n, "k": k, "dtype": dtype, "gen": g}


def q4_tokens(case: dict[str, Any], wd: dict[str, Any], rows: tuple[int, int], torch: Any) -> dict[str, Any]:
    """Tokens ``x[*rows, k]`` (prefill ``(1, M)``, decode ``(M, 1)``), the residual where the
    epilogue adds one, the float64 reference of the output and its dtype."""
    n, k, dtype, g = wd["n"], wd["k"], wd["dtype"], wd["gen"]
    m = rows[0] * rows[1]
    x = torch.randn((*rows, k), device="cuda", generator=g).to(dtype)
    ref = (x.reshape(m, k).double() @ wd["w"].double().T).reshape(*rows, n)
    data = {"x": x, "ref": ref}
    epilogue = case.get("epilogue", "cast")
    if epilogue == "residual":
        r = torch.randn((*rows, n), device="cuda", generator=g).to(dtype)
        data["r"] = r
        data["ref"] = ref.to(dtype).double() + r.double()  # cast, then the add in dtype (ref: exact add)
    data["out_dtype"] = torch.float32 if epilogue == "cast_fp32" else dtype
    return data


def kernel_args(params: list[str], wd: dict[str, Any], data: dict[str, Any], out: Any, tvm: Any, torch: Any) -> list:
    """A q4 function's arguments in the order of its parameter names ``params`` (the output last)."""
    by_name = {"q_weight": wd["q"], "q_scale": wd["scale"], "x": data["x"], "r": data.get("r")}
    return [tensor_to_tvm(tvm, torch, by_name[p]) for p in params[:-1]] + [tensor_to_tvm(tvm, torch, out)]


def command_line(doc: str, sweep_help: str,
                 build_options: Callable[[argparse.ArgumentParser], None] | None = None,
                 ) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The probes' commands, ``build OUT [--no-sweep]`` and ``run MANIFEST -o JSON [--cases ...]``:
    the parser and the ``run`` subparser, for the probe's own options (``build_options`` adds the
    build's)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--no-sweep", action="store_true", help=sweep_help)
    if build_options is not None:
        build_options(b)
    r = sub.add_parser("run")
    r.add_argument("manifest", type=Path)
    r.add_argument("-o", "--output", type=Path, required=True)
    r.add_argument("--cases", nargs="*")
    return ap, r


def rel_error(out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| in float64, over all elements."""
    out, ref = out.double().reshape(-1), ref.double().reshape(-1)
    return float((out - ref).norm() / ref.norm())


# The build halves import the full TVM and fuselight's rules inside their functions: the GPU host
# running the other half has the TVM runtime alone.


def gemv_target() -> tuple[Any, Any]:
    """The GEMV probes' ``(spec, target)``: fuselight's sm_90 and the TVM target of ``TARGET``."""
    import tvm
    from fuselight.target import resolve

    spec = resolve("cuda", "sm_90")
    assert {k: str(v) for k, v in TARGET.items()}.items() <= {k: str(v) for k, v in spec.options.items()}.items(), spec.options
    return spec, tvm.target.Target(dict(TARGET, host={"kind": "llvm"}))


def write_gemv_libraries(out: Path, probe: str, ours: dict[str, Any], base: dict[str, Any], manifest: dict[str, Any],
                         scheduled_base: dict[str, Any] | None = None, sources: bool = False) -> None:
    """Into ``out``: ``ours.so`` (the functions ``ours``, scheduled by fuselight), ``dlight.so``
    (DLight's default rules' schedules of ``base``, and the functions ``scheduled_base`` as they
    are), their AOT cubins, with ``sources`` their CUDA (``ours.cu``, ``dlight.cu``), and
    ``manifest.json`` (``manifest`` naming the libraries)."""
    import tvm
    from fuselight.compile import library_metadata, write_library
    from fuselight.rules import dlight_defaults
    from fuselight.runtime import cuda_sources
    from tvm.s_tir import dlight as dl

    spec, target = gemv_target()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with target:
        base_mod = dl.ApplyDefaultSchedule(*dlight_defaults(target))(tvm.IRModule(base))
    base_mod.update(tvm.IRModule(scheduled_base or {}))
    for fname, mod in (("ours.so", tvm.IRModule(ours)), ("dlight.so", base_mod)):
        lib = tvm.compile(mod, target=target)
        meta = library_metadata(spec, "fuselight" if fname == "ours.so" else "dlight", "dlight (MLC-LLM's GPU rules)",
                                probe=probe)
        write_library(lib, out / fname, meta, spec)
        if sources:  # to read, and ptxas -v
            (out / fname.replace(".so", ".cu")).write_text("\n".join(cuda_sources(lib)))
        print(f"{fname}: {len(mod.functions)} functions, {time.time() - t0:.0f} s", flush=True)
    manifest["libraries"] = {"ours": "ours.so", "dlight": "dlight.so"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out}/manifest.json")


def open_gemv_run(manifest_path: Path, torch: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A GEMV probe's manifest, its libraries loaded (key -> module) and the head of its results."""
    from fuselight.runtime import load_module

    manifest = json.loads(manifest_path.read_text())
    libs = {key: load_module(manifest_path.parent / name)[0] for key, name in manifest["libraries"].items()}
    results = {"device": device_name("cuda"), "torch": torch.__version__, "manifest": str(manifest_path),
               "copy_rate_gbps": COPY_RATE_GBPS, "cases": {}}
    return manifest, libs, results


def chosen_cases(manifest: dict[str, Any], only: list[str] | None) -> list[tuple[int, str, dict[str, Any]]]:
    """The manifest's cases that ``only`` names (all where it names none), each with its place among
    all of them (which seeds its inputs): ``(index, name, case)``."""
    return [(idx, name, case) for idx, (name, case) in enumerate(manifest["cases"].items()) if not only or name in only]


def run_gemv_cases(manifest_path: Path, out_json: Path, only: list[str] | None, widths: tuple[int, int],
                   case_record: Callable[[int, str, dict[str, Any], dict[str, Any], Any], dict[str, Any]]) -> None:
    """A GEMV probe's ``run`` where a case is one table of kernels: the table's header (``widths``:
    ``gemv_row``'s), then ``case_record(index, name, case, libs, torch)`` of each case ``only`` names
    (``chosen_cases``; it prints the case's rows), and the results' JSON into ``out_json``."""
    import torch

    manifest, libs, results = open_gemv_run(manifest_path, torch)
    print(gemv_row("", "", None, widths))
    for idx, name, case in chosen_cases(manifest, only):
        results["cases"][name] = case_record(idx, name, case, libs, torch)
        torch.cuda.empty_cache()
        print(f"{name} done", file=sys.stderr, flush=True)
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out_json}")


def measure_gemv(fn: Callable[[], Any], out: Any | None, ref: Any, tolerance: float, nbytes: int, torch: Any,
                 entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """One GEMV kernel ``fn`` into ``entry`` (a new one by default), returned: run once, where it
    writes ``out`` (None: an anchor, timed only) its relative error against the float64 ``ref`` and
    whether it is below ``tolerance``; then its times with L2 flushed (medians) and the rate of
    reading ``nbytes`` (GB/s and % of ``COPY_RATE_GBPS``). A failure is recorded as ``error``."""
    entry = {} if entry is None else entry
    try:
        fn()
        torch.cuda.synchronize()
        if out is not None:
            entry["rel_err"] = rel_error(out, ref)
            entry["correct"] = bool(entry["rel_err"] < tolerance)
        st = time_fn(fn)
        entry.update(median_us=st.median_us, p10_us=st.p10_us, p90_us=st.p90_us, n=st.n,
                     gbps=nbytes / st.median_us / 1e3)
        entry["copy_rate_pct"] = 100 * entry["gbps"] / COPY_RATE_GBPS
    except Exception as err:  # noqa: BLE001 - record and go on
        entry["error"] = f"{type(err).__name__}: {err}"[:500]
    return entry


def int4pack_weight(n: int, k: int, torch: Any) -> tuple[Any, Any] | Exception:
    """tinygemm's packed ``[n, k]`` weight and its scales (``_weight_int4pack_mm``'s operands: its own
    random words, bf16, group 32; for timing only), or the error where this torch lacks it."""
    try:
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        w4 = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
        return w4, torch.rand((k // 32, n, 2), device="cuda").to(torch.bfloat16) + 0.01
    except Exception as err:  # noqa: BLE001 - recorded as the anchor's error
        return err


def measure_int4pack(anchor: tuple[Any, Any] | Exception, x2: Any, nbytes: int, torch: Any) -> dict[str, Any]:
    """``_weight_int4pack_mm`` of the tokens ``x2`` ([M, K], as bf16) and ``anchor`` (``int4pack_weight``'s),
    timed as ``measure_gemv`` times a kernel (no check: another packing), or its error."""
    if isinstance(anchor, Exception):
        return {"error": f"{type(anchor).__name__}: {anchor}"[:300]}
    (w4, sz), xb = anchor, x2.to(torch.bfloat16)
    entry = measure_gemv(lambda: torch.ops.aten._weight_int4pack_mm(xb, w4, 32, sz), None, None, 0.0, nbytes, torch)
    entry["note"] = "tinygemm, bf16 tokens, group 32 (timing only)"
    return entry


def gemv_row(case: str, kernel: str, entry: dict[str, Any] | None, widths: tuple[int, int]) -> str:
    """A line of a GEMV probe's table (``entry`` None: the header), the case and kernel names
    ``widths`` wide: time (us), % of the copy rate, relative error, and a mark where not correct."""
    if entry is None:
        return f"{'case':<{widths[0]}} {'kernel':<{widths[1]}} {'us':>9} {'%copy':>6} {'rel_err':>9}"
    us = f"{entry['median_us']:9.2f} {entry['copy_rate_pct']:6.1f}" if "median_us" in entry else f"{'error':>16}"
    return (f"{case:<{widths[0]}} {kernel:<{widths[1]}} {us} {entry.get('rel_err', float('nan')):9.2e}"
            f"{'' if entry.get('correct', True) else '  NOT CORRECT'}")


def main(doc: str, build: Callable[[Path, bool], None], run: Callable[[Path, Path, list[str] | None], None]) -> None:
    """A probe's commands (``command_line``) with no options of its own: ``build(out, sweep)`` or
    ``run(manifest, output, cases)``."""
    ap, _ = command_line(doc, "leave out the config sweep")
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.out, not a.no_sweep)
    else:
        run(a.manifest, a.output, a.cases)
