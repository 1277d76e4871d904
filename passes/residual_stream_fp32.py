"""Keep a bfloat16 model's residual stream in float32: ``x = x + f(rms_norm(x))`` adds and norms in float32.

bfloat16 keeps 8 significant bits. A LLaMA adds two branch outputs to its residual stream per layer,
and each sum rounded to bfloat16 adds an error of about 2^-9 of the stream, independent from the others:
over Llama-3-8B's 64 additions they walk to about 1.4e-2 of the logits (relative to a float64
forward), against 1e-2 wanted; every other activation rounding together gives about 3e-3
(docs/experiments/bf16-accuracy.md, which measures each site). float16 (3 more bits) is 8x better and
is left alone.

On a CPU target, the stream: a half tensor ``x`` that an ``R.nn.rms_norm`` reads and an ``R.add`` of the same shape and
dtype adds to (the other operand is the branch), then that add's result, and so on down the chain.
Each such add becomes ``add(x32, astype(branch, "float32"))``; each norm of a stream tensor becomes
``astype(rms_norm(x32, astype(w, "float32")), half)``, so the matmuls still read the model dtype; a
stream tensor entering the chain (the function's input embedding) is widened once, and any other use
of a stream tensor (the last position's slice, a function output) reads it rounded back to the half
dtype. Only bfloat16 streams change.

On a GPU target, FuseAddRMSNorm has already made each add and the norm after it one scheduled kernel
``(x, r, w) -> (normed, x + r)`` of the model dtype when this pass runs (the CPU has no such pass).
There, each chain of those kernels (the ``x + r`` of one is the next one's ``x``; any other reader of
an ``x + r``, such as ``decode_attend``'s last residual add, reads it rounded back to bf16) becomes
plain float32-stream functions (``computations.plain_add_rms_norm``: ``x`` in float32 but
the first, the embedding, in bf16; ``r`` and ``w`` widened; ``x + r`` written in float32; the norm
rounded once to bf16), tagged for ``RowReduction`` as ``add_rms_norm_kernels`` tags the bf16 ones; only
where that rule takes every link, else the function keeps its kernels. In decode (static rows)
``fuse_norm_gemv`` then puts each link into the GEMV that reads its norm
(``computations.fused_norm_matmul`` with the stream dtype; ``stream_add_rms_norm_eps`` recognises the
links) where the Gemv rule takes that function; a link it does not fuse stays a RowReduction kernel.
Runs in the ``before_fuse_transpose_matmul`` slot: after FuseAddRMSNorm, before ``fuse_norm_gemv`` and
``add_rms_norm_kernels``.
"""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from ..computations import plain_add_rms_norm
from ..contracts import OP_PATTERN_ATTR, OPAQUE_OP_PATTERN, RULE_ATTR
from ..relax_rewrite import FunctionRewriter, module_with_unique_binding_names, use_counts
from ..rules.row_reduction import RowReduction
from .add_rms_norm_kernels import add_rms_norm_eps

STREAM_DTYPES = ("bfloat16",)
WIDE = "float32"


@tvm.transform.module_pass(opt_level=0, name="ResidualStreamFP32")
class ResidualStreamFP32:
    """Add and normalise a bfloat16 residual stream in float32 (on a GPU: through prefill's add+RMSNorm kernels)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is not None and "gpu" in target.keys:
            chains = {func: _kernel_chain(mod, func, target) for func in mod.functions.values()
                      if isinstance(func, relax.Function)}
            return _KernelChains(mod, chains).transform() if any(c.links for c in chains.values()) else mod
        if not any(stream_adds(f) for f in mod.functions.values() if isinstance(f, relax.Function)):
            return mod
        # The builder names its new bindings ``lv`` again; the fusion plan names bindings by their vars.
        return module_with_unique_binding_names(_Rewriter(mod).transform())


def _emit_as(builder: relax.BlockBuilder, var: relax.Var, value: relax.Expr) -> relax.Var:
    """``value`` bound under ``var``'s name, a dataflow output where ``var`` is one."""
    if isinstance(var, relax.DataflowVar):
        return builder.emit(value, name_hint=var.name)
    return builder.emit_output(value, name_hint=var.name)


def _is(expr: relax.Expr, op: str) -> bool:
    return isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get(op)


def _half_tensor(expr: relax.Expr) -> str | None:
    ty = getattr(expr, "ty", None)
    if isinstance(ty, relax.TensorType) and str(ty.dtype) in STREAM_DTYPES:
        return str(ty.dtype)
    return None


