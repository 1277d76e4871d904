"""Paged-KV-cache attention: TVM's built-in kernels recognised by interface, replaced by fuselight's.

``tvm.relax.frontend.nn.llm``'s KV cache takes its attention kernels as already-scheduled PrimFuncs
and calls them from its runtime with a fixed argument list, so DLight never sees them. ``analyze``
recognises such a kernel by that interface (parameter kinds, buffer ranks and dtypes, static head
layout); ``PagedAttention.supports`` says whether fuselight has a kernel with the same interface
for it (unsupported: other dtypes or head dims, sliding-window variants, kernels it does not know).
The pass ``fuselight.passes.paged_attention`` tags the cache's kernels the rule supports
(``PAGED_ATTENTION_ATTR``, their kind), names them by fuselight's symbols and takes away their
"scheduled" mark; in phase 4 the ``PagedAttention`` rule (in ``fuselight.rules.RULES``) replaces
each tagged function by fuselight's kernel (``paged_attention_kernel``). Likewise the decode kernel
that also does the KV cache's RoPE and append (``passes.fuse_rope_append``): that pass hands over
TVM's split-rotary function, tagged ``FUSED_ROPE_APPEND_DECODE_ATTR`` (the page size), and the rule
builds ``flash_decode_paged_rotary`` from the rotary's expressions (``flash.rotary``). Untagged
functions are never its.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import tvm
from fuselight.contracts import DECODE_BY_POSITION_ATTR, FUSED_ROPE_APPEND_DECODE_ATTR, PAGED_ATTENTION_ATTR
from fuselight.errors import FuselightError
from fuselight.target import arch_of
from tvm import tirx

from .base import AnalyzeScheduleRule, gpu_target

from .flash.decode import by_position_workspace, flash_decode_paged, flash_decode_paged_rotary, load_decode_config
from .flash.paging import static_dim
from .flash.prefill import (
    HEAD_DIMS,
    flash_prefill_paged,
    flash_prefill_ragged,
    load_prefill_config,
)
from .flash.rotary import SplitRotary
from .flash.rotary import analyze as analyze_split_rotary

Kind = Literal["decode", "prefill_ragged", "prefill_paged"]
_HALF = ("float16", "bfloat16")
# TVM's batch_decode_paged_kv: Q, pages, page_table_indptr, page_table_values, length_info,
# k_rope_pos_offset, q_rope_position, output, lse, then rotary_mode, rope_scale, rope_theta, sm_scale.
_DECODE_RANKS = (3, 5, 1, 1, 1, 1, 1, 3, 2)
_DECODE_SCALARS = ("int32", "float32", "float32", "float32")
# TVM's batch_prefill_ragged_kv: q, q_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset,
# output, lse, then causal, rotary_mode, rope_scale, rope_theta, sm_scale.
_RAGGED_RANKS = (3, 1, 3, 3, 1, 1, 1, 3, 2)
_RAGGED_SCALARS = ("int32", "int32", "float32", "float32", "float32")
# TVM's batch_prefill_paged_kv: q, q_indptr, pages, page_indptr, page_values, length_info,
# k_rope_pos_offset, q_rope_position, output, lse, then the ragged kernel's scalars. length_info is
# [batch] (last page lengths); the sliding-window variant's [3, batch] has another rank.
_PAGED_PREFILL_RANKS = (3, 1, 5, 1, 1, 1, 1, 1, 3, 2)


@dataclasses.dataclass(frozen=True)
class PagedAttentionDesc:
    kind: Kind
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # 0 where the kernel reads no pages
    dtype: str


@dataclasses.dataclass(frozen=True)
class RotaryDecodeDesc:
    """The decode kernel that also does RoPE and the append: TVM's split-rotary read as values, and
    the cache's page size."""

    rotary: SplitRotary
    page_size: int
    by_position: bool = False  # lengths and the append slot from the q positions (DECODE_BY_POSITION_ATTR)


