"""Split-K for the GEMM templates: the fp32 partial-sum workspace and the launch that reduces it.

A template splitting K over ``split_k`` work units of the same output tile stores each unit's fp32
sums as ``part[(split * m + row) * n + col]`` (``split`` < ``split_k``, every accumulator column
``col`` < n, rows below M only), in a global fp32 buffer of ``split_k * m * n`` allocated in its body;
``reduction(ops, split_k)`` is the second launch: it sums the splits and writes the epilogue,
``CHUNK`` adjacent outputs a thread. A paired epilogue (``operands``) reads the sums of columns c
and c + pair_offset for output column c.
"""

from __future__ import annotations

from typing import Any

from tvm.script import tirx as T

from .operands import GemmOperands

# Adjacent outputs a reduction thread sums and writes (16 bytes of fp16/bf16).
CHUNK = 8
# Threads per block of the reduction.
REDUCE_THREADS = 256
VEC = 4  # floats a partial-sum load reads (16 bytes)


def rows(ops: GemmOperands) -> tuple[Any, Any]:
    """M as an int32 expression (tile arithmetic), and a function widening a row or column index to
    M's own dtype (global offsets: M x N reaches 2^31 for lm_head-sized N)."""
    if isinstance(ops.m, int):
        return ops.m, lambda i: i
    dtype = str(ops.m.ty.dtype)
    return T.Cast("int32", ops.m), lambda i: T.Cast(dtype, i)


def reduction(ops: GemmOperands, split_k: int) -> Any:
    """A macro ``reduce_blocks(part)``: the launch writing ``ops.out`` from the ``split_k`` partials."""
    n, out_n, pair = ops.n, ops.out_n, ops.out.pair_offset
    out_buf = ops.out.buffer
    m, wide = rows(ops)
    pieces = out_n // CHUNK  # per output row

    # fmt: off
    @T.macro
    def load_sums(sums, part, row, col):
        # float4 loads, summed over the splits (a float32x8 local TVM's CUDA codegen cannot store).
        for h in T.unroll(CHUNK // VEC):
            for e in T.vectorized(VEC):
                sums[h * VEC + e] = part[wide(row) * n + col + h * VEC + e]
        for s in T.unroll(1, split_k):
            for h in T.unroll(CHUNK // VEC):
                for e in T.vectorized(VEC):
                    sums[h * VEC + e] = sums[h * VEC + e] + part[wide(s * m + row) * n + col + h * VEC + e]

    @T.macro
    def reduce_blocks(part):
        for bx in T.thread_binding((m * pieces + REDUCE_THREADS - 1) // REDUCE_THREADS, thread="blockIdx.x"):
            for tx in T.thread_binding(REDUCE_THREADS, thread="threadIdx.x"):
                with T.sblock("reduce"):
                    T.reads()
                    T.writes()
                    sums = T.sblock_alloc_buffer((CHUNK,), "float32", scope="local")
                    if pair is not None:
                        up = T.sblock_alloc_buffer((CHUNK,), "float32", scope="local")
                    idx: T.let[T.int32] = T.Cast("int32", bx) * REDUCE_THREADS + T.Cast("int32", tx)
                    if idx < m * pieces:
                        row: T.let[T.int32] = idx // pieces
                        col: T.let[T.int32] = idx % pieces * CHUNK
                        load_sums(sums, part, row, col)
                        if pair is None:
                            for e in T.vectorized(CHUNK):
                                out_buf[ops.out.index(wide(row), wide(col + e))] = ops.out.value(wide(row), wide(col + e), sums[e])
                        else:
                            load_sums(up, part, row, pair + col)
                            for e in T.vectorized(CHUNK):
                                out_buf[ops.out.index(wide(row), wide(col + e))] = ops.out.value(
                                    wide(row), wide(col + e), sums[e], up[e]
                                )

    # fmt: on
    return reduce_blocks
