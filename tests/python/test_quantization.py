"""The 4-bit group schemes' layout and arithmetic (``fuselight.quantization``), against values
computed here by hand, not by the module."""

from __future__ import annotations

import numpy as np
import pytest
from fuselight.errors import FuselightError
from fuselight.quantization import SCHEMES, dequantize, pack, quantize, random_quantized, scheme, unpack


def test_pack_puts_element_e_in_bits_4e():
    values = np.array([[1, 2, 3, 4, 5, 6, 7, 15]], dtype=np.uint32)
    word = sum(int(v) << (4 * e) for e, v in enumerate(values[0]))
    assert pack(values).tolist() == [[word]]
    rng = np.random.default_rng(3)
    many = rng.integers(0, 16, size=(5, 40))
    np.testing.assert_array_equal(unpack(pack(many)), many)


@pytest.mark.parametrize("name", sorted(n for n, s in SCHEMES.items() if not s.zero_points))
def test_quantize_round_trip_within_half_a_step(name):
    s = SCHEMES[name]
    rng = np.random.default_rng(7)
    w = rng.standard_normal((9, 3 * s.group_size))  # an odd number of rows, three groups
    q, scale = quantize(w, s)
    assert (q.shape, scale.shape) == s.packed_shapes(9, 3 * s.group_size)
    back = dequantize((q, scale), s)
    step = np.repeat(np.abs(w).reshape(9, 3, s.group_size).max(-1) / 7, s.group_size, axis=1)
    assert np.all(np.abs(back - w) <= step / 2 + 1e-12)
    # The group's largest magnitude is stored exactly (q = 0 or 14 after the shift of 7).
    i = np.abs(w).reshape(9, 3, s.group_size).argmax(-1)
    rows, groups = np.indices(i.shape)
    top = (groups * s.group_size + i)
    np.testing.assert_allclose(np.abs(back[rows, top]), np.abs(w[rows, top]), rtol=1e-6)  # scales in float32


def test_unknown_scheme_and_bad_shapes_are_errors():
    assert scheme(None) is None and scheme("q0f16") is None
    with pytest.raises(FuselightError, match="unsupported quantization 'q3f16_1'"):
        scheme("q3f16_1")
    with pytest.raises(FuselightError, match="K a multiple of 32"):
        quantize(np.ones((4, 48)), SCHEMES["q4f16_1"])


def test_awq_layout_by_hand():
    """AWQ (q4f16_autoawq): W[n, k] = (q - zero) * scale with q in qweight[k, n // 8] at place
    (0, 4, 1, 5, 2, 6, 3, 7)[n % 8] of the word, zero alike in qzeros[k // 128, n // 8], scales[k // 128, n]."""
    s = SCHEMES["q4f16_autoawq"]
    assert (s.group_size, s.quantize_embedding, s.quantize_lm_head) == (128, False, False)
    n, k = 16, 256
    assert s.packed_shapes(n, k) == ((k, 2), (2, 2), (2, n))
    rng = np.random.default_rng(11)
    values = rng.integers(0, 16, size=(n, k))
    zeros = rng.integers(0, 16, size=(n, 2))
    scale = rng.uniform(0.5, 1.5, size=(n, 2))
    places = [0, 4, 1, 5, 2, 6, 3, 7]
    q = np.zeros((k, 2), np.uint32)
    z = np.zeros((2, 2), np.uint32)
    for nn in range(n):
        for kk in range(k):
            q[kk, nn // 8] |= np.uint32(values[nn, kk]) << np.uint32(4 * places[nn % 8])
        for g in range(2):
            z[g, nn // 8] |= np.uint32(zeros[nn, g]) << np.uint32(4 * places[nn % 8])
    want = (values - np.repeat(zeros, 128, axis=1)) * np.repeat(scale, 128, axis=1)
    np.testing.assert_array_equal(dequantize((q, z, scale.T), s), want)
    # quantize stores that layout: its words unpack, by the hand-made places, to its own dequantize.
    w = rng.standard_normal((n, k))
    stored = quantize(w, s)
    assert tuple(a.shape for a in stored) == s.packed_shapes(n, k)
    back = dequantize(stored, s)
    step = np.repeat((w.reshape(n, 2, 128).max(-1) - w.reshape(n, 2, 128).min(-1)) / 15, 128, axis=1)
    assert np.all(np.abs(back - w) <= step * 0.51 + 1e-9)  # asymmetric: half a step, the zero rounded too
    # Random stored weights: values whose RMS is the asked std, zero points 7 or 8.
    stored = random_quantized(rng, 64, 512, 0.02, s)
    assert abs(np.sqrt(np.mean(dequantize(stored, s) ** 2)) / 0.02 - 1) < 0.05
    zero_nibbles = (stored[1][..., None] >> (np.arange(8, dtype=np.uint32) * 4)) & 15
    assert set(np.unique(zero_nibbles)) == {7, 8}
    with pytest.raises(FuselightError, match="N a multiple of 8"):
        quantize(np.ones((12, 256)), s)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_torch_quantize_stores_what_numpy_reads(name):
    """The benchmarks' torch quantize (on the GPU there) in each scheme's layout: numpy's float64
    dequantize of its words and scales is torch's dequantize, and within a step of the weight."""
    torch = pytest.importorskip("torch")
    from fuselight.quantization import dequantize_torch, quantize_torch

    s = SCHEMES[name]
    rng = np.random.default_rng(13)
    w = torch.tensor(rng.standard_normal((24, 3 * s.group_size)) * 0.05, dtype=getattr(torch, s.model_dtype))
    stored = quantize_torch(w, s)
    assert tuple(tuple(t.shape) for t in stored) == s.packed_shapes(24, 3 * s.group_size)
    ours = dequantize(tuple(t.view(torch.int32).numpy().view(np.uint32) if t.dtype == torch.uint32
                            else t.float().numpy() for t in stored), s)
    theirs = dequantize_torch(stored, s).double().numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-2, atol=1e-6)  # torch rounds the product to dtype
    assert np.abs(ours - w.double().numpy()).max() < 0.05 * 4 / 7
