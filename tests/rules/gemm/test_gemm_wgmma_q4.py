"""The 4-bit GEMM with the weight as wgmma's register operand (``rules/gemm/wgmma_q4.py``): the q4
dispatch names its plans where the config does and falls back where it cannot serve (bf16, a
symbolic N); its checks name the problem; the in-register conversion's constants give MLC's
dequantize bit for bit; the A fragments the kernel builds are the PTX ISA's layout (read from the
kernel's TIR, checked against the fragment table); the kernel's structure (wgmma with A from
registers, two register sets, the tensor maps, the register split); the epilogue's transpose
through shared memory puts every accumulator at its own token and feature, for token tiles of 16,
48 (batch decode), 64 and 96; the shipped tiles' CUDA is the CUDA measured; nvcc compiles it for
sm_90a (token tiles of 256, 128, 64 and 16) without spills. Numerics on the GPU against float64: ``bench/probes/q4_gemm.py`` (``--plans q4rs-``)."""

from __future__ import annotations

import dataclasses
import hashlib
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
from fuselight.rules.gemm.wgmma_q4 import (CVT, WgmmaQ4Plan, WgmmaQ4Tile, check_tile, cvt_source, epi_tokens,
                                             smem_layout)
from tvm import tirx
from tvm.tirx import stmt_functor

TILE = WgmmaQ4Tile(block_t=256, warpgroups=2, stages=4, group_m=8, max_blocks=132)
SMALL = WgmmaQ4Tile(block_t=128, warpgroups=2, stages=6, group_m=8, max_blocks=132)
T64 = WgmmaQ4Tile(block_t=64, warpgroups=1, stages=8, group_m=8, max_blocks=264)  # q4rs-t64f64s8b2
T16 = WgmmaQ4Tile(block_t=16, warpgroups=1, stages=8, group_m=8, max_blocks=132)  # batch decode's token tile


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
    (dict(n=4096, k=4096), dataclasses.replace(TILE, block_t=8), "block_t 8 must be a multiple of 16"),
    (dict(n=4096, k=4096), dataclasses.replace(TILE, block_t=24), "block_t 24 must be a multiple of 16"),
    (dict(n=4096, k=4096), dataclasses.replace(TILE, block_t=272), "block_t 272 .* up to 256"),
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


@pytest.mark.parametrize("block_t,chunk", [(16, 16), (32, 32), (48, 48), (64, 64), (80, 16), (96, 48), (160, 32),
                                           (256, 64)])
def test_small_token_tiles_are_accepted_with_their_epilogue_chunk(block_t, chunk):
    """Batch decode's token tiles (16, 32, 48) and any multiple of 16 up to 256 serve the Llama shapes
    (the LM head's 128256 rows too); the epilogue stages ``chunk`` tokens at a time (64 where the
    tile is a multiple of 64, as shipped), and its shared buffer holds one chunk a warpgroup."""
    assert epi_tokens(block_t) == chunk
    for warpgroups in (1, 2):
        tile = WgmmaQ4Tile(block_t=block_t, warpgroups=warpgroups, stages=4, group_m=8, max_blocks=132)
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
            check_tile(tile, _ops(n=n, k=k))
        lay = smem_layout(tile, 32)
        assert lay.bar_base - lay.epi_base == warpgroups * 64 * chunk * 4
        # Every token slot starts on a 1024-byte swizzle atom (TMA's 128-byte swizzle, wgmma's descriptor).
        assert lay.x_slot % 1024 == 0 and lay.w_base % 1024 == 0
    # A 16-token tile leaves room for 12 stages with two warpgroups (2 KB of tokens, 4 KB of words a slot).
    check_tile(WgmmaQ4Tile(16, 2, 12, 8, 132), _ops(n=28672, k=4096))


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


# ---- the epilogue's transpose, read from the kernel's TIR ----------------------------------------


def _walk(func):
    """The kernel's stores by buffer name, its let-bound values by name and loop extents by loop name."""
    stores, lets, loops = {}, {}, {}

    def visit(node):
        if isinstance(node, tirx.BufferStore):
            stores.setdefault(node.buffer.name, []).append(node)
        elif isinstance(node, tirx.LetStmt):
            lets.setdefault(node.var.name, []).append(node.value)
        elif isinstance(node, tirx.For):
            loops.setdefault(node.loop_var.name, []).append(node.extent)

    stmt_functor.post_order_visit(func.body, visit)
    return stores, lets, loops


def _loads(expr, name):
    found = []
    stmt_functor.post_order_visit(expr, lambda n: found.append(n) if isinstance(n, tirx.BufferLoad)
                                  and n.buffer.name == name else None)
    return found


