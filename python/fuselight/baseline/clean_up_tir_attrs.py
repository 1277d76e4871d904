"""Mirrors MLC-LLM's ``CleanUpTIRAttrs``: drop function attributes that must not reach later passes.

The pipeline removes ``op_pattern`` (FuseOps' annotation) after fusion, so DLight and code
generation see the PrimFuncs as plain kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import tvm


@tvm.transform.module_pass(opt_level=0, name="CleanUpTIRAttrs")
class CleanUpTIRAttrs:
    """Remove the named attributes from every function that has them."""

    def __init__(self, attrs: Sequence[str]) -> None:
        self.attrs = list(attrs)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        for gv, func in mod.functions_items():
            present = [a for a in self.attrs if func.attrs is not None and a in func.attrs]
            for attr in present:
                func = func.without_attr(attr)
            if present:
                mod[gv] = func
        return mod
