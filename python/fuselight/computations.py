"""The plain computations a graph pass emits and a schedule rule recognises.

A pass that fuses for a rule writes the fused computation plainly (TE / TIR, unscheduled) with the
functions here; the rule recognises the same computation by analysis (or, for attention, rebuilds
it from the tagged description and compares). Neither half imports the other: both import this.

- ``attention_prim_func`` (``AttentionSpec``): FuseAttention's reference attention, which the
  FlashAttention rule replaces;
- ``gate_up_silu_te`` / ``gate_up_silu_prim_func``: the gate+up projection with ``silu(gate) * up``
  as its paired epilogue (FuseGateUpSiLU; the Matmul and Gemv rules);
- ``fused_norm_matmul``: an RMSNorm (and its residual add) read by a matmul (FuseNormIntoGemv; the
  Gemv rule's norm prologue);
- ``with_dequantized_weight``: a matmul function whose weight operand is computed by a dequantize
  function first, in the same kernel (both passes above, carrying a 4-bit weight's dequantize);
- ``plain_add_rms_norm``: the residual add + RMSNorm of FuseAddRMSNorm's kernels, written plainly
  (AddRMSNormKernels; the RowReduction rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tvm
from tvm import relax, te, tirx, topi

from .contracts import ATTENTION_ATTR, OP_PATTERN_ATTR, OPAQUE_OP_PATTERN

ACCUMULATE_DTYPE = "float32"


# ---------------------------------------------------------------- attention


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What a fused attention PrimFunc computes (also its ``fuselight.attention`` attribute)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # the product of the constant scales on Q, K and the scores
    causal: bool  # key j is seen by query i iff j <= i
    additive_mask: bool
    layout: str  # "BSHD" or "BHSD", for q, k, v and out
    dtype: str  # of q, k, v and out
    softmax_dtype: str  # the dtype the graph took the softmax in
    mask_dtype: str = ""  # "" without an additive mask
    same_length: bool = False  # Sq == Skv is known (one symbolic value, or equal constants)

    def to_attr(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_attr(attr) -> AttentionSpec:
        """The spec from a ``fuselight.attention`` attribute (TVM's map of TVM values)."""
        names = [f.name for f in dataclasses.fields(AttentionSpec)]
        return AttentionSpec(**{name: _plain(attr[name]) for name in names if name in attr})



def _plain(value):
    """A TVM attribute value (IntImm, String, ...) as a Python scalar."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tirx.IntImm, tirx.FloatImm)):
        return bool(value.value) if value.dtype == "bool" else value.value
    return str(value)


def attention_prim_func(spec: AttentionSpec) -> tirx.PrimFunc:
    """The reference attention PrimFunc for ``spec``: params ``(q, k, v[, mask], out)``, batch and
    sequence lengths symbolic (int64), scores accumulated and normalised in float32."""
    batch = tirx.Var("batch_size", "int64")
    q_len = tirx.Var("q_len", "int64")
    kv_len = q_len if spec.same_length else tirx.Var("kv_len", "int64")
    hq, hkv, dim = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    group = hq // hkv
    bshd = spec.layout == "BSHD"
    acc = ACCUMULATE_DTYPE

    def shape(seq, heads):
        return (batch, seq, heads, dim) if bshd else (batch, heads, seq, dim)

    def at(t, b, s, h, d):
        return t[b, s, h, d] if bshd else t[b, h, s, d]

    q = te.placeholder(shape(q_len, hq), spec.dtype, "q")
    k = te.placeholder(shape(kv_len, hkv), spec.dtype, "k")
    v = te.placeholder(shape(kv_len, hkv), spec.dtype, "v")
    # The mask's batch is 1 (shared) or the batch.
    mask_batch = tirx.Var("mask_batch", "int64")
    mask = te.placeholder((mask_batch, 1, q_len, kv_len), spec.mask_dtype, "mask") if spec.additive_mask else None
    rd = te.reduce_axis((0, dim), "rd")
    score = te.compute(
        (batch, hq, q_len, kv_len),
        lambda b, h, i, j: te.sum(at(q, b, i, h, rd).astype(acc) * at(k, b, j, h // group, rd).astype(acc), axis=rd),
        name="score",
    )

    def logit_of(b, h, i, j):
        x = score[b, h, i, j] * tirx.const(spec.scale, acc)
        if mask is not None:
            x = x + mask[tirx.if_then_else(mask_batch == 1, tirx.const(0, "int64"), b), 0, i, j].astype(acc)
        return tirx.if_then_else(j <= i, x, te.min_value(acc)) if spec.causal else x

    logit = te.compute((batch, hq, q_len, kv_len), logit_of, name="logit")
    rj = te.reduce_axis((0, kv_len), "rj")
    row_max = te.compute((batch, hq, q_len), lambda b, h, i: te.max(logit[b, h, i, rj], axis=rj), name="row_max")
    prob = te.compute((batch, hq, q_len, kv_len), lambda b, h, i, j: te.exp(logit[b, h, i, j] - row_max[b, h, i]),
                      name="prob")
    rj2 = te.reduce_axis((0, kv_len), "rj2")
    row_sum = te.compute((batch, hq, q_len), lambda b, h, i: te.sum(prob[b, h, i, rj2], axis=rj2), name="row_sum")
    rj3 = te.reduce_axis((0, kv_len), "rj3")
    acc_out = te.compute(
        (batch, hq, q_len, dim),
        lambda b, h, i, d: te.sum(prob[b, h, i, rj3] * at(v, b, rj3, h // group, d).astype(acc), axis=rj3),
        name="acc_out",
    )

    def out_of(b, x, y, d):
        h, i = (y, x) if bshd else (x, y)
        return (acc_out[b, h, i, d] / row_sum[b, h, i]).astype(spec.dtype)

    out = te.compute(shape(q_len, hq), out_of, name="out")
    params = [q, k, v, *([mask] if mask is not None else []), out]
    func = te.create_prim_func(params, index_dtype_override="int64").without_attr("global_symbol")
    return func.with_attr(ATTENTION_ATTR, spec.to_attr()).with_attr(OP_PATTERN_ATTR, OPAQUE_OP_PATTERN)



# ---------------------------------------------------------------- GEMM with a paired epilogue


def gate_up_silu_te(x: te.Tensor, w: te.Tensor, acc_dtype: str, out_dtype: str, b_layout: str = "NT") -> te.Tensor:
    """``silu(C[..., :I]) * C[..., I:]`` of ``C = cast(x @ w^T)`` (``b_layout`` "NT": ``w`` ``[2I, K]``;
    "NN": ``C = cast(x @ w)``, ``w`` ``[K, 2I]``, a weight dequantized in MLC-LLM's KN layout): the
    matmul (accumulated in ``acc_dtype``, cast to ``out_dtype``) and the paired elementwise stage."""
    width, k = w.shape if b_layout == "NT" else w.shape[::-1]  # static (checked by the match)
    half = tirx.IntImm(str(width.ty.dtype), int(width) // 2)
    lead = list(x.shape[:-1])
    r = te.reduce_axis((tirx.IntImm(str(k.ty.dtype), 0), k), "k")

    def product(*i: Any) -> Any:
        a, b = x[(*i[:-1], r)], w[i[-1], r] if b_layout == "NT" else w[r, i[-1]]
        if acc_dtype != str(x.dtype):
            a, b = a.astype(acc_dtype), b.astype(acc_dtype)
        return te.sum(a * b, axis=r)

    c = te.compute((*lead, width), product, name="NT_matmul" if b_layout == "NT" else "matmul")

    def value(*i: Any) -> Any:
        gate, up = c[(*i[:-1], i[-1])], c[(*i[:-1], i[-1] + half)]
        if out_dtype != acc_dtype:
            gate, up = gate.astype(out_dtype), up.astype(out_dtype)
        # silu as LegalizeOps writes relax.nn.silu (TOPI: x * sigmoid(x)).
        return gate * te.sigmoid(gate) * up

    return te.compute((*lead, half), value, name="silu_multiply")


def gate_up_silu_prim_func(x_shape: list[Any], x_dtype: str, w_shape: list[Any], w_dtype: str, acc_dtype: str,
                           out_dtype: str, b_layout: str = "NT") -> tirx.PrimFunc:
    """``(x, w) -> silu(gate) * up`` (``gate_up_silu_te``) as a PrimFunc, no global symbol."""
    x = te.placeholder(x_shape, x_dtype, "x")
    w = te.placeholder(w_shape, w_dtype, "w")
    out = gate_up_silu_te(x, w, acc_dtype, out_dtype, b_layout)
    return te.create_prim_func([x, w, out]).with_attr("tirx.noalias", True).without_attr("global_symbol")


def matmul_prim_func(x_shape: list[Any], w_shape: list[Any], dtype: str, acc_dtype: str,
                     out_dtype: str | None = None) -> tirx.PrimFunc:
    """``(x, w) -> x @ w`` with ``w`` ``[K, N]`` as a matmul reads it, accumulated in ``acc_dtype``, cast
    to ``out_dtype`` where given (``astype(matmul(x, w, acc_dtype), dtype)`` as LegalizeOps and
    FuseOps leave it; None: ``matmul(x, w, acc_dtype)`` alone), no global symbol."""
    x = te.placeholder(x_shape, dtype, "x")
    w = te.placeholder(w_shape, dtype, "w")
    k, n = w.shape
    r = te.reduce_axis((tirx.IntImm(str(k.ty.dtype), 0), k), "k")
    c = te.compute((*x.shape[:-1], n), lambda *i: te.sum(
        x[(*i[:-1], r)].astype(acc_dtype) * w[r, i[-1]].astype(acc_dtype), axis=r), name="matmul")
    out = c if out_dtype is None else te.compute(c.shape, lambda *i: c(*i).astype(out_dtype), name="compute")
    return te.create_prim_func([x, w, out]).with_attr("tirx.noalias", True).without_attr("global_symbol")


# ---------------------------------------------------------------- norms


def fused_norm_matmul(
    x_ty: relax.TensorType,
    residual: bool,
    weight_ty: relax.TensorType,
    eps: float,
    consumer: tirx.PrimFunc,
    matrix_tys: Sequence[relax.TensorType],
    casts: tuple[str, ...] = (),
    stream_dtype: str | None = None,
) -> tirx.PrimFunc:
    """``(x[, r], w, *W) -> (y[, x + r])``, written plainly: TOPI's add (if ``residual``) and rms_norm
    of ``x`` over its last axis, ``consumer`` (a PrimFunc ``(A, *W) -> y``: the weight, or its packed
    words and scales) reading the norm, then ``casts``; FuseTIR splices the stages into one PrimFunc.

    ``stream_dtype`` (with ``residual``): the residual stream kept in that dtype, as
    ``plain_add_rms_norm`` writes it (``x`` of ``x_ty``, ``r`` of the weight's dtype, ``x + r`` and the
    norm computed and ``x + r`` written in ``stream_dtype``, the norm rounded once to ``r``'s dtype)."""
    x = relax.Var("x", x_ty)
    r = relax.Var("residual", x_ty if stream_dtype is None else relax.TensorType(x_ty.shape, weight_ty.dtype))
    w = relax.Var("norm_weight", weight_ty)
    mats = [relax.Var(f"weight{i}", ty) for i, ty in enumerate(matrix_tys)]
    axes = [len(x_ty.shape.values) - 1]

    def body(bb: relax.BlockBuilder) -> relax.Expr:
        if stream_dtype is not None and residual:
            both = bb.emit_te(stream_add_rms_norm_te, x, r, w, axes, eps, stream_dtype)
            normed, src = (bb.emit(relax.TupleGetItem(both, i)) for i in (0, 1))
        else:
            src = bb.emit_te(topi.add, x, r) if residual else x
            normed = bb.emit_te(topi.nn.rms_norm, src, w, axes, eps)
        y = bb.emit(_call(bb, consumer, "matmul", [normed, *mats]))
        for dtype in casts:
            y = bb.emit_te(topi.cast, y, dtype)
        return relax.Tuple([y, src]) if residual else y

    return _spliced([x, *([r] if residual else []), w, *mats], body)


def with_dequantized_weight(consumer: tirx.PrimFunc, dequantize: tirx.PrimFunc) -> tirx.PrimFunc:
    """``(A, *packed) -> consumer(A, dequantize(*packed))`` as one PrimFunc (FuseTIR's splice):
    ``consumer`` a PrimFunc ``(A, W) -> y``, ``dequantize`` one ``(*packed) -> W``."""
    a = _param_var("a", consumer.params[0])
    packed = [_param_var(f"packed{i}", p) for i, p in enumerate(dequantize.params[:-1])]

    def body(bb: relax.BlockBuilder) -> relax.Expr:
        weight = bb.emit(_call(bb, dequantize, "dequantize", packed))
        return _call(bb, consumer, "matmul", [a, weight])

    return _spliced([a, *packed], body)


def _param_var(name: str, param: tirx.Var) -> relax.Var:
    """A Relax tensor variable of a PrimFunc parameter's (static or symbolic) shape and dtype."""
    return relax.Var(name, relax.TensorType(list(param.ty.shape), str(param.ty.dtype)))


def _call(bb: relax.BlockBuilder, func: tirx.PrimFunc, name: str, args: list[relax.Expr]) -> relax.Call:
    """``call_tir`` of ``func`` (added to ``bb``'s module) on ``args``, its last parameter the output."""
    out = func.params[-1]
    gv = bb.add_func(func.without_attr("global_symbol"), name)
    return relax.call_tir(gv, args, relax.TensorType(list(out.ty.shape), str(out.ty.dtype)))


def _spliced(params: list[relax.Var], body: Callable[[relax.BlockBuilder], relax.Expr]) -> tirx.PrimFunc:
    """The one PrimFunc FuseTIR makes of a primitive Relax function of ``params`` computing
    ``body(bb)`` (its bindings emitted in ``bb``'s dataflow block), no global symbol."""
    bb = relax.BlockBuilder()
    with bb.function("fused", params, attrs={"Primitive": True}, private=True):
        with bb.dataflow():
            result = bb.emit_output(body(bb))
        bb.emit_func_output(result)
    fused = bb.get().get_global_var("fused")
    outer = [relax.Var(p.name, p.ty) for p in params]
    with bb.function("main", outer):
        with bb.dataflow():
            called = bb.emit_output(relax.Call(fused, outer))
        bb.emit_func_output(called)
    mod = relax.transform.FuseTIR()(bb.get())
    calls: list[Any] = []
    relax.analysis.post_order_visit(mod["main"], lambda n: calls.append(n) if isinstance(n, relax.Call) and n.op == tvm.ir.Op.get("relax.call_tir") else None)
    return mod[calls[0].args[0]].without_attr("global_symbol")



def stream_add_rms_norm_te(x: te.Tensor, r: te.Tensor, w: te.Tensor, axes: list[int], eps: float,
                           stream_dtype: str) -> list[te.Tensor]:
    """``[rms_norm(x + r, w), x + r]`` with the sum (a residual stream) and the norm computed in
    ``stream_dtype`` (``x``, ``r`` and ``w`` widened to it), the norm rounded once to ``r``'s dtype."""
    total = te.compute(x.shape, lambda *i: x(*i).astype(stream_dtype) + r(*i).astype(stream_dtype), name="T_add")
    weight = te.compute(w.shape, lambda c: w[c].astype(stream_dtype), name="T_weight")
    wide = topi.nn.rms_norm(total, weight, axes, eps)
    norm = te.compute(wide.shape, lambda *i: wide(*i).astype(str(r.dtype)), name="T_normed")
    return [norm, total]


def plain_add_rms_norm(func: tirx.PrimFunc, eps: float, x_dtype: str | None = None,
                       stream_dtype: str | None = None) -> tirx.PrimFunc:
    """``(x, r, w) -> (rms_norm(x + r, w), x + r)`` as TOPI writes it, over ``func``'s parameter shapes.

    ``stream_dtype``: the sum (a residual stream, written out) and the norm computed in it, ``x`` read in
    ``x_dtype`` (default: its parameter's) and ``r`` and ``w`` widened to it, the normed rows rounded once
    to ``r``'s dtype (``stream_add_rms_norm_te``)."""
    x, r, w = func.params[:3]
    xs = te.placeholder(x.shape, x_dtype or str(x.dtype), x.name)
    rs, ws = (te.placeholder(b.shape, str(b.dtype), b.name) for b in (r, w))
    axes = [len(x.shape) - 1]
    if stream_dtype is None:
        total = topi.add(xs, rs)
        norm = topi.nn.rms_norm(total, ws, axes, eps)
    else:
        norm, total = stream_add_rms_norm_te(xs, rs, ws, axes, eps, stream_dtype)
    return te.create_prim_func([xs, rs, ws, norm, total]).with_attr("tirx.noalias", True)
