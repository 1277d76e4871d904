"""Split-KV (flash-decoding) attention of one query token per sequence: over TVM's paged KV cache and dense.

TVM's built-in decode kernel gives each (sequence, KV head) one block and walks the whole context in
it: 8 blocks for LLaMA-3-8B at batch 1 on a 132-SM GPU. This one splits the context of each sequence
across blocks so that batch x KV heads x splits fills the GPU, then merges the partial results by
their log-sum-exp in a second kernel. A block serves every query head of its KV head (GQA), so each
K/V byte is read once; a thread's next rows are loading while it uses the current ones (and the
pages of the rows after those are being looked up; a split's rows start on a step boundary), the
scores of all rows and heads of a step are reduced together by shuffles, and the merge folds the
splits in several thread rows at once, so no step waits on one memory or shuffle latency at a time.
The merge kernel may launch while the split kernel runs (it waits for it with
``griddepcontrol.wait``; ``fuselight.tir_pipeline`` gives it the launch attribute that allows this),
so its launch latency is hidden; once it has waited it lets the next kernel launch (o_proj's GEMV,
which then prefetches weights while the merge runs: ``rules/gemm/gemv_rows.py``), and the split grid
has only as many splits as the longest possible sequence can use.

``flash_decode_paged`` has the signature, buffers and output conventions (base-2 lse) of TVM's
``batch_decode_paged_kv``, so the KV cache runtime calls it in its place.
``flash_decode_paged_rotary`` is the same kernel doing the cache's RoPE and KV append first, from
the fused qkv (``passes.fuse_rope_append`` hands it to the cache): each split block computes its q
heads and the new key and value rows by TVM's split-rotary expressions (``rotary.py``), writes the
rows into the pages and attends after a barrier, so a decode layer launches nothing else for them;
and with the counters its caller owns (``fuselight.kv_hooks``; zero between calls), it has no merge
kernel: each split block, once its partials are visible device-wide (``__threadfence``), counts
itself done with an atomic add on its (sequence, KV head)'s counter, and the last one merges the
group's partials (read past L1: other SMs wrote them) by the merge kernel's fold and sets the
counter back to zero. The next kernel, which the split kernel lets launch at its start, then waits
for the whole grid, merge included.
``dense_decode`` is plain attention of one query row over dense K/V: the body
``prefill.flash_attention_dense`` runs where the query length is 1 at run time. Both are the same
two kernels (``_kernels``), differing only in how a sequence's length and a K/V row are found; they
keep the merge kernel (TVM's runtime and the dense caller pass no counters).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import tvm
from fuselight.contracts import DECODE_SYMBOL, ROTARY_DECODE_SYMBOL
from fuselight.device import require_device, warp_size
from fuselight.errors import FuselightError
from tvm import arith, tirx
from tvm.script import tirx as T

from .. import arch_config
from ..arch_config import load_arch_config
from .paging import paged_kv_len
from .rotary import K_OUT, Q_OUT, V_OUT, SplitRotary

GLOBAL_SYMBOL = DECODE_SYMBOL
ROTARY_GLOBAL_SYMBOL = ROTARY_DECODE_SYMBOL
# TVM's kernels use this finite "minus infinity" for running maxima, and as an empty sequence's lse.
_NEG = -5e4
_LOAD_BYTES = 16  # each thread loads 16 bytes of a K/V row at once
_WARP = warp_size()
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
LAYOUTS = ("BSHD", "BHSD")  # of the dense q, k, v and out
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    warps: int  # warps per block of the split kernel
    rows_per_step: int  # KV rows a thread loads before using them
    target_blocks: int  # split until batch x KV heads x splits reaches at most this many blocks
    max_splits: int  # bounds the workspace
    min_rows_per_split: int  # short contexts stay in few splits
    merge_groups: int  # thread rows of the merge kernel, each folding every merge_groups-th split
    # The rotary kernel (whose caller owns the counters it needs) merges in its last split block of
    # each (sequence, KV head) instead of a second kernel. Off where measured slower (the merge
    # then runs after the split work instead of overlapping it: docs/experiments/config-attention-decode.md).
    merge_in_split: bool = False
    # splits a thread row of that last block loads at once (a memory latency each such chunk)
    merge_in_split_folds: int = 8
    # The device has griddepcontrol (``load_decode_config`` asks the device model): the merge kernel
    # launches while the split kernel runs and waits for its grid, and lets the next kernel launch early.
    griddepcontrol: bool = False


def load_decode_config(arch: str) -> DecodeConfig:
    cfg = load_arch_config("attention", "decode", arch, DecodeConfig, analytic=arch_config.as_written)
    return dataclasses.replace(cfg, griddepcontrol=require_device(arch).has("griddepcontrol"))


def _num_splits(config: DecodeConfig, kv_heads: int, batch):
    """Splits of each (sequence, KV head): an expression, not a let-bound var, since grid extents and
    the workspace shape both use it. Rounded down: a grid just over ``target_blocks`` (whole waves)
    would add a nearly empty wave."""
    return T.min(T.max(T.floordiv(config.target_blocks, batch * kv_heads), 1), config.max_splits)


def _split_rows(kv_len, num_splits, min_rows: int, align: int):
    """Rows per split of a sequence: the context spread evenly, rounded up to a multiple of
    ``align`` (a block's rows a step: every step but the last then reads whole, aligned row
    groups, one page each where pages are that size), and at least ``min_rows``."""
    return T.max(T.ceildiv(T.ceildiv(kv_len, num_splits), align) * align, min_rows)


@dataclasses.dataclass(frozen=True)
class _Heads:
    """One head layout and the thread shape it gets: BDX lanes of VEC elements cover a head row."""

    qo: int
    kv: int
    dim: int
    dtype: str
    vec: int
    bdx: int

    @property
    def group(self) -> int:
        return self.qo // self.kv


def _heads(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str) -> _Heads:
    if dtype not in _DTYPE_BYTES:
        raise FuselightError(f"decode attention: dtype {dtype!r} is not one of {', '.join(_DTYPE_BYTES)}")
    if num_qo_heads % num_kv_heads:
        raise FuselightError(f"decode attention: kv heads ({num_kv_heads}) must divide query heads ({num_qo_heads})")
    vec = _LOAD_BYTES // _DTYPE_BYTES[dtype]
    bdx = head_dim // vec
    if head_dim % vec or bdx > _WARP or _WARP % bdx:
        raise FuselightError(f"decode attention: head dim {head_dim} unsupported for {dtype} (needs {vec} x 2^k <= {vec * _WARP})")
    return _Heads(num_qo_heads, num_kv_heads, head_dim, dtype, vec, bdx)


def _kernels(heads: _Heads, config: DecodeConfig, rotary: SplitRotary | None = None, counters: bool = False) -> SimpleNamespace:
    """The split and merge kernels as macros, the split count and the kernel launches, for one head layout.

    ``split(io, batch, seq, sm_scale)`` and ``merge(io, batch, seq)`` read the query from ``io.Q``
    and write ``io.output`` (both [batch, qo heads, dim]) and, where given, ``io.lse``, through the
    fp32 partials ``io.O_part`` [batch, qo heads, splits, dim] and ``io.lse_part``. ``seq`` says how
    the K/V of a sequence are found: ``seq.length(io, b)`` its KV length, ``seq.max_length(io)`` a
    bound on every sequence's length that the host knows (the grid has no more splits than it
    needs), ``seq.base(io, b)`` a value computed once per block, ``seq.locate(io, base, row)`` an
    int32 that places row ``row`` in storage (it may load, so it is issued a step ahead),
    ``seq.load_row(io, k, v, u, b, h, lane, loc, row)`` (a macro) row ``row``'s elements of head
    ``h`` for ``lane``, placed by ``loc``, into ``k[u, :]``, ``v[u, :]``, and
    ``seq.bias(io, b, row)`` what is added to the row's base-2 score (None: nothing).

    With ``rotary`` (TVM's split-rotary kernel, read by ``rotary.analyze``) the split kernel first
    does that kernel's and the KV append's work for its token and KV head (``rotate``): ``io.Q``
    is then the split-rotary's q output, and ``io.rotary`` has its ``qkv``, ``positions``, ``k``,
    ``v``, ``apply_rope`` and ``append_positions``, and ``seq.append_position(io, b)`` is the page slot
    of sequence ``b``'s new row.

    With ``counters`` (``io.counters``: int32, one a (sequence, KV head), zero before the call; the
    caller owns them) and ``config.merge_in_split``, ``merge`` is not launched: the last split block
    of each (sequence, KV head) to finish merges that group's partials (it counts the finished blocks
    with an atomic add; ``launches`` is then 1), and sets its counter back to zero.
    """
    H_qo, H_kv, D, G, VEC, BDX, dtype = heads.qo, heads.kv, heads.dim, heads.group, heads.vec, heads.bdx, heads.dtype
    BDY = _WARP // BDX * config.warps  # rows processed side by side in a block
    U = config.rows_per_step
    MIN_ROWS, MAX_SPLITS = config.min_rows_per_split, config.max_splits
    MG = config.merge_groups
    PDL = config.griddepcontrol
    FOLDS = -(-MAX_SPLITS // MG)  # splits a merge thread row folds, at most
    LOG_BDX = int(math.log2(BDX))
    THREADS = BDY * BDX
    IN_SPLIT = counters and config.merge_in_split
    # The last block's thread rows: LR a head, LH heads at once, in LROUNDS rounds, each row loading
    # LFOLDS splits at once.
    LR = max(BDY // G, 1)
    LH = BDY // LR
    LROUNDS = -(-G // LH)
    LFOLDS = min(config.merge_in_split_folds, -(-MAX_SPLITS // LR))

    def num_splits(batch):
        return _num_splits(config, H_kv, batch)

    def grid_splits(io, batch, seq):
        # Blocks a (sequence, KV head) gets: no sequence uses more splits than the longest possible
        # one, and blocks with no rows still cost their launch (b1 x 1024: 2 us at 64 splits).
        return T.min(num_splits(batch), T.max(T.ceildiv(seq.max_length(io), MIN_ROWS), 1))

    @T.macro
    def locate_rows(io, seq, loc, ty, base, row_begin, row_end, step):
        # Where rows step * U * BDY + ... of the split are, a step before they are loaded, so a
        # lookup (a page number) is never waited on between a step and its K/V loads.
        for u in T.unroll(U):
            row: T.let[T.int32] = row_begin + (step * U + u) * BDY + ty
            loc[u] = T.if_then_else(row < row_end, seq.locate(io, base, row), 0)

    @T.macro
    def load_rows(io, seq, k, v, loc, b, h, lane, ty, row_begin, row_end, step):
        # Rows step * U * BDY + ... of the split into registers; rows past the end read as zeros.
        for u in T.unroll(U):
            row: T.let[T.int32] = row_begin + (step * U + u) * BDY + ty
            if row < row_end:
                seq.load_row(io, k, v, u, b, h, lane, loc[u], row)
            else:
                for e in T.serial(VEC):
                    k[u, e] = T.cast(0, dtype)
                    v[u, e] = T.cast(0, dtype)

    @T.macro
    def rotate(io, seq, bz, by, bx, ty, tx, q_rot):
        # TVM's split-rotary values of this token's G query heads into q_rot[0] [G, D] (fp32), its key
        # and value rows into the pages by every block (whichever holds the new row reads it after
        # the barrier), and all of them into the split-rotary outputs by the first split.
        t: T.let[T.int32] = ty * BDX + tx
        for i in T.serial(-(-(G * D) // THREADS)):
            if i * THREADS + t < G * D:
                g: T.let[T.int32] = T.floordiv(i * THREADS + t, D)
                e: T.let[T.int32] = T.floormod(i * THREADS + t, D)
                q_val: T.let = rotary.value(Q_OUT, io.rotary.qkv, io.rotary.positions, io.rotary.apply_rope, bz, by * G + g, e)
                q_rot[0, g, e] = T.cast(q_val, "float32")
                if bx == 0:
                    io.Q[bz, by * G + g, e] = q_val
        pos: T.let[T.int32] = seq.append_position(io, bz)
        for i in T.serial(-(-D // THREADS)):
            if i * THREADS + t < D:
                k_val: T.let = rotary.value(K_OUT, io.rotary.qkv, io.rotary.positions, io.rotary.apply_rope, bz, by, i * THREADS + t)
                v_val: T.let = rotary.value(V_OUT, io.rotary.qkv, io.rotary.positions, io.rotary.apply_rope, bz, by, i * THREADS + t)
                if pos != -1:  # TVM's append skips such tokens
                    io.pages[T.floordiv(pos, io.page_size), 0, by, T.floormod(pos, io.page_size), i * THREADS + t] = k_val
                    io.pages[T.floordiv(pos, io.page_size), 1, by, T.floormod(pos, io.page_size), i * THREADS + t] = v_val
                if bx == 0:
                    io.rotary.k[bz, by, i * THREADS + t] = k_val
                    io.rotary.v[bz, by, i * THREADS + t] = v_val
        T.tvm_storage_sync("shared")

    @T.macro
    def fold(io, load, load_loop, bz, h, row, r, rows, folds, chunks, tx, used, active, acc, mw, l_in, o_in, o_sm, mw_sm):
        # Head h's splits merged by its log-sum-exp into io.output (and io.lse): thread row r of the
        # ``rows`` serving the head folds splits r, r + rows, ..., ``folds`` of them loaded at once (one
        # memory latency, not one a split) per chunk, into shared row ``row``; then the head's row
        # r == 0 merges the head's shared rows from row - r on. ``load`` reads a partial (``load_loop``
        # its vector loop); every thread reaches the barrier (``active``: the thread serves a head).
        if active:
            mw[0] = T.float32(_NEG)
            mw[1] = T.float32(0)
            for e in T.serial(VEC):
                acc[e] = T.float32(0)
            for c in T.serial(chunks):
                for i in T.unroll(folds):
                    if (c * folds + i) * rows + r < used:
                        l_in[i] = load(io.lse_part[bz, h, (c * folds + i) * rows + r])
                        for e in load_loop(VEC):
                            o_in[i, e] = load(io.O_part[bz, h, (c * folds + i) * rows + r, tx * VEC + e])
                for i in T.unroll(folds):
                    if (c * folds + i) * rows + r < used:
                        m_new: T.let[T.float32] = T.max(mw[0], l_in[i])
                        scale: T.let[T.float32] = T.exp2(mw[0] - m_new)
                        f: T.let[T.float32] = T.exp2(l_in[i] - m_new)
                        mw[1] = mw[1] * scale + f
                        for e in T.unroll(VEC):
                            acc[e] = acc[e] * scale + o_in[i, e] * f
                        mw[0] = m_new
            for e in T.serial(VEC):
                o_sm[row, tx * VEC + e] = acc[e]
            mw_sm[row, 0] = mw[0]
            mw_sm[row, 1] = mw[1]
        T.tvm_storage_sync("shared")
        if active:
            if r == 0:
                mw[0] = T.float32(_NEG)
                for j in T.serial(rows):
                    mw[0] = T.max(mw[0], mw_sm[row - r + j, 0])
                mw[1] = T.float32(0)
                for e in T.serial(VEC):
                    acc[e] = T.float32(0)
                for j in T.serial(rows):
                    f2: T.let[T.float32] = T.exp2(mw_sm[row - r + j, 0] - mw[0])
                    mw[1] += mw_sm[row - r + j, 1] * f2
                    for e in T.serial(VEC):
                        acc[e] += o_sm[row - r + j, tx * VEC + e] * f2
                # an empty sequence: output 0 and lse -5e4, as TVM's kernel gives
                for e in T.serial(VEC):
                    io.output[bz, h, tx * VEC + e] = T.cast(T.if_then_else(used > 0, acc[e] / mw[1], T.float32(0)), dtype)
                if io.lse is not None:
                    io.lse[bz, h] = T.if_then_else(used > 0, mw[0] + T.log2(mw[1]), T.float32(_NEG))

    # pylint: disable=invalid-name,too-many-locals,too-many-statements
    @T.macro
    def split(io, batch, seq, sm_scale):
        for bz in T.thread_binding(batch, thread="blockIdx.z"):
            for by in T.thread_binding(H_kv, thread="blockIdx.y"):
                for bx in T.thread_binding(grid_splits(io, batch, seq), thread="blockIdx.x"):
                    for ty in T.thread_binding(BDY, thread="threadIdx.y"):
                        for tx in T.thread_binding(BDX, thread="threadIdx.x"):
                            with T.sblock("split"):
                                T.reads()
                                T.writes()
                                q = T.sblock_alloc_buffer((G, VEC), "float32", scope="local")
                                o = T.sblock_alloc_buffer((G, VEC), "float32", scope="local")
                                m = T.sblock_alloc_buffer((G,), "float32", scope="local")
                                d = T.sblock_alloc_buffer((G,), "float32", scope="local")
                                k = T.sblock_alloc_buffer((U, VEC), dtype, scope="local")
                                v = T.sblock_alloc_buffer((U, VEC), dtype, scope="local")
                                k_next = T.sblock_alloc_buffer((U, VEC), dtype, scope="local")
                                v_next = T.sblock_alloc_buffer((U, VEC), dtype, scope="local")
                                loc = T.sblock_alloc_buffer((U,), "int32", scope="local")
                                bounds = T.sblock_alloc_buffer((2,), "int32", scope="local")
                                sc = T.sblock_alloc_buffer((U, G), "float32", scope="local")
                                mx = T.sblock_alloc_buffer((1,), "float32", scope="local")
                                dsum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                                acc = T.sblock_alloc_buffer((VEC,), "float32", scope="local")
                                o_smem = T.sblock_alloc_buffer((BDY, G, D), "float32", scope="shared")
                                md_smem = T.sblock_alloc_buffer((BDY, G, 2), "float32", scope="shared")

                                # The merge kernel (or, merged here, the next one) may launch now (it
                                # waits for this grid to finish before it reads what this one wrote):
                                # its launch overlaps this kernel.
                                if PDL:
                                    T.ptx.griddepcontrol.launch_dependents()
                                if rotary is not None:
                                    rotate(io, seq, bz, by, bx, ty, tx, o_smem)
                                base: T.let[T.int32] = seq.base(io, bz)
                                kv_len: T.let[T.int32] = seq.length(io, bz)
                                # in registers, not lets: TVM would inline the divisions into every use
                                bounds[0] = _split_rows(kv_len, num_splits(batch), MIN_ROWS, BDY * U)
                                bounds[1] = T.min((bx + 1) * bounds[0], kv_len)
                                bounds[0] = bx * bounds[0]
                                row_begin: T.let[T.int32] = bounds[0]
                                row_end: T.let[T.int32] = bounds[1]
                                if T.tvm_thread_invariant(row_begin < row_end):
                                    for g, e in T.grid(G, VEC):
                                        if rotary is not None:
                                            q[g, e] = o_smem[0, g, tx * VEC + e] * sm_scale * LOG2E
                                        else:
                                            q[g, e] = T.cast(io.Q[bz, by * G + g, tx * VEC + e], "float32") * sm_scale * LOG2E
                                        o[g, e] = T.float32(0)
                                    for g in T.serial(G):
                                        m[g] = T.float32(_NEG)
                                        d[g] = T.float32(0)
                                    locate_rows(io, seq, loc, ty, base, row_begin, row_end, 0)
                                    load_rows(io, seq, k, v, loc, bz, by, tx, ty, row_begin, row_end, 0)
                                    locate_rows(io, seq, loc, ty, base, row_begin, row_end, 1)
                                    for step in T.serial(T.ceildiv(row_end - row_begin, BDY * U)):
                                        # The next step's rows are in flight while this step's are
                                        # used, and the step after's are located.
                                        load_rows(io, seq, k_next, v_next, loc, bz, by, tx, ty, row_begin, row_end, step + 1)
                                        locate_rows(io, seq, loc, ty, base, row_begin, row_end, step + 2)
                                        # All U x G partial dot products first, then reduced across
                                        # the row's BDX lanes by butterfly shuffles, independent of one
                                        # another (one allreduce each would serialise on its latency).
                                        for u, g in T.grid(U, G):
                                            sc[u, g] = T.float32(0)
                                            for e in T.unroll(VEC):
                                                sc[u, g] += q[g, e] * T.cast(k[u, e], "float32")
                                        for sh in T.unroll(LOG_BDX):
                                            for u, g in T.grid(U, G):
                                                sc[u, g] += T.tvm_warp_shuffle_xor(
                                                    T.tvm_warp_activemask(), sc[u, g], T.shift_right(BDX, sh + 1), _WARP, _WARP
                                                )
                                        if seq.bias is not None:
                                            for u in T.unroll(U):
                                                row_u: T.let[T.int32] = row_begin + (step * U + u) * BDY + ty
                                                if row_u < row_end:
                                                    for g in T.serial(G):
                                                        sc[u, g] += seq.bias(io, bz, row_u)
                                        # One rescale per head for the U rows (rows past the end are masked).
                                        for g in T.serial(G):
                                            mx[0] = m[g]
                                            for u in T.unroll(U):
                                                if row_begin + (step * U + u) * BDY + ty < row_end:
                                                    mx[0] = T.max(mx[0], sc[u, g])
                                            rescale: T.let[T.float32] = T.exp2(m[g] - mx[0])
                                            d[g] = d[g] * rescale
                                            for e in T.unroll(VEC):
                                                o[g, e] = o[g, e] * rescale
                                            for u in T.unroll(U):
                                                if row_begin + (step * U + u) * BDY + ty < row_end:
                                                    p: T.let[T.float32] = T.exp2(sc[u, g] - mx[0])
                                                    d[g] = d[g] + p
                                                    for e in T.unroll(VEC):
                                                        o[g, e] = o[g, e] + p * T.cast(v[u, e], "float32")
                                            m[g] = mx[0]
                                        for u, e in T.grid(U, VEC):
                                            k[u, e] = k_next[u, e]
                                            v[u, e] = v_next[u, e]
                                    # merge the row groups of the block through shared memory
                                    if rotary is not None:
                                        T.tvm_storage_sync("shared")  # every thread has read its q from o_smem
                                    for g in T.serial(G):
                                        for e in T.serial(VEC):
                                            o_smem[ty, g, tx * VEC + e] = o[g, e]
                                        md_smem[ty, g, 0] = m[g]
                                        md_smem[ty, g, 1] = d[g]
                                    T.tvm_storage_sync("shared")
                                    for gi in T.serial(T.ceildiv(G, BDY)):
                                        if gi * BDY + ty < G:
                                            mx[0] = T.float32(_NEG)
                                            for j in T.serial(BDY):
                                                mx[0] = T.max(mx[0], md_smem[j, gi * BDY + ty, 0])
                                            dsum[0] = T.float32(0)
                                            for e in T.serial(VEC):
                                                acc[e] = T.float32(0)
                                            for j in T.serial(BDY):
                                                f: T.let[T.float32] = T.exp2(md_smem[j, gi * BDY + ty, 0] - mx[0])
                                                dsum[0] += md_smem[j, gi * BDY + ty, 1] * f
                                                for e in T.serial(VEC):
                                                    acc[e] += o_smem[j, gi * BDY + ty, tx * VEC + e] * f
                                            for e in T.serial(VEC):
                                                io.O_part[bz, by * G + gi * BDY + ty, bx, tx * VEC + e] = acc[e] / dsum[0]
                                            io.lse_part[bz, by * G + gi * BDY + ty, bx] = mx[0] + T.log2(dsum[0])
                                if IN_SPLIT:
                                    last = T.sblock_alloc_buffer((2,), "int32", scope="local")  # flag, used
                                    last_smem = T.sblock_alloc_buffer((1,), "int32", scope="shared")
                                    mw = T.sblock_alloc_buffer((2,), "float32", scope="local")
                                    l_in = T.sblock_alloc_buffer((LFOLDS,), "float32", scope="local")
                                    o_in = T.sblock_alloc_buffer((LFOLDS, VEC), "float32", scope="local")
                                    o_sm = T.sblock_alloc_buffer((BDY, D), "float32", scope="shared")
                                    mw_sm = T.sblock_alloc_buffer((BDY, 2), "float32", scope="shared")
                                    # Every block, with rows or none, counts itself finished once its
                                    # partials are visible to the whole device; the last one merges.
                                    T.tvm_storage_sync("shared")
                                    if ty == 0 and tx == 0:
                                        T.cuda.thread_fence()
                                        done: T.let[T.int32] = T.cuda.atomic_add(T.address_of(io.counters[bz * H_kv + by]), 1)
                                        last_smem[0] = T.if_then_else(done == grid_splits(io, batch, seq) - 1, 1, 0)
                                    T.tvm_storage_sync("shared")
                                    last[0] = last_smem[0]
                                    if T.tvm_thread_invariant(last[0] == 1):
                                        T.cuda.thread_fence()  # then read what the other blocks wrote
                                        # the splits with rows; in a register, not a let (inlined into every use)
                                        last[1] = T.ceildiv(kv_len, _split_rows(kv_len, num_splits(batch), MIN_ROWS, BDY * U))
                                        for rnd in T.serial(LROUNDS):
                                            fold(io, _from_l2, T.serial, bz, by * G + rnd * LH + T.floordiv(ty, LR), ty,
                                                 T.floormod(ty, LR), LR, LFOLDS, T.ceildiv(last[1], LR * LFOLDS), tx, last[1],
                                                 T.And(ty < LH * LR, rnd * LH + T.floordiv(ty, LR) < G),
                                                 acc, mw, l_in, o_in, o_sm, mw_sm)
                                            if LROUNDS > 1:
                                                T.tvm_storage_sync("shared")  # the next round reuses o_sm
                                        if ty == 0 and tx == 0:
                                            io.counters[bz * H_kv + by] = 0  # ready for the next call

    @T.macro
    def merge(io, batch, seq):
        for bz in T.thread_binding(batch, thread="blockIdx.y"):
            for h in T.thread_binding(H_qo, thread="blockIdx.x"):
                for ty in T.thread_binding(MG, thread="threadIdx.y"):
                    for tx in T.thread_binding(BDX, thread="threadIdx.x"):
                        with T.sblock("merge"):
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer((VEC,), "float32", scope="local")
                            mw = T.sblock_alloc_buffer((2,), "float32", scope="local")
                            l_in = T.sblock_alloc_buffer((FOLDS,), "float32", scope="local")
                            o_in = T.sblock_alloc_buffer((FOLDS, VEC), "float32", scope="local")
                            o_sm = T.sblock_alloc_buffer((MG, D), "float32", scope="shared")
                            mw_sm = T.sblock_alloc_buffer((MG, 2), "float32", scope="shared")
                            kv_len: T.let[T.int32] = seq.length(io, bz)
                            used: T.let[T.int32] = T.ceildiv(kv_len, _split_rows(kv_len, num_splits(batch), MIN_ROWS, BDY * U))
                            # Launched early where the TIR pipeline allows (fuselight.tir_pipeline):
                            # the split kernel's partials are complete and visible after this. The
                            # next kernel (o_proj) may launch then: it streams weights while this one
                            # merges. With that trigger ptxas keeps the lengths' loads above the wait,
                            # as written (SASS, H100, nvcc 13.0): they read the page table the host
                            # uploads before the step, which the split kernel does not write, and
                            # fuselight.pdl_audit allows them (configs/pdl_audit.json).
                            if PDL:
                                T.ptx.griddepcontrol.wait()
                                T.ptx.griddepcontrol.launch_dependents()
                            # MG thread rows a head, all splits in one chunk
                            fold(io, _plain, T.vectorized, bz, h, ty, ty, MG, FOLDS, 1, tx, used, True,
                                 acc, mw, l_in, o_in, o_sm, mw_sm)

    return SimpleNamespace(split=split, merge=merge, num_splits=num_splits, launches=1 if IN_SPLIT else 2)


def _plain(load):
    return load


def _from_l2(load):
    # written by other blocks of this launch, on other SMs: read past this SM's L1 (ld.global.cg)
    return T.ptx.ld(T.address_of(load), "float32", "f32", cop="cg")


@T.macro
def _paged_row(io, k, v, u, b, h, lane, page_no, row):
    slot: T.let[T.int32] = T.floormod(row, io.page_size)
    for e in T.vectorized(io.vec):
        k[u, e] = io.pages[page_no, 0, h, slot, lane * io.vec + e]
    for e in T.vectorized(io.vec):
        v[u, e] = io.pages[page_no, 1, h, slot, lane * io.vec + e]


# TVM's paged KV cache: a sequence's pages listed from page_indptr[b], rows in page order.
_PAGED = SimpleNamespace(
    length=lambda io, b: paged_kv_len(io.page_indptr, io.length_info, b, io.page_size),
    # a sequence has at most all the pages of the batch
    max_length=lambda io: io.page_values.shape[0] * io.page_size,
    base=lambda io, b: io.page_indptr[b],
    locate=lambda io, page_begin, row: io.page_values[page_begin + T.floordiv(row, io.page_size)],
    load_row=_paged_row,
    bias=None,
    append_position=lambda io, b: io.rotary.append_positions[b],
)


# Where a graph replays the step (``passes.capture_whole_step``): only metadata at addresses that do
# not move with the page count is read (TVM's q positions, page_indptr, the page table's start), so
# one sequence's KV length is its new token's position + 1, and the grid is sized for every page of
# the cache (blocks past the length exit at once).
_PAGED_BY_POSITION = SimpleNamespace(
    **{**vars(_PAGED), "length": lambda io, b: T.if_then_else(
        io.page_indptr[b + 1] > io.page_indptr[b], io.positions[b] + 1, 0),
       "max_length": lambda io: io.pages.shape[0] * io.page_size,
       # the new row goes after the sequence's last row, in its last page
       "append_position": lambda io, b: io.page_values[io.page_indptr[b + 1] - 1] * io.page_size
       + T.floormod(io.positions[b], io.page_size)},
)


# The rotary kernel's parameters (split-rotary's qkv, positions, k, v, apply_rope; the append's
# positions) by index: without them its signature is TVM's ``batch_decode_paged_kv``'s.
_ROTARY_ONLY_PARAMS = (0, 1, 3, 4, 5, 7)


def _paged_decode(
    heads: _Heads, config: DecodeConfig, page_size: int, rotary: SplitRotary | None, by_position: bool = False
) -> tvm.tirx.PrimFunc:
    """The kernels over TVM's paged cache with the rotary kernel's signature; without ``rotary`` the
    split-rotary and append parameters and the counters are unused (two kernels). ``by_position``:
    lengths and the append slot from the q positions (``_PAGED_BY_POSITION``); length_info and the
    append positions are then unused."""
    kernels = _kernels(heads, config, rotary, counters=rotary is not None)
    in_split = kernels.launches == 1
    H_qo, H_kv, D, PAGE, VEC, dtype = heads.qo, heads.kv, heads.dim, page_size, heads.vec, heads.dtype
    seq = _PAGED_BY_POSITION if by_position else _PAGED

    # pylint: disable=invalid-name
    @T.prim_func(s_tir=True)
    def decode(
        qkv_handle: T.handle,
        positions_handle: T.handle,
        Q_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        apply_rope: T.int64,
        pages_handle: T.handle,
        append_positions_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
        o_part_handle: T.handle,
        lse_part_handle: T.handle,
        counters_handle: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "fuselight.kernel_launches": kernels.launches})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        positions_elem_offset = T.int32()
        append_positions_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        num_counters = T.int32()

        qkv = T.match_buffer(qkv_handle, (B, H_qo + 2 * H_kv, D), dtype)
        positions = T.match_buffer(positions_handle, (B,), "int32", elem_offset=positions_elem_offset)
        Q = T.match_buffer(Q_handle, (B, H_qo, D), dtype)
        k = T.match_buffer(k_handle, (B, H_kv, D), dtype)
        v = T.match_buffer(v_handle, (B, H_kv, D), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, PAGE, D), dtype)
        append_positions = T.match_buffer(append_positions_handle, (B,), "int32", elem_offset=append_positions_elem_offset)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_rope_pos_offset_elem_offset)  # noqa: F841
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, H_qo, D), dtype)
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")
        length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_info_elem_offset)
        # by position, in buffers the caller owns: a replayed graph keeps their addresses, which a
        # block of TVM's workspace pool need not keep (the pool frees a block to grow it)
        O_part = (T.match_buffer(o_part_handle, (B, H_qo, kernels.num_splits(B), D), "float32") if by_position
                  else T.alloc_buffer((B, H_qo, kernels.num_splits(B), D), "float32", scope="global"))
        lse_part = (T.match_buffer(lse_part_handle, (B, H_qo, kernels.num_splits(B)), "float32") if by_position
                    else T.alloc_buffer((B, H_qo, kernels.num_splits(B)), "float32", scope="global"))
        # the caller's (``fuselight.kv_hooks``): zero between calls, at least one a (sequence, KV head)
        if in_split:
            counters = T.match_buffer(counters_handle, (num_counters,), "int32")
            assert num_counters >= B * H_kv, "fuselight_rope_append_decode_paged_kv: fewer counters than sequences x KV heads"
        # RoPE must already be in the cache (applied on append): never attend to un-rotated keys.
        assert rotary_mode == 0, "fuselight_decode_paged_kv: rotary_mode 1 (RoPE inside attention) is not supported"

        # positions (for _PAGED_BY_POSITION): the kernel's own q positions, the same data as the
        # split-rotary's; loads of that one buffer for RoPE and for lengths trip TVM's CSE (a value
        # used before its definition)
        kernels.split(
            SimpleNamespace(
                Q=Q, O_part=O_part, lse_part=lse_part, pages=pages, page_indptr=page_table_indptr,
                page_values=page_table_values, length_info=length_info, positions=q_rope_position, page_size=PAGE, vec=VEC,
                output=output, lse=lse, counters=counters if in_split else None,
                rotary=SimpleNamespace(qkv=qkv, positions=positions, k=k, v=v, apply_rope=apply_rope, append_positions=append_positions),
            ),
            B, seq, sm_scale,
        )
        if not in_split:
            kernels.merge(
                SimpleNamespace(
                    output=output, lse=lse, O_part=O_part, lse_part=lse_part, page_indptr=page_table_indptr,
                    length_info=length_info, positions=q_rope_position, page_size=PAGE,
                ),
                B, seq,
            )

    if by_position:
        return decode
    return tvm.tirx.PrimFunc([*decode.params[:-3], decode.params[-1]], decode.body, decode.ret_type, decode.attrs)


def by_position_workspace(split_rotary: SplitRotary, config: DecodeConfig, batch: int) -> list[tuple[tuple[int, ...], str]]:
    """Shapes and dtypes of the by-position kernel's two parameters before the counters (the split
    partials, which its caller allocates) for a batch of ``batch`` sequences."""
    rot = split_rotary
    splits = int(arith.Analyzer().simplify(_num_splits(config, rot.num_kv_heads, tirx.IntImm("int32", batch))))
    return [((batch, rot.num_qo_heads, splits, rot.head_dim), "float32"), ((batch, rot.num_qo_heads, splits), "float32")]


def flash_decode_paged(
    num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, page_size: int, config: DecodeConfig
) -> tvm.tirx.PrimFunc:
    """The decode kernel for one head layout; a drop-in for TVM's ``batch_decode_paged_kv``."""
    full = _paged_decode(_heads(num_kv_heads, num_qo_heads, head_dim, dtype), config, page_size, None)
    params = [p for i, p in enumerate(full.params[:-1]) if i not in _ROTARY_ONLY_PARAMS]  # nor the counters
    return tvm.tirx.PrimFunc(params, full.body, full.ret_type, full.attrs).with_attr("global_symbol", GLOBAL_SYMBOL)


