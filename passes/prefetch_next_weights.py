"""Have the one-row GEMV before each KV-cache attention ask L2 for the weights read after the attention.

A decode layer's attention, between its QKV projection and o_proj, reads a few pages of the KV cache at
short contexts: for several µs DRAM idles, while every weight GEMV around it streams at the copy rate.
This pass gives the call that computes the attention's q, k and v (through layout-only calls) the
weights the calls after the attention read, in their order (o_proj's, then the next ones'), as extra
inputs its computation never reads, up to a share of the device's L2 (``configs/passes/
prefetch_next_weights.json``: ``l2_share`` of the device model's ``l2_bytes``), and tags its PrimFunc
``contracts.PREFETCH_NEXT_ATTR`` (which parameters, how many bytes of each from the start). The Gemv
rule's row template asks L2 for those bytes after each block's work (``rules.gemm.gemv_rows``), so
they arrive while the attention runs.

Only where it can pay and is understood: the producer is a function the Gemv rule schedules with its
row template (M = 1; asked of the rule, as ``paged_attention`` asks its rule), the device has bulk L2
prefetch (``tma``), and the weights are function parameters of static shape. Nothing is computed
differently: the extra inputs are hints (any schedule but the row template ignores them).
"""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import relax, tirx

from ..contracts import ATTENTION_BUILTIN, ATTENTION_FORWARD_FUNC, PREFETCH_NEXT_ATTR
from ..device import require_device
from ..errors import FuselightError
from ..jsonfile import read_json_object
from ..paths import config_dir
from ..rules.gemm.gemv_rows import PREFETCH_LINE as _LINE
from ..rules.gemv import row_template_takes
from ..target import arch_of

_ATTENTION_FUNCS = (ATTENTION_BUILTIN, ATTENTION_FORWARD_FUNC)


