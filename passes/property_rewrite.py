"""Rewrite Relax dataflow by algebraic laws where the cost model says the result is no worse.

``CATALOGUE`` lists every rewrite: its name, the law it uses, and whether it is ``exact`` or the
tolerance it may change results by (ulp = unit in the last place of the tensor's dtype). Each
rewrite starts from one binding (a call of ``Rewrite.op``), looks back through the bindings that
define its arguments, and proposes expressions computing the same value; the pass keeps the
cheapest proposal whose cost, from ``Classify``'s FLOPs and bytes, is provably no greater in both
FLOPs and bytes for every value of the symbolic dims (from 1 to the function's
``tir_var_upper_bound`` where it has one) than the binding plus the bindings it makes dead. Rewrites run to a fixed point (at most ``MAX_ROUNDS`` sweeps per function); bindings
left unused are removed. A rewritten function's bindings are named apart (``unique_binding_names``):
the new ones would reuse ``lv``, and the fusion plan names bindings by their vars.

What is provable is rewritten, nothing else:

* Arithmetic rewrites apply to floating-point tensors only (integer division and saturation obey
  other laws). Constants are folded in float64 and rounded once to the tensor's dtype; a fold whose
  result is not a normal finite number of that dtype (overflow, underflow, division by zero) is
  refused.
* float16's range is narrow: a rewrite that creates an intermediate that may be larger in
  magnitude than every value of the original computation (``b + c`` in ``a*(b+c)``, a scale moved
  to after a matmul or a sum when ``|s| < 1``) is applied only to ``WIDE_RANGE_DTYPES``.
* Scales move across matmuls and reductions only when they are scalar constants; the softmax
  shift only drops finite constants that do not vary along the softmax axis.
* Every proposal must keep the binding's dtype and shape (broadcasting that would change it is
  refused).

The pass records what it applied, ``{name: count}``, in the module attribute ``APPLIED_ATTR`` and
in ``PropertyRewrite.applied``, and the matches it left alone at the end (no proposal provably no
worse, or one changing dtype or shape) in ``REFUSED_ATTR`` and ``PropertyRewrite.refused``. It belongs in the ``before_fuse_transpose_matmul`` slot: moving
scales across ``R.matmul`` needs the matmul before FuseTransposeMatmul lowers linear layers to TIR,
and none of the rewrites breaks the ``matmul(x, permute_dims(w))`` form that pass looks for.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import ml_dtypes
import numpy as np
import tvm
from tvm import arith, relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..contracts import REWRITES_REFUSED_ATTR as REFUSED_ATTR
from ..errors import FuselightError
from ..relax_rewrite import unique_binding_names, visit_nodes
from .classify import classify_binding

APPLIED_ATTR = "fuselight.rewrites_applied"
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
WIDE_RANGE_DTYPES = ("bfloat16", "float32", "float64")
# astype(astype(x, wide), dtype) == x: every value of dtype is exact in wide.
EXACT_WIDENINGS = {
    "float16": ("float32", "float64"),
    "bfloat16": ("float32", "float64"),
    "float32": ("float64",),
    "int8": ("int16", "int32", "int64", "float32", "float64"),
    "int16": ("int32", "int64", "float32", "float64"),
    "int32": ("int64", "float64"),
    "uint8": ("int16", "int32", "int64", "float32", "float64"),
}
MAX_ROUNDS = 16

Candidate = tuple[relax.Expr, tuple[relax.Var, ...]]  # a proposal, and the bindings it reads through


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One catalogue entry: ``propose(graph, call)`` gives the candidates for a call of ``op``."""

    name: str
    law: str
    precision: str  # "exact", or the tolerance
    ops: tuple[str, ...]
    propose: Callable[[_Graph, relax.Call], list[Candidate]]
    # Applied only when strictly cheaper: rewrites that are each other's inverse would otherwise
    # undo each other at equal cost.
    strict: bool = False

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "law": self.law, "precision": self.precision}


# ---- the function's dataflow -----------------------------------------------------------------------


