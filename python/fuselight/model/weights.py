"""Weights of our LLaMA model as NumPy arrays: seeded random init, safetensors I/O, HF checkpoints.

NumPy only (no TVM), so it runs on the GPU host too. Our parameter names and order are
``ModelConfig.weight_shapes()``: q/k/v fused into ``self_attn.qkv_proj`` (q rows, then k, then v)
and gate/up into ``mlp.gate_up_proj`` (gate rows, then up). Hugging Face checkpoints keep them apart;
``load_hf_checkpoint`` fuses, ``to_hf_state`` splits. Both use the same rotate-half RoPE layout as
TVM's KV-cache kernels, so q/k rows need no permutation.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import quantization
from ..config import ModelConfig, check_dtype
from ..errors import FuselightError

try:
    import ml_dtypes

    _BF16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bf16 files are then read as float32
    _BF16 = None

# Random init. Linear weights get std 1/sqrt(fan_in), so every projection keeps RMS ~1 behind its
# RMSNorm; the two that write into the residual stream (o_proj, down_proj) are further scaled by
# 1/sqrt(2 * layers), so 32 residual additions keep the stream O(1) and fp16 stays finite.
# Norm weights are 1 + N(0, NORM_NOISE_STD): near the trained regime, but not exactly ones.
NORM_NOISE_STD = 0.1
# Embedding rows at RMS 1 like the normalised hidden state; as tied lm_head this gives logits of
# RMS sqrt(hidden), which fp16 holds easily.
EMBED_STD = 1.0

_SAFETENSORS_DTYPES: dict[str, Any] = {
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
}
_HEADER_ALIGN = 8
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
# Rotary tables some older HF Llama checkpoints store; the KV cache recomputes them.
_DERIVED_SUFFIX = "rotary_emb.inv_freq"


def param_names_and_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Our parameters in the compiled module's order."""
    return list(config.weight_shapes().items())


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of a model dtype (bfloat16 needs ``ml_dtypes``)."""
    check_dtype(dtype)
    if dtype == "bfloat16":
        if _BF16 is None:
            raise FuselightError("dtype 'bfloat16' needs the ml_dtypes package")
        return _BF16
    return np.dtype(dtype)


def is_norm_weight(name: str) -> bool:
    """RMSNorm weights: initialised around 1, not 0."""
    return name.endswith("norm.weight")


def init_std(name: str, config: ModelConfig) -> float:
    """Std of the seeded random init of weight ``name`` (for norms: of the noise around 1; for a
    quantized weight: of its dequantized values)."""
    shapes = config.dense_weight_shapes()
    if name not in shapes:
        raise FuselightError(f"unknown parameter {name!r} for model {config.name!r}")
    if is_norm_weight(name):
        return NORM_NOISE_STD
    if name == "model.embed_tokens.weight":
        return EMBED_STD
    std = 1.0 / math.sqrt(shapes[name][1])
    if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        std /= math.sqrt(2 * config.num_hidden_layers)
    return std


def random_weights(config: ModelConfig, seed: int = 0, dtype: str | None = None) -> dict[str, np.ndarray]:
    """Seeded random parameters in ``dtype`` (default: the config's), in parameter order.

    Each tensor draws from its own stream keyed by (seed, name), so a tensor does not change when
    the layer count or tying of another config differs. With quantization, each quantized weight is
    random packed words and scales (``quantization.random_quantized``) whose dequantized values have
    the float init's std; the dtype is then the scheme's.
    """
    if config.quantization is not None and dtype not in (None, config.dtype):
        raise FuselightError(f"{config.quantization} weights are {config.dtype}, not {dtype}")
    out_dtype = numpy_dtype(dtype or config.dtype)
    quantized = config.quantized_weights()
    weights = {}
    for name, shape in config.dense_weight_shapes().items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name in quantized:
            stored = quantization.random_quantized(rng, *shape, init_std(name, config), quantized[name])
            weights.update(_stored_params(name, stored, quantized[name], out_dtype))
            continue
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(init_std(name, config))
        if is_norm_weight(name):
            w += np.float32(1.0)
        weights[name] = w.astype(out_dtype)
    return weights


def _stored_params(name: str, stored: tuple[np.ndarray, ...], s: quantization.QuantScheme,
                   float_dtype: Any) -> dict[str, np.ndarray]:
    """The parameters of weight ``name`` stored as ``stored``: packed words as they are, scales in ``float_dtype``."""
    names = quantization.quantized_names(name, s)
    return {n: a if dtype == quantization.STORAGE_DTYPE else a.astype(float_dtype)
            for n, a, dtype in zip(names, stored, s.packed_dtypes())}


def quantize_weights(config: ModelConfig, dense: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float weights (``dense_weight_shapes()`` names) as the parameters of ``config``: quantized
    where its scheme quantizes, scales and the rest in the config's dtype."""
    quantized = config.quantized_weights()
    out_dtype = numpy_dtype(config.dtype)
    params = {}
    for name in config.dense_weight_shapes():
        w = dense[name]
        if name in quantized:
            stored = quantization.quantize(np.asarray(w, dtype=np.float32), quantized[name])
            params.update(_stored_params(name, stored, quantized[name], out_dtype))
        else:
            params[name] = np.asarray(w).astype(out_dtype)
    return params


def dequantize_weights(config: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float weights ``params`` store, by ``dense_weight_shapes()`` name: each quantized weight
    dequantized in float64 from its stored scales, the others as they are."""
    return dict(iter_dequantized(config, params))


def iter_dequantized(config: ModelConfig, params: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """``dequantize_weights`` one tensor at a time (a float64 LLaMA-3-8B would take 64 GB at once)."""
    quantized = config.quantized_weights()
    for name in config.dense_weight_shapes():
        if name in quantized:
            names = quantization.quantized_names(name, quantized[name])
            yield name, quantization.dequantize(tuple(params[n] for n in names), quantized[name])
        else:
            yield name, params[name]


# --- safetensors ------------------------------------------------------------------------------


def _dtype_code(dtype: np.dtype) -> str:
    if _BF16 is not None and dtype == _BF16:
        return "BF16"
    for code, known in _SAFETENSORS_DTYPES.items():
        if dtype == known:
            return code
    raise FuselightError(f"safetensors: unsupported dtype {dtype}")


def _bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a ``.safetensors`` file, memory-mapped read-only where the dtype allows.

    BF16 comes back as ``ml_dtypes.bfloat16`` when that package is present, else as float32.
    """
    path = Path(path)
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as err:
        raise FuselightError(f"{path}: cannot read ({err})") from None
    if data.size < 8:
        raise FuselightError(f"{path}: not a safetensors file (too short)")
    header_len = int(data[:8].view("<u8")[0])
    if 8 + header_len > data.size:
        raise FuselightError(f"{path}: not a safetensors file (header length {header_len} past end)")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FuselightError(f"{path}: not a safetensors file (bad JSON header)") from None
    if not isinstance(header, dict):
        raise FuselightError(f"{path}: not a safetensors file (header is not a JSON object)")
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        code, shape, begin, end = _tensor_entry(path, name, info)
        if code == "BF16":
            dt, itemsize = np.dtype("<u2"), 2
        elif code in _SAFETENSORS_DTYPES:
            dt = _SAFETENSORS_DTYPES[code].newbyteorder("<")
            itemsize = dt.itemsize
        else:
            raise FuselightError(f"{path}: tensor {name!r} has unsupported dtype {code!r}")
        count = math.prod(shape)
        if end - begin != count * itemsize or base + end > data.size:
            raise FuselightError(
                f"{path}: tensor {name!r} has inconsistent data_offsets [{begin}, {end}] "
                f"(shape {list(shape)}, {code}, file has {data.size - base} data bytes)"
            )
        arr = np.frombuffer(data, dtype=dt, count=count, offset=base + begin)
        if code == "BF16":
            arr = arr.view(_BF16) if _BF16 is not None else _bf16_bits_to_float32(arr)
        tensors[name] = arr.reshape(shape)
    return tensors


def _tensor_entry(path: Path, name: str, info: Any) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype code, shape, begin, end) of one header entry, checked for type."""

    def bad(what: str) -> FuselightError:
        return FuselightError(f"{path}: tensor {name!r} has {what}")

    if not isinstance(info, dict):
        raise bad("a header entry that is not a JSON object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise bad(f"no {key!r} in its header entry")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str):
        raise bad(f"a dtype that is not a string ({code!r})")

    def ints(value: Any) -> bool:
        return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)

    if not ints(shape):
        raise bad(f"a bad shape {shape!r} (want a list of non-negative integers)")
    if not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise bad(f"bad data_offsets {offsets!r} (want [begin, end] with 0 <= begin <= end)")
    return code, tuple(shape), offsets[0], offsets[1]


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Write ``tensors`` as one ``.safetensors`` file (little-endian, header padded to 8 bytes)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.asarray(arr, order="C")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        header[name] = {
            "dtype": _dtype_code(arr.dtype),
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % _HEADER_ALIGN)
    # Write beside and rename: arrays memory-mapped from the old file (``read_safetensors``) stay
    # valid, where truncating it in place would crash their readers.
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)


# --- Hugging Face checkpoints ----------------------------------------------------------------


def hf_rope_scaling(config: ModelConfig) -> dict[str, Any] | None:
    """The ``rope_scaling`` entry of a Hugging Face config (None for plain RoPE).

    TVM's KV-cache kernels read the same dict for ``rope_type: llama3``.
    """
    s = config.rope_scaling
    if s is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position_embeddings,
    }


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """``config`` as a Hugging Face ``config.json`` dict."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": hf_rope_scaling(config),
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": config.dtype,
    }


