"""Fuse plain-op attention, ``softmax(mask(scale * Q K^T)) V``, into ``call_tir(attention, q, k, v[, mask])``.

Graphs that do not use a KV cache (encoders, ViT, diffusion, a LLaMA written with plain ops) spell
attention as a chain of Relax ops; lowered op by op, each step writes the S x S score matrix to
memory. This pass finds the chain and replaces it with a ``call_tir`` to one PrimFunc computing it
(TE's reference computation, which runs anywhere), tagged with the function attribute
``fuselight.attention`` (``contracts.ATTENTION_ATTR``) so that the schedule rule ``fuselight.rules.FlashAttention``
can swap in a flash-attention kernel that never materialises the scores on the GPU.

What is recognised, walking the dataflow bindings back and forth from each ``R.nn.softmax``:

* ``matmul(Q, K^T)`` feeding the softmax, ``matmul(P, V)`` consuming it, softmax over the key axis;
* Q, K, V reached through ``permute_dims``, reshapes that only add or drop unit dims, scalar
  constant scales (multiply/divide, on Q or K) and, for K and V only, grouped-query head sharing
  (``repeat`` over the head axis, or ``expand_dims``/``broadcast_to``/``reshape`` merging the group
  into the heads, or matmul broadcasting of a single head): key/value head ``h // (Hq / Hkv)``
  serves query head ``h``;
* between the two matmuls: scalar constant scales (temperatures), ``astype`` widening to float32
  before the softmax and back to the input dtype after it, a causal mask (``+ triu(full(c), 1)`` or
  ``where(tril(ones), s, c)`` with ``c <= MASK_FLOOR``, key ``j`` seen by query ``i`` iff ``j <= i``)
  and/or an additive mask tensor that does not vary over heads and is not computed from Q, K or V.

Anything else is left unchanged: a softmax not between two such matmuls, masks of other shapes or
diagonals (or that broadcast the scores), non-constant or non-scalar scales, a scale after an
additive mask tensor, or after a causal mask if it lifts masked positions above ``MASK_FLOOR``, a
narrowing ``astype`` of the scores, mixed dtypes, symbolic head counts or head dims, and chains
whose intermediate results (scores, probabilities) have other users. Batch and sequence lengths
stay symbolic.

Q, K, V, the mask and the output take one layout, ``BSHD`` ([batch, seq, heads, dim]) or ``BHSD``
(the one Q already has, so that reshapes adding a unit batch dim are the only glue), mask
``[MB, 1, Sq, Skv]`` (MB = 1 or B); the PrimFunc's parameters are ``(q, k, v[, mask], out)``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from ..computations import ACCUMULATE_DTYPE, AttentionSpec, attention_prim_func
from ..contracts import ATTENTION_NAME
from ..relax_rewrite import FunctionRewriter, visit_nodes

# Additive values at or below this count as "masked out": exp() of them underflows to 0 in float32
# against any score of moderate size (Hugging Face uses the dtype's lowest value, -65504 in fp16).
MASK_FLOOR = -1.0e4
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# Ranks of the first matmul's output and the labels of its batch dims.
_BATCH_LABELS = {2: (), 3: ("H",), 4: ("B", "H")}


@dataclasses.dataclass(frozen=True)
class Operand:
    """One input as found: ``expr`` (a Relax value) and the role of each of its dims.

    Labels: "B" batch, "H" heads, "S" sequence, "D" head dim, "1" a unit dim.
    """

    expr: relax.Expr
    labels: tuple[str, ...]
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
    """One recognised attention: its inputs, what it computes, and the binding it replaces."""

    q: Operand
    k: Operand
    v: Operand
    mask: Operand | None  # additive mask tensor, labels aligned with the scores' dims
    output: relax.Var  # the binding replaced by the fused call
    output_labels: tuple[str, ...]
    spec: AttentionSpec
    batch: tirx.PrimExpr
    q_len: tirx.PrimExpr
    kv_len: tirx.PrimExpr


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Replace plain-op attention with a ``call_tir`` to one attention PrimFunc (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        patterns = {}
        for _, func in mod.functions_items():
            if isinstance(func, relax.Function):
                patterns.update({p.output: p for p in find_attention(func)})
        if not patterns:
            return mod
        return _Rewriter(mod, patterns).transform()


def find_attention(func: relax.Function) -> list[AttentionPattern]:
    """Every attention of ``func`` this pass can fuse."""
    graph = _Graph(func)
    softmax = tvm.ir.Op.get("relax.nn.softmax")
    found = []
    for var, value in graph.bindings.items():
        if isinstance(value, relax.Call) and value.op == softmax:
            pattern = _match(graph, var, value)
            if pattern is not None:
                found.append(pattern)
    return found


class _Graph:
    """The bindings of a Relax function: value of each var, and the number of uses of each var."""

    def __init__(self, func: relax.Function) -> None:
        self.bindings: dict[relax.Var, relax.Expr] = {}
        self.uses: dict[relax.Var, int] = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.VarBinding):
                    self.bindings[binding.var] = binding.value
                    visit_nodes(binding.value, self._count)
        visit_nodes(func.body.body, self._count)
        self.users: dict[relax.Var, list[relax.Var]] = {}
        for var, value in self.bindings.items():
            for used in relax.analysis.free_vars(value):
                self.users.setdefault(used, []).append(var)

    def _count(self, expr: relax.Expr) -> None:
        if isinstance(expr, relax.Var):
            self.uses[expr] = self.uses.get(expr, 0) + 1

    def only_user(self, var: relax.Var) -> relax.Var | None:
        """The binding that is the one use of ``var``, else None."""
        users = self.users.get(var, [])
        return users[0] if self.uses.get(var) == 1 and len(users) == 1 else None

    def call(self, expr: relax.Expr, op: str | None = None) -> relax.Call | None:
        """The call ``expr`` is bound to (of ``op`` if given), else None."""
        value = self.bindings.get(expr) if isinstance(expr, relax.Var) else expr
        is_op_call = isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
        return value if is_op_call and (op is None or value.op.name == op) else None

    def scalar(self, expr: relax.Expr) -> float | None:
        """The value of a scalar (single-element) float constant, else None."""
        value = self.bindings.get(expr, expr) if isinstance(expr, relax.Var) else expr
        if not isinstance(value, relax.Constant):
            return None
        data = value.data.numpy()
        if data.size != 1 or data.dtype.kind != "f":
            return None
        return float(data.reshape(()))

    def ancestors(self, expr: relax.Expr) -> set[relax.Var]:
        """Every var ``expr`` depends on through the bindings."""
        seen: set[relax.Var] = set()
        stack = list(relax.analysis.free_vars(expr)) if not isinstance(expr, relax.Var) else [expr]
        while stack:
            var = stack.pop()
            if var in seen:
                continue
            seen.add(var)
            if var in self.bindings:
                stack.extend(relax.analysis.free_vars(self.bindings[var]))
        return seen


def _shape(expr: relax.Expr) -> list[tirx.PrimExpr] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def _dtype(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)


def _equal(a: tirx.PrimExpr, b: tirx.PrimExpr) -> bool:
    return tvm.arith.Analyzer().can_prove_equal(a, b)


def _is_one(dim: tirx.PrimExpr) -> bool:
    return isinstance(dim, tirx.IntImm) and dim.value == 1


def _int(expr) -> int | None:
    """A constant integer argument or attribute (e.g. a diagonal, an axis), else None."""
    if isinstance(expr, int):
        return expr
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


# ---------------------------------------------------------------- operands (Q, K, V), walking back


def _trace_operand(graph: _Graph, expr: relax.Expr, labels: tuple[str, ...]) -> Operand | None:
    """The farthest point up the chain of transparent ops above ``expr`` (the original tensor,
    before any layout shuffling) whose dims all have one role, with the product of the scales
    between it and ``expr``; None if there is none."""
    farthest = None
    scale = 1.0
    while True:
        if _valid_labels(labels):
            farthest = Operand(expr, labels, scale)
        step = _step_back(graph, expr, labels)
        if step is None:
            return farthest
        expr, labels, factor = step
        scale *= factor


def _valid_labels(labels: tuple[str, ...]) -> bool:
    roles = [label for label in labels if label != "1"]
    return "G" not in roles and len(roles) == len(set(roles)) and "S" in roles and "D" in roles


def _step_back(graph: _Graph, expr: relax.Expr, labels: tuple[str, ...]):
    """``(input, its labels, scale factor)`` for the op producing ``expr`` if it is transparent."""
    call = graph.call(expr)
    out_shape = _shape(expr)
    if call is None or out_shape is None:
        return None
    name = call.op.name
    if name in ("relax.multiply", "relax.divide"):
        a, b = call.args
        factor = graph.scalar(b)
        if factor is None and name == "relax.multiply":
            a, factor = b, graph.scalar(a)
        if factor is None or factor == 0.0 or _shape(a) is None or len(_shape(a)) != len(labels):
            return None
        return a, labels, factor if name == "relax.multiply" else 1.0 / factor
    (x, *_) = call.args
    in_shape = _shape(x)
    if in_shape is None:
        return None
    if name == "relax.permute_dims":
        axes = call.attrs.axes
        axes = list(range(len(labels)))[::-1] if axes is None else [int(a) for a in axes]
        x_labels = [""] * len(labels)
        for i, axis in enumerate(axes):
            x_labels[axis] = labels[i]
        return x, tuple(x_labels), 1.0
    if name == "relax.repeat":
        axis = _int(call.attrs.axis)  # None: repeat flattens
        return (x, labels, 1.0) if axis is not None and labels[axis % len(labels)] == "H" else None
    if name == "relax.broadcast_to":
        offset = len(labels) - len(in_shape)
        x_labels = []
        for i, dim in enumerate(in_shape):
            label = labels[offset + i]
            if _equal(dim, out_shape[offset + i]):
                x_labels.append(label)
            elif _is_one(dim) and label in ("H", "G"):
                x_labels.append("1")  # one head (or one group member) shared by many
            else:
                return None
        return x, tuple(x_labels), 1.0
    if name in ("relax.reshape", "relax.expand_dims", "relax.squeeze"):
        x_labels = _reshape_back(in_shape, out_shape, labels)
        return (x, x_labels, 1.0) if x_labels is not None else None
    return None


def _reshape_back(in_shape: list, out_shape: list, labels: tuple[str, ...]) -> tuple[str, ...] | None:
    """Labels of a reshape's input: unit dims come and go; a head dim may split into (heads, group)."""
    ins = [(i, d) for i, d in enumerate(in_shape) if not _is_one(d)]
    outs = [(labels[i], d) for i, d in enumerate(out_shape) if not _is_one(d)]
    x_labels = ["1"] * len(in_shape)
    pos = 0
    for label, dim in outs:
        if pos < len(ins) and _equal(ins[pos][1], dim):
            x_labels[ins[pos][0]] = label
            pos += 1
        elif label == "H" and pos + 1 < len(ins) and _equal(ins[pos][1] * ins[pos + 1][1], dim):
            x_labels[ins[pos][0]], x_labels[ins[pos + 1][0]] = "H", "G"
            pos += 2
        else:
            return None
    return tuple(x_labels) if pos == len(ins) else None


