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

One exception, on a GPU target: a matmul reading a weight its dequantize computes as the matmul
reads it (``[K, N]``, no transpose: MLC-LLM's KN layout, ``q4f16_0``), whose fused function
(``computations.matmul_prim_func`` with the dequantize spliced in) no fuselight rule takes
(``Rule.takes``: a symbolic M, prefill and batch decode). DLight then schedules it, and its GEMV
schedule streamed such float32-accumulating functions 11-20% slower than the float16 ones on an H100
(Llama-3-8B q4f16_0 decode, docs/experiments/q4-kn-gemv.md): the function stays the baseline's.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from ..computations import matmul_prim_func, with_dequantized_weight
from ..relax_rewrite import FunctionRewriter
from ..rules.gemv import Gemv
from ..rules.matmul import Matmul
from .weight_source import computes_dequantize

HALF_DTYPES = ("float16", "bfloat16")
ACCUMULATE_DTYPE = "float32"
# The rules that would schedule a dequantize matmul's fused function, in phase 4's order.
RULES = (Matmul, Gemv)


@tvm.transform.module_pass(opt_level=0, name="AccumulateMatmulFP32")
class AccumulateMatmulFP32:
    """Make half-precision matmuls accumulate in float32 (output cast back to the half dtype)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return _Rewriter(mod, tvm.target.Target.current(allow_none=True)).transform()


@mutator
class _Rewriter(FunctionRewriter):
    # "Nothing else changes": the function's own unused bindings stay.
    prune_unused = False

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target | None) -> None:
        super().__init__(mod)
        # Only the GPU rules schedule a dequantize in the kernel; elsewhere (CPU numerics) all is rewritten.
        self.target = target if target is not None and "gpu" in target.keys else None
        self.var2val: dict[relax.Var, relax.Expr] = {}
        if self.target is not None:
            for _, func in mod.functions_items():
                if isinstance(func, relax.Function):
                    self.var2val.update(relax.analysis.get_var2val(func))
        self.taken: dict[tuple, bool] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        original = call
        call = super().visit_call_(call)
        if call.op != tvm.ir.Op.get("relax.matmul"):
            return call
        a, b = call.args
        half = call.ty.dtype
        if half not in HALF_DTYPES or a.ty.dtype != half or b.ty.dtype != half:
            return call
        if self.target is not None and not self._taken(original.args[0], original.args[1], half):
            return call
        wide = self.builder_.emit(relax.op.matmul(a, b, out_dtype=ACCUMULATE_DTYPE))
        return relax.op.astype(wide, half)

    def _taken(self, a: relax.Expr, b: relax.Expr, half: str) -> bool:
        """False where ``b`` is computed by a dequantize (``[K, N]`` as the matmul reads it) and no rule
        takes the float32-accumulating fused function; True otherwise (anything else is rewritten)."""
        dequantize = self.var2val.get(b) if isinstance(b, relax.Var) else None
        if not computes_dequantize(dequantize) or not isinstance(dequantize.args[0], tvm.ir.GlobalVar):
            return True
        deq_func = self.mod[dequantize.args[0]]
        x_shape, w_shape = _shape(a), _shape(b)
        if not isinstance(deq_func, tirx.PrimFunc) or x_shape is None or w_shape is None or len(w_shape) != 2:
            return True
        key = (tvm_ffi.structural_hash(a.ty), tvm_ffi.structural_hash(b.ty), dequantize.args[0])
        if key not in self.taken:
            fused = with_dequantized_weight(matmul_prim_func(x_shape, w_shape, half, ACCUMULATE_DTYPE, half), deq_func)
            self.taken[key] = any(rule.takes(fused, self.target) for rule in RULES)
        return self.taken[key]


def _shape(expr: relax.Expr) -> list | None:
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)