def _fused_parts(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Fused parameter suffix -> [(HF suffix, rows)], in row order."""
    return {
        "self_attn.qkv_proj.weight": [
            ("self_attn.q_proj.weight", config.q_size),
            ("self_attn.k_proj.weight", config.kv_size),
            ("self_attn.v_proj.weight", config.kv_size),
        ],
        "mlp.gate_up_proj.weight": [
            ("mlp.gate_proj.weight", config.intermediate_size),
            ("mlp.up_proj.weight", config.intermediate_size),
        ],
    }


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for ``config`` (no lm_head when tied)."""
    parts = _fused_parts(config)
    shapes = {}
    for name, shape in config.dense_weight_shapes().items():
        prefix, suffix = _split_name(name)
        if suffix in parts:
            for hf_suffix, rows in parts[suffix]:
                shapes[prefix + hf_suffix] = (rows, *shape[1:])
        else:
            shapes[name] = shape
    return shapes


def _check_tensors(tensors: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]], source: str) -> None:
    for name, shape in expected.items():
        if name not in tensors:
            raise FuselightError(f"{source}: missing tensor {name!r}")
        if tuple(tensors[name].shape) != tuple(shape):
            raise FuselightError(
                f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {tuple(shape)}"
            )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise FuselightError(f"{source}: unexpected tensor {extra[0]!r}{more}")


