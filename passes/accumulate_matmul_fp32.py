"""Accumulate half-precision matmuls in float32: ``R.matmul(a, b)`` -> ``R.astype(R.matmul(a, b, "float32"), half)``.

A Relax matmul of float16/bfloat16 operands with a half output dtype sums its products in that half
type, so the error grows with the reduction length: on Llama-3-8B the logits of MLC-LLM's build
differ from a float64 reference by about 5e-2 (relative), where PyTorch's float16 (which accumulates
in float32) differs by 9e-3. Asking the matmul for a float32 result and casting it back keeps the
graph's dtypes while the kernel accumulates in float32; FuseOps later fuses the cast into the
matmul kernel as an epilogue, and DLight's Matmul/GEMV rules schedule it as before.

This covers linear layers too (Relax expresses them as ``matmul(x, permute_dims(w))``). It must run
before ``FuseTransposeMatmul``, which turns those matmuls into TIR kernels; that pass keeps the
float32 output dtype. Matmuls of other dtypes, and those already asking for float32, are left alone.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from ..relax_rewrite import FunctionRewriter

HALF_DTYPES = ("float16", "bfloat16")
ACCUMULATE_DTYPE = "float32"


@tvm.transform.module_pass(opt_level=0, name="AccumulateMatmulFP32")
class AccumulateMatmulFP32:
    """Make half-precision matmuls accumulate in float32 (output cast back to the half dtype)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return _Rewriter(mod).transform()


@mutator
class _Rewriter(FunctionRewriter):
    # "Nothing else changes": the function's own unused bindings stay.
    prune_unused = False

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != tvm.ir.Op.get("relax.matmul"):
            return call
        a, b = call.args
        half = call.ty.dtype
        if half not in HALF_DTYPES or a.ty.dtype != half or b.ty.dtype != half:
            return call
        wide = self.builder_.emit(relax.op.matmul(a, b, out_dtype=ACCUMULATE_DTYPE))
        return relax.op.astype(wide, half)