def flash_decode_paged_rotary(
    split_rotary: SplitRotary, page_size: int, config: DecodeConfig, by_position: bool = False
) -> tvm.tirx.PrimFunc:
    """TVM's split-rotary, its KV append and the decode kernel in one: ``(qkv, positions, q, k, v,
    apply_rope)`` (split-rotary's parameters), ``pages, append_positions`` (the append's), then the
    decode kernel's from ``page_table_indptr`` on (``by_position``: and the split partials), then an
    int32 tensor of counters, zero between calls, at least one a (sequence, KV head), that the caller
    (``fuselight.kv_hooks``) owns: with them the last split block of each (sequence, KV head) merges
    the partials (``DecodeConfig.merge_in_split``), and the kernel is one launch. Each split block
    computes its q heads and new k / v rows by ``split_rotary``'s expressions, so nothing waits for
    another launch; the split-rotary outputs are written as TVM's kernel writes them.
    ``by_position``: see ``_PAGED_BY_POSITION``."""
    rot = split_rotary
    heads = _heads(rot.num_kv_heads, rot.num_qo_heads, rot.head_dim, rot.dtype)
    return _paged_decode(heads, config, page_size, rot, by_position).with_attr("global_symbol", ROTARY_GLOBAL_SYMBOL)


@T.macro
def _dense_row(io, k, v, u, b, h, lane, loc, row):
    for e in T.vectorized(io.vec):
        k[u, e] = io.k[b, row, h, lane * io.vec + e] if io.bshd else io.k[b, h, row, lane * io.vec + e]
    for e in T.vectorized(io.vec):
        v[u, e] = io.v[b, row, h, lane * io.vec + e] if io.bshd else io.v[b, h, row, lane * io.vec + e]


