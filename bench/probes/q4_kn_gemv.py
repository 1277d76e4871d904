"""Probe: the KN-layout (q4f16_0) decode GEMVs of Llama-3-8B, the KN template's configs vs DLight's.

  build (CPU host, full TVM + nvcc; from the project root, fuselight's rules importable):
      python3 bench/probes/q4_kn_gemv.py build .build/q4_kn_gemv [--no-sweep]
  writes ``ours.so`` (the Gemv rule's kernel of each case at M = 1 with the shipped config of
  ``configs/gemm/gemv_q4_kn.json``, and the ``SWEEP`` configs), ``dlight.so`` (DLight's GEMV of the
  same functions: what both pipelines ran before the KN template), their cubins and ``manifest.json``.

  run (GPU host, runtime-only TVM):
      python3 bench/probes/q4_kn_gemv.py run .build/q4_kn_gemv/manifest.json -o q4_kn_gemv.json [--cases qkv ...]
  checks every kernel against a float64 reference (``q4_common``: random packed words, never zero,
  the weight dequantized as the function computes it) and times it with L2 flushed (medians),
  with torch's fp16 matmul of the same weight as an anchor. Prints a table and writes JSON.

The cases are ``q4_common.CASES``' Llama-3-8B projections with the weights in the KN layout
(``fuselight.quant_prim_funcs.q4_linear(layout="KN")``; the LM head at a static 128256, as our
model has it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# beside this script (its folder is on sys.path)
from q4_common import (CASES, TARGET, gemv_row, gemv_target, linear_args, main, measure_gemv, q4_tokens, q4_weights,
                       run_gemv_cases, tensor_to_tvm, write_gemv_libraries)

KN_CASES = ("qkv", "o_proj", "gate_up", "down", "lm_head")
# Configs tried besides the shipped one: (lanes_n, warps, unroll, min_blocks_per_sm).
SWEEP = [(8, 8, 4, 2), (2, 8, 4, 2), (4, 4, 4, 4), (4, 8, 2, 2), (4, 8, 8, 2), (4, 16, 4, 1), (8, 4, 4, 4),
         (8, 8, 8, 1), (4, 8, 4, 1), (4, 8, 4, 3)]
WIDTHS = (10, 16)  # of the table's case and kernel names


def _case(name: str) -> dict[str, Any]:
    case = dict(CASES[name])
    if case["n"] is None:  # our model's LM head: a static vocabulary
        case["n"] = case.pop("vocab")
    return case


def _vname(lanes_n: int, warps: int, unroll: int, blocks: int) -> str:
    return f"n{lanes_n}_w{warps}_u{unroll}_b{blocks}"


def build(out: Path, sweep: bool) -> None:
    import dataclasses

    from fuselight.quant_prim_funcs import q4_linear
    from fuselight.rules.base import with_kernels
    from fuselight.rules.gemm import gemv_kn
    from fuselight.rules.gemm.analysis import analyze_matmul
    from fuselight.rules.gemv import Gemv, kn_gemv_config

    _, target = gemv_target()
    ours, base, manifest = {}, {}, {"cases": {}, "target": TARGET}
    for name in KN_CASES:
        case = _case(name)
        func = q4_linear(**linear_args(case), layout="KN").with_attr("target", target)
        sch = Gemv().apply(func, target, False)
        if sch is None:
            raise SystemExit(f"{name}: the Gemv rule does not take the KN function")
        ours[f"{name}__shipped"] = sch.mod["main"].with_attr("global_symbol", f"{name}__shipped")
        ops = analyze_matmul(func, dequant=True).operands
        shipped = kn_gemv_config(ops, target)
        entry = {**case, "params": [p.name for p in func.params], "variants": {"shipped": dataclasses.asdict(shipped)}}
        for lanes_n, warps, unroll, blocks in SWEEP if sweep else []:
            cfg = gemv_kn.KnGemvConfig(max_m=1, lanes_n=lanes_n, warps=warps, unroll=unroll, min_blocks_per_sm=blocks)
            if cfg == shipped:
                continue
            vname = _vname(lanes_n, warps, unroll, blocks)
            body = gemv_kn.kn_body(ops, cfg, gemv_kn.kn_vec(ops.n))
            ours[f"{name}__{vname}"] = with_kernels(func, body).with_attr("global_symbol", f"{name}__{vname}")
            entry["variants"][vname] = dataclasses.asdict(cfg)
        base[f"{name}__dlight"] = func.with_attr("global_symbol", f"{name}__dlight")
        manifest["cases"][name] = entry
    write_gemv_libraries(out, "q4_kn_gemv", ours, base, manifest)


def _case_record(idx: int, name: str, case: dict[str, Any], libs: dict[str, Any], torch: Any) -> dict[str, Any]:
    """The case's kernels checked and timed, a row of the table each: its record of the results."""
    import tvm

    wd = q4_weights(case, torch, seed=4321 + idx)
    n, k = wd["n"], wd["k"]
    weight_bytes = n * k // 2 + n * (k // case.get("group", 32)) * 2
    data = q4_tokens(case, wd, (1, 1), torch)
    # The same words and scales in the KN layout: packed[K / 8, N], scale[K / group, N].
    by_name = {"q_weight": wd["q"].T.contiguous(), "q_scale": wd["scale"].T.contiguous(), "x": data["x"],
               "r": data.get("r")}
    rec: dict[str, Any] = {"n": n, "k": k, "weight_bytes": weight_bytes, "shape": {"n": n, "k": k, "m": 1,
                           "quantization": "q4f16_0"}, "kernels": {}}

    def measure(label: str, fn: Any, out: Any | None, cfg: dict | None = None) -> None:
        entry = measure_gemv(fn, out, data["ref"], 1e-3, weight_bytes, torch, None if cfg is None else {"config": cfg})
        rec["kernels"][label] = entry
        print(gemv_row(name, label, entry, WIDTHS), flush=True)

    def kernel(lib: str, fname: str) -> tuple[Any, Any]:
        out = torch.full((1, 1, n), float("nan"), dtype=data["out_dtype"], device="cuda")
        args = [tensor_to_tvm(tvm, torch, by_name[p]) for p in case["params"][:-1]] + [tensor_to_tvm(tvm, torch, out)]
        f = libs[lib][fname]
        return (lambda: f(*args)), out

    for vname, cfg in case["variants"].items():
        measure(vname, *kernel("ours", f"{name}__{vname}"), cfg)
    measure("dlight", *kernel("dlight", f"{name}__dlight"))
    x2 = data["x"].reshape(1, k)
    measure("torch_fp16_linear", lambda: torch.nn.functional.linear(x2, wd["w"]), None)
    return rec


def run(manifest_path: Path, out_json: Path, only: list[str] | None) -> None:
    run_gemv_cases(manifest_path, out_json, only, WIDTHS, _case_record)


if __name__ == "__main__":
    main(__doc__, build, run)
