"""The LLaMA family (Llama 2 and 3) as a Relax ``nn`` module, laid out the way MLC-LLM compiles it.

Fused ``qkv_proj`` and ``gate_up_proj`` linears without bias, matmuls in the model dtype, RMSNorm,
attention through a TIR paged KV cache that applies RoPE itself (normal mode, rotate-half layout, the
same as Hugging Face checkpoints), logits in float32. Batch 1, sequence length symbolic.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax, te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from .. import quantization
from ..config import ModelConfig
from ..quantization import QuantScheme
from .weights import hf_rope_scaling


class QuantLinear(nn.Module):
    """A bias-free linear layer over 4-bit weights, in MLC-LLM's graph form: a ``call_tir`` of the
    TE ``dequantize`` (``quantization.te_dequantize``), for the NK layout ``permute_dims``, then
    ``matmul``; the compilers' phase 3 fuses the dequantize into the matmul's kernel. Its parameters
    are the scheme's (``quantization.quantized_names``: ``q_weight``, ``q_scale``; AWQ's ``qweight``,
    ``qzeros``, ``scales``)."""

    def __init__(self, in_features: int, out_features: int, s: QuantScheme) -> None:
        self.stored = tuple(name.removeprefix(".") for name in quantization.quantized_names("", s))
        for name, shape, dtype in zip(self.stored, s.packed_shapes(out_features, in_features), s.packed_dtypes()):
            setattr(self, name, nn.Parameter(shape, dtype))
        self.scheme = s

    def to(self, dtype: str | None = None) -> None:
        # The packed words keep their integer dtype; only the scales follow the model.
        for name, stored_dtype in zip(self.stored, self.scheme.packed_dtypes()):
            if stored_dtype != quantization.STORAGE_DTYPE:
                getattr(self, name).to(dtype)

    def weight(self) -> Tensor:
        """The dequantized weight as stored: ``[N, K]`` (NK) or ``[K, N]`` (KN, KN_N)."""
        s = self.scheme
        return op.tensor_expr_op(
            lambda *stored: quantization.te_dequantize(stored, s), name_hint="dequantize",
            args=[getattr(self, name) for name in self.stored],
        )

    def forward(self, x: Tensor, out_dtype: str | None = None) -> Tensor:
        w = self.weight()
        return op.matmul(x, op.permute_dims(w) if self.scheme.layout == "NK" else w, out_dtype=out_dtype)


class QuantEmbedding(QuantLinear):
    """An embedding table over 4-bit rows (NK: grouped along the hidden dim): a ``take`` of its
    dequantize; as a tied LM head, a ``QuantLinear`` over the same parameters."""

    def __init__(self, num: int, dim: int, s: QuantScheme) -> None:
        super().__init__(dim, num, s)

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return op.take(self.weight(), x, axis=0)


def _linear(config: ModelConfig, name: str, in_features: int, out_features: int) -> nn.Module:
    s = config.quantized_weights().get(f"{name}.weight")
    return nn.Linear(in_features, out_features, bias=False) if s is None else QuantLinear(in_features, out_features, s)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        p = "model.layers.0.self_attn."  # every layer is quantized alike
        self.qkv_proj = _linear(config, p + "qkv_proj", config.hidden_size, config.q_size + 2 * config.kv_size)
        self.o_proj = _linear(config, p + "o_proj", config.q_size, config.hidden_size)

    def forward(self, x: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, self.num_q_heads + 2 * self.num_kv_heads, self.head_dim))
        out = kv_cache.attention_with_fused_qkv(layer_id, qkv, self.num_q_heads, sm_scale=self.head_dim**-0.5)
        return self.o_proj(op.reshape(out, (b, s, self.num_q_heads * self.head_dim)))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        p = "model.layers.0.mlp."  # every layer is quantized alike
        self.gate_up_proj = _linear(config, p + "gate_up_proj", config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = _linear(config, p + "down_proj", config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    # Attributes in ``ModelConfig.weight_shapes()`` order: the exporter lists parameters in
    # attribute order, and that is the order of the compiled functions' packed params.
    def __init__(self, config: ModelConfig) -> None:
        eps = config.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(config.hidden_size, -1, eps, bias=False)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, -1, eps, bias=False)
        self.mlp = LlamaMLP(config)

    def attend(self, x: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        return x + self.self_attn(self.input_layernorm(x), kv_cache, layer_id)

    def feed_forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        return self.feed_forward(self.attend(x, kv_cache, layer_id))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        s = config.quantized_weights().get("model.embed_tokens.weight")
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size) if s is None
            else QuantEmbedding(config.vocab_size, config.hidden_size, s)
        )
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, -1, config.rms_norm_eps, bias=False)

    def forward(self, x: Tensor, kv_cache: PagedKVCache) -> Tensor:
        for layer_id, layer in enumerate(self.layers):
            x = layer(x, kv_cache, layer_id)
        return self.norm(x)


def _last_position(x: Tensor) -> Tensor:
    """``x[:, -1:, :]`` for a symbolic sequence length."""

    def compute(t: te.Tensor) -> te.Tensor:
        b, s, h = t.shape
        return te.compute((b, 1, h), lambda i, _, k: t[i, s - 1, k], name="last_position")

    return op.tensor_expr_op(compute, name_hint="last_position", args=[x])


# Logits a block of the argmax's first stage reduces: LLaMA-3's 128256 make 126 blocks, one wave on
# an H100's 132 SMs (one block over them all took 24 us of a 5.8 ms decode step).
GREEDY_CHUNK = 1024


def _argmax_reducer() -> Any:
    """TVM's argmax combiner, term for term (the first index on ties): the GPU lowering of a
    cross-thread reduction only accepts the combiners it knows."""

    def combine(x: tuple, y: tuple) -> tuple:
        first = tirx.Or(x[1] > y[1], tirx.And(x[1] == y[1], x[0] < y[0]))
        return tirx.Select(first, x[0], y[0]), tirx.Select(x[1] > y[1], x[1], y[1])

    def identity(index: str, value: str) -> tuple:
        return tirx.const(-1, index), te.min_value(value)

    return te.comm_reducer(combine, identity, name="argmax")


def _argmax_chunks(logits: te.Tensor, index_dtype: str) -> te.Tensor:
    """``[1, 1, vocab] -> [ceil(vocab / GREEDY_CHUNK)]``: the index of the largest value of each chunk
    of ``GREEDY_CHUNK`` logits (the first on ties), reduced in ``index_dtype``.

    Written out rather than ``relax.op.argmax`` (whose int64 index would cost a second kernel for
    the cast). The index is int64 on GPUs, where an int32 index in the exporter's int64 loops gets
    casts that hide the pattern; int32 on CPUs, whose index-narrowing pass rejects int64 buffers."""
    # Extents in the dtype of the exporter's shapes (int64), so no int32 loop meets an int64 index.
    dim = str(logits.shape[-1].ty)
    vocab = int(logits.shape[-1])
    chunk = tirx.const(GREEDY_CHUNK, dim)
    k = te.reduce_axis((tirx.const(0, dim), chunk), name="k")

    def at(c: Any) -> tuple:
        j = c * chunk + k.var
        # past the vocabulary (the last chunk): the smallest value, never read
        last = tirx.const(vocab - 1, dim)
        value = tirx.if_then_else(j <= last, logits[0, 0, tirx.min(j, last)], te.min_value(logits.dtype))
        return j.astype(index_dtype), value

    chunks = (tirx.const(-(-vocab // GREEDY_CHUNK), dim),)
    index, _ = te.compute(chunks, lambda c: _argmax_reducer()(at(c), axis=k), name="argmax_chunk")
    # The pair stays an intermediate, so the GPU rules see a reduction with an epilogue (as for
    # topi's argmax), not a function with two reduced outputs.
    return te.compute(chunks, lambda c: index[c].astype(index_dtype), name="chunk_argmax")


def _argmax_int32(logits: te.Tensor, chunk_index: te.Tensor) -> te.Tensor:
    """``[1, 1, vocab]`` and each chunk's argmax ``-> int32 [1]``: the index of the largest value, the
    first on ties (the combiner prefers the smaller index among equal values, in any order)."""
    k = te.reduce_axis((0, chunk_index.shape[0]), name="k")
    pair = (chunk_index[k], logits[0, 0, chunk_index[k]])
    index, _ = te.compute((1,), lambda i: _argmax_reducer()(pair, axis=k), name="argmax")
    return te.compute((1,), lambda i: index[i].astype("int32"), name="greedy")


class LlamaForCausalLM(nn.Module):
    """LLaMA with ``embed``/``prefill``/``decode``/``greedy`` entry points over a TIR paged KV cache."""

    def __init__(self, config: ModelConfig, target: tvm.target.Target) -> None:
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config, "lm_head", config.hidden_size, config.vocab_size)
        self.config = config
        self.target = target
        self.to(config.dtype)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def _logits(self, hidden: Tensor) -> Tensor:
        if self.config.tie_word_embeddings:
            embed = self.model.embed_tokens
            if isinstance(embed, QuantEmbedding):
                return QuantLinear.forward(embed, hidden, out_dtype="float32")
            return op.matmul(hidden, op.permute_dims(embed.weight), out_dtype="float32")
        logits = self.lm_head(hidden)
        return logits if logits.dtype == "float32" else logits.astype("float32")

    def prefill(self, input_embed: Tensor, paged_kv_cache: PagedKVCache) -> tuple[Tensor, PagedKVCache]:
        hidden = _last_position(self.model(input_embed, paged_kv_cache))
        return self._logits(hidden), paged_kv_cache

    def decode(self, input_embed: Tensor, paged_kv_cache: PagedKVCache) -> tuple[Tensor, PagedKVCache]:
        return self._logits(self.model(input_embed, paged_kv_cache)), paged_kv_cache

    # ``decode`` cut after its last use of the KV cache, for a generation loop that starts the next
    # step's cache bookkeeping (which must not overtake this step's attention) while the rest runs.
    def decode_attend(self, input_embed: Tensor, paged_kv_cache: PagedKVCache) -> tuple[Tensor, PagedKVCache]:
        *layers, last = self.model.layers
        x = input_embed
        for layer_id, layer in enumerate(layers):
            x = layer(x, paged_kv_cache, layer_id)
        return last.attend(x, paged_kv_cache, len(layers)), paged_kv_cache

    def decode_greedy(self, hidden: Tensor) -> Tensor:
        return self.greedy(self._logits(self.model.norm(self.model.layers[-1].feed_forward(hidden))))

    def greedy(self, logits: Tensor) -> Tensor:
        # On the device, so a generation loop feeds the token to the next embed without a host trip.
        # Two stages, the first over GREEDY_CHUNK logits a block, so the GPU is not left to one block.
        index_dtype = "int32" if self.target.kind.name == "llvm" else "int64"
        chunks = op.tensor_expr_op(_argmax_chunks, name_hint="greedy_chunks", args=[logits, index_dtype])
        return op.tensor_expr_op(_argmax_int32, name_hint="greedy", args=[logits, chunks])

    def create_tir_paged_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> PagedKVCache:
        c = self.config
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=relax.ShapeExpr([0, c.num_hidden_layers]),
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            qk_head_dim=c.head_dim,
            v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=c.rope_theta,
            # TVM reads llama3 scaling in Hugging Face's form; an empty dict means plain RoPE.
            rope_scaling=hf_rope_scaling(c) or {},
            # No longrope extension factors: the runtime reads integer 0 as "none".
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=c.head_dim,
            enable_disaggregation=False,
            dtype=c.dtype,
            target=self.target,
        )

    def module_spec(self) -> nn.spec.ModuleSpec:
        """The exported functions' inputs: batch 1, ``seq_len`` symbolic, params packed."""
        c = self.config
        packed = {"param_mode": "packed", "effect_mode": "none"}
        cache = nn.spec.Object(object_type=PagedKVCache)
        return nn.spec.ModuleSpec.from_raw(
            {
                "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
                "prefill": {
                    "input_embed": nn.spec.Tensor([1, "seq_len", c.hidden_size], c.dtype),
                    "paged_kv_cache": cache,
                    "$": packed,
                },
                "decode": {
                    "input_embed": nn.spec.Tensor([1, 1, c.hidden_size], c.dtype),
                    "paged_kv_cache": cache,
                    "$": packed,
                },
                "decode_attend": {
                    "input_embed": nn.spec.Tensor([1, 1, c.hidden_size], c.dtype),
                    "paged_kv_cache": cache,
                    "$": packed,
                },
                "decode_greedy": {"hidden": nn.spec.Tensor([1, 1, c.hidden_size], c.dtype), "$": packed},
                "greedy": {
                    "logits": nn.spec.Tensor([1, 1, c.vocab_size], "float32"),
                    "$": {"param_mode": "none", "effect_mode": "none"},
                },
                "create_tir_paged_kv_cache": {
                    "max_batch_size": int,
                    "max_total_seq_len": int,
                    "prefill_chunk_size": int,
                    "page_size": int,
                    "support_sliding_window": int,
                    "$": {"param_mode": "none", "effect_mode": "none"},
                },
            },
            self,
        )


