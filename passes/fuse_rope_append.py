"""Give the paged KV cache one kernel for RoPE and the KV append: split-rotary + transpose-append -> one,
and, where its decode attention is fuselight's, split-rotary + transpose-append + decode attention -> one.

In decode, TVM's KV cache (``AttentionWithFusedQKV``) calls ``f_split_rotary(qkv, positions, q, k, v,
apply_rope)``, then ``f_transpose_append(pages, k, v, append_positions)``, then the decode attention:
three launches a layer besides attention's own, the second a tiny kernel that waits for the first
only to copy its k and v into the pages. This pass builds ``fused_rope_append(qkv, positions, q, k, v,
apply_rope, pages, append_positions)``: TVM's split-rotary function whose k and v stores also store
the same values into the pages (where the append position is not -1, as TVM's append skips it).
Where the cache's decode kernel is fuselight's (``passes.paged_attention`` ran, same heads and
pages) and the cache cannot transfer k and v between the append and attention (disaggregation off),
it also asks for ``rules.flash.decode.flash_decode_paged_rotary``: the decode kernel whose split
blocks compute their q heads and the new k / v rows from ``qkv`` by the split-rotary's own
expressions, so a decode layer launches no kernel for RoPE and the append at all. The pass adds a
copy of TVM's split-rotary function tagged ``FUSED_ROPE_APPEND_DECODE_ATTR`` (the page size) under
that kernel's symbol; the ``PagedAttention`` rule builds the kernel from it in phase 4 (only the
wrappers call it, so its parameters may change there).

It then hands the cache wrappers of its kernels (``fuselight.kv_hooks``, registered by the
fuselight runtime): the split-rotary wrapper records its arguments; the append wrapper runs the
fused kernel on them or, with the fused decode kernel, records its own; the decode wrapper runs the
fused decode kernel on both records; every other kernel's wrapper first runs what is recorded (the
fused RoPE + append, or TVM's split-rotary). So every kernel sees what it would without the pass,
in any order the cache calls them (prefill attends before it appends).

The rewrite is skipped (module unchanged) unless both kernels are TVM's layout (``rules.flash.rotary``
reads the split-rotary as one store each to q, k and v; the append's pages [pages, 2, kv heads, page
size, dim] have k's heads and dim and the same dtype) and every kernel of the cache is a PrimFunc
of the module (an external one could not be wrapped). Programs that run such a library must have
the fuselight runtime imported (``fuselight.runtime`` registers the wrappers); MLC-LLM's engine does
not, so the MLC integration leaves this pass out. The fused decode kernel is built for the target
in scope (``tvm.target.Target.current()``); without one the cache keeps the two-kernel form.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from ..contracts import HOOKS_DECODE_FUNC, HOOKS_FUNC, IS_SCHEDULED_ATTR, PAGED_ATTENTION_ATTR
from ..contracts import FUSED_ROPE_APPEND_ATTR as FUSED_ATTR
from ..contracts import FUSED_ROPE_APPEND_DECODE_ATTR as FUSED_DECODE_ATTR
from ..contracts import FUSED_ROPE_APPEND_NAME as FUSED_NAME
from ..contracts import ROTARY_DECODE_SYMBOL as ROTARY_SYMBOL
from ..relax_rewrite import FunctionRewriter, visit_nodes
from ..rules.flash.rotary import SplitRotary
from ..rules.flash.rotary import analyze as analyze_split_rotary
from ..rules.paged_attention import PagedAttention, RotaryDecodeDesc
from ..rules.paged_attention import analyze as analyze_attention
from .paged_attention import create_calls, global_vars

# Positions among the create call's arguments (after its packed function's name; TVM 0.26's
# TIRPagedKVCache): enable_disaggregation, f_transpose_append (MHA), f_attention_decode (a
# ("tirx", kernel) tuple) and f_split_rotary.
DISAGGREGATION_ARG = 7
TRANSPOSE_APPEND_ARG = 13
DECODE_ARG = 17
SPLIT_ROTARY_ARG = 24


@dataclasses.dataclass(frozen=True)
class RopeAppendDesc:
    """The two kernels: the rope function read as values, the append's pages and positions."""

    rotary: SplitRotary
    pages: tirx.Var
    append_positions: tirx.Var

    @property
    def page_size(self) -> int:
        return int(self.pages.ty.shape[3])


