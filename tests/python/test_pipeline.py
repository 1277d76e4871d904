"""The baseline (MLC-LLM's) and fuselight pipelines on a module shaped like one LLaMA layer.

Tests marked by the ``mlc_llm`` fixture run MLC-LLM's own passes and skip where MLC-LLM is absent
(set FUSELIGHT_MLC_LLM_SOURCE to a source checkout to run them); all others use fuselight's
equivalents.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import sys
import types

import numpy as np
import pytest
from conftest import require_nvcc

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402
from fuselight import mlc, rules  # noqa: E402
from fuselight import pipeline as pl  # noqa: E402
from fuselight.cuda_compile import compile_cuda, gencode  # noqa: E402
from fuselight.errors import FuselightError  # noqa: E402
from fuselight.target import resolve, to_tvm  # noqa: E402
from tvm import relax, tirx  # noqa: E402
from tvm.script import ir as I  # noqa: E402
from tvm.script import relax as R  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

# hidden a multiple of 1024 so FuseAddRMSNorm applies on GPUs (one thread per element of a row slice).
HIDDEN, INTERMEDIATE, VOCAB = 1024, 344, 509
EPS = 1e-5
PIPELINES = {"baseline": pl.baseline_pipeline, "fuselight": pl.fuselight_pipeline}


def _layer(bb: relax.BlockBuilder, name: str, rows: list) -> None:
    """add + rms_norm, gate/up projection, SiLU * up, down projection, residual add, lm_head, softmax."""
    half = "float16"
    x = relax.Var("x", relax.TensorType([*rows, HIDDEN], half))
    res = relax.Var("res", relax.TensorType([*rows, HIDDEN], half))
    w_norm = relax.Var("w_norm", relax.TensorType([HIDDEN], half))
    w_gate_up = relax.Var("w_gate_up", relax.TensorType([2 * INTERMEDIATE, HIDDEN], half))
    w_down = relax.Var("w_down", relax.TensorType([HIDDEN, INTERMEDIATE], half))
    w_head = relax.Var("w_head", relax.TensorType([VOCAB, HIDDEN], half))
    op = relax.op
    with bb.function(name, [x, res, w_norm, w_gate_up, w_down, w_head]):
        with bb.dataflow():
            h = bb.emit(op.add(x, res))
            normed = bb.emit(op.nn.rms_norm(h, w_norm, axes=[-1], epsilon=EPS))
            gate_up = bb.emit(op.matmul(normed, bb.emit(op.permute_dims(w_gate_up))))
            parts = bb.emit(op.split(gate_up, 2, axis=-1))
            act = bb.emit(op.multiply(op.nn.silu(bb.emit(relax.TupleGetItem(parts, 0))), relax.TupleGetItem(parts, 1)))
            down = bb.emit(op.matmul(act, bb.emit(op.permute_dims(w_down))))
            out = bb.emit(op.add(h, down))
            logits = bb.emit(op.matmul(out, bb.emit(op.permute_dims(w_head))))
            probs = bb.emit(op.nn.softmax(op.astype(logits, "float32"), axis=-1))
            result = bb.emit_output(relax.Tuple([probs, out]))
        bb.emit_func_output(result)


def layer_module() -> tvm.IRModule:
    """``prefill`` over (1, n, hidden), ``decode`` over (b, 1, hidden), ``decode1`` over (1, 1, hidden)."""
    bb = relax.BlockBuilder()
    _layer(bb, "prefill", [1, tirx.Var("n", "int64")])
    _layer(bb, "decode", [tirx.Var("b", "int64"), 1])
    _layer(bb, "decode1", [1, 1])
    return bb.get()


def layer_inputs(rng: np.random.Generator, rows: tuple[int, int]) -> list[np.ndarray]:
    def normal(shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype("float16")

    return [
        normal((*rows, HIDDEN)),
        normal((*rows, HIDDEN)),
        (1 + 0.1 * rng.standard_normal(HIDDEN)).astype("float16"),
        normal((2 * INTERMEDIATE, HIDDEN), HIDDEN**-0.5),
        normal((HIDDEN, INTERMEDIATE), INTERMEDIATE**-0.5),
        normal((VOCAB, HIDDEN), HIDDEN**-0.5),
    ]


def layer_reference(*inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(probs, out) in float64 for ``layer_inputs``."""
    x, res, w_norm, w_gate_up, w_down, w_head = (a.astype(np.float64) for a in inputs)
    h = x + res
    normed = h / np.sqrt((h**2).mean(-1, keepdims=True) + EPS) * w_norm
    gate, up = np.split(normed @ w_gate_up.T, 2, axis=-1)
    out = h + (gate / (1 + np.exp(-gate)) * up) @ w_down.T
    logits = out @ w_head.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True), out


