"""Row-reduction kernels: a ``RowReductionDesc`` written as CUDA-ready TIR over the analysed buffers.

``row_kernel``: one launch; each row is reduced by one warp (short rows, several rows a block) or
by one block. A thread loads its columns with 16-byte vector loads; where its share of the row fits
(``max_reg_elements``) it keeps it in registers, so the row is read from memory once and every
statistic and output is computed from registers. Statistics are accumulated in float32 (cast to
their own dtype once reduced) and combined by TVM's thread allreduce (warp shuffles, then a small
shared-memory tree across warps).

``split_softmax_kernels``: for few long rows of softmax shape (max, then sum of exp), where one
block per row would leave the GPU idle: each row is split over several blocks, each computing its
chunk's max and sum of exp in one pass (online rescaling), and a second launch merges the chunks'
statistics (every block of a row redundantly) and writes its chunk of the output.

Both bodies use the analysed function's buffers; bind them to its parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tvm import tirx
from tvm.tirx import stmt_functor

from fuselight.device import warp_size
from fuselight.errors import FuselightError
from tvm.script import tirx as T

from .. import arch_config
from ..arch_config import load_arch_config
from ..gemm.analysis import _row_indices
from .analysis import RowReductionDesc

_WARP = warp_size()
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
MAX_STATS = 3  # the kernels below are written out for at most this many statistics
MAX_OUTPUTS = 3  # and outputs


@dataclasses.dataclass(frozen=True)
class RowConfig:
    block_threads: int  # threads of a block that reduces one row
    warp_max_cols: int  # rows of at most this many columns are reduced by one warp
    warp_rows_per_block: int  # rows (warps) a block of the warp kernel serves
    max_reg_elements: int  # elements of the row a thread keeps in registers, all row inputs together
    load_bytes: int  # bytes of one vector load or store


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    split_threads: int  # threads of a block reducing a chunk of a row
    below_rows: int  # rows are split only when there are fewer than this many
    min_cols: int  # and they have at least this many columns
    target_blocks: int  # split until rows x splits reaches about this many blocks
    min_chunk: int  # columns a block gets at least
    max_splits: int  # splits of one row at most (bounds the workspace)


def load_row_config(arch: str) -> RowConfig:
    return load_arch_config("reduction", "rowwise", arch, RowConfig, "row", analytic=arch_config.rowwise)


def load_split_config(arch: str) -> SplitConfig:
    return load_arch_config("reduction", "rowwise", arch, SplitConfig, "split", analytic=arch_config.rowwise)


def _check(desc: RowReductionDesc) -> None:
    if len(desc.stats) > MAX_STATS or len(desc.outputs) > MAX_OUTPUTS:
        raise FuselightError(
            f"row reduction: {len(desc.stats)} statistics and {len(desc.outputs)} outputs; "
            f"the kernels take at most {MAX_STATS} and {MAX_OUTPUTS}"
        )


def vector_width(desc: RowReductionDesc, load_bytes: int) -> int:
    """Elements per vector access: ``load_bytes`` of the widest dtype, halved until it divides the row."""
    widest = max(_ITEMSIZE[str(b.dtype)] for b in (*desc.row_inputs, *desc.col_inputs, *(o.buffer for o in desc.outputs)))
    vec = max(1, load_bytes // widest)
    while desc.cols % vec:
        vec //= 2
    return vec


def use_split(desc: RowReductionDesc, split: SplitConfig) -> bool:
    """Whether ``desc``'s rows may be split over blocks (softmax-shaped and long enough)."""
    return desc.online_softmax and desc.cols >= split.min_cols


