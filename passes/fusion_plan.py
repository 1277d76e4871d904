"""Plan fusion groups by operator class (DNNFusion): the class-pair table and an analytic cost.

An analysis: ``plan_fusion`` returns, per Relax function, the groups of bindings that would run as
one kernel; ``fuselight explain`` reports them, ``ApplyFusionPlan`` lowers them (each group a
``Primitive`` function, which FuseTIR builds into one PrimFunc).

``CLASS_PAIRS`` colours each (producer class, consumer class) edge: green fuse, yellow decide by
cost, red never. Views (reorganize) and index permutations (shuffle) compute nothing, so they fold
into any consumer's indexing; an elementwise (one-to-one) consumer takes any producer's output as
an epilogue; a many-to-many consumer (matmul, reduction, norm) of a computing producer is a
prologue (yellow: it is recomputed for every tile that loads its output); two many-to-many ops are
never fused, nor is anything opaque or any packed/extern call (no PrimFunc to merge).

A producer (with its group) joins the group of its users when all its users are in one group (no
duplicated work), the edge to each user is green, or yellow and the cost decides for it, the merged
group keeps at most one many-to-many op (its anchor, the kernel a schedule rule recognises), and
the rule can inline the rest: after the anchor only ops TVM's pattern analysis calls elementwise or
broadcast, before it those and views (``_schedulable``). A computing producer that would feed the
anchor, directly or through other members, is a prologue: the cost decides with the anchor as
consumer, whatever the edge's colour; a reshape (a free view when left alone) does not join an
anchor's prologue (the schedule rules match the anchor's buffers as they are), a transpose (a copy
when left alone) folds into its loads. Three sweeps, none recomputing anything but the last: the
first, from the first binding to the last, grows each anchor's epilogue chain (before its consumers
group among themselves into something no rule inlines after an anchor); the second, from the last
binding to the first, fuses the other edges and views into their consumers; the third prologues.

Yellow cost (``yellow_cost``): fusing saves writing and reading back the producer's output;
it costs recomputing the producer once per ``tile_reuse`` consumer outputs that reuse each of its
elements, a flop worth ``1 / flops_per_byte`` bytes (``configs/passes/cost.json``). Fused when the
recompute is worth no more than the bytes saved. ``decide_yellow`` is the hook for measured
decisions (the tuning issue): it gets the producer, consumer and this cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import tvm
from tvm import relax

from ..errors import FuselightError
from ..relax_rewrite import repeated_binding_name
from . import cost_model
from .classify import (
    MAPPINGS,
    NON_CALL_OPS,
    OpInfo,
    _evaluate,
    _nbytes,
    classify_module,
)

Color = Literal["green", "yellow", "red"]

_VIEWS = ("reorganize", "shuffle")
_EPILOGUE_PATTERNS = ("ElemWise", "Broadcast")


def _table() -> dict[tuple[str, str], Color]:
    pairs: dict[tuple[str, str], Color] = {}
    for producer in MAPPINGS:
        for consumer in MAPPINGS:
            if "opaque" in (producer, consumer):
                color: Color = "red"
            elif producer in _VIEWS or consumer in ("one-to-one", "reorganize"):
                color = "green"  # no arithmetic to recompute, or an epilogue / a view of the result
            elif consumer == "many-to-many":
                color = "red" if producer == "many-to-many" else "yellow"
            else:  # a computed result permuted or broadcast on the way out: coalescing decides
                color = "yellow"
            pairs[(producer, consumer)] = color
    return pairs


CLASS_PAIRS: dict[tuple[str, str], Color] = _table()


@dataclasses.dataclass(frozen=True)
class YellowCost:
    saved_bytes: int
    recompute_flops: int
    fuse: bool


@dataclasses.dataclass
class Group:
    """Bindings that run as one kernel (in binding order), their classes, and the anchor (the
    many-to-many member, if any)."""

    members: list[str]
    classes: list[str]
    anchor: str | None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


YellowHook = Callable[[OpInfo, OpInfo, YellowCost], bool]


def yellow_cost(producer: OpInfo, consumer: OpInfo, dims: Mapping[str, int], config: cost_model.CostConfig) -> YellowCost:
    """The analytic decision for a yellow edge, with the symbolic dims bound to ``dims``."""
    p_flops, _, written = producer.evaluate(dims)
    c_flops, _, _ = consumer.evaluate(dims)
    saved = 2 * written  # written once, read back once
    recompute = 0
    if consumer.mapping == "many-to-many" and written and p_flops:
        elements = written // _itemsize(producer.dtype)
        reuse = c_flops / (2 * elements)  # multiply-adds each element of the producer's output feeds
        recompute = p_flops * max(0, math.ceil(reuse / config.tile_reuse) - 1)
    return YellowCost(saved, recompute, recompute <= saved * config.flops_per_byte)


def plan_fusion(
    mod: tvm.IRModule,
    dims: Mapping[str, int],
    arch: str | None = None,
    decide_yellow: YellowHook | None = None,
) -> dict[str, list[Group]]:
    """Fusion groups of every Relax function of ``mod`` (singletons included), costs evaluated with
    the symbolic dims bound to ``dims`` (names missing there make yellow edges red); ``arch``: the
    cost model's (None: the target's in scope, ``cost_model.arch_in_scope``)."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and (name := repeated_binding_name(func)) is not None:
            raise FuselightError(f"fusion plan: function {gv.name_hint!r} binds {name!r} twice; the plan names bindings "
                                 "by their vars (rename with relax_rewrite.module_with_unique_binding_names first)")
    config = cost_model.load(arch)
    return {
        name: _plan(infos, dims, config, decide_yellow) for name, infos in classify_module(mod).items()
    }


