"""Tile plans of the mma.sync GEMM template: what one block computes, and how M is covered.

A ``GemmTile`` is one block's ``block_m x block_n`` output tile, accumulated over ``block_k``-wide
slices of K streamed through ``stages`` shared-memory buffers by ``warps_m x warps_n`` warps, each
owning a ``block_m / warps_m x block_n / warps_n`` piece. A ``GemmPlan`` covers a GEMM whose M is
only known at run time: ``main`` tiles over the whole multiples of ``main.block_m`` and ``rest``
tiles over the remaining rows, in one launch; or, with no ``rest``, ``main`` tiles over all rows,
the last one predicated. ``split_k`` > 1 splits K over blocks (small M, where the output tiles
alone cannot fill the GPU). N and K are static and must be multiples of the tiles' ``block_n`` and
``block_k * split_k``: the template specialises them and predicates nothing but M.
"""

from __future__ import annotations

import dataclasses

from fuselight.device import least, most, require_device, warp_size
from fuselight.errors import FuselightError
from fuselight.paths import config_dir

from .. import arch_config
from ..arch_config import arch_entry
from .operands import DTYPES, GemmOperands, check_q4_words

# mma.sync.m16n8k16: a warp's row block, the k step, the n width of one accumulator tile. A warp's
# piece spans whole 16 x 16 blocks (one ldmatrix.x4 of A, or of B for two n tiles).
MMA_M, MMA_K, MMA_N = 16, 16, 8
WARP = warp_size()
MAX_THREADS = least("max_threads_per_block")
# One cp.async / ldmatrix row piece: 16 bytes = 8 halves; an fp32 output row piece: 8 floats.
CHUNK = 8
# block_k: a power of two from one mma k step to 16 pieces a row (the XOR swizzle's range).
BLOCK_K_CHOICES = (16, 32, 64, 128)
# Dynamic shared memory a block may opt in to on the largest described device: the template's bound
# where no arch is at hand (``smem_limit`` None); the dispatcher checks against its arch's own.
MAX_SHARED_BYTES = most("smem_per_block_optin")
# Accumulators a thread holds; more spill out of the 255 registers a thread can have.
MAX_ACCUMULATORS = 128
# The fp32 output tile staged in shared memory has rows padded by this many floats (32 bytes), so
# the accumulator layout's 8 rows x 8 bytes writes of a warp fall in different banks.
EPILOGUE_ROW_PAD = 8
ELEMENT_BYTES = 2
SUPPORTED_B_LAYOUTS = ("NT",)


@dataclasses.dataclass(frozen=True)
class GemmTile:
    """One block's tile: ``block_m x block_n`` outputs, K in ``block_k`` slices, ``stages`` buffers."""

    block_m: int
    block_n: int
    block_k: int
    warps_m: int
    warps_n: int
    stages: int

    @property
    def threads(self) -> int:
        return WARP * self.warps_m * self.warps_n

    @property
    def warp_m(self) -> int:
        return self.block_m // self.warps_m

    @property
    def warp_n(self) -> int:
        return self.block_n // self.warps_n

    @property
    def pipeline_halves(self) -> int:
        """Elements of the A and B stage buffers."""
        return self.stages * (self.block_m + self.block_n) * self.block_k

    @property
    def epilogue_floats(self) -> int:
        """Elements of the fp32 output tile staged for the epilogue (rows padded)."""
        return self.block_m * (self.block_n + EPILOGUE_ROW_PAD)

    @property
    def shared_bytes(self) -> int:
        # The epilogue reuses the pipeline's buffers once the last slice is consumed.
        return max(self.pipeline_halves * ELEMENT_BYTES, self.epilogue_floats * 4)


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """How a GEMM is covered: ``main`` tiles, ``rest`` tiles for the rows past the last whole main
    tile (None: main tiles, the last predicated), K split over ``split_k`` blocks."""

    main: GemmTile
    rest: GemmTile | None = None
    split_k: int = 1