def _size(expr: relax.Expr, labels: tuple[str, ...], label: str) -> tirx.PrimExpr:
    """The size of the dim labelled ``label`` (1 if there is none)."""
    shape = _shape(expr)
    return shape[labels.index(label)] if label in labels else tirx.IntImm("int64", 1)


def _layout_of(labels: tuple[str, ...]) -> str | None:
    roles = [label for label in labels if label not in ("1", "B")]
    if "B" in labels and labels.index("B") != min(i for i, lab in enumerate(labels) if lab != "1"):
        return None
    return {("S", "H", "D"): "BSHD", ("H", "S", "D"): "BHSD", ("S", "D"): "BSHD"}.get(tuple(roles))


# ---------------------------------------------------------------- the scores, between the matmuls


@dataclasses.dataclass
class _Scores:
    matmul: relax.Call
    chain: list[relax.Var]  # vars between the first matmul and the softmax
    scale: float = 1.0
    causal: bool = False
    masked_value: float = 0.0  # what the causal mask leaves at masked positions, scales included
    mask: relax.Expr | None = None
    softmax_dtype: str = ""


def _trace_scores(graph: _Graph, expr: relax.Expr) -> _Scores | None:
    """Walk back from the softmax input to ``matmul(Q, K^T)`` through scales, masks and widening casts."""
    call = graph.call(expr)
    if call is None or not isinstance(expr, relax.Var):
        return None
    name = call.op.name
    if name == "relax.matmul":
        return _Scores(matmul=call, chain=[expr])

    def walk(inner: relax.Expr) -> _Scores | None:
        if _shape(inner) is None or len(_shape(inner)) != len(_shape(expr)):
            return None  # the scores may not be broadcast along the way
        found = _trace_scores(graph, inner)
        if found is not None:
            found.chain.append(expr)
        return found

    if name == "relax.astype":
        (x,) = call.args
        if str(call.attrs.dtype) != ACCUMULATE_DTYPE or _dtype(x) not in FLOAT_DTYPES:
            return None  # only a widening cast is sure not to overflow
        return walk(x)
    if name in ("relax.multiply", "relax.divide"):
        a, b = call.args
        factor = graph.scalar(b)
        if factor is None and name == "relax.multiply":
            a, factor = b, graph.scalar(a)
        if factor is None or factor <= 0.0:
            return None
        found = walk(a)
        if found is None or found.mask is not None:
            return None  # a scale after an additive mask tensor would scale the mask too
        factor = factor if name == "relax.multiply" else 1.0 / factor
        found.scale *= factor
        found.masked_value *= factor  # a temperature after a causal mask scales what it left
        return found
    if name == "relax.add":
        for chain, other in (call.args, call.args[::-1]):
            found = walk(chain)
            if found is None:
                continue
            masked_value = _causal_additive_value(graph, other, _shape(expr))
            if masked_value is not None:
                if found.causal:
                    return None
                found.causal, found.masked_value = True, masked_value
                return found
            if found.mask is None and isinstance(other, (relax.Var, relax.Constant)):
                found.mask = other
                return found
            return None
        return None
    if name == "relax.where":
        cond, a, b = call.args
        for keep, chain, fill in ((True, a, b), (False, b, a)):
            value = graph.scalar(fill)
            if value is not None and value <= MASK_FLOOR and _is_causal_condition(graph, cond, keep, _shape(expr)):
                found = walk(chain)
                if found is not None and not found.causal:
                    found.causal, found.masked_value = True, value
                    return found
        return None
    return None


