"""The GPU tier, kernel suite: GEMMs (fp16 mma.sync and wgmma from the smallest tile to the largest,
q4f16_1 / q4bf16_1), GEMVs (the row and mma templates), gate+up SiLU-mul, RMSNorm and add+RMSNorm,
softmax, flash prefill and split-KV decode (GQA groups 1 to 7, head dim 64 and 128), fp16 and bf16,
run on the GPU against float64, outputs poisoned first (the KV-cache kernels: test_kv_cache_kernels.py).

Runs on the GPU host with the runtime-only TVM, over libraries built on the build host by one
command (``fuselight bench build DIR --suite gpu``: the ``gpu`` suite of ``configs/bench.json``, both
pipelines); point ``FUSELIGHT_GPU_BUILD`` at DIR. Each case is one test: every point of its sweep
(prime and tile-edge sizes) ran for both pipelines, and fuselight's is within the dtype's tolerance
of the float64 reference, with a NaN-poisoned output buffer first (``bench.kernels_run``). The
baseline's errors are recorded, not asserted: MLC's bf16 matmuls accumulate in bf16 (7e-2 at K = 4096). ``FUSELIGHT_GPU_RESULTS``
names a file for the results (pass/fail and error per point), committed beside the benchmarks.
``FUSELIGHT_ACCEPT_PTX=1`` runs a build for an older GPU carried as PTX (``bench build --ptx``) here,
as its proxy. Skipped where there is no CUDA device or no build.
"""

from __future__ import annotations

import pytest
from gpu_tier import BUILD, RESULTS, cuda_available

MANIFEST = BUILD / "manifest.json" if BUILD else None

pytestmark = pytest.mark.skipif(
    MANIFEST is None or not MANIFEST.is_file() or not cuda_available(),
    reason="GPU tier: needs a CUDA device and FUSELIGHT_GPU_BUILD (built by 'fuselight bench build DIR --suite gpu')",
)


def _cases() -> list[str]:
    if MANIFEST is None or not MANIFEST.is_file():
        return ["(no build)"]
    from fuselight.bench.kernels import read_manifest

    return [c.name for c in read_manifest(MANIFEST)[1]]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[list[dict], list[str]]:
    """Every case run once: ``(records, failures)``."""
    import json

    from fuselight.bench.kernels_run import run_suite
    from fuselight.runtime import accept_ptx_from_env

    out = RESULTS or tmp_path_factory.mktemp("gpu") / "gpu-tests.json"
    records = run_suite(MANIFEST, out, accept_ptx=accept_ptx_from_env())
    return records, json.loads(out.read_text())["meta"]["failures"]


@pytest.mark.parametrize("case", _cases())
def test_case_matches_float64(case: str, results: tuple[list[dict], list[str]]) -> None:
    records, failures = results
    from fuselight.bench.kernels import read_manifest

    built = next(c for c in read_manifest(MANIFEST)[1] if c.name == case)
    ours = [r for r in records if r["case"] == case]
    # Every point ran for both pipelines (and PyTorch): nothing skipped silently.
    for impl in ("baseline", "fuselight"):
        assert sorted(r["shape"][built.spec.sweep_var] for r in ours if r["impl"] == impl) == sorted(built.sweep)
    assert [f for f in failures if f.startswith(f"{case} ") and " fuselight: " in f] == []
