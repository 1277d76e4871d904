"""A dequantized weight stays with its matmul: ``weight_source``'s analysis, the fusions that carry
a dequantize into their kernel (FuseGateUpSiLU, FuseNormIntoGemv) and leave one they cannot carry
(read by two matmuls, or of another arithmetic) where it is. Graphs as MLC-LLM's q4f16_1 writes them: ``call_tir(dequantize, (q, s))``
(int4 packed eight to a uint32, a float16 scale per 32 along K), ``permute_dims``, ``matmul``."""

from __future__ import annotations

import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi
from fuselight.baseline.fuse_transpose_matmul import nt_matmul
from fuselight.passes import FuseGateUpSiLU, FuseNormIntoGemv
from fuselight.passes.fuse_gate_up_silu import PRIMFUNC_NAME as GATE_UP
from fuselight.passes.fuse_norm_gemv import PRIMFUNC_NAME as NORM_GEMV
from fuselight.contracts import RULE_ATTR
from fuselight.passes.weight_source import loaded_weight, materialized_weights
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.target import resolve, to_tvm
from q4_dequantize import GROUP
from q4_dequantize import dequantize as _dequantize
from tvm import relax, te, tirx

K, HALF = 128, 64


def _weight(bb: relax.BlockBuilder, quantized: bool, params: list, rows: int, name: str, cols: int = K) -> relax.Expr:
    """A ``[rows, cols]`` float16 weight: a parameter, or the dequantize of two parameters."""
    if not quantized:
        w = relax.Var(name, relax.TensorType([rows, cols], "float16"))
        params.append(w)
        return w
    q = relax.Var(f"{name}_q", relax.TensorType([rows, cols // 8], "uint32"))
    s = relax.Var(f"{name}_s", relax.TensorType([rows, cols // GROUP], "float16"))
    params += [q, s]
    return bb.emit_te(_dequantize, q, s, primfunc_name_hint="dequantize")


def _mlp(quantized: bool) -> tvm.IRModule:
    """``silu(gate) * up`` of a gate+up projection (x: [1, 1, K]), then the down projection."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 1, K], "float16"))
    params: list = [x]
    with bb.function("main"):
        with bb.dataflow():
            w = _weight(bb, quantized, params, 2 * HALF, "gate_up")
            y = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w))))
            halves = bb.emit(relax.op.split(y, 2, axis=-1))
            gate, up = bb.emit(relax.TupleGetItem(halves, 0)), bb.emit(relax.TupleGetItem(halves, 1))
            h = bb.emit(relax.op.multiply(bb.emit(relax.op.nn.silu(gate)), up))
            out = bb.emit_output(relax.op.matmul(h, bb.emit(relax.op.permute_dims(_weight(bb, quantized, params, K, "down", HALF)))))
        bb.emit_func_output(out, params)
    return bb.get()


def _norm_matmul(quantized: bool) -> tvm.IRModule:
    """``NT_matmul(rms_norm(x, g), W)`` as FuseTransposeMatmul leaves a decode projection."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 1, K], "float16"))
    g = relax.Var("g", relax.TensorType([K], "float16"))
    params: list = [x, g]
    with bb.function("main"):
        with bb.dataflow():
            w = _weight(bb, quantized, params, HALF, "w")
            normed = bb.emit(relax.op.nn.rms_norm(x, g, axes=[-1]))
            out = bb.emit_output(bb.emit_te(lambda a, b: nt_matmul(a, b, "float32"), normed, w, primfunc_name_hint="NT_matmul"))
        bb.emit_func_output(out, params)
    return bb.get()


def _callees(mod: tvm.IRModule) -> list[str]:
    return [gv.name_hint for gv in mod.functions]


def test_loaded_weight_follows_parameters_and_tuple_fields_not_computations():
    bb = relax.BlockBuilder()
    packed = relax.Var("packed", relax.TupleType([relax.TensorType([8, K], "float16")]))
    q = relax.Var("q", relax.TensorType([8, K // 8], "uint32"))
    s = relax.Var("s", relax.TensorType([8, K // GROUP], "float16"))
    with bb.function("main", [packed, q, s]):
        with bb.dataflow():
            field = bb.emit(relax.TupleGetItem(packed, 0))
            alias = bb.emit(field)
            computed = bb.emit_te(_dequantize, q, s)
            out = bb.emit_output(relax.op.add(alias, computed))
        bb.emit_func_output(out)
    var2val = relax.analysis.get_var2val(bb.get()["main"])
    assert loaded_weight(packed, var2val) and loaded_weight(field, var2val) and loaded_weight(alias, var2val)
    assert not loaded_weight(computed, var2val)


def test_materialized_weights_finds_a_lone_dequantize_and_nothing_else():
    mod = _mlp(quantized=True)
    found = materialized_weights(mod)
    assert sorted(m.callee for m in found) == ["dequantize", "dequantize1"]
    assert {m.function for m in found} == {"main"}
    # fp16: nothing is dequantized; the matmuls' outputs are not 2, 4 or 8 elements per input word.
    assert materialized_weights(_mlp(quantized=False)) == []
    assert materialized_weights(relax.transform.LegalizeOps()(_mlp(quantized=False))) == []


def test_materialized_weights_ignores_a_dequantize_fused_with_its_matmul_and_a_gather():
    seq = tirx.Var("seq", "int64")
    vocab = tirx.Var("vocab", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 1, K], "float16"))
    q = relax.Var("q", relax.TensorType([HALF, K // 8], "uint32"))
    s = relax.Var("s", relax.TensorType([HALF, K // GROUP], "float16"))
    eq = relax.Var("eq", relax.TensorType([vocab, K // 8], "uint32"))
    es = relax.Var("es", relax.TensorType([vocab, K // GROUP], "float16"))
    ids = relax.Var("ids", relax.TensorType([seq], "int32"))

    def dq_matmul(x, q, s):
        w = _dequantize(q, s)
        r = te.reduce_axis((0, K), "k")
        return te.compute((1, 1, HALF), lambda i, j, n: te.sum(x[i, j, r].astype("float32") * w[n, r].astype("float32"), axis=r))

    def take(eq, es, ids):
        w = _dequantize(eq, es)
        return te.compute((seq, K), lambda i, k: w[ids[i], k])

    with bb.function("main", [x, q, s, eq, es, ids]):
        with bb.dataflow():
            a = bb.emit_te(dq_matmul, x, q, s)
            b = bb.emit_te(take, eq, es, ids)
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    assert materialized_weights(bb.get()) == []
    # The symbolic vocabulary is compared symbolically: a lone dequantize of it is found.
    bb = relax.BlockBuilder()
    with bb.function("main", [eq, es]):
        with bb.dataflow():
            lone = bb.emit_te(_dequantize, eq, es)
            out = bb.emit_output(lone)
        bb.emit_func_output(out)
    assert [m.binding for m in materialized_weights(bb.get())] == [lone.name]


def test_materialized_weights_ignores_an_awq_gemv_whose_output_matches_its_zero_points():
    """AWQ's GEMV reads the packed weight, a packed zero point per group and the scales: its output
    (N values) is twice the zero points' words (K / 128 x N / 8 at K = 512), yet no dequantize."""
    n, k = 256, 512
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 1, k], "float16"))
    q = relax.Var("q", relax.TensorType([k, n // 8], "uint32"))
    z = relax.Var("z", relax.TensorType([k // 128, n // 8], "uint32"))
    s = relax.Var("s", relax.TensorType([k // 128, n], "float16"))

    def weight(q, z, s):
        def nib(word, i):
            return ((word >> (i % 8 * 4).astype("uint32")) & tirx.const(15, "uint32")).astype("float16")
        return te.compute((n, k), lambda i, j: (nib(q[j, i // 8], i) - nib(z[j // 128, i // 8], i)) * s[j // 128, i])

    def gemv(x, q, z, s):
        w = weight(q, z, s)
        r = te.reduce_axis((0, k), "k")
        return te.compute((1, 1, n), lambda a, b, i: te.sum(x[a, b, r].astype("float32") * w[i, r].astype("float32"), axis=r))

    with bb.function("main", [x, q, z, s]):
        with bb.dataflow():
            fused = bb.emit_te(gemv, x, q, z, s)
            lone = bb.emit_te(weight, q, z, s)
            out = bb.emit_output(relax.Tuple([fused, lone]))
        bb.emit_func_output(out)
    assert n == 2 * (k // 128) * (n // 8)  # the coincidence the check must see through
    assert [m.binding for m in materialized_weights(bb.get())] == [lone.name]


def _packed_params(func: tirx.PrimFunc) -> list[str]:
    return [str(p.ty.dtype) for p in func.params if str(p.ty.dtype) == "uint32"]


@pytest.mark.parametrize("schedule", [False, True], ids=["unscheduled", "sm_90"])
@pytest.mark.parametrize("fusion, graph, fused_name", [
    (FuseGateUpSiLU, _mlp, GATE_UP), (FuseNormIntoGemv, _norm_matmul, NORM_GEMV),
], ids=["gate_up_silu", "norm_gemv"])
def test_fusions_carry_the_dequantize_into_the_fused_kernel(fusion, graph, fused_name, schedule):
    target = to_tvm(resolve("cuda", "sm_90"))
    quantized = graph(quantized=True)
    with target:
        after = fusion(schedule=schedule)(quantized)
    fused = [f for gv, f in after.functions_items() if gv.name_hint.startswith(fused_name)]
    assert len(fused) == 1
    # The fused kernel reads the packed words and scales, and dequantizes them itself.
    assert _packed_params(fused[0]) == ["uint32"]
    desc = analyze_matmul(fused[0], prologue=True, dequant=True)
    assert desc.operands.dequant.layout == "NK" and desc.operands.dequant.group == GROUP
    # The weight it dequantized no longer is a kernel of its own; the other one (down) still is.
    before_callees = [m.binding for m in materialized_weights(quantized)]
    assert len(materialized_weights(after)) == len(before_callees) - 1
    if schedule:
        assert fused[0].attrs[RULE_ATTR] == ("gemm" if fusion is FuseGateUpSiLU else "gemv")


def _shared_weight(bb: relax.BlockBuilder, x: relax.Var, g: relax.Var, q: relax.Var, s: relax.Var) -> relax.Expr:
    """One dequantized weight read by the norm's GEMV and by another matmul."""
    w = bb.emit_te(_dequantize, q, s, primfunc_name_hint="dequantize")
    normed = bb.emit(relax.op.nn.rms_norm(x, g, axes=[-1]))
    a = bb.emit_te(lambda a, b: nt_matmul(a, b, "float32"), normed, w, primfunc_name_hint="NT_matmul")
    b = bb.emit_te(lambda a, b: nt_matmul(a, b, "float32"), x, w, primfunc_name_hint="NT_matmul")
    return relax.Tuple([a, b])


def _awq_like(q: te.Tensor, s: te.Tensor, z: te.Tensor) -> te.Tensor:
    """A dequantize with a zero-point tensor: not the templates' arithmetic."""
    n, words = q.shape

    def value(i, k):
        nibble = (q[i, k // 8] >> (k % 8 * 4).astype("uint32")) & tirx.const(15, "uint32")
        return (nibble.astype("float16") - z[i, k // GROUP]) * s[i, k // GROUP]

    return te.compute((n, words * 8), value, name="dequantize")


def _unknown_dequantize(bb: relax.BlockBuilder, x: relax.Var, g: relax.Var, q: relax.Var, s: relax.Var) -> relax.Expr:
    w = bb.emit_te(_awq_like, q, s, s, primfunc_name_hint="dequantize")
    normed = bb.emit(relax.op.nn.rms_norm(x, g, axes=[-1]))
    return bb.emit_te(lambda a, b: nt_matmul(a, b, "float32"), normed, w, primfunc_name_hint="NT_matmul")


@pytest.mark.parametrize("make", [_shared_weight, _unknown_dequantize], ids=["two-users", "zero-point-tensor"])
def test_norm_fusion_leaves_a_dequantize_it_cannot_carry(make):
    bb = relax.BlockBuilder()
    params = [relax.Var("x", relax.TensorType([1, 1, K], "float16")), relax.Var("g", relax.TensorType([K], "float16")),
              relax.Var("q", relax.TensorType([HALF, K // 8], "uint32")),
              relax.Var("s", relax.TensorType([HALF, K // GROUP], "float16"))]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(make(bb, *params))
        bb.emit_func_output(out)
    mod = bb.get()
    with to_tvm(resolve("cuda", "sm_90")):
        assert tvm_ffi.structural_equal(FuseNormIntoGemv()(mod), mod)
    assert tvm_ffi.structural_equal(FuseNormIntoGemv(schedule=False)(mod), mod)
