"""The shape every fuselight rule has: ``analyze``, then ``schedule``.

``analyze`` recognises the computation and returns a plain description (a dataclass), or None;
``supports`` says, from a description and the target's configs alone (building nothing), whether
``schedule`` makes a kernel of it; ``schedule`` turns a description into a scheduled kernel for the
target, or None where its templates do not serve. Keeping them apart lets tests, ``fuselight
explain`` and the benchmarks ask what a rule sees without building anything, and lets a graph pass
that fuses for a rule ask ``takes(func, target)`` before it emits the (unscheduled) fused function:
the rule then schedules it in phase 4. ``apply`` (DLight's entry point) chains them: on None DLight
moves on to the next rule. ``family`` is the rule's name in ``fuselight.rules.RULES``.

Rules that replace a function's body with template kernels build it with ``host_branch`` (a
host-side choice between kernels on a symbolic size; ``branch_on`` for a chain of them, less those
above the size's bound, ``dim_upper_bound``), ``built_once`` (a template written once per
config, where one serves several branches) and ``with_kernels`` (the body bound to the function's own
parameters, marked scheduled).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, ClassVar

from tvm import arith, s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

from ..contracts import DIM_UPPER_BOUND_ATTR


class AnalyzeScheduleRule(GPUScheduleRule):
    """A GPU rule as ``analyze`` + ``schedule`` (see the module docstring)."""

    family: ClassVar[str] = ""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        desc = self.analyze(func)
        if desc is None:
            return None
        kernel = self.schedule(func, desc, target)
        return None if kernel is None else s_tir.Schedule(kernel)

    @staticmethod
    def analyze(func: tirx.PrimFunc) -> Any | None:
        """A description of what ``func`` computes, or None when this rule does not own it."""
        raise NotImplementedError

    def schedule(self, func: tirx.PrimFunc, desc: Any, target: Target) -> tirx.PrimFunc | None:
        """The scheduled replacement of ``func`` (described by ``desc``) on ``target``, or None."""
        raise NotImplementedError

    @classmethod
    def supports(cls, desc: Any, target: Target) -> bool:
        """Whether ``schedule`` makes a kernel for ``desc`` on ``target``: the description and the
        target's configs only, nothing built. Rules that passes fuse for define it."""
        raise NotImplementedError

    @classmethod
    def takes(cls, func: tirx.PrimFunc, target: Target) -> bool:
        """Whether this rule schedules ``func`` on ``target`` (``analyze`` + ``supports``)."""
        if not gpu_target(target):
            return False
        desc = cls.analyze(func)
        return desc is not None and cls.supports(desc, target)


def gpu_target(target: Target) -> bool:
    """The targets GPU rules serve (DLight's ``GPUScheduleRule.is_target_available``)."""
    return "gpu" in target.keys


def host_branch(cond: Any, then_body: tirx.Stmt, else_body: tirx.Stmt | None = None) -> tirx.Stmt:
    """``if cond`` on the host between kernel launches; thread-invariant, so TVM places the kernels'
    shared-memory syncs inside the branches."""
    return tirx.IfThenElse(tirx.op.tvm_thread_invariant(cond), then_body, else_body)


def dim_upper_bound(func: tirx.PrimFunc, size: tirx.PrimExpr) -> int | None:
    """The largest value ``size`` (an expression of ``func``'s symbolic variables) takes under the
    bounds the function's Relax callers allow (``passes.attach_dim_bounds``), or None: unbounded."""
    declared = func.attrs.get(DIM_UPPER_BOUND_ATTR) if func.attrs is not None else None
    if not declared:
        return None
    analyzer = arith.Analyzer()
    for param in func.params:
        for dim in param.ty.shape if isinstance(param.ty, tirx.BufferType) else [param]:
            if isinstance(dim, tirx.Var) and dim.name in declared:
                analyzer.update(dim, arith.ConstIntBound(0, int(declared[dim.name])), override=True)
    top = analyzer.const_int_bound(size).max_value
    return int(top) if top < arith.ConstIntBound.POS_INF else None


def branch_on(size: tirx.PrimExpr, branches: list[tuple[int, Callable[[], tirx.Stmt]]],
              bound: int | None = None) -> tirx.Stmt:
    """Host-side branches on ``size`` over ``branches``, ``(largest size, body builder)`` in increasing
    size, the last serving every larger size too. With ``bound`` (``dim_upper_bound``), the branches
    no size up to it reaches are not built, and the host asserts the bound first (a larger size would
    otherwise run a kernel built for fewer rows)."""
    kept = branches if bound is None else [b for i, b in enumerate(branches) if i == 0 or branches[i - 1][0] < bound]
    body = kept[-1][1]()
    for upper, build in reversed(kept[:-1]):
        body = host_branch(size <= upper, build(), body)
    if len(kept) == len(branches):
        return body
    # TVM 0.26's Python AssertStmt names its first two arguments (kind, condition) but passes them on
    # in order to a constructor taking (condition, kind).
    check = tirx.AssertStmt(size <= bound, tirx.StringImm("ValueError"), [
        tirx.StringImm(f"{size} is larger than {bound}, the most this function's callers declare"
                       " (tir_var_upper_bound) and its kernels were built for")])
    return tirx.SeqStmt([check, body])


def built_once(build: Callable[[Hashable], tirx.Stmt]) -> Callable[[Hashable], tirx.Stmt]:
    """``build`` (a template: a plan or bucket config -> its kernel body over one function's buffers),
    written once per config: where the same config serves several ranges of M, each further branch
    gets a copy of the first body (``fresh_definitions``). Writing a body parses the template's
    TVMScript, most of a rule's time, and gives the same body for the same config."""
    bodies: dict[Hashable, tirx.Stmt] = {}

    def body(config: Hashable) -> tirx.Stmt:
        if config in bodies:
            return fresh_definitions(bodies[config])
        bodies[config] = build(config)
        return bodies[config]

    return body


def fresh_definitions(stmt: tirx.Stmt) -> tirx.Stmt:
    """``stmt`` with new objects for the variables and buffers it defines (a function defines each
    once); the variables it uses from outside (the function's buffers and sizes) stay."""
    # ``undefined_vars`` counts a block's iteration variables in, which the block defines.
    iters: list[tirx.Var] = []
    tirx.stmt_functor.post_order_visit(
        stmt, lambda n: iters.extend(iv.var for iv in n.iter_vars) if isinstance(n, tirx.SBlock) else None)
    free = [v for v in tirx.analysis.undefined_vars(stmt, []) if not any(v.same_as(i) for i in iters)]
    renewed = s_tir.renew_defs(tirx.PrimFunc(free, stmt))  # renews the parameters too: mapped back
    return tirx.stmt_functor.substitute(renewed.body, dict(zip(renewed.params, free)))


def with_kernels(func: tirx.PrimFunc, body: tirx.Stmt) -> tirx.PrimFunc:
    """``func`` (same parameters, signature and attributes) running ``body``: kernels written over
    ``func``'s own buffers, marked scheduled as MLC's LowBatchGemvSpecialize marks its host-side
    branches between kernels."""
    body = tirx.SBlockRealize([], True, tirx.SBlock([], [], [], "root", body))
    kernel = tirx.PrimFunc(func.params, body, func.ret_type, func.attrs)
    return kernel.with_attrs({"tirx.is_scheduled": True, "tirx.HoistIfThenElseExprWithBlock": 1})
