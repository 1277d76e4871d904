"""Give the paged KV cache one kernel for RoPE and the KV append: split-rotary + transpose-append -> one.

In decode, TVM's KV cache (``AttentionWithFusedQKV``) calls ``f_split_rotary(qkv, positions, q, k, v,
apply_rope)``, then ``f_transpose_append(pages, k, v, append_positions)``, two launches a layer, the
second a tiny kernel that waits for the first only to copy its k and v into the pages. This pass
builds ``fused_rope_append(qkv, positions, q, k, v, apply_rope, pages, append_positions)``: TVM's
split-rotary function whose k and v stores also store the same values into the pages (where the
append position is not -1, as TVM's append skips it). It then hands the cache wrappers of its
kernels (``fuselight.kv_hooks``, registered by the fuselight runtime): the split-rotary wrapper
records its arguments, the append wrapper runs the fused kernel on them, and every other kernel's
wrapper first runs a recorded split-rotary, so every kernel sees what it would without the pass,
in any order the cache calls them (prefill attends before it appends).

The rewrite is skipped (module unchanged) unless both kernels are TVM's layout: split-rotary over
[tokens, heads, dim] buffers with exactly one store to k and one to v, and the append's pages
[pages, 2, kv heads, page size, dim] with k's heads and dim and the same dtype, and every kernel of
the cache a PrimFunc of the module (an external one could not be wrapped). Programs that run
such a library must have the fuselight runtime imported (``fuselight.runtime`` registers the
wrappers); MLC-LLM's engine does not, so the MLC integration leaves this pass out.
"""

from __future__ import annotations

import dataclasses

import tvm
from fuselight.rules.paged_attention import static_dim
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from ..relax_rewrite import FunctionRewriter
from .paged_attention import create_calls, global_vars

HOOKS_FUNC = "fuselight.kv_cache.fuse_rope_append"
FUSED_NAME = "fused_rope_append"
FUSED_ATTR = "fuselight.fused_rope_append"  # launch counting (fuselight.compile.kv_cache_kernels) reads it
# Positions among the create call's arguments (after its packed function's name; TVM 0.26's
# TIRPagedKVCache): f_transpose_append (MHA) and f_split_rotary.
TRANSPOSE_APPEND_ARG = 13
SPLIT_ROTARY_ARG = 24


@dataclasses.dataclass(frozen=True)
class RopeAppendDesc:
    """The two kernels' buffers: the rope function's k and v outputs, the append's pages and positions."""

    k: tirx.Var
    v: tirx.Var
    pages: tirx.Var
    append_positions: tirx.Var


def _buffers(func: tirx.PrimFunc) -> list[tirx.Var]:
    return [p for p in func.params if isinstance(p.ty, tirx.BufferType)]


def _stores(func: tirx.PrimFunc, buffer: tirx.Var) -> list[tirx.BufferStore]:
    found: list[tirx.BufferStore] = []

    def visit(node: object) -> None:
        if isinstance(node, tirx.BufferStore) and node.buffer.same_as(buffer):
            found.append(node)

    tirx.stmt_functor.post_order_visit(func.body, visit)
    return found


def _extern_funcs(args: list[relax.Expr]) -> list[relax.ExternFunc]:
    found: list[relax.ExternFunc] = []
    for arg in args:
        relax.analysis.post_order_visit(arg, lambda e: found.append(e) if isinstance(e, relax.ExternFunc) else None)
    return found


def analyze(rope: tirx.PrimFunc, append: tirx.PrimFunc) -> RopeAppendDesc | None:
    """The buffers to fuse the two kernels over, or None where they are not TVM's layout."""
    rope_buffers, append_buffers = _buffers(rope), _buffers(append)
    scalars = [p for p in rope.params if not isinstance(p.ty, tirx.BufferType)]
    if len(rope_buffers) != 5 or len(scalars) != 1 or str(scalars[0].ty) != "int64" or len(append_buffers) != 4:
        return None
    qkv, positions, q, k, v = rope_buffers
    pages, k_in, v_in, append_positions = append_buffers
    dtype = str(qkv.ty.dtype)
    if any(len(b.ty.shape) != 3 or str(b.ty.dtype) != dtype for b in (qkv, q, k, v, k_in, v_in)):
        return None
    if len(pages.ty.shape) != 5 or str(pages.ty.dtype) != dtype:
        return None
    if any(len(b.ty.shape) != 1 or str(b.ty.dtype) != "int32" for b in (positions, append_positions)):
        return None
    heads, dim = static_dim(k.ty.shape[1]), static_dim(k.ty.shape[2])
    two, page_heads, page_size, page_dim = (static_dim(x) for x in pages.ty.shape[1:])
    if None in (heads, dim, page_size) or (two, page_heads, page_dim) != (2, heads, dim):
        return None
    if (static_dim(v.ty.shape[1]), static_dim(v.ty.shape[2])) != (heads, dim):
        return None
    if len(_stores(rope, k)) != 1 or len(_stores(rope, v)) != 1:
        return None
    return RopeAppendDesc(k, v, pages, append_positions)


