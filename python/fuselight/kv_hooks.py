"""Run-time half of ``fuselight.passes.fuse_rope_append``: the KV cache's kernels, wrapped.

A library built with that pass creates its paged KV cache with the wrappers this module's global
function ``fuselight.kv_cache.fuse_rope_append`` returns for its kernels (the pass's docstring says
why). For each cache it keeps one pending split-rotary call:
- the split-rotary wrapper records its arguments (no launch);
- the append wrapper, with a call pending, launches the fused kernel on the recorded arguments and
  the append's (one launch where there were two); with none pending, it appends as TVM's kernel does;
- every other kernel's wrapper first launches a pending split-rotary as TVM's kernel, then itself.
So every kernel sees the q, k and v it would see without the pass, whatever the order of the calls.

Registered by ``register()``, which the fuselight runtime (``runtime.init_tvm``) and ``Engine`` call:
a library built with the pass runs where fuselight is imported. Runtime-only TVM suffices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GLOBAL_NAME = "fuselight.kv_cache.fuse_rope_append"


class RopeAppendHooks:
    """One KV cache's wrappers around its kernels (see the module docstring)."""

    def __init__(self, fused: Callable[..., Any], split_rotary: Callable[..., Any], append: Callable[..., Any]) -> None:
        self.fused, self.split_rotary, self.append = fused, split_rotary, append
        self.pending: tuple | None = None

    def record_split(self, *args: Any) -> None:
        self.flush()  # two splits in a row: the first still runs, in order
        self.pending = args

    def run_append(self, pages: Any, k: Any, v: Any, positions: Any) -> None:
        pending = self.pending
        if pending is not None and _same_buffer(pending[3], k) and _same_buffer(pending[4], v):
            self.pending = None
            self.fused(*pending, pages, positions)  # qkv, positions, q, k, v, apply_rope, pages, append positions
            return
        self.flush()
        self.append(pages, k, v, positions)

    def flush(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            self.split_rotary(*pending)

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


def register() -> None:
    """Register ``GLOBAL_NAME`` (once; idempotent)."""
    import tvm_ffi

    if tvm_ffi.get_global_func(GLOBAL_NAME, allow_missing=True) is None:
        tvm_ffi.register_global_func(GLOBAL_NAME, make_wrappers)
