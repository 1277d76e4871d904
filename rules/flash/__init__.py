"""Flash-attention kernel templates: TIR functions, already scheduled, that the attention rules emit.

``decode``: split-KV (flash-decoding) attention of one query token over TVM's paged KV cache.
``prefill``: tensor-core flash attention over ragged (KV-cache) and dense (graph) layouts.
Each template takes a config dataclass read from ``configs/attention/``.
"""
