"""Fuse the gated MLP's SiLU and multiply into the gate+up projection: one kernel writes ``silu(gate) * up``.

A LLaMA MLP computes its gate and up projections as one linear layer whose weight holds the gate
rows, then the up rows, and splits the result in two halves::

    y = matmul(x, permute_dims(w))                  # [..., 2I]   (or astype(matmul(.., "float32")))
    gate, up = split(y, 2, axis=-1)                 #  (or matmul(x, w), w a [K, 2I] dequantized weight)
    out = multiply(silu(gate), up)                  # [..., I]    (operands of multiply either way)

This pass replaces that chain by one ``call_tir`` of a PrimFunc (TE, ``fuselight.computations
.gate_up_silu_te``) computing the matmul into ``[..., 2I]`` (accumulating in the matmul's output
dtype, then cast where the graph casts) followed by one elementwise stage ``out[..., j] =
silu(C[..., j]) * C[..., j + I]``, left unscheduled for fuselight's GEMM rules in phase 4
(``rules.Matmul`` for dynamic M, ``rules.Gemv`` for decode; their analysis sees a "paired" epilogue
and writes one kernel whose tiles hold both halves, so the ``[..., 2I]`` intermediate never reaches
memory): tagged ``RULE_ATTR = "gemm"`` and opaque to FuseOps, so it reaches them as emitted. Only
where one of those rules takes it (``takes``: its analysis and configs, nothing built): DLight's
Matmul rule cannot inline an epilogue that reads two columns (it fails an assertion), so the fused
function must never reach it; elsewhere (other targets, shapes the templates do not take) the graph
stays as it is. ``FuseGateUpSiLU(schedule=False)`` fuses wherever it matches (any target, untagged:
the plain TE function, e.g. to check the numbers on the CPU). Runs before ``FuseTransposeMatmul``
(which lowers linear layers to TIR). Only exact matches change: two equal halves of a static even
width, SiLU on the first half, every intermediate used by the chain alone, a weight the function
loads or a 4-bit weight dequantized (from loaded packed words and scales) for this matmul alone
(``weight_source.dequantized_weight``): the dequantize then comes along into the fused function,
which reads the packed words and scales (``computations.with_dequantized_weight``), so the
dequantized weight is never written; where the rules' analysis does not see that dequantize in
the fused function (another format), or no rule takes it (the templates for a dequantized B
with symbolic M take no paired epilogue), the graph stays as it is. A weight the matmul reads
``[K, 2I]``, without ``permute_dims`` (MLC-LLM's KN layout, ``q4f16_0``), is matched only where it is
dequantized so: the fused function then reads its words ``[K / 8, 2I]`` (``gate_up_silu_te``'s "NN"),
which the Gemv rule's KN template takes at a static M = 1 (prefill's symbolic M: no rule, unfused).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from ..computations import gate_up_silu_prim_func, with_dequantized_weight
from ..contracts import GATE_UP_SILU_NAME as PRIMFUNC_NAME
from ..contracts import OP_PATTERN_ATTR, OPAQUE_OP_PATTERN, RULE_ATTR
from ..relax_rewrite import FunctionRewriter, rewrite_for_target, use_counts
from ..rules.gemm.analysis import analyze_matmul
from ..rules.gemv import Gemv
from ..rules.matmul import Matmul
from .weight_source import dequantized_weight, loaded_weight

# The rules that schedule the fused function, in phase 4's order.
RULES = (Matmul, Gemv)
RULE_FAMILY = "gemm"


@dataclasses.dataclass(frozen=True)
class _Match:
    x: relax.Expr
    w: relax.Expr  # [2I, K]
    dequantize: relax.Call | None  # the call computing ``w`` from packed words and scales, if it does
    acc_dtype: str  # the matmul's output dtype (what it accumulates in)
    out_dtype: str  # after the graph's cast, if any
    b_layout: str  # "NT": ``w`` is [2I, K], read through permute_dims; "NN": [K, 2I], read as it is


def _op(expr: Any, name: str) -> bool:
    return isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get(name)


def _static_int(expr: Any) -> int | None:
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def _shape(expr: Any) -> list[Any] | None:
    """The dimensions of a tensor-typed ``expr`` whose shape is known, else None."""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def _match(mul: relax.Call, var2val: Any, uses: dict[relax.Var, int]) -> _Match | None:
    """The gate+up matmul feeding ``multiply(silu(gate), up)``, or None (see the module docstring)."""

    def bound(var: Any, op: str, n_uses: int = 1) -> relax.Call | None:
        # ``var``'s value if it is a call of ``op`` and ``var`` has exactly ``n_uses`` uses.
        if not isinstance(var, relax.Var) or uses.get(var, 0) != n_uses or var not in var2val:
            return None
        value = var2val[var]
        return value if _op(value, op) else None

    def item(var: Any) -> tuple[relax.Var, int] | None:
        if not isinstance(var, relax.Var) or uses.get(var, 0) != 1 or var not in var2val:
            return None
        value = var2val[var]
        if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
            return value.tuple_value, int(value.index)
        return None

    for s, u in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        silu = bound(s, "relax.nn.silu")
        gate, up = (item(silu.args[0]) if silu is not None else None), item(u)
        if gate is None or up is None or not gate[0].same_as(up[0]) or (gate[1], up[1]) != (0, 1):
            continue
        split = bound(gate[0], "relax.split", n_uses=2)
        if split is None:
            continue
        y = split.args[0]
        shape = _shape(y)
        ndim = len(shape) if shape is not None else 0
        width = _static_int(shape[-1]) if ndim else None
        sections = split.attrs.indices_or_sections
        halves = (isinstance(sections, tirx.IntImm) and int(sections) == 2) or (
            not isinstance(sections, tirx.IntImm) and len(sections) == 1 and width is not None
            and _static_int(sections[0]) == width // 2
        )
        if width is None or width % 2 or not halves or int(split.attrs.axis) not in (-1, ndim - 1):
            continue
        out_dtype = str(y.ty.dtype)
        cast = bound(y, "relax.astype")
        matmul = bound(cast.args[0] if cast is not None else y, "relax.matmul")
        if matmul is None:
            continue
        x, wt = matmul.args
        transpose = wt if isinstance(wt, relax.Var) and wt in var2val and _op(var2val[wt], "relax.permute_dims") else None
        if transpose is not None:
            permute = var2val[transpose]
            w, b_layout = permute.args[0], "NT"
            axes = permute.attrs.axes
            if axes is not None and [int(a) for a in axes] != [1, 0]:
                continue
        else:
            w, b_layout = wt, "NN"  # [K, 2I]: only a weight dequantized so (MLC-LLM's KN layout), below
        w_shape, x_shape = _shape(w), _shape(x)
        if w_shape is None or len(w_shape) != 2:
            continue
        if x_shape is None or len(x_shape) < 2 or str(x.ty.dtype) != str(w.ty.dtype):
            continue
        width_at = 0 if b_layout == "NT" else 1
        if _static_int(w_shape[width_at]) != width or _static_int(w_shape[1 - width_at]) is None:
            continue
        dequantize = dequantized_weight(w, var2val, uses)
        if dequantize is None and (b_layout == "NN" or not loaded_weight(w, var2val)):
            continue  # a computed weight this pass cannot carry stays with its matmul
        return _Match(x=x, w=w, dequantize=dequantize, acc_dtype=str(matmul.ty.dtype), out_dtype=out_dtype,
                      b_layout=b_layout)
    return None


@tvm.transform.module_pass(opt_level=0, name="FuseGateUpSiLU")
class FuseGateUpSiLU:
    """Replace ``multiply(silu(gate), up)`` of a split gate+up projection by one fused call (see the module docstring)."""

    def __init__(self, schedule: bool = True) -> None:
        self.schedule = schedule

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_for_target(_Rewriter, mod, self.schedule)


@mutator
class _Rewriter(FunctionRewriter):
    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target | None) -> None:
        super().__init__(mod)
        self.target = target  # None: fuse wherever it matches, untagged
        self.matches: dict[relax.Call, _Match] = {}
        self.kernels: dict[tuple, tvm.ir.GlobalVar | None] = {}
        for _, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            var2val, uses = relax.analysis.get_var2val(func), use_counts(func)
            for value in var2val.values():
                if _op(value, "relax.multiply"):
                    found = _match(value, var2val, uses)
                    if found is not None:
                        self.matches[value] = found

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        found = self.matches.get(call)
        if found is None:
            return super().visit_call_(call)
        gv = self._kernel(found)
        if gv is None:
            return super().visit_call_(call)
        weights = [found.w] if found.dequantize is None else list(found.dequantize.args[1].fields)
        # Typed by the graph's own shape variables (the function may have been made for another's).
        x_shape, width = _shape(found.x), _shape(found.w)[0 if found.b_layout == "NT" else 1]
        out_ty = relax.TensorType([*x_shape[:-1], tirx.IntImm(str(width.ty.dtype), int(width) // 2)], found.out_dtype)
        return relax.call_tir(gv, [self.visit_expr(e) for e in (found.x, *weights)], out_ty)

    def _kernel(self, found: _Match) -> tvm.ir.GlobalVar | None:
        """The fused function's GlobalVar (added once per distinct computation), or None where it is
        not made: a dequantize the rules' analysis does not see in it, or no rule takes it."""
        deq = None if found.dequantize is None else found.dequantize.args[0]
        key = (*(tvm_ffi.structural_hash(e.ty) for e in (found.x, found.w)), found.acc_dtype, found.out_dtype,
               found.b_layout, deq)
        if key in self.kernels:
            return self.kernels[key]
        func = gate_up_silu_prim_func(_shape(found.x), str(found.x.ty.dtype), _shape(found.w), str(found.w.ty.dtype),
                                      found.acc_dtype, found.out_dtype, found.b_layout)
        if deq is not None:
            dequantize = self.mod[deq]
            func = with_dequantized_weight(func, dequantize) if isinstance(dequantize, tirx.PrimFunc) else None
            desc = None if func is None else analyze_matmul(func, dequant=True)
            if desc is None or desc.operands.dequant is None:
                func = None  # a dequantize the rules would not see: unfused
        if func is not None and self.target is not None:
            if any(rule.takes(func, self.target) for rule in RULES):
                func = func.with_attrs({RULE_ATTR: RULE_FAMILY, OP_PATTERN_ATTR: OPAQUE_OP_PATTERN})
            else:
                func = None
        self.kernels[key] = None if func is None else self.builder_.add_func(func, PRIMFUNC_NAME)
        return self.kernels[key]
