"""Every rule family on every described arch (``rules/arch_config.py``): the analytic configs of the
unmeasured archs (sm_80, sm_86, sm_89), what the rules claim of our LLaMA there against sm_90, and
the CUDA of those kernels: nvcc compiles it for the arch and it has no Hopper-only instruction.

One pipeline run (phases 1-3 and the rules) per arch and weight format, shared by the tests; one
TVM build and one nvcc per arch. The described archs' runs, builds and nvcc (a minute and a half of
CPU each) go to processes of their own, started by conftest before the first test of the session: in
the whole suite one process on the core that pytest leaves idle, done before these tests run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import re

import pytest
import tvm
from conftest import in_spawned_processes
from fuselight import config, tir_pipeline
from fuselight import pipeline as pl
from fuselight.computations import AttentionSpec, attention_prim_func
from fuselight.cuda_compile import compile_cuda, nvcc_path
from fuselight.device import device_model
from fuselight.errors import FuselightError
from fuselight.model.llama import export_module
from fuselight.model.weights import hf_config
from fuselight.paths import config_dir
from fuselight.rules import fuselight_rules
from fuselight.rules.arch_config import arch_entry, per_sm_counts
from fuselight.rules.flash_attention import FlashAttention
from fuselight.rules.flash.decode import load_decode_config
from fuselight.rules.flash.prefill import load_prefill_config
from fuselight.quant_prim_funcs import q4_linear
from fuselight.rules.gemm import dispatch, estimate
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemm.gemv import load_gemv_configs
from fuselight.rules.gemm.plan import load_tiles
from fuselight.rules.gemm.wgmma import load_wgmma_tiles
from fuselight.rules.reduce.rowwise import load_split_config
from fuselight.target import resolve, to_tvm
from tvm import tirx

UNMEASURED = ("sm_80", "sm_86", "sm_89")
QUANTIZATIONS = (None, "q4f16_1")
# PTX only sm_90 has (wgmma, TMA and its barriers and proxy fence, setmaxnreg, griddepcontrol).
HOPPER_ONLY = re.compile(r"wgmma|cp\.async\.bulk|cp_async_bulk|setmaxnreg|griddepcontrol|expect_tx|fence\.proxy\.async")
# The one fusion that differs: gate/up with SiLU-mul is one matmul with a paired epilogue, which only
# the wgmma template computes; elsewhere it stays a matmul and its SiLU-mul.
WGMMA_ONLY_FUSION = "gate_up_matmul_swiglu"
ATTENTION = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, scale=0.125, causal=True, additive_mask=False,
                          layout="BSHD", dtype="float16", softmax_dtype="float32", same_length=True)


def _model(quantization: str | None) -> config.ModelConfig:
    """One layer at hidden 1024 and head dim 128: every family's kernels (FuseAddRMSNorm needs
    hidden % 1024 == 0, the attention kernels head dim 64 or 128)."""
    raw = {**hf_config(config.load("tiny-llama")), "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 1,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 2000}
    cfg = config.from_dict(raw, name="arch-llama")
    return cfg.with_quantization(quantization) if quantization else cfg.with_dtype("float16")


@functools.lru_cache(maxsize=None)
def _claimed(arch: str, quantization: str | None) -> dict[str, tuple[str, tvm.tirx.PrimFunc]]:
    """PrimFunc name -> (rule family, scheduled kernel) for what fuselight's rules take of the model
    after phase 3 of the fuselight pipeline for ``arch`` (the rules in their phase-4 order)."""
    target = to_tvm(resolve("cuda", arch))
    rules = fuselight_rules()
    mod, _ = export_module(_model(quantization), target)
    with target:
        for stage in pl.stages(target, use_mlc=False, graph_passes=pl.graph_passes(None, rules), rules=rules):
            if stage.phase > 3:
                break
            mod = stage.pass_(mod)
        claimed = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            for rule in rules:
                sch = rule.apply(func, target, False)
                if sch is not None:
                    claimed[gv.name_hint] = (rule.family, sch.mod["main"])
                    break
    return claimed


def _families(claimed: dict[str, tuple[str, object]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, (family, _) in claimed.items():
        out.setdefault(family, set()).add(name)
    return out


def _flash_attention(arch: str) -> tvm.tirx.PrimFunc | None:
    """The flash-attention rule's kernel (prefill, and split-KV decode where Sq is 1 at run time) for
    a fused GQA attention of head dim 64 (what ``passes/fuse_attention`` hands it), or None."""
    target = to_tvm(resolve("cuda", arch))
    func = attention_prim_func(ATTENTION).with_attr("target", target)
    sch = FlashAttention().apply(func, target, False)
    return None if sch is None else sch.mod["main"]


def _cuda_source(arch: str, claimed: dict[str | None, dict[str, tuple[str, tvm.tirx.PrimFunc]]]) -> str:
    """The CUDA of every kernel ``claimed`` for ``arch`` (both weight formats, and the dense flash
    attention), as a build lowers it."""
    target = to_tvm(resolve("cuda", arch))
    funcs = {"flash_attention": _flash_attention(arch).with_attr("global_symbol", "flash_attention")}
    for q in QUANTIZATIONS:
        for name, (_, func) in claimed[q].items():
            symbol = f"{q or 'f16'}_{name}"
            funcs[symbol] = func.with_attr("global_symbol", symbol).with_attr("target", target)
    every_kernel = tir_pipeline.programmatic_launch_supported("cuda", arch)
    exe = tvm.compile(tvm.IRModule(funcs), target=target, tir_pipeline=tir_pipeline.register(every_kernel))
    return exe.mod.imports[0].inspect_source("cuda")


@dataclasses.dataclass(frozen=True)
class _ArchBuild:
    families: dict[str | None, dict[str, set[str]]]  # weight format -> rule family -> PrimFunc names
    source: str  # the CUDA of every claimed kernel
    fatbin_bytes: int | None  # nvcc's output for the arch; None where nvcc is absent


def _build_arch(arch: str) -> _ArchBuild:
    """The pipeline runs, the build and nvcc of one described arch (in a worker process)."""
    claimed = {q: _claimed(arch, q) for q in QUANTIZATIONS}
    source = _cuda_source(arch, claimed)
    fatbin = compile_cuda(source, arch) if nvcc_path() is not None else None
    return _ArchBuild({q: _families(c) for q, c in claimed.items()}, source, None if fatbin is None else len(fatbin))


_BUILDS: dict[str, concurrent.futures.Future] = {}


def start_in_background(alone: bool) -> None:
    """Every described arch's ``_build_arch`` in spawned processes: one after another in one process
    where other tests run too (on the core pytest leaves idle), a process an arch where this module's
    tests are ``alone``. An nvcc error comes back as the test's FuselightError."""
    if _BUILDS:
        return
    _BUILDS.update(in_spawned_processes(_build_arch, UNMEASURED, workers=len(UNMEASURED) if alone else 1))


