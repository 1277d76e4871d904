"""The 4-bit GEMM with the weight as wgmma's register operand (``rules/gemm/wgmma_q4.py``): the q4
dispatch names its plans where the config does and falls back where it cannot serve (bf16, a
symbolic N); its checks name the problem; the in-register conversion's constants give MLC's
dequantize bit for bit; the A fragments the kernel builds are the PTX ISA's layout (read from the
kernel's TIR, checked against the fragment table); the kernel's structure (wgmma with A from
registers, two register sets, the tensor maps, the register split); nvcc compiles it for sm_90a
without spills. Numerics on the GPU against float64: ``bench/probes/q4_gemm.py`` (``--plans q4rs-``)."""

from __future__ import annotations

import dataclasses
import re
import subprocess

import numpy as np
import pytest
from conftest import require_nvcc
from tir_query import evaluate

tvm = pytest.importorskip("tvm")
from fuselight.cuda_compile import FAST_MATH_FLAG, TVM_FLAGS, gencode
from fuselight.errors import FuselightError
from fuselight.quant_prim_funcs import q4_linear
from fuselight.rules.base import host_branch, with_kernels
from fuselight.rules.gemm import dispatch, gemm_body
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemm.plan import GemmPlan
from fuselight.rules.gemm.wgmma import WgmmaPlan
from fuselight.rules.gemm.wgmma_q4 import CVT, WgmmaQ4Plan, WgmmaQ4Tile, check_tile, cvt_source, smem_layout
from tvm import tirx
from tvm.tirx import stmt_functor

TILE = WgmmaQ4Tile(block_t=256, warpgroups=2, stages=4, group_m=8, max_blocks=132)
SMALL = WgmmaQ4Tile(block_t=128, warpgroups=2, stages=6, group_m=8, max_blocks=132)


def _ops(**kwargs):
    return analyze_matmul(q4_linear(m=None, prefill=True, **kwargs), dequant=True).operands


def _body(ops, tile=TILE):
    return gemm_body(ops, WgmmaQ4Plan(tile))


# ---- dispatch and checks ---------------------------------------------------------------------


def test_dispatch_takes_the_plan_where_it_serves():
    # The generic ranges above M = 256 name it first (measured: docs/experiments/q4-gemm.md); the
    # mma.sync tiles keep the small-M ranges. (2048 x 8192: a shape without measured ranges.)
    ranges = dispatch.q4_plan_ranges(_ops(n=2048, k=8192, epilogue="residual"), "sm_90")
    rs = [(upper, p) for upper, p in ranges if isinstance(p, WgmmaQ4Plan)]
    # (the ranges up to 768 and 1536 name the same tile first: one range, one kernel)
    assert [upper for upper, _ in rs] == [1536, 2**31 - 1]
    assert [(p.tile.block_t, p.tile.stages) for _, p in rs] == [(256, 5), (256, 4)]
    assert all(isinstance(p, GemmPlan) for upper, p in ranges if upper <= 256)
    # Where the template cannot serve, the range's next plan: bf16, the LM head's symbolic N.
    bf16 = dispatch.q4_plan_ranges(_ops(n=4096, k=4096, dtype="bfloat16"), "sm_90")
    head = dispatch.q4_plan_ranges(_ops(n=None, k=4096, epilogue="cast_fp32"), "sm_90")
    assert isinstance(bf16[-1][1], WgmmaPlan)
    assert isinstance(head[-1][1], GemmPlan)


def _tiles(ranges):
    return [(upper, (p.tile.block_t, p.tile.block_f, p.tile.max_blocks) if isinstance(p, WgmmaQ4Plan)
             else type(p).__name__) for upper, p in ranges]


