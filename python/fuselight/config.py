"""LLaMA model configuration, read from a Hugging Face style ``config.json`` or a shipped preset.

Every check names the offending field, so a bad config fails in one line before TVM sees it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .errors import FuselightError
from .jsonfile import read_json_object
from .paths import config_dir
from .quantization import PACKED_SUFFIXES, QuantScheme, STORAGE_DTYPE, check_weight_shape, quantized_names, scheme

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
_ROPE_TYPES = ("llama3", "default")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling of RoPE (``rope_type: llama3`` in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The LLaMA family (Llama 2 and 3): RMSNorm, RoPE, GQA, SwiGLU FFN, tied or untied lm_head."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    head_dim: int
    rope_scaling: RopeScaling | None = None
    dtype: str = "float16"
    # A 4-bit scheme of ``fuselight.quantization`` (None: weights in ``dtype``); set with ``with_quantization``.
    quantization: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def with_dtype(self, dtype: str) -> "ModelConfig":
        """The same model computing in ``dtype``."""
        check_dtype(dtype)
        return dataclasses.replace(self, dtype=dtype)

    def with_quantization(self, name: str | None) -> "ModelConfig":
        """The same model with its weights in scheme ``name`` (None: unquantized), computing in the
        scheme's dtype; FuselightError for an unknown scheme or a weight it cannot store."""
        s = scheme(name)
        if s is None:
            return dataclasses.replace(self, quantization=None)
        for weight, (n, k) in self._quantizable_shapes(s).items():
            try:
                check_weight_shape(s, n, k)
            except FuselightError as err:
                raise FuselightError(f"model {self.name!r}: {weight}: {err}") from None
        return dataclasses.replace(self, quantization=s.name, dtype=s.model_dtype)

    def _quantizable_shapes(self, s: QuantScheme) -> dict[str, tuple[int, ...]]:
        dense = self.dense_weight_shapes()
        return {
            name: shape for name, shape in dense.items()
            if len(shape) == 2 and (s.quantize_embedding if name == "model.embed_tokens.weight" else True)
            and (s.quantize_lm_head or name != "lm_head.weight")
        }

    def quantized_weights(self) -> dict[str, QuantScheme]:
        """Each quantized dense weight's name -> its scheme as stored: the linears in the scheme's
        layout, the embedding always NK (MLC-LLM quantizes it along the hidden dim, untransposed,
        since its rows are gathered). Empty without quantization."""
        s = scheme(self.quantization)
        if s is None:
            return {}
        return {
            name: dataclasses.replace(s, layout="NK") if name == "model.embed_tokens.weight" else s
            for name in self._quantizable_shapes(s)
        }

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name to shape, in the compiled functions' order: ``dense_weight_shapes()``, or
        with quantization each quantized ``X.weight`` as its stored parameters (``quantized_names``)."""
        quantized = self.quantized_weights()
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in self.dense_weight_shapes().items():
            if name in quantized:
                shapes.update(zip(quantized_names(name, quantized[name]), quantized[name].packed_shapes(*shape)))
            else:
                shapes[name] = shape
        return shapes

    def weight_dtype(self, name: str) -> str:
        """The dtype of parameter ``name``: packed words for ``*.q_weight`` (AWQ: ``*.qweight``,
        ``*.qzeros``), else the model dtype."""
        return STORAGE_DTYPE if name.endswith(PACKED_SUFFIXES) else self.dtype

    def dense_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Weight name (our model's, fused QKV and gate/up as MLC-LLM lays them out) to its float shape."""
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.qkv_proj.weight"] = (self.q_size + 2 * self.kv_size, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def num_weight_bytes(self, decode: bool = False) -> int:
        """Bytes of all parameters as stored (packed words and scales when quantized); ``decode``:
        those a decode step reads in full (all but the embedding, which it gathers a row of,
        unless the LM head is the embedding)."""
        total = 0
        for name, shape in self.weight_shapes().items():
            if decode and name.startswith("model.embed_tokens.") and not self.tie_word_embeddings:
                continue
            n = 4 if self.weight_dtype(name) in ("float32", STORAGE_DTYPE) else 2
            for d in shape:
                n *= d
            total += n
        return total


def check_dtype(dtype: str) -> str:
    if dtype not in SUPPORTED_DTYPES:
        raise FuselightError(f"unsupported dtype {dtype!r}: expected one of {', '.join(SUPPORTED_DTYPES)}")
    return dtype


def list_presets() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "models").glob("*.json"))


