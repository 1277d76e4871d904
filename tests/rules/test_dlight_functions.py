"""TVM's DLight test functions (``dlight_functions``: PrimFuncs nobody on this project wrote): what
fuselight's rules claim of them on sm_90 they claim on every described arch, and what they claim
builds for the arch (TVM's build to CUDA source, a kernel for each the TIR launches; nvcc is
test_arch_config's, over the same rule families).

The rules are tried in ``fuselight.rules.default``'s order, the first that schedules a function
claiming it, as DLight's ApplyDefaultSchedule does. One scheduling pass a arch, and one build; the
scheduling of the archs only compared by family runs in processes of their own, started by conftest
before the first test of the session (in the whole suite, on the core pytest leaves idle).
"""

from __future__ import annotations

import concurrent.futures
import functools
import re

import pytest
import tvm
from conftest import in_spawned_processes
from dlight_functions import FUNCTIONS
from fuselight import tir_pipeline
from fuselight.rules import fuselight_rules
from fuselight.target import resolve, to_tvm
from tir_query import kernels

UNMEASURED = ("sm_80", "sm_86", "sm_89")
BUILT = "sm_80"  # the arch whose claimed functions are built (below)
COMPARED = tuple(arch for arch in UNMEASURED if arch != BUILT)  # only by family
KERNEL = re.compile(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(")  # its declaration and definition
# Claimed on sm_90 at this commit: the 32000-wide softmax and three RMS norms (row_reduction), three
# fp16 matmuls and two 4-bit ones (matmul), the one-output GEMV (gemv); the rest stay DLight's.
CLAIMED_ON_SM90 = 10


@functools.lru_cache(maxsize=None)
def _claimed(arch: str) -> dict[str, tuple[str, tvm.tirx.PrimFunc]]:
    """Function name -> (family of the first rule that schedules it, its scheduled kernel) on ``arch``."""
    target = to_tvm(resolve("cuda", arch))
    rules = fuselight_rules()
    claimed = {}
    with target:
        for name, func in FUNCTIONS.items():
            for rule in rules:
                sch = rule.apply(func, target, False)
                if sch is not None:
                    claimed[name] = (rule.family, sch.mod["main"])
                    break
    return claimed


def _families_here(arch: str) -> dict[str, str]:
    return {name: family for name, (family, _) in _claimed(arch).items()}


_ELSEWHERE: dict[str, concurrent.futures.Future] = {}


def start_in_background(alone: bool) -> None:
    """``_families_here`` of the archs only compared by family, in spawned processes: one where other
    tests run too, one an arch where these are ``alone``."""
    if _ELSEWHERE:
        return
    _ELSEWHERE.update(in_spawned_processes(_families_here, COMPARED, workers=len(COMPARED) if alone else 1))


def _families(arch: str) -> dict[str, str]:
    if arch not in COMPARED:
        return _families_here(arch)
    start_in_background(alone=True)  # where conftest did not start them
    return _ELSEWHERE[arch].result()


def test_sm90_claims_dlight_functions_of_each_family():
    families = _families("sm_90")
    assert len(families) >= CLAIMED_ON_SM90
    assert {"matmul", "gemv", "row_reduction"} <= set(families.values())


@pytest.mark.background
@pytest.mark.parametrize("arch", UNMEASURED)
def test_what_sm90_claims_every_described_arch_claims(arch):
    assert _families(arch) == _families("sm_90")


# One build: sm_80 lacks every Hopper instruction (sm_86/89 differ from it in sizes only, and
# test_arch_config builds and nvcc-compiles the same rule families for each arch); CI time is tight.
@pytest.mark.parametrize("arch", [BUILT])
def test_the_claimed_functions_build_for_the_arch(arch):
    target = to_tvm(resolve("cuda", arch))
    funcs = {name: func.with_attr("global_symbol", name).with_attr("target", target)
             for name, (_, func) in _claimed(arch).items()}
    every_kernel = tir_pipeline.programmatic_launch_supported("cuda", arch)
    exe = tvm.compile(tvm.IRModule(funcs), target=target, tir_pipeline=tir_pipeline.register(every_kernel))
    assert all(exe.mod.implements_function(name) for name in funcs)
    source = exe.mod.imports[0].inspect_source("cuda")
    assert len(set(KERNEL.findall(source))) == sum(len(kernels(func)) for func in funcs.values())
