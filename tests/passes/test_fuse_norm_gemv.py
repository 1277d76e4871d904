"""FuseNormIntoGemv and the GEMV norm prologue: on our LLaMA the pass fuses every decode norm into the
GEMV after it (numbers equal to the unrewritten model on llvm, prefill untouched); on cuda it replaces
FuseAddRMSNorm's kernel + the GEMV (FuseGateUpSiLU's included) by one scheduled kernel; the analysis
describes the prologue and hands it to the GEMV rule only; near misses stay as they are; the kernels
build for sm_90 and nvcc compiles them (GPU numerics against float64: the measurements' script)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from conftest import needs_nvcc, relative_error
from fuselight.baseline.fuse_add_rms_norm import FuseAddRMSNorm
from fuselight.baseline.fuse_transpose_matmul import FuseTransposeMatmul, nt_matmul
from fuselight.passes import (
    PASSES,
    AccumulateMatmulFP32,
    FuseGateUpSiLU,
    FuseNormIntoGemv,
)
from fuselight.computations import fused_norm_matmul, gate_up_silu_te, with_dequantized_weight
from fuselight.passes.weight_source import materialized_weights
from fuselight.quantization import SCHEMES, random_quantized, te_dequantize
from fuselight.contracts import RULE_ATTR
from fuselight.passes.fuse_norm_gemv import PRIMFUNC_NAME
from fuselight.rules.gemm import gemv
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.base import with_kernels
from fuselight.rules.gemm.gemv_common import GemvConfig
from fuselight.rules.gemv import Gemv
from fuselight.rules.matmul import Matmul
from fuselight.target import resolve, to_tvm
from relax_module import single_function
from tir_query import kernel
from tvm import relax, te, tirx, topi

HIDDEN = 1024  # a multiple of 1024: FuseAddRMSNorm applies on cuda
EPS = 1e-5


@pytest.fixture(scope="module")
def cuda():
    return to_tvm(resolve("cuda", "sm_90"))


def _ty(*shape, dtype="float16"):
    return relax.TensorType(list(shape), dtype)


def _ph(shape, name, dtype="float16"):
    return te.placeholder([tirx.IntImm("int64", s) for s in shape], dtype, name)


def _nt_matmul(n: int, k: int = HIDDEN, dtype: str = "float16", m: int = 1) -> tirx.PrimFunc:
    """FuseTransposeMatmul's function for ``m`` token rows (float32 accumulator)."""
    a, b = _ph((m, 1, k), "a", dtype), _ph((n, k), "b", dtype)
    return te.create_prim_func([a, b, nt_matmul(a, b, "float32")])


def _gate_up(n: int, k: int = HIDDEN, dtype: str = "float16", m: int = 1) -> tirx.PrimFunc:
    a, b = _ph((m, 1, k), "a", dtype), _ph((n, k), "b", dtype)
    return te.create_prim_func([a, b, gate_up_silu_te(a, b, "float32", dtype)])


def _fused(consumer: tirx.PrimFunc, n: int, residual: bool = True, casts=("float16",), k: int = HIDDEN,
           dtype: str = "float16", x_dtype: str | None = None, stream: str | None = None):
    """The norm-GEMV function; ``stream``: its residual stream in that dtype, ``x`` read in ``x_dtype``."""
    return fused_norm_matmul(_ty(1, 1, k, dtype=x_dtype or dtype), residual, _ty(k, dtype=dtype), EPS, consumer,
                             [_ty(n, k, dtype=dtype)], casts, stream)


def _q4(consumer: tirx.PrimFunc, n: int, k: int = HIDDEN, scheme: str = "q4f16_1") -> tirx.PrimFunc:
    """``consumer`` ``(A, W) -> y`` with W dequantized from ``scheme``'s packed words and scales:
    ``(A, q, s) -> y`` (as the pass builds it)."""
    s = SCHEMES[scheme]
    qs, ss = s.packed_shapes(n, k)
    q, scale = _ph(qs, "q", "uint32"), _ph(ss, "s", s.model_dtype)
    return with_dequantized_weight(consumer, te.create_prim_func([q, scale, te_dequantize((q, scale), s)]))


