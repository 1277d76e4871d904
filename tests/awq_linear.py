"""Test helper: an AWQ linear layer (MLC-LLM's ``q4f16_autoawq``) as the PrimFunc MLC's phase 3 leaves.

``awq_linear(n, k)``: ``(x, qweight, qzeros, scales[, r]) -> out``; ``qweight[K, N / 8]``, ``qzeros[K / group, N / 8]``, ``scales[K / group, N]``
unpacked and transposed in stages as MLC has them, then ``value(w, z, s)`` (default ``(w - z) * s``)
into the ``[N, K]`` weight of an NT matmul accumulating in float32, and an epilogue. The keyword
arguments that change how the zero point and the weight are read build near misses."""

from __future__ import annotations

from typing import Any

from tvm import te, tirx


def awq_shift(n: Any) -> Any:
    """AutoAWQ's place of value ``n % 8``, as MLC writes it (not as a table), in bits."""
    return tirx.Cast("uint32", n % 2 * 16 + n % 8 // 2 * 4)


def nibble(word: Any, shift: Any, dtype: str = "float16") -> Any:
    return tirx.Cast(dtype, tirx.bitwise_and(tirx.shift_right(word, shift), tirx.const(15, "uint32")))


def awq_linear(n: int, k: int, *, group: int = 128, value=None, zero_at=None, zero_shift=None, shift=None,
               transposes: bool = True, m: int = 1, epilogue: str = "cast", dtype: str = "float16") -> Any:
    """The PrimFunc (see the module docstring). ``zero_at(z, n, k)``, ``zero_shift(n)`` and
    ``shift(n)`` change how the zero point and the weight are read; ``transposes``: MLC's stages
    (else one stage reading the parameters). epilogue: "cast" (to dtype), "residual" (cast, plus a
    residual input ``r``), "silu_mul" (``silu(gate) * up`` of columns c and c + n / 2, cast)."""
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
