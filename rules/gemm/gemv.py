"""The GEMV template: a matmul of 1 to 16 rows (decode and low-batch) at weight-streaming bandwidth.

``gemv_body(ops, cfg)`` computes ``ops`` (see ``operands``; NT weights) for M up to ``cfg.max_m``.
It is memory bound: every weight byte is read exactly once, by 16-byte loads issued ``cfg.unroll``
steps ahead of their use, and the arithmetic runs on the tensor cores, so that 16 rows cost no more
issue slots than one. The product is computed transposed, ``out^T = W x^T``, on
``mma.sync.m16n8k16``: a block owns 16 weight rows (16 output columns, the mma's M), the tokens are
the mma's N (one 8-wide tile up to M = 8, two up to 16; token rows past M repeat the last row and
are never stored) and K is walked in steps of 32. Within a step, lane (g, q) = (lane / 4, lane % 4)
loads 16 bytes of weight rows g and g + 8 and of token row g at ``k0 + 8 q`` (runs, below, spread
these); read as registers, these are exactly the A and B fragments of two mma k16 steps over a
permutation of those 32 k (the same one for A and B, so the sum is unchanged); no shuffle or shared
memory is needed to feed the tensor cores. The block's ``cfg.warps`` warps split the steps
round-robin (split-K inside the block, which keeps more loads in flight for the same rows and needs
no second launch), in runs of ``cfg.lane_run`` steps over which each lane's pieces are adjacent
(``piece_word``): with runs of 2 a warp's load instruction reads whole 128-byte lines of its 8 rows
(each lane half a 32-byte sector, the next instruction the other half) instead of 64 bytes of each,
which streamed every shape of the kernel suite 2-10% faster (``docs/experiments/config-gemm-gemv.md``
has the numbers); their fp32 partial tiles are summed through shared memory and the epilogue (``ops.out``)
runs once per output. M may be symbolic (at most ``cfg.max_m``, at least 1: the caller branches on
it); the grid does not depend on it.

With a paired epilogue (``silu(gate) * up``: output column c pairs weight rows c and c + n / 2) a
block's 16 rows are 8 gate rows and the 8 matching up rows (rows g and g + 8 of the mma): every
lane then holds both accumulators of its outputs, and the block writes 8 output columns.

With a norm prologue (``operands.NormPrologue``, static M) the tokens are computed, not loaded:
every block first issues its weight loads of the first round (so memory is busy meanwhile), then
reads its M rows of ``x`` (+ the residual) in 16-byte pieces, sums the squares of ``x + r`` in
float32 across the block, and writes the normed rows, rounded to the activation dtype as the norm
kernel rounds them, to shared memory, where the token fragments are then read from (rows padded by
one piece, so rows g of a fragment load sit in different banks). The rows are read from L2 by
every block (a few percent of the weight bytes); ``x + r`` is written out in slices, one per block.

With 4-bit weights (``ops.dequant``: 8 values packed in a uint32 word along K, a scale per group of
a multiple of 32) a lane's 16 bytes of a row are 4 words, 32 values: a K step is 128 values and
feeds 8 mmas. Each A register of an mma is converted from a word in registers (``Q4_PAIR``:
``((w >> 4 j) & 0x000F000F) | magic`` is the pair ``(e_j, e_{j+4})`` offset by an exact constant,
subtracted, then multiplied by the row's group scale in fp16: bit for bit MLC-LLM's dequantized
value); word i of the piece feeds mmas 2 i and 2 i + 1 (``q4_a_pair``). The lane loads the 32 tokens
of each token row those words meet (four 16-byte chunks) and pairs their halves the same way
(``q4_b_pair``: tokens (j, j + 4), (j + 1, j + 5) of a chunk), so A and B meet at the same k. The
scale is applied before the mma because the four lanes of an mma's k carry four different groups
of 32 (a group's words are one lane's piece); N may be symbolic (the LM head: the grid is computed
at launch). The norm prologue and the paired epilogue work as with float weights (the normed rows
in shared memory hold tokens in order, as the global rows do).

With ``cfg.row_tiles`` = R a block owns R tiles of 16 weight rows (8 + 8 paired): a lane loads
its pieces of all R tiles' rows each step and feeds each tile's mmas the same token fragments, so
the tokens, which every block reads from L2 (M rows of K: at M = 16 four times the bytes of a
tile's 4-bit weights), are read once per R tiles.

A bucket that sets ``rows_per_warp`` (M = 1) runs the row-streaming template of ``gemv_rows``
instead, with the same prologue (``gemv_common.norm_prologue``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

from fuselight.device import least, require_device
from fuselight.errors import FuselightError
from fuselight.paths import config_dir
from tvm import tirx
from tvm.backend.cuda import op as cuda_op
from tvm.script import tirx as T

from .. import arch_config
from ..arch_config import arch_entry, from_fields
from .gemv_common import (
    MMA_N,
    PIECE_WORDS,
    Q4_BITS,
    Q4_PIECE,
    GemvConfig,
    index_dtype,
    norm_prologue,
    static_m,
)
from .gemv_rows import rows_body
from .operands import GemmOperands
from .plan import WARP

C = TypeVar("C")
# mma.sync.m16n8k16: weight rows a block owns (tokens per tile: ``MMA_N``).
MMA_M = 16
MAX_TOKEN_TILES = 2  # so M <= 16
# K a warp covers per step: 4 lanes x 8 elements (16 bytes), read as two mma k16 steps.
STEP_K = 32
MAX_THREADS = least("max_threads_per_block")
DTYPE_ABBREV = {"float16": "fp16", "bfloat16": "bf16"}
CONFIG_FAMILY, CONFIG_NAME = "gemm", "gemv"
# The buckets for 4-bit dequantized weights (``GemmOperands.dequant``), keyed alike.
CONFIG_NAME_Q4 = "gemv_q4"
# The in-register conversion of 4-bit values (both templates): ``((w >> 4 j) & 0x000F000F) | magic``
# read as a pair of ``dtype`` is ``(base + e_j, base + e_{j+4})`` exactly (values j and j + 4 of the
# word); minus ``base + zero`` (exact) it is ``(e - zero)``, times the scale rounded once: bit for bit
# the dequantize's ``(dtype(e) - dtype(zero)) * scale``. dtype -> (scalar, pair type, magic, base,
# pair -> float2, scalar -> pair).
Q4_DTYPES = {
    "float16": ("half", "half2", 0x64006400, 0x6400, "__half22float2", "__half2half2"),
    "bfloat16": ("nv_bfloat16", "nv_bfloat162", 0x43004300, 0x4300, "__bfloat1622float2", "__bfloat162bfloat162"),
}
# The mma template's converter: register j of a word, scaled (a pair of the A fragment).
Q4_PAIR = {"float16": "fuselight_q4_pair_fp16", "bfloat16": "fuselight_q4_pair_bf16"}
_Q4_PAIR_SOURCE = """
__forceinline__ __device__ unsigned int {name}(unsigned int w, int j, {scalar} s) {{
  unsigned int b = ((w >> (4 * j)) & 0x000F000Fu) | {magic}u;
  unsigned int zb = {bias}u | ({bias}u << 16);
  const {v2} v = __hmul2(__hsub2(*reinterpret_cast<const {v2}*>(&b), *reinterpret_cast<const {v2}*>(&zb)), {dup}(s));
  return *reinterpret_cast<const unsigned int*>(&v);
}}
"""


def q4_pair_source(dtype: str, zero: int) -> str:
    """The CUDA device function ``Q4_PAIR[dtype]`` for a zero point ``zero``: the scaled pair
    ``(e_j, e_{j+4})`` of a packed word as one 32-bit register (see ``Q4_DTYPES``)."""
    scalar, v2, magic, base, _, dup = Q4_DTYPES[dtype]
    return _Q4_PAIR_SOURCE.format(name=Q4_PAIR[dtype], scalar=scalar, v2=v2, magic=hex(magic), bias=hex(base + zero), dup=dup)


def q4_a_pair(s: int, reg: int) -> tuple[int, int]:
    """(word, j) of the A register ``reg`` of mma ``s`` (of the 8 a 4-bit step): register ``reg`` of
    an m16n8k16 A fragment holds k slots (2 q, 2 q + 1) for reg 0 (row g) and 1 (row g + 8), and
    (2 q + 8, 2 q + 9) for reg 2 and 3; here they are values (j, j + 4) of word ``word`` of the lane's
    16-byte piece of that row (``Q4_PAIR``). Mmas 2 i and 2 i + 1 use word i."""
    return s // 2, 2 * (s % 2) + reg // 2


def q4_b_pair(s: int, reg: int) -> tuple[int, int, int, int]:
    """(chunk, lo, hi, half) of the B register ``reg`` of mma ``s``: the token pair meeting A's
    (``q4_a_pair``): half ``half`` of 32-bit word ``lo`` of the lane's 16-byte chunk ``chunk`` of
    8 tokens (tokens 2 lo + half) below, the same half of word ``hi`` above. Register 0 holds slots
    (2 q, 2 q + 1), register 1 slots (2 q + 8, 2 q + 9): for mma 2 i + h, tokens (2 h, 2 h + 4) and
    (2 h + 1, 2 h + 5) of chunk i, which are values (j, j + 4) and (j + 1, j + 5) of word i."""
    return s // 2, s % 2, s % 2 + 2, reg


def check_gemv_config(cfg: GemvConfig, where: str = "GEMV config") -> None:
    """FuselightError naming the field of ``cfg`` that the template cannot use."""
    if not 1 <= cfg.max_m <= MMA_N * MAX_TOKEN_TILES:
        raise FuselightError(f"{where}: field 'max_m' must be 1..{MMA_N * MAX_TOKEN_TILES}, got {cfg.max_m}")
    if cfg.warps & (cfg.warps - 1) or not 1 <= cfg.warps * WARP <= MAX_THREADS:
        raise FuselightError(f"{where}: field 'warps' must be a power of two up to {MAX_THREADS // WARP}, got {cfg.warps}")
    for field in ("unroll", "min_blocks_per_sm", "lane_run", "row_tiles"):
        if getattr(cfg, field) < 1:
            raise FuselightError(f"{where}: field {field!r} must be a positive integer, got {getattr(cfg, field)}")
    for field in ("max_blocks", "max_k", "rows_per_warp", "prefetch_l2_percent", "grid_blocks_per_sm"):
        if getattr(cfg, field) is not None and getattr(cfg, field) < 1:
            raise FuselightError(f"{where}: field {field!r} must be a positive integer or absent, got {getattr(cfg, field)}")
    if cfg.rows_per_warp is not None and cfg.max_m != 1:
        raise FuselightError(f"{where}: field 'rows_per_warp' (the row-streaming template) needs max_m 1, got {cfg.max_m}")
    if cfg.double_buffer and cfg.rows_per_warp is None:
        raise FuselightError(f"{where}: field 'double_buffer' needs rows_per_warp (the row template)")
    if cfg.prefetch_l2_percent is not None and (cfg.rows_per_warp is None or cfg.prefetch_l2_percent > 100):
        raise FuselightError(f"{where}: field 'prefetch_l2_percent' must be 1..100 and needs rows_per_warp, "
                             f"got {cfg.prefetch_l2_percent}")
    if cfg.grid_blocks_per_sm is not None and (cfg.rows_per_warp is None or cfg.prefetch_l2_percent is not None):
        # (The prefetch asks L2 for a block's first rows before the grid wait; a looping block has more.)
        raise FuselightError(f"{where}: field 'grid_blocks_per_sm' needs rows_per_warp (the row template) and no "
                             "prefetch_l2_percent")
    if cfg.half_sums and cfg.rows_per_warp is None:
        raise FuselightError(f"{where}: field 'half_sums' needs rows_per_warp (the row template)")
    if cfg.row_tiles > 1 and cfg.rows_per_warp is not None:
        raise FuselightError(f"{where}: field 'row_tiles' is the mma template's (no rows_per_warp), got {cfg.row_tiles}")
    if cfg.dtype is not None and cfg.dtype not in DTYPE_ABBREV:
        raise FuselightError(f"{where}: field 'dtype' must be one of {sorted(DTYPE_ABBREV)} or absent, got {cfg.dtype!r}")


def load_gemv_configs(arch: str, quantized: bool = False) -> list[GemvConfig]:
    """The M buckets of ``arch`` (``sm_90``) from ``configs/gemm/gemv.json`` (``quantized``: from
    ``gemv_q4.json``, for dequantized weights; the analytic buckets where it has no entry for ``arch``),
    by increasing ``max_m``. FuselightError naming the field of a bad one, or for an undescribed arch."""
    name = CONFIG_NAME_Q4 if quantized else CONFIG_NAME
    device = require_device(arch)
    buckets, where = read_buckets(name, arch, arch_config.as_written if quantized else arch_config.gemv,
                                  GemvConfig, check_gemv_config)
    configs = []
    for cfg, at in buckets:
        if cfg.prefetch_l2_percent is not None and not (device.has("tma") and device.has("griddepcontrol")):
            raise FuselightError(f"{at}: prefetch_l2_percent needs TMA and griddepcontrol, which {arch} lacks")
        configs.append(cfg)
    configs.sort(key=_bucket_order)
    if len({(c.max_m, c.max_blocks, c.max_k, c.dtype) for c in configs}) != len(configs):
        raise FuselightError(f"{where}: two buckets with the same 'max_m', 'max_blocks', 'max_k' and 'dtype'")
    return configs


def read_buckets(name: str, arch: str, analytic: Any, cls: type[C],
                 check: Callable[[Any, str], None]) -> tuple[list[tuple[C, str]], str]:
    """The M buckets of ``configs/gemm/<name>.json`` for ``arch`` (``arch_config.arch_entry`` with
    ``analytic``), each as ``cls`` checked by ``check(cfg, where)``, with where each came from; and
    where the arch's entry came from. FuselightError naming a bad bucket."""
    node, where = arch_entry(config_dir() / CONFIG_FAMILY / f"{name}.json", arch, analytic)
    if not isinstance(node, dict):
        raise FuselightError(f"{where}: must be an object of M buckets")
    buckets = []
    for bucket, fields in node.items():
        at = f"{where}[{bucket!r}]"
        cfg = from_fields(cls, fields, at)
        check(cfg, at)
        buckets.append((cfg, at))
    return buckets, where


