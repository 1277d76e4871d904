"""``fuselight report``: tables and plots from a synthetic results file."""

from __future__ import annotations

import importlib.util

import pytest
from fuselight import report
from fuselight.bench import results, timing
from fuselight.cli import main
from fuselight.errors import FuselightError

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# Median microseconds of a GEMM 4096x4096 at each M, per implementation.
GEMM_US = {
    1: {"baseline": 24.0, "fuselight": 20.0, "torch": 22.0},
    128: {"baseline": 80.0, "fuselight": 40.0, "torch": 20.0},
}


def _rec(suite, case, shape, impl, metric, median, nbytes=0, flops=0, relerr=None):
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
        device="NVIDIA H100 80GB HBM3",
        tvm_version="0.26.0",
        git_commit="abc123",
        baseline_source="fuselight-equivalents" if impl != "torch" else None,
    )


@pytest.fixture
def results_file(tmp_path):
    recs = []
    for m, times in GEMM_US.items():
        for impl, us in times.items():
            recs.append(
                _rec(
                    "kernels",
                    "gemm-4096x4096",
                    {"m": m, "n": 4096, "k": 4096},
                    impl,
                    "tflops",
                    us,
                    nbytes=(m * 4096 * 2 + 4096 * 4096) * 2,
                    flops=2 * m * 4096 * 4096,
                    relerr=2e-3,
                )
            )
    for impl, ms in (("baseline", 152.0), ("torch", 34.0)):
        recs.append(_rec("e2e", "llama-3-8b-prefill", {"tokens": 1024}, impl, "tokens_per_s", ms * 1e3, relerr=5e-2))
    recs.append(_rec("e2e", "llama-3-8b-decode", {"context": 128, "steps": 32}, "baseline", "ms_per_token", 6310.0))
    return results.write_results(tmp_path / "results.json", recs, {})


def test_metric_values():
    gemm = _rec("kernels", "g", {"m": 128}, "torch", "tflops", 20.0, flops=2 * 128 * 4096 * 4096)
    assert report.metric_value(gemm) == pytest.approx(2 * 128 * 4096 * 4096 / 20e-6 / 1e12)
    norm = _rec("kernels", "n", {"m": 8}, "torch", "gbps", 10.0, nbytes=30_000)
    assert report.metric_value(norm) == pytest.approx(3.0)
    prefill = _rec("e2e", "p", {"tokens": 1024}, "torch", "tokens_per_s", 34_000.0)
    assert report.metric_value(prefill) == pytest.approx(1024 / 0.034)
    decode = _rec("e2e", "d", {"context": 128}, "torch", "ms_per_token", 6310.0)
    assert report.metric_value(decode) == pytest.approx(6.31)


def test_markdown_tables(results_file, tmp_path):
    path = report.make_report(results_file, tmp_path / "out")
    text = path.read_text()
    assert "## kernels: gemm-4096x4096" in text and "## e2e: llama-3-8b-prefill" in text
    header = (
        "| m | baseline us | fuselight us | torch us | baseline TFLOP/s | fuselight TFLOP/s | torch TFLOP/s | "
        "baseline vs torch | fuselight vs torch | fuselight vs baseline | "
        "relerr baseline | relerr fuselight | relerr torch |"
    )
    assert header in text
    # M=128: fuselight 40 us is 2x the baseline's speed and half of torch's.
    tflops = [2 * 128 * 4096 * 4096 / (us * 1e-6) / 1e12 for us in (80.0, 40.0, 20.0)]
    row = (
        f"| 128 | 80 | 40 | 20 | {tflops[0]:.3g} | {tflops[1]:.3g} | {tflops[2]:.3g} | "
        "0.25x | 0.50x | 2.00x | 2.0e-03 | 2.0e-03 | 2.0e-03 |"
    )
    assert row in text
    assert text.index("| 1 | 24") < text.index("| 128 | 80")  # rows in sweep order
    # e2e: tokens/s, and only the implementations that ran get columns.
    assert "| tokens | baseline us | torch us | baseline tok/s | torch tok/s | baseline vs torch |" in text
    assert f"| 1024 | 152000 | 34000 | {1024 / 0.152:.0f} | {1024 / 0.034:.0f} | 0.22x |" in text
    assert "| 128 | 32 | 6310 | 6.31 | 2.0e-03" not in text and "| 128 | 32 | 6310 | 6.31 | - |" in text


def test_plots(results_file, tmp_path, capsys):
    out = tmp_path / "out"
    report.make_report(results_file, out)
    text = (out / report.REPORT_NAME).read_text()
    if HAS_MATPLOTLIB:
        png = out / "kernels-gemm-4096x4096.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "![gemm-4096x4096](kernels-gemm-4096x4096.png)" in text
        # One point along the sweep: nothing to plot.
        assert not (out / "e2e-llama-3-8b-prefill.png").exists()
    else:
        assert "matplotlib is not installed" in capsys.readouterr().out
        assert not list(out.glob("*.png")) and "![" not in text


def test_text_table_for_terminal(results_file):
    text = report.text_table(results.read_results(results_file).records)
    lines = text.splitlines()
    assert lines[0] == "kernels / gemm-4096x4096"
    assert "relerr" not in text and "2.00x" in text


def test_cli_report(results_file, tmp_path, capsys):
    assert main(["report", str(results_file), "-o", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / report.REPORT_NAME).is_file()
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "results file not found" in capsys.readouterr().err


def test_bad_results_are_refused(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"format": 1, "meta": {}, "records": [{"suite": "kernels"}]}')
    with pytest.raises(FuselightError, match="record 0: missing field 'case'"):
        report.make_report(path, tmp_path)


def test_accuracy_section(results_file, tmp_path):
    data = results.read_results(results_file)
    accuracy = {
        "prompt": 32,
        "decode_steps": 2,
        "impls": {
            "baseline": {"vs_float64": [3e-3, 2e-3, 4e-3], "vs_torch": [1e-3, 1e-3, 2e-3]},
            "torch": {"vs_float64": [1.5e-3, 1.7e-3, 1.6e-3]},
        },
    }
    path = results.write_results(tmp_path / "acc.json", data.records, {"accuracy": accuracy})
    text = report.make_report(path, tmp_path / "acc").read_text()
    assert "32-token prefill, then 2 decode steps" in text
    assert "| baseline | float64 | 3.00e-03 | 2.00e-03 | 4.00e-03 | 4.00e-03 |" in text
    assert "| torch | float64 | 1.50e-03 | 1.70e-03 | 1.60e-03 | 1.70e-03 |" in text
    assert "| torch | torch |" not in text
    assert report.accuracy_text(accuracy).splitlines()[0].startswith("Logits accuracy")
