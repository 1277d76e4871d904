"""The Hopper wgmma GEMM template builds for sm_90 into wgmma CUDA that nvcc accepts; bad tiles fail cleanly.

Numerics and speed are checked on the GPU; here: the body binds to a matmul PrimFunc with a symbolic
token count (fp16 and bf16), the host encodes TMA tensor maps (A's rows = the token count) and
passes them as grid constants, the CUDA loads tiles with cp.async.bulk.tensor completing mbarriers
and issues wgmma.mma_async from 128-byte-swizzled shared memory, the epilogue (a residual add too)
stages the accumulators in shared memory and stores (and reads its inputs) 16 bytes a thread, nvcc
compiles it for sm_90a; split-K stores fp32 partials and launches the reduction (a paired epilogue
too), one-warpgroup tiles leave the registers alone; and every tile or operand the template cannot
handle is refused with a FuselightError naming it.
"""

import dataclasses

import pytest
from conftest import needs_nvcc
from fuselight.cuda_compile import compile_cuda
from fuselight.errors import FuselightError
from fuselight.rules.gemm.operands import Epilogue, GemmOperands
from fuselight.rules.gemm.wgmma import (
    WgmmaPlan,
    WgmmaTile,
    check_tile,
    load_wgmma_tile,
    load_wgmma_tiles,
    wgmma_gemm,
)
from fuselight.target import resolve, to_tvm
from tir_query import constants, kernel, kernels

N, K = 512, 256
TILE = load_wgmma_tile("sm_90")


def _matmul(dtype: str, n: int = N, k: int = K):
    """out[0, i, j] = sum_k A[0, i, k] * B[j, k], with the token count seq_len symbolic (int64)."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def matmul(var_a: T.handle, b: T.Buffer((n, k), dtype), var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        seq_len = T.int64()
        a = T.match_buffer(var_a, (1, seq_len, k), dtype)
        out = T.match_buffer(var_out, (1, seq_len, n), dtype)
        for i, j, kk in T.grid(seq_len, n, k):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                with T.init():
                    out[0, vi, vj] = T.Cast(dtype, 0)
                out[0, vi, vj] = out[0, vi, vj] + a[0, vi, vk] * b[vj, vk]

    return matmul


def _matmul_residual(dtype: str):
    """out[0, i, j] = cast(sum_k A[0, i, k] * B[j, k]) + R[0, i, j] (the epilogue; no body needed)."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def matmul_residual(var_a: T.handle, b: T.Buffer((N, K), dtype), var_r: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        seq_len = T.int64()
        a = T.match_buffer(var_a, (1, seq_len, K), dtype)  # noqa: F841 - named for the CUDA
        r = T.match_buffer(var_r, (1, seq_len, N), dtype)  # noqa: F841
        out = T.match_buffer(var_out, (1, seq_len, N), dtype)  # noqa: F841
        T.evaluate(0)

    return matmul_residual


def _operands(func, elem_dtype: str, **changes) -> GemmOperands:
    from tvm.script import tirx as T

    a, b, *res, out = func.params

    def value(r, c, acc):
        return T.Cast(elem_dtype, acc) + res[0][0, r, c] if res else T.Cast(elem_dtype, acc)

    ops = GemmOperands(
        a=a, b=b, m=a.shape[1], n=int(b.shape[0]), k=int(b.shape[1]), b_layout="NT", dtype=elem_dtype,
        out=Epilogue(buffer=out, index=lambda r, c: (0, r, c), value=value),
    )  # fmt: skip
    return dataclasses.replace(ops, **changes)


def _bound(dtype: str, tile: WgmmaTile = TILE, residual: bool = False, split_k: int = 1, ops=None):
    """The template bound to the matmul (or ``ops``, for another epilogue), ready to compile."""
    import tvm

    func = _matmul_residual(dtype) if residual else _matmul(dtype)
    stmt = wgmma_gemm(ops or _operands(func, dtype), tile, split_k)
    bound = tvm.tirx.PrimFunc(func.params, stmt, func.ret_type, func.attrs).with_attr("tirx.is_scheduled", True)
    assert str(bound.params[0].shape[1]) == "seq_len"  # M stays symbolic
    return bound


def _build(dtype: str, tile: WgmmaTile = TILE, residual: bool = False, split_k: int = 1):
    import tvm

    return tvm.compile(tvm.IRModule({"main": _bound(dtype, tile, residual, split_k)}), target=to_tvm(resolve("cuda", "sm_90")))


# H100's largest dynamic shared memory a block may opt into (227 KiB).
MAX_DYNAMIC_SHARED = 232448


