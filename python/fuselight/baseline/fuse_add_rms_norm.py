"""Mirrors MLC-LLM's ``FuseAddRMSNorm``: ``rms_norm(add(x, r), w)`` becomes one hand-scheduled kernel.

The residual add and the RMSNorm that follows it read the same row; one kernel per row does both:
each thread keeps its slice of ``x + r`` in registers, writes it out (the residual stream needs it),
sums its squares in float32, the block reduces the sums across threads, and each thread then scales
its slice. Applies to float16/bfloat16 3-D ``(d0, d1, hidden)`` tensors normalised over the last axis
when ``hidden`` is a multiple of the thread count (the target's threads per block, at most 1024), as
MLC's does; GPU targets only (the pipeline skips it for llvm).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator
from tvm.script import tirx as T

from ..relax_rewrite import FunctionRewriter

HALF_DTYPES = ("float16", "bfloat16")
MAX_THREADS = 1024


@tvm.transform.module_pass(opt_level=0, name="FuseAddRMSNorm")
class FuseAddRMSNorm:
    """Fuse a residual add into the RMSNorm that consumes it."""

    def __init__(self, target: tvm.target.Target) -> None:
        self.threads = min(MAX_THREADS, _max_threads_per_block(target))

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return _Rewriter(mod, self.threads).transform()


def _max_threads_per_block(target: tvm.target.Target) -> int:
    attrs = target.attrs
    return max(int(attrs["max_num_threads"]), int(attrs.get("max_threads_per_block", 0)))


@mutator
class _Rewriter(FunctionRewriter):
    def __init__(self, mod: tvm.IRModule, threads: int):
        super().__init__(mod)
        self.threads = threads
        self.kernels: dict[tuple[int, float, str], tvm.ir.GlobalVar] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != tvm.ir.Op.get("relax.nn.rms_norm") or not isinstance(call.args[0], relax.Var):
            return call
        summed = self.lookup_binding(call.args[0])
        if not isinstance(summed, relax.Call) or summed.op != tvm.ir.Op.get("relax.add"):
            return call
        x, residual = summed.args
        weight = call.args[1]
        ty = call.ty
        if (
            ty.dtype not in HALF_DTYPES
            or ty.ndim != 3
            or list(call.attrs.axes) not in ([-1], [2])
            or not tvm_ffi.structural_equal(x.ty, residual.ty)
            or not isinstance(ty.shape.values[-1], tirx.IntImm)
            or int(ty.shape.values[-1]) % self.threads != 0
        ):
            return call
        hidden = int(ty.shape.values[-1])
        key = (hidden, float(call.attrs.epsilon), ty.dtype)
        if key not in self.kernels:
            # One kernel serves both of the shapes MLC writes a kernel each for, (1, seq_len, hidden)
            # and (batch, 1, hidden).
            kernel = add_rms_norm_kernel(hidden, *key[1:], self.threads)
            self.kernels[key] = self.builder_.add_func(kernel, "fuse_add_norm")
        both = self.builder_.emit(relax.call_tir(self.kernels[key], [x, residual, weight], [x.ty, x.ty]))
        # Later users of the add now read the kernel's second output.
        self.set_var_remap(call.args[0], self.builder_.emit(relax.TupleGetItem(both, 1)))
        return relax.TupleGetItem(both, 0)


def add_rms_norm_kernel(hidden: int, eps: float, dtype: str, threads: int) -> tirx.PrimFunc:
    """``out = rms_norm(x + r, w)`` and ``total = x + r`` over ``(d0, d1, hidden)``; one block per row."""
    chunks = hidden // threads
    inv_hidden = T.float32(1.0 / hidden)
    eps32 = T.float32(eps)

    @T.prim_func(private=True, s_tir=True)
    def add_rms_norm(var_x: T.handle, var_r: T.handle, var_w: T.handle, var_out: T.handle, var_total: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": 1})
        d0, d1 = T.int64(), T.int64()
        X = T.match_buffer(var_x, (d0, d1, hidden), dtype)
        R = T.match_buffer(var_r, (d0, d1, hidden), dtype)
        W = T.match_buffer(var_w, (hidden,), dtype)
        Out = T.match_buffer(var_out, (d0, d1, hidden), dtype)
        Total = T.match_buffer(var_total, (d0, d1, hidden), dtype)
        # Per thread: its `chunks` values of x + r, and its partial sum of squares.
        row_vals = T.sblock_alloc_buffer((chunks,), dtype, scope="local")
        partial = T.sblock_alloc_buffer((threads, d0 * d1), "float32", scope="local")
        sum_sq = T.sblock_alloc_buffer((d0 * d1,), "float32", scope="shared")
        for row in T.thread_binding(d0 * d1, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                for c in range(chunks):
                    with T.sblock("add"):
                        vr = T.axis.spatial(d0 * d1, row)
                        vh = T.axis.spatial(hidden, c * threads + tx)
                        row_vals[vh // threads] = X[vr // d1, vr % d1, vh] + R[vr // d1, vr % d1, vh]
                        Total[vr // d1, vr % d1, vh] = row_vals[vh // threads]
                with T.sblock("sum_sq_partial_init"):
                    vt, vr = T.axis.remap("SS", [tx, row])
                    partial[vt, vr] = T.float32(0)
                for c in range(chunks):
                    with T.sblock("sum_sq_partial"):
                        vt, vr, vc = T.axis.remap("SSR", [tx, row, c])
                        partial[vt, vr] += T.float32(row_vals[vc]) * T.float32(row_vals[vc])
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("sum_sq"):
                    vt, vr = T.axis.remap("RS", [tx, row])
                    with T.init():
                        sum_sq[vr] = T.float32(0)
                    sum_sq[vr] += partial[vt, vr]
            for c in range(chunks):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    with T.sblock("norm"):
                        vr = T.axis.spatial(d0 * d1, row)
                        vh = T.axis.spatial(hidden, c * threads + tx)
                        Out[vr // d1, vr % d1, vh] = T.Cast(
                            dtype,
                            T.rsqrt(sum_sq[vr] * inv_hidden + eps32)
                            * T.float32(row_vals[vh // threads])
                            * T.float32(W[vh]),
                        )

    return add_rms_norm
