"""Whole-step capture (``passes/capture_whole_step.py``): the rewrite of the decode functions, the
by-position decode kernel it asks for (built for sm_90, compiled by nvcc, reading no metadata whose
address moves with the page count), and RewriteCUDAGraph lifting every decode attention call into a
graph. Numerics need a GPU: ``bench e2e`` checks logits against float64 and greedy tokens against
step-by-step decoding (docs/experiments/decode-form.md has the command)."""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest
import tvm
from fuselight import compile as fc
from fuselight import config as model_config
from fuselight.contracts import ATTENTION_FORWARD_FUNC, DECODE_BY_POSITION_ATTR
from fuselight.cuda_compile import compile_cuda
from fuselight.model.llama import export_module
from fuselight.options import Options
from fuselight.passes import DEFAULT, CaptureWholeStep, FuseRopeAppend, PagedAttentionKernels
from fuselight.passes.capture_whole_step import ATTENTION_BUILTIN, attention_calls
from fuselight.rules.flash.decode import ROTARY_GLOBAL_SYMBOL
from fuselight.rules.paged_attention import PagedAttention
from fuselight.target import resolve, to_tvm
from tvm import relax
from tvm.s_tir import dlight as dl

CUDA = to_tvm(resolve("cuda", "sm_90"))
DECODE_FUNCTIONS = {"decode", "decode_attend"}


def _config(layers: int = 2) -> model_config.ModelConfig:
    # SmolLM2's head layout: GQA 9/3, head dim 64
    return dataclasses.replace(
        model_config.load("tiny-llama"), hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        dtype="float16", num_hidden_layers=layers,
    )


def _symbols(func: relax.Function) -> list[str]:
    found: list[str] = []
    relax.analysis.post_order_visit(
        func, lambda e: found.append(e.global_symbol) if isinstance(e, relax.ExternFunc) else None)
    return found


@pytest.fixture(scope="module")
def rewritten() -> tuple[tvm.IRModule, tvm.IRModule]:
    with CUDA:
        before = FuseRopeAppend()(PagedAttentionKernels()(export_module(_config(), CUDA)[0]))
        return before, CaptureWholeStep()(before)


def test_decode_functions_attend_through_the_forwarder_with_the_cache_static(rewritten):
    before, after = rewritten
    for gv, func in after.functions.items():
        if not isinstance(func, relax.Function) or not attention_calls(before[gv]):
            continue
        name = gv.name_hint
        if name in DECODE_FUNCTIONS:
            assert _symbols(func).count(ATTENTION_FORWARD_FUNC) == 2 and ATTENTION_BUILTIN not in _symbols(func), name
            assert int(func.attrs["num_input"]) == 1, name
        else:  # prefill: qkv of symbolic length, never captured
            tvm.ir.assert_structural_equal(func, before[gv])
    assert after[ROTARY_GLOBAL_SYMBOL].attrs[DECODE_BY_POSITION_ATTR]
    assert DECODE_BY_POSITION_ATTR not in before[ROTARY_GLOBAL_SYMBOL].attrs


def test_module_left_alone_without_the_fused_decode_kernel_or_a_cuda_target(rewritten):
    before, _ = rewritten
    unfused = export_module(_config(), CUDA)[0]
    with CUDA:
        tvm.ir.assert_structural_equal(CaptureWholeStep()(unfused), unfused)
    llvm = to_tvm(resolve("llvm"))
    with llvm:
        tvm.ir.assert_structural_equal(CaptureWholeStep()(before), before)


def _kernel_params(source: str) -> dict[str, list[str]]:
    """Each __global__ kernel's parameter names, from the CUDA source."""
    out = {}
    for name, params in re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\)", source):
        out[name] = [p.split()[-1].removesuffix("_ptr") for p in params.split(",")]
    return out


def test_by_position_kernel_reads_only_fixed_metadata_and_compiles_for_sm_90(rewritten):
    _, after = rewritten
    with CUDA:
        scheduled = dl.ApplyDefaultSchedule(PagedAttention())(after)
    lib = tvm.compile(tvm.IRModule({"main": scheduled[ROTARY_GLOBAL_SYMBOL]}), target=CUDA)
    source = lib.mod.imports[0].inspect_source("cuda")
    kernels = _kernel_params(source)
    assert len(kernels) == 2  # split, merge
    used = {p for params in kernels.values() for p in params}
    # q positions, page_indptr and the page table's start stay put as pages are added; these do not
    assert {"length_info", "append_positions"}.isdisjoint(used)
    assert {"q_rope_position", "page_table_indptr", "page_table_values", "pages", "max_num_pages"} <= used
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: the CUDA source was not compiled")
    assert compile_cuda(source, "sm_90")


def test_build_drops_the_pass_without_graphs(monkeypatch):
    seen = {}

    def fake_pipeline(name, target, bounds, options):
        seen["passes"] = options.passes
        raise RuntimeError("stop after choosing the passes")

    monkeypatch.setattr(fc, "pipeline_pass", fake_pipeline)
    options = Options(passes=(*DEFAULT, fc.WHOLE_STEP_PASS))
    for graphs, expected in ((False, DEFAULT), (True, (*DEFAULT, fc.WHOLE_STEP_PASS))):
        with pytest.raises(RuntimeError, match="stop after"):
            fc.build(_config(), resolve("cuda", "sm_90"), "fuselight", options=options, cuda_graph=graphs)
        assert seen["passes"] == expected


@pytest.mark.slow
def test_rewrite_cuda_graph_lifts_every_decode_attention_into_a_graph():
    """Lowered with CUDA graphs, each decode function's attention calls all sit in capture functions."""
    layers = 3
    seq = fc.pipeline_pass("fuselight", CUDA, {"seq_len": 32}, Options(passes=(*DEFAULT, fc.WHOLE_STEP_PASS)))
    with tvm.transform.PassContext(config={fc.CUDA_GRAPH_CONFIG: True}), CUDA:
        lowered = seq(export_module(_config(layers), CUDA)[0])
    for name in DECODE_FUNCTIONS:
        assert ATTENTION_FORWARD_FUNC not in _symbols(lowered[name]), name  # none left outside a graph
        captured = sum(_symbols(lowered[gv]).count(ATTENTION_FORWARD_FUNC) for gv in _captures(lowered[name]))
        assert captured == layers, name


def _captures(func: relax.Function) -> list[tvm.ir.GlobalVar]:
    """The capture functions ``func`` replays (``vm.builtin.cuda_graph.run_or_capture``), in order."""
    found: list[tvm.ir.GlobalVar] = []

    def visit(e: relax.Expr) -> None:
        if (isinstance(e, relax.Call) and e.op.same_as(tvm.ir.Op.get("relax.call_builtin_with_ctx"))
                and e.args[0].global_symbol == "vm.builtin.cuda_graph.run_or_capture"):
            found.append(e.args[1].fields[0])

    relax.analysis.post_order_visit(func, visit)
    return found
