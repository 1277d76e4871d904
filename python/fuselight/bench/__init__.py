"""Benchmarks: the kernel suite (``kernels``), the end-to-end LLaMA suite (``e2e``), timing and results.

The build side compiles on a machine with the full TVM; the run side (``runtime``-only TVM, PyTorch)
runs on the GPU host. Settings come from ``configs/bench.json``.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from ..errors import FuselightError
from ..paths import config_dir


@functools.cache
def bench_config() -> dict[str, Any]:
    """``configs/bench.json``: timing, tolerances, kernel suites and the end-to-end settings."""
    path = config_dir() / "bench.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise FuselightError(f"{path}: cannot read benchmark settings ({err})") from None