def _check_gemm_kernel(kern, dtype: str, tile: WgmmaTile, outputs: set[str], copies: int = 2) -> None:
    """The GEMM kernel of ``tile``: one producer warpgroup and ``tile.warpgroups`` consumers, each
    consumer's m64nN accumulator spread over its 128 threads, stages of the A and B tiles (64 of K)
    in dynamic shared memory, filled by ``copies`` TMA copies (the only copies), wgmma from shared memory."""
    block_m = 64 * tile.warpgroups
    assert kern.launch["threadIdx.x"] == 128 * (tile.warpgroups + 1)
    assert kern.allocs["acc"] == ("local", "float32", (64 * tile.block_n // 128,))
    ((scope, _, (smem,)),) = [a for a in kern.allocs.values() if a[0] == "shared.dyn"]
    assert tile.stages * (block_m + tile.block_n) * 64 * 2 <= smem <= MAX_DYNAMIC_SHARED
    assert [c for c in kern.calls if "cp_async" in c] == ["tirx.ptx.cp_async_bulk_tensor_g2s_cta"]
    assert kern.calls["tirx.ptx.cp_async_bulk_tensor_g2s_cta"] == copies
    assert kern.calls["tirx.ptx.mbarrier_arrive_expect_tx"] == 1 and kern.calls["tirx.ptx.mbarrier_try_wait"] >= 1
    ((shape_m, shape_n, shape_k, in_dtype, acc_dtype, *_),) = kern.call_args["tirx.ptx.wgmma_mma_async_ss"]
    assert (int(shape_m), int(shape_n), int(shape_k), in_dtype.value, acc_dtype.value) == (64, tile.block_n, 16, dtype, "float32")
    assert kern.outputs - {"epi"} == outputs  # epi: the accumulators' staging, a view of shared memory


def _build_cuda(dtype: str, tile: WgmmaTile = TILE, residual: bool = False, split_k: int = 1) -> str:
    return _build(dtype, tile, residual, split_k).mod.imports[0].inspect_source("cuda")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_builds_wgmma_fed_by_tma(dtype):
    kern = kernel(_bound(dtype))
    _check_gemm_kernel(kern, dtype, TILE, {"out"})  # A's tile and B's
    # Two consumer warpgroups: the producer gives registers back (setmaxnreg.dec), they take them.
    assert sorted(bool(inc) for inc, _ in kern.call_args["tirx.ptx.setmaxnreg"]) == [False, True]
    assert kern.launch["blockIdx.x"] == "blocks"  # a persistent grid, sized at run time
    assert kern.vectorized[8] >= 1  # the epilogue stores 8 elements (16 bytes) a thread


@needs_nvcc
def test_residual_epilogue_reads_and_writes_16_bytes():
    # ``out = cast(acc) + R``: the residual too is read 8 halves a load, beside the 16-byte stores.
    src = _build_cuda("float16", residual=True)
    assert "*(uint4*)(out_ptr + " in src and "*(uint4*)(r_ptr + " in src
    assert "(half2*)(out_ptr" not in src and "(half2*)(r_ptr" not in src
    assert compile_cuda(src, arch="sm_90")


def test_host_encodes_tensor_maps_with_symbolic_rows():
    import tvm

    func = _matmul("float16")
    body = wgmma_gemm(_operands(func, "float16"), TILE)
    calls = []
    tvm.tirx.stmt_functor.post_order_visit(
        body,
        lambda node: calls.append(node)
        if isinstance(node, tvm.ir.expr.Call) and node.op.same_as(tvm.ir.Op.get("tirx.tvm_call_packed"))
        else None,
    )
    encodes = [c for c in calls if c.args[0].value == "runtime.cuTensorMapEncodeTiled"]
    assert len(encodes) == 2
    # (name, map, dtype, rank, base, K, rows, row stride in bytes, box K, box rows, ...)
    a_rows, b_rows = (str(c.args[6]) for c in encodes)
    assert not a_rows.isdigit() and b_rows == str(N)  # A's rows: the token count, at run time
    assert [int(c.args[9]) for c in encodes] == [TILE.block_m, TILE.block_n]


@needs_nvcc
def test_nvcc_compiles_for_sm90a():
    assert compile_cuda(_build_cuda("float16"), arch="sm_90")


def test_config_tiles_are_valid():
    tiles = load_wgmma_tiles("sm_90")
    assert tiles["default"] == TILE and len(tiles) > 1
    assert {t.warpgroups for t in tiles.values()} == {1, 2}
    for tile in tiles.values():
        check_tile(tile, _operands(_matmul("float16", 6144, 4096), "float16"), split_k=4)
    with pytest.raises(FuselightError, match="sm_80 has no wgmma"):
        load_wgmma_tile("sm_80")
    with pytest.raises(FuselightError, match="sm_80 has no wgmma"):
        load_wgmma_tiles("sm_80")


@needs_nvcc
def test_nvcc_compiles_the_narrow_tile():
    assert compile_cuda(_build_cuda("bfloat16", load_wgmma_tiles("sm_90")["n128"]), arch="sm_90")


def test_split_k_stores_partials_and_reduces_them():
    # A 64-row tile (one consumer warpgroup) with K split in two, the residual read by the reduction.
    tile = load_wgmma_tiles("sm_90")["m64n128"]
    gemm, reduction = kernels(_bound("float16", tile, residual=True, split_k=2))
    _check_gemm_kernel(gemm, "float16", tile, {"part"})  # fp32 partials, not the output
    assert "tirx.ptx.setmaxnreg" not in gemm.calls  # one consumer warpgroup keeps the compiler's registers
    # The reduction: 8 columns a thread (N = 512: 64 threads a row), the partials summed, R added.
    assert reduction.launch["threadIdx.x"] == 256 and "seq_len) * 64" in reduction.launch["blockIdx.x"]
    assert reduction.allocs == {"sums": ("local", "float32", (8,))}
    assert set(reduction.loads) == {"part", "sums", "r"} and reduction.outputs == {"out"}


@needs_nvcc
def test_nvcc_compiles_split_k_with_a_residual():
    assert compile_cuda(_build_cuda("float16", load_wgmma_tiles("sm_90")["m64n128"], residual=True, split_k=2), arch="sm_90")


def test_split_k_paired_epilogue_reduces_gate_and_up():
    import tvm

    func = _matmul("float16")
    ops = _operands(func, "float16")
    paired = dataclasses.replace(ops, out=dataclasses.replace(
        ops.out, value=lambda r, c, gate, up: tvm.tirx.Cast("float16", gate * up), pair_offset=N // 2))
    gemm, reduction = kernels(_bound("float16", split_k=2, ops=paired))
    # The GEMM stores gate and up sums at their own columns (all N of them); the reduction reads
    # each output's up sum N / 2 = 256 columns after its gate sum and writes N / 2 columns, 8 a thread.
    _check_gemm_kernel(gemm, "float16", TILE, {"part"}, copies=3)  # A's tile, B's gate rows and up rows
    assert reduction.outputs == {"out"} and set(reduction.allocs) == {"sums", "up"}
    assert N // 2 in set().union(*(constants(i) for i in reduction.loads["part"]))
    assert "seq_len) * 32" in reduction.launch["blockIdx.x"]  # 256 columns / 8: 32 threads a row


@pytest.mark.parametrize(
    "tile_changes,op_changes,match",
    [
        ({"block_n": 100}, {}, "block_n 100 must be a multiple of 8"),
        ({"block_n": 512}, {"n": 1024}, "block_n 512 must be a multiple of 8 up to 256"),
        ({"stages": 1}, {}, "stages 1 must be at least 2"),
        ({"stages": 8}, {}, "and the epilogue need 426112 bytes of shared memory"),
        ({"block_n": 96}, {"n": 960}, "block_n 96 must be a multiple of 64"),
        ({"warpgroups": 3}, {}, "warpgroups 3 unsupported"),
        ({}, {"n": 640}, "n 640 is not a multiple of block_n"),
        ({}, {"k": 200}, "k 200 is not a multiple of 64"),
        ({}, {"b_layout": "NN"}, "B layout 'NN' unsupported"),
        ({}, {"dtype": "float32"}, "dtype 'float32' unsupported"),
    ],
)
def test_bad_tiles_and_operands_rejected(tile_changes, op_changes, match):
    ops = _operands(_matmul("float16"), "float16", **op_changes)
    with pytest.raises(FuselightError, match=match):
        wgmma_gemm(ops, dataclasses.replace(TILE, **tile_changes))


@pytest.mark.parametrize(
    "split_k,match", [(0, "split_k must be a positive integer"), (8, "k 256 is not a multiple of 64 x split_k 8")]
)
def test_bad_split_k_rejected(split_k, match):
    with pytest.raises(FuselightError, match=match):
        wgmma_gemm(_operands(_matmul("float16"), "float16"), TILE, split_k)
    assert WgmmaPlan(TILE).split_k == 1
