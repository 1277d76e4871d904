"""A float64 NumPy LLaMA (Llama 2/3) written from the Hugging Face definition, to check our model.

Independent of fuselight's model code: it takes a Hugging Face ``config.json`` dict and HF-named
weights (separate q/k/v and gate/up). Weights are upcast per use, so an 8B model in fp16 fits in
host memory. ``prefill`` may be called again to extend the sequence (chunked prefill).
"""

from __future__ import annotations

import math

import numpy as np


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> np.ndarray:
    """Inverse RoPE frequencies, with Llama-3 scaling as ``_compute_llama3_parameters`` in HF."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        return inv_freq
    factor = rope_scaling["factor"]
    low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_ctx = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class ReferenceLlama:
    """Batch-1 causal LM with a KV cache; returns float64 logits of the last position."""

    def __init__(self, hf_config: dict, hf_weights: dict[str, np.ndarray]) -> None:
        c = hf_config
        self.hidden = c["hidden_size"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads") or self.n_heads
        self.head_dim = c.get("head_dim") or self.hidden // self.n_heads
        self.n_layers = c["num_hidden_layers"]
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.tied = c.get("tie_word_embeddings", False)
        self.inv_freq = rope_inv_freq(self.head_dim, c.get("rope_theta", 10000.0), c.get("rope_scaling"))
        self.w = hf_weights
        self.reset()

    def reset(self) -> None:
        self.keys: list[np.ndarray] = [np.zeros((0, self.n_kv, self.head_dim)) for _ in range(self.n_layers)]
        self.values: list[np.ndarray] = [np.zeros((0, self.n_kv, self.head_dim)) for _ in range(self.n_layers)]
        # Largest |residual stream| entry seen, to check a weight init fits a narrow dtype.
        self.max_abs_hidden = 0.0

    def _weight(self, name: str) -> np.ndarray:
        return self.w[name].astype(np.float64)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        # x: [n, heads, head_dim]; HF layout: cos/sin of the half-size frequencies repeated twice.
        freqs = positions[:, None].astype(np.float64) * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
        return x * np.cos(emb) + _rotate_half(x) * np.sin(emb)

    def _attention(self, layer: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        p = f"model.layers.{layer}.self_attn."
        n = x.shape[0]
        q = (x @ self._weight(p + "q_proj.weight").T).reshape(n, self.n_heads, self.head_dim)
        k = (x @ self._weight(p + "k_proj.weight").T).reshape(n, self.n_kv, self.head_dim)
        v = (x @ self._weight(p + "v_proj.weight").T).reshape(n, self.n_kv, self.head_dim)
        q, k = self._rope(q, positions), self._rope(k, positions)
        keys = self.keys[layer] = np.concatenate([self.keys[layer], k])
        values = self.values[layer] = np.concatenate([self.values[layer], v])
        group = self.n_heads // self.n_kv
        keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)
        # scores[h, i, j]: query i (at positions[i]) against cached key j (at position j).
        scores = np.einsum("ihd,jhd->hij", q, keys) / math.sqrt(self.head_dim)
        causal = np.arange(keys.shape[0])[None, :] > positions[:, None]
        scores = np.where(causal[None], -np.inf, scores)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out = np.einsum("hij,jhd->ihd", probs, values).reshape(n, self.n_heads * self.head_dim)
        return out @ self._weight(p + "o_proj.weight").T

    def _mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        p = f"model.layers.{layer}.mlp."
        gate = x @ self._weight(p + "gate_proj.weight").T
        up = x @ self._weight(p + "up_proj.weight").T
        return (_silu(gate) * up) @ self._weight(p + "down_proj.weight").T

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        start = self.keys[0].shape[0]
        positions = np.arange(start, start + ids.size)
        x = self.w["model.embed_tokens.weight"][ids].astype(np.float64)
        for layer in range(self.n_layers):
            p = f"model.layers.{layer}."
            x = x + self._attention(layer, _rms_norm(x, self.w[p + "input_layernorm.weight"], self.eps), positions)
            x = x + self._mlp(layer, _rms_norm(x, self.w[p + "post_attention_layernorm.weight"], self.eps))
            self.max_abs_hidden = max(self.max_abs_hidden, float(np.abs(x).max()))
        last = _rms_norm(x[-1], self.w["model.norm.weight"], self.eps)
        head = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        return self._weight(head) @ last

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        return self._forward(ids)

    def decode(self, token_id: int) -> np.ndarray:
        return self._forward(np.array([token_id]))
