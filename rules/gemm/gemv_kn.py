"""The GEMV template for 4-bit weights in the KN layout (MLC-LLM's ``q4f16_0``), a few static rows.

KN stores a weight ``W[K, N]`` as ``packed[K / 8, N]`` (each uint32 word is 8 consecutive K of one
output column) and ``scale[K / group, N]``: a row of words runs along N. ``kn_body(ops, cfg)``
computes ``ops`` (M static, at most ``cfg.max_m``) in one launch. A block owns ``cfg.lanes_n`` x 4
adjacent output columns; a lane owns 4 of them and loads, at each of its word rows, the 4 words
(16 bytes: 32 values, 8 K of each column) and the 4 scales of its columns, and the 8 tokens of
each of the M rows those words meet (16 bytes, the same for every lane of a word row). K is split
over the lanes of a warp (``32 / lanes_n`` word rows side by side: one load instruction of a warp
reads ``16 lanes_n`` contiguous bytes of each) and over the block's ``cfg.warps`` warps; each lane
walks its word rows ``cfg.unroll`` at a time, every load of a round issued before any is used.
The words are converted in registers by the bit trick of the NK templates (``gemv.Q4_DTYPES``:
values j and j + 4 of a word as one pair, exact), products and sums in float32, or with
``cfg.half_sums`` (fp16 tokens) summed in a pair of halves first (``gemv_rows.Q4_WORD_HALF``, the
tokens staged as (j, j + 4) pairs); the 8 values of a word share a scale (a group is a multiple of
8 K), which multiplies their float32 sum once. The
partial sums are added over a warp's word rows by butterfly shuffles, then over the warps through
shared memory, and one thread a output runs the epilogue (``ops.out``).

N need not be a multiple of 4: the words and scales are then loaded ``vec`` (2 or 1) at a time
(the caller's choice: ``kn_vec`` of a static N; for a symbolic N, MLC's vocabulary, a host-side
branch between 4 and 1), so no load leaves the row; columns past N read the row's last piece and
are never stored. A symbolic M and the NK layout are not served (``check_kn``): the Gemv rule then
leaves the function to the next rule.

With a norm prologue (``operands.NormPrologue``, ``passes.fuse_norm_gemv``) the token rows are
computed, not loaded: every block first issues its first round of weight loads (so memory is busy
meanwhile), then norms the M rows into shared memory (``gemv_common.norm_prologue``, as the NK
templates do), from where the lanes read their 8 tokens a word row (the 8 word rows of a warp load
128 contiguous bytes: no bank conflict). With a paired epilogue (``silu(gate) * up``,
``passes.fuse_gate_up_silu``: output column c pairs weight columns c and c + N / 2) a lane loads, at
each word row, the 16 bytes of its 4 gate columns and the 16 bytes of the 4 matching up columns,
holds both accumulators of its outputs, and ``cfg.paired_unroll`` word rows are in flight (twice the
words of a row: fewer rows keep the registers of the plain case).

Why not the NK templates: their lanes stream a weight row along K (the words' own order); in KN a
column's words are ``N`` words apart, and a lane reading along K would read 4 bytes a row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fuselight.device import least, require_device
from fuselight.errors import FuselightError
from tvm.backend.cuda import op as cuda_op
from tvm.script import tirx as T

from .. import arch_config
from .gemv import DTYPE_ABBREV, Q4_DTYPES, launch_blocks, read_buckets
from .gemv_common import PIECE, PIECE_WORDS, Q4_BITS, index_dtype, norm_prologue, static_m
from .gemv_rows import Q4_WORD_HALF, q4_order, q4_word_half_source
from .operands import GemmOperands
from .plan import WARP

CONFIG_NAME = "gemv_q4_kn"  # in configs/gemm/
MAX_THREADS = least("max_threads_per_block")
# The dot product of one packed word (8 values along K, one column) with the 8 tokens it meets
# (float32, in order), times the word's scale, added to ``acc``.
Q4_DOT8 = {"float16": "fuselight_q4_dot8_fp16", "bfloat16": "fuselight_q4_dot8_bf16"}
_Q4_DOT8_SOURCE = """
__forceinline__ __device__ float {name}(unsigned int w, {scalar} s, const float* x, float acc) {{
  unsigned int zb = {bias}u | ({bias}u << 16);
  const {v2} z2 = *reinterpret_cast<const {v2}*>(&zb);
  float a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {{
    unsigned int b = ((w >> (4 * j)) & 0x000F000Fu) | {magic}u;
    const float2 v = {to_f2}(__hsub2(*reinterpret_cast<const {v2}*>(&b), z2));
    a0 = fmaf(v.x, x[j], a0);
    a1 = fmaf(v.y, x[j + 4], a1);
  }}
  return fmaf({to_f}(s), a0 + a1, acc);
}}
"""


# The same with fp16 tokens summed in fp16 pairs first (``KnGemvConfig.half_sums``; the NK row
# template's ``Q4_WORD_HALF``): the 8 tokens in the order of the word's value pairs (``q4_order``).
Q4_DOT8_HALF = "fuselight_q4_dot8_fp16_half_sums"
_Q4_DOT8_HALF_SOURCE = """
__forceinline__ __device__ float {name}(unsigned int w, half s, const half* x, float acc) {{
  const float2 f = {word}(w, reinterpret_cast<const half2*>(x));
  return fmaf(__half2float(s), f.x + f.y, acc);
}}
"""


@dataclasses.dataclass(frozen=True)
class KnGemvConfig:
    """One M bucket of ``configs/gemm/gemv_q4_kn.json``."""

    max_m: int  # the largest (static) M served
    lanes_n: int  # lanes of a warp along N (4 columns each); the other 32 / lanes_n split K
    warps: int  # warps of a block, splitting K further
    unroll: int  # word rows a lane loads before using them
    # Blocks one SM must be able to hold (the launch-bounds hint to ptxas, as the NK GEMVs').
    min_blocks_per_sm: int
    # Word rows a lane loads before using them with a paired epilogue (8 columns a lane); None: unroll.
    paired_unroll: int | None = None
    # Each word's products summed in fp16 pairs before float32 (fp16 tokens only, ``Q4_DOT8_HALF``).
    half_sums: bool = False

    def rows_in_flight(self, paired: bool) -> int:
        """Word rows a lane loads before using them: ``paired_unroll`` with a paired epilogue."""
        return self.paired_unroll if paired and self.paired_unroll is not None else self.unroll


def q4_dot8_half_source(zero: int) -> str:
    """The CUDA device function ``Q4_DOT8_HALF`` (fp16) for a zero point ``zero``, with ``Q4_WORD_HALF``."""
    return q4_word_half_source(zero) + _Q4_DOT8_HALF_SOURCE.format(name=Q4_DOT8_HALF, word=Q4_WORD_HALF)


def q4_dot8_source(dtype: str, zero: int) -> str:
    """The CUDA device function ``Q4_DOT8[dtype]`` for a zero point ``zero``."""
    scalar, v2, magic, base, to_f2, _ = Q4_DTYPES[dtype]
    to_f = "__half2float" if dtype == "float16" else "__bfloat162float"
    return _Q4_DOT8_SOURCE.format(name=Q4_DOT8[dtype], scalar=scalar, v2=v2, magic=hex(magic),
                                  bias=hex(base + zero), to_f2=to_f2, to_f=to_f)


def check_kn_config(cfg: KnGemvConfig, where: str = "KN GEMV config") -> None:
    """FuselightError naming the field of ``cfg`` that the template cannot use."""
    if cfg.lanes_n & (cfg.lanes_n - 1) or not 1 <= cfg.lanes_n <= WARP:
        raise FuselightError(f"{where}: field 'lanes_n' must be a power of two up to {WARP}, got {cfg.lanes_n}")
    if cfg.warps & (cfg.warps - 1) or cfg.warps * WARP > MAX_THREADS:
        raise FuselightError(f"{where}: field 'warps' must be a power of two up to {MAX_THREADS // WARP}, got {cfg.warps}")
    for field in ("unroll", "min_blocks_per_sm", "paired_unroll"):
        if getattr(cfg, field) is not None and getattr(cfg, field) < 1:
            raise FuselightError(f"{where}: field {field!r} must be a positive integer, got {getattr(cfg, field)}")


def load_kn_configs(arch: str) -> list[KnGemvConfig]:
    """The M buckets of ``arch`` from ``configs/gemm/gemv_q4_kn.json`` (its ``analytic`` entry where
    it has none for ``arch``), by increasing ``max_m``; FuselightError for a bad one or an
    undescribed arch."""
    require_device(arch)
    buckets, where = read_buckets(CONFIG_NAME, arch, arch_config.as_written, KnGemvConfig, check_kn_config)
    configs = [cfg for cfg, _ in buckets]
    if len({c.max_m for c in configs}) != len(configs):
        raise FuselightError(f"{where}: two buckets with the same 'max_m'")
    return sorted(configs, key=lambda c: c.max_m)


def kn_config_for(configs: list[KnGemvConfig], m: int) -> KnGemvConfig | None:
    """The bucket with the smallest ``max_m`` at least ``m`` (None: none serves it)."""
    return next((c for c in configs if m <= c.max_m), None)


def kn_shared_bytes(ops: GemmOperands, cfg: KnGemvConfig) -> int:
    """Shared memory of the kernel: the warps' partial sums, and the normed token rows with a prologue."""
    halves = 2 if ops.paired else 1
    m = static_m(ops) or 0
    return 4 * cfg.warps * halves * m * kn_block_cols(cfg) + (2 * m * ops.k if ops.prologue is not None else 0)


