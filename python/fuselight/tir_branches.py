"""Lower each host-side branch of a PrimFunc on its own, where TVM's lowering is superlinear in them.

A dynamic-M kernel of fuselight's is one PrimFunc: a chain of ``if`` on the row count with a kernel
behind each branch (the GEMV buckets and the GEMM plans, ``rules.base``). TVM's analyzers in
CompactBufferAllocation, StmtSimplify, HoistIfThenElse and others keep the loops and bindings of
every branch they have visited, so each branch pays for all before it (docs/experiments/compile-time.md).

``per_branch(passes)`` runs ``passes`` over one copy of such a function per branch: a copy keeps the
chain with its conditions (the facts the passes may use) and that one branch, marked; the other
branches are placeholders. The lowered branches then go back into the chain. Where the passes did not
leave the same chain around every branch (the same statements, the same buffer and variable objects
defined), the function is lowered whole instead, as without this. Only for passes that decide per
statement: one that decides for a whole function from all its accesses (NarrowDataType, StorageRewrite's
vector types) or numbers what it creates (CommonSubexprElim) must run on the whole function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx

_MARK = "fuselight.branch"
_PLACEHOLDER_OP = "tirx.call_extern"


def _chain(body: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """The ``if`` chain at the top of a function body, and how to rebuild the body around a new one;
    None where the body is not such a chain (under a root block without buffers and buffer declarations)."""
    if isinstance(body, tirx.IfThenElse):
        return body, lambda new: new
    if isinstance(body, tirx.SeqStmt) and all(isinstance(s, tirx.DeclBuffer) for s in list(body.seq)[:-1]):
        inner = _chain(body.seq[-1])
        if inner is None:
            return None
        chain, rebuild = inner
        return chain, lambda new: tirx.SeqStmt([*list(body.seq)[:-1], rebuild(new)])
    if isinstance(body, tirx.SBlockRealize) and not body.block.alloc_buffers and not body.block.match_buffers:
        inner = _chain(body.block.body)
        if inner is None:
            return None
        chain, rebuild = inner
        b = body.block

        def in_block(new: Any) -> Any:
            block = tirx.SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, rebuild(new), b.init,
                                b.alloc_buffers, b.match_buffers, b.annotations)
            return tirx.SBlockRealize(body.iter_values, body.predicate, block)

        return chain, in_block
    return None


def _map_leaves(stmt: Any, leaf: Callable[[int, Any], Any], counter: list[int]) -> Any:
    """``stmt`` (an ``if`` chain) with its ``i``-th branch that is no ``if`` itself replaced by ``leaf(i, branch)``."""
    if isinstance(stmt, tirx.IfThenElse):
        then = _map_leaves(stmt.then_case, leaf, counter)
        other = _map_leaves(stmt.else_case, leaf, counter) if stmt.else_case is not None else None
        return tirx.IfThenElse(stmt.condition, then, other)
    counter[0] += 1
    return leaf(counter[0] - 1, stmt)


def branch_count(func: tirx.PrimFunc) -> int:
    """How many branches ``per_branch`` lowers ``func`` in (1: whole)."""
    found = _chain(func.body)
    if found is None:
        return 1
    count: list[int] = [0]
    _map_leaves(found[0], lambda _, s: s, count)
    return count[0]


def _placeholder(i: int) -> Any:
    return tirx.Evaluate(tirx.call_extern("int32", _MARK, i))


def _copies(func: tirx.PrimFunc) -> list[tirx.PrimFunc]:
    """One copy of ``func`` per branch: that branch marked, the others placeholders."""
    chain, rebuild = _chain(func.body)

    def copy(i: int) -> tirx.PrimFunc:
        def leaf(j: int, stmt: Any) -> Any:
            if j != i:
                return _placeholder(j)
            return tirx.AttrStmt(tirx.StringImm(_MARK), _MARK, tirx.IntImm("int32", j), stmt)

        return func.with_body(rebuild(_map_leaves(chain, leaf, [0])))

    return [copy(i) for i in range(branch_count(func))]


def _unmark(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, dict[int, Any]]:
    """``func`` with its marked branch back to a placeholder, and that branch by its index."""
    found: dict[int, Any] = {}

    def post(stmt: Any) -> Any:
        if stmt.attr_key != _MARK:
            return None
        found[int(stmt.value)] = stmt.body
        return _placeholder(int(stmt.value))

    return func.with_body(tirx.stmt_functor.ir_transform(func.body, None, post, ["tirx.AttrStmt"])), found


def _definitions(func: tirx.PrimFunc) -> list[Any]:
    """The buffers and variables ``func``'s body defines, in order."""
    found: list[Any] = []

    def visit(node: Any) -> None:
        if isinstance(node, (tirx.DeclBuffer, tirx.AllocBuffer)):
            found.append(node.buffer)
        elif isinstance(node, tirx.Bind):
            found.append(node.var)
        elif isinstance(node, tirx.For):
            found.append(node.loop_var)

    tirx.stmt_functor.post_order_visit(func.body, visit)
    return found


