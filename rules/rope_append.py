"""RopeAppend: the fused RoPE + KV-append kernel (``passes.fuse_rope_append``) in small blocks.

``analyze`` recognises the function the pass builds (its attribute, one block over tokens x heads x
dim) and returns the block; ``schedule`` binds one thread an element, ``threads`` (the arch's entry
of ``configs/elementwise/rope_append.json``) a block. Why not DLight's Fallback, which takes it
otherwise: it puts 1024 elements in a block, so a decode token's 6144 run on 6 SMs, each issuing the
sin, cos and power of 32 warps in turn, where the kernel's time is latency (one token).
"""

from __future__ import annotations

import dataclasses

import tvm
from fuselight.errors import FuselightError
from tvm import tirx

from ..contracts import FUSED_ROPE_APPEND_ATTR as FUSED_ATTR
from ..target import arch_of
from . import arch_config
from .arch_config import load_arch_config
from .base import AnalyzeScheduleRule


@dataclasses.dataclass(frozen=True)
class RopeAppendConfig:
    threads: int  # elements (threads) of a block


@dataclasses.dataclass(frozen=True)
class RopeAppendDesc:
    block: str  # the one block's name


def load_rope_append_config(arch: str) -> RopeAppendConfig:
    return load_arch_config("elementwise", "rope_append", arch, RopeAppendConfig, analytic=arch_config.rope_append)


def analyze(func: tirx.PrimFunc) -> RopeAppendDesc | None:
    """The fused kernel's block, or None for any other function."""
    if func.attrs is None or FUSED_ATTR not in func.attrs or "tirx.is_scheduled" in func.attrs:
        return None
    blocks: list[str] = []

    def visit(node: object) -> None:
        if isinstance(node, tirx.SBlock) and node.name_hint != "root":
            blocks.append(node.name_hint)

    tirx.stmt_functor.post_order_visit(func.body, visit)
    return RopeAppendDesc(blocks[0]) if len(blocks) == 1 else None


def schedule(func: tirx.PrimFunc, desc: RopeAppendDesc, cfg: RopeAppendConfig) -> tirx.PrimFunc:
    """``func`` with its one block a thread an element, ``cfg.threads`` a block."""
    sch = tvm.s_tir.Schedule(func)
    block = sch.get_sblock(desc.block)
    bx, tx = sch.split(sch.fuse(*sch.get_loops(block)), [None, cfg.threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return sch.mod["main"]


class RopeAppend(AnalyzeScheduleRule):
    """The fused RoPE + append kernel, a thread an element (see the module docstring)."""

    family = "rope_append"

    @staticmethod
    def analyze(func: tirx.PrimFunc) -> RopeAppendDesc | None:
        return analyze(func)

    def schedule(self, func: tirx.PrimFunc, desc: RopeAppendDesc, target: tvm.target.Target) -> tirx.PrimFunc | None:
        try:
            cfg = load_rope_append_config(arch_of(target))
        except FuselightError:
            return None  # no entry for this arch: DLight's Fallback takes it
        return schedule(func, desc, cfg)