def _ops(infos: list[OpInfo]) -> list[OpInfo]:
    """Op calls, and the fields taken out of their tuple results (weights taken out of a tuple
    parameter are inputs, not work)."""
    ops: list[OpInfo] = []
    for info in infos:
        if info.op not in NON_CALL_OPS or (info.op == "tuple_get_item" and info.inputs[0] in {o.name for o in ops}):
            ops.append(info)
    return ops


def _plan(infos: list[OpInfo], dims, config, decide_yellow) -> list[Group]:
    ops = _ops(infos)
    by_name = {i.name: i for i in ops}
    users: dict[str, list[str]] = {i.name: [] for i in ops}
    for info in ops:
        for name in set(info.inputs):
            if name in users:
                users[name].append(info.name)
    parent = {i.name: i.name for i in ops}  # union-find
    anchor = {i.name: i.name if i.mapping == "many-to-many" else None for i in ops}  # per root
    prologue: dict[str, set[str]] = {i.name: set() for i in ops}  # per root: members feeding the anchor
    members: dict[str, list[OpInfo]] = {i.name: [i] for i in ops}  # per root

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    # Epilogues and views first (no recompute), then prologues with what is left.
    for sweep in ("epilogues", "views", "prologues"):
        for producer in ops if sweep == "epilogues" else reversed(ops):
            consumers = users[producer.name]
            roots = {find(c) for c in consumers}
            own = find(producer.name)
            if len(roots) != 1 or own in roots:
                continue  # unused, read by several kernels (materialised once), or already fused
            root = roots.pop()
            a = anchor[root]
            if anchor[own] is not None and a is not None:
                continue  # one anchor per group
            if sweep == "epilogues" and anchor[own] is None:
                continue
            feeds_anchor = a is not None and any(c == a or c in prologue[root] for c in consumers)
            if feeds_anchor and producer.mapping == "reorganize":
                continue  # a view costs nothing left alone; in the group, rules would no longer see the anchor's own shapes
            if feeds_anchor and producer.mapping not in _VIEWS and sweep != "prologues":
                continue
            if not _schedulable(members[own], members[root], anchor[own], a, feeds_anchor):
                continue
            target = by_name[a] if feeds_anchor else None
            if all(_fuses(producer, by_name[c], target, dims, config, decide_yellow) for c in consumers):
                parent[own] = root
                members[root] += members.pop(own)
                anchor[root] = a or anchor[own]
                prologue[root] |= prologue[own] | ({producer.name} if feeds_anchor else set())
    groups: dict[str, list[OpInfo]] = {}
    for info in ops:
        groups.setdefault(find(info.name), []).append(info)
    return [Group([m.name for m in ms], [m.mapping for m in ms], anchor[root]) for root, ms in groups.items()]


def _schedulable(own: list[OpInfo], root: list[OpInfo], own_anchor, root_anchor, feeds_anchor: bool) -> bool:
    """Whether the merged group is one a schedule rule takes: DLight's rules inline an anchor's
    epilogues into its output (elementwise and broadcast ops only: a split, gather or reshape there
    fails) and its prologues into its loads (elementwise, broadcast ops and views)."""
    if own_anchor is not None and root_anchor is None:  # own's anchor gets root's members as epilogues
        return all(i.tvm_pattern in _EPILOGUE_PATTERNS for i in root)
    if feeds_anchor:
        return all(i.tvm_pattern in _EPILOGUE_PATTERNS or i.mapping in _VIEWS for i in own)
    return True


def _fuses(producer: OpInfo, consumer: OpInfo, anchor: OpInfo | None, dims, config, decide_yellow) -> bool:
    """Whether ``producer`` joins ``consumer``'s group; ``anchor``: the group's many-to-many op when
    the producer would feed it (a prologue, recomputed per tile: decided by cost whatever the colour)."""
    color = CLASS_PAIRS[(producer.mapping, consumer.mapping)]
    if color == "red" or not (_lowers_to_tir(producer) and _lowers_to_tir(consumer)):
        return False
    target = anchor if anchor is not None and producer.mapping not in _VIEWS else consumer
    if color == "green" and target is consumer:
        return True
    try:
        cost = yellow_cost(producer, target, dims, config)
    except FuselightError:  # a symbolic dim without a value: nothing to decide by
        return False
    return decide_yellow(producer, target, cost) if decide_yellow is not None else cost.fuse


