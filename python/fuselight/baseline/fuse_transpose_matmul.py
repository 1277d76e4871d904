"""Mirrors MLC-LLM's ``FuseTransposeMatmul``: ``matmul(x, permute_dims(w))`` becomes one ``NT_matmul`` kernel.

Linear layers store weights as ``(out_features, in_features)`` and multiply by their transpose.
Lowered as written, the transpose is a kernel of its own (or a strided read DLight's Matmul rule
does not recognise); reading ``w`` row-wise in the matmul instead gives one kernel whose reduction
runs along contiguous rows of both operands. The fused compute accumulates in the matmul's output
dtype, as the original matmul would. Applies when the transpose swaps the last two axes of ``w``
(``w`` 2-D or more); batch dims broadcast as in ``R.matmul``.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import mutator

from ..relax_rewrite import FunctionRewriter


@tvm.transform.module_pass(opt_level=0, name="FuseTransposeMatmul")
class FuseTransposeMatmul:
    """Fold a last-two-axes transpose of the right operand into the matmul."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return _Rewriter(mod).transform()


@mutator
class _Rewriter(FunctionRewriter):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != tvm.ir.Op.get("relax.matmul") or not isinstance(call.args[1], relax.Var):
            return call
        transpose = self.lookup_binding(call.args[1])
        if not _is_last_two_axes_transpose(transpose):
            return call
        x, w = call.args[0], transpose.args[0]
        out_dtype = call.ty.dtype
        return self.builder_.call_te(lambda a, b: nt_matmul(a, b, out_dtype), x, w, primfunc_name_hint="NT_matmul")


def _is_last_two_axes_transpose(expr: relax.Expr | None) -> bool:
    if not isinstance(expr, relax.Call) or expr.op != tvm.ir.Op.get("relax.permute_dims"):
        return False
    ndim = expr.args[0].ty.ndim
    if ndim < 2:
        return False
    if expr.attrs.axes is None:
        return ndim == 2
    swapped = list(range(ndim))
    swapped[-2], swapped[-1] = swapped[-1], swapped[-2]
    return [int(a) for a in expr.attrs.axes] == swapped


def nt_matmul(a: te.Tensor, b: te.Tensor, out_dtype: str) -> te.Tensor:
    """``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` (``a`` may be a vector: no ``m``)."""
    a_batch = list(a.shape[:-2]) if len(a.shape) > 1 else []
    b_batch = list(b.shape[:-2])
    batch = _broadcast(a_batch, b_batch)
    rows = [] if len(a.shape) == 1 else [a.shape[-2]]
    k = te.reduce_axis((0, a.shape[-1]), name="k")

    def operand_index(t_batch: list, idx_batch: tuple, out_batch: list) -> list:
        # Right-aligned broadcast: a size-1 dim of the operand facing a larger one is read at 0.
        offset = len(out_batch) - len(t_batch)
        return [
            0 if _is_one(d) and not _is_one(out_batch[offset + i]) else idx_batch[offset + i]
            for i, d in enumerate(t_batch)
        ]

    def compute(*idx):
        idx_batch, m, n = idx[: len(batch)], idx[len(batch) : -1], idx[-1]
        lhs = a(*operand_index(a_batch, idx_batch, batch), *m, k).astype(out_dtype)
        rhs = b(*operand_index(b_batch, idx_batch, batch), n, k).astype(out_dtype)
        return te.sum(lhs * rhs, axis=k)

    return te.compute([*batch, *rows, b.shape[-2]], compute, name="NT_matmul")


def _broadcast(x: list, y: list) -> list:
    """Numpy-style broadcast of two shapes, right-aligned; of two unequal non-1 dims the first is kept
    (Relax has already checked the shapes are compatible)."""
    if len(x) < len(y):
        x, y = y, x
    out = list(x[: len(x) - len(y)])
    for dx, dy in zip(x[len(x) - len(y) :], y, strict=True):
        out.append(dy if _is_one(dx) else dx)
    return out


def _is_one(dim: tvm.ir.PrimExpr) -> bool:
    return isinstance(dim, tirx.IntImm) and int(dim) == 1
