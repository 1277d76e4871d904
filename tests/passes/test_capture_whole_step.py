"""Whole-step capture (``passes/capture_whole_step.py``): the rewrite of the decode functions, the
by-position decode kernel it asks for (built for sm_90, compiled by nvcc, reading no metadata whose
address moves with the page count), RewriteCUDAGraph lifting every decode attention call into a
graph, and each step function staged so that one graph holds all its kernels (token ids in, outputs
copied out: one host launch a decode step). The staging runs on the CPU too (logits and greedy tokens
as the unstaged build's); the whole step's numerics need a GPU: ``bench e2e`` checks logits against
float64 and greedy tokens against step-by-step decoding (docs/experiments/decode-form.md has the command)."""

from __future__ import annotations

import dataclasses
import re
import shutil

import numpy as np
import pytest
import tvm
import tvm_ffi
from fuselight import compile as fc
from fuselight import config as model_config
from fuselight.contracts import (
    ATTENTION_BUILTIN,
    ATTENTION_FORWARD_FUNC,
    DECODE_BY_POSITION_ATTR,
    TENSOR_COPY_FUNC,
    TOKEN_IDS_PARAM,
)
from fuselight.cuda_compile import compile_cuda
from fuselight.engine import Engine
from fuselight.model.llama import export_module
from fuselight.model.weights import random_weights
from fuselight.options import Options
from fuselight.passes import DEFAULT, CaptureWholeStep, FuseRopeAppend, PagedAttentionKernels
from fuselight.passes.capture_whole_step import attention_calls, stage_step_io, step_functions
from fuselight.rules.flash.decode import ROTARY_GLOBAL_SYMBOL
from fuselight.rules.paged_attention import PagedAttention
from fuselight.target import resolve, to_tvm
from tvm import relax
from tvm.s_tir import dlight as dl

CUDA = to_tvm(resolve("cuda", "sm_90"))
DECODE_FUNCTIONS = {"decode", "decode_attend"}
# The functions of one decode step (greedy's first token too), all of static shapes.
STEP_FUNCTIONS = {*DECODE_FUNCTIONS, "decode_greedy", "greedy"}
CUDA_GRAPH_BUILTIN = "vm.builtin.cuda_graph.run_or_capture"


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


def _shape(ty: object) -> tuple:
    return tuple(int(d) for d in ty.shape.values)


def _bindings(func: relax.Function) -> list[relax.Binding]:
    return [b for block in func.body.blocks for b in block.bindings]


def _copied(value: relax.Expr) -> relax.Expr | None:
    """What ``value`` copies where it is a copy (``TENSOR_COPY_FUNC`` called destination-passing), else None."""
    if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.call_dps_packed"
            and value.args[0].global_symbol == TENSOR_COPY_FUNC):
        return value.args[1].fields[0]
    return None


def _returned(func: relax.Function) -> list[relax.Expr]:
    """The tensors ``func`` returns, each as the expression bound to it."""
    bound = {b.var: b.value for b in _bindings(func)}
    ret = func.body.body
    while ret in bound and isinstance(bound[ret], relax.Var | relax.Tuple):
        ret = bound[ret]
    fields = ret.fields if isinstance(ret, relax.Tuple) else [ret]
    return [bound.get(f, f) for f in fields if isinstance(f.ty, relax.TensorType)]


