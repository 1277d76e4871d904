"""``fuselight report``: one Markdown report with plots over benchmark results.

Input: results files (``bench/results.py``) and GEMM cost-model evaluations (``tuning-*.json``), or
directories of them. Files may measure the same (suite, case, shape, impl) again; the newest record
is used: by its file's ``meta.measured_at`` (a file without one is oldest), then by the order the files
were given in (a directory's files by name). No git is asked: results are data.
``configs/report.json`` maps cases to kernel families and holds the comparisons, device peaks and
the issues' targets.

``report.md``: a summary row per family (per shape point for end to end) with the speed ratios
against the MLC baseline and PyTorch (any implementation present gets its comparisons), the best
figure against the device's peak and the targets; the cost-model evaluations; the logits accuracy
of end-to-end runs; then per family a table of every point and a PNG per case (matplotlib).
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .bench.results import Results, point_key, read_results
from .device import devices
from .errors import FuselightError
from .jsonfile import read_json_object
from .paths import config_dir

UNITS = {"tflops": "TFLOP/s", "gbps": "GB/s", "tokens_per_s": "tok/s", "ms_per_token": "ms/tok"}
LOWER_IS_BETTER = ("ms_per_token",)
REPORT_NAME = "report.md"
TUNING_SUITE = "tuning"
TUNING_FIELDS = ("spearman", "spearman_pooled", "regret_median", "regret_max")
TARGET_QUANTITIES = ("ratio", "metric", "ms")
TARGET_STATS = ("worst", "geomean")


def metric_value(record: dict[str, Any], metric: str | None = None) -> float:
    """The record's figure of merit (or ``metric``, one of ``UNITS``), computed from its median time."""
    seconds = record["median_us"] * 1e-6
    metric = metric or record["metric"]
    if metric == "tflops":
        return record["flops"] / seconds / 1e12
    if metric == "gbps":
        return record["bytes"] / seconds / 1e9
    if metric == "tokens_per_s":
        return record["shape"]["tokens"] / seconds
    return record["median_us"] / 1e3


# --- configuration -----------------------------------------------------------------------------


def _check_target(target: Any, where: str) -> None:
    if not isinstance(target, dict) or not isinstance(target.get("impl"), str):
        raise FuselightError(f"{where}: must be an object with an 'impl'")
    quantity = target.get("quantity", "ratio" if "over" in target else "metric")
    if quantity not in TARGET_QUANTITIES:
        raise FuselightError(f"{where}: 'quantity' must be one of {', '.join(TARGET_QUANTITIES)}, got {quantity!r}")
    if quantity == "ratio" and not isinstance(target.get("over"), str):
        raise FuselightError(f"{where}: a ratio target needs 'over' (the impl it is compared with)")
    if target.get("stat", "worst") not in TARGET_STATS:
        raise FuselightError(f"{where}: 'stat' must be one of {', '.join(TARGET_STATS)}")
    bounds = [k for k in ("at_least", "at_most") if k in target]
    if len(bounds) != 1 or not isinstance(target[bounds[0]], (int, float)):
        raise FuselightError(f"{where}: needs one number 'at_least' or 'at_most'")


def load_config(path: Path | None = None) -> dict[str, Any]:
    """``configs/report.json`` (or ``path``), checked: FuselightError naming the file and field."""
    path = Path(path) if path else config_dir() / "report.json"
    cfg = read_json_object(path, missing=f"report config not found: {path}")
    fields = {"impl_order": list, "subject": str, "comparisons": list, "relabel": dict, "peaks": dict,
              "families": list, "e2e_reference": str, "plot": dict}
    for key, kind in fields.items():
        if not isinstance(cfg.get(key), kind):
            raise FuselightError(f"{path}: field {key!r} must be a JSON {kind.__name__}")
    for i, c in enumerate(cfg["comparisons"]):
        if not isinstance(c, dict) or not all(isinstance(c.get(k), str) for k in ("impl", "over", "label")):
            raise FuselightError(f"{path}: comparisons[{i}] needs strings 'impl', 'over' and 'label'")
    for i, fam in enumerate(cfg["families"]):
        if not isinstance(fam, dict) or not all(isinstance(fam.get(k), str) for k in ("name", "suite", "case")):
            raise FuselightError(f"{path}: families[{i}] needs strings 'name', 'suite' and 'case'")
        if fam.get("figure", "gbps") not in ("tflops", "gbps"):
            raise FuselightError(f"{path}: families[{i}] ({fam['name']}) 'figure' must be tflops or gbps")
        for j, target in enumerate(fam.get("targets", [])):
            _check_target(target, f"{path}: families[{i}] ({fam['name']}) targets[{j}]")
    # The bandwidth peak of a device is its measured copy rate, from the device model.
    for device in devices():
        if device.dram_measured_gbps is not None:
            cfg["peaks"].setdefault(device.name, {})["gbps"] = device.dram_measured_gbps
    return cfg


