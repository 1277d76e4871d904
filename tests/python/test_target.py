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