def _interface(func: tirx.PrimFunc) -> tuple[list, list[str]] | None:
    """(buffers, scalar dtypes) if every buffer parameter precedes every scalar one."""
    params = list(func.params)
    buffers = [p for p in params if isinstance(p.ty, tirx.BufferType)]
    scalars = [str(p.ty) for p in params[len(buffers):]]
    if any(isinstance(p.ty, tirx.BufferType) for p in params[len(buffers):]):
        return None
    return buffers, scalars


def analyze(func: tirx.PrimFunc) -> PagedAttentionDesc | None:
    """The kind and head layout of a TVM paged-KV attention kernel fuselight has a kernel for, or None."""
    found = _interface(func)
    if found is None:
        return None
    buffers, scalars = found
    ranks = tuple(len(b.shape) for b in buffers)
    if ranks == _DECODE_RANKS and tuple(scalars) == _DECODE_SCALARS:
        return _analyze_decode(buffers)
    if ranks == _RAGGED_RANKS and tuple(scalars) == _RAGGED_SCALARS:
        return _analyze_ragged(buffers)
    if ranks == _PAGED_PREFILL_RANKS and tuple(scalars) == _RAGGED_SCALARS:
        return _analyze_paged_prefill(buffers)
    return None


def _analyze_paged(kind: Kind, q, pages, output, lse, index_buffers: list) -> PagedAttentionDesc | None:
    """q/output [n, h_qo, d], pages [max_pages, 2, h_kv, page_size, d], int32 indices, float32 lse."""
    if any(str(b.dtype) != "int32" for b in index_buffers) or str(lse.dtype) != "float32":
        return None
    dtype = str(q.dtype)
    h_qo, d = static_dim(q.shape[1]), static_dim(q.shape[2])
    two, h_kv, page, d_kv = (static_dim(x) for x in pages.shape[1:])
    if str(pages.dtype) != dtype or str(output.dtype) != dtype or two != 2 or None in (h_qo, d, h_kv, page) or d_kv != d:
        return None
    if h_qo % h_kv:
        return None
    return PagedAttentionDesc(kind, h_qo, h_kv, d, page, dtype)


def _analyze_decode(buffers: list) -> PagedAttentionDesc | None:
    q, pages, *index_buffers, output, lse = buffers
    return _analyze_paged("decode", q, pages, output, lse, index_buffers)


def _analyze_paged_prefill(buffers: list) -> PagedAttentionDesc | None:
    q, q_indptr, pages, *index_buffers, output, lse = buffers
    return _analyze_paged("prefill_paged", q, pages, output, lse, [q_indptr, *index_buffers])


def _analyze_ragged(buffers: list) -> PagedAttentionDesc | None:
    q, q_indptr, k, v, kv_indptr, q_pos, k_offset, output, lse = buffers
    if any(str(b.dtype) != "int32" for b in (q_indptr, kv_indptr, q_pos, k_offset)) or str(lse.dtype) != "float32":
        return None
    dtype = str(q.dtype)
    h_qo, d = static_dim(q.shape[1]), static_dim(q.shape[2])
    h_kv, d_k, h_v, d_v = static_dim(k.shape[1]), static_dim(k.shape[2]), static_dim(v.shape[1]), static_dim(v.shape[2])
    if any(str(b.dtype) != dtype for b in (k, v, output)) or None in (h_qo, d, h_kv) or (d_k, h_v, d_v) != (d, h_kv, d):
        return None
    if h_qo % h_kv:
        return None
    return PagedAttentionDesc("prefill_ragged", h_qo, h_kv, d, 0, dtype)


def supported(desc: PagedAttentionDesc) -> bool:
    """Where fuselight's kernel serves: half-precision caches with head dims 64 and 128."""
    return desc.dtype in _HALF and desc.head_dim in HEAD_DIMS