def _lowers_to_tir(info: OpInfo) -> bool:
    """Relax ops and TIR calls become PrimFuncs FuseTIR can merge; packed and extern calls do not,
    nor kernels TVM's pattern analysis calls opaque (hand-written or already scheduled ones), nor
    ops on tensors of unknown shape or rank (LegalizeOps can't lower them; no cost to decide by)."""
    if info.bytes_written is None:
        return False
    if info.op.startswith("call_tir:"):
        return info.tvm_pattern != "Opaque"
    return info.op.startswith("relax.") or info.op == "tuple_get_item"


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A grouping's cost: kernels launched, bytes moved (each kernel reads its inputs and writes its
    outputs once; a tensor made and used inside a group moves nothing, a view alone is free) and the
    flops prologues recompute."""

    kernels: int
    bytes: int
    recompute_flops: int

    def total(self, config: cost_model.CostConfig) -> float:
        """In bytes: traffic, launches at ``launch_bytes`` each, recomputes at ``flops_per_byte``."""
        return self.bytes + self.kernels * config.launch_bytes + self.recompute_flops / config.flops_per_byte


def estimate(
    func: relax.Function,
    infos: list[OpInfo],
    groups: Sequence[Sequence[str]],
    dims: Mapping[str, int],
    config: cost_model.CostConfig,
) -> Estimate:
    """The cost of running ``func`` (classified as ``infos``) with ``groups`` (binding names) as
    kernels and every other op as its own, symbolic dims bound to ``dims``."""
    ops = _ops(infos)
    by_name = {i.name: i for i in ops}
    bindings = {b.var.name: b for block in func.body.blocks for b in block.bindings}
    group_of = {m: i for i, g in enumerate(groups) for m in g}
    members: dict[object, list[str]] = {}
    for info in ops:
        members.setdefault(group_of.get(info.name, info.name), []).append(info.name)
    readers: dict[str, set[object]] = {}  # var name -> groups (or None: outside any op) that read it
    for b in bindings.values():
        key = group_of.get(b.var.name, b.var.name) if b.var.name in by_name else None
        for v in relax.analysis.free_vars(b.value):
            readers.setdefault(v.name, set()).add(key)
    for v in relax.analysis.free_vars(func.body.body):
        readers.setdefault(v.name, set()).add(None)
    total = Estimate(0, 0, 0)
    for key, names in members.items():
        infos_g = [by_name[n] for n in names]
        if all(i.mapping == "reorganize" for i in infos_g):
            continue  # views and tuple plumbing: no kernel
        inside = set(names)
        moved: set[relax.Expr] = set()
        for n in names:
            b, var = bindings[n], bindings[n].var
            if readers.get(n, set()) - {key} or not isinstance(var, relax.DataflowVar):
                moved.add(var)  # an output
            value = b.value
            if isinstance(value, relax.TupleGetItem) and value.tuple_value.name not in inside:
                moved.add(var)  # a field of an outside tuple: read that field only
                continue
            for arg in _tensor_leaves(value):
                if not (isinstance(arg, relax.Var) and arg.name in inside):
                    moved.add(arg)
        nbytes = sum(_evaluate(_nbytes(e.ty), dims) for e in moved)
        anchor = next((i for i in infos_g if i.mapping == "many-to-many"), None)
        recompute = 0
        if anchor is not None:
            upstream = _upstream(anchor.name, by_name, inside)
            recompute = sum(
                yellow_cost(by_name[n], anchor, dims, config).recompute_flops
                for n in upstream
                if by_name[n].mapping not in _VIEWS
            )
        total = Estimate(total.kernels + 1, total.bytes + nbytes, total.recompute_flops + recompute)
    return total


def io_bytes(binding: relax.Binding, dims: Mapping[str, int]) -> int:
    """Bytes a kernel call reads and writes: every tensor argument and its result, in full."""
    return sum(_evaluate(_nbytes(e.ty), dims) for e in [*_tensor_leaves(binding.value), binding.var])


def _tensor_leaves(value: relax.Expr) -> list[relax.Expr]:
    if isinstance(value, relax.Call):
        return [a for arg in value.args for a in _tensor_leaves(arg)]
    if isinstance(value, relax.Tuple):
        return [a for f in value.fields for a in _tensor_leaves(f)]
    if isinstance(value, relax.TupleGetItem):
        return _tensor_leaves(value.tuple_value)
    if isinstance(value, (relax.Var, relax.Constant)) and isinstance(value.ty, (relax.TensorType, relax.TupleType)):
        return [value]
    return []


def _upstream(name: str, by_name: Mapping[str, OpInfo], inside: set[str]) -> set[str]:
    """The members of ``inside`` that ``name`` reads, directly or through other members."""
    found: set[str] = set()
    todo = [name]
    while todo:
        for i in by_name[todo.pop()].inputs:
            if i in inside and i not in found:
                found.add(i)
                todo.append(i)
    return found


def kernels(groups: list[Group]) -> int:
    """Kernels the groups launch: a group of views only (reshapes, tuple fields) launches none."""
    return sum(1 for g in groups if any(c != "reorganize" for c in g.classes))


def _itemsize(dtype) -> int:
    dtype = dtype[0] if isinstance(dtype, list) else dtype
    t = tvm.DataType(dtype or "float32")
    return max(1, t.bits * t.lanes // 8)