def _square_tail(shape: list | None, scores_shape: list) -> bool:
    """Whether ``shape`` is [.., Sq, Skv] of the scores with only unit dims in front."""
    if shape is None or len(shape) < 2 or len(shape) > len(scores_shape):
        return False
    return (all(_is_one(d) for d in shape[:-2]) and _equal(shape[-2], scores_shape[-2])
            and _equal(shape[-1], scores_shape[-1]))


def _causal_additive_value(graph: _Graph, expr: relax.Expr, scores_shape: list) -> float | None:
    """``c`` if ``expr`` is ``triu(full([Sq, Skv], c), 1)`` with ``c <= MASK_FLOOR`` (the keys after
    each query masked out), else None."""
    triu = graph.call(expr, "relax.triu")
    if triu is None or _int(triu.args[1]) != 1 or not _square_tail(_shape(expr), scores_shape):
        return None
    full = graph.call(triu.args[0], "relax.full")
    value = graph.scalar(full.args[1]) if full is not None else None
    return value if value is not None and value <= MASK_FLOOR else None


def _is_causal_condition(graph: _Graph, expr: relax.Expr, keep: bool, scores_shape: list) -> bool:
    """``tril(ones, 0)`` (true where kept) or, for ``keep=False``, ``triu(ones, 1)`` (true where masked)."""
    op, diagonal = ("relax.tril", 0) if keep else ("relax.triu", 1)
    tri = graph.call(expr, op)
    if tri is None or _int(tri.args[1]) != diagonal or not _square_tail(_shape(expr), scores_shape):
        return False
    fill = graph.call(tri.args[0])
    if fill is None or fill.op.name not in ("relax.ones", "relax.full"):
        return False
    if fill.op.name == "relax.full":
        value = graph.bindings.get(fill.args[1], fill.args[1])
        if not isinstance(value, relax.Constant) or not np.all(value.data.numpy()):
            return False
    return True


