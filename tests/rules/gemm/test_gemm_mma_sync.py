"""The mma.sync GEMM template builds for sm_90 into tensor-core CUDA; bad plans fail cleanly.

The numerics run on the GPU; here: a LLaMA-shaped NT matmul with symbolic M (and one with static
M) gets the template's body bound to its own parameters, which builds for sm_90 with mma.sync,
ldmatrix, cp.async and dynamic shared memory over 48 KiB; the split-K variant launches twice;
nvcc accepts the source; the candidate tiles load and the checks name the field of a bad plan.
"""

import dataclasses
import functools
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
from cuda_source import main_loops
from tir_query import kernel, kernels


N, K = 512, 256
BIG = GemmTile(128, 256, 64, 2, 4, 3)  # 144 KiB of shared memory
REST = GemmTile(32, 256, 64, 1, 8, 4)
SMALL = GemmTile(32, 128, 64, 1, 4, 4)


def _matmul(n: int, k: int, dtype: str = "float16", m: int | None = None):
    return matmul_prim_func(n, k, dtype, m)


def _operands(func, b_layout: str = "NT") -> GemmOperands:
    return dataclasses.replace(analyze_matmul(func).operands, b_layout=b_layout)


def _bound(func, plan: GemmPlan):
    import tvm

    stmt = mma_sync_gemm(_operands(func), plan)
    bound = tvm.tirx.PrimFunc(func.params, stmt, func.ret_type, func.attrs).with_attr(
        {"global_symbol": "gemm", "tirx.is_scheduled": True}
    )
    tvm.tirx.analysis.verify_well_formed(bound)
    return bound


def _build(func, plan: GemmPlan):
    import tvm

    exe = tvm.compile(tvm.IRModule({"gemm": _bound(func, plan)}), target=to_tvm(resolve("cuda", "sm_90")))
    return exe.mod.imports[0].inspect_source("cuda")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_main_and_rest_tiles_build_with_tensor_cores(dtype):
    kern = kernel(_bound(_matmul(N, K, dtype), GemmPlan(BIG, REST)))  # main and rest tiles in one launch
    # BIG: 2 x 4 warps; 3 stages of A's 128 x 64 and B's 256 x 64 tiles (144 KiB: dynamic shared
    # memory, over the static 48 KiB). Each warp's 64 x 64 of the main tile is 4 x 8 mma tiles of 4
    # floats; the rest tile's 32 x 32 a warp, 2 x 4 of them.
    assert kern.launch["threadIdx.x"] == 2 * 4 * 32 and kern.launch["blockIdx.y"] == 1
    assert kern.allocs["smem"] == ("shared.dyn", dtype, (3 * (128 + 256) * 64,))
    assert kern.allocs["main_frags_2"] == ("local", "float32", (4 * 8 * 4,))
    assert kern.allocs["rest_frags_2"] == ("local", "float32", (2 * 4 * 4,))
    # Blocks: whole 128-row tiles, then 32-row rest tiles for what is left of M, 2 column tiles each.
    assert kern.launch["blockIdx.x"] == 'T.Cast("int32", seq_len) // 128 * 2 + (T.Cast("int32", seq_len) % 128 + 31) // 32 * 2'
    abbrev = {"float16": "fp16", "bfloat16": "bf16"}[dtype]
    for args in kern.call_args["tirx.ptx.mma_legacy"]:  # the main tile's and the rest tile's
        assert [a.value for a in args[:6]] == ["m16n8k16", "row", "col", abbrev, abbrev, "fp32"]
    assert kern.calls["tirx.ptx.mma_legacy"] == 2 and kern.calls["tirx.ptx.ldmatrix_legacy"] >= 2
    # A and B of the main and the rest tile, through cp.async (device functions TVM's sync planner does not see)
    copies = [str(a[0].value) for a in kern.call_args["tirx.cuda.func_call"]]
    assert copies.count("fuselight_cp_async_16") >= 4 and "tirx.ptx.cp_async" not in kern.calls
    assert kern.outputs - {"C_smem"} == {"O"} and kern.vectorized[8] >= 1  # O stored 16 bytes a thread


def test_split_k_launches_gemm_and_reduction():
    gemm, reduction = kernels(_bound(_matmul(N, K), GemmPlan(SMALL, split_k=2)))
    # The GEMM: K split over blockIdx.y, 32-row tiles x 4 column tiles of 128, fp32 partials out.
    assert gemm.launch == {"threadIdx.x": 128, "blockIdx.y": 2, "blockIdx.x": '(T.Cast("int32", seq_len) + 31) // 32 * 4'}
    assert gemm.outputs - {"C_smem"} == {"part"}
    # The reduction: 8 outputs a thread, 256 threads a block over M x 512 outputs.
    assert reduction.launch == {"threadIdx.x": 256, "blockIdx.x": '(T.Cast("int32", seq_len) * 64 + 255) // 256'}
    assert set(reduction.loads) >= {"part"} and reduction.outputs == {"O"}


def test_static_m_builds():
    kern = kernel(_bound(_matmul(N, K, m=16), GemmPlan(GemmTile(16, 128, 64, 1, 4, 4))))
    # M = 16: one row tile x 512 / 128 column tiles; each warp's 16 x 32 is 1 x 4 mma tiles of 4 floats.
    assert kern.launch == {"threadIdx.x": 128, "blockIdx.y": 1, "blockIdx.x": 4}
    assert kern.allocs["main_frags_2"] == ("local", "float32", (16,)) and kern.calls["tirx.ptx.mma_legacy"] == 1


@functools.cache
def _big_rest_source() -> str:
    return _build(_matmul(N, K), GemmPlan(BIG, REST))


@needs_nvcc
def test_one_barrier_a_k_slice():
    """The pipeline's one barrier a K slice (none from TVM's sync planner, which put two more in
    each when it saw the copies): after the refill's copies and the wait for the next slice."""
    loops = main_loops(_big_rest_source())
    assert len(loops) == 2  # the main and the rest tile's
    pending = []
    for loop in loops:
        assert loop.count("__syncthreads()") == 1 and loop.count("mma.sync.aligned") > 0
        (wait,) = re.finditer(r"fuselight_cp_async_wait_(\d)\(\)", loop)
        pending.append(int(wait.group(1)))
        assert loop.index("fuselight_cp_async_16") < wait.start() < loop.index("__syncthreads()")
    # BIG's 3 stages and REST's 4: all but the newest refill (stages - 2 groups) may be in flight
    assert sorted(pending) == [BIG.stages - 2, REST.stages - 2] == [1, 2]


@needs_nvcc
def test_nvcc_compiles_the_source():
    assert compile_cuda(_big_rest_source(), arch="sm_90")


def test_candidate_tiles_load_and_are_valid():
    tiles = load_tiles("sm_90")
    assert tiles and all(isinstance(t, GemmTile) for t in tiles.values())
    with pytest.raises(FuselightError, match="no entry 'sm_42' and no device description"):
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
