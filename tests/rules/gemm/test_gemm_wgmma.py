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


def _build(dtype: str, tile: WgmmaTile = TILE, residual: bool = False, split_k: int = 1):
    import tvm

    func = _matmul_residual(dtype) if residual else _matmul(dtype)
    stmt = wgmma_gemm(_operands(func, dtype), tile, split_k)
    bound = tvm.tirx.PrimFunc(func.params, stmt, func.ret_type, func.attrs).with_attr("tirx.is_scheduled", True)
    assert str(bound.params[0].shape[1]) == "seq_len"  # M stays symbolic
    return tvm.compile(tvm.IRModule({"main": bound}), target=to_tvm(resolve("cuda", "sm_90")))


def _build_cuda(dtype: str, tile: WgmmaTile = TILE, residual: bool = False, split_k: int = 1) -> str:
    return _build(dtype, tile, residual, split_k).mod.imports[0].inspect_source("cuda")


@pytest.mark.parametrize("dtype,ptx", [("float16", "f16"), ("bfloat16", "bf16")])
def test_builds_wgmma_fed_by_tma(dtype, ptx):
    src = _build_cuda(dtype)
    assert f"wgmma.mma_async.sync.aligned.m64n{TILE.block_n}k16.f32.{ptx}.{ptx}" in src
    assert "ptx_wgmma_encode_matrix_descriptor" in src and "wgmma.wait_group.sync.aligned 1" in src
    # Both operands arrive by TMA, from tensor maps passed as kernel parameters.
    assert src.count("const __grid_constant__ CUtensorMap") == 2 * src.count("__global__")
    assert "cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes" in src
    assert "mbarrier.arrive.expect_tx" in src and "mbarrier.try_wait.parity" in src
    assert "setmaxnreg.dec" in src and "setmaxnreg.inc" in src
    assert "cp.async.cg" not in src and "cp.async.ca" not in src  # no per-thread copies left
    # The epilogue: accumulators staged in shared memory (each warpgroup syncs on its own barrier),
    # then 16 bytes (8 halves) a thread stored; no 4-byte stores from the accumulator registers.
    assert "bar.sync %0, 128" in src
    assert "*(uint4*)(out_ptr + " in src and "*(half2*)(out_ptr" not in src
    assert "*(__nv_bfloat162*)(out_ptr" not in src


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
    with pytest.raises(FuselightError, match="no entry 'sm_80'"):
        load_wgmma_tile("sm_80")
    with pytest.raises(FuselightError, match="no entry 'sm_80'"):
        load_wgmma_tiles("sm_80")


@needs_nvcc
def test_nvcc_compiles_the_narrow_tile():
    assert compile_cuda(_build_cuda("bfloat16", load_wgmma_tiles("sm_90")["n128"]), arch="sm_90")


@needs_nvcc
def test_split_k_stores_partials_and_reduces_them():
    # A 64-row tile (one consumer warpgroup) with K split in two, the residual read by the reduction.
    tile = load_wgmma_tiles("sm_90")["m64n128"]
    src = _build_cuda("float16", tile, residual=True, split_k=2)
    assert src.count("__global__") == 2 * 2  # the GEMM and the reduction, each declared and defined
    assert f"wgmma.mma_async.sync.aligned.m64n{tile.block_n}k16.f32.f16.f16" in src
    assert "setmaxnreg" not in src  # one consumer warpgroup keeps the compiler's registers
    # Partials leave as 32 bytes a thread, the reduction reads them as float4 and writes 16 bytes.
    assert "*(ulonglong4*)(part_ptr + " in src and "*(float4*)(part_ptr + " in src
    assert "*(uint4*)(out_ptr + " in src and "*(uint4*)(r_ptr + " in src
    assert compile_cuda(src, arch="sm_90")


def test_split_k_paired_epilogue_reduces_gate_and_up():
    import tvm

    func = _matmul("float16")
    ops = _operands(func, "float16")
    paired = dataclasses.replace(ops, out=dataclasses.replace(
        ops.out, value=lambda r, c, gate, up: tvm.tirx.Cast("float16", gate * up), pair_offset=N // 2))
    bound = tvm.tirx.PrimFunc(func.params, wgmma_gemm(paired, TILE, 2), func.ret_type, func.attrs)
    lib = tvm.compile(tvm.IRModule({"main": bound.with_attr("tirx.is_scheduled", True)}),
                      target=to_tvm(resolve("cuda", "sm_90")))
    src = lib.mod.imports[0].inspect_source("cuda")
    # The GEMM stores gate and up sums at their own columns; the reduction reads both halves.
    assert src.count("__global__") == 2 * 2 and f"+ {N // 2}" in src


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
