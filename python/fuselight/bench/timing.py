"""Timing: CUDA events around each call with L2 flushed and launch gaps hidden; wall clock elsewhere.

On the GPU, each timed call is preceded by a read of a buffer larger than L2 (so weights are read
from memory, not from a warm cache; a read, not a write, so L2 holds no dirty lines whose
write-back the timed kernel would pay for) and by ``torch.cuda._sleep`` (so the stream is busy
while the host launches, and host launch time is not timed). Quote medians. PyTorch is imported on first use.
Settings: ``timing`` in ``configs/bench.json``.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import FuselightError
from . import bench_config

DEVICES = ("cuda", "cpu")
_FLUSH_BUFFERS: dict[int, Any] = {}
_PERCENTILES = (50, 10, 90)


@dataclasses.dataclass(frozen=True)
class Stats:
    median_us: float
    p10_us: float
    p90_us: float
    n: int


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    warmup: int
    repeat: int
    min_repeat: int  # at least this many timed calls, even past max_seconds
    max_seconds: float  # budget for the timed calls of one measurement
    flush_bytes: int  # L2 flush buffer (0: no flush)
    sleep_cycles: int  # GPU sleep before each start event (0: none)


def timing_config(device: str) -> TimingConfig:
    if device not in DEVICES:
        raise FuselightError(f"unknown device {device!r}: expected one of {', '.join(DEVICES)}")
    return TimingConfig(**bench_config()["timing"][device])


def device_name(device: str) -> str:
    """What the records call the device: the GPU's name, or the CPU's."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine() or "cpu"


def synchronizer(device: str) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on the CPU)."""
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def summarize(samples_us: list[float]) -> Stats:
    if not samples_us:
        raise FuselightError("no timing samples")
    median, p10, p90 = (float(v) for v in np.percentile(np.asarray(samples_us, dtype=np.float64), _PERCENTILES))
    return Stats(median_us=median, p10_us=p10, p90_us=p90, n=len(samples_us))


def _budget(estimate_s: float, cfg: TimingConfig, warmup: int, repeat: int) -> tuple[int, int]:
    """Calls left for warm-up and timing so one measurement stays near ``max_seconds``."""
    fits = int(cfg.max_seconds / estimate_s) if estimate_s > 0 else repeat
    return max(0, min(warmup, fits)), max(cfg.min_repeat, min(repeat, fits))


def time_fn(
    fn: Callable[[], Any],
    *,
    device: str = "cuda",
    warmup: int | None = None,
    repeat: int | None = None,
    flush_l2: bool = True,
) -> Stats:
    """Time ``fn()`` (asynchronous GPU work on the default stream, or plain CPU work)."""
    cfg = timing_config(device)
    warmup = cfg.warmup if warmup is None else warmup
    repeat = cfg.repeat if repeat is None else repeat
    if repeat < 1:
        raise FuselightError(f"repeat must be at least 1, got {repeat}")
    if device == "cpu":
        fn()
        start = time.perf_counter()
        fn()
        more_warmup, n = _budget(time.perf_counter() - start, cfg, warmup, repeat)
        return time_host(fn, warmup=more_warmup, repeat=n)
    import torch

    flush = _flush_buffer(cfg.flush_bytes) if flush_l2 and cfg.flush_bytes else None
    fn()
    torch.cuda.synchronize()
    estimate_s = _cuda_samples(fn, 1, flush, cfg.sleep_cycles)[0] * 1e-6
    more_warmup, n = _budget(estimate_s, cfg, warmup, repeat)
    for _ in range(more_warmup):
        fn()
    torch.cuda.synchronize()
    return summarize(_cuda_samples(fn, n, flush, cfg.sleep_cycles))


def _flush_buffer(nbytes: int) -> Any:
    import torch

    if nbytes not in _FLUSH_BUFFERS:
        _FLUSH_BUFFERS[nbytes] = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    return _FLUSH_BUFFERS[nbytes]


def _cuda_samples(fn: Callable[[], Any], n: int, flush: Any, sleep_cycles: int) -> list[float]:
    """``n`` event-timed calls in microseconds, each after an L2 flush (a read) and a GPU sleep."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.amax()  # reads every line, writes one float
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in zip(starts, ends)]


def time_host(
    fn: Callable[[], Any],
    *,
    warmup: int,
    repeat: int,
    sync: Callable[[], None] | None = None,
    setup: Callable[[], Any] | None = None,
) -> Stats:
    """Wall-clock time of ``fn()`` between two ``sync()`` calls; ``setup()`` runs untimed before each."""
    return summarize(host_samples(fn, warmup=warmup, repeat=repeat, sync=sync, setup=setup))


def host_samples(
    fn: Callable[[], Any],
    *,
    warmup: int,
    repeat: int,
    sync: Callable[[], None] | None = None,
    setup: Callable[[], Any] | None = None,
) -> list[float]:
    """``time_host``'s samples in microseconds, for callers that pool several runs."""
    if repeat < 1:
        raise FuselightError(f"repeat must be at least 1, got {repeat}")
    samples = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        if i >= warmup:
            samples.append((time.perf_counter() - start) * 1e6)
    return samples
