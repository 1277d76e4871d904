"""Plan fusion groups by operator class (DNNFusion): the class-pair table and an analytic cost.

An analysis: ``plan_fusion`` returns, per Relax function, the groups of bindings that would run as
one kernel; ``fuselight explain`` reports them. Lowering the plan (outlining each group into a
``Primitive`` function so that FuseTIR builds one PrimFunc per group, in place of FuseOps) is not
done yet.

``CLASS_PAIRS`` colours each (producer class, consumer class) edge: green fuse, yellow decide by
cost, red never. Views (reorganize) and index permutations (shuffle) compute nothing, so they fold
into any consumer's indexing; an elementwise (one-to-one) consumer takes any producer's output as
an epilogue; a many-to-many consumer (matmul, reduction, norm) of a computing producer is a
prologue (yellow: it is recomputed for every tile that loads its output); two many-to-many ops are
never fused, nor is anything opaque or any packed/extern call (no PrimFunc to merge).

Groups grow backwards from each consumer: producers are visited from the last binding to the
first, and a producer (with its group) joins the group of its users when all its users are in one
group (no duplicated work), the edge to each user is green, or yellow and the cost decides for it,
and the merged group keeps at most one many-to-many op (its anchor, the kernel a schedule rule
recognises). A computing producer that would feed the anchor, directly or through other members,
is a prologue: the cost decides with the anchor as consumer, whatever the edge's colour. A first
sweep fuses epilogues and views only (they recompute nothing), a second one prologues.

Yellow cost (``yellow_cost``): fusing saves writing and reading back the producer's output;
it costs recomputing the producer once per ``tile_reuse`` consumer outputs that reuse each of its
elements, a flop worth ``1 / flops_per_byte`` bytes (``configs/passes/cost.json``). Fused when the
recompute is worth no more than the bytes saved. ``decide_yellow`` is the hook for measured
decisions (the tuning issue): it gets the producer, consumer and this cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Literal

import tvm

from ..errors import FuselightError
from . import cost_model
from .classify import MAPPINGS, NON_CALL_OPS, OpInfo, classify_module

Color = Literal["green", "yellow", "red"]

_VIEWS = ("reorganize", "shuffle")


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
    arch: str = "sm_90",
    decide_yellow: YellowHook | None = None,
) -> dict[str, list[Group]]:
    """Fusion groups of every Relax function of ``mod`` (singletons included), costs evaluated with
    the symbolic dims bound to ``dims`` (names missing there make yellow edges red)."""
    config = cost_model.load(arch)
    return {
        name: _plan(infos, dims, config, decide_yellow) for name, infos in classify_module(mod).items()
    }


def _plan(infos: list[OpInfo], dims, config, decide_yellow) -> list[Group]:
    # Op calls, and the fields taken out of their tuple results (weights taken out of a tuple
    # parameter are inputs, not work).
    ops: list[OpInfo] = []
    for info in infos:
        if info.op not in NON_CALL_OPS or (info.op == "tuple_get_item" and info.inputs[0] in {o.name for o in ops}):
            ops.append(info)
    by_name = {i.name: i for i in ops}
    users: dict[str, list[str]] = {i.name: [] for i in ops}
    for info in ops:
        for name in set(info.inputs):
            if name in users:
                users[name].append(info.name)
    parent = {i.name: i.name for i in ops}  # union-find
    anchor = {i.name: i.name if i.mapping == "many-to-many" else None for i in ops}  # per root
    prologue: dict[str, set[str]] = {i.name: set() for i in ops}  # per root: members feeding the anchor

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    # Epilogues and views first (no recompute), then prologues with what is left.
    for allow_prologue in (False, True):
        for producer in reversed(ops):
            consumers = users[producer.name]
            roots = {find(c) for c in consumers}
            own = find(producer.name)
            if len(roots) != 1 or own in roots:
                continue  # unused, read by several kernels (materialised once), or already fused
            root = roots.pop()
            a = anchor[root]
            if anchor[own] is not None and a is not None:
                continue  # one anchor per group
            feeds_anchor = a is not None and any(c == a or c in prologue[root] for c in consumers)
            if feeds_anchor and producer.mapping not in _VIEWS and not allow_prologue:
                continue
            target = by_name[a] if feeds_anchor else None
            if all(_fuses(producer, by_name[c], target, dims, config, decide_yellow) for c in consumers):
                parent[own] = root
                anchor[root] = a or anchor[own]
                prologue[root] |= prologue[own] | ({producer.name} if feeds_anchor else set())
    members: dict[str, list[OpInfo]] = {}
    for info in ops:
        members.setdefault(find(info.name), []).append(info)
    return [Group([m.name for m in ms], [m.mapping for m in ms], anchor[root]) for root, ms in members.items()]


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
    """Relax ops and TIR calls become PrimFuncs FuseTIR can merge; packed and extern calls do not."""
    return info.op.startswith(("relax.", "call_tir:")) or info.op == "tuple_get_item"


def kernels(groups: list[Group]) -> int:
    """Kernels the groups launch: a group of views only (reshapes, tuple fields) launches none."""
    return sum(1 for g in groups if any(c != "reorganize" for c in g.classes))


def _itemsize(dtype) -> int:
    dtype = dtype[0] if isinstance(dtype, list) else dtype
    t = tvm.DataType(dtype or "float32")
    return max(1, t.bits * t.lanes // 8)
