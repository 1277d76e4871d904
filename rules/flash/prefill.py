"""Tensor-core flash-attention prefill templates: TIR PrimFuncs, already scheduled.

``flash_prefill_ragged`` is a drop-in replacement for TVM's ``batch_prefill_ragged_kv`` (the KV
cache's prefill over the new tokens' own K/V), ``flash_prefill_paged`` for its
``batch_prefill_paged_kv`` (the prefill over the tokens already in the cache's pages);
``flash_attention_dense`` is plain (non-paged) attention for graph-level fusion. All run the same
FlashAttention-2 core, differing only in how a K/V row is addressed: each warp owns 16 query
rows, S = Q K^T and O += P V run on ``mma.sync.m16n8k16`` (fp16/bf16 in, fp32 accumulate) with
operands loaded by ``ldmatrix`` from XOR-swizzled shared memory, the online-softmax state stays in
registers, and the next K (or V) tile streams in by ``cp.async`` while the current one is used.
Grouped-query heads are folded into the row dimension (row = token * group + head-in-group), so
one K/V tile serves the whole group. Scores are kept in base 2 (scaled by ``sm_scale * log2(e)``),
so ``lse = m + log2(sum)``, TVM's convention.
"""

from __future__ import annotations

import dataclasses
import math

from fuselight.contracts import PAGED_PREFILL_SYMBOL, RAGGED_PREFILL_SYMBOL
from fuselight.errors import FuselightError

from fuselight.device import least, require_device, warp_size
from tvm.script import tirx as T

from .. import arch_config
from ..arch_config import load_arch_config
from .paging import paged_kv_len

