"""Mirrors MLC-LLM's ``FuseDequantizeTake``: the embedding lookup (a ``take`` of dequantized rows)
as one kernel that dequantizes only the rows it gathers.

Without it the embedding's dequantize writes the whole float16 table every call and the take reads
a few rows of it. The pattern: a ``call_tir`` of a dequantize (2 or 3 inputs; recognised as in
``fuse_dequantize_matmul_ewise``) whose output a ``take`` reads with non-constant indices (a callee
named ``*take*``, or one without a reduction: a gather). FuseTIR makes them one PrimFunc, in which
the dequantize stage is then inlined into the gather (after narrowing its indices to int32, as MLC
does), so no stage computes the table; the same for a dequantize + take FuseOps had already merged.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import arith, relax, s_tir, tirx
from tvm.relax.dpl.pattern import DFPattern, GlobalVarPattern, TuplePattern, is_const, is_op, wildcard

from .fuse_dequantize_matmul_ewise import has_reduction, is_dequantize

# Inputs of the dequantize (words and scales, or with a third, e.g. zero points), and whether the
# take passes symbolic shape values: the call shapes MLC's pass matches.
_ARITIES = [(inputs, tir_vars) for inputs in (2, 3) for tir_vars in (False, True)]
_UNPACK_RATIOS = (2, 4, 8)


@tvm.transform.module_pass(opt_level=0, name="FuseDequantizeTake")
class FuseDequantizeTake:
    """Merge a dequantize into the take that gathers rows of it, dequantizing only those rows."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        patterns = [("dequantize_take", *_pattern(mod, inputs, tir_vars)) for inputs, tir_vars in _ARITIES]
        mod = relax.transform.FuseTIR()(relax.transform.FuseOpsByPattern(patterns)(mod))
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and _is_dequantize_take(gv.name_hint, func):
                mod[gv] = _inline_dequantize(gv.name_hint, func)
        return mod


def _pattern(
    mod: tvm.IRModule, inputs: int, tir_vars: bool
) -> tuple[DFPattern, dict[str, DFPattern], Callable[[relax.transform.PatternCheckContext], bool]]:
    dequantize = is_op("relax.call_tir")(
        GlobalVarPattern(), TuplePattern([wildcard() for _ in range(inputs)]), add_constraint=False
    )
    indices = ~is_const()
    args = [GlobalVarPattern(), TuplePattern([dequantize, indices])] + ([wildcard()] if tir_vars else [])
    take = is_op("relax.call_tir")(*args, add_constraint=False)

    def is_take(call: relax.Expr) -> bool:
        if not isinstance(call.args[0], relax.GlobalVar):
            return False
        callee = mod.functions.get(call.args[0])
        return "take" in call.args[0].name_hint or (isinstance(callee, tirx.PrimFunc) and not has_reduction(callee))

    def check(ctx: relax.transform.PatternCheckContext) -> bool:
        return is_dequantize(ctx.annotated_expr["dequantize"]) and is_take(ctx.annotated_expr["take"])

    return take, {"take": take, "dequantize": dequantize, "indices": indices}, check


def _mlc_named(name: str) -> bool:
    return "fused_dequantize" in name and "take" in name


def _is_dequantize_take(name: str, func: tirx.PrimFunc) -> bool:
    """A PrimFunc FuseTIR made of a dequantize and a take: by MLC's names, or by structure: a
    gather (no reduction, an integer index parameter) with a stage that writes an intermediate of
    2, 4 or 8 floats per packed integer it reads."""
    if _mlc_named(name):
        return True
    block = _dequantize_block(func)
    if has_reduction(func) or block is None:
        return False
    packed = block[1]
    ints = [b for b in _buffers(func) if str(b.ty.dtype).startswith(("int", "uint")) and not b.same_as(packed)]
    return bool(ints)


def _buffers(func: tirx.PrimFunc) -> list[tvm.ir.Var]:
    """The buffer parameters of ``func`` (on TVM 0.26 the parameters are buffer-typed Vars)."""
    return [p for p in func.params if isinstance(p.ty, tirx.BufferType)]


def _dequantize_block(func: tirx.PrimFunc) -> tuple[str, tvm.ir.Var] | None:
    """The block of ``func`` that computes an intermediate (not an output) from an integer
    parameter with 2, 4 or 8 of its elements per integer: its name and that parameter; None if none."""
    params = _buffers(func)
    analyzer = arith.Analyzer()

    def numel(buf: tvm.ir.Var) -> tvm.ir.PrimExpr:
        n: tvm.ir.PrimExpr = tirx.IntImm("int64", 1)
        for d in buf.ty.shape:
            n = n * d
        return n

    def is_param(buf: tvm.ir.Var) -> bool:
        return any(buf.same_as(p) for p in params)

    found: list[tuple[str, tvm.ir.Var]] = []

    def visit(node: object) -> None:
        if not isinstance(node, tirx.SBlock) or len(node.writes) != 1:
            return
        out = node.writes[0].buffer
        if is_param(out) or not str(out.ty.dtype).startswith(("float", "bfloat")):
            return
        for read in node.reads:
            buf = read.buffer
            if is_param(buf) and str(buf.ty.dtype).startswith(("int", "uint")) and any(
                analyzer.can_prove_equal(numel(out), numel(buf) * r) for r in _UNPACK_RATIOS
            ):
                found.append((node.name_hint, buf))
                return

    tirx.stmt_functor.post_order_visit(func.body, visit)
    return found[0] if found else None


def _inline_dequantize(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc:
    narrowed = tirx.transform.ForceNarrowIndexToInt32()(tvm.IRModule({"main": func}))
    sch = s_tir.Schedule(narrowed)
    # MLC inlines its TE stage named "dequantize"; elsewhere the stage found by what it computes.
    names = _block_names(narrowed["main"])
    found = _dequantize_block(narrowed["main"])
    block = "dequantize" if _mlc_named(name) and "dequantize" in names else (found[0] if found else None)
    if block is None:
        return func
    sch.compute_inline(sch.get_sblock(block))
    return sch.mod["main"]


def _block_names(func: tirx.PrimFunc) -> set[str]:
    names: set[str] = set()
    tirx.stmt_functor.post_order_visit(
        func.body, lambda n: names.add(n.name_hint) if isinstance(n, tirx.SBlock) else None
    )
    return names
