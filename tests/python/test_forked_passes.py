"""A per-function pass over several processes (``fuselight.forked_passes``): the module the pass gives
in one process, the calls of functions it leaves alone still bound, a child's error raised here."""

import pytest
import tvm
import tvm_ffi
from fuselight import tir_pipeline
from fuselight.cuda_compile import JOBS_ENV
from fuselight.forked_passes import balanced_groups, in_processes, rules_in_processes
from fuselight.rules import fuselight_rules
from fuselight.target import resolve, to_tvm
from relax_module import single_function
from tvm import relax
from tvm.s_tir import dlight as dl
from tvm.script import tirx as T

CUDA = to_tvm(resolve("cuda", "sm_90"))


def test_groups_are_balanced_complete_and_the_same_every_time():
    sizes = {"a": 7, "b": 5, "c": 4, "d": 3, "e": 3, "f": 1}
    groups = balanced_groups(sizes, 3)
    assert sorted(n for g in groups for n in g) == sorted(sizes)
    assert sorted(sum(sizes[n] for n in g) for g in groups) == [7, 8, 8]
    assert balanced_groups(dict(reversed(list(sizes.items()))), 3) == groups
    assert all(balanced_groups({"x": 1, "y": 1}, 2))


def _kernel(scale: float, n: int) -> tvm.tirx.PrimFunc:
    @T.prim_func(s_tir=True)
    def f(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
        for bx in T.thread_binding(n // 64, thread="blockIdx.x"):
            for tx in T.thread_binding(64, thread="threadIdx.x"):
                with T.sblock("scale"):
                    b[bx * 64 + tx] = a[bx * 64 + tx] * T.float32(scale) + T.float32(1)

    return f


def _lowering_input(count: int = 5) -> tvm.IRModule:
    funcs = {f"k{i}": _kernel(1.5 + i, 64 * (i + 3)).with_attr("global_symbol", f"k{i}") for i in range(count)}
    return tvm.tirx.transform.BindTarget(CUDA)(tvm.IRModule(funcs))


@pytest.mark.parametrize("jobs", [2, 3, 7])
def test_parallel_lowering_is_the_lowering_in_one_process(jobs, monkeypatch):
    """The parallel TIR pipeline (groups of one function among them) against the serial one and
    TVM's finalization of the kernels: the same functions, the same code, one entry function where
    the module has one."""
    monkeypatch.setenv(JOBS_ENV, str(jobs))
    for mod in (_lowering_input(), _lowering_input(1)):
        serial, _, finalize = tvm.tirx.get_tir_pipeline(tir_pipeline.register())
        parallel, _, _ = tvm.tirx.get_tir_pipeline(tir_pipeline.register(parallel=True))
        with CUDA:
            alone = serial(mod)
            kernels = {gv for gv, f in alone.functions.items() if f.attrs["target"].kind.name == "cuda"}
            alone.update(finalize()(tvm.IRModule({gv: alone[gv] for gv in kernels})))
            forked = parallel(mod)
        assert sorted(gv.name_hint for gv in forked.functions) == sorted(gv.name_hint for gv in alone.functions)
        for gv, func in alone.functions.items():  # the same code (calls name their GlobalVars)
            assert func.script() == forked[gv.name_hint].script(), gv.name_hint


def test_rules_in_processes_keep_the_calls_bound(monkeypatch):
    """Phase 4 over processes: the Relax function's calls reach the scheduled PrimFuncs."""
    monkeypatch.setenv(JOBS_ENV, "2")
    x = relax.Var("x", relax.TensorType((4, 4096), "float16"))
    w = relax.Var("w", relax.TensorType((11008, 4096), "float16"))
    v = relax.Var("v", relax.TensorType((4096, 11008), "float16"))

    def make(bb, x, w, v):
        h = bb.emit(relax.op.nn.silu(relax.op.matmul(x, relax.op.permute_dims(w))))
        return relax.op.matmul(h, relax.op.permute_dims(v))

    mod = single_function([x, w, v], make)
    with CUDA:
        mod = tvm.ir.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                           relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
        alone = dl.ApplyDefaultSchedule(*fuselight_rules())(mod)
        forked = rules_in_processes(fuselight_rules(), "Rules")(mod)
    assert tvm_ffi.structural_equal(alone, forked)
    called = []
    relax.analysis.post_order_visit(forked["main"], lambda e: called.append(e) if isinstance(e, tvm.ir.GlobalVar) else None)
    keys = list(forked.functions)
    assert called and all(any(c.same_as(k) for k in keys) for c in called)


@tvm.transform.module_pass(opt_level=0, name="FailOnK3")
def _fail_on_k3(mod, _ctx):
    if any(gv.name_hint == "k3" for gv in mod.functions):
        raise ValueError("k3 is not welcome")
    return mod


def test_an_error_in_a_child_is_raised_here():
    # k3 goes to some group; whichever process runs it, the error comes out of this one.
    with pytest.raises(ValueError, match="k3 is not welcome"):
        in_processes(_fail_on_k3, 3)(_lowering_input())


def test_a_stuck_child_is_killed_and_its_group_run_here(monkeypatch):
    import os
    import time

    from fuselight import forked_passes

    here = os.getpid()

    @tvm.transform.module_pass(opt_level=0, name="HangInChildren")
    def hang_in_children(mod, _ctx):
        if os.getpid() != here:
            time.sleep(600)
        return tvm.tirx.transform.StmtSimplify()(mod)

    monkeypatch.setattr(forked_passes, "_PATIENCE_S", 0.5)
    mod = _lowering_input()
    with CUDA:
        start = time.monotonic()
        out = in_processes(hang_in_children, 3)(mod)
        assert time.monotonic() - start < 30
        alone = tvm.tirx.transform.StmtSimplify()(mod)
    assert all(out[gv.name_hint].script() == f.script() for gv, f in alone.functions.items())
