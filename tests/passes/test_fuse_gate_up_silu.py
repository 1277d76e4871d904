"""FuseGateUpSiLU and the paired GEMM epilogue: the pass fuses exactly the gated MLP's
``silu(gate) * up`` into its gate+up matmul (same numbers on llvm, unscheduled) and on cuda only
where fuselight's GEMM rules schedule it; the analysis recognises the fused function as a paired
epilogue and rejects near-misses; the Gemv and Matmul rules build it for sm_90 and nvcc compiles it (numerics of the GPU kernels: the kernel suite, against float64)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import needs_nvcc

tvm = pytest.importorskip("tvm")
from fuselight.errors import FuselightError
from fuselight.passes import AccumulateMatmulFP32, FuseGateUpSiLU
from fuselight.computations import gate_up_silu_te
from fuselight.contracts import OP_PATTERN_ATTR, OPAQUE_OP_PATTERN, RULE_ATTR
from fuselight.passes.fuse_gate_up_silu import PRIMFUNC_NAME
from fuselight.rules.gemm import estimate
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemm.plan import GemmPlan, check_plan
from fuselight.rules.gemv import Gemv
from fuselight.rules.matmul import Matmul
from fuselight.model.weights import numpy_dtype
from fuselight.passes.weight_source import materialized_weights
from fuselight.quantization import SCHEMES, random_quantized, te_dequantize
from fuselight.target import resolve, to_tvm
from tir_query import constants, kernel, kernels
from tvm import relax, te, tirx
from tvm.script import tirx as T

K, HALF = 96, 40  # the MLP's hidden size and intermediate size (the weight has 2 * HALF rows)


def _mlp(rows, *, dtype="float16", swap=False, act="silu", sections=2, gate_index=0, axis=-1,
         extra_use=False, k=K, half=HALF, transposed=True) -> tvm.IRModule:
    """``main(x, w) = multiply(act(split(x @ w^T)[gate_index]), split(...)[1 - gate_index])``
    (``transposed=False``: ``x @ w``, ``w`` ``[K, 2I]``)."""
    x = relax.Var("x", relax.TensorType([1, rows, k], dtype))
    w = relax.Var("w", relax.TensorType([2 * half, k] if transposed else [k, 2 * half], dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w)) if transposed else w))
            halves = bb.emit(relax.op.split(y, sections, axis=axis))
            gate = bb.emit(relax.TupleGetItem(halves, gate_index))
            up = bb.emit(relax.TupleGetItem(halves, 1 - gate_index))
            a = bb.emit(getattr(relax.op.nn, act)(gate))
            out = relax.op.multiply(up, a) if swap else relax.op.multiply(a, up)
            out = bb.emit_output(relax.Tuple([out, y]) if extra_use else out)
        bb.emit_func_output(out)
    return bb.get()


def _fused_calls(mod: tvm.IRModule) -> int:
    return sum(gv.name_hint.startswith(PRIMFUNC_NAME) for gv in mod.functions)


def _run(mod: tvm.IRModule, *inputs: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "fp32-accumulate"])
@pytest.mark.parametrize("swap", [False, True], ids=["silu-first", "up-first"])
def test_pass_fuses_and_keeps_the_numbers(dtype: str, accumulate: bool, swap: bool) -> None:
    rows = 7
    mod = _mlp(tirx.Var("seq_len", "int64"), dtype=dtype, swap=swap)
    if accumulate:
        mod = AccumulateMatmulFP32()(mod)
    fused = FuseGateUpSiLU(schedule=False)(mod)
    assert _fused_calls(fused) == 1
    script = fused["main"].script()
    assert "R.nn.silu" not in script and "R.split" not in script
    rng = np.random.default_rng(rows + 10 * swap + 100 * accumulate)
    x = rng.standard_normal((1, rows, K)).astype(dtype)
    w = (rng.standard_normal((2 * HALF, K)) / np.sqrt(K)).astype(dtype)
    want, got = _run(mod, x, w), _run(fused, x, w)
    assert got.shape == (1, rows, HALF)
    tol = 2e-3 if dtype == "float16" else 1e-6
    np.testing.assert_allclose(got.astype("float64"), want.astype("float64"), rtol=tol, atol=tol)
    # Not a trivial output: silu(gate) * up of unit-scale values.
    assert np.abs(want).mean() > 0.05


def _q4_mlp(rows, scheme: str, k: int = K, half: int = HALF) -> tvm.IRModule:
    """``_mlp`` with its weight stored in ``scheme``: ``main(x, q, s)``, the weight a ``call_tir`` of
    the scheme's dequantize as our model and MLC-LLM emit it (NK: read through ``permute_dims``; KN,
    ``q4f16_0``: ``[K, 2I]``, read as it is)."""
    s = SCHEMES[scheme]
    (qs, ss) = s.packed_shapes(2 * half, k)
    x = relax.Var("x", relax.TensorType([1, rows, k], s.model_dtype))
    q = relax.Var("q", relax.TensorType(list(qs), "uint32"))
    scale = relax.Var("s", relax.TensorType(list(ss), s.model_dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, q, scale]):
        with bb.dataflow():
            w = bb.emit_te(lambda q, sc: te_dequantize((q, sc), s), q, scale, primfunc_name_hint="dequantize")
            y = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w)) if s.layout == "NK" else w))
            halves = bb.emit(relax.op.split(y, 2, axis=-1))
            gate, up = bb.emit(relax.TupleGetItem(halves, 0)), bb.emit(relax.TupleGetItem(halves, 1))
            out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.nn.silu(gate)), up))
        bb.emit_func_output(out)
    return bb.get()


def _q4_inputs(rng, rows: int, scheme: str, k: int = K, half: int = HALF) -> list[np.ndarray]:
    s = SCHEMES[scheme]
    q, scale = random_quantized(rng, 2 * half, k, 1 / np.sqrt(k), s)
    x = rng.standard_normal((1, rows, k)).astype(numpy_dtype(s.model_dtype))
    return [x, q, scale.astype(numpy_dtype(s.model_dtype))]


@pytest.mark.parametrize("scheme", ["q4f16_1", "q4bf16_1", "q4f16_0"])
@pytest.mark.parametrize("rows", [1, tirx.Var("seq_len", "int64")], ids=["decode", "prefill"])
def test_pass_carries_the_dequantize_and_keeps_the_numbers(scheme: str, rows) -> None:
    mod = AccumulateMatmulFP32()(_q4_mlp(rows, scheme))
    fused = FuseGateUpSiLU(schedule=False)(mod)
    assert _fused_calls(fused) == 1 and materialized_weights(fused) == [] and len(materialized_weights(mod)) == 1
    funcs = [f for gv, f in fused.functions_items() if gv.name_hint.startswith(PRIMFUNC_NAME)]
    # One function: the dequantize's stages, the matmul reading them, the paired epilogue.
    desc = analyze_matmul(funcs[0], dequant=True)
    assert desc.operands.dequant.dtype == SCHEMES[scheme].model_dtype and desc.operands.paired
    assert desc.epilogue_stages == ("silu_multiply",) and len(desc.operands.dequant.stages) == 1
    n = 5 if isinstance(rows, tirx.Var) else rows
    inputs = _q4_inputs(np.random.default_rng(n + len(scheme)), n, scheme)
    want, got = _run(mod, *inputs).astype("float64"), _run(fused, *inputs).astype("float64")
    assert got.shape == (1, n, HALF)
    # The same roundings (the dequantize's, the output's), the sum in float32 either way.
    tol = 1e-2 if scheme == "q4bf16_1" else 2e-3
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    assert np.abs(want).mean() > 0.05


@pytest.mark.parametrize("scheme, rows, fused", [
    ("q4f16_1", 1, True), ("q4f16_1", 8, True), ("q4f16_1", tirx.Var("seq_len", "int64"), False),
    ("q4f16_0", 1, True), ("q4f16_0", 8, False), ("q4f16_0", tirx.Var("seq_len", "int64"), False),
], ids=["m1", "m8", "prefill", "kn-m1", "kn-m8", "kn-prefill"])
def test_pass_fuses_a_quantized_gate_up_where_the_gemv_rule_takes_it(cuda, scheme, rows, fused: bool) -> None:
    # A static M runs the GEMV templates, which dequantize and pair; a symbolic one would run the
    # mma.sync plans (no paired epilogue) or DLight above the GEMV buckets: the graph stays. KN
    # (q4f16_0): the KN template at M = 1 only, DLight elsewhere.
    mod = AccumulateMatmulFP32()(_q4_mlp(rows, scheme, k=512, half=256))
    with cuda:
        out = FuseGateUpSiLU()(mod)
    assert _fused_calls(out) == int(fused)
    if not fused:
        tvm.ir.assert_structural_equal(out, mod)
        return
    func = next(f for gv, f in out.functions_items() if gv.name_hint.startswith(PRIMFUNC_NAME))
    assert func.attrs[RULE_ATTR] == "gemm" and Gemv.takes(func, cuda) and not Matmul.takes(func, cuda)
    assert materialized_weights(out) == []


@pytest.mark.parametrize(
    "changes",
    [
        {"act": "gelu"},  # another activation
        {"sections": 4},  # other split counts
        {"gate_index": 1},  # silu on the up half
        {"extra_use": True},  # the [.., 2I] product is used elsewhere
        {"axis": 1, "rows": 2 * HALF},  # split along the rows
        {"transposed": False},  # a loaded [K, 2I] weight: only a dequantized one is taken so
    ],
    ids=["gelu", "four-way", "silu-on-second", "product-used", "split-rows", "kn-float-weight"],
)
def test_pass_leaves_near_misses(changes: dict) -> None:
    changes = dict(changes)
    # (Four quarters: silu(q0) * q1 has matching shapes, but is not the gated MLP.)
    mod = _mlp(changes.pop("rows", 5), **changes)
    assert _fused_calls(FuseGateUpSiLU(schedule=False)(mod)) == 0


def test_pass_on_our_llama() -> None:
    from fuselight import config
    from fuselight.model.llama import export_module

    cfg = config.load("tiny-llama").with_dtype("float16")
    mod = AccumulateMatmulFP32()(export_module(cfg, to_tvm(resolve("llvm")))[0])
    fused = FuseGateUpSiLU(schedule=False)(mod)
    for name in ("prefill", "decode"):
        script = fused[name].script()
        assert "R.nn.silu" not in script
        assert script.count(PRIMFUNC_NAME) == cfg.num_hidden_layers
    funcs = [f for gv, f in fused.functions_items() if gv.name_hint.startswith(PRIMFUNC_NAME)]
    descs = [analyze_matmul(f) for f in funcs]
    assert sorted(d.m_static is None for d in descs) == [False, True]  # decode (M = 1) and prefill
    for d in descs:
        assert (d.operands.n, d.operands.out.pair_offset) == (2 * cfg.intermediate_size, cfg.intermediate_size)


def _fused_func(m, n: int = 2 * HALF, k: int = K) -> tirx.PrimFunc:
    """The pass's PrimFunc over int64 shapes, as Relax gives them."""
    one, m, n, k = (tirx.IntImm("int64", v) if isinstance(v, int) else v for v in (1, m, n, k))
    x = te.placeholder((one, m, k), "float16", "x")
    w = te.placeholder((n, k), "float16", "w")
    return te.create_prim_func([x, w, gate_up_silu_te(x, w, "float32", "float16")])