def _bucket_order(cfg: GemvConfig) -> tuple[int, float, float, bool]:
    def bound(v: int | None) -> float:
        return math.inf if v is None else v

    return cfg.max_m, bound(cfg.max_blocks), bound(cfg.max_k), cfg.dtype is None


def config_for(configs: list[GemvConfig], m: int, blocks: int | None = None, k: int | None = None,
               dtype: str | None = None) -> GemvConfig | None:
    """The bucket serving ``m`` rows on a grid of ``blocks`` (see ``grid_blocks``) with ``k``-long rows
    (None: unknown, so only buckets for any) of ``dtype`` tokens (None: only buckets for any): the
    smallest ``max_m`` at least ``m``, then the smallest ``max_blocks`` at least ``blocks``, then the
    smallest ``max_k`` at least ``k``, a bucket for ``dtype`` before one for any (None: no bucket
    serves it)."""

    def fits(bound: int | None, v: int | None) -> bool:
        return bound is None or (v is not None and v <= bound)

    return next(
        (c for c in sorted(configs, key=_bucket_order)
         if m <= c.max_m and fits(c.max_blocks, blocks) and fits(c.max_k, k) and c.dtype in (None, dtype)),
        None,
    )


def _block_cols(ops: GemmOperands) -> int:
    # Output columns of a block: its 16 weight rows, or 8 gate rows with their 8 up rows when paired.
    return MMA_M if ops.out.pair_offset is None else MMA_M // 2


