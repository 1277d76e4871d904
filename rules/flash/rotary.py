"""TVM's split-rotary kernel read as values: what it stores into q, k and v, per element.

The paged KV cache's ``f_split_rotary(qkv, positions, q, k, v, apply_rope)`` (TVM's
``llama_rope_with_position_map``) is one block over (token, fused head, dim) that stores
``q[s, h, d]``, ``k[s, h - H_qo, d]`` and ``v[s, h - H_qo - H_kv, d]`` under conditions on ``h``.
``analyze`` takes each store's value, an expression of the block's iteration variables, the
``qkv`` and ``positions`` buffers and ``apply_rope`` only; ``SplitRotary.value`` instantiates it
for another kernel's buffers and indices. A kernel that computes its q, k and v that way gets
exactly TVM's values (same expression, same roundings), whatever RoPE variant the model uses
(its frequencies are Let-bound inside the expression).
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import tirx

from .paging import static_dim

Q_OUT, K_OUT, V_OUT = 0, 1, 2  # the outputs, in the kernel's parameter order


@dataclasses.dataclass(frozen=True)
class SplitRotary:
    """The split-rotary kernel's parameters and its three stored values."""

    qkv: tirx.Var  # [tokens, H_qo + 2 H_kv, dim]
    positions: tirx.Var  # [tokens] int32
    outputs: tuple[tirx.Var, tirx.Var, tirx.Var]  # q [tokens, H_qo, dim], k and v [tokens, H_kv, dim]
    apply_rope: tirx.Var  # int64 scalar
    iters: tuple[tirx.Var, tirx.Var, tirx.Var]  # the block's token, fused head, dim
    values: tuple[tvm.ir.PrimExpr, tvm.ir.PrimExpr, tvm.ir.PrimExpr]  # stored into q, k, v
    head_offsets: tuple[int, int, int]  # fused head = output head + offset
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def value(self, which: int, qkv, positions, apply_rope, token, head, dim) -> tvm.ir.PrimExpr:
        """Output ``which``'s (``Q``, ``K``, ``V``) element [token, head, dim], read from ``qkv`` and
        ``positions`` (buffer variables of the calling kernel) with its ``apply_rope``."""
        s, h, d = self.iters
        mapping = {
            s: token, h: head + self.head_offsets[which], d: dim,
            self.qkv: qkv, self.positions: positions, self.apply_rope: apply_rope,
        }
        return tirx.stmt_functor.substitute(self.values[which], mapping)


def _block(func: tirx.PrimFunc) -> tirx.SBlock | None:
    """The one block with iteration variables, or None."""
    blocks: list[tirx.SBlock] = []
    tirx.stmt_functor.post_order_visit(
        func.body, lambda n: blocks.append(n) if isinstance(n, tirx.SBlock) and n.iter_vars else None
    )
    return blocks[0] if len(blocks) == 1 else None


def _stores(body: tirx.Stmt) -> list[tirx.BufferStore] | None:
    """The block body's stores, where it is only conditions and stores (nothing a value could depend on)."""
    if isinstance(body, tirx.BufferStore):
        return [body]
    if isinstance(body, tirx.SeqStmt):
        found: list[tirx.BufferStore] = []
        for stmt in body.seq:
            inner = _stores(stmt)
            if inner is None:
                return None
            found += inner
        return found
    if isinstance(body, tirx.IfThenElse):
        then = _stores(body.then_case)
        other = [] if body.else_case is None else _stores(body.else_case)
        return None if then is None or other is None else then + other
    return None


def analyze(func: tirx.PrimFunc) -> SplitRotary | None:
    """The split-rotary kernel's stored values, or None where it is not that kernel's shape."""
    buffers = [p for p in func.params if isinstance(p.ty, tirx.BufferType)]
    scalars = [p for p in func.params if not isinstance(p.ty, tirx.BufferType)]
    if len(buffers) != 5 or len(scalars) != 1 or str(scalars[0].ty) != "int64":
        return None
    qkv, positions, q, k, v = buffers
    dtype = str(qkv.ty.dtype)
    if any(len(b.ty.shape) != 3 or str(b.ty.dtype) != dtype for b in (qkv, q, k, v)):
        return None
    if len(positions.ty.shape) != 1 or str(positions.ty.dtype) != "int32":
        return None
    h_qo, h_kv, dim = static_dim(q.ty.shape[1]), static_dim(k.ty.shape[1]), static_dim(q.ty.shape[2])
    if None in (h_qo, h_kv, dim):
        return None
    expected = ((qkv, h_qo + 2 * h_kv), (k, h_kv), (v, h_kv))
    if any((static_dim(b.ty.shape[1]), static_dim(b.ty.shape[2])) != (heads, dim) for b, heads in expected):
        return None
    block = _block(func)
    if block is None or len(block.iter_vars) != 3:
        return None
    stores = _stores(block.body)
    if stores is None:
        return None
    iters = tuple(iv.var for iv in block.iter_vars)
    allowed = {*iters, qkv, positions, scalars[0]}
    values, offsets = [], []
    analyzer = tvm.arith.Analyzer()
    for out in (q, k, v):
        mine = [st for st in stores if st.buffer.same_as(out)]
        if len(mine) != 1:
            return None
        (store,) = mine
        s, head, d = store.indices
        offset = analyzer.simplify(iters[1] - head)
        same_place = analyzer.can_prove_equal(s, iters[0]) and analyzer.can_prove_equal(d, iters[2])
        if not (same_place and isinstance(offset, tirx.IntImm)):
            return None
        if any(not any(var.same_as(a) for a in allowed) for var in tirx.analysis.undefined_vars(store.value, [])):
            return None
        values.append(store.value)
        offsets.append(int(offset))
    return SplitRotary(qkv, positions, (q, k, v), scalars[0], iters, tuple(values), tuple(offsets), h_qo, h_kv, dim, dtype)