def _built(arch: str) -> _ArchBuild:
    start_in_background(alone=True)  # where conftest did not start them
    return _BUILDS[arch].result()


@pytest.mark.background
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("arch", UNMEASURED)
def test_every_family_claims_on_every_described_arch_what_it_claims_on_sm90(arch, quantization):
    hopper = _families(_claimed("sm_90", quantization))
    ours = _built(arch).families[quantization]
    families = {"matmul", "gemv", "row_reduction", "rope_append", "paged_attention"}
    assert set(ours) == set(hopper) == families
    assert ours["paged_attention"] == {"fuselight_decode_paged_kv", "fuselight_prefill_paged_kv",
                                       "fuselight_prefill_ragged_kv", "fuselight_rope_append_decode_paged_kv"}
    for family in families - {"matmul"}:
        assert ours[family] == hopper[family], family
    # Matmuls: as many, the one paired gate/up of sm_90 a plain matmul here.
    assert len(ours["matmul"]) == len(hopper["matmul"]) >= 4
    assert not any(WGMMA_ONLY_FUSION in n for n in ours["matmul"])
    assert {n for n in hopper["matmul"] if WGMMA_ONLY_FUSION not in n} <= ours["matmul"]


@pytest.mark.parametrize("arch", UNMEASURED)
def test_flash_attention_claims_the_fused_attention_on_every_described_arch(arch):
    ours, hopper = _flash_attention(arch), _flash_attention("sm_90")
    assert ours is not None and hopper is not None
    assert [p.name for p in ours.params] == [p.name for p in hopper.params]