def impl_order(impls: set[str], cfg: dict[str, Any]) -> list[str]:
    """``impls`` in the configured column order; implementations the config does not name follow, sorted."""
    known = [i for i in cfg["impl_order"] if i in impls]
    return known + sorted(impls - set(known))


# --- tables of points --------------------------------------------------------------------------


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


def table_keys(records: list[dict[str, Any]]) -> list[str]:
    """Columns naming a point: 'case' where the records span several cases, then each case's swept keys."""
    groups = _groups(records)
    keys = ["case"] if len(groups) > 1 else []
    for group in groups.values():
        keys += [k for k in sweep_keys(group) if k not in keys]
    return keys


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


def comparisons_present(impls: Sequence[str], cfg: dict[str, Any], *, summary: bool = False) -> list[dict[str, Any]]:
    """The configured comparisons whose two implementations are both in ``impls``."""
    return [
        c for c in cfg["comparisons"]
        if c["impl"] in impls and c["over"] in impls and (c.get("summary", False) or not summary)
    ]


def case_table(
    records: list[dict[str, Any]], *, relerr: bool = True, cfg: dict[str, Any] | None = None
) -> tuple[list[str], list[list[str]]]:
    """Header and rows for records of one metric: a row per point, in the order of first appearance of
    each case, then by the swept values."""
    cfg = cfg or load_config()
    keys = table_keys(records)
    impls = impl_order({r["impl"] for r in records}, cfg)
    unit = UNITS[records[0]["metric"]]
    case_index = {case: i for i, (_, case) in enumerate(_groups(records))}
    points: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in records:
        point = tuple(case_index[r["case"]] if k == "case" else r["shape"].get(k) for k in keys)
        points.setdefault(point, {})[r["impl"]] = r
    cases = list(case_index)
    ratios = comparisons_present(impls, cfg)
    header = list(keys)
    header += [f"{i} us" for i in impls] + [f"{i} {unit}" for i in impls]
    header += [f"{c['impl']} vs {c['over']}" for c in ratios]
    if relerr:
        header += [f"relerr {i}" for i in impls]
    rows = []
    for point in sorted(points, key=lambda p: tuple((v is None, v) for v in p)):
        by_impl = points[point]
        row = [cases[v] if k == "case" else str(v) for k, v in zip(keys, point)]
        row += [_fmt(by_impl[i]["median_us"]) if i in by_impl else "-" for i in impls]
        row += [_fmt(metric_value(by_impl[i])) if i in by_impl else "-" for i in impls]
        for c in ratios:
            # Speed ratio: over's time / impl's time, so above 1 means impl is faster.
            ok = c["impl"] in by_impl and c["over"] in by_impl
            row.append(_ratio(by_impl[c["over"]]["median_us"] / by_impl[c["impl"]]["median_us"]) if ok else "-")
        if relerr:
            row += [_fmt(by_impl[i]["relerr"]) if i in by_impl else "-" for i in impls]
        rows.append(row)
    return header, rows


