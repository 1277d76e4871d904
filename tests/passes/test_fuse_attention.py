"""FuseAttention (plain-op attention -> one attention PrimFunc) and the FlashAttention rule."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from conftest import needs_nvcc

tvm = pytest.importorskip("tvm")
from fuselight import rules
from fuselight.bench import kernels_build
from fuselight.bench.kernels import load_suite
from fuselight.passes import DEFAULT, FuseAttention
from fuselight.computations import AttentionSpec, attention_prim_func
from fuselight.contracts import ATTENTION_ATTR
from fuselight.rules.flash_attention import FlashAttention
from fuselight.target import resolve, to_tvm
from relax_module import single_function as _module
from tir_query import kernel, kernels
from tvm import relax, te, tirx

op = relax.op
TOLERANCE = {"float32": 1e-5, "float16": 1e-2}


# ---------------------------------------------------------------- graphs


def _tensor(name: str, shape, dtype: str = "float32") -> relax.Var:
    return relax.Var(name, relax.TensorType(shape, dtype))


def _suite_module(op_name: str) -> tvm.IRModule:
    """The kernel suite's own attention graph (GQA 32/8, head dim 128, float16, fp32 softmax)."""
    (case,) = [c for c in load_suite("full") if c.op == op_name]
    return kernels_build.relax_module(case)


def _bert(mask_shape: str, dtype: str = "float32", heads: int = 4, dim: int = 16):
    """BERT self-attention after the projections: [B, S, H*D] -> BHSD, ``/ sqrt(D)``, additive
    mask ``[B, 1, 1, S]`` ("row"), ``[B, 1, S, S]`` ("full") or ``[1, 1, S, S]`` ("shared" by the
    batch), back to [B, S, H*D]."""
    b, s = tirx.Var("batch", "int64"), tirx.Var("seq", "int64")
    x = [_tensor(n, [b, s, heads * dim], dtype) for n in "qkv"]
    mask = _tensor("mask", _MASK_SHAPES[mask_shape](b, s), dtype)

    def body(bb, q, k, v, m):
        def heads_first(t):
            return bb.emit(op.permute_dims(bb.emit(op.reshape(t, [b, s, heads, dim])), [0, 2, 1, 3]))

        qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)
        scores = bb.emit(op.matmul(qh, bb.emit(op.permute_dims(kh, [0, 1, 3, 2]))))
        scores = bb.emit(op.add(op.divide(scores, relax.const(math.sqrt(dim), dtype)), m))
        probs = bb.emit(op.nn.softmax(scores, axis=-1))
        ctx = bb.emit(op.permute_dims(bb.emit(op.matmul(probs, vh)), [0, 2, 1, 3]))
        return op.reshape(ctx, [b, s, heads * dim])

    return _module([*x, mask], body), lambda rng, bv, sv: [
        *(_rand(rng, (bv, sv, heads * dim), dtype) for _ in range(3)),
        _padding_mask(rng, bv, sv, mask_shape, dtype),
    ]


def _vit(dtype: str = "float32", batch: int = 2, heads: int = 3, seq: int = 7, dim: int = 8, scale_on: str = "scores"):
    """ViT attention on BHSD inputs, no mask; the scale on the scores, on Q, or on K."""
    shape = [batch, heads, seq, dim]
    c = relax.const(dim**-0.5, dtype)

    def body(bb, q, k, v):
        if scale_on == "q":
            q = bb.emit(op.multiply(q, c))
        kt = bb.emit(op.permute_dims(k, [0, 1, 3, 2]))
        if scale_on == "k":
            kt = bb.emit(op.multiply(c, kt))
        scores = bb.emit(op.matmul(q, kt))
        if scale_on == "scores":
            scores = bb.emit(op.multiply(scores, c))
        return op.matmul(bb.emit(op.nn.softmax(scores, axis=-1)), v)

    return _module([_tensor(n, shape, dtype) for n in "qkv"], body)


