"""fuselight schedule rules (DLight style), tried ahead of DLight's defaults.

``RULES`` names every rule family (the shape of ``fuselight.passes.PASSES``): ``ScheduleRuleEntry``
with its name and the rule class, most specific first. ``DEFAULT`` is that order;
``fuselight_rules(families)`` makes the rule objects, ``default(target)`` is the rule list to hand to
``tvm.s_tir.dlight.ApplyDefaultSchedule``: each PrimFunc is scheduled by the first rule that
applies, so fuselight's rules come first and DLight's defaults, the ones MLC-LLM uses, stay as the
fallback. A rule object's family is its class's ``family`` (``families_of``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import tvm
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight import ScheduleRule

from ..errors import FuselightError
from .flash_attention import FlashAttention
from .gemv import Gemv
from .matmul import Matmul
from .paged_attention import PagedAttention
from .rope_append import RopeAppend
from .row_reduction import RowReduction


@dataclasses.dataclass(frozen=True)
class ScheduleRuleEntry:
    name: str
    make: Callable[[], ScheduleRule]


# Most specific first: FlashAttention only takes functions tagged by FuseAttention (and checked to be
# exactly that computation), which DLight's Reduction and Fallback rules would otherwise accept and
# schedule as separate, S x S-materialising stages. PagedAttention takes only the KV cache's kernels
# the paged_attention and fuse_rope_append passes tagged (TVM's scheduled kernels, no longer marked
# so: no other rule should see them).
RULES: dict[str, ScheduleRuleEntry] = {
    e.name: e
    for e in [
        ScheduleRuleEntry(FlashAttention.family, FlashAttention),
        ScheduleRuleEntry(PagedAttention.family, PagedAttention),
        ScheduleRuleEntry(Matmul.family, Matmul),
        ScheduleRuleEntry(Gemv.family, Gemv),
        ScheduleRuleEntry(RowReduction.family, RowReduction),
        ScheduleRuleEntry(RopeAppend.family, RopeAppend),
    ]
}
DEFAULT: tuple[str, ...] = tuple(RULES)


def get(name: str) -> ScheduleRuleEntry:
    if name not in RULES:
        raise FuselightError(f"unknown rule family {name!r}: expected one of {', '.join(RULES)}")
    return RULES[name]


def fuselight_rules(families: Sequence[str] | None = None) -> list[ScheduleRule]:
    """fuselight's rules (``families``, in ``RULES`` order; None: all); each returns None for targets
    it does not serve."""
    chosen = set(RULES) if families is None else {get(f).name for f in families}
    return [entry.make() for name, entry in RULES.items() if name in chosen]


def families_of(rules: Iterable[ScheduleRule]) -> set[str]:
    """The fuselight rule families among ``rules`` (other rules have none)."""
    return {f for f in (getattr(r, "family", "") for r in rules) if f in RULES}


def default(target: tvm.target.Target | None = None) -> list[ScheduleRule]:
    """fuselight's rules followed by DLight's defaults for ``target`` (the current target if None)."""
    return fuselight_rules() + dlight_defaults(target)


def dlight_defaults(target: tvm.target.Target | None = None) -> list[ScheduleRule]:
    """The DLight rules MLC-LLM schedules GPU targets with; none for llvm.

    MLC-LLM applies ``dl.cpu.GEMV`` on llvm. On TVM 0.26 the loops it produces take LLVM minutes
    per kernel to compile (float16 GEMVs: 90-300 s each; float32 with a reduction length that is
    not a multiple of 128: ~20 s), so llvm kernels stay with TVM's default CPU lowering: the CPU
    build is for checking numerics, not for speed.
    """
    target = target or tvm.target.Target.current(allow_none=False)
    if target.kind.name == "llvm":
        return []
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


__all__ = ["DEFAULT", "RULES", "FlashAttention", "Gemv", "Matmul", "PagedAttention", "RopeAppend", "RowReduction",
           "ScheduleRuleEntry", "default", "dlight_defaults", "families_of", "fuselight_rules", "get"]
