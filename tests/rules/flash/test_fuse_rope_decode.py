"""RoPE, the KV append and decode attention in one kernel: ``rules/flash/rotary.py`` (TVM's
split-rotary read as values), ``flash_decode_paged_rotary`` (``rules/flash/decode.py``), the pass
that hands it to the cache (``passes/fuse_rope_append.py``) and its run-time wrappers
(``fuselight.kv_hooks``).

GPU numerics are the paged-attention suite's ``rope_decode`` points (``fuselight bench paged-run``:
against float64 with RoPE, the new K/V rows poisoned) and the end-to-end suite's. Here: the values
read out of TVM's kernel, instantiated in another kernel, equal TVM's on the CPU; the pass adds the
fused kernel only where it is legal; the fused kernel builds for sm_90 and nvcc compiles it; the
wrappers launch it only for split -> append -> decode on the same buffers.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import tvm
from conftest import FakeTensor, require_nvcc
from fuselight import config as model_config
from fuselight import kv_hooks
from fuselight.compile import _decode_attention_launches, kv_cache_kernels
from fuselight.cuda_compile import compile_cuda
from fuselight.model.llama import export_module
from fuselight.model.weights import hf_config
from fuselight.passes.fuse_rope_append import (
    DISAGGREGATION_ARG,
    FUSED_DECODE_ATTR,
    HOOKS_DECODE_FUNC,
    HOOKS_FUNC,
    SPLIT_ROTARY_ARG,
    TRANSPOSE_APPEND_ARG,
    FuseRopeAppend,
)
from fuselight.passes.paged_attention import (
    CREATE_FUNC,
    PagedAttentionKernels,
    create_calls,
)
from fuselight.rules.flash import rotary
from fuselight.rules.flash.decode import ROTARY_GLOBAL_SYMBOL, flash_decode_paged_rotary, load_decode_config
from fuselight.rules.paged_attention import PagedAttention
from fuselight.target import resolve, to_tvm
from tvm import relax
from tvm.s_tir import dlight as dl
from tvm.script import tirx as T

CUDA = to_tvm(resolve("cuda", "sm_90"))
LLVM = to_tvm(resolve("llvm"))


def _tiny(rope_scaling: bool) -> model_config.ModelConfig:
    tiny = model_config.load("tiny-llama")  # llama3 RoPE scaling, 4 query and 2 KV heads
    if rope_scaling:
        return tiny
    raw = hf_config(tiny)
    raw.update(rope_scaling=None, rope_theta=10000.0)
    return model_config.from_dict(raw, name="tiny-default-rope")


def _split_rotary(cfg: model_config.ModelConfig) -> tvm.tirx.PrimFunc:
    mod = export_module(cfg, LLVM)[0]
    return mod[create_calls(mod)[0].args[1:][SPLIT_ROTARY_ARG]]


def _instantiated(rot: rotary.SplitRotary, tokens: int) -> tvm.tirx.PrimFunc:
    """A kernel of the split-rotary's signature computing every element by ``rot.value``."""
    H, KV, D, dt = rot.num_qo_heads, rot.num_kv_heads, rot.head_dim, rot.dtype

    @T.prim_func(s_tir=True)
    def split(
        qkv: T.Buffer((tokens, H + 2 * KV, D), dt), positions: T.Buffer((tokens,), "int32"),
        q: T.Buffer((tokens, H, D), dt), k: T.Buffer((tokens, KV, D), dt), v: T.Buffer((tokens, KV, D), dt),
        apply_rope: T.int64,
    ):
        for s, h, d in T.grid(tokens, H, D):
            q[s, h, d] = rot.value(rotary.Q_OUT, qkv, positions, apply_rope, s, h, d)
        for s, h, d in T.grid(tokens, KV, D):
            k[s, h, d] = rot.value(rotary.K_OUT, qkv, positions, apply_rope, s, h, d)
            v[s, h, d] = rot.value(rotary.V_OUT, qkv, positions, apply_rope, s, h, d)

    return split


