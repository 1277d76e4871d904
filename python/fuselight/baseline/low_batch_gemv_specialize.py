"""Mirrors MLC-LLM's ``LowBatchGemvSpecialize``: matmuls over a small dynamic batch get GEMV-like kernels.

A matmul whose only symbolic dim is the row count ``m`` (decode over a batch, short prefills) runs
badly on a GEMM schedule tuned for large ``m``. This pass gives such a PrimFunc three schedules in
one kernel, picked at run time: DLight's LowBatchGEMV with bucket 2 for ``m <= 2``, with bucket 4
for ``m <= 8``, and DLight's Matmul otherwise. Functions either rule leaves alone keep going to
the default DLight rules.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import dlight as dl

# (largest row count, LowBatchGEMV bucket), tried in order; larger row counts take the Matmul schedule.
LOW_BATCH_BUCKETS = ((2, 2), (8, 4))


@tvm.transform.module_pass(opt_level=0, name="LowBatchGemvSpecialize")
class LowBatchGemvSpecialize:
    """Dispatch dynamic-row matmuls to low-batch GEMV schedules for small row counts."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc):
                specialized = _specialize(func)
                if specialized is not None:
                    mod.update_func(gv, specialized)
        return mod


def _schedule(func: tirx.PrimFunc, rule: dl.ScheduleRule) -> tirx.PrimFunc | None:
    """``func`` scheduled by ``rule``, or None where the rule does not apply."""
    scheduled = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({"main": func}))["main"]
    return None if tvm_ffi.structural_equal(scheduled, func) else scheduled


def _specialize(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    low_batch = [_schedule(func, dl.gpu.LowBatchGEMV(bucket)) for _, bucket in LOW_BATCH_BUCKETS]
    if any(f is None for f in low_batch):
        return None
    symbolic = {
        dim for p in func.params if isinstance(p.ty, tirx.BufferType) for dim in p.shape if isinstance(dim, tirx.Var)
    }
    if len(symbolic) != 1:
        return None
    gemm = _schedule(func, dl.gpu.Matmul())
    if gemm is None:
        return None
    (rows,) = symbolic
    body = gemm.body
    for (limit, _), scheduled in reversed(list(zip(LOW_BATCH_BUCKETS, low_batch, strict=True))):
        # Thread-invariant so that code generation can hoist the branch out of the kernel's threads.
        body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(rows <= limit), scheduled.body, body)
    root = tirx.SBlockRealize([], True, tirx.SBlock([], [], [], "root", body))
    return (
        func.with_body(root)
        .with_attr("tirx.is_scheduled", 1)
        .with_attr("tirx.HoistIfThenElseExprWithBlock", 1)
    )