def _text_rows(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(header[c]), *(len(r[c]) for r in rows)) for c in range(len(header))]
    return ["  " + "  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *rows]]


def text_table(records: list[dict[str, Any]]) -> str:
    """Plain-text tables for a terminal (no relative errors), one per case."""
    cfg = load_config()
    out = []
    for (suite, case), group in _groups(records).items():
        out.append(f"{suite} / {case}")
        out += _text_rows(*case_table(group, relerr=False, cfg=cfg))
    return "\n".join(out)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


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


# --- inputs and the newest record --------------------------------------------------------------


@dataclasses.dataclass
class Source:
    """One input file: a results file (``results``) or a cost-model evaluation (``tuning``)."""

    path: Path
    results: Results | None = None
    tuning: dict[str, Any] | None = None


def input_files(paths: Sequence[Path]) -> list[tuple[Path, bool]]:
    """The files named, and every ``*.json`` directly in the directories named (sorted by name); each
    with whether it came from a directory (there a JSON that is neither kind is skipped: a probe's)."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                raise FuselightError(f"{path}: no results JSON in this directory")
            files += [(f, True) for f in found]
        elif path.is_file():
            files.append((path, False))
        else:
            raise FuselightError(f"results file not found: {path}")
    return files


def tuning_models(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The cost models an evaluation scored: its entries holding every field of ``TUNING_FIELDS``."""
    return {k: v for k, v in raw.items() if isinstance(v, dict) and all(f in v for f in TUNING_FIELDS)}


def _relabelled(results: Results, names: dict[str, str]) -> Results:
    records = [{**r, "impl": names.get(r["impl"], r["impl"])} for r in results.records]
    meta = dict(results.meta)
    if isinstance(meta.get("accuracy"), dict):
        acc = meta["accuracy"]
        meta["accuracy"] = {**acc, "impls": {names.get(k, k): v for k, v in acc["impls"].items()}}
    return Results(meta=meta, records=records)


def is_source(raw: dict[str, Any]) -> bool:
    """Whether a JSON object claims to be a results file or a cost-model evaluation."""
    return raw.get("suite") == TUNING_SUITE or "format" in raw or "records" in raw


def read_source(path: Path, cfg: dict[str, Any]) -> Source:
    """A results file (validated) or a cost-model evaluation; FuselightError naming the file otherwise."""
    path = Path(path)
    raw = read_json_object(path, missing=f"results file not found: {path}")
    if raw.get("suite") == TUNING_SUITE:
        models = tuning_models(raw)
        if not models:
            raise FuselightError(f"{path}: a tuning evaluation needs a model entry with {', '.join(TUNING_FIELDS)}")
        for name, model in models.items():
            bad = [f for f in TUNING_FIELDS if not isinstance(model[f], (int, float)) or isinstance(model[f], bool)]
            if bad:
                raise FuselightError(f"{path}: {name}.{bad[0]} must be a number, got {model[bad[0]]!r}")
        return Source(path, tuning=raw)
    if not is_source(raw):
        raise FuselightError(
            f"{path}: neither a results file ('format', 'records') nor a tuning evaluation ('suite': 'tuning')"
        )
    results = read_results(path)
    names = cfg["relabel"].get(path.name)
    return Source(path, results=_relabelled(results, names) if names else results)


def measured_at(src: Source) -> float | None:
    """When ``src``'s results were measured (``meta.measured_at``, POSIX seconds); None where unknown."""
    stamp = src.results.meta.get("measured_at") if src.results else None
    if not isinstance(stamp, str):
        return None
    try:
        when = datetime.datetime.fromisoformat(stamp)
    except ValueError:
        raise FuselightError(f"{src.path}: meta.measured_at must be an ISO 8601 time, got {stamp!r}") from None
    return (when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)).timestamp()


def newest_records(sources: Sequence[Source]) -> list[tuple[dict[str, Any], Source]]:
    """Per (suite, case, shape, impl) the newest record and its file: ranked by the file's
    ``measured_at``, then by the order of ``sources`` (later wins); an unknown time ranks oldest."""
    chosen: dict[tuple, tuple[tuple, dict[str, Any], Source]] = {}
    for order, src in enumerate(sources):
        if src.results is None:
            continue
        when = measured_at(src)
        rank = (-math.inf if when is None else when, order)
        for r in src.results.records:
            key = point_key(r)
            if key not in chosen or rank >= chosen[key][0]:
                chosen[key] = (rank, r, src)
    return [(r, src) for _, r, src in chosen.values()]


# --- families and their summary ----------------------------------------------------------------


@dataclasses.dataclass
class Family:
    """A family's config entry, its records and the files they came from (in order)."""

    spec: dict[str, Any]
    records: list[dict[str, Any]]
    files: list[str]


def _in_family(spec: dict[str, Any], record: dict[str, Any]) -> bool:
    if not (fnmatch.fnmatchcase(record["suite"], spec["suite"]) and fnmatch.fnmatchcase(record["case"], spec["case"])):
        return False
    for key, (lo, hi) in spec.get("shape", {}).items():
        value = record["shape"].get(key)
        if value is None or (lo is not None and value < lo) or (hi is not None and value > hi):
            return False
    return True


