"""The analytic cost model's device constants (``configs/passes/cost.json``), per target arch."""

from __future__ import annotations

import dataclasses

from ..errors import FuselightError
from ..jsonfile import read_json_object
from ..paths import config_dir


@dataclasses.dataclass(frozen=True)
class CostConfig:
    """launch_bytes: the memory traffic (bytes) one kernel launch is worth; flops_per_byte: the
    elementwise flops worth one byte of traffic; tile_reuse: outputs of a many-to-many kernel that
    share one load of an input element (one recompute of a fused prologue per that many)."""

    launch_bytes: int
    flops_per_byte: int
    tile_reuse: int


def load(arch: str) -> CostConfig:
    path = config_dir() / "passes" / "cost.json"
    table = read_json_object(path, missing=f"cost model config not found: {path}")
    entry = table.get(arch)
    if not isinstance(entry, dict):
        raise FuselightError(f"{path}: no cost model for {arch!r}")
    try:
        return CostConfig(
            launch_bytes=int(entry["launch_overhead_us"] * entry["dram_bandwidth_gb_s"] * 1000),
            flops_per_byte=int(entry["elementwise_flops_per_byte"]),
            tile_reuse=int(entry["tile_reuse"]),
        )
    except (KeyError, TypeError) as err:
        raise FuselightError(f"{path}: {arch!r} lacks a valid {err}") from None
