"""Test helper: MLC-LLM's q4f16_1 dequantize as a TE compute (and its float64 twin in numpy).

Weights ``[rows, K]`` packed eight 4-bit values to a uint32 along K (element ``e`` of a word in bits
``4e..4e+3``), one scale per group of ``GROUP`` along K, dequantized ``(float(q) - 7) * scale`` in
the scales' dtype (float16 for q4f16_1; float32 where a float32 graph needs it)."""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

GROUP = 32  # elements of K per scale
PER_WORD = 8  # 4-bit values per uint32


def dequantize(q: te.Tensor, s: te.Tensor) -> te.Tensor:
    """``(dtype((q[n, k // 8] >> 4 (k % 8)) & 15) - 7) * s[n, k // 32]``, dtype that of ``s``."""
    n, words = q.shape
    dtype = s.dtype

    def value(i, k):
        nibble = (q[i, k // PER_WORD] >> (k % PER_WORD * 4).astype("uint32")) & tirx.const(15, "uint32")
        return (nibble.astype(dtype) - tirx.const(7, dtype)) * s[i, k // GROUP]

    return te.compute((n, words * PER_WORD), value, name="dequantize")


def dequantize_numpy(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The same in float64: ``q`` uint32 ``[n, K / 8]``, ``s`` ``[n, K / 32]``, result ``[n, K]``."""
    shifts = np.arange(PER_WORD, dtype=np.uint32) * 4
    nibbles = (q[:, :, None] >> shifts) & np.uint32(15)  # [n, words, 8]: element e of each word
    values = nibbles.reshape(q.shape[0], -1).astype("float64") - 7.0
    return values * np.repeat(s.astype("float64"), GROUP, axis=1)
