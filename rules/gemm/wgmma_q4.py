"""Hopper 4-bit GEMM with the weight as wgmma's register operand (the operand swap of Machete and
CUTLASS's mixed-input GEMM): the host code and kernel of one GemmOperands whose B is dequantized.

The template computes ``C[tokens, features] = X W^T`` as ``D = W X^T``: wgmma's M is the weight's
rows (output features), its N the tokens. Each consumer warpgroup owns 64 weight rows of the
block's ``block_f`` and issues ``wgmma.mma_async.m64n{block_t}k16.f32.f16.f16`` with A, the
weight, in registers and B, the ``block_t`` x 64 token tile, read from shared memory through a
descriptor. The token tile is K-major rows of 64 halves (128 bytes) with the 128-byte swizzle
(``wgmma``'s layout, loaded by TMA exactly as that template loads its A; rows past M are zero
filled and never stored).

The weight (``ops.dequant``: MLC-LLM's q4f16_1, uint32 words of 8 consecutive K values of a row,
value ``(q - zero) * scale``, one fp16 scale per ``group`` along K) never passes through shared
memory as fp16. The producer's TMA copies each K slice's packed words as they are (``block_f``
rows of 8 words, 32 bytes a row, no swizzle: the reads below meet no bank conflict) and, every
``8 * group / 64`` slices, a chunk of 8 scales a row (16 bytes, TMA's narrowest box) into a ring
of ``scale_ring`` chunks. One "full" mbarrier a slot (TMA's byte count completes it) and one
"empty" (every consumer warp arrives once the wgmma group reading the slot has retired).

A consumer thread (lane ``g * 4 + t`` of warp ``w``) holds wgmma's A fragment of rows
``16 w + g`` and ``16 w + g + 8`` of its warpgroup, K values ``2t, 2t + 1`` (registers 0, 1) and
``2t + 8, 2t + 9`` (2, 3) of each k16 step (PTX ISA: the register fragment of A for
``.m64nNk16`` f16, as ``mma.m16n8k16``'s): byte ``t`` of the step's two words of each row. Per k32
half of a slice a thread reads each of its two rows' 4 words with one 16-byte load (the quad
reads the same 16 bytes), puts byte ``t`` of a word at bytes 0 and 2 (``prmt``), masks it into the
halves ``(1024 + lo, 1024 + 16 hi)``, and one ``hfma2`` with ``(1, 1/16)`` and ``-(1024 + zero),
-(64 + zero)`` gives ``(lo - zero, hi - zero)`` exactly; times the scale: bit for bit MLC's
``(dtype(q) - dtype(zero)) * scale``. The registers of one slice must stay untouched while its
wgmma group runs (PTX ISA), so the K loop is unrolled by two with a register set each: slice
``k + 1`` is dequantized into the other set while slice ``k``'s group runs.

The accumulators are ``64 features x block_t tokens`` a warpgroup; the epilogue transposes them
through a shared buffer of the warpgroup's own in chunks of ``epi_tokens(block_t)`` tokens (64
where ``block_t`` is a multiple of 64, else the largest multiple of 16 below it dividing
``block_t``: 16, 32 or 48 for batch decode's small token tiles; feature piece ``p`` of token row
``r`` stored at ``p ^ ((r / 2) % 4)``: the accumulator writes of a warp hit 32 banks), then every
thread applies ``ops.out.value`` to 8 adjacent features of a token: 16-byte stores, a chunk's
token rows 16 at a time over the warpgroup's 128 threads (so ``block_t`` is a multiple of 16).
A token tile of 16 rows is one 2 KB slot (two 8-row swizzle atoms: TMA's box, 64 halves x 16 rows
under the 128-byte swizzle, and wgmma's B descriptor, atoms 1024 bytes apart, are those of any
``block_t``); slots stay on 1024-byte atoms.

Blocks are persistent (``max_blocks``), walking the tiles in groups of ``group_m`` token tiles (the
``wgmma`` template's order). Served: fp16 tokens, the NK layout in order with a constant integer
zero, a static N that is a multiple of ``block_f``, K a multiple of 8 groups, the plain epilogue
(a cast, a residual); no paired (SiLU·mul) epilogue, no norm prologue, no split-K. Anything else
raises a FuselightError (the q4 dispatch then keeps its other plans).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm.backend.cuda import op as cuda_op
from tvm.script import tirx as T

from fuselight.errors import FuselightError

from .operands import GemmOperands, check_q4_words
from .wgmma import (
    ATOM_BYTES,
    BLOCK_K,
    ELEM_BYTES,
    EPI_COLS,
    EPI_VEC,
    FLOAT_BYTES,
    GROUPS_IN_FLIGHT,
    MAX_DYNAMIC_SMEM,
    MBAR_BYTES,
    PRODUCER_REGS,
    SUPPORTED_WARPGROUPS,
    TMA_SWIZZLE_128B,
    TMA_SWIZZLE_NONE,
    WARP,
    WARPGROUP,
    WGMMA_K,
    WGMMA_M,
    WGMMA_N_MAX,
    consumer_regs,
    encode_tiled,
    float_pointer,
    grouped_col,
    grouped_row,
    matrix_desc,
    retire_macro,
    setup_macro,
    tma_load_2d,
)

WORD_BYTES = 4
WORDS_A_SLICE = BLOCK_K // 8  # packed words of one row in a K slice (8 values a word)
ROW_BYTES = WORDS_A_SLICE * WORD_BYTES  # a row's packed words of a slice in shared memory
HALF_K = 32  # K values of one 16-byte load of a row's words (a thread's two k16 steps)
SCALES_A_CHUNK = 8  # scales of a row a TMA box holds (16 bytes: TMA's narrowest inner box)
SCALE_CHUNK_BYTES = SCALES_A_CHUNK * ELEM_BYTES
UNROLL = 2  # register sets of A fragments (one slice in flight while the next is dequantized)
A_REGS = 4  # 32-bit registers of one m64k16 A fragment a thread
# The epilogue's 128 threads store 8-feature pieces (EPI_VEC) of a warpgroup's 64 features: 16 token
# rows at a time, so token tiles and epilogue chunks are multiples of this.
EPI_ROWS = WARPGROUP * EPI_VEC // WGMMA_M
RS_PREFIX = "q4rs-"  # the tiles' names in configs/gemm/mma_sync_q4.json (``wgmma_rs_tiles``)
# fp16 bit patterns of the conversion's constants.
HALF_ONE, HALF_SIXTEENTH = 0x3C00, 0x2C00
MAGIC = 0x64006400  # fp16 1024 in both halves: 1024 + m for a 10-bit mantissa m
CVT = "fuselight_q4rs_cvt_fp16"  # one A register from a packed word, the lane's quad index and a scale
CVT_SOURCE = """
__forceinline__ __device__ unsigned int {name}(unsigned int w, int t, half s) {{
  // Byte t of the word at bytes 0 and 2, zeros at 1 and 3, masked into (1024 + lo, 1024 + 16 hi).
  unsigned int b = (__byte_perm(w, 0u, (unsigned int)t * 0x0101u | 0x4040u) & 0x00F0000Fu) | {magic}u;
  const unsigned int mul = {mul}u, add = {add}u;
  half2 v = __hfma2(*reinterpret_cast<half2*>(&b), *reinterpret_cast<const half2*>(&mul),
                    *reinterpret_cast<const half2*>(&add));
  v = __hmul2(v, __halves2half2(s, s));
  return *reinterpret_cast<unsigned int*>(&v);
}}
"""


def _half_bits(value: float) -> int:
    return int(np.array(value, dtype=np.float16).view(np.uint16))


def cvt_source(zero: int) -> str:
    """The device function ``CVT`` for zero point ``zero``: byte ``t`` of ``w`` (the values of K
    ``2t``, ``2t + 1`` of its 8) as the half2 ``((lo - zero) * s, (hi - zero) * s)`` (see the module
    docstring), bit for bit MLC's dequantize."""
    mul = HALF_ONE | HALF_SIXTEENTH << 16
    add = _half_bits(-(1024 + zero)) | _half_bits(-(64 + zero)) << 16
    return CVT_SOURCE.format(name=CVT, magic=hex(MAGIC), mul=hex(mul), add=hex(add))


