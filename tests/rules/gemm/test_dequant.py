"""The dequantize recognition (``rules/gemm/dequant.py``) on AWQ's form (MLC-LLM's ``q4f16_autoawq``):
words packed along N in AutoAWQ's order, a packed zero point per group of 128, the stages reading
transposes as MLC's phase 3 leaves them. What it recognises (checked numerically: a float64 dequantize
driven by the description reproduces the unscheduled function, run on the CPU), the near misses it
rejects, and that the templates for words along K decline the form rather than computing it wrong."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from fuselight.quant_prim_funcs import awq_linear as _awq
from fuselight.quant_prim_funcs import awq_shift as _awq_shift
from fuselight.quant_prim_funcs import nibble as _nib
from fuselight.errors import FuselightError
from fuselight.rules.gemm import gemv
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemm.gemv_common import GemvConfig
from fuselight.rules.gemv import Gemv
from fuselight.rules.matmul import Matmul
from tvm import te, tirx

AWQ_PLACES = (0, 4, 1, 5, 2, 6, 3, 7)  # place in its word of value n % 8 (AutoAWQ's packing order)
ROWS = GemvConfig(max_m=1, warps=8, unroll=4, min_blocks_per_sm=2, rows_per_warp=2)


def _dequantize_from(d, q: np.ndarray, z: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The float64 ``[N, K]`` weight a KN_N ``Dequant`` ``d`` describes, from the arrays alone."""
    mask = (1 << d.bits) - 1
    shifts = np.array(d.places, dtype=np.uint32) * d.bits  # value i of a run of per_word at its place

    def unpack(words):  # [rows, N / per_word] -> [rows, N]
        return ((words[..., None] >> shifts) & mask).reshape(words.shape[0], -1).astype(np.float64)

    w, zeros = unpack(q), unpack(z)  # [K, N], [K / group, N]
    per_k = np.arange(q.shape[0]) // d.group  # each k's group
    return ((w - zeros[per_k]) * s.astype(np.float64)[per_k]).T


# ---- what it recognises ---------------------------------------------------------------------


@pytest.mark.parametrize("transposes", [True, False], ids=["mlc_stages", "one_stage"])
def test_recognises_mlcs_awq_form(transposes):
    func = _awq(512, 1024, transposes=transposes)
    desc = analyze_matmul(func, dequant=True)
    ops, d = desc.operands, desc.operands.dequant
    assert (ops.n, ops.k, int(ops.m), ops.b_layout) == (512, 1024, 1, "NT")
    assert (d.bits, d.per_word, d.group, d.zero, d.layout, d.dtype) == (4, 8, 128, 0.0, "KN_N", "float16")
    assert d.places == AWQ_PLACES
    params = {p.name: p for p in func.params}
    assert d.packed.same_as(params["qweight"]) and d.zeros.same_as(params["qzeros"]) and d.scale.same_as(params["scales"])
    want = ("compute", "T_transpose", "compute_1", "T_transpose_1", "T_transpose_2", "dequantize")
    assert d.stages == (want if transposes else ("dequantize",)) and desc.epilogue_stages == ("compute1",)
    assert not d.nk_in_order


def test_mlcs_group_schemes_stay_in_order():
    from fuselight.quant_prim_funcs import q4_linear

    for layout in ("NK", "KN"):
        d = analyze_matmul(q4_linear(256, 512, layout=layout), dequant=True).operands.dequant
        assert d.places == tuple(range(8)) and d.zeros is None and d.nk_in_order == (layout == "NK")