def static_dim(dim: tvm.ir.PrimExpr) -> int | None:
    """A buffer dimension's value where it is static, else None."""
    return int(dim) if isinstance(dim, tirx.IntImm) else None


def _buffers(func: tirx.PrimFunc) -> list[tirx.Var]:
    return [p for p in func.params if isinstance(p.ty, tirx.BufferType)]


def _extern_funcs(args: list[relax.Expr]) -> list[relax.ExternFunc]:
    found: list[relax.ExternFunc] = []
    for arg in args:
        visit_nodes(arg, lambda e: found.append(e) if isinstance(e, relax.ExternFunc) else None)
    return found


def analyze(rope: tirx.PrimFunc, append: tirx.PrimFunc) -> RopeAppendDesc | None:
    """The buffers to fuse the two kernels over, or None where they are not TVM's layout."""
    rotary = analyze_split_rotary(rope)
    append_buffers = _buffers(append)
    if rotary is None or len(append_buffers) != 4:
        return None
    pages, k_in, v_in, append_positions = append_buffers
    heads, dim = rotary.num_kv_heads, rotary.head_dim
    if any(len(b.ty.shape) != 3 or str(b.ty.dtype) != rotary.dtype for b in (k_in, v_in)):
        return None
    if len(pages.ty.shape) != 5 or str(pages.ty.dtype) != rotary.dtype:
        return None
    if len(append_positions.ty.shape) != 1 or str(append_positions.ty.dtype) != "int32":
        return None
    two, page_heads, page_size, page_dim = (static_dim(x) for x in pages.ty.shape[1:])
    if page_size is None or (two, page_heads, page_dim) != (2, heads, dim):
        return None
    return RopeAppendDesc(rotary, pages, append_positions)


def fuse(rope: tirx.PrimFunc, desc: RopeAppendDesc) -> tirx.PrimFunc:
    """``rope`` with the pages and append positions as two more parameters and every k / v store also
    stored into the pages (k at 0, v at 1 of the pages' second axis)."""
    pages, positions = desc.pages, desc.append_positions
    page_size = pages.ty.shape[3]
    _, k, v = desc.rotary.outputs

    index_dtype = str(pages.ty.shape[0].ty)  # TVM's append indexes the pages in int64

    # the value computed once (its Let-bound frequencies may be defined only once), stored twice
    value = tirx.decl_buffer((1,), desc.rotary.dtype, name="kv_value", scope="local")
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
            if node.buffer.same_as(k):
                return page_store(node, 0)
            if node.buffer.same_as(v):
                return page_store(node, 1)
        if isinstance(node, tirx.SBlock) and any(w.buffer.same_as(k) for w in node.writes):
            # The pages at data-dependent positions: the whole buffer, as the block's region.
            return tirx.SBlock(
                node.iter_vars, [*node.reads, whole(positions)], [*node.writes, whole(pages)], node.name_hint,
                node.body, node.init, [*node.alloc_buffers, value], node.match_buffers, node.annotations,
            )
        return None

    body = tirx.stmt_functor.ir_transform(rope.body, None, rewrite, ["tirx.BufferStore", "tirx.SBlock"])
    fused = tirx.PrimFunc([*rope.params, pages, positions], body, rope.ret_type, rope.attrs)
    return fused.with_attrs({"global_symbol": FUSED_NAME, FUSED_ATTR: True})


def _fuselight_decode(mod: tvm.IRModule, args: list[relax.Expr], desc: RopeAppendDesc) -> tvm.ir.GlobalVar | None:
    """The cache's decode attention kernel where it is fuselight's (``passes.paged_attention`` handed
    it to the rule) over the split-rotary's heads and the append's pages, else None."""
    slot = args[DECODE_ARG] if len(args) > DECODE_ARG else None
    if not isinstance(slot, relax.Tuple) or len(slot.fields) != 2 or not isinstance(slot.fields[1], tvm.ir.GlobalVar):
        return None
    gv = slot.fields[1]
    func = mod[gv]
    if not isinstance(func, tirx.PrimFunc) or func.attrs is None or str(func.attrs.get(PAGED_ATTENTION_ATTR, "")) != "decode":
        return None
    attention = analyze_attention(func)
    rotary = desc.rotary
    if attention is None or attention.kind != "decode":
        return None
    layout = (attention.num_qo_heads, attention.num_kv_heads, attention.head_dim, attention.page_size, attention.dtype)
    if layout != (rotary.num_qo_heads, rotary.num_kv_heads, rotary.head_dim, desc.page_size, rotary.dtype):
        return None
    return gv


