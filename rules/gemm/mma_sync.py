"""The mma.sync GEMM template: a kernel body over the analysed function's own buffers.

``mma_sync_gemm(ops, plan)`` computes ``ops`` (see ``operands``) with ``mma.sync.m16n8k16``
(fp16/bf16 in, fp32 accumulate). A block's A and B slices stream into XOR-swizzled shared memory
by 16-byte ``cp.async`` through a ``stages``-deep pipeline; warps load their operands with
``ldmatrix`` (8 rows of 16 bytes in 8 different bank groups); the fp32 output tile is staged in
shared memory so that the epilogue (``ops.out.value``) runs per element and each thread stores 16
contiguous bytes. M is dynamic: one launch runs ``plan.main`` tiles over the whole multiples of
``main.block_m`` (in groups of ``RASTER_GROUP`` tile rows walked column by column, so concurrent
blocks share A rows and B columns in L2) and ``plan.rest`` tiles over the rows after them; rows
past M are zero-filled in shared memory and never stored. N and K are static multiples of the
tiles (checked): their loops are specialised, nothing but M is predicated. With ``split_k`` > 1
each block sums a K range into an fp32 workspace, and a second launch reduces it and runs the
epilogue (``split_k``).
"""

from __future__ import annotations

from typing import Any

from .operands import GemmOperands
from .plan import (
    CHUNK,
    EPILOGUE_ROW_PAD,
    MMA_K,
    MMA_M,
    MMA_N,
    WARP,
    GemmPlan,
    GemmTile,
    check_plan,
)
from .split_k import reduction, rows

# Tile rows a group of blocks covers before moving to the next column of tiles (L2 reuse).
RASTER_GROUP = 8
# Rows of 16-byte pieces whose XOR patterns differ: the 8 bank groups of a 128-byte line.
SWIZZLE_GROUPS = 8
DTYPE_ABBREV = {"float16": "fp16", "bfloat16": "bf16"}