def stream_adds(func: relax.Function) -> dict[relax.Var, tuple[relax.Expr, relax.Expr]]:
    """``{add binding var: (stream operand, branch operand)}`` for each residual add of ``func``'s
    half stream, in binding order (see the module docstring)."""
    normed = set()
    adds = []
    for block in func.body.blocks:
        for b in block.bindings:
            if not isinstance(b, relax.VarBinding):
                continue
            if _is(b.value, "relax.nn.rms_norm") and isinstance(b.value.args[0], relax.Var):
                normed.add(b.value.args[0])
            elif _is(b.value, "relax.add") and _half_tensor(b.var) is not None:
                adds.append(b)
    stream: set[relax.Var] = set(normed)
    found: dict[relax.Var, tuple[relax.Expr, relax.Expr]] = {}
    for b in adds:
        lhs, rhs = b.value.args
        same = [a for a in (lhs, rhs) if getattr(a, "ty", None) is not None
                and tvm_ffi.structural_equal(a.ty, b.var.ty)]
        if len(same) != 2:
            continue  # a broadcast: not a residual add
        x = lhs if lhs in stream else rhs if rhs in stream else None
        if x is None:
            continue
        found[b.var] = (x, rhs if x is lhs else lhs)
        stream.add(b.var)
    return found


@mutator
class _Rewriter(FunctionRewriter):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.adds: dict[relax.Var, tuple[relax.Expr, relax.Expr]] = {}
        self.wide: dict[relax.Var, relax.Var] = {}  # stream var (original) -> its float32 value

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self.adds = stream_adds(func)
        self.wide = {}
        return super().visit_function_(func)

    def _wide(self, x: relax.Expr) -> relax.Expr:
        """The float32 value of stream tensor ``x`` (an original var), widened here on first use."""
        if x not in self.wide:
            self.wide[x] = self.builder_.emit(relax.op.astype(self.visit_expr(x), WIDE))
        return self.wide[x]

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if binding.var in self.adds:
            x, branch = self.adds[binding.var]
            other = self.wide[branch] if branch in self.wide else relax.op.astype(self.visit_expr(branch), WIDE)
            total = self.builder_.emit(relax.op.add(self._wide(x), other))
            self.wide[binding.var] = total
            half = _half_tensor(binding.var)
            self.set_var_remap(binding.var, _emit_as(self.builder_, binding.var, relax.op.astype(total, half)))
            return
        if _is(value, "relax.nn.rms_norm") and (value.args[0] in self.wide or self._stream(value.args[0])):
            x, weight = value.args
            half = _half_tensor(binding.var)
            normed = relax.op.nn.rms_norm(self._wide(x), relax.op.astype(self.visit_expr(weight), WIDE),
                                          axes=value.attrs.axes, epsilon=value.attrs.epsilon)
            out = _emit_as(self.builder_, binding.var, relax.op.astype(self.builder_.emit(normed), half))
            self.set_var_remap(binding.var, out)
            return
        super().visit_var_binding_(binding)

    def _stream(self, x: relax.Expr) -> bool:
        """Whether ``x`` enters the stream: a residual add reads it as its stream operand."""
        return any(s is x or s.same_as(x) for s, _ in self.adds.values())


@dataclasses.dataclass(frozen=True)
class _Link:
    """One FuseAddRMSNorm kernel call of a chain: ``(normed, total) = kernel(x, r, w)``."""

    kernel: tirx.PrimFunc  # the plain float32-stream function that replaces it
    name: str
    out_ty: list[relax.TensorType]


def stream_add_rms_norm_eps(func: tirx.PrimFunc) -> float | None:
    """``eps`` where ``func`` is a float32-stream add+RMSNorm link this pass writes
    (``plain_add_rms_norm(.., x_dtype, "float32")``, recognised by what it computes), else None."""
    if len(func.params) != 5 or str(func.params[4].dtype) != WIDE or str(func.params[1].dtype) not in STREAM_DTYPES:
        return None
    found: list[float] = []

    def visit(node: object) -> None:
        if isinstance(node, tvm.ir.Call) and node.op.name == "tirx.rsqrt" and isinstance(node.args[0], tirx.Add) \
                and isinstance(node.args[0].b, tirx.FloatImm):
            found.append(float(node.args[0].b.value))

    tirx.stmt_functor.post_order_visit(func.body, visit)
    if len(found) != 1:
        return None
    ref = plain_add_rms_norm(func, found[0], str(func.params[0].dtype), WIDE)
    same = tvm_ffi.structural_equal(tirx.PrimFunc(func.params, func.body), tirx.PrimFunc(ref.params, ref.body))
    return found[0] if same else None