# ---------------------------------------------------------------- the whole pattern


def _match(graph: _Graph, softmax_var: relax.Var, softmax: relax.Call) -> AttentionPattern | None:
    scores_shape = _shape(softmax.args[0])
    if scores_shape is None or len(scores_shape) not in _BATCH_LABELS:
        return None
    if _int(softmax.attrs.axis) not in (-1, len(scores_shape) - 1):
        return None  # only a softmax over the keys is attention
    scores = _trace_scores(graph, softmax.args[0])
    if scores is None or scores.causal and not scores.masked_value <= MASK_FLOOR:
        return None
    if not all(_equal(a, b) for a, b in zip(_shape(scores.chain[0]), scores_shape)):
        return None  # a mask broadcast the scores to more batches or heads than Q K^T has
    scores.softmax_dtype = _dtype(softmax_var)
    # Forward: softmax -> [astype] -> matmul(P, V), each intermediate used once.
    probs = softmax_var
    chain = [*scores.chain, softmax_var]
    user = graph.only_user(probs)
    if user is not None and graph.call(user, "relax.astype") is not None:
        probs = user
        chain.append(user)
        user = graph.only_user(probs)
    if user is None:
        return None
    pv = graph.call(user, "relax.matmul")
    if pv is None or not pv.args[0].same_as(probs):
        return None
    if any(graph.uses.get(var) != 1 for var in chain):
        return None  # the scores or probabilities are used elsewhere: they exist anyway

    batch_labels = _BATCH_LABELS[len(scores_shape)]
    q_arg, k_arg = scores.matmul.args
    v_arg = pv.args[1]
    k_rank, v_rank = len(_shape(k_arg) or []), len(_shape(v_arg) or [])
    rank = len(scores_shape)
    if len(_shape(q_arg) or []) != rank or not (2 <= k_rank <= rank and 2 <= v_rank <= rank):
        return None  # unknown ranks, or a matrix-vector product
    q = _trace_operand(graph, q_arg, (*batch_labels, "S", "D"))
    k = _trace_operand(graph, k_arg, (*batch_labels[len(batch_labels) + 2 - k_rank:], "D", "S"))
    v = _trace_operand(graph, v_arg, (*batch_labels[len(batch_labels) + 2 - v_rank:], "S", "D"))
    if q is None or k is None or v is None:
        return None
    dtype = _dtype(q.expr)
    if dtype not in FLOAT_DTYPES or _dtype(k.expr) != dtype or _dtype(v.expr) != dtype:
        return None
    if _dtype(user) != dtype or _dtype(probs) != dtype:
        return None

    dims = {}
    for name, operand in (("q", q), ("k", k), ("v", v)):
        dims[name] = {label: _size(operand.expr, operand.labels, label) for label in ("B", "H", "S", "D")}
    logical_heads = scores_shape[batch_labels.index("H")] if "H" in batch_labels else tirx.IntImm("int64", 1)
    heads = [dims[n]["H"] for n in ("q", "k", "v")]
    head_dim = dims["q"]["D"]
    if not all(isinstance(x, tirx.IntImm) for x in [*heads, head_dim]):
        return None  # head counts and head dim must be known at compile time
    num_qo, num_kv = heads[0].value, heads[1].value
    if not _equal(heads[0], logical_heads) or heads[2].value != num_kv or num_qo % num_kv:
        return None
    if not (_equal(dims["k"]["D"], head_dim) and _equal(dims["v"]["D"], head_dim)):
        return None
    if not (_equal(dims["k"]["S"], dims["v"]["S"]) and _equal(dims["q"]["S"], scores_shape[-2])):
        return None
    batch = dims["q"]["B"]
    if not (_equal(dims["k"]["B"], batch) and _equal(dims["v"]["B"], batch)):
        return None

    mask = None
    if scores.mask is not None:
        mask = _mask_operand(graph, scores.mask, scores_shape, batch_labels, [q, k, v])
        if mask is None:
            return None
    output, output_labels = _trace_output(graph, user, (*batch_labels, "S", "D"))
    layout = _layout_of(q.labels) or "BSHD"
    spec = AttentionSpec(
        num_qo_heads=num_qo, num_kv_heads=num_kv, head_dim=head_dim.value,
        scale=scores.scale * q.scale * k.scale, causal=scores.causal, additive_mask=mask is not None,
        layout=layout, dtype=dtype, softmax_dtype=scores.softmax_dtype,
        mask_dtype=_dtype(mask.expr) if mask is not None else "",
        same_length=_equal(dims["q"]["S"], dims["k"]["S"]),
    )
    if spec.scale <= 0.0 or not math.isfinite(spec.scale) or v.scale != 1.0:
        return None
    return AttentionPattern(q, k, v, mask, output, output_labels, spec, batch, dims["q"]["S"], dims["k"]["S"])


