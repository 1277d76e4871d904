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
``awq_linear(n, k, ...)`` is MLC's ``q4f16_autoawq`` layer (words along N, packed zero points).
Imports TVM when called, not when imported.
"""

from __future__ import annotations

from collections.abc import Callable
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


def awq_shift(n: Any) -> Any:
    """AutoAWQ's place of value ``n % 8``, as MLC writes it (not as a table), in bits."""
    from tvm import tirx

    return tirx.Cast("uint32", n % 2 * 16 + n % 8 // 2 * 4)


def nibble(word: Any, shift: Any, dtype: str = "float16") -> Any:
    """``dtype((word >> shift) & 15)``."""
    from tvm import tirx

    return tirx.Cast(dtype, tirx.bitwise_and(tirx.shift_right(word, shift), tirx.const(15, "uint32")))


def awq_linear(n: int, k: int, *, group: int = 128, value: Callable | None = None, zero_at: Callable | None = None,
               zero_shift: Callable | None = None, shift: Callable | None = None, transposes: bool = True, m: int = 1,
               epilogue: str = "cast", dtype: str = "float16") -> Any:
    """MLC-LLM's ``q4f16_autoawq`` linear layer as its phase 3 leaves it: ``(x, qweight, qzeros,
    scales[, r]) -> out``, ``qweight[K, N / 8]`` (values along N in AutoAWQ's order, ``awq_shift``),
    ``qzeros[K / group, N / 8]`` packed alike, ``scales[K / group, N]``, unpacked and transposed in
    stages, then ``value(w, z, s)`` (default ``(w - z) * s``) into the ``[N, K]`` weight of an NT
    matmul accumulating in float32, and an epilogue. ``zero_at(z, n, k)``, ``zero_shift(n)`` and
    ``shift(n)`` change how the zero point and the weight are read; ``transposes``: MLC's stages
    (else one stage reading the parameters). epilogue: "cast" (to dtype), "residual" (cast, plus a
    residual input ``r``), "silu_mul" (``silu(gate) * up`` of columns c and c + n / 2, cast)."""
    from tvm import te, tirx

    i64 = "int64"

    def c(v):
        return tirx.IntImm(i64, v)

    groups = -(-k // group)
    q = te.placeholder((c(k), c(n // 8)), "uint32", name="qweight")
    zp = te.placeholder((c(groups), c(n // 8)), "uint32", name="qzeros")
    s = te.placeholder((c(groups), c(n)), dtype, name="scales")
    x = te.placeholder((c(m), c(1), c(k)), dtype, name="x")
    shift = shift or awq_shift
    zero_shift = zero_shift or shift
    value = value or (lambda w, z, sc: (w - z) * sc)

    def nib(word, sh):
        return nibble(word, sh, dtype)

    if transposes:  # unpack [K, N], transpose to [N, K]; zero points and scales likewise
        wu = te.compute((c(k), c(n)), lambda kk, nn: nib(q[kk, nn // 8], shift(nn)), name="compute")
        wt = te.compute((c(n), c(k)), lambda nn, kk: wu[kk, nn], name="T_transpose")
        zu = te.compute((c(groups), c(n)), lambda g, nn: nib(zp[g, nn // 8], zero_shift(nn)), name="compute_1")
        zt = te.compute((c(n), c(groups)), lambda nn, g: zu[g, nn], name="T_transpose_1")
        st = te.compute((c(n), c(groups)), lambda nn, g: s[g, nn], name="T_transpose_2")

        def w_at(nn, kk):
            return wt[nn, kk]

        def z_at(nn, kk):
            return zt[nn, kk // group] if zero_at is None else zero_at(zu, nn, kk)

        def s_at(nn, kk):
            return st[nn, kk // group]
    else:
        def w_at(nn, kk):
            return nib(q[kk, nn // 8], shift(nn))

        def z_at(nn, kk):
            return nib(zp[kk // group, nn // 8], zero_shift(nn)) if zero_at is None else zero_at(zp, nn, kk)

        def s_at(nn, kk):
            return s[kk // group, nn]

    w = te.compute((c(n), c(k)), lambda nn, kk: value(w_at(nn, kk), z_at(nn, kk), s_at(nn, kk)), name="dequantize")
    r = te.reduce_axis((c(0), c(k)), name="k")
    mm = te.compute((c(m), c(1), c(n)), lambda b, t, nn: te.sum(
        tirx.Cast("float32", x[b, t, r]) * tirx.Cast("float32", w[nn, r]), axis=r), name="NT_matmul")
    params = [x, q, zp, s]  # the tokens first, as a consumer of a fused norm takes them
    if epilogue == "silu_mul":
        half = n // 2
        out = te.compute((c(m), c(1), c(half)), lambda b, t, nn: tirx.Cast(
            dtype, tirx.sigmoid(mm[b, t, nn]) * mm[b, t, nn] * mm[b, t, nn + half]), name="silu_multiply")
    else:
        out = te.compute((c(m), c(1), c(n)), lambda b, t, nn: tirx.Cast(dtype, mm[b, t, nn]), name="compute1")
    if epilogue == "residual":
        res = te.placeholder((c(m), c(1), c(n)), dtype, name="r")
        out = te.compute((c(m), c(1), c(n)), lambda b, t, nn: out[b, t, nn] + res[b, t, nn], name="add")
        params.append(res)
    elif epilogue not in ("cast", "silu_mul"):
        raise ValueError(f"unknown epilogue {epilogue!r}")
    return te.create_prim_func([*params, out]).with_attr("tirx.noalias", True)
