"""Recognise a row reduction: statistics of each row of a [rows, cols] tensor, then an elementwise
function of the row, the statistics and per-column inputs. The RowReduction rule's analysis.

The functions FuseTIR leaves for RMSNorm, add+RMSNorm or softmax are perfect loop nests over one
block each, of three shapes (``l...`` the leading indices, folded into rows; ``c`` the column)::

    E[l..., c] = f(X[l..., c], W[c], S[l...], ...)           (elementwise over the row)
    S[l...]    = reduce_c f(X[l..., c], ...)                  (sum or max along the last axis)
    V[l...] = g(S[l...])   /   V[c] = h(W[c])                 (per row / per column)

``analyze_row_reduction`` composes them into expressions of canonical loads (``X[l..., c]``,
``W[c]``) and statistic variables: the statistics in order (each with its reducer and the element
expression reduced), and each output as an expression. Intermediates vanish; an output read by a
later stage (add+RMSNorm's sum) is read as its expression. ``cols`` must be static, the rows may be
symbolic. Anything else (a reduction along another axis, several reduction axes, transposed or
shifted accesses, strided buffers, a statistic written out) gives None.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tvm
from tvm import arith, tirx
from tvm.tirx import stmt_functor
from tvm_ffi import structural_equal

from ..stages import stages as _stages

_DATA_PAR, _COMM_REDUCE = 0, 2  # tirx.IterVar kinds
DTYPES = ("float16", "bfloat16", "float32")
REDUCERS = ("sum", "max")


@dataclasses.dataclass(frozen=True)
class RowStat:
    """One statistic of a row: ``var = reducer over c of element``, starting from ``init``."""

    reducer: str  # one of REDUCERS
    dtype: str
    init: Any  # PrimExpr (a constant)
    element: Any  # PrimExpr of row loads, column loads and earlier statistics
    var: Any  # tirx.Var standing for the statistic in later expressions


@dataclasses.dataclass(frozen=True)
class RowOutput:
    buffer: Any  # tirx.Buffer, shaped like the rows: [*lead_shape, cols]
    value: Any  # PrimExpr in buffer.dtype, of row loads, column loads and statistics


@dataclasses.dataclass(frozen=True)
class RowReductionDesc:
    """A row reduction as recognised (see the module docstring).

    Loads in ``stats``/``outputs`` index row inputs as ``[*row_vars, col_var]`` and column inputs
    as ``[col_var]``; a template substitutes the row it works on and the column.
    """

    kind: str  # "rms_norm", "add_rms_norm", "softmax" or "row_reduction"
    lead_shape: tuple[Any, ...]  # the leading dims, folded into rows
    rows: Any  # PrimExpr: their product
    cols: int
    row_vars: tuple[Any, ...]
    col_var: Any
    row_inputs: tuple[Any, ...]  # buffers read per element, shaped [*lead_shape, cols]
    col_inputs: tuple[Any, ...]  # buffers read per column, shaped [cols]
    stats: tuple[RowStat, ...]
    outputs: tuple[RowOutput, ...]
    online_softmax: bool  # stats are max(e) then sum(exp(e - max)): rows can be split and merged

    @property
    def rows_static(self) -> int | None:
        return int(self.rows) if isinstance(self.rows, tirx.IntImm) else None


def _dtype(expr: Any) -> str:
    return str(expr.ty)


def _equal(a: Any, b: Any) -> bool:
    return bool(arith.Analyzer().can_prove_equal(a, b))


def _same(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def _is_vars(indices: Any, vars_: Any) -> bool:
    return len(indices) == len(vars_) and all(i.same_as(v) for i, v in zip(indices, vars_))


def _plain(buffer: Any) -> bool:
    return not buffer.strides and isinstance(buffer.elem_offset, tirx.IntImm) and int(buffer.elem_offset) == 0


def _reducer(value: Any, acc: tirx.BufferLoad) -> tuple[str, Any] | None:
    """(reducer, element) of ``acc combine element`` (either operand order)."""
    for cls, name in ((tirx.Add, "sum"), (tirx.Max, "max")):
        if isinstance(value, cls):
            for a, b in ((value.a, value.b), (value.b, value.a)):
                if isinstance(a, tirx.BufferLoad) and a.buffer.same_as(acc.buffer) and _is_vars(a.indices, acc.indices):
                    return name, b
    return None


def _loads(expr: Any) -> list[tirx.BufferLoad]:
    found: list[tirx.BufferLoad] = []
    stmt_functor.post_order_visit(expr, lambda n: found.append(n) if isinstance(n, tirx.BufferLoad) else None)
    return found


def _strip_casts(expr: Any) -> Any:
    while isinstance(expr, tirx.Cast):
        expr = expr.value
    return expr


class _Composer:
    """Walks the stages, composing each stored value into canonical form."""

    def __init__(self, lead: tuple[Any, ...], cols: int, params: list[Any], index_dtypes: list[str]) -> None:
        self.lead, self.cols = lead, cols
        self.row_vars = tuple(tirx.Var(f"l{i}", index_dtypes[i]) for i in range(len(lead)))
        self.col_var = tirx.Var("c", index_dtypes[-1])
        self.params = params
        self.defs: dict[Any, tuple[str, Any]] = {}  # buffer -> (shape kind, canonical expression)
        self.row_inputs: list[Any] = []
        self.col_inputs: list[Any] = []
        self.stats: list[RowStat] = []
        self.outputs: list[RowOutput] = []

    def kinds_of(self, shape: Any) -> list[str]:
        """The stage shapes ``shape`` can be (a row's and a column's may coincide)."""
        shapes = {"elem": [*self.lead, self.cols], "row": list(self.lead), "col": [self.cols]}
        return [k for k, s in shapes.items() if _same(shape, s)]

    def canonical(self, kind: str) -> list[Any]:
        return {"elem": [*self.row_vars, self.col_var], "row": list(self.row_vars), "col": [self.col_var]}[kind]

    def load_kind(self, load: tirx.BufferLoad) -> str | None:
        return next((k for k in ("elem", "row", "col") if _is_vars(load.indices, self.canonical(k))), None)

    def is_param(self, buffer: Any) -> bool:
        return any(buffer.same_as(p) for p in self.params)

    def compose(self, expr: Any, block_vars: list[Any], kind: str) -> Any | None:
        """``expr`` (over ``block_vars``, a ``kind``-shaped stage) in canonical form, or None."""
        canonical = self.canonical(kind)
        if any(_dtype(a) != _dtype(b) for a, b in zip(block_vars, canonical)):
            return None
        expr = stmt_functor.substitute(expr, dict(zip(block_vars, canonical)))
        replace: list[tuple[Any, Any]] = []  # (buffer, its canonical expression)
        for load in _loads(expr):
            known = next((d for b, d in self.defs.items() if b.same_as(load.buffer)), None)
            load_kind = self.load_kind(load)
            if load_kind is None or (known is not None and known[0] != load_kind):
                return None
            if known is None and load_kind not in self.kinds_of(load.buffer.shape):
                return None
            if kind != "elem" and load_kind != kind:
                return None  # a per-row value of columns or a per-column value of rows
            if known is not None:
                replace.append((load.buffer, known[1]))
                continue
            if not self.is_param(load.buffer) or load_kind == "row" or not _plain(load.buffer):
                return None  # an intermediate read before it is written, or a per-row input
            group = self.row_inputs if load_kind == "elem" else self.col_inputs
            if not any(load.buffer.same_as(b) for b in group):
                group.append(load.buffer)
        if not replace:
            return expr

        def post(node: Any) -> Any:
            # every load of a defined buffer was checked to be at the canonical indices
            return next((v for b, v in replace if node.buffer.same_as(b)), None)

        return stmt_functor.ir_transform(tirx.Evaluate(expr), None, post, ["tirx.BufferLoad"]).value

    def define(self, buffer: Any, kind: str, value: Any) -> None:
        self.defs[buffer] = (kind, value)


def _classify(stats: list[RowStat], outputs: list[RowOutput], row_inputs: list[Any]) -> tuple[str, bool]:
    online = (
        len(stats) == 2
        and stats[0].reducer == "max"
        and stats[1].reducer == "sum"
        and isinstance(_strip_casts(stats[1].element), tvm.ir.Call)
        and _strip_casts(stats[1].element).op.name == "tirx.exp"
        and isinstance(_strip_casts(stats[1].element).args[0], tirx.Sub)
        and _same_expr(_strip_casts(stats[1].element).args[0].a, stats[0].element)
        and _strip_casts(stats[1].element).args[0].b.same_as(stats[0].var)
    )
    if online and len(outputs) == 1:
        return "softmax", True
    square = (
        len(stats) == 1
        and stats[0].reducer == "sum"
        and isinstance(stats[0].element, tirx.Mul)
        and _same_expr(stats[0].element.a, stats[0].element.b)
    )
    if square and len(outputs) == 1:
        return "rms_norm", online
    sums = [o for o in outputs if isinstance(o.value, tirx.Add) and all(
        isinstance(_strip_casts(x), tirx.BufferLoad) and any(_strip_casts(x).buffer.same_as(b) for b in row_inputs)
        for x in (o.value.a, o.value.b))]
    if square and len(outputs) == 2 and len(sums) == 1:
        return "add_rms_norm", online
    return "row_reduction", online


def _same_expr(a: Any, b: Any) -> bool:
    return bool(structural_equal(a, b, map_free_vars=False))


def analyze_row_reduction(func: tirx.PrimFunc) -> RowReductionDesc | None:
    """The row reduction ``func`` computes, or None (see the module docstring)."""
    found = _stages(func)
    if found is None:
        return None
    stages, allocs = found
    reductions = [s for s in stages if any(int(iv.iter_type) == _COMM_REDUCE for iv in s.block.iter_vars)]
    if not reductions or len(stages) < 2:
        return None
    first = reductions[0]
    if int(first.block.iter_vars[-1].iter_type) != _COMM_REDUCE:
        return None
    lead, cols = tuple(first.extents[:-1]), first.extents[-1]
    if not lead or not isinstance(cols, tirx.IntImm):
        return None  # the column count must be known when compiling
    cols = int(cols)
    params = list(func.params)
    comp = _Composer(lead, cols, params, [_dtype(iv.var) for iv in first.block.iter_vars])
    for stage in stages:
        block, store = stage.block, stage.store
        kinds = [int(iv.iter_type) for iv in block.iter_vars]
        vars_ = [iv.var for iv in block.iter_vars]
        if any(k not in (_DATA_PAR, _COMM_REDUCE) for k in kinds):
            return None
        if _COMM_REDUCE in kinds:
            # S[l...] = S[l...] (+|max) element(l..., c): reduced along the last axis only
            if kinds != [_DATA_PAR] * len(lead) + [_COMM_REDUCE] or not _same(stage.extents, [*lead, cols]):
                return None
            if comp.is_param(store.buffer) or not _is_vars(store.indices, vars_[:-1]):
                return None
            init = block.init
            if not (
                isinstance(init, tirx.BufferStore)
                and init.buffer.same_as(store.buffer)
                and _is_vars(init.indices, vars_[:-1])
                and isinstance(init.value, (tirx.FloatImm, tirx.IntImm))
            ):
                return None
            red = _reducer(store.value, tirx.BufferLoad(store.buffer, store.indices))
            if red is None or str(store.buffer.dtype) not in DTYPES:
                return None
            element = comp.compose(red[1], vars_, "elem")
            if element is None:
                return None
            var = tirx.Var(f"s{len(comp.stats)}", str(store.buffer.dtype))
            comp.stats.append(RowStat(red[0], str(store.buffer.dtype), init.value, element, var))
            comp.define(store.buffer, "row", var)
            continue
        if block.init is not None:
            return None
        if not _is_vars(store.indices, vars_) or not _same(store.buffer.shape, stage.extents):
            return None
        if any(store.buffer.same_as(b) for b in comp.defs):
            return None  # written twice
        composed = ((k, comp.compose(store.value, vars_, k)) for k in comp.kinds_of(stage.extents))
        kind, value = next(((k, v) for k, v in composed if v is not None), (None, None))
        if value is None:
            return None
        if comp.is_param(store.buffer):
            if kind != "elem" or not _plain(store.buffer) or str(store.buffer.dtype) not in DTYPES:
                return None  # only whole rows are written out
            if any(store.buffer.same_as(b) for b in (*comp.row_inputs, *comp.col_inputs)):
                return None  # read before written
            comp.outputs.append(RowOutput(store.buffer, value))
        elif not any(store.buffer.same_as(a) for a in allocs):
            return None
        comp.define(store.buffer, kind, value)
    if not comp.outputs or not comp.row_inputs:
        return None
    if any(str(b.dtype) not in DTYPES for b in (*comp.row_inputs, *comp.col_inputs)):
        return None
    if any(not any(_uses(o.value, s.var) for o in comp.outputs) and not any(
            _uses(t.element, s.var) for t in comp.stats) for s in comp.stats):
        return None  # a statistic nothing uses: not a row reduction feeding its row
    rows: Any = tirx.IntImm("int64", 1)
    for e in lead:
        rows = rows * (e if _dtype(e) == "int64" else tirx.Cast("int64", e))
    rows = arith.Analyzer().simplify(rows)
    kind, online = _classify(comp.stats, comp.outputs, comp.row_inputs)
    return RowReductionDesc(
        kind=kind,
        lead_shape=lead,
        rows=rows,
        cols=cols,
        row_vars=comp.row_vars,
        col_var=comp.col_var,
        row_inputs=tuple(comp.row_inputs),
        col_inputs=tuple(comp.col_inputs),
        stats=tuple(comp.stats),
        outputs=tuple(comp.outputs),
        online_softmax=online,
    )


def _uses(expr: Any, var: Any) -> bool:
    found = []
    stmt_functor.post_order_visit(expr, lambda n: found.append(n) if n.same_as(var) else None)
    return bool(found)