def test_measured_shapes_take_their_ranges_and_others_the_generic_ones():
    # Llama-3-8B's down (4096 x 14336) has measured ranges (configs/gemm/mma_sync_q4.json by_shape):
    # mma.sync with split K up to 64 tokens, then token tiles of 64, 128 (one or two warpgroups), 256.
    down = dispatch.q4_plan_ranges(_ops(n=4096, k=14336, epilogue="residual"), "sm_90")
    assert _tiles(down) == [(64, "GemmPlan"), (128, (64, 64, 264)), (256, (128, 64, 132)),
                            (512, (128, 128, 132)), (1536, (256, 128, 132)), (2**31 - 1, (256, 128, 132))]
    assert down[0][1].split_k == 4 and down[-2][1].tile.stages == 5 and down[-1][1].tile.stages == 4
    # The same shape where the template cannot serve (bf16) takes the generic ranges: their
    # boundaries (64, 256, 768; 1536 and above one wgmma plan), nothing of the measured table.
    bf16 = dispatch.q4_plan_ranges(_ops(n=4096, k=14336, epilogue="residual", dtype="bfloat16"), "sm_90")
    assert [u for u, _ in bf16] == [64, 256, 768, 2**31 - 1]
    assert not any(isinstance(p, WgmmaQ4Plan) for _, p in bf16)
    # A static M gets the measured range holding it.
    static = dispatch.q4_plan_ranges(analyze_matmul(q4_linear(4096, 14336, m=200, prefill=True, epilogue="residual"),
                                                    dequant=True).operands, "sm_90")
    assert _tiles(static) == [(256, (128, 64, 132))]