def _mask_operand(graph: _Graph, mask: relax.Expr, scores_shape: list, batch_labels: tuple,
                  inputs: list[Operand]) -> Operand | None:
    """The additive mask as an operand, if it does not vary over heads nor depend on Q, K or V."""
    shape = _shape(mask)
    if shape is None or len(shape) > len(scores_shape):
        return None
    labels = (*batch_labels, "Sq", "Skv")[len(scores_shape) - len(shape):]
    for label, dim, full in zip(labels, shape, scores_shape[len(scores_shape) - len(shape):]):
        if label == "H" and not _is_one(dim) or not (_is_one(dim) or _equal(dim, full)):
            return None
    forbidden = set().union(*(graph.ancestors(operand.expr) for operand in inputs))
    if graph.ancestors(mask) & forbidden:
        return None
    return Operand(mask, tuple(labels))


def _trace_output(graph: _Graph, var: relax.Var, labels: tuple[str, ...]) -> tuple[relax.Var, tuple[str, ...]]:
    """Follow single-use ``permute_dims``/unit reshapes of the attention output to its last layout
    with one role per dim; the fused call replaces that binding."""
    best = (var, labels)
    while (user := graph.only_user(var)) is not None:
        call = graph.call(user)
        if call is None or not call.args[0].same_as(var):
            break
        if call.op.name == "relax.permute_dims":
            axes = call.attrs.axes
            axes = list(range(len(labels)))[::-1] if axes is None else [int(a) for a in axes]
            labels = tuple(labels[a] for a in axes)
        elif call.op.name in ("relax.reshape", "relax.expand_dims", "relax.squeeze"):
            labels = _reshape_forward(_shape(var), _shape(user), labels)
            if labels is None:
                break
        else:
            break
        var = user
        if _valid_labels(labels) and _layout_of(labels) is not None:
            best = (var, labels)
    return best


