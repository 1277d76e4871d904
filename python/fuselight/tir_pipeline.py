"""fuselight's TIR pipelines: TVM's default one, plus programmatic dependent launch (PDL, sm_90+).

A kernel that waits for the grids before it with ``griddepcontrol.wait`` (PTX; ``T.ptx.griddepcontrol``)
can be launched before they finish (CUDA's programmatic stream serialization): once they have all
called ``griddepcontrol.launch_dependents``, or once their blocks have exited where they do not call
it. Its launch latency then overlaps their tail (loads placed before the wait do not: ptxas
schedules the wait first, and where it does not, it may move loads of their outputs above the wait;
L2 prefetches with warp-uniform addresses do run before it, ``rules/gemm/gemv_rows.py``;
``fuselight.pdl_audit`` checks the SASS, ``fuselight audit-pdl`` on the GPU host). TVM's CUDA
runtime launches a kernel that way when its launch parameters carry the
``tirx.use_programtic_dependent_launch`` flag (TVM's spelling), which its default pipeline never
sets for scheduled (``s_tir``) functions.

- ``NAME``: the flag on exactly the device kernels that wait (the decode attention's merge kernel where
  it has one, and a one-row GEMV whose config prefetches weights before its wait: o_proj's);
  kernels that do not wait launch as TVM launches them. Every build uses at least this one.
- ``NAME_EVERY_KERNEL``: first every other kernel waits at its entry, before any memory access, so
  it stays ordered after the kernel before it as without the flag, and then all get the flag: the
  gap between two kernels of a decode step (about 1 us, 258 times a step) shrinks to the wait.
  The fuselight pipeline's builds use it on sm_90 and later (``programmatic_launch_supported``).

Launched normally (any other pipeline) the wait returns at once, so the kernels stay correct; only
the overlap is lost.

Both pipelines also guard TVM's TIR common-subexpression elimination: on TVM 0.26 it makes some
kernels ill-formed ("cse_v22 has been used before definition": the KV cache's ``batch_tree_attn`` of
head-dim-64 models such as Llama-3.2-1B). Where the module fails so, the kernels that fail alone are
lowered again without it (``tirx.disable_cse_tir``), and every other kernel keeps it. Compile with ``tvm.compile(..., tir_pipeline=register(...))``;
``fuselight.compile`` and the benchmarks' builds do.

Both lower with TVM's s_tir passes, running those that decide per statement one host-side branch of a
function at a time (``fuselight.tir_branches``): the same CUDA, in less time for our dynamic-M kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

NAME = "fuselight"
NAME_EVERY_KERNEL = "fuselight-every-kernel"
PARALLEL_SUFFIX = "-parallel"
PDL_FLAG = "tirx.use_programtic_dependent_launch"
_LAUNCH_PARAMS = "tirx.kernel_launch_params"
_DYN_SHARED_FLAG = "tirx.use_dyn_shared_memory"  # must stay the last launch parameter
_WAIT_OP = "tirx.ptx.griddepcontrol_wait"


def waits_for_previous_grid(func: Any) -> bool:
    """Whether the PrimFunc ``func`` executes ``griddepcontrol.wait``."""
    import tvm
    from tvm import tirx

    found = []

    def visit(node: Any) -> None:
        if isinstance(node, tvm.ir.Call) and getattr(node.op, "name", "") == _WAIT_OP:
            found.append(node)

    tirx.stmt_functor.post_order_visit(func.body, visit)
    return bool(found)


def with_programmatic_launch(params: list[str]) -> list[str]:
    """Launch parameters ``params`` with the PDL flag added (before the dynamic shared memory one)."""
    if PDL_FLAG in params:
        return list(params)
    if params and params[-1] == _DYN_SHARED_FLAG:
        return [*params[:-1], PDL_FLAG, _DYN_SHARED_FLAG]
    return [*params, PDL_FLAG]


def _kernel_pass(name: str, update: Callable[[Any], Any]) -> Any:
    """A module pass over device functions: each kernel (a PrimFunc with launch parameters) becomes
    ``update(kernel)``, which returns it unchanged where it has nothing to do."""
    import tvm
    from tvm import tirx

    @tvm.transform.module_pass(opt_level=0, name=name)
    def run(mod: Any, _ctx: Any) -> Any:
        kernels = {gv: func for gv, func in mod.functions.items()
                   if isinstance(func, tirx.PrimFunc) and func.attrs is not None and _LAUNCH_PARAMS in func.attrs}
        for gv, func in kernels.items():
            mod[gv] = update(func)
        return mod

    return run


def mark_programmatic_launch() -> Any:
    """A module pass over device functions: the PDL flag on every kernel that waits for the previous grid."""

    def mark(func: Any) -> Any:
        if not waits_for_previous_grid(func):
            return func
        params = [str(p) for p in func.attrs[_LAUNCH_PARAMS]]
        return func.with_attr(_LAUNCH_PARAMS, with_programmatic_launch(params))

    return _kernel_pass("fuselight.MarkProgrammaticLaunch", mark)


def wait_at_kernel_entry() -> Any:
    """A module pass over device functions: every kernel that does not wait for the previous grid
    waits at its entry, before any memory access (so it is ordered after the grid before it as it
    is without the flag), and then gets the PDL flag from ``mark_programmatic_launch``."""
    from tvm import tirx

    def wait(func: Any) -> Any:
        if waits_for_previous_grid(func):
            return func
        return func.with_body(tirx.SeqStmt([tirx.Evaluate(tirx.call_intrin("", _WAIT_OP)), func.body]))

    return _kernel_pass("fuselight.WaitAtKernelEntry", wait)


def programmatic_launch_supported(kind: str, arch: str | None) -> bool:
    """Whether kernels of a ``kind`` target of ``arch`` (``sm_90``) can wait for the grid before them:
    its device description has griddepcontrol (an arch without a description, or one fuselight does
    not read as ``sm_XX``, cannot)."""
    from .device import device_model
    from .errors import FuselightError
    from .target import arch_number

    if kind != "cuda" or arch is None:
        return False
    try:
        device = device_model(f"sm_{arch_number(arch)}")
    except FuselightError:
        return False
    return device is not None and device.has("griddepcontrol")


def _s_tir_lowering(entry_function: bool = True) -> Any:
    """TVM 0.26's s_tir lowering (``tvm/s_tir/pipeline.py``, pass for pass; a test compares the two),
    with the passes that decide per statement run one host-side branch at a time
    (``tir_branches.per_branch``): they are superlinear in a function's branches, and our dynamic-M
    GEMMs carry up to 12. The CUDA they produce is the same.

    ``entry_function`` False leaves out AnnotateEntryFunc, the one pass that looks at the whole module
    (a module of one PrimFunc makes it the entry): for lowering a part of a module that was annotated whole.
    """
    import tvm
    from tvm import s_tir, tirx

    from .tir_branches import per_branch

    @tvm.transform.module_pass(opt_level=0, name="fuselight.Lowering")
    def run(mod: Any, _ctx: Any) -> Any:
        config = tvm.transform.PassContext.current().config

        def flag(key: str) -> bool:
            return bool(config.get(key, False))

        before_flatten = [
            s_tir.transform.CanonicalizeLoop(), s_tir.transform.LowerCrossThreadReduction(),
            s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
            s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.LiftThreadBinding(),
            s_tir.transform.ManifestSharedMemoryLocalStage(), s_tir.transform.CompactBufferAllocation(),
            s_tir.transform.LowerAutoCopy(), s_tir.transform.UnifyThreadBinding(),
            s_tir.transform.LowerMatchBuffer(), tirx.transform.StmtSimplify(),
            s_tir.transform.InjectPermutedLayout(), s_tir.transform.AnnotateIrregularLoop(),
            s_tir.transform.InjectSoftwarePipeline(), s_tir.transform.TransformMmaBufferLayout(),
        ]
        # Whole functions: NarrowDataType picks one index width and StorageRewrite one vector type of
        # a buffer for all branches.
        whole = [
            s_tir.transform.LowerOpaqueBlock(), tirx.transform.FlattenBuffer(),
            tirx.transform.BF16ComputeLegalize(), tirx.transform.NarrowDataType(32),
            s_tir.transform.LoopPartition(), tirx.transform.VectorizeLoop(not flag("tirx.disable_vectorize")),
            s_tir.transform.InjectVirtualThread(), s_tir.transform.InjectDoubleBuffer(),
            *([] if flag("tirx.disable_storage_rewrite") else [tirx.transform.StorageRewrite()]),
            *([s_tir.transform.LowerAsyncDMA()] if flag("tirx.use_async_copy") else []),
        ]
        after_storage = [
            s_tir.transform.HoistIfThenElse(), tirx.transform.UnrollLoop(),
            s_tir.transform.RenormalizeSplitPattern(), tirx.transform.StmtSimplify(),
            tirx.transform.RemoveNoOp(), s_tir.transform.RewriteUnsafeSelect(),
        ]
        # Whole functions from here: CommonSubexprElim numbers its variables over a function.
        rest = [
            *([s_tir.transform.InstrumentBoundCheckers()] if flag("tirx.instrument_bound_checkers") else []),
            *([s_tir.transform.InjectPTXLDG32(True)] if flag("tirx.ptx.ldg32") else []),
            *([] if flag(_CSE_CONFIG) else [tirx.transform.CommonSubexprElim()]),
            *([s_tir.transform.InstrumentProfileIntrinsics()] if flag("tirx.instrument_lwp") else []),
            tirx.transform.FP8ComputeLegalize(), s_tir.transform.VerifyVTCMLimit(),
            s_tir.transform.LowerVtcmAlloc(), tirx.transform.VerifyMemory(),
            *([tirx.transform.AnnotateEntryFunc()] if entry_function else []),
            s_tir.transform.ThreadSync("shared"), s_tir.transform.ThreadSync("shared.dyn"),
            s_tir.transform.ThreadSync("warp"), s_tir.transform.InferFragment(),
            s_tir.transform.LowerThreadAllreduce(),
            *([s_tir.transform.InjectPTXAsyncCopy()] if flag("tirx.use_async_copy") else []),
            *([s_tir.transform.InjectPTXLDG32()] if flag("tirx.ptx.ldg32") else []),
            s_tir.transform.MergeSharedMemoryAllocations(), tirx.transform.SplitHostDevice(),
            tirx.transform.MakePackedAPI(), tirx.transform.FP8StorageLegalize(),
            tirx.transform.BF16StorageLegalize(),
        ]
        return tvm.ir.transform.Sequential(
            [per_branch(before_flatten), *whole, per_branch(after_storage), *rest])(mod)

    return run


_CSE_CONFIG = "tirx.disable_cse_tir"
_CSE_FAILURE = "has been used before definition"


def _cse_guarded(pipeline: Any) -> Any:
    """``pipeline`` (TVM's TIR lowering), with CSE left out only for the PrimFuncs it breaks."""
    import tvm
    from tvm import tirx

    def lower(mod: Any, cse: bool) -> Any:
        ctx = tvm.transform.PassContext.current()
        config = {**{str(k): v for k, v in ctx.config.items()}, _CSE_CONFIG: not cse}
        with tvm.transform.PassContext(opt_level=ctx.opt_level, config=config):
            return pipeline(mod)

    def broken(mod: Any, gv: Any) -> bool:
        try:
            lower(mod.__class__({gv: mod[gv]}, attrs=mod.attrs), cse=True)
        except tvm.error.InternalError as err:
            return _CSE_FAILURE in str(err)
        return False

    @tvm.transform.module_pass(opt_level=0, name="fuselight.CSEGuardedLowering")
    def run(mod: Any, ctx: Any) -> Any:
        if bool(ctx.config.get(_CSE_CONFIG, False)):
            return pipeline(mod)
        try:
            return pipeline(mod)
        except tvm.error.InternalError as err:
            if _CSE_FAILURE not in str(err):
                raise
        bad = {gv for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc) and broken(mod, gv)}
        rest = mod.__class__({gv: f for gv, f in mod.functions.items() if gv not in bad}, attrs=mod.attrs)
        lowered = lower(rest, cse=True)
        lowered.update(lower(mod.__class__({gv: mod[gv] for gv in bad}, attrs=mod.attrs), cse=False))
        return lowered

    return run


