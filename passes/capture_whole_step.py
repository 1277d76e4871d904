"""Let one CUDA graph hold a decode step, the KV cache's attention included (issue 27's whole-step capture).

TVM 0.26's RewriteCUDAGraph lifts a call into a capture function only where every argument is static
(a parameter after the function's ``num_input``, or computed from such) and the call is not a
``vm.builtin.*`` ExternFunc, so each layer's attention (``vm.builtin.attention_kv_cache_attention_
with_fused_qkv``, on the KV cache, an input) ends a graph. In each function that decodes one token
(every attention call's qkv has a static shape) this pass points the attention calls at
``ATTENTION_FORWARD_FUNC`` (``fuselight/kv_hooks.cc``: the same builtin under our name) and counts the
cache among the static parameters (``num_input`` 1: the engine passes the same cache object every
step), and it tags the fused RoPE + append + decode kernel ``DECODE_BY_POSITION_ATTR``: a replayed
graph keeps the metadata addresses of the step it captured, and only TVM's q positions, page_indptr
and the page table's start stay put as the sequence gains pages (docs/experiments/decode-form.md),
so the rule builds the kernel that reads only those. The engine uploads the cache's metadata before
each step (``Engine``: ``get_query_positions``), which no replayed graph does.

RewriteCUDAGraph also leaves out every kernel that reads a function's input or writes its output
(neither is planned storage): the embedding lookup (``embed``, a launch of its own), the first
layer's kernels reading the input embedding, the LM head writing the logits. So each step function
(``step_functions``: ``decode``, ``decode_attend``, ``decode_greedy``, ``greedy``) copies its tensor
inputs into tensors it plans and its outputs out of such (``stage_step_io``: a memcpy each, not a
kernel launch), and the decode functions take token ids (``TOKEN_IDS_PARAM``, which the engine reads)
and look their embedding up themselves: a decode step is one graph launch of the host's.

Skipped (module unchanged) unless ``fuse_rope_append`` gave the cache the fused decode kernel (a
function tagged ``FUSED_ROPE_APPEND_DECODE_ATTR``) and the rule serves its by-position form on the
target in scope. Run only with CUDA graphs (``fuselight.compile.build`` drops it otherwise): a step
launched kernel by kernel gains nothing and its decode grid is sized for the whole cache.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from ..contracts import ATTENTION_BUILTIN, ATTENTION_FORWARD_FUNC, DECODE_BY_POSITION_ATTR, TENSOR_COPY_FUNC, TOKEN_IDS_PARAM
from ..contracts import FUSED_ROPE_APPEND_DECODE_ATTR as FUSED_DECODE_ATTR
from ..relax_rewrite import FunctionRewriter, visit_nodes
from ..rules.paged_attention import PagedAttention

# A decode function's parameters: the input embedding, the KV cache, then the weights (static).
_INPUTS_WITH_CACHE = 2
_INPUTS_WITHOUT_CACHE = 1
# The model's embedding lookup (``fuselight.model.llama.export_module``): ``embed(input_ids, params)``.
EMBED_FUNCTION = "embed"


def is_attention(expr: relax.Expr) -> bool:
    """Whether ``expr`` is a ``call_dps_packed`` of TVM's attention builtin."""
    return (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.call_dps_packed"
            and isinstance(expr.args[0], relax.ExternFunc) and expr.args[0].global_symbol == ATTENTION_BUILTIN)


def attention_calls(func: relax.Function) -> list[relax.Call]:
    """The calls of TVM's attention builtin in ``func``."""
    found: list[relax.Call] = []
    visit_nodes(func, lambda e: found.append(e) if is_attention(e) else None)
    return found


def decodes_one_token(func: relax.Function) -> bool:
    """Whether ``func`` attends (with the cache its second input) over qkv of static shape only."""
    calls = attention_calls(func)
    num_input = func.attrs.get("num_input") if func.attrs is not None else None
    if not calls or num_input is None or int(num_input) != _INPUTS_WITH_CACHE:
        return False
    qkv_types = [call.args[1].fields[3].ty for call in calls]
    return all(isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr)
               and all(isinstance(d, tirx.IntImm) for d in ty.shape.values) for ty in qkv_types)


