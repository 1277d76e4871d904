"""Our LLaMA compiled for the CPU against the float64 NumPy reference: prefill + decode logits."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import compare_with_reference, relative_error
from fuselight import FuselightError, config
from fuselight.engine import Engine
from fuselight.model.weights import hf_config, param_names_and_shapes, random_weights, to_hf_state
from reference_llama import ReferenceLlama

TOLERANCE = 1e-4
DECODE_STEPS = 8
# Small enough that the 37-token prompt goes through three chunks.
PREFILL_CHUNK = 16


def _variant(name: str) -> config.ModelConfig:
    tiny = config.load("tiny-llama")
    if name == "llama3":
        return tiny
    raw = hf_config(tiny)
    if name == "tied":
        raw["tie_word_embeddings"] = True
    elif name == "no_rope_scaling":
        # Llama-2 style: plain RoPE, no GQA.
        raw.update(rope_scaling=None, rope_theta=10000.0, num_key_value_heads=raw["num_attention_heads"])
    return config.from_dict(raw, name=f"tiny-{name}")


VARIANTS = ("llama3", "tied", "no_rope_scaling")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("prompt_len", [13, 37])
def test_prefill_decode_match_reference(cpu_model, variant, prompt_len):
    cfg = _variant(variant)
    vm, device = cpu_model(cfg)
    seed = 1000 * VARIANTS.index(variant) + prompt_len
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, prompt_len)
    decode_ids = [int(t) for t in rng.integers(0, cfg.vocab_size, DECODE_STEPS)]
    errors = compare_with_reference(
        vm,
        device,
        cfg,
        random_weights(cfg, seed=seed),
        prompt,
        decode_ids,
        max_total_seq_len=64,
        prefill_chunk_size=PREFILL_CHUNK,
    )
    assert len(errors) == 1 + DECODE_STEPS
    assert max(errors) < TOLERANCE, errors


def test_rope_scaling_changes_the_reference():
    # Guards the llama3 variant above: at these positions the scaling must matter far beyond
    # TOLERANCE, or a model that ignored it would pass.
    cfg = _variant("llama3")
    weights = to_hf_state(cfg, random_weights(cfg, seed=3))
    plain = dict(hf_config(cfg), rope_scaling=None)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 37)
    scaled = ReferenceLlama(hf_config(cfg), weights).prefill(prompt)
    assert relative_error(ReferenceLlama(plain, weights).prefill(prompt), scaled) > 100 * TOLERANCE


def test_reset_starts_a_fresh_sequence(cpu_model):
    cfg = _variant("llama3")
    vm, device = cpu_model(cfg)
    params = [tvm.runtime.tensor(w, device=device) for w in random_weights(cfg, seed=5).values()]
    engine = Engine(vm, params, cfg, device, max_total_seq_len=64, prefill_chunk_size=PREFILL_CHUNK)
    prompt = np.random.default_rng(5).integers(0, cfg.vocab_size, 21)
    first = engine.prefill(prompt).numpy()
    second_turn = engine.prefill(prompt).numpy()
    engine.reset()
    again = engine.prefill(prompt).numpy()
    np.testing.assert_allclose(again, first, rtol=1e-6, atol=1e-6)
    # Without the reset the same tokens see a longer context.
    assert relative_error(second_turn, first) > 100 * TOLERANCE


def test_engine_rejects_bad_input(cpu_model):
    cfg = _variant("llama3")
    vm, device = cpu_model(cfg)
    weights = random_weights(cfg, seed=7)
    params = [tvm.runtime.tensor(w, device=device) for w in weights.values()]
    with pytest.raises(FuselightError, match="takes 15 parameters, got 14"):
        Engine(vm, params[:-1], cfg, device)
    swapped = [params[0], params[2], params[1], *params[3:]]
    with pytest.raises(FuselightError, match="model.layers.0.input_layernorm.weight"):
        Engine(vm, swapped, cfg, device)
    halves = [tvm.runtime.tensor(w.astype("float16"), device=device) for w in weights.values()]
    with pytest.raises(FuselightError, match="'model.embed_tokens.weight' has dtype float16, expected float32"):
        Engine(vm, halves, cfg, device)
    engine = Engine(vm, params, cfg, device, max_total_seq_len=20)
    with pytest.raises(FuselightError, match="exceeds max_total_seq_len 20"):
        engine.prefill(np.arange(21))
    with pytest.raises(FuselightError, match="outside vocabulary"):
        engine.prefill(np.array([cfg.vocab_size]))
    with pytest.raises(FuselightError, match="at least one token"):
        engine.prefill(np.array([], dtype=np.int32))
    engine.prefill(np.arange(20))
    with pytest.raises(FuselightError, match="exceeds max_total_seq_len 20"):
        engine.decode(1)


def _engine(cpu_model, seed: int, **engine_args):
    cfg = _variant("llama3")
    vm, device = cpu_model(cfg)
    params = [tvm.runtime.tensor(w, device=device) for w in random_weights(cfg, seed=seed).values()]
    return Engine(vm, params, cfg, device, **engine_args), vm, cfg


@pytest.mark.parametrize("prompt_len", [1, 13])
def test_generate_matches_step_by_step_greedy(cpu_model, prompt_len):
    engine, _, cfg = _engine(cpu_model, seed=11 + prompt_len, max_total_seq_len=64, prefill_chunk_size=PREFILL_CHUNK)
    prompt = np.random.default_rng(prompt_len).integers(0, cfg.vocab_size, prompt_len)
    steps = 9
    expected = []
    logits = engine.prefill(prompt)
    for _ in range(steps):
        expected.append(int(np.argmax(logits.numpy().reshape(-1))))
        logits = engine.decode(expected[-1])
    engine.reset()
    tokens = engine.generate(prompt, steps)
    assert tokens.dtype == np.int32
    assert tokens.tolist() == expected
    # The last token is returned, not decoded: the cache holds the prompt and steps - 1 tokens.
    assert engine._length == prompt_len + steps - 1
    # Greedy tokens of random weights must not be one repeated id, or the loop's feedback is untested.
    assert len(set(expected)) > 1


def test_greedy_function_takes_the_first_maximum(cpu_model):
    _, vm, cfg = _engine(cpu_model, seed=1)
    logits = np.random.default_rng(2).uniform(-3.0, -1.0, (1, 1, cfg.vocab_size)).astype("float32")
    logits[0, 0, [7, 300]] = 2.5
    out = vm["greedy"](tvm.runtime.tensor(logits, device=tvm.cpu()))
    assert out.numpy().tolist() == [7]


class _WithoutGreedy:
    """A VM whose library lacks ``decode_greedy``, as MLC-LLM's builds do."""

    def __init__(self, vm) -> None:
        self._vm, self.module = vm, self

    def implements_function(self, name: str, query_imports: bool = False) -> bool:
        return name != "decode_greedy"

    def __getitem__(self, name: str):
        return self._vm[name]


