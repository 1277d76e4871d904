"""fuselight inside MLC-LLM's own pipeline: ``enable()`` wraps the pipeline MLC registers as "mlc_llm".

MLC-LLM builds its pass list inside the pipeline it registers (``mlc_llm.compiler_pass.pipeline``)
and has no hook for more passes. While a wrapped pipeline runs, two names in that module's namespace
(the anchors) stand for a sequence around MLC's own pass, and are restored afterwards:

- ``FuseTransposeMatmul`` (end of the graph phase): fuselight's graph passes of the
  "before_fuse_transpose_matmul" slot, MLC's FuseTransposeMatmul, then those of the
  "after_graph_passes" and "before_legalize" slots, as in ``fuselight.pipeline`` (MLC's graph phase
  ends with FuseTransposeMatmul; its next passes lower to TIR);
- ``LowBatchGemvSpecialize`` (start of the schedule phase): fuselight's rules, one
  ``ApplyDefaultSchedule`` per rule family in ``fuselight.rules`` order (a function goes to the first
  family that takes it, as with one list), then MLC's LowBatchGemvSpecialize and DLight's rules.

Everything else is MLC's. With ``Options.dump`` the module is written after each of our steps
(``fuselight-NN-<step>.py``) and ``schedule.json`` says which rule scheduled which kernel
(``fuselight.mlc.schedule_log``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import tvm
from tvm import relax

from ..baseline.debug_dump import DebugDump
from ..errors import FuselightError
from ..forked_passes import rules_in_processes
from .. import rules
from ..options import Options
from ..passes import get as get_graph_pass
from . import SOURCE_ENV, import_mlc_llm, import_mlc_module
from .schedule_log import ScheduleLog

PIPELINE_NAME = "mlc_llm"
# MLC's module that builds the pass list, and the names in it our steps go around.
MLC_PIPELINE_MODULE = "mlc_llm.compiler_pass.pipeline"
GRAPH_ANCHOR = "FuseTransposeMatmul"
SCHEDULE_ANCHOR = "LowBatchGemvSpecialize"
# Rule family name -> factory, in the order fuselight tries them (``fuselight.rules.RULES``).
RULE_FAMILIES: dict[str, Callable[[], Any]] = {name: entry.make for name, entry in rules.RULES.items()}
SCHEDULE_LOG_FILE = "schedule.json"


@dataclasses.dataclass
class _Enabled:
    original: Callable[..., tvm.transform.Pass]  # MLC's registered factory
    options: Options


_STATE: dict[str, _Enabled] = {}


def mlc_pipeline_module() -> types.ModuleType:
    """MLC-LLM's pipeline module, checked to have the anchors; FuselightError naming what is missing."""
    if import_mlc_llm() is None:
        raise FuselightError(f"MLC-LLM is not available: install mlc_llm or set {SOURCE_ENV} to an MLC-LLM source checkout")
    try:
        module = import_mlc_module(MLC_PIPELINE_MODULE)
    except ImportError as err:
        raise FuselightError(f"this MLC-LLM has no {MLC_PIPELINE_MODULE} ({err}): fuselight cannot wrap its pipeline") from None
    missing = [name for name in (GRAPH_ANCHOR, SCHEDULE_ANCHOR) if not callable(getattr(module, name, None))]
    if PIPELINE_NAME not in relax.pipeline.PIPELINE_MAP:
        missing.append(f'the registered pipeline "{PIPELINE_NAME}"')
    if missing:
        raise FuselightError(
            f"this MLC-LLM's {MLC_PIPELINE_MODULE} lacks {', '.join(missing)}: fuselight cannot place its passes"
        )
    return module


def enable(options: Options | None = None) -> None:
    """Make ``relax.get_pipeline("mlc_llm", ...)`` (what ``mlc_llm compile`` uses) run fuselight too.

    Enabling again replaces the options; ``disable()`` restores MLC's pipeline. Passes whose
    libraries call back into the fuselight runtime are left out (MLC's engine does not load it);
    naming one is an error.
    """
    options = options or Options()
    options.check_without_fuselight_runtime()
    module = mlc_pipeline_module()
    state = _STATE.get(PIPELINE_NAME)
    original = state.original if state else relax.pipeline.PIPELINE_MAP[PIPELINE_NAME]
    relax.pipeline.PIPELINE_MAP[PIPELINE_NAME] = _wrap(original, module, options)
    _STATE[PIPELINE_NAME] = _Enabled(original, options)


