"""Recognise a matmul's B operand computed by a group dequantize (MLC-LLM's ``q4f16_1`` and kin).

After MLC-LLM's phase 3 a quantized projection is one PrimFunc: injective stages computing the
float weight ``B`` from packed integer words, then the matmul reading ``B``. MLC writes them as::

    compute[n, k] = dtype((Q[n, k // 8] >> uint32(k % 8 * 4)) & 15)
    B[n, k] = (compute[n, k] - dtype(7)) * S[n, k // 32]

(or as one stage, or with other names). MLC's ``q4f16_autoawq`` (AutoAWQ's checkpoints) packs
along N instead and has a zero point per group, packed alike, and its stages read transposes::

    B[n, k] = (dtype(unpack(Q[k, n // 8], n)) - dtype(unpack(Z[k // 128, n // 8], n))) * S[k // 128, n]
    unpack(w, n) = (w >> uint32(4 * place(n % 8))) & 15,  place = 0, 4, 1, 5, 2, 6, 3, 7

``analyze_dequant`` composes the stages that produce ``B`` into one expression of ``B``'s two
indices (each intermediate replaced by its stage's expression at the indices it is read at) and
matches it by its arithmetic, not by names: a packed word of ``Q`` (an integer buffer), shifted
right by ``bits`` times the element's place in the word (a permutation of the word's places, a
function of the packed index modulo the values a word holds), masked to ``bits`` bits, cast to the
float dtype, minus a zero point, times a scale of ``S`` at ``k // group``. The layouts
(``Dequant.layout``):

- ``NK``: ``Q[n, k / e]``, ``S[n, k / group]`` (q4f16_1, q4bf16_1);
- ``KN``: ``Q[k / e, n]``, ``S[k / group, n]`` (q4f16_0): words along K, transposed;
- ``KN_N``: ``Q[k, n / e]``, ``S[k / group, n]``: words along N (q4f16_autoawq).

The zero point is a constant, or (``KN_N`` only) a packed buffer ``Z[k / group, n / e]`` of the same
bits, places and group as the weight. Anything else (a zero point buffer laid out otherwise; a
non-affine expression; a group that does not divide K; a stage writing something else the function
reads) is not a dequantize (None).

The result is a plain description (``Dequant``); the templates that take one say which they serve
(all of them: ``Dequant.nk_in_order``, 4-bit, a group of a multiple of 32).
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
    """``B[n, k] = (dtype((Q[..] >> bits * place) & (2^bits - 1)) - zero) * S[.., k // group]``
    (see the module docstring for the layouts, the places and the zero point)."""

    bits: int  # 4: bits of one value
    per_word: int  # values packed in one word of ``packed`` (8 for 4-bit values in uint32)
    group: int  # K elements sharing one scale (32, 128)
    zero: float  # the constant subtracted (7 for MLC's 4-bit schemes); 0 where ``zeros`` is a buffer
    layout: str  # "NK", "KN" or "KN_N" (the module docstring)
    packed: Any  # tvm.tirx.Buffer of the packed words (an integer dtype)
    scale: Any  # tvm.tirx.Buffer of the scales (dtype ``dtype``)
    dtype: str  # the dequantized weight's dtype (and the arithmetic's): float16 or bfloat16
    stages: tuple[str, ...]  # names of the blocks computing B, in order
    # Place in its word (in values) of the packed index's value i (i = index % per_word): identity
    # for MLC's group schemes, (0, 4, 1, 5, 2, 6, 3, 7) for AWQ's.
    places: tuple[int, ...]
    zeros: Any  # tvm.tirx.Buffer of packed zero points (KN_N: [K / group, N / per_word]), or None

    @property
    def storage_dtype(self) -> str:
        return str(self.packed.dtype)

    @property
    def nk_in_order(self) -> bool:
        """Words along K in layout NK, values in place order, a constant zero point: the form every
        template dequantizes."""
        return self.layout == "NK" and self.zeros is None and self.places == tuple(range(self.per_word))


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
    expression of the stage writing it at the indices read (a transpose, a group's zero point), and
    the stages used (in order). Each such stage must be 2-D and write its whole intermediate, else None."""
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
        if src is None or len(node.indices) != 2:
            ok = False
            return None
        inner = _compose(stages, src, allocs)
        if inner is None or not all(_equal(a, b) for a, b in zip(stages[src].extents, node.buffer.shape)):
            ok = False
            return None
        value, ivars, sub_used = inner
        used.extend(sub_used)
        return stmt_functor.substitute(value, dict(zip(ivars, node.indices)))

    value = stmt_functor.ir_transform(tirx.Evaluate(stage.store.value), None, post, ["tirx.BufferLoad"]).value
    if not ok:
        return None
    return value, vars_, sorted(set(used))


def _same_vars(indices: Any, vars_: list[tirx.Var]) -> bool:
    return len(indices) == len(vars_) and all(i.same_as(v) for i, v in zip(indices, vars_))


def _unpack(expr: Any, dtype: str) -> tuple[tirx.BufferLoad, Any, int] | None:
    """``(word, shift, bits)`` where ``expr`` is ``dtype((word >> shift) & (2^bits - 1))``, ``word`` a
    2-D load of an integer buffer; else None."""
    if not (isinstance(expr, tirx.Cast) and str(expr.ty) == dtype):
        return None
    masked = _strip_int_casts(expr.value)
    if not isinstance(masked, tvm.ir.Call) or masked.op.name != "tirx.bitwise_and":
        return None
    shifted, mask = masked.args
    if isinstance(shifted, tirx.IntImm):
        shifted, mask = mask, shifted
    if not isinstance(mask, tirx.IntImm):
        return None
    mask = int(mask.value)
    if mask < 1 or (mask + 1) & mask:
        return None
    shifted = _strip_int_casts(shifted)
    if not isinstance(shifted, tvm.ir.Call) or shifted.op.name != "tirx.shift_right":
        return None
    word, shift = _strip_int_casts(shifted.args[0]), _strip_int_casts(shifted.args[1])
    if not isinstance(word, tirx.BufferLoad) or len(word.indices) != 2:
        return None
    if not str(word.buffer.dtype).startswith(("int", "uint")):
        return None
    return word, shift, (mask + 1).bit_length() - 1


def _places(shift: Any, var: tirx.Var, per_word: int, bits: int) -> tuple[int, ...] | None:
    """The place in its word (in values) of value ``i`` of each run of ``per_word`` along ``var``,
    where ``shift`` is ``bits`` times a permutation of the places, a function of ``var % per_word``
    alone (evaluated at ``var = per_word t + i`` for a free ``t``); else None."""
    t = tirx.Var("t", str(var.ty))
    analyzer = arith.Analyzer()
    places = []
    for i in range(per_word):
        at = analyzer.simplify(stmt_functor.substitute(shift, {var: t * per_word + i}))
        if not isinstance(at, tirx.IntImm) or int(at.value) % bits:
            return None
        places.append(int(at.value) // bits)
    return tuple(places) if sorted(places) == list(range(per_word)) else None


def _word_layout(word: tirx.BufferLoad, vn: tirx.Var, vk: tirx.Var, per_word: int) -> str | None:
    """The layout (module docstring) whose packed word ``word`` reads, or None."""
    i0, i1 = word.indices
    if _is_var(i0, vn) and _floordiv_const(i1, vk) == per_word:
        return "NK"
    if _floordiv_const(i0, vk) == per_word and _is_var(i1, vn):
        return "KN"
    if _is_var(i0, vk) and _floordiv_const(i1, vn) == per_word:
        return "KN_N"
    return None


def _match(value: Any, vn: tirx.Var, vk: tirx.Var, dtype: str) -> dict | None:
    """The fields of a dequantize ``value`` of (vn, vk) computes (see the module docstring), or None."""
    if not isinstance(value, tirx.Mul) or str(value.ty) != dtype:
        return None
    for sub, scale in ((value.a, value.b), (value.b, value.a)):
        if isinstance(sub, tirx.Sub) and isinstance(scale, tirx.BufferLoad):
            break
    else:
        return None
    unpacked = _unpack(sub.a, dtype)
    if unpacked is None:
        return None
    word, shift, bits = unpacked
    packed = word.buffer
    storage_bits = int(packed.dtype.bits)
    if storage_bits % bits:
        return None
    per_word = storage_bits // bits
    layout = _word_layout(word, vn, vk, per_word)
    if layout is None:
        return None
    along = vn if layout == "KN_N" else vk  # the axis the words pack
    places = _places(shift, along, per_word, bits)
    if places is None:
        return None
    if len(scale.indices) != 2 or str(scale.buffer.dtype) != dtype:
        return None
    ni, ki = (0, 1) if layout == "NK" else (1, 0)
    group = _floordiv_const(scale.indices[ki], vk)
    if group is None or not _is_var(scale.indices[ni], vn) or (layout != "KN_N" and group % per_word):
        return None
    zero, zeros = _zero_point(sub.b, dtype, layout, vn, vk, (bits, per_word, group, places, str(packed.dtype)))
    if zero is None:
        return None
    return {"bits": bits, "per_word": per_word, "group": group, "zero": zero, "layout": layout,
            "packed": packed, "scale": scale.buffer, "places": places, "zeros": zeros}


def _zero_point(expr: Any, dtype: str, layout: str, vn: tirx.Var, vk: tirx.Var,
                weight: tuple) -> tuple[float | None, Any]:
    """``(zero, zeros)``: a constant zero point ``(value, None)``, or a KN_N packed buffer ``(0.0, Z)``
    read at ``Z[k // group, n // per_word]`` in the weight's ``(bits, per_word, group, places,
    storage dtype)``; ``(None, None)`` for anything else."""
    if isinstance(expr, tirx.FloatImm):
        return float(expr.value), None
    unpacked = _unpack(expr, dtype)
    if layout != "KN_N" or unpacked is None:
        return None, None
    word, shift, bits = unpacked
    w_bits, per_word, group, places, storage = weight
    if bits != w_bits or str(word.buffer.dtype) != storage:
        return None, None
    if _floordiv_const(word.indices[0], vk) != group or _floordiv_const(word.indices[1], vn) != per_word:
        return None, None
    if _places(shift, vn, per_word, bits) != places:
        return None, None
    return 0.0, word.buffer


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
    per_word, group, layout = fields["per_word"], fields["group"], fields["layout"]
    if k % group or (layout != "KN_N" and k % per_word):
        return None
    # Shapes: B as the matmul reads it; the packed words, scales (and zero points) in the layout found.
    extents = stages[writer].extents
    if not (_equal(extents[0], n if b_layout == "NT" else k) and _equal(extents[1], k if b_layout == "NT" else n)):
        return None
    if layout == "KN_N":
        if not isinstance(n, (int, tirx.IntImm)) or int(n) % per_word:
            return None  # words along N: whole words of a static N
        wn = int(n) // per_word
        want = [(fields["packed"], (k, wn)), (fields["scale"], (k // group, n)), (fields["zeros"], (k // group, wn))]
    else:
        nk = layout == "NK"
        want = [(buf, (n, k // per) if nk else (k // per, n))
                for buf, per in ((fields["packed"], per_word), (fields["scale"], group))]
    for buf, shape in want:
        if buf is None:
            continue  # a constant zero point
        if len(buf.shape) != 2 or not all(_equal(a, b_) for a, b_ in zip(buf.shape, shape)):
            return None
        if buf.strides or not (isinstance(buf.elem_offset, tirx.IntImm) and int(buf.elem_offset.value) == 0):
            return None
        if any(buf.same_as(x) for x in allocs):
            return None
    return Dequant(**fields, dtype=dtype, stages=tuple(stages[i].block.name_hint for i in used))
