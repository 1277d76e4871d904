"""Probe (docs/experiments/decode-form.md, session 26): where a decode step's wall time goes beyond
its kernels, in greedy generation (``Engine.greedy``) and in single synchronous steps
(``Engine.decode``), for each library in its own process.

Per library, after a prefill of ``--context`` random tokens:
- generation ms/token (``greedy`` over 48 steps, median of 4 rounds after one untimed) and single
  steps (wall time of ``Engine.decode``, median of 40 after 5 untimed), with the host time of the VM
  call inside the step (the staging copies and the graph launch);
- the device timeline of 24 generation steps and of 8 single steps under ``torch.profiler``: the
  step period (between the ends of successive runs of the step's longest kernel, the LM head), the
  time at least one kernel or copy runs (``busy``), the rest (``idle``), the gaps between one
  operation's end and the next one's start by the pair of operations, and each operation's exclusive
  time (``fuselight.bench.profile.exclusive``).

GPU host (runtime-only TVM, torch), libraries built by ``fuselight compile``:
    python3 bench/probes/decode_timeline.py LIB.so [LIB.so ...] -o OUT.json [--context 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

GENERATE_STEPS, GENERATE_ROUNDS = 48, 4
SINGLE_STEPS, SINGLE_WARMUP = 40, 5
TIMELINE_GENERATE, TIMELINE_SINGLE = 24, 8
TOP = 8


def timeline_summary(events: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Per step: period, busy and idle µs, the largest gaps by (before -> after) and the largest
    exclusive times, from ``(name, start µs, end µs)`` device events of several steps."""
    from fuselight.bench.profile import exclusive

    kernels = [e for e in events if not e[0].startswith("Memcpy")]
    marker = max({e[0] for e in kernels}, key=lambda n: max(e[2] - e[1] for e in kernels if e[0] == n))
    ends = sorted(e[2] for e in events if e[0] == marker)
    lo, hi, steps = ends[1], ends[-1], len(ends) - 2  # whole steps only
    inside = [(n, max(s, lo), min(e, hi)) for n, s, e in events if e > lo and s < hi]
    excl = Counter(exclusive(inside))
    busy = sum(excl.values())  # the exclusive times add up to the covered time
    gaps: Counter[str] = Counter()
    reach, last = lo, marker
    for name, start, end in sorted(inside, key=lambda r: r[1]):
        if start > reach:
            gaps[f"{last} -> {name}"] += start - reach
        if end > reach:
            reach, last = end, name
    return {
        "marker": marker,
        "steps": steps,
        "period_us": round(float(np.median(np.diff(ends))), 1),
        "busy_us": round(busy / steps, 1),
        "idle_us": round((hi - lo - busy) / steps, 1),
        "gaps_us": {k: round(v / steps, 2) for k, v in gaps.most_common(TOP)},
        "exclusive_us": {k: round(v / steps, 2) for k, v in excl.most_common(2 * TOP)},
    }


def measure(lib: Path, context: int) -> dict[str, Any]:
    """One library's numbers (see the module docstring)."""
    import torch

    from fuselight.bench.e2e import _open_tvm, quantize_on_device, random_weights
    from fuselight.bench.profile import device_runs, profiled
    from fuselight.config import load
    from fuselight.runtime import init_tvm, read_metadata

    model = read_metadata(lib)["model"]
    config = load(model["name"]).with_dtype(model["dtype"])
    if model.get("quantization"):
        config = config.with_quantization(model["quantization"])
    tvm = init_tvm()
    device = torch.device("cuda:0")
    out: dict[str, Any] = {"library": str(lib), "model": config.name, "dtype": config.dtype,
                           "quantization": config.quantization, "context": context}
    with torch.inference_mode():
        weights, _ = quantize_on_device(random_weights(config, device, 0), config.quantized_weights())
        params = [tvm.runtime.from_dlpack(weights[name]) for name in config.weight_shapes()]
        runner, _ = _open_tvm(torch, lib, "cuda", config, params, context + 2 * GENERATE_STEPS + SINGLE_STEPS)
        engine = runner.engine
        ids = np.random.default_rng(0).integers(0, config.vocab_size, size=context, dtype=np.int32)

        def fresh() -> Any:
            engine.reset()
            logits = engine.prefill(ids)
            engine.device.sync()
            return logits

        rounds = []
        for _ in range(GENERATE_ROUNDS + 1):
            logits = fresh()
            start = time.perf_counter()
            engine.greedy(logits, GENERATE_STEPS + 1)
            rounds.append((time.perf_counter() - start) / GENERATE_STEPS * 1e3)
        out["generate_ms"] = round(float(np.median(rounds[1:])), 4)

        fresh()
        call, calls = engine._decode, []

        def timed_call(*args: Any) -> Any:
            start = time.perf_counter()
            result = call(*args)
            calls.append(time.perf_counter() - start)
            return result

        engine._decode = timed_call
        steps = []
        for token in range(SINGLE_STEPS + SINGLE_WARMUP):
            start = time.perf_counter()
            engine.decode(token)
            steps.append(time.perf_counter() - start)
        engine._decode = call
        out["single_step_ms"] = round(float(np.median(steps[SINGLE_WARMUP:])) * 1e3, 4)
        out["vm_call_us"] = round(float(np.median(calls[SINGLE_WARMUP:])) * 1e6, 1)

        def timeline(run: Any) -> list[tuple[str, float, float]]:
            return device_runs(profiled(run, torch.cuda.synchronize))

        logits = fresh()
        out["generate_timeline"] = timeline_summary(timeline(lambda: engine.greedy(logits, TIMELINE_GENERATE + 1)))
        fresh()
        for token in range(SINGLE_WARMUP):
            engine.decode(token)
        out["single_timeline"] = timeline_summary(
            timeline(lambda: [engine.decode(token) for token in range(TIMELINE_SINGLE)]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("libraries", nargs="+", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one library
    args = parser.parse_args(argv)
    if args.one:
        args.output.write_text(json.dumps(measure(args.libraries[0], args.context)))
        return
    results = []
    for i, lib in enumerate(args.libraries):
        part = args.output.with_suffix(f".{i}.json")
        subprocess.run([sys.executable, __file__, str(lib), "-o", str(part), "--context", str(args.context), "--one"],
                       check=True)
        results.append(json.loads(part.read_text()))
        part.unlink()
    from fuselight.bench.timing import device_name

    args.output.write_text(json.dumps({"device": device_name("cuda"), "command": " ".join(sys.argv),
                                       "results": results}, indent=1) + "\n")
    print(f"{'library':<40} {'gen ms':>7} {'step ms':>8} {'vm call us':>10} | gen: period busy idle | step: period busy idle")
    for r in results:
        g, s = r["generate_timeline"], r["single_timeline"]
        print(f"{Path(r['library']).name:<40} {r['generate_ms']:>7.3f} {r['single_step_ms']:>8.3f} {r['vm_call_us']:>10.1f} | "
              f"{g['period_us']:.0f} {g['busy_us']:.0f} {g['idle_us']:.0f} | {s['period_us']:.0f} {s['busy_us']:.0f} {s['idle_us']:.0f}")


if __name__ == "__main__":
    main()
