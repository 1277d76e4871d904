"""The 4-bit group schemes' layout and arithmetic (``fuselight.quantization``), against values
computed here by hand, not by the module."""

from __future__ import annotations

import numpy as np
import pytest
from fuselight.errors import FuselightError
from fuselight.quantization import SCHEMES, dequantize, pack, quantize, scheme, unpack


def test_pack_puts_element_e_in_bits_4e():
    values = np.array([[1, 2, 3, 4, 5, 6, 7, 15]], dtype=np.uint32)
    word = sum(int(v) << (4 * e) for e, v in enumerate(values[0]))
    assert pack(values).tolist() == [[word]]
    rng = np.random.default_rng(3)
    many = rng.integers(0, 16, size=(5, 40))
    np.testing.assert_array_equal(unpack(pack(many)), many)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_quantize_round_trip_within_half_a_step(name):
    s = SCHEMES[name]
    rng = np.random.default_rng(7)
    w = rng.standard_normal((9, 3 * s.group_size))  # an odd number of rows, three groups
    q, scale = quantize(w, s)
    assert (q.shape, scale.shape) == s.packed_shapes(9, 3 * s.group_size)
    back = dequantize(q, scale, s)
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
