"""The quantized GEMV (4-bit weights dequantized in the kernel; ``rules/gemm/dequant.py``, the
row-streaming template ``rules/gemm/gemv_rows.py`` and the mma template ``rules/gemm/gemv.py``):
what the analysis recognises and rejects, that the Gemv rule takes MLC-LLM's q4f16_1 decode
functions (M = 1..16 static, a symbolic batch) and builds kernels for sm_90 that nvcc compiles, the
kernels' structure (16-byte loads of the packed words, mma instructions, no dequantized weight in
memory, the grid), the arithmetic of the in-register conversions against MLC's, and that the mma
template's A and B fragments meet at the same k (numerics of the kernels run on the GPU against
float64: ``bench/probes/q4_gemv.py``)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import numpy as np
import pytest
from conftest import apply_rule, needs_nvcc
from tir_query import evaluate, kernel

tvm = pytest.importorskip("tvm")
from cuda_source import kernel_body, kernel_names
from fuselight.errors import FuselightError
from fuselight.quant_prim_funcs import q4_linear
from fuselight.rules.gemm import gemv, gemv_common, gemv_rows
from fuselight.rules.base import with_kernels
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemv import Gemv
from fuselight.rules.matmul import Matmul
import tvm_ffi
from tvm import te, tirx
from tvm.script import tirx as T

ROWS = gemv_common.GemvConfig(max_m=1, warps=8, unroll=4, min_blocks_per_sm=2, rows_per_warp=2)
# The mma template at M = 1 (the alternative to ROWS) and at 16 (two token tiles).
MMA1 = gemv_common.GemvConfig(max_m=1, warps=8, unroll=4, min_blocks_per_sm=2, lane_run=2)
MMA16 = gemv_common.GemvConfig(max_m=16, warps=4, unroll=2, min_blocks_per_sm=2, lane_run=2)
# Llama-3-8B's decode projections (N x K) and the LM head (symbolic vocabulary).
LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


# MLC-LLM's Llama-3-8B q4f16_1 decode QKV projection, as its phase 3 leaves it (names and all).
# fmt: off
@T.prim_func(private=True, s_tir=True)
def mlc_qkv(model_layers_0_self_attn_qkv_proj_q_weight3: T.Buffer((T.int64(6144), T.int64(512)), "uint32"), model_layers_0_self_attn_qkv_proj_q_scale3: T.Buffer((T.int64(6144), T.int64(128)), "float16"), rms_norm5_1: T.Buffer((T.int64(1), T.int64(1), T.int64(4096)), "float16"), compute_intermediate_intermediate: T.Buffer((T.int64(1), T.int64(1), T.int64(6144)), "float16")):
    T.func_attr({"tirx.noalias": True})
    compute = T.sblock_alloc_buffer((T.int64(6144), T.int64(4096)), "float16")
    dequantize_intermediate = T.sblock_alloc_buffer((T.int64(6144), T.int64(4096)), "float16")
    NT_matmul_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(1), T.int64(6144)))
    for i0, i1 in T.grid(T.int64(6144), T.int64(4096)):
        with T.sblock("compute"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            T.reads(model_layers_0_self_attn_qkv_proj_q_weight3[v_i0, v_i1 // T.int64(8)])
            T.writes(compute[v_i0, v_i1])
            compute[v_i0, v_i1] = T.Cast("float16", T.bitwise_and(T.shift_right(model_layers_0_self_attn_qkv_proj_q_weight3[v_i0, v_i1 // T.int64(8)], T.Cast("uint32", v_i1 % T.int64(8) * T.int64(4))), T.uint32(15)))
    for i0, i1 in T.grid(T.int64(6144), T.int64(4096)):
        with T.sblock("dequantize"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            T.reads(compute[v_i0, v_i1], model_layers_0_self_attn_qkv_proj_q_scale3[v_i0, v_i1 // T.int64(32)])
            T.writes(dequantize_intermediate[v_i0, v_i1])
            dequantize_intermediate[v_i0, v_i1] = (compute[v_i0, v_i1] - T.float16(7.0)) * model_layers_0_self_attn_qkv_proj_q_scale3[v_i0, v_i1 // T.int64(32)]
    for i0, i1, i2, k in T.grid(T.int64(1), T.int64(1), T.int64(6144), T.int64(4096)):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(rms_norm5_1[v_i0, v_i1, v_k], dequantize_intermediate[v_i2, v_k])
            T.writes(NT_matmul_intermediate[v_i0, v_i1, v_i2])
            with T.init():
                NT_matmul_intermediate[v_i0, v_i1, v_i2] = T.float32(0.0)
            NT_matmul_intermediate[v_i0, v_i1, v_i2] = NT_matmul_intermediate[v_i0, v_i1, v_i2] + T.Cast("float32", rms_norm5_1[v_i0, v_i1, v_k]) * T.Cast("float32", dequantize_intermediate[v_i2, v_k])
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(1), T.int64(6144)):
        with T.sblock("compute1"):
            v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(NT_matmul_intermediate[v_i0, v_i1, v_i2])
            T.writes(compute_intermediate_intermediate[v_i0, v_i1, v_i2])
            compute_intermediate_intermediate[v_i0, v_i1, v_i2] = T.Cast("float16", NT_matmul_intermediate[v_i0, v_i1, v_i2])
# fmt: on


def _variant(n: int, k: int, value, *, two_matmuls: bool = False, group: int = 32, zero_buffer: bool = False):
    """A q4 linear (M = 1) whose dequantize computes ``value(unpacked, scale, zero)`` (TE), to build
    near misses; ``two_matmuls``: the dequantized weight feeds two matmuls."""
    i64 = "int64"
    q = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // 8)), "uint32", name="q")
    s = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, -(-k // group))), "float16", name="s")
    z = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // group)), "float16", name="z")
    x = te.placeholder((tirx.IntImm(i64, 1), tirx.IntImm(i64, k)), "float16", name="x")

    def unpacked(i, j):
        shift = tirx.Cast("uint32", j % 8 * 4)
        return tirx.Cast("float16", tirx.bitwise_and(tirx.shift_right(q[i, j // 8], shift), tirx.const(15, "uint32")))

    zero = (lambda i, j: z[i, j // group]) if zero_buffer else (lambda i, j: tirx.const(7, "float16"))
    w = te.compute((n, k), lambda i, j: value(unpacked(i, j), s[i, j // group], zero(i, j)), name="dequantize")
    r = te.reduce_axis((0, k), name="k")
    mm = te.compute((1, n), lambda b, i: te.sum(tirx.Cast("float32", x[b, r]) * tirx.Cast("float32", w[i, r]), axis=r), name="NT_matmul")
    outs = [te.compute((1, n), lambda b, i: tirx.Cast("float16", mm[b, i]), name="cast")]
    if two_matmuls:
        r2 = te.reduce_axis((0, k), name="k2")
        outs.append(te.compute((1, n), lambda b, i: te.sum(tirx.Cast("float32", x[b, r2]) * tirx.Cast("float32", w[i, r2]), axis=r2), name="NT_matmul2"))
    params = [q, s, *([z] if zero_buffer else []), x]
    return te.create_prim_func([*params, *outs])


def _affine(e, s, z):
    return (e - z) * s


# ---- analysis -------------------------------------------------------------------------------


def test_analysis_reads_mlcs_decode_qkv():
    desc = analyze_matmul(mlc_qkv, dequant=True)
    ops, d = desc.operands, desc.operands.dequant
    assert (ops.n, ops.k, int(ops.m), ops.b_layout, ops.dtype) == (6144, 4096, 1, "NT", "float16")
    assert (d.bits, d.per_word, d.group, d.zero, d.layout, d.dtype) == (4, 8, 32, 7.0, "NK", "float16")
    assert d.packed.same_as(mlc_qkv.params[0]) and d.scale.same_as(mlc_qkv.params[1])
    assert ops.b.same_as(mlc_qkv.params[0])  # the template reads the packed words
    assert d.stages == ("compute", "dequantize") and desc.epilogue_stages == ("compute1",)
    # Without asking for it (the Matmul rule, fuse_norm_gemv), a dequantized weight is no matmul.
    assert analyze_matmul(mlc_qkv) is None and analyze_matmul(mlc_qkv, prologue=True) is None


@pytest.mark.parametrize(
    "kwargs,fields",
    [
        (dict(dtype="bfloat16"), dict(dtype="bfloat16", group=32, layout="NK")),
        (dict(group=128), dict(dtype="float16", group=128, layout="NK")),
        (dict(layout="KN"), dict(dtype="float16", group=32, layout="KN")),
        (dict(one_stage=True), dict(dtype="float16", group=32, layout="NK")),
        (dict(zero=8.0), dict(zero=8.0, group=32)),
    ],
)
def test_analysis_variants(kwargs, fields):
    d = analyze_matmul(q4_linear(512, 1024, **kwargs), dequant=True).operands.dequant
    for name, value in fields.items():
        assert getattr(d, name) == value, name


def test_analysis_takes_a_symbolic_vocabulary_and_batch():
    head = analyze_matmul(q4_linear(None, 4096, epilogue="cast_fp32"), dequant=True)
    assert isinstance(head.operands.n, tirx.Var) and head.operands.n.name == "vocab_size"
    assert head.epilogue_stages == ("compute1", "compute2") and str(head.out_dtype) == "float32"
    batch = analyze_matmul(q4_linear(4096, 4096, m=None), dequant=True)
    assert batch.m_static is None and batch.operands.n == 4096


@pytest.mark.parametrize(
    "name,value",
    [
        ("squared", lambda e, s, z: (e - z) * (e - z) * s),
        ("scale_squared", lambda e, s, z: (e - z) * s * s),
        ("no_zero", lambda e, s, z: e * s),
        ("plus_zero", lambda e, s, z: (e + z) * s),
    ],
)
def test_analysis_rejects_a_non_affine_dequantize(name, value):
    assert analyze_matmul(_variant(256, 1024, value), dequant=True) is None, name


def test_analysis_rejects_the_near_misses():
    assert analyze_matmul(_variant(256, 1024, _affine), dequant=True) is not None  # the control
    # The dequantized weight also feeds a second matmul.
    assert analyze_matmul(_variant(256, 1024, _affine, two_matmuls=True), dequant=True) is None
    # A group that does not divide K (scales for ceil(K / 96) groups).
    assert analyze_matmul(_variant(256, 1024, _affine, group=96), dequant=True) is None
    # A float16 zero point buffer beside words along K: no known layout (AWQ's: tests/rules/gemm/test_dequant.py).
    assert analyze_matmul(_variant(256, 1024, _affine, zero_buffer=True), dequant=True) is None


def _shifted(shift, mask=15, word=None, scale=None):
    """q4 linear whose unpacking uses ``shift(j)``, ``mask``, ``word(q, i, j)``, ``scale(s, i, j)``."""
    n, k = 256, 1024
    i64 = "int64"
    q = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // 8)), "uint32", name="q")
    s = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // 32)), "float16", name="s")
    x = te.placeholder((tirx.IntImm(i64, 1), tirx.IntImm(i64, k)), "float16", name="x")
    word = word or (lambda q, i, j: q[i, j // 8])
    scale = scale or (lambda s, i, j: s[i, j // 32])
    w = te.compute((n, k), lambda i, j: (tirx.Cast("float16", tirx.bitwise_and(
        tirx.shift_right(word(q, i, j), tirx.Cast("uint32", shift(j))), tirx.const(mask, "uint32"))) - tirx.const(7, "float16")) * scale(s, i, j), name="dq")
    r = te.reduce_axis((0, k), name="k")
    mm = te.compute((1, n), lambda b, i: te.sum(tirx.Cast("float32", x[b, r]) * tirx.Cast("float32", w[i, r]), axis=r), name="mm")
    return te.create_prim_func([q, s, x, mm])


def test_analysis_checks_the_unpacking_arithmetic():
    assert analyze_matmul(_shifted(lambda j: j % 8 * 4), dequant=True).operands.dequant.bits == 4  # control
    assert analyze_matmul(_shifted(lambda j: j % 8 * 2), dequant=True) is None  # shift not 4 bits a value
    assert analyze_matmul(_shifted(lambda j: j % 8 * 4, mask=7), dequant=True) is None  # 3-bit mask
    assert analyze_matmul(_shifted(lambda j: j % 4 * 4), dequant=True) is None  # place in word mod 4
    assert analyze_matmul(_shifted(lambda j: j % 8 * 4, word=lambda q, i, j: q[i, j // 4]), dequant=True) is None
    assert analyze_matmul(_shifted(lambda j: j % 8 * 4, scale=lambda s, i, j: s[i, j // 32 % 16]), dequant=True) is None
    assert analyze_matmul(_shifted(lambda j: j % 8 * 4, scale=lambda s, i, j: s[0, j // 32]), dequant=True) is None


# ---- the rule and the kernel ---------------------------------------------------------------


def _source(kernel, target) -> str:
    lib = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=target)
    return lib.mod.imports[0].inspect_source("cuda")


def _grid_and_allocs(kernel):
    grid, allocs = [], []

    def visit(node):
        if isinstance(node, tirx.For) and node.thread_binding is not None and node.thread_binding.thread_tag == "blockIdx.x":
            grid.append(node.extent)
        if isinstance(node, tirx.SBlock):
            allocs.extend(node.alloc_buffers)

    tirx.stmt_functor.post_order_visit(kernel.body, visit)
    return grid, allocs


def test_rule_takes_mlcs_qkv_and_the_kernel_streams_packed_words(cuda):
    kernel = apply_rule(Gemv(), mlc_qkv, cuda)
    assert [p.name for p in kernel.params] == [p.name for p in mlc_qkv.params]
    # configs/gemm/gemv_q4.json's M = 1 bucket for K up to 4096, read by hand: 8 warps of 2 rows, 4
    # steps unrolled, three blocks an SM: 6144 rows in 384 blocks of 16.
    warps, rows_per_warp, unroll, min_blocks = 8, 2, 4, 3
    grid, allocs = _grid_and_allocs(kernel)
    assert [int(g) for g in grid] == [6144 // 16]
    # No dequantized weight anywhere: only registers and the token row (K fp16 in shared memory).
    assert max(int(np.prod([int(d) for d in b.shape])) for b in allocs) == 4096
    assert {b.scope() for b in allocs if b.shape[0] == 4096} == {"shared"}
    source = _source(kernel, cuda)
    assert len(kernel_names(source)) == 1
    # The weights: 16-byte loads of the uint32 words (4 words, 32 values, a lane a step).
    packed = re.findall(r"\*\(uint4\*\)\(w_ptr \+ \d+\) = \*\(uint4\*\)\(\w+_ptr \+", source)
    assert len(packed) == unroll * rows_per_warp
    assert re.search(r"uint\* __restrict__ \w+q_weight3", source) or "uint* __restrict__ W_ptr" in source
    assert "fuselight_q4_dot32_fp16_half_sums(" in source and "0x64006400u" in source  # sm_90 ships half sums
    assert "half* __restrict__" in source and not re.search(r"half \w+\[25165824\]", source)
    assert f"__launch_bounds__({warps * 32}, {min_blocks})" in source


def test_rule_takes_the_lm_head_with_a_symbolic_vocabulary(cuda):
    func = q4_linear(None, 4096, epilogue="cast_fp32")
    kernel = apply_rule(Gemv(), func, cuda)
    grid, _ = _grid_and_allocs(kernel)
    # configs/gemm/gemv_q4.json's sm_90 bucket for fp16 tokens, any grid, K <= 4096, read by hand:
    # m1_k4096_fp16, 16 warps of 2 columns a block.
    cols = 32
    vocab = next(v for v in tirx.analysis.undefined_vars(grid[0]) if v.name == "vocab_size")
    for size in (128256, 32000, 1):
        assert int(tvm.arith.Analyzer().simplify(tirx.stmt_functor.substitute(grid[0], {vocab: tirx.IntImm("int64", size)}))) == -(-size // cols)
    source = _source(kernel, cuda)
    assert "int64_t vocab_size" in source and "(float)" in source  # the second cast


def test_rule_leaves_what_the_template_does_not_serve(cuda):
    # KN: the KN template's (tests/rules/gemm/test_gemv_kn.py), not these.
    kn = kernel(apply_rule(Gemv(), q4_linear(4096, 4096, layout="KN"), cuda))
    assert [str(a[0].value) for a in kn.call_args["tirx.cuda.func_call"]] == ["fuselight_q4_dot8_fp16_half_sums"]
    assert apply_rule(Gemv(), q4_linear(4096, 4096, m=17), cuda) is None  # static M past 16: DLight
    assert apply_rule(Gemv(), q4_linear(4096, 4096, zero=20.0), cuda) is None  # zero point past 16
    # (A symbolic batch is the Matmul rule's: the quantized GEMM, tests/rules/gemm/test_gemm_q4.py.)
    assert Matmul().apply(q4_linear(4096, 4096, m=None).with_attr("target", cuda), cuda, False) is not None
    with pytest.raises(Exception, match="NK"):
        gemv.check_gemv(analyze_matmul(q4_linear(4096, 4096, layout="KN"), dequant=True).operands, ROWS)
    # The mma template's K step is 128 values (4 lanes x 4 words), the row template's 32.
    k96 = analyze_matmul(q4_linear(4096, 4096 - 96), dequant=True).operands
    gemv.check_gemv(k96, ROWS)
    with pytest.raises(Exception, match="multiple of 128"):
        gemv.check_gemv(k96, MMA1)


@needs_nvcc
def test_nvcc_compiles_every_variant(cuda):
    from fuselight.cuda_compile import compile_cuda

    funcs = {
        "qkv": mlc_qkv,
        "m2": q4_linear(6144, 4096, m=2),
        "m5_res": q4_linear(4096, 4096, m=5, epilogue="residual"),
        "down16": q4_linear(4096, 14336, m=16),  # 112 steps of 128
        "batch": q4_linear(28672, 4096, m=None),
        "head_m8": q4_linear(None, 4096, m=8, epilogue="cast_fp32"),
        "bf16_m3": q4_linear(4096, 4096, m=3, dtype="bfloat16"),
        "g128_m4": q4_linear(4096, 4096, m=4, group=128),
        "o_proj": q4_linear(4096, 4096, epilogue="residual"),
        "down": q4_linear(4096, 14336),  # 448 pieces a row: the last round is masked
        "gate_up": q4_linear(28672, 4096),
        "lm_head": q4_linear(None, 4096, epilogue="cast_fp32"),
        "bf16": q4_linear(4096, 4096, dtype="bfloat16"),
        "g128": q4_linear(4096, 4096, group=128),
    }
    kernels = {name: apply_rule(Gemv(), f, cuda).with_attr("global_symbol", name) for name, f in funcs.items()}
    # Buckets not shipped (the probe's sweep): a looping grid, half sums, row tiles (132 SMs).
    looping = dataclasses.replace(ROWS, unroll=2, double_buffer=True, grid_blocks_per_sm=2)
    tiles = gemv_common.GemvConfig(max_m=16, warps=8, unroll=1, min_blocks_per_sm=1, lane_run=1, row_tiles=4)
    for name, func, cfg in (("mma1_down", q4_linear(4096, 14336), MMA1),
                            ("loop_down", q4_linear(4096, 14336, epilogue="residual"), looping),
                            ("loop_head", q4_linear(None, 4096, epilogue="cast_fp32"), looping),
                            ("loop_half_gate_up", q4_linear(28672, 4096), dataclasses.replace(looping, half_sums=True)),
                            ("half_qkv", q4_linear(6144, 4096), dataclasses.replace(ROWS, half_sums=True)),
                            ("tiles_m16", q4_linear(28672, 4096, m=16), tiles),
                            ("tiles_m5_res", q4_linear(4096, 4096, m=5, epilogue="residual"), dataclasses.replace(tiles, max_m=8, row_tiles=2)),
                            ("tiles_head_m8", q4_linear(None, 4096, m=8, epilogue="cast_fp32"), dataclasses.replace(tiles, max_m=8))):
        body = gemv.gemv_body(analyze_matmul(func, dequant=True).operands, cfg, 132)
        kernels[name] = with_kernels(func, body).with_attr("global_symbol", name)
    source = tvm.compile(tvm.IRModule(kernels), target=cuda).mod.imports[0].inspect_source("cuda")
    assert {f"{name}_kernel" for name in kernels} <= kernel_names(source)
    assert "fuselight_q4_pair_bf16(" in source and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in source
    assert "fuselight_q4_dot32_bf16(" in source and "0x43004300u" in source
    # down (the shipped bucket for K > 4096: unroll 2, double-buffered): 448 pieces a row, 7 rounds of
    # 2 steps of 32 lanes; rounds 0..5 load the next one.
    assert re.search(r"if \(r < 6\)", kernel_body(source, "down_kernel"))
    assert "fuselight_q4_dot32_fp16_half_sums(" in kernel_body(source, "half_qkv_kernel")
    assert "fuselight_q4_dot32_fp16(" not in kernel_body(source, "half_qkv_kernel")
    assert compile_cuda(source, "sm_90")


def test_each_piece_reads_its_groups_scale(cuda):
    # A piece is 32 weights (4 packed words): piece p of row r reads scale r * K / group + 32 p / group
    # (group 32: a scale a piece; group 128: one scale for 4 consecutive pieces).
    for group in (32, 128):
        kern = kernel(apply_rule(Gemv(), q4_linear(4096, 4096, group=group), cuda))
        assert kern.loads["S"]
        for index in kern.loads["S"]:
            for row, piece in ((0, 0), (5, 1), (6, 7), (4095, 127)):
                got = evaluate(index, {"col0": row, "col_first": row, "j": 0, "p": piece})  # (the first round: col_first)
                assert got == row * (4096 // group) + piece * 32 // group, (group, row, piece)


# ---- the arithmetic -------------------------------------------------------------------------


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), as float32."""
    b = x.astype(np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.view(np.float32)


@pytest.mark.parametrize("source", [gemv_rows.q4_dot_source, gemv.q4_pair_source], ids=["rows", "mma"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_bit_trick_is_mlcs_dequantize_bit_for_bit(dtype, source):
    # The constants the CUDA helpers use: magic | nibble is (base + e) exactly, and minus (base + zero)
    # it is e - zero exactly. The mma helper then multiplies by the scale, rounded once: MLC's
    # (dtype(e) - dtype(zero)) * scale bit for bit. The row helper applies the scale to the float32
    # sum of (e - zero) * token instead (one multiply a piece, no rounding of the weight to dtype).
    zero = 7
    src = source(dtype, zero)
    magic = int(re.search(r"\| (0x[0-9a-f]+)u;", src).group(1), 16)
    bias = int(re.search(r"zb = (0x[0-9a-f]+)u", src).group(1), 16)
    rng = np.random.default_rng(0)
    scales = np.concatenate([rng.uniform(-0.05, 0.05, 4000), rng.uniform(-3, 3, 4000), [1e-4, 0.0078125]]).astype(np.float32)
    e = np.arange(16, dtype=np.uint32)
    lanes = (((e | (e << 16)) & 0x000F000F) | magic).astype(np.uint32)
    if dtype == "float16":
        lo = (lanes & 0xFFFF).astype(np.uint16).view(np.float16)
        hi = (lanes >> 16).astype(np.uint16).view(np.float16)
        assert (lo == hi).all() and (lo.astype(np.float64) == 1024 + e).all()
        z = np.uint16(bias).view(np.float16)
        assert ((lo - z).astype(np.float64) == e.astype(np.float64) - zero).all()
        if source is gemv_rows.q4_dot_source:
            return
        s = scales.astype(np.float16)
        ours = (lo[None, :] - z) * s[:, None]
        mlc = (e.astype(np.float16)[None, :] - np.float16(zero)) * s[:, None]
        assert ours.dtype == np.float16 and (ours.view(np.uint16) == mlc.view(np.uint16)).all()
    else:
        lo = ((lanes & 0xFFFF) << 16).view(np.float32)
        assert (lo.astype(np.float64) == 128 + e).all()
        z = np.array([bias << 16], dtype=np.uint32).view(np.float32)[0]
        assert (_bf16_round(lo - z).astype(np.float64) == e.astype(np.float64) - zero).all()
        if source is gemv_rows.q4_dot_source:
            return
        s = _bf16_round(scales)
        ours = _bf16_round(_bf16_round(lo[None, :] - z) * s[:, None])
        mlc = _bf16_round(_bf16_round(e.astype(np.float32)[None, :] - np.float32(zero)) * s[:, None])
        assert (ours.view(np.uint32) == mlc.view(np.uint32)).all()


def test_staged_tokens_meet_their_values():
    # Emulate the template's data flow on indices: the token staged for value (piece p, word i, half
    # h of pair j) must be token 32 p + 8 i + j + 4 h, the one MLC's matmul multiplies it with.
    k = 1024
    staged = np.full(k, -1)
    for c in range(k // 8):  # a thread's 16-byte chunk c of the token row: permuted, then placed
        p = c // 4
        permuted = [8 * c + (e // 2 + e % 2 * 4) for e in range(8)]
        start = (p * 4 + int(gemv_rows.q4_chunk(p, c % 4))) * 8
        staged[start:start + 8] = permuted
    assert sorted(staged) == list(range(k))
    for p in range(k // 32):
        rot = int(gemv_rows.q4_chunk(p, 0))
        for i in range(4):  # the helper reads chunk (i + rot) & 3 of the piece for word i
            chunk = staged[p * 32 + ((i + rot) & 3) * 8:][:8]
            for j in range(4):
                assert chunk[2 * j] == 32 * p + 8 * i + j and chunk[2 * j + 1] == 32 * p + 8 * i + j + 4
    # The rotation spreads a quarter warp (lanes 0..7: pieces 32 s + 0..7) over 8 bank groups.
    for s in range(2):
        for i in range(4):
            units = {((32 * s + l) * 4 + ((i + int(gemv_rows.q4_chunk(32 * s + l, 0))) & 3)) % 8 for l in range(8)}
            assert len(units) == 8


def test_m1_buckets_by_grid_and_k(cuda):
    # Measured on the H100 (docs/experiments/q4-gemv.md, sessions 18 and 22): K of one round a row
    # (4096) keeps the single-buffered loads; longer rows (down's 14336) double-buffer; o_proj's grid
    # (4096 / 16 = 256 blocks, after the attention's merge) also asks L2 for a quarter of each row
    # first; QKV's 384 blocks take the small-grid bucket. fp16 tokens have their own bucket for down
    # (16 warps, one row a warp).
    from fuselight.rules.gemv import gemv_config

    expected = {
        "float16": [(8, 2, 4, False, None), (8, 2, 4, False, 25), (16, 1, 2, True, None)],
        "bfloat16": [(8, 2, 4, False, None), (8, 2, 4, False, 25), (8, 2, 2, True, None)],
    }
    for dtype, want in expected.items():
        chosen = [gemv_config(analyze_matmul(q4_linear(n, k, m=1, dtype=dtype), dequant=True).operands, 1, cuda)
                  for n, k in ((6144, 4096), (4096, 4096), (4096, 14336))]  # qkv, o_proj, down
        assert [(c.warps, c.rows_per_warp, c.unroll, c.double_buffer, c.prefetch_l2_percent) for c in chosen] == want


def _ops_in_order(stmt) -> list[str]:
    """Stores (buffer names) and CUDA device-function calls (their names) of ``stmt``, in program order."""
    out = []

    def visit(node):
        if isinstance(node, tirx.BufferStore):
            out.append(node.buffer.name)
        elif isinstance(node, tvm.ir.expr.Call) and node.op.name == "tirx.cuda.func_call":
            out.append(str(node.args[0].value))

    tirx.stmt_functor.post_order_visit(stmt, visit)
    return out


@pytest.mark.parametrize("k,rounds", [(14336, 7), (4128, 3)])
def test_double_buffer_loads_the_next_round_before_the_dots(k, rounds):
    # 8 warps x 32 lanes, unroll 2: a round is 64 pieces of 32 values; 14336 / 32 = 448 pieces (7
    # rounds), 4128 / 32 = 129 (3 rounds, the last ragged). Inside the loop over rounds, the next
    # round's words and scales are loaded into the second buffers before the first dot, and copied
    # into the first after the last.
    cfg = gemv_common.GemvConfig(max_m=1, warps=8, unroll=2, min_blocks_per_sm=2, rows_per_warp=2, double_buffer=True)
    ops = analyze_matmul(q4_linear(127, k, m=1), dequant=True).operands
    func = with_kernels(q4_linear(127, k, m=1), gemv.gemv_body(ops, cfg))
    kern = kernel(func)
    assert kern.allocs["wn"] == ("local", "uint32", (2 * 2 * 4,)) and kern.allocs["scn"] == ("local", "float16", (2 * 2,))
    loops = []
    tirx.stmt_functor.post_order_visit(func.body, lambda n: loops.append(n) if isinstance(n, tirx.For)
                                       and n.kind == tirx.ForKind.SERIAL and int(n.extent) == rounds else None)
    assert len(loops) == 1
    order = _ops_in_order(loops[0].body)
    dots = [i for i, name in enumerate(order) if name == gemv_rows.Q4_DOT["float16"]]
    assert dots  # (once in the TIR: the loops over rows and pieces unroll in the CUDA)
    assert {"wn", "scn"} <= set(order[:dots[0]]) and "w" not in order[:dots[0]]
    assert {"w", "sc"} <= set(order[dots[-1]:]) and "wn" not in order[dots[-1]:]
    # One round a row (K 4096 at unroll 2 is 2 rounds; at unroll 4, 1): no second buffer.
    one_round = with_kernels(q4_linear(127, 4096, m=1), gemv.gemv_body(
        analyze_matmul(q4_linear(127, 4096, m=1), dequant=True).operands, dataclasses.replace(cfg, unroll=4)))
    assert "wn" not in kernel(one_round).allocs


def test_double_buffer_is_a_row_template_field():
    from fuselight.rules.arch_config import from_fields

    with pytest.raises(FuselightError, match="double_buffer"):
        gemv.check_gemv_config(dataclasses.replace(MMA1, double_buffer=True))
    fields = {"max_m": 1, "warps": 8, "unroll": 2, "min_blocks_per_sm": 2, "rows_per_warp": 2}
    assert from_fields(gemv_common.GemvConfig, {**fields, "double_buffer": True}, "b").double_buffer is True
    with pytest.raises(FuselightError, match="'double_buffer' must be true or false, got 1"):
        from_fields(gemv_common.GemvConfig, {**fields, "double_buffer": 1}, "b")


def test_shipped_config_serves_the_llama_shapes(cuda):
    configs = gemv.load_gemv_configs("sm_90", quantized=True)
    assert configs and all(c.rows_per_warp is None or c.max_m == 1 for c in configs)
    assert max(c.max_m for c in configs) == 16
    for n, k in LLAMA_SHAPES:
        for m in (1, 3, 16):
            assert apply_rule(Gemv(), q4_linear(n, k, m=m), cuda) is not None, (n, k, m)


# ---- the mma template --------------------------------------------------------------------------

# mma.sync.m16n8k16 (f16/bf16; PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane (g, q) holds in A
# register r, half h, row g + 8 (r % 2) at k slot 2 q + h + 8 (r // 2); in B register r, half h,
# column g at k slot 2 q + h + 8 r.
def _a_slot(q, reg, half):
    return 2 * q + half + 8 * (reg // 2)


def _b_slot(q, reg, half):
    return 2 * q + half + 8 * reg


@pytest.mark.parametrize("warps,lane_run,steps", [(8, 2, 4), (4, 1, 8), (1, 2, 2)])
def test_a_and_b_fragments_meet_the_same_k(warps, lane_run, steps):
    # Emulate, on indices, what the template feeds every mma of a 4-bit row: lane (g, q) of a warp
    # at a step owns words piece_word(..) + 0..3 of rows g and g + 8; A register r of mma s is pair
    # q4_a_pair(s, r) of one of them (values j, j + 4 of the word); B register r is the token pair
    # q4_b_pair(s, r) of the 8-token chunks loaded for those words. Each k slot of each mma must
    # meet the same k in A and B, and the mmas of a row must cover each k once.
    per_word = 8
    seen = []
    for warp in range(warps):
        for step in range(steps):
            for q in range(4):
                pw = gemv.piece_word(step, warp, q, warps, lane_run)
                for s in range(2 * gemv_common.PIECE_WORDS):
                    a_k, b_k = {}, {}
                    for reg in range(4):
                        word, j = gemv.q4_a_pair(s, reg)
                        assert 0 <= word < gemv_common.PIECE_WORDS and 0 <= j < 4
                        for half in range(2):
                            k = per_word * (pw + word) + j + 4 * half
                            a_k.setdefault(_a_slot(q, reg, half), set()).add(k)  # rows g and g + 8 alike
                    for reg in range(2):
                        chunk, lo, hi, sel = gemv.q4_b_pair(s, reg)
                        for half in range(2):
                            b_k[_b_slot(q, reg, half)] = per_word * (pw + chunk) + 2 * (lo, hi)[half] + sel
                    assert {slot: {k} for slot, k in b_k.items()} == a_k, (warp, step, q, s)
                    seen.extend(b_k.values())
    assert sorted(seen) == list(range(warps * steps * 16 * per_word))


def _count_mma(source: str, kernel: str) -> int:
    return kernel_body(source, kernel).count("mma.sync.aligned.m16n8k16")


@pytest.mark.parametrize("m,cfg", [(1, MMA1), (5, None), (16, MMA16), (None, None)], ids=["m1", "m5", "m16", "batch"])
def test_mma_kernel_streams_packed_words_into_the_tensor_cores(cuda, m, cfg):
    n, k = 6144, 4096
    func = q4_linear(n, k, m=m)
    ops = analyze_matmul(func, dequant=True).operands
    if cfg is None and m is not None:
        kernel = apply_rule(Gemv(), func, cuda)
        # what the rule must have taken: configs/gemm/gemv_q4.json's bucket for M <= 8, read by hand
        cfg = gemv_common.GemvConfig(max_m=8, warps=8, unroll=1, min_blocks_per_sm=2, lane_run=1)
    elif cfg is None:
        kernel = apply_rule(Gemv(), func, cuda)
    else:
        kernel = with_kernels(func, gemv.gemv_body(ops, cfg))
    grid, allocs = _grid_and_allocs(kernel)
    # No dequantized weight: registers and the warps' partial tiles (not checked with a symbolic
    # batch: DLight's kernel past 16 rows declares its per-thread weight at full shape).
    assert m is None or all(int(np.prod([int(d) if isinstance(d, tirx.IntImm) else 1 for d in b.shape])) < n * k // 64 for b in allocs)
    source = _source(kernel, cuda)
    if m is None:
        # A symbolic batch: a kernel per bucket (host branches on M), DLight's past the largest.
        # configs/gemm/gemv_q4.json's buckets for M <= 1, 2, 4, 8, 16, read by hand: the row template
        # at 1; the mma template's M <= 2, 4 and 8 write one kernel (one token tile, the same fields),
        # one range; M <= 16 two token tiles.
        assert len(kernel_names(source)) == 3 + 1
        assert re.search(r"if \(\(\(int64_t\)0\) < batch_size\)", source) or "batch_size" in source
        mma_kernels = [kn for kn in kernel_names(source) if "mma.sync" in kernel_body(source, kn)]
        assert len(mma_kernels) == 2
        return
    assert [int(g) for g in grid] == [n // 16]
    (name,) = kernel_names(source)
    body = kernel_body(source, name)
    tiles = cfg.token_tiles
    # Per round: unroll steps of 8 mmas for each token tile, 16-byte loads of both rows' words.
    assert _count_mma(source, name) == cfg.unroll * 8 * tiles
    packed = re.findall(r"\*\(uint4\*\)\(w_ptr \+ \d+\) = \*\(uint4\*\)\(W_ptr \+", body)
    assert len(packed) == 2 * cfg.unroll
    tokens = re.findall(r"\*\(uint4\*\)\(x_ptr \+ \d+\) = \*\(uint4\*\)\(X_ptr \+", body)
    assert len(tokens) == 4 * tiles * cfg.unroll
    assert body.count("fuselight_q4_pair_fp16(") == 4 * 8 * cfg.unroll  # 4 A registers an mma
    assert f"__launch_bounds__({block_threads(ops, cfg)}, {cfg.min_blocks_per_sm})" in source


def block_threads(ops, cfg):
    return gemv.block_warps(ops, cfg) * 32


def test_mma_lm_head_grid_follows_the_vocabulary(cuda):
    func = q4_linear(None, 4096, m=4, epilogue="cast_fp32")
    kernel = apply_rule(Gemv(), func, cuda)
    grid, _ = _grid_and_allocs(kernel)
    vocab = next(v for v in tirx.analysis.undefined_vars(grid[0]) if v.name == "vocab_size")
    for size in (128256, 32000, 1, 17):
        assert int(tvm.arith.Analyzer().simplify(tirx.stmt_functor.substitute(grid[0], {vocab: tirx.IntImm("int64", size)}))) == -(-size // 16)
    source = _source(kernel, cuda)
    assert "mma.sync.aligned.m16n8k16" in source and "(float)" in source


def test_batch_lm_head_with_a_symbolic_vocabulary(cuda):
    # Two symbolic sizes: the buckets' grids follow the vocabulary; past 16 rows a DLight rule that
    # takes it (its Matmul and LowBatchGEMV do not).
    kernel = apply_rule(Gemv(), q4_linear(None, 4096, m=None, epilogue="cast_fp32"), cuda)
    assert kernel is not None
    grid, _ = _grid_and_allocs(kernel)
    kernels = 3  # a kernel per M range of the buckets (M <= 1, 8, 16: see the test above)
    assert len(grid) >= kernels + 1
    assert all(any(v.name == "vocab_size" for v in tirx.analysis.undefined_vars(g)) for g in grid[:kernels])


def test_batch_decode_is_scheduled_before_low_batch_gemv_specialize(cuda):
    # The pipeline runs fuselight's rules first; what they schedule, LowBatchGemvSpecialize skips.
    from fuselight.baseline.low_batch_gemv_specialize import LowBatchGemvSpecialize

    scheduled = apply_rule(Gemv(), q4_linear(4096, 4096, m=None), cuda)
    assert scheduled.attrs["tirx.is_scheduled"]
    with cuda:
        after = LowBatchGemvSpecialize()(tvm.IRModule({"main": scheduled}))["main"]
    assert tvm_ffi.structural_equal(after, scheduled)


# ---- buckets not shipped: a looping grid (row template), row tiles (mma template) ------------------


def _let_values(stmt) -> list[tuple]:
    """(var, value) of every let binding in ``stmt``."""
    out = []
    tirx.stmt_functor.post_order_visit(stmt, lambda n: out.append((n.var, n.value)) if isinstance(n, tirx.LetStmt) else None)
    return out


def _resolved(expr, lets):
    """``expr`` with its let-bound variables replaced by their values (repeatedly: lets of lets)."""
    for _ in range(16):
        used = []
        tirx.stmt_functor.post_order_visit(expr, lambda n: used.append(n) if isinstance(n, tirx.Var) else None)
        sub = {v: value for v in used for var, value in lets if var.same_as(v)}
        if not sub:
            return expr
        expr = tirx.stmt_functor.substitute(expr, sub)
    raise AssertionError("lets do not resolve")


def _store_indices(stmt, name: str) -> list:
    """Index expressions of the stores to buffer ``name`` (first dimension), with their values."""
    out = []
    tirx.stmt_functor.post_order_visit(stmt, lambda n: out.append((n.indices[0], n.value))
                                       if isinstance(n, tirx.BufferStore) and n.buffer.name == name else None)
    return out


def _let(stmt, name: str):
    (value,) = [v for var, v in _let_values(stmt) if var.name == name]
    return value


LOOPING = dataclasses.replace(ROWS, warps=2, unroll=1, grid_blocks_per_sm=2)


def test_new_fields_are_checked():
    from fuselight.rules.arch_config import from_fields

    with pytest.raises(FuselightError, match="grid_blocks_per_sm"):
        gemv.check_gemv_config(dataclasses.replace(MMA1, grid_blocks_per_sm=2))  # the row template's
    with pytest.raises(FuselightError, match="grid_blocks_per_sm"):
        gemv.check_gemv_config(dataclasses.replace(LOOPING, prefetch_l2_percent=25))
    with pytest.raises(FuselightError, match="row_tiles"):
        gemv.check_gemv_config(dataclasses.replace(ROWS, row_tiles=2))  # the mma template's
    fields = {"max_m": 4, "warps": 8, "unroll": 1, "min_blocks_per_sm": 2}
    assert from_fields(gemv_common.GemvConfig, {**fields, "row_tiles": 4}, "b").row_tiles == 4
    with pytest.raises(FuselightError, match="'row_tiles' must be a positive integer, got 0"):
        from_fields(gemv_common.GemvConfig, {**fields, "row_tiles": 0}, "b")
    with pytest.raises(FuselightError, match="'grid_blocks_per_sm' must be a positive integer"):
        from_fields(gemv_common.GemvConfig, {**fields, "max_m": 1, "rows_per_warp": 2, "grid_blocks_per_sm": True}, "b")
    # The grid needs the device's SM count (the rule passes its target's).
    ops = analyze_matmul(q4_linear(200, 2048, m=1), dequant=True).operands
    with pytest.raises(FuselightError, match="SM count"):
        gemv.gemv_body(ops, LOOPING)


def test_looping_grid_stores_every_column_once():
    # 200 columns in groups of 2 warps x 2 rows: 50 groups, looped over by 3 SMs x 2 blocks (6 blocks,
    # 9 groups each at most; blocks 0 and 1 take a ninth, 48 and 49).
    n, groups, grid = 200, 50, 6
    func = q4_linear(n, 2048, m=1)
    ops = analyze_matmul(func, dequant=True).operands
    body = gemv.gemv_body(ops, LOOPING, 3)
    kern = kernel(with_kernels(func, body))
    assert kern.launch["blockIdx.x"] == grid and kern.threads == 64
    lets = _let_values(body)
    g, col0 = _resolved(_let(body, "g"), lets), _resolved(_let(body, "col0"), lets)
    stored = []
    for bx in range(grid):
        for it in range(-(-groups // grid)):
            at = {"bx": bx, "it": it}
            if evaluate(g, at) >= groups:
                continue
            for warp in range(2):
                c = evaluate(col0, {**at, "tid": 32 * warp})
                stored += [c + j for j in range(2) if c + j < n]
    assert sorted(stored) == list(range(n))


def test_looping_grid_follows_a_symbolic_vocabulary(cuda):
    func = q4_linear(None, 4096, epilogue="cast_fp32")
    ops = analyze_matmul(func, dequant=True).operands
    cfg = dataclasses.replace(ROWS, grid_blocks_per_sm=2)
    grid, _ = _grid_and_allocs(with_kernels(func, gemv.gemv_body(ops, cfg, 132)))
    vocab = next(v for v in tirx.analysis.undefined_vars(grid[0]) if v.name == "vocab_size")
    for size, blocks in ((128256, 264), (32000, 264), (4000, 250), (17, 2)):  # 16 columns a group
        got = tvm.arith.Analyzer().simplify(tirx.stmt_functor.substitute(grid[0], {vocab: tirx.IntImm("int64", size)}))
        assert int(got) == blocks, size


def test_looping_double_buffer_loads_the_next_groups_first_round():
    # K 4096 at unroll 4 is one round a row: without the loop there is nothing to overlap (no second
    # buffer); looping, a warp loads its next group's words (group g + grid: columns grid x 16 on)
    # into the second buffer before its dots, and copies them after.
    cfg = gemv_common.GemvConfig(max_m=1, warps=8, unroll=4, min_blocks_per_sm=2, rows_per_warp=2, double_buffer=True,
                                 grid_blocks_per_sm=2)
    func = q4_linear(4096, 4096, m=1)
    ops = analyze_matmul(func, dequant=True).operands
    body = gemv.gemv_body(ops, cfg, 4)  # 8 blocks, 256 groups
    kern = kernel(with_kernels(func, body))
    assert kern.launch["blockIdx.x"] == 8 and kern.allocs["wn"] == ("local", "uint32", (2 * 4 * 4,))
    assert "wn" not in kernel(with_kernels(func, gemv.gemv_body(ops, dataclasses.replace(cfg, grid_blocks_per_sm=None)))).allocs
    lets = _let_values(body)
    rows = set()
    for index, value in _store_indices(body, "wn"):
        at = {"bx": 0, "it": 0, "tid": 0, "u": 0, "j": 0, "e": 0, "r": 0}
        rows.add(evaluate(_resolved(value.indices[0], lets), at) // (4096 // 8))
    assert rows == {8 * 16}  # row 0 of group 0 + 8
    loops = []
    tirx.stmt_functor.post_order_visit(body, lambda n: loops.append(n) if isinstance(n, tirx.For) and n.loop_var.name == "r" else None)
    order = _ops_in_order(loops[0].body)
    dots = [i for i, name in enumerate(order) if name == gemv_rows.Q4_DOT["float16"]]
    assert "wn" in order[:dots[0]] and "w" in order[dots[-1]:]


def test_row_tiles_share_the_token_loads_and_keep_rows_and_outputs_together():
    # 96 rows, K 512, M 16 (two token tiles), 2 warps of 2 steps, 2 row tiles a block: 3 blocks.
    n, k, tiles, row_tiles, warps = 96, 512, 2, 2, 2
    cfg = gemv_common.GemvConfig(max_m=16, warps=warps, unroll=1, min_blocks_per_sm=2, lane_run=1, row_tiles=row_tiles)
    func = q4_linear(n, k, m=16)
    ops = analyze_matmul(func, dequant=True).operands
    body = gemv.gemv_body(ops, cfg)
    kern = kernel(with_kernels(func, body))
    assert kern.launch["blockIdx.x"] == n // (16 * row_tiles)
    assert kernel(with_kernels(q4_linear(80, k, m=16), gemv.gemv_body(
        analyze_matmul(q4_linear(80, k, m=16), dequant=True).operands, cfg))).launch["blockIdx.x"] == 3
    lets = _let_values(body)
    w_words = k // 8
    # Every weight word is read once, tile rt of block bx reading rows 16 (2 bx + rt) + 0..15.
    words, rows = [], {}
    for index in kern.loads["W"]:
        index = _resolved(index, lets)
        for bx in range(3):
            for tid in range(warps * 32):
                for r in range(2):
                    for rt in range(row_tiles):
                        w = evaluate(index, {"bx": bx, "tid": tid, "r": r, "u": 0, "rt": rt, "e": 0})
                        words += [w + e for e in range(4)]
                        rows.setdefault((bx, rt), set()).add(w // w_words)
    assert sorted(words) == list(range(n * w_words))
    assert rows == {(bx, rt): set(range(16 * (2 * bx + rt), 16 * (2 * bx + rt) + 16)) for bx in range(3) for rt in range(2)}
    # The tokens are loaded once a step for every row tile: no token load under a loop over the tiles.
    tile_loops = []
    tirx.stmt_functor.post_order_visit(body, lambda n: tile_loops.append(n) if isinstance(n, tirx.For) and n.loop_var.name == "rt" else None)
    under = Counter()
    for loop in tile_loops:
        tirx.stmt_functor.post_order_visit(loop.body, lambda n: under.update([n.buffer.name]) if isinstance(n, tirx.BufferLoad) else None)
    assert under["W"] and not under["X"]
    # Accumulator e of lane l in token tile t of row tile rt lands, through the partial sums, on
    # output (token 8 t + 2 (l % 4) + e % 2, column 16 (2 bx + rt) + l / 4 + 8 (e / 2)).
    ((red_index, _),) = _store_indices(body, "red")
    red_index = _resolved(red_index, lets)
    col, row = _resolved(_let(body, "col"), lets), _resolved(_let(body, "row"), lets)
    outputs = 16 * 8 * tiles * row_tiles
    for bx in (0, 2):
        for lane in range(32):
            for rt in range(row_tiles):
                for t in range(tiles):
                    for e in range(4):
                        oa = evaluate(red_index, {"tid": lane, "rt": rt, "t": t, "e": e})  # warp 0
                        at = {"bx": bx, "it": oa // (warps * 32), "tid": oa % (warps * 32)}
                        assert oa < outputs
                        assert evaluate(col, at) == 16 * (2 * bx + rt) + lane // 4 + 8 * (e // 2)
                        assert evaluate(row, at) == 8 * t + 2 * (lane % 4) + e % 2


def test_half_sums_constants_and_error():
    # The fp16 helper's constants are the float32 helper's (magic | nibble = 1024 + e, minus the bias
    # e - zero, exactly); each word's 8 products are summed 4 to a half by fma (rounded once each:
    # emulated as the float32 fma, exact for a 4-bit value times an fp16 token plus an fp16 sum, then
    # rounded to fp16), then added in float32. Over rows of K = 4096 random values and tokens, the
    # error relative to float64 (the probe's measure: over the whole output) is ~3.4e-4: within the
    # probe's 1e-3 with the output's own rounding (~1.5e-4) added (the float32 dot: ~1e-7 here).
    src = gemv_rows.q4_dot_half_source(7)
    assert int(re.search(r"\| (0x[0-9a-f]+)u;", src).group(1), 16) == 0x64006400
    assert int(re.search(r"zb = (0x[0-9a-f]+)u", src).group(1), 16) == 0x6400 + 7
    # The high nibbles are converted in place: (1024 + 16 e) * (1/16) + (-(64 + zero)) by one fp16 fma
    # (emulated: float32 fma, exact here, rounded to fp16) is e - zero exactly, as the shifted form.
    scale = np.uint16(int(re.search(r"mb = (0x[0-9A-Fa-f]+)u", src).group(1), 16) & 0xFFFF).view(np.float16)
    bias = np.uint16(int(re.search(r"cb = (0x[0-9a-f]+)u", src).group(1), 16)).view(np.float16)
    nibbles = np.arange(16)
    placed = np.float16(1024) + np.float16(16) * nibbles.astype(np.float16)  # (w & 0x00F0) | 0x6400
    assert np.array_equal(placed.astype(np.float32), 1024 + 16 * nibbles)
    converted = (placed.astype(np.float32) * np.float32(scale) + np.float32(bias)).astype(np.float16)
    assert np.array_equal(converted.astype(np.float32), nibbles - 7)
    rng = np.random.default_rng(1)
    err2 = ref2 = 0.0
    for _ in range(64):
        e = rng.integers(0, 16, 4096).astype(np.float32) - 7
        x = rng.standard_normal(4096).astype(np.float16)
        halves = np.zeros(4096 // 4, np.float16)  # one per (word, half): values j, j + 4 of a word
        for j in range(4):
            slot = np.arange(4096 // 8) * 8 + j
            for h in range(2):
                acc = halves[2 * np.arange(4096 // 8) + h]
                acc = (e[slot + 4 * h] * x[slot + 4 * h].astype(np.float32) + acc.astype(np.float32)).astype(np.float16)
                halves[2 * np.arange(4096 // 8) + h] = acc
        got = halves.astype(np.float32).sum(dtype=np.float32)
        want = float(np.dot(e.astype(np.float64), x.astype(np.float64)))
        err2, ref2 = err2 + (float(got) - want) ** 2, ref2 + want ** 2
    assert np.sqrt(err2 / ref2) < 6e-4


def test_half_sums_is_a_row_template_field_for_fp16():
    with pytest.raises(FuselightError, match="half_sums"):
        gemv.check_gemv_config(dataclasses.replace(MMA1, half_sums=True))
    with pytest.raises(FuselightError, match="half_sums"):
        gemv.check_gemv(analyze_matmul(q4_linear(4096, 4096, dtype="bfloat16"), dequant=True).operands,
                        dataclasses.replace(ROWS, half_sums=True))
    ops = analyze_matmul(q4_linear(4096, 4096), dequant=True).operands
    kern = kernel(with_kernels(q4_linear(4096, 4096), gemv.gemv_body(ops, dataclasses.replace(ROWS, half_sums=True))))
    assert [str(a[0].value) for a in kern.call_args["tirx.cuda.func_call"]] == [gemv_rows.Q4_DOT_HALF]
    assert kern.allocs["xf"] == ("local", "float16", (32,))  # the tokens stay fp16


def test_shipped_m1_buckets_take_half_sums_for_fp16_tokens_only():
    # configs/gemm/gemv_q4.json ships half_sums in sm_90's M = 1 buckets (measured: q4-gemv.md). A
    # bf16 function (q4bf16_1) in a bucket for any dtype gets it with the float32 dot, not no bucket
    # (which would leave MLC's bf16 decode GEMVs to DLight): QKV's small-grid bucket serves both.
    # Where fp16 has a bucket of its own (down), bf16 takes the one for any, also without half sums.
    from fuselight.rules.gemv import gemv_config
    from fuselight.target import resolve, to_tvm

    target = to_tvm(resolve("cuda", "sm_90"))
    for n, k in ((6144, 4096), (4096, 14336)):
        f16 = gemv_config(analyze_matmul(q4_linear(n, k), dequant=True).operands, 1, target)
        bf16 = gemv_config(analyze_matmul(q4_linear(n, k, dtype="bfloat16"), dequant=True).operands, 1, target)
        assert f16.half_sums and f16.rows_per_warp is not None
        assert bf16 is not None and not bf16.half_sums and bf16.dtype is None
        assert (bf16 == dataclasses.replace(f16, half_sums=False)) == (f16.dtype is None)


def test_a_bucket_for_one_dtype_serves_those_tokens_and_comes_first():
    # Two buckets alike in max_m, max_blocks and max_k: the one for fp16 tokens serves fp16, the
    # other every other dtype; in any order in the file.
    fp16 = dataclasses.replace(ROWS, max_m=1, max_k=4096, dtype="float16", warps=16)
    anyd = dataclasses.replace(ROWS, max_m=1, max_k=4096, warps=8)
    for configs in ([fp16, anyd], [anyd, fp16]):
        assert gemv.config_for(configs, 1, 1792, 4096, "float16") is fp16
        assert gemv.config_for(configs, 1, 1792, 4096, "bfloat16") is anyd
        assert gemv.config_for(configs, 1, 1792, 4096) is anyd  # dtype unknown: buckets for any only
    assert gemv.config_for([fp16], 1, 1792, 4096, "bfloat16") is None


def test_the_bf16_decode_gemvs_keep_their_buckets_where_fp16_has_its_own(cuda):
    # configs/gemm/gemv_q4.json (sm_90), read by hand: a 28672 x 4096 decode GEMV (1792 blocks, K
    # 4096) takes m1_k4096_fp16 with fp16 tokens (16 warps, 2 blocks an SM, half sums); with bf16
    # tokens the bucket for any dtype, m1_k4096 (8 warps, 3 blocks an SM), with the float32 dot.
    for dtype, warps, min_blocks, dot in (("float16", 16, 2, "fuselight_q4_dot32_fp16_half_sums"),
                                          ("bfloat16", 8, 3, "fuselight_q4_dot32_bf16")):
        kern = kernel(apply_rule(Gemv(), q4_linear(28672, 4096, dtype=dtype), cuda))
        assert kern.threads == 32 * warps
        assert kern.attrs["tirx.launch_bounds_min_blocks_per_sm"] == min_blocks
        assert [str(a[0].value) for a in kern.call_args["tirx.cuda.func_call"]] == [dot]


def test_a_bad_bucket_dtype_names_the_field():
    from fuselight.rules.arch_config import from_fields

    with pytest.raises(FuselightError, match="field 'dtype' must be one of"):
        gemv.check_gemv_config(dataclasses.replace(ROWS, dtype="float8"))
    fields = {"max_m": 1, "warps": 8, "unroll": 2, "min_blocks_per_sm": 1, "rows_per_warp": 2}
    with pytest.raises(FuselightError, match="'dtype' must be a string, got 16"):
        from_fields(gemv_common.GemvConfig, {**fields, "dtype": 16}, "b")
