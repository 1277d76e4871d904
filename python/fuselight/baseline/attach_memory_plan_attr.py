"""Mirrors MLC-LLM's ``AttachMemoryPlanAttr``: let the memory planner plan function outputs too.

With ``relax.memory_plan_dynamic_func_output`` set, ``StaticPlanBlockMemory`` also plans the storage
of tensors a function returns when their size is symbolic (bounded by ``tir_var_upper_bound``),
instead of allocating them on every call.
"""

from __future__ import annotations

import tvm

from ..relax_rewrite import annotate_functions


@tvm.transform.module_pass(opt_level=0, name="AttachMemoryPlanAttr")
class AttachMemoryPlanAttr:
    """Set ``relax.memory_plan_dynamic_func_output`` on every Relax function."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return annotate_functions(mod, "relax.memory_plan_dynamic_func_output", lambda _gv, _func: True)