@dataclasses.dataclass(frozen=True)
class _Chain:
    """The links of one function's stream, and the totals something other than the next link reads."""

    links: dict[relax.Var, _Link]  # by the kernel call's binding var
    narrowed: frozenset[relax.Var] = frozenset()  # read elsewhere as before, rounded back to bf16


def _kernel_chain(mod: tvm.IRModule, func: relax.Function, target: tvm.target.Target) -> _Chain:
    """The FuseAddRMSNorm kernel calls of ``func`` over a bfloat16 stream (prefill's symbolic rows,
    decode's static ones), when ``RowReduction`` takes each one's float32-stream function; else no
    links (the function keeps its kernels). A total the next call reads as its ``x`` stays float32;
    any other reader (``decode_attend``'s last residual add, a returned hidden state) reads it rounded
    to bf16, as it did."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    calls: dict[relax.Var, tuple[tirx.PrimFunc, float, relax.Expr]] = {}
    totals: dict[relax.Var, relax.Var] = {}  # total var -> its call's var
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and v.op == call_tir and len(v.args[1].fields) == 3:
                kernel = mod[v.args[0]]
                eps = add_rms_norm_eps(kernel) if isinstance(kernel, tirx.PrimFunc) else None
                x = v.args[1].fields[0]
                if eps is not None and _half_tensor(x) is not None:
                    calls[b.var] = (kernel, eps, x)
            elif isinstance(v, relax.TupleGetItem) and v.tuple_value in calls and v.index == 1:
                totals[b.var] = v.tuple_value
    if not calls:
        return _Chain({})
    uses = use_counts(func)
    streamed = {x for _, _, x in calls.values() if x in totals}
    narrowed = frozenset(t for t in totals if uses.get(t, 0) > (1 if t in streamed else 0))
    links = {}
    for var, (kernel, eps, x) in calls.items():
        x_dtype = WIDE if x in totals else _half_tensor(x)
        plain = plain_add_rms_norm(kernel, eps, x_dtype, WIDE).without_attr("global_symbol")
        if not RowReduction.takes(plain, target):
            return _Chain({})
        normed_ty, total_ty = var.ty.fields
        links[var] = _Link(plain.with_attrs({RULE_ATTR: RowReduction.family, OP_PATTERN_ATTR: OPAQUE_OP_PATTERN}),
                           f"fuse_add_norm_{x_dtype}_stream", [normed_ty, relax.TensorType(total_ty.shape, WIDE)])
    return _Chain(links, narrowed)


@mutator
class _KernelChains(FunctionRewriter):
    """FuseAddRMSNorm's kernels of each chain replaced by their float32-stream functions, tagged
    for ``RowReduction`` (as ``add_rms_norm_kernels`` tags the bf16 ones)."""

    def __init__(self, mod: tvm.IRModule, chains: dict[relax.Function, _Chain]) -> None:
        super().__init__(mod)
        self.chains = chains
        self.chain = _Chain({})
        self.wide: dict[relax.Var, relax.Var] = {}  # narrowed total -> its float32 value
        self.kernels: dict[int, tvm.ir.GlobalVar] = {}  # by structural hash: one function per kind of link

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self.chain = self.chains.get(func, _Chain({}))
        self.wide = {}
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.chain.narrowed:
            wide = self.builder_.emit(self.visit_expr(binding.value), name_hint=f"{binding.var.name}_{WIDE}")
            self.wide[binding.var] = wide
            half = _half_tensor(binding.var)
            self.set_var_remap(binding.var, _emit_as(self.builder_, binding.var, relax.op.astype(wide, half)))
            return
        link = self.chain.links.get(binding.var)
        if link is None:
            super().visit_var_binding_(binding)
            return
        key = tvm_ffi.structural_hash(link.kernel)
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(link.kernel, link.name)
        args = relax.Tuple([self.wide.get(a, self.visit_expr(a)) for a in binding.value.args[1].fields])
        self.set_var_remap(binding.var, _emit_as(self.builder_, binding.var, relax.call_tir(self.kernels[key], args, link.out_ty)))
