"""``fuselight report``: summary, family tables, newest-record selection and plots over synthetic results files."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess

import pytest
from fuselight import report
from fuselight.bench import results, timing
from fuselight.cli import main
from fuselight.errors import FuselightError

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
DEVICE = "NVIDIA H100 80GB HBM3"
N = K = 4096
# Median microseconds of a GEMM 4096x4096 at each M, per implementation: fuselight over the baseline
# 1.2, 2, 8, 1 and over torch 1.1, 0.5, 1, 2 at M = 1, 16, 32, 64.
GEMM_US = {
    1: {"baseline": 24.0, "fuselight": 20.0, "torch": 22.0},
    16: {"baseline": 20.0, "fuselight": 10.0, "torch": 5.0},
    32: {"baseline": 160.0, "fuselight": 20.0, "torch": 20.0},
    64: {"baseline": 40.0, "fuselight": 40.0, "torch": 80.0},
}


def _rec(suite, case, shape, impl, metric, median, nbytes=0, flops=0, relerr=None, commit="abc123"):
    return results.make_record(
        suite=suite,
        case=case,
        shape=shape,
        impl=impl,
        metric=metric,
        stats=timing.Stats(median_us=median, p10_us=median * 0.9, p90_us=median * 1.2, n=20),
        nbytes=nbytes,
        flops=flops,
        relerr=relerr,
        device=DEVICE,
        tvm_version="0.26.0",
        git_commit=commit,
        baseline_source="fuselight-equivalents" if impl != "torch" else None,
    )


def _gemm(m, impl, us, commit="abc123"):
    nbytes = (m * K + N * K + m * N) * 2
    return _rec("kernels", f"gemm-{N}x{K}", {"n": N, "k": K, "m": m}, impl, "tflops", us, nbytes=nbytes,
                flops=2 * m * N * K, relerr=2e-3, commit=commit)


def _e2e_records():
    recs = [
        _rec("e2e", "llama-3-8b-prefill", {"tokens": 1024}, impl, "tokens_per_s", ms * 1e3, relerr=5e-2)
        for impl, ms in (("baseline", 152.0), ("fuselight", 38.0), ("torch", 34.0))
    ]
    recs += [
        _rec("e2e", "llama-3-8b-decode", {"context": 128, "steps": 32}, impl, "ms_per_token", us)
        for impl, us in (("baseline", 6310.0), ("fuselight", 6500.0))
    ]
    return recs


@pytest.fixture
def results_dir(tmp_path):
    """Two results files in one directory: a GEMM sweep and an end-to-end run."""
    d = tmp_path / "results"
    results.write_results(d / "kernels.json", [_gemm(m, i, us) for m, t in GEMM_US.items() for i, us in t.items()], {})
    results.write_results(d / "e2e.json", _e2e_records(), {})
    return d


@pytest.fixture
def no_plots(monkeypatch):
    """Tables only (matplotlib is slow to start and not what these tests check)."""
    monkeypatch.setattr(report, "_pyplot", lambda: None)


def _summary(text):
    """Summary rows of a report by their first cell."""
    table = text.split("## Summary")[1].split("\n\n")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    return rows[0], {r[0]: dict(zip(rows[0], r)) for r in rows[2:]}


def test_metric_values():
    gemm = _rec("kernels", "g", {"m": 128}, "torch", "tflops", 20.0, nbytes=60_000, flops=2 * 128 * 4096 * 4096)
    assert report.metric_value(gemm) == pytest.approx(2 * 128 * 4096 * 4096 / 20e-6 / 1e12)
    assert report.metric_value(gemm, "gbps") == pytest.approx(3.0)
    norm = _rec("kernels", "n", {"m": 8}, "torch", "gbps", 10.0, nbytes=30_000)
    assert report.metric_value(norm) == pytest.approx(3.0)
    prefill = _rec("e2e", "p", {"tokens": 1024}, "torch", "tokens_per_s", 34_000.0)
    assert report.metric_value(prefill) == pytest.approx(1024 / 0.034)
    decode = _rec("e2e", "d", {"context": 128}, "torch", "ms_per_token", 6310.0)
    assert report.metric_value(decode) == pytest.approx(6.31)


def test_summary_rows(results_dir, tmp_path, no_plots):
    text = report.make_report(results_dir, tmp_path / "out").read_text()
    header, rows = _summary(text)
    assert header[2:4] == ["fuselight vs MLC baseline (geomean, range)", "fuselight vs PyTorch (geomean, range)"]
    gemm = rows["GEMM (M >= 16)"]
    # Over the baseline: 2, 8, 1 at M = 16, 32, 64: (2 * 8 * 1) ** (1/3) = 2.52; over torch 0.5, 1, 2: 1.00.
    assert gemm["points"] == "3"
    assert gemm["fuselight vs MLC baseline (geomean, range)"] == "2.52x (1.00–8.00)"
    assert gemm["fuselight vs PyTorch (geomean, range)"] == "1.00x (0.50–2.00)"
    tflops = 2 * 16 * N * K / 10e-6 / 1e12
    assert gemm["best fuselight (% of peak)"] == f"{tflops:.3g} TFLOP/s ({100 * tflops / 757:.0f}% of 757)"
    assert gemm["met"] == "missed (0.50x)" and "≥ 0.70x" in gemm["target"]
    assert gemm["from"] == "kernels.json"
    # M = 1 is the GEMV family, its best figure in GB/s (config 'figure').
    gemv = rows["GEMV / low batch (M < 16)"]
    assert gemv["fuselight vs MLC baseline (geomean, range)"] == "1.20x"
    gbps = (K + N * K + N) * 2 / 20e-6 / 1e9
    assert gemv["best fuselight (% of peak)"] == f"{gbps:.0f} GB/s ({100 * gbps / 3000:.0f}% of 3000)"
    # End to end: a row per point; targets only where their point is.
    prefill = rows["prefill 1024 tokens (llama-3-8b-prefill)"]
    assert prefill["fuselight vs MLC baseline (geomean, range)"] == "4.00x"
    assert prefill["fuselight vs PyTorch (geomean, range)"] == "0.89x"
    assert prefill["met"] == "met (38 ms)" and prefill["from"] == "e2e.json"
    decode = rows["decode at context 128 (llama-3-8b-decode)"]
    assert decode["fuselight vs PyTorch (geomean, range)"] == "-" and decode["met"] == "missed (6.5 ms/tok)"
    assert "mlc" not in " ".join(header)


def test_family_tables(results_dir, tmp_path, no_plots):
    text = report.make_report(results_dir, tmp_path / "out").read_text()
    gemm = text.split("## GEMM (M >= 16)")[1].split("\n## ")[0]
    assert "From: kernels.json." in gemm
    header = (
        "| m | baseline us | fuselight us | torch us | baseline TFLOP/s | fuselight TFLOP/s | torch TFLOP/s | "
        "fuselight vs baseline | fuselight vs torch | baseline vs torch | "
        "relerr baseline | relerr fuselight | relerr torch |"
    )
    assert header in gemm
    tflops = [2 * 32 * N * K / (us * 1e-6) / 1e12 for us in (160.0, 20.0, 20.0)]
    row = (
        f"| 32 | 160 | 20 | 20 | {tflops[0]:.3g} | {tflops[1]:.3g} | {tflops[2]:.3g} | "
        "8.00x | 1.00x | 0.12x | 2.0e-03 | 2.0e-03 | 2.0e-03 |"
    )
    assert row in gemm and "| 1 | 24" not in gemm
    assert gemm.index("| 16 | 20") < gemm.index("| 32 | 160") < gemm.index("| 64 | 40")
    # Only the implementations that ran get columns; no relative error checked: "-".
    decode = text.split("## end to end: decode")[1]
    header = ("| context | steps | baseline us | fuselight us | baseline ms/tok | fuselight ms/tok | "
              "fuselight vs baseline |")
    assert header in decode
    assert "| 128 | 32 | 6310 | 6500 | 6.31 | 6.5 | 0.97x | - | - |" in decode


def test_any_impl_gets_columns():
    """MLC-LLM's own build with and without fuselight: columns and the 'vs MLC's own build' summary."""
    cfg = report.load_config()
    recs = [{**_gemm(64, "baseline", us), "impl": impl} for impl, us in (("mlc", 30.0), ("mlc+fuselight", 20.0))]
    recs += [{**_gemm(64, "baseline", 45.0), "impl": "other-build"}, _gemm(64, "torch", 15.0)]
    family = report.Family(cfg["families"][0], recs, ["mlc.json"])
    header, rows = report.summary_table([family], cfg)
    assert "mlc+fuselight vs MLC's own build (geomean, range)" in header
    assert rows[0][header.index("mlc+fuselight vs MLC's own build (geomean, range)")] == "1.50x"
    assert rows[0][header.index("mlc+fuselight vs PyTorch (geomean, range)")] == "0.75x"
    header, _ = report.case_table(recs, cfg=cfg)
    assert header[3:7] == ["mlc us", "mlc+fuselight us", "torch us", "other-build us"]
    assert "mlc+fuselight vs mlc" in header


def _selected(paths):
    sources = [report.read_source(p, report.load_config()) for p in paths]
    return {(r["shape"]["m"], r["impl"]): (r["median_us"], src.path.name) for r, src in report.newest_records(sources)}


def test_newest_record_by_measured_at_then_order(tmp_path):
    # The record of the later measurement wins though its file comes first; points only the older file has stay.
    a = results.write_results(tmp_path / "a.json", [_gemm(16, "fuselight", 10.0)], {"measured_at": "2026-01-02T00:00:00+00:00"})
    b_records = [_gemm(16, "fuselight", 30.0), _gemm(32, "fuselight", 20.0)]
    b = results.write_results(tmp_path / "b.json", b_records, {"measured_at": "2026-01-02T01:00:00+02:00"})
    assert _selected([a, b]) == {(16, "fuselight"): (10.0, "a.json"), (32, "fuselight"): (20.0, "b.json")}
    # Time zones count: 23:00 at UTC-2 is after a's midnight UTC (01:00 at UTC+2 above was before it).
    b = results.write_results(b, b_records, {"measured_at": "2026-01-01T23:00:00-02:00"})
    assert _selected([a, b])[(16, "fuselight")] == (30.0, "b.json")
    # A file without a time (written before files had one) ranks oldest.
    c = tmp_path / "c.json"
    c.write_text(json.dumps({"format": results.FORMAT, "meta": {}, "records": [_gemm(16, "fuselight", 40.0)]}))
    assert _selected([a, c])[(16, "fuselight")] == (10.0, "a.json")
    bad = results.write_results(tmp_path / "bad.json", b_records, {"measured_at": "yesterday"})
    with pytest.raises(FuselightError, match="bad.json: meta.measured_at must be an ISO 8601 time, got 'yesterday'"):
        _selected([a, bad])


def test_newest_record_at_the_same_time_is_the_later_file(tmp_path):
    same = {"measured_at": "2026-01-01T00:00:00+00:00"}
    a = results.write_results(tmp_path / "a.json", [_gemm(16, "fuselight", 10.0, "unknown")], same)
    b = results.write_results(tmp_path / "b.json", [_gemm(16, "fuselight", 30.0, "unknown")], same)
    assert _selected([a, b])[(16, "fuselight")] == (30.0, "b.json")
    assert _selected([b, a])[(16, "fuselight")] == (10.0, "a.json")


def test_report_needs_no_git(results_dir, tmp_path, monkeypatch, no_plots):
    # Results are data: the report starts no process (no git) to rank them.
    def no_process(*args, **kwargs):
        raise AssertionError(f"the report started a process: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    text = report.make_report(results_dir, tmp_path / "out").read_text()
    assert "## GEMM (M >= 16)" in text


def test_bad_files_are_named(results_dir, tmp_path):
    bad = results_dir / "zz-bad.json"
    bad.write_text('{"format": 1, "meta": {}, "records": [{"suite": "kernels"}]}')
    with pytest.raises(FuselightError, match=r"zz-bad.json: record 0: missing field 'case'"):
        report.make_report(results_dir, tmp_path / "out")
    # In a directory, a JSON that is neither kind (a probe's) is skipped; named, it is an error.
    bad.write_text('{"anything": 1}')
    assert "zz-bad.json" not in report.make_report(results_dir, tmp_path / "out").read_text()
    with pytest.raises(FuselightError, match=r"zz-bad.json: neither a results file"):
        report.make_report([results_dir / "kernels.json", bad], tmp_path / "out")
    bad.write_text('{"suite": "tuning", "xgboost": {"spearman": 0.9, "spearman_pooled": 0.9, '
                   '"regret_median": 0, "regret_max": "high"}}')
    with pytest.raises(FuselightError, match=r"zz-bad.json: xgboost.regret_max must be a number"):
        report.make_report(results_dir, tmp_path / "out")
    bad.write_text("{")
    with pytest.raises(FuselightError, match=r"zz-bad.json: not valid JSON"):
        report.make_report(results_dir, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FuselightError, match="empty: no results JSON in this directory"):
        report.make_report(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "probe.json").write_text('{"cases": []}')
    with pytest.raises(FuselightError, match="no results JSON in .*probes"):
        report.make_report(tmp_path / "probes", tmp_path / "out")


def test_bad_config_is_named(tmp_path):
    cfg = json.loads((report.config_dir() / "report.json").read_text())
    cfg["families"][0]["targets"] = [{"impl": "fuselight", "over": "torch"}]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(FuselightError, match=r"report.json: families\[0\] .* needs one number 'at_least' or 'at_most'"):
        report.load_config(path)


def test_tuning_summary(results_dir, tmp_path, no_plots):
    evaluation = {"suite": "tuning", "family": "gemm", "arch": "sm_90", "versions": {"git_commit": "fef8f6c"},
                  "protocol": "leave-one-shape-out", "target": {"regret_median": 0.05, "regret_max": 0.15}}
    evaluation["xgboost"] = {"spearman": 0.956, "spearman_pooled": 0.993, "regret_median": 0.0, "regret_max": 0.071}
    evaluation["analytic"] = {"spearman": 0.683, "spearman_pooled": 0.973, "regret_median": 0.0, "regret_max": 0.289}
    (results_dir / "tuning-gemm-sm_90.json").write_text(json.dumps(evaluation))
    text = report.make_report(results_dir, tmp_path / "out").read_text()
    assert "| tuning-gemm-sm_90.json | gemm | sm_90 | fef8f6c | leave-one-shape-out | xgboost | 0.956 | 0.993 | " \
           "0.0% | 7.1% | median ≤ 5% / max ≤ 15% | met |" in text
    assert "| analytic | 0.683 | 0.973 | 0.0% | 28.9% | median ≤ 5% / max ≤ 15% | missed |" in text


def test_plots(results_dir, tmp_path, capsys):
    out = tmp_path / "out"
    text = report.make_report(results_dir, out).read_text()
    if HAS_MATPLOTLIB:
        png = out / f"kernels-gemm-{N}x{K}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # The case's plot under both families it spans; the end-to-end chart under the summary.
        assert text.count(f"![gemm-{N}x{K}](kernels-gemm-{N}x{K}.png)") == 2
        assert "![end to end](e2e.png)" in text and (out / "e2e.png").is_file()
        # One point along the sweep: nothing to plot.
        assert not (out / "e2e-llama-3-8b-prefill.png").exists()
    else:
        assert "matplotlib is not installed" in capsys.readouterr().out
        assert not list(out.glob("*.png")) and "![" not in text


# A q4f16_1 GEMM 28672x4096 at M = 1, 4, 8: median microseconds per implementation.
Q4_US = {
    1: {"baseline": 90.0, "fuselight": 30.0, "torch": 96.0, results.TORCH_INT4PACK: 42.0},
    4: {"baseline": 100.0, "fuselight": 25.0, "torch": 100.0, results.TORCH_INT4PACK: 40.0},
    8: {"baseline": 110.0, "fuselight": 40.0, "torch": 96.0, results.TORCH_INT4PACK: 32.0},
}


def _q4(m, impl, us):
    n, k = 28672, 4096
    nbytes = (m * k + n * k // 4 + n * k // 32 + m * n) * 2
    return _rec("kernels", f"gemm-q4-{n}x{k}", {"n": n, "k": k, "m": m, "quantization": "q4f16_1"}, impl, "tflops",
                us, nbytes=nbytes, flops=2 * m * n * k, relerr=None if impl == results.TORCH_INT4PACK else 2e-3)


def test_q4_cases_against_baseline_torch_and_int4pack(tmp_path, no_plots):
    """Issue 24's kernel-suite comparisons: ratios to the baseline, torch fp16 and _weight_int4pack_mm;
    M = 1 and M = 2..16 are their own families, the latter judged by the issue's targets."""
    recs = [_q4(m, impl, us) for m, t in Q4_US.items() for impl, us in t.items()]
    text = report.text_table(recs)
    header, *rows = text.splitlines()[1:]
    columns = header.split()
    for ratio in ("fuselight vs baseline", "fuselight vs torch", "fuselight vs torch-int4pack"):
        assert ratio in header
    m4 = rows[1].split()
    assert m4[0] == "4" and m4[1:5] == ["100", "25", "100", "40"] and m4[-4:-1] == ["4.00x", "4.00x", "1.60x"]
    assert columns[:5] == ["m", "baseline", "us", "fuselight", "us"]
    d = tmp_path / "results"
    results.write_results(d / "kernels.json", recs, {})
    header, summary = _summary(report.make_report(d, tmp_path / "out").read_text())
    assert "fuselight vs PyTorch's int4 matmul (timed only) (geomean, range)" in header
    decode = summary["4-bit GEMV, decode (M = 1)"]
    assert decode["points"] == "1" and decode["fuselight vs PyTorch's int4 matmul (timed only) (geomean, range)"] == "1.40x"
    low = summary["4-bit GEMV, low batch (M = 2..16)"]
    # Over torch 4.0 and 2.4 at M = 4, 8: geomean 3.10 (met), worst 2.4 (missed); over int4pack 1.6, 0.8 (missed).
    assert low["met"] == "met (3.10x); missed (2.40x); missed (0.80x)"


