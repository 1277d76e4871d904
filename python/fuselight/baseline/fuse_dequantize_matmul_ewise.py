"""Mirrors MLC-LLM's ``FuseDequantizeMatmulEwise``: each dequantize kernel merged into the matmul
kernel (with its fused elementwise epilogue) that reads the dequantized weight.

Phase 2's FuseOps never puts a producer into a matmul's inputs, so a quantized linear layer leaves
it as two kernels, the first writing the whole float16 weight (4x the packed bytes) to memory each
call. Here the two ``call_tir``s become one function that FuseTIR lowers to one kernel, which
dequantizes as it reads. A dequantize is recognised by its callee's name as MLC names it
(``dequantize*``, ``fused_dequantize*``) or by what it computes (``weight_source.computes_dequantize``:
packed integers in, 2, 4 or 8 floats out for each); a matmul by its name (``matmul*``,
``NT_matmul*``, with ``fused_`` before either) or by having a reduction, so the kernels fuselight's
graph passes name otherwise are fused as well. The call shapes taken are MLC's (the weight second,
``_ARITIES``), so an MLC-shaped module comes out as MLC's pass leaves it, and then those MLC's pass
leaves alone: the weight elsewhere among the kernel's inputs (``_LATE_WEIGHT``). FuseOps orders a
fused kernel's inputs by first use, so a residual add whose other operand comes first puts the
weight third: our ``decode_attend`` ends in such an add where no RMSNorm follows (on GPUs, where
FuseAddRMSNorm takes the others), and MLC's pattern would leave its o_proj weight materialized.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, tirx
from tvm.relax.dpl.pattern import DFPattern, GlobalVarPattern, TuplePattern, is_op, wildcard

from ..passes.weight_source import computes_dequantize

DEQUANTIZE_PREFIXES = ("dequantize", "fused_dequantize")
_MATMUL_PREFIXES = ("matmul", "fused_matmul", "NT_matmul", "fused_NT_matmul")
# (inputs of the dequantize besides the packed words, inputs of the matmul kernel after x and the
# weight): the call shapes MLC's pass matches. Four elementwise inputs only with four scales etc.
_ARITIES = [(aux, extra) for aux in range(5) for extra in (0, 1, 2, 3, 6) if extra != 6 or aux == 4]
# (inputs of the matmul kernel, position of the weight) beyond MLC's: the weight after the second input
# (its dequantize reading words and scales, as every scheme of ours stores them).
_LATE_WEIGHT = [(inputs, at) for inputs in range(3, 9) for at in range(2, inputs)]


@tvm.transform.module_pass(opt_level=0, name="FuseDequantizeMatmulEwise")
class FuseDequantizeMatmulEwise:
    """Merge each dequantize into the matmul (and epilogue) that consumes its output."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        patterns = [("dequantize_matmul", *_pattern(mod, aux, 2 + extra, 1)) for aux, extra in _ARITIES]
        patterns += [("dequantize_matmul", *_pattern(mod, 1, inputs, at)) for inputs, at in _LATE_WEIGHT]
        mod = relax.transform.FuseOpsByPattern(patterns)(mod)
        return relax.transform.FuseTIR()(mod)


def is_dequantize(call: relax.Expr) -> bool:
    """A ``call_tir`` of a dequantize: by MLC's callee names, or by what it computes."""
    if not isinstance(call, relax.Call) or not isinstance(call.args[0], relax.GlobalVar):
        return False
    return call.args[0].name_hint.startswith(DEQUANTIZE_PREFIXES) or computes_dequantize(call)


def has_reduction(func: tirx.PrimFunc) -> bool:
    """Whether some block of ``func`` reduces (a matmul's k loop, among others)."""
    found = []

    def visit(node: object) -> None:
        if isinstance(node, tirx.SBlock) and any(iv.iter_type == tirx.IterVar.CommReduce for iv in node.iter_vars):
            found.append(node)

    tirx.stmt_functor.post_order_visit(func.body, visit)
    return bool(found)


def _pattern(
    mod: tvm.IRModule, aux: int, inputs: int, at: int
) -> tuple[DFPattern, dict[str, DFPattern], Callable[[relax.transform.PatternCheckContext], bool]]:
    """A dequantize of ``1 + aux`` inputs read as input ``at`` of a matmul kernel of ``inputs``."""
    packed, x = wildcard(), wildcard()
    weight = is_op("relax.call_tir")(
        GlobalVarPattern(), TuplePattern([packed] + [wildcard() for _ in range(aux)]), add_constraint=False
    )
    args = [x] + [wildcard() for _ in range(inputs - 1)]
    args[at] = weight
    matmul = is_op("relax.call_tir")(GlobalVarPattern(), TuplePattern(args), add_constraint=False)

    def is_matmul(call: relax.Expr) -> bool:
        if not isinstance(call, relax.Call) or not isinstance(call.args[0], relax.GlobalVar):
            return False
        callee = mod.functions.get(call.args[0])
        return call.args[0].name_hint.startswith(_MATMUL_PREFIXES) or (
            isinstance(callee, tirx.PrimFunc) and has_reduction(callee)
        )

    def check(ctx: relax.transform.PatternCheckContext) -> bool:
        return is_dequantize(ctx.annotated_expr["w"]) and is_matmul(ctx.annotated_expr["matmul"])

    return matmul, {"w_scaled": packed, "x": x, "w": weight, "matmul": matmul}, check
