"""Recognise a matmul PrimFunc with its fused elementwise epilogue: the Matmul rule's analysis.

The functions FuseTIR leaves for a linear layer are a reduction stage followed by elementwise
stages, each a perfect loop nest over one block::

    C[v..., vn] += cast(A[v..., vk]) * cast(B[vn, vk])        (or B[vk, vn])
    E1[v..., vn] = f1(C[v..., vn], params...)
    ...
    Out[v..., vn] = fk(E{k-1}[v..., vn], params...)

``analyze_matmul`` returns the GEMM (A's leading dimensions folded into M, B a 2-D weight, N and K
static) and the epilogue as one expression of the fp32 accumulator, composed through the chain, so
a template can write ``Out`` directly and the intermediates vanish. One stage of the chain may be
"paired" (a gated MLP's ``silu(gate) * up``, ``passes.fuse_gate_up_silu``): over N / 2 columns, it
reads its input at ``[v..., vn]`` and ``[v..., vn + N / 2]``; the epilogue then takes both
accumulators (``operands.Epilogue.pair_offset``). Anything else (another stage shape, an
intermediate read twice or by a later stage, other offsets, strided buffers, other dtypes) gives None.

With ``prologue=True`` the matmul may also be preceded by the stages of an RMSNorm of its A (TOPI's
``rms_norm``, with or without a residual ``add`` written out first, as ``passes.fuse_norm_gemv``
writes them): A is then that intermediate, described by ``operands.NormPrologue``. Only callers whose
template computes the prologue ask for it; for the others such a function is not a matmul (None).
With ``dequant=True`` B may be computed by a group dequantize (``dequant.analyze_dequant``), whose
stages come right before the matmul (after the norm's, where there is both).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tvm
from tvm import arith, tirx
from tvm.tirx import stmt_functor
from tvm_ffi import structural_equal

from ..reduce.analysis import analyze_row_reduction
from ..stages import Stage as _Stage
from ..stages import stages as _stages
from .dequant import analyze_dequant
from .operands import DTYPES, Epilogue, GemmOperands, NormPrologue

_DATA_PAR, _COMM_REDUCE = 0, 2  # tirx.IterVar kinds


@dataclasses.dataclass(frozen=True)
class MatmulDesc:
    """A matmul function as recognised."""

    operands: GemmOperands
    out_dtype: str
    epilogue_stages: tuple[str, ...]  # names of the elementwise blocks folded into the epilogue
    m_static: int | None  # M when known at compile time


def _dtype(expr: Any) -> str:
    return str(expr.ty)


def _is_const(expr: Any, value: int) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr.value) == value


def _equal(a: Any, b: Any) -> bool:
    return bool(arith.Analyzer().can_prove_equal(a, b))


def _strip_cast(expr: Any, dtype: str) -> Any:
    if isinstance(expr, tirx.Cast) and _dtype(expr) == dtype:
        return expr.value
    return expr


def _same_vars(indices: Any, vars_: list[tirx.Var]) -> bool:
    return len(indices) == len(vars_) and all(i.same_as(v) for i, v in zip(indices, vars_))


def _plain(buffer: tirx.Buffer) -> bool:
    return not buffer.strides and _is_const(buffer.elem_offset, 0)


def _matmul(stage: _Stage) -> tuple[tirx.Buffer, tirx.Buffer, tirx.Buffer, str] | None:
    """(A, B, C, b_layout) of a ``C[v..., vn] += A[v..., vk] * B[vn, vk]`` stage (or B[vk, vn])."""
    block, store = stage.block, stage.store
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    if kinds.count(_COMM_REDUCE) != 1 or kinds[-1] != _COMM_REDUCE or any(
        k not in (_DATA_PAR, _COMM_REDUCE) for k in kinds
    ):
        return None
    spatial = [iv.var for iv in block.iter_vars[:-1]]
    vk = block.iter_vars[-1].var
    c = store.buffer
    init = block.init
    if not (
        isinstance(init, tirx.BufferStore)
        and init.buffer.same_as(c)
        and _same_vars(init.indices, spatial)
        and isinstance(init.value, tirx.FloatImm)
        and float(init.value.value) == 0.0
    ):
        return None
    value = store.value
    if not (
        _same_vars(store.indices, spatial)
        and isinstance(value, tirx.Add)
        and isinstance(value.a, tirx.BufferLoad)
        and value.a.buffer.same_as(c)
        and _same_vars(value.a.indices, spatial)
        and isinstance(value.b, tirx.Mul)
    ):
        return None
    acc = str(c.dtype)
    x, y = _strip_cast(value.b.a, acc), _strip_cast(value.b.b, acc)
    if not (isinstance(x, tirx.BufferLoad) and isinstance(y, tirx.BufferLoad)):
        return None
    rows, vn = spatial[:-1], spatial[-1]
    for a, b in ((x, y), (y, x)):
        if not _same_vars(a.indices, [*rows, vk]) or len(b.indices) != 2:
            continue
        if _same_vars(b.indices, [vn, vk]):
            return a.buffer, b.buffer, c, "NT"
        if _same_vars(b.indices, [vk, vn]):
            return a.buffer, b.buffer, c, "NN"
    return None


def _paired_load(load: tirx.BufferLoad, vars_: list[tirx.Var], offset: int) -> bool:
    """Whether ``load`` reads ``[v..., vn + offset]``."""
    if len(load.indices) != len(vars_) or not _same_vars(load.indices[:-1], vars_[:-1]):
        return False
    diff = arith.Analyzer().simplify(load.indices[-1] - vars_[-1])
    return _is_const(diff, offset)


def _elementwise(
    stage: _Stage, prev: tirx.Buffer, older: list[tirx.Buffer], extents: tuple[Any, ...],
    pair_offset: int | None = None,
) -> bool:
    """Whether ``stage`` is ``Out[v...] = f(prev[v...], ...)`` over ``extents``, reading none of the
    ``older`` intermediates (the chain writes only its last stage's output). With ``pair_offset``:
    ``f(prev[v...], prev[v..., vn + pair_offset], ...)``, reading both."""
    block, store = stage.block, stage.store
    if block.init is not None or any(int(iv.iter_type) != _DATA_PAR for iv in block.iter_vars):
        return False
    vars_ = [iv.var for iv in block.iter_vars]
    if len(stage.extents) != len(extents) or not all(_equal(a, b) for a, b in zip(stage.extents, extents)):
        return False
    if not _same_vars(store.indices, vars_) or store.buffer.same_as(prev):
        return False
    loads: list[tirx.BufferLoad] = []
    stmt_functor.post_order_visit(
        store.value, lambda n: loads.append(n) if isinstance(n, tirx.BufferLoad) else None
    )
    reads_prev = reads_pair = False
    for load in loads:
        if load.buffer.same_as(store.buffer) or any(load.buffer.same_as(o) for o in older):
            return False
        if load.buffer.same_as(prev):
            if _same_vars(load.indices, vars_):
                reads_prev = True
            elif pair_offset is not None and _paired_load(load, vars_, pair_offset):
                reads_pair = True
            else:
                return False
    return reads_prev and (pair_offset is None or reads_pair)


def _replace_loads(expr: Any, buffer: tirx.Buffer, value: Any, vn: Any = None, paired: Any = None) -> Any:
    """``expr`` with its loads of ``buffer`` replaced by ``value``; with ``paired``, those whose last
    index is not ``vn`` (the paired column) by ``paired``."""

    def post(node: Any) -> Any:
        if isinstance(node, tirx.BufferLoad) and node.buffer.same_as(buffer):
            return value if paired is None or node.indices[-1].same_as(vn) else paired
        return None

    return stmt_functor.ir_transform(tirx.Evaluate(expr), None, post, ["tirx.BufferLoad"]).value


def _row_indices(row: Any, extents: tuple[Any, ...], dtype: str) -> list[Any]:
    """Indices over ``extents`` of flat row ``row < prod(extents)`` (row-major), in ``dtype``."""
    row = tirx.Cast(dtype, row) if _dtype(row) != dtype else row
    outer = next((i for i, e in enumerate(extents) if not _is_const(e, 1)), len(extents))
    out: list[Any] = []
    stride: Any = tirx.IntImm(dtype, 1)
    for i in reversed(range(len(extents))):
        e = extents[i]
        q = row if _is_const(stride, 1) else tirx.floordiv(row, stride)
        if _is_const(e, 1):
            out.append(tirx.IntImm(dtype, 0))
        else:
            # The outermost non-unit index needs no wrap: rows stay below the product.
            out.append(q if i == outer else tirx.floormod(q, e))
        stride = stride * e
    return out[::-1]


def _norm_prologue(func: tirx.PrimFunc, count: int, allocs: list[tirx.Buffer], a: tirx.Buffer) -> NormPrologue | None:
    """The RMSNorm (with its residual add) the first ``count`` stages of ``func`` compute into the
    intermediate ``a``, exactly as TOPI writes them, or None."""

    if not any(a.same_as(b) for b in allocs):
        return None
    root = func.body.block
    stmts = list(root.body.seq)[:count]
    others = [b for b in allocs if not b.same_as(a)]
    sub = tirx.PrimFunc(
        [*func.params, a],
        tirx.SBlockRealize([], True, tirx.SBlock([], [], [], "root", tirx.SeqStmt(stmts), None, others)),
    )
    desc = analyze_row_reduction(sub)
    if desc is None or desc.kind not in ("rms_norm", "add_rms_norm") or len(desc.col_inputs) != 1:
        return None
    if len(desc.row_inputs) > 2:
        return None
    dtype = str(a.dtype)
    x, residual = desc.row_inputs[0], desc.row_inputs[1] if len(desc.row_inputs) == 2 else None
    weight = desc.col_inputs[0]
    normed = [o for o in desc.outputs if o.buffer.same_as(a)]
    totals = [o for o in desc.outputs if not o.buffer.same_as(a)]
    if len(normed) != 1 or len(totals) != (residual is not None):
        return None
    # The stream (x + r, written out) in the activation dtype, or in float32 (``residual_stream_fp32``):
    # then x is float32 or, entering the stream, of the activation dtype.
    stream = str(totals[0].buffer.dtype) if totals else dtype
    if stream not in (dtype, "float32") or str(x.dtype) not in (dtype, stream):
        return None
    if any(str(buf.dtype) != dtype for buf in (weight, *([] if residual is None else [residual]))):
        return None
    if not all(_plain(buf) for buf in (x, weight, *(o.buffer for o in totals), *([] if residual is None else [residual]))):
        return None
    if not all(_equal(s, e) for s, e in zip(x.shape, a.shape)) or len(x.shape) != len(a.shape):
        return None
    index = [*desc.row_vars, desc.col_var]

    def load(buf: tirx.Buffer) -> Any:
        """``buf``'s element, read in the stream's dtype."""
        value = tirx.BufferLoad(buf, index)
        return value if str(buf.dtype) == stream else tirx.Cast(stream, value)

    t = load(x)
    if residual is not None:
        t = t + load(residual)
        if not structural_equal(totals[0].value, t, map_free_vars=False):
            return None
    t32 = t if stream == "float32" else tirx.Cast("float32", t)
    stat = desc.stats[0]
    if not (stat.reducer == "sum" and float(stat.init.value) == 0.0 and structural_equal(stat.element, t32 * t32)):
        return None
    # out = cast(rsqrt(s / cols + eps) * float32(t) * float32(weight[c])): find eps, then compare the whole.
    value = normed[0].value
    scale = value.value.a if isinstance(value, tirx.Cast) and isinstance(value.value, tirx.Mul) else None
    rsqrt = scale.a if isinstance(scale, tirx.Mul) else None
    if not (isinstance(rsqrt, tvm.ir.Call) and rsqrt.op.name == "tirx.rsqrt" and isinstance(rsqrt.args[0], tirx.Add)):
        return None
    eps = rsqrt.args[0].b
    if not isinstance(eps, tirx.FloatImm) or _dtype(eps) != "float32":
        return None
    rstd = tirx.rsqrt(stat.var / tirx.FloatImm("float32", float(desc.cols)) + eps)
    expected = tirx.Cast(dtype, rstd * t32 * tirx.Cast("float32", tirx.BufferLoad(weight, [desc.col_var])))
    if not structural_equal(value, expected, map_free_vars=False):
        return None
    return NormPrologue(x=x, residual=residual, weight=weight, eps=float(eps.value),
                        total=totals[0].buffer if totals else None)


def analyze_matmul(func: tirx.PrimFunc, prologue: bool = False, dequant: bool = False) -> MatmulDesc | None:
    """The GEMM and fused epilogue ``func`` computes, or None (see the module docstring).

    prologue: also recognise an RMSNorm computing A first (``GemmOperands.prologue``).
    dequant: also recognise B computed by a group dequantize of packed words (``dequant.Dequant``,
    ``GemmOperands.dequant``; ``b`` is then the packed buffer, and N may be symbolic).
    """
    found = _stages(func)
    if found is None or not found[0]:
        return None
    stages, allocs = found
    at = next((i for i, s in enumerate(stages) if _matmul(s) is not None), None)
    if at is None or (at > 0 and not (prologue or dequant)):
        return None
    a, b, c, b_layout = _matmul(stages[at])
    dtype = str(a.dtype)
    if dtype not in DTYPES or str(b.dtype) != dtype or str(c.dtype) not in ("float32", dtype):
        return None
    n, k = c.shape[-1], a.shape[-1]
    if not isinstance(k, tirx.IntImm):
        return None
    k = int(k)
    deq = None
    if dequant and at > 0 and any(b.same_as(x) for x in allocs):
        deq = analyze_dequant(stages, at, allocs, b, b_layout, n, k)
        if deq is None:
            return None
    # The stages before the matmul: the dequantize's last, a norm prologue's first.
    first = at - (len(deq.stages) if deq is not None else 0)
    norm = _norm_prologue(func, first, allocs, a) if first > 0 and prologue else None
    if first > 0 and norm is None:
        return None
    # With a prologue, A is the norm's intermediate; with a dequantize, B is computed (its packed
    # words and scales were checked by ``analyze_dequant``).
    inputs = [buf for buf, computed in ((a, norm is not None), (b, deq is not None)) if not computed]
    if any(not _plain(buf) for buf in (a, b)) or any(buf.same_as(x) for buf in inputs for x in allocs):
        return None
    if isinstance(n, tirx.IntImm):
        n = int(n)
    elif deq is None:
        return None  # a symbolic N only with a dequantized weight (the quantized LM head)
    if deq is None and [int(x) for x in b.shape] != ([n, k] if b_layout == "NT" else [k, n]):
        return None
    extents = stages[at].extents[:-1]  # C's
    row_extents = extents[:-1]
    m: Any = tirx.IntImm(_dtype(row_extents[0]) if row_extents else "int64", 1)
    for e in row_extents:
        m = m * e
    m = arith.Analyzer().simplify(m)
    # What the epilogue must not read: the prologue's intermediates, and its sum (written by the
    # kernel's blocks in slices, so not all of it is there when a block's epilogue runs).
    before = [s.store.buffer for s in stages[:at]]

    # The chain: each stage reads the previous one's output, which must be an intermediate; one
    # stage may pair column vn with vn + N / 2 (the later ones run over N / 2 columns).
    prev = c
    chain: list[_Stage] = []
    paired_at: int | None = None
    half = n // 2 if isinstance(n, int) and n % 2 == 0 else None
    for stage in stages[at + 1:]:
        older = [*before, *[c, *(s.store.buffer for s in chain)][:-1]]
        if not any(prev.same_as(x) for x in allocs):
            return None
        if not _elementwise(stage, prev, older, extents):
            halved = (*extents[:-1], tirx.IntImm(_dtype(extents[-1]), half)) if half else None
            if paired_at is not None or halved is None or not _elementwise(stage, prev, older, halved, half):
                return None
            paired_at, extents = len(chain), halved
        chain.append(stage)
        prev = stage.store.buffer
    out = prev
    if any(out.same_as(x) for x in (*allocs, *before)) or not _plain(out):
        return None

    def value(row: Any, col: Any, acc: Any, acc_up: Any = None) -> Any:
        def base(a: Any) -> Any:
            return a if str(c.dtype) == "float32" else tirx.Cast(str(c.dtype), a)

        v = base(acc)
        up = base(acc_up) if paired_at is not None else None
        src = c
        for i, stage in enumerate(chain):
            vars_ = [iv.var for iv in stage.block.iter_vars]
            if paired_at is not None and i < paired_at:
                # Before the pairing, the chain runs on both columns.
                expr = _replace_loads(stage.store.value, src, up)
                up = stmt_functor.substitute(expr, dict(zip(vars_, _indices(row, col + half, vars_))))
            if i == paired_at:
                expr = _replace_loads(stage.store.value, src, v, vars_[-1], up)
            else:
                expr = _replace_loads(stage.store.value, src, v)
            v = stmt_functor.substitute(expr, dict(zip(vars_, _indices(row, col, vars_))))
            src = stage.store.buffer
        return v

    def _indices(row: Any, col: Any, vars_: list[tirx.Var]) -> list[Any]:
        dt = _dtype(vars_[-1])
        col = tirx.Cast(dt, col) if _dtype(col) != dt else col
        return [*_row_indices(row, row_extents, dt), col]

    def index(row: Any, col: Any) -> tuple:
        return tuple(_indices(row, col, [tirx.Var("i", _dtype(x)) for x in extents]))

    operands = GemmOperands(
        a=a if norm is None else norm.x, b=b if deq is None else deq.packed, m=m, n=n, k=k,
        b_layout=b_layout, dtype=dtype,
        out=Epilogue(out, index, value, half if paired_at is not None else None), prologue=norm, dequant=deq,
    )
    return MatmulDesc(
        operands=operands,
        out_dtype=str(out.dtype),
        epilogue_stages=tuple(s.block.name_hint for s in chain),
        m_static=int(m) if isinstance(m, tirx.IntImm) else None,
    )

