"""What the two GEMV templates (``gemv``: mma, M up to 16; ``gemv_rows``: row streaming, M = 1)
share: the 16-byte piece a lane loads, the 4-bit weights they dequantize, a bucket's config
(``configs/gemm/gemv.json``), the output's index dtype and the norm prologue."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tvm.script import tirx as T

from .operands import GemmOperands

MMA_N = 8  # mma.sync.m16n8k16: tokens per tile of the mma template
PIECE_WORDS = 4  # 16 bytes as 32-bit registers
PIECE = 2 * PIECE_WORDS  # 16-bit elements of a piece
WIDE_LANES = PIECE_WORDS  # float32 elements of 16 bytes: a piece of a float32 stream is two such loads
# What the templates dequantize: 4-bit values, 8 to a uint32 word along K (``NK``), a scale per
# group of a multiple of 32 (a lane's 16-byte piece of words is 32 values, within one group), an
# integer zero point the float dtype subtracts exactly.
Q4_BITS, Q4_PIECE = 4, 32


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One M bucket's config (``configs/gemm/gemv.json``)."""

    max_m: int  # the largest M served (at most 16): one token tile up to 8, two above
    warps: int  # warps a block's K steps are split over (a power of two; halved until they divide K)
    unroll: int  # K steps whose loads a warp issues before using them (16 bytes x 3-4 a step)
    # Blocks one SM must be able to hold (the launch-bounds hint to ptxas, which otherwise budgets
    # registers for full occupancy and delays loads to fit): 1 keeps every unrolled load in flight.
    min_blocks_per_sm: int
    # Serves only grids of at most this many blocks (None: any). Small grids fit on the GPU at
    # once with fewer warps a block and more blocks an SM; large ones stream best with many warps.
    max_blocks: int | None = None
    # Serves only K of at most this many elements (None: any); of buckets alike in M and grid, the
    # smallest max_k that fits wins.
    max_k: int | None = None
    # Set: the row-streaming template (``gemv_rows``, M = 1 only), where a warp owns this many output
    # columns and streams their weight rows along K, 512 contiguous bytes a load; ``warps`` are then
    # the block's warps (one column group each) and ``unroll`` the 512-byte steps of each row in
    # flight. None: the mma template above.
    rows_per_warp: int | None = None
    # mma template: consecutive K steps of a warp whose pieces a lane reads as one contiguous span
    # (halved until it divides ``unroll`` and the warp's steps). 1: the four lanes of a row read 64
    # adjacent bytes a step; r: each lane reads 16 r contiguous bytes, a row 64 r bytes a run.
    lane_run: int = 1
    # Row template: the percentage of each weight row its warp asks L2 for (one bulk prefetch a row,
    # sm_90) before the kernel waits for the grid before it. Pays only where that grid lets this one
    # launch early and leaves memory idle meanwhile (the decode attention's merge, before o_proj);
    # elsewhere it duplicates the first loads. None: no prefetch, and the wait is the pipeline's.
    prefetch_l2_percent: int | None = None
    # Row template: a warp issues K round r + 1's loads before computing round r (twice the weight
    # registers), so its loads and arithmetic overlap where K takes more than one round.
    double_buffer: bool = False
    # Row template: a grid of this many blocks an SM (times the device's SM count; never more blocks
    # than column groups), each looping over the column groups in strides of the grid. Where the
    # groups outnumber the blocks resident at once, the grid then runs no partial last wave, every
    # block stages the token row once, and with ``double_buffer`` a warp loads its next group's
    # first round while computing its last (so even one round a row overlaps). None: a block a
    # column group.
    grid_blocks_per_sm: int | None = None
    # Row template, 4-bit weights and fp16 tokens: each word's 8 products summed in fp16 (``hfma2``, 4
    # products a half), those sums added in float32. Near the copy rate the float32 dot is bound by
    # the SM's issue rate (about 4 instructions a weight); this takes about 2.5, at about twice the
    # rounding error (a product of at most 8 x |token|, 4 to a half-precision sum).
    half_sums: bool = False
    # Serves only tokens of this dtype (None: any). Where fp16 and bf16 want different settings of
    # one bucket (the 4-bit row template's fp16 half sums against bf16's float32 dot), the bucket
    # for one dtype comes first among those alike in max_m, max_blocks and max_k.
    dtype: str | None = None
    # mma template: 16-row tiles a block owns. Its warps' token fragments of a K step feed every
    # tile, so the token rows, read from L2 by every block (at M = 16 four times the bytes of one
    # tile's weights), are read once per ``row_tiles`` tiles.
    row_tiles: int = 1

    @property
    def token_tiles(self) -> int:
        return -(-self.max_m // MMA_N)


def index_dtype(ops: GemmOperands) -> str:
    """The dtype of the output's row and column indices: M's, or int64 for a static M."""
    return "int64" if isinstance(ops.m, int) else str(ops.m.ty.dtype)


def static_m(ops: GemmOperands) -> int | None:
    """M where it is static (an int or an IntImm), else None."""
    m = ops.m
    if isinstance(m, int):
        return m
    return int(m.value) if hasattr(m, "value") else None


def norm_prologue(ops: GemmOperands, threads: int, blocks: Any, x_stride: int,
                  staging: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None) -> Any:
    """The GEMV templates' norm prologue (``ops.prologue``, static M) as a TIR macro
    ``norm_rows(xs, tid, bx)``: thread ``tid`` of block ``bx`` (of ``blocks``, ``threads`` each)
    reads its pieces of the M rows of ``x`` (+ the residual) in 16-byte pieces, the block sums the
    squares of ``x + r`` in float32, and writes the normed rows, rounded to the activation dtype as
    the norm kernel rounds them, to the shared buffer ``xs`` (row ``r`` at ``2 r x_stride``
    elements). ``x + r`` is written out in slices, one per block. The caller syncs the block after.
    A float32 stream (``NormPrologue.stream_dtype``): ``x + r`` is summed, squared and written in
    float32 (``x`` read as float32 or widened from the activation dtype), a piece's 8 elements
    loaded and stored 16 bytes at a time; the normed rows are rounded as before.

    staging: ``(slot, order)`` where the template reads its token row permuted (the row template's
    4-bit dot product): piece ``p`` of 8 tokens goes to piece ``slot(p)``, its element ``e`` being
    token ``order(e)`` of the piece; None: in order."""
    norm, k, dtype = ops.prologue, ops.k, ops.dtype
    stream, x_dtype = norm.stream_dtype, str(norm.x.dtype)
    wide, x_wide = stream != dtype, x_dtype != dtype
    halves = PIECE // WIDE_LANES
    rows_p = static_m(ops)
    pieces = k // PIECE
    thread_pieces = -(-pieces // threads)
    slice_pieces = -(-(rows_p * pieces) // blocks)

    # fmt: off
    @T.macro
    def norm_rows(xs, tid, bx):
        Xg = T.decl_buffer((rows_p * k,), x_dtype, data=norm.x.data)
        Wn = T.decl_buffer((k,), dtype, data=norm.weight.data)
        if norm.residual is not None:
            Rg = T.decl_buffer((rows_p * k,), dtype, data=norm.residual.data)
            Tg = T.decl_buffer((rows_p * k,), stream, data=norm.total.data)
        t_reg = T.sblock_alloc_buffer((thread_pieces * PIECE,), stream, scope="local")
        piece = T.sblock_alloc_buffer((PIECE,), dtype, scope="local")
        if staging is not None:
            staged = T.sblock_alloc_buffer((PIECE,), dtype, scope="local")
        part = T.sblock_alloc_buffer((1,), "float32", scope="local")
        ssq = T.sblock_alloc_buffer((1,), "float32", scope="local")
        for row in T.serial(rows_p):
            part[0] = T.float32(0)
            for i in T.unroll(thread_pieces):
                p: T.let[T.int32] = i * threads + T.Cast("int32", tid)
                if p < pieces:
                    if x_wide:
                        for h in T.unroll(halves):
                            for e in T.vectorized(WIDE_LANES):
                                t_reg[i * PIECE + h * WIDE_LANES + e] = Xg[row * k + p * PIECE + h * WIDE_LANES + e]
                    elif wide:
                        for e in T.vectorized(PIECE):
                            piece[e] = Xg[row * k + p * PIECE + e]
                        for e in T.unroll(PIECE):
                            t_reg[i * PIECE + e] = T.Cast(stream, piece[e])
                    else:
                        for e in T.vectorized(PIECE):
                            t_reg[i * PIECE + e] = Xg[row * k + p * PIECE + e]
                    if norm.residual is not None:
                        for e in T.vectorized(PIECE):
                            piece[e] = Rg[row * k + p * PIECE + e]
                        if wide:
                            for e in T.unroll(PIECE):
                                t_reg[i * PIECE + e] = t_reg[i * PIECE + e] + T.Cast(stream, piece[e])
                        else:
                            for e in T.unroll(PIECE):
                                t_reg[i * PIECE + e] = t_reg[i * PIECE + e] + piece[e]
                        if bx * slice_pieces <= row * pieces + p and row * pieces + p < (bx + 1) * slice_pieces:
                            if wide:
                                for h in T.unroll(halves):
                                    for e in T.vectorized(WIDE_LANES):
                                        Tg[row * k + p * PIECE + h * WIDE_LANES + e] = t_reg[i * PIECE + h * WIDE_LANES + e]
                            else:
                                for e in T.vectorized(PIECE):
                                    Tg[row * k + p * PIECE + e] = t_reg[i * PIECE + e]
                    for e in T.unroll(PIECE):
                        part[0] = part[0] + T.Cast("float32", t_reg[i * PIECE + e]) * T.Cast("float32", t_reg[i * PIECE + e])
            with T.sblock("norm_sum"):
                T.reads(part[0])
                T.writes(ssq[0])
                T.attr(T.comm_reducer(lambda a0, b0: a0 + b0, [T.float32(0)]), "reduce_scope", T.int32(0))
                T.tvm_thread_allreduce(T.uint32(1), part[0], True, ssq[0], tid, dtype="void")
            # As TOPI's rms_norm: rsqrt(mean + eps) * float32(t) * float32(w), rounded once.
            # (A register: TVM lowers ``ssq`` to shared memory, which a store would race on.)
            rstd: T.let[T.float32] = T.rsqrt(ssq[0] / T.float32(k) + T.float32(norm.eps))
            for i in T.unroll(thread_pieces):
                p: T.let[T.int32] = i * threads + T.Cast("int32", tid)
                if p < pieces:
                    for e in T.vectorized(PIECE):
                        piece[e] = Wn[p * PIECE + e]
                    for e in T.unroll(PIECE):
                        piece[e] = T.Cast(dtype, rstd * T.Cast("float32", t_reg[i * PIECE + e]) * T.Cast("float32", piece[e]))
                    if staging is None:
                        for e in T.vectorized(PIECE):
                            xs[row * x_stride * 2 + p * PIECE + e] = piece[e]
                    else:
                        for e in T.unroll(PIECE):
                            staged[e] = piece[staging[1](e)]
                        for e in T.vectorized(PIECE):
                            xs[row * x_stride * 2 + staging[0](p) * PIECE + e] = staged[e]
    # fmt: on
    return norm_rows
