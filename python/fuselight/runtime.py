"""Load compiled libraries where only the TVM runtime is installed, and compile their CUDA ahead of time.

TVM 0.26 keeps CUDA *source* inside an exported library and compiles it when the library is loaded,
through the global function ``tvm_callback_cuda_compile``. TVM's own callback needs the compiler
library, so on a runtime-only host ``register_cuda_compiler`` installs ours. It answers each source,
found by the SHA-256 of its text, from (1) the cubins compiled at build time next to a library
(``fuselight.library.aot_compile_cuda`` writes them, ``load_library`` registers them), (2) the disk
cache of compiled sources (``fuselight.library.cached_fatbin``, the build host's too), (3) nvcc.

Nothing here imports TVM's compiler side (``import tvm.relax`` fails on such a host), and TVM itself
is imported on first use. The library's artefacts (sidecar, AOT cubins) are ``fuselight.library``'s.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from pathlib import Path
from typing import Any

from . import kv_hooks
from .cuda_compile import nvcc_path, ptx_runs_on
from .errors import FuselightError
from .jsonfile import read_json_object
from .library import aot_dir, cache_path, cached_fatbin, cuda_sources, default_cache_dir, metadata_path, source_hash
from .target import arch_number

CALLBACK_NAME = "tvm_callback_cuda_compile"
# "1": the benchmark commands and the GPU test tier accept a PTX library built for an older GPU
# (``load_module(accept_ptx=True)``): that architecture's code, compiled by the driver, run as its proxy.
ACCEPT_PTX_ENV = "FUSELIGHT_ACCEPT_PTX"
# CUDA modules only load when these runtime parts are loaded globally right after ``import tvm``.
_RUNTIME_ONLY_ENV = "TVM_USE_RUNTIME_LIB"
_EXTRA_RUNTIME_LIBS = ("libtvm_runtime_extra.so", "libtvm_runtime_cuda.so")
# Library target kind -> the device kind it runs on.
DEVICE_OF_TARGET = {"cuda": "cuda", "llvm": "cpu"}


@dataclasses.dataclass
class _CompilerState:
    """What the registered callback consults: set up by ``register_cuda_compiler``/``load_library``."""

    aot: dict[str, Path] = dataclasses.field(default_factory=dict)  # source sha256 -> cubin file
    arch: str | None = None  # arch to compile for when no cubin is found; None: the device's
    ptx: bool = False  # ... and as PTX for it (the library's sidecar says which)
    cache_dir: Path | None = None
    registered: bool = False
    error: str | None = None  # the last failure inside the callback, re-raised by load_library
    runtime_lib_error: str | None = None  # why a runtime part did not load (no CUDA driver, say)


_STATE = _CompilerState()


def init_tvm() -> Any:
    """Import TVM for running libraries: runtime parts loaded, our CUDA compile callback registered."""
    import tvm

    if os.environ.get(_RUNTIME_ONLY_ENV):
        lib_dir = Path(tvm.__file__).resolve().parent / "lib"
        for name in _EXTRA_RUNTIME_LIBS:
            if (lib_dir / name).is_file():
                try:
                    ctypes.CDLL(str(lib_dir / name), ctypes.RTLD_GLOBAL)
                except OSError as err:
                    # CPU-only hosts lack the CUDA driver; only loading a CUDA library needs it.
                    _STATE.runtime_lib_error = f"{name}: {err}"
    if not _STATE.registered:
        register_cuda_compiler()
    kv_hooks.register()  # libraries built with fuselight.passes.fuse_rope_append call it
    return tvm


def register_cuda_compiler(cache_dir: Path | None = None, arch: str | None = None) -> None:
    """Install ``tvm_callback_cuda_compile``: AOT cubin by hash, else disk cache, else nvcc.

    ``arch``: what nvcc compiles for (machine code) until a library says otherwise (None: the device's).
    """
    # The full TVM registers its own callback when imported, refusing one already there: import
    # it first, then override.
    import tvm  # noqa: F401
    import tvm_ffi

    _STATE.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if arch is not None:
        arch_number(arch)
        _STATE.arch, _STATE.ptx = arch, False

    # TVM calls it with the source as the first argument (later arguments, if any, are unused) and
    # loads whatever bytes come back with cuModuleLoadData, which takes cubin, fatbin and PTX alike.
    def callback(code: str, *_: Any) -> bytes:
        try:
            return cuda_binary(str(code))
        except Exception as err:
            _STATE.error = str(err)
            raise

    tvm_ffi.register_global_func(CALLBACK_NAME, callback, override=True)
    _STATE.registered = True


def cuda_binary(code: str) -> bytes:
    """The compiled form of one CUDA source, as the callback returns it."""
    sha = source_hash(code)
    aot = _STATE.aot.get(sha)
    if aot is not None and aot.is_file():
        return aot.read_bytes()
    arch = _STATE.arch or device_arch()
    cache_dir = _STATE.cache_dir or default_cache_dir()
    if cache_path(sha, arch, cache_dir, ptx=_STATE.ptx).is_file():
        return cached_fatbin(code, arch, cache_dir, ptx=_STATE.ptx)
    if nvcc_path() is None:
        raise FuselightError(
            f"no precompiled cubin for CUDA source {sha[:12]} and nvcc is not on PATH: "
            "build the library with ahead-of-time CUDA (the default) or install the CUDA toolkit"
        )
    form = f"{arch} PTX" if _STATE.ptx else arch
    print(f"compiling CUDA source {sha[:12]} with nvcc for {form} (no precompiled cubin)", flush=True)
    return cached_fatbin(code, arch, cache_dir, ptx=_STATE.ptx)


def device_arch(device: Any = None) -> str:
    """``sm_XX`` of a CUDA device (default ``cuda:0``) from its compute capability."""
    import tvm

    dev = device if device is not None else tvm.cuda(0)
    if not dev.exist:
        raise FuselightError("no CUDA device is visible")
    major, _, minor = str(dev.compute_version).partition(".")
    return f"sm_{major}{minor}"


def accept_ptx_from_env() -> bool:
    """Whether ``$FUSELIGHT_ACCEPT_PTX`` asks to accept PTX libraries of older GPUs (tests, benchmarks)."""
    return os.environ.get(ACCEPT_PTX_ENV) == "1"


def check_arch(
    library_arch: str, device_arch_: str, library: Path | str = "library", *, ptx: bool = False,
    accept_ptx: bool = False,
) -> None:
    """A cubin for sm_XX(a) runs on sm_XX only: refuse a library built for another GPU. With
    ``accept_ptx``, a PTX library (``ptx``) the driver can compile for this GPU is let through."""
    if arch_number(library_arch) == arch_number(device_arch_):
        return
    if ptx and accept_ptx and ptx_runs_on(library_arch, device_arch_):
        return
    built = f"{library_arch} PTX" if ptx else library_arch
    raise FuselightError(
        f"{library}: library built for {built}, this GPU is {device_arch_} (only a PTX build for an arch "
        f"<= {device_arch_}, fuselight compile --ptx, runs here, and only when asked: accept_ptx=True / "
        f"--accept-ptx / {ACCEPT_PTX_ENV}=1, for tests and benchmarks)"
    )


def read_metadata(library: Path) -> dict[str, Any]:
    """The sidecar ``LIB.json`` written next to a library at build time."""
    path = metadata_path(Path(library))
    meta = read_json_object(path, missing=f"{library}: metadata {path.name} not found (build it with fuselight)")
    target = meta.get("target")
    if target not in DEVICE_OF_TARGET:
        raise FuselightError(f"{path}: field 'target' {target!r} is not one of {', '.join(DEVICE_OF_TARGET)}")
    if target == "cuda":
        arch_number(str(meta.get("arch")))
        if not isinstance(meta.get("cuda_sources", {}), dict):
            raise FuselightError(f"{path}: field 'cuda_sources' must be an object")
        if not isinstance(meta.get("ptx", False), bool):
            raise FuselightError(f"{path}: field 'ptx' must be true or false")
    return meta


def register_aot(library: Path, meta: dict[str, Any]) -> None:
    """Make the callback find ``library``'s precompiled CUDA (``meta["cuda_sources"]``) by source hash."""
    folder = aot_dir(Path(library))
    for sha, name in meta.get("cuda_sources", {}).items():
        path = folder / name
        if not path.is_file():
            raise FuselightError(f"{library}: precompiled CUDA {name} missing from {folder}")
        _STATE.aot[sha] = path


def load_library(path: Path, device: str = "cuda", *, accept_ptx: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """Load a fuselight library on ``device`` ("cuda" or "cpu"): ``(VirtualMachine, Device, metadata)``.

    ``accept_ptx``: also run a PTX library built for an older GPU (``load_module``)."""
    lib, dev, meta = load_module(path, device, accept_ptx=accept_ptx)
    from tvm.runtime.vm import (
        VirtualMachine,  # not imported by ``import tvm`` on a runtime-only host
    )

    return VirtualMachine(lib, dev), dev, meta


def load_module(path: Path, device: str = "cuda", *, accept_ptx: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """Load a fuselight library (a model, or bare kernels) on ``device``: ``(runtime Module, Device, metadata)``.

    A library built for another GPU is refused, unless ``accept_ptx`` and it is PTX the driver can
    compile for this one (``cuda_compile.ptx_runs_on``): for tests and benchmarks that run an older
    architecture's code here as its proxy (their results say so: ``library.device_label``)."""
    path = Path(path)
    if not path.is_file():
        raise FuselightError(f"library not found: {path}")
    meta = read_metadata(path)
    expected = DEVICE_OF_TARGET[meta["target"]]
    if device != expected:
        raise FuselightError(f"{path}: library built for target {meta['target']!r} cannot run on device {device!r}")
    tvm = init_tvm()
    dev = tvm.device(device, 0)
    if device == "cuda":
        if _STATE.runtime_lib_error:
            raise FuselightError(f"TVM's CUDA runtime did not load ({_STATE.runtime_lib_error})")
        here = device_arch(dev)
        check_arch(meta["arch"], here, path, ptx=meta.get("ptx", False), accept_ptx=accept_ptx)
        if arch_number(meta["arch"]) != arch_number(here):
            print(f"{path}: {meta['arch']} PTX on this {here} GPU, compiled by the driver (a proxy for {meta['arch']})",
                  flush=True)
        register_aot(path, meta)
        _STATE.arch, _STATE.ptx = meta["arch"], meta.get("ptx", False)
        if not meta.get("cuda_sources") and nvcc_path() is None:
            raise FuselightError(f"{path}: built without precompiled CUDA and nvcc is not on PATH")
    elif not dev.exist:
        raise FuselightError(f"no {device} device is visible")
    _STATE.error = None
    try:
        lib = tvm.runtime.load_module(str(path))
    except Exception as err:  # noqa: BLE001 - TVM's loader raises many kinds; all become one line
        if _STATE.error is not None:
            raise FuselightError(f"{path}: {_STATE.error}") from None
        raise FuselightError(f"{path}: cannot load library ({type(err).__name__}: {err})") from None
    return lib, dev, meta


def release_memory() -> None:
    """Free the VM's pooled device memory no live VM holds (TVM keeps freed buffers for reuse)."""
    import tvm

    clear = tvm.get_global_func("vm.builtin.memory_manager.clear", allow_missing=True)
    if clear is not None:
        clear()