class RowAt:
    """Instantiates the description's expressions at one row of the kernel."""

    def __init__(self, desc: RowReductionDesc, row: Any) -> None:
        self.desc = desc
        self.dtype = str(desc.col_var.ty)
        # flat row -> leading indices in int64, each then in its own dtype
        lead = [tirx.IntImm("int64", int(e)) if isinstance(e, tirx.IntImm) else _cast("int64", e) for e in desc.lead_shape]
        self.row_index = [_cast(str(v.ty), i) for v, i in zip(desc.row_vars, _row_indices(row, lead, "int64"))]

    def col(self, col: Any) -> Any:
        return _cast(self.dtype, col)

    def index(self, col: Any) -> list[Any]:
        return [*self.row_index, self.col(col)]

    def expr(self, expr: Any, col: Any, regs: list[Any], cregs: list[Any], slot: Any, stats: list[Any]) -> Any:
        """``expr`` at column ``col``: row inputs read from ``regs[k][slot]``, column inputs from
        ``cregs[k][slot]``, statistic j from ``stats[j][0]``."""
        desc = self.desc
        sub = dict(zip(desc.row_vars, self.row_index))
        sub[desc.col_var] = self.col(col)
        for s, buf in zip(desc.stats, stats):
            sub[s.var] = tirx.BufferLoad(buf, [0])
        expr = stmt_functor.substitute(expr, sub)
        pairs = list(zip(desc.row_inputs, regs)) + list(zip(desc.col_inputs, cregs))

        def post(node: Any) -> Any:
            reg = next((r for b, r in pairs if node.buffer.same_as(b)), None)
            return None if reg is None else tirx.BufferLoad(reg, [slot])

        return stmt_functor.ir_transform(tirx.Evaluate(expr), None, post, ["tirx.BufferLoad"]).value


def _cast(dtype: str, expr: Any) -> Any:
    return expr if str(expr.ty) == dtype else tirx.Cast(dtype, expr)


def _as_list(index: Any) -> list[Any]:
    return index if isinstance(index, list) else [index]


def _f32(expr: Any) -> Any:
    return expr if str(expr.ty) == "float32" else tirx.Cast("float32", expr)


def _combine(reducer: str, acc: Any, value: Any) -> Any:
    return tirx.Max(acc, value) if reducer == "max" else acc + value


def _locals(buffers: Any, size: int) -> list[Any]:
    """Per-thread registers: one ``size``-element buffer per buffer of ``buffers`` (inside an sblock)."""
    return [T.sblock_alloc_buffer((size,), str(b.dtype), scope="local") for b in buffers]


def _stat_locals(desc: RowReductionDesc) -> list[Any]:
    return [T.sblock_alloc_buffer((1,), s.dtype, scope="local") for s in desc.stats]


def _macros(desc: RowReductionDesc, vec: int):
    """Macros shared by the kernels: vector loads of a row's columns, one reduction across threads,
    and the outputs at one vector of columns."""
    def load(at, col0, regs, cregs, base):
        # regs[k][base + e] = row input k at (row, col0 + e); cregs likewise for column inputs
        for inputs, dest, index in ((desc.row_inputs, regs, at.index), (desc.col_inputs, cregs, at.col)):
            for buf, reg in zip(inputs, dest):
                with T.vectorized(vec) as e:
                    T.buffer_store(reg, tirx.BufferLoad(buf, _as_list(index(col0 + e))), [base + e])

    @T.macro
    def allreduce(reducer, value, result, tx):
        with T.sblock("allreduce"):
            T.reads(value[0])
            T.writes(result[0])
            if reducer == "max":
                T.attr(T.comm_reducer(lambda a, b: T.max(a, b), [T.min_value("float32")]), "reduce_scope", T.int32(0))
            else:
                T.attr(T.comm_reducer(lambda a, b: a + b, [T.float32(0)]), "reduce_scope", T.int32(0))
            T.tvm_thread_allreduce(T.uint32(1), value[0], True, result[0], tx, dtype="void")

    def write(at, col0, regs, cregs, base, stats, staged):
        # each output computed into registers, stored as one vector
        for out, reg in zip(desc.outputs, staged):
            with T.unroll(vec) as e:
                T.buffer_store(reg, at.expr(out.value, col0 + e, regs, cregs, base + e, stats), [e])
            with T.vectorized(vec) as e:
                T.buffer_store(out.buffer, tirx.BufferLoad(reg, [e]), at.index(col0 + e))

    return load, allreduce, write


