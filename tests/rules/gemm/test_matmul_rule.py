"""The Matmul rule and its dispatcher: which functions it schedules, that the result builds for sm_90
and nvcc compiles it, and that the dispatch ranges come from the config (numerics run on the GPU:
``fuselight tune gemm-run`` and the kernel suite)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from conftest import needs_nvcc
import tvm
from fuselight.errors import FuselightError
from fuselight.rules.gemm import dispatch, estimate
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemm.operands import GemmOperands
from fuselight.rules.matmul import Matmul
from fuselight.tune.gemm import matmul_prim_func
from tvm import tirx
from tir_query import kernels

LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _ops(n: int, k: int, m=None) -> GemmOperands:
    return GemmOperands(a=None, b=None, m=m if m is not None else tirx.Var("m", "int64"), n=n, k=k,
                        b_layout="NT", dtype="float16", out=None)


def _cuda_source(func: tirx.PrimFunc, target) -> str:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    return lib.mod.imports[0].inspect_source("cuda")


@pytest.mark.parametrize("n,k", LLAMA_SHAPES)
def test_dispatch_covers_every_m_with_valid_plans(n, k):
    d = estimate.load_dispatch("sm_90")
    ranges = dispatch.plan_ranges(_ops(n, k), d)
    assert ranges
    uppers = [u for u, _ in ranges]
    assert uppers == sorted(uppers) and len(set(uppers)) == len(uppers)
    for upper, plan in ranges:
        if isinstance(plan, estimate.WgmmaPlan):
            estimate.check_tile(plan.tile, _ops(n, k), plan.split_k)
            continue
        estimate.check_plan(plan, _ops(n, k))
        assert plan.rest is None or upper > plan.main.block_m  # a rest tile only follows whole main tiles


def test_no_plan_for_what_no_template_serves():
    d = estimate.load_dispatch("sm_90")
    nn = dataclasses.replace(_ops(4096, 4096), b_layout="NN")  # the templates read B as [n, k]
    assert dispatch.plan_ranges(nn, d) == [] and dispatch.best_plan(nn, 4096, d) is None
    assert dispatch.plan_ranges(_ops(4100, 4096), d) == []  # N no tile divides


def test_static_m_gets_one_plan():
    d = estimate.load_dispatch("sm_90")
    assert len(dispatch.plan_ranges(_ops(4096, 4096, tirx.IntImm("int64", 300)), d)) == 1


def test_estimate_prefers_large_tiles_at_large_m_and_fills_the_gpu_at_small_m():
    d = estimate.load_dispatch("sm_90")
    assert dispatch.best_plan(_ops(4096, 4096), 8192, d) == estimate.WgmmaPlan(d.wgmma[estimate.WGMMA])
    small = dispatch.best_plan(_ops(4096, 4096), 32, d)
    tile = small.tile if isinstance(small, estimate.WgmmaPlan) else small.main
    # 32 rows x 4096 columns are 16 128 x 256 tiles; the small-M plan spreads them over the GPU
    assert -(-32 // tile.block_m) * (4096 // tile.block_n) * small.split_k >= 32


def test_wgmma_split_k_plans_are_named_priced_and_candidates():
    d = estimate.load_dispatch("sm_90")
    plan = estimate.WgmmaPlan(d.wgmma["wgmma-n128"], 4)
    assert estimate.plan_name(plan, d) == "wgmma-n128/sk4"
    assert estimate.parse_plan(d.tiles, d.wgmma, "wgmma-n128/sk4") == plan
    assert estimate.parse_plan(d.tiles, d.wgmma, "wgmma") == estimate.WgmmaPlan(d.wgmma["wgmma"])
    assert plan in estimate.candidates(_ops(4096, 4096), d)
    # 128 x 4096 outputs are 32 tiles of 128 x 128: split four ways they fill the GPU, whole they do not
    assert estimate.estimate_us(plan, 128, 4096, 4096, d) < estimate.estimate_us(
        estimate.WgmmaPlan(plan.tile), 128, 4096, 4096, d)
    # at large M the partial sums cost more than the split gains
    assert estimate.estimate_us(plan, 8192, 4096, 4096, d) > estimate.estimate_us(
        estimate.WgmmaPlan(plan.tile), 8192, 4096, 4096, d)
    with pytest.raises(FuselightError, match="'wgmma-n96/sk2' has no wgmma tile"):
        estimate.parse_plan(d.tiles, d.wgmma, "wgmma-n96/sk2")
    # k = 4096 is 64 slices of 64: no split of it into 128 ranges
    assert not estimate.fits(estimate.WgmmaPlan(plan.tile, 128), _ops(4096, 4096))


def test_measured_table_overrides_the_estimate():
    d = estimate.load_dispatch("sm_90")
    tile = next(iter(d.tiles.values()))
    forced = dataclasses.replace(d, measured={"4096x4096": [(10**9, estimate.GemmPlan(tile, None, 2))]})
    assert dispatch.best_plan(_ops(4096, 4096), 4000, forced) == estimate.GemmPlan(tile, None, 2)
    assert dispatch.plan_ranges(_ops(4096, 4096), forced) == [(10**9, estimate.GemmPlan(tile, None, 2))]
    # other shapes keep the estimate
    assert dispatch.best_plan(_ops(6144, 4096), 4000, forced) == dispatch.best_plan(_ops(6144, 4096), 4000, d)


def test_bad_dispatch_config_names_the_problem(tmp_path, monkeypatch):
    from fuselight import paths

    src = paths.config_dir()
    (tmp_path / "gemm").mkdir()
    shutil.copy(src / "gemm" / "mma_sync.json", tmp_path / "gemm" / "mma_sync.json")
    cfg = json.loads((src / "gemm" / "dispatch.json").read_text())
    cfg["sm_90"]["efficiency"]["no-such-tile"] = 0.5
    (tmp_path / "gemm" / "dispatch.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(estimate, "config_dir", lambda: tmp_path)
    with pytest.raises(FuselightError, match="unknown tiles"):
        estimate.load_dispatch("sm_90")
    with pytest.raises(FuselightError, match="sm_75"):
        estimate.load_dispatch("sm_75")


# The kernels a symbolic M gets, in host-branch order, read by hand from the shipped sm_90 configs:
# configs/gemm/gemv.json's buckets for M <= 1, 2, 4, 8, 16 (the row template's 16 warps; the mma
# template's 16, 16, 16 and 4 warps, 4 floats a lane per 8 tokens), then dispatch.json's measured
# ranges above 16 (wgmma.json: a warpgroup of 128 threads per consumer plus the producer; a lane holds
# 64 x block_n / 128 floats), each split-K range followed by its reduction.
_GEMV = [("rows", 512, 1), ("mma", 512, 4), ("mma", 512, 4), ("mma", 512, 4), ("mma", 128, 8)]
EXPECTED_KERNELS = {
    # <=48 m64n128/sk4, <=64 m64n64/sk2, <=256 m64n128, <=512 n128, <=1024 wgmma, <=1536 n128, then wgmma
    (4096, 4096): _GEMV + [("wgmma", 256, 64), ("reduce", 256, None), ("wgmma", 256, 32), ("reduce", 256, None),
                           ("wgmma", 256, 64), ("wgmma", 384, 64), ("wgmma", 384, 128), ("wgmma", 384, 64),
                           ("wgmma", 384, 128)],
    # <=16 (mma.sync, left to the GEMV), <=128 m64n128, <=192 m64n256, <=256 n128, <=1024 n192, <=1536 n128, wgmma
    (6144, 4096): _GEMV + [("wgmma", 256, 64), ("wgmma", 256, 128), ("wgmma", 384, 64), ("wgmma", 384, 96),
                           ("wgmma", 384, 64), ("wgmma", 384, 128)],
}


def _kind(kern) -> str:
    if "tirx.ptx.wgmma_mma_async_ss" in kern.calls:
        return "wgmma"
    if "tirx.ptx.mma_legacy" in kern.calls:
        return "mma"
    return "rows" if "tirx.tvm_warp_shuffle_xor" in kern.calls else "reduce"


@pytest.mark.parametrize("n,k", list(EXPECTED_KERNELS))
def test_rule_schedules_dynamic_m_matmuls_for_sm90(n, k, cuda):
    func = matmul_prim_func(n, k, "float16").with_attr("target", cuda)
    scheduled = Matmul().apply(func, cuda, False).mod["main"]
    assert [p.name for p in scheduled.params] == [p.name for p in func.params]  # the signature stays
    got = [(_kind(kern), kern.launch["threadIdx.x"], kern.allocs["acc"][2][0] if "acc" in kern.allocs else None)
           for kern in kernels(scheduled)]
    assert got == EXPECTED_KERNELS[(n, k)]


@needs_nvcc
def test_nvcc_compiles_the_scheduled_matmul(cuda):
    from fuselight.cuda_compile import compile_cuda

    func = matmul_prim_func(4096, 14336, "float16").with_attr("target", cuda)
    assert compile_cuda(_cuda_source(Matmul().apply(func, cuda, False).mod["main"], cuda), "sm_90")


gemv = matmul_prim_func(4096, 4096, "float16", m=1)


def test_rule_leaves_gemv_and_cpu_to_the_next_rule(cuda):
    assert analyze_matmul(gemv) is not None  # recognised, but M = 1 is below min_static_m
    assert Matmul().apply(gemv.with_attr("target", cuda), cuda, False) is None
    assert Matmul().apply(matmul_prim_func(4096, 4096, "float16"), tvm.target.Target("llvm"), False) is None


def test_rule_leaves_shapes_no_plan_tiles(cuda):
    # N = 4100 is no multiple of any tile's block_n: the template does not predicate N.
    assert Matmul().apply(matmul_prim_func(4100, 4096, "float16").with_attr("target", cuda), cuda, False) is None