@pytest.mark.parametrize("rope_scaling", [True, False])
@pytest.mark.parametrize("apply_rope", [1, 0])
def test_values_read_from_tvm_kernel_reproduce_it(rope_scaling, apply_rope):
    theirs = _split_rotary(_tiny(rope_scaling))
    rot = rotary.analyze(theirs)
    assert rot is not None and rot.head_offsets == (0, rot.num_qo_heads, rot.num_qo_heads + rot.num_kv_heads)
    tokens = 7
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((tokens, rot.num_qo_heads + 2 * rot.num_kv_heads, rot.head_dim)).astype(rot.dtype)
    positions = rng.integers(0, 5000, tokens).astype("int32")
    results = []
    for func in (theirs, _instantiated(rot, tokens)):
        fn = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)["main"]
        outs = [tvm.runtime.tensor(np.full((tokens, n, rot.head_dim), np.nan, rot.dtype))
                for n in (rot.num_qo_heads, rot.num_kv_heads, rot.num_kv_heads)]
        fn(tvm.runtime.tensor(qkv), tvm.runtime.tensor(positions), *outs, apply_rope)
        results.append([o.numpy() for o in outs])
    for ours, ref in zip(results[1], results[0], strict=True):
        assert not np.isnan(ref).any()
        np.testing.assert_array_equal(ours, ref)  # the same expression: the same bits
    q = results[0][0]
    assert (q != qkv[:, : rot.num_qo_heads]).any() == bool(apply_rope)  # RoPE did (not) rotate


def _toy_split(shift: int, read_k: bool) -> tvm.tirx.PrimFunc:
    """A split-rotary-shaped kernel; its q element goes to token s + ``shift``, and with ``read_k``
    its value also reads the k output (not a function of qkv and the positions alone)."""

    @T.prim_func(s_tir=True)
    def split(
        qkv: T.Buffer((4, 8, 16), "float16"), positions: T.Buffer((4,), "int32"), q: T.Buffer((4, 4, 16), "float16"),
        k: T.Buffer((4, 2, 16), "float16"), v: T.Buffer((4, 2, 16), "float16"), apply_rope: T.int64,
    ):
        for i, j, l in T.grid(3, 8, 16):
            with T.sblock("split"):
                s, h, d = T.axis.remap("SSS", [i, j, l])
                if h < 4:
                    if read_k:
                        q[s + shift, h, d] = qkv[s, h, d] + k[s, 0, d]
                    else:
                        q[s + shift, h, d] = qkv[s, h, d] * T.Cast("float16", positions[s])
                elif h < 6:
                    k[s, h - 4, d] = qkv[s, h, d]
                else:
                    v[s, h - 6, d] = qkv[s, h, d]

    return split


def test_analyze_declines_what_is_not_a_split_rotary():
    mod = export_module(_tiny(True), LLVM)[0]
    args = create_calls(mod)[0].args[1:]
    assert rotary.analyze(mod[args[TRANSPOSE_APPEND_ARG]]) is None
    assert rotary.analyze(_toy_split(0, read_k=False)) is not None
    assert rotary.analyze(_toy_split(0, read_k=True)) is None
    assert rotary.analyze(_toy_split(1, read_k=False)) is None  # stored at another token than it reads


def _fp16_llama_config(**changes) -> model_config.ModelConfig:
    fields = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, dtype="float16")
    return dataclasses.replace(model_config.load("tiny-llama"), **{**fields, **changes})


def _fp16_llama(**changes) -> tvm.IRModule:
    return export_module(_fp16_llama_config(**changes), CUDA)[0]


def _hooks_call(mod: tvm.IRModule) -> relax.Call:
    found = []
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.Call)
                                            and isinstance(e.args[0], relax.ExternFunc)
                                            and e.args[0].global_symbol.startswith("fuselight.kv_cache") else None)
    (call,) = found
    return call