def test_text_table_for_terminal(results_dir):
    text = report.text_table(results.read_results(results_dir / "kernels.json").records)
    lines = text.splitlines()
    assert lines[0] == f"kernels / gemm-{N}x{K}"
    assert "relerr" not in text and "8.00x" in text


def test_cli_report(results_dir, tmp_path, capsys, no_plots):
    assert main(["report", str(results_dir)]) == 0
    assert (results_dir / "report" / report.REPORT_NAME).is_file()
    (results_dir / "report" / report.REPORT_NAME).unlink()
    # Named files: report/ beside the first, never the report among the results.
    assert main(["report", str(results_dir / "e2e.json")]) == 0
    assert (results_dir / "report" / report.REPORT_NAME).is_file() and not (results_dir / report.REPORT_NAME).exists()
    files = [str(results_dir / "e2e.json"), str(results_dir / "kernels.json")]
    assert main(["report", *files, "-o", str(tmp_path / "cli")]) == 0
    assert "## GEMM (M >= 16)" in (tmp_path / "cli" / report.REPORT_NAME).read_text()
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "results file not found" in capsys.readouterr().err


def test_accuracy_section(results_dir, tmp_path, no_plots):
    data = results.read_results(results_dir / "e2e.json")
    accuracy = {
        "prompt": 32,
        "decode_steps": 2,
        "impls": {
            "baseline": {"vs_float64": [3e-3, 2e-3, 4e-3], "vs_torch": [1e-3, 1e-3, 2e-3]},
            "torch": {"vs_float64": [1.5e-3, 1.7e-3, 1.6e-3]},
        },
    }
    results.write_results(results_dir / "e2e.json", data.records, {"accuracy": accuracy})
    text = report.make_report(results_dir, tmp_path / "acc").read_text()
    assert "32-token prefill, then 2 decode steps" in text and "e2e.json" in text
    assert "| baseline | float64 | 3.00e-03 | 2.00e-03 | 4.00e-03 | 4.00e-03 |" in text
    assert "| torch | float64 | 1.50e-03 | 1.70e-03 | 1.60e-03 | 1.70e-03 |" in text
    assert "| torch | torch |" not in text
    assert report.accuracy_text(accuracy).splitlines()[0].startswith("Logits accuracy")
    assert math.isclose(report.geomean([2.0, 8.0, 1.0]), 16 ** (1 / 3))
