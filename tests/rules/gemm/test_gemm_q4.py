"""The quantized GEMM (prefill, symbolic M): the Matmul rule takes MLC-LLM's q4f16_1 / q4bf16_1
projections with a 4-bit B and runs the mma.sync template with the dequantize in its mainloop. Here:
the rule claims them for sm_90 (the LM head's symbolic vocabulary too), the kernels' structure (the
packed words and scales streamed by cp.async, no dequantized weight in memory, tensor cores, one
kernel per M range behind a host branch), the plans of the config, what is left to DLight (KN,
zero-point buffers, groups no multiple of 32, non-integer zero points), the dequantize's arithmetic
against MLC's (bit for bit, an emulation of the device function), and nvcc compiling every variant.
Numerics of the kernels run on the GPU against float64: ``bench/probes/q4_gemm.py``."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re

import numpy as np
import pytest
from conftest import apply_rule, in_spawned_processes, needs_nvcc
from cuda_source import main_loops
from tir_query import evaluate, kernels
from fuselight.paths import config_dir

tvm = pytest.importorskip("tvm")
from fuselight.cuda_compile import nvcc_path
from fuselight.device import device_model
from fuselight.quant_prim_funcs import q4_linear
from fuselight.rules.arch_config import per_sm_counts
from fuselight.rules.gemm import dispatch
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemm.mma_sync import Q4_DEQUANT, q4_dequant_source
from fuselight.rules.gemm.plan import GemmPlan, GemmTile, check_plan, q4_smem, shared_bytes
from fuselight.rules.gemm.wgmma import (
    MAX_DYNAMIC_SMEM,
    WgmmaPlan, WgmmaTile,
    check_tile,
    q4_staging_bytes,
)
from fuselight.rules.gemm.wgmma import smem_bytes as wgmma_smem_bytes
from fuselight.rules.gemv import symbolic_m_buckets
from fuselight.rules.gemm.wgmma_q4 import WgmmaQ4Plan
from fuselight.rules.gemm.wgmma_q4 import check_tile as check_rs_tile
from fuselight.rules.matmul import Matmul
from tvm import te, tirx

LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (None, 4096)]


def _source(kernel, target) -> str:
    lib = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=target)
    return lib.mod.imports[0].inspect_source("cuda")


def _kernels(src: str) -> set[str]:
    return set(re.findall(r'extern "C" __global__ void __launch_bounds__\([\d, ]+\) (\w+)\(', src))


def _kernel_body(src: str, name: str) -> str:
    start = src.index(f" {name}(", src.index(f" {name}(") + 1)  # the definition (after the declaration)
    nxt = src.find('extern "C" __global__', start)
    return src[start: nxt if nxt >= 0 else len(src)]


def _assert_one_barrier_a_slice(body: str) -> None:
    """The 4-bit mainloop's pipeline: one barrier a K slice (none from TVM's sync planner); each
    thread waits for its own copies (a wait with a memory clobber) before it dequantizes, and the
    dequantize of the next slice sits between the mmas of this one, before the barrier."""
    loops = main_loops(body)
    assert loops
    for loop in loops:
        assert loop.count("__syncthreads()") == 1
        wait = loop.index("fuselight_cp_async_wait_")
        first_deq = loop.index("fuselight_q4_dequant32_")
        barrier = loop.index("__syncthreads()")
        first_mma = loop.index("mma.sync.aligned")
        assert first_mma < wait < first_deq < barrier


def _assert_wgmma_producer_dequantizes(body: str) -> None:
    """The wgmma kernel of a 4-bit B: the producer warpgroup streams the packed words and scales by
    cp.async (A alone by TMA, no B tensor map), waits for its own copies, dequantizes into the
    slot, fences for the async proxy and arrives on the slot's full barrier (count 1 + 128)."""
    assert "wgmma_mma_async_ss_" in body
    assert "CUtensorMap a_map" in body and "b_map" not in body
    assert re.search(r"fuselight_cp_async_16\(buf_dyn_shmem_ptr, [^;]*q_weight_ptr", body)
    assert re.search(r"fuselight_cp_async_4\(buf_dyn_shmem_ptr, [^;]*q_scale_ptr", body)
    assert re.search(r"tvm_builtin_ptx_mbarrier_init\([^;]*, 129\);", body)
    producer = body[body.index("tvm_builtin_ptx_setmaxnreg_dec_"): body.index("tvm_builtin_ptx_setmaxnreg_inc_")]
    loop = producer[producer.index("for (int kt"):]
    assert "__syncthreads" not in producer  # mbarriers only past the setup
    wait = loop.index("fuselight_cp_async_wait_")
    deq = loop.index("fuselight_q4_dequant32_")
    fence = loop.index("tvm_builtin_ptx_fence_proxy_async_shared_cta()")
    arrive = loop.index("tvm_builtin_ptx_mbarrier_arrive_shared(")
    assert loop.index("tvm_builtin_ptx_mbarrier_try_wait(") < deq  # the slot is free
    assert wait < deq < fence < arrive
    assert "ptx_cp_async_bulk_tensor_g2s_cta_tile_2d" in loop  # A's TMA
    # The register split gives back exactly what it takes: producer + 2 consumers = 3 x the launch's
    # allocation (65536 registers over 384 threads, in steps of 8); more hangs setmaxnreg.inc.
    (dec,) = map(int, re.findall(r"tvm_builtin_ptx_setmaxnreg_dec_(\d+)\(\)", body))
    (inc,) = map(int, re.findall(r"tvm_builtin_ptx_setmaxnreg_inc_(\d+)\(\)", body))
    assert dec + 2 * inc == 3 * (65536 // 384 // 8 * 8)
    # The epilogue is the fp16 template's: every accumulator it reads exists (a regression: the
    # producer's piece count once shadowed the epilogue's, which then read past the accumulators).
    n_acc = int(re.search(r"float acc_ptr\[(\d+)\];", body).group(1))
    used = [int(i) for i in re.findall(r"acc_ptr \+ (\d+)\)", body) + re.findall(r"acc_ptr\[(\d+)\]", body)]
    assert max(used) == n_acc  # (the declaration)
    assert sorted(set(used))[-2] == n_acc - 1


# ---- the rule and its plans ------------------------------------------------------------------


@pytest.mark.parametrize("n,k", LLAMA_SHAPES)
def test_q4_ranges_cover_every_m_with_valid_plans(n, k):
    ops = analyze_matmul(q4_linear(n, k, m=None, epilogue="cast_fp32" if n is None else "cast"), dequant=True).operands
    ranges = dispatch.q4_plan_ranges(ops, "sm_90")
    assert ranges
    uppers = [u for u, _ in ranges]
    assert uppers == sorted(uppers) and len(set(uppers)) == len(uppers)
    for _, plan in ranges:
        if isinstance(plan, WgmmaQ4Plan):
            check_rs_tile(plan.tile, ops)
        elif isinstance(plan, WgmmaPlan):
            check_tile(plan.tile, ops, plan.split_k)
            assert wgmma_smem_bytes(plan.tile, ops) == plan.tile.smem_bytes + plan.tile.q4_staging * q4_staging_bytes(plan.tile)
            assert wgmma_smem_bytes(plan.tile, ops) <= MAX_DYNAMIC_SMEM
        else:
            check_plan(plan, ops)
            assert shared_bytes(plan.main, ops) == max(q4_smem(plan.main, 32).halves * 2, plan.main.epilogue_floats * 4)
    assert ranges[-1][1].split_k == 1  # every larger M: never split
    assert all(a[1] != b[1] for a, b in zip(ranges, ranges[1:]))  # neighbours differ: one kernel a plan
    if n is None:
        assert all(plan.split_k == 1 for _, plan in ranges)  # a symbolic N: no split-K
    # Past M = 512 a static N takes the weight-in-registers template (the sweep's best,
    # docs/experiments/q4-gemm.md): configs/gemm/mma_sync_q4.json names q4rs-t256s5 first up to
    # 1536 (two ranges, one plan) and q4rs-t256s4 above (these shapes' measured ranges take its
    # smaller token tiles below, tested in test_gemm_wgmma_q4.py). The LM head's symbolic N cannot (static N
    # only) and falls back to mma.sync, as bf16 falls back to the producer-dequantizing wgmma tiles,
    # which serve where their block_n divides N (6144 = 32 x 192; 4096 and 28672 only by 256).
    rs = [(upper, plan.tile.block_t, plan.tile.stages) for upper, plan in ranges if isinstance(plan, WgmmaQ4Plan)]
    assert not any(isinstance(plan, WgmmaPlan) for _, plan in ranges)
    if n is None:
        assert rs == []
    else:
        assert rs[-2:] == [(1536, 256, 5), (2**31 - 1, 256, 4)]
        bf16 = analyze_matmul(q4_linear(n, k, m=None, dtype="bfloat16"), dequant=True).operands
        tiles = {(plan.tile.block_n, plan.tile.stages) for upper, plan in dispatch.q4_plan_ranges(bf16, "sm_90")
                 if upper > 256}
        assert tiles == {(192, 4) if n == 6144 else (256, 3)}
    assert dispatch.q4_plan_ranges(ops, "sm_42") == []


def test_rule_takes_mlcs_prefill_projection(cuda):
    func = q4_linear(6144, 4096, m=None)  # fused_dequantize1_fused_NT_matmul_astype
    kernel = apply_rule(Matmul(), func, cuda)
    assert kernel is not None
    assert [p.name for p in kernel.params] == [p.name for p in func.params]  # the signature stays
    ops = analyze_matmul(func, dequant=True).operands
    gemv = symbolic_m_buckets(ops, cuda)
    ranges = dispatch.q4_plan_ranges(ops, "sm_90")
    kept = [r for r in ranges[:-1] if not gemv or r[0] > gemv[-1][0]] + ranges[-1:]
    src = _source(kernel, cuda)
    names = _kernels(src)
    # one kernel per GEMV bucket and M range, a reduction per split-K range
    assert len(names) == len(gemv) + sum(2 if plan.split_k > 1 else 1 for _, plan in kept)
    gemm = [nm for nm in names if "fuselight_q4_dequant32_fp16(" in _kernel_body(src, nm)]
    rs = [nm for nm in names if "ptx_wgmma_mma_async_rs_" in _kernel_body(src, nm)]
    assert len(gemm) + len(rs) == len(kept)
    assert len(rs) == sum(isinstance(plan, WgmmaQ4Plan) for _, plan in kept) > 0
    wgmma = [nm for nm in gemm if "wgmma_mma_async_ss_" in _kernel_body(src, nm)]
    assert len(wgmma) == sum(isinstance(plan, WgmmaPlan) for _, plan in kept)
    for nm in wgmma:
        _assert_wgmma_producer_dequantizes(_kernel_body(src, nm))
    mma = set(gemm) - set(wgmma)
    assert len(mma) == sum(isinstance(plan, GemmPlan) for _, plan in kept)
    for nm in mma:
        body = _kernel_body(src, nm)
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in body
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in body
        # The packed words stream in by 16-byte cp.async, the scales by 4-byte ones (through the
        # template's own copy functions, which TVM's sync planner does not see).
        assert re.search(r"fuselight_cp_async_16\(smem_ptr, [^;]*q_weight_ptr", body)
        assert re.search(r"fuselight_cp_async_4\(smem_ptr, [^;]*q_scale_ptr", body)
        _assert_one_barrier_a_slice(body)
        assert "extern __shared__" in src
    # No dequantized weight anywhere: no N x K buffer, no fp16 weight parameter.
    assert "25165824" not in src
    assert not re.search(r"half\* __restrict__ (dequantize\w*|compute)_ptr", src)
    assert "0x64006400u" in src and "__byte_perm" in src
    if mma:
        # The waits and copies are compiler memory barriers (no shared load moves above its wait).
        assert re.search(r'asm volatile\("cp\.async\.wait_group \d+;\\n" ::: "memory"\);', src)
        assert src.count('"l"(src) : "memory");') >= 2
    # The host branches on M (batch_size): the dispatch's ranges.
    host = kernel.script()
    for upper, _ in kept[:-1]:
        assert f"batch_size <= T.int64({upper})" in host


def test_rule_takes_the_lm_head_with_a_symbolic_vocabulary(cuda):
    func = q4_linear(None, 4096, m=None, epilogue="cast_fp32")
    found = kernels(apply_rule(Matmul(), func, cuda))
    # configs/gemm/gemv_q4.json's five buckets (M <= 1, 2, 4, 8, 16: the row template, then mma; the
    # buckets for 2, 4 and 8 write one kernel, one range), then mma_sync_q4.json's four ranges; all
    # write the logits only, over a grid that follows the vocabulary at run time.
    assert len(found) == 3 + 4
    for kern in found:
        assert kern.outputs - {"C_smem"} == {"compute2"} and "vocab_size" in kern.launch["blockIdx.x"]
    # The last row tile is clamped on load: a row past the vocabulary reads the last row's words
    # (512 a row), whatever the lane's piece.
    # (The first round's loads index from the block's first column, ``col_first``, the rest from ``col0``.)
    vocab = 1000
    for index in found[0].loads["W"]:
        at = {"j": 0, "p": 0, "e": 0, "vocab_size": vocab}
        last = evaluate(index, {**at, "col0": vocab - 1, "col_first": vocab - 1})
        assert last == (vocab - 1) * 512
        assert evaluate(index, {**at, "col0": vocab + 7, "col_first": vocab + 7}) == last


@pytest.mark.parametrize(
    "kwargs",
    [dict(layout="KN"), dict(group=16), dict(zero=7.5), dict(zero=200.0)],
    ids=["KN", "group16", "zero7.5", "zero200"],
)
def test_rule_leaves_what_the_template_does_not_dequantize(kwargs, cuda):
    func = q4_linear(4096, 4096, m=None, **kwargs)
    assert apply_rule(Matmul(), func, cuda) is None


def test_rule_leaves_a_zero_point_buffer(cuda):
    n, k, group = 4096, 4096, 32
    i64 = "int64"
    q = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // 8)), "uint32", name="q")
    s = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // group)), "float16", name="s")
    z = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // group)), "float16", name="z")
    mm = tirx.Var("m", i64)
    x = te.placeholder((mm, tirx.IntImm(i64, k)), "float16", name="x")

    def value(i, j):
        e = tirx.Cast("float16", tirx.bitwise_and(tirx.shift_right(q[i, j // 8], tirx.Cast("uint32", j % 8 * 4)),
                                                  tirx.const(15, "uint32")))
        return (e - z[i, j // group]) * s[i, j // group]

    w = te.compute((n, k), value, name="dequantize")
    r = te.reduce_axis((0, k), name="k")
    acc = te.compute((mm, n), lambda b, i: te.sum(tirx.Cast("float32", x[b, r]) * tirx.Cast("float32", w[i, r]), axis=r))
    out = te.compute((mm, n), lambda b, i: tirx.Cast("float16", acc[b, i]), name="cast")
    assert apply_rule(Matmul(), te.create_prim_func([q, s, z, x, out]), cuda) is None


def test_plan_checks_name_the_problem():
    ops = analyze_matmul(q4_linear(4096, 4096, m=None), dequant=True).operands
    tile = GemmTile(128, 128, 64, 2, 2, 4)  # (the 4096 x 4096 plans at M 257..1024 before wgmma)
    bad_k = dataclasses.replace(tile, block_k=16)
    with pytest.raises(Exception, match="whole pieces of 32 packed values"):
        check_plan(GemmPlan(bad_k), ops)
    kn = analyze_matmul(q4_linear(4096, 4096, m=None, layout="KN"), dequant=True)
    if kn is not None:  # (the analysis may already refuse a KN weight under an NT matmul)
        with pytest.raises(Exception, match="layout"):
            check_plan(GemmPlan(tile), kn.operands)
    head = analyze_matmul(q4_linear(None, 4096, m=None, epilogue="cast_fp32"), dequant=True).operands
    with pytest.raises(Exception, match="split_k needs a static n"):
        check_plan(GemmPlan(tile, split_k=2), head)
    # A wgmma tile of the config whose block_n divides 4096.
    raw = per_sm_counts(device_model("sm_90"),
                        json.loads((config_dir() / "gemm" / "mma_sync_q4.json").read_text())["sm_90"]["wgmma_tiles"], "q4")
    wg = next(t for t in (WgmmaTile(**fields) for fields in raw.values()) if 4096 % t.block_n == 0)
    with pytest.raises(Exception, match="not a multiple of block_n"):
        check_tile(dataclasses.replace(wg, block_n=192), ops)
    with pytest.raises(Exception, match="needs a static n"):
        check_tile(wg, head)
    with pytest.raises(Exception, match="shared memory"):
        check_tile(dataclasses.replace(wg, block_n=256, stages=4), ops)  # the staging ring does not fit
    g16 = analyze_matmul(q4_linear(4096, 4096, m=None, group=128), dequant=True).operands
    check_tile(wg, g16)
    fp16 = dataclasses.replace(ops, dequant=None)
    with pytest.raises(Exception, match="must be static"):
        check_plan(GemmPlan(tile), dataclasses.replace(fp16, n=tirx.Var("n", "int64")))


# ---- the dequantize's arithmetic ------------------------------------------------------------


def _emulate(words: np.ndarray, scale: float, dtype: str, zero: int) -> np.ndarray:
    """What the device function writes for one piece (4 words): 32 values in K order, emulating
    its bit operations (``((w >> 4 j) & 0x000F000F) | magic``, half2 subtract and multiply, byte_perm)."""
    import ml_dtypes

    np_t = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    magic, base = (0x64006400, 0x6400) if dtype == "float16" else (0x43004300, 0x4300)
    bias = np.array([base + zero], dtype=np.uint16).view(np_t)[0]
    s = np_t(scale)
    out = []
    for w in words.astype(np.uint32):
        h = []
        for j in range(4):
            b = ((int(w) >> (4 * j)) & 0x000F000F) | magic
            pair = np.array([b], dtype=np.uint32).view(np_t)  # [low half, high half]
            v = ((pair - bias).astype(np_t) * s).astype(np_t)  # one rounding each, in dtype
            h.append(int(v.view(np.uint32)[0]))

        def perm(x, y, sel):  # __byte_perm
            src = x.to_bytes(4, "little") + y.to_bytes(4, "little")
            return int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")

        chunk = [perm(h[0], h[1], 0x5410), perm(h[2], h[3], 0x5410), perm(h[0], h[1], 0x7632), perm(h[2], h[3], 0x7632)]
        out.append(np.array(chunk, dtype=np.uint32).view(np_t))
    return np.concatenate(out)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dequantize_arithmetic_is_mlcs_bit_for_bit(dtype):
    import ml_dtypes

    np_t = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    for _ in range(50):
        words = rng.integers(0, 2**32, size=4, dtype=np.uint64).astype(np.uint32)
        scale = float(rng.uniform(-0.05, 0.05))
        got = _emulate(words, scale, dtype, 7)
        values = np.array([(int(w) >> (4 * e)) & 15 for w in words for e in range(8)])  # K order
        want = ((values.astype(np_t) - np_t(7)).astype(np_t) * np_t(scale)).astype(np_t)
        assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist()
    src = q4_dequant_source(dtype, 7)
    assert Q4_DEQUANT[dtype] in src and ("0x6407" in src if dtype == "float16" else "0x4307" in src)


# ---- nvcc ------------------------------------------------------------------------------------


# One dtype a module (kernels of both would declare the dynamic shared buffer with two types), the
# float16 kernels in two. The three builds and nvcc runs go to spawned processes started at collection
# (conftest: the ``background`` marker), on the core pytest leaves idle.
MODULES = (("qkv", "o_proj", "gate_up", "lm_head"), ("down", "g128", "static_m"), ("bf16",))


def _variant(name: str) -> tirx.PrimFunc:
    return {
        "qkv": lambda: q4_linear(6144, 4096, m=None),
        "o_proj": lambda: q4_linear(4096, 4096, m=None, epilogue="residual"),
        "gate_up": lambda: q4_linear(28672, 4096, m=None),
        "down": lambda: q4_linear(4096, 14336, m=None, epilogue="residual"),
        "lm_head": lambda: q4_linear(None, 4096, m=None, epilogue="cast_fp32"),
        "bf16": lambda: q4_linear(4096, 4096, m=None, dtype="bfloat16"),
        "g128": lambda: q4_linear(4096, 4096, m=None, group=128),
        "static_m": lambda: q4_linear(4096, 4096, m=512),
    }[name]()


def _build_and_compile(names: tuple[str, ...]) -> tuple[bool, int]:
    """(whether the CUDA has the 4-bit dequantize of its dtype, nvcc's fatbin bytes for sm_90) of the
    Matmul rule's kernels of ``names`` (in a worker process)."""
    from fuselight.cuda_compile import compile_cuda
    from fuselight.target import resolve, to_tvm

    cuda = to_tvm(resolve("cuda", "sm_90"))
    kernels = {nm: apply_rule(Matmul(), _variant(nm), cuda).with_attr("global_symbol", nm) for nm in names}
    source = tvm.compile(tvm.IRModule(kernels), target=cuda).mod.imports[0].inspect_source("cuda")
    dequant = f"fuselight_q4_dequant32_{'bf16' if names == ('bf16',) else 'fp16'}(" in source
    return dequant, len(compile_cuda(source, "sm_90"))


_NVCC: dict[tuple[str, ...], concurrent.futures.Future] = {}


def start_in_background(alone: bool) -> None:
    """``_build_and_compile`` of every module in spawned processes (one where other tests run too)."""
    if not _NVCC and nvcc_path() is not None:
        _NVCC.update(in_spawned_processes(_build_and_compile, MODULES, workers=len(MODULES) if alone else 1))


@needs_nvcc
@pytest.mark.background
def test_nvcc_compiles_every_variant():
    assert sorted(n for names in MODULES for n in names) == sorted(
        ["qkv", "o_proj", "gate_up", "down", "lm_head", "bf16", "g128", "static_m"])
    start_in_background(alone=True)  # where conftest did not start it
    for names, run in _NVCC.items():
        dequant, fatbin = run.result()
        assert dequant and fatbin > 0, names
