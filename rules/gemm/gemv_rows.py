"""The GEMV template for one token row: weight rows streamed along K, 512 contiguous bytes a load.

``rows_body(ops, cfg)`` computes ``ops`` (NT weights, M = 1; the bucket's ``rows_per_warp`` is set)
in one launch. Each warp owns ``cfg.rows_per_warp`` output columns and streams their weight rows
(with a paired ``silu(gate) * up`` epilogue, the gate row and the up row of each column): lane l
loads the 16-byte piece ``32 s + l`` of a row at step s, so one load instruction of a warp reads
512 contiguous bytes, ``cfg.unroll`` steps of every row in flight before they are used. The token
row sits in shared memory (copied once a block, or normed into it by the norm prologue of
``gemv_common.norm_prologue``); products are summed in float32, then over the warp's lanes by butterfly
shuffles, and the column's lane runs the epilogue.

A bucket with ``prefetch_l2_percent`` also has each warp ask L2 for that share of its weight rows
(``cp.async.bulk.prefetch.L2``) and only then wait for the grid before it (``griddepcontrol.wait``;
the TIR pipeline adds no second wait). Launched early behind the decode attention (its merge kernel,
or its split kernel where the last split block merges), whose blocks let it launch once they have
their inputs, o_proj's blocks so stream weights while the attention finishes. The prefetches take warp-uniform addresses and sit in no branch: so placed, ptxas keeps every
load after the wait (``fuselight.pdl_audit`` checks the SASS; with a branch on the lane it moved the
norm prologue's loads above it).

Dequantized weights (``GemmOperands.dequant``: 4-bit values packed eight to a uint32 along K, a
scale per group of 32 or more) stream the same way, their packed words instead of the float
weights: lane l's 16-byte piece ``32 s + l`` of a row is 4 words, 32 values, within one group, so
the lane also loads that group's scale. The values are converted in registers by bit tricks, not by
a shift and a cast each (``Q4_DOT``): ``((w >> 4 j) & 0x000F000F) | 0x64006400`` read as half2 is
``(1024 + e_j, 1024 + e_{j+4})`` (values j and j + 4 of the word), minus ``1024 + zero`` (exact)
is ``(e - zero)`` in fp16 (bf16: bias 0x4300, 128 + e). Products and sums are float32, as the
matmul's; the scale multiplies the piece's float32 sum once, not each weight (so the weight is not
rounded to fp16 as the dequantize rounds it: within float32 of the exact product). Since each word
pairs values j and j + 4, the token row is staged in shared memory permuted the same way (within
every 8 tokens: 0, 4, 1, 5, 2, 6, 3, 7), so no shuffle is needed; the norm prologue stages its
normed row so too. A lane converts its piece's 32 tokens to float32 once for all its rows: at about
five instructions a weight, the conversions had made the template issue-bound below the copy rate.
N may be symbolic there (the LM head's vocabulary): the grid is then computed at launch. With
``cfg.half_sums`` (fp16) the tokens stay fp16 and each word's products are summed in fp16 pairs
before float32 (``Q4_DOT_HALF``): fewer instructions a weight, at about twice the rounding error.

With ``cfg.grid_blocks_per_sm`` the grid is that many blocks an SM (never more than the column
groups of ``warps`` x ``rows_per_warp`` columns), each looping over the groups in strides of the
grid: the token row is staged once a block, and with ``double_buffer`` a warp issues its next
group's first round while computing the last of this one, so a block streams without a gap
between groups and the grid has no partial last wave of block launches.

``rows_stage`` is one block's work as a TIR macro over ``(bx, tid)`` and the shared token row, with
a hook after the block's first round of weight loads and before anything else is read;
``rows_body`` binds it to a grid of its own, and ``gemv_persistent`` runs several, one per stage of a
decode layer, in one kernel with a grid barrier at each hook.

Why beside the mma template: at M = 1 the tensor cores buy nothing, and there its rows-of-16 layout
(64 bytes of each of 16 rows a load) streamed the decode step's smaller projections slower than
whole-row streaming (``docs/experiments/config-gemm-gemv.md`` has the numbers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import tirx
from tvm.backend.cuda import op as cuda_op
from tvm.script import tirx as T

from .gemv_common import PIECE, PIECE_WORDS, Q4_PIECE, GemvConfig, index_dtype, norm_prologue
from .operands import GemmOperands
from .plan import WARP

LOG_WARP = WARP.bit_length() - 1  # butterfly rounds over a warp's lanes
PREFETCH_L2 = "fuselight_prefetch_l2"
PREFETCH_L2_SOURCE = f"""
__forceinline__ __device__ void {PREFETCH_L2}(const void* p, unsigned int bytes) {{
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}}
"""


# The dequantizing dot product of one lane's 16-byte piece of 4-bit words (32 values of one group)
# with the 32 tokens it meets (float32, in the staged order: see the module docstring), times the
# group's scale, added to ``acc``.
Q4_DOT = {"float16": "fuselight_q4_dot32_fp16", "bfloat16": "fuselight_q4_dot32_bf16"}
_Q4_DOT_BODY = """
  const unsigned int w[4] = {{w0, w1, w2, w3}};
  unsigned int zb = {bias}u | ({bias}u << 16);
  const {v2} z2 = *reinterpret_cast<const {v2}*>(&zb);
  float a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