def disable() -> None:
    """Restore MLC's own pipeline (a no-op when fuselight is not enabled)."""
    state = _STATE.pop(PIPELINE_NAME, None)
    if state is not None:
        relax.pipeline.PIPELINE_MAP[PIPELINE_NAME] = state.original


def enabled_options() -> Options | None:
    """The options fuselight is enabled with, or None."""
    state = _STATE.get(PIPELINE_NAME)
    return state.options if state else None


@contextlib.contextmanager
def enabled(options: Options | None = None) -> Iterator[None]:
    """``enable(options)`` for the ``with`` block; what was registered before comes back after."""
    before = _STATE.get(PIPELINE_NAME)
    enable(options)
    try:
        yield
    finally:
        if before is None:
            disable()
        else:
            enable(before.options)


def _wrap(
    original: Callable[..., tvm.transform.Pass], module: types.ModuleType, options: Options
) -> Callable[..., tvm.transform.Pass]:
    def fuselight_mlc_llm(*args: Any, **kwargs: Any) -> tvm.transform.Pass:
        inner = original(*args, **kwargs)

        @tvm.transform.module_pass(opt_level=0, name="fuselight_mlc_llm")
        def run(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
            log = ScheduleLog()
            with _anchors_replaced(module, options, log):
                mod = inner(mod)
            log.finish(mod, tvm.target.Target.current(allow_none=True))
            if options.dump is not None:
                log.write(Path(options.dump) / SCHEDULE_LOG_FILE, options.describe(fuselight_runtime=False))
            return mod

        return run

    return fuselight_mlc_llm


@contextlib.contextmanager
def _anchors_replaced(module: types.ModuleType, options: Options, log: ScheduleLog) -> Iterator[None]:
    graph, schedule = getattr(module, GRAPH_ANCHOR), getattr(module, SCHEDULE_ANCHOR)
    steps = _StepCounter(options.dump)
    ours = [get_graph_pass(name) for name in options.graph_passes(fuselight_runtime=False)]

    def slot(which: str) -> list[tvm.transform.Pass]:
        return steps.each([(p.name, p.make()) for p in ours if p.slot == which])

    def graph_phase(*args: Any, **kwargs: Any) -> tvm.transform.Pass:
        # MLC's graph phase ends with FuseTransposeMatmul: right after it is before legalization.
        return tvm.transform.Sequential(
            [*slot("before_fuse_transpose_matmul"), graph(*args, **kwargs), *slot("after_graph_passes"),
             *slot("before_legalize")]
        )

    def schedule_phase(*args: Any, **kwargs: Any) -> tvm.transform.Pass:
        sequence = [log.check_weights(), log.mark(ScheduleLog.BEFORE), *slot("before_rules")]
        for family in options.rule_families:
            # Rules schedule each function alone: over the host's cores.
            sequence += steps.each([(f"rules-{family}", rules_in_processes([rules.get(family).make()], f"rules-{family}"))])
            sequence.append(log.mark(family))
        return tvm.transform.Sequential([*sequence, schedule(*args, **kwargs)])

    setattr(module, GRAPH_ANCHOR, graph_phase)
    setattr(module, SCHEDULE_ANCHOR, schedule_phase)
    try:
        yield
    finally:
        setattr(module, GRAPH_ANCHOR, graph)
        setattr(module, SCHEDULE_ANCHOR, schedule)


class _StepCounter:
    """Numbers our steps and, with a dump folder, follows each with a ``DebugDump``."""

    def __init__(self, dump: Path | None) -> None:
        self.dump, self.count = dump, 0

    def each(self, steps: Sequence[tuple[str, tvm.transform.Pass]]) -> list[tvm.transform.Pass]:
        out = []
        for name, pass_ in steps:
            self.count += 1
            out.append(pass_)
            if self.dump is not None:
                out.append(DebugDump(Path(self.dump), f"fuselight-{self.count:02d}-{name}.py"))
        return out