def relative_max_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def llvm() -> tvm.target.Target:
    return to_tvm(resolve("llvm"))


@pytest.fixture(scope="module")
def cuda() -> tvm.target.Target:
    return to_tvm(resolve("cuda", "sm_90"))


@pytest.fixture(scope="module")
def mlc_llm() -> types.ModuleType:
    module = mlc.import_mlc_llm()
    if module is None:
        pytest.skip(f"MLC-LLM not available (install mlc_llm or set {mlc.SOURCE_ENV})")
    return module


@pytest.fixture
def without_mlc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process where MLC-LLM was never imported and no source checkout is named."""
    for name in [m for m in sys.modules if m == "mlc_llm" or m.startswith("mlc_llm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delenv(mlc.SOURCE_ENV, raising=False)
    if importlib.util.find_spec("mlc_llm") is not None:
        pytest.skip("MLC-LLM is installed")


def _lower(mod: tvm.IRModule, target: tvm.target.Target, pipeline: tvm.transform.Pass) -> tvm.IRModule:
    with target:
        return pipeline(mod)


def _run_stages(mod: tvm.IRModule, target: tvm.target.Target, until: str, **kwargs) -> tvm.IRModule:
    """``mod`` through the pipeline's stages up to (not including) the one named ``until``."""
    with target:
        for stage in pl.stages(target, **kwargs):
            if stage.name == until:
                return mod
            mod = stage.pass_(mod)
    raise AssertionError(f"no stage {until}")


