"""The GEMV template for 4-bit words packed along N (AutoAWQ's layout, MLC's ``q4f16_autoawq``), M = 1.

A word of ``qweight[K, N / 8]`` holds 8 adjacent output columns at one k, so no lane can stream a
weight row along K (the row template, ``gemv_rows``); here lanes stream along N instead. Lane l of a
warp is ``(kq, ln) = (l / lanes_n, l % lanes_n)``: its 16-byte piece of a row is 4 words, the 32
adjacent columns ``32 ln ..`` of the block's tile, so the ``lanes_n`` lanes of a k read ``16
lanes_n`` contiguous bytes and one load instruction of a warp reads ``32 / lanes_n`` rows of them.
K is cut into units of ``run_rows`` rows within one group; the K slots (``kq`` of every warp of
every split of the grid's y) take units round-robin (``unit_of``). A lane loads ``unroll`` rows of
its unit before using them, each meeting one token ``x[k]`` broadcast from shared memory.

The values are converted by the bit trick of the other templates: ``((w >> 4 j) & 0x000F000F) |
magic`` read as a pair of ``dtype`` is ``(base + e, base + e')`` for the values at places j and
j + 4 of the word; minus the pair of ``base + zero`` of the same places of the zero-point word
(converted once a unit), it is exactly ``(e - zero)``. Which columns those places are is the
dequantize's ``places`` (``pair_columns``; AutoAWQ's order makes them adjacent columns, any
permutation works: the accumulators are registers). Products are float32 and summed per unit;
the unit's group scale multiplies each column's unit sum once (as the row template applies its
scale to a piece's sum: within float32 of the exact product, the weight is not rounded to
``dtype``). The K slots' partial sums of a block are summed in shared memory (in the token row's
bytes, once the K loop is done). With ``split_k`` > 1 each split writes its fp32 sums and a second
launch sums them and runs the epilogue (``split_k.reduction``; not with a paired epilogue): small N
has few tiles of a wide tile. Those sums are TVM workspace, which a replayed CUDA graph may
outlive: the shipped buckets (``configs/gemm/gemv_cols.json``) do not split.

A paired epilogue (``silu(gate) * up``) gives half the lanes of N gate pieces and half their up
pieces, so a block's tile holds both columns of each output. The norm prologue is the other
templates' (``gemv_common.norm_prologue``), staging the normed row in order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fuselight.device import require_device
from fuselight.errors import FuselightError
from fuselight.paths import config_dir
from tvm.backend.cuda import op as cuda_op
from tvm.script import tirx as T

from .. import arch_config
from ..arch_config import arch_entry, from_fields
from .gemv import MAX_THREADS, Q4_DTYPES
from .gemv_common import PIECE, PIECE_WORDS, Q4_BITS, Q4_PIECE, index_dtype, norm_prologue, static_m
from .operands import GemmOperands
from .plan import WARP
from .split_k import CHUNK, reduction

CONFIG_FAMILY, CONFIG_NAME = "gemm", "gemv_cols"
ROW_FN = {"float16": "fuselight_q4n_row_fp16", "bfloat16": "fuselight_q4n_row_bf16"}
# One row of a lane's piece: 4 words, 16 pairs converted, each minus its zero pair, times x, added
# to the columns ``pair_columns`` names (LO, HI: value j and j + 4 of a word).
_ROW_BODY = """
  const unsigned int w[4] = {{w0, w1, w2, w3}};
  const int lo[4] = {{{lo}}};
  const int hi[4] = {{{hi}}};
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
#pragma unroll
    for (int j = 0; j < 4; ++j) {{
      unsigned int b = ((w[i] >> (4 * j)) & 0x000F000Fu) | {magic}u;
      const float2 v = {to_f2}(__hsub2(*reinterpret_cast<const {v2}*>(&b), *reinterpret_cast<const {v2}*>(&z[4 * i + j])));
      acc[8 * i + lo[j]] = fmaf(v.x, x, acc[8 * i + lo[j]]);
      acc[8 * i + hi[j]] = fmaf(v.y, x, acc[8 * i + hi[j]]);
    }}
  }}