def _gqa_bhsd(q_len, kv_len, *, causal_where: bool = False, heads: int = 6, kv_heads: int = 2, dim: int = 8,
              dtype: str = "float32") -> tvm.IRModule:
    """Hugging Face's repeat_kv (expand_dims, broadcast_to, reshape) on BHSD inputs; optionally
    the causal mask as ``where(tril(ones), scores, -1e9)``."""
    b = tirx.Var("batch", "int64")
    group = heads // kv_heads
    q = _tensor("q", [b, heads, q_len, dim], dtype)
    k = _tensor("k", [b, kv_heads, kv_len, dim], dtype)
    v = _tensor("v", [b, kv_heads, kv_len, dim], dtype)

    def repeat_kv(bb, t):
        t = bb.emit(op.expand_dims(t, 2))
        t = bb.emit(op.broadcast_to(t, [b, kv_heads, group, kv_len, dim]))
        return bb.emit(op.reshape(t, [b, heads, kv_len, dim]))

    def body(bb, q, k, v):
        kt = bb.emit(op.permute_dims(repeat_kv(bb, k), [0, 1, 3, 2]))
        scores = bb.emit(op.divide(op.matmul(q, kt), relax.const(math.sqrt(dim), dtype)))
        if causal_where:
            keep = bb.emit(op.tril(op.ones((q_len, kv_len), "bool"), 0))
            scores = bb.emit(op.where(keep, scores, relax.const(-1e9, dtype)))
        return op.matmul(bb.emit(op.nn.softmax(scores, axis=-1)), repeat_kv(bb, v))

    return _module([q, k, v], body)


def _hf_llama(heads: int = 4, kv_heads: int = 2, dim: int = 16, dtype: str = "float16") -> tvm.IRModule:
    """Hugging Face's eager LLaMA attention after the projections: heads split off [B, S, H*D] and
    moved first, repeat_kv, ``* D^-0.5``, the causal mask as ``triu(full(lowest), 1)`` added, softmax
    in float32, heads moved back and joined."""
    b, s = tirx.Var("batch", "int64"), tirx.Var("seq", "int64")
    group = heads // kv_heads
    params = [_tensor("q", [b, s, heads * dim], dtype), *(_tensor(n, [b, s, kv_heads * dim], dtype) for n in "kv")]

    def body(bb, q, k, v):
        def split(t, n):
            return bb.emit(op.permute_dims(bb.emit(op.reshape(t, [b, s, n, dim])), [0, 2, 1, 3]))

        def repeat_kv(t):
            t = bb.emit(op.broadcast_to(bb.emit(op.expand_dims(t, 2)), [b, kv_heads, group, s, dim]))
            return bb.emit(op.reshape(t, [b, heads, s, dim]))

        qh, kh, vh = split(q, heads), repeat_kv(split(k, kv_heads)), repeat_kv(split(v, kv_heads))
        scores = bb.emit(op.multiply(op.matmul(qh, bb.emit(op.permute_dims(kh, [0, 1, 3, 2]))),
                                     relax.const(dim**-0.5, dtype)))
        causal = bb.emit(op.triu(op.full((s, s), relax.const(float(np.finfo(dtype).min), dtype)), 1))
        probs = bb.emit(op.astype(op.nn.softmax(op.astype(bb.emit(op.add(scores, causal)), "float32")), dtype))
        ctx = bb.emit(op.permute_dims(bb.emit(op.matmul(probs, vh)), [0, 2, 1, 3]))
        return op.reshape(ctx, [b, s, heads * dim])

    return _module(params, body)


