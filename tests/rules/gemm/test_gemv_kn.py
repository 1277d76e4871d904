"""The GEMV for 4-bit weights in the KN layout (MLC-LLM's ``q4f16_0``; ``rules/gemm/gemv_kn.py``):
that the Gemv rule takes the decode functions our q4f16_0 model has (M = 1: a cast, a residual add,
the LM head's float32) and nothing else of KN, the kernel's structure (16-byte loads of 4 columns'
words, narrower where N is not a multiple of 4), its data flow emulated on the kernel's own load
indices against the unscheduled function run on llvm, the arithmetic of its in-register
conversion, and that nvcc compiles its kernels for sm_90 and sm_80 (numerics of the kernels on the
GPU: the kernel suite and ``bench e2e``'s logits)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from conftest import apply_rule, compile_cuda_concurrently
from tir_query import evaluate, kernel, kernels

tvm = pytest.importorskip("tvm")
from cuda_source import kernel_body, kernel_names
from fuselight.computations import fused_norm_matmul, gate_up_silu_prim_func, matmul_prim_func, with_dequantized_weight
from fuselight.errors import FuselightError
from fuselight.quant_prim_funcs import q4_linear
from fuselight.quantization import QuantScheme, te_dequantize
from fuselight.rules.base import with_kernels
from fuselight.rules.gemm import gemv_kn
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemv import Gemv, kn_gemv_config, symbolic_m_buckets
from tvm import relax, te, tirx

# The template's parameters the tests read by hand: a lane owns 4 columns (a uint4 of words).
COLS_PER_LANE = 4
WARP = 32
EPS = 1e-5


def _cfg():
    (cfg,) = gemv_kn.load_kn_configs("sm_90")
    return cfg


# ---- what the rule takes -----------------------------------------------------------------------


@pytest.mark.parametrize("n,k,kwargs", [
    (6144, 4096, {}),  # Llama-3-8B's qkv
    (4096, 4096, dict(epilogue="residual")),  # o_proj + the residual
    (4096, 14336, dict(epilogue="residual")),  # down + the residual
    (128256, 4096, dict(epilogue="cast_fp32")),  # the LM head
    (4096, 4096, dict(dtype="bfloat16", group=128)),
    (37, 1024, {}),  # a prime N
    (4098, 576, {}),  # N a multiple of 2, not 4
])
def test_rule_takes_kn_decode_functions(cuda, n, k, kwargs):
    func = q4_linear(n, k, layout="KN", **kwargs)
    scheduled = apply_rule(Gemv(), func, cuda)
    assert scheduled is not None
    assert [p.name for p in scheduled.params] == [p.name for p in func.params]
    kern = kernel(scheduled)
    cfg = _cfg()
    cols = cfg.lanes_n * COLS_PER_LANE
    assert kern.launch == {"blockIdx.x": -(-n // cols), "threadIdx.x": cfg.warps * WARP}
    # No dequantized weight: registers and the warps' partial sums in shared memory.
    assert {name for name, (scope, _, _) in kern.allocs.items() if scope == "shared"} == {"red"}
    assert all(int(np.prod(shape)) <= cfg.warps * cols for _, _, shape in kern.allocs.values())
    # Words and scales loaded 4, 2 or 1 at a time as N allows; 8 tokens (16 bytes) a word row.
    vec = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    assert kern.allocs["w"] == ("local", "uint32", (cfg.unroll * 4,))
    assert kern.vectorized[vec] >= 2 and kern.vectorized[8] >= 1
    # sm_90's bucket sums fp16 tokens in halves; bf16 keeps the float32 dot.
    dot = gemv_kn.Q4_DOT8_HALF if kwargs.get("dtype", "float16") == "float16" else gemv_kn.Q4_DOT8["bfloat16"]
    assert cfg.half_sums and [str(a[0].value) for a in kern.call_args["tirx.cuda.func_call"]] == [dot]


def test_a_symbolic_vocabulary_branches_on_its_alignment(cuda):
    # MLC-LLM's LM head: N (vocab_size) known at launch. Two kernels behind a host-side branch on
    # N % 4: 16-byte loads where it holds, one word at a time otherwise; both grids follow N.
    scheduled = apply_rule(Gemv(), q4_linear(None, 4096, layout="KN", epilogue="cast_fp32"), cuda)
    found = kernels(scheduled)
    assert len(found) == 2
    assert [k.vectorized[4] > 0 for k in found] == [True, False] and found[1].vectorized[1] > 0
    cols = _cfg().lanes_n * COLS_PER_LANE
    grids = []
    tirx.stmt_functor.post_order_visit(scheduled.body, lambda x: grids.append(x.extent) if isinstance(x, tirx.For)
                                       and x.thread_binding is not None and x.thread_binding.thread_tag == "blockIdx.x" else None)
    for vocab in (128256, 32001, 17):
        assert [evaluate(g, {"vocab_size": vocab}) for g in grids] == [-(-vocab // cols)] * 2
    conds = []  # the host-side branches (thread-invariant conditions)
    tirx.stmt_functor.post_order_visit(scheduled.body, lambda x: conds.append(x.condition.args[0])
                                       if isinstance(x, tirx.IfThenElse) and isinstance(x.condition, tvm.ir.Call)
                                       and x.condition.op.name == "tirx.tvm_thread_invariant" else None)
    assert [[evaluate(c, {"vocab_size": v}) for v in (128256, 32001, 32002)] for c in conds] == [[1, 0, 0]]


@pytest.mark.parametrize("name", ["qkv_norm", "gate_up_norm", "gate_up", "head_norm", "bf16_qkv_norm_f32_stream"])
def test_rule_takes_the_fused_decode_functions(cuda, name):
    # What fuse_norm_gemv and fuse_gate_up_silu emit for KN weights: one kernel, a block per 16
    # output columns; the norm prologue's row in shared
    # memory beside the warps' sums; paired, each lane loads the 16 bytes of its 4 gate columns and of
    # its 4 up columns a word row, paired_unroll word rows in flight.
    func = FUSED[name]()
    ops = analyze_matmul(func, prologue=True, dequant=True).operands
    scheduled = apply_rule(Gemv(), func, cuda)
    assert scheduled is not None and [p.name for p in scheduled.params] == [p.name for p in func.params]
    kern = kernel(scheduled)
    cfg = _cfg()
    assert kern.launch == {"blockIdx.x": -(-ops.out_n // (cfg.lanes_n * COLS_PER_LANE)), "threadIdx.x": cfg.warps * WARP}
    shared = {buf: shape for buf, (scope, _, shape) in kern.allocs.items() if scope == "shared"}
    halves = 2 if ops.paired else 1
    assert shared["red"] == (cfg.warps * halves * cfg.lanes_n * COLS_PER_LANE,)
    assert ("xs" in shared) == (ops.prologue is not None) and shared.get("xs", (ops.k,)) == (ops.k,)
    assert ("tirx.rsqrt" in kern.calls) == (ops.prologue is not None)
    assert kern.allocs["w"] == ("local", "uint32", (cfg.rows_in_flight(ops.paired) * halves * COLS_PER_LANE,))
    # sm_90 measured: twice the words in flight of the plain kernel (8 rows of 32 bytes a lane)
    assert cfg.rows_in_flight(True) == cfg.rows_in_flight(False) == 8


FUSED = {
    "qkv_norm": lambda: kn_fused(6144, 4096),
    "gate_up_norm": lambda: kn_fused(28672, 4096, paired=True),
    "gate_up": lambda: kn_fused(28672, 4096, paired=True, norm=False),
    "head_norm": lambda: kn_fused(128256, 4096, residual=False),
    "bf16_gate_up_norm": lambda: kn_fused(2 * 1000, 1024, paired=True, dtype="bfloat16", group=128),
    "prime_norm": lambda: kn_fused(37, 1024),
    "bf16_qkv_norm_f32_stream": lambda: kn_fused(1000, 1024, dtype="bfloat16", group=128, stream="float32"),
}


def test_rule_leaves_what_the_template_does_not_serve(cuda):
    assert apply_rule(Gemv(), q4_linear(4096, 4096, layout="KN", m=None), cuda) is None  # prefill / batch: DLight
    assert apply_rule(Gemv(), q4_linear(4096, 4096, layout="KN", m=2), cuda) is None  # no bucket past M = 1
    assert apply_rule(Gemv(), q4_linear(4096, 4096, layout="KN", zero=20.0), cuda) is None  # zero past 16
    assert apply_rule(Gemv(), q4_linear(4096, 4096, layout="KN"), tvm.target.Target("llvm")) is None
    # NK stays with the NK templates (the KN template refuses it).
    nk = analyze_matmul(q4_linear(4096, 4096), dequant=True).operands
    with pytest.raises(FuselightError, match="KN layout"):
        gemv_kn.check_kn(nk, _cfg())
    assert kn_gemv_config(nk, cuda) is None and apply_rule(Gemv(), q4_linear(4096, 4096), cuda) is not None
    # A static M past the bucket, a normed row past the static shared memory: refused by name.
    big = analyze_matmul(kn_fused(64, 32768), prologue=True, dequant=True)
    with pytest.raises(FuselightError, match="shared memory"):
        gemv_kn.check_kn(big.operands, _cfg(), 48 * 1024)
    assert not Gemv.supports(big, cuda) and Gemv.supports(analyze_matmul(kn_fused(64, 16384), prologue=True, dequant=True), cuda)
    with pytest.raises(FuselightError, match="M must be static"):
        gemv_kn.check_kn(analyze_matmul(q4_linear(4096, 4096, layout="KN", m=3), dequant=True).operands, _cfg())
    # The symbolic-M paths of the Gemv and Matmul rules stay away from KN (DLight takes it).
    batch = analyze_matmul(q4_linear(4096, 4096, layout="KN", m=None), dequant=True)
    assert symbolic_m_buckets(batch.operands, cuda) == [] and not Gemv.supports(batch, cuda)


def test_analysis_refuses_what_is_not_a_4bit_kn_dequantize():
    def kn_linear(mask: int, zero_buffer: bool = False):
        n, k, i64 = 64, 256, "int64"
        q = te.placeholder((tirx.IntImm(i64, k // 8), tirx.IntImm(i64, n)), "uint32", name="q")
        s = te.placeholder((tirx.IntImm(i64, k // 32), tirx.IntImm(i64, n)), "float16", name="s")
        z = te.placeholder((tirx.IntImm(i64, k // 32), tirx.IntImm(i64, n)), "float16", name="z")
        x = te.placeholder((tirx.IntImm(i64, 1), tirx.IntImm(i64, k)), "float16", name="x")

        def value(j, i):
            e = tirx.Cast("float16", tirx.bitwise_and(tirx.shift_right(q[j // 8, i], tirx.Cast("uint32", j % 8 * 4)),
                                                      tirx.const(mask, "uint32")))
            zero = z[j // 32, i] if zero_buffer else tirx.const(7, "float16")
            return (e - zero) * s[j // 32, i]

        w = te.compute((k, n), value, name="dequantize")
        r = te.reduce_axis((0, k), name="k")
        mm = te.compute((1, n), lambda b, i: te.sum(tirx.Cast("float32", x[b, r]) * tirx.Cast("float32", w[r, i]), axis=r))
        return te.create_prim_func([q, s, *([z] if zero_buffer else []), x, mm])

    assert Gemv.analyze(kn_linear(15)).operands.dequant.layout == "KN"  # the control: [K, N] read NN
    assert Gemv.analyze(kn_linear(7)) is None  # 3-bit values in 4-bit places
    assert Gemv.analyze(kn_linear(15, zero_buffer=True)) is None  # a zero-point buffer (AWQ)


# ---- the kernel's data flow --------------------------------------------------------------------


def _run_llvm(func, args, outputs=1):
    """``func`` run on llvm; its last ``outputs`` arguments as numpy arrays."""
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*tensors)
    return [t.numpy() for t in tensors[-outputs:]]


def _with_m(cfg, m):
    """``cfg`` serving ``m`` rows (the template takes any static M; the config ships M = 1 only)."""
    return dataclasses.replace(cfg, max_m=max(cfg.max_m, m))


def _emulate(kern, cfg, n_out, k, group, m, words, scales, tokens, pair=None, vec=4, symbolic=False):
    """The kernel's data flow in numpy: every thread of every block loads the words, scales and tokens
    at the kernel's own load indices (evaluated from its TIR), for the lanes' word rows and columns the
    module docstring gives, and sums in float64: ``[halves, m, n_out]`` (paired: the gate, then the up
    columns of each output), checking that each word is read exactly once."""
    def one(name):
        found = {str(i): i for i in kern.loads[name]}  # (a prologue loads round 0's words first: the same index)
        assert len(found) == 1, found
        return next(iter(found.values()))

    w_index, s_index, x_index = one("W"), one("S"), one("X")
    halves = 1 if pair is None else 2
    unroll = cfg.rows_in_flight(pair is not None)
    lanes_k = WARP // cfg.lanes_n
    slots, cols = lanes_k * cfg.warps, cfg.lanes_n * COLS_PER_LANE
    rounds = -(-(k // 8) // (slots * unroll))
    out = np.zeros((halves, m, n_out))
    seen = np.zeros((k // 8, n_out * halves), dtype=int)
    blocks = -(-n_out // cols)
    assert symbolic or kern.launch["blockIdx.x"] == blocks  # (a symbolic grid: the test above)
    for bx in range(blocks):
        for tid in range(kern.launch["threadIdx.x"]):
            warp, lane = tid // WARP, tid % WARP
            slot, col0 = warp * lanes_k + lane // cfg.lanes_n, bx * cols + lane % cfg.lanes_n * COLS_PER_LANE
            for r in range(rounds):
                for u in range(unroll):
                    kw = (r * unroll + u) * slots + slot
                    if kw >= k // 8:
                        continue
                    at = {"kw": kw, "col0": col0, "vocab_size": n_out}
                    t = np.array([[tokens[evaluate(x_index, {**at, "row": row, "e": e})] for e in range(8)]
                                  for row in range(m)], dtype=np.float64)
                    for h in range(halves):
                        for j in range(COLS_PER_LANE):
                            v, e = j // vec, j % vec
                            wi, si = (evaluate(index, {**at, "v": v, "e": e, "h": h}) for index in (w_index, s_index))
                            assert 0 <= wi < words.size and 0 <= si < scales.size
                            col = col0 + j
                            if col >= n_out:
                                continue  # read (in bounds), never stored
                            assert wi % (n_out * halves) == col + h * (pair or 0) and si // (n_out * halves) == kw * 8 // group
                            seen[kw, col + h * (pair or 0)] += 1
                            nibbles = (int(words[wi]) >> (4 * np.arange(8))) & 15
                            out[h, :, col] += float(scales[si]) * ((nibbles - 7) * t).sum(axis=1)
    assert (seen == 1).all()  # every word of the weight once
    return out


@pytest.mark.parametrize("n,k,group,m,symbolic", [
    (37, 1024, 128, 1, False), (42, 768, 32, 1, False), (40, 256, 32, 3, False),
    (36, 256, 32, 1, True), (37, 256, 128, 1, True),  # a symbolic N: each arm of the host branch
])
def test_emulated_kernel_matches_the_unscheduled_function(cuda, n, k, group, m, symbolic):
    # The kernel's data flow emulated (``_emulate``), then against the unscheduled function run on
    # llvm (its fp16 dequantize and float32 matmul).
    func = q4_linear(None if symbolic else n, k, layout="KN", group=group, m=m)
    cfg = _with_m(_cfg(), m)
    vec = 4 if n % 4 == 0 else 2 if n % 2 == 0 and not symbolic else 1
    kern = kernel(with_kernels(func, gemv_kn.kn_body(analyze_matmul(func, dequant=True).operands, cfg, vec)))
    rng = np.random.default_rng(n)
    q = rng.integers(0, 2**32, size=(k // 8, n), dtype=np.uint64).astype(np.uint32)
    s = rng.uniform(-0.02, 0.02, size=(k // group, n)).astype(np.float16)
    x = rng.standard_normal((m, 1, k)).astype(np.float16)
    (out,) = _emulate(kern, cfg, n, k, group, m, q.reshape(-1), s.reshape(-1), x.reshape(-1), vec=vec, symbolic=symbolic)
    ref = _run_llvm(func, [q, s, x, np.zeros((m, 1, n), np.float16)])[0].reshape(m, n).astype(np.float64)
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


def kn_fused(n: int, k: int, *, paired: bool = False, norm: bool = True, residual: bool = True, m: int = 1,
             dtype: str = "float16", group: int = 32, stream: str | None = None) -> tirx.PrimFunc:
    """What the passes emit for a KN weight ``[K, n]`` (its words ``[K / 8, n]``, dequantized in the
    function): the matmul accumulating in float32 (cast back; paired: FuseGateUpSiLU's SiLU-mul),
    and with ``norm`` FuseNormIntoGemv's RMSNorm (of x + residual with ``residual``) in front
    (``stream``: x and x + residual in that dtype, residual_stream_fp32's)."""
    s = QuantScheme("kn", dtype, group, "KN")
    i64 = "int64"
    nn = tirx.IntImm(i64, n)
    x_shape, w_shape = [tirx.IntImm(i64, d) for d in (m, 1, k)], [tirx.IntImm(i64, k), nn]
    consumer = (gate_up_silu_prim_func(x_shape, dtype, w_shape, dtype, "float32", dtype, "NN") if paired
                else matmul_prim_func(x_shape, w_shape, dtype, "float32"))
    qs, ss = [tirx.IntImm(i64, k // 8), nn], [tirx.IntImm(i64, k // group), nn]
    q, scale = te.placeholder(qs, "uint32", "q"), te.placeholder(ss, dtype, "s")
    func = with_dequantized_weight(consumer, te.create_prim_func([q, scale, te_dequantize((q, scale), s)]))
    if not norm:
        return func
    return fused_norm_matmul(relax.TensorType([m, 1, k], stream or dtype), residual, relax.TensorType([k], dtype), EPS,
                             func, [relax.TensorType(qs, "uint32"), relax.TensorType(ss, dtype)], () if paired else (dtype,),
                             stream)


def _rms_norm(t: np.ndarray, w: np.ndarray) -> np.ndarray:
    """TOPI's rms_norm of fp16 rows: float32 statistics, the result rounded to fp16 once."""
    t32 = t.astype(np.float32)
    rstd = 1 / np.sqrt((t32 * t32).mean(axis=-1, keepdims=True) + np.float32(EPS))
    return (rstd * t32 * w.astype(np.float32)).astype(np.float16)


@pytest.mark.parametrize("n,k,group,paired,norm", [
    (2 * 44, 512, 32, True, False),  # gate+up alone (I = 44: loads of 4 columns; 11 blocks, one ragged)
    (2 * 42, 768, 128, True, True),  # normed gate+up (I = 42: loads of 2)
    (37, 1024, 32, False, True),  # normed qkv-like, a prime N
])
def test_emulated_fused_kernels_match_the_unscheduled_function(cuda, n, k, group, paired, norm):
    # The norm prologue and the paired epilogue: the kernel's weight and token loads emulated
    # (``_emulate``; with the prologue, its tokens are the normed row it stages in shared memory,
    # computed here as TOPI does, the staging itself being the NK templates' shared prologue), the
    # epilogue applied in float64, against the unscheduled function run on llvm.
    func = kn_fused(n, k, paired=paired, norm=norm, group=group)
    ops = analyze_matmul(func, prologue=True, dequant=True).operands
    assert ops.paired == paired and (ops.prologue is not None) == norm and ops.dequant.layout == "KN"
    cfg = _cfg()
    n_out = n // 2 if paired else n
    vec = gemv_kn.kn_vec(n_out)
    kern = kernel(with_kernels(func, gemv_kn.kn_body(ops, cfg, vec)))
    assert ("tirx.rsqrt" in kern.calls) == norm
    rng = np.random.default_rng(n + k)
    q = rng.integers(0, 2**32, size=(k // 8, n), dtype=np.uint64).astype(np.uint32)
    s = rng.uniform(0.01, 0.03, size=(k // group, n)).astype(np.float16)
    x = rng.standard_normal((1, 1, k)).astype(np.float16)
    r = rng.standard_normal((1, 1, k)).astype(np.float16)
    w = rng.uniform(0.5, 1.5, size=k).astype(np.float16)
    tokens = _rms_norm(x + r, w) if norm else x
    acc = _emulate(kern, cfg, n_out, k, group, 1, q.reshape(-1), s.reshape(-1), tokens.reshape(-1),
                   pair=n_out if paired else None, vec=vec)
    if paired:
        gate, up = acc.astype(np.float16).astype(np.float64)  # the accumulators cast to fp16, as the function
        got = gate / (1 + np.exp(-gate)) * up
    else:
        got = acc[0]
    out = np.zeros((1, 1, n_out), np.float16)
    args = [x, r, w, q, s, out, np.zeros_like(x)] if norm else [x, q, s, out]
    ref = _run_llvm(func, args, 1 + norm)[0].reshape(1, n_out).astype(np.float64)
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(got, ref, rtol=5e-3, atol=5e-3 * np.abs(ref).max())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_bit_trick_gives_each_value_exactly(dtype):
    # ``((w >> 4 j) & 0x000F000F) | magic`` read as a pair of ``dtype`` is (base + e_j, base + e_{j+4});
    # minus the bias (base + zero) it is e - zero exactly, for every nibble.
    zero = 7
    src = gemv_kn.q4_dot8_source(dtype, zero)
    magic = int(re.search(r"\| (0x[0-9a-f]+)u;", src).group(1), 16)
    bias = int(re.search(r"zb = (0x[0-9a-f]+)u", src).group(1), 16)
    e = np.arange(16, dtype=np.uint32)
    word = np.uint32(0x76543210)  # values 0..7 in places 0..7
    for j in range(4):
        pair = ((word >> np.uint32(4 * j)) & np.uint32(0x000F000F)) | np.uint32(magic)
        assert pair & 0xF == j and (pair >> 16) & 0xF == j + 4
    lanes = ((e | (e << 16)) & 0x000F000F) | magic
    if dtype == "float16":
        lo = (lanes & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
        z = float(np.uint16(bias).view(np.float16))
    else:
        lo = ((lanes & 0xFFFF) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
        z = float(np.array([bias << 16], dtype=np.uint32).view(np.float32)[0])
    assert ((lo - z) == e.astype(np.float64) - zero).all()


def test_half_sums_pair_the_tokens_as_the_words_pair_their_values(cuda):
    # With half sums the 8 tokens of a word row are staged for the dot as (j, j + 4) pairs, the order
    # in which ``Q4_WORD_HALF`` converts a word's values: staged element e holds token q4_order(e).
    func = q4_linear(4096, 4096, layout="KN")
    ops = analyze_matmul(func, dequant=True).operands
    body = with_kernels(func, gemv_kn.kn_body(ops, _cfg(), 4)).body
    stores = []

    def visit(node):
        if isinstance(node, tirx.BufferStore) and node.buffer.name == "xf":
            assert isinstance(node.value, tirx.BufferLoad) and node.value.buffer.name == "xv"
            stores.append((node.indices[0], node.value.indices[0]))

    tirx.stmt_functor.post_order_visit(body, visit)
    ((into, source),) = stores
    staged = {evaluate(into, {"i": i, "u": 0}): evaluate(source, {"i": i, "u": 0}) for i in range(8)}
    assert staged == dict(enumerate([0, 4, 1, 5, 2, 6, 3, 7]))
    with pytest.raises(FuselightError, match="half_sums"):
        bf16 = analyze_matmul(q4_linear(4096, 4096, layout="KN", dtype="bfloat16"), dequant=True).operands
        gemv_kn.check_kn(bf16, _cfg())
    assert not kn_gemv_config(bf16, cuda).half_sums  # the rule drops it


def test_nvcc_compiles_the_kernels(cuda):
    funcs = {
        "qkv": q4_linear(6144, 4096, layout="KN"),
        "down_res": q4_linear(4096, 14336, layout="KN", epilogue="residual"),
        "head": q4_linear(128256, 4096, layout="KN", epilogue="cast_fp32"),
        "bf16_g128": q4_linear(4096, 4096, layout="KN", dtype="bfloat16", group=128),
        "prime": q4_linear(37, 1024, layout="KN", group=128),
        "even": q4_linear(4098, 576, layout="KN"),
        "vocab": q4_linear(None, 4096, layout="KN", epilogue="cast_fp32"),  # two kernels
        "nk": q4_linear(6144, 4096),  # the NK row template's half sums share the word helper (guarded)
        **{name: make() for name, make in FUSED.items()},  # the norm prologue, the paired epilogue
    }
    kernels = {name: apply_rule(Gemv(), f, cuda).with_attr("global_symbol", name) for name, f in funcs.items()}
    m3 = q4_linear(4096, 4096, layout="KN", m=3, epilogue="residual")  # the template at M = 3
    kernels["m3"] = with_kernels(m3, gemv_kn.kn_body(analyze_matmul(m3, dequant=True).operands, _with_m(_cfg(), 3), 4)).with_attr(
        "global_symbol", "m3")
    source = tvm.compile(tvm.IRModule(kernels), target=cuda).mod.imports[0].inspect_source("cuda")
    assert kernel_names(source) == {f"{name}_kernel" for name in kernels if name != "vocab"} | {"vocab_kernel", "vocab_kernel_1"}
    assert "fuselight_q4_dot8_bf16(" in kernel_body(source, "bf16_g128_kernel")
    assert "fuselight_q4_dot8_fp16_half_sums(" in kernel_body(source, "qkv_kernel")
    assert "fuselight_q4_dot32_fp16_half_sums(" in kernel_body(source, "nk_kernel")
    # The config is the analytic one for every described arch: sm_80 too.
    assert all(compile_cuda_concurrently([(source, "sm_90"), (source, "sm_80")]))


def test_config_serves_every_described_arch_and_names_a_bad_field():
    # sm_90 measured (8 word rows in flight); the other described archs take the analytic entry; others none.
    assert gemv_kn.load_kn_configs("sm_80") == gemv_kn.load_kn_configs("sm_86") == gemv_kn.load_kn_configs("sm_89")
    assert [c.unroll for c in gemv_kn.load_kn_configs("sm_90")] == [8]
    assert [c.unroll for c in gemv_kn.load_kn_configs("sm_80")] == [4]
    with pytest.raises(FuselightError):
        gemv_kn.load_kn_configs("sm_70")
    good = _cfg()
    for field, value in (("lanes_n", 3), ("lanes_n", 64), ("warps", 6), ("warps", 64)):
        with pytest.raises(FuselightError, match=field):
            gemv_kn.check_kn_config(dataclasses.replace(good, **{field: value}))
