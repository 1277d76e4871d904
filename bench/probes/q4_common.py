"""What the q4 probes (``q4_gemv.py``, ``q4_gemm.py``) share on the GPU host: the error measure and
torch -> TVM tensors (packed words are uint32)."""

from __future__ import annotations

from typing import Any

from fuselight.bench.kernels_run import tensor_to_tvm  # noqa: F401 - the probes' torch -> TVM conversion


def rel_error(out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| in float64, over all elements."""
    out, ref = out.double().reshape(-1), ref.double().reshape(-1)
    return float((out - ref).norm() / ref.norm())
