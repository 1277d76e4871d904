"""Run a pass that transforms each PrimFunc on its own over several processes: a build's wall time over the host's cores.

TVM runs a module pass one function after another in one process. Where the pass decides each
PrimFunc alone (TIR lowering; applying schedule rules), ``in_processes(pass_, jobs)`` splits the
module's PrimFuncs into ``jobs`` groups of about equal size (statements), runs the pass over the first
group here while forked children run it over the others, and merges what they send back
(``tvm.ir.save_json``). The result is the module the pass gives the whole module (tests compare
them). A child that fails, dies or hangs has its group run again here, so an error is raised as it
would be without the children. Only where the host can fork (POSIX); elsewhere, or with one job, it is the
pass itself.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tvm
from tvm import tirx
from tvm.s_tir import dlight as dl

from .contracts import IS_SCHEDULED_ATTR
from .cuda_compile import compile_jobs

# How long a child may outlast this process's own share before it counts as stuck, at least (s).
_PATIENCE_S = 60.0


def statement_count(func: tirx.PrimFunc) -> int:
    """The nodes of ``func``'s body: what the time to lower it grows with."""
    count = [0]
    tirx.stmt_functor.post_order_visit(func.body, lambda _: count.__setitem__(0, count[0] + 1))
    return count[0]


def balanced_groups(sizes: dict[str, int], groups: int) -> list[list[str]]:
    """Names split into ``groups`` lists of about equal total size (largest first, each to the least
    loaded group; ties by name, so the split is the same every build). No list is empty where there are
    at least ``groups`` names."""
    out: list[list[str]] = [[] for _ in range(groups)]
    load = [0] * groups
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        i = load.index(min(load))
        out[i].append(name)
        load[i] += sizes[name]
    return out


def _finished(pid: int, deadline: float) -> bool:
    """Whether the child ``pid`` exited cleanly by ``deadline`` (killed if still running then); reaped."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def _submodule(mod: tvm.IRModule, names: list[str]) -> tvm.IRModule:
    keep = set(names)
    return tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint in keep}, attrs=mod.attrs)


def in_processes(
    pass_: Any,
    jobs: int,
    select: Callable[[tirx.PrimFunc], bool] | None = None,
    cost: Callable[[tirx.PrimFunc], int] = statement_count,
    name: str = "InProcesses",
) -> tvm.transform.Pass:
    """The module pass ``pass_``, which transforms each PrimFunc alone, run over ``jobs`` processes.

    ``select``: the PrimFuncs worth a child's time (default all); the rest, and every other function,
    are passed here. ``cost``: what the groups balance (default the statements). Functions keep their
    GlobalVars where their names were in the module, so calls to them from functions the pass leaves
    alone stay bound.
    """

    @tvm.transform.module_pass(opt_level=0, name=f"fuselight.{name}")
    def run(mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
        sizes = {gv.name_hint: cost(f) for gv, f in mod.functions.items()
                 if isinstance(f, tirx.PrimFunc) and (select is None or select(f))}
        workers = min(jobs, len(sizes))
        if workers < 2 or not hasattr(os, "fork"):
            return pass_(mod)
        groups = balanced_groups(sizes, workers)
        groups[0] += [gv.name_hint for gv in mod.functions if gv.name_hint not in sizes]
        with tempfile.TemporaryDirectory(prefix="fuselight-pass-") as tmp:
            children = {}
            for i, names in enumerate(groups[1:], start=1):
                out = Path(tmp, f"{i}.json")
                pid = os.fork()
                if pid == 0:  # the child: run, write, leave without running the parent's cleanup
                    code = 1
                    try:
                        out.write_text(tvm.ir.save_json(pass_(_submodule(mod, names))))
                        code = 0
                    finally:
                        os._exit(code)
                children[pid] = (names, out)
            started = time.monotonic()
            try:
                parts = [pass_(_submodule(mod, groups[0]))]
            except BaseException:
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                raise
            # A child still busy long after this process finished its like share is stuck (a
            # library's thread pool that did not survive the fork): its group is run here.
            deadline = time.monotonic() + max(_PATIENCE_S, 2 * (time.monotonic() - started))
            ok = {pid: _finished(pid, deadline) for pid in children}
            for pid, (names, out) in children.items():
                parts.append(tvm.ir.load_json(out.read_text()) if ok[pid] else pass_(_submodule(mod, names)))
        known = {gv.name_hint: gv for gv in mod.functions}
        merged = tvm.IRModule({}, attrs=parts[0].attrs)
        for part in parts:
            for gv, func in part.functions.items():
                merged[known.get(gv.name_hint, gv)] = func
        return merged

    return run


def _unscheduled(func: tirx.PrimFunc) -> bool:
    """Whether DLight's ``ApplyDefaultSchedule`` tries its rules on ``func`` (not marked scheduled)."""
    return not (func.attrs is not None and int(func.attrs.get(IS_SCHEDULED_ATTR, 0)) == 1)


def rules_in_processes(rules: Sequence[Any], name: str) -> tvm.transform.Pass:
    """DLight's ``ApplyDefaultSchedule(*rules)`` over ``compile_jobs()`` processes, children taking only
    unscheduled functions. The groups balance counts: a function's size says little of its rule's time
    (a GEMM template's parse outweighs a larger elementwise function's)."""
    return in_processes(dl.ApplyDefaultSchedule(*rules), compile_jobs(), _unscheduled, lambda _: 1, name=name)