def _prim_funcs(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


# --- the pass table and the stages built from it -------------------------------------------------------


def test_baseline_passes_table_matches_stages(llvm, cuda) -> None:
    names = [p.name for p in pl.BASELINE_PASSES]
    assert len(names) == len(set(names))
    assert [p.phase for p in pl.BASELINE_PASSES] == sorted(p.phase for p in pl.BASELINE_PASSES)
    run = [p.name for p in pl.BASELINE_PASSES if p.ours != "absent"]
    gpu_only, not_cuda = {"FuseAddRMSNorm", "LiftTIRGlobalBufferAlloc"}, {"ForceNarrowIndexToInt32"}
    for target, skipped in ((llvm, gpu_only), (cuda, not_cuda)):
        stages = pl.stages(target, use_mlc=False)
        assert [s.name for s in stages] == [n for n in run if n not in skipped]
        phase_of = {p.name: p.phase for p in pl.BASELINE_PASSES}
        assert all(s.phase == phase_of[s.name] for s in stages)
    for info in pl.BASELINE_PASSES:
        if info.ours == "equivalent":
            _, module = pl._EQUIVALENT_MODULES[info.name]
            ours = importlib.import_module(f"fuselight.baseline.{module}")
            assert f"``{info.name}``" in ours.__doc__


def test_fuselight_stages_add_passes_and_rules(cuda) -> None:
    stages = pl.stages(cuda, use_mlc=False, graph_passes=["accumulate_matmul_fp32"], rules=rules.fuselight_rules())
    names = [s.name for s in stages]
    assert names[names.index("accumulate_matmul_fp32") + 1] == "FuseTransposeMatmul"
    assert names.count("accumulate_matmul_fp32") == 1
    # Our rules see every function before LowBatchGemvSpecialize schedules dynamic-M matmuls.
    assert names[names.index("ApplyFuselightRules") + 1] == "LowBatchGemvSpecialize"
    baseline = [s.name for s in pl.stages(cuda, use_mlc=False)]
    assert [n for n in names if n not in ("accumulate_matmul_fp32", "ApplyFuselightRules")] == baseline


def test_rules_default_puts_fuselight_rules_first(monkeypatch, llvm, cuda) -> None:
    from tvm.s_tir import dlight as dl

    ours = [entry.make for entry in rules.RULES.values()]
    assert [type(r) for r in rules.default(llvm)] == ours
    dlight = [dl.gpu.Matmul, dl.gpu.GEMV, dl.gpu.Reduction, dl.gpu.GeneralReduction, dl.gpu.Fallback]
    assert [type(r) for r in rules.default(cuda)] == [*ours, *dlight]

    class Mine(dl.ScheduleRule):
        def apply(self, func, target, tunable):
            return None

    monkeypatch.setattr(rules, "RULES", {"mine": rules.ScheduleRuleEntry("mine", Mine)})
    assert [type(r) for r in rules.default(cuda)] == [Mine, *dlight]


# --- MLC-LLM present or not ----------------------------------------------------------------------------


def test_use_mlc_without_mlc_is_an_error(without_mlc) -> None:
    assert mlc.import_mlc_llm() is None
    assert pl.baseline_source() == "fuselight-equivalents"
    with pytest.raises(FuselightError, match="MLC-LLM is not available"):
        pl.baseline_pipeline(use_mlc=True)
    with pytest.raises(FuselightError, match="MLC-LLM is not available"):
        pl.fuselight_pipeline(use_mlc=True)


def test_bad_mlc_source_is_an_error(without_mlc, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(mlc.SOURCE_ENV, str(tmp_path))
    with pytest.raises(FuselightError, match=mlc.SOURCE_ENV):
        mlc.import_mlc_llm()


def test_use_mlc_false_does_not_look_for_mlc(monkeypatch) -> None:
    def boom():
        raise AssertionError("import_mlc_llm called")

    monkeypatch.setattr(mlc, "import_mlc_llm", boom)
    assert pl.use_mlc_passes(False) is False
    assert pl.baseline_source(use_mlc=False) == "fuselight-equivalents"


def test_broken_installed_mlc_is_a_one_line_error(without_mlc, monkeypatch, tmp_path) -> None:
    package = tmp_path / "site" / "mlc_llm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise OSError('libmlc_llm.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    with pytest.raises(FuselightError, match="installed mlc_llm package fails to import .*libmlc_llm.so") as err:
        mlc.import_mlc_llm()
    assert "\n" not in str(err.value)


def test_failed_source_import_leaves_no_mlc_module(without_mlc, monkeypatch, tmp_path) -> None:
    package = tmp_path / "python" / "mlc_llm"
    (package / "compiler_pass").mkdir(parents=True)
    (package / "helper.py").write_text("X = 1\n")
    (package / "libinfo.py").write_text("from mlc_llm import helper\nraise ImportError('broken libinfo')\n")
    monkeypatch.setenv(mlc.SOURCE_ENV, str(tmp_path))
    with pytest.raises(ImportError, match="broken libinfo"):
        mlc.import_mlc_llm()
    assert [m for m in sys.modules if m == "mlc_llm" or m.startswith("mlc_llm.")] == []


def test_unknown_pass_is_an_error() -> None:
    with pytest.raises(FuselightError, match="unknown pass 'no_such_pass'"):
        pl.fuselight_pipeline(passes=["no_such_pass"], use_mlc=False)


def test_registries_have_one_shape() -> None:
    from fuselight import passes

    # Named entries both; default() gives objects (README's step 2), DEFAULT the names.
    assert list(passes.DEFAULT) and set(passes.DEFAULT) <= set(passes.PASSES)
    assert all(isinstance(p, tvm.transform.Pass) for p in passes.default())
    tvm.transform.Sequential(passes.default())  # as the README composes them
    assert all(e.name == name and e.make.family == name for name, e in rules.RULES.items())
    assert [type(r) for r in rules.fuselight_rules(["gemv", "matmul"])] == [rules.Matmul, rules.Gemv]  # RULES order
    # Every rule family a pass needs exists.
    assert {f for p in passes.PASSES.values() for f in p.rules} <= set(rules.RULES)


def test_passes_need_their_rules() -> None:
    from fuselight import passes

    # Without the rules a pass fuses for, the defaults leave it out (DLight cannot schedule what it emits)...
    served = pl.graph_passes(None, [])
    assert "fuse_gate_up_silu" not in served and "paged_attention" not in served and "fuse_attention" in served
    assert pl.graph_passes(None, None) == list(passes.DEFAULT)
    assert "add_rms_norm_kernels" in pl.graph_passes(None, rules.fuselight_rules(["row_reduction"]))
    # ... and naming it is an error.
    with pytest.raises(FuselightError, match="pass 'fuse_norm_gemv' needs the rule families gemv"):
        pl.fuselight_pipeline(passes=["fuse_norm_gemv"], rules=[], use_mlc=False)


def test_baseline_source_names_mlc(mlc_llm) -> None:
    assert pl.baseline_source().startswith("mlc-llm@")
    assert pl.baseline_source(use_mlc=False) == "fuselight-equivalents"


# --- compile and run on the CPU ------------------------------------------------------------------------


def _llvm_errors(llvm, pipeline: tvm.transform.Pass, rng: np.random.Generator) -> dict[str, float]:
    executable = tvm.compile(_lower(layer_module(), llvm, pipeline), target=llvm, relax_pipeline=None)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    errors: dict[str, float] = {}
    for func, rows in (("prefill", (1, 7)), ("decode", (3, 1)), ("decode1", (1, 1))):
        inputs = layer_inputs(rng, rows)
        probs, out = vm[func](*[tvm.runtime.tensor(a) for a in inputs])
        ref_probs, ref_out = layer_reference(*inputs)
        errors[f"{func}.probs"] = relative_max_error(probs.numpy(), ref_probs)
        errors[f"{func}.out"] = relative_max_error(out.numpy(), ref_out)
    return errors


@pytest.mark.parametrize("use_mlc", [False, True], ids=["equivalents", "mlc"])
def test_llvm_numerics(request, llvm, use_mlc: bool) -> None:
    if use_mlc:
        request.getfixturevalue("mlc_llm")
    baseline = _llvm_errors(llvm, pl.baseline_pipeline(llvm, use_mlc=use_mlc), np.random.default_rng(0))
    fuselight = _llvm_errors(llvm, pl.fuselight_pipeline(llvm, use_mlc=use_mlc), np.random.default_rng(0))
    # The baseline accumulates its matmuls in float16: right, to float16-accumulation accuracy.
    assert max(baseline.values()) < 6e-2, baseline
    # fuselight accumulates in float32: float16 rounding of the results only.
    assert max(fuselight.values()) < 3e-3, fuselight
    assert fuselight["prefill.probs"] < baseline["prefill.probs"] / 4


def test_equivalents_match_mlc_on_llvm(mlc_llm, llvm) -> None:
    # From FuseTIR on (MLC's FuseTransposeMatmul leaves dead composite functions that FuseTIR drops)
    # up to VMShapeLower (which writes variable names, chosen differently, into its error messages).
    for until in ("DeadCodeElimination", "VMShapeLower"):
        ours = _run_stages(layer_module(), llvm, until, use_mlc=False)
        theirs = _run_stages(layer_module(), llvm, until, use_mlc=True)
        assert tvm_ffi.structural_equal(ours, theirs, map_free_vars=True), until


def test_registered_pipelines(llvm) -> None:
    importlib.reload(pl)  # registering again on reimport must not fail
    for name in ("fuselight_baseline", "fuselight"):
        executable = tvm.compile(layer_module(), target=llvm, relax_pipeline=name)
        vm = relax.VirtualMachine(executable, tvm.cpu())
        inputs = layer_inputs(np.random.default_rng(1), (1, 1))
        probs, _ = vm["decode1"](*[tvm.runtime.tensor(a) for a in inputs])
        assert relative_max_error(probs.numpy(), layer_reference(*inputs)[0]) < 6e-2


def test_debug_dump(llvm, tmp_path) -> None:
    _lower(layer_module(), llvm, pl.baseline_pipeline(llvm, use_mlc=False, debug_dump=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"debug-phase{i}.py" for i in range(6)]
    assert "NT_matmul" in (tmp_path / "debug-phase1.py").read_text()


# --- CUDA: build, schedule, nvcc --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_lowered(cuda) -> dict[str, tvm.IRModule]:
    return {name: _lower(layer_module(), cuda, make(cuda, use_mlc=False)) for name, make in PIPELINES.items()}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_cuda_build_compiles_with_nvcc(cuda, cuda_lowered, name: str) -> None:
    from fuselight.runtime import cuda_sources

    kernels = _prim_funcs(cuda_lowered[name])
    assert "fuse_add_norm" in kernels
    assert all(f.attrs.get("tirx.is_scheduled") for f in kernels.values() if not f.attrs.get("tirx.is_host_func"))
    executable = tvm.compile(cuda_lowered[name], target=cuda, relax_pipeline=None)
    sources = [s for s in cuda_sources(executable) if s]
    assert len(sources) == 1 and "__global__" in sources[0]
    require_nvcc()
    assert len(compile_cuda(sources[0], "sm_90")) > 0


def test_cuda_graph_alloc_init(cuda) -> None:
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        lowered = _lower(layer_module(), cuda, pl.baseline_pipeline(cuda, use_mlc=False))
    names = {gv.name_hint for gv in lowered.get_global_vars()}
    assert {"cuda_graph_alloc", "cuda_graph_alloc_init"} <= names
    # Idempotent: ``cuda_graph_alloc_init`` shares the prefix but is not the allocation function.
    from fuselight.baseline.attach_cuda_graph_alloc_init_func import AttachCUDAGraphAllocInitFunc

    again = AttachCUDAGraphAllocInitFunc()(lowered)
    assert sorted(gv.name_hint for gv in again.get_global_vars()) == sorted(names)
    tvm.ir.assert_structural_equal(again["cuda_graph_alloc_init"], lowered["cuda_graph_alloc_init"])


def _first_rule(func: tirx.PrimFunc, target: tvm.target.Target) -> str:
    if func.attrs.get("tirx.is_scheduled"):
        return "hand-scheduled"
    for rule in rules.default(target):
        if rule.apply(func, target, False) is not None:
            return type(rule).__name__
    return "none"


def test_accumulate_fp32_keeps_dlight_schedules(cuda) -> None:
    """Matmuls fused with their float32->float16 cast go to the same rules as the unfused ones."""
    picked = {}
    for name, graph_passes in (("baseline", []), ("fuselight", ["accumulate_matmul_fp32"])):
        mod = _run_stages(layer_module(), cuda, "LowBatchGemvSpecialize", use_mlc=False, graph_passes=graph_passes)
        picked[name] = {k: _first_rule(f, cuda) for k, f in _prim_funcs(mod).items()}
    counts = {name: collections.Counter(p.values()) for name, p in picked.items()}
    assert counts["baseline"] == counts["fuselight"]
    matmuls = {k: v for k, v in picked["fuselight"].items() if "NT_matmul" in k}
    # Three functions of three matmuls, each now fused with its cast back to float16.
    assert len(matmuls) == 9 and all("cast" in k for k in matmuls)
    # fuselight's Matmul (dynamic M) and Gemv (M = 1); DLight's GEMV where K is no multiple of 32
    assert set(matmuls.values()) == {"Matmul", "GEMV", "Gemv"}


def test_equivalents_match_mlc_on_cuda(mlc_llm, cuda) -> None:
    """Every kernel but add+RMSNorm (fuselight writes its own) is the one MLC's passes give."""
    ours = _prim_funcs(_run_stages(layer_module(), cuda, "LiftTIRGlobalBufferAlloc", use_mlc=False))
    theirs = _prim_funcs(_run_stages(layer_module(), cuda, "LiftTIRGlobalBufferAlloc", use_mlc=True))
    assert {k for k in theirs if k.startswith("fuse_add_norm")} == {"fuse_add_norm_prefill", "fuse_add_norm_decode"}
    theirs = {k: f for k, f in theirs.items() if not k.startswith("fuse_add_norm")}
    ours.pop("fuse_add_norm")
    assert ours.keys() == theirs.keys()
    for name, func in ours.items():
        assert tvm_ffi.structural_equal(func, theirs[name], map_free_vars=True), name


# --- single passes -----------------------------------------------------------------------------------------


def _scratch_module() -> tvm.IRModule:
    @I.ir_module
    class Scratch:
        @T.prim_func(private=True, s_tir=True)
        def twice_plus_one(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            X = T.match_buffer(var_x, (n, 8), "float32")
            Y = T.match_buffer(var_y, (n, 8), "float32")
            scratch = T.sblock_alloc_buffer((n, 8), "float32")
            for i, j in T.grid(n, 8):
                with T.sblock("double"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    scratch[vi, vj] = X[vi, vj] * T.float32(2)
            for i, j in T.grid(n, 8):
                with T.sblock("inc"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    Y[vi, vj] = scratch[vi, vj] + T.float32(1)

        @R.function
        def main(x: R.Tensor(("n", 8), "float32")):
            n = T.int64()
            cls = Scratch
            with R.dataflow():
                y = R.call_tir(cls.twice_plus_one, (x,), out_ty=R.Tensor((n, 8), "float32"))
                z = R.add(y, x)
                R.output(z)
            return z

    return Scratch


def test_lift_global_buffer_alloc(llvm) -> None:
    from fuselight.baseline.lift_global_buffer_alloc import LiftTIRGlobalBufferAlloc

    lifted = LiftTIRGlobalBufferAlloc()(_scratch_module())
    (kernel,) = _prim_funcs(lifted).values()
    assert [p.name for p in kernel.params] == ["X", "Y", "scratch"]
    assert not kernel.body.block.alloc_buffers
    x = np.random.default_rng(2).random((5, 8), dtype=np.float32)
    vm = relax.VirtualMachine(tvm.compile(lifted, target=llvm), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), 3 * x + 1, rtol=1e-6)


def test_lift_global_buffer_alloc_matches_mlc(mlc_llm) -> None:
    from fuselight.baseline.lift_global_buffer_alloc import LiftTIRGlobalBufferAlloc
    from mlc_llm.compiler_pass.lift_global_buffer_alloc import LiftTIRGlobalBufferAlloc as Theirs

    assert tvm_ffi.structural_equal(LiftTIRGlobalBufferAlloc()(_scratch_module()), Theirs()(_scratch_module()))


def _tuple_module() -> tvm.IRModule:
    @I.ir_module
    class Tuples:
        @R.function
        def main(x: R.Tensor((4, 6), "float32")):
            with R.dataflow():
                parts = R.split(x, 2, axis=1)
                first = parts[0]
                second = parts[1]
                doubled = R.multiply(second, R.const(2, "float32"))
                out = R.multiply(first, doubled)
                R.output(out)
            return out

    return Tuples


def test_scatter_tuple_get_item() -> None:
    from fuselight.baseline.scatter_tuple_get_item import ScatterTupleGetItem

    bindings = ScatterTupleGetItem()(_tuple_module())["main"].body.blocks[0].bindings
    # `first` now sits right before its only use.
    assert [b.var.name for b in bindings] == ["parts", "second", "doubled", "first", "out"]


def test_scatter_tuple_get_item_matches_mlc(mlc_llm) -> None:
    from fuselight.baseline.scatter_tuple_get_item import ScatterTupleGetItem
    from mlc_llm.compiler_pass.scatter_tuple_get_item import ScatterTupleGetItem as Theirs

    assert tvm_ffi.structural_equal(ScatterTupleGetItem()(_tuple_module()), Theirs()(_tuple_module()))


# --- nvcc helper ------------------------------------------------------------------------------------------


def test_compile_cuda_needs_nvcc(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with pytest.raises(FuselightError, match="nvcc not found"):
        compile_cuda("__global__ void k() {}", "sm_90")


def test_gencode() -> None:
    assert gencode("sm_90") == "arch=compute_90a,code=sm_90a"
    assert gencode("sm_80") == "arch=compute_80,code=sm_80"
    with pytest.raises(FuselightError, match="unsupported arch"):
        gencode("compute_90")
