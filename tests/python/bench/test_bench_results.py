"""Benchmarks on the CPU: results schema, timing, suite definitions, the kernel suite and e2e on llvm."""

from __future__ import annotations

import datetime
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from fuselight.bench import kernels, kernels_build, kernels_run, results, timing
from fuselight.errors import FuselightError


def _record(**over):
    base = {
        "suite": "kernels",
        "case": "gemm-4096x4096",
        "shape": {"m": 16, "n": 4096, "k": 4096},
        "impl": "fuselight",
        "metric": "tflops",
        "stats": timing.Stats(median_us=25.0, p10_us=24.0, p90_us=27.5, n=50),
        "nbytes": 33_816_576,
        "flops": 536_870_912,
        "relerr": 1.5e-3,
        "device": "NVIDIA H100 80GB HBM3",
        "tvm_version": "0.26.0",
        "git_commit": "abc123",
        "baseline_source": "mlc-llm@79d603f",
    }
    base.update(over)
    return results.make_record(**base)


def test_results_round_trip(tmp_path):
    recs = [_record(), _record(impl="torch", relerr=None), _record(impl="baseline", relerr=float("nan"))]
    # A 4-bit point: its scheme in the shape; PyTorch's int4 matmul, timed only, says so in a note.
    q4 = {"m": 4, "n": 4096, "k": 4096, "quantization": "q4f16_1"}
    recs.append(_record(impl=results.TORCH_INT4PACK, shape=q4, relerr=None, note="timed only"))
    path = results.write_results(tmp_path / "r" / "out.json", recs, {"suite": "kernels"})
    back = results.read_results(path)
    assert set(back.meta) == {"suite", "measured_at"} and back.meta["suite"] == "kernels"
    # When it was written, in UTC: what the report ranks measurements of the same point by.
    written = datetime.datetime.fromisoformat(back.meta["measured_at"])
    now = datetime.datetime.now(datetime.timezone.utc)
    assert written.utcoffset() == datetime.timedelta(0) and abs((now - written).total_seconds()) < 60
    assert back.records[:2] == recs[:2]
    assert "baseline_source" not in back.records[1]  # torch records carry none
    assert math.isnan(back.records[2]["relerr"])  # a NaN output stays visible, not 'unchecked'
    assert back.records[3] == recs[3] and "baseline_source" not in recs[3] and "note" not in recs[0]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("median_us", -1.0, "field 'median_us' must be a positive number"),
        ("impl", "cublas", "field 'impl' must be one of baseline, fuselight, torch"),
        ("shape", {"m": -2}, "field 'shape' must be an object of non-negative integers"),
        ("bytes", 1.5, "field 'bytes' must be a non-negative integer"),
        ("relerr", -0.1, "field 'relerr' must be a non-negative number or null"),
        ("baseline_source", None, "missing field 'baseline_source'"),
        ("git_commit", None, "missing field 'git_commit'"),
        ("note", "", "field 'note' must be a non-empty string"),
        ("shape", {"m": 4, "quantization": ""}, "field 'shape' must be an object of non-negative integers"),
    ],
)
def test_bad_record_names_record_and_field(tmp_path, field, value, message):
    good = _record()
    bad = dict(good)
    if value is None:
        del bad[field]
    else:
        bad[field] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": results.FORMAT, "meta": {}, "records": [good, bad]}))
    with pytest.raises(FuselightError) as err:
        results.read_results(path)
    assert "bad.json: record 1 (case 'gemm-4096x4096', impl " in str(err.value)
    assert message in str(err.value)


@pytest.fixture
def results_root(tmp_path, monkeypatch):
    """bench/results/ in a temporary directory: where the suites write without -o."""
    root = tmp_path / "bench-results"
    monkeypatch.setattr(results, "results_dir", lambda: root)
    return root


def test_default_path_is_device_folder_and_suite(results_root):
    # The device description's results_folder (configs/targets/devices.json), else the name as a slug.
    assert results.default_path("NVIDIA H100 80GB HBM3", "kernels") == results_root / "h100" / "kernels.json"
    assert results.default_path("NVIDIA RTX A6000 (48 GB)", "e2e-llama-3-8b") == (
        results_root / "nvidia-rtx-a6000-48-gb" / "e2e-llama-3-8b.json"
    )


