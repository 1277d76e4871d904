"""Recognise a matmul's B operand computed by a group dequantize (MLC-LLM's ``q4f16_1`` and kin).

After MLC-LLM's phase 3 a quantized projection is one PrimFunc: injective stages computing the
float weight ``B`` from packed integer words, then the matmul reading ``B``. MLC writes them as::

    compute[n, k] = dtype((Q[n, k // 8] >> uint32(k % 8 * 4)) & 15)
    B[n, k] = (compute[n, k] - dtype(7)) * S[n, k // 32]

(or as one stage, or with other names). ``analyze_dequant`` composes the stages that produce ``B``
into one expression of ``B``'s two indices and matches it by its arithmetic, not by names: a packed
word of ``Q`` (an integer buffer) at the element's word, shifted right by ``bits`` times the
element's place in the word, masked to ``bits`` bits, cast to the float dtype, minus a constant
zero point, times a scale of ``S`` at ``k // group``. The packed words run along K: ``Q[n, k / e]``
(layout ``NK``) or ``Q[k / e, n]`` (``KN``), with the scale laid out alike. Anything else (a zero
point buffer, as AWQ has; a non-affine expression; a group that does not divide K; a stage writing
something else the function reads) is not a dequantize (None).

The result is a plain description (``Dequant``); the templates that take one say which they serve
(``gemv_rows``: 4-bit, ``NK``, a group of a multiple of 32).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tvm
from tvm import arith, tirx
from tvm.tirx import stmt_functor

_DATA_PAR = 0


@dataclasses.dataclass(frozen=True)
class Dequant:
    """``B[n, k] = (dtype((Q[..] >> bits * (k % per_word)) & (2^bits - 1)) - zero) * S[.., k // group]``."""

    bits: int  # 4: bits of one value
    per_word: int  # values packed in one word of ``packed`` (8 for 4-bit values in uint32)
    group: int  # K elements sharing one scale (32, 128)
    zero: float  # the constant subtracted (7 for MLC's 4-bit schemes)
    layout: str  # "NK": packed[N, K / per_word], scale[N, K / group]; "KN": both transposed
    packed: Any  # tvm.tirx.Buffer of the packed words (an integer dtype)
    scale: Any  # tvm.tirx.Buffer of the scales (dtype ``dtype``)
    dtype: str  # the dequantized weight's dtype (and the arithmetic's): float16 or bfloat16
    stages: tuple[str, ...]  # names of the blocks computing B, in order

    @property
    def storage_dtype(self) -> str:
        return str(self.packed.dtype)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, int):
        a, b = b, a
    if isinstance(b, int):
        b = tirx.IntImm(str(a.ty), b)
    if str(a.ty) != str(b.ty):
        b = tirx.Cast(str(a.ty), b)
    return bool(arith.Analyzer().can_prove_equal(a, b))


def _is_var(expr: Any, var: tirx.Var) -> bool:
    return expr.same_as(var) or (isinstance(expr, tirx.Cast) and expr.value.same_as(var))


def _strip_int_casts(expr: Any) -> Any:
    while isinstance(expr, tirx.Cast) and str(expr.ty).startswith(("int", "uint")) and str(
        expr.value.ty
    ).startswith(("int", "uint")):
        expr = expr.value
    return expr


def _floordiv_const(expr: Any, var: tirx.Var) -> int | None:
    """``d`` where ``expr`` is ``var // d`` (a positive constant), else None."""
    if isinstance(expr, tirx.FloorDiv) and _is_var(expr.a, var) and isinstance(expr.b, tirx.IntImm):
        d = int(expr.b.value)
        return d if d > 0 else None
    return None


def _compose(stages: list[Any], writer: int, allocs: list[tirx.Buffer]) -> tuple[Any, list[tirx.Var], list[int]] | None:
    """``B``'s value (the store of stage ``writer``) with every intermediate it reads replaced by the
    expression of the stage writing it, and the stages used (in order). Intermediates must be read at
    the same indices their 2-D stage writes (an injective chain), else None."""
    stage = stages[writer]
    vars_ = [iv.var for iv in stage.block.iter_vars]
    if len(vars_) != 2 or any(int(iv.iter_type) != _DATA_PAR for iv in stage.block.iter_vars):
        return None
    if stage.block.init is not None or not _same_vars(stage.store.indices, vars_):
        return None
    used = [writer]
    ok = True

    def post(node: Any) -> Any:
        nonlocal ok
        if not isinstance(node, tirx.BufferLoad) or not any(node.buffer.same_as(a) for a in allocs):
            return None
        src = next((i for i in range(writer) if stages[i].store.buffer.same_as(node.buffer)), None)
        if src is None or not _same_vars(node.indices, vars_):
            ok = False
            return None
        inner = _compose(stages, src, allocs)
        if inner is None or not all(_equal(a, b) for a, b in zip(stages[src].extents, stage.extents)):
            ok = False
            return None
        value, ivars, sub_used = inner
        used.extend(sub_used)
        return stmt_functor.substitute(value, dict(zip(ivars, vars_)))

    value = stmt_functor.ir_transform(tirx.Evaluate(stage.store.value), None, post, ["tirx.BufferLoad"]).value
    if not ok:
        return None
    return value, vars_, sorted(set(used))


