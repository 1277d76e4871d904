"""The Matmul rule and its dispatcher: which functions it schedules, that the result builds for sm_90
and nvcc compiles it, and that the dispatch ranges come from the config (numerics run on the GPU:
``fuselight tune gemm-run`` and the kernel suite)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics

import pytest
from conftest import needs_nvcc
import tvm
from fuselight.device import device_model
from fuselight.errors import FuselightError
from fuselight.paths import config_dir
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


def test_unmeasured_archs_price_tiles_at_sm90s_measured_mma_sync_fractions():
    """configs/gemm/dispatch.json's analytic efficiencies are the median sustained fraction of sm_90's
    mma.sync peak of each tile in sm_90's measured table (no split-K or rest tile, M >= 4096)."""
    cfg = json.loads((config_dir() / "gemm" / "dispatch.json").read_text())
    peak = device_model("sm_90").fp16_tensor_tflops * cfg["sm_90"]["mma_sync_peak_fraction"] * 1e12
    rows = json.loads((config_dir() / "gemm" / "measured-sm_90.json").read_text())["rows"]
    fractions: dict[str, list[float]] = {}
    for r in rows:
        if r["template"] == "mma_sync" and r["split_k"] == 1 and r["rest_block_m"] == 0 and r["m"] >= 4096:
            fractions.setdefault(r["plan"], []).append(2 * r["m"] * r["n"] * r["k"] / (r["median_us"] * 1e-6) / peak)
    d = estimate.load_dispatch("sm_80")
    assert len(fractions) >= 6 and set(fractions) <= set(d.tiles)  # sm_80 fits every measured tile at its stages
    for tile, values in fractions.items():
        assert d.efficiency[tile] == pytest.approx(statistics.median(values), abs=0.006), tile
    # the 128 x 128 x 64 tile of 4 stages (one block of 4 warps an SM) sustains less than 128 x 256
    assert d.efficiency["m128n128k64w2x2s4"] < d.efficiency["m128n256k64w2x4s3"] - 0.1


@pytest.mark.parametrize("m", [1000, 1024, 1536, 2048])
def test_sm80_prefill_gate_up_takes_the_128x256_tile(m):
    """28672 x 4096 at prefill M on the A100's 108 SMs: 128 x 256 tiles are 112 x ceil(M / 128) blocks
    in whole waves of 108, 128 x 128 x 64 twice as many blocks at 0.47 / 0.58 of the rate; the finer
    waves do not make up for it (by hand: waves x block tensor time)."""
    d = estimate.load_dispatch("sm_80")
    ops = _ops(28672, 4096)
    plan = next(p for upper, p in dispatch.plan_ranges(ops, d) if m <= upper)
    assert plan == estimate.GemmPlan(d.tiles["m128n256k64w2x4s3"])
    small = estimate.GemmPlan(d.tiles["m128n128k64w2x2s4"])
    per_sm = device_model("sm_80").fp16_tensor_tflops * 1e12 / 108

    def by_hand(block_m: int, block_n: int, eff: float) -> float:
        blocks = -(-m // block_m) * (28672 // block_n)
        return -(-blocks // 108) * 2 * block_m * block_n * 4096 / (per_sm * eff)

    hand = by_hand(128, 128, 0.47) / by_hand(128, 256, 0.58)
    priced = estimate.estimate_us(small, m, 28672, 4096, d) / estimate.estimate_us(plan, m, 28672, 4096, d)
    assert hand > 1.05 and priced == pytest.approx(hand, rel=0.02)


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
# configs/gemm/gemv.json's buckets for M <= 1, 8, 16 (the row template's 16 warps; the mma template's
# 16 and 4 warps, 4 floats a lane per 8 tokens; the buckets for M <= 2 and 4 write the M <= 8 kernel,
# one token tile, so they are its range), then dispatch.json's measured
# ranges above 16 (wgmma.json: a warpgroup of 128 threads per consumer plus the producer; a lane holds
# 64 x block_n / 128 floats), each split-K range followed by its reduction.
_GEMV = [("rows", 512, 1), ("mma", 512, 4), ("mma", 128, 8)]
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


@pytest.mark.parametrize("bound,ranges", [(1, 0), (16, 0), (256, 5), (300, 6)])
def test_rule_builds_no_kernel_above_the_bound_its_callers_declare(bound, ranges, cuda):
    # passes.attach_dim_bounds' attribute: seq_len <= bound. Kept: the GEMV buckets and GEMM ranges
    # that some M <= bound reaches (<=48 and <=64 are a kernel and its reduction each).
    from fuselight.contracts import DIM_UPPER_BOUND_ATTR

    func = matmul_prim_func(4096, 4096, "float16").with_attrs({"target": cuda, DIM_UPPER_BOUND_ATTR: {"seq_len": bound}})
    scheduled = Matmul().apply(func, cuda, False).mod["main"]
    gemv = [g for g in _GEMV if g[0] == "rows" or bound > 1]
    got = [(_kind(kern), kern.launch["threadIdx.x"], kern.allocs["acc"][2][0] if "acc" in kern.allocs else None)
           for kern in kernels(scheduled)]
    assert got == gemv + EXPECTED_KERNELS[(4096, 4096)][len(_GEMV):][:ranges]
    asserts = []
    tirx.stmt_functor.post_order_visit(scheduled.body, lambda n: asserts.append(n) if isinstance(n, tirx.AssertStmt) else None)
    assert len(asserts) == 1 and str(asserts[0].condition) == f"seq_len <= T.int64({bound})"
    assert str(asserts[0].error_kind.value) == "ValueError"


def test_the_bound_is_checked_on_the_host(cuda):
    # A larger M would run a kernel built for fewer rows: the host refuses it with the bound's message.
    from fuselight.contracts import DIM_UPPER_BOUND_ATTR

    func = matmul_prim_func(4096, 4096, "float16").with_attrs({"target": cuda, DIM_UPPER_BOUND_ATTR: {"seq_len": 1}})
    lib = tvm.compile(tvm.IRModule({"main": Matmul().apply(func, cuda, False).mod["main"].with_attr("global_symbol", "main")}),
                      target=cuda)
    assert "seq_len is larger than 1, the most this function's callers declare" in lib.mod.inspect_source("ll")


def test_an_unbounded_or_unreached_bound_keeps_every_kernel(cuda):
    from fuselight.contracts import DIM_UPPER_BOUND_ATTR

    func = matmul_prim_func(6144, 4096, "float16").with_attrs({"target": cuda, DIM_UPPER_BOUND_ATTR: {"other": 1}})
    assert len(kernels(Matmul().apply(func, cuda, False).mod["main"])) == len(EXPECTED_KERNELS[(6144, 4096)])
    func = func.with_attr(DIM_UPPER_BOUND_ATTR, {"seq_len": 100000})
    scheduled = Matmul().apply(func, cuda, False).mod["main"]
    assert len(kernels(scheduled)) == len(EXPECTED_KERNELS[(6144, 4096)])
    asserts = []
    tirx.stmt_functor.post_order_visit(scheduled.body, lambda n: asserts.append(n) if isinstance(n, tirx.AssertStmt) else None)
    assert not asserts  # the last range serves every M: nothing to refuse


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