def _on_kernels(passes: Any) -> Any:
    """A module pass running ``passes`` over the device functions of a lowered module (as TVM's build
    runs the finalization passes over its device modules), the host functions unchanged."""
    import tvm
    from tvm.tirx.build import split_host_device_mods

    @tvm.transform.module_pass(opt_level=0, name="fuselight.FinalizeKernels")
    def run(mod: Any, _ctx: Any) -> Any:
        host, devices = split_host_device_mods(mod)
        out = tvm.IRModule(dict(host.functions.items()), attrs=mod.attrs)
        for device in devices.values():
            out.update(passes(device))
        return out

    return run


def register(every_kernel: bool = False, parallel: bool = False) -> str:
    """Register ``NAME_EVERY_KERNEL`` if ``every_kernel``, else ``NAME`` (once; idempotent); return its name.

    ``parallel`` (the name gets ``PARALLEL_SUFFIX``): lower in ``cuda_compile.compile_jobs()``
    processes, and put the kernels in several CUDA units for nvcc (``compile_units``). The same kernels;
    the baseline's builds lower as TVM does, in one process and one unit.
    """
    import tvm
    from tvm.tirx import compilation_pipeline

    name = (NAME_EVERY_KERNEL if every_kernel else NAME) + (PARALLEL_SUFFIX if parallel else "")
    if name in compilation_pipeline.PIPELINE_MAP:
        return name

    def factory() -> tuple[Any, Any, Any]:
        _, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")

        def device_passes() -> Any:
            waits = [wait_at_kernel_entry()] if every_kernel else []
            return tvm.ir.transform.Sequential([finalize_device(), *waits, mark_programmatic_launch()])

        if not parallel:
            return _cse_guarded(_s_tir_lowering()), finalize_host, device_passes
        from .compile_units import assign_compile_units
        from .cuda_compile import compile_jobs
        from .forked_passes import in_processes

        # The entry function is chosen over the whole module, the rest per function; the kernels'
        # finalization is per function too, so it runs in the lowering's processes.
        per_function = tvm.ir.transform.Sequential(
            [_cse_guarded(_s_tir_lowering(entry_function=False)), _on_kernels(device_passes())])
        parallel_lowering = tvm.ir.transform.Sequential([
            tvm.tirx.transform.AnnotateEntryFunc(), in_processes(per_function, compile_jobs(), name="LowerInProcesses"),
            assign_compile_units(),
        ])
        return parallel_lowering, finalize_host, lambda: tvm.ir.transform.Sequential([])

    compilation_pipeline.register_tir_pipeline(name, factory)
    return name