def test_malformed_measured_ranges_name_the_config(tmp_path, monkeypatch):
    import json

    from fuselight.paths import config_dir
    cfg = json.loads((config_dir() / "gemm" / "mma_sync_q4.json").read_text())
    cfg["sm_90"]["by_shape"]["4096x14336"] = [[64, "q4rs-t64f64s8b2"]]  # no [null, ...] last
    (tmp_path / "gemm").mkdir()
    (tmp_path / "gemm" / "mma_sync_q4.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(dispatch, "config_dir", lambda: tmp_path)
    with pytest.raises(FuselightError, match="mma_sync_q4.json.*ranges must end"):
        dispatch.q4_plan_ranges(_ops(n=4096, k=14336, epilogue="residual"), "sm_90")


@pytest.mark.parametrize("kwargs,tile,problem", [
    (dict(n=4096, k=4096, dtype="bfloat16"), TILE, "dtype bfloat16"),
    (dict(n=None, k=4096, epilogue="cast_fp32"), TILE, "static multiple"),
    (dict(n=4160, k=4096), TILE, "static multiple"),  # 65 x 64: no whole 128-row tiles
    (dict(n=4096, k=4096 + 32 * 4), TILE, "multiple of 8 groups"),  # 132 groups: no whole chunks of 8
    (dict(n=4096, k=4096), dataclasses.replace(TILE, block_t=96), "block_t 96"),
    (dict(n=4096, k=4096), dataclasses.replace(TILE, stages=6), "shared memory"),
    (dict(n=4096, k=4096), dataclasses.replace(TILE, warpgroups=3), "warpgroups 3"),
])
def test_checks_name_the_problem(kwargs, tile, problem):
    with pytest.raises(FuselightError, match=problem):
        check_tile(tile, _ops(**kwargs))


def test_checks_accept_the_llama_shapes_and_refuse_split_k():
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        for tile in (TILE, SMALL):
            check_tile(tile, _ops(n=n, k=k))
    with pytest.raises(FuselightError, match="split_k 2"):
        check_tile(TILE, _ops(n=4096, k=4096), split_k=2)
    # The scale ring outlives the stages reading it: 8 scales a row cover 4 slices of group 32.
    assert smem_layout(TILE, 32).ring == 2 and smem_layout(SMALL, 32).ring == 3


# ---- the conversion's arithmetic -------------------------------------------------------------


def _constants(src: str) -> tuple[int, int, int]:
    magic = int(re.search(r"\| (0x[0-9a-f]+)u;", src).group(1), 16)
    mul = int(re.search(r"mul = (0x[0-9a-f]+)u", src).group(1), 16)
    add = int(re.search(r"add = (0x[0-9a-f]+)u", src).group(1), 16)
    return magic, mul, add


@pytest.mark.parametrize("zero", [7, 0, 8])
def test_conversion_is_mlcs_dequantize_bit_for_bit(zero):
    """Every byte value and several scales through the source's constants (prmt, mask, hfma2, hmul2,
    each rounded once in fp16, as the device does) against ``(fp16(q) - fp16(zero)) * scale``."""
    magic, mul, add = _constants(cvt_source(zero))
    halves = lambda u: np.array([u], dtype=np.uint32).view(np.float16)  # noqa: E731 - [low, high]
    rng = np.random.default_rng(1)
    for scale in [np.float16(s) for s in rng.uniform(-0.06, 0.06, 6)] + [np.float16(1.0)]:
        for t in range(4):
            for byte in range(256):
                w = int(rng.integers(0, 2**32)) & ~(0xFF << (8 * t)) | byte << (8 * t)
                b = (((w >> (8 * t)) & 0xFF) * 0x00010001 & 0x00F0000F) | magic  # byte t at bytes 0, 2
                fma = (halves(b).astype(np.float64) * halves(mul) + halves(add)).astype(np.float16)
                got = (fma * scale).astype(np.float16)
                q = np.array([byte & 15, byte >> 4], dtype=np.float16)  # K 2t, 2t + 1
                want = ((q - np.float16(zero)).astype(np.float16) * scale).astype(np.float16)
                assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist()


# ---- the A fragment layout, read from the kernel's TIR -----------------------------------------


def _stores(func, name):
    found = []

    def visit(node):
        if isinstance(node, tirx.BufferStore) and node.buffer.name == name:
            found.append(node)

    stmt_functor.post_order_visit(func.body, visit)
    return found


def test_fragments_are_the_ptx_a_layout():
    """For each consumer thread, register set and k16 step: the packed word and the byte each A
    register is converted from, evaluated from the kernel's own index expressions, against the
    PTX ISA's m64k16 A fragment (warp w of the warpgroup: rows 16 w + g and + 8, K 2t, 2t + 1 and
    + 8; register r: row + 8 (r % 2), K + 8 (r / 2)); a word's byte t holds K 2t and 2t + 1."""
    ops = _ops(n=4096, k=4096)
    func = with_kernels(q4_linear(n=4096, k=4096, m=None, prefill=True), host_branch(ops.m > 0, _body(ops)))
    wstores = _stores(func, "words")  # one a register set (slice 2 kp + u), regs0's first
    assert len(wstores) == 2 and len(_stores(func, "regs0")) == 1 and len(_stores(func, "regs1")) == 1
    wstore, (reg,) = wstores[0], _stores(func, "regs0")
    call = reg.value
    assert call.args[0].value == CVT
    word_load, tid_arg = call.args[1], call.args[2]
    assert word_load.buffer.name == "words"
    words_slice = smem_layout(TILE, 32).w_slot // 4  # words of a slot
    checked = 0
    for tid in range(0, 256, 7):  # consumer threads of both warpgroups
        wg, warp, lane = tid // 128, tid % 128 // 32, tid % 32
        g, t = lane // 4, lane % 4
        assert evaluate(tid_arg, {"tid": tid}) % 4 == t
        for h in range(2):
            held = {}  # words[] index -> the packed word (its index in the slot) it holds
            for rr in range(2):
                for e in range(4):
                    v = {"tid": tid, "h": h, "rr": rr, "e": e, "slot": 0, "wg": wg}
                    held[evaluate(wstore.indices[0], v)] = evaluate(wstore.value.indices[0], v)
            for q in range(4):
                for rr in range(2):
                    v = {"tid": tid, "h": h, "q": q, "rr": rr, "wg": wg}
                    r_index = evaluate(reg.indices[0], v)
                    step, r = divmod(r_index, 4)
                    word = held[evaluate(word_load.indices[0], v)]
                    assert 0 <= word < words_slice
                    row, k0 = divmod(word, 8)  # the row's 8 words of 8 K values
                    assert row == wg * 64 + warp * 16 + g + 8 * (r % 2)
                    assert k0 * 8 + 2 * t == 16 * step + 2 * t + 8 * (r // 2)
                    checked += 1
    assert checked == 37 * 16


# ---- the kernel's structure and nvcc ---------------------------------------------------------


def _source(funcs, target):
    mod = tvm.IRModule({name: f.with_attr("target", target).with_attr("global_symbol", name) for name, f in funcs.items()})
    return tvm.compile(mod, target=target).mod.imports[0].inspect_source("cuda")


@pytest.fixture(scope="module")
def source(cuda):
    funcs = {}
    for name, kwargs, tile in (("o_proj", dict(n=4096, k=4096, epilogue="residual"), TILE),
                               ("gate_up", dict(n=28672, k=4096), SMALL),
                               ("down", dict(n=4096, k=14336, epilogue="residual"), TILE)):
        func = q4_linear(m=None, prefill=True, **kwargs)
        ops = analyze_matmul(func, dequant=True).operands
        funcs[name] = with_kernels(func, host_branch(ops.m > 0, _body(ops, tile)))
    return _source(funcs, cuda)


def _kernel_body(src, name):
    start = src.index(f" {name}_kernel(", src.index(f" {name}_kernel(") + 1)
    nxt = src.find('extern "C" __global__', start)
    return src[start: nxt if nxt >= 0 else len(src)]


def test_kernel_structure(source):
    for name, bt in (("o_proj", 256), ("gate_up", 128), ("down", 256)):
        body = _kernel_body(source, name)
        # wgmma with A from registers: 4 k16 steps a slice, one call site per register set.
        rs = re.findall(rf"ptx_wgmma_mma_async_rs_64x{bt}x16_float16_float32_1_1_0_0\(([^;]*)\);", body)
        assert len(rs) == 8 and "wgmma_mma_async_ss" not in body
        sets = [re.findall(r"regs(\d)_ptr\[(\d+)\]", call) for call in rs]
        assert [s[0][0] for s in sets] == ["0"] * 4 + ["1"] * 4
        assert [[int(i) for _, i in s] for s in sets[:4]] == [[4 * kk + r for r in range(4)] for kk in range(4)]
        # TMA of the tokens, the packed words and the scales; only the output is written to global memory.
        assert sorted(re.findall(r"CUtensorMap (\w+)", body)) == ["s_map", "w_map", "x_map"]
        assert not re.search(r"q_weight_ptr\[[^\]]*\] =|q_scale_ptr\[[^\]]*\] =", body)
        # The register split gives back exactly what it takes (setmaxnreg.inc waits for it otherwise).
        (dec,) = map(int, re.findall(r"tvm_builtin_ptx_setmaxnreg_dec_(\d+)\(\)", body))
        (inc,) = map(int, re.findall(r"tvm_builtin_ptx_setmaxnreg_inc_(\d+)\(\)", body))
        assert dec + 2 * inc == 3 * (65536 // 384 // 8 * 8)


def test_nvcc_compiles_without_spills(source, tmp_path):
    nvcc = require_nvcc()
    cu = tmp_path / "k.cu"
    cu.write_text(source)
    proc = subprocess.run([nvcc, "-O3", "-cubin", f"-gencode={gencode('sm_90')}", FAST_MATH_FLAG, *TVM_FLAGS,
                           "-Xptxas", "-v", str(cu), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
    assert len(spills) == 3 and all(s == ("0", "0") for s in spills)
    # ptxas serializes wgmma where it cannot prove the register operands untouched while in flight.
    assert "Potential Performance Loss" not in proc.stderr