class _Graph:
    """Definitions and users of a function's variables."""

    def __init__(self, func: relax.Function) -> None:
        self.value: dict[relax.Var, relax.Expr] = {}
        self.users: dict[relax.Var, list[relax.Var | None]] = {}  # None: the function's result
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.VarBinding):
                    self.value[binding.var] = binding.value
                self._use(binding.value, binding.var)
        self._use(func.body.body, None)

    def _use(self, expr: relax.Expr, user: relax.Var | None) -> None:
        def visit(node):
            if isinstance(node, relax.Var):
                self.users.setdefault(node, []).append(user)

        visit_nodes(expr, visit)

    def call(self, expr: relax.Expr, *ops: str) -> relax.Call | None:
        value = self.value.get(expr, expr) if isinstance(expr, relax.Var) else expr
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in ops:
            return value
        return None

    def const(self, expr: relax.Expr) -> np.ndarray | None:
        value = self.value.get(expr, expr) if isinstance(expr, relax.Var) else expr
        return value.data.numpy() if isinstance(value, relax.Constant) else None

    def scalar(self, expr: relax.Expr) -> float | None:
        c = self.const(expr)
        return float(c.reshape(())) if c is not None and c.size == 1 and _is_float(str(c.dtype)) else None


# ---- helpers -----------------------------------------------------------------------------------------


def _dtype(expr: relax.Expr) -> str:
    return str(expr.ty.dtype) if isinstance(expr.ty, relax.TensorType) else ""


def _is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def _shape(expr: relax.Expr) -> list[tirx.PrimExpr] | None:
    ty = expr.ty
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return list(ty.shape.values)
    return None


def _same_type(a: relax.Expr, b: relax.Expr) -> bool:
    sa, sb = _shape(a), _shape(b)
    if sa is None or sb is None or len(sa) != len(sb) or _dtype(a) != _dtype(b):
        return False
    analyzer = arith.Analyzer()
    return all(analyzer.can_prove_equal(x, y) for x, y in zip(sa, sb))


def _const(value: np.ndarray, dtype: str) -> relax.Constant | None:
    """``value`` (float64) rounded once to ``dtype``; None unless every element is finite and, where
    non-zero, a normal number of ``dtype`` (so nothing overflowed or underflowed)."""
    info = ml_dtypes.finfo(dtype)
    with np.errstate(over="ignore"):  # overflow is checked below
        rounded = value.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    wide = rounded.astype("float64")
    if not np.all(np.isfinite(wide)) or np.any((value != 0) & (np.abs(wide) < float(info.smallest_normal))):
        return None
    return relax.const(rounded, dtype)


def _commuted(call: relax.Call) -> list[tuple[relax.Expr, relax.Expr]]:
    a, b = call.args
    return [(a, b), (b, a)]


def matmul_out_dtype(call: relax.Call) -> str | None:
    """A matmul's ``out_dtype`` attribute, None when it takes the operands' dtype."""
    out = call.attrs.out_dtype
    return None if out is None or str(out) in ("", "void") else str(out)


# ---- the rewrites ------------------------------------------------------------------------------------


def _permute_axes(call: relax.Call) -> list[int] | None:
    ndim = call.args[0].ty.ndim
    if ndim < 0:
        return None
    axes = call.attrs.axes
    return list(range(ndim))[::-1] if axes is None else [int(a) for a in axes]


def _permute_permute(g: _Graph, call: relax.Call) -> list[Candidate]:
    inner = g.call(call.args[0], "relax.permute_dims")
    if inner is None or (p := _permute_axes(inner)) is None or (q := _permute_axes(call)) is None:
        return []
    axes = [p[i] for i in q]
    x = inner.args[0]
    return [(x if axes == sorted(axes) else relax.op.permute_dims(x, axes), (call.args[0],))]


def _permute_identity(_g: _Graph, call: relax.Call) -> list[Candidate]:
    axes = _permute_axes(call)
    return [(call.args[0], ())] if axes is not None and axes == list(range(len(axes))) else []


_RESHAPES = ("relax.reshape", "relax.flatten", "relax.squeeze", "relax.expand_dims")