def fuse(rope: tirx.PrimFunc, desc: RopeAppendDesc) -> tirx.PrimFunc:
    """``rope`` with the pages and append positions as two more parameters and every k / v store also
    stored into the pages (k at 0, v at 1 of the pages' second axis)."""
    pages, positions = desc.pages, desc.append_positions
    page_size = pages.ty.shape[3]

    index_dtype = str(pages.ty.shape[0].ty)  # TVM's append indexes the pages in int64

    # the value computed once (its Let-bound frequencies may be defined only once), stored twice
    value = tirx.decl_buffer((1,), str(desc.k.ty.dtype), name="kv_value", scope="local")
    zero = tirx.IntImm("int32", 0)

    def page_store(store: tirx.BufferStore, kv: int) -> tirx.Stmt:
        token, head, d = store.indices
        pos = tirx.BufferLoad(positions, [tirx.Cast(str(positions.ty.shape[0].ty), token)])
        index = [tirx.floordiv(pos, page_size), tirx.IntImm("int32", kv), head, tirx.floormod(pos, page_size), d]
        index = [tirx.Cast(index_dtype, i) for i in index]
        kept = tirx.BufferLoad(value, [zero])
        append = tirx.IfThenElse(pos != tirx.IntImm("int32", -1), tirx.BufferStore(pages, kept, index), None)
        return tirx.SeqStmt([tirx.BufferStore(value, store.value, [zero]), tirx.BufferStore(store.buffer, kept, store.indices), append])

    def whole(buffer: tirx.Var) -> tirx.BufferRegion:
        return tirx.BufferRegion(buffer, [tvm.ir.Range(0, extent) for extent in buffer.ty.shape])

    def rewrite(node: object) -> object:
        if isinstance(node, tirx.BufferStore):
            if node.buffer.same_as(desc.k):
                return page_store(node, 0)
            if node.buffer.same_as(desc.v):
                return page_store(node, 1)
        if isinstance(node, tirx.SBlock) and any(w.buffer.same_as(desc.k) for w in node.writes):
            # The pages at data-dependent positions: the whole buffer, as the block's region.
            return tirx.SBlock(
                node.iter_vars, [*node.reads, whole(positions)], [*node.writes, whole(pages)], node.name_hint,
                node.body, node.init, [*node.alloc_buffers, value], node.match_buffers, node.annotations,
            )
        return None

    body = tirx.stmt_functor.ir_transform(rope.body, None, rewrite, ["tirx.BufferStore", "tirx.SBlock"])
    fused = tirx.PrimFunc([*rope.params, pages, positions], body, rope.ret_type, rope.attrs)
    return fused.with_attrs({"global_symbol": FUSED_NAME, FUSED_ATTR: True})


@tvm.transform.module_pass(opt_level=0, name="FuseRopeAppend")
class FuseRopeAppend:
    """Hand the paged KV cache a fused RoPE + append kernel through fuselight's wrappers."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _HookKernels(mod)
        for call in create_calls(mod):
            args = call.args[1:]
            if len(args) <= SPLIT_ROTARY_ARG:
                continue
            split_gv, append_gv = args[SPLIT_ROTARY_ARG], args[TRANSPOSE_APPEND_ARG]
            if not isinstance(split_gv, tvm.ir.GlobalVar) or not isinstance(append_gv, tvm.ir.GlobalVar):
                continue
            if _extern_funcs(args):
                continue  # a kernel we cannot wrap (e.g. FlashInfer's) could read q, k, v before the split ran
            rope, append = mod[split_gv], mod[append_gv]
            if not isinstance(rope, tirx.PrimFunc) or not isinstance(append, tirx.PrimFunc):
                continue
            desc = analyze(rope, append)
            if desc is None:
                continue
            fused = fuse(rope, desc)
            # the builder picks a unique name; the symbol must match it for the VM to find the kernel
            fused_gv = rewriter.builder_.add_func(fused, FUSED_NAME)
            rewriter.builder_.update_func(fused_gv, fused.with_attr("global_symbol", fused_gv.name_hint))
            rewriter.hooked[call] = (fused_gv, split_gv, append_gv)
        return rewriter.transform() if rewriter.hooked else mod


@mutator
class _HookKernels(FunctionRewriter):
    """Each hooked create call: its kernels replaced by the wrappers ``HOOKS_FUNC`` returns."""

    prune_unused = False

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.hooked: dict[relax.Call, tuple[tvm.ir.GlobalVar, tvm.ir.GlobalVar, tvm.ir.GlobalVar]] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        hooked = self.hooked.get(call)
        if hooked is None:
            return super().visit_call_(call)
        fused_gv, split_gv, append_gv = hooked
        kernels = [gv for gv in global_vars(relax.Tuple(list(call.args[1:]))) if gv not in (split_gv, append_gv)]
        # wrappers: [split-rotary, append, then each other kernel in order]
        wrappers = self.builder_.emit(
            relax.call_pure_packed(
                HOOKS_FUNC, fused_gv, split_gv, append_gv, *kernels,
                ty_args=relax.TupleType([relax.ObjectType()] * (2 + len(kernels))),
            )
        )
        order = [split_gv, append_gv, *kernels]
        wrapped = {gv: self.builder_.emit(relax.TupleGetItem(wrappers, i)) for i, gv in enumerate(order)}

        def swap(expr: relax.Expr) -> relax.Expr:
            if isinstance(expr, tvm.ir.GlobalVar) and expr in wrapped:
                return wrapped[expr]
            if isinstance(expr, relax.Tuple):
                return relax.Tuple([swap(e) for e in expr.fields])
            return expr

        return relax.Call(call.op, [call.args[0], *(swap(a) for a in call.args[1:])], call.attrs, call.ty_args)
