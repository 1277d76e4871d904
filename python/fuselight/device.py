"""The device model: what a build may assume of a GPU architecture (``configs/targets/devices.json``).

One plain description per arch, the one source of hardware facts for every rule, template, cost
function and report: SM count, registers, shared memory, L2, DRAM rate, tensor-core peak, launch
cost and the PTX capabilities (``has``). An arch without a description has none: fuselight then
leaves its kernels to DLight, and whatever asks falls back to what needs no fact.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from .errors import FuselightError
from .jsonfile import read_json_object
from .paths import config_dir

# The PTX features a description may name: mma.sync, ldmatrix and cp.async are sm_80's; wgmma,
# TMA (cp.async.bulk, mbarrier expect_tx, fence.proxy.async), setmaxnreg and griddepcontrol
# (programmatic dependent launch) sm_90's.
CAPABILITIES = ("ldmatrix", "cp.async", "mma.sync", "wgmma", "tma", "setmaxnreg", "griddepcontrol")


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    arch: str
    name: str
    also: tuple[str, ...]  # other GPUs of the arch (their SM count and rates differ; name's are used)
    sms: int
    warp_size: int
    max_threads_per_block: int
    max_threads_per_sm: int
    regs_per_sm: int  # 32-bit registers
    regs_per_block: int
    max_regs_per_thread: int
    smem_per_block: int  # bytes of static shared memory a block may declare
    smem_per_block_optin: int  # bytes of dynamic shared memory a block may opt in to
    smem_per_sm: int
    l2_bytes: int
    dram_peak_gbps: float  # datasheet
    dram_measured_gbps: float | None  # device-to-device copy rate (bytes read + written) measured on the GPU
    fp16_tensor_tflops: float  # dense fp16 tensor-core peak with fp32 accumulate
    fp32_tflops: float  # CUDA-core fp32 peak
    launch_us: float  # GPU time one kernel launch costs (gap, ramp-up and tail)
    host_launch_us: float | None  # measured host time to launch one kernel from the TVM VM
    capabilities: frozenset[str]

    @property
    def dram_gbps(self) -> float:
        """The DRAM rate cost functions use: the measured copy rate where there is one, else the datasheet's."""
        return self.dram_measured_gbps if self.dram_measured_gbps is not None else self.dram_peak_gbps

    def has(self, capability: str) -> bool:
        """Whether kernels for this arch may use ``capability`` (one of ``CAPABILITIES``)."""
        if capability not in CAPABILITIES:
            raise FuselightError(f"unknown device capability {capability!r}: expected one of {', '.join(CAPABILITIES)}")
        return capability in self.capabilities


_INT_FIELDS = ("sms", "warp_size", "max_threads_per_block", "max_threads_per_sm", "regs_per_sm", "regs_per_block",
               "max_regs_per_thread", "smem_per_block", "smem_per_block_optin", "smem_per_sm", "l2_bytes")
_FLOAT_FIELDS = ("dram_peak_gbps", "fp16_tensor_tflops", "fp32_tflops", "launch_us")
_OPTIONAL_FLOAT_FIELDS = ("dram_measured_gbps", "host_launch_us")


def described_archs() -> tuple[str, ...]:
    """The archs ``configs/targets/devices.json`` describes, e.g. ``("sm_80", "sm_86", "sm_89", "sm_90")``."""
    return tuple(sorted(k for k in _table() if not k.startswith("_")))


def devices() -> tuple[DeviceModel, ...]:
    """Every described arch's model."""
    return tuple(_parse(arch) for arch in described_archs())


def least(field: str) -> int:
    """The smallest ``field`` (e.g. ``smem_per_block``) of any described device: what a check with
    no arch at hand may assume."""
    return min(getattr(d, field) for d in devices())


def most(field: str, capability: str | None = None) -> int:
    """The largest ``field`` of any described device (that has ``capability``): the bound of a
    template-wide check with no arch at hand; per-arch checks use the arch's own."""
    return max(getattr(d, field) for d in devices() if capability is None or d.has(capability))


def warp_size() -> int:
    """The warp size every described device shares: the width mma.sync, shuffles and the templates'
    lane arithmetic are written for."""
    sizes = {d.warp_size for d in devices()}
    if len(sizes) != 1:
        raise FuselightError(f"{_path()}: the descriptions disagree on warp_size ({sorted(sizes)})")
    return sizes.pop()


def device_model(arch: str | None) -> DeviceModel | None:
    """The description of ``arch`` (``sm_90``), or None where there is none."""
    return _parse(arch) if arch and arch in _table() and not arch.startswith("_") else None


def require_device(arch: str) -> DeviceModel:
    """The description of ``arch``; FuselightError naming the described ones where there is none."""
    device = device_model(arch)
    if device is None:
        raise FuselightError(f"no device description for {arch!r} (described: {', '.join(described_archs())})")
    return device


def _path() -> Path:
    return config_dir() / "targets" / "devices.json"


def _table() -> dict:
    path = _path()
    return read_json_object(path, missing=f"device descriptions not found: {path}")


@functools.lru_cache(maxsize=None)
def _parse_cached(arch: str, path: Path, _mtime_ns: int) -> DeviceModel:
    entry = read_json_object(path, missing=f"device descriptions not found: {path}")[arch]
    try:
        caps = frozenset(str(c) for c in entry["capabilities"])
        unknown = sorted(caps - set(CAPABILITIES))
        if unknown:
            raise ValueError(f"unknown capabilities {unknown}")
        values = {f: int(entry[f]) for f in _INT_FIELDS}
        values.update({f: float(entry[f]) for f in _FLOAT_FIELDS})
        values.update({f: (float(entry[f]) if f in entry else None) for f in _OPTIONAL_FLOAT_FIELDS})
        if any(v <= 0 for v in values.values() if v is not None):
            raise ValueError("every number must be positive")
        return DeviceModel(arch=arch, name=str(entry["name"]), also=tuple(str(a) for a in entry.get("also", ())),
                           capabilities=caps, **values)
    except (KeyError, TypeError, ValueError) as err:
        raise FuselightError(f"{path}[{arch!r}]: a bad device description ({err})") from None


def _parse(arch: str) -> DeviceModel:
    path = _path()
    return _parse_cached(arch, path, path.stat().st_mtime_ns)


def results_folder(device_name: str) -> str:
    """The folder under ``bench/results/`` for results measured on ``device_name`` (a record's
    ``device``): the ``results_folder`` of the description with that name, else the name in lower
    case with every run of other characters as one '-'."""
    # A PTX build's records name the GPU it ran on, marked "(sm_80 PTX)" (library.device_label).
    device_name = re.sub(r" \(sm_\d+a? PTX\)$", "", device_name)
    for entry in _table().values():
        if isinstance(entry, dict) and entry.get("name") == device_name and entry.get("results_folder"):
            return str(entry["results_folder"])
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown-device"
