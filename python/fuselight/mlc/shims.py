"""What MLC-LLM's sources still expect of TVM and 0.26 changed: restored only where missing.

- ``PrimFunc.buffer_map``: 0.26 PrimFunc parameters *are* the buffers (buffer-typed Vars), so the
  mapping is each buffer parameter to itself (read by LowBatchGemvSpecialize and
  LiftTIRGlobalBufferAlloc).
- LiftTIRGlobalBufferAlloc also *builds* PrimFuncs with a ``buffer_map`` and handle parameters;
  its rebuilding helper is replaced by fuselight's 0.26 version.
- ``DataflowVar.name_hint`` is now ``.name`` (read by ScatterTupleGetItem).
- ``nn.tensor_ir_op``: before 0.26 scalar arguments went *after* the outputs (``call_tir``'s
  ``tir_vars``); 0.26 passes every argument in order, then the outputs. MLC's sampler helper
  ``full(result, value)`` is written the old way; such PrimFuncs get their parameters reordered
  (scalar parameters retyped to the argument's dtype, as old ``tir_vars`` converted implicitly).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

# Marks our tensor_ir_op wrapper, so applying the shims twice wraps once.
_WRAPPED = "__fuselight_scalars_last__"


def apply_tvm_shims() -> None:
    """Install every shim the running TVM needs (a no-op on a TVM that has the old interfaces)."""
    from tvm import relax, tirx

    if not hasattr(tirx.PrimFunc, "buffer_map"):
        tirx.PrimFunc.buffer_map = property(_buffer_map)
    if not hasattr(relax.DataflowVar, "name_hint"):
        relax.DataflowVar.name_hint = property(lambda var: var.name)
    if "buffer_map" not in inspect.signature(tirx.PrimFunc.__init__).parameters:
        from ..baseline.lift_global_buffer_alloc import lift_global_allocations

        lift = importlib.import_module("mlc_llm.compiler_pass.lift_global_buffer_alloc")
        lift.remove_global_buf_alloc = lift_global_allocations
    if "tir_vars" not in inspect.signature(relax.call_tir).parameters:
        from tvm.relax.frontend import nn

        # MLC calls it as nn.tensor_ir_op and as nn.op.tensor_ir_op: the same function, two names.
        if not getattr(nn.op.tensor_ir_op, _WRAPPED, False):
            wrapped = _scalars_after_outputs_compat(nn.op.tensor_ir_op)
            nn.op.tensor_ir_op = wrapped
            nn.tensor_ir_op = wrapped


def _buffer_map(func) -> dict:
    from tvm import tirx

    return {param: param for param in func.params if isinstance(param.ty, tirx.BufferType)}


def _scalars_after_outputs_compat(tensor_ir_op: Callable[..., Any]) -> Callable[..., Any]:
    """``tensor_ir_op`` that first reorders a PrimFunc written with scalars after its outputs."""

    @functools.wraps(tensor_ir_op)
    def wrapper(func, name_hint, args, out):
        func, args = scalars_before_outputs(func, args, out)
        return tensor_ir_op(func, name_hint, args, out)

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def scalars_before_outputs(func: Any, args: Any, out: Any) -> tuple[Any, Any]:
    """``(func, args)`` in 0.26's order when ``func``'s parameters are in the pre-0.26 order, else as given.

    Pre-0.26: tensor arguments, outputs, scalar arguments. 0.26: the arguments as given, outputs.
    Only a function whose parameter kinds (buffer or scalar) fit the old order and not the new one
    is rewritten, so calls written for 0.26 pass through unchanged.
    """
    from tvm import relax, tirx
    from tvm.relax.frontend import nn

    arg_list = list(args) if isinstance(args, (tuple, list)) else [args]
    if any(isinstance(arg, relax.ShapeExpr) for arg in arg_list):
        return func, args  # no MLC helper passes one the old way
    kinds = [isinstance(arg, nn.Tensor) for arg in arg_list]  # True: a buffer
    n_out = 1 if isinstance(out, nn.Tensor) else len(out)
    params = list(func.params)
    scalars = [i for i, is_buffer in enumerate(kinds) if not is_buffer]
    if not scalars or len(params) != len(kinds) + n_out:
        return func, args
    param_kinds = [isinstance(p.ty, tirx.BufferType) for p in params]
    new_order = kinds + [True] * n_out
    tensors = len(kinds) - len(scalars)
    old_order = [True] * (tensors + n_out) + [False] * len(scalars)
    if param_kinds == new_order or param_kinds != old_order:
        return func, args
    inputs, outputs, trailing = params[:tensors], params[tensors : tensors + n_out], params[tensors + n_out :]
    # A scalar parameter takes the argument's dtype and is cast back inside: old tir_vars were
    # converted implicitly, 0.26 checks the types (and the VM cannot pass a cast expression).
    scalar_args = [arg for arg, is_buffer in zip(arg_list, kinds) if not is_buffer]
    retyped = [tirx.Var(p.name, str(a.ty)) for p, a in zip(trailing, scalar_args)]
    body = tirx.stmt_functor.substitute(
        func.body, {p: tirx.Cast(str(p.ty), v) for p, v in zip(trailing, retyped) if str(p.ty) != str(v.ty)}
    )
    reordered = _interleave(kinds, inputs, retyped) + outputs
    return tirx.PrimFunc(reordered, body, func.ret_type, func.attrs), args


def _interleave(kinds: Sequence[bool], buffers: Sequence[Any], scalars: Sequence[Any]) -> list[Any]:
    """Buffers and scalars merged in the order ``kinds`` gives (True: next buffer)."""
    buffer_iter, scalar_iter = iter(buffers), iter(scalars)
    return [next(buffer_iter) if is_buffer else next(scalar_iter) for is_buffer in kinds]
