"""MLC's pipeline shape: the pass list is built when the pipeline runs, from this module's names."""

import tvm
from tvm import relax
from tvm.relax import register_pipeline
from tvm.s_tir import dlight as dl

from fuselight.baseline.fuse_transpose_matmul import FuseTransposeMatmul
from fuselight.baseline.low_batch_gemv_specialize import LowBatchGemvSpecialize

# Each run's pass names, in order (the tests read it).
RAN: list = []


@tvm.transform.module_pass(opt_level=0, name="Record")
class _Record:
    def __init__(self, name):
        self.name = name

    def transform_module(self, mod, _ctx):
        RAN.append(self.name)
        return mod


@register_pipeline("mlc_llm")
def _mlc_llm_pipeline(target, debug_dump=None, **_kwargs):
    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod, _ctx):
        seq = tvm.transform.Sequential(
            [
                _Record("phase1"),
                FuseTransposeMatmul(),
                _Record("phase2"),
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                relax.transform.DeadCodeElimination(),
                _Record("phase4"),
                LowBatchGemvSpecialize(),
                dl.ApplyDefaultSchedule(dl.gpu.Fallback()) if target.kind.name != "llvm" else tvm.transform.Sequential([]),
                _Record("phase5"),
                relax.transform.ToNonDataflow(),
                relax.transform.RemovePurityChecking(),
                relax.transform.CallTIRRewrite(),
                relax.transform.StaticPlanBlockMemory(),
                relax.transform.LowerAllocTensor(),
                relax.transform.KillAfterLastUse(),
                relax.transform.LowerRuntimeBuiltin(),
                relax.transform.VMShapeLower(),
                relax.transform.AttachGlobalSymbol(),
            ]
        )
        return seq(mod)

    return _pipeline