def _disaggregated(args: list[relax.Expr]) -> bool:
    """Whether the cache may transfer k and v between the append and attention (not provably off)."""
    flag = args[DISAGGREGATION_ARG]
    return not (isinstance(flag, tirx.IntImm) and int(flag.value) == 0)


@tvm.transform.module_pass(opt_level=0, name="FuseRopeAppend")
class FuseRopeAppend:
    """Hand the paged KV cache a fused RoPE + append kernel through fuselight's wrappers, and a
    decode attention that does both itself where the cache's decode kernel is fuselight's."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
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
            hooked = _Hooked(rewriter.add(fuse(rope, desc), FUSED_NAME), split_gv, append_gv)
            decode_gv = _fuselight_decode(mod, args, desc)
            if (decode_gv is not None and target is not None and not _disaggregated(args)
                    and PagedAttention.supports(RotaryDecodeDesc(desc.rotary, desc.page_size), target)):
                # TVM's split-rotary for the rule, which builds the fused decode kernel from it in phase 4.
                fused_decode = rope.without_attr(IS_SCHEDULED_ATTR).with_attr(FUSED_DECODE_ATTR, desc.page_size)
                hooked = dataclasses.replace(hooked, fused_decode=rewriter.add(fused_decode, ROTARY_SYMBOL), decode=decode_gv)
            rewriter.hooked[call] = hooked
        return rewriter.transform() if rewriter.hooked else mod


@dataclasses.dataclass(frozen=True)
class _Hooked:
    """One create call's kernels to wrap, and the fused kernels the wrappers launch instead."""

    fused: tvm.ir.GlobalVar
    split: tvm.ir.GlobalVar
    append: tvm.ir.GlobalVar
    fused_decode: tvm.ir.GlobalVar | None = None
    decode: tvm.ir.GlobalVar | None = None


@mutator
class _HookKernels(FunctionRewriter):
    """Each hooked create call: its kernels replaced by the wrappers ``HOOKS_FUNC`` (or, with a fused
    decode kernel, ``HOOKS_DECODE_FUNC``) returns."""

    prune_unused = False

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.hooked: dict[relax.Call, _Hooked] = {}

    def add(self, func: tirx.PrimFunc, name: str) -> tvm.ir.GlobalVar:
        # the builder picks a unique name; the symbol must match it for the VM to find the kernel
        gv = self.builder_.add_func(func, name)
        self.builder_.update_func(gv, func.with_attr("global_symbol", gv.name_hint))
        return gv

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        hooked = self.hooked.get(call)
        if hooked is None:
            return super().visit_call_(call)
        # wrappers: [split-rotary, append, (decode,) then each other kernel in order]
        wrapped_first = [hooked.split, hooked.append] + ([hooked.decode] if hooked.decode is not None else [])
        kernels = [gv for gv in global_vars(relax.Tuple(list(call.args[1:]))) if gv not in wrapped_first]
        if hooked.fused_decode is None:
            factory, fused = HOOKS_FUNC, [hooked.fused]
        else:
            factory, fused = HOOKS_DECODE_FUNC, [hooked.fused, hooked.fused_decode]
        order = [*wrapped_first, *kernels]
        wrappers = self.builder_.emit(
            relax.call_pure_packed(
                factory, *fused, *order, ty_args=relax.TupleType([relax.ObjectType()] * len(order))
            )
        )
        wrapped = {gv: self.builder_.emit(relax.TupleGetItem(wrappers, i)) for i, gv in enumerate(order)}

        def swap(expr: relax.Expr) -> relax.Expr:
            if isinstance(expr, tvm.ir.GlobalVar) and expr in wrapped:
                return wrapped[expr]
            if isinstance(expr, relax.Tuple):
                return relax.Tuple([swap(e) for e in expr.fields])
            return expr

        return relax.Call(call.op, [call.args[0], *(swap(a) for a in call.args[1:])], call.attrs, call.ty_args)
