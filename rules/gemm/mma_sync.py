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

from tvm.backend.cuda import op as cuda_op
from tvm.script import tirx as T

from .operands import GemmOperands
from .plan import (
    CHUNK,
    EPILOGUE_ROW_PAD,
    MMA_K,
    MMA_M,
    MMA_N,
    Q4_PIECE,
    WARP,
    GemmPlan,
    GemmTile,
    check_plan,
    q4_smem,
    shared_bytes,
)
from .split_k import reduction, rows

# Tile rows a group of blocks covers before moving to the next column of tiles (L2 reuse).
RASTER_GROUP = 8
# Rows of 16-byte pieces whose XOR patterns differ: the 8 bank groups of a 128-byte line.
SWIZZLE_GROUPS = 8
DTYPE_ABBREV = {"float16": "fp16", "bfloat16": "bf16"}

# Dequantizes one 16-byte piece of packed words (4 uint32, 32 4-bit values of one group) into the
# 4 swizzled 16-byte chunks of its B row (offsets in fp16/bf16 elements from ``smem_v``, the
# dynamic shared buffer's start, whatever its declared type): ``((w >> 4 j) & 0x000F000F) | magic`` read as a half2 is
# (bias + e_j, bias + e_{j+4}); minus (bias + zero), exact, then times the scale: bit for bit the
# function's ``(dtype(e) - dtype(zero)) * scale``. byte_perm puts the 8 values of a word in order.
Q4_DEQUANT = {"float16": "fuselight_q4_dequant32_fp16", "bfloat16": "fuselight_q4_dequant32_bf16"}
_Q4_DEQUANT_BODY = """
  {scalar}* smem = static_cast<{scalar}*>(smem_v);
  const uint4 w4 = *reinterpret_cast<const uint4*>(smem + packed);
  const unsigned int w[4] = {{w4.x, w4.y, w4.z, w4.w}};
  const {scalar} s = smem[scale];
  const {v2} s2 = {{s, s}};
  const unsigned int zb = {bias}u | ({bias}u << 16);
  const {v2} z2 = *reinterpret_cast<const {v2}*>(&zb);
  uint4* out = reinterpret_cast<uint4*>(smem + out_row);
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    unsigned int h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {{
      unsigned int b = ((w[i] >> (4 * j)) & 0x000F000Fu) | {magic}u;
      const {v2} v = __hmul2(__hsub2(*reinterpret_cast<const {v2}*>(&b), z2), s2);
      h[j] = *reinterpret_cast<const unsigned int*>(&v);
    }}
    uint4 o;
    o.x = __byte_perm(h[0], h[1], 0x5410);
    o.y = __byte_perm(h[2], h[3], 0x5410);
    o.z = __byte_perm(h[0], h[1], 0x7632);
    o.w = __byte_perm(h[2], h[3], 0x7632);
    out[(c0 + i) ^ sw] = o;
  }}
"""


def q4_dequant_source(dtype: str, zero: int) -> str:
    """The CUDA device function ``Q4_DEQUANT[dtype]`` for the zero point ``zero`` (see above)."""
    if dtype == "float16":
        scalar, v2, magic, base = "half", "half2", 0x64006400, 0x6400
    else:
        scalar, v2, magic, base = "nv_bfloat16", "nv_bfloat162", 0x43004300, 0x4300
    body = _Q4_DEQUANT_BODY.format(scalar=scalar, v2=v2, bias=hex(base + zero), magic=hex(magic))
    return (f"\n__forceinline__ __device__ void {Q4_DEQUANT[dtype]}(void* smem_v, int packed, int scale, "
            f"int out_row, int c0, int sw) {{{body}}}\n")


# The mainloop's copies into shared memory and its waits, as device functions it calls with the
# dynamic shared buffer's data pointer and an element offset: TVM's shared-memory sync planner does
# not see them (seeing TVM's cp.async it put two more block-wide barriers in every K slice: at its
# top and after the refill's copies), so the template's own barriers are all there is (one a slice,
# see ``compute``); the "memory" clobbers keep the compiler from moving shared-memory loads and
# stores across them.
CP_ASYNC = {
    "fuselight_cp_async_16": """
__forceinline__ __device__ void fuselight_cp_async_16(void* smem, int off, const void* src) {
  const unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(static_cast<char*>(smem) + 2 * off));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" :: "r"(dst), "l"(src) : "memory");
}
""",
    "fuselight_cp_async_16_zfill": """
__forceinline__ __device__ void fuselight_cp_async_16_zfill(void* smem, int off, const void* src, bool pred) {
  const unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(static_cast<char*>(smem) + 2 * off));
  const int bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
""",
    "fuselight_cp_async_4": """
__forceinline__ __device__ void fuselight_cp_async_4(void* smem, int off, const void* src) {
  const unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(static_cast<char*>(smem) + 2 * off));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\\n" :: "r"(dst), "l"(src) : "memory");
}
""",
}


