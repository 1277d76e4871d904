"""The GEMV template for one token row: weight rows streamed along K, 512 contiguous bytes a load.

``rows_body(ops, cfg)`` computes ``ops`` (NT weights, M = 1; the bucket's ``rows_per_warp`` is set)
in one launch. Each warp owns ``cfg.rows_per_warp`` output columns and streams their weight rows
(with a paired ``silu(gate) * up`` epilogue, the gate row and the up row of each column): lane l
loads the 16-byte piece ``32 s + l`` of a row at step s, so one load instruction of a warp reads
512 contiguous bytes, ``cfg.unroll`` steps of every row in flight before they are used. The token
row sits in shared memory (copied once a block, or normed into it by the norm prologue of
``gemv.norm_prologue``); products are summed in float32, then over the warp's lanes by butterfly
shuffles, and the column's lane runs the epilogue.

A bucket with ``prefetch_l2_percent`` also has each warp ask L2 for that share of its weight rows
(``cp.async.bulk.prefetch.L2``) and only then wait for the grid before it (``griddepcontrol.wait``;
the TIR pipeline adds no second wait). Launched early behind the decode attention's merge kernel, whose
blocks let it launch once they have their inputs, o_proj's blocks so stream weights while the merge
runs. The prefetches take warp-uniform addresses and sit in no branch: so placed, ptxas keeps every
load after the wait (``fuselight.pdl_audit`` checks the SASS; with a branch on the lane it moved the
norm prologue's loads above it).

Why beside the mma template: at M = 1 the tensor cores buy nothing, and there its rows-of-16 layout
(64 bytes of each of 16 rows a load) streamed the decode step's smaller projections slower than
whole-row streaming (``configs/gemm/gemv.json`` has the numbers).
"""

from __future__ import annotations

from typing import Any

from .gemv import PIECE, GemvConfig, index_dtype, norm_prologue
from .operands import GemmOperands
from .plan import WARP

LOG_WARP = WARP.bit_length() - 1  # butterfly rounds over a warp's lanes
PREFETCH_L2 = "fuselight_prefetch_l2"
PREFETCH_L2_SOURCE = f"""
__forceinline__ __device__ void {PREFETCH_L2}(const void* p, unsigned int bytes) {{
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}}
"""


