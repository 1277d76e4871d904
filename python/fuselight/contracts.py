"""The names passes, rules and the runtime agree on: IR attributes, kernel symbols, global functions.

A graph pass that fuses a computation for a schedule rule emits it unscheduled and tags it with the
attribute naming the rule family (``RULE_ATTR``; some families read more attributes of their own);
the rule schedules it in phase 4. The KV cache's kernels are named by symbol: launch counting
(``fuselight.compile``), the PDL audit's exceptions and the profiles' kernel families read them.
Plain strings only: this module imports nothing, so the runtime-only GPU host (no TVM compiler)
imports it as well.
"""

from __future__ import annotations

# ---------------------------------------------------------------- TVM's own names

# Set on a PrimFunc whose body is final; DLight's ApplyDefaultSchedule skips it.
IS_SCHEDULED_ATTR = "tirx.is_scheduled"
# TVM's op pattern of a PrimFunc (AnnotateTIROpPattern keeps one already set; FuseOps reads it).
OP_PATTERN_ATTR = "op_pattern"
# ``kOpaque``: FuseOps fuses nothing into, or out of, a call of such a function: it stays standalone,
# so the rule sees the computation as the pass emitted it.
OPAQUE_OP_PATTERN = 8
# TVM's tensor copy ``(from, to)``, destination-passing: a memcpy on the stream, never a kernel launch.
TENSOR_COPY_FUNC = "runtime.TVMTensorCopyFromTo"

# ---------------------------------------------------------------- fused computations (passes -> rules)

# Which fuselight rule family schedules an unscheduled fused function a pass emitted
# (``"gemm"``: the Matmul or Gemv rule, by M; ``"gemv"``, ``"row_reduction"``, ``"paged_attention"``).
RULE_ATTR = "fuselight.rule"
# PrimFunc attribute: {symbolic variable name: largest value} its Relax callers allow (passes.attach_dim_bounds).
DIM_UPPER_BOUND_ATTR = "fuselight.dim_upper_bound"
# FuseAttention's reference attention: the ``AttentionSpec`` as a map (the FlashAttention rule).
ATTENTION_ATTR = "fuselight.attention"
# A KV-cache attention kernel of TVM's handed to the PagedAttention rule: its kind
# ("decode", "prefill_ragged", "prefill_paged").
PAGED_ATTENTION_ATTR = "fuselight.paged_attention"
# FuseRopeAppend's kernels: the fused split-rotary + append (RopeAppend rule), and the decode
# attention that does RoPE and the append itself.
FUSED_ROPE_APPEND_ATTR = "fuselight.fused_rope_append"
FUSED_ROPE_APPEND_DECODE_ATTR = "fuselight.fused_rope_append_decode"
# Kernel launches one call of a PrimFunc makes (more than one: a split-KV decode and its merge).
KERNEL_LAUNCHES_ATTR = "fuselight.kernel_launches"
# Rewrites PropertyRewrite considered and refused, on the Relax function.
REWRITES_REFUSED_ATTR = "fuselight.rewrites_refused"

# Names (GlobalVars) of the PrimFuncs the passes emit.
GATE_UP_SILU_NAME = "gate_up_matmul_swiglu"
NORM_GEMV_NAME = "fused_rms_norm_gemv"
ATTENTION_NAME = "fused_attention"
FUSED_ROPE_APPEND_NAME = "fused_rope_append"

# ---------------------------------------------------------------- the KV cache's kernels

# Symbols of fuselight's KV-cache attention kernels, by PAGED_ATTENTION_ATTR kind.
DECODE_SYMBOL = "fuselight_decode_paged_kv"
ROTARY_DECODE_SYMBOL = "fuselight_rope_append_decode_paged_kv"
RAGGED_PREFILL_SYMBOL = "fuselight_prefill_ragged_kv"
PAGED_PREFILL_SYMBOL = "fuselight_prefill_paged_kv"
PAGED_ATTENTION_SYMBOLS = {"decode": DECODE_SYMBOL, "prefill_ragged": RAGGED_PREFILL_SYMBOL,
                           "prefill_paged": PAGED_PREFILL_SYMBOL}

# Global functions the fuselight runtime registers (``fuselight.kv_hooks``): the KV cache's kernel
# wrappers a library built with FuseRopeAppend asks for.
HOOKS_FUNC = "fuselight.kv_cache.fuse_rope_append"
HOOKS_DECODE_FUNC = "fuselight.kv_cache.fuse_rope_append_decode"
# On the function tagged FUSED_ROPE_APPEND_DECODE_ATTR: build the decode kernel that finds lengths
# and the append slot from the q positions (``passes.capture_whole_step``; rules/flash/decode.py).
DECODE_BY_POSITION_ATTR = "fuselight.decode_by_position"
# TVM's KV-cache attention builtin, which a decode function's layers call (``call_dps_packed``).
ATTENTION_BUILTIN = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
# TVM's attention builtin forwarded under our name (``kv_hooks.cc``): RewriteCUDAGraph captures calls
# of it, never of ``vm.builtin.*`` (``passes.capture_whole_step``).
ATTENTION_FORWARD_FUNC = "fuselight.kv_cache.attention_with_fused_qkv"
# The first parameter of a decode function that takes token ids (int32 ``[1]``) and looks their
# embedding up itself (``passes.capture_whole_step``), where it would take the input embedding.
TOKEN_IDS_PARAM = "input_ids"
