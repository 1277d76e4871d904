"""The one sm_XX parser (``fuselight.target.arch_number``) and its users."""

import pytest
from fuselight import cuda_compile, runtime, target
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
    with pytest.raises(FuselightError, match="sm_80 or newer"):
        target.resolve("cuda", "sm_75")
