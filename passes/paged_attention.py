"""Give the paged KV cache fuselight's attention kernels: TVM's built-in ones -> ``rules.PagedAttention``'s.

``tvm.relax.frontend.nn.llm.TIRPagedKVCache`` (used by our LLaMA and by MLC-LLM's models) passes its
attention kernels as PrimFuncs to ``vm.builtin.paged_attention_kv_cache_create``; its runtime calls
them. This pass asks the ``PagedAttention`` rule about each PrimFunc named in such a call
(``analyze`` + ``PagedAttention.supports``: its interface and the configs, nothing built) and, where
the rule has a kernel for it (same interface, faster), hands the function to the rule: tagged
``PAGED_ATTENTION_ATTR`` (its kind), no longer marked scheduled (so phase 4 reaches it), added
under fuselight's symbol for that kind (``contracts.PAGED_ATTENTION_SYMBOLS``), with the call
pointed at it. The rule swaps in its kernel in phase 4. TVM's kernel stays wherever the rule
declines (other dtypes, head dims, sliding window) and is removed from the module otherwise. A cache that applies RoPE inside attention (``RopeMode.INLINE``) is left alone: ours
expect rotated keys in the cache.

Runs on the target in scope (``tvm.target.Target.current()``); on targets the rule does not serve
the module comes back unchanged.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode

from ..contracts import IS_SCHEDULED_ATTR, PAGED_ATTENTION_ATTR, PAGED_ATTENTION_SYMBOLS
from ..relax_rewrite import FunctionRewriter, visit_nodes
from ..rules.paged_attention import PagedAttention, analyze

CREATE_FUNC = "vm.builtin.paged_attention_kv_cache_create"
# Positions in the create call (TVM 0.26's TIRPagedKVCache): rope_mode is the 9th argument.
_ROPE_MODE_ARG = 8


def create_calls(mod: tvm.IRModule) -> list[relax.Call]:
    """Every call of ``vm.builtin.paged_attention_kv_cache_create`` in ``mod``'s Relax functions."""
    calls: list[relax.Call] = []

    def visit(expr: relax.Expr) -> None:
        if (
            isinstance(expr, relax.Call)
            and isinstance(expr.op, tvm.ir.Op)
            and expr.op.name == "relax.call_pure_packed"
            and isinstance(expr.args[0], relax.ExternFunc)
            and expr.args[0].global_symbol == CREATE_FUNC
        ):
            calls.append(expr)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            visit_nodes(func, visit)
    return calls


def _rope_inline(call: relax.Call) -> bool:
    arg = call.args[1 + _ROPE_MODE_ARG]  # args[0] is the packed function's name
    return not isinstance(arg, tirx.IntImm) or int(arg.value) == int(RopeMode.INLINE)


def global_vars(expr: relax.Expr) -> list[tvm.ir.GlobalVar]:
    """The GlobalVars ``expr`` references (a create call's kernels), first occurrences in order."""
    found: list[tvm.ir.GlobalVar] = []

    def visit(e: relax.Expr) -> None:
        if isinstance(e, tvm.ir.GlobalVar) and e not in found:
            found.append(e)

    visit_nodes(expr, visit)
    return found


def _kernels(call: relax.Call) -> list[tvm.ir.GlobalVar]:
    return [gv for arg in call.args[1:] for gv in global_vars(arg)]


@tvm.transform.module_pass(opt_level=0, name="PagedAttentionKernels")
class PagedAttentionKernels:
    """Hand the paged KV cache's attention kernels to the PagedAttention rule where it has one."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is None:
            return mod
        rewriter = _Repoint(mod)
        for call in create_calls(mod):
            if _rope_inline(call):
                continue
            for gv in _kernels(call):
                func = mod[gv]
                if gv in rewriter.replaced or not isinstance(func, tirx.PrimFunc):
                    continue
                desc = analyze(func)
                if desc is not None and PagedAttention.supports(desc, target):
                    tagged = func.without_attr(IS_SCHEDULED_ATTR).with_attr(PAGED_ATTENTION_ATTR, desc.kind)
                    # the builder picks a unique name; the symbol must match it for the VM to find the kernel
                    new_gv = rewriter.builder_.add_func(tagged, PAGED_ATTENTION_SYMBOLS[desc.kind])
                    rewriter.builder_.update_func(new_gv, tagged.with_attr("global_symbol", new_gv.name_hint))
                    rewriter.replaced[gv] = new_gv
        if not rewriter.replaced:
            return mod
        out = rewriter.transform()
        # TVM's kernels are referenced by the create call only: drop the ones no longer referenced
        still_used = {gv for func in out.functions.values() if isinstance(func, relax.Function)
                      for gv in relax.analysis.all_global_vars(func)}
        for gv in rewriter.replaced:
            if gv not in still_used:
                del out[gv]
        return out


@mutator
class _Repoint(FunctionRewriter):
    prune_unused = False

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.replaced: dict[tvm.ir.GlobalVar, tvm.ir.GlobalVar] = {}

    def visit_global_var_(self, gv: tvm.ir.GlobalVar) -> relax.Expr:
        return self.replaced.get(gv, gv)
