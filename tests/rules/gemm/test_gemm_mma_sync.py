"""The mma.sync GEMM template builds for sm_90 into tensor-core CUDA; bad plans fail cleanly.

The numerics run on the GPU; here: a LLaMA-shaped NT matmul with symbolic M (and one with static
M) gets the template's body bound to its own parameters, which builds for sm_90 with mma.sync,
ldmatrix, cp.async and dynamic shared memory over 48 KiB; the split-K variant launches twice;
nvcc accepts the source; the candidate tiles load and the checks name the field of a bad plan.
"""

import dataclasses
import re

import pytest
from conftest import needs_nvcc
from fuselight.cuda_compile import compile_cuda
from fuselight.errors import FuselightError
from fuselight.rules.gemm.mma_sync import mma_sync_gemm
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemm.operands import GemmOperands
from fuselight.rules.gemm.plan import GemmPlan, GemmTile, check_plan, load_tiles
from fuselight.target import resolve, to_tvm
from fuselight.tune.gemm import matmul_prim_func


N, K = 512, 256
BIG = GemmTile(128, 256, 64, 2, 4, 3)  # 144 KiB of shared memory
REST = GemmTile(32, 256, 64, 1, 8, 4)
SMALL = GemmTile(32, 128, 64, 1, 4, 4)


def _matmul(n: int, k: int, dtype: str = "float16", m: int | None = None):
    return matmul_prim_func(n, k, dtype, m)


def _operands(func, b_layout: str = "NT") -> GemmOperands:
    return dataclasses.replace(analyze_matmul(func).operands, b_layout=b_layout)


def _build(func, plan: GemmPlan, dtype: str = "float16"):
    import tvm

    stmt = mma_sync_gemm(_operands(func), plan)
    bound = tvm.tirx.PrimFunc(func.params, stmt, func.ret_type, func.attrs).with_attr(
        {"global_symbol": "gemm", "tirx.is_scheduled": True}
    )
    tvm.tirx.analysis.verify_well_formed(bound)
    exe = tvm.compile(tvm.IRModule({"gemm": bound}), target=to_tvm(resolve("cuda", "sm_90")))
    return exe.mod.imports[0].inspect_source("cuda")


def _kernels(src: str) -> set[str]:
    # (each kernel is declared, then defined)
    return set(re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(', src))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_main_and_rest_tiles_build_with_tensor_cores(dtype):
    src = _build(_matmul(N, K, dtype), GemmPlan(BIG, REST), dtype)
    abbrev = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{abbrev}.{abbrev}.f32" in src
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in src
    assert "cp.async.cg.shared.global" in src
    # Over 48 KiB: dynamic shared memory (TVM's CUDA runtime raises the kernel's limit at launch).
    assert "extern __shared__" in src
    assert len(_kernels(src)) == 1  # main and rest tiles in one launch
    # The rest tile's rows past M are zero-filled (cp.async with a source size), the main tile's are not.
    assert "cp_async_cg_16_with_src_size" in src
    # Every output is written as 16 bytes.
    assert "*(uint4*)(O_ptr" in src


def test_split_k_launches_gemm_and_reduction():
    src = _build(_matmul(N, K), GemmPlan(SMALL, split_k=2))
    assert len(_kernels(src)) == 2


def test_static_m_builds():
    src = _build(_matmul(N, K, m=16), GemmPlan(GemmTile(16, 128, 64, 1, 4, 4)))
    assert "mma.sync.aligned.m16n8k16" in src


@needs_nvcc
def test_nvcc_compiles_the_source():
    assert compile_cuda(_build(_matmul(N, K), GemmPlan(BIG, REST)), arch="sm_90")


def test_candidate_tiles_load_and_are_valid():
    tiles = load_tiles("sm_90")
    assert tiles and all(isinstance(t, GemmTile) for t in tiles.values())
    with pytest.raises(FuselightError, match="no entry 'sm_42'"):
        load_tiles("sm_42")


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (GemmPlan(dataclasses.replace(BIG, block_m=120)), "block_m 120 must be a multiple of 16 x warps_m"),
        (GemmPlan(dataclasses.replace(BIG, block_n=96)), "block_n 96 must be a multiple of 16 x warps_n"),
        (GemmPlan(dataclasses.replace(BIG, block_k=48)), "block_k 48 must be one of"),
        (GemmPlan(dataclasses.replace(BIG, stages=1)), "stages 1 must be at least 2"),
        (GemmPlan(dataclasses.replace(BIG, stages=5)), "need 245760 bytes of shared memory"),
        (GemmPlan(GemmTile(128, 256, 64, 1, 2, 2)), "accumulators"),
        (GemmPlan(GemmTile(128, 384, 64, 2, 8, 3)), "n 512 is not a multiple of block_n 384"),
        (GemmPlan(BIG, split_k=8), "k 256 is not a multiple of block_k 64 x split_k 8"),
        (GemmPlan(BIG, split_k=0), "split_k must be a positive integer"),
        (GemmPlan(BIG, SMALL), "rest tile has 128 threads, main tile 256"),
        (GemmPlan(SMALL, GemmTile(32, 128, 64, 1, 4, 3)), "rest tile block_m 32 must be below main's 32"),
    ],
)
def test_bad_plans_are_refused(plan, message):
    with pytest.raises(FuselightError, match=re.escape(message)):
        check_plan(plan, _operands(_matmul(N, K)))
    with pytest.raises(FuselightError, match=re.escape(message)):
        mma_sync_gemm(_operands(_matmul(N, K)), plan)


def test_bad_operands_are_refused():
    func = _matmul(N, K)
    with pytest.raises(FuselightError, match="b_layout 'NN' unsupported"):
        check_plan(GemmPlan(BIG), _operands(func, b_layout="NN"))
    with pytest.raises(FuselightError, match="dtype 'float32' unsupported"):
        check_plan(GemmPlan(BIG), dataclasses.replace(_operands(func), dtype="float32"))
