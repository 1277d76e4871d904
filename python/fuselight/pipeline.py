"""The Relax pipelines: MLC-LLM's compilation ("fuselight_baseline") and fuselight's ("fuselight").

The baseline is MLC-LLM's "mlc_llm" pipeline for a model with no sampling functions and no pipeline
parallelism (weights in float or in MLC's 4-bit group schemes), in MLC's order and phases:

0. attach information (target, variable bounds, memory-planning and CUDA-graph hints);
1. graph passes (FuseAddRMSNorm on GPUs, FuseTransposeMatmul);
2. TVM's lowering to TIR (LegalizeOps ... FuseTIR);
3. TIR passes (each dequantize fused into the matmul or take reading it, DeadCodeElimination,
   CleanUpTIRAttrs);
4. scheduling (LowBatchGemvSpecialize, then DLight's default rules; none on llvm, see
   ``fuselight.rules.dlight_defaults``);
5. lowering to VM code (LiftTIRGlobalBufferAlloc ... AttachGlobalSymbol).

MLC-LLM's own pass objects are used when ``fuselight.mlc.import_mlc_llm()`` finds MLC-LLM, and
fuselight's equivalents (``fuselight.baseline``) otherwise; ``BASELINE_PASSES`` says which MLC passes
have an equivalent and which do not apply. The fuselight pipeline is the baseline plus fuselight's
graph passes in phase 1 (``fuselight.passes``), the lowering of its fusion plan at the start of
phase 2 (groups outlined for FuseTIR, ahead of LegalizeOps and FuseOps), and fuselight's schedule
rules first in phase 4 (``fuselight.rules``): ahead of LowBatchGemvSpecialize, which would
otherwise schedule every dynamic-M matmul with DLight's Matmul before any rule of ours saw it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from . import mlc
from .baseline.debug_dump import DebugDump
from .errors import FuselightError
from .forked_passes import rules_in_processes
from .passes import DEFAULT as DEFAULT_PASSES
from .passes import get as get_graph_pass
from .passes import served
from .rules import dlight_defaults, families_of, fuselight_rules

if TYPE_CHECKING:
    from tvm.s_tir.dlight import ScheduleRule

Ours = Literal["equivalent", "absent", "tvm"]


@dataclasses.dataclass(frozen=True)
class PassInfo:
    """One pass of MLC-LLM's pipeline and what the baseline runs for it.

    ours: "equivalent" (MLC's pass, or fuselight's version of it without MLC-LLM), "tvm" (a TVM
    pass, run as MLC runs it) or "absent" (not run: it does not apply to fuselight's models).
    when: the condition under which MLC runs it ("" for always).
    """

    name: str
    phase: int
    ours: Ours
    note: str = ""
    when: str = ""


BASELINE_PASSES: list[PassInfo] = [
    PassInfo("DispatchKVCacheCreation", 0, "absent", "our model creates TVM's TIR paged KV cache directly"),
    PassInfo("AttachSoftmaxWithTemperature", 0, "absent", "sampling helper for MLC's serving engine"),
    PassInfo("AttachVariableBounds", 0, "equivalent", "upper bounds of symbolic dims for memory planning"),
    PassInfo("AttachCUDAGraphSymbolicCaptureHints", 0, "equivalent"),
    PassInfo("AttachPipelineParallelStages", 0, "absent", "no pipeline parallelism"),
    PassInfo("AttachLogitProcessFunc", 0, "absent", "sampling helper for MLC's serving engine"),
    PassInfo("AttachAdditionalPrimFuncs", 0, "absent", "no extra PrimFuncs"),
    PassInfo("AttachAllocEmbeddingTensorFunc", 0, "absent", "MLC engine helper"),
    PassInfo("AttachGPUSamplingFunc", 0, "absent", "sampling helper for MLC's serving engine"),
    PassInfo("AttachSpecDecodeAuxFuncs", 0, "absent", "no speculative decoding"),
    PassInfo("AttachMemoryPlanAttr", 0, "equivalent"),
    PassInfo("AttachSequenceLengthPaddingFactor", 0, "absent", "only for CUTLASS FP8 GEMMs on sm_100a"),
    PassInfo("BindTarget", 0, "tvm"),
    PassInfo("DispatchTritonKernel", 1, "absent", "no Triton kernels"),
    PassInfo("FuseFTDequantizeEpilogue", 1, "absent", "no FasterTransformer quantization (q4f16_ft)"),
    PassInfo("FuseDequantizeTranspose", 1, "absent",
             "never fires on our graphs: no dequantize PrimFunc with a transpose stage"),
    PassInfo("BLASDispatch", 1, "absent", "cuBLAS is not in the TVM wheel", "cublas_gemm"),
    PassInfo("FuseAddRMSNorm", 1, "equivalent", "one kernel per row for hidden % 1024 == 0", "non-llvm targets"),
    PassInfo("FuseTransposeMatmul", 1, "equivalent", "matmul(x, permute_dims(w)) -> NT_matmul"),
    PassInfo("DispatchSampling", 2, "tvm"),
    PassInfo("DispatchSortScan", 2, "tvm"),
    PassInfo("LegalizeOps", 2, "tvm"),
    PassInfo("AnnotateTIROpPattern", 2, "tvm"),
    PassInfo("FoldConstant", 2, "tvm"),
    PassInfo("FuseOps", 2, "tvm"),
    PassInfo("FuseTIR", 2, "tvm"),
    PassInfo("FuseDequantizeMatmulEwise", 3, "equivalent",
             "a dequantize into the matmul reading it (by name, as MLC, or by what each computes)"),
    PassInfo("FuseDequantizeTake", 3, "equivalent", "the embedding's dequantize into its take, gathered rows only"),
    PassInfo("DeadCodeElimination", 3, "tvm"),
    PassInfo("CleanUpTIRAttrs", 3, "equivalent", "drops op_pattern"),
    PassInfo("LowBatchGemvSpecialize", 4, "equivalent", "m <= 2, m <= 8 LowBatchGEMV, else Matmul"),
    PassInfo("ApplyDefaultSchedule", 4, "tvm",
             "DLight: Matmul, GEMV, Reduction, GeneralReduction, Fallback; on llvm MLC's cpu.GEMV is left out "
             "(its kernels take LLVM minutes each to compile on TVM 0.26)"),
    PassInfo("LiftTIRGlobalBufferAlloc", 5, "equivalent", "", "non-llvm targets"),
    PassInfo("ForceNarrowIndexToInt32", 5, "tvm", "", "non-cuda targets"),
    PassInfo("ScatterTupleGetItem", 5, "equivalent"),
    PassInfo("PipelineParallelRewrite", 5, "absent", "no pipeline parallelism"),
    PassInfo("RewriteDataflowReshape", 5, "tvm"),
    PassInfo("ToNonDataflow", 5, "tvm"),
    PassInfo("RemovePurityChecking", 5, "tvm"),
    PassInfo("CallTIRRewrite", 5, "tvm"),
    PassInfo("IPCAllReduceRewrite", 5, "absent", "single GPU", "allreduce_strategy"),
    PassInfo("StaticPlanBlockMemory", 5, "tvm"),
    PassInfo("AttachMetadataWithMemoryUsage", 5, "absent", "metadata for MLC's serving engine"),
    PassInfo("RewriteCUDAGraph", 5, "tvm", "active with the pass config relax.backend.use_cuda_graph (fuselight compile: on for cuda, as MLC-LLM's O2, unless every kernel launches programmatically)"),
    PassInfo("AttachCUDAGraphAllocInitFunc", 5, "equivalent"),
    PassInfo("LowerGPUIPCAllocStorage", 5, "tvm"),
    PassInfo("LowerAllocTensor", 5, "tvm"),
    PassInfo("KillAfterLastUse", 5, "tvm"),
    PassInfo("LowerRuntimeBuiltin", 5, "tvm"),
    PassInfo("VMShapeLower", 5, "tvm"),
    PassInfo("AttachGlobalSymbol", 5, "tvm"),
    PassInfo("AttachExternModules", 5, "absent", "no external modules"),
]

# Where each "equivalent" pass lives: module under mlc_llm.compiler_pass, module under fuselight.baseline.
_EQUIVALENT_MODULES: dict[str, tuple[str, str]] = {
    "AttachVariableBounds": ("attach_support_info", "attach_variable_bounds"),
    "AttachCUDAGraphSymbolicCaptureHints": ("attach_support_info", "attach_cuda_graph_capture_hints"),
    "AttachMemoryPlanAttr": ("attach_support_info", "attach_memory_plan_attr"),
    "FuseAddRMSNorm": ("fuse_add_norm", "fuse_add_rms_norm"),
    "FuseTransposeMatmul": ("fuse_transpose_matmul", "fuse_transpose_matmul"),
    "FuseDequantizeMatmulEwise": ("fuse_dequantize_matmul_ewise", "fuse_dequantize_matmul_ewise"),
    "FuseDequantizeTake": ("fuse_dequantize_take", "fuse_dequantize_take"),
    "CleanUpTIRAttrs": ("clean_up_tir_attrs", "clean_up_tir_attrs"),
    "LowBatchGemvSpecialize": ("low_batch_specialization", "low_batch_gemv_specialize"),
    "LiftTIRGlobalBufferAlloc": ("lift_global_buffer_alloc", "lift_global_buffer_alloc"),
    "ScatterTupleGetItem": ("scatter_tuple_get_item", "scatter_tuple_get_item"),
    "AttachCUDAGraphAllocInitFunc": ("attach_cuda_graph_alloc_init_func", "attach_cuda_graph_alloc_init_func"),
}


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pass of a pipeline as built for a target: its phase, its name, the pass."""

    phase: int
    name: str
    pass_: tvm.transform.Pass


def use_mlc_passes(use_mlc: bool | None = None) -> bool:
    """Whether the baseline runs MLC-LLM's pass objects: ``use_mlc``, or whether MLC-LLM is found if None."""
    if use_mlc is False:
        return False  # no need to look for (or import) MLC-LLM at all
    found = mlc.import_mlc_llm() is not None
    if use_mlc and not found:
        raise FuselightError(
            f"MLC-LLM is not available: install mlc_llm or set {mlc.SOURCE_ENV} to an MLC-LLM source checkout"
        )
    return found if use_mlc is None else use_mlc


def baseline_source(use_mlc: bool | None = None) -> str:
    """``"mlc-llm@<commit or version>"`` when the baseline runs MLC-LLM's passes, else ``"fuselight-equivalents"``."""
    if use_mlc_passes(use_mlc):
        return mlc.describe(mlc.import_mlc_llm())
    return "fuselight-equivalents"


def stages(
    target: tvm.target.Target,
    *,
    use_mlc: bool | None = None,
    graph_passes: Sequence[str] = (),
    rules: Sequence[ScheduleRule] | None = None,
    variable_bounds: Mapping[str, int] | None = None,
    cuda_graph_capture_hints: Mapping[str, Sequence[str]] | None = None,
) -> list[Stage]:
    """The passes a pipeline runs for ``target``, in order.

    ``graph_passes`` (names from ``fuselight.passes``) go into phase 1 at their slot; ``rules`` are
    tried first in phase 4, before LowBatchGemvSpecialize and DLight's defaults (None or empty: the
    baseline's phase 4).
    """
    from_mlc = use_mlc_passes(use_mlc)
    ours = [get_graph_pass(name) for name in graph_passes]
    gpu = target.kind.name != "llvm"

    def equivalent(name: str, *args):
        mlc_module, our_module = _EQUIVALENT_MODULES[name]
        package = "mlc_llm.compiler_pass" if from_mlc else "fuselight.baseline"
        cls = getattr(importlib.import_module(f"{package}.{mlc_module if from_mlc else our_module}"), name)
        return cls(*args)

    def slot(which: str, phase: int = 1) -> list[tuple[int, str, tvm.transform.Pass]]:
        return [(phase, p.name, p.make()) for p in ours if p.slot == which]

    rt = relax.transform
    passes: list[tuple[int, str, tvm.transform.Pass] | None] = [
        (0, "AttachVariableBounds", equivalent("AttachVariableBounds", dict(variable_bounds or {}))),
        (0, "AttachCUDAGraphSymbolicCaptureHints",
         equivalent("AttachCUDAGraphSymbolicCaptureHints", dict(cuda_graph_capture_hints or {}))),
        (0, "AttachMemoryPlanAttr", equivalent("AttachMemoryPlanAttr")),
        (0, "BindTarget", tvm.tirx.transform.BindTarget(target)),
        (1, "FuseAddRMSNorm", equivalent("FuseAddRMSNorm", target)) if gpu else None,
        *slot("before_fuse_transpose_matmul"),
        (1, "FuseTransposeMatmul", equivalent("FuseTransposeMatmul")),
        *slot("after_graph_passes"),
        (2, "DispatchSampling", relax.backend.DispatchSampling()),
        (2, "DispatchSortScan", relax.backend.DispatchSortScan()),
        *slot("before_legalize", phase=2),
        (2, "LegalizeOps", rt.LegalizeOps()),
        (2, "AnnotateTIROpPattern", rt.AnnotateTIROpPattern()),
        (2, "FoldConstant", rt.FoldConstant()),
        (2, "FuseOps", rt.FuseOps()),
        (2, "FuseTIR", rt.FuseTIR()),
        (3, "FuseDequantizeMatmulEwise", equivalent("FuseDequantizeMatmulEwise")),
        (3, "FuseDequantizeTake", equivalent("FuseDequantizeTake")),
        (3, "DeadCodeElimination", rt.DeadCodeElimination()),
        (3, "CleanUpTIRAttrs", equivalent("CleanUpTIRAttrs", ["op_pattern"])),
        *slot("before_rules", phase=4),
        # Rules schedule each function alone: over the host's cores.
        (4, "ApplyFuselightRules", rules_in_processes(rules, "ApplyFuselightRules")) if rules else None,
        (4, "LowBatchGemvSpecialize", equivalent("LowBatchGemvSpecialize")),
        (4, "ApplyDefaultSchedule", dl.ApplyDefaultSchedule(*dlight_defaults(target))),
        (5, "LiftTIRGlobalBufferAlloc", equivalent("LiftTIRGlobalBufferAlloc")) if gpu else None,
        (5, "ForceNarrowIndexToInt32", tvm.tirx.transform.ForceNarrowIndexToInt32())
        if target.kind.name != "cuda" else None,
        (5, "ScatterTupleGetItem", equivalent("ScatterTupleGetItem")),
        (5, "RewriteDataflowReshape", rt.RewriteDataflowReshape()),
        (5, "ToNonDataflow", rt.ToNonDataflow()),
        (5, "RemovePurityChecking", rt.RemovePurityChecking()),
        (5, "CallTIRRewrite", rt.CallTIRRewrite()),
        (5, "StaticPlanBlockMemory", rt.StaticPlanBlockMemory()),
        (5, "RewriteCUDAGraph", rt.RewriteCUDAGraph()),
        (5, "AttachCUDAGraphAllocInitFunc", equivalent("AttachCUDAGraphAllocInitFunc")),
        (5, "LowerGPUIPCAllocStorage", rt.LowerGPUIPCAllocStorage()),
        (5, "LowerAllocTensor", rt.LowerAllocTensor()),
        (5, "KillAfterLastUse", rt.KillAfterLastUse()),
        (5, "LowerRuntimeBuiltin", rt.LowerRuntimeBuiltin()),
        (5, "VMShapeLower", rt.VMShapeLower()),
        (5, "AttachGlobalSymbol", rt.AttachGlobalSymbol()),
    ]
    return [Stage(*p) for p in passes if p is not None]


def baseline_pipeline(
    target: tvm.target.Target | None = None,
    *,
    use_mlc: bool | None = None,
    variable_bounds: Mapping[str, int] | None = None,
    cuda_graph_capture_hints: Mapping[str, Sequence[str]] | None = None,
    debug_dump: Path | None = None,
) -> tvm.transform.Pass:
    """MLC-LLM's pipeline (see the module docstring) for ``target`` (None: the target in scope when run).

    use_mlc: True requires MLC-LLM's passes, False uses fuselight's equivalents, None picks MLC's when found.
    variable_bounds: upper bounds of symbolic dims by name (e.g. ``{"seq_len": 4096}``), for memory planning.
    cuda_graph_capture_hints: Relax function name -> symbolic dims CUDA graphs are captured per value of.
    debug_dump: a folder to write the module to after each phase (``debug-phase<N>.py``).
    """
    use_mlc_passes(use_mlc)  # fail now, not when the pipeline runs

    def make(bound: tvm.target.Target) -> list[Stage]:
        return stages(bound, use_mlc=use_mlc, variable_bounds=variable_bounds,
                      cuda_graph_capture_hints=cuda_graph_capture_hints)

    return _pipeline("fuselight_baseline", target, make, debug_dump)


def fuselight_pipeline(
    target: tvm.target.Target | None = None,
    *,
    passes: Sequence[str] | None = None,
    rules: Sequence[ScheduleRule] | None = None,
    use_mlc: bool | None = None,
    variable_bounds: Mapping[str, int] | None = None,
    cuda_graph_capture_hints: Mapping[str, Sequence[str]] | None = None,
    debug_dump: Path | None = None,
) -> tvm.transform.Pass:
    """The baseline with fuselight's graph passes in phase 1 and its schedule rules first in phase 4.

    passes: names from ``fuselight.passes`` (None: ``fuselight.passes.DEFAULT``, less the passes whose
    rule families are not among ``rules``; see ``graph_passes``).
    rules: the rules tried first in phase 4, DLight's defaults following (None: ``fuselight.rules.fuselight_rules()``).
    Other arguments as for ``baseline_pipeline``.
    """
    use_mlc_passes(use_mlc)
    rules = list(rules) if rules is not None else fuselight_rules()
    names = graph_passes(passes, rules)

    def make(bound: tvm.target.Target) -> list[Stage]:
        return stages(bound, use_mlc=use_mlc, graph_passes=names, rules=rules,
                      variable_bounds=variable_bounds, cuda_graph_capture_hints=cuda_graph_capture_hints)

    return _pipeline("fuselight", target, make, debug_dump)


def graph_passes(passes: Sequence[str] | None, rules: Sequence[ScheduleRule] | None) -> list[str]:
    """The graph passes a fuselight pipeline with ``rules`` (None: all of fuselight's) runs: ``passes``,
    each checked, or (None) the defaults whose rule families (``GraphPass.rules``) are all among
    ``rules``: what such a pass emits unscheduled only those rules schedule (DLight's Matmul rule
    fails on a paired epilogue). A named pass whose rule families are missing is an error."""
    families = families_of(rules if rules is not None else fuselight_rules())
    if passes is None:
        return served(DEFAULT_PASSES, families)
    for name in passes:
        missing = [f for f in get_graph_pass(name).rules if f not in families]  # unknown names fail here too
        if missing:
            raise FuselightError(f"pass {name!r} needs the rule families {', '.join(missing)}, which this pipeline leaves out")
    return list(passes)


def _pipeline(
    name: str,
    target: tvm.target.Target | None,
    make_stages: Callable[[tvm.target.Target], list[Stage]],
    debug_dump: Path | None,
) -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name=name)
    def run(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        built = make_stages(target or tvm.target.Target.current(allow_none=False))
        sequence: list[tvm.transform.Pass] = []
        for i, stage in enumerate(built):
            sequence.append(stage.pass_)
            last_of_phase = i + 1 == len(built) or built[i + 1].phase != stage.phase
            if debug_dump is not None and last_of_phase:
                sequence.append(DebugDump(debug_dump, f"debug-phase{stage.phase}.py"))
        return tvm.transform.Sequential(sequence)(mod)

    return run


def _register() -> None:
    # A module reimported (e.g. by importlib.reload) must not register twice: TVM refuses a name twice.
    for name, factory in (("fuselight_baseline", baseline_pipeline), ("fuselight", fuselight_pipeline)):
        if name not in relax.pipeline.PIPELINE_MAP:
            relax.register_pipeline(name)(factory)


_register()
