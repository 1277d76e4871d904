"""Mirrors MLC-LLM's ``LiftTIRGlobalBufferAlloc``: global scratch buffers become kernel outputs.

A scheduled PrimFunc may still allocate global-memory scratch in its root block (intermediates that
FuseTIR left and DLight did not move on chip). Left there, each call allocates device memory at run
time. This pass turns every such buffer into an extra output parameter (after the existing outputs,
before scalar parameters) and widens each ``call_tir`` to it, so Relax's static memory planner owns
and reuses that memory. Symbolic dims in a lifted buffer's shape are bound from the call's argument
and output shapes; a call where that fails keeps the original kernel.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from ..relax_rewrite import FunctionRewriter


@tvm.transform.module_pass(opt_level=0, name="LiftTIRGlobalBufferAlloc")
class LiftTIRGlobalBufferAlloc:
    """Lift global-scope ``alloc_buffer``s of PrimFuncs to Relax-allocated kernel outputs."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return _Lifter(mod).transform()


def lift_global_allocations(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, list[relax.TensorType]]:
    """``func`` with its root block's global allocations as extra buffer parameters, and their types."""
    realize = func.body
    if not isinstance(realize, tirx.SBlockRealize):
        return func, []
    root = realize.block
    lifted = [buf for buf in root.alloc_buffers if buf.scope() == "global"]
    if not lifted:
        return func, []
    kept = [buf for buf in root.alloc_buffers if buf.scope() != "global"]
    params = list(func.params)
    after_last_buffer = max(i for i, p in enumerate(params) if isinstance(p.ty, tirx.BufferType)) + 1
    params[after_last_buffer:after_last_buffer] = lifted
    new_root = tirx.SBlock(
        root.iter_vars, root.reads, root.writes, root.name_hint, root.body,
        init=root.init, alloc_buffers=kept, match_buffers=root.match_buffers, annotations=root.annotations,
    )
    body = tirx.SBlockRealize(realize.iter_values, realize.predicate, new_root)
    new_func = tirx.PrimFunc(params, body, func.ret_type, func.attrs)
    return new_func, [relax.TensorType(list(buf.shape), buf.dtype) for buf in lifted]


@mutator
class _Lifter(FunctionRewriter):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        # original GlobalVar -> (original PrimFunc, lifted GlobalVar, types of the lifted buffers)
        self.lifted: dict[tvm.ir.GlobalVar, tuple[tirx.PrimFunc, tvm.ir.GlobalVar, list[relax.TensorType]]] = {}

    def transform(self) -> tvm.IRModule:
        for gv, func in self.mod.functions_items():
            if isinstance(func, tirx.PrimFunc):
                new_func, extra = lift_global_allocations(func)
                if extra:
                    self.lifted[gv] = (func, self.builder_.add_func(new_func, gv.name_hint), extra)
        if not self.lifted:
            return self.mod
        self.rewrite_functions()
        # Kernels whose every call was widened are no longer referenced.
        return relax.transform.DeadCodeElimination()(self.builder_.get())

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if call.op != tvm.ir.Op.get("relax.call_tir") or call.args[0] not in self.lifted:
            return call
        original, new_gv, extra = self.lifted[call.args[0]]
        bound = _bind_symbolic_dims(original, call)
        if bound is None:
            return call
        extra = [relax.TensorType([tirx.stmt_functor.substitute(d, bound) for d in t.shape.values], t.dtype)
                 for t in extra]
        out = call.ty_args[0]
        outputs = list(out.fields) if isinstance(out, relax.TupleType) else [out]
        widened = relax.Call(call.op, [new_gv, *call.args[1:]], call.attrs,
                             [relax.TupleType(outputs + extra)])
        if isinstance(out, relax.TupleType):
            return widened
        return relax.TupleGetItem(self.builder_.emit(widened), 0)


def _bind_symbolic_dims(func: tirx.PrimFunc, call: relax.Call) -> dict[tirx.Var, tvm.ir.PrimExpr] | None:
    """Each symbolic dim of ``func``'s buffer parameters -> its value at ``call``; None if a dim is an
    expression (not a bare variable) that cannot be matched."""
    out = call.ty_args[0]
    relax_types = [arg.ty for arg in call.args[1].fields]
    relax_types += list(out.fields) if isinstance(out, relax.TupleType) else [out]
    buffers = [p for p in func.params if isinstance(p.ty, tirx.BufferType)]
    bound: dict[tirx.Var, tvm.ir.PrimExpr] = {}
    for buf, ty in zip(buffers, relax_types, strict=True):
        for dim, value in zip(buf.shape, ty.shape.values, strict=True):
            if isinstance(dim, tirx.Var):
                bound[dim] = value
            elif not isinstance(dim, tirx.IntImm):
                return None
    # Trailing scalar parameters take the call's ``tir_vars``.
    if len(call.args) > 2:
        scalars = [p for p in func.params if not isinstance(p.ty, tirx.BufferType)]
        bound.update(zip(scalars, call.args[2].values, strict=True))
    return bound
