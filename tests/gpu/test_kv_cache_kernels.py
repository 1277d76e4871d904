"""The GPU tier, KV-cache attention: paged prefill, paged decode and the decode kernel that also does
RoPE and the append, for every head layout of the tier (fp16 and bf16, head dim 64 and 128, GQA
groups 1, 3, 4 and 7), at prime and page-edge lengths, against float64 with outputs (and the appended
K/V rows) poisoned first (``bench.paged_attention``).

Built on the build host by ``fuselight bench paged-build DIR --gpu-tier`` (``DIR/paged-<layout>/``);
point ``FUSELIGHT_GPU_BUILD`` at DIR. The results (pass/fail and error per point and layout) go
beside ``FUSELIGHT_GPU_RESULTS``, as ``<stem>-paged.json``. Skipped where there is no CUDA device or
no such build.
"""

from __future__ import annotations

import json

import pytest
from gpu_tier import BUILD, RESULTS, cuda_available

LAYOUTS = sorted(p.parent.name for p in BUILD.glob("paged-*/manifest.json")) if BUILD and BUILD.is_dir() else []

pytestmark = pytest.mark.skipif(
    not LAYOUTS or not cuda_available(),
    reason="GPU tier: needs a CUDA device and FUSELIGHT_GPU_BUILD (built by 'fuselight bench paged-build DIR --gpu-tier')",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], list[str]]]:
    """Every layout run once: ``layout -> (records, failures)``; all of them written to one results
    file, ``<FUSELIGHT_GPU_RESULTS stem>-paged.json`` (each record's case prefixed by its layout)."""
    from fuselight.bench.paged_attention import run_suite
    from fuselight.bench.results import write_results
    from fuselight.runtime import accept_ptx_from_env

    tmp = tmp_path_factory.mktemp("paged")
    found, records, failures = {}, [], []
    for layout in LAYOUTS:
        out = tmp / f"{layout}.json"
        layout_records = run_suite(BUILD / layout / "manifest.json", out, accept_ptx=accept_ptx_from_env())
        layout_failures = json.loads(out.read_text())["meta"]["failures"]
        found[layout] = layout_records, layout_failures
        records += [{**r, "case": f"{layout}/{r['case']}"} for r in layout_records]
        failures += [f"{layout}/{f}" for f in layout_failures]
    path = RESULTS.with_name(f"{RESULTS.stem}-paged.json") if RESULTS else tmp / "gpu-tests-paged.json"
    write_results(path, records, {"suite": "paged_attention", "layouts": LAYOUTS, "failures": failures})
    return found


@pytest.mark.parametrize("layout", LAYOUTS or ["(no build)"])
def test_layout_matches_float64(layout: str, runs: dict) -> None:
    from fuselight.bench.paged_attention import load_points

    records, failures = runs[layout]
    points = {p.name for p in load_points("gpu")[1]}
    # Every point ran for TVM's kernels and ours: nothing skipped silently.
    for impl in ("baseline", "fuselight"):
        assert {r["case"] for r in records if r["impl"] == impl} == points
    assert [f for f in failures if " fuselight: " in f] == []