def _field(raw: dict[str, Any], key: str, kind: type, source: str, default: Any = ...) -> Any:
    if key not in raw or raw[key] is None:
        if default is ...:
            raise FuselightError(f"{source}: missing field {key!r}")
        return default
    value = raw[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (kind is not bool and isinstance(value, bool)) or not isinstance(value, kind):
        raise FuselightError(f"{source}: field {key!r} must be {kind.__name__}, got {value!r}")
    if kind in (int, float) and value <= 0:
        raise FuselightError(f"{source}: field {key!r} must be positive, got {value!r}")
    return value


def _rope_scaling(raw: Any, source: str) -> RopeScaling | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise FuselightError(f"{source}: field 'rope_scaling' must be an object or null")
    kind = raw.get("rope_type", raw.get("type"))
    if kind not in _ROPE_TYPES:
        raise FuselightError(
            f"{source}: field 'rope_scaling.rope_type' {kind!r} is not supported (supported: llama3)"
        )
    if kind == "default":
        return None
    src = f"{source}: rope_scaling"
    return RopeScaling(
        factor=_field(raw, "factor", float, src),
        low_freq_factor=_field(raw, "low_freq_factor", float, src),
        high_freq_factor=_field(raw, "high_freq_factor", float, src),
        original_max_position_embeddings=_field(raw, "original_max_position_embeddings", int, src),
    )


def from_dict(raw: dict[str, Any], name: str = "model", source: str | None = None) -> ModelConfig:
    """Validate a Hugging Face style config dict; every error names its field."""
    source = source or name
    if not isinstance(raw, dict):
        raise FuselightError(f"{source}: config must be a JSON object")
    arch = raw.get("architectures") or ["LlamaForCausalLM"]
    model_type = raw.get("model_type", "llama")
    if model_type != "llama" or "LlamaForCausalLM" not in arch:
        raise FuselightError(
            f"{source}: field 'model_type'/'architectures' ({model_type!r}, {arch!r}) is not the LLaMA family"
        )
    hidden = _field(raw, "hidden_size", int, source)
    heads = _field(raw, "num_attention_heads", int, source)
    kv_heads = _field(raw, "num_key_value_heads", int, source, heads)
    if "head_dim" not in raw and hidden % heads:
        raise FuselightError(f"{source}: field 'hidden_size' ({hidden}) is not a multiple of num_attention_heads")
    head_dim = _field(raw, "head_dim", int, source, hidden // heads)
    if heads % kv_heads:
        raise FuselightError(
            f"{source}: field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})"
        )
    if head_dim % 2:
        raise FuselightError(f"{source}: field 'head_dim' ({head_dim}) must be even for RoPE")
    dtype = raw.get("torch_dtype") or "float16"
    if dtype not in SUPPORTED_DTYPES:
        raise FuselightError(f"{source}: field 'torch_dtype' {dtype!r} is not one of {', '.join(SUPPORTED_DTYPES)}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise FuselightError(f"{source}: field 'hidden_act' {act!r} is not supported (silu only)")
    return ModelConfig(
        name=name,
        hidden_size=hidden,
        intermediate_size=_field(raw, "intermediate_size", int, source),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=_field(raw, "num_hidden_layers", int, source),
        vocab_size=_field(raw, "vocab_size", int, source),
        rms_norm_eps=_field(raw, "rms_norm_eps", float, source, 1e-6),
        rope_theta=_field(raw, "rope_theta", float, source, 10000.0),
        max_position_embeddings=_field(raw, "max_position_embeddings", int, source, 4096),
        tie_word_embeddings=_field(raw, "tie_word_embeddings", bool, source, False),
        head_dim=head_dim,
        rope_scaling=_rope_scaling(raw.get("rope_scaling"), source),
        dtype=dtype,
    )


def load(spec: str | Path) -> ModelConfig:
    """A preset name (``configs/models/NAME.json``) or a path to a ``config.json``."""
    path = Path(spec)
    if path.suffix == ".json" or path.is_dir() or path.exists():
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FuselightError(f"config file not found: {path}")
        name = path.parent.name if path.name == "config.json" else path.stem
    else:
        path = config_dir() / "models" / f"{spec}.json"
        if not path.is_file():
            raise FuselightError(f"unknown model preset {str(spec)!r}: available {', '.join(list_presets())}")
        name = str(spec)
    raw = read_json_object(path, missing=f"config file not found: {path}")
    return from_dict(raw, name=name, source=str(path))
