"""The fused RoPE + KV-append kernel (``passes/fuse_rope_append.py``) and its run-time wrappers
(``fuselight.kv_hooks``): the rewrite's shape, the wrappers' call order, and our LLaMA built with it on
the CPU against the float64 reference, with the fused kernel counted as taking the decode steps."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from conftest import FakeTensor, compare_with_reference, require_nvcc
from fuselight import FuselightError, config, kv_hooks
from fuselight.model.llama import export_module
from fuselight.model.weights import hf_config, random_weights
from fuselight.passes.fuse_rope_append import (
    FUSED_NAME,
    HOOKS_FUNC,
    SPLIT_ROTARY_ARG,
    TRANSPOSE_APPEND_ARG,
    FuseRopeAppend,
    analyze,
)
from fuselight.passes.paged_attention import create_calls
from fuselight.target import resolve, to_tvm
from tvm import relax

TOLERANCE = 1e-4


def _config(gqa: bool) -> config.ModelConfig:
    tiny = config.load("tiny-llama")
    if gqa:
        return tiny
    raw = hf_config(tiny)
    raw.update(rope_scaling=None, rope_theta=10000.0, num_key_value_heads=raw["num_attention_heads"])
    return config.from_dict(raw, name="tiny-mha")


def _module(cfg: config.ModelConfig) -> tvm.IRModule:
    return export_module(cfg, to_tvm(resolve("llvm")))[0]


def _kernels(mod: tvm.IRModule) -> tuple:
    args = create_calls(mod)[0].args[1:]
    return mod[args[SPLIT_ROTARY_ARG]], mod[args[TRANSPOSE_APPEND_ARG]]


def test_the_create_call_gets_wrappers_and_the_fused_kernel():
    mod = _module(_config(gqa=True))
    out = FuseRopeAppend()(mod)
    fused = out[FUSED_NAME]
    rope, append = _kernels(mod)
    # TVM's rope function's parameters, then the append's pages and positions
    assert len(fused.params) == len(rope.params) + 2
    assert fused.params[-2].same_as(append.params[0]) and fused.params[-1].same_as(append.params[3])
    text = fused.script()
    assert text.count("pages[") >= 2  # k into the pages' half 0, v into half 1
    (call,) = create_calls(out)
    packed = [b.value for f in out.functions.values() if isinstance(f, relax.Function)
              for blk in f.body.blocks for b in blk.bindings
              if isinstance(b.value, relax.Call) and isinstance(b.value.args[0], relax.ExternFunc)
              and b.value.args[0].global_symbol == HOOKS_FUNC]
    assert len(packed) == 1
    # every kernel of the create call now comes from the wrappers: no GlobalVar is left in it
    assert not any(isinstance(a, tvm.ir.GlobalVar) for a in call.args[1:])


def test_analyze_declines_kernels_of_another_layout():
    rope, append = _kernels(_module(_config(gqa=True)))
    assert analyze(rope, append) is not None
    assert analyze(append, rope) is None  # swapped
    assert analyze(rope, rope) is None
    other_rope, _ = _kernels(_module(_config(gqa=False)))  # 4 KV heads: not the append's 2
    assert analyze(other_rope, append) is None


def test_a_module_whose_kernels_do_not_match_is_left_alone():
    mod = _module(_config(gqa=True))
    args = create_calls(mod)[0].args[1:]
    mod[args[TRANSPOSE_APPEND_ARG]] = mod[args[SPLIT_ROTARY_ARG]]  # the append slot's kernel: not an append
    out = FuseRopeAppend()(mod)
    tvm.ir.assert_structural_equal(out, mod)
    assert FUSED_NAME not in [gv.name_hint for gv in out.get_global_vars()]


def test_a_cache_with_an_external_kernel_is_left_alone():
    @relax.expr_functor.mutator
    class External(relax.PyExprMutator):  # one attention kernel as an external function (FlashInfer's)
        def visit_global_var_(self, gv):
            return relax.ExternFunc("flashinfer.prefill") if gv.name_hint == "batch_prefill_ragged_kv" else gv

    mod = _module(_config(gqa=True))
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and create_calls(tvm.IRModule({gv: func})):
            mod[gv] = External(mod).visit_expr(func)
    assert any(isinstance(e, relax.ExternFunc) for e in _flatten(create_calls(mod)[0].args[1:]))
    tvm.ir.assert_structural_equal(FuseRopeAppend()(mod), mod)


def _flatten(args):
    for a in args:
        yield from (_flatten(a.fields) if isinstance(a, relax.Tuple) else [a])


def _hooks():
    calls = []
    hooks = kv_hooks.RopeAppendHooks(
        lambda *a: calls.append(("fused", a)), lambda *a: calls.append(("split", a)), lambda *a: calls.append(("append", a))
    )
    other = hooks.wrap(lambda *a: calls.append(("attention", a)))
    return hooks, other, calls


def test_wrappers_fuse_a_split_followed_by_its_append():
    hooks, _, calls = _hooks()
    k, v = FakeTensor(1), FakeTensor(2)
    hooks.record_split("qkv", "pos", "q", k, v, 1)
    assert calls == []  # nothing launched yet
    hooks.run_append("pages", FakeTensor(1), FakeTensor(2), "append_pos")  # new views of the same k and v
    assert calls == [("fused", ("qkv", "pos", "q", k, v, 1, "pages", "append_pos"))]
    hooks.run_append("pages", k, v, "append_pos")  # nothing pending: TVM's append
    assert calls[-1][0] == "append"


def test_wrappers_run_a_pending_split_before_any_other_kernel():
    hooks, attention, calls = _hooks()
    k, v = FakeTensor(1), FakeTensor(2)
    hooks.record_split("qkv", "pos", "q", k, v, 1)
    attention("q", "out")  # prefill attends first: the split must have run
    hooks.run_append("pages", k, v, "append_pos")
    assert [c[0] for c in calls] == ["split", "attention", "append"]


def test_wrappers_keep_order_for_other_buffers_and_repeated_splits():
    hooks, _, calls = _hooks()
    hooks.record_split("qkv0", "pos", "q", FakeTensor(1), FakeTensor(2), 1)
    hooks.record_split("qkv1", "pos", "q", FakeTensor(1), FakeTensor(2), 1)  # the first runs now
    hooks.run_append("pages", FakeTensor(7), FakeTensor(2), "append_pos")  # not the split's k
    assert [(c[0], c[1][0]) for c in calls] == [("split", "qkv0"), ("split", "qkv1"), ("append", "pages")]
    hooks.record_split("qkv2", "pos", "q", FakeTensor(1), FakeTensor(2, (3, 2, 8)), 1)
    hooks.run_append("pages", FakeTensor(1), FakeTensor(2), "append_pos")  # v of another shape
    assert [c[0] for c in calls[-2:]] == ["split", "append"]


@pytest.fixture
def counting_hooks():
    """The registered wrapper factory, counting the fused and unfused launches of every cache."""
    counts = {"fused": 0, "split": 0, "append": 0}

    def counted(name, fn):
        def call(*args):
            counts[name] += 1
            return fn(*args)

        return call

    def make(fused, split, append, *kernels):
        return kv_hooks.make_wrappers(counted("fused", fused), counted("split", split), counted("append", append), *kernels)

    import tvm_ffi

    kv_hooks.register()
    tvm_ffi.register_global_func(HOOKS_FUNC, make, override=True)
    yield counts
    tvm_ffi.register_global_func(HOOKS_FUNC, kv_hooks.make_wrappers, override=True)


@pytest.mark.parametrize("gqa", [True, False])
def test_llama_with_the_fused_kernel_matches_the_reference(counting_hooks, gqa):
    cfg = _config(gqa)
    target = to_tvm(resolve("llvm"))
    mod = FuseRopeAppend()(_module(cfg))
    assert FUSED_NAME in [gv.name_hint for gv in mod.get_global_vars()]
    vm = relax.VirtualMachine(tvm.compile(mod, target=target, relax_pipeline=relax.get_default_pipeline(target)), tvm.cpu())
    seed = 7 + gqa
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, 37)  # three 16-token chunks: attention before append
    decode_ids = [int(t) for t in rng.integers(0, cfg.vocab_size, 5)]
    errors = compare_with_reference(
        vm, tvm.cpu(), cfg, random_weights(cfg, seed=seed), prompt, decode_ids, max_total_seq_len=64, prefill_chunk_size=16
    )
    assert max(errors) < TOLERANCE, errors
    layers = cfg.num_hidden_layers
    # decode steps take the fused kernel; prefill chunks run TVM's two kernels (attention in between)
    assert counting_hooks["fused"] == layers * len(decode_ids)
    assert counting_hooks["split"] == counting_hooks["append"] == layers * 3


def test_mlc_integration_leaves_the_pass_out():
    from fuselight.mlc.pipeline import Options

    assert "fuse_rope_append" not in Options().graph_passes(fuselight_runtime=False)
    assert "fuse_rope_append" in Options().graph_passes()  # fuselight's own pipeline
    with pytest.raises(FuselightError, match="needs the fuselight runtime"):
        Options(passes=("fuse_rope_append",)).check_without_fuselight_runtime()


def test_the_rule_schedules_only_the_fused_kernel_and_it_builds_for_sm_90():
    
    from fuselight.cuda_compile import compile_cuda
    from fuselight.rules.rope_append import RopeAppend, load_rope_append_config

    cuda = to_tvm(resolve("cuda", "sm_90"))
    mod = FuseRopeAppend()(_module(_config(gqa=True)))
    rule = RopeAppend()
    for gv, func in mod.functions_items():  # the module's other kernels: not this rule's
        if isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint != FUSED_NAME:
            assert rule.apply(func, cuda, False) is None, gv.name_hint
    assert rule.apply(mod[FUSED_NAME], to_tvm(resolve("llvm")), False) is None
    scheduled = rule.apply(mod[FUSED_NAME], cuda, False).mod["main"].with_attr("tirx.is_scheduled", True)
    assert rule.apply(scheduled, cuda, False) is None  # scheduled once
    threads = load_rope_append_config("sm_90").threads
    lib = tvm.compile(tvm.IRModule({FUSED_NAME: scheduled}), target=cuda)
    source = lib.mod.imports[0].inspect_source("cuda")
    kernels = set(re.findall(r"__global__ void __launch_bounds__\((\d+)\) (\w+)\(", source))
    assert kernels == {(str(threads), f"{FUSED_NAME}_kernel")}  # one kernel, a block of `threads`
    require_nvcc()
    assert compile_cuda(source, "sm_90")