#pragma unroll
    for (int j = 0; j < 4; ++j) {{
      unsigned int b = ((w[i] >> (4 * j)) & 0x000F000Fu) | {magic}u;
      const float2 v = {to_f2}(__hsub2(*reinterpret_cast<const {v2}*>(&b), z2));
      a0 = fmaf(v.x, x[8 * i + 2 * j], a0);
      a1 = fmaf(v.y, x[8 * i + 2 * j + 1], a1);
    }}
  }}
  return fmaf({to_f}(s), a0 + a1, acc);
"""


# The same with fp16 tokens and fp16 partial sums (``GemvConfig.half_sums``): each word's 8 products
# are summed in a pair of halves (``hfma2``, 4 products a half; ``Q4_WORD_HALF``), and only those
# pairs are added in float32; the tokens arrive in fp16 (no conversion).
Q4_DOT_HALF = "fuselight_q4_dot32_fp16_half_sums"
# One word's products with its 8 tokens (as 4 half2 in the order of its value pairs), summed in a
# pair of halves. The low nibbles of each pair are (1024 + e) - (1024 + zero); the high ones are
# converted where they sit, (1024 + 16 e) / 16 - (64 + zero): no shift (both exact), as Marlin does.
# Guarded: every template's dot that uses it carries it in its source.
Q4_WORD_HALF = "fuselight_q4_word_half_sums"
_Q4_WORD_HALF_SOURCE = """
#ifndef FUSELIGHT_Q4_WORD_HALF_SUMS
#define FUSELIGHT_Q4_WORD_HALF_SUMS
__forceinline__ __device__ float2 {name}(unsigned int w, const half2* x2) {{
  unsigned int zb = {bias}u | ({bias}u << 16);
  const half2 z2 = *reinterpret_cast<const half2*>(&zb);
  unsigned int mb = 0x2C002C00u;  // 1/16 twice
  const half2 m2 = *reinterpret_cast<const half2*>(&mb);
  unsigned int cb = {odd_bias}u | ({odd_bias}u << 16);  // -(64 + zero)
  const half2 c2 = *reinterpret_cast<const half2*>(&cb);
  half2 p = __float2half2_rn(0.f);
  const unsigned int hi = w >> 8;
#pragma unroll
  for (int j = 0; j < 4; ++j) {{
    const unsigned int src = j < 2 ? w : hi;
    unsigned int b = (src & (j % 2 ? 0x00F000F0u : 0x000F000Fu)) | 0x64006400u;
    const half2 v = j % 2 ? __hfma2(*reinterpret_cast<const half2*>(&b), m2, c2)
                          : __hsub2(*reinterpret_cast<const half2*>(&b), z2);
    p = __hfma2(v, x2[j], p);
  }}
  return __half22float2(p);
}}
#endif
"""
_Q4_DOT_HALF_SOURCE = """
__forceinline__ __device__ float {name}(unsigned int w0, unsigned int w1, unsigned int w2, unsigned int w3,
                                        half s, const half* x, float acc) {{
  const unsigned int w[4] = {{w0, w1, w2, w3}};
  const half2* x2 = reinterpret_cast<const half2*>(x);
  float a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    const float2 f = {word}(w[i], x2 + 4 * i);
    a0 += f.x;
    a1 += f.y;
  }}
  return fmaf(__half2float(s), a0 + a1, acc);
}}
"""


def q4_word_half_source(zero: int) -> str:
    """The CUDA device function ``Q4_WORD_HALF`` (fp16) for a zero point ``zero``, guarded."""
    odd_bias = int(np.float16(-(64 + zero)).view(np.uint16))
    return _Q4_WORD_HALF_SOURCE.format(name=Q4_WORD_HALF, bias=hex(0x6400 + zero), odd_bias=hex(odd_bias))


def q4_dot_half_source(zero: int) -> str:
    """The CUDA device function ``Q4_DOT_HALF`` (fp16) for a zero point ``zero``, with ``Q4_WORD_HALF``."""
    return q4_word_half_source(zero) + _Q4_DOT_HALF_SOURCE.format(name=Q4_DOT_HALF, word=Q4_WORD_HALF)


def q4_dot_source(dtype: str, zero: int) -> str:
    """The CUDA device function ``Q4_DOT[dtype]`` for a zero point ``zero`` (see the module docstring)."""
    if dtype == "float16":
        scalar, v2, magic, base, to_f2, to_f = "half", "half2", 0x64006400, 0x6400, "__half22float2", "__half2float"
    else:
        scalar, v2, magic, base = "nv_bfloat16", "nv_bfloat162", 0x43004300, 0x4300
        to_f2, to_f = "__bfloat1622float2", "__bfloat162float"
    body = _Q4_DOT_BODY.format(v2=v2, bias=hex(base + zero), magic=hex(magic), to_f2=to_f2, to_f=to_f)
    return (f"\n__forceinline__ __device__ float {Q4_DOT[dtype]}(unsigned int w0, unsigned int w1, unsigned int w2, "
            f"unsigned int w3, {scalar} s, const float* x, float acc) {{{body}}}\n")


def q4_chunk(piece: Any, c: Any) -> Any:
    """Where, in 16-byte units from the piece's start, chunk ``c`` (tokens 8 c..8 c + 7) of the token
    row's 64-byte piece ``piece`` is staged: rotated by ``(piece >> 1) & 3``, so that the 8 lanes of
    a quarter warp (pieces 32 s + 0..7, each reading its chunk c) hit 8 different 16-byte bank groups
    (unrotated, lanes 0, 2, 4, 6 would share the same 4 banks)."""
    return (c + (piece >> 1)) & 3


def q4_slot(p: Any) -> Any:
    """Where the row template stages piece ``p`` (8 tokens) of the token row for 4-bit weights, in
    pieces: within its 64-byte group of 4, rotated by ``q4_chunk``."""
    return p // 4 * 4 + q4_chunk(p // 4, p % 4)


def q4_order(e: Any) -> Any:
    """The token of its piece that staged element ``e`` holds: 0, 4, 1, 5, 2, 6, 3, 7, the order of a
    word's values as ``Q4_DOT`` converts them."""
    return e // 2 + e % 2 * 4


