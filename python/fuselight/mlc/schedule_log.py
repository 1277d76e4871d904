"""Which step of a wrapped MLC-LLM pipeline scheduled each kernel.

``ScheduleLog.mark(step)`` is a pass that attributes every PrimFunc scheduled by then and not yet
attributed to ``step``. The wrapper marks ``BEFORE`` as its schedule phase starts (kernels written
already scheduled: MLC's KV cache, sampler and norm kernels) and each fuselight rule family after it
runs; ``finish`` attributes the rest when the pipeline is done: scheduled since then is ``MLC``
(LowBatchGemvSpecialize or DLight's rules), host-side functions (and every function of a CPU build,
which needs no schedule) are ``HOST``, and anything else is ``UNSCHEDULED`` (a kernel no rule took).

``check_weights()`` is a pass (run as the schedule phase starts, after MLC's dequantize fusions)
recording every kernel that writes a dequantized weight to memory (``passes.weight_source``): with
fuselight in MLC's pipeline the list must stay empty.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tvm

from ..passes.weight_source import materialized_weights

SCHEDULED_ATTR = "tirx.is_scheduled"
# Functions that run on the host (VMShapeLower's shape functions) carry this attribute.
HOST_ATTR = "tirx.is_host_func"


class ScheduleLog:
    BEFORE = "prescheduled"
    MLC = "mlc"
    HOST = "host"
    UNSCHEDULED = "unscheduled"

    def __init__(self) -> None:
        self.by: dict[str, str] = {}  # PrimFunc name -> step that scheduled it
        self.materialized: list[str] = []  # "function/binding: callee" of kernels writing dequantized weights

    def check_weights(self) -> tvm.transform.Pass:
        """A pass recording the kernels that write a dequantized weight; the module is unchanged."""

        @tvm.transform.module_pass(opt_level=0, name="ScheduleLog[materialized_weights]")
        def record(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
            self.materialized = [f"{m.function}/{m.binding}: {m.callee}" for m in materialized_weights(mod)]
            return mod

        return record

    def mark(self, step: str) -> tvm.transform.Pass:
        """A pass attributing the PrimFuncs newly scheduled by now to ``step``; the module is unchanged."""

        @tvm.transform.module_pass(opt_level=0, name=f"ScheduleLog[{step}]")
        def record(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
            for name in scheduled(mod):
                self.by.setdefault(name, step)
            return mod

        return record

    def finish(self, mod: tvm.IRModule, target: tvm.target.Target | None) -> None:
        """Attribute every PrimFunc of the finished module not attributed yet; forget removed ones.

        ``target``: what functions without a target attribute are built for (None: unknown)."""
        now = scheduled(mod)
        final: dict[str, str] = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            name = gv.name_hint
            if name in self.by:
                final[name] = self.by[name]
            elif name in now:
                final[name] = self.MLC
            else:
                final[name] = self.HOST if is_host_func(func, target) else self.UNSCHEDULED
        self.by = final

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for step in self.by.values():
            out[step] = out.get(step, 0) + 1
        return out

    def unscheduled(self) -> list[str]:
        return sorted(name for name, step in self.by.items() if step == self.UNSCHEDULED)

    def write(self, path: Path, options: dict[str, Any]) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"options": options, "counts": self.counts(), "kernels": dict(sorted(self.by.items())),
                  "materialized_weights": self.materialized}
        path.write_text(json.dumps(record, indent=1) + "\n")
        return path


def scheduled(mod: tvm.IRModule) -> set[str]:
    """Names of the module's PrimFuncs marked scheduled."""
    return {
        gv.name_hint
        for gv, func in mod.functions.items()
        if isinstance(func, tvm.tirx.PrimFunc) and bool(func.attrs and func.attrs.get(SCHEDULED_ATTR, False))
    }


def is_host_func(func: tvm.tirx.PrimFunc, target: tvm.target.Target | None = None) -> bool:
    """Runs on the host: marked so, or bound to (or, with no target of its own, built for) a CPU target."""
    attrs = func.attrs or {}
    if bool(attrs.get(HOST_ATTR, False)):
        return True
    bound = attrs.get("target", target)
    return bound is not None and bound.kind.name in ("llvm", "c")
