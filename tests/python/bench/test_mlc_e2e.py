"""``fuselight bench mlc-e2e``'s parts that need no MLC-LLM library: model info, weights, argument checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuselight.bench.mlc_e2e import model_info, random_weights, run_mlc_e2e
from fuselight.cli import main as cli_main
from fuselight.errors import FuselightError

HIDDEN, VOCAB, INTER = 64, 100, 96


def _metadata(dtype: str = "float16", hidden: int = HIDDEN, inter: int = INTER) -> dict:
    """MLC's ``_metadata`` for a 2-layer Qwen2-like model (biases on the fused QKV projection)."""
    params = [("model.embed_tokens.weight", [VOCAB, hidden])]
    for i in range(2):
        p = f"model.layers.{i}."
        params += [(p + "self_attn.c_attn.weight", [3 * hidden, hidden]), (p + "self_attn.c_attn.bias", [3 * hidden]),
                   (p + "self_attn.o_proj.weight", [hidden, hidden]), (p + "mlp.gate_up_proj.weight", [2 * inter, hidden]),
                   (p + "mlp.down_proj.weight", [hidden, inter]), (p + "input_layernorm.weight", [hidden]),
                   (p + "post_attention_layernorm.weight", [hidden])]
    # MLC leaves the vocabulary symbolic in its Llama, Mistral and Phi-3 heads.
    params += [("model.norm.weight", [hidden]), ("lm_head.weight", ["vocab_size", hidden])]
    return {"model_type": "qwen2", "prefill_chunk_size": 128,
            "params": [{"name": n, "shape": s, "dtype": dtype, "preprocs": []} for n, s in params]}


SIZES = {"vocab_size": VOCAB, "hidden_size": HIDDEN}


def test_model_info_from_mlc_metadata() -> None:
    info = model_info("qwen2", _metadata(), Path("lib.so"), SIZES)
    assert (info.hidden_size, info.vocab_size, info.dtype, info.num_layers) == (HIDDEN, VOCAB, "float16", 2)
    assert info.params[0] == ("model.embed_tokens.weight", (VOCAB, HIDDEN), "float16")
    assert info.params[-1] == ("lm_head.weight", (VOCAB, HIDDEN), "float16")
    assert info.quantization is None
    with pytest.raises(FuselightError, match="'lm_head.weight' has dimension 'vocab_size' and the library's metadata"):
        model_info("qwen2", _metadata(), Path("lib.so"))


def _phi3_metadata() -> dict:
    """MLC's Phi-3 names its parameters differently: transformer.embd, transformer.h.N, ln.weight, mixer.out_proj."""
    params = [("transformer.embd.weight", ["vocab_size", HIDDEN])]
    for i in range(3):
        p = f"transformer.h.{i}."
        params += [(p + "ln.weight", [HIDDEN]), (p + "mixer.qkv_proj.weight", [3 * HIDDEN, HIDDEN]),
                   (p + "mixer.out_proj.weight", [HIDDEN, HIDDEN]), (p + "post_attention_layernorm.weight", [HIDDEN])]
    params += [("transformer.norm.weight", [HIDDEN]), ("lm_head.weight", ["vocab_size", HIDDEN])]
    return {"model_type": "phi3", "params": [{"name": n, "shape": s, "dtype": "float32"} for n, s in params]}


def test_phi3_names() -> None:
    torch = pytest.importorskip("torch")
    info = model_info("phi3", _phi3_metadata(), Path("lib.so"), SIZES)
    assert (info.hidden_size, info.vocab_size, info.num_layers) == (HIDDEN, VOCAB, 3)
    weights = random_weights(info, torch.device("cpu"), seed=0)
    assert abs(float(weights["transformer.h.0.ln.weight"].mean()) - 1.0) < 0.05  # a norm: around 1
    out = weights["transformer.h.2.mixer.out_proj.weight"]
    assert float(out.std()) == pytest.approx(HIDDEN**-0.5 / 6**0.5, rel=0.1)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m.update(params=[]), "lists no parameters"),
        (lambda m: m["params"][1].update(dtype="float32"), "several float dtypes"),
        (lambda m: m["params"][1].update(dtype="uint32"), "packed parameters without a quantization scheme"),
        (lambda m: m.update(params=m["params"][1:]), "no single 2-D token embedding"),
    ],
)
def test_bad_metadata_is_an_error(change, message) -> None:
    meta = _metadata()
    change(meta)
    with pytest.raises(FuselightError, match=message):
        model_info("qwen2", meta, Path("lib.so"), SIZES)


def test_random_weights_follow_the_model_weights_distributions() -> None:
    torch = pytest.importorskip("torch")
    info = model_info("qwen2", _metadata("float32"), Path("lib.so"), SIZES)
    weights = random_weights(info, torch.device("cpu"), seed=3)
    assert list(weights) == [name for name, _, _ in info.params]
    assert all(tuple(weights[n].shape) == s for n, s, _ in info.params)
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert abs(float(norm.mean()) - 1.0) < 0.05 and 0.05 < float(norm.std()) < 0.2
    down = weights["model.layers.1.mlp.down_proj.weight"]
    assert float(down.std()) == pytest.approx(INTER**-0.5 / 2, rel=0.1)  # 1/sqrt(fan-in), over sqrt(2 * layers)
    again = random_weights(info, torch.device("cpu"), seed=3)
    assert all(torch.equal(weights[n], again[n]) for n in weights)


