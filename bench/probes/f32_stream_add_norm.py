"""Probe (docs/experiments/bf16-accuracy.md, plan step 1): the RowReduction rule's kernel for a prefill add+RMSNorm
with a float32 residual stream, ``(x f32, r bf16, w bf16) -> (normed bf16, x + r in f32)``, checked on the GPU
against float64, next to the same kernel for the bf16 stream ``(x, r, w bf16) -> (normed, x + r bf16)``.

  build (CPU host, full TVM + nvcc; from the project root, fuselight importable):
      python3 bench/probes/f32_stream_add_norm.py build .build/f32_stream
  run (GPU host, runtime-only TVM, torch):
      python3 bench/probes/f32_stream_add_norm.py run .build/f32_stream

The functions are the pipeline's (``computations.plain_add_rms_norm``). Rows symbolic, hidden 4096
(Llama-3-8B), eps 1e-5; run at 1, 7 and 1024 rows. Prints, per stream dtype and
row count, the relative error of ``normed`` and of the written stream against float64 of the same inputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

HIDDEN, EPS = 4096, 1e-5
STREAMS = ("bfloat16", "float32")
ROWS = (1, 7, 1024)


def build(out: Path) -> None:
    import tvm
    from tvm import te, tirx, topi

    from fuselight.computations import plain_add_rms_norm
    from fuselight.rules.row_reduction import RowReduction
    from fuselight.target import resolve, to_tvm

    target = to_tvm(resolve("cuda", "sm_90"))
    out.mkdir(parents=True, exist_ok=True)
    n = tirx.Var("n", "int64")
    x, r = (te.placeholder((n, HIDDEN), "bfloat16", name) for name in ("x", "r"))
    w = te.placeholder((HIDDEN,), "bfloat16", "w")
    shapes = te.create_prim_func([x, r, w, topi.add(x, r)])  # the parameters' shapes and dtypes
    funcs = {}
    for stream in STREAMS:
        # As the pipeline writes them: add_rms_norm_kernels for bf16, residual_stream_fp32 for float32.
        func = plain_add_rms_norm(shapes, EPS, *((stream, stream) if stream == "float32" else ()))
        if not RowReduction.takes(func, target):
            raise SystemExit(f"RowReduction does not take the {stream} stream")
        name = f"add_norm_{stream}"
        with target:
            funcs[name] = RowReduction().apply(func, target, False).mod["main"].with_attr("global_symbol", name)
    lib = tvm.compile(tvm.IRModule(funcs), target=target)
    lib.export_library(str(out / "add_norm.so"))
    print(f"built {sorted(funcs)} -> {out / 'add_norm.so'}")


def run(out: Path) -> None:
    import torch
    import tvm

    lib = tvm.runtime.load_module(str(out / "add_norm.so"))
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'stream':<9} {'rows':>5} {'normed relerr':>14} {'stream relerr':>14}")
    for stream in STREAMS:
        for rows in ROWS:
            dtype = getattr(torch, stream)
            x = torch.randn((rows, HIDDEN), generator=g, device="cuda").to(dtype)
            r = (torch.randn((rows, HIDDEN), generator=g, device="cuda") * 0.2).to(torch.bfloat16)
            w = (1 + 0.1 * torch.randn((HIDDEN,), generator=g, device="cuda")).to(torch.bfloat16)
            normed = torch.full((rows, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
            total = torch.full((rows, HIDDEN), float("nan"), dtype=dtype, device="cuda")
            lib[f"add_norm_{stream}"](*(tvm.runtime.from_dlpack(t) for t in (x, r, w, normed, total)))
            torch.cuda.synchronize()
            t64 = x.double() + r.double()
            n64 = t64 * torch.rsqrt((t64 * t64).mean(-1, keepdim=True) + EPS) * w.double()
            err = [float((a.double() - b).norm() / b.norm()) for a, b in ((normed, n64), (total, t64))]
            print(f"{stream:<9} {rows:>5} {err[0]:>14.2e} {err[1]:>14.2e}")


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1]](Path(sys.argv[2]))
