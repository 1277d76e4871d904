"""fuselight graph passes (Relax), each a ``tvm.transform.Pass``.

``PASSES`` names every pass with where it runs in the pipeline (``fuselight.pipeline``): in phase 1,
``"before_fuse_transpose_matmul"`` for rewrites of ``R.matmul`` itself (MLC's FuseTransposeMatmul
turns linear layers into TIR kernels), ``"after_graph_passes"`` for the rest, after MLC's graph
passes; at the start of phase 2, ``"before_legalize"`` for the lowering of the fusion plan (after
every graph pass, ahead of TVM's LegalizeOps and FuseOps); at the start of phase 4,
``"before_rules"`` for what the rules read of the whole module (each rule sees one function). ``DEFAULT`` names the passes the fuselight
pipeline runs when none are given, in order; ``default()`` returns them as pass objects (for
``tvm.transform.Sequential``). ``rules`` names the rule families (``fuselight.rules.RULES``) that
schedule, in phase 4, what a pass emits unscheduled: a pipeline without them leaves the pass out,
since DLight's rules cannot schedule those functions.

``MergeSiblingMatmuls`` and ``FoldNormWeight`` are not among them: they change the weights a
function takes, so its caller must transform the weights too (``weight_transform``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import tvm

from ..errors import FuselightError
from .accumulate_matmul_fp32 import AccumulateMatmulFP32
from .add_rms_norm_kernels import AddRMSNormKernels
from .apply_fusion_plan import ApplyFusionPlan
from .attach_dim_bounds import AttachDimBounds
from .classify import Classify, classify_module
from .fold_norm_weight import FoldNormWeight
from .fuse_attention import FuseAttention
from .fuse_gate_up_silu import FuseGateUpSiLU
from .fuse_norm_gemv import FuseNormIntoGemv
from .capture_whole_step import CaptureWholeStep
from .fuse_rope_append import FuseRopeAppend
from .merge_sibling_matmuls import MergeSiblingMatmuls
from .paged_attention import PagedAttentionKernels
from .property_rewrite import PropertyRewrite
from .residual_stream_fp32 import ResidualStreamFP32

Slot = Literal["before_fuse_transpose_matmul", "after_graph_passes", "before_legalize", "before_rules"]
SLOTS: tuple[Slot, ...] = ("before_fuse_transpose_matmul", "after_graph_passes", "before_legalize", "before_rules")


@dataclasses.dataclass(frozen=True)
class GraphPass:
    name: str
    slot: Slot
    make: Callable[[], tvm.transform.Pass]
    # The built library calls back into the fuselight runtime (``fuselight.kv_hooks``): it runs only
    # where fuselight is imported, so not in MLC-LLM's engine.
    needs_fuselight_runtime: bool = False
    # Rule families (``fuselight.rules.RULES``) that must run in phase 4: the pass emits functions
    # only they schedule.
    rules: tuple[str, ...] = ()


PASSES: dict[str, GraphPass] = {
    p.name: p
    for p in [
        # Before accumulate_matmul_fp32, which rewrites the matmuls FuseAttention matches.
        GraphPass("fuse_attention", "before_fuse_transpose_matmul", FuseAttention),
        GraphPass("accumulate_matmul_fp32", "before_fuse_transpose_matmul", AccumulateMatmulFP32),
        # Before the norm fusions (fuse_norm_gemv, add_rms_norm_kernels), which read its stream; on GPUs its
        # add+RMSNorm functions are RowReduction's where fuse_norm_gemv leaves them.
        GraphPass("residual_stream_fp32", "before_fuse_transpose_matmul", ResidualStreamFP32, rules=("row_reduction",)),
        # After accumulate_matmul_fp32: the fused kernel accumulates as the matmul it replaces.
        GraphPass("fuse_gate_up_silu", "before_fuse_transpose_matmul", FuseGateUpSiLU, rules=("matmul", "gemv")),
        # Moves scales across R.matmul, which FuseTransposeMatmul lowers to TIR.
        GraphPass("property_rewrite", "before_fuse_transpose_matmul", PropertyRewrite),
        GraphPass("paged_attention", "after_graph_passes", PagedAttentionKernels, rules=("paged_attention",)),
        GraphPass("fuse_rope_append", "after_graph_passes", FuseRopeAppend, needs_fuselight_runtime=True),
        # After fuse_rope_append, whose fused decode kernel it tags; not a default: only with CUDA
        # graphs (fuselight.compile.build drops it otherwise).
        GraphPass("capture_whole_step", "after_graph_passes", CaptureWholeStep, needs_fuselight_runtime=True,
                  rules=("paged_attention",)),
        # Before add_rms_norm_kernels, which replaces the norm kernels this pass recognises.
        GraphPass("fuse_norm_gemv", "after_graph_passes", FuseNormIntoGemv, rules=("gemv",)),
        GraphPass("add_rms_norm_kernels", "after_graph_passes", AddRMSNormKernels, rules=("row_reduction",)),
        GraphPass("fusion_plan", "before_legalize", ApplyFusionPlan),
        # The matmul rule builds no kernel for an M above its callers' bound.
        GraphPass("attach_dim_bounds", "before_rules", AttachDimBounds),
    ]
}


# The passes the fuselight pipeline runs by default, in order.
DEFAULT: tuple[str, ...] = (
    "fuse_attention", "accumulate_matmul_fp32", "residual_stream_fp32", "fuse_gate_up_silu", "property_rewrite",
    "paged_attention",
    "fuse_rope_append", "fuse_norm_gemv", "add_rms_norm_kernels", "fusion_plan", "attach_dim_bounds",
)  # fmt: skip


def default() -> list[tvm.transform.Pass]:
    """The default passes (``DEFAULT``) as pass objects, in order."""
    return [get(name).make() for name in DEFAULT]


def get(name: str) -> GraphPass:
    if name not in PASSES:
        raise FuselightError(f"unknown pass {name!r}: expected one of {', '.join(PASSES)}")
    return PASSES[name]


def served(names: Sequence[str], families: Iterable[str]) -> list[str]:
    """``names`` less the passes whose rule families (``GraphPass.rules``) are not all in ``families``."""
    have = set(families)
    return [name for name in names if set(get(name).rules) <= have]


__all__ = ["DEFAULT", "PASSES", "SLOTS", "AccumulateMatmulFP32", "AddRMSNormKernels", "ApplyFusionPlan", "AttachDimBounds", "CaptureWholeStep", "Classify", "FoldNormWeight", "FuseAttention", "FuseGateUpSiLU", "FuseNormIntoGemv", "FuseRopeAppend", "GraphPass", "MergeSiblingMatmuls", "PagedAttentionKernels", "PropertyRewrite", "ResidualStreamFP32", "Slot", "classify_module", "default", "get", "served"]