def rows_grid_blocks(ops: GemmOperands, cfg: GemvConfig) -> Any:
    """Blocks of the row-streaming grid: ``cfg.warps`` x ``cfg.rows_per_warp`` output columns each (an
    expression where N is symbolic)."""
    cols = cfg.warps * cfg.rows_per_warp
    if isinstance(ops.out_n, int):
        return -(-ops.out_n // cols)

    return tirx.Cast("int32", tirx.floordiv(ops.out_n + (cols - 1), cols))


def rows_body(ops: GemmOperands, cfg: GemvConfig, sms: int | None = None) -> Any:
    """The kernel body (a ``tvm.tirx.Stmt``) computing ``ops`` (M = 1) over ``ops``' buffers; call
    it through ``gemv.gemv_body``, which checks first that the template serves ``ops`` (and that
    ``sms``, the device's SM count, is given where ``cfg.grid_blocks_per_sm`` needs it)."""
    groups_n = rows_grid_blocks(ops, cfg)  # column groups: a block's each, or looped over
    blocks = groups_n
    if cfg.grid_blocks_per_sm is not None:
        resident = sms * cfg.grid_blocks_per_sm
        blocks = min(groups_n, resident) if isinstance(groups_n, int) else tirx.min(groups_n, resident)
    stage, views = rows_stage(ops, cfg, blocks, looping=cfg.grid_blocks_per_sm is not None)
    threads = cfg.warps * WARP

    # fmt: off
    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tid in T.thread_binding(threads, thread="threadIdx.x"):
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", cfg.min_blocks_per_sm), T.sblock("gemv_rows"):
                    T.reads()
                    T.writes()
                    xs = T.sblock_alloc_buffer((ops.k,), ops.dtype, scope="shared")
                    stage(bx, tid, xs)
    # fmt: on
    return declared(views, body.body)


def rows_stage(ops: GemmOperands, cfg: GemvConfig, blocks: Any, looping: bool, hook: Any = None) -> Any:
    """The per-block work of the row template as a TIR macro ``stage(bx, tid, xs)``, to be expanded
    inside a kernel's ``blockIdx.x`` / ``threadIdx.x`` bindings (``bx`` of ``blocks``, ``cfg.warps``
    warps) and an ``sblock`` it allocates its registers in; ``xs``: a shared buffer of at least
    ``ops.k`` elements of ``ops.dtype`` for the token row. ``looping``: block ``bx`` computes column
    groups ``bx``, ``bx + blocks``, ... (``blocks`` may then be fewer or more than the groups);
    else group ``bx`` alone. ``hook``: a TIR macro without arguments expanded after the block's
    first round of weight loads and before anything else is read (the token row, the norm's input):
    ``gemv_persistent``'s grid barrier. Returns the macro and the flat views of ``ops``' buffers it
    reads through, for the caller to declare around its kernel (``declared``)."""
    n, k, dtype = ops.n, ops.k, ops.dtype
    norm, pair, deq = ops.prologue, ops.out.pair_offset, ops.dequant
    warps, unroll, cols_w = cfg.warps, cfg.unroll, cfg.rows_per_warp
    rows_w = cols_w if pair is None else 2 * cols_w  # weight rows a warp streams
    threads = warps * WARP
    # A lane's 16-byte piece of a row: 8 float values, or 4 packed words of 32 values.
    piece_k = PIECE if deq is None else Q4_PIECE
    pieces = k // piece_k  # 16-byte pieces of a row
    rounds = -(-pieces // (WARP * unroll))
    ragged = pieces % (WARP * unroll) != 0
    # A looping block double-buffers across its groups too.
    double_buffer = cfg.double_buffer and (rounds > 1 or looping)
    groups_n = rows_grid_blocks(ops, cfg)  # column groups
    iters = 1
    if looping:
        if isinstance(groups_n, int) and isinstance(blocks, int):
            iters = -(-groups_n // blocks)
        else:
            iters = tirx.floordiv(groups_n + blocks - 1, blocks)
    group_cols = warps * cols_w  # output columns of a group
    out_n = ops.out_n if isinstance(ops.out_n, int) else T.Cast("int32", ops.out_n)
    last = n - 1 if isinstance(n, int) else T.Cast("int32", n) - 1
    m_dtype = index_dtype(ops)
    # The token row: copied (a thread's pieces of it), or normed by the prologue (row 0 at 0).
    copy_pieces = -(-(k // PIECE) // threads)
    staging = None if deq is None else (q4_slot, q4_order)
    norm_rows = None if norm is None else norm_prologue(ops, threads, blocks, k // 2, staging)
    if deq is None:
        w_dtype, w_vec, row_len = dtype, PIECE, k  # the buffer's elements a piece, a row
    else:
        w_dtype, w_vec, row_len = "uint32", PIECE_WORDS, k // deq.per_word
        groups = k // deq.group
        if cfg.half_sums:
            dot, dot_source, x_dtype = Q4_DOT_HALF, q4_dot_half_source(int(deq.zero)), dtype
        else:
            dot, dot_source, x_dtype = Q4_DOT[dtype], q4_dot_source(dtype, int(deq.zero)), "float32"

    def weight_row(col0, j):
        # Row j of the warp whose first output column is col0 (columns past the end read the last
        # one and are never stored); paired: j < cols_w the gate rows, then the up rows.
        if pair is None:
            return T.min(col0 + j, last)
        return T.min(col0 + j % cols_w, pair - 1) + j // cols_w * pair

    # Whole pieces of a row (its bytes: 16 a piece).
    prefetch_bytes = pieces * (cfg.prefetch_l2_percent or 0) // 100 * PIECE * 2

    @T.macro
    def load_round(w, sc, W, S, col0, lane, r):
        for u in T.unroll(unroll):
            p: T.let[T.int32] = (r * unroll + u) * WARP + lane
            if not ragged or p < pieces:
                for j in T.unroll(rows_w):
                    for e in T.vectorized(w_vec):
                        w[(j * unroll + u) * w_vec + e] = W[T.Cast("int64", weight_row(col0, j)) * row_len + p * w_vec + e]
                    if deq is not None:
                        sc[j * unroll + u] = S[T.Cast("int64", weight_row(col0, j)) * groups + p * Q4_PIECE // deq.group]

    # Flat views of the weights (packed words), their scales and token row 0, which the caller
    # declares (``declared``) where its kernel's parameters should take their names.
    W = tirx.decl_buffer((n * row_len,), w_dtype, "W", data=ops.b.data)
    S = None if deq is None else tirx.decl_buffer((n * groups,), dtype, "S", data=deq.scale.data)
    X = None if norm is not None else tirx.decl_buffer((k,), dtype, "X", data=ops.a.data)
    views = [(W, ops.b.data)] + ([] if S is None else [(S, deq.scale.data)]) + ([] if X is None else [(X, ops.a.data)])

    # fmt: off
    @T.macro
    def stage(bx, tid, xs):
        w = T.sblock_alloc_buffer((rows_w * unroll * w_vec,), w_dtype, scope="local")
        if deq is not None:
            sc = T.sblock_alloc_buffer((rows_w * unroll,), dtype, scope="local")
            xp = T.sblock_alloc_buffer((PIECE,), dtype, scope="local")
            xf = T.sblock_alloc_buffer((Q4_PIECE,), x_dtype, scope="local")
        if double_buffer:
            wn = T.sblock_alloc_buffer((rows_w * unroll * w_vec,), w_dtype, scope="local")
            if deq is not None:
                scn = T.sblock_alloc_buffer((rows_w * unroll,), dtype, scope="local")
        xv = T.sblock_alloc_buffer((PIECE,), dtype, scope="local")
        acc = T.sblock_alloc_buffer((rows_w,), "float32", scope="local")
        warp: T.let[T.int32] = T.Cast("int32", tid) // WARP
        lane: T.let[T.int32] = T.Cast("int32", tid) % WARP
        col_first: T.let[T.int32] = (T.Cast("int32", bx) * warps + warp) * cols_w
        if prefetch_bytes > 0:
            for j in T.unroll(rows_w):
                T.evaluate(cuda_op.cuda_func_call(
                    PREFETCH_L2, W.access_ptr("r", offset=T.Cast("int64", weight_row(col_first, j)) * row_len),
                    T.uint32(prefetch_bytes), source_code=PREFETCH_L2_SOURCE))
            T.ptx.griddepcontrol.wait()
        # The first round's weights are in flight while the token row is staged.
        if deq is None:
            load_round(w, w, W, W, col_first, lane, 0)  # (no scales)
        else:
            load_round(w, sc, W, S, col_first, lane, 0)
        if hook is not None:
            hook()
        if norm is None:
            for i in T.unroll(copy_pieces):
                p: T.let[T.int32] = i * threads + T.Cast("int32", tid)
                if p < k // PIECE:
                    if deq is None:
                        for e in T.vectorized(PIECE):
                            xs[p * PIECE + e] = X[p * PIECE + e]
                    else:
                        # Tokens in the order of a word's values (``q4_order``).
                        for e in T.vectorized(PIECE):
                            xv[e] = X[p * PIECE + e]
                        for e in T.unroll(PIECE):
                            xp[e] = xv[q4_order(e)]
                        for e in T.vectorized(PIECE):
                            xs[q4_slot(p) * PIECE + e] = xp[e]
        else:
            norm_rows(xs, tid, bx)
        T.tvm_storage_sync("shared")
        for it in T.serial(iters):
            g: T.let[T.int32] = T.Cast("int32", bx) + it * blocks
            col0: T.let[T.int32] = (g * warps + warp) * cols_w
            if not looping or g < groups_n:  # (block-uniform)
                if looping and not double_buffer and it > 0:
                    if deq is None:
                        load_round(w, w, W, W, col0, lane, 0)
                    else:
                        load_round(w, sc, W, S, col0, lane, 0)
                for j in T.unroll(rows_w):
                    acc[j] = T.float32(0)
                for r in T.serial(rounds):
                    if double_buffer:
                        # Round r + 1's loads are in flight while round r is computed (after
                        # the last, the block's next group's first).
                        if rounds > 1 and r + 1 < rounds:
                            if deq is None:
                                load_round(wn, wn, W, W, col0, lane, r + 1)
                            else:
                                load_round(wn, scn, W, S, col0, lane, r + 1)
                        if looping and r + 1 == rounds and g + blocks < groups_n:
                            if deq is None:
                                load_round(wn, wn, W, W, col0 + blocks * group_cols, lane, 0)
                            else:
                                load_round(wn, scn, W, S, col0 + blocks * group_cols, lane, 0)
                    elif r > 0:
                        if deq is None:
                            load_round(w, w, W, W, col0, lane, r)
                        else:
                            load_round(w, sc, W, S, col0, lane, r)
                    for u in T.unroll(unroll):
                        p: T.let[T.int32] = (r * unroll + u) * WARP + lane
                        if not ragged or p < pieces:
                            if deq is None:
                                for e in T.vectorized(PIECE):
                                    xv[e] = xs[p * PIECE + e]
                                for j in T.unroll(rows_w):
                                    for e in T.unroll(PIECE):
                                        acc[j] = acc[j] + T.Cast("float32", w[(j * unroll + u) * PIECE + e]) * T.Cast("float32", xv[e])
                            else:
                                # The piece's 32 tokens in float32 (with half sums, fp16), converted
                                # once for every row.
                                for c in T.unroll(Q4_PIECE // PIECE):
                                    for e in T.vectorized(PIECE):
                                        xv[e] = xs[(p * (Q4_PIECE // PIECE) + q4_chunk(p, c)) * PIECE + e]
                                    for e in T.unroll(PIECE):
                                        xf[c * PIECE + e] = T.Cast(x_dtype, xv[e])
                                for j in T.unroll(rows_w):
                                    acc[j] = cuda_op.cuda_func_call(
                                        dot, w[(j * unroll + u) * PIECE_WORDS], w[(j * unroll + u) * PIECE_WORDS + 1],
                                        w[(j * unroll + u) * PIECE_WORDS + 2], w[(j * unroll + u) * PIECE_WORDS + 3],
                                        sc[j * unroll + u], xf.access_ptr("r"), acc[j],
                                        source_code=dot_source, return_type="float32")
                    if double_buffer:
                        if r + 1 < rounds or (looping and g + blocks < groups_n):
                            for i in T.unroll(rows_w * unroll * w_vec):
                                w[i] = wn[i]
                            if deq is not None:
                                for i in T.unroll(rows_w * unroll):
                                    sc[i] = scn[i]
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
    return stage, views


def declared(views: list[tuple[Any, Any]], stmt: Any) -> Any:
    """``stmt`` after the declarations of the buffer views ``views`` (``rows_stage``'s: each a view
    and the data it aliases), in order."""
    return tirx.SeqStmt([*(tirx.DeclBuffer(view, data=data) for view, data in views), stmt])