def _fused_q4(consumer: tirx.PrimFunc, n: int, residual: bool = True, casts=("float16",), k: int = HIDDEN,
              scheme: str = "q4f16_1", m: int = 1, stream: str | None = None) -> tirx.PrimFunc:
    """``_fused`` with ``scheme``'s 4-bit weight; ``stream``: a residual stream in that dtype (x read in it)."""
    dtype = SCHEMES[scheme].model_dtype
    qs, ss = SCHEMES[scheme].packed_shapes(n, k)
    return fused_norm_matmul(_ty(m, 1, k, dtype=stream or dtype), residual, _ty(k, dtype=dtype), EPS,
                             _q4(consumer, n, k, scheme), [_ty(*qs, dtype="uint32"), _ty(*ss, dtype=dtype)], casts, stream)


def _calls(func: relax.Function) -> list[str]:
    names: list[str] = []

    def visit(n):
        if isinstance(n, relax.Call) and n.op == tvm.ir.Op.get("relax.call_tir"):
            names.append(n.args[0].name_hint)

    relax.analysis.post_order_visit(func, visit)
    return names


# --- the analysis -------------------------------------------------------------------------------


@pytest.mark.parametrize("residual", [True, False])
def test_analysis_describes_the_prologue(residual):
    func = _fused(_nt_matmul(384), 384, residual)
    desc = analyze_matmul(func, prologue=True)
    assert desc is not None and desc.m_static == 1 and desc.out_dtype == "float16"
    ops = desc.operands
    pro = ops.prologue
    assert (ops.n, ops.k, pro.eps) == (384, HIDDEN, pytest.approx(EPS))
    assert ops.a.same_as(pro.x) and pro.x.same_as(func.params[0])
    assert pro.weight.same_as(func.params[2 if residual else 1])
    if residual:
        assert pro.residual.same_as(func.params[1]) and pro.total.same_as(func.params[-1])
    else:
        assert pro.residual is None and pro.total is None
    # Templates without a prologue never see it: by default the function is not a matmul.
    assert analyze_matmul(func) is None
    assert analyze_matmul(_nt_matmul(384)).operands.prologue is None


def test_analysis_keeps_the_paired_epilogue():
    ops = analyze_matmul(_fused(_gate_up(2 * 344), 2 * 344, casts=()), prologue=True).operands
    assert ops.paired and ops.out_n == 344 and ops.prologue.residual is not None


@pytest.mark.parametrize("scheme", ["q4f16_1", "q4bf16_1"])
def test_analysis_describes_the_prologue_with_a_dequantized_weight(scheme):
    dtype = SCHEMES[scheme].model_dtype
    func = _fused_q4(_gate_up(2 * 352, dtype=dtype), 2 * 352, casts=(), scheme=scheme)
    desc = analyze_matmul(func, prologue=True, dequant=True)
    ops = desc.operands
    # Both ends of the kernel: the norm of x + r before, the packed words and scales for B.
    assert ops.prologue.residual.same_as(func.params[1]) and ops.prologue.weight.same_as(func.params[2])
    assert ops.b.same_as(func.params[3]) and ops.dequant.scale.same_as(func.params[4])
    assert (ops.dequant.dtype, ops.dequant.group, ops.dequant.zero) == (dtype, 32, 7.0)
    assert ops.paired and ops.out_n == 352 and ops.prologue.total.same_as(func.params[-1])
    # Either alone is not enough to describe it.
    assert analyze_matmul(func, prologue=True) is None and analyze_matmul(func, dequant=True) is None


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_analysis_describes_a_float32_stream(x_dtype):
    # residual_stream_fp32's: x + r summed and written in float32 (x bf16 where the stream starts)
    func = _fused(_nt_matmul(384, dtype="bfloat16"), 384, casts=("bfloat16",), dtype="bfloat16", x_dtype=x_dtype,
                  stream="float32")
    ops = analyze_matmul(func, prologue=True).operands
    pro = ops.prologue
    assert ops.dtype == "bfloat16" and pro.stream_dtype == "float32" and str(pro.x.dtype) == x_dtype
    assert pro.x.same_as(func.params[0]) and pro.residual.same_as(func.params[1]) and pro.total.same_as(func.params[-1])
    assert str(pro.residual.dtype) == str(pro.weight.dtype) == "bfloat16" and pro.eps == pytest.approx(EPS)


