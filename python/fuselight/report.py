"""``fuselight report``: Markdown tables and plots from a benchmark results file.

One table per suite and case: a row per shape point, implementations side by side (median time,
TFLOP/s, GB/s, tokens/s or ms/token as the record's metric says), speed ratios against PyTorch and
the baseline, and the relative error against the float64 reference. With matplotlib installed, a
PNG per case plots the metric against the swept dimension for each implementation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .bench.results import IMPLS, Results, read_results

UNITS = {"tflops": "TFLOP/s", "gbps": "GB/s", "tokens_per_s": "tok/s", "ms_per_token": "ms/tok"}
REPORT_NAME = "report.md"


def metric_value(record: dict[str, Any]) -> float:
    """The record's figure of merit, computed from its median time."""
    seconds = record["median_us"] * 1e-6
    metric = record["metric"]
    if metric == "tflops":
        return record["flops"] / seconds / 1e12
    if metric == "gbps":
        return record["bytes"] / seconds / 1e9
    if metric == "tokens_per_s":
        return record["shape"]["tokens"] / seconds
    return record["median_us"] / 1e3


def _groups(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["suite"], r["case"]), []).append(r)
    return groups


def sweep_keys(records: list[dict[str, Any]]) -> list[str]:
    """Shape keys whose value changes across ``records`` (all keys when none does)."""
    keys = list(records[0]["shape"])
    varying = [k for k in keys if len({r["shape"].get(k) for r in records}) > 1]
    return varying or keys


def _fmt(value: float | None) -> str:
    """Three significant digits; scientific below 0.01; "-" for no value."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:.0f}"
    if value == 0 or abs(value) >= 0.01:
        return f"{value:.3g}"
    return f"{value:.1e}"


def _ratio(value: float) -> str:
    return f"{value:.2f}x" if value >= 0.01 else f"{value:.1e}x"


def case_table(records: list[dict[str, Any]], *, relerr: bool = True) -> tuple[list[str], list[list[str]]]:
    """Header and rows for one case's records: a row per shape point."""
    keys = sweep_keys(records)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    unit = UNITS[records[0]["metric"]]
    points: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in records:
        points.setdefault(tuple(r["shape"].get(k) for k in keys), {})[r["impl"]] = r
    ratios = [
        (a, b)
        for a, b in (("baseline", "torch"), ("fuselight", "torch"), ("fuselight", "baseline"))
        if a in impls and b in impls
    ]
    header = list(keys)
    header += [f"{i} us" for i in impls] + [f"{i} {unit}" for i in impls]
    header += [f"{a} vs {b}" for a, b in ratios]
    if relerr:
        header += [f"relerr {i}" for i in impls]
    rows = []
    for point in sorted(points, key=lambda p: tuple((v is None, v) for v in p)):
        by_impl = points[point]
        row = [str(v) for v in point]
        row += [_fmt(by_impl[i]["median_us"]) if i in by_impl else "-" for i in impls]
        row += [_fmt(metric_value(by_impl[i])) if i in by_impl else "-" for i in impls]
        for a, b in ratios:
            # Speed ratio: b's time over a's time, so above 1 means a is faster.
            ok = a in by_impl and b in by_impl
            row.append(_ratio(by_impl[b]["median_us"] / by_impl[a]["median_us"]) if ok else "-")
        if relerr:
            row += [_fmt(by_impl[i]["relerr"]) if i in by_impl else "-" for i in impls]
        rows.append(row)
    return header, rows


def _text_rows(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(header[c]), *(len(r[c]) for r in rows)) for c in range(len(header))]
    return ["  " + "  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *rows]]


def text_table(records: list[dict[str, Any]]) -> str:
    """Plain-text tables for a terminal (no relative errors), one per case."""
    out = []
    for (suite, case), group in _groups(records).items():
        out.append(f"{suite} / {case}")
        out += _text_rows(*case_table(group, relerr=False))
    return "\n".join(out)


def accuracy_table(accuracy: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """(title, header, rows) of the e2e logits check: each impl's relative error at every step."""
    steps = ["prefill"] + [f"decode {i + 1}" for i in range(accuracy["decode_steps"])]
    title = (
        f"Logits accuracy: {accuracy['prompt']}-token prefill, then {accuracy['decode_steps']} decode steps "
        "(relative error of the last-position logits)"
    )
    header = ["impl", "against", *steps, "max"]
    rows = []
    for impl, entry in accuracy["impls"].items():
        for against in ("float64", "torch"):
            errs = entry.get(f"vs_{against}")
            if errs:
                rows.append([impl, against, *(f"{e:.2e}" for e in errs), f"{max(errs):.2e}"])
    return title, header, rows


def accuracy_text(accuracy: dict[str, Any]) -> str:
    title, header, rows = accuracy_table(accuracy)
    return "\n".join([title, *_text_rows(header, rows)])


def markdown(results: Results, plots: dict[tuple[str, str], str] | None = None) -> str:
    """The whole report as Markdown; ``plots`` maps (suite, case) to an image file name."""
    records = results.records
    lines = ["# fuselight benchmark report", ""]
    if records:
        first = records[0]
        lines.append(f"Device: {first['device']}; TVM {first['tvm_version']}; commit {first['git_commit']}.")
        sources = sorted({r["baseline_source"] for r in records if r.get("baseline_source")})
        if sources:
            lines.append(f"Baseline passes: {', '.join(sources)}.")
        lines.append("Times are medians in microseconds; 'A vs B' is B's time over A's (above 1: A is faster).")
        lines.append("")
    if results.meta.get("accuracy"):
        title, header, rows = accuracy_table(results.meta["accuracy"])
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows] + [""]
    for (suite, case), group in _groups(records).items():
        header, rows = case_table(group)
        lines += [f"## {suite}: {case}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        if plots and (suite, case) in plots:
            lines += ["", f"![{case}]({plots[(suite, case)]})"]
        lines.append("")
    return "\n".join(lines)


def _plot(group: list[dict[str, Any]], key: str, path: Path, title: str, plt: Any) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in IMPLS:
        points = sorted((r["shape"][key], metric_value(r)) for r in group if r["impl"] == impl)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(key)
    ax.set_ylabel(UNITS[group[0]["metric"]])
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def make_plots(results: Results, out_dir: Path) -> dict[tuple[str, str], str]:
    """A PNG per case with two or more points along one swept dimension; {} without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: the report has tables only (pip install matplotlib for plots)")
        return {}
    plots = {}
    for (suite, case), group in _groups(results.records).items():
        keys = sweep_keys(group)
        if len(keys) != 1 or len({r["shape"][keys[0]] for r in group}) < 2:
            continue
        name = f"{suite}-{case}.png"
        _plot(group, keys[0], Path(out_dir) / name, f"{case}: {UNITS[group[0]['metric']]} vs {keys[0]}", plt)
        plots[(suite, case)] = name
    return plots


def make_report(results: Path, out_dir: Path) -> Path:
    """Write ``out_dir/report.md`` (and PNG plots when matplotlib is available); returns its path."""
    data = read_results(Path(results))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = make_plots(data, out_dir)
    path = out_dir / REPORT_NAME
    path.write_text(markdown(data, plots))
    return path