def test_the_pass_gives_fuselight_decode_the_rope_and_append_and_it_builds_for_sm_90():
    with CUDA:
        out = FuseRopeAppend()(PagedAttentionKernels()(_fp16_llama()))
    call = _hooks_call(out)
    assert call.args[0].global_symbol == HOOKS_DECODE_FUNC
    # factory arguments: the fused RoPE + append, the fused decode, then split, append, decode, ...
    assert [a.name_hint for a in call.args[1:6]] == [
        "fused_rope_append", ROTARY_GLOBAL_SYMBOL, "fused_rope", "tir_kv_cache_transpose_append", "fuselight_decode_paged_kv",
    ]
    # TVM's split-rotary, handed to the PagedAttention rule (tagged with the page size), which builds
    # the fused decode kernel in phase 4.
    assert "tirx.is_scheduled" not in out[ROTARY_GLOBAL_SYMBOL].attrs
    with CUDA:
        out = dl.ApplyDefaultSchedule(PagedAttention())(out)
    fused = out[ROTARY_GLOBAL_SYMBOL]
    # two launches as shipped (merge_in_split off in configs/attention/decode.json: measured slower)
    assert FUSED_DECODE_ATTR in fused.attrs and int(fused.attrs["fuselight.kernel_launches"]) == 2
    assert str(fused.attrs["global_symbol"]) == ROTARY_GLOBAL_SYMBOL
    assert fused.params[-1].name.startswith("counters")  # (a handle the kernel leaves unused, as shipped)
    assert kv_cache_kernels(out) == 0  # a decode layer launches nothing for RoPE and the append
    # a decode step launches the fused kernel, not TVM's decode kernel beside it (two launches)
    assert int(out["fuselight_decode_paged_kv"].attrs["fuselight.kernel_launches"]) == 2
    assert _decode_attention_launches(out) == 2
    lib = tvm.compile(tvm.IRModule({"main": fused}), target=CUDA)
    source = lib.mod.imports[0].inspect_source("cuda")
    assert len(set(re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", source))) == 2
    assert "cosf" in source and "sinf" in source  # RoPE computed in the split kernel
    require_nvcc()
    assert compile_cuda(source, "sm_90")


def _events(func: tvm.tirx.PrimFunc) -> list[tuple]:
    """The kernel's barriers, fences, atomics, L1-bypassing loads and stores, in program order."""
    found: list[tuple] = []

    def visit(node):
        if isinstance(node, tvm.ir.Call) and isinstance(node.op, tvm.ir.Op):
            name = node.op.name
            if name == "tirx.tvm_storage_sync":
                found.append(("sync",))
            elif name == "tirx.cuda.thread_fence":
                found.append(("fence",))
            elif name == "tirx.cuda.atomic_add":
                found.append(("atomic", node.args[0].args[0].buffer.name, node.args[0].args[0].indices[0], int(node.args[1])))
            elif name == "tirx.ptx.ld":
                found.append(("load", node.args[0].args[0].buffer.name, f"{node.args[4].value}.{node.args[5].value}"))
        elif isinstance(node, tvm.tirx.BufferStore):
            found.append(("store", node.buffer.name, node.indices[0] if node.buffer.name == "counters" else None,
                          node.value.value if isinstance(node.value, tvm.tirx.IntImm) else None))
        return True

    tvm.tirx.stmt_functor.pre_order_visit(func.body, visit)
    return found


@pytest.fixture(scope="module")
def rotary_kernels() -> dict[str, object]:
    """The fused decode kernel of SmolLM2's head layout (GQA 9/3, head dim 64) with the last split
    block merging (``merge_in_split``) for sm_90 and sm_80, as the rule schedules it (``shipped``),
    and (``desc``) what the rule read of it."""
    mod = export_module(_fp16_llama_config(num_attention_heads=9, num_key_value_heads=3, hidden_size=576), CUDA)[0]
    with CUDA:
        fused = FuseRopeAppend()(PagedAttentionKernels()(mod))[ROTARY_GLOBAL_SYMBOL]
    desc = PagedAttention.analyze(fused)
    kernels = {arch: flash_decode_paged_rotary(desc.rotary, desc.page_size,
                                               dataclasses.replace(load_decode_config(arch), merge_in_split=True))
               for arch in ("sm_90", "sm_80")}
    return {**kernels, "desc": desc, "shipped": PagedAttention().schedule(fused, desc, CUDA)}


def test_last_split_block_merges_after_every_block_counted_itself(rotary_kernels):
    """Each block: its partials stored, a barrier, a device fence, one atomic add on its (sequence,
    KV head)'s counter, the verdict shared through a barrier; the last block then fences, reads the
    partials past L1, writes the output and lse, and sets the same counter back to zero."""
    for arch in ("sm_90", "sm_80"):
        kernel = rotary_kernels[arch]
        events = _events(kernel)
        kinds = [e[0] for e in events]
        (atomic_at,) = [i for i, e in enumerate(events) if e[0] == "atomic"]
        _, counters, slot, step = events[atomic_at]
        assert (counters, step) == ("counters", 1), arch
        partial_stores = [i for i, e in enumerate(events) if e[:2] in (("store", "O_part"), ("store", "lse_part"))]
        assert partial_stores and max(partial_stores) < atomic_at, arch
        # after the last partial store: barrier, then fence right before the atomic
        assert "sync" in kinds[max(partial_stores):atomic_at - 1] and kinds[atomic_at - 1] == "fence", arch
        after = events[atomic_at + 1:]
        assert [e[0] for e in after[:2]] == ["store", "sync"], arch  # the verdict, shared
        fence_at = after.index(("fence",))  # the last block fences before it reads
        assert all(e[:2] == ("store", "last") for e in after[2:fence_at]), arch  # (its register copy)
        loads = [e for e in after if e[0] == "load"]
        assert {e[1] for e in loads} == {"O_part", "lse_part"} and {e[2] for e in loads} == {"global.cg"}, arch
        stores = [e for e in after if e[0] == "store"]
        outputs = [i for i, e in enumerate(after) if e[:2] in (("store", "output"), ("store", "lse"))]
        first_load = next(i for i, e in enumerate(after) if e[0] == "load")
        assert fence_at < first_load < min(outputs), arch
        # the reset is the last store, of the counter the block added to
        assert stores[-1][:2] == ("store", "counters") and stores[-1][3] == 0, arch
        tvm.ir.assert_structural_equal(stores[-1][2], slot, map_free_vars=True)
        assert not any(e[:2] == ("store", "counters") for e in events[:atomic_at]), arch
        assert int(kernel.attrs["fuselight.kernel_launches"]) == 1, arch


def test_fused_decode_kernel_compiles_for_sm_80(rotary_kernels):
    """No griddepcontrol before sm_90: the atomics and fences are all it needs there."""
    target = to_tvm(resolve("cuda", "sm_80"))
    source = tvm.compile(tvm.IRModule({"main": rotary_kernels["sm_80"]}), target=target).mod.imports[0].inspect_source("cuda")
    assert len(set(re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", source))) == 1
    assert "griddepcontrol" not in source
    require_nvcc()
    assert compile_cuda(source, "sm_80")


def test_shipped_config_keeps_the_merge_kernel(rotary_kernels):
    """merge_in_split is off as shipped: two launches, the counters unused, the parameters the same."""
    shipped, fused = rotary_kernels["shipped"], rotary_kernels["sm_90"]
    assert int(shipped.attrs["fuselight.kernel_launches"]) == 2
    assert [p.name for p in shipped.params[:-1]] == [p.name for p in fused.params[:-1]]
    assert (shipped.params[-1].name, fused.params[-1].name) == ("counters_handle", "counters")
    assert not any(e[0] in ("atomic", "fence") for e in _events(shipped))


def _factory(mod: tvm.IRModule) -> str:
    return _hooks_call(mod).args[0].global_symbol


def test_the_pass_keeps_two_kernels_where_the_fusion_is_not_legal():
    # no target in scope: the decode kernel cannot be built
    with CUDA:
        ours = PagedAttentionKernels()(_fp16_llama())
    assert _factory(FuseRopeAppend()(ours)) == HOOKS_FUNC
    # TVM's own decode kernel (paged_attention did not run): it reads q and the pages itself
    with CUDA:
        assert _factory(FuseRopeAppend()(_fp16_llama())) == HOOKS_FUNC
    # k and v may be transferred between the append and attention
    with CUDA:
        disaggregated = FuseRopeAppend()(PagedAttentionKernels()(_with_arg(_fp16_llama(), DISAGGREGATION_ARG, True)))
    assert _factory(disaggregated) == HOOKS_FUNC
    assert kv_cache_kernels(disaggregated) == 1


def _with_arg(mod: tvm.IRModule, index: int, value: object) -> tvm.IRModule:
    """``mod`` (changed in place) with the create call's argument ``index`` (after its name) replaced."""

    @relax.expr_functor.mutator
    class _Replace(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if isinstance(call.args[0], relax.ExternFunc) and call.args[0].global_symbol == CREATE_FUNC:
                args = list(call.args)
                args[1 + index] = tvm.tirx.IntImm("bool", int(value))
                return relax.Call(call.op, args, call.attrs, call.ty_args)
            return call

    gv = mod.get_global_var("create_tir_paged_kv_cache")
    mod[gv] = _Replace(mod).visit_expr(mod[gv])
    return mod


def _decode_hooks():
    calls = []

    def named(name):
        return lambda *a: calls.append((name, a))

    hooks = kv_hooks.RopeAppendHooks(named("fused"), named("split"), named("append"), named("fused_decode"), named("decode"))
    return hooks, hooks.wrap(named("other")), calls


Q, K, V, PAGES = FakeTensor(10, (1, 4, 8)), FakeTensor(1), FakeTensor(2), FakeTensor(20, (9, 2, 2, 16, 8))


def test_decode_wrapper_launches_one_kernel_for_split_append_and_attention():
    hooks, _, calls = _decode_hooks()
    hooks.record_split("qkv", "pos", Q, K, V, 1)
    hooks.run_append(PAGES, FakeTensor(1), FakeTensor(2), "append_pos")
    assert calls == []  # both wait for the attention
    hooks.run_decode(FakeTensor(10, (1, 4, 8)), FakeTensor(20, (9, 2, 2, 16, 8)), "indptr", "out", 0.125)
    (name, args), = calls
    assert (name, args[:-1]) == ("fused_decode", ("qkv", "pos", Q, K, V, 1, PAGES, "append_pos", "indptr", "out", 0.125))
    # last, the counters the hooks own: zero, one for each of the cache's 9 pages x 2 KV heads
    counters = args[-1]
    assert counters.dtype == "int32" and counters.numpy().tolist() == [0] * 18
    hooks.record_split("qkv", "pos", Q, K, V, 1)
    hooks.run_append(PAGES, K, V, "append_pos")
    hooks.run_decode(Q, PAGES, "indptr", "out", 0.125)
    assert calls[-1][1][-1] is counters  # the same ones every call (a captured graph replays them)
    hooks.run_decode(Q, PAGES, "indptr", "out", 0.125)  # nothing pending: the decode kernel alone
    assert calls[-1][0] == "decode"


def test_decode_wrapper_falls_back_in_order():
    hooks, other, calls = _decode_hooks()
    hooks.record_split("qkv", "pos", Q, K, V, 1)
    hooks.run_append(PAGES, K, V, "append_pos")
    hooks.run_decode(FakeTensor(11, (1, 4, 8)), PAGES, "out")  # another q: RoPE + append run first
    assert [c[0] for c in calls] == ["fused", "decode"]
    hooks.record_split("qkv", "pos", Q, K, V, 1)
    hooks.run_append(PAGES, K, V, "append_pos")
    other("merge")  # any other kernel between append and attention
    hooks.run_decode(Q, PAGES, "out")
    assert [c[0] for c in calls[2:]] == ["fused", "other", "decode"]
    hooks.record_split("qkv", "pos", Q, K, V, 1)
    other("prefill")  # prefill attends before it appends
    hooks.run_append(PAGES, K, V, "append_pos")
    assert [c[0] for c in calls[5:]] == ["split", "other", "append"]