def test_generate_rejects_bad_requests(cpu_model):
    engine, vm, cfg = _engine(cpu_model, seed=3, max_total_seq_len=20)
    with pytest.raises(FuselightError, match="max_new_tokens must be at least 1, got 0"):
        engine.generate(np.arange(5), 0)
    with pytest.raises(FuselightError, match="exceeds max_total_seq_len 20"):
        engine.generate(np.arange(15), 7)
    assert engine._length == 0
    # 15 prompt tokens + 6 decoded (the 7th is only returned) exceed 20, before any work is done.
    with pytest.raises(FuselightError, match="exceeds max_total_seq_len 20"):
        engine.greedy(engine.prefill(np.arange(15)), 7)
    assert engine._length == 15
    params = [tvm.runtime.tensor(w, device=tvm.cpu()) for w in random_weights(cfg, seed=3).values()]
    other = Engine(_WithoutGreedy(vm), params, cfg, tvm.cpu(), max_total_seq_len=20)
    with pytest.raises(FuselightError, match="lacks greedy, decode_attend, decode_greedy"):
        other.generate(np.arange(5), 2)


def test_export_keeps_seq_len_symbolic_and_param_order():
    from fuselight.model.llama import export_module
    from fuselight.target import resolve, to_tvm
    from tvm import relax, tirx

    cfg = _variant("llama3")
    mod, params = export_module(cfg, to_tvm(resolve("llvm")))
    assert [(n, s) for n, s, _ in params] == param_names_and_shapes(cfg)
    assert {d for _, _, d in params} == {"float32"}
    functions = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    assert set(functions) == {
        "embed", "prefill", "decode", "decode_attend", "decode_greedy", "greedy", "create_tir_paged_kv_cache"
    }

    def shape(func: str, arg: int) -> list:
        return list(functions[func].params[arg].ty.shape.values)

    (embed_len,) = shape("embed", 0)
    _, prefill_len, hidden = shape("prefill", 0)
    for dim in (embed_len, prefill_len):
        assert isinstance(dim, tirx.Var) and dim.name == "seq_len"
    assert int(hidden) == cfg.hidden_size
    assert [int(d) for d in shape("decode", 0)] == [1, 1, cfg.hidden_size]
    assert [int(d) for d in shape("decode_attend", 0)] == [int(d) for d in shape("decode_greedy", 0)] == [1, 1, cfg.hidden_size]
    assert [int(d) for d in shape("greedy", 0)] == [1, 1, cfg.vocab_size]
    logits = functions["prefill"].ret_ty.fields[0]
    assert [int(d) for d in logits.shape.values] == [1, 1, cfg.vocab_size] and logits.dtype == "float32"
