"""The paged-KV attention rule, its split-KV decode template and the pass that hands them to the KV cache.

GPU numerics are the paged-attention benchmark suite's (``fuselight bench paged-run``); here: the
rule recognises TVM's kernels by interface and nothing else, the decode template keeps TVM's
signature, builds for sm_90 into two kernels and nvcc compiles it, the pass points a LLaMA
model's KV cache at fuselight's kernels only where it should, and the suite's points and costs.
"""

import dataclasses

import pytest
from conftest import require_nvcc
import tvm
from fuselight import config as model_config
from fuselight.bench.paged_attention import Layout, Point, gpu_layouts, layout_name, load_points
from fuselight.contracts import PAGED_ATTENTION_ATTR
from fuselight.cuda_compile import compile_cuda
from fuselight.errors import FuselightError
from fuselight.model.llama import export_module
from fuselight.passes.paged_attention import PagedAttentionKernels
from fuselight.rules.flash.decode import DecodeConfig, flash_decode_paged, load_decode_config
from fuselight.rules.paged_attention import PagedAttention, analyze, kernel_for
from fuselight.target import resolve, to_tvm
from tvm.relax.frontend.nn.llm import _decode_kernels as dk
from tvm.relax.frontend.nn.llm import _prefill_kernels as pk
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode
from tvm.s_tir import dlight as dl
from tvm.script import tirx as T

CUDA = to_tvm(resolve("cuda", "sm_90"))
LLVM = to_tvm(resolve("llvm"))


def _decode(h_kv=8, h_q=32, d=128, dtype="float16", sliding=False):
    return dk._attention_decode(h_kv, h_q, d, dtype, sliding, {}, CUDA)


def _ragged(h_kv=8, h_q=32, d=128, dtype="float16"):
    return pk._attention_prefill_ragged(h_kv, h_q, d, d, dtype, {}, CUDA)


@T.prim_func(s_tir=True)
def _matmul(a: T.Buffer((16, 16), "float16"), b: T.Buffer((16, 16), "float16"), c: T.Buffer((16, 16), "float16")):
    for i, j, k in T.grid(16, 16, 16):
        with T.sblock("c"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                c[vi, vj] = T.float16(0)
            c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vj, vk]


def test_recognises_tvm_decode_and_ragged_prefill():
    d = analyze(_decode())
    assert (d.kind, d.num_qo_heads, d.num_kv_heads, d.head_dim, d.page_size, d.dtype) == ("decode", 32, 8, 128, 16, "float16")
    r = analyze(_ragged(4, 4, 64, "bfloat16"))
    assert (r.kind, r.num_qo_heads, r.num_kv_heads, r.head_dim, r.dtype) == ("prefill_ragged", 4, 4, 64, "bfloat16")


@pytest.mark.parametrize(
    "func",
    [
        _matmul,
        dk._merge_state_inplace(32, 128, "float16", CUDA),
        pk._attention_prefill_ragged(8, 32, 128, 64, "float16", {}, CUDA),  # d_v != d_qk
    ],
    ids=["matmul", "merge_state", "mla_ragged"],
)
def test_declines_what_it_does_not_own(func):
    assert analyze(func) is None
    assert kernel_for(func, CUDA) is None


def test_declines_sliding_window_and_unsupported_layouts():
    assert analyze(_decode(sliding=True)) is None
    assert kernel_for(_decode(), LLVM) is None
    assert kernel_for(_decode(d=96), CUDA) is None  # head dim without a config
    assert kernel_for(_decode(dtype="float32"), CUDA) is None


def _signature(func):
    return [(p.name, str(p.ty) if not isinstance(p.ty, tvm.tirx.BufferType) else (str(p.dtype), len(p.shape))) for p in func.params]


@pytest.mark.parametrize("d,h_kv", [(128, 8), (64, 32)])
def test_decode_template_keeps_tvm_signature_and_splits_in_two_kernels(d, h_kv):
    ours = kernel_for(_decode(h_kv=h_kv, d=d), CUDA)
    assert _signature(ours) == _signature(_decode(h_kv=h_kv, d=d))
    assert ours.attrs["global_symbol"] == "fuselight_decode_paged_kv"
    src = tvm.compile(tvm.IRModule({"main": ours}), target=CUDA).mod.imports[0].inspect_source("cuda")
    assert src.count("__global__") == 4  # split and merge, each declared then defined
    assert "uint4" in src  # 16-byte K/V loads
    require_nvcc()
    compile_cuda(src, arch="sm_90")


def test_decode_template_errors_name_the_problem():
    cfg = load_decode_config("sm_90")
    with pytest.raises(FuselightError, match="dtype"):
        flash_decode_paged(8, 32, 128, "int8", 16, cfg)
    with pytest.raises(FuselightError, match="must divide"):
        flash_decode_paged(3, 32, 128, "float16", 16, cfg)
    with pytest.raises(FuselightError, match="head dim 100"):
        flash_decode_paged(8, 32, 100, "float16", 16, cfg)
    with pytest.raises(FuselightError, match="no entry 'sm_75' and no device description"):
        load_decode_config("sm_75")
    assert isinstance(cfg, DecodeConfig) and cfg.warps > 0