def grid_blocks(ops: GemmOperands) -> int | None:
    """Blocks of the mma template's grid for ``ops`` (16 weight rows each; 8 output columns paired):
    the size that buckets' ``max_blocks`` bound, whichever template the bucket uses; None where N is
    symbolic (only buckets for any grid serve it)."""
    if not isinstance(ops.out_n, int):
        return None
    return -(-ops.out_n // _block_cols(ops))


def launch_blocks(out_n: Any, cols: int) -> Any:
    """Blocks of ``cols`` output columns each covering ``out_n`` columns: an int, or an int32
    expression computed at launch where N is symbolic (the LM head's vocabulary)."""
    if isinstance(out_n, int):
        return -(-out_n // cols)

    return tirx.Cast("int32", tirx.floordiv(out_n + (cols - 1), cols))


def tokens_per_word(ops: GemmOperands) -> int:
    """32-bit words of token values (pairs of fp16/bf16) that one 32-bit word of weights meets:
    1 for float weights, 4 for 4-bit values packed 8 to a word."""
    return 1 if ops.dequant is None else ops.dequant.per_word // 2


def step_k(ops: GemmOperands) -> int:
    """K elements a warp covers in one step of the mma template: its 4 lanes of a row load 16 bytes
    each, 8 float values (32) or 32 4-bit values (128)."""
    return STEP_K * tokens_per_word(ops)


def check_gemv(ops: GemmOperands, cfg: GemvConfig, max_shared_bytes: int | None = None) -> None:
    """FuselightError where the template cannot compute ``ops`` with ``cfg`` (in at most
    ``max_shared_bytes`` of shared memory a block, if given)."""
    check_gemv_config(cfg)
    if ops.b_layout != "NT" or ops.dtype not in DTYPE_ABBREV:
        raise FuselightError(f"GEMV: needs NT fp16/bf16 weights, got {ops.b_layout} {ops.dtype}")
    if ops.dequant is not None:
        check_dequant(ops, cfg)
    elif not isinstance(ops.n, int):
        raise FuselightError(f"GEMV: N must be static, got {ops.n}")
    if cfg.half_sums and (ops.dequant is None or ops.dtype != "float16"):
        raise FuselightError(f"GEMV: 'half_sums' needs 4-bit weights and fp16 tokens, got {ops.dtype}"
                             f"{'' if ops.dequant else ' weights'}")
    need = STEP_K if cfg.rows_per_warp is not None else step_k(ops)  # a K step of the template
    if ops.k % need:
        raise FuselightError(f"GEMV: K ({ops.k}) must be a multiple of {need}")
    m = static_m(ops)
    if m is not None and not 1 <= m <= cfg.max_m:
        raise FuselightError(f"GEMV: M ({m}) must be 1..{cfg.max_m} (the config's max_m)")
    if ops.prologue is not None and m is None:
        raise FuselightError("GEMV: a norm prologue needs a static M")
    if max_shared_bytes is not None and shared_bytes(ops, cfg) > max_shared_bytes:
        raise FuselightError(f"GEMV: needs {shared_bytes(ops, cfg)} bytes of shared memory, the target has {max_shared_bytes}")


def check_dequant(ops: GemmOperands, cfg: GemvConfig) -> None:
    """FuselightError where the templates cannot dequantize ``ops``' weights (see ``Q4_BITS``)."""
    d = ops.dequant
    if d.bits != Q4_BITS or d.storage_dtype != "uint32" or d.per_word != 32 // Q4_BITS:
        raise FuselightError(f"GEMV: needs 4-bit values packed in uint32, got {d.bits}-bit in {d.storage_dtype}")
    if not d.nk_in_order:
        raise FuselightError(f"GEMV: needs packed words along K (NK) in place order and a constant zero point, got "
                             f"{d.layout}, places {d.places}, zero points {'a buffer' if d.zeros is not None else d.zero}")
    if d.group % Q4_PIECE or ops.k % Q4_PIECE:
        raise FuselightError(f"GEMV: group ({d.group}) and K ({ops.k}) must be multiples of {Q4_PIECE}")
    if d.zero != int(d.zero) or not 0 <= d.zero <= (1 << d.bits):
        raise FuselightError(f"GEMV: the zero point must be an integer 0..{1 << d.bits}, got {d.zero}")
    if d.dtype != ops.dtype:
        raise FuselightError(f"GEMV: dequantized to {d.dtype}, tokens in {ops.dtype}")


def shared_bytes(ops: GemmOperands, cfg: GemvConfig) -> int:
    """Shared memory of a block: the warps' partial tiles, and the normed token rows of a prologue
    (the row-streaming template: the token row)."""
    if cfg.rows_per_warp is not None:
        return ops.k * 2
    partials = block_warps(ops, cfg) * MMA_M * MMA_N * cfg.token_tiles * cfg.row_tiles * 4
    if ops.prologue is None:
        return partials
    return partials + static_m(ops) * (ops.k // 2 + PIECE_WORDS) * 4


def block_warps(ops: GemmOperands, cfg: GemvConfig) -> int:
    """Warps a block splits its K steps over: ``cfg.warps``, halved until they divide the steps."""
    warps = cfg.warps
    while (ops.k // step_k(ops)) % warps:
        warps //= 2
    return warps


def lane_run(cfg: GemvConfig, steps: int) -> int:
    """Steps of a lane-contiguous run for a warp of ``steps`` K steps: ``cfg.lane_run``, halved until
    it divides ``cfg.unroll`` and ``steps`` (so a run never straddles a round or the end of K)."""
    run = cfg.lane_run
    while cfg.unroll % run or steps % run:
        run //= 2
    return run


def piece_word(step: Any, warp: Any, quad: Any, warps: int, run: int) -> Any:
    """First 32-bit word, within a row, of the 16-byte piece that lane ``quad`` (lane % 4) of
    ``warp`` (of ``warps``) reads at its K step ``step`` (ints or TIR expressions). Steps go
    round-robin over the warps in runs of ``run`` (see ``lane_run``); within a run the lane's
    pieces are adjacent, so each lane reads ``16 run`` contiguous bytes and the four lanes of a row
    ``64 run``. Weights and tokens are read at the same words, so every k meets its token."""
    return ((step // run) * warps + warp) * run * (STEP_K // 2) + (quad * run + step % run) * PIECE_WORDS


def body_config(ops: GemmOperands, cfg: GemvConfig) -> GemvConfig:
    """A config for which ``gemv_body(ops, ...)`` writes the same kernel as for ``cfg``, the same one
    for every bucket of ``cfg``'s token tiles: for a symbolic M the mma template uses ``max_m`` only
    through its token tiles (the row template's is 1), so such buckets share one body
    (``rules.base.built_once``)."""
    if static_m(ops) is not None or cfg.rows_per_warp is not None:
        return cfg
    return dataclasses.replace(cfg, max_m=cfg.token_tiles * MMA_N)


def gemv_body(ops: GemmOperands, cfg: GemvConfig, sms: int | None = None) -> Any:
    """The kernel body (a ``tvm.tirx.Stmt``) computing ``ops`` (M <= ``cfg.max_m``) in one launch;
    it uses ``ops``' buffers: bind it to the analysed function's parameters. ``sms``: the device's
    SM count, which sizes the grid of a bucket with ``grid_blocks_per_sm``.

    FuselightError if the template cannot serve ``ops`` (see ``check_gemv``).
    """
    check_gemv(ops, cfg)
    if cfg.grid_blocks_per_sm is not None and sms is None:
        raise FuselightError("GEMV: a bucket with 'grid_blocks_per_sm' needs the device's SM count")
    if cfg.rows_per_warp is not None:
        return rows_body(ops, cfg, sms)
    n, k, dtype = ops.n, ops.k, ops.dtype
    norm, deq = ops.prologue, ops.dequant
    ab = DTYPE_ABBREV[dtype]
    tiles, unroll = cfg.token_tiles, cfg.unroll
    warps = block_warps(ops, cfg)
    threads = warps * WARP
    steps = k // step_k(ops) // warps  # a warp's K steps
    # Per step a lane loads 16 bytes of rows g and g + 8 and the token words they meet: ``tpw``
    # 16-byte chunks a token row (1 for float weights; 4 for 4-bit words: 32 tokens), and runs
    # ``mmas`` k16 mmas on them (2; 8).
    tpw = tokens_per_word(ops)
    mmas = 2 * tpw
    rounds = -(-steps // unroll)
    ragged = steps % unroll != 0
    row_tiles = cfg.row_tiles
    outputs = MMA_M * MMA_N * tiles  # accumulators of a row tile (per warp: 4 a lane per token tile)
    block_outputs = outputs * row_tiles
    m_dtype = index_dtype(ops)
    m = T.Cast("int32", ops.m) if not isinstance(ops.m, int) else ops.m
    words = k // 2  # a token row of K elements in 32-bit words
    w_words = words // tpw  # a weight row in 32-bit words (float pairs, or packed 4-bit values)
    pair = ops.out.pair_offset
    # The last weight row (int32; N may be symbolic where the weights are dequantized)
    last = n - 1 if isinstance(n, int) else T.Cast("int32", n) - 1
    groups = 1 if deq is None else k // deq.group
    if deq is not None:
        pair_fn, pair_source = Q4_PAIR[dtype], q4_pair_source(dtype, int(deq.zero))
    # Weight rows g and g + 8 of row tile ``tile`` (rows past N read row N - 1 and are never stored);
    # paired: gate row c and up row c + pair of output column c = 8 tile + g (c clamped likewise).
    # Block bx owns row tiles bx * row_tiles + rt.
    block_cols = _block_cols(ops)
    out_n = ops.out_n

    def weight_rows(tile, g):
        if pair is None:
            return T.min(tile * MMA_M + g, last), T.min(tile * MMA_M + g + 8, last)
        c = T.min(tile * block_cols + g, pair - 1)
        return c, c + pair

    def out_col(tile, o):
        # Accumulator e of lane l: weight row l / 4 (+8 for e >= 2) of the tile.
        if pair is None:
            return tile * MMA_M + o // 4 % WARP // 4 + o % 4 // 2 * 8
        return tile * block_cols + o // 4 % WARP // 4

    def stored(o):
        # Paired: the lane's gate accumulators (e < 2) write; e + 2 holds the up row.
        return True if pair is None else o % 4 < 2

    def tile_output(oa):
        # (row tile, output within it) of output ``oa`` of the block.
        return (0, oa) if row_tiles == 1 else (oa // outputs, oa % outputs)

    blocks = launch_blocks(out_n, block_cols * row_tiles)
    out_n = out_n if isinstance(out_n, int) else T.Cast("int32", out_n)
    # Token rows: in global memory (``words`` apart), or normed into shared memory by the
    # prologue (one piece of padding a row). Prologue: a thread's pieces of a row, and the pieces
    # of x + r a block writes.
    x_stride = words if norm is None else words + PIECE_WORDS
    rows_p = 0 if norm is None else static_m(ops)
    norm_rows = None if norm is None else norm_prologue(ops, threads, blocks, x_stride)

    run = lane_run(cfg, steps)

    def step_word(rr, u, warp):
        return piece_word(rr * unroll + u, warp, 0, warps, run)

    def row_offset(bx, rt, lane, hi, per_row, piece):
        # Row g (hi: g + 8) of row tile rt of block bx, times ``per_row``, plus ``piece``: the first
        # word of the lane's piece or the row's first scale. (64-bit until TVM proves it fits in 32:
        # 2^31 words are the largest weights.)
        return T.Cast("int64", weight_rows(bx * row_tiles + rt, lane // 4)[hi]) * per_row + piece

    @T.macro
    def load_weights(w, W, sc, S, bx, lane, warp, rr, u, rt):
        # 16 bytes of weight rows g and g + 8 of row tile rt at step (rr, u) of this warp (4-bit:
        # and their scales).
        kw: T.let[T.int32] = step_word(rr, u, warp)
        lead: T.let[T.int32] = piece_word(0, 0, lane % 4, warps, run)
        for e in T.vectorized(PIECE_WORDS):
            w[((u * row_tiles + rt) * 2) * PIECE_WORDS + e] = W[row_offset(bx, rt, lane, 0, w_words, lead) + kw + e]
        for e in T.vectorized(PIECE_WORDS):
            w[((u * row_tiles + rt) * 2 + 1) * PIECE_WORDS + e] = W[row_offset(bx, rt, lane, 1, w_words, lead) + kw + e]
        if deq is not None:
            # The piece's 32 values lie in one group (``Q4_PIECE``).
            grp: T.let[T.int32] = (lead + kw) * deq.per_word // deq.group
            sc[(u * row_tiles + rt) * 2] = S[row_offset(bx, rt, lane, 0, groups, 0) + grp]
            sc[(u * row_tiles + rt) * 2 + 1] = S[row_offset(bx, rt, lane, 1, groups, 0) + grp]

    # fmt: off
    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        W = T.decl_buffer((n * w_words,), "uint32", data=ops.b.data)
        if deq is not None:
            S = T.decl_buffer((n * groups,), dtype, data=deq.scale.data)
        if norm is None:
            X = T.decl_buffer((ops.m * words,), "uint32", data=ops.a.data)
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tid in T.thread_binding(threads, thread="threadIdx.x"):
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", cfg.min_blocks_per_sm), T.sblock("gemv"):
                    T.reads()
                    T.writes()
                    w = T.sblock_alloc_buffer((unroll * row_tiles * 2 * PIECE_WORDS,), "uint32", scope="local")
                    x = T.sblock_alloc_buffer((unroll * tiles * tpw * PIECE_WORDS,), "uint32", scope="local")
                    # The fragments of the step's mmas, copied (4-bit: converted) out of the loaded
                    # pieces: registers, once compiled; the copies also keep TVM from retyping the
                    # pieces into vectors (which the mma's offsets would not follow).
                    a = T.sblock_alloc_buffer((mmas * 4,), "uint32", scope="local")
                    b = T.sblock_alloc_buffer((mmas * tiles * 2,), "uint32", scope="local")
                    if deq is not None:
                        sc = T.sblock_alloc_buffer((unroll * row_tiles * 2,), dtype, scope="local")
                    acc = T.sblock_alloc_buffer((row_tiles * tiles * 4,), "float32", scope="local")
                    red = T.sblock_alloc_buffer((warps * block_outputs,), "float32", scope="shared")
                    total = T.sblock_alloc_buffer((1 if pair is None else 2,), "float32", scope="local")
                    warp: T.let[T.int32] = T.Cast("int32", tid) // WARP
                    lane: T.let[T.int32] = T.Cast("int32", tid) % WARP
                    for i in T.unroll(row_tiles * tiles * 4):
                        acc[i] = T.float32(0)
                    if norm is not None:
                        # The first round's weights are in flight while the rows are normed.
                        for u in T.unroll(unroll):
                            if not ragged or u < steps:
                                for rt in T.unroll(row_tiles):
                                    if deq is None:
                                        load_weights(w, W, w, W, T.Cast("int32", bx), lane, warp, 0, u, rt)
                                    else:
                                        load_weights(w, W, sc, S, T.Cast("int32", bx), lane, warp, 0, u, rt)
                        xs = T.sblock_alloc_buffer((rows_p * x_stride * 2,), dtype, scope="shared")
                        X = T.decl_buffer((rows_p * x_stride,), "uint32", data=xs.data, scope="shared")
                        norm_rows(xs, tid, bx)
                        T.tvm_storage_sync("shared")
                    for r in T.serial(rounds):
                        # Every load of ``unroll`` steps first, so they are in flight together.
                        for u in T.unroll(unroll):
                            if not ragged or r * unroll + u < steps:
                                k0: T.let[T.int32] = step_word(r, u, warp)
                                if norm is None or r > 0:  # with a prologue, round 0's are loaded
                                    for rt in T.unroll(row_tiles):
                                        if deq is None:
                                            load_weights(w, W, w, W, T.Cast("int32", bx), lane, warp, r, u, rt)
                                        else:
                                            load_weights(w, W, sc, S, T.Cast("int32", bx), lane, warp, r, u, rt)
                                for t in T.unroll(tiles):
                                    for c in T.unroll(tpw):
                                        # Chunk c of the tokens meeting the weight piece (words tpw x its words).
                                        for e in T.vectorized(PIECE_WORDS):
                                            x[((u * tiles + t) * tpw + c) * PIECE_WORDS + e] = X[
                                                T.min(t * MMA_N + lane // 4, m - 1) * x_stride
                                                + (piece_word(0, 0, lane % 4, warps, run) + k0) * tpw + c * PIECE_WORDS + e]
                        for u in T.unroll(unroll):
                            if not ragged or r * unroll + u < steps:
                                for s in T.unroll(mmas):
                                    for t in T.unroll(tiles):
                                        if deq is None:
                                            # B fragment: words 2s, 2s+1 of the token piece.
                                            b[(s * tiles + t) * 2 + 0] = x[(u * tiles + t) * PIECE_WORDS + 2 * s]
                                            b[(s * tiles + t) * 2 + 1] = x[(u * tiles + t) * PIECE_WORDS + 2 * s + 1]
                                        else:
                                            # The token pairs meeting A's (``q4_b_pair``): halves of two words.
                                            for reg in T.unroll(2):
                                                b[(s * tiles + t) * 2 + reg] = T.bitwise_or(
                                                    T.bitwise_and(T.shift_right(
                                                        x[((u * tiles + t) * tpw + q4_b_pair(s, reg)[0]) * PIECE_WORDS + q4_b_pair(s, reg)[1]],
                                                        T.Cast("uint32", 16 * q4_b_pair(s, reg)[3])), T.uint32(0xFFFF)),
                                                    T.shift_left(T.shift_right(
                                                        x[((u * tiles + t) * tpw + q4_b_pair(s, reg)[0]) * PIECE_WORDS + q4_b_pair(s, reg)[2]],
                                                        T.Cast("uint32", 16 * q4_b_pair(s, reg)[3])), T.uint32(16)))
                                    # Every row tile meets the same token fragments.
                                    for rt in T.unroll(row_tiles):
                                        if deq is None:
                                            # A fragment of k16 step s: words 2s, 2s+1 of rows g and g + 8.
                                            a[s * 4 + 0] = w[(u * row_tiles + rt) * 2 * PIECE_WORDS + 2 * s]
                                            a[s * 4 + 1] = w[((u * row_tiles + rt) * 2 + 1) * PIECE_WORDS + 2 * s]
                                            a[s * 4 + 2] = w[(u * row_tiles + rt) * 2 * PIECE_WORDS + 2 * s + 1]
                                            a[s * 4 + 3] = w[((u * row_tiles + rt) * 2 + 1) * PIECE_WORDS + 2 * s + 1]
                                        else:
                                            # Converted and scaled pairs of the rows' words (``q4_a_pair``).
                                            for reg in T.unroll(4):
                                                a[s * 4 + reg] = cuda_op.cuda_func_call(
                                                    pair_fn, w[((u * row_tiles + rt) * 2 + reg % 2) * PIECE_WORDS + q4_a_pair(s, reg)[0]],
                                                    q4_a_pair(s, reg)[1], sc[(u * row_tiles + rt) * 2 + reg % 2],
                                                    source_code=pair_source, return_type="uint32")
                                        for t in T.unroll(tiles):
                                            T.ptx.mma.legacy(
                                                "m16n8k16", "row", "col", ab, ab, "fp32",
                                                a.data, s * 4, b.data, (s * tiles + t) * 2,
                                                acc.data, (rt * tiles + t) * 4, False, dtype="float32",
                                            )
                    # Sum the warps' partial tiles; one thread per output runs the epilogue.
                    for rt in T.unroll(row_tiles):
                        for t in T.unroll(tiles):
                            for e in T.vectorized(4):
                                red[warp * block_outputs + rt * outputs + (t * WARP + lane) * 4 + e] = acc[(rt * tiles + t) * 4 + e]
                    T.tvm_storage_sync("shared")
                    for it in T.serial(-(-block_outputs // threads)):
                        oa: T.let[T.int32] = it * threads + T.Cast("int32", tid)
                        o: T.let[T.int32] = tile_output(oa)[1]
                        # Accumulator e of lane l in tile t: token t * 8 + 2 (l % 4) + e % 2.
                        col: T.let[T.int32] = out_col(T.Cast("int32", bx) * row_tiles + tile_output(oa)[0], o)
                        row: T.let[T.int32] = o // (4 * WARP) * MMA_N + o // 4 % 4 * 2 + o % 2
                        if oa < block_outputs and stored(o) and row < m and col < out_n:
                            total[0] = red[oa]
                            for j in T.serial(1, warps):
                                total[0] = total[0] + red[j * block_outputs + oa]
                            if pair is None:
                                ops.out.buffer[ops.out.index(T.Cast(m_dtype, row), T.Cast(m_dtype, col))] = ops.out.value(
                                    T.Cast(m_dtype, row), T.Cast(m_dtype, col), total[0])
                            else:
                                total[1] = red[oa + 2]
                                for j in T.serial(1, warps):
                                    total[1] = total[1] + red[j * block_outputs + oa + 2]
                                ops.out.buffer[ops.out.index(T.Cast(m_dtype, row), T.Cast(m_dtype, col))] = ops.out.value(
                                    T.Cast(m_dtype, row), T.Cast(m_dtype, col), total[0], total[1])
    # fmt: on
    return body.body