def check_tile(tile: GemmTile, what: str = "tile", smem_limit: int | None = None) -> None:
    """FuselightError naming the field if ``tile`` is not a valid mma.sync tile (any shape) within
    ``smem_limit`` bytes of shared memory (None: ``MAX_SHARED_BYTES``)."""
    smem_limit = smem_limit or MAX_SHARED_BYTES
    for field in dataclasses.fields(GemmTile):
        v = getattr(tile, field.name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise FuselightError(f"gemm {what}: {field.name} must be a positive integer, got {v!r}")
    if tile.block_m % (MMA_M * tile.warps_m):
        raise FuselightError(
            f"gemm {what}: block_m {tile.block_m} must be a multiple of {MMA_M} x warps_m ({tile.warps_m})"
        )
    if tile.block_n % (2 * MMA_N * tile.warps_n):
        raise FuselightError(
            f"gemm {what}: block_n {tile.block_n} must be a multiple of {2 * MMA_N} x warps_n ({tile.warps_n})"
        )
    if tile.block_k not in BLOCK_K_CHOICES:
        raise FuselightError(f"gemm {what}: block_k {tile.block_k} must be one of {BLOCK_K_CHOICES}")
    if tile.stages < 2:
        raise FuselightError(f"gemm {what}: stages {tile.stages} must be at least 2")
    if tile.threads > MAX_THREADS:
        raise FuselightError(
            f"gemm {what}: warps_m x warps_n = {tile.warps_m * tile.warps_n} warps exceed {MAX_THREADS} threads"
        )
    chunks = tile.block_k // CHUNK
    for name, rows in (("block_m", tile.block_m), ("block_n", tile.block_n)):
        if rows * chunks % tile.threads:
            raise FuselightError(
                f"gemm {what}: {name} {rows} x block_k {tile.block_k}: {tile.threads} threads cannot load "
                "it in whole 16-byte pieces"
            )
    if tile.block_m * tile.block_n // CHUNK % tile.threads:
        raise FuselightError(
            f"gemm {what}: block_m x block_n {tile.block_m}x{tile.block_n}: {tile.threads} threads cannot "
            "store it in whole 16-byte pieces"
        )
    accumulators = tile.warp_m * tile.warp_n // WARP
    if accumulators > MAX_ACCUMULATORS:
        raise FuselightError(
            f"gemm {what}: a warp's {tile.warp_m}x{tile.warp_n} piece needs {accumulators} accumulators a "
            f"thread (at most {MAX_ACCUMULATORS}): raise warps_m or warps_n"
        )
    if tile.shared_bytes > smem_limit:
        raise FuselightError(
            f"gemm {what}: stages {tile.stages} of {tile.block_m}x{tile.block_n}x{tile.block_k} need "
            f"{tile.shared_bytes} bytes of shared memory (at most {smem_limit})"
        )


# A dequantized B (``ops.dequant``): 16-byte pieces of 4 packed uint32 words, 32 4-bit values along K.
Q4_PIECE = 32


@dataclasses.dataclass(frozen=True)
class Q4Smem:
    """Shared memory of a tile whose B is dequantized in the kernel, in halves from the start: the
    A stages, then ``stages`` buffers of packed words (``block_n`` rows of ``block_k / 8`` words) and
    of scales (one aligned 4-byte pair of scales per 16-byte piece of packed words: the thread that
    loads a piece also loads the scale it needs, so it can dequantize it after its own
    ``cp.async.wait_group``, no barrier between), then two fp16/bf16 B tiles the pieces are
    dequantized into (swizzled like the A tiles)."""

    packed_base: int
    packed_stage: int
    scale_base: int
    scale_stage: int
    scale_words: int  # 4-byte scale words per piece (always 1: the aligned pair holding its scale)
    half_base: int
    halves: int


def q4_smem(tile: GemmTile, group: int) -> Q4Smem:
    """The shared-memory layout of ``tile`` for a dequantized B of scale group ``group``."""
    packed_base = tile.stages * tile.block_m * tile.block_k
    packed_stage = tile.block_n * tile.block_k // 4  # block_k / 8 words of 2 halves a row
    scale_words = 1
    scale_base = packed_base + tile.stages * packed_stage
    scale_stage = tile.block_n * tile.block_k // Q4_PIECE * 2 * scale_words  # a pair a piece
    half_base = scale_base + tile.stages * scale_stage
    return Q4Smem(packed_base, packed_stage, scale_base, scale_stage, scale_words, half_base,
                  half_base + 2 * tile.block_n * tile.block_k)


def shared_bytes(tile: GemmTile, ops: GemmOperands) -> int:
    """Shared memory of ``tile`` computing ``ops`` (a dequantized B has its own layout)."""
    if ops.dequant is None:
        return tile.shared_bytes
    return max(q4_smem(tile, ops.dequant.group).halves * ELEMENT_BYTES, tile.epilogue_floats * 4)


def q4_tile_bytes(fields: dict[str, int]) -> int:
    """Shared memory of the tile ``fields`` describe with a dequantized B, at the smallest group (the
    most scales): for the analytic configs."""
    tile = GemmTile(**fields)
    return max(q4_smem(tile, Q4_PIECE).halves * ELEMENT_BYTES, tile.epilogue_floats * 4)


def check_dequant(plan: GemmPlan, ops: GemmOperands, smem_limit: int | None = None) -> None:
    """FuselightError naming the problem if the template cannot dequantize ``ops``' B with ``plan``:
    4-bit values 8 to a 32-bit word along K (layout NK), a group of a multiple of 32, an integer
    zero point the conversion subtracts exactly, slices of whole pieces spread evenly over the threads."""
    deq = ops.dequant
    check_q4_words(ops, "mma.sync gemm", Q4_PIECE)
    if deq.dtype != ops.dtype:
        raise FuselightError(f"mma.sync gemm: dequantized dtype {deq.dtype} differs from A's {ops.dtype}")
    if not isinstance(ops.n, int) and plan.split_k > 1:
        raise FuselightError("mma.sync gemm: split_k needs a static n")
    for what, tile in (("main", plan.main), ("rest", plan.rest)):
        if tile is None:
            continue
        pieces = tile.block_n * tile.block_k // Q4_PIECE
        if tile.block_k < Q4_PIECE or pieces % tile.threads:
            raise FuselightError(
                f"gemm plan {what} tile: block_n x block_k {tile.block_n}x{tile.block_k} is not "
                f"{tile.threads} threads' whole pieces of {Q4_PIECE} packed values"
            )
        if (ops.k // deq.group) % 2:
            raise FuselightError(
                f"gemm plan {what} tile: {ops.k // deq.group} scales a row are no whole 4-byte loads"
            )
        if shared_bytes(tile, ops) > (smem_limit or MAX_SHARED_BYTES):
            raise FuselightError(
                f"gemm plan {what} tile: stages {tile.stages} of {tile.block_m}x{tile.block_n}x{tile.block_k} "
                f"with a dequantized B need {shared_bytes(tile, ops)} bytes of shared memory "
                f"(at most {smem_limit or MAX_SHARED_BYTES})"
            )


def check_plan(plan: GemmPlan, ops: GemmOperands, smem_limit: int | None = None) -> None:
    """FuselightError naming the field (or the operand) if ``plan`` cannot tile ``ops`` (within
    ``smem_limit`` bytes of shared memory; None: ``MAX_SHARED_BYTES``)."""
    if ops.dtype not in DTYPES:
        raise FuselightError(f"gemm: dtype {ops.dtype!r} unsupported (supported: {', '.join(DTYPES)})")
    if ops.b_layout not in SUPPORTED_B_LAYOUTS:
        raise FuselightError(
            f"mma.sync gemm: b_layout {ops.b_layout!r} unsupported (supported: {', '.join(SUPPORTED_B_LAYOUTS)})"
        )
    if isinstance(ops.m, int) and ops.m <= 0:
        raise FuselightError(f"gemm: m must be positive, got {ops.m}")
    if ops.paired:
        raise FuselightError("mma.sync gemm: paired (gate/up) epilogues unsupported")
    if not isinstance(plan.split_k, int) or isinstance(plan.split_k, bool) or plan.split_k < 1:
        raise FuselightError(f"gemm plan: split_k must be a positive integer, got {plan.split_k!r}")
    tiles = [("main", plan.main)] + ([("rest", plan.rest)] if plan.rest is not None else [])
    for what, tile in tiles:
        # A dequantized B has its own shared-memory layout, checked by check_dequant.
        check_tile(tile, f"plan {what} tile", smem_limit if ops.dequant is None else None)
        if not isinstance(ops.n, int):
            if ops.dequant is None:
                raise FuselightError(f"gemm plan: n {ops.n} must be static (symbolic only with a dequantized B)")
        elif ops.n % tile.block_n:
            raise FuselightError(f"gemm plan {what} tile: n {ops.n} is not a multiple of block_n {tile.block_n}")
        if ops.k % (tile.block_k * plan.split_k):
            raise FuselightError(
                f"gemm plan {what} tile: k {ops.k} is not a multiple of block_k {tile.block_k} x split_k {plan.split_k}"
            )
    if plan.rest is not None:
        if plan.rest.threads != plan.main.threads:
            raise FuselightError(
                f"gemm plan: rest tile has {plan.rest.threads} threads, main tile {plan.main.threads} "
                "(one launch runs both)"
            )
        if plan.rest.block_m >= plan.main.block_m:
            raise FuselightError(
                f"gemm plan: rest tile block_m {plan.rest.block_m} must be below main's {plan.main.block_m}"
            )
    if ops.dequant is not None:
        check_dequant(plan, ops, smem_limit)


def tile_bytes(fields: dict[str, int]) -> int:
    """Shared memory of the tile ``fields`` describe (for the analytic configs)."""
    return GemmTile(**fields).shared_bytes


def load_tiles(arch: str) -> dict[str, GemmTile]:
    """The named candidate tiles for ``arch`` (e.g. ``sm_90``): ``configs/gemm/mma_sync.json``'s, or
    the analytic ones (``arch_config.mma_sync``), each within the arch's shared memory."""
    entries, where_arch = arch_entry(config_dir() / "gemm" / "mma_sync.json", arch,
                                     lambda d, t: arch_config.mma_sync(d, t, tile_bytes))
    if not isinstance(entries, dict) or not entries:
        raise FuselightError(f"{where_arch}: must be a non-empty object of named tiles")
    limit = require_device(arch).smem_per_block_optin
    names = [f.name for f in dataclasses.fields(GemmTile)]
    tiles = {}
    for name, fields in entries.items():
        where = f"{where_arch}[{name!r}]"
        if not isinstance(fields, dict) or set(fields) != set(names):
            raise FuselightError(f"{where}: must have exactly the fields {', '.join(names)}")
        tile = GemmTile(**fields)
        try:
            check_tile(tile, name, limit)
        except FuselightError as err:
            raise FuselightError(f"{where}: {err}") from None
        tiles[name] = tile
    return tiles