def _reshape_forward(in_shape: list, out_shape: list | None, labels: tuple[str, ...]) -> tuple[str, ...] | None:
    if out_shape is None:
        return None
    ins = [labels[i] for i, d in enumerate(in_shape) if not _is_one(d)]
    in_dims = [d for d in in_shape if not _is_one(d)]
    out_dims = [(i, d) for i, d in enumerate(out_shape) if not _is_one(d)]
    if len(in_dims) != len(out_dims) or not all(_equal(a, b) for a, (_, b) in zip(in_dims, out_dims)):
        return None
    out = ["1"] * len(out_shape)
    for label, (i, _) in zip(ins, out_dims):
        out[i] = label
    return tuple(out)


# ---------------------------------------------------------------- the rewrite


def _canonical_order(layout: str) -> tuple[str, ...]:
    return ("B", "S", "H", "D") if layout == "BSHD" else ("B", "H", "S", "D")


def _relabel(bb: relax.BlockBuilder, expr: relax.Expr, labels: tuple[str, ...], target: tuple[str, ...],
             target_shape: list) -> relax.Expr:
    """``expr`` (dims ``labels``) as a tensor of dims ``target`` and shape ``target_shape``: a permute
    only where the roles are out of order, reshapes (free) for unit dims and roles one side lacks
    (which are of size 1)."""
    shape = _shape(expr)
    present = [i for i, label in enumerate(labels) if label != "1" and label in target]
    order = [labels[i] for i in present]
    wanted = [label for label in target if label in order]
    if order != wanted:
        if len(present) != len(labels):
            expr = bb.emit(relax.op.reshape(expr, [shape[i] for i in present]))
        expr = bb.emit(relax.op.permute_dims(expr, [order.index(label) for label in wanted]))
    if len(_shape(expr)) != len(target_shape) or not all(_equal(a, b) for a, b in zip(_shape(expr), target_shape)):
        expr = bb.emit(relax.op.reshape(expr, target_shape))
    return expr


