"""FlashAttention: schedule the attention PrimFuncs of ``fuselight.passes.FuseAttention`` as flash attention.

The pass leaves a reference attention (scores, softmax and output as separate TIR stages, the S x S
scores in a buffer) tagged with the ``fuselight.attention`` attribute. This rule recognises such a
function, checks that its body is exactly the reference computation the attribute describes, and
replaces it with the tensor-core flash-attention template ``fuselight.rules.flash.prefill
.flash_attention_dense`` (same parameters ``(q, k, v[, mask], out)``, same layouts), which keeps
the scores on chip. Where the template cannot serve (head dims, dtypes, arches it has no config
for, a causal mask whose diagonal it does not share), ``apply`` returns None and DLight's default
rules schedule the reference function instead. The template tiles queries (times the GQA group)
per block and walks all keys in each, which for a call with one query (decode) would be B x Hkv
blocks on the whole GPU: without a causal mask (one query under it sees only the first key), such
calls branch at run time to the split-KV kernels of ``fuselight.rules.flash.decode``.
"""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import Target

from ..errors import FuselightError
from ..target import arch_of
from ..computations import AttentionSpec, attention_prim_func
from ..contracts import ATTENTION_ATTR
from .base import AnalyzeScheduleRule
from .flash.decode import dense_decode, load_decode_config
from .flash.prefill import flash_attention_dense, load_prefill_config

# Attributes of the reference function the scheduled kernel keeps (the template sets its own others).
KEPT_ATTRS = ("target", ATTENTION_ATTR)


@dataclasses.dataclass(frozen=True)
class AttentionDesc:
    """An attention PrimFunc as recognised: what it computes (see ``AttentionSpec``)."""

    spec: AttentionSpec


class FlashAttention(AnalyzeScheduleRule):
    """Swap fused attention functions for the flash-attention template (see the module docstring)."""

    family = "flash_attention"

    @staticmethod
    def analyze(func: tirx.PrimFunc) -> AttentionDesc | None:
        """The attention ``func`` computes, if it carries ``fuselight.attention`` and its body is the
        reference computation for that description; None for anything else."""
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None or ATTENTION_ATTR not in func.attrs:
            return None
        try:
            spec = AttentionSpec.from_attr(func.attrs[ATTENTION_ATTR])
            reference = attention_prim_func(spec)
        except (TypeError, ValueError, KeyError, tvm.error.TVMError):
            return None  # an attribute this version does not understand
        # Same parameters and body up to variable names: attributes differ (target, op_pattern).
        reference = tirx.PrimFunc(reference.params, reference.body, reference.ret_type, attrs=func.attrs)
        if not tvm_ffi.structural_equal(func, reference, map_free_vars=True):
            return None
        return AttentionDesc(spec)

    def schedule(self, func: tirx.PrimFunc, desc: AttentionDesc, target: Target) -> tirx.PrimFunc | None:
        """The flash-attention template for ``desc`` on ``target`` (keeping ``func``'s target and
        attention attributes), or None where it does not serve."""
        spec = desc.spec
        if spec.causal and not spec.same_length:
            # Ours: key j seen by query i iff j <= i; the template's diagonal ends at the last key
            # (j <= i + Skv - Sq). They agree only when Sq == Skv is known.
            return None
        if spec.additive_mask and spec.mask_dtype != spec.dtype:
            return None
        kwargs = {"sm_scale": spec.scale, "layout": spec.layout, "additive_mask": spec.additive_mask}
        heads = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype)
        try:
            arch = arch_of(target)
            config = load_prefill_config(arch, spec.head_dim)
        except FuselightError:
            return None  # no tile config for this arch or head dim
        decode = None
        if not spec.causal:
            try:
                decode = dense_decode(*heads, **kwargs, config=load_decode_config(arch))
            except FuselightError:
                pass  # no decode config or head layout it takes: the prefill kernel serves Sq = 1 too
        try:
            kernel = flash_attention_dense(*heads, causal=spec.causal, **kwargs, config=config, decode=decode)
        except FuselightError:
            return None  # a dtype or head dim the template does not take
        kernel = kernel.without_attr("global_symbol")
        for key in KEPT_ATTRS:
            if key in func.attrs:
                kernel = kernel.with_attr(key, func.attrs[key])
        return kernel
