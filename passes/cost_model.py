"""The analytic cost model of the graph passes for a target arch: device facts from the device model
(``fuselight.device``), the template-level constant from ``configs/passes/cost.json``."""

from __future__ import annotations

import dataclasses
import re

import tvm

from ..device import device_model, require_device
from ..errors import FuselightError
from ..jsonfile import read_json_object
from ..paths import config_dir


@dataclasses.dataclass(frozen=True)
class CostConfig:
    """launch_bytes: the memory traffic (bytes) one kernel launch is worth (the device's launch cost
    at its DRAM rate); flops_per_byte: the elementwise flops worth one byte of traffic (its CUDA-core
    fp32 rate over its DRAM rate); tile_reuse: outputs of a many-to-many kernel that share one load
    of an input element (one recompute of a fused prologue per that many)."""

    launch_bytes: int
    flops_per_byte: int
    tile_reuse: int


# Where the target in scope has no device description (a CPU build, whose graphs the passes still
# rewrite), the cost model prices launches and recomputes as on this one.
REFERENCE_ARCH = "sm_90"


def arch_in_scope(arch: str | None) -> str:
    """``arch``, or (None) the arch of the CUDA target in scope if it has a device description, else
    ``REFERENCE_ARCH``."""
    if arch is not None:
        return arch

    target = tvm.target.Target.current(allow_none=True)
    scoped = str(target.attrs.get("arch", "")) if target is not None and target.kind.name == "cuda" else ""
    m = re.match(r"^sm_(\d+)", scoped)
    return f"sm_{m.group(1)}" if m and device_model(f"sm_{m.group(1)}") is not None else REFERENCE_ARCH


def load(arch: str | None = None) -> CostConfig:
    """The cost model for ``arch`` (None: ``arch_in_scope``); FuselightError where the arch has no
    device description."""
    device = require_device(arch_in_scope(arch))
    path = config_dir() / "passes" / "cost.json"
    table = read_json_object(path, missing=f"cost model config not found: {path}")
    try:
        tile_reuse = int(table["tile_reuse"])
    except (KeyError, TypeError, ValueError) as err:
        raise FuselightError(f"{path}: lacks a valid {err}") from None
    return CostConfig(
        launch_bytes=int(device.launch_us * device.dram_gbps * 1000),
        flops_per_byte=int(device.fp32_tflops * 1000 / device.dram_gbps),
        tile_reuse=tile_reuse,
    )
