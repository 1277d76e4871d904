"""The scaffolding of a Relax rewrite pass: one ``PyExprMutator`` run over every Relax function of a module.

A pass defines the rewrite as a subclass that overrides ``visit_*`` methods and carries TVM's
``@mutator`` decorator (this base stays undecorated: ``@mutator`` refuses subclasses of a decorated
class), and its ``transform_module`` returns ``Subclass(mod, ...).transform()``.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.analysis import remove_all_unused
from tvm.relax.expr_functor import PyExprMutator


class FunctionRewriter(PyExprMutator):
    """Rewrites each Relax function of ``mod`` with the subclass's ``visit_*`` methods.

    ``prune_unused``: drop the dataflow bindings left unused after the rewrite (e.g. a transpose
    folded into its matmul); a subclass that must leave everything but its rewrite alone sets it False.
    """

    prune_unused = True

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod = mod

    def transform(self) -> tvm.IRModule:
        """The module with every Relax function rewritten (and added functions given unique names)."""
        for gv, func in self.mod.functions_items():
            if isinstance(func, relax.Function):
                rewritten = self.visit_expr(func)
                self.builder_.update_func(gv, remove_all_unused(rewritten) if self.prune_unused else rewritten)
        return self.builder_.finalize()