def export_module(
    config: ModelConfig, target: tvm.target.Target
) -> tuple[tvm.IRModule, list[tuple[str, tuple[int, ...], str]]]:
    """The model as a Relax IRModule plus its parameters as ``(name, shape, dtype)``.

    Functions (batch 1, ``seq_len`` symbolic); ``params`` is ONE packed argument, the tuple of
    all weights in the returned order (``ModelConfig.weight_shapes()`` order), as MLC-LLM's
    ``param_mode: packed``:

    - ``embed(input_ids: int32[seq_len], params) -> [seq_len, hidden]``
    - ``prefill(input_embed: [1, seq_len, hidden], paged_kv_cache, params)
      -> (float32 logits [1, 1, vocab] of the last position, paged_kv_cache)``
    - ``decode(input_embed: [1, 1, hidden], paged_kv_cache, params) -> (float32 [1, 1, vocab], paged_kv_cache)``
    - ``greedy(logits: float32 [1, 1, vocab]) -> int32 [1]``: the largest logit's index (the first
      on ties), ready to feed ``embed``
    - ``decode_attend(input_embed: [1, 1, hidden], paged_kv_cache, params) -> ([1, 1, hidden],
      paged_kv_cache)`` and ``decode_greedy(hidden: [1, 1, hidden], params) -> int32 [1]``: ``decode``
      then ``greedy``, cut after the last layer's attention (the last use of the cache)
    - ``create_tir_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
      support_sliding_window)`` (shape-tuple ints) ``-> paged_kv_cache``

    ``target`` picks the cache's attention kernels (CPU ones for ``llvm``).
    """
    model = LlamaForCausalLM(config, target)
    mod, named_params = model.export_tvm(spec=model.module_spec(), allow_extern=False)
    params = [(name, tuple(int(d) for d in p.shape), str(p.dtype)) for name, p in named_params]
    # The weight loaders feed tensors in weight_shapes() order; a drift here would mis-assign weights.
    expected = list(config.weight_shapes().items())
    if [(n, s) for n, s, _ in params] != expected:
        raise AssertionError("exported parameter list differs from ModelConfig.weight_shapes()")
    return mod, params