def test_results_names_of_the_suites():
    from fuselight.bench.e2e import e2e_name
    from fuselight.bench.mlc_e2e import mlc_e2e_name
    from fuselight.config import load

    llama = load("llama-3-8b")
    assert e2e_name(llama, llama.dtype) == "e2e-llama-3-8b"
    assert e2e_name(llama.with_quantization("q4f16_1"), llama.dtype) == "e2e-llama-3-8b-q4f16_1"
    smollm = load("smollm2-135m")  # a bfloat16 preset run in float16 says so
    assert e2e_name(smollm.with_dtype("float16"), smollm.dtype) == "e2e-smollm2-135m-float16"
    q4 = [_record(suite="mlc-e2e", impl=i, shape={"tokens": 128, "quantization": "q4f16_1"}) for i in ("mlc", "mlc+fuselight")]
    assert mlc_e2e_name("llama-3-8b", ["llama-3-8b", "qwen2-2l"], q4) == "mlc-e2e-llama-3-8b-q4f16_1"
    fp16 = [_record(suite="mlc-e2e", impl="mlc", shape={"tokens": 128})]
    assert mlc_e2e_name("llama-3-8b", ["llama-3-8b"], fp16) == "mlc-e2e-llama-3-8b"
    # Not timing the model: named by the cases compared, never the model's file.
    assert mlc_e2e_name("llama-3-8b", ["qwen2-2l", "phi3-2l"], []) == "mlc-e2e-phi3-2l-qwen2-2l"
    assert kernels_run.results_name("full") == "kernels" and kernels_run.results_name("small") == "kernels-small"


def test_merge_keeps_the_points_a_run_did_not_measure(tmp_path):
    old = [_record(impl="baseline"), _record(impl="fuselight"), _record(impl="fuselight", shape={"m": 7, "n": 4096, "k": 4096})]
    path = results.write_results(tmp_path / "k.json", old, {})
    again = _record(impl="fuselight", stats=timing.Stats(median_us=20.0, p10_us=19.0, p90_us=21.0, n=50))
    merged = results.merged_with(path, [again])
    assert merged == [old[0], old[2], again]
    assert results.merged_with(tmp_path / "none.json", [again]) == [again]


