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

Skipped (module unchanged) unless ``fuse_rope_append`` gave the cache the fused decode kernel (a
function tagged ``FUSED_ROPE_APPEND_DECODE_ATTR``) and the rule serves its by-position form on the
target in scope. Run only with CUDA graphs (``fuselight.compile.build`` drops it otherwise): a step
launched kernel by kernel gains nothing and its decode grid is sized for the whole cache.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from ..contracts import ATTENTION_BUILTIN, ATTENTION_FORWARD_FUNC, DECODE_BY_POSITION_ATTR
from ..contracts import FUSED_ROPE_APPEND_DECODE_ATTR as FUSED_DECODE_ATTR
from ..relax_rewrite import FunctionRewriter
from ..rules.paged_attention import PagedAttention

# A decode function's parameters: the input embedding, the KV cache, then the weights (static).
_INPUTS_WITH_CACHE = 2
_INPUTS_WITHOUT_CACHE = 1


def is_attention(expr: relax.Expr) -> bool:
    """Whether ``expr`` is a ``call_dps_packed`` of TVM's attention builtin."""
    return (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.call_dps_packed"
            and isinstance(expr.args[0], relax.ExternFunc) and expr.args[0].global_symbol == ATTENTION_BUILTIN)


def attention_calls(func: relax.Function) -> list[relax.Call]:
    """The calls of TVM's attention builtin in ``func``."""
    found: list[relax.Call] = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if is_attention(e) else None)
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
        return out


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
