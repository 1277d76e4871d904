"""The shape every fuselight rule has: ``analyze``, then ``schedule``.

``analyze`` recognises the computation and returns a plain description (a dataclass), or None;
``schedule`` turns a description into a scheduled kernel for the target, or None where its
templates do not serve. Keeping them apart lets tests, ``fuselight explain`` and the benchmarks
ask what a rule sees without building anything. ``apply`` (DLight's entry point) chains them:
on None DLight moves on to the next rule.
"""

from __future__ import annotations

from typing import Any

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target


class AnalyzeScheduleRule(GPUScheduleRule):
    """A GPU rule as ``analyze`` + ``schedule`` (see the module docstring)."""

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
