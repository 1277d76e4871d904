"""Fold an RMSNorm's weight into the linear layers it feeds (a weight transform).

``rms_norm(x, g) = r(x) * x * g`` with the per-row ``r(x) = 1 / sqrt(mean(x^2) + eps)``, so for a
user ``matmul(rms_norm(x, g), permute_dims(W))`` (``W`` of shape ``[N, K]``) the products in each
dot product regroup (associativity and commutativity):
``matmul(rms_norm(x, 1), permute_dims(W * g))``, ``W`` scaled column by column. The norm keeps a
constant all-ones weight (Relax has no weightless ``rms_norm``), so its output is a pure per-row
scale of ``x``, which a later rewrite can move after the matmul (the GEMM then reads ``x``).

Rounding: ``W * g`` is computed in float32 and rounded once per weight element to ``W``'s dtype,
where the graph rounded ``r(x) * x * g`` once per activation: within 2 ulp per product. Overflow:
``W * g`` may leave float16's range on real weights; ``lift_and_transform`` refuses transformed
weights that are not finite.

Folded when ``g`` is a weight, the norm is over the last axis, and every user of its output is a
linear layer whose weight is a weight of the same dtype; ``WeightCost`` then finds it no worse (the
weight products are lifted, the norm reads a constant instead of ``g``). The new weights follow as
for every weight transform (``fuselight.passes.weight_transform``):

    mod = FoldNormWeight()(mod)
    mod, new_weights = lift_and_transform(mod, "decode", weights)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..relax_rewrite import use_counts
from .property_rewrite import emit_bindings, matmul_out_dtype
from .weight_transform import WeightCost, weight_vars

FOLDED_ATTR = "fuselight.folded_norm_weights"
REWRITE = {
    "name": "fold_norm_weight",
    "law": "associativity and commutativity: (r*x*g)@W^T = (r*x)@(W*g)^T",
    "precision": "rel 2 ulp per product (W*g rounded once per weight)",
}
PRODUCT_DTYPE = "float32"  # W * g is computed in it, then rounded once to W's dtype
FOLDABLE_DTYPES = ("float16", "bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class _Fold:
    norm: relax.Var  # = rms_norm(x, g)
    call: relax.Call
    users: tuple[tuple[relax.Var, relax.Call, relax.Var], ...]  # (binding, its matmul, the weight W)


@tvm.transform.module_pass(opt_level=0, name="FoldNormWeight")
class FoldNormWeight:
    """Fold RMSNorm weights into the following linear layers' weights where no worse;
    ``self.folded`` lists ``(function, norm weight binding name)``."""

    def __init__(self, arch: str | None = None) -> None:
        self.arch = arch  # None: the target's in scope when the pass runs
        self.cost: WeightCost | None = None
        self.folded: list[tuple[str, str]] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.folded = []
        self.cost = WeightCost(self.arch)
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            folds = [f for f in _foldable(func) if self._no_worse(func, f)]
            if folds:
                out[gv] = relax.analysis.remove_all_unused(_Rewrite(folds).visit_expr(func))
                self.folded += [(gv.name_hint, f.call.args[1].name) for f in folds]
        return out.with_attr(FOLDED_ATTR, [list(f) for f in self.folded])

    def _no_worse(self, func: relax.Function, fold: _Fold) -> bool:
        weights = weight_vars(func)
        old = [relax.VarBinding(fold.norm, fold.call)] + [relax.VarBinding(v, c) for v, c, _ in fold.users]
        new = emit_bindings(_folded_norm(fold.call, fold.call.args[0]))
        norm = new[-1].var
        for _var, matmul, w in fold.users:
            new += emit_bindings(_folded_matmul(matmul, norm, w, fold.call.args[1]))
        return self.cost.no_worse(func, new, old, weights)


def _foldable(func: relax.Function) -> list[_Fold]:
    weights = weight_vars(func)
    counts = use_counts(func)
    bindings = [b for block in func.body.blocks if isinstance(block, relax.DataflowBlock) for b in block.bindings]
    values = {b.var: b.value for b in bindings if isinstance(b, relax.VarBinding)}
    users: dict[relax.Var, list[tuple[relax.Var, relax.Call, relax.Var]]] = {}
    for b in bindings:
        lin = _linear(b, values, weights)
        if lin is not None:
            users.setdefault(lin[1].args[0], []).append(lin)
    folds = []
    for b in bindings:
        call = b.value
        if not isinstance(call, relax.Call) or call.op != tvm.ir.Op.get("relax.nn.rms_norm"):
            continue
        g = call.args[1]
        dtype = str(call.ty.dtype)
        axes = [int(a) % call.ty.ndim for a in call.attrs.axes] if call.ty.ndim > 0 else None
        if g not in weights or g.ty.ndim != 1 or axes != [call.ty.ndim - 1] or dtype not in FOLDABLE_DTYPES:
            continue
        linear = users.get(b.var, [])
        # Every use of the norm is one of these linear layers (a var used twice by one call counts twice).
        if linear and counts.get(b.var, 0) == len(linear) and all(str(w.ty.dtype) == dtype for *_, w in linear):
            folds.append(_Fold(b.var, call, tuple(linear)))
    return folds


def _linear(binding: relax.Binding, values: dict, weights: set) -> tuple[relax.Var, relax.Call, relax.Var] | None:
    """``(var, matmul, W)`` for ``var = matmul(a, permute_dims(W))`` with ``W`` a 2-D weight."""
    call = binding.value
    if not isinstance(call, relax.Call) or call.op != tvm.ir.Op.get("relax.matmul"):
        return None
    t = values.get(call.args[1])
    if not isinstance(t, relax.Call) or t.op != tvm.ir.Op.get("relax.permute_dims"):
        return None
    w = t.args[0]
    axes = t.attrs.axes
    if w not in weights or w.ty.ndim != 2 or (axes is not None and [int(a) for a in axes] != [1, 0]):
        return None
    return binding.var, call, w


def _folded_norm(call: relax.Call, x: relax.Expr) -> relax.Expr:
    ones = relax.const(np.ones([int(d) for d in call.args[1].ty.shape.values], str(call.ty.dtype)))
    return relax.op.nn.rms_norm(x, ones, axes=[int(a) for a in call.attrs.axes], epsilon=float(call.attrs.epsilon))


def _folded_matmul(matmul: relax.Call, norm: relax.Expr, w: relax.Expr, g: relax.Expr) -> relax.Expr:
    if str(w.ty.dtype) == PRODUCT_DTYPE:
        scaled = relax.op.multiply(w, g)
    else:
        product = relax.op.multiply(relax.op.astype(w, PRODUCT_DTYPE), relax.op.astype(g, PRODUCT_DTYPE))
        scaled = relax.op.astype(product, str(w.ty.dtype))
    return relax.op.matmul(norm, relax.op.permute_dims(scaled), out_dtype=matmul_out_dtype(matmul))


@mutator
class _Rewrite(PyExprMutator):
    def __init__(self, folds: list[_Fold]) -> None:
        super().__init__()
        self.norms = {f.norm: f for f in folds}
        self.users = {v: (f, matmul, w) for f in folds for v, matmul, w in f.users}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.norms:
            call = self.norms[binding.var].call
            value = _folded_norm(call, self.visit_expr(call.args[0]))
        elif binding.var in self.users:
            fold, matmul, w = self.users[binding.var]
            norm = self.visit_expr(fold.norm)
            value = _folded_matmul(matmul, norm, self.visit_expr(w), self.visit_expr(fold.call.args[1]))
        else:
            super().visit_var_binding_(binding)
            return
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(value, name_hint=binding.var.name))
