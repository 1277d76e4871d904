"""The contract between the Matmul rule's analysis and the GEMM templates.

A template computes, for every row ``r < m`` and column ``c < n``::

    acc = sum_k float32(A[r, k]) * float32(B[c, k])      (b_layout "NT"; "NN": B[k, c])
    out.buffer[out.index(r, c)] = out.value(r, c, acc)

A is addressed as row-major ``m x k`` (all leading dimensions of the analysed A folded into its
rows), B as row-major ``n x k`` ("NT") or ``k x n`` ("NN"); both through flat element offsets, so
a template only needs ``access_ptr``. ``out.value`` is the fused epilogue (casts, bias, residual,
activation) as an expression of the fp32 accumulator; it may read other buffers of the function.

A "paired" epilogue (``out.pair_offset`` = n / 2, a gated MLP's ``silu(gate) * up``) combines
two accumulator columns into one output: for ``c < n / 2``::

    out.buffer[out.index(r, c)] = out.value(r, c, acc[r, c], acc[r, c + pair_offset])

and writes nothing else (the output is ``m x n / 2``). A template serving it arranges its tiles so
that the thread holding column ``c`` also holds ``c + pair_offset``.

A "norm prologue" (``GemmOperands.prologue``, ``passes.fuse_norm_gemv``) computes A itself: A is the
RMSNorm of ``x`` (plus a residual, whose sum the kernel also writes out), rounded to ``dtype``::

    t[r, k] = x[r, k] (+ residual[r, k])                     (in dtype; written to ``total``)
    A[r, k] = dtype(rsqrt(sum_k' float32(t[r, k'])^2 / k + eps) * float32(t[r, k]) * float32(weight[k]))

``a`` is then ``x`` (A's shape; A itself is never in memory). A float32 residual stream
(``NormPrologue.stream_dtype``, ``passes.residual_stream_fp32``): ``t`` is computed in float32 from
``x`` (float32, or of ``dtype`` where the stream starts) and the residual (of ``dtype``), and written
to ``total`` in float32. Only templates that say so
take a prologue; the analysis hands one out only to callers that ask for it.

A "dequantized B" (``GemmOperands.dequant``, a ``dequant.Dequant``) is computed from packed integer
words and group scales as the template loads it: ``b`` is the packed words, ``dequant.scale`` the
scales, and B[c, k] (NT) the value the function's dequantize computes, in ``dtype``. Only templates
that say so take one (``gemv_rows``, ``gemv``'s mma template, ``gemv_kn`` for the KN layout); the analysis hands one out only to callers that ask for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fuselight.errors import FuselightError

B_LAYOUTS = ("NT", "NN")
DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """Where and what a template writes for output element (row, col)."""

    buffer: Any  # tvm.tirx.Buffer
    index: Callable[[Any, Any], tuple]  # (row, col) -> the buffer's indices
    # (row, col, fp32 accumulator) -> value in buffer.dtype; paired: (row, col, acc, acc at col + pair_offset)
    value: Callable[..., Any]
    pair_offset: int | None = None  # n / 2 for a paired epilogue, else None


@dataclasses.dataclass(frozen=True)
class NormPrologue:
    """A computed as the RMSNorm of ``x`` (+ ``residual``) in the GEMM kernel (see the module docstring)."""

    x: Any  # tvm.tirx.Buffer, contiguous row-major, m rows of k, dtype ``GemmOperands.dtype`` or the stream's
    residual: Any | None  # tvm.tirx.Buffer like x, dtype ``GemmOperands.dtype``, added to it first; None: a plain RMSNorm
    weight: Any  # tvm.tirx.Buffer [k], the norm's weight, dtype ``GemmOperands.dtype``
    eps: float
    total: Any | None  # tvm.tirx.Buffer like x receiving x + residual (None exactly when residual is)

    @property
    def stream_dtype(self) -> str:
        """The dtype ``x + residual`` is computed and written in: ``total``'s (else ``x``'s)."""
        return str((self.total if self.total is not None else self.x).dtype)


@dataclasses.dataclass(frozen=True)
class GemmOperands:
    """One GEMM over the analysed function's buffers."""

    a: Any  # tvm.tirx.Buffer, dtype ``dtype`` (a prologue's x: or its stream's), contiguous row-major, rows = m
    b: Any  # tvm.tirx.Buffer, dtype ``dtype``, contiguous row-major, n x k or k x n
    m: Any  # PrimExpr (int or symbolic)
    n: int
    k: int
    b_layout: str  # one of B_LAYOUTS
    dtype: str  # one of DTYPES
    out: Epilogue | None  # None: a plain GEMM priced or tuned, never written
    prologue: NormPrologue | None = None  # A computed in the kernel (then ``a`` is ``prologue.x``)
    # B dequantized in the kernel from packed words (``dequant.Dequant``): ``b`` is then the packed
    # buffer, not n x k elements of ``dtype``, and ``n`` may be symbolic (a PrimExpr)
    dequant: Any | None = None

    @property
    def paired(self) -> bool:
        """Whether the epilogue pairs columns c and c + n / 2 (no epilogue given: a plain GEMM)."""
        return self.out is not None and self.out.pair_offset is not None

    @property
    def out_n(self) -> int:
        """Columns of the output: n, or n / 2 with a paired epilogue."""
        return self.out.pair_offset if self.paired else self.n

    def a_offset(self, row: Any, col: Any) -> Any:
        """Flat element offset of A[row, col]."""
        return row * self.k + col

    def b_offset(self, n_index: Any, k_index: Any) -> Any:
        """Flat element offset of the B element multiplying A[:, k_index] into column n_index."""
        if self.b_layout == "NT":
            return n_index * self.k + k_index
        return k_index * self.n + n_index


# A dequantized B the 4-bit GEMM templates take: 4-bit values 8 to a 32-bit word along K, in order (NK).
Q4_BITS, Q4_PER_WORD = 4, 8
Q4_STORAGE = ("uint32", "int32")
# The zero points the in-register conversions subtract exactly: 1024 + zero (fp16), 128 + zero (bf16).
Q4_MAX_ZERO = 127


def check_q4_words(ops: GemmOperands, template: str, group_multiple: int) -> None:
    """FuselightError, prefixed ``template``, unless ``ops``' dequantized B is 4-bit values 8 to a
    32-bit word along K in order (NK, B read as N x K), a constant integer zero point in
    0..Q4_MAX_ZERO, and groups of a multiple of ``group_multiple`` values."""
    deq = ops.dequant
    if (deq.bits, deq.per_word) != (Q4_BITS, Q4_PER_WORD) or deq.storage_dtype not in Q4_STORAGE:
        raise FuselightError(
            f"{template}: dequantize of {deq.bits}-bit values {deq.per_word} to a {deq.storage_dtype} "
            f"unsupported (supported: {Q4_BITS}-bit, {Q4_PER_WORD} to a 32-bit word)"
        )
    if not deq.nk_in_order or ops.b_layout != "NT":
        raise FuselightError(f"{template}: dequantize layout {deq.layout!r} (places {deq.places}, zero point "
                             f"buffer {deq.zeros is not None}) unsupported (supported: NK in order, a constant zero)")
    if deq.group % group_multiple:
        raise FuselightError(f"{template}: dequantize group {deq.group} is not a multiple of {group_multiple}")
    if deq.zero != int(deq.zero) or not 0 <= deq.zero <= Q4_MAX_ZERO:
        raise FuselightError(f"{template}: zero point {deq.zero} is not an integer in 0..{Q4_MAX_ZERO}")
