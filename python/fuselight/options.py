"""What fuselight adds to a pipeline: one ``Options`` for our pipeline (``fuselight compile``) and for
MLC-LLM's (``fuselight mlc compile``, ``fuselight.mlc.pipeline``).

passes: graph pass names from ``fuselight.passes`` (None: ``passes.DEFAULT`` less the passes whose
rule families are not among ``rules``; () none). A named pass whose rule families (``GraphPass
.rules``) are left out is an error: what it emits unscheduled only those rules schedule.
rules: rule families from ``fuselight.rules.RULES`` (None: all; (): DLight's rules alone, to
measure the passes by themselves).
programmatic_launch: every kernel may launch while the one before it finishes (sm_90 and later;
``fuselight.tir_pipeline.NAME_EVERY_KERNEL``).
dump: a folder for the module after each of our steps and ``schedule.json`` (MLC's pipeline).

Inside MLC-LLM's engine the fuselight runtime is not loaded: ``graph_passes(fuselight_runtime=False)``
leaves out the passes whose libraries call back into it (``GraphPass.needs_fuselight_runtime``).

The registries (``fuselight.passes``, ``fuselight.rules``) are imported where used: they load TVM's
compiler, and ``fuselight.compile``, which imports this module, is imported on runtime-only hosts
(through ``fuselight.bench.results``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .errors import FuselightError


@dataclasses.dataclass(frozen=True)
class Options:
    """See the module docstring."""

    passes: tuple[str, ...] | None = None
    rules: tuple[str, ...] | None = None
    programmatic_launch: bool = True
    dump: Path | None = None

    def __post_init__(self) -> None:
        from .passes import get as get_pass
        from .rules import get as get_rule

        for family in self.rules or ():
            get_rule(family)  # unknown families fail here
        for name in self.passes or ():
            missing = [f for f in get_pass(name).rules if f not in self.rule_families]  # unknown names fail too
            if missing:
                raise FuselightError(f"pass {name!r} needs the rule families {', '.join(missing)}: add them to the rules")

    @property
    def rule_families(self) -> list[str]:
        """The rule families chosen, in ``fuselight.rules.RULES`` order."""
        from .rules import RULES

        chosen = set(self.rules) if self.rules is not None else set(RULES)
        return [family for family in RULES if family in chosen]

    def graph_passes(self, fuselight_runtime: bool = True) -> list[str]:
        """The graph passes to run: those named, or the defaults the chosen rules serve; without
        ``fuselight_runtime`` (MLC-LLM's engine) less those whose libraries need it."""
        from .passes import DEFAULT, get, served

        names = list(self.passes) if self.passes is not None else served(DEFAULT, self.rule_families)
        return names if fuselight_runtime else [n for n in names if not get(n).needs_fuselight_runtime]

    def check_without_fuselight_runtime(self) -> None:
        """FuselightError if a named pass needs the fuselight runtime where the model runs."""
        from .passes import get

        for name in self.passes or ():
            if get(name).needs_fuselight_runtime:
                raise FuselightError(f"pass {name!r} needs the fuselight runtime where the model runs; "
                                     "MLC-LLM's engine does not load it")

    def describe(self, fuselight_runtime: bool = True) -> dict[str, Any]:
        return {"passes": self.graph_passes(fuselight_runtime), "rules": self.rule_families,
                "programmatic_launch": self.programmatic_launch}
