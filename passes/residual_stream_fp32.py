"""Keep a bfloat16 model's residual stream in float32: ``x = x + f(rms_norm(x))`` adds and norms in float32.

bfloat16 keeps 8 significant bits. A LLaMA adds two branch outputs to its residual stream per layer,
and each sum rounded to bfloat16 adds an error of about 2^-9 of the stream, independent from the others:
over Llama-3-8B's 64 additions they walk to about 1.4e-2 of the logits (relative to a float64
forward), against 1e-2 wanted; every other activation rounding together gives about 3e-3
(docs/experiments/bf16-accuracy.md, which measures each site). float16 (3 more bits) is 8x better and
is left alone.

The stream: a half tensor ``x`` that an ``R.nn.rms_norm`` reads and an ``R.add`` of the same shape and
dtype adds to (the other operand is the branch), then that add's result, and so on down the chain.
Each such add becomes ``add(x32, astype(branch, "float32"))``; each norm of a stream tensor becomes
``astype(rms_norm(x32, astype(w, "float32")), half)``, so the matmuls still read the model dtype; a
stream tensor entering the chain (the function's input embedding) is widened once, and any other use
of a stream tensor (the last position's slice, a function output) reads it rounded back to the half
dtype. Only bfloat16 streams change.

Only on targets without fuselight's GPU rules: on a GPU, FuseAddRMSNorm has already made each add and
the norm after it one kernel of the model dtype when this pass runs, and ``fuse_norm_gemv`` and
``add_rms_norm_kernels`` after it take only those; none of the kernels they lead to yet reads or
writes a float32 stream (the plan is in the experiment log). A GPU target is returned unchanged. Runs
in the ``before_fuse_transpose_matmul`` slot: on the CPU the adds and norms are plain ``R.add`` /
``R.nn.rms_norm`` there.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import mutator

from ..relax_rewrite import FunctionRewriter, module_with_unique_binding_names

STREAM_DTYPES = ("bfloat16",)
WIDE = "float32"


@tvm.transform.module_pass(opt_level=0, name="ResidualStreamFP32")
class ResidualStreamFP32:
    """Add and normalise a bfloat16 residual stream in float32 (CPU targets; GPU targets unchanged)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is not None and "gpu" in target.keys:
            return mod
        if not any(stream_adds(f) for f in mod.functions.values() if isinstance(f, relax.Function)):
            return mod
        # The builder names its new bindings ``lv`` again; the fusion plan names bindings by their vars.
        return module_with_unique_binding_names(_Rewriter(mod).transform())


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
            self.set_var_remap(binding.var, self._emit_as(binding.var, relax.op.astype(total, half)))
            return
        if _is(value, "relax.nn.rms_norm") and (value.args[0] in self.wide or self._stream(value.args[0])):
            x, weight = value.args
            half = _half_tensor(binding.var)
            normed = relax.op.nn.rms_norm(self._wide(x), relax.op.astype(self.visit_expr(weight), WIDE),
                                          axes=value.attrs.axes, epsilon=value.attrs.epsilon)
            out = self._emit_as(binding.var, relax.op.astype(self.builder_.emit(normed), half))
            self.set_var_remap(binding.var, out)
            return
        super().visit_var_binding_(binding)

    def _emit_as(self, var: relax.Var, value: relax.Expr) -> relax.Var:
        """``value`` bound under ``var``'s name, a dataflow output where ``var`` is one."""
        if isinstance(var, relax.DataflowVar):
            return self.builder_.emit(value, name_hint=var.name)
        return self.builder_.emit_output(value, name_hint=var.name)

    def _stream(self, x: relax.Expr) -> bool:
        """Whether ``x`` enters the stream: a residual add reads it as its stream operand."""
        return any(s is x or s.same_as(x) for s, _ in self.adds.values())
