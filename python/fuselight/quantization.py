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
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .errors import FuselightError

if TYPE_CHECKING:
    from tvm import te

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
    """FuselightError unless ``s`` can store an ``[n, k]`` weight (K whole groups)."""
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


def te_dequantize(q: te.Tensor, scale: te.Tensor, s: QuantScheme) -> te.Tensor:
    """The dequantized weight as one TE stage named ``dequantize``, in the stored orientation:
    ``[N, K]`` for NK, ``[K, N]`` for KN. The one definition the model's graph and the tests use.

    Written as MLC-LLM writes its own, ``(dtype(nibble) - dtype(7)) * scale``, in the model dtype,
    and named as MLC names it, so MLC's phase-3 fusions (and ours) treat both graphs alike."""
    from tvm import te, tirx

    axis = 1 if s.layout == "NK" else 0  # the packed (K) axis of q and scale
    shape = list(q.shape)
    shape[axis] = shape[axis] * PER_WORD
    mask = tirx.const((1 << BITS) - 1, STORAGE_DTYPE)
    zero = tirx.const(MAX_INT, s.model_dtype)

    def compute(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        k = idx[axis]

        def at(packed_k: tirx.PrimExpr) -> list[tirx.PrimExpr]:
            return [packed_k if a == axis else i for a, i in enumerate(idx)]

        shift = ((k % PER_WORD) * BITS).astype(STORAGE_DTYPE)
        nibble = tirx.bitwise_and(tirx.shift_right(q(*at(k // PER_WORD)), shift), mask)
        return (nibble.astype(s.model_dtype) - zero) * scale(*at(k // s.group_size))

    return te.compute(shape, compute, name="dequantize")


# Random stored nibbles are drawn from 0..14, what ``quantize`` produces (a group's largest magnitude
# maps to 0 or 14, never 15): values -7..7, mean 0, mean square (15**2 - 1) / 12.
_VALUE_MEAN_SQUARE = ((2 * MAX_INT + 1) ** 2 - 1) / 12
# Scales vary by a factor uniform in [0.5, 1.5] from group to group (mean square 13 / 12), so a
# mistake in which scale a weight takes changes the result.
_SCALE_SPREAD = 0.5
_SCALE_MEAN_SQUARE = 1 + _SCALE_SPREAD**2 / 3


def random_quantized(
    rng: np.random.Generator, n: int, k: int, std: float, s: QuantScheme
) -> tuple[np.ndarray, np.ndarray]:
    """Random ``(q, scale)`` in ``s``'s layout for an ``[n, k]`` weight whose dequantized values
    have RMS ``std`` (packed words of random nibbles; scales float32, for the caller to convert)."""
    check_weight_shape(s, n, k)
    values = rng.integers(0, 2 * MAX_INT + 1, size=(n, k), dtype=np.uint32)
    base = std / np.sqrt(_VALUE_MEAN_SQUARE * _SCALE_MEAN_SQUARE)
    spread = rng.uniform(1 - _SCALE_SPREAD, 1 + _SCALE_SPREAD, size=(n, k // s.group_size))
    q, scale = pack(values), (base * spread).astype(np.float32)
    return (q, scale) if s.layout == "NK" else (q.T.copy(), scale.T.copy())


def quantized_names(name: str) -> tuple[str, str]:
    """``X.weight`` -> ``(X.q_weight, X.q_scale)``, MLC-LLM's parameter names."""
    stem = name.removesuffix(".weight")
    return f"{stem}.q_weight", f"{stem}.q_scale"


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