@pytest.mark.background
@pytest.mark.parametrize("arch", UNMEASURED)
def test_kernels_have_no_hopper_only_instruction_and_nvcc_compiles_them(arch):
    build = _built(arch)
    source = build.source
    assert source.count("__global__") >= 20  # every family's kernels, both weight formats
    assert "mma.sync" in source and "cp.async" in source and "ldmatrix" in source  # sm_80's tensor-core path
    assert HOPPER_ONLY.findall(source) == []
    if build.fatbin_bytes is None:
        pytest.skip("nvcc not installed")
    assert build.fatbin_bytes > 0


def test_the_hopper_pattern_finds_sm90s_instructions():
    """The check above can fail: sm_90's kernels (their TIR, which names the PTX) use wgmma and griddepcontrol."""
    found = {m for _, func in _claimed("sm_90", None).values() for m in HOPPER_ONLY.findall(func.script())}
    assert {"wgmma", "griddepcontrol"} <= found


# --- the analytic configs against the datasheet numbers ------------------------------------------


def test_measured_arch_keeps_its_table_and_others_get_analytic_configs():
    assert estimate.load_dispatch("sm_90").cost_model == "xgboost"  # configs/gemm/dispatch.json
    assert load_decode_config("sm_90").target_blocks == 1056  # the measured value
    for arch in UNMEASURED:
        d = estimate.load_dispatch(arch)
        assert d.cost_model == "analytic" and d.wgmma == {} and d.measured == {}
        assert not load_decode_config(arch).griddepcontrol
    assert load_decode_config("sm_90").griddepcontrol


def test_sm90s_grid_sizes_written_per_sm_resolve_to_its_measured_numbers():
    """The measured sm_90 entries write grid sizes as {"per_sm": k}; over its 132 SMs they are the
    numbers measured: one persistent wgmma block an SM, 8 x 132 decode blocks, 2 x 132 split blocks."""
    assert {t.max_blocks for t in load_wgmma_tiles("sm_90").values()} == {132}
    assert load_decode_config("sm_90").target_blocks == 1056
    split = load_split_config("sm_90")
    assert (split.target_blocks, split.below_rows) == (264, 256)
    m1 = sorted(c.max_blocks for c in load_gemv_configs("sm_90") if c.max_m == 1 and c.max_blocks is not None)
    assert m1 == [128, 256, 256, 256, 256, 256, 528]
    q4, _ = arch_entry(config_dir() / "gemm" / "mma_sync_q4.json", "sm_90", lambda d, t: pytest.fail("measured"))
    assert q4["min_blocks"] == 132 and {t["max_blocks"] for t in q4["wgmma_tiles"].values()} == {132}


def test_a_count_per_sm_needs_a_positive_k_and_a_device():
    assert per_sm_counts(device_model("sm_86"), [{"a": {"per_sm": 3}, "b": 5}], "x") == [{"a": 216, "b": 5}]
    with pytest.raises(FuselightError, match=r"x\[0\]\['a'\]: 'per_sm' must be a positive integer, got 0"):
        per_sm_counts(device_model("sm_86"), [{"a": {"per_sm": 0}}], "x")
    with pytest.raises(FuselightError, match="no device description"):
        per_sm_counts(None, {"a": {"per_sm": 1}}, "x")