@pytest.mark.parametrize("n,k", [(24, 384), (40, 640)], ids=["3_groups_3_words", "5_groups_5_words"])
def test_the_description_reproduces_the_function(n, k):
    """Odd group and word counts: a float64 dequantize driven by the description (places, group,
    layout, which buffer is which) against the unscheduled function, run on the CPU."""
    func = _awq(n, k)
    d = analyze_matmul(func, dequant=True).operands.dequant
    rng = np.random.default_rng(5)
    q = rng.integers(0, 2**32, size=(k, n // 8), dtype=np.uint64).astype(np.uint32)
    z = rng.integers(0, 2**32, size=(k // 128, n // 8), dtype=np.uint64).astype(np.uint32)
    s = rng.uniform(0.5, 1.5, size=(k // 128, n)).astype(np.float16) / 16
    x = rng.standard_normal((1, 1, k)).astype(np.float16)
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.zeros((1, 1, n), np.float16))
    lib["main"](*(tvm.runtime.tensor(a) for a in (x, q, z, s)), out)
    want = x.astype(np.float64)[0, 0] @ _dequantize_from(d, q, z, s).T
    got = out.numpy().astype(np.float64)[0, 0]
    assert np.abs(want).max() > 1  # not a test on zeros
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


# ---- what it rejects ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,kwargs",
    [
        # Zero points laid out otherwise: one word a group, another group than the scales', packed
        # along K, or read in another order than the weight's values.
        ("zeros_one_word_a_group", dict(zero_at=lambda zp, n, k: _nib(zp[k // 128, 0], _awq_shift(n)), transposes=False)),
        ("zeros_group_256", dict(zero_at=lambda zp, n, k: _nib(zp[k // 256, n // 8], _awq_shift(n)), transposes=False)),
        ("zeros_along_k", dict(zero_at=lambda zp, n, k: _nib(zp[k // 128, n // 8], tirx.Cast("uint32", k % 8 * 4)),
                               transposes=False)),
        ("zeros_in_order", dict(zero_shift=lambda n: tirx.Cast("uint32", n % 8 * 4))),
        # Not a permutation of a word's places.
        ("places_repeat", dict(shift=lambda n: tirx.Cast("uint32", n % 2 * 16 + n % 8 // 4 * 4))),
        # Non-affine forms.
        ("scale_squared", dict(value=lambda w, z, s: (w - z) * s * s)),
        ("zero_after_scale", dict(value=lambda w, z, s: w * s - z)),
        ("zero_squared", dict(value=lambda w, z, s: (w - z * z) * s)),
        ("plus_zero", dict(value=lambda w, z, s: (w + z) * s)),
        # A group that does not divide K (3 scales for K = 320).
        ("group_not_dividing_k", dict(group=128, transposes=False)),
    ],
)
def test_rejects_the_near_misses(name, kwargs):
    k = 320 if name == "group_not_dividing_k" else 512
    assert analyze_matmul(_awq(64, k, **kwargs), dequant=True) is None, name


def test_rejects_a_zero_point_buffer_beside_words_along_k():
    # An NK weight with AWQ-style packed zero points: no known layout.
    from fuselight.quant_prim_funcs import q4_linear

    assert analyze_matmul(q4_linear(64, 512, layout="NK"), dequant=True) is not None  # the control
    i64 = "int64"
    n, k = 64, 512
    q = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // 8)), "uint32", name="q")
    zp = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // 128 // 8 + 1)), "uint32", name="z")
    s = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // 128)), "float16", name="s")
    x = te.placeholder((tirx.IntImm(i64, 1), tirx.IntImm(i64, k)), "float16", name="x")

    def u32(e):
        return tirx.Cast("uint32", e)

    w = te.compute((n, k), lambda i, j: (_nib(q[i, j // 8], u32(j % 8 * 4)) - _nib(zp[i, j // 1024], u32(j // 128 % 8 * 4)))
                   * s[i, j // 128])
    r = te.reduce_axis((0, k), name="k")
    mm = te.compute((1, n), lambda b, i: te.sum(tirx.Cast("float32", x[b, r]) * tirx.Cast("float32", w[i, r]), axis=r))
    assert analyze_matmul(te.create_prim_func([q, zp, s, x, mm]), dequant=True) is None


# ---- the rules decline it -------------------------------------------------------------------


def test_only_the_column_template_takes_awq(cuda):
    from fuselight.quant_prim_funcs import q4_linear

    # The row GEMV, the mma GEMV, the GEMM (mma.sync / wgmma plans) each take q4f16_1's form and
    # decline AWQ's; at M = 1 the Gemv rule takes AWQ with the column template
    # (tests/rules/gemm/test_gemv_cols.py), above it DLight keeps it.
    for m, rule in ((1, Gemv), (7, Gemv), (512, Matmul)):
        assert rule.takes(q4_linear(4096, 4096, m=m).with_attr("target", cuda), cuda)  # the control
        func = _awq(4096, 4096, m=m).with_attr("target", cuda)
        assert analyze_matmul(func, dequant=True) is not None
        assert (Gemv().apply(func, cuda, False) is not None) == (m == 1) and Gemv.takes(func, cuda) == (m == 1)
        assert Matmul().apply(func, cuda, False) is None and not Matmul.takes(func, cuda)
    ops = analyze_matmul(_awq(4096, 4096), dequant=True).operands
    with pytest.raises(FuselightError, match="KN_N.*zero points a buffer"):
        gemv.check_dequant(ops, ROWS)


def test_the_templates_decline_words_along_k_out_of_order(cuda):
    """NK words with AWQ's order of values: recognised (places), and every template declines it, since
    they convert values in place order (this would be a wrong answer, not a slow one)."""
    from fuselight.quant_prim_funcs import q4_linear

    i64 = "int64"
    n, k = 4096, 4096
    q = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // 8)), "uint32", name="q")
    s = te.placeholder((tirx.IntImm(i64, n), tirx.IntImm(i64, k // 32)), "float16", name="s")
    x = te.placeholder((tirx.IntImm(i64, 1), tirx.IntImm(i64, k)), "float16", name="x")
    w = te.compute((n, k), lambda i, j: (_nib(q[i, j // 8], _awq_shift(j)) - tirx.const(7, "float16")) * s[i, j // 32])
    r = te.reduce_axis((0, k), name="k")
    mm = te.compute((1, n), lambda b, i: te.sum(tirx.Cast("float32", x[b, r]) * tirx.Cast("float32", w[i, r]), axis=r))
    out = te.compute((1, n), lambda b, i: tirx.Cast("float16", mm[b, i]))
    func = te.create_prim_func([q, s, x, out]).with_attr("target", cuda)
    d = analyze_matmul(func, dequant=True).operands.dequant
    assert (d.layout, d.places) == ("NK", AWQ_PLACES) and not d.nk_in_order
    assert Gemv().apply(func, cuda, False) is None and Matmul().apply(func, cuda, False) is None
    assert Gemv().apply(q4_linear(n, k).with_attr("target", cuda), cuda, False) is not None  # the control