def rows_grid_blocks(ops: GemmOperands, cfg: GemvConfig) -> int:
    """Blocks of the row-streaming grid: ``cfg.warps`` x ``cfg.rows_per_warp`` output columns each."""
    return -(-ops.out_n // (cfg.warps * cfg.rows_per_warp))


def rows_body(ops: GemmOperands, cfg: GemvConfig) -> Any:
    """The kernel body (a ``tvm.tirx.Stmt``) computing ``ops`` (M = 1) over ``ops``' buffers; call
    it through ``gemv.gemv_body``, which checks first that the template serves ``ops``."""
    from tvm.backend.cuda import op as cuda_op
    from tvm.script import tirx as T

    n, k, dtype = ops.n, ops.k, ops.dtype
    norm, pair = ops.prologue, ops.out.pair_offset
    warps, unroll, cols_w = cfg.warps, cfg.unroll, cfg.rows_per_warp
    rows_w = cols_w if pair is None else 2 * cols_w  # weight rows a warp streams
    threads = warps * WARP
    pieces = k // PIECE  # 16-byte pieces of a row
    rounds = -(-pieces // (WARP * unroll))
    ragged = pieces % (WARP * unroll) != 0
    blocks = rows_grid_blocks(ops, cfg)
    out_n = ops.out_n
    m_dtype = index_dtype(ops)
    # The token row: copied (a thread's pieces of it), or normed by the prologue (row 0 at 0).
    copy_pieces = -(-pieces // threads)
    norm_rows = None if norm is None else norm_prologue(ops, threads, blocks, k // 2)

    def weight_row(col0, j):
        # Row j of the warp whose first output column is col0 (columns past the end read the last
        # one and are never stored); paired: j < cols_w the gate rows, then the up rows.
        if pair is None:
            return T.min(col0 + j, n - 1)
        return T.min(col0 + j % cols_w, pair - 1) + j // cols_w * pair

    prefetch_bytes = pieces * (cfg.prefetch_l2_percent or 0) // 100 * PIECE * 2  # whole pieces of a row

    @T.macro
    def load_round(w, W, col0, lane, r):
        for u in T.unroll(unroll):
            p: T.let[T.int32] = (r * unroll + u) * WARP + lane
            if not ragged or p < pieces:
                for j in T.unroll(rows_w):
                    for e in T.vectorized(PIECE):
                        w[(j * unroll + u) * PIECE + e] = W[T.Cast("int64", weight_row(col0, j)) * k + p * PIECE + e]

    # fmt: off
    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        W = T.decl_buffer((n * k,), dtype, data=ops.b.data)
        if norm is None:
            X = T.decl_buffer((k,), dtype, data=ops.a.data)  # token row 0
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tid in T.thread_binding(threads, thread="threadIdx.x"):
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", cfg.min_blocks_per_sm), T.sblock("gemv_rows"):
                    T.reads()
                    T.writes()
                    w = T.sblock_alloc_buffer((rows_w * unroll * PIECE,), dtype, scope="local")
                    xv = T.sblock_alloc_buffer((PIECE,), dtype, scope="local")
                    acc = T.sblock_alloc_buffer((rows_w,), "float32", scope="local")
                    xs = T.sblock_alloc_buffer((k,), dtype, scope="shared")
                    warp: T.let[T.int32] = T.Cast("int32", tid) // WARP
                    lane: T.let[T.int32] = T.Cast("int32", tid) % WARP
                    col0: T.let[T.int32] = (T.Cast("int32", bx) * warps + warp) * cols_w
                    if prefetch_bytes > 0:
                        for j in T.unroll(rows_w):
                            T.evaluate(cuda_op.cuda_func_call(
                                PREFETCH_L2, W.access_ptr("r", offset=T.Cast("int64", weight_row(col0, j)) * k),
                                T.uint32(prefetch_bytes), source_code=PREFETCH_L2_SOURCE))
                        T.ptx.griddepcontrol.wait()
                    # The first round's weights are in flight while the token row is staged.
                    load_round(w, W, col0, lane, 0)
                    if norm is None:
                        for i in T.unroll(copy_pieces):
                            p: T.let[T.int32] = i * threads + T.Cast("int32", tid)
                            if p < pieces:
                                for e in T.vectorized(PIECE):
                                    xs[p * PIECE + e] = X[p * PIECE + e]
                    else:
                        norm_rows(xs, tid, bx)
                    T.tvm_storage_sync("shared")
                    for j in T.unroll(rows_w):
                        acc[j] = T.float32(0)
                    for r in T.serial(rounds):
                        if r > 0:
                            load_round(w, W, col0, lane, r)
                        for u in T.unroll(unroll):
                            p: T.let[T.int32] = (r * unroll + u) * WARP + lane
                            if not ragged or p < pieces:
                                for e in T.vectorized(PIECE):
                                    xv[e] = xs[p * PIECE + e]
                                for j in T.unroll(rows_w):
                                    for e in T.unroll(PIECE):
                                        acc[j] = acc[j] + T.Cast("float32", w[(j * unroll + u) * PIECE + e]) * T.Cast("float32", xv[e])
                    # Butterfly sums: every lane ends with its warp's row totals.
                    for sh in T.unroll(LOG_WARP):
                        for j in T.unroll(rows_w):
                            acc[j] = acc[j] + T.tvm_warp_shuffle_xor(
                                T.tvm_warp_activemask(), acc[j], T.shift_right(WARP, sh + 1), WARP, WARP)
                    for j in T.unroll(cols_w):
                        if lane == j and col0 + j < out_n:
                            if pair is None:
                                ops.out.buffer[ops.out.index(T.Cast(m_dtype, 0), T.Cast(m_dtype, col0 + j))] = ops.out.value(
                                    T.Cast(m_dtype, 0), T.Cast(m_dtype, col0 + j), acc[j])
                            else:
                                ops.out.buffer[ops.out.index(T.Cast(m_dtype, 0), T.Cast(m_dtype, col0 + j))] = ops.out.value(
                                    T.Cast(m_dtype, 0), T.Cast(m_dtype, col0 + j), acc[j], acc[j + cols_w])
    # fmt: on
    return body.body