@pytest.mark.parametrize("residual_dtype,total_dtype", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_analysis_refuses_other_float32_streams(residual_dtype, total_dtype):
    # x in float32 with a float32 residual, or with its sum rounded to bf16: no template computes them
    x, r = _ph((1, 1, HIDDEN), "x", "float32"), _ph((1, 1, HIDDEN), "r", residual_dtype)
    w, b = _ph((HIDDEN,), "w", "bfloat16"), _ph((384, HIDDEN), "b", "bfloat16")
    total = te.compute(x.shape, lambda *i: (x(*i) + r(*i).astype("float32")).astype(total_dtype), name="T_add")
    wide = topi.nn.rms_norm(te.compute(x.shape, lambda *i: total(*i).astype("float32")),
                            te.compute(w.shape, lambda c: w[c].astype("float32")), [2], EPS)
    normed = te.compute(x.shape, lambda *i: wide(*i).astype("bfloat16"), name="T_normed")
    func = te.create_prim_func([x, r, w, b, nt_matmul(normed, b, "float32"), total])
    assert analyze_matmul(func, prologue=True) is None


def test_analysis_refuses_another_norm():
    # A norm without the weight (not TOPI's rms_norm as the template computes it) is no prologue.
    x, w = _ph((1, 1, HIDDEN), "x"), _ph((HIDDEN,), "w")
    b = _ph((384, HIDDEN), "b")
    sq = te.compute(x.shape, lambda *i: x(*i).astype("float32") * x(*i).astype("float32"))
    kk = te.reduce_axis((0, HIDDEN), "kk")
    ss = te.compute(x.shape[:-1], lambda i, j: te.sum(sq[i, j, kk], axis=kk))
    normed = te.compute(x.shape, lambda i, j, c: (x[i, j, c].astype("float32") * te.rsqrt(ss[i, j] / HIDDEN + 1e-5)).astype("float16"))
    func = te.create_prim_func([x, w, b, nt_matmul(normed, b, "float32")])
    assert analyze_matmul(func, prologue=True) is None


# --- the GEMV rule and its kernels ----------------------------------------------------------------


def test_only_the_gemv_rule_takes_it(cuda):
    func = _fused(_nt_matmul(384), 384).with_attr("target", cuda)
    assert Matmul().apply(func, cuda, False) is None
    assert Gemv().apply(func, cuda, False) is not None
    assert Gemv().apply(func, tvm.target.Target("llvm"), False) is None


def test_too_much_shared_memory_is_refused():
    ops = analyze_matmul(_fused(_nt_matmul(384, k=8192), 384, k=8192), prologue=True).operands
    cfg = gemv.config_for(gemv.load_gemv_configs("sm_90"), 1)
    gemv.check_gemv(ops, cfg, gemv.shared_bytes(ops, cfg))
    with pytest.raises(Exception, match="shared memory"):
        gemv.check_gemv(ops, cfg, gemv.shared_bytes(ops, cfg) - 4)


# 4-bit weights: the dequantize comes along (M = 1: the row template, with sm_90's shipped half sums;
# 2 and 4: the mma one).
Q4_KERNELS = {"qkv_q4": "fuselight_q4_dot32_fp16_half_sums", "gate_up_q4": "fuselight_q4_dot32_fp16_half_sums",
              "gate_up_q4_m2": "fuselight_q4_pair_fp16", "qkv_q4bf16_m4": "fuselight_q4_pair_bf16",
              "lm_head_q4_first": "fuselight_q4_dot32_fp16_half_sums", "gate_up_q4_looping": "fuselight_q4_dot32_fp16",
              "gate_up_q4_m2_tiles": "fuselight_q4_pair_fp16"}
# Buckets not shipped (yet) that the templates take with the prologue and the paired epilogue: a grid
# of resident blocks looping over the column groups (M = 1, double-buffered across them), and 4 row
# tiles a block of the mma template (SM count: an H100's).
LOOPING = GemvConfig(max_m=1, warps=8, unroll=2, min_blocks_per_sm=2, rows_per_warp=2, double_buffer=True,
                     grid_blocks_per_sm=2)
TILES = GemvConfig(max_m=2, warps=8, unroll=1, min_blocks_per_sm=2, lane_run=1, row_tiles=4)


@pytest.fixture(scope="module")
def llama_kernels(cuda) -> dict[str, tirx.PrimFunc]:
    """The Gemv rule's kernels for Llama-3-8B's fused norm + projection shapes, fp16, bf16 and 4-bit."""
    k = 4096
    funcs = {
        "qkv": _fused(_nt_matmul(6144, k), 6144, k=k),
        "qkv_first": _fused(_nt_matmul(6144, k), 6144, residual=False, k=k),
        "gate_up": _fused(_gate_up(28672, k), 28672, casts=(), k=k),
        "qkv_bf16": _fused(_nt_matmul(6144, k, "bfloat16"), 6144, casts=("bfloat16",), k=k, dtype="bfloat16"),
        "qkv_q4": _fused_q4(_nt_matmul(6144, k), 6144, k=k),
        "gate_up_q4": _fused_q4(_gate_up(28672, k), 28672, casts=(), k=k),
        "gate_up_q4_m2": _fused_q4(_gate_up(28672, k, m=2), 28672, casts=(), k=k, m=2),
        "qkv_q4bf16_m4": _fused_q4(_nt_matmul(6144, k, "bfloat16", m=4), 6144, casts=("bfloat16",), k=k,
                                   scheme="q4bf16_1", m=4),
        # a float32 residual stream (residual_stream_fp32), on the mma template
        "qkv_q4bf16_m4_f32": _fused_q4(_nt_matmul(6144, k, "bfloat16", m=4), 6144, casts=("bfloat16",), k=k,
                                       scheme="q4bf16_1", m=4, stream="float32"),
        "lm_head_q4_first": _fused_q4(_nt_matmul(1000, k), 1000, residual=False, casts=(), k=k),
    }
    kernels = {}
    for name, func in funcs.items():
        sch = Gemv().apply(func.with_attr("target", cuda), cuda, False)
        assert sch is not None, name
        kernels[name] = sch.mod["main"].without_attr("target").with_attr("global_symbol", name)
    for name, (func, cfg) in {"gate_up_q4_looping": (funcs["gate_up_q4"], LOOPING),
                              "gate_up_q4_m2_tiles": (funcs["gate_up_q4_m2"], TILES)}.items():
        ops = analyze_matmul(func, prologue=True, dequant=True).operands
        kernels[name] = with_kernels(func, gemv.gemv_body(ops, cfg, 132)).with_attr("global_symbol", name)
    return kernels


def test_llama_shaped_kernels_build_for_sm90(llama_kernels):
    for name, func in llama_kernels.items():
        kern = kernel(func)  # one launch each
        assert kern.calls["tirx.rsqrt"] >= 1, name  # the norm (which template: test_gemv, test_gemv_rows)
        if name not in Q4_KERNELS:
            continue
        externs = [args[0].value for args in kern.call_args.get("tirx.cuda.func_call", [])]
        # The kernel reads the packed words, the scales and the norm's inputs, converts the words in
        # registers and allocates no weight-sized buffer.
        assert [str(p.ty.dtype) for p in func.params].count("uint32") == 1
        assert Q4_KERNELS[name] in externs, name
        assert all(_numel(b) < 4096 * 64 for b in _allocs(func))


@needs_nvcc
def test_llama_shaped_kernels_nvcc_compiles_them(cuda, llama_kernels):
    from fuselight.cuda_compile import compile_cuda

    lib = tvm.compile(tvm.IRModule(llama_kernels), target=cuda)
    assert compile_cuda(lib.mod.imports[0].inspect_source("cuda"), "sm_90")


def _allocs(func: tirx.PrimFunc) -> list[tirx.Buffer]:
    found: list[tirx.Buffer] = []
    tirx.stmt_functor.post_order_visit(
        func.body, lambda n: found.extend(n.alloc_buffers) if isinstance(n, tirx.SBlock) else None)
    return found


def _numel(buf: tirx.Buffer) -> int:
    return int(np.prod([int(d) for d in buf.shape]))


# --- the pass -----------------------------------------------------------------------------------


def _llama_graph(cfg):
    """Our model through the pipeline's graph passes up to this one (llvm, unscheduled)."""
    from fuselight.model.llama import export_module

    mod = export_module(cfg, to_tvm(resolve("llvm")))[0]
    return FuseTransposeMatmul()(FuseGateUpSiLU(schedule=False)(AccumulateMatmulFP32()(mod)))


@pytest.mark.parametrize("quantization", [None, "q4f16_1", "q4f16_0"])
def test_pass_on_our_llama_matches_the_unrewritten_model(quantization):
    from fuselight import config
    from fuselight.engine import Engine
    from fuselight.model.weights import hf_config, random_weights

    # (4-bit: an intermediate size of whole groups of 32.)
    raw = {**hf_config(config.load("tiny-llama")), "intermediate_size": 352}
    cfg = config.from_dict(raw, name="tiny").with_dtype("float16").with_quantization(quantization)
    before = _llama_graph(cfg)
    after = FuseNormIntoGemv(schedule=False)(before)
    layers = cfg.num_hidden_layers
    # Every decode norm: the first layer's alone, then add+norm twice a layer (the last the final norm).
    fused = [n for n in _calls(after["decode"]) if n.startswith(PRIMFUNC_NAME)]
    assert len(fused) == 2 * layers + 1
    assert "R.nn.rms_norm" not in after["decode"].script() and "R.add" not in after["decode"].script()
    tvm.ir.assert_structural_equal(after["prefill"], before["prefill"])  # symbolic rows: untouched
    if quantization:
        # Each fused GEMV dequantizes its weight itself: QKV's and the LM head's dequantize calls are
        # gone (gate+up's went into FuseGateUpSiLU's function; o_proj and down keep theirs for phase 3).
        assert all(analyze_matmul(after[n], prologue=True, dequant=True).operands.dequant for n in fused)
        written = [Counter(m.function for m in materialized_weights(mod)) for mod in (before, after)]
        assert written[0]["decode"] - written[1]["decode"] == layers + 1
        assert written[1]["decode"] == 2 * layers and written[0]["prefill"] == written[1]["prefill"]

    target = to_tvm(resolve("llvm"))
    weights = random_weights(cfg, seed=11)
    rng = np.random.default_rng(11)
    prompt, steps = rng.integers(0, cfg.vocab_size, 6), [int(t) for t in rng.integers(0, cfg.vocab_size, 3)]
    logits = []
    for mod in (before, after):
        exe = tvm.compile(mod, target=target, relax_pipeline=relax.get_default_pipeline(target))
        vm, dev = relax.VirtualMachine(exe, tvm.cpu()), tvm.cpu()
        engine = Engine(vm, [tvm.runtime.tensor(w, device=dev) for w in weights.values()], cfg, dev,
                        max_total_seq_len=32)
        engine.prefill(prompt)
        logits.append([engine.decode(t).numpy() for t in steps])
    for ours, ref in zip(*reversed(logits)):
        assert np.isfinite(ours).all() and relative_error(ours, ref) < 1e-3


def _decoder_step(bb, x, res, res2, w1, wqkv, w2, wgu, transposed=True):
    """add+norm -> qkv, add+norm -> gate_up/SiLU, as our model's decode step lays them out (weights
    read through permute_dims; ``transposed=False``: as they are, ``[K, N]``, KN)."""
    op = relax.op

    def weight(w):
        return bb.emit(op.permute_dims(w)) if transposed else w

    h = bb.emit(op.add(x, res))
    qkv = bb.emit(op.matmul(bb.emit(op.nn.rms_norm(h, w1, axes=[-1], epsilon=EPS)), weight(wqkv)))
    h2 = bb.emit(op.add(h, res2))
    y = bb.emit(op.matmul(bb.emit(op.nn.rms_norm(h2, w2, axes=[-1], epsilon=EPS)), weight(wgu)))
    parts = bb.emit(op.split(y, 2, axis=-1))
    gate, up = bb.emit(relax.TupleGetItem(parts, 0)), bb.emit(relax.TupleGetItem(parts, 1))
    return relax.Tuple([qkv, bb.emit(op.multiply(bb.emit(op.nn.silu(gate)), up)), h2])


def _step_module(rows=1):
    row = [relax.Var(name, _ty(1, rows, HIDDEN)) for name in ("x", "res", "res2")]
    params = [*row, relax.Var("w1", _ty(HIDDEN)), relax.Var("wqkv", _ty(384, HIDDEN)),
              relax.Var("w2", _ty(HIDDEN)), relax.Var("wgu", _ty(688, HIDDEN))]
    return single_function(params, _decoder_step)


def _q4_step_module(scheme: str = "q4f16_1"):
    """``_decoder_step`` with its two weights dequantized from ``scheme``'s words (our model's graph)."""
    sch = SCHEMES[scheme]
    dtype = sch.model_dtype
    row = [relax.Var(name, _ty(1, 1, HIDDEN, dtype=dtype)) for name in ("x", "res", "res2")]
    packed = {}
    for name, n in (("wqkv", 384), ("wgu", 704)):
        qs, ss = sch.packed_shapes(n, HIDDEN)
        packed[name] = [relax.Var(f"{name}_q", _ty(*qs, dtype="uint32")), relax.Var(f"{name}_s", _ty(*ss, dtype=dtype))]
    params = [*row, relax.Var("w1", _ty(HIDDEN, dtype=dtype)), *packed["wqkv"], relax.Var("w2", _ty(HIDDEN, dtype=dtype)),
              *packed["wgu"]]

    def make(bb, x, res, res2, w1, qq, qs, w2, gq, gs):
        def dequantize(q, s):
            return bb.emit_te(lambda q, s: te_dequantize((q, s), sch), q, s, primfunc_name_hint="dequantize")

        return _decoder_step(bb, x, res, res2, w1, dequantize(qq, qs), w2, dequantize(gq, gs), sch.layout == "NK")

    return single_function(params, make)


def _graph_passes(mod, target):
    with target:
        mod = FuseAddRMSNorm(target)(mod)
        mod = FuseGateUpSiLU()(AccumulateMatmulFP32()(mod))
        return FuseTransposeMatmul()(mod)


def test_pass_fuses_fuse_add_rms_norm_kernels_and_the_unscheduled_gate_up(cuda):
    mod = _graph_passes(_step_module(), cuda)
    before = _calls(mod["main"])
    assert before.count("fuse_add_norm") == 2 and "gate_up_matmul_swiglu" in before
    assert FuseNormIntoGemv()(mod).same_as(mod)  # no target in scope: unchanged
    with cuda:
        out = FuseNormIntoGemv()(mod)
    after = _calls(out["main"])
    assert "fuse_add_norm" not in after and "gate_up_matmul_swiglu" not in after
    fused = [n for n in after if n.startswith(PRIMFUNC_NAME)]
    assert len(fused) == 2 and len(after) == len(before) - 2
    # Left to the GEMV rule in phase 4, which takes them.
    assert all("tirx.is_scheduled" not in out[n].attrs and out[n].attrs[RULE_ATTR] == "gemv" for n in fused)
    assert all(Gemv().apply(out[n], cuda, False) is not None for n in fused)


@pytest.mark.parametrize("scheme", ["q4f16_1", "q4f16_0"])
def test_pass_fuses_quantized_projections_with_their_dequantize(cuda, scheme):
    # (KN, q4f16_0: QKV is still an R.matmul, which FuseTransposeMatmul leaves; the pass takes it.)
    mod = _graph_passes(_q4_step_module(scheme), cuda)
    before = _calls(mod["main"])
    # FuseGateUpSiLU took the gate+up dequantize along; QKV's is still a call of its own.
    assert before.count("fuse_add_norm") == 2 and before.count("dequantize") == 1 and len(materialized_weights(mod)) == 1
    with cuda:
        out = FuseNormIntoGemv()(mod)
    after = _calls(out["main"])
    fused = [n for n in after if n.startswith(PRIMFUNC_NAME)]
    assert len(fused) == 2 and not {"fuse_add_norm", "dequantize", "gate_up_matmul_swiglu"} & set(after)
    assert materialized_weights(out) == [] and "R.matmul" not in out["main"].script()
    for name in fused:
        ops = analyze_matmul(out[name], prologue=True, dequant=True).operands
        assert ops.prologue.residual is not None and ops.dequant.layout == SCHEMES[scheme].layout
        assert out[name].attrs[RULE_ATTR] == "gemv" and Gemv().apply(out[name], cuda, False) is not None


@pytest.mark.parametrize("scheme", ["q4f16_1", "q4bf16_1", "q4f16_0"])
def test_pass_with_quantized_weights_keeps_the_numbers(scheme):
    from fuselight.model.weights import numpy_dtype

    mod = AccumulateMatmulFP32()(_q4_step_module(scheme))
    mod = FuseTransposeMatmul()(FuseGateUpSiLU(schedule=False)(mod))
    out = FuseNormIntoGemv(schedule=False)(mod)
    assert sum(n.startswith(PRIMFUNC_NAME) for n in _calls(out["main"])) == 2 and materialized_weights(out) == []
    sch = SCHEMES[scheme]
    dtype = numpy_dtype(sch.model_dtype)
    rng = np.random.default_rng(len(scheme))
    args = [rng.standard_normal((1, 1, HIDDEN)).astype(dtype) for _ in range(3)]
    for n in (384, 704):
        q, s = random_quantized(rng, n, HIDDEN, 1 / np.sqrt(HIDDEN), sch)
        args += [(1 + 0.1 * rng.standard_normal(HIDDEN)).astype(dtype), q, s.astype(dtype)]
    results = []
    for m in (mod, out):
        vm = relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())
        results.append([t.numpy().astype("float64") for t in vm["main"](*[tvm.runtime.tensor(a) for a in args])])
    for ref, got in zip(*results):
        assert np.abs(ref).mean() > 0.05 and relative_error(got, ref) < (2e-2 if scheme == "q4bf16_1" else 2e-3)


