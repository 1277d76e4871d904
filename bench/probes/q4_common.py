"""What the q4 probes (``q4_gemv.py``, ``q4_gemm.py``) share on the GPU host: the error measure and
torch -> TVM tensors (packed words are uint32)."""

from __future__ import annotations

from typing import Any


def rel_error(out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| in float64, over all elements."""
    out, ref = out.double().reshape(-1), ref.double().reshape(-1)
    return float((out - ref).norm() / ref.norm())


def tensor_to_tvm(tvm: Any, torch: Any, t: Any) -> Any:
    """``t`` as a TVM tensor (no copy); uint32 through int32 where torch's DLPack lacks uint32."""
    if t.dtype == torch.uint32:
        try:
            return tvm.runtime.from_dlpack(t)
        except Exception:  # noqa: BLE001 - a torch without uint32 DLPack: same bits as int32
            return tvm.runtime.from_dlpack(t.view(torch.int32))._create_view(tuple(t.shape), "uint32")
    return tvm.runtime.from_dlpack(t)