def test_step_functions_copy_their_tensors_in_and_out_and_decode_takes_token_ids(rewritten):
    """Every kernel of a step may join its graph: what a kernel reads is planned storage, never a
    parameter (the copies of the inputs), and what it writes is never returned (the copies returned)."""
    before, after = rewritten
    assert {gv.name_hint for gv in step_functions(before)} == STEP_FUNCTIONS  # not embed, prefill: symbolic
    for name in STEP_FUNCTIONS:
        func = after[name]
        tensor_inputs = [p for p in func.params[:int(func.attrs["num_input"])] if isinstance(p.ty, relax.TensorType)]
        copies = {b.var: _copied(b.value) for b in _bindings(func) if _copied(b.value) is not None}
        assert len(tensor_inputs) == 1 and sum(src.same_as(tensor_inputs[0]) for src in copies.values()) == 1, name
        # a parameter is read by its copy alone
        readers = [b for b in _bindings(func)
                   if any(v.same_as(tensor_inputs[0]) for v in relax.analysis.free_vars(b.value))]
        assert len(readers) == 1 and _copied(readers[0].value) is not None, name
        returned = _returned(func)
        assert returned and all(_copied(r) is not None for r in returned), name
        if name in DECODE_FUNCTIONS:
            ids = func.params[0]
            assert (ids.name, _shape(ids.ty), ids.ty.dtype) == (TOKEN_IDS_PARAM, (1,), "int32"), name
            staged_ids = next(v for v, src in copies.items() if src.same_as(ids))
            takes = [b.value for b in _bindings(func)
                     if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.take"]
            assert len(takes) == 1 and takes[0].args[1].same_as(staged_ids), name
        else:  # decode_greedy and greedy keep their inputs
            assert all(tvm_ffi.structural_equal(p.ty, q.ty) for p, q in zip(func.params, before[name].params, strict=True))
    for name in ("embed", "prefill"):
        tvm.ir.assert_structural_equal(after[name], before[name])


def test_decode_split_partials_come_from_the_caller(rewritten):
    """The by-position kernel takes its split partials last but for the counters (a graph replays
    their addresses, which a block of TVM's workspace pool need not keep); the forwarder's call
    allocates them, as the rule sizes them for one sequence."""
    _, after = rewritten
    desc = PagedAttention.analyze(after[ROTARY_GLOBAL_SYMBOL])
    shapes = PagedAttention.by_position_workspace(desc, CUDA, 1)
    assert [dtype for _, dtype in shapes] == ["float32", "float32"]
    heads, dim = 9, 64
    assert shapes[0][0][:2] == (1, heads) and shapes[0][0][3] == dim and shapes[1][0] == shapes[0][0][:3]
    for name in DECODE_FUNCTIONS:
        calls = _forwarder_calls(after[name])
        assert len(calls) == 2, name
        for call in calls:
            outputs = call.ty_args[0].fields
            assert [(_shape(t), t.dtype) for t in outputs[1:]] == shapes, name
    kernel = PagedAttention().schedule(after[ROTARY_GLOBAL_SYMBOL], desc, CUDA)
    o_part, lse_part, counters = kernel.params[-3:]
    assert (o_part.name, lse_part.name) == ("O_part", "lse_part") and counters.name.startswith("counters")
    # TVM's cache passes the builtin's 19 arguments; the forwarder adds the two, the hooks the counters
    assert len(kernel.params) == 22


def _forwarder_calls(func: relax.Function) -> list[relax.Call]:
    found: list[relax.Call] = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if (
        isinstance(e, relax.Call) and e.args and isinstance(e.args[0], relax.ExternFunc)
        and e.args[0].global_symbol == ATTENTION_FORWARD_FUNC) else None)
    return found


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
    assert len(kernels) == 2  # split and merge (merge_in_split off as shipped)
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


def test_build_captures_the_whole_step_with_the_default_passes(monkeypatch):
    """With the default passes every CUDA build on a described arch captures the whole decode step:
    host-bound decode (SmolLM2's step launches ~12x its weight floor) without programmatic launch,
    GPU-bound decode (Llama-3.2-1B) with it; passes named by the caller are kept as named (then
    graphs only where the host sets the pace)."""
    seen = {}

    def fake_pipeline(name, target, bounds, options):
        seen["options"] = options
        raise RuntimeError("stop after choosing the passes")

    monkeypatch.setattr(fc, "pipeline_pass", fake_pipeline)
    sm90 = resolve("cuda", "sm_90")
    for model, pdl in (("smollm2-135m", False), ("llama-3.2-1b", True)):
        with pytest.raises(RuntimeError, match="stop after"):
            fc.build(model_config.load(model).with_dtype("float16"), sm90, "fuselight")
        passes = seen["options"].graph_passes()
        assert tuple(passes) == (*Options().graph_passes(), fc.WHOLE_STEP_PASS), model
        assert seen["options"].programmatic_launch == pdl, model
    for model, pdl in (("smollm2-135m", False), ("llama-3.2-1b", True)):
        named = Options(passes=("paged_attention", "fuse_rope_append"))
        with pytest.raises(RuntimeError, match="stop after"):
            fc.build(model_config.load(model).with_dtype("float16"), sm90, "fuselight", options=named)
        assert seen["options"].passes == named.passes and seen["options"].programmatic_launch == pdl


@pytest.mark.slow
def test_rewrite_cuda_graph_lifts_the_whole_step_into_one_graph():
    """Lowered with CUDA graphs, each step function launches one graph and nothing else: every kernel,
    the embedding, each decode attention call and the LM head, sits in its capture function; outside
    it the host only copies tensors and runs the VM's bookkeeping (``vm.builtin.*``, no kernels)."""
    layers = 3
    seq = fc.pipeline_pass("fuselight", CUDA, {"seq_len": 32}, Options(passes=(*DEFAULT, fc.WHOLE_STEP_PASS)))
    with tvm.transform.PassContext(config={fc.CUDA_GRAPH_CONFIG: True}), CUDA:
        lowered = seq(export_module(_config(layers), CUDA)[0])
    for name in STEP_FUNCTIONS:
        func = lowered[name]
        assert _kernel_calls(lowered, func) == [], name
        outside = _symbols(func)
        assert outside.count(CUDA_GRAPH_BUILTIN) == 1, name
        assert {s for s in outside if not s.startswith("vm.builtin.")} == {TENSOR_COPY_FUNC}, name
        # the input copied in, the output copied out
        assert outside.count(TENSOR_COPY_FUNC) == 2, name
    for name in DECODE_FUNCTIONS:
        (capture,) = _captures(lowered[name])
        assert _symbols(lowered[capture]).count(ATTENTION_FORWARD_FUNC) == layers, name
        assert any("take" in k for k in _kernel_calls(lowered, lowered[capture])), name  # the embedding
    decode_kernels = _kernel_calls(lowered, lowered[_captures(lowered["decode"])[0]])
    assert decode_kernels[-1].startswith("fused_rms_norm_gemv")  # the final norm and the LM head, last