@tvm.transform.module_pass(opt_level=0, name="CaptureWholeStep")
class CaptureWholeStep:
    """Decode functions' attention capturable by RewriteCUDAGraph; the fused decode kernel by position."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        fused = [gv for gv, f in mod.functions.items()
                 if isinstance(f, tirx.PrimFunc) and f.attrs is not None and FUSED_DECODE_ATTR in f.attrs]
        decode_fns = [gv for gv, f in mod.functions.items() if isinstance(f, relax.Function) and decodes_one_token(f)]
        if len(fused) != 1 or not decode_fns or target is None:
            return mod
        tagged = mod[fused[0]].with_attr(DECODE_BY_POSITION_ATTR, True)
        desc = PagedAttention.analyze(tagged)
        if desc is None or not PagedAttention.supports(desc, target):
            return mod
        out = _ForwardAttention(mod, decode_fns, lambda batch: PagedAttention.by_position_workspace(desc, target, batch)).transform()
        out[fused[0]] = tagged
        return stage_step_io(out, decode_fns)


@mutator
class _ForwardAttention(FunctionRewriter):
    """In the functions named: attention through the forwarder, the cache a static parameter."""

    prune_unused = False

    def __init__(self, mod: tvm.IRModule, functions: list[tvm.ir.GlobalVar],
                 workspace: Callable[[int], list[tuple[tuple[int, ...], str]]]) -> None:
        super().__init__(mod)
        self.functions = functions
        self.workspace = workspace

    def rewrite_functions(self) -> None:
        for gv in self.functions:
            func = self.visit_expr(self.mod[gv])
            self.builder_.update_func(gv, func.with_attr("num_input", _INPUTS_WITHOUT_CACHE))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_attention(call):
            return call
        # The kernel's split partials as extra outputs: planned with the function's other tensors,
        # so a graph that replays the step keeps their addresses (kv_hooks.cc passes them on).
        batch = int(call.args[1].fields[3].ty.shape.values[0])
        out_types = [call.ty_args[0], *(relax.TensorType(relax.ShapeExpr(list(shape)), dtype)
                                        for shape, dtype in self.workspace(batch))]
        forwarded = self.builder_.emit(relax.call_dps_packed(
            relax.ExternFunc(ATTENTION_FORWARD_FUNC), call.args[1], out_types))
        return relax.TupleGetItem(forwarded, 0)


def step_functions(mod: tvm.IRModule) -> list[tvm.ir.GlobalVar]:
    """The entry functions (those that say their ``num_input``; a fused function such as MLC's
    FuseTransposeMatmul outlines says nothing) whose inputs (the parameters before ``num_input``)
    include tensors, all of static shape: one decode step's (``decode``, ``decode_attend``,
    ``decode_greedy``, ``greedy``; a prefill or ``embed`` has a symbolic length). Other inputs (the KV
    cache) are objects."""
    found = []
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or func.attrs is None or "num_input" not in func.attrs:
            continue
        tensors = [p.ty for p in func.params[:_num_input(func)] if isinstance(p.ty, relax.TensorType)]
        if tensors and all(_static_shape(ty) for ty in tensors):
            found.append(gv)
    return found


def stage_step_io(mod: tvm.IRModule, token_functions: list[tvm.ir.GlobalVar]) -> tvm.IRModule:
    """``mod`` with each step function (``step_functions``) copying its tensor inputs into tensors it
    plans and its tensor outputs out of them (``TENSOR_COPY_FUNC``: a memcpy each, no kernel launch).

    RewriteCUDAGraph captures a kernel only where every argument is static: a tensor the function's
    memory plan allocates is, an input or an output is not, so without the copies the kernels reading
    an input and the one writing the output (the LM head) stay outside the graph, a host launch each.
    The functions of ``token_functions`` whose first input is the input embedding ``[1, n, hidden]``
    take ``n`` token ids instead (``TOKEN_IDS_PARAM``) and look them up as ``embed`` does (its body
    inlined), so the embedding joins the graph too. Without ``embed``, or where its parameters are not
    the function's, the function keeps its embedding input."""
    embed_gv = next((gv for gv in mod.get_global_vars() if gv.name_hint == EMBED_FUNCTION), None)
    out = mod.clone()
    for gv in step_functions(mod):
        embed = mod[embed_gv] if embed_gv is not None and gv in token_functions else None
        out[gv] = _staged(mod[gv], gv.name_hint, embed)
    return out


