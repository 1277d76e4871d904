"""Tensor-core GEMM templates for matmuls whose M (tokens) is only known at run time.

``operands`` says what a template computes (the contract between the Matmul rule's analysis and
the templates); the templates write a kernel body over the analysed function's own buffers, so the
rule keeps the function's signature and any fused epilogue.
"""

from __future__ import annotations

from typing import Any

from .mma_sync import mma_sync_gemm
from .operands import GemmOperands
from .plan import GemmPlan
from .wgmma import WgmmaPlan, wgmma_gemm
from .wgmma_q4 import WgmmaQ4Plan, wgmma_q4_gemm


def gemm_body(ops: GemmOperands, plan: GemmPlan | WgmmaPlan | WgmmaQ4Plan) -> Any:
    """The kernel body (a ``tvm.tirx.Stmt``) of ``plan``'s template for ``ops``."""
    if isinstance(plan, WgmmaQ4Plan):
        return wgmma_q4_gemm(ops, plan.tile)
    if isinstance(plan, WgmmaPlan):
        return wgmma_gemm(ops, plan.tile, plan.split_k)
    return mma_sync_gemm(ops, plan)
