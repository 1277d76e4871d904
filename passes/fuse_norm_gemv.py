"""Compute each decode RMSNorm (and its residual add) inside the GEMV that consumes it: one launch, not two.

In a decode step every RMSNorm of a LLaMA layer feeds exactly one linear layer (the QKV projection,
the gate+up projection; the final norm the LM head), and with one token row that linear layer is a
GEMV whose kernel reads the normed row anyway. This pass finds::

    normed = rms_norm(x (+ r), w)       # FuseAddRMSNorm's kernel (normed, x + r), or a float32-stream
                                        # one of residual_stream_fp32 (x + r in float32), or
                                        # R.nn.rms_norm(R.add(x, r), w), or R.nn.rms_norm(x, w)
    y = call_tir(F, (normed, W))        # F: a matmul PrimFunc the GEMM analysis recognises
                                        # (FuseGateUpSiLU's unscheduled function included), or
    y = matmul(normed, W)               # W a [K, N] dequantized weight (MLC-LLM's KN layout,
                                        # which FuseTransposeMatmul leaves as it is)
    z = astype(astype(y ...))           # casts of y, each the only use of the one before (optional)

where ``normed`` has no other use, the token rows are static and ``W`` is a weight the function loads,
and replaces them with one ``call_tir`` of a PrimFunc ``(x[, r], w, W) -> (z[, x + r])`` written plainly
(``fuselight.computations.fused_norm_matmul``: TOPI's add and rms_norm, ``F``'s own stages reading
the norm, the casts; spliced by FuseTIR). A 4-bit weight comes along with its dequantize: ``W``
computed by a dequantize call of loaded packed words and scales, used by ``F`` alone
(``weight_source.dequantized_weight``), or ``F`` dequantizing them itself (``F(normed, q, s)``,
FuseGateUpSiLU's function for a quantized weight): the fused PrimFunc then reads the packed words
and scales, ``(x[, r], w, q, s)``, and the dequantized weight is never written (it would be if the
norm's GEMV read it alone). The fused function is left unscheduled for the GEMV rule in phase 4 (tagged
``RULE_ATTR = "gemv"``, opaque to FuseOps), whose template computes the norm in every block
(``rules.gemm.gemv``). Only where that rule takes it (``Gemv.takes``: analysis and configs, nothing
built): the other GEMM templates take no norm prologue, so the fused function must never reach them
(prefill, with its symbolic rows, keeps the separate norm kernel; there the norm is a small part of
the time). ``FuseNormIntoGemv(schedule=False)`` fuses (untagged) wherever the GEMM analysis
recognises the fused function with static rows (any target: e.g. to check the numbers on the CPU).

Runs after the graph passes (FuseGateUpSiLU, FuseTransposeMatmul) and before
``add_rms_norm_kernels``, which replaces FuseAddRMSNorm's kernels with ones this pass does not read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from ..computations import fused_norm_matmul, matmul_prim_func, with_dequantized_weight
from ..contracts import IS_SCHEDULED_ATTR, OP_PATTERN_ATTR, OPAQUE_OP_PATTERN, RULE_ATTR
from ..contracts import NORM_GEMV_NAME as PRIMFUNC_NAME
from ..relax_rewrite import FunctionRewriter, rewrite_for_target, use_counts, visit_nodes
from ..rules.gemm.analysis import analyze_matmul
from ..rules.gemv import Gemv
from .add_rms_norm_kernels import add_rms_norm_eps
from .residual_stream_fp32 import stream_add_rms_norm_eps
from .weight_source import dequantized_weight, loaded_weight


@dataclasses.dataclass(frozen=True)
class _Site:
    """One norm and the matmul it feeds, as found in a Relax function."""

    anchor: relax.Var  # where the fused call goes: the norm kernel's result, the add, or the rms_norm
    kind: str  # "kernel", "add" (R.nn.rms_norm of an R.add) or "norm" (R.nn.rms_norm alone)
    x: relax.Expr
    residual: relax.Expr | None
    weight: relax.Expr
    eps: float
    stream: str | None  # the dtype of a float32 stream's x + r (residual_stream_fp32), else None
    consumer: tirx.PrimFunc  # plain: (A, *matrices) -> y, the dequantize included where there is one
    matrices: tuple[relax.Expr, ...]  # the weight, or its packed words and scales
    casts: tuple[str, ...]
    final: relax.Var  # the binding the GEMV's result replaces
    dropped: tuple[relax.Var, ...]  # bindings that vanish (the norm, the matmul, the casts before final)


def _op(expr: Any, name: str) -> bool:
    return isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get(name)


def _shape(expr: Any) -> list[Any] | None:
    """The dimensions of a tensor-typed ``expr`` whose shape is known (static or symbolic), else None."""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def _static_shape(expr: Any) -> list[int] | None:
    dims = _shape(expr)
    return [int(d) for d in dims] if dims is not None and all(isinstance(d, tirx.IntImm) for d in dims) else None


def _vars(expr: Any) -> list[relax.Var]:
    found: list[relax.Var] = []
    visit_nodes(expr, lambda n: found.append(n) if isinstance(n, relax.Var) else None)
    return found


@tvm.transform.module_pass(opt_level=0, name="FuseNormIntoGemv")
class FuseNormIntoGemv:
    """Replace an RMSNorm and the GEMV reading it by one fused call (see the module docstring)."""

    def __init__(self, schedule: bool = True) -> None:
        self.schedule = schedule

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_for_target(_Rewriter, mod, self.schedule)


class _Finder:
    """The sites of one Relax function (see the module docstring)."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function, consumer_of: Any) -> None:
        self.mod, self.consumer_of = mod, consumer_of
        self.var2val = relax.analysis.get_var2val(func)
        self.order: dict[relax.Var, int] = {}
        self.users: dict[relax.Var, list[relax.Var]] = {}
        self.uses = use_counts(func)
        bindings = [b for block in func.body.blocks for b in block.bindings]
        for i, b in enumerate(bindings):
            self.order[b.var] = i
            for v in _vars(b.value):
                self.users.setdefault(v, []).append(b.var)
        self.sites: list[_Site] = []
        for b in bindings:
            site = self._site(b.var, b.value)
            if site is not None and all(not s.anchor.same_as(site.anchor) for s in self.sites):
                self.sites.append(site)

    def _before(self, expr: Any, anchor: relax.Var) -> bool:
        """Whether ``expr`` is defined before ``anchor`` (a parameter, or bound earlier)."""
        return not isinstance(expr, relax.Var) or self.order.get(expr, -1) < self.order[anchor]

    def _only_user(self, var: relax.Var) -> relax.Var | None:
        users = self.users.get(var, [])
        return users[0] if len(users) == 1 and self.uses.get(var, 0) == 1 else None

    def _site(self, var: relax.Var, value: Any) -> _Site | None:
        if _op(value, "relax.call_tir") and isinstance(value.args[0], tvm.ir.GlobalVar):
            callee, args = value.args[0], list(value.args[1].fields)
        elif _op(value, "relax.matmul"):
            callee, args = value, list(value.args)  # R.matmul(normed, W): W [K, N] (KN), below
        else:
            return None
        if len(args) < 2 or not isinstance(args[0], relax.Var) or self._only_user(args[0]) is None:
            return None
        normed, matrices = args[0], tuple(args[1:])
        if _static_shape(normed) is None or (callee is value and len(_shape(matrices[0]) or ()) != 2):
            return None
        dequantize = dequantized_weight(matrices[0], self.var2val, self.uses) if len(matrices) == 1 else None
        if dequantize is not None:
            # Carried along: the fused function dequantizes the packed words it reads.
            computed = [matrices[0]]
            matrices = tuple(dequantize.args[1].fields)
        elif callee is value or not all(loaded_weight(m, self.var2val) for m in matrices):
            # A computed weight this pass cannot carry stays with its matmul; an R.matmul is taken
            # only with a dequantized weight (float weights come as FuseTransposeMatmul's kernels).
            return None
        else:
            computed = []
        consumer = self.consumer_of(callee, None if dequantize is None else dequantize.args[0])
        if consumer is None:
            return None
        casts, final, dropped = [], var, [normed, var, *computed]
        while (user := self._only_user(final)) is not None and _op(self.var2val.get(user), "relax.astype"):
            casts.append(str(self.var2val[user].attrs.dtype))
            final = user
            dropped.append(user)
        dropped.remove(final)
        norm = self._norm(normed)
        if norm is None:
            return None
        kind, anchor, x, residual, weight, eps, stream = norm
        # The fused call goes where the norm (or its add) was: what it reads must be there already.
        if not all(self._before(e, anchor) for e in (*matrices, weight)):
            return None
        return _Site(anchor, kind, x, residual, weight, eps, stream, consumer, matrices, tuple(casts), final,
                     tuple(dropped))

    def _norm(self, normed: relax.Var) -> tuple[str, relax.Var, Any, Any, Any, float, str | None] | None:
        value = self.var2val.get(normed)
        if isinstance(value, relax.TupleGetItem) and int(value.index) == 0 and isinstance(value.tuple_value, relax.Var):
            lv = value.tuple_value
            kernel = self.var2val.get(lv)
            if not _op(kernel, "relax.call_tir") or not isinstance(kernel.args[0], tvm.ir.GlobalVar):
                return None
            called = self.mod[kernel.args[0]]
            eps, stream = add_rms_norm_eps(called), None
            if eps is None and (eps := stream_add_rms_norm_eps(called)) is not None:
                stream = str(called.params[4].dtype)
            items = [self.var2val.get(u) for u in self.users.get(lv, [])]
            if eps is None or self.uses.get(lv, 0) != len(items):
                return None  # the kernel's result used other than through its two fields
            if not all(isinstance(i, relax.TupleGetItem) for i in items) or [int(i.index) for i in items].count(0) != 1:
                return None
            x, r, w = kernel.args[1].fields
            return "kernel", lv, x, r, w, eps, stream
        if not _op(value, "relax.nn.rms_norm"):
            return None
        data, weight = value.args
        ndim = len(_static_shape(normed))
        if [int(a) % ndim for a in value.attrs.axes] != [ndim - 1]:
            return None
        eps = float(value.attrs.epsilon)
        summed = self.var2val.get(data) if isinstance(data, relax.Var) else None
        if _op(summed, "relax.add") and all(
            _static_shape(a) == _static_shape(data) and a.ty.dtype == data.ty.dtype for a in summed.args
        ):
            return "add", data, summed.args[0], summed.args[1], weight, eps, None
        return "norm", normed, data, None, weight, eps, None


