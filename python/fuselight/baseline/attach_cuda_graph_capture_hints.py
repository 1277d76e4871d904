"""Mirrors MLC-LLM's ``AttachCUDAGraphSymbolicCaptureHints``: which symbolic dims a CUDA graph is keyed on.

``RewriteCUDAGraph`` captures a function's static regions into CUDA graphs; a region whose shapes
depend on symbolic dims can be captured once per value of the dims named in
``relax.rewrite_cuda_graph.capture_symbolic_vars`` (e.g. the batch size of ``decode``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import tvm

from ..relax_rewrite import annotate_functions


@tvm.transform.module_pass(opt_level=0, name="AttachCUDAGraphSymbolicCaptureHints")
class AttachCUDAGraphSymbolicCaptureHints:
    """Attach, per Relax function name, the symbolic dims CUDA graph capture may key on."""

    def __init__(self, hints: Mapping[str, Sequence[str]]) -> None:
        self.hints = {name: list(dims) for name, dims in hints.items()}

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return annotate_functions(
            mod, "relax.rewrite_cuda_graph.capture_symbolic_vars", lambda gv, _func: self.hints.get(gv.name_hint)
        )