def _num_input(func: relax.Function) -> int:
    """How many of ``func``'s parameters are inputs (RewriteCUDAGraph counts the rest static)."""
    return int(func.attrs["num_input"])


def _static_shape(ty: relax.Type) -> bool:
    return isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr) and all(
        isinstance(d, tirx.IntImm) for d in ty.shape.values)


def _embeds_first_input(func: relax.Function, embed: relax.Function) -> bool:
    """Whether ``embed(ids, params)``, reshaped, can stand for ``func``'s first input: ``func``'s last
    parameter is ``embed``'s weights, and the first is ``[1, n, hidden]`` of the dtype and hidden size
    of ``embed``'s rows ``[n, hidden]``."""
    first, weights = func.params[0].ty, func.params[-1].ty
    ids, rows = (embed.params[0].ty if embed.params else None), embed.ret_ty
    return (len(embed.params) == 2 and tvm_ffi.structural_equal(embed.params[1].ty, weights)
            and isinstance(ids, relax.TensorType) and ids.ndim == 1
            and _static_shape(first) and len(first.shape.values) == 3 and int(first.shape.values[0]) == 1
            and isinstance(rows, relax.TensorType) and rows.dtype == first.dtype
            and isinstance(rows.shape, relax.ShapeExpr) and len(rows.shape.values) == 2
            and isinstance(rows.shape.values[1], tirx.IntImm)
            and int(rows.shape.values[1]) == int(first.shape.values[2]))


def _staged(func: relax.Function, name: str, embed: relax.Function | None) -> relax.Function:
    """``func`` (named ``name``) between copies of its tensor inputs and outputs (``stage_step_io``);
    ``embed``: the first input becomes token ids, looked up with it."""
    tokens = embed is not None and _embeds_first_input(func, embed)
    params = [relax.Var(p.name, p.ty) for p in func.params]
    if tokens:
        seq = func.params[0].ty.shape.values[1]
        params[0] = relax.Var(TOKEN_IDS_PARAM, relax.TensorType(relax.ShapeExpr([seq]), embed.params[0].ty.dtype))
    bb = relax.BlockBuilder()
    body_gv = bb.add_func(func.without_attr("global_symbol"), "step_body")
    embed_gv = bb.add_func(embed.without_attr("global_symbol"), "step_embed") if tokens else None
    with bb.function(name, params, attrs=dict(func.attrs) if func.attrs is not None else None):
        with bb.dataflow():
            args = [_copy(bb, p) if i < _num_input(func) and isinstance(p.ty, relax.TensorType) else p
                    for i, p in enumerate(params)]
            if tokens:
                rows = bb.emit(relax.Call(embed_gv, [args[0], params[-1]]))
                args[0] = bb.emit(relax.op.reshape(rows, func.params[0].ty.shape))
            result = bb.emit(relax.Call(body_gv, args))
            output = bb.emit_output(_copy_tensors(bb, result))
        bb.emit_func_output(output)
    staged = bb.get()[name]
    return staged.inline_functions({body_gv: bb.get()[body_gv], **({embed_gv: bb.get()[embed_gv]} if tokens else {})})


def _copy(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Var:
    return bb.emit(relax.call_dps_packed(relax.ExternFunc(TENSOR_COPY_FUNC), relax.Tuple([x]), x.ty))


def _copy_tensors(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Expr:
    """``x`` with every tensor in it (a tensor, or the fields of a tuple) copied."""
    if isinstance(x.ty, relax.TensorType):
        return _copy(bb, x)
    if isinstance(x.ty, relax.TupleType):
        return relax.Tuple([_copy_tensors(bb, bb.emit(relax.TupleGetItem(x, i))) for i in range(len(x.ty.fields))])
    return x
