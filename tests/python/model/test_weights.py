"""Weights: random init, our safetensors reader/writer, Hugging Face checkpoints in and out."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import compare_with_reference, relative_error
from fuselight import FuselightError, config
from fuselight.model import weights as W
from reference_llama import ReferenceLlama

ml_dtypes = pytest.importorskip("ml_dtypes")


def _tiny(**overrides) -> config.ModelConfig:
    raw = W.hf_config(config.load("tiny-llama"))
    raw.update(overrides)
    # Named as the preset, so with no overrides it equals it and shares its compiled model.
    return config.from_dict(raw, name="tiny-llama")


def _tensors(dtype: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    # Odd sizes so data offsets are not multiples of 8; a scalar and an empty tensor as edge cases.
    shapes = {"a.weight": (3, 5), "b": (7,), "c": (), "d": (2, 0, 3), "e.f": (4, 3, 2)}
    if np_dtype.kind == "i":
        return {k: np.asarray(rng.integers(-(2**30), 2**30, s), dtype=np_dtype) for k, s in shapes.items()}
    return {k: np.asarray(rng.standard_normal(s) * 100, dtype=np_dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16", "float64", "int32", "int64"])
def test_safetensors_round_trip(tmp_path, dtype):
    tensors = _tensors(dtype, seed=len(dtype))
    W.write_safetensors(tmp_path / "t.safetensors", tensors)
    back = W.read_safetensors(tmp_path / "t.safetensors")
    assert list(back) == list(tensors)
    for name, arr in tensors.items():
        assert back[name].dtype == arr.dtype and back[name].shape == arr.shape
        assert back[name].tobytes() == arr.tobytes(), name
    raw = (tmp_path / "t.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert header_len % 8 == 0
    assert len(raw) == 8 + header_len + sum(a.nbytes for a in tensors.values())


def test_bf16_read_without_ml_dtypes(tmp_path, monkeypatch):
    tensors = _tensors("bfloat16", seed=1)
    W.write_safetensors(tmp_path / "t.safetensors", tensors)
    monkeypatch.setattr(W, "_BF16", None)
    back = W.read_safetensors(tmp_path / "t.safetensors")
    for name, arr in tensors.items():
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name], arr.astype(np.float32))


def test_interoperates_with_safetensors_library(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    ours = {**_tensors("float16", seed=2), **{f"i.{k}": v for k, v in _tensors("int64", seed=3).items()}}
    W.write_safetensors(tmp_path / "ours.safetensors", ours)
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    assert set(theirs) == set(ours)
    for name, arr in ours.items():
        np.testing.assert_array_equal(theirs[name], arr)
    st.save_file(ours, str(tmp_path / "theirs.safetensors"))
    back = W.read_safetensors(tmp_path / "theirs.safetensors")
    for name, arr in ours.items():
        assert back[name].dtype == arr.dtype
        np.testing.assert_array_equal(back[name], arr)


def test_read_rejects_a_non_safetensors_file(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(FuselightError, match="bad.safetensors: not a safetensors file"):
        W.read_safetensors(bad)


def _write_raw(path, header, data: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


_GOOD = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "header, match",
    [
        ([1, 2], "header is not a JSON object"),
        ({"w": {"shape": [2], "data_offsets": [0, 8]}}, "'w' has no 'dtype'"),
        ({"w": {"dtype": "F32", "data_offsets": [0, 8]}}, "'w' has no 'shape'"),
        ({"w": {"dtype": "F32", "shape": [2]}}, "'w' has no 'data_offsets'"),
        ({"w": "F32"}, "'w' has a header entry that is not a JSON object"),
        ({"w": {**_GOOD, "shape": "2"}}, "'w' has a bad shape"),
        ({"w": {**_GOOD, "data_offsets": [0]}}, "'w' has bad data_offsets"),
        ({"w": {**_GOOD, "dtype": "Q4"}}, "'w' has unsupported dtype 'Q4'"),
        ({"w": {**_GOOD, "dtype": 7}}, "'w' has a dtype that is not a string"),
        ({"w": {**_GOOD, "shape": [4], "data_offsets": [0, 16]}}, "'w' has inconsistent data_offsets"),
        ({"w": {**_GOOD, "dtype": "BF16", "shape": [8], "data_offsets": [0, 16]}}, "'w' has inconsistent"),
        ({"w": {**_GOOD, "data_offsets": [8, 16]}}, "'w' has inconsistent data_offsets"),
    ],
)
def test_read_rejects_damaged_files_naming_file_and_tensor(tmp_path, header, match):
    bad = tmp_path / "damaged.safetensors"
    _write_raw(bad, header, b"\0" * 8)
    with pytest.raises(FuselightError, match="damaged.safetensors: .*" + match):
        W.read_safetensors(bad)


def test_read_accepts_a_hand_written_file(tmp_path):
    good = tmp_path / "good.safetensors"
    _write_raw(good, {"w": _GOOD}, np.array([1.5, 2.5], "<f4").tobytes())
    np.testing.assert_array_equal(W.read_safetensors(good)["w"], [1.5, 2.5])


def test_random_weights_are_seeded_and_scaled():
    cfg = _tiny()
    a, b, c = W.random_weights(cfg, seed=0), W.random_weights(cfg, seed=0), W.random_weights(cfg, seed=1)
    assert [(n, w.shape) for n, w in a.items()] == W.param_names_and_shapes(cfg)
    for name, w in a.items():
        assert w.dtype == np.float32
        np.testing.assert_array_equal(w, b[name])
        assert not np.array_equal(w, c[name]), name
        std = W.init_std(name, cfg)
        if name.endswith("norm.weight"):
            assert not np.any(w == 1.0) and abs(float(w.mean()) - 1.0) < 4 * std / np.sqrt(w.size)
            continue
        assert abs(float(w.mean())) < 4 * std / np.sqrt(w.size), name
        assert abs(float(w.std()) / std - 1.0) < 0.1, name
    assert W.random_weights(cfg, seed=0, dtype="bfloat16")["model.norm.weight"].dtype == ml_dtypes.bfloat16
    with pytest.raises(FuselightError, match="unknown parameter 'lm_head.bias'"):
        W.init_std("lm_head.bias", cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_init_keeps_fp16_finite_through_32_layers(tied):
    # Llama-3-8B's depth and head layout at a small width: the float64 reference on fp16 weights
    # sees a residual stream and logits that fp16 holds with a wide margin.
    cfg = config.from_dict(
        dict(
            W.hf_config(config.load("llama-3-8b")),
            hidden_size=256,
            intermediate_size=896,
            head_dim=32,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=1000,
            tie_word_embeddings=tied,
        )
    )
    weights = W.random_weights(cfg, seed=0, dtype="float16")
    ref = ReferenceLlama(W.hf_config(cfg), W.to_hf_state(cfg, weights))
    logits = ref.prefill(np.random.default_rng(0).integers(0, cfg.vocab_size, 16))
    fp16_max = float(np.finfo(np.float16).max)
    assert ref.max_abs_hidden < fp16_max / 1000
    assert np.all(np.isfinite(logits)) and np.abs(logits).max() < fp16_max / 100
    assert 0.1 < np.sqrt(np.mean(logits**2)) < 100  # not collapsed to a constant either


def test_hf_checkpoint_round_trip_and_model_on_it(tmp_path, cpu_model):
    cfg = _tiny()
    assert cfg == config.load("tiny-llama")
    weights = W.random_weights(cfg, seed=11)
    W.save_hf_checkpoint(tmp_path, cfg, weights)
    assert dataclasses.replace(config.load(tmp_path), name=cfg.name) == cfg
    hf_state = W.read_safetensors(tmp_path / "model.safetensors")
    assert {n: a.shape for n, a in hf_state.items()} == W.hf_shapes(cfg)
    assert "model.layers.1.self_attn.k_proj.weight" in hf_state and "lm_head.weight" in hf_state
    loaded = W.load_hf_checkpoint(tmp_path, cfg)
    assert list(loaded) == list(weights)
    for name, w in weights.items():
        assert loaded[name].dtype == w.dtype
        np.testing.assert_array_equal(loaded[name], w)
    halved = W.load_hf_checkpoint(tmp_path, cfg, dtype="float16")
    np.testing.assert_array_equal(halved["model.norm.weight"], weights["model.norm.weight"].astype(np.float16))

    # The compiled model on the loaded weights against the reference on the HF files themselves.
    vm, device = cpu_model(cfg)
    rng = np.random.default_rng(11)
    prompt, decode_ids = rng.integers(0, cfg.vocab_size, 19), [int(t) for t in rng.integers(0, cfg.vocab_size, 3)]
    errors = compare_with_reference(vm, device, cfg, loaded, prompt, decode_ids, max_total_seq_len=64)
    assert max(errors) < 1e-4, errors
    ref = ReferenceLlama(json.loads((tmp_path / "config.json").read_text()), hf_state)
    direct = ReferenceLlama(W.hf_config(cfg), W.to_hf_state(cfg, weights))
    assert relative_error(ref.prefill(prompt), direct.prefill(prompt)) == 0.0


def test_sharded_and_tied_checkpoints(tmp_path):
    cfg = _tiny(tie_word_embeddings=True)
    weights = W.random_weights(cfg, seed=12)
    state = W.to_hf_state(cfg, weights)
    assert "lm_head.weight" not in state
    names = list(state)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for file, part in shards.items():
        W.write_safetensors(tmp_path / file, {n: state[n] for n in part})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = W.load_hf_checkpoint(tmp_path, cfg)
    for name, w in weights.items():
        np.testing.assert_array_equal(loaded[name], w)

    # A tied checkpoint may repeat the embedding as lm_head, but not carry a different one.
    embed = state["model.embed_tokens.weight"]
    second = tmp_path / "model-00002-of-00002.safetensors"
    W.write_safetensors(second, {n: state[n] for n in names[5:]} | {"lm_head.weight": embed})
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    np.testing.assert_array_equal(W.load_hf_checkpoint(tmp_path, cfg)["model.embed_tokens.weight"], embed)
    W.write_safetensors(second, {n: state[n] for n in names[5:]} | {"lm_head.weight": embed + 1})
    with pytest.raises(FuselightError, match="'lm_head.weight' differs from the embedding"):
        W.load_hf_checkpoint(tmp_path, cfg)


def _rewrite(tmp_path, edit) -> None:
    state = dict(W.read_safetensors(tmp_path / "model.safetensors"))
    edit(state)
    W.write_safetensors(tmp_path / "model.safetensors", state)


def test_checkpoint_errors_name_the_tensor(tmp_path):
    cfg = _tiny()
    W.save_hf_checkpoint(tmp_path, cfg, W.random_weights(cfg, seed=13))
    _rewrite(tmp_path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(FuselightError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        W.load_hf_checkpoint(tmp_path, cfg)

    W.save_hf_checkpoint(tmp_path, cfg, W.random_weights(cfg, seed=13))
    _rewrite(tmp_path, lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((3, 128), np.float32)}))
    wrong_shape = r"'model.layers.0.self_attn.k_proj.weight' has shape \(3, 128\), expected \(64, 128\)"
    with pytest.raises(FuselightError, match=wrong_shape):
        W.load_hf_checkpoint(tmp_path, cfg)

    W.save_hf_checkpoint(tmp_path, cfg, W.random_weights(cfg, seed=13))
    _rewrite(tmp_path, lambda s: s.update({"model.layers.2.mlp.up_proj.weight": np.ones((2, 2), np.float32)}))
    with pytest.raises(FuselightError, match=r"unexpected tensor 'model.layers.2.mlp.up_proj.weight'"):
        W.load_hf_checkpoint(tmp_path, cfg)

    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FuselightError, match="no model.safetensors"):
        W.load_hf_checkpoint(tmp_path, cfg)
    with pytest.raises(FuselightError, match="missing tensor 'model.norm.weight'"):
        W.to_hf_state(cfg, {k: v for k, v in W.random_weights(cfg).items() if k != "model.norm.weight"})


def test_reference_matches_transformers(tmp_path):
    # Validates the reference itself (RoPE layout, llama3 scaling, GQA) and that our checkpoint
    # writer produces files Hugging Face loads.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = _tiny()
    weights = W.random_weights(cfg, seed=14)
    W.save_hf_checkpoint(tmp_path, cfg, weights)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    ref = ReferenceLlama(W.hf_config(cfg), W.to_hf_state(cfg, weights))
    ids = np.random.default_rng(14).integers(0, cfg.vocab_size, 45)
    with torch.no_grad():
        hf_logits = hf(torch.from_numpy(ids)[None]).logits[0].numpy()
    ours = [ref.prefill(ids[:40])] + [ref.decode(int(t)) for t in ids[40:]]
    for step, logits in enumerate(ours):
        # HF computes the RoPE tables in float32 even for a float64 model: ~1e-7 apart.
        assert relative_error(logits, hf_logits[39 + step]) < 1e-6, step
