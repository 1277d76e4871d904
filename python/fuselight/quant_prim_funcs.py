"""Quantized linear layers as PrimFuncs, written the way MLC-LLM's phase 3 leaves them (tests, kernels).

``q4_linear(n, k, ...)`` is one function: the dequantize of a 4-bit group weight (``quantization``'s
schemes: packed ``uint32`` words along K, one scale per group) as two injective stages, the
``NT_matmul`` reduction accumulating in float32 (fuselight's ``accumulate_matmul_fp32``) and a cast
epilogue, exactly as MLC's Llama-3-8B ``q4f16_1`` build has it for a decode projection
(``fused_dequantize1_fused_NT_matmul8_astype``)::

    compute[n, k]    = dtype((q[n, k // 8] >> uint32(k % 8 * 4)) & 15)
    dequantize[n, k] = (compute[n, k] - dtype(7)) * scale[n, k // group]
    NT_matmul[b, 0, n] += float32(x[b, 0, k]) * float32(dequantize[n, k])
    out[b, 0, n]     = dtype(NT_matmul[b, 0, n])         (the LM head: then float32 of that)

N may be symbolic (``vocab_size``: the LM head), and so may the batch (``batch_size``: batch decode).
Imports TVM when called, not when imported.
"""

from __future__ import annotations

from typing import Any


def q4_linear(
    n: int | None, k: int, m: int | None = 1, dtype: str = "float16", group: int = 32, layout: str = "NK",
    epilogue: str = "cast", zero: float = 7.0, one_stage: bool = False, prefill: bool = False,
) -> Any:
    """The PrimFunc (see the module docstring) of an ``[n, k]`` 4-bit weight.

    n: None: symbolic (``vocab_size``). m: token rows (the batch), None: symbolic (``batch_size``).
    layout: "NK" (``q[n, k / 8]``, ``scale[n, k / group]``) or "KN" (both transposed, q4f16_0).
    epilogue: "cast" (to dtype), "cast_fp32" (to dtype then float32: the LM head), "residual"
    (cast, plus a residual input ``r``), "none" (float32 out: the matmul's accumulator).
    one_stage: the dequantize as one stage instead of MLC's two.
    prefill: the token rows as MLC's prefill has them, ``x[1, m, k]`` (``seq_len`` when symbolic),
    instead of ``x[m, 1, k]``.
    """
    from tvm import te, tirx

    i64 = "int64"
    nn: Any = tirx.Var("vocab_size", i64) if n is None else tirx.IntImm(i64, n)
    mm: Any = tirx.Var("seq_len" if prefill else "batch_size", i64) if m is None else tirx.IntImm(i64, m)
    kk = tirx.IntImm(i64, k)
    nk = layout == "NK"
    words, groups = tirx.IntImm(i64, k // 8), tirx.IntImm(i64, k // group)
    q = te.placeholder((nn, words) if nk else (words, nn), "uint32", name="q_weight")
    s = te.placeholder((nn, groups) if nk else (groups, nn), dtype, name="q_scale")
    one = tirx.IntImm(i64, 1)
    rows = (one, mm) if prefill else (mm, one)
    x = te.placeholder((*rows, kk), dtype, name="x")

    def word(i: Any, j: Any) -> Any:
        return q[i, j // 8] if nk else q[j // 8, i]

    def scale(i: Any, j: Any) -> Any:
        return s[i, j // group] if nk else s[j // group, i]

    def unpacked(i: Any, j: Any) -> Any:
        shift = tirx.Cast("uint32", j % 8 * 4)
        return tirx.Cast(dtype, tirx.bitwise_and(tirx.shift_right(word(i, j), shift), tirx.const(15, "uint32")))

    if one_stage:
        w = te.compute((nn, kk), lambda i, j: (unpacked(i, j) - tirx.const(zero, dtype)) * scale(i, j), name="dequantize")
    else:
        c = te.compute((nn, kk), unpacked, name="compute")
        w = te.compute((nn, kk), lambda i, j: (c[i, j] - tirx.const(zero, dtype)) * scale(i, j), name="dequantize")
    r = te.reduce_axis((tirx.IntImm(i64, 0), kk), name="k")
    acc = te.compute(
        (*rows, nn),
        lambda b, t, i: te.sum(tirx.Cast("float32", x[b, t, r]) * tirx.Cast("float32", w[i, r]), axis=r),
        name="NT_matmul",
    )
    params = [q, s, x]
    if epilogue == "none":
        out = acc
    else:
        cast = te.compute(acc.shape, lambda b, t, i: tirx.Cast(dtype, acc[b, t, i]), name="compute1")
        out = cast
        if epilogue == "cast_fp32":
            out = te.compute(acc.shape, lambda b, t, i: tirx.Cast("float32", cast[b, t, i]), name="compute2")
        elif epilogue == "residual":
            res = te.placeholder(acc.shape, dtype, name="r")
            params.append(res)
            out = te.compute(acc.shape, lambda b, t, i: cast[b, t, i] + res[b, t, i], name="add")
        elif epilogue != "cast":
            raise ValueError(f"unknown epilogue {epilogue!r}")
    return te.create_prim_func([*params, out]).with_attr("tirx.noalias", True)
