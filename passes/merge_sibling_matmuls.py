"""Merge sibling linear layers that read the same input into one wider matmul.

Distributivity of the matmul over concatenation: for linear layers ``y_i = matmul(x,
permute_dims(W_i))`` (``W_i`` of shape ``[N_i, K]``) reading the same ``x``,
``[y_1, .., y_k] = split(matmul(x, permute_dims(concat([W_1, .., W_k], axis=0))))``. Exact: every
output element is the same dot product as before. Separate Q/K/V projections or gate/up
projections become one GEMM that reads ``x`` once, as MLC-LLM's models write them by hand.

The merged weight is computed in the graph from the separate ones (``fuselight.passes.weight_transform``
says how the real weights follow):

    mod = MergeSiblingMatmuls()(mod)
    mod, new_weights = lift_and_transform(mod, "decode", weights)  # weights in parameter order

A group is merged only when ``WeightCost`` says it is provably no worse: the ``split`` writes the
outputs a second time, so merging pays where ``x`` would be re-read by several siblings and a
launch is saved (three projections in decode), not for two siblings, nor for long prefills.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..relax_rewrite import use_counts
from .property_rewrite import emit_bindings, matmul_out_dtype
from .weight_transform import WeightCost, binding_value, weight_vars

MERGED_ATTR = "fuselight.merged_siblings"
REWRITE = {
    "name": "merge_sibling_matmuls",
    "law": "distributivity of matmul over concatenation: [x@A^T, x@B^T] = split(x@[A;B]^T)",
    "precision": "exact",
}


@dataclasses.dataclass(frozen=True)
class _Linear:
    var: relax.Var  # y = matmul(x, permute_dims(w))
    x: relax.Var
    weight: relax.Var
    transposed: relax.Var  # the permute_dims binding
    rows: int  # N
    out_dtype: str | None


@tvm.transform.module_pass(opt_level=0, name="MergeSiblingMatmuls")
class MergeSiblingMatmuls:
    """Merge linear layers sharing an input where no worse; ``self.merged`` lists the groups merged
    as ``(function, [weight binding names])``."""

    def __init__(self, arch: str | None = None) -> None:
        self.arch = arch  # None: the target's in scope when the pass runs
        # A named arch is checked now, so a typo fails where it is written, not when the pass runs.
        self.cost: WeightCost | None = None if arch is None else WeightCost(arch)
        self.merged: list[tuple[str, list[str]]] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.merged = []
        self.cost = WeightCost(self.arch)
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            groups = [g for g in _sibling_groups(func) if self._cheaper(func, g)]
            if groups:
                rewritten = _Merge(groups).visit_expr(func)
                out[gv] = relax.analysis.remove_all_unused(rewritten)
                self.merged += [(gv.name_hint, [m.weight.name for m in g]) for g in groups]
        return out.with_attr(MERGED_ATTR, [[f, names] for f, names in self.merged])

    def _cheaper(self, func: relax.Function, group: list[_Linear]) -> bool:
        users = use_counts(func)
        old = [relax.VarBinding(m.var, binding_value(func, m.var)) for m in group]
        old += [relax.VarBinding(m.transposed, binding_value(func, m.transposed)) for m in group if users[m.transposed] == 1]
        new = emit_bindings(_merged(group, group[0].x, [m.weight for m in group]))
        return self.cost.no_worse(func, new, old, {m.weight for m in group})


# ---- finding siblings --------------------------------------------------------------------------------


def _linear(binding: relax.Binding, values: dict, weights: set[relax.Var]) -> _Linear | None:
    value = binding.value
    if not isinstance(binding, relax.VarBinding) or not isinstance(value, relax.Call):
        return None
    if value.op != tvm.ir.Op.get("relax.matmul"):
        return None
    x, t = value.args
    transpose = values.get(t)
    if not isinstance(x, relax.Var) or not isinstance(transpose, relax.Call):
        return None
    if transpose.op != tvm.ir.Op.get("relax.permute_dims") or transpose.args[0] not in weights:
        return None
    w = transpose.args[0]
    axes = transpose.attrs.axes
    shape = w.ty.shape.values if isinstance(w.ty.shape, relax.ShapeExpr) else None
    if w.ty.ndim != 2 or (axes is not None and [int(a) for a in axes] != [1, 0]) or shape is None:
        return None
    if not isinstance(shape[0], tirx.IntImm):
        return None  # the split needs static row counts
    return _Linear(binding.var, x, w, t, int(shape[0]), matmul_out_dtype(value))


def _sibling_groups(func: relax.Function) -> list[list[_Linear]]:
    weights = weight_vars(func)
    groups: list[list[_Linear]] = []
    defined: set[relax.Var] = set(func.params)
    for block in func.body.blocks:
        values = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
        # Per (x, weight dtype, K, out dtype): the variables bound before its first member (where the
        # merged matmul goes, so every member's weight must be bound by then), and the members.
        by_key: dict[tuple, tuple[set[relax.Var], list[_Linear]]] = {}
        for binding in block.bindings:
            lin = _linear(binding, values, weights) if isinstance(block, relax.DataflowBlock) else None
            if lin is not None:
                key = (lin.x, str(lin.weight.ty.dtype), str(lin.weight.ty.shape.values[1]), lin.out_dtype)
                if key not in by_key:
                    by_key[key] = (set(defined), [lin])
                elif lin.weight in by_key[key][0]:
                    by_key[key][1].append(lin)
            defined.add(binding.var)
        groups += [members for _, members in by_key.values() if len(members) > 1]
    return groups


def _merged(group: list[_Linear], x: relax.Expr, weights: list[relax.Expr]) -> relax.Expr:
    w = relax.op.concat(weights, axis=0)
    y = relax.op.matmul(x, relax.op.permute_dims(w), out_dtype=group[0].out_dtype)
    offsets = np.cumsum([m.rows for m in group])[:-1].tolist()
    return relax.op.split(y, offsets, axis=-1)


@mutator
class _Merge(PyExprMutator):
    """Emit each group's merged matmul where its first member was; members become its parts."""

    def __init__(self, groups: list[list[_Linear]]) -> None:
        super().__init__()
        self.first = {g[0].var: g for g in groups}
        self.later = {m.var for g in groups for m in g[1:]}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.later:
            return  # bound with the group's first member
        group = self.first.get(binding.var)
        if group is None:
            super().visit_var_binding_(binding)
            return
        x = self.visit_expr(group[0].x)
        parts = self.builder_.emit(_merged(group, x, [self.visit_expr(m.weight) for m in group]))
        for i, member in enumerate(group):
            emit = self.builder_.emit if isinstance(member.var, relax.DataflowVar) else self.builder_.emit_output
            self.set_var_remap(member.var, emit(relax.TupleGetItem(parts, i), name_hint=member.var.name))
