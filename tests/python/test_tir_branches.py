"""Lowering one host-side branch at a time (``fuselight.tir_branches``) and the TIR pipeline that uses
it: the same passes as TVM's s_tir lowering, the same lowered IR and CUDA as lowering whole functions,
and the whole-function lowering where the branches do not fit back together."""

from __future__ import annotations

import re
from typing import Any

import pytest
import tvm
from fuselight import tir_branches, tir_pipeline
from fuselight.rules.matmul import Matmul
from fuselight.target import resolve, to_tvm
from fuselight.tune.gemm import matmul_prim_func
from tvm import s_tir, tirx
from tvm.script import tirx as T

CUDA = to_tvm(resolve("cuda", "sm_90"))
_KERNEL = re.compile(r"__global__ void [^;{]*\{")  # a kernel's definition, not its declaration
# Pass names of the containers around the passes (TVM's and ours), not passes that lower.
_CONTAINERS = {"sequential", "_pipeline", "fuselight.Lowering", "fuselight.PerBranch", "fuselight.CSEGuardedLowering"}


@pytest.fixture(scope="module")
def gemm() -> tirx.PrimFunc:
    """A dynamic-M GEMM (N = K = 256) as the Matmul rule schedules it: GEMV buckets, mma.sync and
    wgmma plans, each behind an ``if`` on M."""
    func = matmul_prim_func(256, 256, "float16").with_attr("target", CUDA)
    return Matmul().apply(func, CUDA, False).mod["main"].with_attr("global_symbol", "main")


@T.macro
def _double(a, out, n, rows):
    for bx in T.thread_binding((rows + 63) // 64, thread="blockIdx.x"):
        for tx in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("row"):
                T.reads()
                T.writes()
                t = T.sblock_alloc_buffer((2,), scope="local")
                for j in range(2):
                    t[j] = T.if_then_else(bx * 64 + tx < n, a[bx * 64 + tx], T.float32(0)) * T.float32(j + 1)
                if bx * 64 + tx < n:
                    out[bx * 64 + tx] = t[1]


@T.prim_func(s_tir=True)
def _three_branches(var_a: T.handle, var_out: T.handle):
    """``out = 2 a`` for ``n`` rows: one kernel (a local buffer, a block per 64 rows) behind each
    branch of an ``if`` chain on ``n``, as a dynamic-M kernel of ours."""
    n = T.int32()
    a = T.match_buffer(var_a, (n,), "float32")
    out = T.match_buffer(var_out, (n,), "float32")
    if T.tvm_thread_invariant(n <= 64):
        _double(a, out, n, 64)
    elif T.tvm_thread_invariant(n <= 192):
        _double(a, out, n, 192)
    else:
        _double(a, out, n, n)


@T.prim_func(s_tir=True)
def _one_kernel(var_a: T.handle, var_out: T.handle):
    n = T.int32()
    a = T.match_buffer(var_a, (n,), "float32")
    out = T.match_buffer(var_out, (n,), "float32")
    _double(a, out, n, n)


def _names(pipeline: Any, mod: tvm.IRModule) -> list[str]:
    """The passes ``pipeline`` runs over ``mod``, by name, in order."""
    names: list[str] = []

    @tvm.instrument.pass_instrument
    class Record:
        def run_before_pass(self, _mod: Any, info: Any) -> None:
            if info.name not in _CONTAINERS:
                names.append(info.name)

    with tvm.transform.PassContext(opt_level=3, instruments=[Record()]), CUDA:
        pipeline(mod)
    return names


def _bound(func: tirx.PrimFunc) -> tvm.IRModule:
    return tirx.transform.BindTarget(CUDA.with_host("llvm"))(tvm.IRModule({"main": func}))


def test_our_lowering_runs_tvms_passes_in_tvms_order(gemm):
    mod = _bound(gemm)
    assert tir_branches.branch_count(gemm) >= 5
    ours = _names(tvm.tirx.get_tir_pipeline(tir_pipeline.register())[0], mod)
    tvms = _names(tvm.tirx.get_tir_pipeline("s_tir")[0], mod)
    assert ours == tvms and "s_tir.CompactBufferAllocation" in ours and "tirx.CommonSubexprElim" in ours


def test_gemm_lowered_branch_by_branch_gives_tvms_cuda(gemm):
    mod = tvm.IRModule({"main": gemm})
    tvms = tvm.compile(mod, target=CUDA, tir_pipeline="s_tir").mod.imports[0].inspect_source("cuda")
    ours = tvm.compile(mod, target=CUDA, tir_pipeline=tir_pipeline.register()).mod.imports[0].inspect_source("cuda")
    assert ours == tvms and len(_KERNEL.findall(tvms)) >= tir_branches.branch_count(gemm)


def _lowered_whole_and_by_branch(passes: list[Any]) -> tuple[tvm.IRModule, tvm.IRModule, list[int]]:
    """``_three_branches`` through ``passes`` whole and through ``per_branch(passes)``, and how many
    functions the first pass saw in the second run."""
    seen: list[int] = []

    @tvm.instrument.pass_instrument
    class Count:
        def run_before_pass(self, mod: Any, info: Any) -> None:
            if info.name == passes[0].info.name:
                seen.append(len(mod.functions))

    mod = _bound(_three_branches)
    with tvm.transform.PassContext(opt_level=3), CUDA:
        whole = tvm.ir.transform.Sequential(passes)(mod)
    with tvm.transform.PassContext(opt_level=3, instruments=[Count()]), CUDA:
        by_branch = tir_branches.per_branch(passes)(mod)
    return whole, by_branch, seen


def test_branch_count():
    assert tir_branches.branch_count(_three_branches) == 3
    assert tir_branches.branch_count(_one_kernel) == 1


def test_branches_lowered_alone_fit_back_into_the_chain():
    passes = [s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
              s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation(),
              tirx.transform.StmtSimplify()]
    whole, by_branch, seen = _lowered_whole_and_by_branch(passes)
    assert seen == [3]  # one copy per branch, lowered together
    tvm.ir.assert_structural_equal(by_branch, whole)


def test_a_chain_the_passes_change_per_copy_is_lowered_whole():
    @tirx.transform.prim_func_pass(opt_level=0, name="test.FreshLet")
    def fresh_let(func: tirx.PrimFunc, _mod: Any, _ctx: Any) -> tirx.PrimFunc:
        # a new variable defined above the chain in each copy: the branches cannot share one frame
        return func.with_body(tirx.SeqStmt([tirx.Bind(tirx.Var("x", "int32"), 7), func.body]))

    whole, by_branch, seen = _lowered_whole_and_by_branch([fresh_let])
    assert seen == [3, 1]  # the copies, then the function whole
    tvm.ir.assert_structural_equal(by_branch, whole)
    assert "fuselight.branch" not in by_branch["main"].script()


def test_small_multi_branch_function_lowers_to_tvms_cuda():
    mod = tvm.IRModule({"main": _three_branches.with_attr("global_symbol", "main")})
    tvms = tvm.compile(mod, target=CUDA, tir_pipeline="s_tir").mod.imports[0].inspect_source("cuda")
    ours = tvm.compile(mod, target=CUDA, tir_pipeline=tir_pipeline.register()).mod.imports[0].inspect_source("cuda")
    assert ours == tvms and len(_KERNEL.findall(tvms)) == 3
