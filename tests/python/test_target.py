"""The one sm_XX parser (``fuselight.target.arch_number``) and its users."""

import pytest
from fuselight import cuda_compile, runtime, target
from fuselight.device import device_model
from fuselight.errors import FuselightError


def test_arch_number_parses_sm_xx_and_refuses_the_rest():
    assert target.arch_number("sm_90") == target.arch_number("sm_90a") == 90
    assert target.arch_number("sm_100") == 100
    for bad in ("", "sm90", "compute_90", "sm_9", None):
        with pytest.raises(FuselightError, match="unsupported arch"):
            target.arch_number(bad)
    assert runtime.arch_number is cuda_compile.arch_number is target.arch_number


def test_gencode_and_resolve_use_it():
    assert cuda_compile.gencode("sm_90") == "arch=compute_90a,code=sm_90a"
    assert cuda_compile.gencode("sm_80") == "arch=compute_80,code=sm_80"
    with pytest.raises(FuselightError, match="unsupported arch"):
        cuda_compile.gencode("gfx90a")
    with pytest.raises(FuselightError, match="unsupported arch"):
        target.resolve("cuda", "gfx90a")


def test_ptx_build_names_the_virtual_architecture():
    # PTX alone: nvcc's "code" is the virtual architecture, so the fatbin holds no machine code.
    assert cuda_compile.gencode("sm_80", ptx=True) == "arch=compute_80,code=compute_80"
    assert cuda_compile.gencode("sm_89", ptx=True) == "arch=compute_89,code=compute_89"
    assert cuda_compile.gencode("sm_90", ptx=True) == "arch=compute_90a,code=compute_90a"
    spec = target.resolve("cuda", "sm_86", ptx=True)
    assert (spec.arch, spec.ptx, spec.name) == ("sm_86", True, "cuda-sm_86-ptx")
    assert target.resolve("cuda", "sm_86").ptx is False
    with pytest.raises(FuselightError, match="--ptx applies to cuda targets only"):
        target.resolve("llvm", ptx=True)


@pytest.mark.parametrize(
    "built,device,runs",
    [
        ("sm_80", "sm_90", True), ("sm_86", "sm_89", True), ("sm_89", "sm_90", True), ("sm_80", "sm_80", True),
        ("sm_89", "sm_86", False),  # PTX of a newer GPU than this one
        ("sm_90", "sm_90", True), ("sm_90", "sm_100", False),  # compute_90a is sm_90's alone
    ],
)
def test_ptx_runs_on_its_arch_and_newer(built, device, runs):
    assert cuda_compile.ptx_runs_on(built, device) is runs


@pytest.mark.parametrize("arch,sms", [("sm_80", 108), ("sm_86", 72), ("sm_89", 142), ("sm_90", 132)])
def test_described_archs_resolve_with_their_device_model(arch, sms):
    spec = target.resolve("cuda", arch)
    device = device_model(arch)
    assert spec.described and device.sms == sms  # the A100, A10, L40S and H100 datasheets
    # TVM's limit is the static one (DLight's shared memory is static), 48 KiB on every arch.
    assert spec.options["max_shared_memory_per_block"] == device.smem_per_block == 49152
    assert device.smem_per_block_optin > device.smem_per_block


def test_an_undescribed_arch_resolves_but_is_not_described():
    spec = target.resolve("cuda", "sm_75")
    assert spec.arch == "sm_75" and not spec.described
    assert spec.options["max_shared_memory_per_block"] == 49152 and "_doc" not in spec.options
    assert device_model("sm_75") is None and device_model("sm_100") is None