@mutator
class _Rewriter(FunctionRewriter):
    def __init__(self, mod: tvm.IRModule, patterns: dict[relax.Var, AttentionPattern]) -> None:
        super().__init__(mod)
        self.patterns = patterns
        self.kernels: dict[AttentionSpec, tvm.ir.GlobalVar] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        pattern = self.patterns.get(binding.var)
        if pattern is None:
            super().visit_var_binding_(binding)
            return
        value = self._fused(pattern)
        if isinstance(binding.var, relax.DataflowVar) or not self.builder_.current_block_is_dataflow():
            new = value if isinstance(value, relax.Var) else self.builder_.emit(value, binding.var.name)
        else:
            new = self.builder_.emit_output(value, binding.var.name)
        self.set_var_remap(binding.var, new)

    def _fused(self, p: AttentionPattern) -> relax.Expr:
        bb, spec = self.builder_, p.spec
        order = _canonical_order(spec.layout)
        sizes = {"B": p.batch, "D": tirx.IntImm("int64", spec.head_dim)}

        def canonical(op: Operand, seq: tirx.PrimExpr, heads: int) -> relax.Expr:
            full = {**sizes, "S": seq, "H": tirx.IntImm("int64", heads)}
            return _relabel(bb, self.visit_expr(op.expr), op.labels, order, [full[label] for label in order])

        args = [canonical(p.q, p.q_len, spec.num_qo_heads), canonical(p.k, p.kv_len, spec.num_kv_heads),
                canonical(p.v, p.kv_len, spec.num_kv_heads)]
        if p.mask is not None:
            # [MB, 1, Sq, Skv]: the mask's own sizes first (1 where it broadcasts), then broadcast
            # over the queries and keys; a mask shared by the batch (MB = 1) stays shared.
            labels = tuple("1" if label == "H" else label for label in p.mask.labels)
            own = [_size(p.mask.expr, labels, label) for label in ("B", "H", "Sq", "Skv")]
            mask = _relabel(bb, self.visit_expr(p.mask.expr), labels, ("B", "H", "Sq", "Skv"), own)
            full = [own[0], tirx.IntImm("int64", 1), p.q_len, p.kv_len]
            if not all(_equal(a, b) for a, b in zip(own, full)):
                mask = bb.emit(relax.op.broadcast_to(mask, full))
            args.append(mask)
        out_shape = [{**sizes, "S": p.q_len, "H": tirx.IntImm("int64", spec.num_qo_heads)}[label] for label in order]
        out = bb.emit(relax.call_tir(self._kernel(spec), args, relax.TensorType(out_shape, spec.dtype)))
        return _relabel(bb, out, order, p.output_labels, _shape(p.output))

    def _kernel(self, spec: AttentionSpec) -> tvm.ir.GlobalVar:
        if spec not in self.kernels:
            self.kernels[spec] = self.builder_.add_func(attention_prim_func(spec), ATTENTION_NAME)
        return self.kernels[spec]