@mutator
class _Rewriter(FunctionRewriter):
    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target | None) -> None:
        super().__init__(mod)
        self.target = target  # None: fuse wherever recognised, untagged
        self.consumers: dict[tuple, tirx.PrimFunc | None] = {}
        self.kernels: dict[tuple, tvm.ir.GlobalVar | None] = {}
        self.anchors: dict[relax.Var, _Site] = {}
        self.finals: dict[relax.Var, _Site] = {}
        self.dropped: set[relax.Var] = set()
        self.fused: dict[relax.Var, relax.Var] = {}  # final -> the fused call's result
        for _, func in mod.functions_items():
            if isinstance(func, relax.Function):
                for site in _Finder(mod, func, self._consumer).sites:
                    if self._kernel(site) is not None:
                        self.anchors[site.anchor] = site
                        self.finals[site.final] = site
                        self.dropped.update(site.dropped)

    def _consumer(self, callee: tvm.ir.GlobalVar | relax.Call, dequantize: tvm.ir.GlobalVar | None) -> tirx.PrimFunc | None:
        """The plain matmul function ``(A, *matrices) -> y`` that ``callee`` computes (a called
        PrimFunc, or an ``R.matmul`` of a ``[K, N]`` weight, ``computations.matmul_prim_func``; after
        ``dequantize``, spliced in front, where its weight is dequantized by that call), or None."""
        if isinstance(callee, relax.Call):
            a, w = callee.args
            key = ("matmul", *(tvm_ffi.structural_hash(e.ty) for e in (a, w)), str(callee.ty.dtype), dequantize)
        else:
            key = (callee, dequantize)
        if key not in self.consumers:
            if isinstance(callee, relax.Call):
                func = matmul_prim_func(_shape(a), _shape(w), str(a.ty.dtype), str(callee.ty.dtype))
            else:
                func = self.mod[callee]
            deq = None if dequantize is None else self.mod[dequantize]
            plain = None
            if all(isinstance(f, tirx.PrimFunc) and IS_SCHEDULED_ATTR not in (f.attrs or {}) for f in (func, deq or func)):
                if deq is not None and len(func.params) == 3:
                    func = with_dequantized_weight(func, deq)
                desc = analyze_matmul(func, dequant=True)
                ops = desc.operands if desc is not None else None
                inputs = None if ops is None else [ops.a, ops.b] if ops.dequant is None else [
                    ops.a, ops.b, ops.dequant.scale, *([] if ops.dequant.zeros is None else [ops.dequant.zeros])]
                # Only the dequantizes the GEMV templates recognise travel: (A, q, s) -> y, or
                # (A, q, z, s) -> y with packed zero points (AWQ).
                if inputs is not None and (deq is None or ops.dequant is not None) \
                        and len(func.params) == len(inputs) + 1 and func.params[0].same_as(inputs[0]) \
                        and all(any(p.same_as(b) for b in inputs[1:]) for p in func.params[1:-1]):
                    plain = func
            self.consumers[key] = plain
        return self.consumers[key]

    def _kernel(self, site: _Site) -> tvm.ir.GlobalVar | None:
        """The fused function's GlobalVar (added once per distinct computation), or None where it is
        not made: not recognised with static rows, or not taken by the GEMV rule."""
        key = (site.residual is not None, site.eps, tuple(site.casts), site.stream,
               *(tvm_ffi.structural_hash(e.ty) for e in (site.x, site.weight, *site.matrices)),
               tvm_ffi.structural_hash(site.consumer))
        if key not in self.kernels:
            func = fused_norm_matmul(site.x.ty, site.residual is not None, site.weight.ty, site.eps,
                                     site.consumer, [m.ty for m in site.matrices], site.casts, site.stream)
            desc = analyze_matmul(func, prologue=True, dequant=True)
            if desc is None or desc.m_static is None:
                func = None
            elif self.target is not None:
                takes = Gemv.takes(func, self.target)
                func = func.with_attrs({RULE_ATTR: Gemv.family, OP_PATTERN_ATTR: OPAQUE_OP_PATTERN}) if takes else None
            self.kernels[key] = None if func is None else self.builder_.add_func(func, PRIMFUNC_NAME)
        return self.kernels[key]

    def _bind(self, var: relax.Var, value: relax.Expr) -> None:
        if isinstance(var, relax.DataflowVar) or not self.builder_.current_block_is_dataflow():
            new = value if isinstance(value, relax.Var) else self.builder_.emit(value, var.name)
        else:
            new = self.builder_.emit_output(value, var.name)
        self.set_var_remap(var, new)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var = binding.var
        if var in self.anchors:
            site = self.anchors[var]
            args = [self.visit_expr(e) for e in (site.x, site.residual, site.weight, *site.matrices) if e is not None]
            final_ty = relax.TensorType(list(site.final.ty.shape.values), site.final.ty.dtype)
            out_ty = [final_ty, relax.TensorType(list(site.x.ty.shape.values), site.stream or site.x.ty.dtype)] \
                if site.residual is not None else final_ty
            fused = self.builder_.emit(relax.call_tir(self._kernel(site), args, out_ty), PRIMFUNC_NAME)
            self.fused[site.final] = fused
            if site.kind == "kernel":
                self._bind(var, fused)  # its fields: [1] is x + r as before; [0] only fed the matmul
            elif site.kind == "add":
                self._bind(var, relax.TupleGetItem(fused, 1))
        elif var in self.finals:
            site = self.finals[var]
            fused = self.fused[var]
            self._bind(var, relax.TupleGetItem(fused, 0) if site.residual is not None else fused)
        elif var not in self.dropped:
            super().visit_var_binding_(binding)
