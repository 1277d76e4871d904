"""Build targets: ``cuda`` (with an sm_XX arch) and ``llvm`` (the host CPU), from ``configs/targets``.

A cuda arch with a device description (``fuselight.device``) takes its TVM options from it; one
without (sm_75, sm_100, ...) builds with the limits every CUDA GPU shares, and fuselight's rules
leave all its kernels to DLight (``TargetSpec.described``).

``resolve`` validates and returns a plain description; ``to_tvm`` makes the TVM Target (compiler
side, imported lazily so this module also loads where only the TVM runtime is installed).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from .device import device_model
from .errors import FuselightError
from .paths import config_dir

SUPPORTED_KINDS = ("cuda", "llvm")
_ARCH = re.compile(r"^sm_(\d{2,3})a?$")


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    kind: str
    arch: str | None
    options: dict[str, Any]
    # CUDA carried as PTX for ``arch`` (compiled by the driver at load), not machine code.
    ptx: bool = False

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def described(self) -> bool:
        """Whether fuselight has a device description of this target (else DLight schedules everything)."""
        return self.kind == "llvm" or device_model(f"sm_{arch_number(self.arch)}") is not None

    @property
    def name(self) -> str:
        name = f"{self.kind}-{self.arch}" if self.arch else self.kind
        return f"{name}-ptx" if self.ptx else name


def arch_number(arch: str) -> int:
    """``sm_90`` / ``sm_90a`` -> 90; FuselightError for anything not of the form sm_XX."""
    m = _ARCH.match(arch or "")
    if not m:
        raise FuselightError(f"unsupported arch {arch!r}: expected sm_XX such as sm_90")
    return int(m.group(1))


def arch_of(tvm_target) -> str:
    """The ``sm_XX`` a CUDA ``tvm.target.Target`` builds for (``sm_90a`` -> ``sm_90``): the key of per-arch configs."""
    arch = tvm_target.attrs.get("arch")
    if arch is None:
        raise FuselightError(f"target {tvm_target} names no arch: give one such as sm_90")
    return f"sm_{arch_number(str(arch))}"


def resolve(kind: str, arch: str | None = None, *, ptx: bool = False) -> TargetSpec:
    """Validate ``kind``/``arch``; options come from ``configs/targets``. ``ptx``: carry the CUDA as
    PTX for ``arch`` (``fuselight.cuda_compile``), so a newer GPU runs this arch's code."""
    if kind not in SUPPORTED_KINDS:
        raise FuselightError(f"unsupported target {kind!r}: expected one of {', '.join(SUPPORTED_KINDS)}")
    if kind == "llvm":
        if arch:
            raise FuselightError(f"--arch {arch!r} applies to cuda targets only")
        if ptx:
            raise FuselightError("--ptx applies to cuda targets only")
        return TargetSpec("llvm", None, json.loads((config_dir() / "targets" / "llvm.json").read_text()))
    arch = arch or "sm_90"
    arch_number(arch)
    options = {k: v for k, v in json.loads((config_dir() / "targets" / "cuda.json").read_text()).items()
               if not k.startswith("_")}
    device = device_model(f"sm_{arch_number(arch)}")
    if device is not None:
        # TVM's limit is the static one: DLight declares its shared memory statically; our templates
        # that need more opt in to dynamic shared memory up to the device's smem_per_block_optin.
        options.update(max_threads_per_block=device.max_threads_per_block,
                       max_shared_memory_per_block=device.smem_per_block, thread_warp_size=device.warp_size)
    options["arch"] = arch
    return TargetSpec("cuda", arch, options, ptx=ptx)


def to_tvm(spec: TargetSpec):  # -> tvm.target.Target
    import tvm

    if spec.kind == "llvm":
        return tvm.target.Target({"kind": "llvm", "host": {"kind": "llvm"}})
    return tvm.target.Target(dict(spec.options, host={"kind": "llvm"}))