def _rand(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


_MASK_SHAPES = {
    "row": lambda b, s: [b, 1, 1, s],
    "full": lambda b, s: [b, 1, s, s],
    "shared": lambda b, s: [1, 1, s, s],
}


def _padding_mask(rng, batch: int, seq: int, kind: str, dtype: str) -> np.ndarray:
    """0 for kept keys, a large negative value for padded ones; every row keeps its first key."""
    shape = tuple(_MASK_SHAPES[kind](batch, seq))
    padded = rng.random(shape) < 0.3
    padded[..., 0] = False
    return np.where(padded, np.finfo(dtype).min, rng.standard_normal(shape) * 0.1).astype(dtype)


# ---------------------------------------------------------------- helpers


def _run(mod: tvm.IRModule, args: list[np.ndarray], pipeline=None, func: str = "main") -> np.ndarray:
    target = to_tvm(resolve("llvm"))
    executable = tvm.compile(mod, target=target, **({"relax_pipeline": pipeline} if pipeline else {}))
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm[func](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _specs(mod: tvm.IRModule) -> list[AttentionSpec]:
    return [AttentionSpec.from_attr(f.attrs[ATTENTION_ATTR]) for _, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc) and f.attrs is not None and ATTENTION_ATTR in f.attrs]


def _ops(mod: tvm.IRModule) -> list[str]:
    names = []

    def visit(e: relax.Expr) -> None:
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            names.append(e.op.name)

    relax.analysis.post_order_visit(mod["main"], visit)
    return names


def _fuse(mod: tvm.IRModule) -> tuple[tvm.IRModule, AttentionSpec]:
    fused = FuseAttention()(mod)
    (spec,) = _specs(fused)
    ops = _ops(fused)
    assert "relax.nn.softmax" not in ops and "relax.matmul" not in ops, ops
    return fused, spec


def _check_numerics(before: tvm.IRModule, after: tvm.IRModule, args: list[np.ndarray], dtype: str) -> None:
    expected = _run(before, args).astype(np.float64)
    got = _run(after, args).astype(np.float64)
    assert got.shape == expected.shape
    assert np.abs(expected).max() > 0.1  # a real result, not zeros
    np.testing.assert_allclose(got, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


# ---------------------------------------------------------------- positive cases


@pytest.mark.parametrize("seq", [13, 1])
def test_suite_prefill_causal_gqa(seq: int) -> None:
    mod = _suite_module("attention_prefill")
    fused, spec = _fuse(mod)
    assert (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim) == (32, 8, 128)
    assert spec.causal and not spec.additive_mask and spec.same_length
    assert (spec.layout, spec.dtype, spec.softmax_dtype) == ("BSHD", "float16", "float32")
    assert spec.scale == pytest.approx(128**-0.5, rel=1e-3)
    assert "seq" in str(fused["main"].params[0].ty.shape)  # still symbolic
    rng = np.random.default_rng(seq)
    args = [_rand(rng, (seq, 32, 128), "float16"), *(_rand(rng, (seq, 8, 128), "float16") for _ in range(2))]
    _check_numerics(mod, fused, args, "float16")


def test_suite_decode_one_query() -> None:
    mod = _suite_module("attention_decode")
    fused, spec = _fuse(mod)
    assert not spec.causal and not spec.same_length and (spec.num_qo_heads, spec.num_kv_heads) == (32, 8)
    rng = np.random.default_rng(1)
    for context in (13, 1):
        args = [_rand(rng, (1, 32, 128), "float16"), *(_rand(rng, (context, 8, 128), "float16") for _ in range(2))]
        _check_numerics(mod, fused, args, "float16")


@pytest.mark.parametrize("mask_shape", sorted(_MASK_SHAPES))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bert_additive_mask(mask_shape: str, dtype: str) -> None:
    mod, make_args = _bert(mask_shape, dtype)
    fused, spec = _fuse(mod)
    assert spec.additive_mask and not spec.causal and spec.mask_dtype == dtype
    # The heads are split off [B, S, H*D] and joined back: BSHD, no copies of Q, K, V or the output.
    assert spec.layout == "BSHD" and "relax.permute_dims" not in _ops(fused)
    # Only a mask of one row per sequence is broadcast to [B, 1, Sq, Skv]; a shared one stays [1, 1, Sq, Skv].
    assert ("relax.broadcast_to" in _ops(fused)) == (mask_shape == "row")
    rng = np.random.default_rng(2)
    for batch, seq in ((2, 7), (1, 13)):
        _check_numerics(mod, fused, make_args(rng, batch, seq), dtype)


@pytest.mark.parametrize("scale_on", ["scores", "q", "k"])
def test_vit_no_mask(scale_on: str) -> None:
    mod = _vit(scale_on=scale_on)
    fused, spec = _fuse(mod)
    assert spec.layout == "BHSD" and not spec.causal and not spec.additive_mask
    assert spec.scale == pytest.approx(8**-0.5)
    rng = np.random.default_rng(3)
    _check_numerics(mod, fused, [_rand(rng, (2, 3, 7, 8), "float32") for _ in range(3)], "float32")


@pytest.mark.parametrize("causal_where", [False, True])
def test_gqa_repeat_kv_bhsd(causal_where: bool) -> None:
    q_len, kv_len = (tirx.Var("n", "int64"),) * 2 if causal_where else (7, 13)
    mod = _gqa_bhsd(q_len, kv_len, causal_where=causal_where)
    fused, spec = _fuse(mod)
    assert (spec.num_qo_heads, spec.num_kv_heads, spec.causal) == (6, 2, causal_where)
    rng = np.random.default_rng(4)
    sizes = [(5, 5), (1, 1)] if causal_where else [(7, 13)]
    for sq, skv in sizes:
        args = [_rand(rng, (2, 6, sq, 8), "float32"), *(_rand(rng, (2, 2, skv, 8), "float32") for _ in range(2))]
        _check_numerics(mod, fused, args, "float32")


def test_other_diagonal_is_an_additive_mask() -> None:
    """``triu(full(c), 2)`` is not causal (each query also sees the next key): fused as a plain additive mask."""
    mod = _scores_module(lambda bb, s, q: bb.emit(op.add(s, bb.emit(op.triu(op.full((5, 5), relax.const(-1e9)), 2)))))
    fused, spec = _fuse(mod)
    assert spec.additive_mask and not spec.causal
    rng = np.random.default_rng(6)
    _check_numerics(mod, fused, [_rand(rng, (1, 2, 5, 4), "float32") for _ in range(3)], "float32")


def test_hf_llama_eager_attention() -> None:
    mod = _hf_llama()
    fused, spec = _fuse(mod)
    assert (spec.num_qo_heads, spec.num_kv_heads, spec.layout, spec.causal) == (4, 2, "BSHD", True)
    # Heads split off and joined back, K/V shared by reshapes of broadcasts: no copies left.
    assert not {"relax.permute_dims", "relax.broadcast_to"} & set(_ops(fused)), _ops(fused)
    rng = np.random.default_rng(10)
    for batch, seq in ((2, 7), (1, 1)):
        args = [_rand(rng, (batch, seq, 64), "float16"), *(_rand(rng, (batch, seq, 32), "float16") for _ in range(2))]
        _check_numerics(mod, fused, args, "float16")


def test_masked_where_and_two_layers_share_one_kernel() -> None:
    """``where(triu(ones, 1), c, s)`` is causal too; two attentions of one spec share one PrimFunc."""

    def causal(bb, s, q):
        masked = bb.emit(op.triu(op.ones((5, 5), "bool"), 1))
        return bb.emit(op.where(masked, relax.const(-1e9), s))

    def body(bb, q, k, v):
        first = _attend(bb, q, k, v, causal)
        return op.add(bb.emit(first), bb.emit(_attend(bb, k, q, v, causal)))

    mod = _module([_tensor(n, [1, 2, 5, 4]) for n in "qkv"], body)
    fused = FuseAttention()(mod)
    specs = _specs(fused)
    assert len(specs) == 1 and specs[0].causal
    assert _ops(fused).count("relax.call_tir") == 2 and "relax.nn.softmax" not in _ops(fused)
    rng = np.random.default_rng(7)
    _check_numerics(mod, fused, [_rand(rng, (1, 2, 5, 4), "float32") for _ in range(3)], "float32")


def test_nn_frontend_vit_block() -> None:
    """A ViT block written with ``tvm.relax.frontend.nn``: fused qkv projection split into heads."""
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op as F

    class Attention(nn.Module):
        def __init__(self, hidden: int, heads: int) -> None:
            self.heads, self.dim = heads, hidden // heads
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)

        def forward(self, x: nn.Tensor) -> nn.Tensor:
            b, s, _ = x.shape
            qkv = F.permute_dims(F.reshape(self.qkv(x), (b, s, 3, self.heads, self.dim)), [2, 0, 3, 1, 4])
            q, k, v = (F.squeeze(t, 0) for t in F.split(qkv, 3, axis=0))
            scores = F.matmul(q, F.permute_dims(k, [0, 1, 3, 2])) * (self.dim**-0.5)
            ctx = F.matmul(F.softmax(scores, axis=-1), v)
            return self.proj(F.reshape(F.permute_dims(ctx, [0, 2, 1, 3]), (b, s, self.heads * self.dim)))

    mod, params = Attention(32, 4).export_tvm({"forward": {"x": nn.spec.Tensor(["batch", "seq", 32], "float32")}})
    fused = FuseAttention()(mod)
    (spec,) = _specs(fused)
    assert (spec.num_qo_heads, spec.head_dim, spec.layout) == (4, 8, "BHSD")
    rng = np.random.default_rng(9)
    weights = [_rand(rng, [int(d) for d in p.shape], "float32") * 0.3 for _, p in params]
    args = [_rand(rng, (2, 7, 32), "float32"), *weights]
    expected = _run(mod, args, func="forward")
    assert np.abs(expected).max() > 0.1
    np.testing.assert_allclose(_run(fused, args, func="forward"), expected, rtol=1e-5, atol=1e-5)


def test_fuselight_pipeline_on_llvm() -> None:
    """The pass is in the default pipeline (ahead of accumulate_matmul_fp32, which rewrites matmuls)."""
    from fuselight.pipeline import baseline_pipeline, fuselight_pipeline

    names = DEFAULT
    assert names.index("fuse_attention") < names.index("accumulate_matmul_fp32")
    mod = _suite_module("attention_prefill")
    rng = np.random.default_rng(5)
    args = [_rand(rng, (7, 32, 128), "float16"), *(_rand(rng, (7, 8, 128), "float16") for _ in range(2))]
    expected = _run(mod, args, baseline_pipeline(use_mlc=False)).astype(np.float64)
    got = _run(mod, args, fuselight_pipeline(use_mlc=False)).astype(np.float64)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE["float16"], rtol=TOLERANCE["float16"])