def _reshape_reshape(g: _Graph, call: relax.Call) -> list[Candidate]:
    inner = g.call(call.args[0], *_RESHAPES)
    if inner is None:
        return []
    return [(relax.op.reshape(inner.args[0], call.args[1]), (call.args[0],))]


def _reshape_identity(_g: _Graph, call: relax.Call) -> list[Candidate]:
    x = call.args[0]
    return [(x, ())] if _same_type(x, call) else []


def _const_assoc(op: str, make: Callable, fold: Callable[[np.ndarray, np.ndarray], np.ndarray]):
    def propose(g: _Graph, call: relax.Call) -> list[Candidate]:
        if not _is_float(_dtype(call)):
            return []
        found = []
        for t, b in _commuted(call):
            inner, cb = g.call(t, op), g.const(b)
            if inner is None or cb is None:
                continue
            for x, a in _commuted(inner):
                ca = g.const(a)
                if ca is not None and g.const(x) is None:
                    folded = _const(fold(ca.astype("float64"), cb.astype("float64")), _dtype(call))
                    if folded is not None:
                        found.append((make(x, folded), (t,)))
        return found

    return propose


def _sub_const_to_add(g: _Graph, call: relax.Call) -> list[Candidate]:
    x, c = call.args
    cc = g.const(c)
    if not _is_float(_dtype(call)) or cc is None:
        return []
    return [(relax.op.add(x, relax.const(-cc, _dtype(c))), ())]


def _div_const_to_mul(g: _Graph, call: relax.Call) -> list[Candidate]:
    x, c = call.args
    cc = g.const(c)
    if not _is_float(_dtype(call)) or cc is None or np.any(cc == 0):
        return []
    inverse = _const(1.0 / cc.astype("float64"), _dtype(c))
    return [(relax.op.multiply(x, inverse), ())] if inverse is not None else []


def _identity_operand(neutral: float, ops_commute: bool):
    def propose(g: _Graph, call: relax.Call) -> list[Candidate]:
        pairs = _commuted(call) if ops_commute else [tuple(call.args)]
        found = []
        for x, c in pairs:
            cc = g.const(c)
            if cc is not None and np.all(cc == neutral) and _same_type(x, call):
                found.append((x, ()))
        return found

    return propose


def _double_negation(g: _Graph, call: relax.Call) -> list[Candidate]:
    inner = g.call(call.args[0], "relax.negative")
    return [(inner.args[0], (call.args[0],))] if inner is not None else []


def _astype_round_trip(g: _Graph, call: relax.Call) -> list[Candidate]:
    inner = g.call(call.args[0], "relax.astype")
    if inner is None:
        return []
    x = inner.args[0]
    narrow, wide = _dtype(x), _dtype(inner)
    if _dtype(call) == narrow and wide in EXACT_WIDENINGS.get(narrow, ()):
        return [(x, (call.args[0],))]
    return []


def _astype_identity(_g: _Graph, call: relax.Call) -> list[Candidate]:
    return [(call.args[0], ())] if _dtype(call.args[0]) == _dtype(call) else []


def _scale_moves(dtype: str, s: float, later: bool) -> bool:
    """Whether scale ``s`` may be applied later (or earlier) in ``dtype``: in a narrow dtype the
    intermediate it leaves unscaled must not grow."""
    return dtype in WIDE_RANGE_DTYPES or (abs(s) >= 1 if later else abs(s) <= 1)


def _scaled(g: _Graph, expr: relax.Expr) -> tuple[relax.Expr, float, relax.Expr] | None:
    """``expr = y * s`` with a scalar constant ``s``: (y, s, the constant)."""
    mul = g.call(expr, "relax.multiply")
    if mul is None:
        return None
    for y, c in _commuted(mul):
        s = g.scalar(c)
        if s is not None and g.const(y) is None:
            return y, s, c
    return None