def group_families(selected: list[tuple[dict[str, Any], Source]], cfg: dict[str, Any]) -> list[Family]:
    """Records by the first configured family they match (else '<suite>: other'), in config order."""
    families = {spec["name"]: Family(spec, [], []) for spec in cfg["families"]}
    for record, src in selected:
        spec = next((s for s in cfg["families"] if _in_family(s, record)), None)
        if spec is None:
            spec = {"name": f"{record['suite']}: other", "suite": record["suite"], "case": "*"}
        family = families.setdefault(spec["name"], Family(spec, [], []))
        family.records.append(record)
        if src.path.name not in family.files:
            family.files.append(src.path.name)
    return [f for f in families.values() if f.records]


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _points(records: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    points: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in records:
        points.setdefault((r["case"], tuple(sorted(r["shape"].items()))), {})[r["impl"]] = r
    return points


def speed_ratios(records: list[dict[str, Any]], impl: str, over: str) -> list[float]:
    """``over``'s time / ``impl``'s time at every point where both ran (above 1: ``impl`` is faster)."""
    return [
        by[over]["median_us"] / by[impl]["median_us"] for by in _points(records).values() if impl in by and over in by
    ]


def _where_holds(target: dict[str, Any], shape: dict[str, int]) -> bool:
    return all(shape.get(k) == v for k, v in target.get("where", {}).items())


def target_value(records: list[dict[str, Any]], target: dict[str, Any]) -> float | None:
    """The figure ``target`` judges over the records where its 'where' holds; None without data."""
    chosen = [r for r in records if _where_holds(target, r["shape"])]
    quantity = target.get("quantity", "ratio" if "over" in target else "metric")
    if quantity == "ratio":
        values = speed_ratios(chosen, target["impl"], target["over"])
    else:
        mine = [r for r in chosen if r["impl"] == target["impl"]]
        values = [metric_value(r) if quantity == "metric" else r["median_us"] / 1e3 for r in mine]
    if not values:
        return None
    if target.get("stat", "worst") == "geomean":
        return geomean(values)
    return min(values) if "at_least" in target else max(values)


def _target_text(target: dict[str, Any], unit: str) -> str:
    quantity = target.get("quantity", "ratio" if "over" in target else "metric")
    bound = "≥" if "at_least" in target else "≤"
    value = target.get("at_least", target.get("at_most"))
    stat = target.get("stat", "worst")
    if quantity == "ratio":
        text = f"{stat} {target['impl']} vs {target['over']} {bound} {_ratio(value)}"
    else:
        text = f"{target['impl']} {bound} {_fmt(value)} {unit if quantity == 'metric' else 'ms'}"
    where = ", ".join(f"{k} {v}" for k, v in target.get("where", {}).items())
    return text + (f" at {where}" if where else "") + (f" ({target['source']})" if target.get("source") else "")


def _value_text(value: float, target: dict[str, Any], unit: str) -> str:
    quantity = target.get("quantity", "ratio" if "over" in target else "metric")
    return _ratio(value) if quantity == "ratio" else f"{_fmt(value)} {unit if quantity == 'metric' else 'ms'}"


def judge(records: list[dict[str, Any]], target: dict[str, Any]) -> tuple[float | None, bool | None]:
    """(achieved value, met) of ``target`` over ``records``; (None, None) without data."""
    value = target_value(records, target)
    if value is None:
        return None, None
    return value, value >= target["at_least"] if "at_least" in target else value <= target["at_most"]


def summary_groups(family: Family) -> list[tuple[str, list[dict[str, Any]]]]:
    """(row label, records) per summary row: the family, or each point for a family with 'point_label'."""
    label = family.spec.get("point_label")
    if not label:
        return [(family.spec["name"], family.records)]
    return [
        (label.format(case=next(iter(by.values()))["case"], **dict(shape)), list(by.values()))
        for (_, shape), by in _points(family.records).items()
    ]


def _ratio_summary(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    if len(ratios) == 1:
        return _ratio(ratios[0])
    return f"{_ratio(geomean(ratios))} ({min(ratios):.2f}–{max(ratios):.2f})"


def best_figure(records: list[dict[str, Any]], cfg: dict[str, Any], figure: str | None = None) -> str:
    """The subject implementation's best figure per metric (or in ``figure``), with the share of the
    device's peak."""
    out = []
    mine = [r for r in records if r["impl"] == cfg["subject"]]
    for metric in dict.fromkeys(figure or r["metric"] for r in mine):
        of_metric = [r for r in mine if (figure or r["metric"]) == metric]
        pick = min if metric in LOWER_IS_BETTER else max
        best = pick(of_metric, key=lambda r: metric_value(r, metric))
        value = metric_value(best, metric)
        text = f"{_fmt(value)} {UNITS[metric]}"
        peak = cfg["peaks"].get(best["device"], {}).get(metric)
        if peak:
            text += f" ({100 * value / peak:.0f}% of {_fmt(peak)})"
        out.append(text)
    return "; ".join(out) or "-"


def summary_table(families: list[Family], cfg: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The summary: a row per family (per point for end to end); a column per summary comparison with data."""
    impls = {r["impl"] for f in families for r in f.records}
    comparisons = [
        c for c in comparisons_present(list(impls), cfg, summary=True)
        if any(speed_ratios(f.records, c["impl"], c["over"]) for f in families)
    ]
    header = ["family", "points", *(f"{c['label']} (geomean, range)" for c in comparisons)]
    header += [f"best {cfg['subject']} (% of peak)", "target", "met", "from"]
    rows = []
    for family in families:
        for label, records in summary_groups(family):
            row = [label, str(len(_points(records)))]
            row += [_ratio_summary(speed_ratios(records, c["impl"], c["over"])) for c in comparisons]
            row.append(best_figure(records, cfg, family.spec.get("figure")))
            targets = family.spec.get("targets", [])
            if "point_label" in family.spec:
                targets = [t for t in targets if _where_holds(t, records[0]["shape"])]
            unit = UNITS[records[0]["metric"]]
            judged = [(t, *judge(records, t)) for t in targets]
            row.append("; ".join(_target_text(t, unit) for t, _, _ in judged) or "-")
            row.append("; ".join(
                "no data" if met is None else f"{'met' if met else 'missed'} ({_value_text(v, t, unit)})"
                for t, v, met in judged
            ) or "-")
            row.append(", ".join(family.files))
            rows.append(row)
    return header, rows


def tuning_table(sources: Sequence[Source]) -> tuple[list[str], list[list[str]]]:
    """A row per cost model of each evaluation: rank correlation and regret of the plan it chooses."""
    header = ["file", "family", "arch", "commit", "protocol", "model", "spearman (median per shape, M)",
              "spearman pooled", "regret median", "regret max", "target", "met"]
    rows = []
    for src in sources:
        if src.tuning is None:
            continue
        raw = src.tuning
        target = raw.get("target") or {}
        for name, m in tuning_models(raw).items():
            checks = [m[k] <= target[k] for k in ("regret_median", "regret_max") if k in target]
            rows.append([
                src.path.name, str(raw.get("family", "-")), str(raw.get("arch", "-")),
                str((raw.get("versions") or {}).get("git_commit", "-")), str(raw.get("protocol", "-")), name,
                f"{m['spearman']:.3f}", f"{m['spearman_pooled']:.3f}",
                f"{100 * m['regret_median']:.1f}%", f"{100 * m['regret_max']:.1f}%",
                " / ".join(f"{k.split('_')[1]} ≤ {100 * v:.0f}%" for k, v in target.items()) or "-",
                "-" if not checks else ("met" if all(checks) else "missed"),
            ])
    return header, rows


# --- plots -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plots:
    """Image file names: per (suite, case), per family (bar charts of single-point cases), end to end."""

    cases: dict[tuple[str, str], str]
    families: dict[str, str]
    e2e: str | None
    note: str | None = None


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(fig: Any, ax: Any, path: Path, cfg: dict[str, Any], plt: Any) -> None:
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=cfg["plot"]["dpi"])
    plt.close(fig)


def _line_plot(group: list[dict[str, Any]], key: str, path: Path, cfg: dict[str, Any], plt: Any) -> None:
    fig, ax = plt.subplots(figsize=(cfg["plot"]["width"], cfg["plot"]["height"]))
    for impl in impl_order({r["impl"] for r in group}, cfg):
        points = sorted((r["shape"][key], metric_value(r)) for r in group if r["impl"] == impl)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
    unit = UNITS[group[0]["metric"]]
    ax.set_xscale("log", base=2)
    ax.set_xlabel(key)
    ax.set_ylabel(unit)
    ax.set_title(f"{group[0]['case']}: {unit} vs {key}", fontsize=10)
    _save(fig, ax, path, cfg, plt)


def _bar_plot(
    labels: list[str], series: dict[str, list[float]], ylabel: str, title: str, path: Path, cfg: dict[str, Any],
    plt: Any,
) -> None:
    """Grouped bars, one colour per implementation, log scale (values span orders of magnitude)."""
    fig, ax = plt.subplots(figsize=(cfg["plot"]["width"], cfg["plot"]["height"]))
    width = 0.8 / len(series)
    for i, (impl, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar([j + offset for j in range(len(labels))], values, width, label=impl)
    ax.set_xticks(range(len(labels)), labels, rotation=25, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    _save(fig, ax, path, cfg, plt)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def make_plots(families: list[Family], out_dir: Path, cfg: dict[str, Any]) -> Plots:
    """A line plot per case with two or more points along one swept dimension; a bar chart per family
    of single-point cases; the end-to-end bar chart (speed over ``e2e_reference``). Without matplotlib:
    none, and a note saying so."""
    plt = _pyplot()
    if plt is None:
        note = "matplotlib is not installed: the report has tables only (pip install matplotlib for plots)"
        print(note)
        return Plots({}, {}, None, note)
    out_dir = Path(out_dir)
    records = [r for f in families for r in f.records]
    cases = {}
    for (suite, case), group in _groups(records).items():
        keys = sweep_keys(group)
        if len(keys) == 1 and len({r["shape"][keys[0]] for r in group}) > 1:
            cases[(suite, case)] = f"{suite}-{case}.png"
            _line_plot(group, keys[0], out_dir / cases[(suite, case)], cfg, plt)
    family_plots = {}
    for family in families:
        groups = _groups(family.records)
        if "point_label" in family.spec or len(groups) < 2 or any(k in cases for k in groups):
            continue
        metric = family.records[0]["metric"]
        keys = [k for k, group in groups.items() if group[0]["metric"] == metric]
        series = {
            impl: [next((metric_value(r) for r in groups[k] if r["impl"] == impl), math.nan) for k in keys]
            for impl in impl_order({r["impl"] for r in family.records}, cfg)
        }
        name = f"family-{_slug(family.spec['name'])}.png"
        _bar_plot([k[1] for k in keys], series, UNITS[metric], family.spec["name"], out_dir / name, cfg, plt)
        family_plots[family.spec["name"]] = name
    e2e = _e2e_chart(families, out_dir, cfg, plt)
    return Plots(cases, family_plots, e2e)


def _e2e_chart(families: list[Family], out_dir: Path, cfg: dict[str, Any], plt: Any) -> str | None:
    ref = cfg["e2e_reference"]
    rows = [
        (label, {r["impl"]: r for r in records})
        for f in families if "point_label" in f.spec
        for label, records in summary_groups(f)
    ]
    rows = [(label, by) for label, by in rows if ref in by]
    if not rows:
        return None
    impls = impl_order({i for _, by in rows for i in by}, cfg)
    series = {
        impl: [by[ref]["median_us"] / by[impl]["median_us"] if impl in by else math.nan for _, by in rows]
        for impl in impls
    }
    name = "e2e.png"
    _bar_plot([label for label, _ in rows], series, f"speed over {ref} (x)", f"end to end: speed over {ref}",
              out_dir / name, cfg, plt)
    return name


# --- the report --------------------------------------------------------------------------------


def _sources_table(sources: Sequence[Source], selected: list[tuple[dict[str, Any], Source]]) -> list[str]:
    used: dict[Path, int] = {}
    for _, src in selected:
        used[src.path] = used.get(src.path, 0) + 1
    rows = []
    for src in sources:
        if src.results is not None:
            commits = ", ".join(sorted({r["git_commit"] for r in src.results.records}))
            kind = f"results ({', '.join(sorted({r['suite'] for r in src.results.records}))})"
            rows.append([src.path.name, kind, str(len(src.results.records)), str(used.get(src.path, 0)), commits])
        else:
            commit = str((src.tuning.get("versions") or {}).get("git_commit", "-"))
            rows.append([src.path.name, f"tuning ({src.tuning.get('family', '-')})", "-", "-", commit])
    return _md_table(["file", "kind", "records", "newest (used)", "commits"], rows)


def markdown(
    sources: Sequence[Source],
    selected: list[tuple[dict[str, Any], Source]],
    families: list[Family],
    cfg: dict[str, Any],
    plots: Plots,
) -> str:
    """The whole report as Markdown; ``selected``: the newest records and their files."""
    selected_records = [r for r, _ in selected]
    lines = ["# fuselight benchmark report", ""]
    if selected_records:
        devices = sorted({r["device"] for r in selected_records})
        versions = sorted({r["tvm_version"] for r in selected_records})
        lines.append(f"Device: {', '.join(devices)}; TVM {', '.join(versions)}.")
        baselines = sorted({r["baseline_source"] for r in selected_records if r.get("baseline_source")})
        if baselines:
            lines.append(f"Baseline passes: {', '.join(baselines)}.")
    lines.append(
        "Times are medians in microseconds. 'A vs B' is B's time over A's (above 1: A is faster); summary ratios "
        "are the geometric mean over the family's points, with the lowest and highest. Where several files "
        "measured the same point, the newest measurement is used (by the time its file records, then by the "
        "order of the files)."
    )
    lines.append("")
    lines += [*_sources_table(sources, selected), ""]
    if families:
        lines += ["## Summary", "", *_md_table(*summary_table(families, cfg)), ""]
        peaks = "; ".join(
            f"{device}: " + ", ".join(f"{_fmt(v)} {UNITS[m]}" for m, v in p.items() if m in UNITS)
            for device, p in cfg["peaks"].items()
        )
        if peaks:
            lines += [f"Peaks: {peaks} (measured copy bandwidth and fp16 matmul through torch).", ""]
        if plots.e2e:
            lines += [f"![end to end]({plots.e2e})", ""]
    if plots.note:
        lines += [f"Plots skipped: {plots.note}.", ""]
    header, rows = tuning_table(sources)
    if rows:
        lines += ["## GEMM cost model (held-out evaluation)", "", *_md_table(header, rows), ""]
    for src in sources:
        accuracy = src.results.meta.get("accuracy") if src.results else None
        if accuracy:
            title, header, rows = accuracy_table(accuracy)
            lines += [f"## {title}: {src.path.name}", "", *_md_table(header, rows), ""]
    for family in families:
        lines += [f"## {family.spec['name']}", "", f"From: {', '.join(family.files)}.", ""]
        for metric in dict.fromkeys(r["metric"] for r in family.records):
            of_metric = [r for r in family.records if r["metric"] == metric]
            lines += [*_md_table(*case_table(of_metric, cfg=cfg)), ""]
        images = [(key[1], plots.cases[key]) for key in _groups(family.records) if key in plots.cases]
        if family.spec["name"] in plots.families:
            images.append((family.spec["name"], plots.families[family.spec["name"]]))
        lines += [f"![{alt}]({name})" for alt, name in images]
        if images:
            lines.append("")
    return "\n".join(lines)


def default_out_dir(paths: Sequence[Path]) -> Path:
    """Where the report goes without ``-o``: ``report/`` in the directory named first, or in the first
    file's directory (``bench/results/**/report/`` is ignored by git: reports are not committed)."""
    first = Path(paths[0])
    return (first if first.is_dir() else first.parent) / "report"


def make_report(paths: Path | Sequence[Path], out_dir: Path | None = None) -> Path:
    """Write ``out_dir/report.md`` (and PNG plots when matplotlib is available) over the results files
    and directories ``paths``; returns its path."""
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    cfg = load_config()
    files = [p for p, from_dir in input_files(paths) if not from_dir or is_source(read_json_object(p, missing=f"results file not found: {p}"))]
    if not files:
        raise FuselightError(f"no results JSON in {', '.join(map(str, paths))}")
    sources = [read_source(p, cfg) for p in files]
    selected = newest_records(sources)
    families = group_families(selected, cfg)
    out_dir = Path(out_dir) if out_dir else default_out_dir(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = make_plots(families, out_dir, cfg)
    path = out_dir / REPORT_NAME
    path.write_text(markdown(sources, selected, families, cfg, plots))
    return path
