"""Hopper GEMM template on ``wgmma.mma_async``: the kernel body of one GemmOperands.

C tile ``block_m x block_n`` per block, ``warpgroups`` consumer warpgroups of 128 threads, each
owning 64 rows and issuing ``wgmma.mma_async.m64n{block_n}k16`` with both operands read from
shared memory through matrix descriptors. A and B tiles are K-major rows of ``BLOCK_K`` = 64
halves (128 bytes) stored with the 128-byte swizzle the descriptor names: 16-byte piece ``c`` of
row ``r`` at piece ``c ^ (r % 8)``, 8-row atoms of 1024 bytes. Every thread also loads: tiles
stream in by ``cp.async`` (rows past ``m`` zero-filled) into ``stages`` slots, ``stages - 2``
tiles ahead, while up to two wgmma groups run. Rows past ``m`` are not stored, so any M works
(the last row tile is partly wasted work); blocks walk the tiles in groups of ``group_m`` row
tiles so concurrent blocks share A and B in L2. Needs the arch-specific target (sm_90a): TVM's
CUDA compile and ``fuselight.cuda_compile`` both build for it. Shared memory is dynamic (up to
227 KiB, opted in at launch by TVM's runtime).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fuselight.errors import FuselightError

from ..arch_config import load_arch_config
from .operands import B_LAYOUTS, DTYPES, GemmOperands

if TYPE_CHECKING:
    import tvm

WARPGROUP = 128  # threads
WGMMA_M, WGMMA_K = 64, 16
# wgmma's n runs 8..256 in steps of 8; one 128-byte swizzle row holds 64 halves of K.
WGMMA_N_STEP, WGMMA_N_MAX = 8, 256
BLOCK_K = 64
CHUNK = 8  # halves per 16-byte cp.async piece
SWIZZLE_ROWS = 8
ATOM_BYTES = 1024  # one swizzle atom: 8 rows of 128 bytes; tiles start on one
ELEM_BYTES = 2  # both DTYPES
# Descriptor fields in 16-byte units: the stride between 8-row atoms; the leading offset is unused
# by K-major swizzled layouts (1 by convention). TVM's swizzle code 3 is the 128-byte swizzle.
DESC_SBO = ATOM_BYTES // 16
DESC_LBO = 1
DESC_SWIZZLE_128B = 3
# Shared memory a block may opt in to on sm_90 (227 KiB).
MAX_DYNAMIC_SMEM = 232448
# Keeps the compiler from reading an accumulator before the wgmma wait above it.
REGISTER_FENCE = "fuselight_wgmma_register_fence"
REGISTER_FENCE_SOURCE = f"""
__forceinline__ __device__ void {REGISTER_FENCE}(float& reg) {{
    asm volatile("" : "+f"(reg) :: "memory");
}}
"""
# wgmma groups left running while the next tile is loaded (the slot two steps back is free).
GROUPS_IN_FLIGHT = 1


@dataclasses.dataclass(frozen=True)
class WgmmaTile:
    """Tile config: ``block_n`` columns, ``warpgroups`` x 64 rows, ``stages`` shared-memory slots."""

    block_n: int
    warpgroups: int
    stages: int
    group_m: int

    @property
    def block_m(self) -> int:
        return WGMMA_M * self.warpgroups

    @property
    def threads(self) -> int:
        return WARPGROUP * self.warpgroups

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.block_m + self.block_n) * BLOCK_K * ELEM_BYTES


def load_wgmma_tile(arch: str) -> WgmmaTile:
    """The tile for ``arch`` (e.g. ``sm_90``) from ``configs/gemm/wgmma.json``."""
    return load_arch_config("gemm", "wgmma", arch, WgmmaTile)


def check_tile(tile: WgmmaTile, ops: GemmOperands) -> None:
    """FuselightError naming the problem if ``tile`` cannot compute ``ops``."""
    if ops.dtype not in DTYPES:
        raise FuselightError(f"wgmma gemm: dtype {ops.dtype!r} unsupported (supported: {', '.join(DTYPES)})")
    if ops.b_layout != "NT":
        raise FuselightError(
            f"wgmma gemm: B layout {ops.b_layout!r} unsupported (supported: NT of {B_LAYOUTS})"
        )
    if tile.block_n % WGMMA_N_STEP or tile.block_n > WGMMA_N_MAX:
        raise FuselightError(
            f"wgmma tile: block_n {tile.block_n} must be a multiple of {WGMMA_N_STEP} up to {WGMMA_N_MAX}"
        )
    if ops.n % tile.block_n:
        raise FuselightError(f"wgmma gemm: n {ops.n} is not a multiple of block_n {tile.block_n}")
    if ops.k % BLOCK_K:
        raise FuselightError(f"wgmma gemm: k {ops.k} is not a multiple of {BLOCK_K}")
    if tile.stages < GROUPS_IN_FLIGHT + 2:
        raise FuselightError(f"wgmma tile: stages {tile.stages} must be at least {GROUPS_IN_FLIGHT + 2}")
    for what, rows in (("A", tile.block_m), ("B", tile.block_n)):
        if rows * (BLOCK_K // CHUNK) % tile.threads:
            raise FuselightError(
                f"wgmma tile: {tile.threads} threads cannot load the {rows}x{BLOCK_K} {what} tile "
                f"in whole 16-byte pieces"
            )
    if tile.smem_bytes > MAX_DYNAMIC_SMEM:
        raise FuselightError(
            f"wgmma tile: {tile.stages} stages of {tile.block_m}x{BLOCK_K} + {tile.block_n}x{BLOCK_K} "
            f"need {tile.smem_bytes} bytes of shared memory (at most {MAX_DYNAMIC_SMEM})"
        )


def wgmma_gemm(ops: GemmOperands, tile: WgmmaTile) -> tvm.tirx.Stmt:
    """The kernel body (a ``tvm.tirx.Stmt``) computing ``ops`` with ``tile``.

    It uses ``ops``' buffers as they are: bind it to the analysed function's params.
    """
    from tvm.backend.cuda import op as cuda_op
    from tvm.script import tirx as T

    check_tile(tile, ops)
    dtype, n, k = ops.dtype, ops.n, ops.k
    bm, bn, stages, threads = tile.block_m, tile.block_n, tile.stages, tile.threads
    chunks = BLOCK_K // CHUNK
    a_loads = bm * chunks // threads
    b_loads = bn * chunks // threads
    a_slot, b_slot = bm * BLOCK_K * ELEM_BYTES, bn * BLOCK_K * ELEM_BYTES  # bytes per stage
    b_base = stages * a_slot
    k_tiles = k // BLOCK_K
    n_tiles = n // bn
    n_acc = WGMMA_M * bn // WARPGROUP  # fp32 accumulators per thread
    prefetch = stages - 1 - GROUPS_IN_FLIGHT  # tiles loaded ahead of the one computed
    a_buf, b_buf, out_buf = ops.a, ops.b, ops.out.buffer

    def swz(row, chunk):
        # Byte offset of 16-byte piece ``chunk`` of tile row ``row``.
        return (row * BLOCK_K + T.bitwise_xor(chunk, T.bitwise_and(row, SWIZZLE_ROWS - 1)) * CHUNK) * ELEM_BYTES

    def desc(base, byte_offset):
        # Start address is the descriptor's low field, in 16-byte units: offsets add to it.
        return base + T.Cast("uint64", byte_offset // 16)

    def mma(desc_a, desc_b, acc):
        return cuda_op.ptx_wgmma_mma_async_ss(
            desc_a, desc_b, *[acc[i] for i in range(n_acc)],
            M=WGMMA_M, N=bn, K=WGMMA_K, in_dtype=dtype, out_dtype="float32",
            transA=False, transB=False, scaleA=1.0, scaleB=1.0, scaleD=1,
        )  # fmt: skip

    def fence_register(reg):
        return cuda_op.cuda_func_call(REGISTER_FENCE, reg, source_code=REGISTER_FENCE_SOURCE)

    @T.macro
    def load_tile(smem, tid, kt, m0, n0, m):
        slot: T.let[T.int32] = kt % stages
        for it in T.unroll(a_loads):
            row: T.let[T.int32] = (it * threads + tid) // chunks
            c: T.let[T.int32] = (it * threads + tid) % chunks
            T.ptx.cp_async(
                smem.access_ptr("w", offset=slot * a_slot + swz(row, c)),
                a_buf.access_ptr(
                    "r", offset=ops.a_offset(T.Cast("int64", T.min(m0 + row, m - 1)), kt * BLOCK_K + c * CHUNK)
                ),
                16,
                predicate=m0 + row < m,
                fill_mode="zero",
            )
        for it in T.unroll(b_loads):
            row: T.let[T.int32] = (it * threads + tid) // chunks
            c: T.let[T.int32] = (it * threads + tid) % chunks
            T.ptx.cp_async(
                smem.access_ptr("w", offset=b_base + slot * b_slot + swz(row, c)),
                b_buf.access_ptr("r", offset=ops.b_offset(n0 + row, kt * BLOCK_K + c * CHUNK)),
                16,
            )

    # fmt: off
    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        m: T.let[T.int32] = T.Cast("int32", ops.m)
        m_tiles: T.let[T.int32] = T.ceildiv(m, bm)
        for bx in T.thread_binding(m_tiles * n_tiles, thread="blockIdx.x"):
            for tid in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("gemm"):
                    T.reads()
                    T.writes()
                    # Raw bytes: every kernel of a CUDA source that declares this extern array must
                    # give it the same type (an fp16 and a bf16 GEMM in one module would clash).
                    buf_dyn_shmem = T.sblock_alloc_buffer((tile.smem_bytes,), "uint8", scope="shared.dyn", align=ATOM_BYTES)
                    acc = T.sblock_alloc_buffer((n_acc,), "float32", scope="local")
                    smem_desc = T.sblock_alloc_buffer((1,), "uint64", scope="local")
                    # Grouped order: group_m row tiles sweep the columns together.
                    # (All non-negative: truncating division is floor division here, and cheaper.)
                    group: T.let[T.int32] = T.truncdiv(bx, tile.group_m * n_tiles)
                    rows_in_group: T.let[T.int32] = T.min(m_tiles - group * tile.group_m, tile.group_m)
                    in_group: T.let[T.int32] = T.truncmod(bx, tile.group_m * n_tiles)
                    m0: T.let[T.int32] = (group * tile.group_m + T.truncmod(in_group, rows_in_group)) * bm
                    n0: T.let[T.int32] = T.truncdiv(in_group, rows_in_group) * bn
                    wg: T.let[T.int32] = tid // WARPGROUP
                    T.ptx.wgmma.encode_matrix_descriptor(
                        T.address_of(smem_desc[0]), buf_dyn_shmem.access_ptr("r"), DESC_LBO, DESC_SBO, DESC_SWIZZLE_128B
                    )
                    for i in T.unroll(n_acc):
                        acc[i] = T.float32(0)
                    for kt in T.unroll(prefetch):
                        if kt < k_tiles:
                            load_tile(buf_dyn_shmem, tid, kt, m0, n0, m)
                        T.ptx.cp_async.commit_group()
                    for kt in T.serial(k_tiles):
                        T.ptx.cp_async.wait_group(prefetch - 1)
                        # cp.async writes are generic-proxy; wgmma reads through the async proxy.
                        T.ptx.fence.proxy_async("shared::cta")
                        T.tvm_storage_sync("shared")
                        slot: T.let[T.int32] = kt % stages
                        T.ptx.wgmma.fence()
                        for kk in T.unroll(BLOCK_K // WGMMA_K):
                            T.evaluate(mma(
                                desc(smem_desc[0], slot * a_slot + (wg * WGMMA_M * BLOCK_K + kk * WGMMA_K) * ELEM_BYTES),
                                desc(smem_desc[0], b_base + slot * b_slot + kk * WGMMA_K * ELEM_BYTES),
                                acc,
                            ))
                        T.ptx.wgmma.commit_group()
                        # Leaves this step's group running; every warpgroup passed the barrier
                        # above after finishing the group before, so slot kt + prefetch is free.
                        T.ptx.wgmma.wait_group(GROUPS_IN_FLIGHT)
                        if kt + prefetch < k_tiles:
                            load_tile(buf_dyn_shmem, tid, kt + prefetch, m0, n0, m)
                        T.ptx.cp_async.commit_group()
                    T.ptx.wgmma.wait_group(0)
                    for i in T.unroll(n_acc):
                        T.evaluate(fence_register(acc[i]))
                    # Accumulator 4j + 2h + e: row lane / 4 + 8h of the warp's 16, column
                    # 8j + 2 (lane % 4) + e; each thread's e = 0, 1 pair is stored together.
                    for j in T.unroll(n_acc // 4):
                        for h in T.unroll(2):
                            r: T.let[T.int32] = m0 + wg * WGMMA_M + (tid % WARPGROUP) // 32 * 16 + (tid % 32) // 4 + h * 8
                            if r < m:
                                for e in T.vectorized(2):
                                    out_buf[ops.out.index(T.Cast("int64", r), n0 + j * 8 + tid % 4 * 2 + e)] = ops.out.value(
                                        T.Cast("int64", r), n0 + j * 8 + tid % 4 * 2 + e, acc[j * 4 + h * 2 + e]
                                    )
    # fmt: on
    return body.body