def _scale_out_of_matmul(g: _Graph, call: relax.Call) -> list[Candidate]:
    a, b = call.args
    out_dtype, in_dtype = _dtype(call), _dtype(a)
    if not _is_float(in_dtype) or not _is_float(out_dtype):
        return []
    found = []
    for i, operand in enumerate((a, b)):
        scaled = _scaled(g, operand)
        if scaled is None:
            continue
        y, s, _c = scaled
        if not _scale_moves(out_dtype, s, later=True):
            continue
        args = [y, b] if i == 0 else [a, y]
        product = relax.op.matmul(*args, out_dtype=matmul_out_dtype(call))
        s_out = _const(np.array(s, "float64"), out_dtype)  # exact: s was in the narrower in_dtype
        if s_out is not None:
            found.append((relax.op.multiply(product, s_out), (operand,)))
    return found


def _scale_into_matmul(g: _Graph, call: relax.Call) -> list[Candidate]:
    scaled = _scaled(g, call)  # call is the multiply: (matmul(a, b)) * s
    if scaled is None:
        return []
    y, s, _c = scaled
    mm = g.call(y, "relax.matmul")
    if mm is None:
        return []
    a, b = mm.args
    in_dtype = _dtype(a)
    if not _is_float(in_dtype) or not _scale_moves(in_dtype, s, later=False):
        return []
    s_in = _const(np.array(s, "float64"), in_dtype)
    if s_in is None or float(s_in.data.numpy()) != s:  # s must be exact in the operands' dtype
        return []
    out_dtype = matmul_out_dtype(mm)
    return [
        (relax.op.matmul(relax.op.multiply(a, s_in), b, out_dtype=out_dtype), (y,)),
        (relax.op.matmul(a, relax.op.multiply(b, s_in), out_dtype=out_dtype), (y,)),
    ]


def _factor_common(g: _Graph, call: relax.Call) -> list[Candidate]:
    if _dtype(call) not in WIDE_RANGE_DTYPES:
        return []
    p, q = call.args
    mp, mq = g.call(p, "relax.multiply"), g.call(q, "relax.multiply")
    if mp is None or mq is None:
        return []
    combine = relax.op.add if call.op.name == "relax.add" else relax.op.subtract
    found = []
    for a, b in _commuted(mp):
        for c, d in _commuted(mq):
            if a.same_as(c):
                found.append((relax.op.multiply(a, combine(b, d)), (p, q)))
    return found


def _matmul_factor_common(g: _Graph, call: relax.Call) -> list[Candidate]:
    if _dtype(call) not in WIDE_RANGE_DTYPES:
        return []
    p, q = call.args
    mp, mq = g.call(p, "relax.matmul"), g.call(q, "relax.matmul")
    if mp is None or mq is None or matmul_out_dtype(mp) != matmul_out_dtype(mq):
        return []
    if any(_dtype(x) != _dtype(call) for x in (*mp.args, *mq.args)):  # no accumulation in a wider dtype
        return []
    combine = relax.op.add if call.op.name == "relax.add" else relax.op.subtract
    (a, b), (c, d) = mp.args, mq.args
    found = []
    if b.same_as(d):
        found.append((relax.op.matmul(combine(a, c), b), (p, q)))
    if a.same_as(c):
        found.append((relax.op.matmul(a, combine(b, d)), (p, q)))
    return found


def _reduce_of_scaled(g: _Graph, call: relax.Call) -> list[Candidate]:
    scaled = _scaled(g, call.args[0])
    dtype = _dtype(call)
    if scaled is None or not _is_float(dtype):
        return []
    y, s, c = scaled
    positive_only = call.op.name in ("relax.max", "relax.min")
    if (positive_only and s <= 0) or (not positive_only and not _scale_moves(dtype, s, later=True)):
        return []
    reduced = relax.Call(call.op, [y], call.attrs)  # same axes and keepdims
    return [(relax.op.multiply(reduced, c), (call.args[0],))]


def _softmax_shift(g: _Graph, call: relax.Call) -> list[Candidate]:
    add = g.call(call.args[0], "relax.add")
    if add is None or not _is_float(_dtype(call)):
        return []
    ndim = call.ty.ndim
    axis = int(call.attrs.axis) % ndim
    found = []
    for x, c in _commuted(add):
        cc = g.const(c)
        if cc is None or not np.all(np.isfinite(cc.astype("float64"))) or not _same_type(x, add):
            continue
        offset = ndim - cc.ndim  # numpy broadcasting aligns trailing dims
        if axis < offset or cc.shape[axis - offset] == 1:
            found.append((relax.Call(call.op, [x], call.attrs), (call.args[0],)))
    return found


