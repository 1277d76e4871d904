"""Compile the CUDA source of a built library ahead of time with nvcc.

TVM 0.26 stores a CUDA module's *source* in a built library and compiles it when the library is
loaded. Compiling it here instead (to a fatbin for one architecture) checks that the generated code
builds and lets a machine without a compiler load prebuilt code. A PTX build (``ptx=True``) puts
only the PTX of ``compute_XX`` in the fatbin: the driver compiles it for the GPU it is loaded on, so
one architecture's code paths also run on a newer GPU (``ptx_runs_on``). No TVM import at module
load: this also runs where only TVM's runtime is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import FuselightError
from .target import arch_number

# From sm_90 on, the arch-specific target ("sm_90a") unlocks instructions such as wgmma; code built
# for it runs on that architecture only, which is all an ahead-of-time build is for.
FIRST_ARCH_SPECIFIC = 90
# The flags TVM's own CUDA compile callback passes (nvrtc or nvcc), so the code behaves the same.
TVM_FLAGS = (
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__",
    "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
)
FAST_MATH_FLAG = "--use_fast_math"
JOBS_ENV = "FUSELIGHT_COMPILE_JOBS"


def compile_jobs() -> int:
    """Processes a build may run at once (TIR lowering, nvcc): ``$FUSELIGHT_COMPILE_JOBS``, else the
    cores this process may run on."""
    env = os.environ.get(JOBS_ENV)
    if env:
        if not env.isdigit() or int(env) < 1:
            raise FuselightError(f"{JOBS_ENV} must be a positive integer, not {env!r}")
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def nvcc_path() -> str | None:
    """nvcc on PATH, else under ``$CUDA_HOME``; None if neither has it."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = Path(home, "bin", "nvcc") if home else None
    return str(candidate) if candidate and candidate.is_file() else None


def gencode(arch: str, *, ptx: bool = False) -> str:
    """nvcc's ``-gencode`` value for ``arch``: machine code (``sm_90`` -> ``arch=compute_90a,code=sm_90a``)
    or, with ``ptx``, the virtual architecture's PTX alone (``sm_80`` -> ``arch=compute_80,code=compute_80``)."""
    version = arch_number(arch)
    suffix = "a" if version >= FIRST_ARCH_SPECIFIC else ""
    code = f"compute_{version}{suffix}" if ptx else f"sm_{version}{suffix}"
    return f"arch=compute_{version}{suffix},code={code}"


def ptx_runs_on(ptx_arch: str, device_arch: str) -> bool:
    """Whether the driver can compile PTX built for ``ptx_arch`` for a ``device_arch`` GPU: PTX of
    ``compute_XX`` runs on XX and newer, but the arch-specific PTX (``compute_90a``, see
    ``FIRST_ARCH_SPECIFIC``) on its own architecture only."""
    built, device = arch_number(ptx_arch), arch_number(device_arch)
    return built == device or (built < FIRST_ARCH_SPECIFIC and built <= device)


def compile_cuda(source: str, arch: str = "sm_90", *, fast_math: bool = True, ptx: bool = False) -> bytes:
    """Compile CUDA C ``source`` to a fatbin for ``arch`` (with ``ptx``: holding its PTX only).

    ``fast_math`` matches TVM's own compile (it passes ``--use_fast_math``): leave it on for code that
    must behave as it would when TVM compiles it at load time.
    """
    nvcc = nvcc_path()
    if nvcc is None:
        raise FuselightError("nvcc not found: install the CUDA toolkit or put nvcc on PATH")
    flags = ["-O3", "--fatbin", f"-gencode={gencode(arch, ptx=ptx)}", *TVM_FLAGS]
    if fast_math:
        flags.append(FAST_MATH_FLAG)
    with tempfile.TemporaryDirectory(prefix="fuselight-nvcc-") as tmp:
        src, fatbin = Path(tmp, "kernels.cu"), Path(tmp, "kernels.fatbin")
        src.write_text(source)
        proc = subprocess.run([nvcc, *flags, "-o", str(fatbin), str(src)], capture_output=True, text=True)
        if proc.returncode != 0:
            first_error = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:500])
            raise FuselightError(f"nvcc failed for {arch}{' PTX' if ptx else ''}: {first_error}")
        return fatbin.read_bytes()