def epi_tokens(block_t: int) -> int:
    """Token rows of an epilogue chunk for a ``block_t``-token tile: ``EPI_COLS`` where that divides
    it, else the largest multiple of ``EPI_ROWS`` below ``EPI_COLS`` that does (the whole tile up to 48)."""
    return max(c for c in range(EPI_ROWS, EPI_COLS + 1, EPI_ROWS) if block_t % c == 0)


@dataclasses.dataclass(frozen=True)
class WgmmaQ4Tile:
    """Tile config: ``block_t`` tokens (wgmma's N) x ``warpgroups`` x 64 weight rows a block,
    ``stages`` shared-memory slots, ``group_m`` token tiles per raster group, at most ``max_blocks``
    persistent blocks."""

    block_t: int
    warpgroups: int
    stages: int
    group_m: int
    max_blocks: int

    @property
    def block_f(self) -> int:
        """Output features (weight rows) of a block."""
        return WGMMA_M * self.warpgroups

    # The output tile as the GEMM dispatch sees it: rows are tokens (M), columns features (N).
    @property
    def block_m(self) -> int:
        return self.block_t

    @property
    def block_n(self) -> int:
        return self.block_f

    @property
    def threads(self) -> int:
        return WARPGROUP * (self.warpgroups + 1)


@dataclasses.dataclass(frozen=True)
class WgmmaQ4Plan:
    """A plan of this template (no split-K: ``split_k`` is 1, checked)."""

    tile: WgmmaQ4Tile
    split_k: int = 1