def _rewrite(name: str, law: str, precision: str, ops: Sequence[str], propose, strict: bool = False) -> Rewrite:
    return Rewrite(name, law, precision, tuple("relax." + op for op in ops), propose, strict)


CATALOGUE: tuple[Rewrite, ...] = (
    _rewrite("permute_permute", "associativity of permutation composition: permute(permute(x, p), q) = permute(x, p[q])",
             "exact", ["permute_dims"], _permute_permute),
    _rewrite("permute_identity", "identity: permute(x, (0, 1, ..)) = x", "exact", ["permute_dims"], _permute_identity),
    _rewrite("reshape_reshape", "associativity of reshapes (row-major order kept): reshape(reshape(x, s1), s2) = reshape(x, s2)",
             "exact", ["reshape"], _reshape_reshape),
    _rewrite("reshape_identity", "identity: reshape(x, shape(x)) = x", "exact", ["reshape"], _reshape_identity),
    _rewrite("mul_one", "identity: x*1 = x", "exact", ["multiply"], _identity_operand(1.0, True)),
    _rewrite("add_zero", "identity: x+0 = x", "exact (-0 + 0 gives +0)", ["add"], _identity_operand(0.0, True)),
    _rewrite("sub_zero", "identity: x-0 = x", "exact", ["subtract"], _identity_operand(0.0, False)),
    _rewrite("mul_const_assoc", "associativity and commutativity: (x*a)*b = x*(a*b), a, b constant",
             "rel 2 ulp (a*b rounded once)", ["multiply"], _const_assoc("relax.multiply", relax.op.multiply, np.multiply)),
    _rewrite("add_const_assoc", "associativity and commutativity: (x+a)+b = x+(a+b), a, b constant",
             "abs 2 ulp of |x|+|a|+|b| (a+b rounded once)", ["add"], _const_assoc("relax.add", relax.op.add, np.add)),
    _rewrite("sub_const_to_add", "inverse: x-c = x+(-c)", "exact", ["subtract"], _sub_const_to_add),
    _rewrite("div_const_to_mul", "inverse: x/c = x*(1/c)",
             "exact when c is a power of two, else rel 2 ulp (1/c rounded once)", ["divide"], _div_const_to_mul),
    _rewrite("double_negation", "inverse pair: -(-x) = x", "exact", ["negative"], _double_negation),
    _rewrite("astype_round_trip", "inverse pair: astype(astype(x, wide), dtype(x)) = x for an exact widening",
             "exact", ["astype"], _astype_round_trip),
    _rewrite("astype_identity", "identity: astype(x, dtype(x)) = x", "exact", ["astype"], _astype_identity),
    _rewrite("scale_out_of_matmul", "homogeneity (distributivity of a scalar over the dot product): (x*s)@W = (x@W)*s",
             "rel 2 ulp per product, exact for powers of two", ["matmul"], _scale_out_of_matmul, strict=True),
    _rewrite("scale_into_matmul", "homogeneity: (A@B)*s = (A*s)@B = A@(B*s), onto the smaller operand",
             "rel 2 ulp per product, exact for powers of two", ["multiply"], _scale_into_matmul, strict=True),
    _rewrite("factor_common", "distributivity: a*b + a*c = a*(b+c) (also with -)",
             "abs 2 ulp of |a*b|+|a*c|", ["add", "subtract"], _factor_common),
    _rewrite("matmul_factor_common", "distributivity: A@B + C@B = (A+C)@B, A@B + A@C = A@(B+C) (also with -)",
             "abs 2 ulp of sum |A||B| + |C||B|", ["add", "subtract"], _matmul_factor_common),
    _rewrite("reduce_of_scaled", "distributivity: sum(x*s) = sum(x)*s (also mean); max/min(x*s) = max/min(x)*s for s > 0",
             "sum/mean: rel 2 ulp of sum |x*s|; max/min: exact", ["sum", "mean", "max", "min"], _reduce_of_scaled),
    _rewrite("softmax_shift", "inverse pair exp(c)/exp(c): softmax(x + c) = softmax(x) for c constant along the axis",
             "abs 2 ulp of |x|+|c| in the logits", ["nn.softmax", "nn.log_softmax"], _softmax_shift),
)  # fmt: skip


