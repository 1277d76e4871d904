"""PrefetchNextWeights: the one-row GEMV before a decode attention gets the weights read after the
attention as inputs it never reads (the Gemv rule's row template asks L2 for them), within the L2
budget, only on devices with bulk L2 prefetch; the computation is unchanged."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi
from conftest import apply_rule, needs_nvcc
from fuselight.baseline.fuse_transpose_matmul import nt_matmul
from fuselight.contracts import ATTENTION_BUILTIN, ATTENTION_FORWARD_FUNC, PREFETCH_NEXT_ATTR
from fuselight.passes import PrefetchNextWeights
from fuselight.passes.prefetch_next_weights import prefetch_budget
from fuselight.rules.gemm.gemv_rows import PREFETCH_L2
from fuselight.rules.gemv import Gemv
from fuselight.target import resolve, to_tvm
from tvm import relax, te, tirx

K, N_QKV, N_O = 1024, 1536, 1024  # a GQA layer's shapes, scaled down
FAKE_ATTENTION = "test.prefetch_next_weights.attention"


def _ph(shape, name, dtype="float16"):
    return te.placeholder([tirx.IntImm("int64", s) for s in shape], dtype, name)


def _gemv(name: str, n: int, k: int, m: int | None = 1) -> tirx.PrimFunc:
    """FuseTransposeMatmul's function: ``m`` token rows (None: a symbolic M) times an NK weight."""
    rows = tirx.Var("m", "int64") if m is None else tirx.IntImm("int64", m)
    a = te.placeholder([rows, tirx.IntImm("int64", 1), tirx.IntImm("int64", k)], "float16", "a")
    b = _ph((n, k), "b")
    return te.create_prim_func([a, b, nt_matmul(a, b, "float16")]).with_attr("global_symbol", name)