def _same_vars(indices: Any, vars_: list[tirx.Var]) -> bool:
    return len(indices) == len(vars_) and all(i.same_as(v) for i, v in zip(indices, vars_))


def _match(value: Any, vn: tirx.Var, vk: tirx.Var, dtype: str) -> dict | None:
    """The fields of a dequantize ``value`` of (vn, vk) computes (see the module docstring), or None."""
    if not isinstance(value, tirx.Mul) or str(value.ty) != dtype:
        return None
    for sub, scale in ((value.a, value.b), (value.b, value.a)):
        if isinstance(sub, tirx.Sub) and isinstance(scale, tirx.BufferLoad):
            break
    else:
        return None
    if not isinstance(sub.b, tirx.FloatImm):
        return None  # a zero-point buffer (AWQ) or another expression: not served
    zero = float(sub.b.value)
    cast = sub.a
    if not (isinstance(cast, tirx.Cast) and str(cast.ty) == dtype):
        return None
    masked = _strip_int_casts(cast.value)
    if not isinstance(masked, tvm.ir.Call) or masked.op.name != "tirx.bitwise_and":
        return None
    shifted, mask = masked.args
    if isinstance(shifted, tirx.IntImm):
        shifted, mask = mask, shifted
    if not isinstance(mask, tirx.IntImm):
        return None
    mask = int(mask.value)
    bits = (mask + 1).bit_length() - 1
    if mask < 1 or (mask + 1) & mask:
        return None
    shifted = _strip_int_casts(shifted)
    if not isinstance(shifted, tvm.ir.Call) or shifted.op.name != "tirx.shift_right":
        return None
    word, shift = _strip_int_casts(shifted.args[0]), _strip_int_casts(shifted.args[1])
    if not isinstance(word, tirx.BufferLoad) or len(word.indices) != 2:
        return None
    packed = word.buffer
    storage = str(packed.dtype)
    if not storage.startswith(("int", "uint")):
        return None
    storage_bits = int(packed.dtype.bits)
    if storage_bits % bits:
        return None
    per_word = storage_bits // bits
    # Which index of the packed word runs along K: NK has [n, k / e], KN [k / e, n].
    layouts = {"NK": (0, 1), "KN": (1, 0)}
    layout = None
    for name, (ni, ki) in layouts.items():
        if _is_var(word.indices[ni], vn) and _floordiv_const(word.indices[ki], vk) == per_word:
            layout = name
    if layout is None:
        return None
    # The shift: bits x (k % per_word).
    if not _equal(shift, tirx.floormod(vk, per_word) * bits):
        return None
    if len(scale.indices) != 2 or str(scale.buffer.dtype) != dtype:
        return None
    ni, ki = layouts[layout]
    group = _floordiv_const(scale.indices[ki], vk)
    if group is None or not _is_var(scale.indices[ni], vn) or group % per_word:
        return None
    return {"bits": bits, "per_word": per_word, "group": group, "zero": zero, "layout": layout,
            "packed": packed, "scale": scale.buffer}


def analyze_dequant(
    stages: list[Any], at: int, allocs: list[tirx.Buffer], b: tirx.Buffer, b_layout: str, n: Any, k: int,
) -> Dequant | None:
    """The dequantize computing the matmul's B (an intermediate written by the stages before stage
    ``at``, the matmul) as ``Dequant``, or None. Its stages must be the last ones before the matmul
    (``Dequant.stages``; those before them, a norm prologue of A, are the caller's to recognise), and
    ``B`` must be ``[n, k]`` (``b_layout`` "NT") or ``[k, n]`` ("NN") as the matmul reads it.

    stages: the function's stages (``analysis._Stage``: block, extents, store), in order.
    """
    if not any(b.same_as(x) for x in allocs) or k <= 0:
        return None
    writer = next((i for i in range(at) if stages[i].store.buffer.same_as(b)), None)
    if writer is None:
        return None
    found = _compose(stages, writer, allocs)
    if found is None:
        return None
    value, vars_, used = found
    if used != list(range(used[0], at)):
        return None  # the dequantize's stages interleaved with others
    # Intermediates of the dequantize other than B: read by nothing but the chain (checked by the
    # caller for the stages after the matmul), and the matmul reads only B.
    vn, vk = (vars_[0], vars_[1]) if b_layout == "NT" else (vars_[1], vars_[0])
    dtype = str(b.dtype)
    fields = _match(value, vn, vk, dtype)
    if fields is None:
        return None
    per_word, group = fields["per_word"], fields["group"]
    if k % group or k % per_word:
        return None
    # Shapes: B as the matmul reads it; the packed words and the scales in the layout found.
    extents = stages[writer].extents
    if not (_equal(extents[0], n if b_layout == "NT" else k) and _equal(extents[1], k if b_layout == "NT" else n)):
        return None
    nk = fields["layout"] == "NK"
    for buf, per in ((fields["packed"], per_word), (fields["scale"], group)):
        want = (n, k // per) if nk else (k // per, n)
        if len(buf.shape) != 2 or not all(_equal(a, b_) for a, b_ in zip(buf.shape, want)):
            return None
        if buf.strides or not (isinstance(buf.elem_offset, tirx.IntImm) and int(buf.elem_offset.value) == 0):
            return None
        if any(buf.same_as(x) for x in allocs):
            return None
    return Dequant(**fields, dtype=dtype, stages=tuple(stages[i].block.name_hint for i in used))