def _tile_code(ops: GemmOperands, tile: GemmTile, split_k: int, predicated: bool):
    """Macros of one tile shape: ``compute`` (the pipelined main loop) and ``store`` (epilogue).

    ``predicated``: rows at or past M are zero-filled when loaded and skipped when stored.
    """
    from tvm.script import tirx as T

    bm, bn, bk, threads = tile.block_m, tile.block_n, tile.block_k, tile.threads
    wm, wn, stages = tile.warp_m, tile.warp_n, tile.stages
    chunks = bk // CHUNK
    # Rows sharing a 128-byte line: the XOR pattern changes every that many rows.
    rows_per_line = max(1, SWIZZLE_GROUPS // chunks)
    a_loads, b_loads = bm * chunks // threads, bn * chunks // threads
    a_stage, b_stage = bm * bk, bn * bk
    b_base = stages * a_stage
    k_tiles = ops.k // split_k // bk
    k_steps = bk // MMA_K
    mi, nj = wm // MMA_M, wn // MMA_N
    ld_c = bn + EPILOGUE_ROW_PAD
    out_pieces = bm * bn // CHUNK // threads
    ab = DTYPE_ABBREV[ops.dtype]
    n, dtype = ops.n, ops.dtype
    m, wide = rows(ops)

    def in_rows(row):
        # Python True (no branch at all) where every row of the tile is below M.
        return row < m if predicated else True

    def swz(row, chunk):
        # 16-byte piece ``chunk`` of ``row`` is stored at chunk ^ f(row): the 8 rows an ldmatrix
        # reads (same chunk, consecutive rows) land in 8 different bank groups.
        return row * bk + T.bitwise_xor(chunk, (row // rows_per_line) % chunks) * CHUNK

    @T.macro
    def load_slice(smem, slot, k0, row0, col0, tid):
        for it in T.unroll(a_loads):
            row = (it * threads + tid) // chunks
            c = (it * threads + tid) % chunks
            if predicated:
                T.ptx.cp_async(
                    smem.access_ptr("w", offset=slot * a_stage + swz(row, c)),
                    ops.a.access_ptr("r", offset=ops.a_offset(wide(T.min(row0 + row, m - 1)), k0 + c * CHUNK)),
                    16,
                    predicate=row0 + row < m,
                    fill_mode="zero",
                )
            else:
                T.ptx.cp_async(
                    smem.access_ptr("w", offset=slot * a_stage + swz(row, c)),
                    ops.a.access_ptr("r", offset=ops.a_offset(wide(row0 + row), k0 + c * CHUNK)),
                    16,
                )
        for it in T.unroll(b_loads):
            row = (it * threads + tid) // chunks
            c = (it * threads + tid) % chunks
            T.ptx.cp_async(
                smem.access_ptr("w", offset=b_base + slot * b_stage + swz(row, c)),
                ops.b.access_ptr("r", offset=ops.b_offset(col0 + row, k0 + c * CHUNK)),
                16,
            )

    @T.macro
    def ldmatrix_x4(frag, frag_offset, smem, smem_offset):
        T.ptx.ldmatrix_legacy(
            False, 4, ".b16", frag.data, frag_offset, smem.access_ptr("r"), smem_offset, dtype=dtype
        )

    @T.macro
    def load_fragments(smem, slot, kk, Af, Bf, buf, warp_row, warp_col, lane):
        for i in T.unroll(mi):
            # Lanes 0-15 address rows 0-15 at k 0-7, lanes 16-31 the same rows at k 8-15.
            ldmatrix_x4(
                Af, (buf * mi + i) * 8, smem,
                slot * a_stage + swz(warp_row + i * MMA_M + lane % 16, kk * 2 + lane // 16),
            )  # fmt: skip
        for j in T.unroll(nj // 2):
            # Two n tiles of 8 B rows each, k 0-7 and 8-15: the col operands of two mma tiles.
            ldmatrix_x4(
                Bf, (buf * nj // 2 + j) * 8, smem,
                b_base + slot * b_stage
                + swz(warp_col + j * 2 * MMA_N + (lane // 16) * 8 + lane % 8, kk * 2 + (lane // 8) % 2),
            )  # fmt: skip

    @T.macro
    def compute(smem, Af, Bf, acc, row0, col0, k_begin, tid):
        # acc = this warp's piece of A[row0:, k range] x B[col0:, k range]^T, staged in shared memory.
        warp: T.let[T.int32] = tid // WARP
        lane: T.let[T.int32] = tid % WARP
        warp_row: T.let[T.int32] = warp // tile.warps_n * wm
        warp_col: T.let[T.int32] = warp % tile.warps_n * wn
        for i in T.unroll(mi * nj * 4):
            acc[i] = T.float32(0)
        # Always stages - 1 groups (empty past the last slice): the waits below count on it.
        for s in T.unroll(stages - 1):
            if s < k_tiles:
                load_slice(smem, s, k_begin + s * bk, row0, col0, tid)
            T.ptx.cp_async.commit_group()
        T.ptx.cp_async.wait_group(stages - 2)
        T.tvm_storage_sync("shared")
        load_fragments(smem, 0, 0, Af, Bf, 0, warp_row, warp_col, lane)
        for kt in T.serial(k_tiles):
            for kk in T.unroll(k_steps):
                if kk == 0:
                    # Every warp is past the barrier that followed its last read of slice kt - 1:
                    # refill that buffer. (An empty group keeps the count wait_group relies on.)
                    if kt + (stages - 1) < k_tiles:
                        load_slice(
                            smem, (kt + (stages - 1)) % stages, k_begin + (kt + (stages - 1)) * bk, row0, col0, tid
                        )
                    T.ptx.cp_async.commit_group()
                if kk == k_steps - 1:
                    # Slice kt + 1 has landed and is visible to all warps.
                    T.ptx.cp_async.wait_group(stages - 2)
                    T.tvm_storage_sync("shared")
                # Operands of the next k step (the next slice's first) load while this one multiplies.
                if kk + 1 < k_steps:
                    load_fragments(smem, kt % stages, kk + 1, Af, Bf, (kk + 1) % 2, warp_row, warp_col, lane)
                elif kt + 1 < k_tiles:
                    load_fragments(smem, (kt + 1) % stages, 0, Af, Bf, (kk + 1) % 2, warp_row, warp_col, lane)
                for i in T.unroll(mi):
                    for j in T.unroll(nj):
                        T.ptx.mma.legacy(
                            "m16n8k16", "row", "col", ab, ab, "fp32",
                            Af.data, (kk % 2 * mi + i) * 8, Bf.data, (kk % 2 * nj + j) * 4, acc.data,
                            (i * nj + j) * 4, False, dtype="float32",
                        )  # fmt: skip
        T.ptx.cp_async.wait_group(0)
        T.tvm_storage_sync("shared")
        # Stage the fp32 tile (thread holds rows lane / 4 and + 8, columns 2 (lane % 4) and + 1).
        C_smem = T.decl_buffer((tile.epilogue_floats,), "float32", data=smem.data, scope="shared.dyn")
        for i in T.unroll(mi):
            for j in T.unroll(nj):
                for h in T.unroll(2):
                    for e in T.vectorized(2):
                        C_smem[(warp_row + i * MMA_M + lane // 4 + h * 8) * ld_c + warp_col + j * MMA_N + (lane % 4) * 2 + e] = acc[(i * nj + j) * 4 + h * 2 + e]  # fmt: skip
        T.tvm_storage_sync("shared")

    @T.macro
    def store(smem, row0, col0, tid, out_buf):
        # Epilogue of the staged tile: CHUNK adjacent outputs a thread, 16-byte stores.
        C_smem = T.decl_buffer((tile.epilogue_floats,), "float32", data=smem.data, scope="shared.dyn")
        for it in T.unroll(out_pieces):
            row: T.let[T.int32] = (it * threads + tid) // (bn // CHUNK)
            col: T.let[T.int32] = (it * threads + tid) % (bn // CHUNK) * CHUNK
            if in_rows(row0 + row):
                for e in T.vectorized(CHUNK):
                    out_buf[ops.out.index(wide(row0 + row), wide(col0 + col + e))] = ops.out.value(
                        wide(row0 + row), wide(col0 + col + e), C_smem[row * ld_c + col + e]
                    )

    @T.macro
    def store_partial(smem, row0, col0, tid, part, split):
        # The staged tile as split ``split``'s fp32 partial sums (a second launch reduces them).
        C_smem = T.decl_buffer((tile.epilogue_floats,), "float32", data=smem.data, scope="shared.dyn")
        for it in T.unroll(out_pieces):
            row: T.let[T.int32] = (it * threads + tid) // (bn // CHUNK)
            col: T.let[T.int32] = (it * threads + tid) % (bn // CHUNK) * CHUNK
            if in_rows(row0 + row):
                for e in T.vectorized(CHUNK):
                    part[wide(split * m + row0 + row) * n + col0 + col + e] = C_smem[row * ld_c + col + e]

    return compute, store, store_partial


def _fragments(tile: GemmTile, dtype: str):
    """Per-thread registers of one tile shape (call inside the block's ``sblock``)."""
    from tvm.script import tirx as T

    mi, nj = tile.warp_m // MMA_M, tile.warp_n // MMA_N
    return (
        T.sblock_alloc_buffer((2 * mi * 8,), dtype, scope="local"),  # A operands of two k steps
        T.sblock_alloc_buffer((2 * nj * 4,), dtype, scope="local"),  # B operands of two k steps
        T.sblock_alloc_buffer((mi * nj * 4,), "float32", scope="local"),  # accumulators
    )


def mma_sync_gemm(ops: GemmOperands, plan: GemmPlan) -> Any:
    """The kernel body (a ``tvm.tirx.Stmt``) computing ``ops`` with ``plan``: one launch, two with
    ``split_k`` > 1. It uses ``ops``' buffers; bind it to the analysed function's parameters.

    FuselightError if ``plan`` cannot tile ``ops`` (see ``plan.check_plan``).
    """
    from tvm.script import tirx as T

    check_plan(plan, ops)
    main, rest, split_k = plan.main, plan.rest, plan.split_k
    n, dtype = ops.n, ops.dtype
    m, _ = rows(ops)
    out_buf = ops.out.buffer
    threads = main.threads
    smem_halves = max(t.shared_bytes for t in (main, rest) if t is not None) // 2
    reduce_blocks = reduction(ops, split_k) if split_k > 1 else None
    main_compute, main_store, main_partial = _tile_code(ops, main, split_k, predicated=rest is None)
    n_tiles = n // main.block_n
    k_split = ops.k // split_k
    if rest is not None:
        rest_compute, rest_store, rest_partial = _tile_code(ops, rest, split_k, predicated=True)
        rest_n_tiles = n // rest.block_n

    def main_rows():
        # Tile rows of main tiles: whole ones only when a rest tile takes the remainder.
        return m // main.block_m if rest is not None else (m + main.block_m - 1) // main.block_m

    def rest_row0(t):
        return m // main.block_m * main.block_m + t // rest_n_tiles * rest.block_m

    def rest_col0(t):
        return t % rest_n_tiles * rest.block_n

    def blocks():
        if rest is None:
            return main_rows() * n_tiles
        return main_rows() * n_tiles + (m % main.block_m + rest.block_m - 1) // rest.block_m * rest_n_tiles

    @T.macro
    def main_tile(smem, frags, t, tid, split, part):
        # Groups of RASTER_GROUP tile rows, walked column by column.
        # (Non-negative operands: truncating division, cheaper than floor division by a variable.)
        first: T.let[T.int32] = t // (RASTER_GROUP * n_tiles) * RASTER_GROUP
        size: T.let[T.int32] = T.min(main_rows() - first, RASTER_GROUP)
        within: T.let[T.int32] = t % (RASTER_GROUP * n_tiles)
        row0: T.let[T.int32] = (first + T.truncmod(within, size)) * main.block_m
        col0: T.let[T.int32] = T.truncdiv(within, size) * main.block_n
        main_compute(smem, frags[0], frags[1], frags[2], row0, col0, split * k_split, tid)
        if split_k > 1:
            main_partial(smem, row0, col0, tid, part, split)
        else:
            main_store(smem, row0, col0, tid, out_buf)

    @T.macro
    def rest_tile(smem, frags, t, tid, split, part):
        # Rest tiles follow the whole main tile rows.
        rest_compute(smem, frags[0], frags[1], frags[2], rest_row0(t), rest_col0(t), split * k_split, tid)
        if split_k > 1:
            rest_partial(smem, rest_row0(t), rest_col0(t), tid, part, split)
        else:
            rest_store(smem, rest_row0(t), rest_col0(t), tid, out_buf)

    # fmt: off
    @T.macro
    def gemm_blocks(part):
        for bx in T.thread_binding(blocks(), thread="blockIdx.x"):
            for by in T.thread_binding(split_k, thread="blockIdx.y"):
                for tid in T.thread_binding(threads, thread="threadIdx.x"):
                    with T.sblock("gemm"):
                        T.reads()
                        T.writes()
                        smem = T.sblock_alloc_buffer((smem_halves,), dtype, scope="shared.dyn")
                        main_frags = _fragments(main, dtype)
                        t: T.let[T.int32] = T.Cast("int32", bx)
                        split: T.let[T.int32] = T.Cast("int32", by)
                        if rest is None:
                            main_tile(smem, main_frags, t, tid, split, part)
                        else:
                            rest_frags = _fragments(rest, dtype)
                            if T.tvm_thread_invariant(t < main_rows() * n_tiles):
                                main_tile(smem, main_frags, t, tid, split, part)
                            else:
                                rest_tile(smem, rest_frags, t - main_rows() * n_tiles, tid, split, part)

    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        if split_k > 1:
            part = T.alloc_buffer((split_k * ops.m * n,), "float32", scope="global")
            gemm_blocks(part)
            reduce_blocks(part)
        else:
            gemm_blocks(None)

    # fmt: on
    return body.body