# ---------------------------------------------------------------- negative cases


def _attend(bb, q, k, v, make_scores, *rest, axis: int = -1, dtype: str = "float32") -> relax.Expr:
    scores = bb.emit(op.matmul(q, bb.emit(op.permute_dims(k, [0, 1, 3, 2]))))
    probs = bb.emit(op.nn.softmax(make_scores(bb, scores, q, *rest), axis=axis))
    if probs.ty.dtype != dtype:
        probs = bb.emit(op.astype(probs, dtype))
    return op.matmul(probs, v)


def _scores_module(make_scores, *, axis: int = -1, dtype: str = "float32", extra=(),
                   probs_also_summed: bool = False) -> tvm.IRModule:
    """``softmax(make_scores(...), axis) @ v`` on BHSD inputs [1, 2, 5, 4] (plus the row sums of the
    probabilities if ``probs_also_summed``: they are then needed anyway)."""
    shape = [1, 2, 5, 4]

    def body(bb, q, k, v, *rest):
        out = _attend(bb, q, k, v, make_scores, *rest, axis=axis, dtype=dtype)
        if not probs_also_summed:
            return out
        probs = out.args[0]  # matmul(probs, v)
        return op.add(bb.emit(out), op.sum(probs, axis=[3], keepdims=True))

    return _module([*(_tensor(n, shape, dtype) for n in "qkv"), *extra], body)


