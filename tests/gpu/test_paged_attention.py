"""The GPU tier, KV-cache attention: paged prefill, paged decode and the decode kernel that also does
RoPE and the append, for every head layout of the tier (fp16 and bf16, head dim 64 and 128, GQA
groups 1, 3, 4 and 7), at prime and page-edge lengths, against float64 with outputs (and the appended
K/V rows) poisoned first (``bench.paged_attention``).

Built on the build host by ``fuselight bench paged-build DIR --gpu-tier`` (``DIR/paged-<layout>/``);
point ``FUSELIGHT_GPU_BUILD`` at DIR. Each layout's results go beside ``FUSELIGHT_GPU_RESULTS``
(``<stem>-paged-<layout>.json``). Skipped where there is no CUDA device or no such build.
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
def runs() -> dict:
    """Each layout run once, when first asked for: ``layout -> (records, failures)``."""
    return {}


def _run(layout: str, runs: dict, tmp_path_factory) -> tuple[list[dict], list[str]]:
    from fuselight.bench.paged_attention import run_suite

    if layout not in runs:
        folder = RESULTS.parent if RESULTS else tmp_path_factory.mktemp("gpu")
        stem = RESULTS.stem if RESULTS else "gpu-tests"
        out = folder / f"{stem}-{layout}.json"
        records = run_suite(BUILD / layout / "manifest.json", out)
        runs[layout] = records, json.loads(out.read_text())["meta"]["failures"]
    return runs[layout]


@pytest.mark.parametrize("layout", LAYOUTS or ["(no build)"])
def test_layout_matches_float64(layout: str, runs: dict, tmp_path_factory) -> None:
    from fuselight.bench.paged_attention import load_points

    records, failures = _run(layout, runs, tmp_path_factory)
    points = {p.name for p in load_points("gpu")[1]}
    # Every point ran for TVM's kernels and ours: nothing skipped silently.
    for impl in ("baseline", "fuselight"):
        assert {r["case"] for r in records if r["impl"] == impl} == points
    assert [f for f in failures if " fuselight: " in f] == []
