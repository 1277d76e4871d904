"""Hopper GEMM template on ``wgmma.mma_async`` fed by TMA: the host code and kernel of one GemmOperands.

C tile ``block_m x block_n`` per block, ``warpgroups`` consumer warpgroups of 128 threads, each
owning 64 rows and issuing ``wgmma.mma_async.m64n{block_n}k16`` with both operands read from
shared memory through matrix descriptors, plus one producer warpgroup whose first thread streams
the tiles in with ``cp.async.bulk.tensor`` (TMA) into ``stages`` slots. A and B tiles are K-major
rows of ``BLOCK_K`` = 64 halves (128 bytes) stored with the 128-byte swizzle that both TMA and the
descriptors name (16-byte piece ``c`` of row ``r`` at piece ``c ^ (r % 8)``, 8-row atoms of 1024
bytes). Each slot has a "full" mbarrier (TMA's byte count completes it) and an "empty" one (every
consumer warp arrives once its wgmma group reading the slot has retired); consumers keep one
wgmma group in flight. With two consumer warpgroups the producer hands most of its registers to
them (setmaxnreg).

The tensor maps are encoded on the host at each call (A's row extent is M, so TMA fills rows past
M with zeros; they are never stored): the returned body is host code holding the kernel launch.
Blocks are persistent (at most ``max_blocks``), walking the tiles in groups of ``group_m`` row
tiles so concurrent blocks share A and B in L2; the producer loads the next tile while the
consumers store the last. The epilogue stages each consumer warpgroup's 64 rows in ``EPI_COLS``-wide
fp32 chunks through a buffer of its own (the slots are still being filled with the next tile), then
applies ``ops.out.value`` to 8 adjacent columns a thread: 16-byte coalesced stores, and 16-byte loads
of whatever the epilogue reads (a residual). A paired epilogue (``silu(gate) * up``, see
``operands``) loads each B tile as two TMA boxes, ``block_n / 2`` gate rows and the matching up rows
``pair_offset`` further: a thread's accumulator columns c and c + block_n / 2 then pair, a chunk
stages 32 gate and the matching 32 up columns, and the block writes ``block_n / 2`` output columns.
With ``split_k`` > 1 (small M, where the tiles alone leave SMs idle) a work unit is a tile and one
of ``split_k`` K ranges; the epilogue stores the unit's fp32 sums (every accumulator column, gate
and up alike, at its own GEMM column) and a second launch (``split_k.reduction``) sums the units
and applies ``ops.out.value``. Needs the arch-specific target (sm_90a): TVM's CUDA compile and
``fuselight.cuda_compile`` both build for it. Shared memory is dynamic (up to 227 KiB, opted in at
launch by TVM's runtime).

A B computed by a 4-bit dequantize (``ops.dequant``: MLC-LLM's q4f16_1, static N) changes only the
producer (the B-load hook; the consumers and the epilogue are the same): TMA still loads A, while
all 128 producer threads stream the packed words and scales by cp.async into a staging ring, each
its own pieces, convert them (bit for bit MLC's dequantize) into the slot's swizzled fp16/bf16 B
tile, fence for the async proxy and arrive on the slot's full barrier (see ``WgmmaTile.q4_staging``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tvm
from tvm.backend.cuda import op as cuda_op
from tvm.script import tirx as T

from fuselight.errors import FuselightError
from fuselight.jsonfile import read_json_object
from fuselight.paths import config_dir

from fuselight.device import most, require_device, warp_size

from ..arch_config import from_fields, per_sm_counts
from .mma_sync import CP_ASYNC, Q4_DEQUANT, cp_async_wait_source, q4_dequant_source
from .operands import B_LAYOUTS, DTYPES, GemmOperands, check_q4_words
from .split_k import reduction

WARPGROUP = 128  # threads
WARP = warp_size()
WGMMA_M, WGMMA_K = 64, 16
# wgmma's n runs 8..256 in steps of 8; one 128-byte swizzle row holds 64 halves of K.
WGMMA_N_STEP, WGMMA_N_MAX = 8, 256
BLOCK_K = 64
ATOM_BYTES = 1024  # one swizzle atom: 8 rows of 128 bytes; tiles start on one
ELEM_BYTES = 2  # both DTYPES
MBAR_BYTES = 8
# Epilogue chunk: 64 rows (a warpgroup's) x EPI_COLS fp32 accumulators staged at once; each thread
# then handles EPI_VEC adjacent columns (16 bytes of fp16/bf16). Chunk rows are 8 pieces of EPI_VEC
# floats, piece p of row r stored at p ^ (r % 8): the accumulator writes (8-byte, rows r..r+3 of a
# half warp, one piece each) then hit distinct banks.
EPI_COLS = 64
EPI_VEC = 16 // ELEM_BYTES
FLOAT_BYTES = 4
# Descriptor fields in 16-byte units: the stride between 8-row atoms; the leading offset is unused
# by K-major swizzled layouts (1 by convention). TVM's swizzle code 3 is the 128-byte swizzle.
DESC_SBO = ATOM_BYTES // 16
DESC_LBO = 1
DESC_SWIZZLE_128B = 3
# cuTensorMapEncodeTiled enums: no interleave, 128-byte swizzle, 256-byte L2 promotion, zero fill.
TMA_INTERLEAVE_NONE, TMA_SWIZZLE_128B, TMA_L2_PROMOTION_256B, TMA_OOB_ZERO = 0, 3, 3, 0
TMA_SWIZZLE_NONE = 0
TMA_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "uint32": 4, "int32": 4}  # the dtypes the templates map
# Shared memory a block may opt in to on the devices with wgmma (the device model's).
MAX_DYNAMIC_SMEM = most("smem_per_block_optin", "wgmma")
# Register split after setmaxnreg (``consumer_regs``). The producer warpgroup shrinks to
# PRODUCER_REGS (TMA alone needs few); the consumers grow into what it gives back.
PRODUCER_REGS = 40
SUPPORTED_WARPGROUPS = (1, 2)
SETMAXNREG_STEP = 8  # setmaxnreg counts are multiples of 8 (PTX ISA)
# A dequantized B (4-bit words, ``ops.dequant``): the whole producer warpgroup works. Each thread
# streams its pieces of the packed slice (16-byte pieces of 32 values along K, 4 words) and, per
# piece, the aligned pair of scales holding its scale, by cp.async into a staging ring of
# ``q4_staging`` slices (its own data: after its own wait_group it converts them, no barrier), converts
# them (half2 bit trick, bit for bit MLC's ``(dtype(q) - dtype(7)) * scale``) into the slot's
# swizzled fp16/bf16 B tile, fences the generic-proxy writes for wgmma's async proxy and arrives on
# the slot's "full" barrier (count 1 + 128: the leader's expect_tx for A's TMA, then every producer
# thread). It needs more registers than TMA alone (``consumer_regs`` gives the consumers the rest).
Q4_PIECE = 32  # values of one 16-byte piece of packed words
Q4_PRODUCER_REGS = 56
# Keeps the compiler from reading an accumulator before the wgmma wait above it.
REGISTER_FENCE = "fuselight_wgmma_register_fence"
REGISTER_FENCE_SOURCE = f"""
__forceinline__ __device__ void {REGISTER_FENCE}(float& reg) {{
    asm volatile("" : "+f"(reg) :: "memory");
}}
"""
DEFAULT_TILE = "default"  # the tile config name for large M
# wgmma groups left running while the next slot is waited for (the slot before is released).
GROUPS_IN_FLIGHT = 1


@dataclasses.dataclass(frozen=True)
class WgmmaTile:
    """Tile config: ``block_n`` columns, ``warpgroups`` x 64 rows, ``stages`` shared-memory slots,
    ``group_m`` row tiles per raster group, at most ``max_blocks`` persistent blocks."""

    block_n: int
    warpgroups: int
    stages: int
    group_m: int
    max_blocks: int
    # Slices of a dequantized B's packed words staged ahead (see WgmmaTile.q4_staging); unused without one.
    q4_staging: int = 3

    @property
    def block_m(self) -> int:
        return WGMMA_M * self.warpgroups

    @property
    def threads(self) -> int:
        return WARPGROUP * (self.warpgroups + 1)

    @property
    def slot_bytes(self) -> int:
        return (self.block_m + self.block_n) * BLOCK_K * ELEM_BYTES

    @property
    def epilogue_bytes(self) -> int:
        return self.warpgroups * WGMMA_M * EPI_COLS * FLOAT_BYTES

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.slot_bytes + 2 * MBAR_BYTES) + self.epilogue_bytes


def q4_staging_bytes(tile: WgmmaTile) -> int:
    """Bytes of one staged slice of a dequantized B: packed words (block_n rows of 64 values, 4 bits
    each) and a 4-byte pair of scales per 16-byte piece."""
    pieces = tile.block_n * BLOCK_K // Q4_PIECE
    return pieces * 16 + pieces * 4


def smem_bytes(tile: WgmmaTile, ops: GemmOperands) -> int:
    """Shared memory of ``tile`` computing ``ops`` (a dequantized B adds its staging ring)."""
    if ops.dequant is None:
        return tile.smem_bytes
    return tile.smem_bytes + tile.q4_staging * q4_staging_bytes(tile)


def consumer_regs(warpgroups: int, producer_regs: int) -> int | None:
    """What each consumer warpgroup grows to once the producer has shrunk to ``producer_regs``, or
    None (no rebalancing) with one consumer warpgroup, where ptxas allocates what the code needs
    (about 105 at block_n 128), too few to move.

    The launch gives every thread the block's register file over its threads (in steps of 8: 168
    for 384 threads). ``setmaxnreg.inc`` waits until the block's own pool holds what it asks, so
    the consumers may take exactly what the producer gives back and no more: with one register
    too many a thread-slot, every kernel hangs (the first 4-bit wgmma GEMM did, at 64 + 2 x 224)."""
    if warpgroups == 1:
        return None
    threads = WARPGROUP * (warpgroups + 1)
    per_thread = min(most("regs_per_block", "wgmma") // threads, most("max_regs_per_thread", "wgmma"))
    per_thread -= per_thread % SETMAXNREG_STEP
    share = ((warpgroups + 1) * per_thread - producer_regs) // warpgroups
    return share - share % SETMAXNREG_STEP


@dataclasses.dataclass(frozen=True)
class WgmmaPlan:
    """A tile with K split over ``split_k`` work units per output tile (> 1: each stores fp32
    partial sums, a second launch reduces them and runs the epilogue; see ``split_k``)."""

    tile: WgmmaTile
    split_k: int = 1


def load_wgmma_tiles(arch: str) -> dict[str, WgmmaTile]:
    """The named tiles for ``arch`` (e.g. ``sm_90``) from ``configs/gemm/wgmma.json``: measured only
    (no analytic tiles), and only for a device with wgmma; FuselightError if the arch has no
    ``default`` (large-M) tile."""
    device = require_device(arch)
    if not device.has("wgmma"):
        raise FuselightError(f"wgmma gemm: {arch} has no wgmma (configs/targets/devices.json)")
    path = config_dir() / "gemm" / "wgmma.json"
    node = read_json_object(path, missing=f"gemm config not found: {path}")
    if DEFAULT_TILE not in node.get(arch, {}):
        raise FuselightError(f"{path}: no entry {arch!r} with a {DEFAULT_TILE!r} tile (no measured wgmma tiles)")
    where = f"{path}[{arch!r}]"
    names = per_sm_counts(device, node[arch], where)
    return {name: from_fields(WgmmaTile, names[name], f"{where}[{name!r}]") for name in names}


def load_wgmma_tile(arch: str) -> WgmmaTile:
    """The default (large-M) tile for ``arch`` (``load_wgmma_tiles``)."""
    return load_wgmma_tiles(arch)[DEFAULT_TILE]


def check_tile(tile: WgmmaTile, ops: GemmOperands, split_k: int = 1) -> None:
    """FuselightError naming the problem if ``tile`` with K split ``split_k`` ways cannot compute ``ops``."""
    if ops.dtype not in DTYPES:
        raise FuselightError(f"wgmma gemm: dtype {ops.dtype!r} unsupported (supported: {', '.join(DTYPES)})")
    if ops.dequant is not None:
        check_q4(tile, ops)
    if ops.b_layout != "NT":
        raise FuselightError(
            f"wgmma gemm: B layout {ops.b_layout!r} unsupported (supported: NT of {B_LAYOUTS})"
        )
    if tile.block_n % WGMMA_N_STEP or tile.block_n > WGMMA_N_MAX:
        raise FuselightError(
            f"wgmma tile: block_n {tile.block_n} must be a multiple of {WGMMA_N_STEP} up to {WGMMA_N_MAX}"
        )
    if tile.block_n % EPI_COLS:
        raise FuselightError(f"wgmma tile: block_n {tile.block_n} must be a multiple of {EPI_COLS} (the epilogue chunk)")
    if tile.warpgroups not in SUPPORTED_WARPGROUPS:
        raise FuselightError(
            f"wgmma tile: warpgroups {tile.warpgroups} unsupported (supported: {list(SUPPORTED_WARPGROUPS)})"
        )
    if not isinstance(ops.n, int) or ops.n % tile.block_n:
        raise FuselightError(f"wgmma gemm: n {ops.n} is not a multiple of block_n {tile.block_n}")
    if not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1:
        raise FuselightError(f"wgmma plan: split_k must be a positive integer, got {split_k!r}")
    if ops.k % (BLOCK_K * split_k):
        raise FuselightError(f"wgmma gemm: k {ops.k} is not a multiple of {BLOCK_K} x split_k {split_k}")
    if tile.stages < GROUPS_IN_FLIGHT + 1:
        raise FuselightError(f"wgmma tile: stages {tile.stages} must be at least {GROUPS_IN_FLIGHT + 1}")
    if smem_bytes(tile, ops) > MAX_DYNAMIC_SMEM:
        raise FuselightError(
            f"wgmma tile: {tile.stages} stages of {tile.block_m}x{BLOCK_K} + {tile.block_n}x{BLOCK_K} "
            f"and the epilogue{' and the 4-bit staging' if ops.dequant is not None else ''} need "
            f"{smem_bytes(tile, ops)} bytes of shared memory (at most {MAX_DYNAMIC_SMEM})"
        )


def check_q4(tile: WgmmaTile, ops: GemmOperands) -> None:
    """FuselightError naming the problem if the producer cannot dequantize ``ops``' B for ``tile``:
    4-bit values 8 to a 32-bit word along K (NK), a group of a multiple of 32, an integer zero point
    the conversion subtracts exactly, whole 4-byte pairs of scales, a static N, no paired epilogue."""
    deq = ops.dequant
    check_q4_words(ops, "wgmma gemm", Q4_PIECE)
    if deq.dtype != ops.dtype:
        raise FuselightError(f"wgmma gemm: dequantized dtype {deq.dtype} differs from A's {ops.dtype}")
    if not isinstance(ops.n, int):
        raise FuselightError("wgmma gemm: a dequantized B needs a static n")
    if (ops.k // deq.group) % 2:
        raise FuselightError(f"wgmma gemm: {ops.k // deq.group} scales a row are no whole 4-byte pairs")
    if ops.paired:
        raise FuselightError("wgmma gemm: a paired epilogue with a dequantized B is unsupported")
    if tile.block_n * BLOCK_K // Q4_PIECE % WARPGROUP:
        raise FuselightError(f"wgmma tile: block_n {tile.block_n}: the producer's 128 threads cannot share its pieces")


def matrix_desc(base: Any, byte_offset: Any) -> Any:
    """The wgmma matrix descriptor ``base`` (encoded at the shared buffer's start) moved ``byte_offset``
    bytes on: the start address is the descriptor's low field, in 16-byte units, so offsets add to it."""
    return base + T.Cast("uint64", byte_offset // 16)


def fence_register(reg: Any) -> Any:
    """A call keeping the compiler from reading accumulator ``reg`` before the wgmma wait above it."""
    return cuda_op.cuda_func_call(REGISTER_FENCE, reg, source_code=REGISTER_FENCE_SOURCE)


def float_pointer(ptr: Any, dtype: str = "float32") -> Any:
    """``ptr`` (a shared-memory access pointer) as a pointer to ``dtype`` (default ``float*``)."""
    return tvm.ir.expr.Call(tvm.ir.Op.get("tirx.reinterpret"), [ptr], ret_ty=T.handle(dtype).ty)


def encode_tiled(tensor_map: Any, buf: Any, dtype: str, inner: Any, rows: Any, box_inner: int, box_rows: int,
                 swizzle: int) -> Any:
    """Host call encoding a TMA map of row-major ``buf`` (``rows`` x ``inner`` elements of ``dtype``),
    boxes of ``box_rows`` x ``box_inner``, zero fill past the extents."""
    elem_bytes = TMA_ELEM_BYTES[dtype]
    # Dims and box innermost first: the contiguous extent, then rows; the row stride in bytes.
    return T.call_packed(
        "runtime.cuTensorMapEncodeTiled", tensor_map, dtype, 2, buf.data,
        inner, rows, inner * elem_bytes, box_inner, box_rows, 1, 1,
        TMA_INTERLEAVE_NONE, swizzle, TMA_L2_PROMOTION_256B, TMA_OOB_ZERO,
    )  # fmt: skip


def tma_load_2d(smem: Any, offset: int | Any, barrier: Any, tensor_map: Any, x: Any, y: Any) -> Any:
    """A TMA load of the box at element coordinates (``x`` innermost, ``y``) into ``smem`` at byte
    ``offset``, completing on the mbarrier at ``barrier``."""
    return T.ptx.cp_async.bulk.tensor.g2s_cta(
        2, smem.access_ptr("w", offset=offset), barrier, T.address_of(tensor_map), 1, "", x, y,
    )  # fmt: skip


def setup_macro(full: Any, empty: Any, stages: int, full_count: int, empty_count: int) -> Any:
    """A block's start (``setup(smem, smem_desc, tid)``): the matrix descriptor of the shared buffer's
    start into ``smem_desc[0]``, each slot's "full" (``full_count`` arrivals) and "empty"
    (``empty_count``) mbarriers initialised by thread 0, then a barrier."""
    @T.macro
    def setup(smem, smem_desc, tid):
        T.ptx.wgmma.encode_matrix_descriptor(
            T.address_of(smem_desc[0]), smem.access_ptr("r"), DESC_LBO, DESC_SBO, DESC_SWIZZLE_128B
        )
        if tid == 0:
            for s in T.unroll(stages):
                T.ptx.mbarrier.init(full(smem, s), full_count)
                T.ptx.mbarrier.init(empty(smem, s), empty_count)
            # The barriers are completed by TMA, through the async proxy.
            T.ptx.fence.proxy_async("shared::cta")
        T.tvm_storage_sync("shared")

    return setup


def retire_macro(empty: Any, stages: int, k_tiles: int, n_acc: int) -> Any:
    """A consumer's end of a work tile (``retire(smem, acc, tid, ti)``): its last wgmma group
    retired, the slot of its last slice released (``empty(smem, slot)``: the barrier's pointer), the
    accumulators fenced so nothing reads them earlier."""
    @T.macro
    def retire(smem, acc, tid, ti):
        T.ptx.wgmma.wait_group(0)
        if tid % WARP == 0:
            T.ptx.mbarrier.arrive(empty(smem, T.truncmod(ti * k_tiles + k_tiles - 1, stages)))
        for i in T.unroll(n_acc):
            T.evaluate(fence_register(acc[i]))

    return retire


# Grouped order of tile t: group_m row tiles sweep the columns together. (All non-negative:
# truncating division is floor division here, and cheaper.)
def _rows_in_group(t: Any, m_tiles: Any, n_tiles: int, group_m: int) -> Any:
    return T.min(m_tiles - T.truncdiv(t, group_m * n_tiles) * group_m, group_m)


def grouped_row(t: Any, m_tiles: Any, n_tiles: int, group_m: int) -> Any:
    """The row-tile index of tile ``t`` in the grouped order (``group_m`` row tiles sweep the columns)."""
    in_group = T.truncmod(t, group_m * n_tiles)
    group_row = T.truncmod(in_group, _rows_in_group(t, m_tiles, n_tiles, group_m))
    return T.truncdiv(t, group_m * n_tiles) * group_m + group_row


def grouped_col(t: Any, m_tiles: Any, n_tiles: int, group_m: int) -> Any:
    """The column-tile index of tile ``t`` in the grouped order."""
    return T.truncdiv(T.truncmod(t, group_m * n_tiles), _rows_in_group(t, m_tiles, n_tiles, group_m))


def wgmma_gemm(ops: GemmOperands, tile: WgmmaTile, split_k: int = 1) -> tvm.tirx.Stmt:
    """The body (a ``tvm.tirx.Stmt``: host code encoding the tensor maps, then the kernel, and with
    ``split_k`` > 1 the reduction's launch) computing ``ops``.

    It uses ``ops``' buffers as they are: bind it to the analysed function's params.
    """
    check_tile(tile, ops, split_k)
    for what, buf in (("A", ops.a), ("B", ops.b)):
        # The tensor maps start at the buffer's data pointer.
        if not isinstance(buf.elem_offset, tvm.tirx.IntImm) or buf.elem_offset.value != 0:
            raise FuselightError(f"wgmma gemm: {what} buffer has element offset {buf.elem_offset} (must be 0)")
    dtype, n, k = ops.dtype, ops.n, ops.k
    bm, bn, stages, consumers = tile.block_m, tile.block_n, tile.stages, tile.warpgroups * WARPGROUP
    a_slot, b_slot = bm * BLOCK_K * ELEM_BYTES, bn * BLOCK_K * ELEM_BYTES  # bytes per stage
    b_base = stages * a_slot
    epi_base = stages * tile.slot_bytes // FLOAT_BYTES  # in floats; each warpgroup's chunk follows
    epi_chunk = WGMMA_M * EPI_COLS  # floats
    bar_base = stages * tile.slot_bytes + tile.epilogue_bytes
    k_tiles = k // BLOCK_K // split_k  # per work unit
    n_tiles = n // bn
    n_acc = WGMMA_M * bn // WARPGROUP  # fp32 accumulators per thread
    consumer_warps = consumers // WARP
    pieces = EPI_COLS // EPI_VEC  # per chunk row
    out_buf = ops.out.buffer
    pair = ops.out.pair_offset
    # Output pieces a chunk row yields (paired: its gate half pairs with its up half); output
    # columns a tile yields.
    out_pieces = pieces if pair is None else pieces // 2
    out_bn = bn if pair is None else bn // 2
    b_box = out_bn  # B rows one TMA box loads (two boxes a slot when paired)
    reduce_blocks = reduction(ops, split_k) if split_k > 1 else None
    deq = ops.dequant
    total_smem = smem_bytes(tile, ops)
    producer_regs = PRODUCER_REGS if ops.dequant is None else Q4_PRODUCER_REGS
    grown_regs = consumer_regs(tile.warpgroups, producer_regs)
    if deq is not None:
        # The staging ring after the barriers (16-byte aligned: stages x 2 barriers of 8 bytes).
        staging_base = tile.stages * (tile.slot_bytes + 2 * MBAR_BYTES) + tile.epilogue_bytes
        staging_bytes = q4_staging_bytes(tile)
        staging = tile.q4_staging
        slice_pieces = bn * BLOCK_K // Q4_PIECE  # of packed words in a slice (not the epilogue's ``pieces``)
        packed_bytes = slice_pieces * 16
        thread_pieces = slice_pieces // WARPGROUP
        words_row, groups_row = k // deq.per_word, k // deq.group
        deq_fn, deq_src = Q4_DEQUANT[dtype], q4_dequant_source(dtype, int(deq.zero))
    full_count = 1 if deq is None else 1 + WARPGROUP

    def mma(desc_a, desc_b, acc):
        return cuda_op.ptx_wgmma_mma_async_ss(
            desc_a, desc_b, *[acc[i] for i in range(n_acc)],
            M=WGMMA_M, N=bn, K=WGMMA_K, in_dtype=dtype, out_dtype="float32",
            transA=False, transB=False, scaleA=1.0, scaleB=1.0, scaleD=1,
        )  # fmt: skip

    def full(smem, slot):
        return smem.access_ptr("w", offset=bar_base + slot * MBAR_BYTES)

    def empty(smem, slot):
        return smem.access_ptr("w", offset=bar_base + (stages + slot) * MBAR_BYTES)

    def encode(tensor_map, buf, rows, box_rows):
        return encode_tiled(tensor_map, buf, dtype, k, rows, BLOCK_K, box_rows, TMA_SWIZZLE_128B)

    def tile_row(t, m_tiles):
        return grouped_row(t, m_tiles, n_tiles, tile.group_m) * bm

    def tile_col(t, m_tiles):
        return grouped_col(t, m_tiles, n_tiles, tile.group_m) * bn

    # Work unit u: tile u % tiles, K split u / tiles (concurrent units share a K range: A and B in L2).
    def unit_tile(u, m_tiles):
        return u if split_k == 1 else T.truncmod(u, m_tiles * n_tiles)

    def unit_split(u, m_tiles):
        return 0 if split_k == 1 else T.truncdiv(u, m_tiles * n_tiles)

    def acc_col(n0, j):
        # GEMM column of the tile's accumulator column j (a multiple of 8): paired, the first
        # block_n / 2 are gate columns from n0 / 2, the rest up columns pair_offset further.
        if pair is None:
            return n0 + j
        return T.if_then_else(j < out_bn, n0 // 2 + j, pair + n0 // 2 + j - out_bn)

    def acc_group(cc, jj):
        # The accumulators' 8-column group staged as piece jj of chunk cc: paired, pieces 0-3 are
        # gate columns of the tile's first half, 4-7 the up columns block_n / 2 further.
        if pair is None or split_k > 1:
            return cc * pieces + jj
        return cc * out_pieces + jj % out_pieces + jj // out_pieces * (out_bn // EPI_VEC)

    def tma_load(smem, offset, slot, tensor_map, kt, row):
        return tma_load_2d(smem, offset, full(smem, slot), tensor_map, kt * BLOCK_K, row)

    def cp_async(name, *args):
        return T.evaluate(cuda_op.cuda_func_call(name, *args, source_code=CP_ASYNC[name]))

    def cp_async_wait(pending):
        name, src = cp_async_wait_source(pending)
        return T.evaluate(cuda_op.cuda_func_call(name, source_code=src))

    def q4_load(hsmem, j, ptid, m_tiles, bx, blocks):
        # This thread's pieces of the block's slice j (work unit j / k_tiles of the block, K slice
        # j % k_tiles of it) and their scales into staging slot j % staging. (Offsets in halves.)
        unit = unit_tile(bx + T.truncdiv(j, k_tiles) * blocks, m_tiles)
        n0 = tile_col(unit, m_tiles)
        kslice = unit_split(bx + T.truncdiv(j, k_tiles) * blocks, m_tiles) * k_tiles + T.truncmod(j, k_tiles)
        stage = staging_base + T.truncmod(j, staging) * staging_bytes
        for p in range(thread_pieces):
            piece = p * WARPGROUP + ptid
            row = T.Cast("int64", n0 + piece // 2)
            kel = kslice * BLOCK_K + piece % 2 * Q4_PIECE
            cp_async("fuselight_cp_async_16", hsmem, (stage + piece * 16) // 2,
                     ops.b.access_ptr("r", offset=row * words_row + kel // deq.per_word))
            cp_async("fuselight_cp_async_4", hsmem, (stage + packed_bytes + piece * 4) // 2,
                     deq.scale.access_ptr("r", offset=row * groups_row + kel // deq.group // 2 * 2))

    def q4_convert(hsmem, it, kslice, slot, ptid):
        # This thread's pieces of slice ``it`` (staged by itself, waited for) into the slot's B
        # tile: row r's 16-byte piece c at c ^ (r % 8), the 128-byte swizzle TMA and wgmma use.
        stage = staging_base + T.truncmod(it, staging) * staging_bytes
        for p in range(thread_pieces):
            piece = p * WARPGROUP + ptid
            row = piece // 2
            kel = kslice * BLOCK_K + piece % 2 * Q4_PIECE
            T.evaluate(cuda_op.cuda_func_call(
                deq_fn, hsmem, (stage + piece * 16) // 2,
                (stage + packed_bytes + piece * 4) // 2 + T.truncmod(kel // deq.group, 2),
                (b_base + slot * b_slot) // ELEM_BYTES + row * BLOCK_K, piece % 2 * (Q4_PIECE // 8), row % 8,
                source_code=deq_src,
            ))  # fmt: skip

    retire = retire_macro(empty, stages, k_tiles, n_acc)
    setup = setup_macro(full, empty, stages, full_count, consumer_warps)

    # fmt: off
    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        if split_k > 1:
            part = T.alloc_buffer((split_k * ops.m * n,), "float32", scope="global")
        m: T.let[T.int32] = T.Cast("int32", ops.m)
        a_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.evaluate(encode(a_map, ops.a, m, bm))
        if deq is None:
            b_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.evaluate(encode(b_map, ops.b, n, b_box))
        m_tiles: T.let[T.int32] = T.ceildiv(m, bm)
        units: T.let[T.int32] = m_tiles * n_tiles * split_k
        blocks: T.let[T.int32] = T.min(units, tile.max_blocks)
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tid in T.thread_binding(tile.threads, thread="threadIdx.x"):
                with T.sblock("gemm"):
                    T.reads()
                    T.writes()
                    # Raw bytes: every kernel of a CUDA source that declares this extern array must
                    # give it the same type (an fp16 and a bf16 GEMM in one module would clash).
                    buf_dyn_shmem = T.sblock_alloc_buffer((total_smem,), "uint8", scope="shared.dyn", align=ATOM_BYTES)
                    acc = T.sblock_alloc_buffer((n_acc,), "float32", scope="local")
                    smem_desc = T.sblock_alloc_buffer((1,), "uint64", scope="local")
                    if split_k == 1:
                        vals = T.sblock_alloc_buffer((WGMMA_M * out_pieces // WARPGROUP * EPI_VEC,), out_buf.dtype, scope="local")
                    # The epilogue chunks, through a plain pointer: each warpgroup syncs its own with a
                    # named barrier, which TVM's shared-memory sync planner does not know (it would put
                    # a block-wide barrier under the consumers' branch).
                    epi_ptr: T.let[T.handle("float32")] = float_pointer(buf_dyn_shmem.access_ptr("rw", offset=epi_base * FLOAT_BYTES))
                    epi = T.decl_buffer((tile.epilogue_bytes // FLOAT_BYTES,), "float32", data=epi_ptr)
                    wg: T.let[T.int32] = tid // WARPGROUP
                    # This block's work units: bx, bx + blocks, ...; each at step (its count) * k_tiles.
                    my_tiles: T.let[T.int32] = T.truncdiv(units - bx + blocks - 1, blocks)
                    setup(buf_dyn_shmem, smem_desc, tid)
                    if wg == tile.warpgroups:
                        if grown_regs is not None:
                            T.ptx.setmaxnreg(False, producer_regs)
                        if deq is not None:
                            # The B-load hook for a dequantized B (see WgmmaTile.q4_staging): the whole warpgroup.
                            ptid: T.let[T.int32] = tid - consumers
                            slices: T.let[T.int32] = my_tiles * k_tiles
                            # Always staging - 1 groups ahead (empty past the last slice): the waits count on it.
                            for j in T.unroll(staging - 1):
                                if j < slices:
                                    q4_load(buf_dyn_shmem.data, j, ptid, m_tiles, bx, blocks)
                                T.ptx.cp_async.commit_group()
                            for ti in T.serial(my_tiles):
                                m0: T.let[T.int32] = tile_row(unit_tile(bx + ti * blocks, m_tiles), m_tiles)
                                k0: T.let[T.int32] = unit_split(bx + ti * blocks, m_tiles) * k_tiles
                                for kt in T.serial(k_tiles):
                                    it: T.let[T.int32] = ti * k_tiles + kt
                                    slot: T.let[T.int32] = T.truncmod(it, stages)
                                    # Staging slot of slice it + staging - 1: converted by this thread at it - 1.
                                    if it + staging - 1 < slices:
                                        q4_load(buf_dyn_shmem.data, it + staging - 1, ptid, m_tiles, bx, blocks)
                                    T.ptx.cp_async.commit_group()
                                    if it >= stages:
                                        T.ptx.mbarrier.try_wait(empty(buf_dyn_shmem, slot), T.truncmod(T.truncdiv(it, stages) + 1, 2))
                                    if tid == consumers:
                                        T.ptx.mbarrier.arrive.expect_tx(full(buf_dyn_shmem, slot), a_slot)
                                        T.evaluate(tma_load(buf_dyn_shmem, slot * a_slot, slot, a_map, k0 + kt, m0))
                                    cp_async_wait(staging - 1)  # this thread's pieces of slice it have landed
                                    q4_convert(buf_dyn_shmem.data, it, k0 + kt, slot, ptid)
                                    # The generic-proxy writes, then visible to wgmma's async proxy.
                                    T.ptx.fence.proxy_async("shared::cta")
                                    T.ptx.mbarrier.arrive(full(buf_dyn_shmem, slot))
                        elif tid == consumers:
                            for ti in T.serial(my_tiles):
                                m0: T.let[T.int32] = tile_row(unit_tile(bx + ti * blocks, m_tiles), m_tiles)
                                n0: T.let[T.int32] = tile_col(unit_tile(bx + ti * blocks, m_tiles), m_tiles)
                                k0: T.let[T.int32] = unit_split(bx + ti * blocks, m_tiles) * k_tiles
                                for kt in T.serial(k_tiles):
                                    it: T.let[T.int32] = ti * k_tiles + kt
                                    slot: T.let[T.int32] = T.truncmod(it, stages)
                                    if it >= stages:
                                        T.ptx.mbarrier.try_wait(empty(buf_dyn_shmem, slot), T.truncmod(T.truncdiv(it, stages) + 1, 2))
                                    T.ptx.mbarrier.arrive.expect_tx(full(buf_dyn_shmem, slot), tile.slot_bytes)
                                    T.evaluate(tma_load(buf_dyn_shmem, slot * a_slot, slot, a_map, k0 + kt, m0))
                                    if pair is None:
                                        T.evaluate(tma_load(buf_dyn_shmem, b_base + slot * b_slot, slot, b_map, k0 + kt, n0))
                                    else:
                                        T.evaluate(tma_load(buf_dyn_shmem, b_base + slot * b_slot, slot, b_map, k0 + kt, n0 // 2))
                                        T.evaluate(tma_load(buf_dyn_shmem, b_base + slot * b_slot + b_slot // 2, slot, b_map, k0 + kt, pair + n0 // 2))
                    else:
                        if grown_regs is not None:
                            T.ptx.setmaxnreg(True, grown_regs)
                        for ti in T.serial(my_tiles):
                            m0: T.let[T.int32] = tile_row(unit_tile(bx + ti * blocks, m_tiles), m_tiles)
                            n0: T.let[T.int32] = tile_col(unit_tile(bx + ti * blocks, m_tiles), m_tiles)
                            split: T.let[T.int32] = unit_split(bx + ti * blocks, m_tiles)
                            for i in T.unroll(n_acc):
                                acc[i] = T.float32(0)
                            for kt in T.serial(k_tiles):
                                it: T.let[T.int32] = ti * k_tiles + kt
                                slot: T.let[T.int32] = T.truncmod(it, stages)
                                T.ptx.mbarrier.try_wait(full(buf_dyn_shmem, slot), T.truncmod(T.truncdiv(it, stages), 2))
                                T.ptx.wgmma.fence()
                                for kk in T.unroll(BLOCK_K // WGMMA_K):
                                    T.evaluate(mma(
                                        matrix_desc(smem_desc[0], slot * a_slot + (wg * WGMMA_M * BLOCK_K + kk * WGMMA_K) * ELEM_BYTES),
                                        matrix_desc(smem_desc[0], b_base + slot * b_slot + kk * WGMMA_K * ELEM_BYTES),
                                        acc,
                                    ))
                                T.ptx.wgmma.commit_group()
                                T.ptx.wgmma.wait_group(GROUPS_IN_FLIGHT)
                                # The group before this one has retired (in this warp): its slot is free.
                                if kt > 0 and tid % WARP == 0:
                                    T.ptx.mbarrier.arrive(empty(buf_dyn_shmem, T.truncmod(it + stages - 1, stages)))
                            retire(buf_dyn_shmem, acc, tid, ti)
                            # Accumulator 4j + 2h + e: row lane / 4 + 8h of the warp's 16, column
                            # 8j + 2 (lane % 4) + e; a chunk holds j = 8 cc .. 8 cc + 7 (piece j % 8).
                            for cc in T.unroll(bn // EPI_COLS):
                                for jj in T.unroll(pieces):
                                    for h in T.unroll(2):
                                        for e in T.vectorized(2):
                                            epi[wg * epi_chunk + ((tid % WARPGROUP) // WARP * 16 + (tid % WARP) // 4 + h * 8) * EPI_COLS
                                                + T.bitwise_xor(jj, (tid % WARP) // 4) * EPI_VEC + tid % 4 * 2 + e] = acc[acc_group(cc, jj) * 4 + h * 2 + e]
                                T.cuda.warpgroup_sync(1 + wg)
                                if split_k > 1:
                                    # Thread t of the warpgroup: piece t % 8 of rows t / 8 + 16 i, the
                                    # unit's fp32 sums (32 bytes a thread) for the reduction.
                                    for i in T.unroll(WGMMA_M * pieces // WARPGROUP):
                                        row: T.let[T.int32] = i * (WARPGROUP // pieces) + (tid % WARPGROUP) // pieces
                                        r: T.let[T.int32] = m0 + wg * WGMMA_M + row
                                        if r < m:
                                            for e in T.vectorized(EPI_VEC):
                                                part[T.Cast("int64", split * m + r) * n + acc_col(n0, cc * EPI_COLS + tid % pieces * EPI_VEC) + e] = epi[
                                                    wg * epi_chunk + row * EPI_COLS + T.bitwise_xor(tid % pieces, row % 8) * EPI_VEC + e]
                                else:
                                    # Thread t of the warpgroup: output piece t % p of rows t / p + (128 / p) i
                                    # (p = out_pieces). All values first (rows past M clamped to the last row, so
                                    # the epilogue's loads are unconditional and overlap), then the stores of rows below M.
                                    for i in T.unroll(WGMMA_M * out_pieces // WARPGROUP):
                                        row: T.let[T.int32] = i * (WARPGROUP // out_pieces) + (tid % WARPGROUP) // out_pieces
                                        for e in T.vectorized(EPI_VEC):
                                            if pair is None:
                                                vals[i * EPI_VEC + e] = ops.out.value(
                                                    T.Cast("int64", T.min(m0 + wg * WGMMA_M + row, m - 1)), n0 + cc * EPI_COLS + tid % pieces * EPI_VEC + e,
                                                    epi[wg * epi_chunk + row * EPI_COLS + T.bitwise_xor(tid % pieces, row % 8) * EPI_VEC + e],
                                                )
                                            else:
                                                vals[i * EPI_VEC + e] = ops.out.value(
                                                    T.Cast("int64", T.min(m0 + wg * WGMMA_M + row, m - 1)), n0 // 2 + cc * (EPI_COLS // 2) + tid % out_pieces * EPI_VEC + e,
                                                    epi[wg * epi_chunk + row * EPI_COLS + T.bitwise_xor(tid % out_pieces, row % 8) * EPI_VEC + e],
                                                    epi[wg * epi_chunk + row * EPI_COLS + T.bitwise_xor(tid % out_pieces + out_pieces, row % 8) * EPI_VEC + e],
                                                )
                                    for i in T.unroll(WGMMA_M * out_pieces // WARPGROUP):
                                        r: T.let[T.int32] = m0 + wg * WGMMA_M + i * (WARPGROUP // out_pieces) + (tid % WARPGROUP) // out_pieces
                                        if r < m:
                                            for e in T.vectorized(EPI_VEC):
                                                out_buf[ops.out.index(T.Cast("int64", r), n0 * out_bn // bn + cc * (EPI_COLS * out_bn // bn) + tid % out_pieces * EPI_VEC + e)] = vals[i * EPI_VEC + e]
                                # The chunk is read before the next overwrites it.
                                T.cuda.warpgroup_sync(1 + wg)
        if split_k > 1:
            reduce_blocks(part)
    # fmt: on
    return body.body