def _causal_then_temperature(bb, scores, temperature_scale: float) -> relax.Expr:
    masked = bb.emit(op.add(scores, bb.emit(op.triu(op.full((5, 5), relax.const(-1e9)), 1))))
    return bb.emit(op.multiply(masked, relax.const(temperature_scale)))


def test_temperature_after_causal_mask() -> None:
    mod = _scores_module(lambda bb, s, q: _causal_then_temperature(bb, s, 0.5))
    fused, spec = _fuse(mod)
    assert spec.causal and spec.scale == 0.5
    rng = np.random.default_rng(8)
    _check_numerics(mod, fused, [_rand(rng, (1, 2, 5, 4), "float32") for _ in range(3)], "float32")


NEGATIVES = {
    "softmax_not_attention": lambda: _module(
        [_tensor("x", [5, 6]), _tensor("w", [6, 3])],
        lambda bb, x, w: op.matmul(bb.emit(op.nn.softmax(bb.emit(op.exp(x)), axis=-1)), w),
    ),
    "where_not_causal": lambda: _scores_module(
        lambda bb, s, q: bb.emit(op.where(bb.emit(op.tril(op.ones((5, 5), "bool"), -1)), s, relax.const(-1e9)))
    ),
    "mask_from_a_tensor_condition": lambda: _scores_module(
        lambda bb, s, q, cond: bb.emit(op.where(cond, s, relax.const(-1e9))),
        extra=[_tensor("cond", [5, 5], "bool")],
    ),
    "mask_depends_on_q": lambda: _scores_module(
        lambda bb, s, q: bb.emit(op.add(s, bb.emit(op.sum(q, axis=[1, 3], keepdims=True))))
    ),
    "mask_varies_over_heads": lambda: _scores_module(
        lambda bb, s, q, m: bb.emit(op.add(s, m)), extra=[_tensor("m", [1, 2, 5, 5])]
    ),
    "mask_broadcasts_the_scores": lambda: _scores_module(
        lambda bb, s, q, m: bb.emit(op.add(s, m)), extra=[_tensor("m", [3, 1, 5, 5])]
    ),
    "non_constant_scale": lambda: _scores_module(
        lambda bb, s, q, c: bb.emit(op.multiply(s, c)), extra=[_tensor("c", [])]
    ),
    "temperature_unmasks_causal": lambda: _scores_module(lambda bb, s, q: _causal_then_temperature(bb, s, 1e-6)),
    "softmax_over_queries": lambda: _scores_module(lambda bb, s, q: s, axis=-2),
    "narrowing_cast": lambda: _scores_module(lambda bb, s, q: bb.emit(op.astype(s, "float16")), dtype="float32"),
    "probabilities_used_twice": lambda: _scores_module(lambda bb, s, q: s, probs_also_summed=True),
}


