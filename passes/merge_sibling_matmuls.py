"""Merge sibling linear layers that read the same input into one wider matmul.

Distributivity of the matmul over concatenation: for linear layers ``y_i = matmul(x,
permute_dims(W_i))`` (``W_i`` of shape ``[N_i, K]``) reading the same ``x``,
``[y_1, .., y_k] = split(matmul(x, permute_dims(concat([W_1, .., W_k], axis=0))))``. Exact: every
output element is the same dot product as before. Separate Q/K/V projections or gate/up
projections become one GEMM that reads ``x`` once, as MLC-LLM's models write them by hand.

Weights are runtime parameters (a function's parameters after ``num_input``, or fields of a tuple
parameter there, as MLC packs them): the merged weight is computed in the graph from the separate
ones, a computation on weights only. ``relax.transform.LiftTransformParams`` moves it into a
``<function>_transform_params`` function, which runs once on the real weights; the rewritten
function then takes the merged weights. ``lift_and_transform`` does both for one function:

    mod = MergeSiblingMatmuls()(mod)
    mod, new_weights = lift_and_transform(mod, "decode", weights)  # weights in parameter order

So the pass belongs in no pipeline slot: it changes what the function's caller passes.

Cost: weight-only computations are free (lifted, run once); the rest is ``Classify``'s FLOPs and
bytes plus, per kernel launched, the bytes the GPU could have moved in that time
(``configs/passes/cost.json``). A group is merged only when that is provably no worse for every
value of the symbolic dims (bounded by the function's ``tir_var_upper_bound``): the ``split`` writes
the outputs a second time, so merging pays where ``x`` is re-read by many siblings or launches
dominate (decode), not always for long prefills.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..errors import FuselightError
from ..jsonfile import read_json_object
from ..paths import config_dir
from .classify import classify_binding
from .property_rewrite import emit_bindings, matmul_out_dtype, no_worse

MERGED_ATTR = "fuselight.merged_siblings"


def launch_bytes(arch: str) -> int:
    """Bytes of memory traffic one kernel launch is worth on ``arch`` (``configs/passes/cost.json``)."""
    path = config_dir() / "passes" / "cost.json"
    table = read_json_object(path, missing=f"cost model config not found: {path}")
    if arch not in table:
        raise FuselightError(f"{path}: no launch cost for {arch!r}")
    entry = table[arch]
    return int(entry["launch_overhead_us"] * entry["dram_bandwidth_gb_s"] * 1000)


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

    def __init__(self, arch: str = "sm_90") -> None:
        self.launch_bytes = launch_bytes(arch)
        self.merged: list[tuple[str, list[str]]] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.merged = []
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
        users = _users(func)
        old = [relax.VarBinding(m.var, _value(func, m.var)) for m in group]
        old += [relax.VarBinding(m.transposed, _value(func, m.transposed)) for m in group if users[m.transposed] == 1]
        new = emit_bindings(_merged(group, group[0].x, [m.weight for m in group]))
        weights = {m.weight for m in group}
        bounds = func.attrs.get("tir_var_upper_bound") if func.attrs is not None else None
        return no_worse(self._cost(new, weights), self._cost(old, weights), bounds=bounds)

    def _cost(self, bindings: list[relax.VarBinding], weights: set[relax.Var]) -> list[tirx.PrimExpr] | None:
        """(FLOPs, bytes + launches x launch bytes); bindings computed from weights alone are free."""
        flops: tirx.PrimExpr = tirx.IntImm("int64", 0)
        nbytes: tirx.PrimExpr = tirx.IntImm("int64", 0)
        derived = set(weights)
        for binding in bindings:
            inputs = _tensor_vars(binding.value)
            if inputs and all(v in derived for v in inputs):
                derived.add(binding.var)
                continue
            info = classify_binding(binding)
            f, b = info.cost_exprs()
            if f is None or b is None:
                return None
            launches = 0 if info.mapping == "reorganize" else 1  # views and tuple plumbing launch nothing
            flops, nbytes = flops + f, nbytes + b + launches * self.launch_bytes
        return [flops, nbytes]


def lift_and_transform(
    mod: tvm.IRModule, func: str, weights: Sequence[np.ndarray | Sequence[np.ndarray]]
) -> tuple[tvm.IRModule, list[np.ndarray]]:
    """``mod`` with ``func``'s computations on weights lifted out (``LiftTransformParams``), and
    ``func``'s new weight parameters computed on the CPU from ``weights``, its weight parameters in
    order (a list of arrays for a tuple parameter, as MLC packs them)."""
    lifted = relax.transform.LiftTransformParams()(mod)
    name = f"{func}_transform_params"
    if name not in [gv.name_hint for gv in lifted.get_global_vars()]:
        raise FuselightError(f"function {func!r} has no weight parameters (no num_input attribute)")
    transform = tvm.IRModule({name: lifted[name]})
    vm = relax.VirtualMachine(tvm.compile(transform, target="llvm"), tvm.cpu())
    def runtime(w):
        if isinstance(w, np.ndarray):
            return tvm.runtime.tensor(np.ascontiguousarray(w))
        return tuple(runtime(f) for f in w)

    out = vm[name](tuple(runtime(w) for w in weights))
    return lifted, [t.numpy() for t in out]


# ---- finding siblings --------------------------------------------------------------------------------


def _weights(func: relax.Function) -> set[relax.Var]:
    num_input = func.attrs.get("num_input") if func.attrs is not None else None
    if num_input is None:
        return set()
    weights = set(func.params[int(num_input) :])
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in weights:
                weights.add(b.var)
    return weights


def _value(func: relax.Function, var: relax.Var) -> relax.Expr:
    for block in func.body.blocks:
        for b in block.bindings:
            if b.var.same_as(var):
                return b.value
    raise KeyError(var.name)


def _users(func: relax.Function) -> dict[relax.Var, int]:
    counts: dict[relax.Var, int] = {}

    def visit(node):
        if isinstance(node, relax.Var):
            counts[node] = counts.get(node, 0) + 1

    for block in func.body.blocks:
        for b in block.bindings:
            relax.analysis.post_order_visit(b.value, visit)
    relax.analysis.post_order_visit(func.body.body, visit)
    return counts


def _tensor_vars(expr: relax.Expr) -> list[relax.Var]:
    found: list[relax.Var] = []
    relax.analysis.post_order_visit(
        expr, lambda n: found.append(n) if isinstance(n, relax.Var) and isinstance(n.ty, relax.TensorType) else None
    )
    return found


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
    weights = _weights(func)
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
