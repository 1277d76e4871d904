"""fuselight schedule rules (DLight style), tried ahead of DLight's defaults.

``default(target)`` is the rule list to hand to ``tvm.s_tir.dlight.ApplyDefaultSchedule``: each
PrimFunc is scheduled by the first rule that applies, so fuselight's rules (``FUSELIGHT_RULES``)
come first and DLight's defaults, the ones MLC-LLM uses, stay as the fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tvm
    from tvm.s_tir.dlight import ScheduleRule


def flash_attention_rule() -> ScheduleRule:
    from .flash_attention import FlashAttention

    return FlashAttention()


def matmul_rule() -> ScheduleRule:
    from .matmul import Matmul

    return Matmul()


def gemv_rule() -> ScheduleRule:
    from .gemv import Gemv

    return Gemv()


def rope_append_rule() -> ScheduleRule:
    from .rope_append import RopeAppend

    return RopeAppend()


def row_reduction_rule() -> ScheduleRule:
    from .row_reduction import RowReduction

    return RowReduction()


# Factories of fuselight's rules, most specific first: FlashAttention only takes functions tagged
# by FuseAttention (and checked to be exactly that computation), which DLight's Reduction and
# Fallback rules would otherwise accept and schedule as separate, S x S-materialising stages.
FUSELIGHT_RULES: list[Callable[[], ScheduleRule]] = [
    flash_attention_rule, matmul_rule, gemv_rule, row_reduction_rule, rope_append_rule,
]


def fuselight_rules() -> list[ScheduleRule]:
    """fuselight's rules alone (each returns None for targets it does not serve)."""
    return [make() for make in FUSELIGHT_RULES]


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
    from tvm.s_tir import dlight as dl
    from tvm.target import Target

    target = target or Target.current(allow_none=False)
    if target.kind.name == "llvm":
        return []
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