def test_pass_leaves_many_rows_to_the_separate_norm(cuda):
    mod = _graph_passes(_step_module(rows=64), cuda)  # above the GEMV's rows: a GEMM without a prologue
    with cuda:
        out = FuseNormIntoGemv()(mod)
    tvm.ir.assert_structural_equal(out["main"], mod["main"])


@pytest.mark.parametrize("rows", [2, tirx.Var("seq_len", "int64")], ids=["m2", "prefill"])
def test_pass_leaves_kn_rows_the_kn_template_does_not_take(cuda, rows):
    # KN (q4f16_0): the GEMV rule's KN template serves M = 1 only; 2 rows or prefill's symbolic rows
    # keep the separate norm, the dequantize and the matmul (DLight's, as the baseline's).
    sch = SCHEMES["q4f16_0"]
    qs, ss = sch.packed_shapes(384, HIDDEN)
    params = [relax.Var("x", _ty(1, rows, HIDDEN)), relax.Var("g", _ty(HIDDEN)), relax.Var("q", _ty(*qs, dtype="uint32")),
              relax.Var("s", _ty(*ss))]

    def make(bb, x, g, q, s):
        w = bb.emit_te(lambda q, s: te_dequantize((q, s), sch), q, s, primfunc_name_hint="dequantize")
        normed = bb.emit(relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=EPS))
        return bb.emit(relax.op.matmul(normed, w))

    with cuda:
        mod = FuseTransposeMatmul()(AccumulateMatmulFP32()(single_function(params, make)))
        tvm.ir.assert_structural_equal(FuseNormIntoGemv()(mod), mod)
    assert len(materialized_weights(mod)) == 1 and "R.nn.rms_norm" in mod["main"].script()
    # At M = 1 the same graph is fused (the control).
    if isinstance(rows, int):
        params[0] = relax.Var("x", _ty(1, 1, HIDDEN))
        with cuda:
            one = FuseTransposeMatmul()(AccumulateMatmulFP32()(single_function(params, make)))
            assert [n.startswith(PRIMFUNC_NAME) for n in _calls(FuseNormIntoGemv()(one)["main"])] == [True]