def slices_a_chunk(group: int) -> int:
    """K slices one chunk of 8 scales a row covers."""
    return SCALES_A_CHUNK * group // BLOCK_K


def scale_ring(tile: WgmmaQ4Tile, group: int) -> int:
    """Scale chunks in the ring: the producer loads chunk c + ring with slice ``spc (c + ring)``,
    once the consumers have released slice ``spc (c + ring) - stages``; the last slice reading
    chunk c is ``spc c + spc - 1``, so ``spc * ring >= stages + spc - 1``."""
    spc = slices_a_chunk(group)
    return -(-(tile.stages + spc - 1) // spc)


@dataclasses.dataclass(frozen=True)
class Smem:
    """Byte offsets of the shared buffer: token tiles, packed words, the scale ring, the epilogue
    chunks, the barriers; ``total`` bytes."""

    x_slot: int
    w_base: int
    w_slot: int
    s_base: int
    s_chunk: int
    ring: int
    epi_base: int
    bar_base: int
    total: int


def smem_layout(tile: WgmmaQ4Tile, group: int) -> Smem:
    """The shared-memory layout of ``tile`` for scale group ``group``."""
    x_slot = tile.block_t * BLOCK_K * ELEM_BYTES
    w_base = tile.stages * x_slot
    w_slot = tile.block_f * ROW_BYTES
    s_base = w_base + tile.stages * w_slot
    s_chunk = tile.block_f * SCALE_CHUNK_BYTES
    ring = scale_ring(tile, group)
    epi_base = s_base + ring * s_chunk
    bar_base = epi_base + tile.warpgroups * WGMMA_M * epi_tokens(tile.block_t) * FLOAT_BYTES
    return Smem(x_slot, w_base, w_slot, s_base, s_chunk, ring, epi_base, bar_base,
                bar_base + 2 * tile.stages * MBAR_BYTES)


def check_tile(tile: WgmmaQ4Tile, ops: GemmOperands, split_k: int = 1) -> None:
    """FuselightError naming the problem if ``tile`` cannot compute ``ops`` (see the module docstring)."""
    deq = ops.dequant
    if deq is None:
        raise FuselightError("wgmma q4 gemm: B is not dequantized in the kernel")
    if ops.dtype != "float16" or deq.dtype != "float16":
        raise FuselightError(f"wgmma q4 gemm: dtype {ops.dtype} (dequantized {deq.dtype}) unsupported (supported: float16)")
    check_q4_words(ops, "wgmma q4 gemm", HALF_K)
    if ops.paired or ops.prologue is not None or ops.out is None:
        raise FuselightError("wgmma q4 gemm: a paired epilogue, a norm prologue or no epilogue is unsupported")
    if split_k != 1:
        raise FuselightError(f"wgmma q4 gemm: split_k {split_k} unsupported (1 only)")
    if tile.block_t % EPI_ROWS or not EPI_ROWS <= tile.block_t <= WGMMA_N_MAX:
        raise FuselightError(f"wgmma q4 tile: block_t {tile.block_t} must be a multiple of {EPI_ROWS} (the epilogue's "
                             f"token rows at a time) up to {WGMMA_N_MAX}")
    if tile.warpgroups not in SUPPORTED_WARPGROUPS:
        raise FuselightError(f"wgmma q4 tile: warpgroups {tile.warpgroups} unsupported (supported: {list(SUPPORTED_WARPGROUPS)})")
    if tile.stages < GROUPS_IN_FLIGHT + 1 or tile.group_m < 1 or tile.max_blocks < 1:
        raise FuselightError(f"wgmma q4 tile: stages {tile.stages} (at least {GROUPS_IN_FLIGHT + 1}), group_m "
                             f"{tile.group_m}, max_blocks {tile.max_blocks} (positive)")
    if not isinstance(ops.n, int) or ops.n % tile.block_f:
        raise FuselightError(f"wgmma q4 gemm: n {ops.n} is not a static multiple of {tile.block_f} rows")
    # Whole chunks of 8 scales a row (also TMA's 16-byte row stride of the scales), an even slice count.
    if ops.k % (SCALES_A_CHUNK * deq.group) or (ops.k // BLOCK_K) % UNROLL:
        raise FuselightError(f"wgmma q4 gemm: k {ops.k} is not a multiple of {SCALES_A_CHUNK} groups of {deq.group}")
    total = smem_layout(tile, deq.group).total
    if total > MAX_DYNAMIC_SMEM:
        raise FuselightError(f"wgmma q4 tile: {tile.stages} stages of {tile.block_t} tokens need {total} bytes of "
                             f"shared memory (at most {MAX_DYNAMIC_SMEM})")


def wgmma_q4_gemm(ops: GemmOperands, tile: WgmmaQ4Tile) -> tvm.tirx.Stmt:
    """The body (host code encoding the tensor maps, then the kernel) computing ``ops``; it uses
    ``ops``' buffers as they are (bind it to the analysed function's params)."""
    check_tile(tile, ops)
    for what, buf in (("tokens", ops.a), ("packed words", ops.b), ("scales", ops.dequant.scale)):
        if not isinstance(buf.elem_offset, tvm.tirx.IntImm) or buf.elem_offset.value != 0:
            raise FuselightError(f"wgmma q4 gemm: {what} buffer has element offset {buf.elem_offset} (must be 0)")
    deq = ops.dequant
    n, k = ops.n, ops.k
    bt, bf, stages = tile.block_t, tile.block_f, tile.stages
    consumers = tile.warpgroups * WARPGROUP
    lay = smem_layout(tile, deq.group)
    spc = slices_a_chunk(deq.group)
    k_tiles = k // BLOCK_K
    n_tiles = n // bf
    n_acc = WGMMA_M * bt // WARPGROUP
    consumer_warps = consumers // WARP
    pieces = WGMMA_M // EPI_VEC  # 8-feature pieces of a chunk row (a token's warpgroup features)
    chunk_t = epi_tokens(bt)  # token rows of an epilogue chunk
    per_thread = chunk_t * pieces // WARPGROUP  # pieces a thread stores a chunk
    epi_chunk = chunk_t * WGMMA_M  # floats a warpgroup: chunk_t token rows of its 64 features
    out_buf = ops.out.buffer
    grown_regs = consumer_regs(tile.warpgroups, PRODUCER_REGS)
    cvt_src = cvt_source(int(deq.zero))
    halves = BLOCK_K // HALF_K  # 16-byte loads of a row's words a slice
    steps = BLOCK_K // WGMMA_K

    def full(smem, slot):
        return smem.access_ptr("w", offset=lay.bar_base + slot * MBAR_BYTES)

    def empty(smem, slot):
        return smem.access_ptr("w", offset=lay.bar_base + (stages + slot) * MBAR_BYTES)

    def tile_t(t, m_tiles):
        return grouped_row(t, m_tiles, n_tiles, tile.group_m) * bt

    def tile_f(t, m_tiles):
        return grouped_col(t, m_tiles, n_tiles, tile.group_m) * bf

    def cvt(word, tid, scale):
        return cuda_op.cuda_func_call(CVT, word, tid % 4, scale, source_code=cvt_src, return_type="uint32")

    def frag_row(wg, tid, rr):
        # Row 16 w + g (rr 0) or 16 w + g + 8 (rr 1) of the block's weight rows.
        return wg * WGMMA_M + (tid % WARPGROUP) // WARP * 16 + (tid % WARP) // 4 + rr * 8

    def scale_group(kt, h):
        # The scale (of the chunk's 8) of the k32 half h of slice kt.
        return (T.truncmod(kt, spc) * halves + h) * HALF_K // deq.group

    def mma(desc_b, regs, base, acc):
        # A from registers, B (the tokens, K-major) by descriptor, accumulate.
        return cuda_op.ptx_wgmma_mma_async_rs(
            desc_b, *[regs[base + i] for i in range(A_REGS)], *[acc[i] for i in range(n_acc)],
            M=WGMMA_M, N=bt, K=WGMMA_K, in_dtype=ops.dtype, out_dtype="float32",
            transA=False, transB=False, scaleA=1.0, scaleB=1.0, scaleD=1,
        )  # fmt: skip

    retire = retire_macro(empty, stages, k_tiles, n_acc)
    setup = setup_macro(full, empty, stages, 1, consumer_warps)

    # fmt: off
    @T.macro
    def consume_slice(smem, regs, w_smem, s_smem, words, scales, acc, smem_desc, tid, wg, ti, kt):
        # Slice kt of work tile ti: its fragments into ``regs``, its wgmma group, the slot before released.
        it: T.let[T.int32] = ti * k_tiles + kt
        slot: T.let[T.int32] = T.truncmod(it, stages)
        chunk: T.let[T.int32] = T.truncmod(T.truncdiv(it, spc), lay.ring)
        T.ptx.mbarrier.try_wait(full(smem, slot), T.truncmod(T.truncdiv(it, stages), 2))
        for h in T.unroll(halves):
            # One 16-byte load of each row's 4 words (the quad reads the same), its scale; word q
            # is register (q % 2) * 2 + rr of k16 step 2h + q / 2 (rr: the row).
            for rr in T.unroll(2):
                for e in T.vectorized(HALF_K // 8):
                    words[rr * (HALF_K // 8) + e] = w_smem[(slot * lay.w_slot + frag_row(wg, tid, rr) * ROW_BYTES) // WORD_BYTES
                                                           + h * (HALF_K // 8) + e]
                scales[rr] = s_smem[(chunk * lay.s_chunk + frag_row(wg, tid, rr) * SCALE_CHUNK_BYTES) // ELEM_BYTES + scale_group(kt, h)]
            for q in T.unroll(HALF_K // 8):
                for rr in T.unroll(2):
                    regs[(h * 2 + q // 2) * A_REGS + q % 2 * 2 + rr] = cvt(words[rr * (HALF_K // 8) + q], tid, scales[rr])
        T.ptx.wgmma.fence()
        for kk in T.unroll(steps):
            T.evaluate(mma(matrix_desc(smem_desc[0], slot * lay.x_slot + kk * WGMMA_K * ELEM_BYTES), regs, kk * A_REGS, acc))
        T.ptx.wgmma.commit_group()
        T.ptx.wgmma.wait_group(GROUPS_IN_FLIGHT)
        # The group before this one has retired (in this warp): its slot is free.
        if kt > 0 and tid % WARP == 0:
            T.ptx.mbarrier.arrive(empty(smem, T.truncmod(it + stages - 1, stages)))

    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        m: T.let[T.int32] = T.Cast("int32", ops.m)
        x_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.evaluate(encode_tiled(x_map, ops.a, ops.dtype, k, m, BLOCK_K, bt, TMA_SWIZZLE_128B))
        w_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.evaluate(encode_tiled(w_map, ops.b, deq.storage_dtype, k // deq.per_word, n, WORDS_A_SLICE, bf, TMA_SWIZZLE_NONE))
        s_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.evaluate(encode_tiled(s_map, deq.scale, deq.dtype, k // deq.group, n, SCALES_A_CHUNK, bf, TMA_SWIZZLE_NONE))
        m_tiles: T.let[T.int32] = T.ceildiv(m, bt)
        units: T.let[T.int32] = m_tiles * n_tiles
        blocks: T.let[T.int32] = T.min(units, tile.max_blocks)
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tid in T.thread_binding(tile.threads, thread="threadIdx.x"):
                with T.sblock("gemm"):
                    T.reads()
                    T.writes()
                    buf_dyn_shmem = T.sblock_alloc_buffer((lay.total,), "uint8", scope="shared.dyn", align=ATOM_BYTES)
                    acc = T.sblock_alloc_buffer((n_acc,), "float32", scope="local")
                    # One buffer a register set (TVM merges the sets of one buffer: it sees no async read).
                    regs0 = T.sblock_alloc_buffer((steps * A_REGS,), "uint32", scope="local")
                    regs1 = T.sblock_alloc_buffer((steps * A_REGS,), "uint32", scope="local")
                    words = T.sblock_alloc_buffer((2 * HALF_K // 8,), deq.storage_dtype, scope="local")  # a k32 half of rows g, g + 8
                    scales = T.sblock_alloc_buffer((2,), "float16", scope="local")
                    smem_desc = T.sblock_alloc_buffer((1,), "uint64", scope="local")
                    vals = T.sblock_alloc_buffer((per_thread * EPI_VEC,), out_buf.dtype, scope="local")
                    # The epilogue chunks, through a plain pointer (each warpgroup syncs its own with a
                    # named barrier, which TVM's shared-memory sync planner does not know).
                    epi_ptr: T.let[T.handle("float32")] = float_pointer(buf_dyn_shmem.access_ptr("rw", offset=lay.epi_base))
                    epi = T.decl_buffer((tile.warpgroups * epi_chunk,), "float32", data=epi_ptr)
                    # The packed words and the scale ring, read through plain pointers too (TMA writes them).
                    w_ptr: T.let[T.handle(deq.storage_dtype)] = float_pointer(buf_dyn_shmem.access_ptr("r", offset=lay.w_base), deq.storage_dtype)
                    w_smem = T.decl_buffer((stages * lay.w_slot // WORD_BYTES,), deq.storage_dtype, data=w_ptr)
                    s_ptr: T.let[T.handle("float16")] = float_pointer(buf_dyn_shmem.access_ptr("r", offset=lay.s_base), "float16")
                    s_smem = T.decl_buffer((lay.ring * lay.s_chunk // ELEM_BYTES,), "float16", data=s_ptr)
                    wg: T.let[T.int32] = tid // WARPGROUP
                    my_tiles: T.let[T.int32] = T.truncdiv(units - bx + blocks - 1, blocks)
                    setup(buf_dyn_shmem, smem_desc, tid)
                    if wg == tile.warpgroups:
                        if grown_regs is not None:
                            T.ptx.setmaxnreg(False, PRODUCER_REGS)
                        if tid == consumers:
                            for ti in T.serial(my_tiles):
                                t0: T.let[T.int32] = tile_t(bx + ti * blocks, m_tiles)
                                f0: T.let[T.int32] = tile_f(bx + ti * blocks, m_tiles)
                                for kt in T.serial(k_tiles):
                                    it: T.let[T.int32] = ti * k_tiles + kt
                                    slot: T.let[T.int32] = T.truncmod(it, stages)
                                    if it >= stages:
                                        T.ptx.mbarrier.try_wait(empty(buf_dyn_shmem, slot), T.truncmod(T.truncdiv(it, stages) + 1, 2))
                                    if T.truncmod(kt, spc) == 0:
                                        # A new chunk of scales, into ring entry (it / spc) % ring.
                                        T.ptx.mbarrier.arrive.expect_tx(full(buf_dyn_shmem, slot), lay.x_slot + lay.w_slot + lay.s_chunk)
                                        T.evaluate(tma_load_2d(buf_dyn_shmem, lay.s_base + T.truncmod(T.truncdiv(it, spc), lay.ring) * lay.s_chunk,
                                                               full(buf_dyn_shmem, slot), s_map, kt * BLOCK_K // deq.group, f0))
                                    else:
                                        T.ptx.mbarrier.arrive.expect_tx(full(buf_dyn_shmem, slot), lay.x_slot + lay.w_slot)
                                    T.evaluate(tma_load_2d(buf_dyn_shmem, slot * lay.x_slot, full(buf_dyn_shmem, slot), x_map, kt * BLOCK_K, t0))
                                    T.evaluate(tma_load_2d(buf_dyn_shmem, lay.w_base + slot * lay.w_slot, full(buf_dyn_shmem, slot), w_map,
                                                           kt * WORDS_A_SLICE, f0))
                    else:
                        if grown_regs is not None:
                            T.ptx.setmaxnreg(True, grown_regs)
                        for ti in T.serial(my_tiles):
                            t0: T.let[T.int32] = tile_t(bx + ti * blocks, m_tiles)
                            f0: T.let[T.int32] = tile_f(bx + ti * blocks, m_tiles)
                            for i in T.unroll(n_acc):
                                acc[i] = T.float32(0)
                            for kp in T.serial(k_tiles // UNROLL):
                                # Register set u for slice 2 kp + u: its fragments stay untouched while its group runs.
                                consume_slice(buf_dyn_shmem, regs0, w_smem, s_smem, words, scales, acc, smem_desc, tid, wg, ti, kp * UNROLL)
                                consume_slice(buf_dyn_shmem, regs1, w_smem, s_smem, words, scales, acc, smem_desc, tid, wg, ti, kp * UNROLL + 1)
                            retire(buf_dyn_shmem, acc, tid, ti)
                            # Accumulator 4j + 2h + e: feature 16 w + g + 8h of the warpgroup's 64 (piece
                            # 2w + h, place g), token 8j + 2t + e; chunk cc holds j = cc c .. cc c + c - 1
                            # (c = chunk_t / 8).
                            for cc in T.unroll(bt // chunk_t):
                                for jj in T.unroll(chunk_t // 8):
                                    for h in T.unroll(2):
                                        for e in T.unroll(2):
                                            epi[wg * epi_chunk + (jj * 8 + tid % 4 * 2 + e) * WGMMA_M
                                                + T.bitwise_xor((tid % WARPGROUP) // WARP * 2 + h, tid % 4) * EPI_VEC
                                                + (tid % WARP) // 4] = acc[(cc * (chunk_t // 8) + jj) * 4 + h * 2 + e]
                                T.cuda.warpgroup_sync(1 + wg)
                                # Thread i of the warpgroup: feature piece i % 8 of token rows i / 8 + 16 r. All
                                # values first (rows past M clamped to the last row, so the loads are
                                # unconditional), then the stores of rows below M.
                                for r in T.unroll(per_thread):
                                    row: T.let[T.int32] = r * (WARPGROUP // pieces) + (tid % WARPGROUP) // pieces
                                    for e in T.vectorized(EPI_VEC):
                                        vals[r * EPI_VEC + e] = ops.out.value(
                                            T.Cast("int64", T.min(t0 + cc * chunk_t + row, m - 1)),
                                            f0 + wg * WGMMA_M + tid % pieces * EPI_VEC + e,
                                            epi[wg * epi_chunk + row * WGMMA_M + T.bitwise_xor(tid % pieces, T.truncmod(row // 2, 4)) * EPI_VEC + e],
                                        )
                                for r in T.unroll(per_thread):
                                    tok: T.let[T.int32] = t0 + cc * chunk_t + r * (WARPGROUP // pieces) + (tid % WARPGROUP) // pieces
                                    if tok < m:
                                        for e in T.vectorized(EPI_VEC):
                                            out_buf[ops.out.index(T.Cast("int64", tok), f0 + wg * WGMMA_M + tid % pieces * EPI_VEC + e)] = vals[r * EPI_VEC + e]
                                # The chunk is read before the next overwrites it.
                                T.cuda.warpgroup_sync(1 + wg)
    # fmt: on
    return body.body
