"""Where a matmul's weight comes from: loaded as it is, or computed (a dequantize). Analysis only.

Every fusion that takes a weight operand into a new kernel must ask first. A weight the function
loads (a parameter, or a field of the parameter tuple MLC-LLM packs its weights in) can move into
any kernel. A computed one, such as 4-bit packed words dequantized to float16, cannot move alone:
the new kernel would read the float16 tensor, so the dequantize would run alone and write every
weight to memory in float16 (4x the packed bytes, each step), where MLC's phase 3 fuses it into its
matmul. A fusion may carry the dequantize into its kernel instead (``dequantized_weight``: the
call computing it from loaded tensors, used by nothing else).

``materialized_weights(mod)`` is the check of the whole pipeline's result: every ``call_tir`` that
reads a packed integer tensor and writes a floating tensor of 2, 4 or 8 elements for each packed one,
and no fewer than any integer tensor it reads has (what a dequantize of 16-, 8- or 4-bit values
writes; a gather of rows such as the embedding writes a different count, and a GEMV reading AWQ's
small zero-point tensor beside its weight writes fewer than the weight has).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import tvm
from tvm import arith, relax

# Unpacked elements per packed element a dequantize writes (2, 4 or 8 values per word).
_UNPACK_RATIOS = (2, 4, 8)


def loaded_weight(expr: relax.Expr, var2val: Mapping[relax.Var, relax.Expr]) -> bool:
    """Whether ``expr`` is a tensor the function loads as it is: a parameter, or (through aliases) a
    field of a parameter tuple. Anything computed, a dequantize above all, is not."""
    while isinstance(expr, relax.Var) and expr in var2val:
        expr = var2val[expr]
        if isinstance(expr, relax.TupleGetItem):
            expr = expr.tuple_value
    return isinstance(expr, relax.Var)


def dequantized_weight(expr: relax.Expr, var2val: Mapping[relax.Var, relax.Expr],
                       uses: Mapping[relax.Var, int]) -> relax.Call | None:
    """The ``call_tir`` computing the weight ``expr`` by a dequantize (``computes_dequantize``) of
    tensors the function loads, where ``expr`` has no use (``uses``: the function's count of each
    variable's uses) but the one being fused, so a fusion can carry the call into its kernel; else None."""
    if not isinstance(expr, relax.Var) or uses.get(expr, 0) != 1:
        return None
    call = var2val.get(expr)
    if not computes_dequantize(call) or not isinstance(call.args[0], tvm.ir.GlobalVar):
        return None
    return call if all(loaded_weight(a, var2val) for a in call.args[1].fields) else None


@dataclasses.dataclass(frozen=True)
class MaterializedWeight:
    """A kernel call that writes a dequantized weight: the Relax function, the binding, the callee."""

    function: str
    binding: str
    callee: str


def materialized_weights(mod: tvm.IRModule) -> list[MaterializedWeight]:
    """Every ``call_tir`` of ``mod``'s Relax functions that writes a floating tensor of 2, 4 or 8
    elements for each element of an integer tensor it reads (see the module docstring)."""
    found = []
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        for binding in (b for block in _blocks(func) for b in block.bindings):
            if computes_dequantize(binding.value):
                call = binding.value
                found.append(MaterializedWeight(gv.name_hint, binding.var.name, call.args[0].name_hint))
    return found


def computes_dequantize(call: relax.Expr) -> bool:
    """Whether ``call`` is a ``call_tir`` that writes a floating tensor of 2, 4 or 8 elements for
    each element of an integer tensor it reads, and no fewer than any integer tensor it reads: a
    dequantize of packed weights, by what it computes rather than by its callee's name."""
    if not isinstance(call, relax.Call) or call.op != tvm.ir.Op.get("relax.call_tir"):
        return False
    if not isinstance(call.args[1], relax.Tuple):
        return False
    analyzer = arith.Analyzer()
    packed = [_numel(a.ty) for a in call.args[1].fields if _is_tensor(a.ty, "int")]
    outs = call.ty.fields if isinstance(call.ty, relax.TupleType) else [call.ty]
    written = [_numel(t) for t in outs if _is_tensor(t, "float")]
    # A dequantize writes no fewer values than any integer tensor it reads has: a GEMV's output can
    # be a multiple of a small one (AWQ's zero points) by chance, but is fewer than its weight.
    return any(
        p is not None and w is not None and analyzer.can_prove_equal(w, p * r)
        and not any(q is not None and analyzer.can_prove(w < q) for q in packed)
        for p in packed for w in written for r in _UNPACK_RATIOS
    )


def _blocks(func: relax.Function) -> list[relax.BindingBlock]:
    return list(func.body.blocks) if isinstance(func.body, relax.SeqExpr) else []


def _is_tensor(ty: relax.Type, kind: str) -> bool:
    if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.dtype is None:
        return False
    dtype = str(ty.dtype)
    return dtype.startswith(("int", "uint")) if kind == "int" else dtype.startswith(("float", "bfloat"))


def _numel(ty: relax.TensorType) -> tvm.ir.PrimExpr | None:
    if not isinstance(ty.shape, relax.ShapeExpr):
        return None
    n: tvm.ir.PrimExpr = tvm.tirx.IntImm("int64", 1)
    for d in ty.shape.values:
        n = n * d
    return n
