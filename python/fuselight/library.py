"""A built library's artefacts beside it, what the build host writes and the GPU host reads.

``LIB.so`` (TVM's export), ``LIB.so.json`` (``metadata_path``: the sidecar, with ``cuda_sources``
mapping each CUDA source's SHA-256 to its cubin, and for CUDA ``arch`` and ``ptx``: whether the
cubins hold that arch's PTX, for the driver to compile at load, rather than machine code) and ``LIB.so.cuda/`` (``aot_dir``: the cubins nvcc
compiled ahead of time, ``aot_compile_cuda``). ``fuselight.compile`` (and ``fuselight mlc compile``,
the tuning builds) write them with ``write_library``; ``fuselight.runtime`` reads them. Both hosts
keep what nvcc compiled in one disk cache by source hash and arch (``cached_fatbin``), so a source
built before (a rebuild whose kernels did not change) skips nvcc. Nothing here imports TVM's
compiler side: the runtime-only GPU host imports this module too.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import kv_hooks
from .cuda_compile import compile_cuda, compile_jobs
from .errors import FuselightError
from .target import TargetSpec, arch_number

FATBIN_SUFFIX = ".fatbin"
# The disk cache of compiled CUDA sources (default ``~/.cache/fuselight/cuda``).
CACHE_ENV = "FUSELIGHT_CACHE_DIR"
# The commit recorded with a library or a measurement (else ``git rev-parse``).
COMMIT_ENV = "FUSELIGHT_GIT_COMMIT"


def metadata_path(library: Path) -> Path:
    return Path(str(library) + ".json")


def aot_dir(library: Path) -> Path:
    return Path(str(library) + ".cuda")


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "fuselight" / "cuda"


def cache_path(sha: str, arch: str, cache_dir: Path | None = None, *, ptx: bool = False) -> Path:
    """Where the disk cache (``cache_dir``, default ``default_cache_dir()``) keeps the fatbin of the
    CUDA source with hash ``sha`` for ``arch`` (its PTX alone with ``ptx``)."""
    form = f"{arch}-ptx" if ptx else arch
    return (cache_dir or default_cache_dir()) / f"{sha}-{form}{FATBIN_SUFFIX}"


def cached_fatbin(code: str, arch: str, cache_dir: Path | None = None, *, ptx: bool = False) -> bytes:
    """nvcc's fatbin of CUDA ``code`` for ``arch`` (``compile_cuda``'s flags; ``ptx``: its PTX alone),
    from the disk cache (``cache_path``) where it was compiled before, else compiled and cached. The
    key is the source's hash and the arch, not nvcc's version: clear the cache after changing the
    toolkit."""
    cache = cache_path(source_hash(code), arch, cache_dir, ptx=ptx)
    if cache.is_file():
        return cache.read_bytes()
    binary = compile_cuda(code, arch=arch, ptx=ptx)
    cache.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent run never reads half a file.
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    tmp.write_bytes(binary)
    tmp.replace(cache)
    return binary


def source_hash(code: str) -> str:
    """The key a CUDA source is found by: SHA-256 of its UTF-8 text."""
    return hashlib.sha256(code.encode("utf-8")).hexdigest()


def git_commit() -> str:
    """The commit being measured: ``$FUSELIGHT_GIT_COMMIT``, else ``git rev-parse``, else "unknown"."""
    env = os.environ.get(COMMIT_ENV)
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def cuda_sources(lib_module: Any) -> list[str]:
    """Every CUDA source in a built module (a VM executable or a runtime module), imports included."""
    from tvm.runtime.executable import Executable

    root = lib_module.mod if isinstance(lib_module, Executable) else lib_module
    found: list[str] = []
    stack = [root]
    while stack:
        mod = stack.pop()
        if mod.kind == "cuda":
            # "cuda" gives the source; "cu" returns an empty string in TVM 0.26.
            found.append(mod.inspect_source("cuda"))
        stack.extend(mod.imports)
    return found


def aot_compile_cuda(sources: list[str], out_dir: Path, arch: str, *, ptx: bool = False) -> dict[str, str]:
    """Compile the CUDA ``sources`` of a library (``cuda_sources``) with nvcc (``cached_fatbin``) into
    ``out_dir/<sha>.fatbin`` (with ``ptx``: fatbins of ``arch``'s PTX alone).

    Build-host side. Returns ``{sha256 of source: file name}`` for the library's metadata.
    """
    arch_number(arch)
    sources = [s for s in sources if s]
    if not sources:
        raise FuselightError("the built module holds no CUDA source (was it built for a cuda target?)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    unique = {source_hash(code): code for code in sources}

    def compile_one(sha: str) -> tuple[str, str]:
        name = sha + FATBIN_SUFFIX
        (out_dir / name).write_bytes(cached_fatbin(unique[sha], arch, ptx=ptx))
        return sha, name

    # One nvcc process per source (a build's compilation units, ``fuselight.compile_units``), at once.
    with ThreadPoolExecutor(max_workers=max(1, min(compile_jobs(), len(unique)))) as pool:
        return dict(pool.map(compile_one, unique))


def write_library(
    executable: Any, path: Path, meta: dict[str, Any], target: TargetSpec, *, aot_cuda: bool = True
) -> Path:
    """Write ``executable`` to ``path``, ``meta`` to ``path.json`` and, for a GPU target with
    ``aot_cuda``, its cubins to ``path.cuda/`` (``meta["cuda_sources"]``: CUDA source hash -> cubin;
    ``meta["ptx"]``: whether they are ``target.arch``'s PTX). A library whose KV cache takes
    ``fuselight.kv_hooks``' wrappers carries their C++ build (``meta["native_kv_hooks"]``; compiled once
    into the disk cache), so running it calls no Python a step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "cuda_sources": {}}
    sources = cuda_sources(executable) if target.is_gpu and aot_cuda else None
    if target.is_gpu:
        # Also without AOT cubins: the runtime then compiles the source at load, as PTX where this says so.
        meta["ptx"] = target.ptx
    with ThreadPoolExecutor(max_workers=1) as pool:
        # nvcc (a process of its own) runs while TVM exports the library.
        cubins = (pool.submit(aot_compile_cuda, sources, aot_dir(path), target.arch, ptx=target.ptx)
                  if sources is not None else None)
        addons = [str(kv_hooks.native_object(default_cache_dir()))] if kv_hooks.uses_hooks(executable) else []
        meta["native_kv_hooks"] = bool(addons)
        executable.export_library(str(path), addons=addons)
        if cubins is not None:
            meta["cuda_sources"] = cubins.result()
    metadata_path(path).write_text(json.dumps(meta, indent=1, default=str) + "\n")
    return path


def device_label(device: str, meta: dict[str, Any]) -> str:
    """What results call the device a library ran on: ``device``, marked where the library is PTX
    that the driver compiled for it (``NVIDIA H100 80GB HBM3 (sm_80 PTX)``: another architecture's
    code run here, a proxy for that GPU)."""
    return f"{device} ({meta.get('arch')} PTX)" if meta.get("ptx") else device