@pytest.mark.parametrize("name", sorted(NEGATIVES))
def test_not_attention_left_unchanged(name: str) -> None:
    mod = NEGATIVES[name]()
    assert "relax.nn.softmax" in _ops(mod)
    after = FuseAttention()(mod)
    tvm.ir.assert_structural_equal(after, mod)


# ---------------------------------------------------------------- the rule


def _zoo() -> dict[str, tirx.PrimFunc]:
    """PrimFuncs that are not attention: matmul, softmax, rmsnorm, two chained matmuls."""
    n = tirx.Var("n", "int64")
    a, b, c = te.placeholder((n, 64), "float16", "a"), te.placeholder((64, 64), "float16", "b"), te.placeholder(
        (64, 64), "float16", "c")
    r = te.reduce_axis((0, 64), "r")
    mm = te.compute((n, 64), lambda i, j: te.sum(a[i, r].astype("float32") * b[r, j].astype("float32"), axis=r))
    r2 = te.reduce_axis((0, 64), "r2")
    mm2 = te.compute((n, 64), lambda i, j: te.sum(mm[i, r2] * c[r2, j].astype("float32"), axis=r2))
    r3, r4 = te.reduce_axis((0, 64), "r3"), te.reduce_axis((0, 64), "r4")
    x = te.placeholder((n, 64), "float32", "x")
    mx = te.compute((n,), lambda i: te.max(x[i, r3], axis=r3))
    ex = te.compute((n, 64), lambda i, j: te.exp(x[i, j] - mx[i]))
    sm = te.compute((n,), lambda i: te.sum(ex[i, r4], axis=r4))
    softmax = te.compute((n, 64), lambda i, j: ex[i, j] / sm[i])
    r5 = te.reduce_axis((0, 64), "r5")
    ss = te.compute((n,), lambda i: te.sum(x[i, r5] * x[i, r5], axis=r5))
    rms = te.compute((n, 64), lambda i, j: x[i, j] / te.sqrt(ss[i] / 64 + 1e-5))
    return {
        "matmul": te.create_prim_func([a, b, mm]),
        "softmax": te.create_prim_func([x, softmax]),
        "rmsnorm": te.create_prim_func([x, rms]),
        "two_matmuls": te.create_prim_func([a, b, c, mm2]),
    }


SPEC = AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, scale=0.125, causal=True, additive_mask=False,
                     layout="BSHD", dtype="float16", softmax_dtype="float32", same_length=True)


@pytest.mark.parametrize("name", ["matmul", "softmax", "rmsnorm", "two_matmuls"])
def test_rule_rejects_non_attention(name: str) -> None:
    func = _zoo()[name]
    assert FlashAttention.analyze(func) is None
    # Even when tagged as attention: the body must be the computation the tag describes.
    assert FlashAttention.analyze(func.with_attr(ATTENTION_ATTR, SPEC.to_attr())) is None


