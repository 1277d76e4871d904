"""Benchmarks: the kernel suite (``kernels``), the end-to-end LLaMA suite (``e2e``), timing and results.

The build side compiles on a machine with the full TVM; the run side (``runtime``-only TVM, PyTorch)
runs on the GPU host. Settings come from ``configs/bench.json``.
"""

from __future__ import annotations

import functools
from typing import Any

from ..jsonfile import read_json_object
from ..paths import config_dir


@functools.cache
def bench_config() -> dict[str, Any]:
    """``configs/bench.json``: timing, tolerances, kernel suites and the end-to-end settings."""
    path = config_dir() / "bench.json"
    return read_json_object(path, missing=f"benchmark settings not found: {path}")