def test_bad_results_files(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("[1, 2")
    with pytest.raises(FuselightError, match="not valid JSON"):
        results.read_results(path)
    path.write_text("[1, 2]")
    with pytest.raises(FuselightError, match="r.json: must be a JSON object"):
        results.read_results(path)
    path.write_text(json.dumps({"format": 99, "records": []}))
    with pytest.raises(FuselightError, match="field 'format' must be 1"):
        results.read_results(path)
    with pytest.raises(FuselightError, match="results file not found"):
        results.read_results(tmp_path / "none.json")
    with pytest.raises(FuselightError, match="needs 'tokens'"):
        _record(metric="tokens_per_s")


def test_summarize_and_host_timing():
    stats = timing.summarize([float(v) for v in range(1, 102)])
    assert (stats.median_us, stats.p10_us, stats.p90_us, stats.n) == (51.0, 11.0, 91.0, 101)
    calls = []
    timed = timing.time_host(lambda: calls.append("fn"), warmup=2, repeat=3, setup=lambda: calls.append("setup"))
    assert calls == ["setup", "fn"] * 5  # setup before every call, warm-up calls included
    assert timed.n == 3
    with pytest.raises(FuselightError, match="repeat must be at least 1"):
        timing.time_host(lambda: None, warmup=0, repeat=0)


def test_time_fn_on_cpu_respects_budget():
    cfg = timing.timing_config("cpu")
    stats = timing.time_fn(lambda: sum(range(1000)), device="cpu")
    assert cfg.min_repeat <= stats.n <= cfg.repeat and stats.median_us > 0
    # A call longer than the whole budget is still timed min_repeat times.
    assert timing._budget(10 * cfg.max_seconds, cfg, warmup=5, repeat=50) == (0, cfg.min_repeat)
    with pytest.raises(FuselightError, match="unknown device 'tpu'"):
        timing.time_fn(lambda: None, device="tpu")


def test_full_suite_matches_llama_shapes():
    cases = {c.name: c for c in kernels.load_suite("full")}
    gemms = [c for c in cases.values() if c.op == "gemm" and not c.static]
    assert sorted((c.dims["n"], c.dims["k"]) for c in gemms) == sorted(
        [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    )
    assert all(c.sweep == (1, 2, 4, 8, 16, 17, 33, 64, 128, 255, 256, 512, 1000, 2048, 4095, 4096, 8192) for c in gemms)
    assert {
        "rmsnorm-4096",
        "softmax-4096",
        "softmax-128256-float32",
        "attention-prefill-32x8x128",
        "attention-decode-32x8x128",
    } <= set(cases)
    # Costs: a GEMM reads x and W and writes y (fp16); causal prefill counts half of QK^T and PV.
    assert cases["gemm-4096x4096"].cost(16) == ((16 * 4096 + 4096 * 4096 + 16 * 4096) * 2, 2 * 16 * 4096 * 4096)
    nbytes, flops = cases["attention-prefill-32x8x128"].cost(1024)
    assert flops == 2 * 1024 * 1024 * 128 * 32 and nbytes == (2 * 1024 * 32 * 128 + 2 * 1024 * 8 * 128) * 2
    assert cases["attention-decode-32x8x128"].cost(8192)[0] == (2 * 32 * 128 + 2 * 8192 * 8 * 128) * 2
    assert cases["softmax-128256-float32"].cost(4)[0] == 2 * 4 * 128256 * 4
    # The gate+up projection with silu(gate) * up fused: the M sweep, and decode (M = 1 compiled
    # static) next to the plain GEMV of the same weight; it writes half the GEMM's width.
    fused = cases["gemm-gate-up-silu-28672x4096"]
    assert fused.sweep == gemms[0].sweep and not fused.static
    for name in ("gemm-28672x4096-m1", "gemm-gate-up-silu-28672x4096-m1"):
        assert cases[name].static and cases[name].sweep == (1,) and cases[name].to_dict()["static"]
    assert fused.cost(16)[0] == (16 * 4096 + 28672 * 4096 + 16 * 14336) * 2


def test_full_suite_has_q4_cases_on_the_fp16_shapes():
    """Issue 24: q4f16_1 GEMMs on the same weights over the same M sweep as fp16, and decode's gate+up
    GEMV compiled at M = 1; every record names its scheme in ``shape``."""
    cases = kernels.load_suite("full")
    fp16 = {(c.dims["n"], c.dims["k"]): c.sweep for c in cases if c.op == "gemm" and not c.static}
    q4 = [c for c in cases if c.op == "gemm_q4" and c.scheme is None]
    assert all(c.dtype == "float16" and c.quantization == "q4f16_1" for c in q4)
    assert {(c.dims["n"], c.dims["k"]): c.sweep for c in q4 if not c.static} == fp16
    [decode] = [c for c in q4 if c.static]
    assert (decode.name, decode.sweep) == ("gemm-q4-28672x4096-m1", (1,))
    assert q4[0].shape(7) == {"n": q4[0].dims["n"], "k": q4[0].dims["k"], "m": 7, "quantization": "q4f16_1"}
    assert "quantization" not in next(c for c in cases if c.op == "gemm").shape(7)
    # Packed words (8 nibbles a uint32) and an fp16 scale per 32 weights: 4.5 bits a weight.
    n, k = 28672, 4096
    assert decode.cost(1) == (2 * (k + n) + n * k // 2 + n * k // 32 * 2, 2 * n * k)


def test_full_suite_has_the_kn_decode_gemvs():
    """q4f16_0 (KN layout) GEMVs at M = 1 on Llama-3-8B's decode shapes, named and recorded by scheme."""
    cases = kernels.load_suite("full")
    kn = {c.name: c for c in cases if c.scheme == "q4f16_0"}
    assert {(c.op, c.dims["n"], c.dims["k"], c.sweep, c.static) for c in kn.values()} == {
        ("gemm_q4", n, k, (1,), True) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))}
    case = kn["gemm-q4-4096x14336-q4f16_0-m1"]
    assert case.shape(1) == {"n": 4096, "k": 14336, "m": 1, "quantization": "q4f16_0"}
    assert kernels.case_from_dict(case.to_dict()) == case  # through a manifest
    raw = {"op": "gemm_q4", "n": 64, "k": 64, "dtype": "bfloat16", "sweep": [1]}
    with pytest.raises(FuselightError, match="'quantization' 'q4f16_0' must name a 4-bit scheme computing in bfloat16"):
        kernels.case_from_dict({**raw, "quantization": "q4f16_0"})
    with pytest.raises(FuselightError, match="'quantization'"):
        kernels.case_from_dict({"op": "gemm", "n": 64, "k": 64, "dtype": "float16", "sweep": [1], "quantization": "q4f16_0"})


def test_static_case_needs_one_sweep_value():
    raw = {"op": "gemm_gate_up_silu", "n": 64, "k": 32, "dtype": "float16", "static": True}
    assert kernels.case_from_dict({**raw, "sweep": [3]}).name == "gemm-gate-up-silu-64x32-m3"
    with pytest.raises(FuselightError, match="static"):
        kernels.case_from_dict({**raw, "sweep": [1, 2]})
    with pytest.raises(FuselightError, match="static"):
        kernels.case_from_dict({**raw, "sweep": [1], "static": "yes"})


def test_bad_case_definitions():
    with pytest.raises(FuselightError, match="field 'op' 'conv2d'"):
        kernels.case_from_dict({"op": "conv2d", "dtype": "float16", "sweep": [1]})
    with pytest.raises(FuselightError, match="field 'k' must be a positive integer"):
        kernels.case_from_dict({"op": "gemm", "n": 8, "dtype": "float16", "sweep": [1]})
    with pytest.raises(FuselightError, match="kv_heads .3. must divide q_heads .4."):
        kernels.case_from_dict(
            {"op": "attention_decode", "q_heads": 4, "kv_heads": 3, "head_dim": 8, "dtype": "float16", "sweep": [1]}
        )
    with pytest.raises(FuselightError, match="unknown sweep 'nope'"):
        kernels.case_from_dict({"op": "softmax", "cols": 8, "dtype": "float32", "sweep": "nope"}, sweeps={})
    with pytest.raises(FuselightError, match="unknown kernel case 'gemm-1x1'"):
        kernels.load_suite("small", ["gemm-1x1"])
    with pytest.raises(FuselightError, match="unknown kernel suite 'huge'"):
        kernels.load_suite("huge")


def test_manifest_errors(tmp_path):
    path = tmp_path / "manifest.json"
    with pytest.raises(FuselightError, match="manifest not found"):
        kernels.read_manifest(path)
    path.write_text(
        json.dumps({"format": 1, "cases": [{**kernels.load_suite("small")[0].to_dict(), "libraries": {"tvm": "x.so"}}]})
    )
    with pytest.raises(FuselightError, match="field 'libraries' must map baseline / fuselight"):
        kernels.read_manifest(path)


# A plain GEMM, epilogues (a residual; two outputs: add + RMSNorm), 4-bit weights and attention.
SMALL_CASES = ["gemm-48x64", "gemm-residual-48x64", "gemm-q4-48x64", "add-rmsnorm-64", "attention-prefill-4x2x16"]


def test_gpu_suite_covers_every_family_dtype_head_dim_and_group():
    """The GPU tier's matrix (issue 28): each family in fp16 and bf16; attention at head dim 64 and
    128 and GQA groups 1, 3 and 4, at prime and tile-edge lengths; GQA 32/8, 9/3, 7/1 and 1/1."""
    cases = kernels.load_suite("gpu")
    dtypes = {"float16", "bfloat16"}
    attention = {(c.op, c.dtype, c.dims["head_dim"], c.dims["q_heads"] // c.dims["kv_heads"])
                 for c in cases if c.op.startswith("attention")}
    assert attention >= {(op, dt, d, g) for op in ("attention_prefill", "attention_decode") for dt in dtypes
                         for d in (64, 128) for g in (1, 3, 4)}
    layouts = {(c.dims["q_heads"], c.dims["kv_heads"]) for c in cases if c.op.startswith("attention")}
    assert layouts >= {(32, 8), (9, 3), (7, 1), (1, 1)}
    for c in cases:
        if c.op.startswith("attention"):
            assert {1, 7, 127, 1000} <= set(c.sweep), c.name
    for op in ("gemm", "gemm_q4", "gemm_gate_up_silu", "rmsnorm", "add_rmsnorm"):
        assert {c.dtype for c in cases if c.op == op} >= dtypes, op
    for op in ("gemm", "gemm_q4"):
        for dt in dtypes:
            # M = 1 as the decode shape (static) and within a symbolic M: the row template; 2..16:
            # the GEMV's mma template; above: the GEMM's plans, from the smallest tile to the largest.
            assert any(c.static and c.sweep == (1,) for c in cases if (c.op, c.dtype) == (op, dt))
            swept = set().union(*(c.sweep for c in cases if (c.op, c.dtype) == (op, dt) and not c.static))
            assert {1, 7, 16, 33, 63, 127, 1000, 4095} <= swept, (op, dt)
    assert all(c.quantization == {"float16": "q4f16_1", "bfloat16": "q4bf16_1"}[c.dtype]
               for c in cases if c.op == "gemm_q4" and c.scheme is None)
    # KN (q4f16_0) at M = 1: down's shape and a prime N (the template's narrow loads), and a normed
    # GEMV (the KN template's norm prologue).
    assert {(c.op, c.dims["n"], c.sweep) for c in cases if c.scheme == "q4f16_0"} == {
        ("gemm_q4", 4096, (1,)), ("gemm_q4", 127, (1,)), ("norm_gemm_q4", 1024, (1,))}
    # The norm-prologue GEMVs, float and 4-bit weights; a 4-bit case's records name their scheme too.
    norm_q4 = [c for c in cases if c.op == "norm_gemm_q4"]
    assert {c.dtype for c in cases if c.op == "norm_gemm"} == dtypes and {c.dtype for c in norm_q4} == dtypes
    assert all(c.shape(2)["quantization"] == (c.scheme or {"float16": "q4f16_1", "bfloat16": "q4bf16_1"}[c.dtype])
               for c in norm_q4)
    # A static M of 16 over 6144 x 4096 is the Matmul rule's (min_static_m) and its mma.sync plan.
    assert {c.dtype for c in cases if c.op == "gemm" and c.static and c.sweep == (16,)} == dtypes


@pytest.mark.parametrize("suite", ["gpu", "full"])
def test_every_case_of_a_suite_builds_its_relax_module(suite):
    """Each case's Relax function is constructed (what ``bench build`` compiles): a case kind the
    module builder mishandles fails here, not on the build host (session 19's KN change once broke
    the float ``norm_gemm`` cases of both suites)."""
    for case in kernels.load_suite(suite):
        mod = kernels_build.relax_module(case)
        assert "main" in [gv.name_hint for gv in mod.functions], case.name


@pytest.mark.parametrize("use_mlc", [False, True])
def test_the_baseline_fuses_the_add_rmsnorm_cases(use_mlc):
    """The add + RMSNorm cases are a model's ``[1, rows, hidden]``: MLC-LLM's FuseAddRMSNorm (with
    MLC-LLM present) unpacks three dims and raised on the two-dim form the cases had, and fuselight's
    equivalent skipped it; both fuse it now, as in a model."""
    import tvm
    from fuselight import pipeline
    from fuselight.target import resolve, to_tvm

    if use_mlc and not pipeline.use_mlc_passes():
        pytest.skip("MLC-LLM is not available")
    target = to_tvm(resolve("cuda", "sm_90"))
    (fuse,) = [st.pass_ for st in pipeline.stages(target, use_mlc=use_mlc) if st.name == "FuseAddRMSNorm"]
    cases = [c for c in kernels.load_suite("gpu") if c.op == "add_rmsnorm"]
    assert cases
    for case in cases:
        mod = kernels_build.relax_module(case)
        assert all(len(p.ty.shape.values) == 3 for p in mod["main"].params[:2]), case.name
        with target:
            fused = fuse(mod)
        assert len([gv for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]) == 1, case.name


@pytest.fixture(scope="module")
def small_suite(tmp_path_factory):
    """Small cases built for llvm through the same build path as CUDA, and their run."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("suite")
    manifest = kernels_build.build_suite(out, None, SMALL_CASES, target="llvm", suite="small")
    records = kernels_run.run_suite(manifest, out / "results.json")
    return manifest, records


def test_kernel_suite_on_llvm(small_suite):
    manifest, records = small_suite
    raw, cases = kernels.read_manifest(manifest)
    assert raw["target"] == "llvm" and [c.name for c in cases] == SMALL_CASES
    for entry in raw["cases"]:
        for lib in entry["libraries"].values():
            assert (manifest.parent / lib).is_file() and (manifest.parent / (lib + ".json")).is_file()
    by_name = {c.name: c for c in cases}
    checked = [r for r in records if r["impl"] != results.TORCH_INT4PACK]  # timed only: test_q4_anchors
    expected = [(c.name, n, impl) for c in cases for n in c.sweep for impl in ("baseline", "fuselight", "torch")]
    assert [(r["case"], r["shape"][by_name[r["case"]].spec.sweep_var], r["impl"]) for r in checked] == expected
    tolerance = 0.02
    assert all(r["relerr"] < tolerance for r in checked), [(r["case"], r["impl"], r["relerr"]) for r in checked]
    back = results.read_results(manifest.parent / "results.json")
    assert back.records == records and back.meta["failures"] == []
    gemm = next(r for r in records if r["case"] == "gemm-48x64" and r["shape"]["m"] == 33)
    assert (gemm["bytes"], gemm["flops"]) == ((33 * 64 + 48 * 64 + 33 * 48) * 2, 2 * 33 * 48 * 64)


def test_q4_anchors(small_suite):
    """A 4-bit case: every record names its scheme; torch's anchor is its fp16 GEMM on the dequantized
    weight, checked against float64 as the compiled libraries are; ``_weight_int4pack_mm`` is timed only."""
    manifest, records = small_suite
    q4 = [r for r in records if r["case"] == "gemm-q4-48x64"]
    assert q4 and all(r["shape"]["quantization"] == "q4f16_1" for r in q4)
    torch16 = [r for r in q4 if r["impl"] == "torch"]
    assert [r["shape"]["m"] for r in torch16] == [1, 5] and all(0 < r["relerr"] < 2e-3 for r in torch16)
    errors = results.read_results(manifest.parent / "results.json").meta["anchor_errors"]
    if errors:
        pytest.skip(f"this torch has no int4 matmul on the CPU: {errors[0]}")
    int4 = [r for r in q4 if r["impl"] == results.TORCH_INT4PACK]
    assert [r["shape"]["m"] for r in int4] == [1, 5]
    assert all(r["relerr"] is None and r["note"] == kernels_run.INT4PACK_NOTE and r["median_us"] > 0 for r in int4)
    # Only the 4-bit case gets the anchor.
    assert {r["case"] for r in records if r["impl"] == results.TORCH_INT4PACK} == {"gemm-q4-48x64"}


def test_q4_anchor_missing_is_recorded(small_suite, tmp_path, monkeypatch):
    """An int4 matmul this torch lacks is named in meta.anchor_errors at each point; the rest still runs."""
    manifest, _ = small_suite
    monkeypatch.setitem(kernels_run._INT4PACK_OPS, "cpu", ("_no_such_pack", 1, "_no_such_matmul"))
    records = kernels_run.run_suite(manifest, tmp_path / "r.json", cases=["gemm-q4-48x64"], sweep=[3, 7])
    assert [(r["shape"]["m"], r["impl"]) for r in records] == [
        (m, impl) for m in (3, 7) for impl in ("baseline", "fuselight", "torch")
    ]
    meta = results.read_results(tmp_path / "r.json").meta
    assert meta["failures"] == [] and len(meta["anchor_errors"]) == 2
    assert meta["anchor_errors"][0].startswith("gemm-q4-48x64 m=3 torch-int4pack: ")


def test_kernel_suite_sweep_override(small_suite, tmp_path):
    """--sweep runs other values of a symbolic case's swept dimension (odd and prime ones too)."""
    manifest, _ = small_suite
    records = kernels_run.run_suite(manifest, tmp_path / "r.json", cases=["gemm-48x64"], sweep=[2, 13])
    assert [(r["shape"]["m"], r["impl"]) for r in records] == [
        (m, impl) for m in (2, 13) for impl in ("baseline", "fuselight", "torch")
    ]
    assert all(r["relerr"] < 0.02 for r in records)
    with pytest.raises(FuselightError, match="--sweep"):
        kernels_run.run_suite(manifest, tmp_path / "r.json", cases=["gemm-48x64"], sweep=[0])


def test_kernel_suite_default_output(small_suite, results_root):
    """Without -o the suite writes bench/results/<device>/kernels-<suite>.json; a partial run there
    replaces its points and keeps the others."""
    manifest, _ = small_suite
    full = kernels_run.run_suite(manifest, cases=["gemm-residual-48x64"])
    [path] = results_root.glob("*/kernels-small.json")
    assert results.read_results(path).records == full
    part = kernels_run.run_suite(manifest, cases=["gemm-48x64"], sweep=[5])
    assert [(r["case"], r["impl"]) for r in results.read_results(path).records] == [
        (r["case"], r["impl"]) for r in full + part
    ]
    again = kernels_run.run_suite(manifest, cases=["gemm-48x64"], sweep=[5])
    after = results.read_results(path).records
    assert after[len(full):] == again and after[: len(full)] == full


def test_kernel_suite_records_name_a_ptx_build(small_suite, tmp_path):
    """A suite built as PTX (the manifest says so) is recorded on 'DEVICE (sm_XX PTX)'."""
    from fuselight.bench.timing import device_name

    manifest, _ = small_suite
    raw = json.loads(manifest.read_text())
    # The llvm build's manifest as a PTX build's would read (its libraries, beside it, are loaded alike).
    ptx = manifest.parent / "manifest-ptx.json"
    ptx.write_text(json.dumps({**raw, "arch": "sm_80", "ptx": True}))
    records = kernels_run.run_suite(ptx, tmp_path / "r.json", cases=["gemm-48x64"], sweep=[3])
    assert {r["device"] for r in records} == {f"{device_name('cpu')} (sm_80 PTX)"}
    assert results.read_results(tmp_path / "r.json").meta["ptx"] is True


def test_kernel_suite_flags_wrong_results(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from fuselight.bench import kernels_build

    # A library computing 1.5x RMSNorm must fail the float64 check, not pass silently.
    original = kernels_build._BUILDERS["rmsnorm"]

    def wrong(case, n, relax):
        params, body = original(case, n, relax)
        return params, lambda bb: relax.op.multiply(body(bb), relax.const(1.5, case.dtype))

    monkeypatch.setitem(kernels_build._BUILDERS, "rmsnorm", wrong)
    manifest = kernels_build.build_suite(tmp_path, None, ["rmsnorm-64"], target="llvm", suite="small")
    records = kernels_run.run_suite(manifest, tmp_path / "results.json")
    errors = {r["impl"]: r["relerr"] for r in records if r["shape"]["m"] == 7}
    assert errors["baseline"] == pytest.approx(0.5, rel=0.01) and errors["torch"] < 1e-3
    failures = results.read_results(tmp_path / "results.json").meta["failures"]
    assert len(failures) == 2 * len(kernels.load_suite("small", ["rmsnorm-64"])[0].sweep)


def test_e2e_on_llvm(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from fuselight import compile as fc
    from fuselight.bench.e2e import run_e2e
    from fuselight.config import load
    from fuselight.target import resolve

    try:
        import transformers  # noqa: F401

        with_torch = True
    except ImportError:
        with_torch = False
    config = load("tiny-llama")
    lib = fc.export(fc.build(config, resolve("llvm"), "baseline"), tmp_path / "tiny-baseline.so")
    # The same library as if built at another commit, and as if it carried sm_80 PTX: each
    # implementation's records name their own commit, and the device its library ran as.
    other = tmp_path / "tiny-other.so"
    shutil.copy(lib, other)
    meta = json.loads(Path(f"{lib}.json").read_text())
    Path(f"{other}.json").write_text(json.dumps({**meta, "git_commit": "0123456789ab", "arch": "sm_80", "ptx": True}))
    root = tmp_path / "bench-results"
    monkeypatch.setattr(results, "results_dir", lambda: root)
    records = run_e2e(
        {"baseline": lib, "fuselight": other},
        "tiny-llama",
        torch=with_torch,
        device="cpu",
        prefill_tokens=[7, 20],
        decode_contexts=[9],
        decode_steps=3,
    )
    # Without -o: bench/results/<device>/e2e-<model>.json
    [out] = root.glob("*/e2e-tiny-llama.json")
    impls = ["baseline", "fuselight"] + (["torch"] if with_torch else [])
    cases = ("tiny-llama-prefill", "tiny-llama-prefill", "tiny-llama-decode")
    # Greedy generation is timed for the compiled libraries only.
    assert [(r["impl"], r["case"]) for r in records] == [
        (i, c) for i in impls for c in cases + (("tiny-llama-generate",) if i != "torch" else ())
    ]
    generate_check = results.read_results(out).meta["generate_check"]
    tokens = generate_check["tokens"]
    assert generate_check["agree"] == {"baseline": {"9": tokens}, "fuselight": {"9": tokens}}
    commits = {r["impl"]: r["git_commit"] for r in records}
    assert commits["fuselight"] == "0123456789ab" and commits["baseline"] == meta["git_commit"] != "0123456789ab"
    from fuselight.bench.timing import device_name

    devices = {r["impl"]: r["device"] for r in records}
    assert devices["baseline"] == device_name("cpu") and devices["fuselight"] == f"{device_name('cpu')} (sm_80 PTX)"
    from fuselight.bench.timing import device_name

    devices = {r["impl"]: r["device"] for r in records}
    assert devices["baseline"] == device_name("cpu") and devices["fuselight"] == f"{device_name('cpu')} (sm_80 PTX)"
    # tiny-llama computes in float32: both implementations match the float64 forward pass closely.
    prefill = [r for r in records if r["case"].endswith("prefill")]
    assert all(r["relerr"] < 1e-4 for r in prefill), [(r["impl"], r["relerr"]) for r in prefill]
    assert results.read_results(out).records == records


def test_e2e_decode_interleaves_contexts_in_rounds():
    """Each round prefills every context afresh, so a drift of the host's speed reaches them all."""
    from fuselight.bench.e2e import _Measure
    from fuselight.config import load

    calls = []

    class Runner:
        def reset(self):
            calls.append("reset")

        def prefill(self, ids):
            calls.append(("prefill", len(ids)))

        def decode(self, token):
            calls.append("decode")

    common = {"suite": "e2e", "device": "cpu", "tvm_version": "x", "git_commit": "x", "impl": "torch"}
    measure = _Measure(load("tiny-llama"), Runner(), np.arange(64, dtype=np.int32), lambda: None, common)
    measure.cfg = {**measure.cfg, "decode_rounds": 3, "decode_warmup": 1}
    records = measure.decode([5, 9], 5)
    assert [c for c in calls if c != "decode" and c != "reset"] == [("prefill", 5), ("prefill", 9)] * 3
    # 2 steps a round (5 over 3 rounds, rounded up), each after 1 warm-up step
    assert calls.count("decode") == 3 * 2 * (1 + 2)
    assert [(r["shape"]["context"], r["shape"]["steps"]) for r in records] == [(5, 6), (9, 6)]


def test_e2e_refuses_a_library_of_another_model(tmp_path):
    pytest.importorskip("torch")
    from fuselight.bench.e2e import run_e2e

    lib = tmp_path / "other.so"
    lib.write_bytes(b"")
    (tmp_path / "other.so.json").write_text(json.dumps({"target": "llvm", "model": {"hidden_size": 4096}}))
    with pytest.raises(FuselightError, match="library built for hidden_size=4096"):
        run_e2e(
            {"baseline": lib},
            "tiny-llama",
            tmp_path / "o.json",
            torch=False,
            device="cpu",
            prefill_tokens=[4],
            decode_contexts=[4],
            decode_steps=2,
        )
    with pytest.raises(FuselightError, match="implementation must be one of baseline, fuselight"):
        run_e2e({"torch": lib}, "tiny-llama", tmp_path / "o.json", device="cpu")


def test_relative_error_is_chunked_and_exact():
    torch = pytest.importorskip("torch")
    from fuselight.bench import kernels_run

    rng = np.random.default_rng(1)
    ref = torch.from_numpy(rng.standard_normal((300, 7)))
    out = (ref * (1 + 1e-3)).to(torch.float16)
    expected = float((out.double() - ref).norm() / ref.norm())
    assert kernels_run.relative_error(torch, out, ref) == pytest.approx(expected, rel=1e-12)
    out[5, 3] = float("nan")
    assert math.isnan(kernels_run.relative_error(torch, out, ref))
    with pytest.raises(FuselightError, match="differs from the reference"):
        kernels_run.relative_error(torch, out[:10], ref)


def _committed_devices():
    root = Path(__file__).resolve().parents[3] / "bench" / "results"
    return [d for d in sorted(root.iterdir()) if d.is_dir() and (d / "README.md").is_file()]


@pytest.mark.parametrize("folder", _committed_devices(), ids=lambda d: d.name)
def test_committed_results_follow_the_layout(folder):
    """bench/results/<device>/: every results file valid, measured on that folder's device, dated, and
    listed in the folder's README with its commands; every file the README lists exists."""
    from fuselight.device import results_folder

    readme = (folder / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+\.json)`", readme, flags=re.M))
    listed |= set(re.findall(r"^\| `[^`]+\.json`, `([^`]+\.json)`", readme, flags=re.M))
    files = {p.name for p in folder.glob("*.json")}
    assert listed == files
    for path in sorted(folder.glob("*.json")):
        raw = json.loads(path.read_text())
        if "records" not in raw:
            continue  # a probe's or a tuning evaluation's own format
        res = results.read_results(path)
        datetime.datetime.fromisoformat(res.meta["measured_at"])
        assert {results_folder(r["device"]) for r in res.records} <= {folder.name}, path.name