@pytest.mark.parametrize("arch,sms,optin_kib", [("sm_80", 108, 163), ("sm_86", 72, 99), ("sm_89", 142, 99)])
def test_analytic_configs_follow_the_device(arch, sms, optin_kib):
    assert device_model(arch).sms == sms and device_model(arch).smem_per_block_optin == optin_kib * 1024
    assert load_decode_config(arch).target_blocks == 8 * sms
    assert load_split_config(arch).target_blocks == 2 * sms
    assert estimate.load_dispatch(arch).sms == sms
    m1 = [c for c in load_gemv_configs(arch) if c.max_m == 1 and c.max_blocks is not None]
    assert sorted({c.max_blocks for c in m1}) == [2 * sms, 4 * sms]
    assert all(c.prefetch_l2_percent is None for c in load_gemv_configs(arch))  # bulk prefetch is sm_90's
    # Prefill's static shared memory is 48 KiB everywhere: Q (64 rows) + K + V of 128 halves a row.
    assert load_prefill_config(arch, 128).tile_kv == 64 and load_prefill_config(arch, 64).tile_kv == 128
    tiles = load_tiles(arch)
    candidates = json.loads((config_dir() / "gemm" / "mma_sync.json").read_text())["analytic"]
    most = {(c["block_m"], c["block_n"], c["block_k"], c["warps_m"], c["warps_n"]): c["stages"]
            for name, c in candidates.items() if not name.startswith("_")}
    for name, t in tiles.items():
        pipeline = t.stages * (t.block_m + t.block_n) * t.block_k * 2
        epilogue = t.block_m * (t.block_n + 8) * 4
        assert max(pipeline, epilogue) <= optin_kib * 1024, name
        # one stage more would not fit (or the shape's most stages are reached)
        shape = (t.block_m, t.block_n, t.block_k, t.warps_m, t.warps_n)
        assert t.stages == most[shape] or (t.stages + 1) * (t.block_m + t.block_n) * t.block_k * 2 > optin_kib * 1024
    # 128 x 256: its fp32 epilogue tile (135168 bytes) fits the A100's 163 KiB, not the 99 KiB of sm_86/89.
    assert ("m128n256k64w2x4s3" in tiles) == (optin_kib == 163)


def test_q4_gemm_ranges_on_every_described_arch():
    ops = analyze_matmul(q4_linear(4096, 4096, m=None), dequant=True).operands
    for arch in UNMEASURED:
        ranges = dispatch.q4_plan_ranges(ops, arch)
        # The largest-M range's 128 x 256 tile fits the A100's 163 KiB only; on sm_86/89 it comes to
        # the 1024 range's 128 x 128 plan, and neighbours with one plan are one range (one kernel).
        wide = device_model(arch).smem_per_block_optin // 1024 == 163
        assert [upper for upper, _ in ranges] == ([64, 256, 1024, 2**31 - 1] if wide else [64, 256, 2**31 - 1]), arch
        assert all(p.main.block_m == bm for (_, p), bm in zip(ranges, (32, 64, 128, 128))), arch
        assert (ranges[-1][1].main.block_n == 256) == wide, arch


def test_undescribed_arch_has_no_config():
    for load in (lambda: load_tiles("sm_75"), lambda: load_decode_config("sm_100"), lambda: estimate.load_dispatch("sm_75")):
        with pytest.raises(FuselightError, match="no device description"):
            load()


def test_a_gemv_prefetch_asked_of_an_arch_without_tma_is_refused(tmp_path, monkeypatch):
    from fuselight.rules.gemm import gemv

    raw = json.loads((config_dir() / "gemm" / "gemv.json").read_text())
    raw["sm_80"] = raw["sm_90"]  # sm_90's measured buckets, one with the L2 bulk prefetch
    (tmp_path / "gemm").mkdir()
    (tmp_path / "gemm" / "gemv.json").write_text(json.dumps(raw))
    monkeypatch.setattr(gemv, "config_dir", lambda: tmp_path)
    with pytest.raises(FuselightError, match="prefetch_l2_percent needs TMA and griddepcontrol, which sm_80 lacks"):
        load_gemv_configs("sm_80")
    assert any(c.prefetch_l2_percent for c in load_gemv_configs("sm_90"))