def check_kn(ops: GemmOperands, cfg: KnGemvConfig, max_shared_bytes: int | None = None) -> None:
    """FuselightError where the template cannot compute ``ops`` with ``cfg`` (in at most
    ``max_shared_bytes`` of shared memory a block, if given; see the module docstring)."""
    check_kn_config(cfg)
    d = ops.dequant
    if d is None or d.layout != "KN":
        raise FuselightError("KN GEMV: needs 4-bit words packed along K in the KN layout")
    if d.bits != Q4_BITS or d.storage_dtype != "uint32" or d.per_word != 32 // Q4_BITS:
        raise FuselightError(f"KN GEMV: needs 4-bit values packed in uint32, got {d.bits}-bit in {d.storage_dtype}")
    if d.group % d.per_word:
        raise FuselightError(f"KN GEMV: the group ({d.group}) must be a multiple of {d.per_word}")
    if d.zero != int(d.zero) or not 0 <= d.zero <= (1 << d.bits):
        raise FuselightError(f"KN GEMV: the zero point must be an integer 0..{1 << d.bits}, got {d.zero}")
    if ops.dtype not in DTYPE_ABBREV or d.dtype != ops.dtype:
        raise FuselightError(f"KN GEMV: needs fp16/bf16 tokens and scales alike, got {ops.dtype} and {d.dtype}")
    if cfg.half_sums and ops.dtype != "float16":
        raise FuselightError(f"KN GEMV: half_sums needs fp16 tokens, got {ops.dtype}")
    m = static_m(ops)
    if m is None or not 1 <= m <= cfg.max_m:
        raise FuselightError(f"KN GEMV: M must be static, 1..{cfg.max_m} (the config's max_m), got {ops.m}")
    if ops.prologue is not None and ops.k % PIECE:
        raise FuselightError(f"KN GEMV: a norm prologue needs K a multiple of {PIECE}, got {ops.k}")
    if max_shared_bytes is not None and kn_shared_bytes(ops, cfg) > max_shared_bytes:
        raise FuselightError(f"KN GEMV: needs {kn_shared_bytes(ops, cfg)} bytes of shared memory, "
                             f"more than {max_shared_bytes}")


