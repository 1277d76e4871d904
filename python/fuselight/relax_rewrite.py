"""The scaffolding of Relax passes that touch every Relax function of a module.

``FunctionRewriter``: one ``PyExprMutator`` run over every Relax function. A pass defines the
rewrite as a subclass that overrides ``visit_*`` methods and carries TVM's ``@mutator`` decorator
(this base stays undecorated: ``@mutator`` refuses subclasses of a decorated class), and its
``transform_module`` returns ``Subclass(mod, ...).transform()``.

``rewrite_for_target``: run a rewriter that schedules the kernels it makes for the target in scope.

``annotate_functions``: set one function attribute on the Relax functions of a module.

``unique_binding_names``: a function with every binding named apart from the others.

``visit_nodes`` and ``use_counts``: walks of a Relax expression's nodes, without the struct info.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import relax
from tvm.relax.analysis import remove_all_unused
from tvm.relax.expr_functor import PyExprMutator, mutator


class FunctionRewriter(PyExprMutator):
    """Rewrites each Relax function of ``mod`` with the subclass's ``visit_*`` methods.

    ``prune_unused``: drop the dataflow bindings left unused after the rewrite (e.g. a transpose
    folded into its matmul); a subclass that must leave everything but its rewrite alone sets it False.
    """

    prune_unused = True

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod = mod

    def rewrite_functions(self) -> None:
        """Rewrite every Relax function of ``self.mod`` into the builder's module."""
        for gv, func in self.mod.functions_items():
            if isinstance(func, relax.Function):
                rewritten = self.visit_expr(func)
                self.builder_.update_func(gv, remove_all_unused(rewritten) if self.prune_unused else rewritten)

    def transform(self) -> tvm.IRModule:
        """The module with every Relax function rewritten (and added functions given unique names)."""
        self.rewrite_functions()
        return self.builder_.finalize()


def rewrite_for_target(rewriter: Callable[[tvm.IRModule, Any], FunctionRewriter], mod: tvm.IRModule,
                       schedule: bool) -> tvm.IRModule:
    """``rewriter(mod, target).transform()`` for the target in scope, whose rules schedule what it fuses
    (no target in scope: ``mod`` unchanged); ``schedule=False``: fused only (target None), for CPU numerics."""
    target = tvm.target.Target.current(allow_none=True)
    if schedule and target is None:
        return mod
    return rewriter(mod, target if schedule else None).transform()


def annotate_functions(
    mod: tvm.IRModule, attr: str, value_of: Callable[[tvm.ir.GlobalVar, relax.Function], Any | None]
) -> tvm.IRModule:
    """``mod`` (updated in place) with ``attr`` set to ``value_of(gv, func)`` on each Relax function;
    a function for which it returns None is left as it is."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            value = value_of(gv, func)
            if value is not None:
                mod[gv] = func.with_attr(attr, value)
    return mod


def visit_nodes(expr: relax.Expr, visit: Callable[[relax.Expr], None]) -> None:
    """Call ``visit`` on every Relax expression in ``expr``, children first, as
    ``relax.analysis.post_order_visit`` does, but without walking struct info (and the PrimExprs in
    it), which that visitor does at every use of a variable: for a packed-parameter tuple, hundreds of
    shapes per use, 95% of the nodes of an MLC-LLM function."""
    if isinstance(expr, relax.Call):
        if isinstance(expr.op, relax.Expr):
            visit_nodes(expr.op, visit)
        for arg in expr.args:
            visit_nodes(arg, visit)
    elif isinstance(expr, relax.Tuple):
        for field in expr.fields:
            visit_nodes(field, visit)
    elif isinstance(expr, relax.TupleGetItem):
        visit_nodes(expr.tuple_value, visit)
    elif isinstance(expr, relax.SeqExpr):
        for block in expr.blocks:
            for binding in block.bindings:
                visit_nodes(binding.value, visit)
        visit_nodes(expr.body, visit)
    elif isinstance(expr, relax.If):
        for part in (expr.cond, expr.true_branch, expr.false_branch):
            visit_nodes(part, visit)
    elif isinstance(expr, relax.Function):
        visit_nodes(expr.body, visit)
    visit(expr)


def use_counts(func: relax.Function) -> dict[relax.Var, int]:
    """How often each variable is used in ``func``'s body."""
    counts: dict[relax.Var, int] = {}

    def count(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Var):
            counts[expr] = counts.get(expr, 0) + 1

    visit_nodes(func.body, count)
    return counts


def _names(func: relax.Function) -> list[str]:
    """The names of ``func``'s parameters, then of its bindings, in order."""
    return [p.name for p in func.params] + [b.var.name for block in func.body.blocks for b in block.bindings]


def repeated_binding_name(func: relax.Function) -> str | None:
    """A name ``func`` gives to a parameter or binding more than once, or None."""
    seen: set[str] = set()
    for name in _names(func):
        if name in seen:
            return name
        seen.add(name)
    return None


def module_with_unique_binding_names(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with ``unique_binding_names`` applied to each Relax function that repeats a name (the
    same module where none does)."""
    renamed = {gv: unique_binding_names(f) for gv, f in mod.functions_items() if isinstance(f, relax.Function)}
    if all(f.same_as(mod[gv]) for gv, f in renamed.items()):
        return mod
    mod = mod.clone()
    for gv, f in renamed.items():
        mod[gv] = f
    return mod


def unique_binding_names(func: relax.Function) -> relax.Function:
    """``func`` with no binding named like a parameter or an earlier binding: such a binding gets the
    first free ``name_k``; every other name stays. Analyses that name bindings by their vars (the
    fusion plan) need this; the BlockBuilder of a rewrite names its new bindings ``lv`` again."""
    if repeated_binding_name(func) is None:
        return func
    return _UniqueNames(set(_names(func)), {p.name for p in func.params}).visit_expr(func)


@mutator
class _UniqueNames(PyExprMutator):
    def __init__(self, taken: set[str], kept: set[str]) -> None:
        super().__init__()
        self.taken = taken  # every name of the function: a new one avoids them all
        self.kept = kept  # names given out so far

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        name = binding.var.name
        if name not in self.kept:
            self.kept.add(name)
            super().visit_var_binding_(binding)
            return
        k = 1
        while f"{name}_{k}" in self.taken:
            k += 1
        self.taken.add(f"{name}_{k}")
        var = type(binding.var)(f"{name}_{k}", binding.var.ty)
        self.builder_.emit_normalized(relax.VarBinding(var, self.visit_expr(binding.value)))
        self.set_var_remap(binding.var, var)
