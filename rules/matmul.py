"""Matmul: schedule linear-layer PrimFuncs (dynamic M) with fuselight's tensor-core GEMM templates.

``analyze`` (``rules.gemm.analysis``) recognises a matmul with its fused elementwise epilogue and
folds the epilogue into one expression of the fp32 accumulator. ``schedule`` asks the dispatcher
(``rules.gemm.dispatch``) which plan serves which range of M (the mma.sync template with split-K
where M is too small to fill the GPU, the Hopper wgmma template above) and writes the template's
body for each, behind a host-side branch on M, over the function's own buffers: the signature,
the parameters and the epilogue stay, the intermediates vanish. A symbolic M of at most the GEMV
config's largest bucket (16 rows) branches into the GEMV template instead (``rules.gemv``), one
kernel per bucket. Functions whose M is a small constant (decode GEMVs, below ``min_static_m`` of
the dispatch config) and targets without a config are left to the next rule. A paired epilogue
(``passes.fuse_gate_up_silu``: ``silu(gate) * up`` of a gate+up projection) is priced as the plain
GEMM of the same N and K, among the plans whose template takes one (wgmma; mma.sync does not yet).
A B computed by a 4-bit group dequantize (MLC-LLM's ``q4f16_1``: ``rules.gemm.dequant``) runs the
plans of ``configs/gemm/mma_sync_q4.json``: at large M the wgmma template, whose producer warpgroup
streams the packed words and scales and dequantizes them into the slots' B tiles (static N), else
(and for a symbolic N: the quantized LM head) the mma.sync template, which dequantizes them in
shared memory between its mmas; one neither can serve (another packing, a zero-point buffer, a
group no multiple of 32) is left to DLight.
"""

from __future__ import annotations

from tvm import tirx
from tvm.target import Target

from ..errors import FuselightError
from ..target import arch_of
from .base import AnalyzeScheduleRule, branch_on, built_once, dim_upper_bound, host_branch, with_kernels
from .gemm import gemm_body
from .gemm.analysis import MatmulDesc, analyze_matmul
from .gemm.dispatch import plan_ranges, q4_plan_ranges
from .gemm.estimate import load_dispatch
from .gemm.gemv import body_config
from .gemv import gemv_kernel, symbolic_m_buckets


class Matmul(AnalyzeScheduleRule):
    """Swap matmul functions for the tensor-core GEMM templates (see the module docstring)."""

    family = "matmul"

    @staticmethod
    def analyze(func: tirx.PrimFunc) -> MatmulDesc | None:
        """The GEMM and fused epilogue ``func`` computes, or None."""
        return analyze_matmul(func, dequant=True)

    @classmethod
    def supports(cls, desc: MatmulDesc, target: Target) -> bool:
        """Whether ``schedule`` builds ``desc`` on ``target``: a GEMM config for the arch, M not left
        to the Gemv rule, and a plan for every M (from the plans for a dequantized B where it is one)."""
        try:
            dispatch = load_dispatch(arch_of(target))
            if desc.m_static is not None and desc.m_static < dispatch.min_static_m:
                return False
            ops = desc.operands
            return bool(plan_ranges(ops, dispatch) if ops.dequant is None else q4_plan_ranges(ops, arch_of(target)))
        except FuselightError:
            return False

    def schedule(self, func: tirx.PrimFunc, desc: MatmulDesc, target: Target) -> tirx.PrimFunc | None:
        """``func`` with its body replaced by the kernels for ``desc`` on ``target``, or None where the
        templates do not serve it."""
        try:
            dispatch = load_dispatch(arch_of(target))
        except FuselightError:
            return None  # no GEMM config for this arch
        if desc.m_static is not None and desc.m_static < dispatch.min_static_m:
            return None
        ops = desc.operands
        # A dequantized B: the mma.sync template's plans for it (configs/gemm/mma_sync_q4.json).
        ranges = plan_ranges(ops, dispatch) if ops.dequant is None else q4_plan_ranges(ops, arch_of(target))
        if not ranges:
            return None
        # A symbolic M of a few rows runs the GEMV template (one kernel at weight-streaming
        # bandwidth, where the GEMM plans there split K over a second, reducing launch).
        gemv = symbolic_m_buckets(ops, target) if desc.m_static is None else []
        if gemv:
            ranges = [r for r in ranges[:-1] if r[0] > gemv[-1][0]] + ranges[-1:]
        # Host-side branches on M: the last range serves every larger M; none above the M the
        # function's callers allow.
        gemm = built_once(lambda plan: gemm_body(ops, plan))
        gemv_bucket = built_once(lambda cfg: gemv_kernel(ops, cfg, target))
        body = branch_on(ops.m, [
            *((upper, lambda cfg=cfg: gemv_bucket(body_config(ops, cfg))) for upper, cfg in gemv),
            *((upper, lambda plan=plan: gemm(plan)) for upper, plan in ranges),
        ], None if desc.m_static is not None else dim_upper_bound(func, ops.m))
        if desc.m_static is None:
            body = host_branch(ops.m > 0, body)  # no empty grids
        return with_kernels(func, body)