def _norm_then(users):
    """rms_norm(x) read by ``users`` (callables of (bb, normed, w) -> expr), each result returned."""
    params = [relax.Var("x", _ty(1, 1, HIDDEN)), relax.Var("g", _ty(HIDDEN)), relax.Var("w", _ty(384, HIDDEN))]

    def make(bb, x, g, w):
        normed = bb.emit(relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=EPS))
        return relax.Tuple([bb.emit(u(bb, normed, w)) for u in users])

    return FuseTransposeMatmul()(AccumulateMatmulFP32()(single_function(params, make)))


def _linear(bb, normed, w):
    return relax.op.matmul(normed, bb.emit(relax.op.permute_dims(w)))


@pytest.mark.parametrize("users", [
    [_linear, _linear],  # the norm read by two matmuls
    [_linear, lambda bb, normed, w: relax.op.multiply(normed, normed)],  # and by something else
    [lambda bb, normed, w: relax.op.sum(relax.op.multiply(normed, normed), axis=[-1])],  # not a matmul
], ids=["two-matmuls", "matmul-and-multiply", "no-matmul"])
def test_pass_leaves_norms_with_other_users(users):
    mod = _norm_then(users)
    tvm.ir.assert_structural_equal(FuseNormIntoGemv(schedule=False)(mod), mod)