def catalogue() -> list[dict[str, str]]:
    """The catalogue as ``{"name", "law", "precision"}`` records."""
    return [r.to_dict() for r in CATALOGUE]


# ---- the pass ----------------------------------------------------------------------------------------


@tvm.transform.module_pass(opt_level=0, name="PropertyRewrite")
class PropertyRewrite:
    """Apply ``CATALOGUE`` (or the named subset) where no worse; ``self.applied`` and
    ``self.refused`` count by name."""

    def __init__(self, names: Sequence[str] | None = None) -> None:
        known = {r.name: r for r in CATALOGUE}
        unknown = [n for n in names or () if n not in known]
        if unknown:
            raise FuselightError(f"unknown rewrite(s) {', '.join(unknown)}: expected names from {', '.join(known)}")
        self.rewrites = [known[n] for n in names] if names is not None else list(CATALOGUE)
        self.applied: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.applied, self.refused = Counter(), Counter()
        by_op: dict[str, list[Rewrite]] = {}
        for r in self.rewrites:
            for op in r.ops:
                by_op.setdefault(op, []).append(r)
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewritten = _rewrite_function(func, by_op, self.applied, self.refused)
                out[gv] = rewritten if rewritten.same_as(func) else unique_binding_names(rewritten)
        out = out.with_attr(APPLIED_ATTR, dict(self.applied))
        return out.with_attr(REFUSED_ATTR, dict(self.refused))


def _rewrite_function(
    func: relax.Function, by_op: dict[str, list[Rewrite]], applied: Counter, refused: Counter
) -> relax.Function:
    for _ in range(MAX_ROUNDS):
        graph = _Graph(func)
        bounds = func.attrs.get("tir_var_upper_bound") if func.attrs is not None else None
        chosen: dict[relax.Var, relax.Expr] = {}
        left: list[str] = []  # rewrites that matched but were not applied, this round
        # Each choice is costed on this round's graph, crediting the bindings it frees as dead: a
        # later choice of the same round must not read those, nor free what an earlier one reads
        # (both applied, the freed binding would stay alive beside its replacement). Such a
        # rewrite waits for the next round, costed on the graph the earlier choices made.
        freed: set[relax.Var] = set()
        read: set[relax.Var] = set()
        deferred = False
        for block in func.body.blocks:
            if not isinstance(block, relax.DataflowBlock):
                continue  # outside dataflow, calls may have effects
            for binding in block.bindings:
                value = binding.value
                if not isinstance(binding, relax.VarBinding) or not isinstance(value, relax.Call):
                    continue
                if not isinstance(value.op, tvm.ir.Op):
                    continue
                matched = []
                for rewrite in by_op.get(value.op.name, ()):
                    candidates = rewrite.propose(graph, value)
                    best = _cheapest(graph, binding, candidates, rewrite.strict, bounds)
                    if best is not None:
                        expr, frees = best
                        reads = set(relax.analysis.free_vars(expr))
                        if reads & freed or set(frees) & read:
                            deferred = True
                            break
                        chosen[binding.var] = expr
                        freed.update(frees)
                        read.update(reads)
                        applied[rewrite.name] += 1
                        break
                    matched += [rewrite.name] if candidates else []
                else:
                    left += matched
        if not chosen:
            assert not deferred  # a rewrite waits only for one chosen in its round
            refused.update(left)  # the final state: what stays matched but unapplied
            break
        func = _canonical(relax.analysis.remove_all_unused(_Replace(chosen).visit_expr(func)))
    return func


def _canonical(func: relax.Function) -> relax.Function:
    """Aliases left by rewrites to an existing variable replaced by that variable."""
    gv = tvm.ir.GlobalVar("f")
    return relax.transform.CanonicalizeBindings()(tvm.IRModule({gv: func}))[gv]