# mma.sync.m16n8k16: a warp's row block, the k step, the n width of one accumulator tile.
MMA_M, MMA_K, MMA_N = 16, 16, 8
WARP = warp_size()
# One cp.async / ldmatrix row piece: 16 bytes = 8 halves; the swizzle permutes these within 8 rows.
CHUNK = 8
SWIZZLE_ROWS = 8
HEAD_DIMS = (64, 128)
DTYPES = {"float16": "fp16", "bfloat16": "bf16"}
LOG2E = math.log2(math.e)
# Scores of masked positions: exp2 of it minus any real row max is exactly 0.
MASKED = -1.0e30
# lse of a query row that sees no key in TVM's KV-cache kernels (their initial row max, sum 1).
EMPTY_LSE = -5.0e4


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tile config: ``warps`` warps of 16 query rows each, ``tile_kv`` KV rows per step."""

    warps: int
    tile_kv: int

    @property
    def tile_q(self) -> int:
        return MMA_M * self.warps

    @property
    def threads(self) -> int:
        return WARP * self.warps


def load_prefill_config(arch: str, head_dim: int) -> PrefillConfig:
    """The config for ``arch`` (e.g. ``sm_90``) and ``head_dim`` from ``configs/attention/prefill.json``."""
    cfg = load_arch_config("attention", "prefill", arch, PrefillConfig, str(head_dim),
                           analytic=lambda d, t: arch_config.prefill(d, t, HEAD_DIMS, shared_bytes))
    check_config(cfg, head_dim, require_device(arch).smem_per_block)
    return cfg


def shared_bytes(warps: int, tile_kv: int, head_dim: int) -> int:
    """Static shared memory of a block: the Q tile and the K and V tiles, 2-byte elements."""
    return (MMA_M * warps + 2 * tile_kv) * head_dim * 2


def check_config(cfg: PrefillConfig, head_dim: int, smem_limit: int | None = None) -> None:
    """FuselightError naming the field if ``cfg`` cannot tile ``head_dim`` (within ``smem_limit``
    bytes of static shared memory; None: the least any described device allows)."""
    if head_dim not in HEAD_DIMS:
        raise FuselightError(
            f"prefill attention: head_dim {head_dim} unsupported (supported: {HEAD_DIMS})"
        )
    if cfg.tile_kv % MMA_K:
        raise FuselightError(
            f"prefill config: tile_kv {cfg.tile_kv} must be a multiple of {MMA_K}"
        )
    for what, rows in (("Q", cfg.tile_q), ("K/V", cfg.tile_kv)):
        if rows * head_dim // CHUNK % cfg.threads:
            raise FuselightError(
                f"prefill config: warps {cfg.warps} / tile_kv {cfg.tile_kv}: {cfg.threads} threads cannot load "
                f"the {rows}x{head_dim} {what} tile in whole 16-byte pieces"
            )
    smem, limit = shared_bytes(cfg.warps, cfg.tile_kv, head_dim), smem_limit or least("smem_per_block")
    if smem > limit:
        raise FuselightError(
            f"prefill config: warps {cfg.warps} / tile_kv {cfg.tile_kv} need {smem} bytes of shared memory "
            f"at head_dim {head_dim} (at most {limit})"
        )


def _check_args(
    num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: str, cfg: PrefillConfig
) -> int:
    if dtype not in DTYPES:
        raise FuselightError(
            f"prefill attention: dtype {dtype!r} unsupported (supported: {', '.join(DTYPES)})"
        )
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
        raise FuselightError(
            f"prefill attention: {num_qo_heads} query heads are not a multiple of {num_kv_heads} KV heads"
        )
    check_config(cfg, head_dim)
    return num_qo_heads // num_kv_heads


def _strided_row(row, at):
    """Element offset of K/V row ``row`` where ``at`` = (base, row stride): ragged and dense layouts."""
    base, tok_stride = at
    return base + row * tok_stride


def _make_core(
    head_dim: int,
    group: int,
    dtype: str,
    cfg: PrefillConfig,
    with_mask: bool = False,
    kv_row=_strided_row,
    empty_rows_zero: bool = False,
):
    """The macros all templates share: the attention of one block's query tile, and its epilogue.

    Q/output addresses are element offsets into the flat buffers, given as a base plus a token
    stride and a head stride. K/V row ``r`` of the block's sequence is at element offset
    ``kv_row(r, at)`` of its buffer, where ``at`` is what the kernel passes ``attend`` as
    ``k_at``/``v_at`` (a tuple of expressions): so one core serves ragged, paged and both dense
    layouts. ``with_mask``: ``attend`` adds ``mask_flat[mask_base + token * kv_len + key]`` to the
    scaled scores. ``empty_rows_zero``: a query row that sees no key gets output 0 and lse
    ``EMPTY_LSE`` (TVM's KV-cache kernels' convention) instead of NaN.
    """
    d = head_dim
    ab = DTYPES[dtype]
    tile_q, tile_kv, threads = cfg.tile_q, cfg.tile_kv, cfg.threads
    chunks = d // CHUNK
    q_loads = tile_q * chunks // threads
    kv_loads = tile_kv * chunks // threads
    k_steps = d // MMA_K  # k steps of S = Q K^T
    s_tiles = tile_kv // MMA_N  # n tiles of S
    pv_steps = tile_kv // MMA_K  # k steps of O += P V
    o_tiles = d // MMA_N  # n tiles of O

    def swz(row, chunk):
        # 16-byte piece ``chunk`` of ``row`` lands at chunk ^ (row % 8): the 8 rows an ldmatrix
        # reads hit 8 different bank groups.
        return (
            row * d + T.bitwise_xor(chunk, T.bitwise_and(row, SWIZZLE_ROWS - 1)) * CHUNK
        )

    @T.macro
    def ldmatrix_x4(frag, frag_offset, trans, smem, smem_offset):
        T.ptx.ldmatrix_legacy(
            trans,
            4,
            ".b16",
            frag.data,
            frag_offset,
            smem.access_ptr("r"),
            smem_offset,
            dtype=dtype,
        )

    @T.macro
    def mma_two_tiles(A, a_offset, B, C, c_tile):
        # C tiles c_tile, c_tile + 1 += A (16x16) x the two 16x8 B operands an ldmatrix_x4 loaded.
        for h in T.unroll(2):
            T.ptx.mma.legacy(
                "m16n8k16", "row", "col", ab, ab, "fp32",
                A.data, a_offset, B.data, h * 4, C.data, (c_tile + h) * 4, False, dtype="float32",
            )  # fmt: skip

    @T.macro
    def load_kv_rows(smem, src, at, tid, kv_start, kv_len):
        # cp.async of K/V rows kv_start.. of a tile, 16 bytes per thread per step; rows at or past
        # kv_len are zero-filled (their address clamped to the last row, which kv_len > 0 makes real).
        for it in T.unroll(kv_loads):
            row = (it * threads + tid) // chunks
            c = (it * threads + tid) % chunks
            T.ptx.cp_async(
                smem.access_ptr("w", offset=swz(row, c)),
                src.access_ptr(
                    "r", offset=kv_row(T.min(kv_start + row, kv_len - 1), at) + c * CHUNK
                ),
                16,
                predicate=kv_start + row < kv_len,
                fill_mode="zero",
            )

    @T.macro
    def load_q_rows(smem, src, tid, LH_start, base, tok_stride, head_stride, q_len):
        for it in T.unroll(q_loads):
            row = (it * threads + tid) // chunks
            c = (it * threads + tid) % chunks
            tok = (LH_start + row) // group
            T.ptx.cp_async(
                smem.access_ptr("w", offset=swz(row, c)),
                src.access_ptr(
                    "r",
                    offset=base
                    + T.min(tok, q_len - 1) * tok_stride
                    + (LH_start + row) % group * head_stride
                    + c * CHUNK,
                ),
                16,
                predicate=tok < q_len,
                fill_mode="zero",
            )

    # fmt: off
    @T.macro
    def attend(
        q, k, v, Q_smem, K_smem, V_smem, Qf, Kf, Vf, S, Pf, O, m, l, row_max,
        tid, LH_start, q_base, q_tok_stride, q_head_stride, k_at, v_at,
        q_len, kv_len, causal, sm_scale, mask_flat, mask_base,
    ):
    # fmt: on
        warp: T.let[T.int32] = tid // WARP
        lane: T.let[T.int32] = tid % WARP
        # Query row of tile row r: token (LH_start + r) // group, head (LH_start + r) % group.
        last_tok: T.let[T.int32] = T.min(q_len - 1, (LH_start + tile_q - 1) // group)
        kv_end: T.let[T.int32] = T.if_then_else(
            causal > 0, T.min(kv_len, last_tok + kv_len - q_len + 1), kv_len
        )
        n_kv_tiles: T.let[T.int32] = T.ceildiv(kv_end, tile_kv)
        score_scale: T.let[T.float32] = sm_scale * LOG2E

        for i in T.unroll(2):
            m[i] = T.float32(MASKED)
            l[i] = T.float32(0)
        for i in T.unroll(o_tiles * 4):
            O[i] = T.float32(0)

        load_q_rows(
            Q_smem, q, tid, LH_start, q_base, q_tok_stride, q_head_stride, q_len
        )
        T.ptx.cp_async.commit_group()
        if n_kv_tiles > 0:  # no key visible (or none at all): no K row to address
            load_kv_rows(K_smem, k, k_at, tid, 0, kv_len)
        T.ptx.cp_async.commit_group()
        T.ptx.cp_async.wait_group(1)
        T.tvm_storage_sync("shared")
        for kk in T.unroll(k_steps):
            ldmatrix_x4(
                Qf,
                kk * 8,
                False,
                Q_smem,
                swz(warp * MMA_M + lane % 16, kk * 2 + lane // 16),
            )

        for j in T.serial(n_kv_tiles):
            kv_start: T.let[T.int32] = j * tile_kv
            T.ptx.cp_async.wait_group(0)
            T.tvm_storage_sync("shared")
            load_kv_rows(V_smem, v, v_at, tid, kv_start, kv_len)
            T.ptx.cp_async.commit_group()

            # S = Q K^T for this warp's 16 rows.
            for i in T.unroll(s_tiles * 4):
                S[i] = T.float32(0)
            for kk in T.unroll(k_steps):
                for np in T.unroll(pv_steps):
                    ldmatrix_x4(
                        Kf,
                        0,
                        False,
                        K_smem,
                        swz(
                            np * 16 + (lane // 16) * 8 + lane % 8,
                            kk * 2 + (lane // 8) % 2,
                        ),
                    )
                    mma_two_tiles(Qf, kk * 8, Kf, S, np * 2)

            # Online softmax; this thread holds rows lane // 4 and lane // 4 + 8 of the warp's block.
            for i in T.unroll(2):
                tok: T.let[T.int32] = (
                    LH_start + warp * MMA_M + lane // 4 + i * 8
                ) // group
                limit: T.let[T.int32] = T.if_then_else(
                    causal > 0, T.min(kv_len, tok + kv_len - q_len + 1), kv_len
                )
                for nt in T.unroll(s_tiles):
                    for e in T.unroll(2):
                        col = kv_start + nt * MMA_N + (lane % 4) * 2 + e
                        if with_mask:
                            S[nt * 4 + i * 2 + e] = T.if_then_else(
                                col < limit,
                                S[nt * 4 + i * 2 + e] * score_scale
                                + T.Cast(
                                    "float32",
                                    mask_flat[
                                        mask_base + T.min(tok, q_len - 1) * kv_len + col
                                    ],
                                )
                                * LOG2E,
                                T.float32(MASKED),
                            )
                        else:
                            S[nt * 4 + i * 2 + e] = T.if_then_else(
                                col < limit,
                                S[nt * 4 + i * 2 + e] * score_scale,
                                T.float32(MASKED),
                            )
                row_max[0] = m[i]
                for nt in T.unroll(s_tiles):
                    for e in T.unroll(2):
                        row_max[0] = T.max(row_max[0], S[nt * 4 + i * 2 + e])
                m_new: T.let[T.float32] = T.cuda.warp_max(row_max[0], 4)
                alpha: T.let[T.float32] = T.exp2(m[i] - m_new)
                m[i] = m_new
                l[i] = l[i] * alpha
                for nt in T.unroll(s_tiles):
                    for e in T.unroll(2):
                        S[nt * 4 + i * 2 + e] = T.exp2(S[nt * 4 + i * 2 + e] - m_new)
                        l[i] = l[i] + S[nt * 4 + i * 2 + e]
                for nt in T.unroll(o_tiles):
                    for e in T.unroll(2):
                        O[nt * 4 + i * 2 + e] = O[nt * 4 + i * 2 + e] * alpha
            # The S accumulator layout of two n tiles is the A operand layout of one k step.
            for i in T.unroll(s_tiles * 4):
                Pf[i] = T.Cast(dtype, S[i])

            T.ptx.cp_async.wait_group(0)
            T.tvm_storage_sync("shared")
            if j + 1 < n_kv_tiles:
                load_kv_rows(K_smem, k, k_at, tid, kv_start + tile_kv, kv_len)
                T.ptx.cp_async.commit_group()

            # O += P V.
            for kk in T.unroll(pv_steps):
                for np in T.unroll(o_tiles // 2):
                    ldmatrix_x4(
                        Vf,
                        0,
                        True,
                        V_smem,
                        swz(
                            kk * 16 + ((lane // 8) % 2) * 8 + lane % 8,
                            np * 2 + lane // 16,
                        ),
                    )
                    mma_two_tiles(Pf, kk * 8, Vf, O, np * 2)

    # fmt: off
    @T.macro
    def store_output(out_flat, Q_smem, O, l, tid, LH_start, q_base, q_tok_stride, q_head_stride, q_len):
    # fmt: on
        # Normalise, stage the tile in (now free) Q shared memory, write it back in 16-byte pieces.
        warp: T.let[T.int32] = tid // WARP
        lane: T.let[T.int32] = tid % WARP
        for i in T.unroll(2):
            l[i] = T.cuda.warp_sum(l[i], 4)
            if empty_rows_zero:
                inv: T.let[T.float32] = T.if_then_else(l[i] > 0, T.float32(1) / l[i], T.float32(0))
            else:
                inv: T.let[T.float32] = T.float32(1) / l[i]
            for nt in T.unroll(o_tiles):
                for e in T.unroll(2):
                    Q_smem[
                        swz(warp * MMA_M + lane // 4 + i * 8, nt) + (lane % 4) * 2 + e
                    ] = T.Cast(dtype, O[nt * 4 + i * 2 + e] * inv)
        T.tvm_storage_sync("shared")
        for it in T.unroll(q_loads):
            idx: T.let[T.int32] = it * threads + tid
            row: T.let[T.int32] = idx // chunks
            c: T.let[T.int32] = idx % chunks
            tok: T.let[T.int32] = (LH_start + row) // group
            if tok < q_len:
                dst = (
                    q_base
                    + tok * q_tok_stride
                    + (LH_start + row) % group * q_head_stride
                    + c * CHUNK
                )
                for e in T.vectorized(CHUNK):
                    out_flat[dst + e] = Q_smem[swz(row, c) + e]

    return attend, store_output


def _alloc_fragments(head_dim: int, dtype: str, cfg: PrefillConfig):
    """Shared tiles and per-thread register fragments of one block (call inside its ``sblock``)."""
    return (
        T.sblock_alloc_buffer((cfg.tile_q * head_dim,), dtype, scope="shared"),
        T.sblock_alloc_buffer((cfg.tile_kv * head_dim,), dtype, scope="shared"),
        T.sblock_alloc_buffer((cfg.tile_kv * head_dim,), dtype, scope="shared"),
        T.sblock_alloc_buffer(
            (head_dim // MMA_K * 8,), dtype, scope="local"
        ),  # Q, A operand
        T.sblock_alloc_buffer(
            (8,), dtype, scope="local"
        ),  # K, B operand of two n tiles
        T.sblock_alloc_buffer(
            (8,), dtype, scope="local"
        ),  # V, B operand of two n tiles
        T.sblock_alloc_buffer(
            (cfg.tile_kv // MMA_N * 4,), "float32", scope="local"
        ),  # S
        T.sblock_alloc_buffer(
            (cfg.tile_kv // MMA_N * 4,), dtype, scope="local"
        ),  # P, A operand
        T.sblock_alloc_buffer((head_dim // MMA_N * 4,), "float32", scope="local"),  # O
        T.sblock_alloc_buffer(
            (2,), "float32", scope="local"
        ),  # running row max (base 2)
        T.sblock_alloc_buffer(
            (2,), "float32", scope="local"
        ),  # running row sum (this thread's part)
        T.sblock_alloc_buffer(
            (1,), "float32", scope="local"
        ),  # a row max being reduced
    )


def _make_kv_cache_blocks(
    num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, cfg: PrefillConfig, kv_row, kv_of, kv_at
):
    """The grid of the KV-cache prefill kernels, shared by the ragged and paged ones.

    Blocks walk the batch's query tiles (q rows ``q_indptr[b]:q_indptr[b+1]``, grouped heads
    folded in); ``kv_of(kv_index, b)`` gives (first index, KV length) of sequence b and
    ``kv_at(kv_index, first, by)`` the ``k_at``/``v_at`` of ``kv_row`` for KV head ``by``.
    Rows that see no key get output 0 and lse ``EMPTY_LSE``, as in TVM's kernels.
    """
    group = _check_args(num_qo_heads, num_kv_heads, head_dim, dtype, cfg)
    attend, store_output = _make_core(head_dim, group, dtype, cfg, kv_row=kv_row, empty_rows_zero=True)
    h_q, h_kv, d = num_qo_heads, num_kv_heads, head_dim

    # fmt: off
    @T.macro
    def prefill_blocks(q, q_indptr, k, v, kv_index, out_flat, lse, batch_size, qo_len, causal, sm_scale):
        # A sequence of n queries has ceil(n * group / tile_q) tiles; their sum over the batch is
        # below total / tile_q + batch_size, so that many blocks cover every tile.
        for bx in T.thread_binding(T.ceildiv(qo_len * group, cfg.tile_q) + batch_size, thread="blockIdx.x"):
            for by in T.thread_binding(h_kv, thread="blockIdx.y"):
                for tid in T.thread_binding(cfg.threads, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        T.reads()
                        T.writes()
                        Q_smem, K_smem, V_smem, Qf, Kf, Vf, S, Pf, O, m, l, row_max = _alloc_fragments(d, dtype, cfg)
                        seq = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        tile = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        seq[0] = 0
                        tile[0] = bx
                        while T.tvm_thread_invariant(
                            seq[0] < batch_size
                            and tile[0] >= T.ceildiv((q_indptr[seq[0] + 1] - q_indptr[seq[0]]) * group, cfg.tile_q)
                        ):
                            tile[0] = tile[0] - T.ceildiv((q_indptr[seq[0] + 1] - q_indptr[seq[0]]) * group, cfg.tile_q)
                            seq[0] = seq[0] + 1
                        if T.tvm_thread_invariant(seq[0] < batch_size):
                            b: T.let[T.int32] = seq[0]
                            q_start: T.let[T.int32] = q_indptr[b]
                            q_n: T.let[T.int32] = q_indptr[b + 1] - q_start
                            kv_first: T.let[T.int32] = kv_of(kv_index, b)[0]
                            kv_n: T.let[T.int32] = kv_of(kv_index, b)[1]
                            # Last tiles first: under a causal mask they have the most work.
                            LH_start: T.let[T.int32] = (T.ceildiv(q_n * group, cfg.tile_q) - 1 - tile[0]) * cfg.tile_q
                            q_base: T.let[T.int32] = (q_start * h_q + by * group) * d
                            attend(
                                q, k, v, Q_smem, K_smem, V_smem, Qf, Kf, Vf, S, Pf, O, m, l, row_max,
                                tid, LH_start, q_base, h_q * d, d,
                                kv_at(kv_index, kv_first, by)[0], kv_at(kv_index, kv_first, by)[1],
                                q_n, kv_n, causal, sm_scale, out_flat, 0,
                            )
                            store_output(out_flat, Q_smem, O, l, tid, LH_start, q_base, h_q * d, d, q_n)
                            if tid % 4 == 0:
                                for i in T.unroll(2):
                                    r: T.let[T.int32] = LH_start + (tid // WARP) * MMA_M + (tid % WARP) // 4 + i * 8
                                    if r // group < q_n:
                                        lse[q_start + r // group, by * group + r % group] = T.if_then_else(
                                            l[i] > 0, m[i] + T.log2(l[i]), T.float32(EMPTY_LSE)
                                        )
    # fmt: on
    return prefill_blocks


RAGGED_SYMBOL = RAGGED_PREFILL_SYMBOL
PAGED_SYMBOL = PAGED_PREFILL_SYMBOL
ROTARY_ASSERT = "fuselight flash prefill: rotary_mode 1 (RoPE inside attention) is not supported"


def flash_prefill_ragged(
    num_kv_heads: int,
    num_qo_heads: int,
    head_dim: int,
    dtype: str,
    config: PrefillConfig,
):
    """Drop-in for TVM's ``batch_prefill_ragged_kv``: same parameters, shapes and results.

    Sequence b's queries are rows ``q_indptr[b]:q_indptr[b+1]`` of q, its keys/values rows
    ``kv_indptr[b]:kv_indptr[b+1]`` of k/v; with ``causal`` query i sees key j iff
    ``j <= i + kv_len_b - q_len_b``. ``lse`` is base 2. RoPE inside attention (``rotary_mode`` 1)
    is not supported: the function asserts ``rotary_mode == 0`` on the host.
    """
    h_q, h_kv, d = num_qo_heads, num_kv_heads, head_dim

    def kv_of(kv_index, b):
        (kv_indptr,) = kv_index
        return kv_indptr[b], kv_indptr[b + 1] - kv_indptr[b]

    def kv_at(_kv_index, first, by):
        at = ((first * h_kv + by) * d, h_kv * d)
        return at, at

    prefill_blocks = _make_kv_cache_blocks(h_kv, h_q, d, dtype, config, _strided_row, kv_of, kv_at)

    # fmt: off
    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": RAGGED_SYMBOL})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=q_rope_position_elem_offset)  # noqa: F841 (TVM's signature)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_pos_offset_elem_offset)  # noqa: F841
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")
        assert rotary_mode == 0, ROTARY_ASSERT
        out_flat = T.decl_buffer((qo_len * h_q * d,), dtype, data=output.data)
        prefill_blocks(q, q_indptr, k, v, (kv_indptr,), out_flat, lse, batch_size, qo_len, causal, sm_scale)
    # fmt: on
    return batch_prefill_ragged_kv


def flash_prefill_paged(
    num_kv_heads: int,
    num_qo_heads: int,
    head_dim: int,
    dtype: str,
    page_size: int,
    config: PrefillConfig,
):
    """Drop-in for TVM's ``batch_prefill_paged_kv`` (non-sliding-window): same parameters, shapes, results.

    The KV cache calls it for a prefill chunk's attention over the tokens already in the cache.
    Sequence b's queries are rows ``q_indptr[b]:q_indptr[b+1]`` of q; its KV row r is slot
    ``r % page_size`` of page ``page_values[page_indptr[b] + r // page_size]`` of ``pages``
    [max_num_pages, 2 (K, V), h_kv, page_size, d]; it has ``kv_len_b = (num_pages_b - 1) *
    page_size + length_info[b]`` rows (0 without pages). With ``causal`` query i sees key j iff
    ``j <= i + kv_len_b - q_len_b``. ``lse`` is base 2; a row that sees no key gets output 0 and
    lse ``EMPTY_LSE``, as TVM's does. ``rotary_mode`` 1 is not supported (asserted on the host).
    """
    if page_size <= 0:
        raise FuselightError(f"paged prefill attention: page_size {page_size} must be positive")
    h_q, h_kv, d = num_qo_heads, num_kv_heads, head_dim
    page_elems = 2 * h_kv * page_size * d

    def kv_row(row, at):
        page_values, first, head_offset = at
        page = T.Cast("int64", page_values[first + row // page_size])
        return page * page_elems + head_offset + row % page_size * d

    def kv_of(kv_index, b):
        page_indptr, _, last_page_len = kv_index
        return page_indptr[b], paged_kv_len(page_indptr, last_page_len, b, page_size)

    def kv_at(kv_index, first, by):
        page_values = kv_index[1]
        return (page_values, first, by * page_size * d), (page_values, first, (h_kv + by) * page_size * d)

    prefill_blocks = _make_kv_cache_blocks(h_kv, h_q, d, dtype, config, kv_row, kv_of, kv_at)

    # fmt: off
    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": PAGED_SYMBOL})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        pages_elem_offset = T.int64()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype, elem_offset=pages_elem_offset)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_pos_offset_elem_offset)  # noqa: F841 (TVM's signature)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=q_rope_position_elem_offset)  # noqa: F841
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        # Last page lengths; TVM's sliding-window variant has [3, batch_size] here (not supported).
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset)
        assert rotary_mode == 0, ROTARY_ASSERT
        out_flat = T.decl_buffer((total_len * h_q * d,), dtype, data=output.data)
        prefill_blocks(
            q, q_indptr, pages, pages, (page_indptr, page_values, length_info), out_flat, lse,
            batch_size, total_len, causal, sm_scale,
        )
    # fmt: on
    return batch_prefill_paged_kv


LAYOUTS = ("BSHD", "BHSD")


def flash_attention_dense(
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    *,
    causal: bool,
    sm_scale: float,
    layout: str,
    additive_mask: bool,
    config: PrefillConfig,
    decode=None,
):
    """Plain attention ``out = softmax(q k^T * sm_scale [+ mask]) v`` with grouped-query heads.

    ``layout`` "BSHD": q/out [B, Sq, Hq, D], k/v [B, Skv, Hkv, D]; "BHSD": q/out [B, Hq, Sq, D],
    k/v [B, Hkv, Skv, D]. B, Sq, Skv are symbolic int64. ``causal`` is bottom-right aligned (query i
    sees key j iff ``j <= i + Skv - Sq``). With ``additive_mask`` a ``mask`` [MB, 1, Sq, Skv] in
    ``dtype`` (MB = 1 or B) is added to the scaled scores, before the causal mask; a row masked
    everywhere gives NaN, as PyTorch's SDPA does. Parameters: q, k, v, [mask,] out. ``decode``
    (``decode.dense_decode``'s macro for the same heads, layout and mask) runs instead where Sq is 1
    at run time: one query row tiled this way leaves most of the GPU idle, the split-KV kernel fills it.
    """
    if layout not in LAYOUTS:
        raise FuselightError(
            f"dense attention: layout {layout!r} unsupported (supported: {', '.join(LAYOUTS)})"
        )
    group = _check_args(num_qo_heads, num_kv_heads, head_dim, dtype, config)
    attend, store_output = _make_core(
        head_dim, group, dtype, config, with_mask=additive_mask
    )
    h_q, h_kv, d, cfg = num_qo_heads, num_kv_heads, head_dim, config
    bshd = layout == "BSHD"
    is_causal = 1 if causal else 0

    def q_layout(batch, q_len):
        return (batch, q_len, h_q, d) if bshd else (batch, h_q, q_len, d)

    def kv_layout(batch, kv_len):
        return (batch, kv_len, h_kv, d) if bshd else (batch, h_kv, kv_len, d)

    # fmt: off
    @T.macro
    def kernel(q, k, v, out, mask_flat, mask_batch, batch, q_len, kv_len):
        out_flat = T.decl_buffer((batch * q_len * h_q * d,), dtype, data=out.data)
        for bx in T.thread_binding(T.ceildiv(q_len * group, cfg.tile_q), thread="blockIdx.x"):
            for by in T.thread_binding(h_kv, thread="blockIdx.y"):
                for bz in T.thread_binding(batch, thread="blockIdx.z"):
                    for tid in T.thread_binding(cfg.threads, thread="threadIdx.x"):
                        with T.sblock("attn"):
                            T.reads()
                            T.writes()
                            Q_smem, K_smem, V_smem, Qf, Kf, Vf, S, Pf, O, m, l, row_max = _alloc_fragments(d, dtype, cfg)
                            n_q: T.let[T.int32] = T.Cast("int32", q_len)
                            n_kv: T.let[T.int32] = T.Cast("int32", kv_len)
                            # Last tiles first: under a causal mask they have the most work.
                            LH_start: T.let[T.int32] = (T.ceildiv(n_q * group, cfg.tile_q) - 1 - T.Cast("int32", bx)) * cfg.tile_q
                            q_base: T.let[T.int64] = (
                                (bz * q_len * h_q + by * group) * d if bshd else (bz * h_q + by * group) * q_len * d
                            )
                            kv_base: T.let[T.int64] = (
                                (bz * kv_len * h_kv + by) * d if bshd else (bz * h_kv + by) * kv_len * d
                            )
                            attend(
                                q, k, v, Q_smem, K_smem, V_smem, Qf, Kf, Vf, S, Pf, O, m, l, row_max,
                                tid, LH_start, q_base,
                                h_q * d if bshd else d,
                                d if bshd else q_len * d,
                                (kv_base, h_kv * d if bshd else d),
                                (kv_base, h_kv * d if bshd else d),
                                n_q, n_kv, is_causal, T.float32(sm_scale),
                                mask_flat, T.if_then_else(mask_batch == 1, T.int64(0), bz) * q_len * kv_len,
                            )
                            store_output(
                                out_flat, Q_smem, O, l, tid, LH_start, q_base,
                                h_q * d if bshd else d, d if bshd else q_len * d, n_q,
                            )

    if additive_mask:
        @T.prim_func(s_tir=True)
        def flash_attention(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_mask: T.handle, var_out: T.handle):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            batch, q_len, kv_len, mask_batch = T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(var_q, q_layout(batch, q_len), dtype)
            k = T.match_buffer(var_k, kv_layout(batch, kv_len), dtype)
            v = T.match_buffer(var_v, kv_layout(batch, kv_len), dtype)
            mask = T.match_buffer(var_mask, (mask_batch, 1, q_len, kv_len), dtype)
            out = T.match_buffer(var_out, q_layout(batch, q_len), dtype)
            mask_flat = T.decl_buffer((mask_batch * q_len * kv_len,), dtype, data=mask.data)
            if decode is None:
                kernel(q, k, v, out, mask_flat, mask_batch, batch, q_len, kv_len)
            elif q_len == 1:
                decode(q, k, v, mask, mask_batch, out, batch, kv_len)
            else:
                kernel(q, k, v, out, mask_flat, mask_batch, batch, q_len, kv_len)
    else:
        @T.prim_func(s_tir=True)
        def flash_attention(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_out: T.handle):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            batch, q_len, kv_len = T.int64(), T.int64(), T.int64()
            q = T.match_buffer(var_q, q_layout(batch, q_len), dtype)
            k = T.match_buffer(var_k, kv_layout(batch, kv_len), dtype)
            v = T.match_buffer(var_v, kv_layout(batch, kv_len), dtype)
            out = T.match_buffer(var_out, q_layout(batch, q_len), dtype)
            # No mask: attend never reads mask_flat (with_mask is off), any buffer stands in.
            if decode is None:
                kernel(q, k, v, out, q, T.int64(1), batch, q_len, kv_len)
            elif q_len == 1:
                decode(q, k, v, q, T.int64(1), out, batch, kv_len)
            else:
                kernel(q, k, v, out, q, T.int64(1), batch, q_len, kv_len)
    # fmt: on
    return flash_attention
