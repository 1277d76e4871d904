"""Weight quantization schemes: MLC-LLM's 4-bit group formats, their layout and arithmetic.

A scheme stores a float weight ``W[N, K]`` (out features x in features) as 4-bit integers packed
eight to a ``uint32`` (element ``e`` of a word in bits ``4e..4e+3``) along K, with one scale per
group of ``group_size`` consecutive K. Dequantized, ``W[n, k] = (q[n, k] - 7) * scale[n, k // g]``,
computed in the model dtype as MLC writes it: ``(dtype(q) - dtype(7)) * scale``. The ``NK`` layout
stores ``q[N, K / 8]`` and ``scale[N, K / g]``; ``KN`` (q4f16_0) stores both transposed,
``q[K / 8, N]`` and ``scale[K / g, N]`` (packed along K, then transposed, as MLC does). Quantizing takes the group's largest magnitude over 7 as its scale, and rounds
``w / scale + 7`` into 0..14, as MLC does.

AWQ (``q4f16_autoawq``, AutoAWQ's checkpoints as MLC-LLM reads them; layout ``KN_N``) stores
``W[N, K]`` as ``qweight[K, N / 8]``, 4-bit values packed along N (value ``n % 8`` of a word at
place ``AWQ_PLACES[n % 8]``, bits ``4 place..4 place + 3``), a zero point per group of 128 along K
packed alike, ``qzeros[K / 128, N / 8]``, and ``scales[K / 128, N]``: ``W[n, k] = (dtype(q) -
dtype(zero)) * scale``. Quantizing maps a group's range [min, max] onto 0..15 (AutoAWQ's
asymmetric rounding). It quantizes neither the embedding nor the LM head.

A scheme's parameters for one weight ``X.weight`` (``quantized_names``, in MLC's order): ``X.q_weight``,
``X.q_scale``; for AWQ ``X.qweight``, ``X.qzeros``, ``X.scales``. Every function below takes and
returns them as one tuple in that order (``stored``).

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
MAX_VALUE = (1 << BITS) - 1  # 15
STORAGE_DTYPE = "uint32"
# AWQ: the place in its word of value i = n % 8 (AutoAWQ packs values 0, 2, 4, 6, 1, 3, 5, 7 in
# places 0..7, so the pairs a conversion takes from places j and j + 4 are adjacent outputs).
AWQ_PLACES = tuple(i % 2 * 4 + i // 2 for i in range(PER_WORD))


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """One 4-bit group scheme (see the module docstring)."""

    name: str
    model_dtype: str  # "float16" or "bfloat16": the scales and the dequantized weights
    group_size: int
    layout: Literal["NK", "KN", "KN_N"]
    quantize_embedding: bool = True
    quantize_lm_head: bool = True

    @property
    def zero_points(self) -> bool:
        """Whether a packed zero point per group is stored (AWQ) instead of the constant 7."""
        return self.layout == "KN_N"

    def packed_shapes(self, n: int, k: int) -> tuple[tuple[int, int], ...]:
        """Shapes of the stored parameters (``quantized_names``' order) for an ``[n, k]`` weight."""
        check_weight_shape(self, n, k)
        if self.zero_points:
            groups = k // self.group_size
            return (k, n // PER_WORD), (groups, n // PER_WORD), (groups, n)
        q, s = (n, k // PER_WORD), (n, k // self.group_size)
        return (q, s) if self.layout == "NK" else (q[::-1], s[::-1])

    def weight_shape(self, packed: tuple[int, int]) -> tuple[int, int]:
        """The ``[N, K]`` weight whose packed words (the first stored parameter) have shape ``packed``."""
        if self.zero_points:
            return packed[1] * PER_WORD, packed[0]
        return (packed[0], packed[1] * PER_WORD) if self.layout == "NK" else (packed[1], packed[0] * PER_WORD)

    def packed_dtypes(self) -> tuple[str, ...]:
        """Dtypes of the stored parameters, in ``quantized_names``' order."""
        return (STORAGE_DTYPE, STORAGE_DTYPE, self.model_dtype) if self.zero_points else (STORAGE_DTYPE, self.model_dtype)


SCHEMES: dict[str, QuantScheme] = {
    s.name: s
    for s in [
        QuantScheme("q4f16_1", "float16", 32, "NK"),
        QuantScheme("q4bf16_1", "bfloat16", 32, "NK"),
        QuantScheme("q4f16_0", "float16", 32, "KN"),
        QuantScheme("q4f16_autoawq", "float16", 128, "KN_N", quantize_embedding=False, quantize_lm_head=False),
    ]
}
# Suffixes of the stored integer parameters, in every scheme.
PACKED_SUFFIXES = (".q_weight", ".qweight", ".qzeros")


def scheme(name: str | None) -> QuantScheme | None:
    """The scheme called ``name`` (None or "q0f16"/"q0bf16": no quantization); FuselightError otherwise."""
    if name is None or name in ("q0f16", "q0bf16", "none"):
        return None
    if name not in SCHEMES:
        raise FuselightError(f"unsupported quantization {name!r}: expected one of {', '.join(SCHEMES)} (or none)")
    return SCHEMES[name]


def check_weight_shape(s: QuantScheme, n: int, k: int) -> None:
    """FuselightError unless ``s`` can store an ``[n, k]`` weight (K whole groups; AWQ: N whole words)."""
    if k % s.group_size or k % PER_WORD or n < 1:
        raise FuselightError(f"{s.name}: a weight of shape [{n}, {k}] needs K a multiple of {s.group_size}")
    if s.zero_points and n % PER_WORD:
        raise FuselightError(f"{s.name}: a weight of shape [{n}, {k}] needs N a multiple of {PER_WORD}")


def quantize(w: np.ndarray, s: QuantScheme) -> tuple[np.ndarray, ...]:
    """The stored parameters (``quantized_names``' order) of a float ``[N, K]`` weight in ``s``'s
    layout (numpy; scales in float32 here, rounded to the model dtype by the caller's conversion)."""
    n, k = w.shape
    check_weight_shape(s, n, k)
    groups = w.astype(np.float32).reshape(n, k // s.group_size, s.group_size)
    if s.zero_points:
        lo, hi = groups.min(axis=-1), groups.max(axis=-1)
        scale = np.maximum(hi - lo, 1e-5) / MAX_VALUE
        zero = np.clip(np.rint(-lo / scale), 0, MAX_VALUE)
        values = np.clip(np.rint(groups / scale[..., None]) + zero[..., None], 0, MAX_VALUE).astype(np.uint32)
        return awq_stored(values.reshape(n, k), zero.astype(np.uint32), scale.astype(np.float32))
    scale = np.abs(groups).max(axis=-1) / MAX_INT
    safe = np.where(scale == 0, 1, scale)
    values = np.clip(np.rint(groups / safe[..., None] + MAX_INT), 0, 2 * MAX_INT).astype(np.uint32)
    q = pack(values.reshape(n, k))
    return (q, scale) if s.layout == "NK" else (q.T.copy(), scale.T.copy())


def awq_stored(values: np.ndarray, zeros: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, ...]:
    """AWQ's ``(qweight, qzeros, scales)`` of ``[N, K]`` values 0..15 and ``[N, K / group]`` zero
    points and scales."""
    return pack(values.T, AWQ_PLACES), pack(zeros.T, AWQ_PLACES), scale.T.copy()


def _shifts(places: tuple[int, ...] | None) -> np.ndarray:
    return np.array(places if places is not None else range(PER_WORD), dtype=np.uint32) * BITS


def pack(values: np.ndarray, places: tuple[int, ...] | None = None) -> np.ndarray:
    """``[R, C]`` integers in 0..15 -> ``[R, C / 8]`` uint32, value e of each 8 in bits 4p..4p+3 of its
    word, p = ``places[e]`` (default: p = e)."""
    n, k = values.shape
    v = values.astype(np.uint32).reshape(n, k // PER_WORD, PER_WORD)
    return np.bitwise_or.reduce(v << _shifts(places)[None, None, :], axis=-1).astype(np.uint32)


def unpack(q: np.ndarray, places: tuple[int, ...] | None = None) -> np.ndarray:
    """Inverse of ``pack``: ``[R, C / 8]`` uint32 -> ``[R, C]`` integers 0..15."""
    n, words = q.shape
    return ((q.astype(np.uint32)[..., None] >> _shifts(places)[None, None, :]) & 0xF).reshape(n, words * PER_WORD)


def dequantize(stored: tuple[np.ndarray, ...], s: QuantScheme) -> np.ndarray:
    """The float64 ``[N, K]`` weight that ``stored`` (``quantize``'s tuple; scales as stored, any
    float dtype) holds."""
    if s.zero_points:
        q, zeros, scale = stored
        values = unpack(q, AWQ_PLACES).T.astype(np.float64)  # [N, K]
        per_k = np.arange(values.shape[1]) // s.group_size
        return (values - unpack(zeros, AWQ_PLACES).T.astype(np.float64)[:, per_k]) * \
            np.asarray(scale, dtype=np.float64).T[:, per_k]
    q, scale = stored
    if s.layout == "KN":
        q, scale = q.T, scale.T
    values = unpack(q).astype(np.float64) - MAX_INT
    return values * np.repeat(np.asarray(scale, dtype=np.float64), s.group_size, axis=1)


def te_dequantize(stored: tuple[te.Tensor, ...], s: QuantScheme) -> te.Tensor:
    """The dequantized weight as one TE stage named ``dequantize``, in the stored orientation:
    ``[N, K]`` for NK, ``[K, N]`` for KN and KN_N. The one definition the model's graph and the tests use.

    Written as MLC-LLM writes its own, ``(dtype(nibble) - dtype(zero)) * scale``, in the model dtype,
    and named as MLC names it, so MLC's phase-3 fusions (and ours) treat both graphs alike."""
    from tvm import te, tirx

    mask = tirx.const((1 << BITS) - 1, STORAGE_DTYPE)

    def nibble(word: tirx.PrimExpr, shift: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.bitwise_and(tirx.shift_right(word, shift.astype(STORAGE_DTYPE)), mask).astype(s.model_dtype)

    if s.zero_points:
        q, zeros, scale = stored
        g = s.group_size

        def awq(k: tirx.PrimExpr, n: tirx.PrimExpr) -> tirx.PrimExpr:
            shift = (n % 2 * 4 + n % PER_WORD // 2) * BITS  # AWQ_PLACES, as MLC writes them
            return (nibble(q[k, n // PER_WORD], shift) - nibble(zeros[k // g, n // PER_WORD], shift)) * scale[k // g, n]

        return te.compute((q.shape[0], q.shape[1] * PER_WORD), awq, name="dequantize")
    q, scale = stored
    axis = 1 if s.layout == "NK" else 0  # the packed (K) axis of q and scale
    shape = list(q.shape)
    shape[axis] = shape[axis] * PER_WORD
    zero = tirx.const(MAX_INT, s.model_dtype)

    def compute(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        k = idx[axis]

        def at(packed_k: tirx.PrimExpr) -> list[tirx.PrimExpr]:
            return [packed_k if a == axis else i for a, i in enumerate(idx)]

        return (nibble(q(*at(k // PER_WORD)), (k % PER_WORD) * BITS) - zero) * scale(*at(k // s.group_size))

    return te.compute(shape, compute, name="dequantize")


# Random stored nibbles are drawn from 0..14, what ``quantize`` produces (a group's largest magnitude
# maps to 0 or 14, never 15): values -7..7, mean 0, mean square (15**2 - 1) / 12.
_VALUE_MEAN_SQUARE = ((2 * MAX_INT + 1) ** 2 - 1) / 12
# Scales vary by a factor uniform in [0.5, 1.5] from group to group (mean square 13 / 12), so a
# mistake in which scale a weight takes changes the result.
_SCALE_SPREAD = 0.5
_SCALE_MEAN_SQUARE = 1 + _SCALE_SPREAD**2 / 3


# AWQ's random values: 0..15 (mean square about their mean 7.5: (16**2 - 1) / 12) less a zero point
# of 7 or 8 a group (AutoAWQ's for weights about symmetric around 0): mean square 21.25 + 0.25.
_AWQ_VALUE_MEAN_SQUARE = ((MAX_VALUE + 1) ** 2 - 1) / 12 + 0.25


def random_quantized(
    rng: np.random.Generator, n: int, k: int, std: float, s: QuantScheme
) -> tuple[np.ndarray, ...]:
    """Random stored parameters (``quantize``'s tuple) for an ``[n, k]`` weight whose dequantized
    values have RMS ``std`` (packed words of random nibbles; scales float32, for the caller to convert)."""
    check_weight_shape(s, n, k)
    groups = (n, k // s.group_size)
    spread = rng.uniform(1 - _SCALE_SPREAD, 1 + _SCALE_SPREAD, size=groups)
    if s.zero_points:
        values = rng.integers(0, MAX_VALUE + 1, size=(n, k), dtype=np.uint32)
        zeros = rng.integers(MAX_INT, MAX_INT + 2, size=groups, dtype=np.uint32)
        base = std / np.sqrt(_AWQ_VALUE_MEAN_SQUARE * _SCALE_MEAN_SQUARE)
        return awq_stored(values, zeros, (base * spread).astype(np.float32))
    values = rng.integers(0, 2 * MAX_INT + 1, size=(n, k), dtype=np.uint32)
    base = std / np.sqrt(_VALUE_MEAN_SQUARE * _SCALE_MEAN_SQUARE)
    q, scale = pack(values), (base * spread).astype(np.float32)
    return (q, scale) if s.layout == "NK" else (q.T.copy(), scale.T.copy())


def quantized_names(name: str, s: QuantScheme | None = None) -> tuple[str, ...]:
    """``X.weight`` -> ``(X.q_weight, X.q_scale)``, MLC-LLM's parameter names; for a scheme with zero
    points (``s``, AWQ) ``(X.qweight, X.qzeros, X.scales)``."""
    stem = name.removesuffix(".weight")
    if s is not None and s.zero_points:
        return f"{stem}.qweight", f"{stem}.qzeros", f"{stem}.scales"
    return f"{stem}.q_weight", f"{stem}.q_scale"


def _pack_torch(values: Any, places: tuple[int, ...] | None = None) -> Any:
    """``pack`` on the GPU: ``[R, C]`` int64 values 0..15 -> ``[R, C / 8]`` uint32."""
    import torch

    r, c = values.shape
    shifts = torch.tensor(list(places if places is not None else range(PER_WORD)), device=values.device,
                          dtype=torch.int64) * BITS
    words = (values.reshape(r, c // PER_WORD, PER_WORD) << shifts).sum(dim=-1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32).view(torch.uint32)


def _unpack_torch(q: Any, places: tuple[int, ...] | None = None) -> Any:
    """``unpack`` on the GPU: ``[R, C / 8]`` uint32 -> ``[R, C]`` int64."""
    import torch

    r, words = q.shape
    shifts = torch.tensor(list(places if places is not None else range(PER_WORD)), device=q.device,
                          dtype=torch.int64) * BITS
    return ((q.view(torch.int32).to(torch.int64)[..., None] >> shifts) & 0xF).reshape(r, words * PER_WORD)


def quantize_torch(w: Any, s: QuantScheme) -> tuple[Any, ...]:
    """``quantize`` on the GPU: the stored parameters (uint32 words, scales in the weight's dtype)
    of a torch ``[N, K]`` weight; the benchmarks quantize random weights of 8B-parameter models with it."""
    import torch

    n, k = w.shape
    check_weight_shape(s, n, k)
    groups = w.float().reshape(n, k // s.group_size, s.group_size)
    if s.zero_points:
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((hi - lo).clamp(min=1e-5) / MAX_VALUE).to(w.dtype)
        zero = torch.clamp(torch.round(-lo / scale.float()), 0, MAX_VALUE)
        values = torch.clamp(torch.round(groups / scale.float()[..., None]) + zero[..., None], 0, MAX_VALUE)
        values = values.to(torch.int64).reshape(n, k)
        return (_pack_torch(values.T.contiguous(), AWQ_PLACES),
                _pack_torch(zero.to(torch.int64).T.contiguous(), AWQ_PLACES), scale.T.contiguous())
    scale = (groups.abs().amax(dim=-1) / MAX_INT).to(w.dtype)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    values = torch.clamp(torch.round(groups / safe[..., None] + MAX_INT), 0, 2 * MAX_INT).to(torch.int64)
    q = _pack_torch(values.reshape(n, k))
    return (q, scale) if s.layout == "NK" else (q.T.contiguous(), scale.T.contiguous())


def dequantize_torch(stored: tuple[Any, ...], s: QuantScheme) -> Any:
    """``dequantize`` on the GPU, ``[N, K]`` in the scales' dtype as the kernels compute it:
    ``(q - zero) * scale``."""
    if s.zero_points:
        q, zeros, scale = stored
        values = _unpack_torch(q, AWQ_PLACES).to(scale.dtype)  # [K, N]
        zero = _unpack_torch(zeros, AWQ_PLACES).to(scale.dtype).repeat_interleave(s.group_size, dim=0)
        return ((values - zero) * scale.repeat_interleave(s.group_size, dim=0)).T.contiguous()
    q, scale = stored
    if s.layout == "KN":
        q, scale = q.T, scale.T
    values = _unpack_torch(q).to(scale.dtype) - MAX_INT
    return values * scale.repeat_interleave(s.group_size, dim=1)
