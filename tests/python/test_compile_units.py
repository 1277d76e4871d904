"""CUDA kernels over several compilation units (``fuselight.compile_units``): each kernel in exactly one
unit, each unit a CUDA module of its own that nvcc compiles, and a model's kernels the same code as
from one unit."""

import re

import pytest
from conftest import require_nvcc
import tvm
from fuselight import tir_pipeline
from fuselight.compile import build
from fuselight.compile_units import TAG_PREFIX, assign_compile_units, unit_count
from fuselight.cuda_compile import compile_cuda
from fuselight.library import cuda_sources
from fuselight.config import load
from fuselight.target import resolve, to_tvm
from test_forked_passes import CUDA, _lowering_input
from tvm.tirx.build import split_host_device_mods, tir_to_runtime

_KERNEL = re.compile(r'^extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(.*\{$', re.M)


def kernel_definitions(source: str) -> dict[str, str]:
    """Each kernel's definition in a CUDA source, by name (TVM emits them one after another, last)."""
    starts = list(_KERNEL.finditer(source))
    return {m.group(1): source[m.start():(starts[i + 1].start() if i + 1 < len(starts) else len(source))].rstrip()
            for i, m in enumerate(starts)}


@pytest.mark.parametrize("statements,units", [(0, 1), (100, 1), (101, 2), (250, 3), (10**6, 4)])
def test_unit_count(statements, units):
    assert unit_count(statements, unit_statements=100, max_units=4) == units


def test_each_kernel_in_one_unit_and_each_unit_a_module_nvcc_compiles():
    lowering, finalize_host, finalize = tvm.tirx.get_tir_pipeline(tir_pipeline.register())
    with CUDA:
        lowered = lowering(_lowering_input())
    split = assign_compile_units(unit_statements=1, max_units=3)(lowered)
    tags = {gv.name_hint: f.attrs["target"].tag for gv, f in split.functions.items()}
    kernels = {gv.name_hint for gv, f in lowered.functions.items() if f.attrs["target"].kind.name == "cuda"}
    assert len(kernels) == 5
    assert {tags[k] for k in kernels} == {f"{TAG_PREFIX}{i}" for i in range(3)}
    assert all(tags[n] == "" for n in tags if n not in kernels)  # host functions keep their target
    host, devices = split_host_device_mods(split)  # as TVM's build does next: a module per target
    assert len(devices) == 3
    sources = cuda_sources(tir_to_runtime(finalize_host()(host), {t: finalize()(d) for t, d in devices.items()}, CUDA.host))
    assert len(sources) == 3
    found = [set(kernel_definitions(src)) for src in sources]
    assert set().union(*found) == kernels and sum(map(len, found)) == len(kernels)
    require_nvcc()
    for src in sources:
        compile_cuda(src, arch="sm_90")


@pytest.mark.slow
def test_a_models_kernels_are_the_same_code_in_units(monkeypatch):
    """tiny-llama for sm_90 in three units: they hold its kernels, each defined as in one unit."""
    from fuselight import compile_units
    from fuselight.compile import lower, pipeline_pass
    from fuselight.model.llama import export_module

    monkeypatch.setattr(compile_units, "unit_count", lambda *_: 3)
    spec = resolve("cuda", "sm_90")
    config = load("tiny-llama").with_dtype("float16")
    units = cuda_sources(build(config, spec, "fuselight", cuda_graph=False).executable)
    target = to_tvm(spec)
    mod, _ = export_module(config, target)
    _, one = lower(mod, target, pipeline_pass("fuselight", target, {"seq_len": 2048}, None), programmatic_launch=True)
    (whole,) = cuda_sources(one)
    assert len(units) == 3
    split = {}
    for src in units:
        split.update(kernel_definitions(src))
    assert split == kernel_definitions(whole)
