"""Transformer graphs besides our LLaMA, for the graph passes' reports (``fuselight explain --graph``).

Each is one layer as a Relax ``nn`` module, configured by ``configs/graphs/<name>.json``:

- ``bert-encoder``: a BERT encoder layer (post-norm): fused QKV projection, attention, output
  projection, residual + LayerNorm, GELU MLP, residual + LayerNorm; sequence length symbolic.
- ``vit-block``: a ViT block (pre-norm): LayerNorm, attention, residual; LayerNorm, GELU MLP,
  residual; a static sequence length (patches + class token).

Attention is written out (reshape, head transposes, ``Q K^T``, scale, softmax, ``P V``) as a model
compiled without an attention kernel would be: the layout changes the fusion plan folds into its
consumers' indexing. Batch 1; the function is ``forward(x, params...)``.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..errors import FuselightError
from ..jsonfile import read_json_object
from ..paths import config_dir

KINDS = ("bert-encoder", "vit-block")


@dataclasses.dataclass(frozen=True)
class GraphConfig:
    name: str
    kind: str
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    layer_norm_eps: float
    seq_len: int | str  # a number, or the name of a symbolic dim
    dtype: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def names() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "graphs").glob("*.json"))


def load(name: str) -> GraphConfig:
    """The graph config ``configs/graphs/<name>.json``."""
    path = config_dir() / "graphs" / f"{name}.json"
    raw = read_json_object(path, missing=f"unknown graph {name!r}: expected one of {', '.join(names())}")
    try:
        config = GraphConfig(
            name=name,
            kind=str(raw["kind"]),
            hidden_size=int(raw["hidden_size"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            layer_norm_eps=float(raw["layer_norm_eps"]),
            seq_len=raw["seq_len"] if isinstance(raw["seq_len"], str) else int(raw["seq_len"]),
            dtype=str(raw["dtype"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise FuselightError(f"{path}: missing or invalid field {err}") from None
    if config.kind not in KINDS:
        raise FuselightError(f"{path}: kind must be one of {', '.join(KINDS)}, not {config.kind!r}")
    if config.hidden_size % config.num_attention_heads:
        raise FuselightError(f"{path}: hidden_size must be a multiple of num_attention_heads")
    return config


class Attention(nn.Module):
    def __init__(self, config: GraphConfig) -> None:
        self.heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, 3, self.heads, self.head_dim))
        q, k, v = (op.permute_dims(op.squeeze(t, 2), (0, 2, 1, 3)) for t in op.split(qkv, 3, axis=2))
        scores = op.matmul(q, op.permute_dims(k, (0, 1, 3, 2))) * (self.head_dim**-0.5)
        out = op.matmul(op.softmax(scores, axis=-1), v)  # [b, heads, s, head_dim]
        return self.out_proj(op.reshape(op.permute_dims(out, (0, 2, 1, 3)), (b, s, h)))


class MLP(nn.Module):
    def __init__(self, config: GraphConfig) -> None:
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(op.gelu(self.fc1(x)))


class Block(nn.Module):
    """A transformer layer: post-norm (BERT) or pre-norm (ViT)."""

    def __init__(self, config: GraphConfig) -> None:
        self.pre_norm = config.kind == "vit-block"
        self.attention = Attention(config)
        self.mlp = MLP(config)
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_norm:
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.mlp(x))


def export_module(config: GraphConfig) -> tvm.IRModule:
    """The layer as a Relax IRModule: ``forward(x: [1, seq_len, hidden], weights...)``."""
    block = Block(config)
    block.to(config.dtype)
    spec = {"forward": {"x": nn.spec.Tensor([1, config.seq_len, config.hidden_size], config.dtype)}}
    mod, _ = block.export_tvm(spec=spec)
    return mod
