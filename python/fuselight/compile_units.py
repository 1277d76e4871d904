"""Spread a build's CUDA kernels over several compilation units, for nvcc to compile at once.

TVM emits one CUDA source per device target, and nvcc compiles one source on one core (about 10 s for
Llama-3-8B's, most of it in the front end). ``assign_compile_units`` gives each kernel of a lowered
module a copy of its target that differs only in its tag (``fuselight-cuda-unit-N``): TVM's build groups
device functions by target, so each unit becomes a CUDA module of its own in the library, with its own
source, compiled by its own nvcc (``library.aot_compile_cuda``) and loaded by the runtime as one more
imported module (kernels are looked up by name across the imports). The code of a kernel is what it
is in one unit. How many units: one per ``cuda_unit_statements`` statements of kernel code, at most
``max_cuda_units`` (``configs/build.json``), from the code alone: the same library on every host.
"""

from __future__ import annotations

import math
from typing import Any

import tvm
from tvm import tirx

from .forked_passes import balanced_groups, statement_count
from .jsonfile import read_json_object
from .paths import config_dir

TAG_PREFIX = "fuselight-cuda-unit-"


def unit_count(statements: int, unit_statements: int, max_units: int) -> int:
    """Units for ``statements`` of kernel code: one per ``unit_statements``, 1 to ``max_units``."""
    return max(1, min(max_units, math.ceil(statements / unit_statements)))


def assign_compile_units(unit_statements: int | None = None, max_units: int | None = None) -> tvm.transform.Pass:
    """A module pass over a lowered module: its CUDA kernels in ``unit_count`` units of about equal size
    (unset settings from ``configs/build.json``)."""
    path = config_dir() / "build.json"
    settings = read_json_object(path, missing=f"build settings not found: {path}")
    unit_statements = unit_statements or int(settings["cuda_unit_statements"])
    max_units = max_units or int(settings["max_cuda_units"])

    @tvm.transform.module_pass(opt_level=0, name="fuselight.AssignCompileUnits")
    def run(mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
        kernels = {
            gv: f for gv, f in mod.functions.items()
            if isinstance(f, tirx.PrimFunc) and f.attrs is not None and "target" in f.attrs
            and f.attrs["target"].kind.name == "cuda"
        }
        sizes = {gv.name_hint: statement_count(f) for gv, f in kernels.items()}
        units = unit_count(sum(sizes.values()), unit_statements, max_units)
        if units < 2:
            return mod
        unit_of = {name: i for i, names in enumerate(balanced_groups(sizes, units)) for name in names}
        for gv, func in kernels.items():
            target = func.attrs["target"]
            tagged = tvm.target.Target({**dict(target.export()), "tag": f"{TAG_PREFIX}{unit_of[gv.name_hint]}"})
            mod[gv] = func.with_attr("target", tagged)
        return mod

    return run
