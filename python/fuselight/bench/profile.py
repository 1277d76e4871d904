"""Where a decode step's GPU time goes: kernels by family, device time and launches per step.

Runs the step under ``torch.profiler`` with CUDA activities (TVM 0.26's VM has no profiler of its
own; kernels carry their PrimFunc names, and kernels replayed from CUDA graphs are recorded too) and
sums each kernel's device time per step (``gpu_us``), and the time at least one kernel runs
(``busy_us``, the union of their intervals: kernels launched early overlap the one before, so the
sum counts that time twice), and each kernel's exclusive time (``exclusive_us``: what its runs add
past the end of the kernels started before them, so a kernel launched early is counted from the end
of the one it waits for; these add up to ``busy_us``, and are a kernel's share of the step where
durations are not). Families are the first matching name pattern of
``profile_families`` in ``configs/bench.json`` ("other" if none matches), so the split between weight
GEMVs, attention and everything else that issue targets name is read off directly.
``host_launches``: the kernel and graph launches the host makes a step (the CUDA runtime and driver
calls named by ``host_launch_apis`` in ``configs/bench.json``, as the profiler records them): a
graph replays many kernels for one, so this, not ``launches``, is what the host pays for.
Runtime-only: PyTorch is imported when called.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from . import bench_config

OTHER = "other"


def family_of(kernel: str, families: list[tuple[str, str]]) -> str:
    """The family of the first ``(family, regex)`` whose regex matches ``kernel`` (``re.search``)."""
    return next((family for family, pattern in families if re.search(pattern, kernel)), OTHER)


def families() -> list[tuple[str, str]]:
    return [(f, p) for f, p in bench_config()["profile_families"]]


def host_launches(api_calls: list[str], apis: list[str]) -> int | None:
    """How many of the host's CUDA API calls ``api_calls`` launch a kernel or a graph (``apis``);
    None where none does (a step always launches something, so the profiler did not record them)."""
    wanted = set(apis)
    count = sum(1 for name in api_calls if name in wanted)
    return count or None


def covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def exclusive(runs: list[tuple[str, float, float]]) -> dict[str, float]:
    """Per kernel name, the time its ``(name, start, end)`` runs add past the end of every run that
    started before them (see the module docstring); the values add up to ``covered`` of the runs."""
    out: dict[str, float] = {}
    reach = float("-inf")
    for name, start, end in sorted(runs, key=lambda r: r[1]):
        out[name] = out.get(name, 0.0) + max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return out


def summarize(
    events: list[tuple[str, float, int]],
    steps: int,
    table: list[tuple[str, str]],
    busy_us: float | None = None,
    exclusive_us: dict[str, float] | None = None,
    launched_by_host: int | None = None,
) -> dict[str, Any]:
    """Per-step totals of ``(kernel name, device µs, calls)`` events, by family and by kernel;
    ``busy_us``: the steps' covered device time (``covered``), stored per step; ``exclusive_us``: each
    kernel name's exclusive time over the steps (``exclusive``), stored per step beside ``us``;
    ``launched_by_host``: the steps' ``host_launches``, stored per step."""
    fields = ("us", "launches", *(("exclusive_us",) if exclusive_us is not None else ()))
    by_family: dict[str, dict[str, float]] = {}
    by_kernel: dict[str, dict[str, Any]] = {}
    for name, us, calls in events:
        fam = family_of(name, table)
        add = {"us": us, "launches": calls, "exclusive_us": (exclusive_us or {}).get(name, 0.0)}
        f = by_family.setdefault(fam, dict.fromkeys(fields, 0.0))
        k = by_kernel.setdefault(name, {"family": fam, **dict.fromkeys(fields, 0.0)})
        for field in fields:
            f[field] += add[field] / steps
            k[field] += add[field] / steps
    rounded = {fam: {f: round(v[f], 2) for f in fields} for fam, v in by_family.items()}
    return {
        "steps": steps,
        "gpu_us": round(sum(v["us"] for v in by_family.values()), 1),
        **({"busy_us": round(busy_us / steps, 1)} if busy_us is not None else {}),
        "launches": round(sum(v["launches"] for v in by_family.values()), 1),
        **({"host_launches": round(launched_by_host / steps, 1)} if launched_by_host is not None else {}),
        "families": dict(sorted(rounded.items(), key=lambda kv: -kv[1]["us"])),
        "kernels": {n: {**v, **{f: round(v[f], 2) for f in fields}}
                    for n, v in sorted(by_kernel.items(), key=lambda kv: -kv[1]["us"])},
    }


def profiled(run: Callable[[], Any], sync: Callable[[], None]) -> Any:
    """``run()`` under the CUDA profiler, the device synchronised before and after: the profiler."""
    import torch

    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    return prof


def device_runs(prof: Any, skip: tuple[str, ...] = ()) -> list[tuple[str, float, float]]:
    """``(name, start µs, end µs)`` of each device operation ``prof`` recorded, but those whose name
    starts with one of ``skip``."""
    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA" and not e.name.startswith(skip)
    ]


def profile_steps(step: Callable[[], Any], steps: int, sync: Callable[[], None]) -> dict[str, Any]:
    """Run ``step`` ``steps`` times under the CUDA profiler; ``summarize`` of its kernels."""
    prof = profiled(lambda: [step() for _ in range(steps)], sync)
    skip = ("Memcpy", "Memset", "cudaDeviceSynchronize")
    events = [
        (e.key, e.device_time_total, e.count)
        for e in prof.key_averages()
        if e.device_time_total > 0 and not e.key.startswith(skip)
    ]
    runs = device_runs(prof, skip)
    api_calls = [e.name for e in prof.events() if e.device_type.name == "CPU"]
    launched = host_launches(api_calls, list(bench_config()["host_launch_apis"]))
    return summarize(events, steps, families(), covered([r[1:] for r in runs]), exclusive(runs), launched)
