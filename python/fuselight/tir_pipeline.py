"""fuselight's TIR pipeline: TVM's default one, plus programmatic dependent launch where a kernel asks.

A kernel that waits for the grids before it with ``griddepcontrol.wait`` (PTX; ``T.ptx.griddepcontrol``)
can be launched before they finish, once they have all called ``griddepcontrol.launch_dependents``
(CUDA's programmatic stream serialization): its launch latency and whatever it does before the wait
overlap their tail. TVM's CUDA runtime launches a kernel that way when its launch parameters carry
the ``tirx.use_programtic_dependent_launch`` flag (TVM's spelling), which its default pipeline never
sets for scheduled (``s_tir``) functions; this pipeline sets it on exactly the device kernels that
wait. Launched normally (any other pipeline) the wait returns at once, so the kernels stay correct;
only the overlap is lost.

Compile with ``tvm.compile(..., tir_pipeline=fuselight.tir_pipeline.NAME)`` (``register()`` first);
``fuselight.compile`` and the benchmarks' builds do.
"""

from __future__ import annotations

from typing import Any

NAME = "fuselight"
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


def mark_programmatic_launch() -> Any:
    """A module pass over device functions: the PDL flag on every kernel that waits for the previous grid."""
    import tvm
    from tvm import tirx

    @tvm.transform.module_pass(opt_level=0, name="fuselight.MarkProgrammaticLaunch")
    def mark(mod: Any, _ctx: Any) -> Any:
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc) or func.attrs is None or _LAUNCH_PARAMS not in func.attrs:
                continue
            if waits_for_previous_grid(func):
                params = [str(p) for p in func.attrs[_LAUNCH_PARAMS]]
                updates[gv] = func.with_attr(_LAUNCH_PARAMS, with_programmatic_launch(params))
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return mark


def register() -> str:
    """Register the pipeline under ``NAME`` (once; idempotent) and return the name."""
    import tvm
    from tvm.tirx import compilation_pipeline

    if NAME in compilation_pipeline.PIPELINE_MAP:
        return NAME

    def factory() -> tuple[Any, Any, Any]:
        pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")

        def device_passes() -> Any:
            return tvm.ir.transform.Sequential([finalize_device(), mark_programmatic_launch()])

        return pipeline, finalize_host, device_passes

    compilation_pipeline.register_tir_pipeline(NAME, factory)
    return NAME