@tvm.transform.module_pass(opt_level=0, name="PrefetchNextWeights")
class PrefetchNextWeights:
    """Pass the weights read after each decode attention to the GEMV before it (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        budget = prefetch_budget(target)
        if budget == 0:
            return mod
        return _rewrite(mod, target, budget)


def prefetch_budget(target: tvm.target.Target | None) -> int:
    """Bytes of weights a GEMV asks L2 for on ``target``: 0 where it cannot (no target, no device model,
    no bulk L2 prefetch)."""
    if target is None or target.kind.name != "cuda":
        return 0
    try:
        device = require_device(arch_of(target))
    except FuselightError:
        return 0
    if not device.has("tma"):
        return 0
    path = config_dir() / "passes" / "prefetch_next_weights.json"
    table = read_json_object(path, missing=f"prefetch config not found: {path}")
    try:
        share = float(table["l2_share"])
    except (KeyError, TypeError, ValueError) as err:
        raise FuselightError(f"{path}: lacks a valid {err}") from None
    if not 0 <= share <= 1:
        raise FuselightError(f"{path}: 'l2_share' must be within 0..1, got {share}")
    return int(device.l2_bytes * share) // _LINE * _LINE


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """Weights a call asks L2 for: each a parameter variable of the caller and its bytes from the start."""

    weights: tuple[tuple[relax.Var, int], ...]


def _nbytes(var: relax.Var) -> int | None:
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = [d for d in ty.shape.values]
    if not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    return math.prod(int(d) for d in dims) * tvm.DataType(ty.dtype).bits // 8


def _is_attention(value: relax.Expr) -> bool:
    return (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.call_dps_packed" and isinstance(value.args[0], relax.ExternFunc)
            and value.args[0].global_symbol in _ATTENTION_FUNCS)


def _call_tir(value: relax.Expr) -> bool:
    return (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.call_tir"
            and isinstance(value.args[0], tvm.ir.GlobalVar))


def _layout_only(mod: tvm.IRModule, value: relax.Expr) -> relax.Expr | None:
    """The input of a call that only re-lays its input out (a reshape: one tensor in, as many elements
    of the same dtype out), else None."""
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.reshape":
        return value.args[0]
    if not _call_tir(value) or len(value.args[1].fields) != 1:
        return None
    src = value.args[1].fields[0]
    if not isinstance(src, relax.Var) or not isinstance(value.ty, relax.TensorType):
        return None
    same = (_nbytes(src) is not None and _nbytes(src) == _static_bytes(value.ty)
            and src.ty.dtype == value.ty.dtype)
    return src if same and not isinstance(mod[value.args[0]], relax.Function) else None


def _static_bytes(ty: relax.TensorType) -> int | None:
    if ty.shape is None or not all(isinstance(d, tirx.IntImm) for d in ty.shape.values):
        return None
    return math.prod(int(d) for d in ty.shape.values) * tvm.DataType(ty.dtype).bits // 8


def _weights(func: relax.Function, bound: dict[relax.Var, relax.Expr]) -> set[relax.Var]:
    """``func``'s weight variables: its parameters after ``num_input``, and the fields of a parameter
    tuple (``packed_params``) bound to variables."""
    n_input = int(func.attrs["num_input"]) if func.attrs is not None and "num_input" in func.attrs else None
    params = list(func.params) if n_input is None else list(func.params[n_input:])
    out = {p for p in params if isinstance(p.ty, relax.TensorType)}
    for var, value in bound.items():
        if isinstance(value, relax.TupleGetItem) and any(value.tuple_value.same_as(p) for p in params):
            out.add(var)
    return out


def plan(mod: tvm.IRModule, target: tvm.target.Target, budget: int) -> dict[relax.Call, Prefetch]:
    """Each call that gets weights to prefetch (see the module docstring), and which."""
    out: dict[relax.Call, Prefetch] = {}
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        for block in func.body.blocks:
            bindings = [b for b in block.bindings if isinstance(b, relax.VarBinding)]
            bound = {b.var: b.value for b in bindings}
            weights = _weights(func, bound)
            for i, binding in enumerate(bindings):
                if not _is_attention(binding.value):
                    continue
                producer = _producer(mod, binding.value.args[1].fields[-1], bound)
                if producer is None or producer in out or not row_template_takes(mod[producer.args[0]], target):
                    continue
                picked = _next_weights(bindings[i + 1:], weights, budget)
                if picked:
                    out[producer] = Prefetch(tuple(picked))
    return out


def _producer(mod: tvm.IRModule, expr: relax.Expr, bound: dict[relax.Var, relax.Expr]) -> relax.Call | None:
    """The call_tir that computes ``expr`` through layout-only calls and tuple fields, or None."""
    while isinstance(expr, relax.Var) and expr in bound:
        value = bound[expr]
        if isinstance(value, relax.TupleGetItem):
            expr = value.tuple_value
            continue
        src = _layout_only(mod, value)
        if src is not None:
            expr = src
            continue
        return value if _call_tir(value) else None
    return None


def _next_weights(after: list[relax.VarBinding], weights: set[relax.Var], budget: int) -> list[tuple[relax.Var, int]]:
    """The weights the calls in ``after`` read, in order, up to the next attention, and the bytes of
    each within ``budget``."""
    picked: list[tuple[relax.Var, int]] = []
    for binding in after:
        if _is_attention(binding.value) or budget < _LINE:
            break
        if not _call_tir(binding.value):
            continue
        for arg in binding.value.args[1].fields:
            size = _nbytes(arg) if arg in weights else None
            if size is None or any(arg.same_as(w) for w, _ in picked):
                continue
            take = min(size // _LINE * _LINE, budget)
            if take > 0:
                picked.append((arg, take))
                budget -= take
    return picked


def _rewrite(mod: tvm.IRModule, target: tvm.target.Target, budget: int) -> tvm.IRModule:
    planned = plan(mod, target, budget)
    if not planned:
        return mod
    bb = relax.BlockBuilder(mod)
    added: dict[tuple, tvm.ir.GlobalVar] = {}
    replaced: set[str] = set()
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        blocks = []
        for block in func.body.blocks:
            bindings = []
            for b in block.bindings:
                if isinstance(b, relax.VarBinding) and b.value in planned:
                    new_gv = _with_prefetch(bb, mod, b.value, planned[b.value], added)
                    replaced.add(b.value.args[0].name_hint)
                    args = [*b.value.args[1].fields, *(w for w, _ in planned[b.value].weights)]
                    call = relax.Call(b.value.op, [new_gv, relax.Tuple(args), *b.value.args[2:]], b.value.attrs,
                                      b.value.ty_args)
                    b = relax.VarBinding(b.var, call)
                bindings.append(b)
            blocks.append(type(block)(bindings))
        body = relax.SeqExpr(blocks, func.body.body)
        bb.update_func(gv, relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span))
    out = bb.get()
    used = {g.name_hint for _, f in out.functions_items() if isinstance(f, relax.Function)
            for g in relax.analysis.all_global_vars(f)}
    for name in replaced - used:
        del out[out.get_global_var(name)]
    return out


def _with_prefetch(bb: relax.BlockBuilder, mod: tvm.IRModule, call: relax.Call, prefetch: Prefetch,
                   added: dict[tuple, tvm.ir.GlobalVar]) -> tvm.ir.GlobalVar:
    """The GlobalVar of ``call``'s PrimFunc with ``prefetch``'s weights as inputs after its own (one
    function per callee and weight signature), added to ``bb``'s module."""
    callee = call.args[0]
    sig = tuple((tuple(int(d) for d in w.ty.shape.values), w.ty.dtype, n) for w, n in prefetch.weights)
    key = (callee.name_hint, sig)
    if key not in added:
        func = mod[callee]
        extra = [tirx.decl_buffer([int(d) for d in w.ty.shape.values], w.ty.dtype, f"prefetch{i}")
                 for i, (w, _) in enumerate(prefetch.weights)]
        n_in = len(call.args[1].fields)  # the inputs, then the outputs and any shape variables
        params = [*func.params[:n_in], *extra, *func.params[n_in:]]
        attr = [[n_in + i, n] for i, (_, n) in enumerate(prefetch.weights)]
        new = tirx.PrimFunc(params, func.body, func.ret_type, func.attrs).with_attr(PREFETCH_NEXT_ATTR, attr)
        gv = bb.add_func(new, f"{callee.name_hint}_prefetch")
        if "global_symbol" in func.attrs:
            bb.update_func(gv, new.with_attr("global_symbol", gv.name_hint))
        added[key] = gv
    return added[key]
