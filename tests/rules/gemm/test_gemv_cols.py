"""The column GEMV (``rules/gemm/gemv_cols.py``) for 4-bit words packed along N (MLC-LLM's
``q4f16_autoawq``) at M = 1: that the Gemv rule takes AWQ's decode functions (plain, residual,
paired gate+up) with the shipped buckets and declines what the template does not serve, the
kernels' structure, an emulation of the kernel's data flow on the CPU (which lane reads which words,
zero points and scales, the bit trick, the sums over K slots and splits) driven by the template's
own index functions against a float64 product and the unscheduled function run on the CPU (on odd
sizes), and nvcc compiling the kernels for sm_90 and sm_80."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import apply_rule, compile_cuda_concurrently
from tir_query import evaluate, kernels

tvm = pytest.importorskip("tvm")
from fuselight.errors import FuselightError
from fuselight.quant_prim_funcs import awq_linear, q4_linear
from fuselight.quantization import AWQ_PLACES, SCHEMES, dequantize
from fuselight.rules.gemm import gemv_cols
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.base import with_kernels
from fuselight.rules.gemm.gemv_cols import ColsConfig
from fuselight.rules.gemv import Gemv
from fuselight.target import resolve, to_tvm
from tvm import tirx

AWQ = SCHEMES["q4f16_autoawq"]


def _ops(func):
    return analyze_matmul(func, dequant=True).operands


# ---- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k,epilogue,lanes_n,warps", [(6144, 4096, "cast", 1, 8), (4096, 4096, "residual", 1, 8),
                                                        (4096, 14336, "residual", 1, 8), (28672, 4096, "silu_mul", 4, 8)],
                         ids=["qkv", "o_proj", "down", "gate_up"])
def test_rule_takes_llama_awq_decode(cuda, n, k, epilogue, lanes_n, warps):
    func = awq_linear(n, k, epilogue=epilogue)
    (main,) = kernels(apply_rule(Gemv(), func, cuda))
    # configs/gemm/gemv_cols.json, read by hand: one launch; N up to 8192 in tiles of 32 columns (one
    # lane's 16 bytes a row) of 8 warps, gate_up in tiles of 64 gate and 64 up columns of 8 warps.
    out_cols = n // 2 if epilogue == "silu_mul" else n
    tile = 32 * lanes_n
    assert main.launch["blockIdx.x"] == out_cols // (tile // 2 if epilogue == "silu_mul" else tile)
    assert main.launch.get("blockIdx.y", 1) == 1 and main.threads == 32 * warps
    # No dequantized weight: registers, and in shared memory the token row, then (the same bytes)
    # the K slots' sums of the tile.
    assert main.allocs["smem"] == ("shared", "float32", (max(k * 2, 32 // lanes_n * warps * tile * 4) // 4,))
    assert max(int(np.prod(shape)) for _, _, shape in main.allocs.values()) < n * k // 512
    assert main.vectorized[4] >= 2  # 16-byte loads of 4 words (weights and zero points)
    row_calls = main.call_args["tirx.cuda.func_call"]
    assert {a[0].value for a in row_calls} == {gemv_cols.ROW_FN["float16"]}
    views = {"xs", "red"}  # of the shared buffer
    assert main.outputs - views == {{"cast": "compute1", "residual": "add", "silu_mul": "silu_multiply"}[epilogue]}


def test_split_k_sums_the_splits_in_a_second_launch(cuda):
    # Not shipped (its partials are TVM workspace, see configs/gemm/gemv_cols.json), but built: each
    # split writes its sums, the second launch adds them and runs the epilogue.
    func = awq_linear(4096, 4096, epilogue="residual")
    cfg = ColsConfig(lanes_n=4, warps=4, run_rows=16, unroll=8, min_blocks_per_sm=2, split_k=8)
    main, reduce = kernels(with_kernels(func, gemv_cols.cols_body(_ops(func), cfg)))
    assert (main.launch["blockIdx.x"], main.launch["blockIdx.y"]) == (4096 // 128, 8)
    assert main.outputs - {"xs", "red"} == {"part"} and reduce.outputs == {"add"}


def _with_norm(n: int, k: int, epilogue: str = "cast"):
    """``awq_linear`` reading the RMSNorm of ``x + r`` (fuse_norm_gemv's function, x + r written out)."""
    from fuselight.computations import fused_norm_matmul
    from tvm import relax

    consumer = awq_linear(n, k, epilogue=epilogue)
    tys = [relax.TensorType([int(d) for d in p.ty.shape], str(p.ty.dtype)) for p in consumer.params[1:4]]
    x_ty = relax.TensorType([1, 1, k], "float16")
    return fused_norm_matmul(x_ty, True, relax.TensorType([k], "float16"), 1e-5, consumer, tys)


@pytest.mark.parametrize("epilogue", ["cast", "silu_mul"])
def test_rule_takes_the_norm_prologue(cuda, epilogue):
    # fuse_norm_gemv's QKV and gate+up: the block norms x + r into the token row (and writes x + r).
    func = _with_norm(6144 if epilogue == "cast" else 28672, 4096, epilogue)
    ops = analyze_matmul(func, prologue=True, dequant=True).operands
    assert ops.prologue is not None and ops.prologue.residual is not None
    main = kernels(apply_rule(Gemv(), func, cuda))[0]
    assert main.allocs["smem"][0] == "shared" and "Tg" in main.outputs  # x + r, in slices
    assert main.calls["tirx.rsqrt"] == 1


def test_rule_declines_what_the_template_does_not_serve(cuda):
    assert apply_rule(Gemv(), awq_linear(2144, 640), cuda) is not None  # the control
    assert apply_rule(Gemv(), awq_linear(2144, 640, m=2), cuda) is None  # M past 1: DLight
    assert apply_rule(Gemv(), awq_linear(296, 640), cuda) is None  # N not whole pieces of 32 columns (16-byte words)
    # q4f16_1 (NK) and q4f16_0 (KN): the templates of words along K, never this one.
    for layout in ("NK", "KN"):
        ops = _ops(q4_linear(4096, 4096, layout=layout))
        assert gemv_cols.cols_config(ops, "sm_90") is None
        with pytest.raises(FuselightError, match="KN_N"):
            gemv_cols.check_cols(ops, ColsConfig(4, 4, 32, 8, 2))
    # A symbolic batch of AWQ: no bucket (DLight schedules it).
    sym = _symbolic_batch(tirx.Var("batch_size", "int64"))
    assert analyze_matmul(sym, dequant=True).m_static is None
    assert apply_rule(Gemv(), sym, cuda) is None and not Gemv.takes(sym.with_attr("target", cuda), cuda)


def _symbolic_batch(batch):
    """An AWQ linear over ``batch`` token rows (MLC's batch decode)."""
    from tvm import te

    k, n = 512, 256
    i64 = "int64"
    q = te.placeholder((tirx.IntImm(i64, k), tirx.IntImm(i64, n // 8)), "uint32", name="qweight")
    zp = te.placeholder((tirx.IntImm(i64, k // 128), tirx.IntImm(i64, n // 8)), "uint32", name="qzeros")
    s = te.placeholder((tirx.IntImm(i64, k // 128), tirx.IntImm(i64, n)), "float16", name="scales")
    x = te.placeholder((batch, tirx.IntImm(i64, 1), tirx.IntImm(i64, k)), "float16", name="x")
    from fuselight.quant_prim_funcs import awq_shift, nibble

    w = te.compute((n, k), lambda nn, kk: (nibble(q[kk, nn // 8], awq_shift(nn)) - nibble(zp[kk // 128, nn // 8], awq_shift(nn)))
                   * s[kk // 128, nn], name="dequantize")
    r = te.reduce_axis((0, k), name="k")
    mm = te.compute((batch, 1, n), lambda b, t, nn: te.sum(tirx.Cast("float32", x[b, t, r]) * tirx.Cast("float32", w[nn, r]), axis=r))
    out = te.compute((batch, 1, n), lambda b, t, nn: tirx.Cast("float16", mm[b, t, nn]), name="compute1")
    return te.create_prim_func([q, zp, s, x, out])


def test_bad_configs_name_the_field():
    good = ColsConfig(lanes_n=4, warps=4, run_rows=32, unroll=8, min_blocks_per_sm=2)
    gemv_cols.check_cols_config(good)
    for field, value in (("lanes_n", 3), ("lanes_n", 64), ("warps", 6), ("unroll", 16), ("unroll", 3),
                         ("split_k", 0)):
        with pytest.raises(FuselightError, match=field):
            gemv_cols.check_cols_config(dataclasses.replace(good, **{field: value}))
    ops = _ops(awq_linear(256, 512))
    with pytest.raises(FuselightError, match="run_rows"):
        gemv_cols.check_cols(ops, dataclasses.replace(good, run_rows=96, unroll=8))
    with pytest.raises(FuselightError, match="shared memory"):
        gemv_cols.check_cols(ops, dataclasses.replace(good, lanes_n=32, warps=32), max_shared_bytes=48 * 1024)
    paired = _ops(awq_linear(512, 512, epilogue="silu_mul"))
    with pytest.raises(FuselightError, match="lanes_n of at least 2"):
        gemv_cols.check_cols(paired, dataclasses.replace(good, lanes_n=1))
    with pytest.raises(FuselightError, match="no paired epilogue"):
        gemv_cols.check_cols(paired, dataclasses.replace(good, split_k=2))


def test_shipped_buckets_by_n():
    configs = gemv_cols.load_cols_configs("sm_90")
    assert (gemv_cols.cols_config_for(configs, 4096).lanes_n, gemv_cols.cols_config_for(configs, 4096).warps) == (1, 8)
    assert gemv_cols.cols_config_for(configs, 28672).lanes_n == 4
    assert all(c.split_k == 1 for c in configs)  # no workspace in a shipped kernel
    # An unmeasured arch gets the analytic entry.
    assert gemv_cols.load_cols_configs("sm_80")
    with pytest.raises(FuselightError, match="sm_70"):
        gemv_cols.load_cols_configs("sm_70")


def _lets(func) -> dict:
    """The first kernel's let-bound values by name."""
    out = {}
    tirx.stmt_functor.post_order_visit(func.body, lambda n: out.setdefault(n.var.name, n.value)
                                       if isinstance(n, tirx.LetStmt) else None)
    return out


@pytest.mark.parametrize("n,k,epilogue", [(2144, 640, "cast"), (28672, 4096, "silu_mul")], ids=["small_n", "paired"])
def test_kernel_indexes_as_the_emulation(cuda, n, k, epilogue):
    # The kernel's TIR binds its piece, unit and rows by the functions the emulation below runs, and
    # reads words, zero points and scales there.
    func = awq_linear(n, k, epilogue=epilogue)
    ops = _ops(func)
    cfg = gemv_cols.cols_config(ops, "sm_90")
    scheduled = apply_rule(Gemv(), func, cuda)
    lets, main = _lets(scheduled), kernels(scheduled)[0]
    words, d = n // 8, ops.dequant
    for bx, by, tid, it in ((0, 0, 0, 0), (3, cfg.split_k - 1, 77, 0), (5, 0, 127, 1)):
        v = {"bx": bx, "by": by, "tid": tid, "it": it, "r": 1, "u": 2, "e": 3, "h": 1}
        for name in ("warp", "lane", "kq", "ln", "col", "unit", "g", "row0"):
            v[name] = evaluate(lets[name], v)
        assert v["col"] == gemv_cols.piece_col(bx, v["ln"], ops, cfg)
        assert v["unit"] == gemv_cols.unit_of(it, by, v["warp"], v["kq"], cfg)
        assert (v["g"], v["row0"]) == (v["unit"] * cfg.run_rows // d.group, v["unit"] * cfg.run_rows + cfg.unroll)
        assert [evaluate(i, v) for i in main.loads["Wq"]] == [(v["row0"] + 2) * words + v["col"] // 8 + 3]
        assert [evaluate(i, v) for i in main.loads["Z"]] == [v["g"] * words + v["col"] // 8 + 3]
        assert [evaluate(i, v) for i in main.loads["S"]] == [v["g"] * n + v["col"] + 8 + 3]
    if epilogue == "silu_mul":
        # One launch: output t of a block pairs tile indices t and t + 64 of every K slot.
        assert cfg.split_k == 1 and sorted(str(i) for i in main.loads["red"]) == [
            "s * 128 + t", "s * 128 + t + 64", "t", "t + 64"]


# ---- the kernel's data flow, emulated --------------------------------------------------------


def _bit_trick_pair(words: np.ndarray, j: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The two ``dtype`` values ``((w >> 4 j) & 0x000F000F) | magic`` holds, as float64."""
    import ml_dtypes

    magic = 0x64006400 if dtype == "float16" else 0x43004300
    b = ((words >> np.uint32(4 * j)) & np.uint32(0x000F000F)) | np.uint32(magic)
    lo, hi = (b & np.uint32(0xFFFF)).astype(np.uint16), (b >> np.uint32(16)).astype(np.uint16)
    np_t = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    return lo.view(np_t).astype(np.float64), hi.view(np_t).astype(np.float64)


def _emulate(ops, cfg: ColsConfig, q, z, s, x) -> np.ndarray:
    """The float32 sums (one per weight column) the kernel computes: every thread of the grid runs
    its units (``unit_of``) over its piece (``piece_col``), converting words by the bit trick and
    pairing places as ``pair_columns`` says, scaled per unit; the block's K slots and the splits are
    summed; each tile index lands on the column ``tile_col`` names (paired: gate t and up t + tile / 2
    of the same output, as the kernel pairs them). Vectorised over the grid's threads."""
    d = ops.dequant
    kl = 32 // cfg.lanes_n
    tile = gemv_cols.tile_cols(cfg)
    units = ops.k // cfg.run_rows
    iters = -(-units // (kl * cfg.warps * cfg.split_k))
    lo_cols, hi_cols = gemv_cols.pair_columns(d.places)
    blocks = gemv_cols.grid_blocks(ops, cfg)
    bx, by, warp, lane = (a.ravel() for a in np.meshgrid(np.arange(blocks), np.arange(cfg.split_k),
                                                         np.arange(cfg.warps), np.arange(32), indexing="ij"))
    kq, ln = lane // cfg.lanes_n, lane % cfg.lanes_n
    col = gemv_cols.piece_col(bx, ln, ops, cfg, np.minimum)
    acc = np.zeros((len(bx), 32), np.float32)
    bias = (1024.0 if ops.dtype == "float16" else 128.0) + d.zero
    for it in range(iters):
        unit = gemv_cols.unit_of(it, by, warp, kq, cfg)
        valid = unit < units
        unit = np.where(valid, unit, 0)
        g = unit * cfg.run_rows // d.group
        acc_u = np.zeros_like(acc)
        for r in range(cfg.run_rows):
            row = unit * cfg.run_rows + r
            xr = x[row].astype(np.float32)
            for i in range(4):
                words = q[row, col // 8 + i]
                for j in range(4):
                    w_lo, w_hi = _bit_trick_pair(words, j, ops.dtype)
                    z_lo, z_hi = (bias, bias) if d.zeros is None else _bit_trick_pair(z[g, col // 8 + i], j, ops.dtype)
                    acc_u[:, 8 * i + lo_cols[j]] += (w_lo - z_lo).astype(np.float32) * xr
                    acc_u[:, 8 * i + hi_cols[j]] += (w_hi - z_hi).astype(np.float32) * xr
        scales = s[g[:, None], col[:, None] + np.arange(32)].astype(np.float32)
        acc += np.where(valid[:, None], scales * acc_u, np.float32(0))
    red = np.zeros((blocks, tile), np.float32)
    np.add.at(red, (bx[:, None], ln[:, None] * 32 + np.arange(32)), acc)
    sums = np.zeros(ops.n, np.float32)
    covered = np.zeros(ops.n, np.int64)
    half = tile // 2
    for b in range(blocks):
        for t in range(tile):
            c = gemv_cols.tile_col(b, t, ops, cfg)
            if ops.paired and t < half:
                assert gemv_cols.tile_col(b, t + half, ops, cfg) == c + ops.out.pair_offset
            if (b * half + t % half < ops.out.pair_offset) if ops.paired else (c < ops.n):
                sums[c] += red[b, t]
                covered[c] += 1
    assert (covered == 1).all(), "every weight column summed by exactly one tile index"
    return sums


def _awq_arrays(rng, n: int, k: int, zero_range=(0, 16)):
    """Random stored AWQ parameters (every nibble 0..15, zero points over ``zero_range``) and a token row."""
    from fuselight.quantization import awq_stored

    groups = k // AWQ.group_size
    values = rng.integers(0, 16, size=(n, k), dtype=np.uint32)
    zeros = rng.integers(*zero_range, size=(n, groups), dtype=np.uint32)
    scales = rng.uniform(0.5, 1.5, size=(n, groups)).astype(np.float32) / 16
    q, z, s = awq_stored(values, zeros, scales)
    return q, z, s.astype(np.float16), rng.standard_normal(k).astype(np.float16)


CASES = {
    # 67 pieces of 32 columns (a prime), 5 groups: the shipped bucket (40 units of 16 rows, 128 K slots).
    "prime_pieces": (2144, 640, "cast", None),
    # Splits that do not divide the units (3 of 20), a wide tile (8 lanes of N): a ragged last block.
    "split3": (2144, 640, "cast", ColsConfig(lanes_n=8, warps=2, run_rows=32, unroll=4, min_blocks_per_sm=2, split_k=3)),
    # Paired gate+up: 37 pieces of outputs (a prime), gate and up pieces in one tile.
    "paired": (2 * 1184, 384, "silu_mul", ColsConfig(lanes_n=4, warps=4, run_rows=32, unroll=8, min_blocks_per_sm=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_kernel_matches_the_float64_product(name):
    n, k, epilogue, cfg = CASES[name]
    ops = _ops(awq_linear(n, k, epilogue=epilogue))
    cfg = cfg or gemv_cols.cols_config(ops, "sm_90")
    gemv_cols.check_cols(ops, cfg)
    q, z, s, x = _awq_arrays(np.random.default_rng(len(name)), n, k)
    got = _emulate(ops, cfg, q, z, s, x)
    want = dequantize((q, z, s), AWQ) @ x.astype(np.float64)
    assert np.abs(want).max() > 1  # not a test on zeros
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_emulated_kernel_matches_the_unscheduled_function():
    # The function itself (MLC's stages, run on the CPU) against the emulated kernel and its cast.
    n, k = 2144, 640
    func = awq_linear(n, k)
    ops = _ops(func)
    q, z, s, x = _awq_arrays(np.random.default_rng(3), n, k)
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.zeros((1, 1, n), np.float16))
    lib["main"](*(tvm.runtime.tensor(a) for a in (x.reshape(1, 1, k), q, z, s)), out)
    want = out.numpy().astype(np.float64).ravel()
    got = _emulate(ops, gemv_cols.cols_config(ops, "sm_90"), q, z, s, x).astype(np.float16).astype(np.float64)
    assert np.abs(want).max() > 1
    # Both round the same float32 sums to fp16 (the function's weight is rounded to fp16 first).
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-3


def test_constant_zero_point_and_bf16():
    # A KN_N weight with the constant zero point 8 (no zero buffer), and bf16 weights and tokens.
    n, k = 256, 256
    func = awq_linear(n, k, value=lambda w, z, sc: (w - tirx.const(8, "float16")) * sc)
    ops = _ops(func)
    assert ops.dequant.zeros is None and ops.dequant.zero == 8.0
    cfg = gemv_cols.cols_config(ops, "sm_90")
    q, z, s, x = _awq_arrays(np.random.default_rng(7), n, k, zero_range=(8, 9))  # zero points 8: the reference's
    got = _emulate(ops, cfg, q, z, s, x)
    want = dequantize((q, z, s), AWQ) @ x.astype(np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    bf = _ops(awq_linear(n, k, dtype="bfloat16"))
    got = _emulate(bf, cfg, q, z, s, x)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5  # the bf16 trick is exact as well


def test_pair_columns_follow_the_places():
    # AutoAWQ's order pairs adjacent columns; any permutation pairs the columns at places j, j + 4.
    assert gemv_cols.pair_columns(AWQ_PLACES) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert gemv_cols.pair_columns(tuple(range(8))) == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_units_cover_k_once_for_every_lane_of_n():
    # The K slots of a column tile (kq of every warp of every split) take each unit once.
    for cfg, units in ((ColsConfig(4, 4, 16, 8, 2, split_k=8), 896), (ColsConfig(8, 2, 32, 4, 2, split_k=3), 20)):
        kl = 32 // cfg.lanes_n
        iters = -(-units // (kl * cfg.warps * cfg.split_k))
        seen = sorted(u for it in range(iters) for by in range(cfg.split_k) for w in range(cfg.warps)
                      for kq in range(kl) if (u := gemv_cols.unit_of(it, by, w, kq, cfg)) < units)
        assert seen == list(range(units))


# ---- nvcc ------------------------------------------------------------------------------------


def test_nvcc_compiles_the_kernels():
    funcs = {
        "qkv": awq_linear(6144, 4096),
        "down": awq_linear(4096, 14336, epilogue="residual"),
        "gate_up": awq_linear(28672, 4096, epilogue="silu_mul"),
        "odd": awq_linear(2144, 640),
        "bf16": awq_linear(2144, 640, dtype="bfloat16"),
        "norm_gate_up": _with_norm(28672, 4096, "silu_mul"),
    }
    sources = {}
    split = awq_linear(4096, 4096, epilogue="residual")
    split_cfg = ColsConfig(lanes_n=4, warps=4, run_rows=16, unroll=8, min_blocks_per_sm=2, split_k=8)
    for arch, names in (("sm_90", list(funcs)), ("sm_80", ["gate_up"])):
        target = to_tvm(resolve("cuda", arch))
        mod = tvm.IRModule({name: apply_rule(Gemv(), funcs[name], target).with_attr("global_symbol", name) for name in names})
        if arch == "sm_90":  # split K: the second launch's residual epilogue
            mod["split"] = with_kernels(split, gemv_cols.cols_body(_ops(split), split_cfg)).with_attr("global_symbol", "split")
        sources[arch] = tvm.compile(mod, target=target).mod.imports[0].inspect_source("cuda")
    assert all(compile_cuda_concurrently([(source, arch) for arch, source in sources.items()]))