def _same_frame(func: tirx.PrimFunc, frame: tirx.PrimFunc) -> bool:
    """Whether ``func`` is ``frame``, with the same objects defined (the branches refer to them)."""
    if not tvm_ffi.structural_equal(func, frame):
        return False
    ours, theirs = _definitions(func), _definitions(frame)
    return len(ours) == len(theirs) and all(a.same_as(b) for a, b in zip(ours, theirs))


def _stitch(copies: Sequence[tirx.PrimFunc], count: int) -> tirx.PrimFunc | None:
    """The lowered copies of one function as one, or None where they do not fit together."""
    frame = None
    branches: dict[int, Any] = {}
    for func in copies:
        func, found = _unmark(func)
        if len(found) != 1 or found.keys() & branches.keys():
            return None
        branches.update(found)
        if frame is None:
            frame = func
        elif not _same_frame(func, frame):
            return None
    if sorted(branches) != list(range(count)):
        return None
    placed: list[int] = []

    def post(stmt: Any) -> Any:
        call = stmt.value
        if not (isinstance(call, tvm.ir.Call) and getattr(call.op, "name", "") == _PLACEHOLDER_OP
                and getattr(call.args[0], "value", None) == _MARK):
            return None
        placed.append(int(call.args[1]))
        return branches[placed[-1]]

    stitched = frame.with_body(tirx.stmt_functor.ir_transform(frame.body, None, post, ["tirx.Evaluate"]))
    return stitched if sorted(placed) == list(range(count)) else None


def per_branch(passes: Sequence[Any], name: str = "fuselight.PerBranch") -> Any:
    """A module pass: ``passes`` (PrimFunc-local TIR passes), each multi-branch PrimFunc lowered one
    branch at a time (see the module's docstring); every other function as ``Sequential(passes)``."""
    inner = tvm.ir.transform.Sequential(list(passes))

    @tvm.transform.module_pass(opt_level=0, name=name)
    def run(mod: Any, _ctx: Any) -> Any:
        split: dict[Any, list[Any]] = {}
        work: dict[Any, Any] = {}
        for gv, func in mod.functions.items():
            count = branch_count(func) if isinstance(func, tirx.PrimFunc) else 1
            if count < 2:
                work[gv] = func
                continue
            split[gv] = [tvm.ir.GlobalVar(f"{gv.name_hint}.branch{i}") for i in range(count)]
            work.update(zip(split[gv], _copies(func)))
        lowered = inner(tvm.IRModule(work, attrs=mod.attrs, global_infos=mod.global_infos))
        result = {gv: lowered[gv] for gv in mod.functions if gv not in split}
        whole = {}
        for gv, parts in split.items():
            stitched = _stitch([lowered[p] for p in parts], len(parts))
            if stitched is None:
                whole[gv] = mod[gv]
            else:
                result[gv] = stitched
        if whole:
            result.update(inner(tvm.IRModule(whole, attrs=mod.attrs, global_infos=mod.global_infos)).functions)
        return tvm.IRModule({gv: result[gv] for gv in mod.functions}, attrs=lowered.attrs,
                            global_infos=lowered.global_infos)

    return run