def _split_name(name: str) -> tuple[str, str]:
    """``model.layers.3.self_attn.qkv_proj.weight`` -> (``model.layers.3.``, ``self_attn.qkv_proj.weight``)."""
    for marker in ("self_attn.", "mlp."):
        head, sep, tail = name.partition(marker)
        if sep:
            return head, marker + tail
    return "", name


def to_hf_state(config: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our float weights (``dense_weight_shapes()``; see ``dequantize_weights``) under Hugging Face
    names, fused tensors split back (views, no copies)."""
    _check_tensors(weights, config.dense_weight_shapes(), "weights")
    parts = _fused_parts(config)
    state = {}
    for name, w in weights.items():
        prefix, suffix = _split_name(name)
        if suffix not in parts:
            state[name] = w
            continue
        row = 0
        for hf_suffix, rows in parts[suffix]:
            state[prefix + hf_suffix] = w[row : row + rows]
            row += rows
    return state


def _checkpoint_files(path: Path) -> list[Path]:
    if (path / _SINGLE_FILE).is_file():
        return [path / _SINGLE_FILE]
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise FuselightError(f"{index}: not a safetensors index (no 'weight_map')") from None
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FuselightError(f"{index}: shard {f.name} not found")
        return files
    raise FuselightError(f"{path}: no {_SINGLE_FILE} or {_INDEX_FILE} (only safetensors checkpoints are supported)")


def load_hf_checkpoint(path: str | Path, config: ModelConfig, dtype: str | None = None) -> dict[str, np.ndarray]:
    """Our parameters (parameter order, ``dtype`` or the config's) from a Hugging Face model directory.

    Reads ``model.safetensors`` or the shards an index names; fuses q/k/v and gate/up. A tied model
    may still carry ``lm_head.weight`` if it equals the embedding. With quantization the float
    weights are quantized as they load (``quantize_weights``).
    """
    path = Path(path)
    if not path.is_dir():
        raise FuselightError(f"checkpoint directory not found: {path}")
    out_dtype = numpy_dtype(dtype or config.dtype)
    state: dict[str, np.ndarray] = {}
    for f in _checkpoint_files(path):
        state.update((k, v) for k, v in read_safetensors(f).items() if not k.endswith(_DERIVED_SUFFIX))
    if config.tie_word_embeddings and "lm_head.weight" in state:
        lm_head = state.pop("lm_head.weight")
        embed = state.get("model.embed_tokens.weight")
        if embed is None or lm_head.shape != embed.shape or not np.array_equal(lm_head, embed):
            raise FuselightError(
                f"{path}: tensor 'lm_head.weight' differs from the embedding although tie_word_embeddings is set"
            )
    _check_tensors(state, hf_shapes(config), str(path))
    parts = _fused_parts(config)
    weights = {}
    for name in config.dense_weight_shapes():
        prefix, suffix = _split_name(name)
        if suffix in parts:
            w = np.concatenate([state[prefix + hf_suffix] for hf_suffix, _ in parts[suffix]], axis=0)
        else:
            w = state[name]
        weights[name] = w if config.quantization else w.astype(out_dtype)
    if config.quantization:
        if dtype not in (None, config.dtype):
            raise FuselightError(f"{config.quantization} weights are {config.dtype}, not {dtype}")
        return quantize_weights(config, weights)
    return weights


def save_hf_checkpoint(path: str | Path, config: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Write ``model.safetensors`` and ``config.json`` (Hugging Face layout) into directory ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / _SINGLE_FILE, to_hf_state(config, weights))
    (path / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