def _quantized_metadata(layout: str = "NK") -> dict:
    """MLC's q4f16_1 (NK) or q4f16_0 (KN) parameter list: packed words and scales for every matrix."""
    meta = _metadata()
    params = []
    for p in meta["params"]:
        name, (n, k) = p["name"], p["shape"] if len(p["shape"]) == 2 else (None, None)
        if n is None or "bias" in name:
            params.append(p)
            continue
        base = name.removesuffix(".weight")
        packed, scale = [n, k // 8], [n, k // 32]
        if layout == "KN" and "embed_tokens" not in name:
            packed, scale = packed[::-1], scale[::-1]
        params += [{"name": base + ".q_weight", "shape": packed, "dtype": "uint32"},
                   {"name": base + ".q_scale", "shape": scale, "dtype": "float16"}]
    return {**meta, "params": params, "quantization": "q4f16_1" if layout == "NK" else "q4f16_0"}


@pytest.mark.parametrize("layout", ["NK", "KN"])
def test_quantized_model_info_and_float_params(layout) -> None:
    from fuselight.bench.mlc_e2e import float_params

    info = model_info("qwen2", _quantized_metadata(layout), Path("lib.so"), SIZES)
    assert (info.hidden_size, info.vocab_size, info.dtype) == (HIDDEN, VOCAB, "float16")
    assert info.quantization == ("q4f16_1" if layout == "NK" else "q4f16_0")
    assert info.params[0] == ("model.embed_tokens.q_weight", (VOCAB, HIDDEN // 8), "uint32")
    # The float weights the packed pairs store: the fp16 model's parameter list.
    assert float_params(info) == [(n, tuple(s)) for n, s, _ in model_info("qwen2", _metadata(), Path("l"), SIZES).params]


def _awq_metadata() -> dict:
    """MLC's q4f16_autoawq parameter list (hidden 128, intermediate 256: whole groups of 128): for
    every linear layer but the LM head ``qweight[K, N / 8]``, ``qzeros[K / 128, N / 8]``,
    ``scales[K / 128, N]``; the embedding and the LM head in float16."""
    meta = _metadata(hidden=128, inter=256)
    params = []
    for p in meta["params"]:
        name, shape = p["name"], p["shape"]
        if len(shape) != 2 or "bias" in name or "embed_tokens" in name or name == "lm_head.weight":
            params.append(p)
            continue
        (n, k), base = shape, name.removesuffix(".weight")
        params += [{"name": base + ".qweight", "shape": [k, n // 8], "dtype": "uint32"},
                   {"name": base + ".qzeros", "shape": [k // 128, n // 8], "dtype": "uint32"},
                   {"name": base + ".scales", "shape": [k // 128, n], "dtype": "float16"}]
    return {**meta, "params": params, "quantization": "q4f16_autoawq"}


def test_awq_model_info_and_float_params() -> None:
    from fuselight.bench.mlc_e2e import float_params

    sizes = {**SIZES, "hidden_size": 128}
    info = model_info("qwen2", _awq_metadata(), Path("lib.so"), sizes)
    assert (info.hidden_size, info.vocab_size, info.quantization) == (128, VOCAB, "q4f16_autoawq")
    fp16 = model_info("qwen2", _metadata(hidden=128, inter=256), Path("l"), sizes)
    assert float_params(info) == [(n, tuple(s)) for n, s, _ in fp16.params]


def test_awq_random_weights_are_the_librarys_parameters() -> None:
    torch = pytest.importorskip("torch")
    from fuselight.bench.mlc_e2e import quantized

    sizes = {**SIZES, "hidden_size": 128}
    info = model_info("qwen2", _awq_metadata(), Path("lib.so"), sizes)
    weights = random_weights(info, torch.device("cpu"), seed=5)
    assert [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in weights.items()] == list(info.params)
    floats = model_info("qwen2", _metadata(hidden=128, inter=256), Path("l"), sizes)
    _, stored = quantized(info, random_weights(floats, torch.device("cpu"), seed=5))
    assert float(stored["model.layers.1.mlp.down_proj.weight"].float().std()) == pytest.approx(256**-0.5 / 2, rel=0.15)


def test_quantized_random_weights_store_the_drawn_distribution() -> None:
    torch = pytest.importorskip("torch")
    from fuselight.bench.mlc_e2e import quantized

    info = model_info("qwen2", _quantized_metadata(), Path("lib.so"), SIZES)
    weights = random_weights(info, torch.device("cpu"), seed=5)
    assert [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in weights.items()] == list(info.params)
    down = weights["model.layers.1.mlp.down_proj.q_weight"]
    assert int((down.view(torch.int32) != 0).sum()) > down.numel() // 2  # words, not zeros
    floats = model_info("qwen2", _metadata(), Path("l"), SIZES)
    library, stored = quantized(info, random_weights(floats, torch.device("cpu"), seed=5))
    assert float(stored["model.layers.1.mlp.down_proj.weight"].float().std()) == pytest.approx(INTER**-0.5 / 2, rel=0.15)


def test_each_case_needs_both_libraries(tmp_path) -> None:
    with pytest.raises(FuselightError, match="case 'qwen2': needs a library for each of mlc, mlc\\+fuselight"):
        run_mlc_e2e({("mlc", "qwen2"): tmp_path / "a.so"}, tmp_path / "out.json")
    with pytest.raises(FuselightError, match="implementation must be one of mlc, mlc\\+fuselight"):
        run_mlc_e2e({("baseline", "qwen2"): tmp_path / "a.so"}, tmp_path / "out.json")


def test_cli_lib_needs_impl_and_case(tmp_path, capsys) -> None:
    assert cli_main(["bench", "mlc-e2e", "--lib", "mlc=a.so", "-o", str(tmp_path / "o.json")]) == 2
    assert "expected IMPL@CASE=PATH" in capsys.readouterr().err
