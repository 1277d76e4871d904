"""The persistent-decode probe's host-side pieces (``bench/probes/persistent_decode.py``): its float64
reference of a decode layer's GEMV block against a hand computation, the error measure, its cases and
plans, the ptxas report it reads, and its command line. Its GPU run needs a GPU (the lead's host)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "probes"))
import persistent_decode as probe  # noqa: E402


def _f16(a):
    return np.asarray(a, dtype=np.float64).astype(np.float16).astype(np.float64)


def test_reference_of_identity_weights_is_the_block_by_hand():
    # Identity weights (gate = up = the normed row) leave the block's arithmetic visible.
    rng = np.random.default_rng(0)
    k = 8
    x, h = rng.standard_normal(k), rng.standard_normal(k)
    eye = np.eye(k)
    layer = {"x": x.reshape(1, 1, k), "h": h.reshape(1, 1, k), "wo": eye, "wgu": np.vstack([eye, eye]), "wd": eye,
             "wqkv": eye, "norm2": np.ones(k), "norm1": np.full(k, 2.0)}
    out = probe.reference(layer, 1e-5, 4)
    h1 = _f16(_f16(x) + _f16(h))
    n = _f16(h1 / np.sqrt(np.mean(h1**2) + 1e-5))
    act = _f16(n / (1 + np.exp(-n)) * n)
    h2 = _f16(act + h1)
    qkv = _f16(2 * h2 / np.sqrt(np.mean(h2**2) + 1e-5))
    for name, want in {"h1": h1, "act": act, "h2": h2, "qkv": qkv}.items():
        np.testing.assert_allclose(out[name], want, rtol=1e-3, atol=1e-3, err_msg=name)
    assert set(probe.reference(layer, 1e-5, 3)) == {"h1", "act", "h2"}


def test_reference_uses_each_weight():
    # A random layer: changing one weight changes exactly the outputs after it.
    rng = np.random.default_rng(1)
    hid, inter, qkv = 16, 24, 20
    layer = {"x": rng.standard_normal((1, 1, hid)), "h": rng.standard_normal((1, 1, hid)),
             "wo": rng.standard_normal((hid, hid)) / 4, "wgu": rng.standard_normal((2 * inter, hid)) / 4,
             "wd": rng.standard_normal((hid, inter)) / 5, "wqkv": rng.standard_normal((qkv, hid)) / 4,
             "norm2": 1 + 0.1 * rng.standard_normal(hid), "norm1": 1 + 0.1 * rng.standard_normal(hid)}
    base = probe.reference(layer, 1e-5, 4)
    assert [base[k].shape for k in probe.NAMES] == [(hid,), (inter,), (hid,), (qkv,)]
    changed = probe.reference({**layer, "wd": layer["wd"] * 1.5}, 1e-5, 4)
    assert np.array_equal(changed["h1"], base["h1"]) and np.array_equal(changed["act"], base["act"])
    assert not np.allclose(changed["h2"], base["h2"]) and not np.allclose(changed["qkv"], base["qkv"])


def test_errors_are_relative_to_the_reference():
    ref = np.array([1.0, -2.0, 4.0])
    errs = probe.errors(np.array([1.0, -2.0, 4.4]), ref)
    assert errs["max_rel"] == pytest.approx(0.4 / 4)
    assert errs["rel"] == pytest.approx(0.4 / np.sqrt(21))


def test_cases_cover_the_three_models_both_forms_and_q4_at_8b():
    cases = probe.case_names()
    assert len(cases) == 8
    assert {c["scheme"] for c in cases.values() if c["model"] == "llama-3-8b"} == {None, "q4f16_1"}
    smol = cases["smollm2-135m-fp16-mlp_qkv"]
    assert probe.stage_dims(smol) == [(576, 576), (3072, 576), (576, 1536), (960, 576)]
    assert probe.stage_dims(cases["smollm2-135m-fp16-mlp"])[-1] == (576, 1536)
    names = [probe.plan_name(p) for p in probe.PLANS["float"][1:]]
    assert len(set(names)) == len(names)


def test_parse_registers_reads_each_kernel():
    report = """ptxas info    : Compiling entry function 'a_kernel' for 'sm_90'
ptxas info    : Function properties for a_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 3328 bytes smem
ptxas info    : Compiling entry function 'b_kernel' for 'sm_90'
ptxas info    : Function properties for b_kernel
    24 bytes stack frame, 24 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 127 registers, used 1 barriers"""
    assert probe.parse_registers(report) == {"a_kernel": {"registers": 64, "spill_stores": 0},
                                             "b_kernel": {"registers": 127, "spill_stores": 24}}


def test_command_line(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(probe, "build", lambda out, cases: calls.append(("build", out, cases)))
    monkeypatch.setattr(probe, "run", lambda manifest, out, cases: calls.append(("run", manifest, out, cases)))
    probe.main(["build", str(tmp_path), "--cases", "smollm2-135m-fp16-mlp"])
    probe.main(["run", str(tmp_path / "manifest.json"), "-o", str(tmp_path / "o.json")])
    assert calls == [("build", tmp_path, ["smollm2-135m-fp16-mlp"]),
                     ("run", tmp_path / "manifest.json", tmp_path / "o.json", None)]
    with pytest.raises(SystemExit):
        probe.main(["run", str(tmp_path / "manifest.json")])  # -o is required