def _dense_bias(io, b, row):
    # the additive mask [MB, 1, 1, Skv] (MB 1 or the batch), in the scores' base 2
    mb = T.if_then_else(io.mask_batch == 1, T.int64(0), T.Cast("int64", b))
    return T.cast(io.mask[mb, 0, 0, row], "float32") * LOG2E


def dense_decode(
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    *,
    sm_scale: float,
    layout: str,
    additive_mask: bool,
    config: DecodeConfig,
):
    """Plain attention of one query row, ``out = softmax(q k^T * sm_scale [+ mask]) v``, split over K/V.

    A macro ``body(q, k, v, mask, mask_batch, out, batch, kv_len)`` over the buffers of
    ``prefill.flash_attention_dense`` (``layout`` "BSHD": q/out [B, Sq, Hq, D], k/v [B, Skv, Hkv, D];
    "BHSD": q/out [B, Hq, Sq, D], k/v [B, Hkv, Skv, D]), which runs it where Sq is 1 at run time.
    With ``additive_mask``, ``mask`` [MB, 1, 1, Skv] in ``dtype`` (MB = 1 or B) is added to the
    scaled scores. No causal mask: the caller takes it only where the one query sees every key.
    """
    if layout not in LAYOUTS:
        raise FuselightError(f"decode attention: layout {layout!r} unsupported (supported: {', '.join(LAYOUTS)})")
    heads = _heads(num_kv_heads, num_qo_heads, head_dim, dtype)
    kernels = _kernels(heads, config)
    H_qo, D, VEC = heads.qo, heads.dim, heads.vec
    bshd = layout == "BSHD"
    seq = SimpleNamespace(
        length=lambda io, b: T.Cast("int32", io.kv_len), max_length=lambda io: T.Cast("int32", io.kv_len),
        base=lambda io, b: T.int32(0), locate=lambda io, base, row: T.int32(0), load_row=_dense_row,
        bias=_dense_bias if additive_mask else None,
    )

    @T.macro
    def body(q, k, v, mask, mask_batch, out, batch, kv_len):
        # With one query row both layouts of q and out are [B, Hq, D] in memory.
        Q = T.decl_buffer((batch, H_qo, D), dtype, data=q.data)
        output = T.decl_buffer((batch, H_qo, D), dtype, data=out.data)
        B: T.let[T.int32] = T.Cast("int32", batch)
        O_part = T.alloc_buffer((B, H_qo, kernels.num_splits(B), D), "float32", scope="global")
        lse_part = T.alloc_buffer((B, H_qo, kernels.num_splits(B)), "float32", scope="global")
        kernels.split(
            SimpleNamespace(
                Q=Q, O_part=O_part, lse_part=lse_part, k=k, v=v, kv_len=kv_len, bshd=bshd, vec=VEC,
                mask=mask, mask_batch=mask_batch,
            ),
            B, seq, T.float32(sm_scale),
        )
        kernels.merge(SimpleNamespace(output=output, lse=None, O_part=O_part, lse_part=lse_part, kv_len=kv_len), B, seq)

    return body
