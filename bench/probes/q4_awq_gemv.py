"""Probe: the AWQ (q4f16_autoawq) decode GEMVs of Llama-3-8B, the column template's configs vs DLight's.

  build (CPU host, full TVM + nvcc; from the project root, fuselight's rules importable):
      python3 bench/probes/q4_awq_gemv.py build .build/q4_awq_gemv [--no-sweep]
  writes ``ours.so`` (the Gemv rule's kernel of each case at M = 1 with the shipped bucket of
  ``configs/gemm/gemv_cols.json``, and the ``SWEEP`` configs), ``dlight.so`` (DLight's schedule of
  the same functions: what both pipelines ran before the column template), their cubins and
  ``manifest.json``.

  run (GPU host, runtime-only TVM):
      python3 bench/probes/q4_awq_gemv.py run .build/q4_awq_gemv/manifest.json -o q4_awq_gemv.json [--cases qkv ...]
  checks every kernel against a float64 reference (random packed words and zero points, never all
  zero; the weight dequantized as the function computes it, ``quantization.dequantize_torch``) and
  times it with L2 flushed (medians), with torch's fp16 matmul of the same weight as an anchor;
  prints a table and writes JSON. The bytes a kernel reads are the packed words, scales and zero points.

The cases are MLC's AWQ decode functions (``fuselight.quant_prim_funcs.awq_linear``) with the
epilogues its Llama-3-8B build gives them: QKV (cast), o_proj and down (residual), gate+up (SiLU-mul).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# beside this script (its folder is on sys.path)
from q4_common import (TARGET, gemv_row, gemv_target, main, measure_gemv, run_gemv_cases, tensor_to_tvm,
                       write_gemv_libraries)

CASES = {
    "qkv": dict(n=6144, k=4096, epilogue="cast"),
    "o_proj": dict(n=4096, k=4096, epilogue="residual"),
    "gate_up": dict(n=28672, k=4096, epilogue="silu_mul"),
    "down": dict(n=4096, k=14336, epilogue="residual"),
}
# Configs tried besides the shipped one: (lanes_n, warps, run_rows, unroll, split_k, min_blocks_per_sm).
# split_k > 1 allocates TVM workspace (see configs/gemm/gemv_cols.json): measured here, not shipped.
SWEEP = [(4, 4, 16, 8, 4, 2), (4, 4, 32, 8, 8, 2), (4, 8, 16, 8, 4, 2), (8, 4, 16, 8, 8, 2), (2, 4, 16, 8, 8, 2),
         (4, 4, 32, 8, 1, 2), (4, 8, 32, 8, 1, 2), (8, 8, 32, 8, 1, 1), (4, 4, 16, 4, 8, 4), (2, 8, 32, 8, 1, 2),
         (1, 8, 16, 8, 1, 1), (2, 4, 16, 8, 1, 2)]
WIDTHS = (8, 26)  # of the table's case and kernel names


def _name(c: Any) -> str:
    return f"n{c.lanes_n}_w{c.warps}_r{c.run_rows}_u{c.unroll}_s{c.split_k}_b{c.min_blocks_per_sm}"


def build(out: Path, sweep: bool) -> None:
    import dataclasses

    from fuselight.device import require_device
    from fuselight.errors import FuselightError
    from fuselight.quant_prim_funcs import awq_linear
    from fuselight.rules.base import with_kernels
    from fuselight.rules.gemm import gemv_cols
    from fuselight.rules.gemm.analysis import analyze_matmul

    _, target = gemv_target()
    ours, base, manifest = {}, {}, {"cases": {}, "target": TARGET}
    for name, case in CASES.items():
        func = awq_linear(**case).with_attr("target", target)
        ops = analyze_matmul(func, dequant=True).operands
        shipped = gemv_cols.cols_config(ops, "sm_90")
        if shipped is None:
            raise SystemExit(f"{name}: no bucket of configs/gemm/gemv_cols.json takes it")
        configs = {"shipped": shipped}
        for fields in SWEEP if sweep else []:
            cfg = gemv_cols.ColsConfig(*fields[:4], min_blocks_per_sm=fields[5], split_k=fields[4])
            try:
                gemv_cols.check_cols(ops, cfg, require_device("sm_90").smem_per_block)
            except FuselightError:
                continue  # a config this shape cannot take
            if cfg != shipped:
                configs[_name(cfg)] = cfg
        variants = {}
        for vname, cfg in configs.items():
            fname = f"{name}__{vname}"
            ours[fname] = with_kernels(func, gemv_cols.cols_body(ops, cfg)).with_attr("global_symbol", fname)
            variants[vname] = dataclasses.asdict(cfg)
        # DLight's Matmul fails on a paired epilogue: MLC's baseline runs gate+up unpaired (its SiLU-mul
        # a kernel of its own), so DLight's case is the plain projection.
        base_epilogue = "cast" if case["epilogue"] == "silu_mul" else case["epilogue"]
        base_func = awq_linear(**{**case, "epilogue": base_epilogue}).with_attr("target", target)
        base[f"{name}__dlight"] = base_func.with_attr("global_symbol", f"{name}__dlight")
        manifest["cases"][name] = {**case, "params": [p.name for p in func.params], "variants": variants,
                                   "dlight_epilogue": base_epilogue}
    write_gemv_libraries(out, "q4_awq_gemv", ours, base, manifest)


def _inputs(case: dict[str, Any], torch: Any, seed: int) -> dict[str, Any]:
    """Random words, zero points (any nibble), scales and tokens; the float64 reference of the output."""
    from fuselight.quantization import SCHEMES, dequantize_torch

    n, k, group = case["n"], case["k"], 128
    g = torch.Generator(device="cuda").manual_seed(seed)

    def words(rows: int) -> Any:
        w = torch.randint(-2**31, 2**31 - 1, (rows, n // 8), dtype=torch.int32, device="cuda", generator=g)
        w[w == 0] = 0x12345678
        return w.view(torch.uint32)

    q, z = words(k), words(k // group)
    s = (torch.rand((k // group, n), device="cuda", generator=g) * 0.004 + 0.001).to(torch.float16)
    w = dequantize_torch((q, z, s), SCHEMES["q4f16_autoawq"])  # [N, K], as the function rounds it
    x = torch.randn((1, 1, k), device="cuda", generator=g).to(torch.float16)
    data = {"qweight": q, "qzeros": z, "scales": s, "x": x, "w": w,
            "acc": x.reshape(1, k).double() @ w.double().T,
            "r": torch.randn((1, 1, n), device="cuda", generator=g).to(torch.float16)}
    data["bytes"] = k * n // 2 + (k // group) * n * 2 + (k // group) * n // 2
    return data


def _reference(data: dict[str, Any], epilogue: str, torch: Any) -> Any:
    """The float64 output of the function with ``epilogue`` (its casts to fp16 where it makes them)."""
    acc = data["acc"]
    n = acc.shape[-1]
    if epilogue == "silu_mul":
        gate, up = acc[:, : n // 2], acc[:, n // 2:]
        return (gate * torch.sigmoid(gate) * up).reshape(1, 1, n // 2)
    if epilogue == "residual":
        return acc.to(torch.float16).double().reshape(1, 1, n) + data["r"].double()
    return acc.reshape(1, 1, n)


def _case_record(idx: int, name: str, case: dict[str, Any], libs: dict[str, Any], torch: Any) -> dict[str, Any]:
    """The case's kernels checked and timed, a row of the table each: its record of the results."""
    import tvm

    data = _inputs(case, torch, seed=8765 + idx)
    rec: dict[str, Any] = {"shape": {"n": case["n"], "k": case["k"], "m": 1, "quantization": "q4f16_autoawq",
                                     "epilogue": case["epilogue"]}, "bytes": data["bytes"], "kernels": {}}
    for lib, vname in [("ours", v) for v in case["variants"]] + [("dlight", "dlight"), ("torch", "torch_fp16_linear")]:
        entry: dict[str, Any] = {"config": case["variants"].get(vname)} if lib == "ours" else {}
        if lib == "torch":
            x2, w = data["x"].reshape(1, -1), data["w"]
            fn, out, ref = (lambda: torch.nn.functional.linear(x2, w)), None, None
        else:
            ref = _reference(data, case["epilogue"] if lib == "ours" else case["dlight_epilogue"], torch)
            out = torch.full(tuple(ref.shape), float("nan"), dtype=torch.float16, device="cuda")
            params = case["params"][:-1] if lib == "ours" or case["epilogue"] != "silu_mul" else case["params"][:4]
            args = [tensor_to_tvm(tvm, torch, data[p]) for p in params] + [tensor_to_tvm(tvm, torch, out)]
            f = libs[lib][f"{name}__{vname}"]
            fn = lambda f=f, args=args: f(*args)  # noqa: E731
        rec["kernels"][vname] = measure_gemv(fn, out, ref, 1e-3, data["bytes"], torch, entry)
        print(gemv_row(name, vname, entry, WIDTHS), flush=True)
    return rec


def run(manifest_path: Path, out_json: Path, only: list[str] | None) -> None:
    run_gemv_cases(manifest_path, out_json, only, WIDTHS, _case_record)


if __name__ == "__main__":
    main(__doc__, build, run)