def _cheapest(
    graph: _Graph, binding: relax.VarBinding, candidates: list[Candidate], strict: bool, bounds: Mapping | None
) -> tuple[relax.Expr, list[relax.Var]] | None:
    """The cheapest candidate no worse than the binding and the bindings it frees, and those."""
    if not candidates:
        return None
    freed = _freed(graph, binding.var, candidates)
    old = _cost([binding] + [relax.VarBinding(v, graph.value[v]) for v in freed])
    best, best_cost = None, None
    for expr, _through in candidates:
        emitted = emit_bindings(expr)
        if emitted is None or not _same_type(emitted[-1].var, binding.var):
            continue
        new = _cost(emitted)
        if no_worse(new, old, strict, bounds) and (best_cost is None or no_worse(new, best_cost, bounds=bounds)):
            best, best_cost = expr, new
    return (best, freed) if best is not None else None


def _freed(graph: _Graph, root: relax.Var, candidates: list[Candidate]) -> list[relax.Var]:
    """Bindings read through that die with the rewrite: every user of each is the root or dies too.

    Only those read through by every candidate count, so the saving credited is certain."""
    through = set.intersection(*(set(t) for _, t in candidates))
    freed: set[relax.Var] = set()
    changed = True
    while changed:
        changed = False
        for var in through - freed:
            users = graph.users.get(var, [])
            if var in graph.value and users and all(u is not None and (u.same_as(root) or u in freed) for u in users):
                freed.add(var)
                changed = True
    return sorted(freed, key=lambda v: v.name)


def emit_bindings(expr: relax.Expr) -> list[relax.VarBinding] | None:
    """The bindings ``expr`` normalizes to (the last binds its value); None if TVM refuses it."""
    bb = relax.BlockBuilder()
    bb._begin_dataflow_block()
    try:
        bb.emit(expr)
    except tvm.error.TVMError:
        return None
    finally:
        block = bb._end_block()
    return list(block.bindings)


def _cost(bindings: list[relax.VarBinding]) -> tuple[tirx.PrimExpr, tirx.PrimExpr] | None:
    flops: tirx.PrimExpr = tirx.IntImm("int64", 0)
    nbytes: tirx.PrimExpr = tirx.IntImm("int64", 0)
    for binding in bindings:
        f, b = classify_binding(binding).cost_exprs()
        if f is None or b is None:
            return None
        flops, nbytes = flops + f, nbytes + b
    return flops, nbytes


def no_worse(
    new: Sequence[tirx.PrimExpr] | None,
    old: Sequence[tirx.PrimExpr] | None,
    strict: bool = False,
    bounds: Mapping[str, int] | None = None,
) -> bool:
    """Provably ``new <= old`` in every component (FLOPs, bytes) for every symbolic dim >= 1 and at
    most its bound in ``bounds`` (``tir_var_upper_bound``) (``strict``: and ``new < old`` in one)."""
    if new is None or old is None:
        return False
    analyzer = arith.Analyzer()
    free: dict[str, tirx.Var] = {}
    for e in (*new, *old):
        tirx.stmt_functor.post_order_visit(e, lambda n: free.setdefault(n.name, n) if isinstance(n, tirx.Var) else None)
    domain = tirx.const(True, "bool")
    for name, v in free.items():
        domain = tirx.And(domain, v >= 1)
        if bounds and name in bounds:
            domain = tirx.And(domain, v <= int(bounds[name]))
    with analyzer.constraint_scope(domain):
        # The simplified difference proves more than the comparison (terms in n * m cancel first).
        margins = [analyzer.simplify(o - n) for n, o in zip(new, old)]
        no_worse = all(analyzer.can_prove(d >= 0) for d in margins)
        return no_worse and (not strict or any(analyzer.can_prove(d > 0) for d in margins))


@mutator
class _Replace(PyExprMutator):
    """Re-emit the function with the chosen bindings' values replaced."""

    def __init__(self, chosen: dict[relax.Var, relax.Expr]) -> None:
        super().__init__()
        self.chosen = chosen

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.chosen:
            super().visit_var_binding_(binding)
            return
        value = self.visit_expr(self.chosen[binding.var])
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(value, name_hint=binding.var.name))