def _kernel_calls(mod: tvm.IRModule, func: relax.Function) -> list[str]:
    """The PrimFuncs ``func`` calls itself, in order (a capture function's are not its caller's)."""
    found: list[str] = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e.op.name_hint) if (
        isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.GlobalVar)
        and isinstance(mod[e.op], tvm.tirx.PrimFunc)) else None)
    return found


def _captures(func: relax.Function) -> list[tvm.ir.GlobalVar]:
    """The capture functions ``func`` replays (``vm.builtin.cuda_graph.run_or_capture``), in order."""
    found: list[tvm.ir.GlobalVar] = []

    def visit(e: relax.Expr) -> None:
        if (isinstance(e, relax.Call) and e.op.same_as(tvm.ir.Op.get("relax.call_builtin_with_ctx"))
                and e.args[0].global_symbol == "vm.builtin.cuda_graph.run_or_capture"):
            found.append(e.args[1].fields[0])

    relax.analysis.post_order_visit(func, visit)
    return found


@pytest.mark.slow
def test_staged_step_functions_decode_as_before_on_the_cpu(cpu_model):
    """``stage_step_io`` on an llvm build (the copies are the CPU's memcpy; the rest of the pass needs
    CUDA): the engine passes token ids to ``decode`` and ``decode_attend``, and every step's logits
    and the greedy tokens are the unstaged build's."""
    cfg = dataclasses.replace(_config(), dtype="float32")
    target = to_tvm(resolve("llvm"))
    mod, _ = export_module(cfg, target)
    staged = stage_step_io(mod, [gv for gv in mod.get_global_vars() if gv.name_hint in DECODE_FUNCTIONS])
    vm = relax.VirtualMachine(tvm.compile(staged, target=target, relax_pipeline=relax.get_default_pipeline(target)),
                              tvm.cpu())
    plain_vm, device = cpu_model(cfg)
    params = [tvm.runtime.tensor(w, device=device) for w in random_weights(cfg, seed=27).values()]
    engines = [Engine(v, params, cfg, device, max_total_seq_len=64, prefill_chunk_size=16) for v in (vm, plain_vm)]
    rng = np.random.default_rng(27)
    prompt = rng.integers(0, cfg.vocab_size, 19)
    steps = [[e.prefill(prompt).numpy()] for e in engines]
    for token in rng.integers(0, cfg.vocab_size, 6):
        for engine, logits in zip(engines, steps, strict=True):
            logits.append(engine.decode(int(token)).numpy())
    for got, want in zip(*steps, strict=True):
        np.testing.assert_array_equal(got, want)
    tokens = []
    for engine in engines:
        engine.reset()
        tokens.append(engine.generate(prompt, 9).tolist())
    assert tokens[0] == tokens[1] and len(set(tokens[0])) > 1


def test_without_embed_the_decode_functions_keep_their_embedding_input(rewritten):
    before, _ = rewritten
    alone = before.clone()
    del alone[next(gv for gv in alone.get_global_vars() if gv.name_hint == "embed")]
    staged = stage_step_io(alone, [gv for gv in alone.get_global_vars() if gv.name_hint in DECODE_FUNCTIONS])
    for name in DECODE_FUNCTIONS:
        first = staged[name].params[0]
        assert first.name == "input_embed" and _shape(first.ty) == (1, 1, 576), name
        assert [_copied(b.value) for b in _bindings(staged[name])][0].same_as(first), name  # copied in first


def test_fused_functions_are_not_step_functions():
    """A function a fusion outlines (MLC's FuseTransposeMatmul: static tensors only, no ``num_input``)
    is left alone: copying its operands, weights among them, would put copies inside a kernel's
    function."""
    bb = relax.BlockBuilder()
    w, x = relax.Var("w", relax.TensorType([7, 5], "float16")), relax.Var("x", relax.TensorType([1, 5], "float16"))
    with bb.function("fused_matmul", [w, x], attrs={"Primitive": True}):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    with bb.function("step", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    mod = bb.get()
    assert [gv.name_hint for gv in step_functions(mod)] == ["step"]
    staged = stage_step_io(mod, [])
    tvm.ir.assert_structural_equal(staged["fused_matmul"], mod["fused_matmul"])
    # the step copies x, its input, and its output; never the weight w
    assert [str(c) for c in (_copied(b.value) for b in _bindings(staged["step"])) if c is not None][0] == "x"
    assert sum(_copied(b.value) is not None for b in _bindings(staged["step"])) == 2
