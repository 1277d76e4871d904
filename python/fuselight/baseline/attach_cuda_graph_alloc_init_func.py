"""Mirrors MLC-LLM's ``AttachCUDAGraphAllocInitFunc``: a function that makes the graph-captured allocations.

When ``RewriteCUDAGraph`` (enabled by the pass config ``relax.backend.use_cuda_graph``) moves a
module's static allocations into a ``cuda_graph_alloc`` function, ``cuda_graph_alloc_init()`` lets a
runtime make them up front, through the VM builtin that caches their result, instead of inside the
first step it runs.
"""

from __future__ import annotations

import tvm
from tvm import relax

INIT_FUNC = "cuda_graph_alloc_init"
_ALLOC_FUNC = "cuda_graph_alloc"
_GET_CACHED_ALLOC = "vm.builtin.cuda_graph.get_cached_alloc"


@tvm.transform.module_pass(opt_level=0, name="AttachCUDAGraphAllocInitFunc")
class AttachCUDAGraphAllocInitFunc:
    """Add ``cuda_graph_alloc_init()`` when the module has a CUDA graph allocation function."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        names = {gv.name_hint: gv for gv in mod.get_global_vars()}
        # The exact name (``cuda_graph_alloc_init`` shares its prefix); already attached: nothing to do.
        if _ALLOC_FUNC not in names or INIT_FUNC in names:
            return mod
        alloc_gv = names[_ALLOC_FUNC]
        builder = relax.BlockBuilder(mod)
        with builder.function(INIT_FUNC, []):
            builder.emit_func_output(
                relax.op.call_builtin_with_ctx(
                    _GET_CACHED_ALLOC, args=[alloc_gv, relax.prim_value(0)], ty_args=relax.ObjectType()
                )
            )
        return builder.finalize()