def paged_attention_kernel(desc: PagedAttentionDesc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """fuselight's kernel (same interface as TVM's, named by its ``contracts`` symbol) for ``desc`` on
    ``target``, or None where the rule does not support it."""
    if not PagedAttention.supports(desc, target):
        return None
    arch = arch_of(target)
    if desc.kind == "decode":
        config = load_decode_config(arch)
        return flash_decode_paged(desc.num_kv_heads, desc.num_qo_heads, desc.head_dim, desc.dtype, desc.page_size, config)
    config = load_prefill_config(arch, desc.head_dim)
    if desc.kind == "prefill_paged":
        return flash_prefill_paged(
            desc.num_kv_heads, desc.num_qo_heads, desc.head_dim, desc.dtype, desc.page_size, config
        )
    return flash_prefill_ragged(desc.num_kv_heads, desc.num_qo_heads, desc.head_dim, desc.dtype, config)


def kernel_for(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """fuselight's kernel for TVM's KV-cache kernel ``func`` (tagged or not) on ``target``, or None:
    what the pass and the rule together make of it (benchmarks, tests)."""
    desc = analyze(func)
    return None if desc is None else paged_attention_kernel(desc, target)


class PagedAttention(AnalyzeScheduleRule):
    """The KV cache's kernels the pass tagged: TVM's paged-KV decode kernel -> split-KV decode
    (rules/flash/decode.py); its ragged and paged prefill kernels -> tensor-core flash prefill
    (rules/flash/prefill.py)."""

    family = "paged_attention"

    @staticmethod
    def analyze(func: tirx.PrimFunc) -> PagedAttentionDesc | RotaryDecodeDesc | None:
        """The tagged kernel's description (its interface agreeing with the tag), else None."""
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
            return None
        if FUSED_ROPE_APPEND_DECODE_ATTR in func.attrs:
            rotary = analyze_split_rotary(func)
            by_position = bool(func.attrs.get(DECODE_BY_POSITION_ATTR, False))
            return None if rotary is None else RotaryDecodeDesc(rotary, int(func.attrs[FUSED_ROPE_APPEND_DECODE_ATTR]), by_position)
        if PAGED_ATTENTION_ATTR not in func.attrs:
            return None
        desc = analyze(func)
        return desc if desc is not None and desc.kind == str(func.attrs[PAGED_ATTENTION_ATTR]) else None

    @classmethod
    def supports(cls, desc: PagedAttentionDesc | RotaryDecodeDesc, target: tvm.target.Target) -> bool:
        """Whether fuselight has a kernel for ``desc`` on ``target``: CUDA, half precision, head dims
        64 and 128, tile configs for the arch."""
        rotary = isinstance(desc, RotaryDecodeDesc)
        if target.kind.name != "cuda" or not gpu_target(target) or not (rotary or supported(desc)):
            return False
        try:
            arch = arch_of(target)
            load_decode_config(arch) if rotary or desc.kind == "decode" else load_prefill_config(arch, desc.head_dim)
        except FuselightError:
            return False
        return True

    @staticmethod
    def by_position_workspace(desc: RotaryDecodeDesc, target: tvm.target.Target, batch: int) -> list[tuple[tuple[int, ...], str]]:
        """Shapes and dtypes of the buffers the by-position decode kernel takes last (its split
        partials) for ``batch`` sequences: its caller allocates them."""
        return by_position_workspace(desc.rotary, load_decode_config(arch_of(target)), batch)

    def schedule(self, func: tirx.PrimFunc, desc: PagedAttentionDesc | RotaryDecodeDesc,
                 target: tvm.target.Target) -> tirx.PrimFunc | None:
        """fuselight's kernel for ``desc``, under ``func``'s symbol (the pass named it)."""
        if isinstance(desc, RotaryDecodeDesc):
            if not self.supports(desc, target):
                return None
            config = load_decode_config(arch_of(target))
            kernel = flash_decode_paged_rotary(desc.rotary, desc.page_size, config, desc.by_position)
            kernel = kernel.with_attr(FUSED_ROPE_APPEND_DECODE_ATTR, True)
        else:
            kernel = paged_attention_kernel(desc, target)
        if kernel is None:
            return None
        symbol = func.attrs.get("global_symbol")
        return kernel.without_attr("global_symbol") if symbol is None else kernel.with_attr("global_symbol", symbol)
