"""The device model: what a build may assume of a GPU architecture (``configs/targets/devices.json``).

One plain description per arch, read by whatever needs a hardware fact (today: the choice of the
decode form, ``fuselight.compile.graphs_by_default``); an arch without a description has none, and
whatever asks falls back to what needs no fact.
"""

from __future__ import annotations

import dataclasses
import re

from .errors import FuselightError
from .jsonfile import read_json_object
from .paths import config_dir


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    arch: str
    name: str
    dram_gbps: float  # measured device-to-device copy rate, bytes read + written
    host_launch_us: float  # host time to launch one kernel on its own from the TVM VM


def device_model(arch: str | None) -> DeviceModel | None:
    """The description of ``arch`` (``sm_90``), or None where there is none."""
    path = config_dir() / "targets" / "devices.json"
    node = read_json_object(path, missing=f"device descriptions not found: {path}")
    entry = node.get(arch) if arch else None
    if entry is None:
        return None
    try:
        return DeviceModel(arch=arch, name=str(entry["name"]), dram_gbps=float(entry["dram_gbps"]),
                           host_launch_us=float(entry["host_launch_us"]))
    except (KeyError, TypeError, ValueError) as err:
        raise FuselightError(f"{path}[{arch!r}]: a bad device description ({err})") from None


def results_folder(device_name: str) -> str:
    """The folder under ``bench/results/`` for results measured on ``device_name`` (a record's
    ``device``): the ``results_folder`` of the description with that name, else the name in lower
    case with every run of other characters as one '-'."""
    # A PTX build's records name the GPU it ran on, marked "(sm_80 PTX)" (library.device_label).
    device_name = re.sub(r" \(sm_\d+a? PTX\)$", "", device_name)
    path = config_dir() / "targets" / "devices.json"
    node = read_json_object(path, missing=f"device descriptions not found: {path}")
    for entry in node.values():
        if isinstance(entry, dict) and entry.get("name") == device_name and entry.get("results_folder"):
            return str(entry["results_folder"])
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown-device"
