"""The decode GEMV sweep probe's host-side pieces (``bench/probes/gemv_decode_sweep.py``): its variant
enumeration and pruning, its float64 reference against a hand computation and against the functions
themselves (tiny-llama's decode GEMVs, run on the CPU), the error measure and its command line. Its
GPU run needs a GPU (the lead's host)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from fuselight import config
from fuselight.device import require_device
from fuselight.model.weights import hf_config
from fuselight.quantization import pack

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "probes"))
import gemv_decode_sweep as probe  # noqa: E402

SMS = 132
# (out_n, K) of the decode GEMVs: SmolLM2-135M, Llama-3.2-1B, Llama-3-8B (gate_up: paired, N / 2)
SHAPES = [(576, 576), (576, 1536), (960, 576), (1536, 576), (49152, 576), (2048, 2048), (2048, 8192), (3072, 2048),
          (8192, 2048), (128256, 2048), (4096, 4096), (4096, 14336), (6144, 4096), (14336, 4096), (128256, 4096)]


def _f16(a):
    return np.asarray(a, dtype=np.float64).astype(np.float16).astype(np.float64)


@pytest.mark.parametrize("out_n,k", SHAPES)
def test_variants_fit_and_are_pruned(out_n, k):
    found = probe.variants(out_n, k, 2, SMS)
    assert 10 <= len(found) <= 40, len(found)
    names = [probe.variant_name(c) for c in found]
    assert len(set(names)) == len(names)
    steps = -(-k * 2 // probe.ROW_BYTES)
    for c in found:
        grid_per_sm = -(-(-(-out_n // (c["warps"] * c["rows_per_warp"]))) // SMS)
        assert c["warps"] * 32 * c["min_blocks_per_sm"] <= 2048
        assert c["min_blocks_per_sm"] <= max(1, grid_per_sm)
        assert (1 + c["double_buffer"]) * c["unroll"] * c["rows_per_warp"] <= probe.MAX_ROWS_IN_FLIGHT
        assert not c["double_buffer"] or -(-steps // c["unroll"]) >= 2  # a second round to overlap
        assert c["prefetch_l2_percent"] is None


def test_variants_of_a_small_grid_keep_few_warps_and_a_large_grid_many():
    # SmolLM2's o_proj (576 columns, 36 blocks of 16 rows): 2-warp blocks stay (the grid can fill
    # SMs only with small blocks); its LM head (49152 columns) keeps only 32+ resident warps an SM.
    small = probe.variants(576, 576, 2, SMS)
    assert {c["warps"] for c in small} == {2, 4, 8, 16}
    large = probe.variants(49152, 576, 2, SMS)
    assert all(c["warps"] * c["min_blocks_per_sm"] >= 32 for c in large)
    assert min(c["warps"] for c in large) == 8
    # K 576 is 2.25 steps of 512 bytes: no unroll past 4, double buffering only with unroll 2
    assert {c["unroll"] for c in small} == {2, 4}
    assert all(c["unroll"] == 2 for c in small if c["double_buffer"])
    # the shipped m1_256 config is among the 1B QKV's (3072 columns, K 2048) without its prefetch
    qkv = probe.variants(3072, 2048, 2, SMS)
    assert {"warps": 16, "rows_per_warp": 1, "unroll": 4, "min_blocks_per_sm": 1, "double_buffer": False,
            "prefetch_l2_percent": None} in qkv


def test_reduced_variants_are_a_subset():
    full = probe.variants(6144, 4096, 2, SMS)
    reduced = probe.variants(6144, 4096, 2, SMS, reduced=True)
    assert reduced and all(c in full for c in reduced) and len(reduced) < len(full)
    assert {c["warps"] for c in reduced} <= set(probe.REDUCED["warps"])


def test_variant_name():
    cfg = {"warps": 16, "rows_per_warp": 2, "unroll": 4, "min_blocks_per_sm": 3, "double_buffer": True,
           "prefetch_l2_percent": 25}
    assert probe.variant_name(cfg) == "w16_r2_u4_b3_db_pf25"
    assert probe.variant_name({**cfg, "double_buffer": False, "prefetch_l2_percent": None}) == "w16_r2_u4_b3"


def _desc(**kw):
    return {"norm": False, "eps": None, "paired": False, "dtype": "float16", "out_dtype": "float16", **kw}


def test_reference_norm_residual_paired_by_hand():
    rng = np.random.default_rng(0)
    k, i = 7, 3
    x, r = rng.standard_normal(k), rng.standard_normal(k)
    nw = 1 + 0.01 * rng.standard_normal(k)
    w = rng.standard_normal((2 * i, k)) / np.sqrt(k)
    got = probe.reference(_desc(norm=True, eps=1e-5, paired=True),
                          {"x": x.reshape(1, 1, k), "residual": r.reshape(1, 1, k), "norm_weight": nw, "weight": w})
    total = _f16(x + r)
    normed = _f16(total / np.sqrt(np.mean(total**2) + 1e-5) * nw)
    y = w @ normed
    gate, up = _f16(y[:i]), _f16(y[i:])
    np.testing.assert_array_equal(got["total"], total)
    np.testing.assert_allclose(got["out"], _f16(gate / (1 + np.exp(-gate)) * up), rtol=1e-3)
    # the up rows follow the gate rows: swapping the halves changes the output
    swapped = probe.reference(_desc(norm=True, eps=1e-5, paired=True),
                              {"x": x, "residual": r, "norm_weight": nw, "weight": np.vstack([w[i:], w[:i]])})
    assert not np.allclose(swapped["out"], got["out"])


def test_reference_plain_residual_epilogue_and_float32_out():
    rng = np.random.default_rng(1)
    x, w, r = rng.standard_normal(5), rng.standard_normal((4, 5)), rng.standard_normal(4)
    plain = probe.reference(_desc(), {"x": x, "weight": w})
    assert set(plain) == {"out"}
    np.testing.assert_array_equal(plain["out"], _f16(w @ x))
    added = probe.reference(_desc(), {"x": x, "weight": w, "out_residual": r})
    np.testing.assert_array_equal(added["out"], _f16(_f16(w @ x) + r))
    wide = probe.reference(_desc(norm=True, eps=1e-5, out_dtype="float32"), {"x": x, "norm_weight": np.ones(5), "weight": w})
    normed = _f16(x / np.sqrt(np.mean(x**2) + 1e-5))
    np.testing.assert_allclose(wide["out"], (w @ normed).astype(np.float32), rtol=1e-6)


def test_rel_error():
    ref = np.array([3.0, -4.0])
    assert probe.rel_error(np.array([3.0, -4.5]), ref) == pytest.approx(0.5 / 5)
    assert probe.rel_error(ref, ref) == 0.0


def _tiny_q4():
    """tiny-llama at hidden 1024 (so the norm fuses into the GEMVs) with whole 4-bit groups, q4f16_1."""
    raw = {**hf_config(config.load("tiny-llama")), "hidden_size": 1024, "intermediate_size": 2816,
           "num_attention_heads": 8, "num_key_value_heads": 2}
    return config.from_dict(raw, name="tiny-q").with_quantization("q4f16_1")


@pytest.mark.parametrize("quantized", [False, True], ids=["fp16", "q4f16_1"])
def test_reference_computes_what_the_model_functions_do(quantized):
    # tiny-llama's decode GEMVs as the pipeline hands them to the rules (4-bit: fused with their
    # dequantize), run on the CPU in fp16 (the unscheduled functions), against the reference from
    # their descriptions.
    import tvm
    from fuselight.target import resolve, to_tvm

    target = to_tvm(resolve("cuda", "sm_90"))
    funcs = probe.decode_gemvs(_tiny_q4(), target) if quantized else probe.decode_gemvs("tiny-llama", target)
    descs = {name: probe.describe(f, "q4f16_1" if quantized else None) for name, f in funcs.items()}
    assert any(d["paired"] for d in descs.values()) and any(d["norm"] and not d["paired"] for d in descs.values())
    assert any(not d["norm"] for d in descs.values()) and any(d["out_dtype"] == "float32" for d in descs.values())
    for d in descs.values():  # 4-bit: packed words [N, K / 8] and a scale a group of 32, both streamed
        roles = {p["role"]: p for p in d["params"]}
        assert ("scale" in roles) == quantized
        if quantized:
            assert roles["weight"]["shape"] == [d["n"], d["k"] // 8] and roles["weight"]["dtype"] == "uint32"
            assert roles["scale"]["shape"] == [d["n"], d["k"] // 32]
            assert d["weight_bytes"] == d["n"] * d["k"] // 2 + d["n"] * d["k"] // 32 * 2
    rng = np.random.default_rng(2)
    for name, func in funcs.items():
        d = descs[name]
        lib = tvm.compile(tvm.IRModule({"main": func.without_attr("target").with_attr("global_symbol", "main")}),
                          target="llvm")
        inputs, args = {}, []
        for p in d["params"]:
            if quantized and p["role"] == "weight":  # random words, none zero
                a = rng.integers(1, 2**32, p["shape"], dtype=np.uint64).astype(np.uint32)
            elif quantized and p["role"] == "scale":  # as the q4 probes draw them
                a = (rng.random(p["shape"]) * 0.018 + 0.002).astype(p["dtype"])
            else:
                scale = {"weight": 1 / np.sqrt(d["k"]), "norm_weight": 0.01}.get(p["role"], 1.0)
                a = (rng.standard_normal(p["shape"]) * scale + (p["role"] == "norm_weight")).astype(p["dtype"])
            if p["role"] not in ("out", "total"):
                inputs[p["role"]] = a
            args.append(tvm.runtime.tensor(a))
        lib["main"](*args)
        got = {p["role"]: args[i].numpy() for i, p in enumerate(d["params"])}
        for role, want in probe.reference(d, inputs).items():
            assert probe.rel_error(got[role], want) < 2e-3, (name, role)


def test_q4_reference_by_hand():
    # 2 rows of K 64 (two groups): words packed value e in bits 4e.., weight (e - 7) * scale rounded to fp16
    rng = np.random.default_rng(3)
    values = rng.integers(0, 16, (2, 64))
    scale = (rng.random((2, 2)) * 0.018 + 0.002).astype(np.float16)
    x = rng.standard_normal(64)
    w = _f16((values - 7) * np.repeat(scale.astype(np.float64), 32, axis=1))
    got = probe.reference(_desc(quantization="q4f16_1"), {"x": x, "weight": pack(values), "scale": scale})
    np.testing.assert_array_equal(got["out"], _f16(w @ x))
    assert np.abs(got["out"]).max() > 0.01
    # value e sits in bits 4e..4e+3 of its word: the words with their nibbles reversed compute another row
    flipped = probe.reference(_desc(quantization="q4f16_1"), {"x": x, "weight": pack(values[:, ::-1].copy())[:, ::-1].copy(),
                                                             "scale": scale})
    assert not np.allclose(flipped["out"], got["out"])


# (out_n, K) of Llama-3-8B's decode GEMVs with 4-bit weights: o_proj, down, QKV, gate_up (paired), LM head
Q4_SHAPES = [(4096, 4096), (4096, 14336), (6144, 4096), (14336, 4096), (128256, 4096), (384, 1024)]


@pytest.mark.parametrize("out_n,k", Q4_SHAPES)
def test_q4_variants_fit_and_are_pruned(out_n, k):
    found = probe.variants(out_n, k, 0.5, SMS, quantized=True)
    assert 10 <= len(found) <= 45, len(found)
    names = [probe.variant_name(c) for c in found]
    assert len(set(names)) == len(names) and all(n.endswith("_hs") for n in names)
    sm = require_device("sm_90")
    steps = -(-k // 1024)  # a 512-byte step of a 4-bit row holds 1024 values
    for c in found:
        assert c["half_sums"] is True and c["prefetch_l2_percent"] is None
        assert c["warps"] * 32 * c["min_blocks_per_sm"] * probe.Q4_MIN_REGISTERS <= sm.regs_per_sm
        in_flight = (1 + c["double_buffer"]) * c["unroll"] * c["rows_per_warp"]
        assert probe.MIN_ROWS_IN_FLIGHT <= in_flight <= probe.MAX_ROWS_IN_FLIGHT
        assert not c["double_buffer"] or -(-steps // c["unroll"]) >= 2
    # unroll 4 needs 3+ steps (K 1024 is one); every rows_per_warp stays
    assert {c["unroll"] for c in found} == ({1, 2, 4} if steps > 2 else {1, 2})
    assert {c["rows_per_warp"] for c in found} == {1, 2, 4}


def test_q4_variants_keep_the_shipped_settings_and_the_fp16_sweep_is_unchanged():
    # gemv_q4.json's m1_k4096 (QKV, gate_up, LM head) and m1 (down) settings, half sums on
    m1_k4096 = {"warps": 8, "rows_per_warp": 2, "unroll": 4, "min_blocks_per_sm": 3, "double_buffer": False,
                "prefetch_l2_percent": None, "half_sums": True}
    for out_n in (6144, 14336, 128256):
        assert m1_k4096 in probe.variants(out_n, 4096, 0.5, SMS, quantized=True)
    # large grids: 24-32 resident warps an SM (the register bound above, the shipped 8 x 3 below)
    head = probe.variants(128256, 4096, 0.5, SMS, quantized=True)
    assert {c["warps"] * c["min_blocks_per_sm"] for c in head} == {24, 32}
    down = probe.variants(4096, 14336, 0.5, SMS, quantized=True)
    assert {"warps": 8, "rows_per_warp": 2, "unroll": 2, "min_blocks_per_sm": 2, "double_buffer": True,
            "prefetch_l2_percent": None, "half_sums": True} in down
    assert all("half_sums" not in c for c in probe.variants(6144, 4096, 2, SMS))
    assert probe.MAX_WARPS_PER_SM == require_device("sm_90").max_threads_per_sm // 32


def test_extra_configs():
    shipped = {"warps": 8, "rows_per_warp": 2, "unroll": 4, "min_blocks_per_sm": 2, "double_buffer": False,
               "prefetch_l2_percent": 25, "half_sums": True}
    names = {probe.variant_name(c) for c in probe.extra_configs(shipped)}
    assert names == {"w8_r2_u4_b2_pf25", "w8_r2_u4_b2_hs", "w8_r2_u4_b2"}
    assert [probe.variant_name(c) for c in probe.extra_configs({**shipped, "prefetch_l2_percent": None})] == ["w8_r2_u4_b2"]
    fp16 = {k: v for k, v in shipped.items() if k != "half_sums"}
    assert [probe.variant_name(c) for c in probe.extra_configs(fp16)] == ["w8_r2_u4_b2"]
    assert probe.extra_configs({**fp16, "prefetch_l2_percent": None}) == []


def test_command_line():
    a = probe.parse_args(["build", "out", "--model", "smollm2-135m", "llama-3.2-1b"])
    assert (a.cmd, a.model, a.reduced) == ("build", ["smollm2-135m", "llama-3.2-1b"], [])
    assert a.quantization is None
    q = probe.parse_args(["build", "out", "--model", "llama-3-8b", "--quantization", "q4f16_1"])
    assert (q.model, q.quantization) == (["llama-3-8b"], "q4f16_1")
    assert probe.manifest_key("llama-3-8b", "q4f16_1") == "llama-3-8b-q4f16_1"
    assert probe.parse_args(["run", "m.json", "-o", "x.json", "--models", "llama-3-8b-q4f16_1"]).models == ["llama-3-8b-q4f16_1"]
    with pytest.raises(SystemExit):
        probe.parse_args(["build", "out", "--quantization", "q3f16_1"])
    assert probe.parse_args(["build", "out"]).model == list(probe.MODELS)
    r = probe.parse_args(["run", "m.json", "-o", "x.json", "--models", "llama-3-8b"])
    assert (r.cmd, str(r.output), r.models) == ("run", "x.json", ["llama-3-8b"])
    with pytest.raises(SystemExit):
        probe.parse_args(["build", "out", "--model", "llama-70b"])
    with pytest.raises(SystemExit):
        probe.parse_args(["run", "m.json"])  # -o is required


def _func(k, bucket, max_blocks, times, correct=True):
    cfgs = {"w16_r1_u4_b1": {"warps": 16, "rows_per_warp": 1, "unroll": 4, "min_blocks_per_sm": 1,
                             "double_buffer": False, "prefetch_l2_percent": None},
            "w8_r1_u8_b2_db": {"warps": 8, "rows_per_warp": 1, "unroll": 8, "min_blocks_per_sm": 2,
                               "double_buffer": True, "prefetch_l2_percent": None}}
    kernels = {"shipped": {"chained_us": times[0], "isolated_us": times[0] + 1, "correct": True}}
    for (name, cfg), t in zip(cfgs.items(), times[1:]):
        kernels[name] = {"config": cfg, "chained_us": t, "isolated_us": t + 1, "correct": correct}
    return {"n": 64, "k": k, "out_n": 64, "grid_blocks": 4, "bucket": bucket, "bucket_max_blocks": max_blocks,
            "weight_bytes": 64 * k * 2, "norm": False, "paired": False, "kernels": kernels}


def test_suggest_takes_the_best_geomean_per_k_and_bucket(capsys):
    results = {"models": {"m": {
        "qkv": _func(2048, "m1_256_k4096", 256, [10.0, 9.0, 8.0]),
        "o_proj": _func(2048, "m1_256_k4096", 256, [6.0, 5.0, 5.5]),   # geomean: 8/8, 5.5/5 beats 9/8, 5/5
        "gate_up": _func(2048, "m1", None, [30.0, 29.0, 31.0]),
        "down": _func(8192, "m1_256", 256, [12.0, 11.0, 13.0], correct=False),  # nothing correct: no suggestion
    }}}
    got = probe.suggest(results)
    assert set(got) == {"m/k2048/m1_256_k4096", "m/k2048/m1"}
    small = got["m/k2048/m1_256_k4096"]
    assert small["bucket"] == {"max_m": 1, "max_blocks": 256, "max_k": 2048, "warps": 8, "rows_per_warp": 1, "unroll": 8,
                               "min_blocks_per_sm": 2, "double_buffer": True}
    assert small["geomean_vs_best"] == pytest.approx(np.sqrt(1.0 * 5.5 / 5))
    assert got["m/k2048/m1"]["bucket"]["warps"] == 16 and "max_blocks" not in got["m/k2048/m1"]["bucket"]
    results["suggested_buckets"] = got
    probe.print_table(results, 3000.0)
    out = capsys.readouterr().out
    assert "NOT CORRECT or failed: w16_r1_u4_b1, w8_r1_u8_b2_db" in out
    assert '"max_k": 2048' in out