def test_pass_fuses_a_lone_norm_and_matmul():
    mod = _norm_then([_linear])
    out = FuseNormIntoGemv(schedule=False)(mod)
    assert [n.startswith(PRIMFUNC_NAME) for n in _calls(out["main"])] == [True]


def test_registered_before_add_rms_norm_kernels():
    from fuselight.passes import DEFAULT

    assert PASSES["fuse_norm_gemv"].slot == PASSES["add_rms_norm_kernels"].slot == "after_graph_passes"
    names = list(PASSES)
    assert names.index("fuse_norm_gemv") < names.index("add_rms_norm_kernels")
    if "fuse_norm_gemv" in DEFAULT:
        assert DEFAULT.index("fuse_norm_gemv") < DEFAULT.index("add_rms_norm_kernels")


@pytest.mark.parametrize("m", [1, 2, 4])
def test_q4_mma_template_with_the_prologue_loads_scales_from_the_scales(cuda, m):
    # With a norm prologue the mma template loads its first round's weights before the rows are
    # normed. Those loads once passed the packed weights as the scales too: every register of the
    # weights and scales must be loaded from its own tensor (the words W, the scales S), the scales
    # as many times as the words' pairs of rows (H100: 0.5-0.7 relative error at M = 2 and 4 before).
    func = _fused_q4(_nt_matmul(1024, HIDDEN, m=m), 1024, m=m).with_attr("target", cuda)
    cfg = GemvConfig(max_m=m, warps=8, unroll=4, min_blocks_per_sm=2, lane_run=2)
    ops = analyze_matmul(func, prologue=True, dequant=True).operands
    kern = kernel(with_kernels(func, gemv.gemv_body(ops, cfg)))
    loaded = {name: {str(v).split("[")[0] for v in values} for name, values in kern.values.items() if name in ("w", "sc")}
    assert loaded == {"w": {"W"}, "sc": {"S"}}
    assert len(kern.values["sc"]) == len(kern.values["w"])  # a scale load beside each 16-byte piece load