def _module(attention: str = ATTENTION_FORWARD_FUNC, m: int | None = 1, o_rows: int = N_O) -> tvm.IRModule:
    """``decode(x, params)``: QKV GEMV -> reshape -> attention (a packed call) -> o_proj GEMV -> up GEMV,
    the weights fields of a parameter tuple as in our LLaMA."""
    bb = relax.BlockBuilder()
    rows = 1 if m is None else m
    qkv_gv = bb.add_func(_gemv("qkv", N_QKV, K, m), "qkv")
    o_gv = bb.add_func(_gemv("o_proj", o_rows, N_QKV // 3 * 2, m), "o_proj")
    up_gv = bb.add_func(_gemv("up", K, o_rows, m), "up")
    x = relax.Var("x", relax.TensorType([rows, 1, K], "float16"))
    weights = [([N_QKV, K], "w_qkv"), ([o_rows, N_QKV // 3 * 2], "w_o"), ([K, o_rows], "w_up")]
    params = relax.Var("packed_params", relax.TupleType([relax.TensorType(s, "float16") for s, _ in weights]))
    with bb.function("decode", [x, params], attrs={"num_input": 1}):
        with bb.dataflow():
            w_qkv, w_o, w_up = (bb.emit(relax.TupleGetItem(params, i), name) for i, (_, name) in enumerate(weights))
            qkv = bb.emit(relax.call_tir(qkv_gv, [x, w_qkv], relax.TensorType([rows, 1, N_QKV], "float16")))
            heads = bb.emit(relax.op.reshape(qkv, [rows, 6, N_QKV // 6]))
            attn = bb.emit(relax.call_dps_packed(
                relax.ExternFunc(attention), [tirx.IntImm("int64", 0), tirx.IntImm("int64", 0), tirx.FloatImm("float64", 1.0), heads],
                [relax.TensorType([rows, 4, N_QKV // 6], "float16")]))
            flat = bb.emit(relax.op.reshape(attn, [rows, 1, N_QKV // 3 * 2]))
            o = bb.emit(relax.call_tir(o_gv, [flat, w_o], relax.TensorType([rows, 1, o_rows], "float16")))
            out = bb.emit_output(relax.call_tir(up_gv, [o, w_up], relax.TensorType([rows, 1, K], "float16")))
        bb.emit_func_output(out)
    return bb.get()


def _run_pass(mod: tvm.IRModule, arch: str = "sm_90") -> tvm.IRModule:
    with to_tvm(resolve("cuda", arch)):
        return PrefetchNextWeights()(mod)


def _qkv_call(mod: tvm.IRModule) -> relax.Call:
    calls = []
    relax.analysis.post_order_visit(mod["decode"].body, lambda e: calls.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.args[0] if e.args else None, tvm.ir.GlobalVar) else None)
    return next(c for c in calls if c.args[0].name_hint.startswith("qkv"))


def _budget() -> int:
    return prefetch_budget(to_tvm(resolve("cuda", "sm_90")))


@pytest.mark.parametrize("attention", [ATTENTION_FORWARD_FUNC, ATTENTION_BUILTIN])
def test_the_gemv_before_the_attention_gets_the_weights_after_it(attention):
    out = _run_pass(_module(attention))
    call = _qkv_call(out)
    names = [a.name for a in call.args[1].fields]
    assert names == ["x", "w_qkv", "w_o", "w_up"]  # o_proj's first, then the next call's
    func = out[call.args[0]]
    assert len(func.params) == 5  # x, w_qkv, the two prefetched weights, the output
    marked = [(int(i), int(n)) for i, n in func.attrs[PREFETCH_NEXT_ATTR]]
    assert [i for i, _ in marked] == [2, 3]
    assert [tuple(func.params[i].ty.shape) for i, _ in marked] == [(N_O, N_QKV // 3 * 2), (K, N_O)]
    assert all(n % 128 == 0 for _, n in marked)
    assert marked[0][1] == N_O * N_QKV // 3 * 2 * 2  # o_proj's weight whole
    assert sum(n for _, n in marked) <= _budget()
    assert "qkv" not in [gv.name_hint for gv in out.get_global_vars()]  # the function it replaced


def test_the_budget_cuts_the_weights_after_it():
    rows = _budget() // 2 // (N_QKV // 3 * 2) + 64  # o_proj's weight alone is more than the budget
    out = _run_pass(_module(o_rows=rows))
    func = out[_qkv_call(out).args[0]]
    marked = [(int(i), int(n)) for i, n in func.attrs[PREFETCH_NEXT_ATTR]]
    assert len(marked) == 1 and marked[0][1] == _budget()


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_no_change_without_bulk_l2_prefetch(arch):
    mod = _module()
    assert tvm_ffi.structural_equal(_run_pass(mod, arch), mod)


def test_no_change_on_the_cpu_or_without_a_target():
    mod = _module()
    assert tvm_ffi.structural_equal(PrefetchNextWeights()(mod), mod)
    with to_tvm(resolve("llvm")):
        assert tvm_ffi.structural_equal(PrefetchNextWeights()(mod), mod)


def test_no_change_where_the_producer_is_not_the_row_template():
    mod = _module(m=None)  # batch decode: a symbolic M (the mma template or DLight)
    assert tvm_ffi.structural_equal(_run_pass(mod), mod)


def test_no_change_without_an_attention():
    mod = _module(attention="vm.builtin.some_other_call")
    assert tvm_ffi.structural_equal(_run_pass(mod), mod)


@pytest.fixture
def fake_attention():
    """A CPU stand-in for the attention (destination-passing): out[r, h, d] = qkv[r, h, d] * 2."""

    def attention(_cache, _layer, _scale, qkv, out):
        out.copyfrom(np.ascontiguousarray(qkv.numpy()[:, :4, :] * 2))

    tvm_ffi.register_global_func(FAKE_ATTENTION, attention, override=True)
    return FAKE_ATTENTION


def _run(mod: tvm.IRModule, x: np.ndarray, weights: list[np.ndarray]) -> np.ndarray:
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["decode"](tvm.runtime.tensor(x), [tvm.runtime.tensor(w) for w in weights]).numpy()


def test_the_rewritten_module_computes_the_same(fake_attention, monkeypatch):
    import fuselight.passes.prefetch_next_weights as pnw

    monkeypatch.setattr(pnw, "_ATTENTION_FUNCS", (fake_attention,))
    mod = _module(fake_attention)
    out = _run_pass(mod)
    assert PREFETCH_NEXT_ATTR in out[_qkv_call(out).args[0]].attrs
    rng = np.random.default_rng(7)
    x = rng.uniform(-1, 1, (1, 1, K)).astype("float16")
    weights = [(rng.standard_normal(s) / np.sqrt(s[1])).astype("float16")
               for s in [(N_QKV, K), (N_O, N_QKV // 3 * 2), (K, N_O)]]
    want, got = _run(mod, x, weights), _run(out, x, weights)
    assert np.abs(want).max() > 0.1
    np.testing.assert_array_equal(got, want)


def _scheduled(arch: str, mod: tvm.IRModule | None = None) -> tuple[tirx.PrimFunc, str]:
    """The pass's QKV function of ``mod`` (``_module()``), and its CUDA as the Gemv rule schedules it
    for ``arch``."""
    out = _run_pass(_module() if mod is None else mod)
    func = out[_qkv_call(out).args[0]]
    target = to_tvm(resolve("cuda", arch))
    scheduled = apply_rule(Gemv(), func, target)
    lib = tvm.compile(tvm.IRModule({"qkv": scheduled.with_attr("global_symbol", "qkv")}), target=target)
    return func, lib.mod.imports[0].inspect_source("cuda")


@pytest.mark.parametrize("o_rows", [N_O, None])
def test_the_row_template_asks_l2_for_each_weight(o_rows):
    # None: o_proj's weight is over the budget, the only one asked for.
    rows = _budget() // 2 // (N_QKV // 3 * 2) + 64 if o_rows is None else o_rows
    func, source = _scheduled("sm_90", _module(o_rows=rows))
    marked = [(int(i), int(n)) for i, n in func.attrs[PREFETCH_NEXT_ATTR]]
    assert source.count(f"{PREFETCH_L2}((&(prefetch") == len(marked)
    for i, _ in enumerate(marked):
        assert f"prefetch{i}_ptr[" in source


def test_where_the_device_cannot_the_rule_ignores_them():
    # The attribute reached an sm_80 build (the pass would not put it there): the row template runs
    # without prefetches.
    _, source = _scheduled("sm_80")
    assert f"{PREFETCH_L2}(" not in source


@needs_nvcc
def test_the_prefetching_kernel_compiles_with_nvcc():
    from fuselight.cuda_compile import compile_cuda

    _, source = _scheduled("sm_90")
    assert compile_cuda(source, "sm_90")
