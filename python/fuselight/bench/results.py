"""Benchmark results: one record per measurement, in a JSON file with run metadata, validated on read.

File: ``{"format": 1, "meta": {...}, "records": [record, ...]}``. A record names the suite, case,
shape point and implementation, and holds the timing (median/p10/p90 in microseconds), the bytes
and flops the measurement moves and computes (for GB/s and TFLOP/s), the relative error against a
float64 reference (null where none was checked), and where it ran; an optional ``note`` says what a
reader must know of the measurement. ``metric`` says how the report presents it. Compiled impls'
records (baseline, fuselight, mlc, mlc+fuselight) also say where the MLC passes came from.
``meta.measured_at`` (UTC, ISO 8601) says when the file was written; the report takes the newest
measurement of a point by it, not by git.

Where results go by default: ``bench/results/<device folder>/<suite name>.json``, one file per device
and suite, overwritten by each run (history is git's); the device folder is the device description's
``results_folder`` (``fuselight.device.results_folder``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any

from ..compile import PIPELINES
from ..device import results_folder
from ..errors import FuselightError
from ..jsonfile import read_json_object
from ..library import git_commit
from ..paths import results_dir

FORMAT = 1
# MLC-LLM's own models compiled by MLC's pipeline, and with fuselight in it (``fuselight mlc compile``).
MLC_IMPLS = ("mlc", "mlc+fuselight")
# PyTorch's int4 weight-only matmul (``_weight_int4pack_mm``, tinygemm on CUDA): the kernel suite's
# second anchor for 4-bit weights, timed only (another packing and precision), so its relerr is null.
TORCH_INT4PACK = "torch-int4pack"
IMPLS = (*PIPELINES, "torch", TORCH_INT4PACK, *MLC_IMPLS)
METRICS = ("tflops", "gbps", "tokens_per_s", "ms_per_token")
# Compiled impls: their records carry ``baseline_source`` (where the MLC passes came from).
COMPILED_IMPLS = (*PIPELINES, *MLC_IMPLS)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v) and v > 0


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _text(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


# Shape fields that name, rather than count: a quantized record's scheme.
TEXT_SHAPE_FIELDS = ("quantization",)


def _shape(v: Any) -> bool:
    return isinstance(v, dict) and bool(v) and all(
        isinstance(k, str) and (_text(x) if k in TEXT_SHAPE_FIELDS else _count(x)) for k, x in v.items()
    )


# field -> (check, what it must be)
_FIELDS: dict[str, tuple[Any, str]] = {
    "suite": (_text, "a non-empty string"),
    "case": (_text, "a non-empty string"),
    "shape": (_shape, f"an object of non-negative integers (and {', '.join(TEXT_SHAPE_FIELDS)}: a name)"),
    "impl": (lambda v: v in IMPLS, f"one of {', '.join(IMPLS)}"),
    "metric": (lambda v: v in METRICS, f"one of {', '.join(METRICS)}"),
    "median_us": (_positive, "a positive number"),
    "p10_us": (_positive, "a positive number"),
    "p90_us": (_positive, "a positive number"),
    "n": (lambda v: _count(v) and v > 0, "a positive integer"),
    "bytes": (_count, "a non-negative integer"),
    "flops": (_count, "a non-negative integer"),
    # NaN/inf are kept: a kernel that produced NaN must show as such, not as 'unchecked'.
    "relerr": (lambda v: v is None or (_is_number(v) and not v < 0), "a non-negative number or null"),
    "device": (_text, "a non-empty string"),
    "tvm_version": (_text, "a non-empty string"),
    "git_commit": (_text, "a non-empty string"),
}


@dataclasses.dataclass
class Results:
    meta: dict[str, Any]
    records: list[dict[str, Any]]


def validate_record(record: Any, where: str) -> None:
    """FuselightError naming ``where`` (file and record) and the first bad field."""
    if not isinstance(record, dict):
        raise FuselightError(f"{where}: must be an object")
    label = where
    if isinstance(record.get("case"), str) and isinstance(record.get("impl"), str):
        label = f"{where} (case {record['case']!r}, impl {record['impl']!r})"
    for field, (check, what) in _FIELDS.items():
        if field not in record:
            raise FuselightError(f"{label}: missing field {field!r}")
        if not check(record[field]):
            raise FuselightError(f"{label}: field {field!r} must be {what}, got {record[field]!r}")
    if record["metric"] == "tokens_per_s" and "tokens" not in record["shape"]:
        raise FuselightError(f"{label}: field 'shape' needs 'tokens' for metric 'tokens_per_s'")
    if record["impl"] in COMPILED_IMPLS and not _text(record.get("baseline_source")):
        raise FuselightError(f"{label}: missing field 'baseline_source' (required for impl {record['impl']!r})")
    if "note" in record and not _text(record["note"]):
        raise FuselightError(f"{label}: field 'note' must be a non-empty string, got {record['note']!r}")


def default_path(device: str, name: str) -> Path:
    """Where the latest results of suite ``name`` measured on ``device`` (a record's ``device``) go."""
    return results_dir() / results_folder(device) / f"{name}.json"


def point_key(record: dict[str, Any]) -> tuple:
    """What a record measures: (suite, case, shape, impl)."""
    return record["suite"], record["case"], tuple(sorted(record["shape"].items())), record["impl"]


def merged_with(path: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the results file at ``path`` (none if there is no file) whose points ``records``
    does not measure, then ``records``: a partial run updates its points and keeps the others."""
    if not Path(path).is_file():
        return list(records)
    new = {point_key(r) for r in records}
    return [r for r in read_results(path).records if point_key(r) not in new] + list(records)


def write_results(path: Path, records: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """Validate and write ``records`` with ``meta`` (plus ``measured_at``: now, unless ``meta`` has
    one); returns ``path``."""
    path = Path(path)
    for i, record in enumerate(records):
        validate_record(record, f"record {i}")
    meta = {"measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **meta}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT, "meta": meta, "records": records}, indent=1) + "\n")
    return path


def read_results(path: Path) -> Results:
    """Read and validate a results file."""
    path = Path(path)
    raw = read_json_object(path, missing=f"results file not found: {path}")
    if raw.get("format") != FORMAT:
        raise FuselightError(f"{path}: field 'format' must be {FORMAT}, got {raw.get('format')!r}")
    meta, records = raw.get("meta", {}), raw.get("records")
    if not isinstance(meta, dict):
        raise FuselightError(f"{path}: field 'meta' must be an object")
    if not isinstance(records, list):
        raise FuselightError(f"{path}: field 'records' must be a list")
    for i, record in enumerate(records):
        validate_record(record, f"{path}: record {i}")
    return Results(meta=meta, records=records)


def make_record(
    *,
    suite: str,
    case: str,
    shape: dict[str, int | str],
    impl: str,
    metric: str,
    stats: Any,
    nbytes: int,
    flops: int,
    relerr: float | None,
    device: str,
    tvm_version: str,
    git_commit: str,
    baseline_source: str | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """One validated record; ``stats`` is a ``timing.Stats``; ``note`` says what a reader must know
    of the measurement (e.g. that it was timed only)."""
    record = {
        "suite": suite,
        "case": case,
        "shape": dict(shape),
        "impl": impl,
        "metric": metric,
        "median_us": stats.median_us,
        "p10_us": stats.p10_us,
        "p90_us": stats.p90_us,
        "n": stats.n,
        "bytes": int(nbytes),
        "flops": int(flops),
        "relerr": None if relerr is None else float(relerr),
        "device": device,
        "tvm_version": tvm_version,
        "git_commit": git_commit,
    }
    if impl in COMPILED_IMPLS:
        record["baseline_source"] = baseline_source
    if note is not None:
        record["note"] = note
    validate_record(record, f"new record for case {case!r}")
    return record
