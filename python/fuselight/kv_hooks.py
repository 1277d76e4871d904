"""Run-time half of ``fuselight.passes.fuse_rope_append``: the KV cache's kernels, wrapped.

A library built with that pass creates its paged KV cache with the wrappers this module's global
function ``fuselight.kv_cache.fuse_rope_append`` (or, with a fused decode kernel,
``fuselight.kv_cache.fuse_rope_append_decode``) returns for its kernels (the pass's docstring says
why). For each cache it keeps one pending split-rotary call, and with the fused decode kernel one
pending append:
- the split-rotary wrapper records its arguments (no launch);
- the append wrapper, with a split pending, launches the fused kernel on the recorded arguments and
  the append's (one launch where there were two) or, with the fused decode kernel, records its own;
  with none pending, it appends as TVM's kernel does;
- the decode wrapper, with both pending for its q and pages, launches the fused decode kernel (no
  launch for RoPE and the append at all), with the counters it owns as the kernel's last argument
  (int32, zero between calls, one a sequence x KV head at least: the kernel's last split block of
  each merges, ``rules/flash/decode.py``); they are allocated when the append is recorded, where no
  CUDA graph is being captured (a prefill appends before any decode), for every page x KV head of the
  cache (a decode batch has a page per sequence), and kept as long as the hooks (a captured graph may
  replay their address);
- every other kernel's wrapper (and the decode wrapper otherwise) first launches what is pending
  (the fused RoPE + append, or TVM's split-rotary), then itself.
So every kernel sees the q, k and v it would see without the pass, whatever the order of the calls.

The same wrappers in C++ (``kv_hooks.cc``) are linked into every library built with the pass
(``native_object``, ``fuselight.library.write_library``): loading the library registers them under
the same names, replacing these, so a decode layer's three cache calls cost no trip into Python
(about 90 a SmolLM2-135M step; docs/experiments/decode-form.md). These Python ones serve libraries
built before that and modules run in-process without export (the CPU tests); ``load_native`` loads
the C++ ones in-process. Registered by ``register()``, which the fuselight runtime
(``runtime.init_tvm``) and ``Engine`` call. Runtime-only TVM suffices.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .contracts import ATTENTION_FORWARD_FUNC
from .contracts import HOOKS_DECODE_FUNC as DECODE_GLOBAL_NAME
from .contracts import HOOKS_FUNC as GLOBAL_NAME
from .errors import FuselightError

NATIVE_SOURCE = Path(__file__).with_name("kv_hooks.cc")
# The VM's instruction text names the factory a library's KV cache is created with.
_FACTORIES = (GLOBAL_NAME, DECODE_GLOBAL_NAME, ATTENTION_FORWARD_FUNC)


class RopeAppendHooks:
    """One KV cache's wrappers around its kernels (see the module docstring)."""

    def __init__(
        self,
        fused: Callable[..., Any],
        split_rotary: Callable[..., Any],
        append: Callable[..., Any],
        fused_decode: Callable[..., Any] | None = None,
        decode: Callable[..., Any] | None = None,
    ) -> None:
        self.fused, self.split_rotary, self.append = fused, split_rotary, append
        self.fused_decode, self.decode = fused_decode, decode
        self.pending: tuple | None = None  # split-rotary's arguments
        self.pending_append: tuple | None = None  # (pages, append positions), only with fused_decode
        self.counters: list[Any] = []  # the fused decode kernel's (see the module docstring), the newest last

    def record_split(self, *args: Any) -> None:
        self.flush()  # two splits in a row: the first still runs, in order
        self.pending = args

    def run_append(self, pages: Any, k: Any, v: Any, positions: Any) -> None:
        pending = self.pending
        if pending is not None and self.pending_append is None and _same_buffer(pending[3], k) and _same_buffer(pending[4], v):
            if self.fused_decode is not None:
                self.counters_for(pages.device, pages.shape[0] * pages.shape[2])
                self.pending_append = (pages, positions)  # the decode attention may take both
                return
            self.pending = None
            self.fused(*pending, pages, positions)  # qkv, positions, q, k, v, apply_rope, pages, append positions
            return
        self.flush()
        self.append(pages, k, v, positions)

    def run_decode(self, q: Any, pages: Any, *args: Any) -> Any:
        split, append = self.pending, self.pending_append
        if split is not None and append is not None and _same_buffer(split[2], q) and _same_buffer(append[0], pages):
            self.pending = self.pending_append = None
            return self.fused_decode(*split, *append, *args, self.counters_for(q.device, q.shape[0] * pages.shape[2]))
        self.flush()
        return self.decode(q, pages, *args)

    def flush(self) -> None:
        pending, append = self.pending, self.pending_append
        self.pending = self.pending_append = None
        if pending is None:
            return
        if append is not None:
            self.fused(*pending, *append)
        else:
            self.split_rotary(*pending)

    def counters_for(self, device: Any, count: int) -> Any:
        """At least ``count`` zeroed int32 counters on ``device``; new ones only where the newest are
        fewer or elsewhere (the old stay allocated)."""
        import tvm  # on first use, as fuselight.runtime imports it (the GPU host's runtime-only TVM)

        newest = self.counters[-1] if self.counters else None
        if newest is None or newest.device != device or newest.shape[0] < count:
            newest = tvm.runtime.tensor(np.zeros(max(count, 1), "int32"), device)
            self.counters.append(newest)
        return newest

    def wrap(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.flush()
            return kernel(*args)

        return call


def _same_buffer(a: Any, b: Any) -> bool:
    """Whether two tensors view the same memory with the same shape (the cache passes new views)."""
    return a.data_ptr() == b.data_ptr() and tuple(a.shape) == tuple(b.shape)


def make_wrappers(fused: Any, split_rotary: Any, append: Any, *kernels: Any) -> list[Callable[..., Any]]:
    """``[split-rotary wrapper, append wrapper, then one wrapper per kernel of kernels]`` for one cache."""
    hooks = RopeAppendHooks(fused, split_rotary, append)
    return [hooks.record_split, hooks.run_append, *(hooks.wrap(k) for k in kernels)]


def make_decode_wrappers(
    fused: Any, fused_decode: Any, split_rotary: Any, append: Any, decode: Any, *kernels: Any
) -> list[Callable[..., Any]]:
    """``[split-rotary wrapper, append wrapper, decode wrapper, then one per kernel of kernels]``."""
    hooks = RopeAppendHooks(fused, split_rotary, append, fused_decode, decode)
    return [hooks.record_split, hooks.run_append, hooks.run_decode, *(hooks.wrap(k) for k in kernels)]


def register() -> None:
    """Register ``GLOBAL_NAME`` and ``DECODE_GLOBAL_NAME`` (once; idempotent)."""
    import tvm_ffi

    for name, factory in ((GLOBAL_NAME, make_wrappers), (DECODE_GLOBAL_NAME, make_decode_wrappers)):
        if tvm_ffi.get_global_func(name, allow_missing=True) is None:
            tvm_ffi.register_global_func(name, factory)


def uses_hooks(executable: Any) -> bool:
    """Whether a ``tvm.relax.VMExecutable`` creates its KV cache through these wrappers or calls the
    attention forwarder of ``kv_hooks.cc``, which only the C++ build provides (a library of PrimFuncs
    alone, such as the kernel suites', has no VM and does neither)."""
    as_text = getattr(executable, "as_text", None)
    return as_text is not None and any(name in as_text() for name in _FACTORIES)


def _compile(out: Path, *flags: str) -> Path:
    """``NATIVE_SOURCE`` compiled with the C++ compiler (``$CXX``, else g++) against TVM-FFI's headers."""
    import tvm_ffi.libinfo

    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None:
        raise FuselightError("no C++ compiler (g++ or $CXX) to build the KV cache's wrappers (fuselight/kv_hooks.cc)")
    cmd = [cxx, "-std=c++17", "-O2", "-fPIC", f"-I{tvm_ffi.libinfo.find_include_path()}", *flags,
           str(NATIVE_SOURCE), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise FuselightError(f"compiling {NATIVE_SOURCE.name} failed:\n{done.stderr[-2000:]}")
    return out


def _built(cache_dir: Path, suffix: str, *flags: str) -> Path:
    """``NATIVE_SOURCE`` compiled with ``flags`` under ``cache_dir``, once per source (the file's name
    carries the source's hash; not the compiler's version: clear the cache after changing it)."""
    digest = hashlib.sha256(NATIVE_SOURCE.read_bytes()).hexdigest()[:16]
    out = Path(cache_dir) / f"fuselight_kv_hooks-{digest}{suffix}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        # Written then renamed, so a concurrent build never reads half a file.
        _compile(out.with_name(f"{out.name}.{os.getpid()}.tmp"), *flags).replace(out)
    return out


def native_object(cache_dir: Path) -> Path:
    """The C++ wrappers as an object file (built once per source under ``cache_dir``), to link into a
    library (``export_library``'s addons)."""
    return _built(cache_dir, ".o", "-c")


def load_native(cache_dir: Path) -> None:
    """Build (once per source, under ``cache_dir``) and load the C++ wrappers into this process: they
    replace the registered Python ones, as loading a library that carries them does."""
    lib = _built(cache_dir, ".so", "-shared")
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