def _llama(rope_mode=None):
    cfg = dataclasses.replace(
        model_config.load("tiny-llama"), hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, dtype="float16"
    )
    mod = export_module(cfg, CUDA)[0]
    if rope_mode is None:
        return mod
    # The same module with the KV cache asked to apply RoPE inside attention.
    from tvm import relax

    @relax.expr_functor.mutator
    class _Inline(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if isinstance(call.args[0], relax.ExternFunc) and "kv_cache_create" in call.args[0].global_symbol:
                args = list(call.args)
                args[9] = tvm.tirx.IntImm("int64", int(rope_mode))
                return relax.Call(call.op, args, call.attrs, call.ty_args)
            return call

    gv = mod.get_global_var("create_tir_paged_kv_cache")
    mutated = _Inline(mod)
    mod[gv] = mutated.visit_expr(mod[gv])
    return mod


def _cache_kernels(mod):
    return str(mod["create_tir_paged_kv_cache"].script())


def test_pass_points_the_kv_cache_at_fuselight_kernels():
    mod = _llama()
    with CUDA:
        out = PagedAttentionKernels()(mod)
    script = _cache_kernels(out)
    assert "fuselight_decode_paged_kv" in script
    assert "batch_decode_paged_kv)" not in script
    assert "batch_decode_paged_kv_sliding_window" in script  # left to TVM
    assert out.get_global_var("fuselight_decode_paged_kv") is not None
    names = {gv.name_hint for gv in out.get_global_vars()}
    assert "batch_decode_paged_kv" not in names  # replaced kernels leave the module
    assert "batch_decode_paged_kv_sliding_window" in names
    # TVM's kernel, handed to the rule: tagged, no longer marked scheduled; the rule swaps in ours in phase 4.
    tagged = out["fuselight_decode_paged_kv"]
    assert tagged.attrs[PAGED_ATTENTION_ATTR] == "decode" and "tirx.is_scheduled" not in tagged.attrs
    assert PagedAttention().apply(_decode(), CUDA, False) is None  # untagged: not the rule's
    with CUDA:
        out = dl.ApplyDefaultSchedule(PagedAttention())(out)
    assert int(out["fuselight_decode_paged_kv"].attrs["fuselight.kernel_launches"]) == 2  # split + merge
    assert str(out["fuselight_decode_paged_kv"].attrs["global_symbol"]) == "fuselight_decode_paged_kv"
    # the original module is untouched
    assert "fuselight" not in _cache_kernels(mod)


def test_pass_leaves_inline_rope_and_cpu_alone():
    with CUDA:
        inline = PagedAttentionKernels()(_llama(RopeMode.INLINE))
    assert "fuselight" not in _cache_kernels(inline)
    mod = _llama()
    with LLVM:
        assert "fuselight" not in _cache_kernels(PagedAttentionKernels()(mod))


def test_gpu_tier_layouts_cover_dtype_head_dim_and_group():
    """The GPU tier's KV-cache layouts (issue 28): fp16 and bf16 x head dim 64 and 128 x GQA groups
    1, 3 and 4, GQA 32/8, 9/3, 7/1 and 1/1; every kind checked at lengths 1, 7, 127 and 1000."""
    layouts = gpu_layouts()
    assert {(l.dtype, l.head_dim, l.q_heads // l.kv_heads) for l in layouts} >= {
        (dt, d, g) for dt in ("float16", "bfloat16") for d in (64, 128) for g in (1, 3, 4)}
    assert {(l.q_heads, l.kv_heads) for l in layouts} >= {(32, 8), (9, 3), (7, 1), (1, 1)}
    assert len({layout_name(l) for l in layouts}) == len(layouts)
    _, points = load_points("gpu")
    for kind in ("decode", "prefill", "rope_decode"):
        assert {1, 7, 127, 1000} <= {n for p in points if p.kind == kind for n in p.lengths}, kind
    with pytest.raises(FuselightError, match="no paged_attention.nothing section"):
        load_points("nothing")


def test_suite_points_and_costs():
    layout, points = load_points()
    assert {p.kind for p in points} == {"decode", "prefill", "rope_decode"}
    small = Layout(q_heads=4, kv_heads=2, head_dim=8, dtype="float16", page_size=16, rope_theta=1e4)
    # decode: K and V of every row, plus q and out; rope_decode the same bytes
    assert Point("decode", (3, 5)).cost(small) == ((2 * 8 * 2 * 8 + 2 * 2 * 4 * 8) * 2, 4 * 8 * 8 * 4)
    assert Point("rope_decode", (3, 5)).cost(small) == Point("decode", (3, 5)).cost(small)
    # causal prefill counts the lower triangle with its diagonal
    assert Point("prefill", (3,), causal=True).cost(small)[1] == 4 * 6 * 8 * 4
    assert Point("prefill", (3,), causal=False).cost(small)[1] == 4 * 9 * 8 * 4
    assert Point("decode", (7, 7)).name == "decode-b2x7"
    assert Point("prefill", (1, 4), causal=True).name == "prefill-ragged-1-4-causal"
