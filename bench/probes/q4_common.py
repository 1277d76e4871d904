"""What the q4 probes (``q4_gemv.py``, ``q4_gemm.py``) share: the Llama-3-8B cases, and on the GPU
host their inputs (random packed words, scales and tokens, never all zeros, with the float64
reference), the kernels' arguments, the error measure and torch -> TVM tensors (packed words are uint32)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fuselight.bench.kernels_run import tensor_to_tvm

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


def command_line(doc: str, sweep_help: str) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The probes' commands, ``build OUT [--no-sweep]`` and ``run MANIFEST -o JSON [--cases ...]``:
    the parser and the ``run`` subparser, for the probe's own options."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--no-sweep", action="store_true", help=sweep_help)
    r = sub.add_parser("run")
    r.add_argument("manifest", type=Path)
    r.add_argument("-o", "--output", type=Path, required=True)
    r.add_argument("--cases", nargs="*")
    return ap, r


def rel_error(out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| in float64, over all elements."""
    out, ref = out.double().reshape(-1), ref.double().reshape(-1)
    return float((out - ref).norm() / ref.norm())
