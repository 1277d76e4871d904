"""Probe (docs/experiments/rope-append-and-pdl-wait.md, session 13): RMSNorm [M, 4096] fp16 timed back to back over rotating
inputs, next to the kernel suite's single-call timing (L2 flushed by a read, GPU sleep, events); the
baseline's and fuselight's kernels, PyTorch's, and a copy of the same bytes (x -> y).

Back to back: 32 calls over 8 input sets between two events (each call's input last touched 7 calls
earlier, at least 112 MB before at M = 2048, so read from memory), after a GPU sleep that lets the host
enqueue them all. The single call's output lands in L2 and is written back after the end event; back to
back, the earlier calls' write-backs share the memory with the current call.

GPU host, after ``fuselight bench build build/norm --cases rmsnorm-4096`` on the build host:
    python3 bench/probes/rmsnorm_back_to_back.py build/norm/manifest.json bench/results/h100/probe-rmsnorm-back-to-back.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

SETS, CALLS, REPS = 8, 32, 15
SLEEP_CYCLES = 3_000_000  # about 1.5 ms: the host enqueues every call before the first runs
HIDDEN, EPS = 4096, 1e-5


def main(manifest: Path, out_json: Path) -> None:
    import torch
    import torch.nn.functional as F
    from fuselight.bench.timing import time_fn
    from fuselight.runtime import init_tvm, load_library

    tvm = init_tvm()
    case = json.loads(manifest.read_text())["cases"][0]
    vms = {k: load_library(manifest.parent / v, "cuda")[0] for k, v in case["libraries"].items()}
    results = {}
    for m in (2048, 4096, 8192):
        gen = torch.Generator(device="cuda").manual_seed(m)
        xs = [torch.randn((m, HIDDEN), generator=gen, device="cuda").half() for _ in range(SETS)]
        w = (torch.randn((HIDDEN,), generator=gen, device="cuda") * 0.1 + 1).half()
        ys = [torch.empty_like(x) for x in xs]
        x64 = xs[0].double()
        ref = x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + EPS) * w.double()
        fns = {}
        for impl, vm in vms.items():
            args = [(tvm.runtime.from_dlpack(x), tvm.runtime.from_dlpack(w)) for x in xs]
            fns[impl] = [lambda a=a, f=vm["main"]: f(*a) for a in args]
            err = float((torch.from_dlpack(fns[impl][0]()).double() - ref).norm() / ref.norm())
            assert err < 1e-2, (impl, m, err)
        fns["torch"] = [lambda x=x, w=w: F.rms_norm(x, (HIDDEN,), w, EPS) for x in xs]
        fns["copy"] = [lambda x=x, y=y: y.copy_(x) for x, y in zip(xs, ys, strict=True)]
        nbytes = 2 * m * HIDDEN * 2
        for impl, calls in fns.items():
            for call in calls:
                call()
            torch.cuda.synchronize()
            samples = []
            for _ in range(REPS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(SLEEP_CYCLES)
                start.record()
                for i in range(CALLS):
                    calls[i % SETS]()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / CALLS)
            b2b, single = float(np.median(samples)), time_fn(calls[0]).median_us
            results[f"{m}/{impl}"] = {"back_to_back_us": b2b, "single_call_us": single,
                                      "back_to_back_GBps": nbytes / b2b / 1e3, "single_call_GBps": nbytes / single / 1e3}
            print(f"M={m:5d} {impl:10s} back to back {b2b:7.2f} us ({nbytes / b2b / 1e3:5.0f} GB/s)"
                  f"   single call {single:7.2f} us ({nbytes / single / 1e3:5.0f} GB/s)", flush=True)
    out_json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: rmsnorm_back_to_back.py MANIFEST.json OUT.json")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
