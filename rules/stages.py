"""Analysis helpers the rules share: a PrimFunc read as its stages.

``stages`` splits a plain (unscheduled) function into the blocks under its root, each alone in a
perfect serial loop nest over its iter vars, with the one store it makes; the GEMM analysis
(``gemm.analysis``) and the row-reduction analysis (``reduce.analysis``) both start from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tvm import arith, tirx


def _is_const(expr: Any, value: int) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr.value) == value


def _equal(a: Any, b: Any) -> bool:
    return bool(arith.Analyzer().can_prove_equal(a, b))


@dataclasses.dataclass(frozen=True)
class Stage:
    block: tirx.SBlock
    extents: tuple[Any, ...]  # of the block's iter vars, in order
    store: tirx.BufferStore


def stages(func: tirx.PrimFunc) -> tuple[list[Stage], list[tirx.Buffer]] | None:
    """The root's child blocks, each required to sit alone in a perfect loop nest over its iter vars."""
    root = func.body
    if not isinstance(root, tirx.SBlockRealize):
        return None
    body = root.block.body
    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    found = []
    for stmt in stmts:
        loops = []
        while isinstance(stmt, tirx.For):
            if stmt.kind != tirx.ForKind.SERIAL or not _is_const(stmt.min, 0) or stmt.thread_binding is not None:
                return None
            loops.append(stmt)
            stmt = stmt.body
        if not isinstance(stmt, tirx.SBlockRealize) or not _is_const(stmt.predicate, 1):
            return None
        block = stmt.block
        if len(loops) != len(block.iter_vars) or block.alloc_buffers or block.match_buffers:
            return None
        for loop, value, iv in zip(loops, stmt.iter_values, block.iter_vars):
            if not value.same_as(loop.loop_var) or not _is_const(iv.dom.min, 0):
                return None
            if not _equal(iv.dom.extent, loop.extent):
                return None
        if not isinstance(block.body, tirx.BufferStore):
            return None
        found.append(Stage(block, tuple(iv.dom.extent for iv in block.iter_vars), block.body))
    return found, list(root.block.alloc_buffers)
