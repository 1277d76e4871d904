"""Give each PrimFunc the upper bounds its Relax callers declare for its symbolic dims.

MLC-LLM (and ``fuselight compile``) bound the symbolic dims of each Relax function
(``tir_var_upper_bound``: ``batch_size`` by ``max_batch_size``, ``seq_len`` by the prefill chunk), and
plan memory for those sizes only, so no call exceeds them. A PrimFunc does not see them: its dims
are its own variables. This pass carries them over, per PrimFunc variable, as
``contracts.DIM_UPPER_BOUND_ATTR`` (variable name -> largest value), so that a rule compiles only the
kernels a size up to the bound can reach (``rules.matmul`` drops its M ranges above it, and asserts the
bound on the host).

A variable gets a bound only where every reference to the PrimFunc is the callee of a ``call_tir`` at
the top level of a Relax function's bindings, and at every such call its dim is bounded: the largest
value of the caller's shape expression under the caller's bounds (``arith.Analyzer``), the smallest
of these where the variable sizes several dims, the largest over the calls. Everything else (a
PrimFunc handed to a builtin, a call inside an ``If``, an unbounded caller, a shape the caller does
not know) leaves the variable, or the PrimFunc, without one. Relax functions are the only callers
looked at: in the pipelines this runs in, PrimFuncs do not call each other before lowering.
Nothing is rewritten.
"""

from __future__ import annotations

from collections.abc import Iterator

import tvm
from tvm import arith, relax, tirx

from ..contracts import DIM_UPPER_BOUND_ATTR

_CALL_TIR_OPS = ("relax.call_tir", "relax.call_tir_inplace")
_UNBOUNDED = arith.ConstIntBound.POS_INF


@tvm.transform.module_pass(opt_level=0, name="AttachDimBounds")
class AttachDimBounds:
    """Attach the Relax callers' upper bounds of each PrimFunc's symbolic dims (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        bounds = prim_func_dim_bounds(mod)
        for gv, found in bounds.items():
            mod[gv] = mod[gv].with_attr(DIM_UPPER_BOUND_ATTR, found)
        return mod


def prim_func_dim_bounds(mod: tvm.IRModule) -> dict[tvm.ir.GlobalVar, dict[str, int]]:
    """The bounds ``AttachDimBounds`` attaches: PrimFunc -> {variable name: largest value}, PrimFuncs
    with no bounded variable left out."""
    prim_funcs = {gv for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    per_call: dict[tvm.ir.GlobalVar, list[dict[str, int]]] = {}
    opaque: set[tvm.ir.GlobalVar] = set()
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        analyzer = _caller_analyzer(func)
        for value in _binding_values(func):
            callee = _call_tir_callee(value)
            if callee in prim_funcs:
                per_call.setdefault(callee, []).append(_call_bounds(mod[callee], value, analyzer))
                others = list(value.args[1:])
            else:
                others = [value]
            for other in others:
                opaque.update(gv for gv in relax.analysis.all_global_vars(other) if gv in prim_funcs)
    out = {}
    for gv, calls in per_call.items():
        if gv in opaque:
            continue
        names = set.intersection(*(set(c) for c in calls))
        found = {name: max(c[name] for c in calls) for name in sorted(names)}
        if found:
            out[gv] = found
    return out


def _binding_values(func: relax.Function) -> Iterator[relax.Expr]:
    """The value of every binding of ``func``'s body, and the body's result (nested expressions whole)."""
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        yield body
        return
    for block in body.blocks:
        for binding in block.bindings:
            yield binding.value
    yield body.body


def _call_tir_callee(value: relax.Expr) -> tvm.ir.GlobalVar | None:
    if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in _CALL_TIR_OPS
            and isinstance(value.args[0], tvm.ir.GlobalVar)):
        return value.args[0]
    return None


def _caller_analyzer(func: relax.Function) -> arith.Analyzer | None:
    """An analyzer knowing ``func``'s bounded symbolic variables, or None where it declares none."""
    declared = func.attrs.get("tir_var_upper_bound") if func.attrs is not None else None
    if not declared:
        return None
    declared = {str(k): int(v) for k, v in declared.items()}
    analyzer = arith.Analyzer()
    for var in relax.analysis.defined_symbolic_vars(func):
        if var.name in declared:
            analyzer.update(var, arith.ConstIntBound(0, declared[var.name]))
    return analyzer


def _call_bounds(callee: tirx.PrimFunc, call: relax.Call, analyzer: arith.Analyzer | None) -> dict[str, int]:
    """{callee variable name: largest value} at this call, for the variables sizing a dim of the
    callee's buffers or passed as its trailing scalars, where the caller bounds them."""
    if analyzer is None:
        return {}
    args = call.args[1]
    inputs = list(args.fields) if isinstance(args, relax.Tuple) else [args]
    outputs = list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else [call.ty]
    actual: list[list[tvm.ir.PrimExpr] | None] = [_shape(x.ty) for x in inputs] + [_shape(t) for t in outputs]
    params = list(callee.params)
    if len(call.args) > 2 and isinstance(call.args[2], relax.ShapeExpr):
        scalars = list(call.args[2].values)
        actual += [[v] for v in scalars]
    if len(actual) != len(params):
        return {}
    variables: dict[str, tirx.Var] = {}
    bounded: dict[str, int] = {}
    for param, dims in zip(params, actual):
        formal = list(param.ty.shape) if isinstance(param.ty, tirx.BufferType) else [param]
        if dims is None:
            continue  # a shape the caller does not know: its other dims may still say
        if len(formal) != len(dims):
            return {}  # not the callee's signature: say nothing of this call
        for f, a in zip(formal, dims):
            if not isinstance(f, tirx.Var):
                continue
            if not variables.setdefault(f.name, f).same_as(f):
                return {}  # one name for two variables
            top = analyzer.const_int_bound(a).max_value
            if top < _UNBOUNDED:
                bounded[f.name] = min(bounded.get(f.name, top), int(top))
    return bounded


def _shape(ty: relax.Type) -> list[tvm.ir.PrimExpr] | None:
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return list(ty.shape.values)
    return None
