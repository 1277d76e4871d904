"""A LLaMA decode layer's GEMV functions (M = 1) as PrimFuncs, as they reach the Gemv rule (probes, tests).

After the attention, a decode layer is (MLC-LLM's build; ours puts the residual adds into the norms
instead, ``passes.fuse_norm_gemv``)::

    o_proj       h1  = cast(attn @ Wo^T) + h           (float32 sums; ``linear_residual``)
    gate_up      act = silu(g) * u, [g, u] = cast(rms_norm(h1, w2) @ Wgu^T)   (``norm_linear(paired)``)
    down         h2  = cast(act @ Wd^T) + h1           (``linear_residual``)
    next qkv     qkv = cast(rms_norm(h2, w1') @ Wqkv^T)                       (``norm_linear``)

each over ``[1, 1, K]`` token rows, the weights ``[N, K]`` in fp16/bf16 or a 4-bit scheme's packed
words and scales (``quantization.SCHEMES``, NK layout): the norms as ``fuse_norm_gemv`` writes them
(``computations.fused_norm_matmul``), the paired epilogue as ``fuse_gate_up_silu``
(``computations.gate_up_silu_te``), the dequantize spliced in as both passes splice it
(``computations.with_dequantized_weight``). Parameter names: ``x`` (the token row), ``residual``,
``norm_weight``, the weight (``w``, or ``q`` and ``s``; with a norm ``weight0`` and ``weight1``, as
``fused_norm_matmul`` names them), the output last.
"""

from __future__ import annotations

from typing import Any

from tvm import relax, te, tirx

from .baseline.fuse_transpose_matmul import nt_matmul
from .computations import fused_norm_matmul, gate_up_silu_te, with_dequantized_weight
from .quantization import SCHEMES, te_dequantize

ACC = "float32"  # the matmuls' accumulator (``passes.accumulate_matmul_fp32``)


def _row(k: int, dtype: str, name: str) -> te.Tensor:
    return te.placeholder([tirx.IntImm("int64", 1), tirx.IntImm("int64", 1), tirx.IntImm("int64", k)], dtype, name)


def _packed(n: int, k: int, scheme: str) -> tuple[list[te.Tensor], te.Tensor]:
    """The packed words and scales of an ``[n, k]`` weight in ``scheme`` and its dequantize."""
    s = SCHEMES[scheme]
    q_shape, s_shape = s.packed_shapes(n, k)
    q = te.placeholder([tirx.IntImm("int64", d) for d in q_shape], "uint32", "q")
    scale = te.placeholder([tirx.IntImm("int64", d) for d in s_shape], s.model_dtype, "s")
    return [q, scale], te_dequantize((q, scale), s)


def _matrix(n: int, k: int, dtype: str) -> te.Tensor:
    return te.placeholder([tirx.IntImm("int64", n), tirx.IntImm("int64", k)], dtype, "w")


def linear_residual(n: int, k: int, dtype: str = "float16", scheme: str | None = None) -> tirx.PrimFunc:
    """``(x, w | q, s, residual) -> cast(x @ W^T) + residual``: o_proj and down with the residual add."""
    x = _row(k, dtype, "x")
    if scheme is None:
        w = _matrix(n, k, dtype)
        params = [w]
    else:
        params, w = _packed(n, k, scheme)
    r = _row(n, dtype, "residual")
    acc = nt_matmul(x, w, ACC)
    out = te.compute(acc.shape, lambda *i: acc(*i).astype(dtype) + r(*i), name="add")
    return te.create_prim_func([x, *params, r, out]).with_attr("tirx.noalias", True).without_attr("global_symbol")


def norm_linear(n: int, k: int, eps: float, dtype: str = "float16", scheme: str | None = None,
                paired: bool = False) -> tirx.PrimFunc:
    """``(x, norm_weight, w | q, s) -> y``: ``y = cast(rms_norm(x) @ W^T)`` (the QKV projection), or
    with ``paired`` ``silu(gate) * up`` of its halves (gate_up, ``n`` = 2 x intermediate)."""
    a, w = _row(k, dtype, "a"), _matrix(n, k, dtype)
    consumer = te.create_prim_func([a, w, gate_up_silu_te(a, w, ACC, dtype) if paired else nt_matmul(a, w, ACC)])
    matrix = [w]
    if scheme is not None:
        matrix, dequantized = _packed(n, k, scheme)
        consumer = with_dequantized_weight(consumer, te.create_prim_func([*matrix, dequantized]))
    tys = [relax.TensorType([int(d) for d in p.shape], str(p.dtype)) for p in matrix]
    func = fused_norm_matmul(relax.TensorType([1, 1, k], dtype), False, relax.TensorType([k], dtype), eps,
                             consumer, tys, () if paired else (dtype,))
    return func.with_attr("tirx.noalias", True)


def param_names(func: tirx.PrimFunc) -> list[str]:
    """The function's parameter names, in order."""
    return [p.name for p in func.params]


def decode_layer(hidden: int, intermediate: int, qkv: int, eps: float, dtype: str = "float16",
                 scheme: str | None = None, next_qkv: bool = True) -> tuple[list[tirx.PrimFunc], dict[Any, Any]]:
    """The GEMV functions of a decode layer after its attention (o_proj, gate_up, down, and with
    ``next_qkv`` the next layer's QKV: see the module docstring), and how they feed each other: ``{(i,
    param): (j, param)}``, parameter ``param`` of function ``i`` being that of function ``j`` (the
    form ``rules.gemm.gemv_persistent.link`` takes)."""
    funcs = [linear_residual(hidden, hidden, dtype, scheme),
             norm_linear(2 * intermediate, hidden, eps, dtype, scheme, paired=True),
             linear_residual(hidden, intermediate, dtype, scheme)]
    if next_qkv:
        funcs.append(norm_linear(qkv, hidden, eps, dtype, scheme))
    out = [param_names(f)[-1] for f in funcs]
    feeds = {(1, "x"): (0, out[0]), (2, "x"): (1, out[1]), (2, "residual"): (0, out[0])}
    if next_qkv:
        feeds[(3, "x")] = (2, out[2])
    return funcs, feeds