@pytest.mark.parametrize("block_t,warpgroups", [(16, 2), (48, 1), (64, 2), (96, 1)])
def test_epilogue_puts_every_accumulator_at_its_token_and_feature(block_t, warpgroups):
    """Each chunk: every consumer thread's accumulator writes into the shared chunk (their index
    expressions evaluated from the kernel's TIR), where accumulator ``i`` is, by the PTX ISA's wgmma
    D fragment, feature ``16 w + g + 8 (i % 4 / 2)`` of the warpgroup and token ``8 (i / 4) + 2 t + i % 2``;
    then every thread's reads and the output elements it stores them to: each chunk address is
    written once and read once, and what is read lands at the token and feature written there,
    every token of the tile once."""
    func = q4_linear(n=4096, k=4096, m=None, prefill=False)
    ops = analyze_matmul(func, dequant=True).operands
    tile = WgmmaQ4Tile(block_t, warpgroups, 4, 8, 132)
    stores, lets, loops = _walk(with_kernels(func, host_branch(ops.m > 0, _body(ops, tile))))
    (write,), (read,), (out,) = stores["epi"], stores["vals"], stores[func.params[-1].name]
    (row,), (tok,) = lets["row"], lets["tok"]
    (chunks,), (jjs,), (pieces,) = (int(x) for x in loops["cc"]), (int(x) for x in loops["jj"]), {int(x) for x in loops["r"]}
    (epi_load,) = _loads(read.value, "epi")
    (vals_load,) = _loads(out.value, "vals")
    assert chunks * jjs * 8 == block_t  # the chunks cover the tile's accumulators
    seen_tokens = []
    for cc in range(chunks):
        written = {}
        for tid in range(128 * warpgroups):
            wg, warp, g, t = tid // 128, tid % 128 // 32, tid % 32 // 4, tid % 4
            for jj in range(jjs):
                for h in range(2):
                    for e in range(2):
                        v = {"tid": tid, "wg": wg, "cc": cc, "jj": jj, "h": h, "e": e}
                        i = evaluate(write.value.indices[0], v)
                        addr = evaluate(write.indices[0], v)
                        assert addr not in written
                        written[addr] = (wg * 64 + 16 * warp + g + 8 * (i % 4 // 2), 8 * (i // 4) + 2 * t + i % 2)
        assert len(written) == warpgroups * 64 * block_t // chunks
        read_back = set()
        for tid in range(128 * warpgroups):
            for r in range(pieces):
                for e in range(8):
                    v = {"tid": tid, "wg": tid // 128, "cc": cc, "r": r, "e": e, "t0": 0, "f0": 0, "m": block_t}
                    v["row"], v["tok"] = evaluate(row, v), evaluate(tok, v)
                    addr = evaluate(epi_load.indices[0], v)
                    assert evaluate(vals_load.indices[0], v) == evaluate(read.indices[0], v)
                    token, feature = evaluate(out.indices[0], v), evaluate(out.indices[-1], v)  # out[M, 1, N]
                    assert written[addr] == (feature, token) and addr not in read_back
                    read_back.add(addr)
                    seen_tokens.append(token)
        assert read_back == set(written)
    assert sorted(set(seen_tokens)) == list(range(block_t))


# ---- the kernel's structure and nvcc ---------------------------------------------------------


def _source(funcs, target):
    mod = tvm.IRModule({name: f.with_attr("target", target).with_attr("global_symbol", name) for name, f in funcs.items()})
    return tvm.compile(mod, target=target).mod.imports[0].inspect_source("cuda")


@pytest.fixture(scope="module")
def source(cuda):
    funcs = {}
    for name, kwargs, tile in (("o_proj", dict(n=4096, k=4096, epilogue="residual"), TILE),
                               ("gate_up", dict(n=28672, k=4096), SMALL),
                               ("down", dict(n=4096, k=14336, epilogue="residual"), TILE),
                               ("qkv", dict(n=6144, k=4096), T64),
                               ("batch_down", dict(n=4096, k=14336, epilogue="residual", prefill=False), T16)):
        func = q4_linear(m=None, **{"prefill": True, **kwargs})
        ops = analyze_matmul(func, dequant=True).operands
        funcs[name] = with_kernels(func, host_branch(ops.m > 0, _body(ops, tile)))
    return _source(funcs, cuda)


def _kernel_body(src, name):
    start = src.index(f" {name}_kernel(", src.index(f" {name}_kernel(") + 1)
    nxt = src.find('extern "C" __global__', start)
    return src[start: nxt if nxt >= 0 else len(src)]


# sha256 of the kernels of shipped tiles (``q4rs-t256s4``, ``q4rs-t128f128s6``, ``q4rs-t64f64s8b2``) as
# measured (docs/experiments/q4-gemm.md, sessions 20-21) and unchanged since token tiles below 64
# were added. A change to the template that alters them must be measured again, then pinned here.
SHIPPED_KERNELS = {
    "o_proj": "7bf76cf5d3f3be65a51b4e462dd991a7a3bf5252769f1135c64e2e918e00fa74",
    "gate_up": "272f7866cf0bc54dcedd58fc4d6f4fd26127397392cec97ae82435a755954d56",
    "down": "9d0487193d94fc4cd9b7221e5be9d1f725ea1f54b2c80ca2952aaee5a472d8d9",
    "qkv": "f76ac21410a87905665bd54bde64f6fdd7216c2a5b6acf86cd0e1880c7c747e9",
}


def test_shipped_tiles_kernels_are_the_measured_ones(source):
    got = {name: hashlib.sha256(_kernel_body(source, name).encode()).hexdigest() for name in SHIPPED_KERNELS}
    assert got == SHIPPED_KERNELS


def test_kernel_structure(source):
    for name, bt in (("o_proj", 256), ("gate_up", 128), ("down", 256), ("qkv", 64), ("batch_down", 16)):
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
        if name in ("qkv", "batch_down"):  # one consumer warpgroup: no register split
            assert "setmaxnreg" not in body
            continue
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
    assert len(spills) == 5 and all(s == ("0", "0") for s in spills)
    # ptxas serializes wgmma where it cannot prove the register operands untouched while in flight.
    assert "Potential Performance Loss" not in proc.stderr