def test_rule_recognises_fused_function_and_checks_the_tag() -> None:
    func = attention_prim_func(SPEC)
    assert FlashAttention.analyze(func).spec == SPEC
    # A tag that does not match the body (another diagonal, another scale) is not trusted.
    for wrong in (dataclasses.replace(SPEC, causal=False), dataclasses.replace(SPEC, scale=0.25)):
        assert FlashAttention.analyze(func.with_attr(ATTENTION_ATTR, wrong.to_attr())) is None
    # Not a GPU target: nothing to do.
    assert FlashAttention().apply(func, to_tvm(resolve("llvm")), False) is None


def test_rule_leaves_what_the_template_cannot_serve() -> None:
    cuda = to_tvm(resolve("cuda", "sm_90"))
    for spec in (dataclasses.replace(SPEC, head_dim=16), dataclasses.replace(SPEC, dtype="float32"),
                 dataclasses.replace(SPEC, same_length=False)):
        assert FlashAttention().apply(attention_prim_func(spec), cuda, False) is None


def test_rule_swaps_in_the_template_with_our_signature() -> None:
    cuda = to_tvm(resolve("cuda", "sm_90"))
    for spec in (SPEC, dataclasses.replace(SPEC, causal=False, additive_mask=True, mask_dtype="float16",
                                           layout="BHSD", same_length=False)):
        ours = attention_prim_func(spec).with_attr("target", cuda)
        sch = FlashAttention().apply(ours, cuda, False)
        assert sch is not None
        kernel = sch.mod["main"]
        assert [p.name for p in kernel.params] == [p.name for p in ours.params]
        for mine, theirs in zip(ours.params, kernel.params):
            assert mine.dtype == theirs.dtype and len(mine.shape) == len(theirs.shape), mine.name
            for a, b in zip(mine.shape, theirs.shape):  # static dims equal, symbolic ones symbolic
                assert (int(a) if isinstance(a, tirx.IntImm) else None) == (
                    int(b) if isinstance(b, tirx.IntImm) else None), mine.name
        assert kernel.attrs[ATTENTION_ATTR] is not None


def test_rule_branches_one_query_calls_to_split_kv_decode() -> None:
    """Without a causal mask the kernel runs the split-KV decode kernels (split and merge) where
    Sq is 1 at run time, the flash kernel elsewhere; under one, where a single query sees only the
    first key, always the flash kernel."""
    cuda = to_tvm(resolve("cuda", "sm_90"))
    no_mask = dataclasses.replace(SPEC, causal=False, additive_mask=True, mask_dtype="float16", same_length=False)
    # Split-KV: the split kernel's partial outputs and lse, the merge into the output; then the flash kernel.
    for spec, outputs in ((no_mask, [{"O_part", "lse_part"}, {"output"}, {"out_flat"}]), (SPEC, [{"out_flat"}])):
        sch = FlashAttention().apply(attention_prim_func(spec).with_attr("target", cuda), cuda, False)
        assert [k.outputs for k in kernels(sch.mod["main"])] == outputs


def _cuda_build(mod: tvm.IRModule, schedule_rules) -> str:
    from fuselight.pipeline import fuselight_pipeline
    from fuselight.runtime import cuda_sources

    target = to_tvm(resolve("cuda", "sm_90"))
    with target:
        executable = tvm.compile(mod, target=target,
                                 relax_pipeline=fuselight_pipeline(target, rules=schedule_rules, use_mlc=False))
    return "\n".join(cuda_sources(executable))


GPU_GRAPHS = {
    "suite_prefill": lambda: _suite_module("attention_prefill"),
    "suite_decode": lambda: _suite_module("attention_decode"),
    "bert_shared_mask": lambda: _bert("shared", "float16", heads=2, dim=64)[0],
}


@needs_nvcc
@pytest.mark.parametrize("graph", sorted(GPU_GRAPHS))
@pytest.mark.parametrize("which", ["fuselight", "dlight"])
def test_sm90_build_compiles(which: str, graph: str) -> None:
    """Fused graphs build for sm_90 with fuselight's rules, and with DLight's alone (the reference
    function scheduled stage by stage), and nvcc compiles the CUDA."""
    from fuselight.cuda_compile import compile_cuda

    schedule_rules = rules.fuselight_rules() if which == "fuselight" else []
    source = _cuda_build(GPU_GRAPHS[graph](), schedule_rules)
    assert "fused_attention" in source
    # The flash kernel keeps the scores on chip; the reference passes them between its stages.
    assert ("score_ptr" in source) == (which == "dlight")
    assert compile_cuda(source, "sm_90")