"""


@dataclasses.dataclass(frozen=True)
class ColsConfig:
    """One bucket of ``configs/gemm/gemv_cols.json`` (see the module docstring)."""

    lanes_n: int  # lanes of a warp along N (a power of two): 32 columns, 16 bytes of a row each
    warps: int  # warps of a block, all along K (a power of two)
    run_rows: int  # rows of a unit: divides the group; its sums are scaled once
    unroll: int  # rows a lane loads before using them (1, 2, 4 or 8; divides run_rows)
    min_blocks_per_sm: int  # the launch-bounds hint (see ``gemv_common.GemvConfig``)
    split_k: int = 1  # blocks along K; > 1: a second launch sums their partials
    max_n: int | None = None  # serves weights of at most this many columns (None: any)


def check_cols_config(cfg: ColsConfig, where: str = "GEMV columns config") -> None:
    """FuselightError naming the field of ``cfg`` that the template cannot use."""
    if cfg.lanes_n & (cfg.lanes_n - 1) or not 1 <= cfg.lanes_n <= WARP:
        raise FuselightError(f"{where}: field 'lanes_n' must be a power of two up to {WARP}, got {cfg.lanes_n}")
    if cfg.warps & (cfg.warps - 1) or not 1 <= cfg.warps * WARP <= MAX_THREADS:
        raise FuselightError(f"{where}: field 'warps' must be a power of two up to {MAX_THREADS // WARP}, got {cfg.warps}")
    if cfg.unroll not in (1, 2, 4, 8) or cfg.run_rows % cfg.unroll:
        raise FuselightError(f"{where}: field 'unroll' must be 1, 2, 4 or 8 and divide run_rows ({cfg.run_rows}), "
                             f"got {cfg.unroll}")
    for field in ("min_blocks_per_sm", "split_k"):
        if getattr(cfg, field) < 1:
            raise FuselightError(f"{where}: field {field!r} must be a positive integer, got {getattr(cfg, field)}")


def load_cols_configs(arch: str) -> list[ColsConfig]:
    """The buckets of ``arch`` (the analytic ones where the file has no entry for it), by increasing
    ``max_n``. FuselightError naming the field of a bad one, or for an undescribed arch."""
    require_device(arch)
    node, where = arch_entry(config_dir() / CONFIG_FAMILY / f"{CONFIG_NAME}.json", arch, arch_config.as_written)
    if not isinstance(node, dict):
        raise FuselightError(f"{where}: must be an object of buckets")
    configs = []
    for name, fields in node.items():
        cfg = from_fields(ColsConfig, fields, f"{where}[{name!r}]")
        check_cols_config(cfg, f"{where}[{name!r}]")
        configs.append(cfg)
    configs.sort(key=lambda c: float("inf") if c.max_n is None else c.max_n)
    if len({c.max_n for c in configs}) != len(configs):
        raise FuselightError(f"{where}: two buckets with the same 'max_n'")
    return configs


def cols_config_for(configs: list[ColsConfig], n: int) -> ColsConfig | None:
    """The bucket with the smallest ``max_n`` at least ``n`` (weight columns), or None."""
    return next((c for c in configs if c.max_n is None or n <= c.max_n), None)


def pair_columns(places: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(lo, hi)``: the columns, within a word's 8, of the values the bit trick pairs: at places j
    (the pair's low half) and j + 4 (its high half), j = 0..3. AutoAWQ's places give (0, 2, 4, 6)
    and (1, 3, 5, 7)."""
    column = {place: i for i, place in enumerate(places)}
    return tuple(column[j] for j in range(4)), tuple(column[j + 4] for j in range(4))


def tile_cols(cfg: ColsConfig) -> int:
    """Weight columns of a block's tile (paired: half gate, half up)."""
    return cfg.lanes_n * Q4_PIECE


def unit_of(it: Any, split: Any, warp: Any, kq: Any, cfg: ColsConfig) -> Any:
    """The unit (of ``run_rows`` rows) that K slot ``(split, warp, kq)`` runs at its iteration ``it``:
    the slots take units round-robin."""
    kl = WARP // cfg.lanes_n
    return it * (kl * cfg.warps * cfg.split_k) + (split * cfg.warps + warp) * kl + kq