def kn_vec(n: int) -> int:
    """Words (and scales) a load reads: the largest of 4, 2, 1 dividing ``n``, so that a load
    starting at a multiple of it never leaves the row."""
    return next(v for v in (PIECE_WORDS, 2, 1) if n % v == 0)


def kn_block_cols(cfg: KnGemvConfig) -> int:
    """Output columns of a block."""
    return cfg.lanes_n * PIECE_WORDS


def kn_body(ops: GemmOperands, cfg: KnGemvConfig, vec: int) -> Any:
    """The kernel body (a ``tvm.tirx.Stmt``) computing ``ops`` over its buffers, loading words and
    scales ``vec`` at a time (4, 2 or 1; it must divide the output's N, which a symbolic N's caller
    checks on the host); FuselightError where the template cannot (``check_kn``)."""
    check_kn(ops, cfg)
    n, k, dtype, deq, norm = ops.n, ops.k, ops.dtype, ops.dequant, ops.prologue
    out_n = ops.out_n
    if vec not in (PIECE_WORDS, 2, 1) or (isinstance(out_n, int) and out_n % vec):
        raise FuselightError(f"KN GEMV: loads of {vec} words must divide N ({out_n}) and be 4, 2 or 1")
    # Column arithmetic in int32 (N < 2^31); paired: the up column of output c is c + pair.
    lim = out_n if isinstance(out_n, int) else T.Cast("int32", out_n)
    pair = ops.out.pair_offset or 0
    halves = 2 if ops.paired else 1  # weight columns an output reads: gate and up, or one
    m = static_m(ops)
    per_word = deq.per_word
    k_words = k // per_word  # word rows
    lanes_n, warps, unroll = cfg.lanes_n, cfg.warps, cfg.rows_in_flight(ops.paired)
    lanes_k = WARP // lanes_n  # word rows a warp covers side by side
    slots = lanes_k * warps  # word rows a block covers side by side
    steps = -(-k_words // slots)  # word rows of a lane
    rounds = -(-steps // unroll)
    ragged = k_words % (slots * unroll) != 0
    threads = warps * WARP
    cols = kn_block_cols(cfg)
    blocks = launch_blocks(out_n, cols)
    outputs = m * cols
    lane_accs = halves * m * PIECE_WORDS  # a lane's accumulators: [half, row, column]
    m_dtype = index_dtype(ops)
    half_sums = cfg.half_sums
    if half_sums:
        dot, dot_source, x_dtype = Q4_DOT8_HALF, q4_dot8_half_source(int(deq.zero)), dtype
    else:
        dot, dot_source, x_dtype = Q4_DOT8[dtype], q4_dot8_source(dtype, int(deq.zero)), "float32"
    norm_rows = None if norm is None else norm_prologue(ops, threads, blocks, k // 2)

    @T.macro
    def load_weights(w, sc, W, S, slot, col0, r):
        # The words and scales of round r's word rows (every load of the round before any is used).
        for u in T.unroll(unroll):
            kw: T.let[T.int32] = (r * unroll + u) * slots + slot
            if not ragged or kw < k_words:
                for h in T.unroll(halves):
                    for v in T.unroll(PIECE_WORDS // vec):
                        # A piece past the row reads its last one (never stored).
                        for e in T.vectorized(vec):
                            w[(u * halves + h) * PIECE_WORDS + v * vec + e] = W[T.Cast("int64", kw) * n + T.Cast("int64", T.min(col0 + v * vec, lim - vec) + h * pair) + e]
                        for e in T.vectorized(vec):
                            sc[(u * halves + h) * PIECE_WORDS + v * vec + e] = S[T.Cast("int64", kw * per_word // deq.group) * n + T.Cast("int64", T.min(col0 + v * vec, lim - vec) + h * pair) + e]

    # fmt: off
    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        W = T.decl_buffer((k_words * n,), "uint32", data=ops.b.data)
        S = T.decl_buffer((k // deq.group * n,), dtype, data=deq.scale.data)
        if norm is None:
            X = T.decl_buffer((m * k,), dtype, data=ops.a.data)
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tid in T.thread_binding(threads, thread="threadIdx.x"):
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", cfg.min_blocks_per_sm), T.sblock("gemv_kn"):
                    T.reads()
                    T.writes()
                    w = T.sblock_alloc_buffer((unroll * halves * PIECE_WORDS,), "uint32", scope="local")
                    sc = T.sblock_alloc_buffer((unroll * halves * PIECE_WORDS,), dtype, scope="local")
                    xv = T.sblock_alloc_buffer((unroll * m * PIECE,), dtype, scope="local")
                    xf = T.sblock_alloc_buffer((m * PIECE,), x_dtype, scope="local")
                    acc = T.sblock_alloc_buffer((lane_accs,), "float32", scope="local")
                    red = T.sblock_alloc_buffer((warps * halves * outputs,), "float32", scope="shared")
                    total = T.sblock_alloc_buffer((halves,), "float32", scope="local")
                    warp: T.let[T.int32] = T.Cast("int32", tid) // WARP
                    lane: T.let[T.int32] = T.Cast("int32", tid) % WARP
                    slot: T.let[T.int32] = warp * lanes_k + lane // lanes_n
                    col0: T.let[T.int32] = T.Cast("int32", bx) * cols + lane % lanes_n * PIECE_WORDS
                    for i in T.unroll(lane_accs):
                        acc[i] = T.float32(0)
                    if norm is not None:
                        # The first round's weights are in flight while the rows are normed.
                        load_weights(w, sc, W, S, slot, col0, 0)
                        xs = T.sblock_alloc_buffer((m * k,), dtype, scope="shared")
                        X = T.decl_buffer((m * k,), dtype, data=xs.data, scope="shared")
                        norm_rows(xs, tid, bx)
                        T.tvm_storage_sync("shared")
                    for r in T.serial(rounds):
                        if norm is None or r > 0:  # with a prologue, round 0's are loaded
                            load_weights(w, sc, W, S, slot, col0, r)
                        for u in T.unroll(unroll):
                            kw: T.let[T.int32] = (r * unroll + u) * slots + slot
                            if not ragged or kw < k_words:
                                for row in T.unroll(m):
                                    for e in T.vectorized(PIECE):
                                        xv[(u * m + row) * PIECE + e] = X[row * k + kw * per_word + e]
                        for u in T.unroll(unroll):
                            kw: T.let[T.int32] = (r * unroll + u) * slots + slot
                            if not ragged or kw < k_words:
                                for i in T.unroll(m * PIECE):
                                    if half_sums:  # in the order of a word's value pairs
                                        xf[i] = xv[u * m * PIECE + i // PIECE * PIECE + q4_order(i % PIECE)]
                                    else:
                                        xf[i] = T.Cast("float32", xv[u * m * PIECE + i])
                                for j in T.unroll(PIECE_WORDS):
                                    for h in T.unroll(halves):
                                        for row in T.unroll(m):
                                            acc[(h * m + row) * PIECE_WORDS + j] = cuda_op.cuda_func_call(
                                                dot, w[(u * halves + h) * PIECE_WORDS + j], sc[(u * halves + h) * PIECE_WORDS + j],
                                                xf.access_ptr("r", offset=row * PIECE), acc[(h * m + row) * PIECE_WORDS + j],
                                                source_code=dot_source, return_type="float32")
                    # Butterfly sums over the warp's word rows (lanes lanes_n apart).
                    for sh in T.unroll((lanes_k).bit_length() - 1):
                        for i in T.unroll(lane_accs):
                            acc[i] = acc[i] + T.tvm_warp_shuffle_xor(
                                T.tvm_warp_activemask(), acc[i], T.shift_right(WARP, sh + 1), WARP, WARP)
                    if lane < lanes_n:
                        for i in T.unroll(lane_accs):
                            red[(warp * halves * m + i // PIECE_WORDS) * cols + lane * PIECE_WORDS + i % PIECE_WORDS] = acc[i]
                    T.tvm_storage_sync("shared")
                    for it in T.serial(-(-outputs // threads)):
                        o: T.let[T.int32] = it * threads + T.Cast("int32", tid)
                        col: T.let[T.int32] = T.Cast("int32", bx) * cols + o % cols
                        if o < outputs and col < lim:
                            for h in T.unroll(halves):
                                total[h] = red[h * outputs + o]
                                for j in T.serial(1, warps):
                                    total[h] = total[h] + red[(j * halves + h) * outputs + o]
                            if halves == 1:
                                ops.out.buffer[ops.out.index(T.Cast(m_dtype, o // cols), T.Cast(m_dtype, col))] = ops.out.value(
                                    T.Cast(m_dtype, o // cols), T.Cast(m_dtype, col), total[0])
                            else:
                                ops.out.buffer[ops.out.index(T.Cast(m_dtype, o // cols), T.Cast(m_dtype, col))] = ops.out.value(
                                    T.Cast(m_dtype, o // cols), T.Cast(m_dtype, col), total[0], total[1])
    # fmt: on
    return body.body
