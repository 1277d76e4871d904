"""Rewrites that change a function's weights: what they share.

Weights are runtime parameters (a function's parameters after ``num_input``, or fields of a tuple
parameter there, as MLC packs them). A rewrite of weights writes the new weights as computations on
the old ones in the graph; ``relax.transform.LiftTransformParams`` moves those into a
``<function>_transform_params`` function that runs once on the real weights, and the function then
takes the new weights: ``lift_and_transform`` does that for one function and runs the transform on
the CPU. Such rewrites change what the function's caller passes, so they are not pipeline passes.

``WeightCost``: the cost model they decide by. Computations on weights alone are free (lifted, run
once); the rest is ``Classify``'s FLOPs and bytes plus, per kernel launched, the bytes the GPU could
have moved in that time (``configs/passes/cost.json``), compared for every value of the symbolic
dims up to the function's ``tir_var_upper_bound``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tvm
from tvm import relax, tirx

from ..errors import FuselightError
from ..relax_rewrite import visit_nodes
from . import cost_model
from .classify import classify_binding
from .property_rewrite import no_worse


def launch_bytes(arch: str | None = None) -> int:
    """Bytes of memory traffic one kernel launch is worth on ``arch`` (None: the target's in scope)."""
    return cost_model.load(arch).launch_bytes


class WeightCost:
    """``(FLOPs, bytes + launches x launch bytes)`` of bindings, computations on weights free."""

    def __init__(self, arch: str | None) -> None:
        self.launch_bytes = launch_bytes(arch)

    def no_worse(self, func: relax.Function, new: list, old: list, weights: set[relax.Var]) -> bool:
        """Whether bindings ``new`` provably cost no more than ``old`` in ``func``."""
        bounds = func.attrs.get("tir_var_upper_bound") if func.attrs is not None else None
        return no_worse(self.cost(new, weights), self.cost(old, weights), bounds=bounds)

    def cost(self, bindings: list[relax.VarBinding], weights: set[relax.Var]) -> list[tirx.PrimExpr] | None:
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

    out = [t.numpy() for t in vm[name](tuple(runtime(w) for w in weights))]
    # A transform that rounds to a narrow dtype (W * g in float16) can overflow on real weights.
    bad = [i for i, w in enumerate(out) if np.issubdtype(w.dtype, np.floating) and not np.all(np.isfinite(w))]
    if bad:
        raise FuselightError(f"transformed weight(s) {bad} of {func!r} overflow their dtype: keep the original weights")
    return lifted, out


def weight_vars(func: relax.Function) -> set[relax.Var]:
    num_input = func.attrs.get("num_input") if func.attrs is not None else None
    if num_input is None:
        return set()
    weights = set(func.params[int(num_input) :])
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in weights:
                weights.add(b.var)
    return weights


def binding_value(func: relax.Function, var: relax.Var) -> relax.Expr:
    for block in func.body.blocks:
        for b in block.bindings:
            if b.var.same_as(var):
                return b.value
    raise KeyError(var.name)


def _tensor_vars(expr: relax.Expr) -> list[relax.Var]:
    found: list[relax.Var] = []
    visit_nodes(expr, lambda n: found.append(n) if isinstance(n, relax.Var) and isinstance(n.ty, relax.TensorType) else None)
    return found
