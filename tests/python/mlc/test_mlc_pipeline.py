"""fuselight inside MLC-LLM's pipeline (``fuselight.mlc.pipeline``, ``fuselight.mlc.cli``).

Everywhere: against ``tests/python/mlc/mlc_stub``, a stand-in package with MLC's anchors (its pipeline builds
its pass list when it runs, from names in its module, as MLC's does). Where MLC-LLM is available
(installed, or ``FUSELIGHT_MLC_LLM_SOURCE``): the same wrapper on MLC's own pipeline.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from fuselight import mlc  # noqa: E402
from fuselight.cli import main as cli_main  # noqa: E402
from fuselight.contracts import NORM_GEMV_NAME as NORM_GEMV  # noqa: E402
from fuselight.errors import FuselightError  # noqa: E402
from fuselight.mlc import pipeline as mp  # noqa: E402
from fuselight.mlc.cli import without_missing_thrust  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.s_tir import dlight as dl  # noqa: E402

STUB = Path(__file__).parent / "mlc_stub"
LLVM = {"kind": "llvm"}


def _mlc_modules() -> list[str]:
    return [name for name in sys.modules if name == "mlc_llm" or name.startswith("mlc_llm.")]


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch):
    """The stand-in MLC-LLM, imported as a source checkout; whatever was there comes back after."""
    if importlib.util.find_spec("mlc_llm") is not None:
        pytest.skip("an installed mlc_llm would be imported instead of the stand-in")
    saved_modules = {name: sys.modules.pop(name) for name in _mlc_modules()}
    saved_pipeline = relax.pipeline.PIPELINE_MAP.pop(mp.PIPELINE_NAME, None)
    saved_state = dict(mp._STATE)
    mp._STATE.clear()
    monkeypatch.setenv(mlc.SOURCE_ENV, str(STUB))
    assert mlc.import_mlc_llm() is not None
    module = importlib.import_module(mp.MLC_PIPELINE_MODULE)
    module.RAN.clear()
    try:
        yield module
    finally:
        mp._STATE.clear()
        mp._STATE.update(saved_state)
        for name in _mlc_modules():
            del sys.modules[name]
        sys.modules.update(saved_modules)
        relax.pipeline.PIPELINE_MAP.pop(mp.PIPELINE_NAME, None)
        if saved_pipeline is not None:
            relax.pipeline.PIPELINE_MAP[mp.PIPELINE_NAME] = saved_pipeline


def _module(hidden: int = 16, out: int = 8) -> tvm.IRModule:
    return importlib.import_module("mlc_llm.cli.compile").make_module(hidden, out)


def _run_pipeline(mod: tvm.IRModule, target_dict: dict = LLVM) -> tvm.IRModule:
    target = tvm.target.Target(target_dict)
    with target:
        return relax.get_pipeline(mp.PIPELINE_NAME, target=target)(mod)


class _TakeWithParams(dl.ScheduleRule):
    """Takes (unchanged) the functions with ``n`` parameters (None: all): ApplyDefaultSchedule marks them."""

    def __init__(self, n: int | None) -> None:
        self.n = n

    def apply(self, func, target, _tunable):
        from tvm.s_tir import Schedule

        return Schedule(func) if self.n in (None, len(func.params)) else None


def test_steps_run_at_the_anchors(stub, tmp_path) -> None:
    # (paged_attention hands the KV cache's kernels to the rule of its name: it needs that family.)
    options = mp.Options(passes=("accumulate_matmul_fp32", "paged_attention", "fusion_plan"),
                         rules=("matmul", "paged_attention"), dump=tmp_path)
    anchors = stub.FuseTransposeMatmul, stub.LowBatchGemvSpecialize
    with mp.enabled(options):
        _run_pipeline(_module())
    assert (stub.FuseTransposeMatmul, stub.LowBatchGemvSpecialize) == anchors  # restored after the run
    assert stub.RAN == ["phase1", "phase2", "phase4", "phase5"]  # MLC's own passes all ran, once
    dumps = sorted(p.name for p in tmp_path.glob("fuselight-*.py"))
    assert dumps == ["fuselight-01-accumulate_matmul_fp32.py", "fuselight-02-paged_attention.py",
                     "fuselight-03-fusion_plan.py", "fuselight-04-rules-paged_attention.py",
                     "fuselight-05-rules-matmul.py"]
    # Before MLC's FuseTransposeMatmul, after it, and in the schedule phase (after lowering to TIR).
    first, second, _plan, _paged, third = (tmp_path / name for name in dumps)
    assert "permute_dims" in first.read_text() and "NT_matmul" not in first.read_text()
    assert "NT_matmul" in second.read_text() and "R.nn.softmax" in second.read_text()
    assert "R.nn.softmax" not in third.read_text() and "T.prim_func" in third.read_text()
    log = json.loads((tmp_path / mp.SCHEDULE_LOG_FILE).read_text())
    assert log["options"] == {"passes": ["accumulate_matmul_fp32", "paged_attention", "fusion_plan"],
                              "rules": ["paged_attention", "matmul"],
                              "programmatic_launch": True}


def test_rule_families_are_tried_in_order_and_logged(stub, monkeypatch, tmp_path) -> None:
    # NT_matmul(x, w, out) has three parameters, the softmax kernels two.
    from fuselight import rules

    families = {"first": lambda: _TakeWithParams(3), "second": lambda: _TakeWithParams(None)}
    monkeypatch.setattr(rules, "RULES", {name: rules.ScheduleRuleEntry(name, make) for name, make in families.items()})
    with mp.enabled(mp.Options(passes=(), dump=tmp_path)):
        _run_pipeline(_module())
    kernels = json.loads((tmp_path / mp.SCHEDULE_LOG_FILE).read_text())["kernels"]
    assert any("NT_matmul" in name for name in kernels)
    for name, step in kernels.items():
        # VMShapeLower's shape function comes after the schedule phase, and runs on the host.
        assert step == ("first" if "NT_matmul" in name else "host" if name == "shape_func" else "second"), name
    # Only the families asked for run: the rest stays with MLC (here: a CPU build, which needs no schedule).
    with mp.enabled(mp.Options(passes=(), rules=("first",), dump=tmp_path)):
        _run_pipeline(_module())
    kernels = json.loads((tmp_path / mp.SCHEDULE_LOG_FILE).read_text())["kernels"]
    assert {step for name, step in kernels.items() if "NT_matmul" not in name} == {"host"}


def test_disable_and_context_restore_mlc_pipeline(stub) -> None:
    original = relax.pipeline.PIPELINE_MAP[mp.PIPELINE_NAME]
    mp.enable(mp.Options(passes=()))
    assert relax.pipeline.PIPELINE_MAP[mp.PIPELINE_NAME] is not original
    mp.enable(mp.Options(rules=()))  # again: replaces the options, still wraps MLC's own factory once
    assert mp.enabled_options() == mp.Options(rules=())
    with mp.enabled(mp.Options(passes=("paged_attention",))):
        assert mp.enabled_options().passes == ("paged_attention",)
    assert mp.enabled_options() == mp.Options(rules=())
    mp.disable()
    assert relax.pipeline.PIPELINE_MAP[mp.PIPELINE_NAME] is original
    assert mp.enabled_options() is None
    with mp.enabled():
        pass
    assert relax.pipeline.PIPELINE_MAP[mp.PIPELINE_NAME] is original


def test_same_numbers_with_and_without_fuselight(stub) -> None:
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 16)).astype("float32"), rng.standard_normal((8, 16)).astype("float32")
    outs = []
    for options in (None, mp.Options()):
        if options is None:
            mp.disable()
        else:
            mp.enable(options)
        target = tvm.target.Target(LLVM)
        ex = relax.build(_module(), target=target, relax_pipeline=relax.get_pipeline(mp.PIPELINE_NAME, target=target))
        vm = relax.VirtualMachine(ex, tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy())
    logits = x.astype(np.float64) @ w.T.astype(np.float64)
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    for out in outs:
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("missing", [mp.GRAPH_ANCHOR, mp.SCHEDULE_ANCHOR])
def test_missing_anchor_is_an_error(stub, monkeypatch, missing) -> None:
    monkeypatch.delattr(stub, missing)
    with pytest.raises(FuselightError, match=f"lacks {missing}"):
        mp.enable()


def test_missing_registered_pipeline_is_an_error(stub) -> None:
    # Not monkeypatch: it would put the stand-in's pipeline back after the fixture has removed it.
    registered = relax.pipeline.PIPELINE_MAP.pop(mp.PIPELINE_NAME)
    try:
        with pytest.raises(FuselightError, match='registered pipeline "mlc_llm"'):
            mp.enable()
    finally:
        relax.pipeline.PIPELINE_MAP[mp.PIPELINE_NAME] = registered


def test_bad_options_are_errors() -> None:
    with pytest.raises(FuselightError, match="unknown pass 'nope'"):
        mp.Options(passes=("nope",))
    with pytest.raises(FuselightError, match="unknown rule family 'nope': expected one of flash_attention, paged_attention, matmul"):
        mp.Options(rules=("nope",))
    # A pass whose functions only its rules schedule needs them; left out of the defaults without them.
    with pytest.raises(FuselightError, match="pass 'fuse_gate_up_silu' needs the rule families gemv"):
        mp.Options(passes=("fuse_gate_up_silu",), rules=("matmul",))
    assert "fuse_gate_up_silu" not in mp.Options(rules=("matmul",)).graph_passes(fuselight_runtime=False)
    assert "fuse_gate_up_silu" in mp.Options(rules=("matmul", "gemv")).graph_passes(fuselight_runtime=False)
    assert mp.Options(rules=("gemv", "matmul")).rule_families == ["matmul", "gemv"]  # fuselight's order


def test_enable_without_mlc_is_an_error(monkeypatch) -> None:
    monkeypatch.setattr(mp, "import_mlc_llm", lambda: None)
    with pytest.raises(FuselightError, match="MLC-LLM is not available"):
        mp.enable()


def _compile(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden": 16, "out": 8}))
    lib = tmp_path / "model.so"
    rc = cli_main(["mlc", "compile", str(config), "--device", json.dumps(LLVM), "-o", str(lib), *extra])
    return rc, lib


def test_cli_compiles_a_runnable_library(stub, tmp_path) -> None:
    from fuselight.runtime import load_library

    dump = tmp_path / "dump"
    rc, lib = _compile(tmp_path, "--fuselight-passes", "accumulate_matmul_fp32", "--fuselight-dump", str(dump))
    assert rc == 0
    meta = json.loads(Path(str(lib) + ".json").read_text())
    assert meta["pipeline"] == "mlc+fuselight"
    assert meta["baseline_source"] == "mlc-llm@0.0.stub"
    assert meta["fuselight"]["passes"] == ["accumulate_matmul_fp32"]
    assert meta["mlc_model_config"] == {"hidden": 16, "out": 8}  # sizes MLC may leave symbolic
    assert (dump / mp.SCHEDULE_LOG_FILE).is_file() and (dump / "fuselight-01-accumulate_matmul_fp32.py").is_file()
    assert mp.enabled_options() is None  # the command leaves MLC's pipeline as it found it
    vm, dev, _ = load_library(lib, "cpu")
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 16)).astype("float32"), rng.standard_normal((8, 16)).astype("float32")
    out = vm["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev)).numpy()
    np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(out.argmax(-1), (x @ w.T).argmax(-1))


def test_cli_no_fuselight_is_mlc_alone(stub, tmp_path) -> None:
    rc, lib = _compile(tmp_path, "--no-fuselight")
    assert rc == 0
    meta = json.loads(Path(str(lib) + ".json").read_text())
    assert meta["pipeline"] == "mlc" and "fuselight" not in meta


def test_cli_errors_are_one_line(stub, tmp_path, capsys) -> None:
    assert _compile(tmp_path, "--no-fuselight", "--fuselight-passes", "none")[0] == 2
    assert "--no-fuselight with --fuselight-passes" in capsys.readouterr().err
    assert _compile(tmp_path, "--no-fuselight", "--fuselight-no-programmatic-launch")[0] == 2
    assert "--no-fuselight with --fuselight-no-programmatic-launch" in capsys.readouterr().err
    assert _compile(tmp_path, "--fuselight-rules", "bogus")[0] == 2
    assert "unknown rule family 'bogus'" in capsys.readouterr().err
    # --fuselight-ptx reaches the library's target (either pipeline): PTX is CUDA's alone.
    assert _compile(tmp_path, "--no-fuselight", "--fuselight-ptx")[0] == 2
    assert "--ptx applies to cuda targets only" in capsys.readouterr().err


def test_thrust_left_out_where_tvm_lacks_it() -> None:
    if tvm.get_global_func("tvm.contrib.thrust.sort", allow_missing=True) is not None:
        pytest.skip("this TVM has thrust")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "libs": ["thrust"], "host": LLVM})
    assert "thrust" not in list(without_missing_thrust(target).attrs.get("libs", []) or [])
    assert without_missing_thrust(target).attrs["arch"] == "sm_90"


def test_scalar_after_outputs_primfunc_runs(stub) -> None:
    """MLC's sampler helper ``full(result, value)`` passes ``value`` the pre-0.26 way (after the output)."""
    from tvm.relax.frontend import nn
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def full(var_result: T.handle, value: T.int32):
        batch = T.int32()
        result = T.match_buffer(var_result, (batch, 1), "int32")
        for i in T.serial(batch):
            with T.sblock("block"):
                vi = T.axis.spatial(batch, i)
                result[vi, 0] = value

    batch, vocab = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("vocab", "int64")
    x = relax.Var("x", relax.TensorType((batch, vocab), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = nn.tensor_ir_op(full, "full", [vocab], nn.Tensor.placeholder([batch, 1], "int32"))
            gv = bb.emit_output(out._expr)
        bb.emit_func_output(gv)
    ex = relax.build(bb.get(), target=tvm.target.Target(LLVM))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(np.zeros((3, 509), "float32"))).numpy()
    np.testing.assert_array_equal(got, np.full((3, 1), 509, "int32"))


@pytest.mark.mlc
def test_mlc_own_pipeline_has_the_anchors() -> None:
    if mlc.import_mlc_llm() is None:
        pytest.skip(f"MLC-LLM not available (install mlc_llm or set {mlc.SOURCE_ENV})")
    module = mp.mlc_pipeline_module()
    assert callable(getattr(module, mp.GRAPH_ANCHOR)) and callable(getattr(module, mp.SCHEDULE_ANCHOR))
    original = relax.pipeline.PIPELINE_MAP[mp.PIPELINE_NAME]
    with mp.enabled():
        assert relax.pipeline.PIPELINE_MAP[mp.PIPELINE_NAME] is not original
    assert relax.pipeline.PIPELINE_MAP[mp.PIPELINE_NAME] is original


@pytest.mark.mlc
@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["q4f16_1", "q4bf16_1", "q4f16_0", "q4f16_autoawq"])
def test_mlc_quantized_build_writes_no_dequantized_weight(tmp_path, quantization) -> None:
    """MLC's own 4-bit LLaMA with fuselight for sm_90: no kernel writes a dequantized weight, and the
    decode GEMVs carry their norms (AWQ's too: words along N, the column template)."""
    if mlc.import_mlc_llm() is None:
        pytest.skip(f"MLC-LLM not available (install mlc_llm or set {mlc.SOURCE_ENV})")
    config = json.loads((Path(__file__).parents[3] / "configs" / "models" / "llama-3-8b.json").read_text())
    config.update(num_hidden_layers=1, hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(config))
    device = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
              "max_shared_memory_per_block": 49152, "thread_warp_size": 32}
    dump = tmp_path / "dump"
    rc = cli_main(["mlc", "compile", str(tmp_path / "config.json"), "--quantization", quantization,
                   "--opt", "flashinfer=0;cublas_gemm=0;cudagraph=0;cutlass=0", "--host", "x86_64-unknown-linux-gnu",
                   "--overrides", "prefill_chunk_size=128;context_window_size=256", "--device", json.dumps(device),
                   "-o", str(tmp_path / "model.so"), "--fuselight-dump", str(dump)])
    assert rc == 0
    log = json.loads((dump / mp.SCHEDULE_LOG_FILE).read_text())
    assert log["materialized_weights"] == []
    assert any(name.startswith("fused_dequantize") for name in log["kernels"])  # MLC's fusions ran
    # Decode's norms went into the quantized GEMVs after them (QKV, gate+up with its SiLU, the LM
    # head), dequantize and all, and the GEMV rule scheduled them (KN, q4f16_0: its KN template).
    fused = [name for name in log["kernels"] if name.startswith(NORM_GEMV)]
    assert len(fused) >= 2 and all(log["kernels"][name] == "gemv" for name in fused)


def test_missing_mlc_requirement_is_one_line(tmp_path, monkeypatch) -> None:
    (tmp_path / "mlc_module_needing_a_package.py").write_text("import a_package_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(FuselightError, match="needs the Python package 'a_package_nobody_installed'.*pip install tqdm"):
        mlc.import_mlc_module("mlc_module_needing_a_package")
