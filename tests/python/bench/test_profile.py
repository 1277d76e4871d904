"""Decode-step profile summaries (bench/profile.py): kernel families from configs/bench.json, per-step sums."""

from types import SimpleNamespace

import pytest
from fuselight.bench.profile import (
    OTHER,
    covered,
    device_runs,
    exclusive,
    families,
    family_of,
    host_launches,
    summarize,
)


@pytest.mark.parametrize(
    "kernel, family",
    [
        ("batch_decode_paged_kv_kernel", "attention"),
        ("fuselight_merge_state_kernel", "attention"),
        ("tir_kv_cache_transpose_append_kernel", "kv_append"),
        ("tir_split_rotary_kernel", "rotary"),
        ("fuse_add_norm_prefill_kernel", "norm"),
        ("rms_norm_kernel", "norm"),
        ("fused_split_silu_multiply_kernel", "silu_mul"),
        ("fused_NT_matmul2_cast2_kernel", "gemv"),
        ("something_else_kernel", OTHER),
    ],
)
def test_families_of_llama_decode_kernels(kernel, family):
    assert family_of(kernel, families()) == family


def test_summarize_sums_per_step_by_family_and_kernel():
    table = [("gemv", "matmul"), ("norm", "norm")]
    events = [("NT_matmul_kernel", 300.0, 6), ("NT_matmul1_kernel", 90.0, 3), ("rms_norm_kernel", 12.0, 3),
              ("odd_kernel", 3.0, 3)]
    out = summarize(events, 3, table)
    assert out["families"]["gemv"] == {"us": 130.0, "launches": 3.0}
    assert out["families"]["norm"] == {"us": 4.0, "launches": 1.0}
    assert out["families"][OTHER] == {"us": 1.0, "launches": 1.0}
    assert list(out["families"]) == ["gemv", "norm", OTHER]  # largest first
    assert out["gpu_us"] == 135.0 and out["launches"] == 5.0
    assert out["kernels"]["NT_matmul1_kernel"] == {"family": "gemv", "us": 30.0, "launches": 1.0}


def test_busy_time_counts_overlapping_kernels_once():
    # a merge kernel launched early overlaps the split kernel it waits for; a gap is not busy
    assert covered([(0.0, 10.0), (4.0, 12.0), (20.0, 25.0), (21.0, 22.0)]) == 17.0
    assert covered([]) == 0.0
    out = summarize([("NT_matmul_kernel", 30.0, 3)], 3, [("gemv", "matmul")], busy_us=24.0)
    assert out["busy_us"] == 8.0 and out["gpu_us"] == 10.0
    assert "busy_us" not in summarize([("NT_matmul_kernel", 30.0, 3)], 3, [("gemv", "matmul")])


def test_exclusive_time_counts_an_early_kernel_from_the_end_of_the_one_before():
    # b launched early (waiting from 8 to 10 for a), c after a gap, d inside c: nothing added
    runs = [("a", 0.0, 10.0), ("b", 8.0, 14.0), ("c", 20.0, 25.0), ("d", 21.0, 22.0), ("a", 30.0, 31.0)]
    got = exclusive(runs)
    assert got == {"a": 11.0, "b": 4.0, "c": 5.0, "d": 0.0}
    assert sum(got.values()) == covered([r[1:] for r in runs])
    out = summarize([("a_matmul", 22.0, 2), ("b", 12.0, 2)], 2, [("gemv", "matmul")], exclusive_us={"a_matmul": 20.0, "b": 8.0})
    assert out["families"]["gemv"] == {"us": 11.0, "launches": 1.0, "exclusive_us": 10.0}
    assert out["kernels"]["b"] == {"family": OTHER, "us": 6.0, "launches": 1.0, "exclusive_us": 4.0}


def test_host_launches_count_kernel_and_graph_launches_per_step():
    apis = ["cuLaunchKernelEx", "cudaGraphLaunch"]
    calls = ["cudaGraphLaunch", "cuLaunchKernelEx", "cudaMemcpyAsync", "cuLaunchKernelEx", "cudaStreamWaitEvent"] * 3
    assert host_launches(calls, apis) == 9
    assert host_launches(["cudaMemcpyAsync", "cudaDeviceSynchronize"], apis) is None  # not recorded: no count
    out = summarize([("NT_matmul_kernel", 30.0, 90)], 3, [("gemv", "matmul")], launched_by_host=9)
    assert out["host_launches"] == 3.0 and out["launches"] == 30.0  # a graph launches many kernels for one
    assert "host_launches" not in summarize([("NT_matmul_kernel", 30.0, 3)], 3, [("gemv", "matmul")])


def test_device_runs_keep_the_device_operations_but_the_skipped():
    def event(name, device, start, end):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device),
                               time_range=SimpleNamespace(start=start, end=end))

    prof = SimpleNamespace(events=lambda: [
        event("cudaGraphLaunch", "CPU", 0.0, 2.0), event("Memcpy DtoD (Device -> Device)", "CUDA", 1.0, 2.0),
        event("a_kernel", "CUDA", 3.0, 9.0), event("Memset (Device)", "CUDA", 9.0, 9.5),
    ])
    assert device_runs(prof) == [("Memcpy DtoD (Device -> Device)", 1.0, 2.0), ("a_kernel", 3.0, 9.0),
                                 ("Memset (Device)", 9.0, 9.5)]
    assert device_runs(prof, ("Memcpy", "Memset")) == [("a_kernel", 3.0, 9.0)]