def piece_col(bx: Any, ln: Any, ops: GemmOperands, cfg: ColsConfig, clamp: Any = min) -> Any:
    """First weight column of lane ``ln``'s piece in block ``bx``, clamped to the last piece (its
    columns are never stored); paired: lanes below ``lanes_n / 2`` gate columns, the others the up
    columns of the same outputs. ``clamp``: ``min`` for ints, ``T.min`` for TIR."""
    pair = ops.out.pair_offset
    if pair is None:
        return clamp(bx * tile_cols(cfg) + ln * Q4_PIECE, ops.n - Q4_PIECE)
    half = cfg.lanes_n // 2
    return clamp(bx * (tile_cols(cfg) // 2) + ln % half * Q4_PIECE, pair - Q4_PIECE) + ln // half * pair


def tile_col(bx: Any, t: Any, ops: GemmOperands, cfg: ColsConfig) -> Any:
    """Weight column of tile index ``t`` of block ``bx`` (unclamped: past the end where the tile is)."""
    pair, tile = ops.out.pair_offset, tile_cols(cfg)
    if pair is None:
        return bx * tile + t
    return bx * (tile // 2) + t % (tile // 2) + t // (tile // 2) * pair


def grid_blocks(ops: GemmOperands, cfg: ColsConfig) -> int:
    """Blocks along N: a tile's outputs each."""
    out_tile = tile_cols(cfg) if ops.out.pair_offset is None else tile_cols(cfg) // 2
    return -(-ops.out_n // out_tile)


def shared_bytes(ops: GemmOperands, cfg: ColsConfig) -> int:
    """The token row, then (in the same bytes) the block's K slots' partial sums of its tile."""
    return max(ops.k * 2, (WARP // cfg.lanes_n) * cfg.warps * tile_cols(cfg) * 4)


def check_cols(ops: GemmOperands, cfg: ColsConfig, max_shared_bytes: int | None = None) -> None:
    """FuselightError where the template cannot compute ``ops`` with ``cfg``."""
    check_cols_config(cfg)
    d = ops.dequant
    if d is None or d.layout != "KN_N":
        raise FuselightError(f"GEMV columns: needs 4-bit words along N (KN_N), got {'float weights' if d is None else d.layout}")
    if d.bits != Q4_BITS or d.storage_dtype != "uint32" or d.per_word != 32 // Q4_BITS:
        raise FuselightError(f"GEMV columns: needs 4-bit values packed in uint32, got {d.bits}-bit in {d.storage_dtype}")
    if ops.dtype not in Q4_DTYPES or d.dtype != ops.dtype:
        raise FuselightError(f"GEMV columns: needs fp16/bf16 tokens and weights alike, got {ops.dtype} and {d.dtype}")
    if d.zeros is None and (d.zero != int(d.zero) or not 0 <= d.zero <= (1 << d.bits)):
        raise FuselightError(f"GEMV columns: the zero point must be an integer 0..{1 << d.bits}, got {d.zero}")
    if static_m(ops) != 1:
        raise FuselightError(f"GEMV columns: M must be 1, got {ops.m}")
    if not isinstance(ops.n, int) or ops.n % Q4_PIECE or (ops.paired and ops.out_n % Q4_PIECE):
        raise FuselightError(f"GEMV columns: N ({ops.n}, paired at {ops.out.pair_offset}) must be static and "
                             f"whole pieces of {Q4_PIECE} columns (16-byte aligned words)")
    if ops.paired and cfg.lanes_n < 2:
        raise FuselightError("GEMV columns: a paired epilogue needs lanes_n of at least 2 (gate and up pieces)")
    if d.group % cfg.run_rows:
        raise FuselightError(f"GEMV columns: run_rows ({cfg.run_rows}) must divide the group ({d.group})")
    if ops.k % PIECE:
        raise FuselightError(f"GEMV columns: K ({ops.k}) must be a multiple of {PIECE}")
    if cfg.split_k > 1 and (ops.out_n % CHUNK or ops.paired):
        # (The reduction's vectorised paired epilogue does not compile: TVM's CUDA codegen of float32x8.)
        raise FuselightError(f"GEMV columns: split_k needs output columns ({ops.out_n}) a multiple of {CHUNK} "
                             "and no paired epilogue")
    if max_shared_bytes is not None and shared_bytes(ops, cfg) > max_shared_bytes:
        raise FuselightError(f"GEMV columns: needs {shared_bytes(ops, cfg)} bytes of shared memory, "
                             f"the target has {max_shared_bytes}")


def cols_config(ops: GemmOperands, arch: str) -> ColsConfig | None:
    """The bucket of ``arch`` computing ``ops``, or None (no config, no bucket, operands it does not take)."""
    try:
        cfg = cols_config_for(load_cols_configs(arch), ops.n if isinstance(ops.n, int) else 0)
        if cfg is None:
            return None
        check_cols(ops, cfg, require_device(arch).smem_per_block)
    except FuselightError:
        return None
    return cfg


def row_source(dtype: str, places: tuple[int, ...]) -> str:
    """The CUDA device function ``ROW_FN[dtype]`` for a word order ``places`` (see the module docstring)."""
    _, v2, magic, _, to_f2, _ = Q4_DTYPES[dtype]
    lo, hi = pair_columns(places)
    body = _ROW_BODY.format(lo=", ".join(map(str, lo)), hi=", ".join(map(str, hi)), magic=hex(magic), v2=v2, to_f2=to_f2)
    return (f"\n__forceinline__ __device__ void {ROW_FN[dtype]}(unsigned int w0, unsigned int w1, unsigned int w2, "
            f"unsigned int w3, const unsigned int* z, float x, float* acc) {{{body}}}\n")


def cols_body(ops: GemmOperands, cfg: ColsConfig) -> Any:
    """The kernel body (a ``tvm.tirx.Stmt``: one launch, two with ``split_k`` > 1) computing ``ops``
    over ``ops``' buffers. FuselightError if the template cannot serve ``ops`` (``check_cols``)."""
    check_cols(ops, cfg)
    n, k, dtype, deq = ops.n, ops.k, ops.dtype, ops.dequant
    norm, pair = ops.prologue, ops.out.pair_offset
    _, _, magic, base, _, _ = Q4_DTYPES[dtype]
    lanes_n, warps, unroll, split = cfg.lanes_n, cfg.warps, cfg.unroll, cfg.split_k
    kl = WARP // lanes_n  # lanes of a warp along K
    threads = warps * WARP
    tile = tile_cols(cfg)
    out_tile = tile if pair is None else tile // 2
    blocks = grid_blocks(ops, cfg)
    units = k // cfg.run_rows
    iters = -(-units // (kl * warps * split))
    ragged = units % (kl * warps * split) != 0
    rounds = cfg.run_rows // unroll
    words = n // deq.per_word  # words of a row
    groups = k // deq.group
    slots = kl * warps  # K slots of a block
    smem_words = shared_bytes(ops, cfg) // 4
    copy_pieces = -(-(k // PIECE) // threads)
    norm_rows = None if norm is None else norm_prologue(ops, threads, blocks, k // 2)
    fn, fn_source = ROW_FN[dtype], row_source(dtype, deq.places)
    zero_pair = (base + int(deq.zero)) * 0x10001  # (base + zero) in both halves
    m_dtype = index_dtype(ops)
    reduce_blocks = reduction(ops, split) if split > 1 else None
    # Tile indices a thread sums: outputs (one launch) or weight columns (split partials).
    sums = out_tile if split == 1 else tile

    def out_value(col, total):
        if pair is None:
            return ops.out.value(T.Cast(m_dtype, 0), T.Cast(m_dtype, col), total[0])
        return ops.out.value(T.Cast(m_dtype, 0), T.Cast(m_dtype, col), total[0], total[1])

    def in_range(bx, t):
        # Tile index t of block bx lies on a column of the weight (its half, paired).
        if pair is None:
            return bx * tile + t < n
        return bx * (tile // 2) + t % (tile // 2) < pair

    # fmt: off
    @T.macro
    def blocks_(part):
        Wq = T.decl_buffer((k * words,), "uint32", data=ops.b.data)
        S = T.decl_buffer((groups * n,), dtype, data=deq.scale.data)
        if deq.zeros is not None:
            Z = T.decl_buffer((groups * words,), "uint32", data=deq.zeros.data)
        if norm is None:
            X = T.decl_buffer((k,), dtype, data=ops.a.data)
        for by in T.thread_binding(split, thread="blockIdx.y"):
            for bx in T.thread_binding(blocks, thread="blockIdx.x"):
                for tid in T.thread_binding(threads, thread="threadIdx.x"):
                    with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", cfg.min_blocks_per_sm), T.sblock("gemv_cols"):
                        T.reads()
                        T.writes()
                        w = T.sblock_alloc_buffer((unroll * PIECE_WORDS,), "uint32", scope="local")
                        xv = T.sblock_alloc_buffer((unroll,), dtype, scope="local")
                        zw = T.sblock_alloc_buffer((PIECE_WORDS,), "uint32", scope="local")
                        zp = T.sblock_alloc_buffer((PIECE_WORDS * 4,), "uint32", scope="local")
                        sc = T.sblock_alloc_buffer((Q4_PIECE,), dtype, scope="local")
                        acc_u = T.sblock_alloc_buffer((Q4_PIECE,), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((Q4_PIECE,), "float32", scope="local")
                        total = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        # The token row, and after the K loop the K slots' sums, in the same bytes.
                        smem = T.sblock_alloc_buffer((smem_words,), "float32", scope="shared")
                        xs = T.decl_buffer((k,), dtype, data=smem.data, scope="shared")
                        red = T.decl_buffer((slots * tile,), "float32", data=smem.data, scope="shared")
                        warp: T.let[T.int32] = T.Cast("int32", tid) // WARP
                        lane: T.let[T.int32] = T.Cast("int32", tid) % WARP
                        kq: T.let[T.int32] = lane // lanes_n
                        ln: T.let[T.int32] = lane % lanes_n
                        col: T.let[T.int32] = piece_col(T.Cast("int32", bx), ln, ops, cfg, T.min)
                        if norm is None:
                            for i in T.unroll(copy_pieces):
                                p: T.let[T.int32] = i * threads + T.Cast("int32", tid)
                                if p < k // PIECE:
                                    for e in T.vectorized(PIECE):
                                        xs[p * PIECE + e] = X[p * PIECE + e]
                        else:
                            norm_rows(xs, tid, bx)
                        T.tvm_storage_sync("shared")
                        for c in T.unroll(Q4_PIECE):
                            acc[c] = T.float32(0)
                        for it in T.serial(iters):
                            unit: T.let[T.int32] = unit_of(it, T.Cast("int32", by), warp, kq, cfg)
                            if not ragged or unit < units:
                                g: T.let[T.int32] = unit * cfg.run_rows // deq.group
                                # The unit's zero points as pairs of (base + zero), in the weights' places.
                                if deq.zeros is not None:
                                    for e in T.vectorized(PIECE_WORDS):
                                        zw[e] = Z[g * words + col // deq.per_word + e]
                                    for i in T.unroll(PIECE_WORDS):
                                        for j in T.unroll(4):
                                            zp[i * 4 + j] = T.bitwise_or(T.bitwise_and(
                                                T.shift_right(zw[i], T.uint32(4 * j)), T.uint32(0x000F000F)), T.uint32(magic))
                                else:
                                    for i in T.unroll(PIECE_WORDS * 4):
                                        zp[i] = T.uint32(zero_pair)
                                for c in T.unroll(Q4_PIECE):
                                    acc_u[c] = T.float32(0)
                                for r in T.serial(rounds):
                                    row0: T.let[T.int32] = unit * cfg.run_rows + r * unroll
                                    # Every row's words first, so they are in flight together.
                                    for u in T.unroll(unroll):
                                        for e in T.vectorized(PIECE_WORDS):
                                            w[u * PIECE_WORDS + e] = Wq[T.Cast("int64", row0 + u) * words + col // deq.per_word + e]
                                    for e in T.vectorized(unroll):
                                        xv[e] = xs[row0 + e]
                                    for u in T.unroll(unroll):
                                        T.evaluate(cuda_op.cuda_func_call(
                                            fn, w[u * PIECE_WORDS], w[u * PIECE_WORDS + 1], w[u * PIECE_WORDS + 2],
                                            w[u * PIECE_WORDS + 3], zp.access_ptr("r"), T.Cast("float32", xv[u]),
                                            acc_u.access_ptr("rw"), source_code=fn_source))
                                for h in T.unroll(Q4_PIECE // PIECE):
                                    for e in T.vectorized(PIECE):
                                        sc[h * PIECE + e] = S[T.Cast("int64", g) * n + col + h * PIECE + e]
                                for c in T.unroll(Q4_PIECE):
                                    acc[c] = acc[c] + T.Cast("float32", sc[c]) * acc_u[c]
                        # The block's K slots' sums of each tile column (once every thread is done
                        # with the token row), then one thread a column.
                        T.tvm_storage_sync("shared")
                        for h in T.unroll(Q4_PIECE // 4):
                            for e in T.vectorized(4):
                                red[(warp * kl + kq) * tile + ln * Q4_PIECE + h * 4 + e] = acc[h * 4 + e]
                        T.tvm_storage_sync("shared")
                        for it in T.serial(-(-sums // threads)):
                            t: T.let[T.int32] = it * threads + T.Cast("int32", tid)
                            if t < sums and in_range(T.Cast("int32", bx), t):
                                total[0] = red[t]
                                for s in T.serial(1, slots):
                                    total[0] = total[0] + red[s * tile + t]
                                if split > 1:
                                    part[T.Cast("int64", by) * n + tile_col(T.Cast("int32", bx), t, ops, cfg)] = total[0]
                                else:
                                    if pair is not None:
                                        total[1] = red[t + out_tile]
                                        for s in T.serial(1, slots):
                                            total[1] = total[1] + red[s * tile + t + out_tile]
                                    ops.out.buffer[ops.out.index(T.Cast(m_dtype, 0), T.Cast(m_dtype, T.Cast("int32", bx) * out_tile + t))] = out_value(
                                        T.Cast("int32", bx) * out_tile + t, total)

    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        if split > 1:
            part = T.alloc_buffer((split * n,), "float32", scope="global")
            blocks_(part)
            reduce_blocks(part)
        else:
            blocks_(None)
    # fmt: on
    return body.body