def cp_async_wait_source(pending: int) -> tuple[str, str]:
    """``cp.async.wait_group pending`` with a memory clobber: (function name, source)."""
    name = f"fuselight_cp_async_wait_{pending}"
    return name, (f"\n__forceinline__ __device__ void {name}() {{\n"
                  f'  asm volatile("cp.async.wait_group {pending};\\n" ::: "memory");\n}}\n')


def _tile_code(ops: GemmOperands, tile: GemmTile, split_k: int, predicated: bool):
    """Macros of one tile shape: ``compute`` (the pipelined main loop) and ``store`` (epilogue).

    ``predicated``: rows at or past M are zero-filled when loaded and skipped when stored.
    """
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
    deq = ops.dequant

    if deq is not None:
        q4 = q4_smem(tile, deq.group)
        b_base = q4.half_base  # the two dequantized B tiles
        pieces_row = bk // Q4_PIECE  # 16-byte pieces of packed words in a row of a slice
        p_loads = bn * pieces_row // threads
        words_row, groups_row = ops.k // deq.per_word, ops.k // deq.group
        deq_fn, deq_src = Q4_DEQUANT[dtype], q4_dequant_source(dtype, int(deq.zero))
    n_static = isinstance(n, int)
    n32 = n if n_static else T.Cast("int32", n)

    def b_row(row):
        # A symbolic N (the LM head's vocabulary) is no multiple of the tile: clamp, never store.
        return row if n_static else T.min(row, n32 - 1)

    def in_rows(row):
        # Python True (no branch at all) where every row of the tile is below M.
        return row < m if predicated else True

    def swz(row, chunk):
        # 16-byte piece ``chunk`` of ``row`` is stored at chunk ^ f(row): the 8 rows an ldmatrix
        # reads (same chunk, consecutive rows) land in 8 different bank groups.
        return row * bk + T.bitwise_xor(chunk, (row // rows_per_line) % chunks) * CHUNK

    def cp_async(name, *args):
        return T.evaluate(cuda_op.cuda_func_call(name, *args, source_code=CP_ASYNC[name]))

    def cp_async_wait(pending):
        name, src = cp_async_wait_source(pending)
        return T.evaluate(cuda_op.cuda_func_call(name, source_code=src))

    def copy_a(smem, offset, src, pred):
        # 16 bytes of A into the A tile (``pred`` None: the row is below M, else zero-filled where false).
        if pred is None:
            return cp_async("fuselight_cp_async_16", smem.data, offset, src)
        return cp_async("fuselight_cp_async_16_zfill", smem.data, offset, src, pred)

    @T.macro
    def load_a(smem, slot, k0, row0, tid):
        for it in T.unroll(a_loads):
            row = (it * threads + tid) // chunks
            c = (it * threads + tid) % chunks
            if predicated:
                copy_a(
                    smem, slot * a_stage + swz(row, c),
                    ops.a.access_ptr("r", offset=ops.a_offset(wide(T.min(row0 + row, m - 1)), k0 + c * CHUNK)),
                    row0 + row < m,
                )  # fmt: skip
            else:
                copy_a(
                    smem, slot * a_stage + swz(row, c),
                    ops.a.access_ptr("r", offset=ops.a_offset(wide(row0 + row), k0 + c * CHUNK)), None,
                )  # fmt: skip

    @T.macro
    def load_slice(smem, slot, k0, row0, col0, tid):
        load_a(smem, slot, k0, row0, tid)
        for it in T.unroll(b_loads):
            row = (it * threads + tid) // chunks
            c = (it * threads + tid) % chunks
            cp_async(
                "fuselight_cp_async_16", smem.data, b_base + slot * b_stage + swz(row, c),
                ops.b.access_ptr("r", offset=ops.b_offset(col0 + row, k0 + c * CHUNK)),
            )  # fmt: skip

    @T.macro
    def load_slice_q4(smem, slot, k0, row0, col0, tid):
        # The A slice; the packed words (a quarter of the fp16 tile's bytes), unswizzled; for each
        # piece, the aligned pair of scales holding its scale, loaded by the thread that loads the
        # piece (and dequantizes it). Planner-invisible copies (CP_ASYNC).
        load_a(smem, slot, k0, row0, tid)
        for it in T.unroll(p_loads):
            row = (it * threads + tid) // pieces_row
            c = (it * threads + tid) % pieces_row
            cp_async(
                "fuselight_cp_async_16", smem.data,
                q4.packed_base + slot * q4.packed_stage + (row * pieces_row + c) * CHUNK,
                ops.b.access_ptr("r", offset=wide(b_row(col0 + row)) * words_row + (k0 + c * Q4_PIECE) // deq.per_word),
            )  # fmt: skip
            cp_async(
                "fuselight_cp_async_4", smem.data,
                q4.scale_base + slot * q4.scale_stage + (it * threads + tid) * 2,
                deq.scale.access_ptr(
                    "r", offset=wide(b_row(col0 + row)) * groups_row + (k0 + c * Q4_PIECE) // deq.group // 2 * 2
                ),
            )  # fmt: skip

    @T.macro
    def dequant_piece(smem, slot, hslot, k0, tid, it):
        # This thread's piece ``it`` of the packed slice (its own cp.async's, waited for by this
        # thread) into the B tile ``hslot``, in fp16/bf16.
        row = (it * threads + tid) // pieces_row
        c = (it * threads + tid) % pieces_row
        T.evaluate(cuda_op.cuda_func_call(
            deq_fn, smem.data,
            q4.packed_base + slot * q4.packed_stage + (row * pieces_row + c) * CHUNK,
            q4.scale_base + slot * q4.scale_stage + (it * threads + tid) * 2 + (k0 + c * Q4_PIECE) // deq.group % 2,
            b_base + hslot * b_stage + row * bk,
            c * (Q4_PIECE // CHUNK), (row // rows_per_line) % chunks,
            source_code=deq_src,
        ))  # fmt: skip

    @T.macro
    def ldmatrix_x4(frag, frag_offset, smem, smem_offset):
        T.ptx.ldmatrix_legacy(
            False, 4, ".b16", frag.data, frag_offset, smem.access_ptr("r"), smem_offset, dtype=dtype
        )

    @T.macro
    def load_fragments(smem, slot, bslot, kk, Af, Bf, buf, warp_row, warp_col, lane):
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
                b_base + bslot * b_stage
                + swz(warp_col + j * 2 * MMA_N + (lane // 16) * 8 + lane % 8, kk * 2 + (lane // 8) % 2),
            )  # fmt: skip

    @T.macro
    def mma_step(Af, Bf, acc, kk):
        for i in T.unroll(mi):
            for j in T.unroll(nj):
                T.ptx.mma.legacy(
                    "m16n8k16", "row", "col", ab, ab, "fp32",
                    Af.data, (kk % 2 * mi + i) * 8, Bf.data, (kk % 2 * nj + j) * 4, acc.data,
                    (i * nj + j) * 4, False, dtype="float32",
                )  # fmt: skip

    @T.macro
    def stage_accumulators(smem, acc, warp_row, warp_col, lane):
        # Stage the fp32 tile (thread holds rows lane / 4 and + 8, columns 2 (lane % 4) and + 1).
        C_smem = T.decl_buffer((tile.epilogue_floats,), "float32", data=smem.data, scope="shared.dyn")
        for i in T.unroll(mi):
            for j in T.unroll(nj):
                for h in T.unroll(2):
                    for e in T.vectorized(2):
                        C_smem[(warp_row + i * MMA_M + lane // 4 + h * 8) * ld_c + warp_col + j * MMA_N + (lane % 4) * 2 + e] = acc[(i * nj + j) * 4 + h * 2 + e]  # fmt: skip
        T.tvm_storage_sync("shared")

    # One pipeline for both B operands, the 4-bit one's differences chosen when the macro is parsed.
    # 4-bit B: dequantized in the kernel, software-pipelined with one barrier a slice. Iteration kt:
    # (k step 0) refill the buffers of slice kt - 1 with slice kt + stages - 1; multiply slice kt
    # from B tile kt % 2 while, between the k steps' mmas, each thread waits for its own copies of
    # slice kt + 1 (cp.async.wait_group: visible to the thread itself, no barrier needed) and
    # dequantizes its pieces of it into B tile (kt + 1) % 2, which every warp finished reading
    # before the barrier of iteration kt - 1; (last k step) the one barrier: slice kt + 1's A and
    # dequantized B are visible to all, slice kt's buffers are free.
    q4_b = deq is not None
    load = load_slice_q4 if q4_b else load_slice
    b_tiles = 2 if q4_b else stages  # the B tiles ldmatrix reads: the two dequantized ones, or each stage's

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
                load(smem, s, k_begin + s * bk, row0, col0, tid)
            T.ptx.cp_async.commit_group()
        cp_async_wait(stages - 2)
        if q4_b:
            for it in T.unroll(p_loads):
                dequant_piece(smem, 0, 0, k_begin, tid, it)
        T.tvm_storage_sync("shared")
        load_fragments(smem, 0, 0, 0, Af, Bf, 0, warp_row, warp_col, lane)
        for kt in T.serial(k_tiles):
            for kk in T.unroll(k_steps):
                if kk == 0:
                    # Every warp is past the barrier that followed its last read of slice kt - 1:
                    # refill that buffer. (An empty group keeps the count wait_group relies on.)
                    if kt + (stages - 1) < k_tiles:
                        load(
                            smem, (kt + (stages - 1)) % stages, k_begin + (kt + (stages - 1)) * bk, row0, col0, tid
                        )
                    T.ptx.cp_async.commit_group()
                if kk == k_steps - 1:
                    # Slice kt + 1 has landed (4-bit B: each thread waited for its own copies
                    # below) and is visible to all warps.
                    if not q4_b:
                        cp_async_wait(stages - 2)
                    T.tvm_storage_sync("shared")
                # Operands of the next k step (the next slice's first) load while this one multiplies.
                if kk + 1 < k_steps:
                    load_fragments(
                        smem, kt % stages, kt % b_tiles, kk + 1, Af, Bf, (kk + 1) % 2, warp_row, warp_col, lane
                    )
                elif kt + 1 < k_tiles:
                    load_fragments(
                        smem, (kt + 1) % stages, (kt + 1) % b_tiles, 0, Af, Bf, (kk + 1) % 2, warp_row, warp_col, lane
                    )
                mma_step(Af, Bf, acc, kk)
                if q4_b:
                    # The tensor cores get this step's mmas before the thread waits and converts.
                    if kk == 0:
                        cp_async_wait(stages - 2)  # this thread's copies of slice kt + 1 have landed
                    if kk + 1 < k_steps:
                        if kt + 1 < k_tiles:
                            for it in T.unroll(p_loads):
                                if it % (k_steps - 1) == kk:
                                    dequant_piece(
                                        smem, (kt + 1) % stages, (kt + 1) % 2, k_begin + (kt + 1) * bk, tid, it
                                    )
        T.ptx.cp_async.wait_group(0)
        T.tvm_storage_sync("shared")
        stage_accumulators(smem, acc, warp_row, warp_col, lane)

    @T.macro
    def store(smem, row0, col0, tid, out_buf):
        # Epilogue of the staged tile: CHUNK adjacent outputs a thread, 16-byte stores.
        C_smem = T.decl_buffer((tile.epilogue_floats,), "float32", data=smem.data, scope="shared.dyn")
        for it in T.unroll(out_pieces):
            row: T.let[T.int32] = (it * threads + tid) // (bn // CHUNK)
            col: T.let[T.int32] = (it * threads + tid) % (bn // CHUNK) * CHUNK
            if in_rows(row0 + row):
                if n_static:
                    for e in T.vectorized(CHUNK):
                        out_buf[ops.out.index(wide(row0 + row), wide(col0 + col + e))] = ops.out.value(
                            wide(row0 + row), wide(col0 + col + e), C_smem[row * ld_c + col + e]
                        )
                elif col0 + col + CHUNK <= n32:
                    for e in T.vectorized(CHUNK):
                        out_buf[ops.out.index(wide(row0 + row), wide(col0 + col + e))] = ops.out.value(
                            wide(row0 + row), wide(col0 + col + e), C_smem[row * ld_c + col + e]
                        )
                else:
                    # The last columns of a symbolic N: one output at a time, up to N.
                    for e in T.serial(CHUNK):
                        if col0 + col + e < n32:
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
    check_plan(plan, ops)
    main, rest, split_k = plan.main, plan.rest, plan.split_k
    n, dtype = ops.n, ops.dtype
    m, _ = rows(ops)
    out_buf = ops.out.buffer
    threads = main.threads
    smem_halves = max(shared_bytes(t, ops) for t in (main, rest) if t is not None) // 2
    reduce_blocks = reduction(ops, split_k) if split_k > 1 else None
    main_compute, main_store, main_partial = _tile_code(ops, main, split_k, predicated=rest is None)
    # Column tiles (a symbolic N: the last one partly past N, its columns clamped and never stored).
    n_tiles = n // main.block_n if isinstance(n, int) else (T.Cast("int32", n) + main.block_n - 1) // main.block_n
    k_split = ops.k // split_k
    if rest is not None:
        rest_compute, rest_store, rest_partial = _tile_code(ops, rest, split_k, predicated=True)
        rest_n_tiles = (
            n // rest.block_n if isinstance(n, int) else (T.Cast("int32", n) + rest.block_n - 1) // rest.block_n
        )

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
