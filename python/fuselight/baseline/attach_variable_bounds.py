"""Mirrors MLC-LLM's ``AttachVariableBounds``: upper bounds of symbolic dims for the memory planner.

``StaticPlanBlockMemory`` can plan a buffer whose size depends on a symbolic dim (sequence length,
batch size) only when it knows the dim's largest value (``tir_var_upper_bound`` on the function);
variables listed as non-negative (``tir_non_negative_var``) help it simplify sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import tvm

from ..relax_rewrite import annotate_functions

# MLC-LLM marks the vocabulary size non-negative in every model it compiles.
DEFAULT_NON_NEGATIVE = ("vocab_size",)


@tvm.transform.module_pass(opt_level=0, name="AttachVariableBounds")
class AttachVariableBounds:
    """Attach ``tir_var_upper_bound`` (positive bounds only) and ``tir_non_negative_var`` to Relax functions."""

    def __init__(self, upper_bounds: Mapping[str, int], non_negative: Sequence[str] = DEFAULT_NON_NEGATIVE) -> None:
        # A bound <= 0 stands for "unbounded" in model configs (e.g. no sliding window).
        self.upper_bounds = {name: int(v) for name, v in upper_bounds.items() if v > 0}
        self.non_negative = list(non_negative)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = annotate_functions(mod, "tir_var_upper_bound", lambda _gv, _func: self.upper_bounds)
        return annotate_functions(mod, "tir_non_negative_var", lambda _gv, _func: self.non_negative)
