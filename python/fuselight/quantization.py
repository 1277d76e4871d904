"""Weight quantization schemes: MLC-LLM's 4-bit group formats, their layout and arithmetic.

A scheme stores a float weight ``W[N, K]`` (out features x in features) as 4-bit integers packed
eight to a ``uint32`` (element ``e`` of a word in bits ``4e..4e+3``) along K, with one scale per
group of ``group_size`` consecutive K. Dequantized, ``W[n, k] = (q[n, k] - 7) * scale[n, k // g]``,
computed in the model dtype as MLC writes it: ``(dtype(q) - dtype(7)) * scale``. The ``NK`` layout
stores ``q[N, K / 8]`` and ``scale[N, K / g]``; ``KN`` (q4f16_0) stores both transposed,
``q[K / 8, N]`` and ``scale[K / g, N]`` (packed along K, then transposed, as MLC does). Quantizing takes the group's largest magnitude over 7 as its scale, and rounds
``w / scale + 7`` into 0..14, as MLC does.

The names and the formats are MLC-LLM's (``mlc_llm.quantization``), so libraries of either agree
on the parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from .errors import FuselightError

BITS = 4
PER_WORD = 32 // BITS  # values per uint32
MAX_INT = (1 << (BITS - 1)) - 1  # 7: the stored zero
STORAGE_DTYPE = "uint32"


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """One 4-bit group scheme (see the module docstring)."""

    name: str
    model_dtype: str  # "float16" or "bfloat16": the scales and the dequantized weights
    group_size: int
    layout: Literal["NK", "KN"]
    quantize_embedding: bool = True
    quantize_lm_head: bool = True

    def packed_shapes(self, n: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Shapes of ``(q, scale)`` for an ``[n, k]`` weight."""
        check_weight_shape(self, n, k)
        q, s = (n, k // PER_WORD), (n, k // self.group_size)
        return (q, s) if self.layout == "NK" else (q[::-1], s[::-1])


SCHEMES: dict[str, QuantScheme] = {
    s.name: s
    for s in [
        QuantScheme("q4f16_1", "float16", 32, "NK"),
        QuantScheme("q4bf16_1", "bfloat16", 32, "NK"),
        QuantScheme("q4f16_0", "float16", 32, "KN"),
    ]
}


def scheme(name: str | None) -> QuantScheme | None:
    """The scheme called ``name`` (None or "q0f16"/"q0bf16": no quantization); FuselightError otherwise."""
    if name is None or name in ("q0f16", "q0bf16", "none"):
        return None
    if name not in SCHEMES:
        raise FuselightError(f"unsupported quantization {name!r}: expected one of {', '.join(SCHEMES)} (or none)")
    return SCHEMES[name]


def check_weight_shape(s: QuantScheme, n: int, k: int) -> None:
    if k % s.group_size or k % PER_WORD or n < 1:
        raise FuselightError(f"{s.name}: a weight of shape [{n}, {k}] needs K a multiple of {s.group_size}")


def quantize(w: np.ndarray, s: QuantScheme) -> tuple[np.ndarray, np.ndarray]:
    """``(q, scale)`` of a float ``[N, K]`` weight in ``s``'s layout (numpy; scales in float32 here,
    rounded to the model dtype by the caller's conversion)."""
    n, k = w.shape
    check_weight_shape(s, n, k)
    groups = w.astype(np.float32).reshape(n, k // s.group_size, s.group_size)
    scale = np.abs(groups).max(axis=-1) / MAX_INT
    safe = np.where(scale == 0, 1, scale)
    values = np.clip(np.rint(groups / safe[..., None] + MAX_INT), 0, 2 * MAX_INT).astype(np.uint32)
    q = pack(values.reshape(n, k))
    return (q, scale) if s.layout == "NK" else (q.T.copy(), scale.T.copy())


def pack(values: np.ndarray) -> np.ndarray:
    """``[N, K]`` integers in 0..15 -> ``[N, K / 8]`` uint32, element e of a word in bits 4e..4e+3."""
    n, k = values.shape
    v = values.astype(np.uint32).reshape(n, k // PER_WORD, PER_WORD)
    shifts = (np.arange(PER_WORD, dtype=np.uint32) * BITS)[None, None, :]
    return np.bitwise_or.reduce(v << shifts, axis=-1).astype(np.uint32)


def unpack(q: np.ndarray) -> np.ndarray:
    """Inverse of ``pack``: ``[N, K / 8]`` uint32 -> ``[N, K]`` integers 0..15."""
    n, words = q.shape
    shifts = (np.arange(PER_WORD, dtype=np.uint32) * BITS)[None, None, :]
    return ((q.astype(np.uint32)[..., None] >> shifts) & 0xF).reshape(n, words * PER_WORD)


def dequantize(q: np.ndarray, scale: np.ndarray, s: QuantScheme) -> np.ndarray:
    """The float64 ``[N, K]`` weight that ``(q, scale)`` stores (``scale`` as stored, any float dtype)."""
    if s.layout == "KN":
        q, scale = q.T, scale.T
    values = unpack(q).astype(np.float64) - MAX_INT
    return values * np.repeat(np.asarray(scale, dtype=np.float64), s.group_size, axis=1)


def quantize_torch(w: Any, s: QuantScheme) -> tuple[Any, Any]:
    """``quantize`` on the GPU: ``(q uint32, scale)`` of a torch ``[N, K]`` weight, scales in the
    weight's dtype; the benchmarks quantize random weights of 8B-parameter models with it."""
    import torch

    n, k = w.shape
    check_weight_shape(s, n, k)
    groups = w.float().reshape(n, k // s.group_size, s.group_size)
    scale = (groups.abs().amax(dim=-1) / MAX_INT).to(w.dtype)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    values = torch.clamp(torch.round(groups / safe[..., None] + MAX_INT), 0, 2 * MAX_INT).to(torch.int64)
    shifts = torch.arange(PER_WORD, device=w.device, dtype=torch.int64) * BITS
    words = (values.reshape(n, k // PER_WORD, PER_WORD) << shifts).sum(dim=-1)
    q = (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32).view(torch.uint32)
    return (q, scale) if s.layout == "NK" else (q.T.contiguous(), scale.T.contiguous())


def dequantize_torch(q: Any, scale: Any, s: QuantScheme) -> Any:
    """``dequantize`` on the GPU, in ``scale``'s dtype as the kernels compute it: ``(q - 7) * scale``."""
    import torch

    if s.layout == "KN":
        q, scale = q.T, scale.T
    n, words = q.shape
    shifts = torch.arange(PER_WORD, device=q.device, dtype=torch.int64) * BITS
    values = (q.view(torch.int32).to(torch.int64)[..., None] >> shifts) & 0xF
    values = values.reshape(n, words * PER_WORD).to(scale.dtype) - MAX_INT
    return values * scale.repeat_interleave(s.group_size, dim=1)