def test_analysis_paired_epilogue_value() -> None:
    desc = analyze_matmul(_fused_func(tirx.Var("m", "int64")))
    ops = desc.operands
    assert (ops.n, ops.k, ops.out_n, ops.out.pair_offset, ops.paired) == (2 * HALF, K, HALF, HALF, True)
    assert desc.epilogue_stages == ("silu_multiply",)
    # value(row, col, gate, up) = silu(fp16(gate)) * fp16(up), TOPI's silu as LegalizeOps writes it.
    g, u = tirx.Var("g", "float32"), tirx.Var("u", "float32")
    gate, up = tirx.Cast("float16", g), tirx.Cast("float16", u)
    value = ops.out.value(tirx.IntImm("int64", 0), tirx.IntImm("int64", 3), g, u)
    tvm.ir.assert_structural_equal(value, gate * tirx.sigmoid(gate) * up)
    index = ops.out.index(tirx.IntImm("int64", 2), tirx.IntImm("int64", 3))
    assert [int(tvm.arith.Analyzer().simplify(i)) for i in index] == [0, 2, 3]


# fmt: off
def _near_miss(offset: int, out_cols: int, reads_gate: bool = True) -> tirx.PrimFunc:
    n = 2 * HALF

    @T.prim_func(private=True, s_tir=True)
    def func(A: T.Buffer((T.int64(4), T.int64(K)), "float16"), W: T.Buffer((T.int64(n), T.int64(K)), "float16"),
             O: T.Buffer((T.int64(4), T.int64(out_cols)), "float16")):
        C = T.sblock_alloc_buffer((T.int64(4), T.int64(n)))
        for i, j, kk in T.grid(T.int64(4), T.int64(n), T.int64(K)):
            with T.sblock("NT_matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                with T.init():
                    C[vi, vj] = T.float32(0)
                C[vi, vj] = C[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast("float32", W[vj, vk])
        for i, j in T.grid(T.int64(4), T.int64(out_cols)):
            with T.sblock("silu_multiply"):
                vi, vj = T.axis.remap("SS", [i, j])
                O[vi, vj] = T.Cast("float16", T.sigmoid(C[vi, vj + T.int64(offset if not reads_gate else 0)])
                                   * C[vi, vj + T.int64(offset)])
    return func
# fmt: on


@pytest.mark.parametrize(
    "offset, out_cols, reads_gate",
    [(HALF - 8, HALF, True), (HALF, HALF - 8, True), (HALF, HALF, False), (HALF // 2, HALF // 2, True)],
    ids=["offset-not-half", "fewer-columns", "up-only", "quarters"],
)
def test_analysis_rejects_near_misses(offset: int, out_cols: int, reads_gate: bool) -> None:
    assert analyze_matmul(_near_miss(offset, out_cols, reads_gate)) is None


def test_analysis_accepts_the_handwritten_pair() -> None:
    desc = analyze_matmul(_near_miss(HALF, HALF))
    assert desc is not None and desc.operands.out.pair_offset == HALF and desc.m_static == 4


@pytest.fixture(scope="module")
def cuda():
    return to_tvm(resolve("cuda", "sm_90"))


def _cuda_source(func: tirx.PrimFunc, target) -> str:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    return lib.mod.imports[0].inspect_source("cuda")


def _nvcc(src: str, tmp_path) -> None:
    import subprocess

    path = tmp_path / "k.cu"
    path.write_text(src)
    subprocess.run(["nvcc", "-O3", "--fatbin", "-gencode=arch=compute_90a,code=sm_90a", str(path), "-o",
                    str(tmp_path / "k.fatbin")], check=True, capture_output=True)


@pytest.mark.parametrize("m", [1, 4])
def test_gemv_rule_builds_the_paired_kernel(cuda, m: int) -> None:
    func = _fused_func(m, n=512, k=256)
    # One launch writing the 256 outputs only; both accumulators of an output combined by one thread
    # (silu's sigmoid in the epilogue). With the shipped buckets one token row streams whole rows
    # (a gate and an up sum a lane), more run on the tensor cores (4 floats a lane per 8 tokens, each half).
    kern = kernel(Gemv().apply(func, cuda, False).mod["main"])
    assert kern.outputs == {"silu_multiply"} and kern.calls["tirx.sigmoid"] == 1
    assert ("tirx.ptx.mma_legacy" in kern.calls) == (m > 1)
    assert kern.allocs["acc"] == ("local", "float32", (4 if m > 1 else 2,))
    assert Matmul().apply(func, cuda, False) is None  # static M below min_static_m: the Gemv rule's


def _q4_fused_func(rows: int, scheme: str = "q4f16_1") -> tirx.PrimFunc:
    """What the pass makes of ``_q4_mlp(rows)`` on sm_90 (Llama-3-8B's gate+up: 28672 x 4096)."""
    mod = AccumulateMatmulFP32()(_q4_mlp(rows, scheme, k=4096, half=14336))
    with to_tvm(resolve("cuda", "sm_90")):
        fused = FuseGateUpSiLU()(mod)
    return next(f for gv, f in fused.functions_items() if gv.name_hint.startswith(PRIMFUNC_NAME))


@pytest.fixture(scope="module")
def gemv_kernels(cuda) -> dict[str, tirx.PrimFunc]:
    """The Gemv rule's kernels for the fp16 pair and the q4 pairs (Llama-3-8B's gate+up), built once."""
    funcs = {"fp16": _fused_func(1, n=512, k=256), "q4_m1": _q4_fused_func(1), "q4_m8": _q4_fused_func(8),
             "q4bf16_m1": _q4_fused_func(1, "q4bf16_1")}
    return {name: Gemv().apply(f, cuda, False).mod["main"].with_attr("global_symbol", name) for name, f in funcs.items()}


# (M = 1: sm_90's shipped half sums)
@pytest.mark.parametrize("name, convert, mma", [("q4_m1", "fuselight_q4_dot32_fp16_half_sums", False),
                                                ("q4_m8", "fuselight_q4_pair_fp16", True),
                                                ("q4bf16_m1", "fuselight_q4_dot32_bf16", False)])
def test_gemv_rule_builds_the_q4_paired_kernel(gemv_kernels, name: str, convert: str, mma: bool) -> None:
    # Packed words in, silu(gate) * up out, one launch: the in-register conversion (row template at
    # M = 1, mma fragments at 8) and the epilogue's sigmoid in the same kernel.
    func = gemv_kernels[name]
    kern = kernel(func)
    assert [str(p.ty.dtype) for p in func.params].count("uint32") == 1
    assert kern.outputs == {"silu_multiply_intermediate"} and kern.calls["tirx.sigmoid"] == 1
    assert [args[0].value for args in kern.call_args["tirx.cuda.func_call"]] == [convert]
    assert ("tirx.ptx.mma_legacy" in kern.calls) == mma


@needs_nvcc
def test_gemv_paired_kernel_compiles(cuda, gemv_kernels, tmp_path) -> None:
    _nvcc(tvm.compile(tvm.IRModule(gemv_kernels), target=cuda).mod.imports[0].inspect_source("cuda"), tmp_path)


def test_matmul_rule_builds_the_paired_wgmma_kernel(cuda) -> None:
    func = _fused_func(tirx.Var("seq_len", "int64"), n=1024, k=256)
    gemms = [k for k in kernels(Matmul().apply(func, cuda, False).mod["main"]) if "tirx.ptx.wgmma_mma_async_ss" in k.calls]
    assert gemms  # the GEMV's buckets below, a wgmma kernel for each range above
    for kern in gemms:
        assert kern.outputs - {"epi"} == {"silu_multiply"} and kern.calls["tirx.sigmoid"] == 1
        # Three boxes a slot: A's rows, B's gate rows at n0 / 2, and its up rows pair_offset (512) further.
        a_box, gate_box, up_box = (args[-1] for args in kern.call_args["tirx.ptx.cp_async_bulk_tensor_g2s_cta"])
        assert 512 not in constants(gate_box) and 512 in constants(up_box)


@needs_nvcc
def test_wgmma_paired_kernel_compiles(cuda, tmp_path) -> None:
    func = _fused_func(tirx.Var("seq_len", "int64"), n=1024, k=256)
    _nvcc(_cuda_source(Matmul().apply(func, cuda, False).mod["main"], cuda), tmp_path)


def test_mma_sync_rejects_paired_epilogues() -> None:
    ops = analyze_matmul(_fused_func(tirx.Var("m", "int64"), n=1024, k=256)).operands
    d = estimate.load_dispatch("sm_90")
    tile = next(iter(d.tiles.values()))
    with pytest.raises(FuselightError, match="paired"):
        check_plan(GemmPlan(main=tile), ops)
    assert all(isinstance(p, estimate.WgmmaPlan) for p in estimate.candidates(ops, d))


def test_dlight_cannot_schedule_the_fused_function(cuda) -> None:
    # Why the pass fuses only where our rules take the function: DLight's Matmul rule claims it, then
    # fails to inline an epilogue reading two columns.
    from tvm.s_tir import dlight as dl

    mod = tvm.IRModule({"main": _fused_func(4, n=512, k=256)})
    with cuda, pytest.raises(AssertionError):
        dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Fallback())(mod)


@pytest.mark.parametrize("rows", [tirx.Var("seq_len", "int64"), 1], ids=["prefill", "decode"])
def test_pass_leaves_what_it_fuses_to_the_rules_on_cuda(cuda, rows) -> None:
    mod = AccumulateMatmulFP32()(_mlp(rows, k=256, half=512))
    with cuda:
        fused = FuseGateUpSiLU()(mod)
    funcs = [f for gv, f in fused.functions_items() if gv.name_hint.startswith(PRIMFUNC_NAME)]
    assert len(funcs) == 1 and "R.nn.silu" not in fused["main"].script()
    # Unscheduled, tagged for the GEMM rules and opaque to FuseOps; the rule of its M schedules it.
    func = funcs[0]
    assert "tirx.is_scheduled" not in func.attrs and func.attrs[RULE_ATTR] == "gemm"
    assert int(func.attrs[OP_PATTERN_ATTR]) == OPAQUE_OP_PATTERN
    rule = Matmul if isinstance(rows, tirx.Var) else Gemv
    assert rule.takes(func, cuda) and rule().apply(func, cuda, False) is not None


def test_pass_leaves_what_no_rule_takes(cuda) -> None:
    # K = 96: the wgmma template needs K a multiple of 64 and mma.sync takes no paired epilogue.
    mod = AccumulateMatmulFP32()(_mlp(tirx.Var("seq_len", "int64")))
    with cuda:
        assert _fused_calls(FuseGateUpSiLU()(mod)) == 0
    with tvm.target.Target("llvm"):
        assert _fused_calls(FuseGateUpSiLU()(_mlp(5))) == 0
    assert _fused_calls(FuseGateUpSiLU()(_mlp(5))) == 0  # no target in scope