def row_kernel(desc: RowReductionDesc, cfg: RowConfig) -> Any:
    """One launch, a warp or a block per row (see the module docstring): a ``tvm.tirx.Stmt``."""
    _check(desc)
    vec = vector_width(desc, cfg.load_bytes)
    cols, rows = desc.cols, desc.rows
    vectors = cols // vec
    if cols <= cfg.warp_max_cols:
        group, per_block = _WARP, cfg.warp_rows_per_block
    else:
        group, per_block = min(cfg.block_threads, -(-vectors // _WARP) * _WARP), 1
    steps = -(-vectors // group)
    exact = vectors % group == 0
    in_regs = steps * vec * len(desc.row_inputs) <= cfg.max_reg_elements
    slots = steps * vec if in_regs else vec
    load, allreduce, write = _macros(desc, vec)
    stats_desc = desc.stats

    def col0(i, tx):
        return (i * group + tx) * vec

    def slot0(i):
        return i * vec if in_regs else 0

    @T.macro
    def statistic(j, at, regs, cregs, stats, part, reds, tx):
        s = T.meta_var(stats_desc[j])
        part[0] = _f32(s.init)
        for i in T.unroll(steps) if in_regs else T.serial(steps):
            if exact or col0(i, tx) < cols:
                if not in_regs:
                    load(at, col0(i, tx), regs, cregs, 0)
                for e in T.unroll(vec):
                    part[0] = _combine(s.reducer, part[0], _f32(at.expr(s.element, col0(i, tx) + e, regs, cregs, slot0(i) + e, stats)))
        allreduce(s.reducer, part, reds[j], tx)
        stats[j][0] = T.Cast(s.dtype, reds[j][0])

    @T.macro
    def each_statistic(at, regs, cregs, stats, part, reds, tx):
        # in order: a statistic may use the ones before it
        if len(stats_desc) > 0:
            statistic(0, at, regs, cregs, stats, part, reds, tx)
        if len(stats_desc) > 1:
            statistic(1, at, regs, cregs, stats, part, reds, tx)
        if len(stats_desc) > 2:
            statistic(2, at, regs, cregs, stats, part, reds, tx)

    # fmt: off
    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        for bx in T.thread_binding((rows + per_block - 1) // per_block, thread="blockIdx.x"):
            for ty in T.thread_binding(per_block, thread="threadIdx.y"):
                for tx in T.thread_binding(group, thread="threadIdx.x"):
                    with T.sblock("row_reduction"):
                        T.reads()
                        T.writes()
                        regs = _locals(desc.row_inputs, slots)
                        cregs = _locals(desc.col_inputs, slots)
                        staged = _locals([o.buffer for o in desc.outputs], vec)
                        stats = _stat_locals(desc)
                        part = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        # one result register per allreduce: TVM's lowering gives each its own
                        reds = _locals([part] * len(stats_desc), 1)
                        row: T.let[rows.ty] = T.Cast(rows.ty, bx * per_block + ty)
                        # Rows past the end (warp kernel) reduce the last row again: every thread
                        # joins every allreduce; only the stores are guarded.
                        at = T.meta_var(RowAt(desc, T.min(row, rows - 1)))
                        if in_regs:
                            for i in T.unroll(steps):
                                if exact or col0(i, tx) < cols:
                                    load(at, col0(i, tx), regs, cregs, i * vec)
                        each_statistic(at, regs, cregs, stats, part, reds, tx)
                        if row < rows:
                            for i in T.unroll(steps) if in_regs else T.serial(steps):
                                if exact or col0(i, tx) < cols:
                                    if not in_regs:
                                        load(at, col0(i, tx), regs, cregs, 0)
                                    write(at, col0(i, tx), regs, cregs, slot0(i), stats, staged)
    # fmt: on
    return body.body


def split_softmax_kernels(desc: RowReductionDesc, cfg: SplitConfig, load_bytes: int) -> Any:
    """Two launches, each row split over blocks (see the module docstring): a ``tvm.tirx.Stmt``."""
    _check(desc)
    if not desc.online_softmax:
        raise FuselightError("row reduction: only softmax-shaped rows (max, then sum of exp) can be split")
    vec = vector_width(desc, load_bytes)
    cols, rows = desc.cols, desc.rows
    threads = cfg.split_threads
    load, allreduce, write = _macros(desc, vec)
    m_stat, s_stat = desc.stats
    idx = rows.ty

    def splits():
        by_rows = (T.int64(cfg.target_blocks) + rows - 1) // rows
        return T.max(T.min(T.min(by_rows, -(-cols // cfg.min_chunk)), cfg.max_splits), 1)

    def chunk():
        return ((cols + splits() - 1) // splits() + vec - 1) // vec * vec

    def steps():
        return (chunk() + threads * vec - 1) // (threads * vec)

    # fmt: off
    @T.macro
    def blocks(kernel, ws):
        for bx in T.thread_binding(rows * splits(), thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock(kernel):
                    T.reads()
                    T.writes()
                    regs = _locals(desc.row_inputs, vec)
                    cregs = _locals(desc.col_inputs, vec)
                    staged = _locals([o.buffer for o in desc.outputs], vec)
                    stats = _stat_locals(desc)
                    val = T.sblock_alloc_buffer((vec,), "float32", scope="local")
                    m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    s = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    mx = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    red = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    red_s = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    # block indices are non-negative: truncating division, no sign fix-ups
                    nsp: T.let[T.int32] = T.Cast("int32", splits())
                    b: T.let[T.int32] = T.Cast("int32", bx)
                    row: T.let[idx] = T.Cast(idx, T.truncdiv(b, nsp))
                    sp: T.let[T.int32] = T.truncmod(b, nsp)
                    begin: T.let[T.int32] = sp * T.Cast("int32", chunk())
                    end: T.let[T.int32] = T.min(begin + T.Cast("int32", chunk()), cols)
                    at = T.meta_var(RowAt(desc, row))
                    if kernel == "split_stats":
                        # this chunk's max and sum of exp(e - max), in one pass
                        m[0] = _f32(m_stat.init)
                        s[0] = T.float32(0)
                        for it in T.serial(T.Cast("int32", steps())):
                            if begin + (it * threads + tx) * vec < end:
                                load(at, begin + (it * threads + tx) * vec, regs, cregs, 0)
                                for e in T.unroll(vec):
                                    val[e] = _f32(at.expr(m_stat.element, begin + (it * threads + tx) * vec + e, regs, cregs, e, stats))
                                mx[0] = m[0]
                                for e in T.unroll(vec):
                                    mx[0] = T.max(mx[0], val[e])
                                s[0] = s[0] * T.exp(m[0] - mx[0])
                                for e in T.unroll(vec):
                                    s[0] = s[0] + T.exp(val[e] - mx[0])
                                m[0] = mx[0]
                        allreduce("max", m, red, tx)
                        s[0] = s[0] * T.exp(m[0] - red[0])
                        m[0] = red[0]
                        allreduce("sum", s, red_s, tx)
                        if tx == 0:
                            ws[(row * cfg.max_splits + sp) * 2] = m[0]
                            ws[(row * cfg.max_splits + sp) * 2 + 1] = red_s[0]
                    else:
                        # the row's max and sum from its chunks', then this chunk of the output
                        m[0] = _f32(m_stat.init)
                        for k in T.serial(nsp):
                            m[0] = T.max(m[0], ws[(row * cfg.max_splits + k) * 2])
                        s[0] = T.float32(0)
                        for k in T.serial(nsp):
                            s[0] = s[0] + ws[(row * cfg.max_splits + k) * 2 + 1] * T.exp(ws[(row * cfg.max_splits + k) * 2] - m[0])
                        stats[0][0] = T.Cast(m_stat.dtype, m[0])
                        stats[1][0] = T.Cast(s_stat.dtype, s[0])
                        for it in T.serial(T.Cast("int32", steps())):
                            if begin + (it * threads + tx) * vec < end:
                                load(at, begin + (it * threads + tx) * vec, regs, cregs, 0)
                                write(at, begin + (it * threads + tx) * vec, regs, cregs, 0, stats, staged)

    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        ws = T.alloc_buffer((rows * cfg.max_splits * 2,), "float32", scope="global")
        blocks("split_stats", ws)
        blocks("split_write", ws)
    # fmt: on
    return body.body