def _awq_norm_module(n: int, k: int = HIDDEN) -> tvm.IRModule:
    """``rms_norm(x, w)`` read by MLC's AWQ linear function (it dequantizes its packed words and
    zero points itself): ``main(x, w, qweight, qzeros, scales)``."""
    from fuselight.quant_prim_funcs import awq_linear

    consumer = awq_linear(n, k)
    x, w = relax.Var("x", _ty(1, 1, k)), relax.Var("w", _ty(k))
    packed = [relax.Var(p.name, relax.TensorType([int(d) for d in p.ty.shape], str(p.ty.dtype)))
              for p in consumer.params[1:4]]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, *packed]):
        with bb.dataflow():
            normed = bb.emit(relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=EPS))
            gv = bb.add_func(consumer.without_attr("global_symbol"), "awq_linear")
            out = bb.emit_output(relax.call_tir(gv, [normed, *packed], _ty(1, 1, n)))
        bb.emit_func_output(out)
    return bb.get()


def test_pass_carries_awq_zero_points_into_the_gemv(cuda):
    # MLC's q4f16_autoawq decode QKV: the fused function reads the packed words, zero points and
    # scales; the GEMV rule (the column template) takes it; the numbers are the unrewritten module's.
    from fuselight.quantization import awq_stored

    n = 256
    mod = _awq_norm_module(n)
    with cuda:
        tagged = FuseNormIntoGemv()(mod)
    fused = [f for gv, f in tagged.functions_items() if gv.name_hint.startswith(PRIMFUNC_NAME)]
    assert len(fused) == 1 and fused[0].attrs[RULE_ATTR] == "gemv" and Gemv.takes(fused[0], cuda)
    assert [str(p.ty.dtype) for p in fused[0].params].count("uint32") == 2
    out = FuseNormIntoGemv(schedule=False)(mod)
    rng = np.random.default_rng(11)
    groups = HIDDEN // 128
    q, z, s = awq_stored(rng.integers(0, 16, (n, HIDDEN), dtype=np.uint32), rng.integers(0, 16, (n, groups), dtype=np.uint32),
                         rng.uniform(0.5, 1.5, (n, groups)).astype(np.float32) / 64)
    args = [rng.standard_normal((1, 1, HIDDEN)).astype("float16"), (1 + 0.1 * rng.standard_normal(HIDDEN)).astype("float16"),
            q, z, s.astype("float16")]
    results = []
    for m in (mod, out):
        vm = relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())
        results.append(vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy().astype("float64"))
    assert np.abs(results[0]).mean() > 0.05 and relative_error(results[1], results[0]) < 2e-3
