"""Mirrors MLC-LLM's ``ScatterTupleGetItem``: each tuple-element binding moves to just before its first use.

After lifting (LiftTIRGlobalBufferAlloc) kernels return tuples whose elements are taken right away;
binding an element only where it is first needed keeps the dataflow order the memory planner and
``KillAfterLastUse`` work from tight. Applies to dataflow variables bound to ``TupleGetItem``.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from ..relax_rewrite import FunctionRewriter


@tvm.transform.module_pass(opt_level=0, name="ScatterTupleGetItem")
class ScatterTupleGetItem:
    """Defer ``v = t[i]`` bindings in dataflow blocks to the first use of ``v``."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return _Deferrer(mod).transform()


@mutator
class _Deferrer(FunctionRewriter):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.deferred: dict[relax.DataflowVar, relax.TupleGetItem] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if isinstance(binding.var, relax.DataflowVar) and isinstance(binding.value, relax.TupleGetItem):
            self.deferred[binding.var] = self.visit_expr(binding.value)
            return
        super().visit_var_binding_(binding)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        if var in self.deferred:
            bound = self.builder_.emit(self.deferred.pop(var), name_hint=var.name)
            self.set_var_remap(var, bound)
            return bound
        return super().visit_dataflow_var_(var)
