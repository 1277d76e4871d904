"""Classify every Relax binding: DNNFusion mapping type, TVM op pattern, FLOPs and bytes (the extended graph).

An analysis, not a rewrite: ``Classify`` returns the module unchanged and keeps the result. The
mapping type says how output elements depend on input elements (DNNFusion):

- ``one-to-one``: each output element from one element of each input (elementwise, ``astype``,
  ``where``, slices, ``split``, ``concat``). A binary op that broadcasts one operand stays
  one-to-one, as DNNFusion lists ``Add``/``Mul`` there; ``tvm_pattern`` shows the broadcast.
- ``reorganize``: element order kept, only the shape changes (``reshape``, ``flatten``,
  ``squeeze``, ``expand_dims``; tuple plumbing and aliases, which move no data either).
- ``shuffle``: element order permuted (``permute_dims``).
- ``one-to-many``: an input element feeds several outputs (``broadcast_to``, ``repeat``, ``tile``,
  ``take`` -- a gather, as DNNFusion classes ``Gather`` -- and fills such as ``full``/``zeros``).
- ``many-to-many``: each output reads many inputs (matmul, conv, reductions, softmax, norms,
  attention -- including the paged KV cache's fused-QKV attention builtin).
- ``opaque``: an op not in ``OPS`` (or a ``call_tir`` whose PrimFunc we can't prove a class for);
  never fused through, never guessed.

Costs are ``tvm.tirx`` expressions over the module's symbolic dims (printed as strings) and
evaluate numerically with ``OpInfo.cost(bindings)``. FLOPs: one per output element for
one-to-one ops (transcendental cost is not modelled), ``2*M*N*K`` for matmul, a per-input-element
factor for reductions and norms (``OPS``). Bytes: every tensor input read once plus the outputs
written; reorganize ops are views (Relax lowers dataflow reshapes to no-copy views) and move
nothing; a gather or slice reads only what it outputs. Attention through the KV cache depends on
the cached length, which the graph doesn't hold: its cost uses the symbolic ``kv_len`` (the
full length, an upper bound for causal prefill). An opaque op, or a tensor of unknown rank or
shape, has unknown (``None``) cost. A ``call_tir`` is classified from its PrimFunc's indexing and
costed from its blocks; its bytes count every argument in full. Bindings inside ``If`` branches
are not visited (the ``If`` binding itself is opaque).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Literal

import tvm
from tvm import arith, relax, tirx

from ..errors import FuselightError

Mapping = Literal["one-to-one", "reorganize", "shuffle", "one-to-many", "many-to-many", "opaque"]
MAPPINGS: tuple[Mapping, ...] = ("one-to-one", "reorganize", "shuffle", "one-to-many", "many-to-many", "opaque")

# TVM's OpPatternKind (include/tvm/relax/op_attr_types.h), by value.
TVM_PATTERNS = {
    0: "ElemWise",
    1: "Broadcast",
    2: "Injective",
    3: "CommReduce",
    4: "OutEWiseFusable",
    7: "Tuple",
    8: "Opaque",
}

# The cached sequence length seen by KV-cache attention: not in the graph, so a free symbolic dim.
KV_LEN = tirx.Var("kv_len", "int64")


@dataclasses.dataclass(frozen=True)
class OpRule:
    """How to classify and cost one op.

    ``tvm_pattern`` is the pattern TVM's ``AnnotateTIROpPattern`` gives the op's legalized kernel
    (``None`` where it has none). ``flops`` names a rule in ``_FLOPS``; ``factor`` multiplies
    it. ``bytes`` names a rule in ``_BYTES``.
    """

    mapping: Mapping
    tvm_pattern: str | None
    flops: str = "per_output"
    factor: int = 1
    bytes: str = "io"


# Bindings that are not op calls (tuple plumbing, aliases, literals), with TVM's pattern where FuseOps
# gives one.
NON_CALL_OPS: dict[str, str | None] = {
    "tuple": "Tuple", "tuple_get_item": "Injective", "alias": None, "constant": None, "shape": None,
    "prim_value": None, "match_cast": None,
}  # fmt: skip


def _table() -> dict[str, OpRule]:
    ops: dict[str, OpRule] = {}
    for name in (
        "add", "subtract", "multiply", "divide", "floor_divide", "power", "maximum", "minimum",
        "exp", "log", "sqrt", "rsqrt", "tanh", "erf", "sigmoid", "negative", "abs", "clip",
        "nn.silu", "nn.gelu", "nn.gelu_tanh", "nn.relu", "astype", "where",
    ):  # fmt: skip
        ops["relax." + name] = OpRule("one-to-one", "ElemWise")
    ops["relax.strided_slice"] = OpRule("one-to-one", "ElemWise", bytes="slice")
    ops["relax.split"] = OpRule("one-to-one", "Injective", flops="zero")
    ops["relax.concat"] = OpRule("one-to-one", "Injective", flops="zero")
    ops["relax.reshape"] = OpRule("reorganize", "Injective", flops="zero", bytes="view")
    ops["relax.flatten"] = OpRule("reorganize", "Injective", flops="zero", bytes="view")
    ops["relax.squeeze"] = OpRule("reorganize", "Broadcast", flops="zero", bytes="view")
    ops["relax.expand_dims"] = OpRule("reorganize", "Broadcast", flops="zero", bytes="view")
    ops["relax.permute_dims"] = OpRule("shuffle", "Injective", flops="zero")
    ops["relax.broadcast_to"] = OpRule("one-to-many", "Broadcast", flops="zero")
    ops["relax.repeat"] = OpRule("one-to-many", "Injective", flops="zero")
    ops["relax.tile"] = OpRule("one-to-many", "Injective", flops="zero")
    ops["relax.take"] = OpRule("one-to-many", "Opaque", flops="zero", bytes="gather")
    for name in ("full", "zeros", "ones", "full_like", "zeros_like", "ones_like"):
        ops["relax." + name] = OpRule("one-to-many", "ElemWise", flops="zero")
    ops["relax.matmul"] = OpRule("many-to-many", "OutEWiseFusable", flops="matmul")
    for name in ("nn.conv1d", "nn.conv2d", "nn.conv3d"):
        ops["relax." + name] = OpRule("many-to-many", "OutEWiseFusable", flops="conv")
    ops["relax.nn.attention"] = OpRule("many-to-many", None, flops="attention")
    for name in ("sum", "max", "min", "prod"):
        ops["relax." + name] = OpRule("many-to-many", "CommReduce", flops="per_input")
    for name in ("mean", "argmax", "argmin"):
        ops["relax." + name] = OpRule("many-to-many", "OutEWiseFusable", flops="per_input")
    ops["relax.cumsum"] = OpRule("many-to-many", None, flops="per_input")
    # Per input element: variance = sub, square, sum; softmax = max, sub, exp, sum, div;
    # rms_norm = square, sum, scale, weight; layer/group norm = mean, sub, square, sum, scale, gamma, beta.
    ops["relax.variance"] = OpRule("many-to-many", "OutEWiseFusable", flops="per_input", factor=3)
    ops["relax.nn.softmax"] = OpRule("many-to-many", "OutEWiseFusable", flops="per_input", factor=5)
    ops["relax.nn.log_softmax"] = OpRule("many-to-many", "OutEWiseFusable", flops="per_input", factor=5)
    ops["relax.nn.rms_norm"] = OpRule("many-to-many", "OutEWiseFusable", flops="per_input", factor=4)
    ops["relax.nn.layer_norm"] = OpRule("many-to-many", "OutEWiseFusable", flops="per_input", factor=7)
    ops["relax.nn.group_norm"] = OpRule("many-to-many", "OutEWiseFusable", flops="per_input", factor=7)
    ops["call_dps_packed:vm.builtin.attention_kv_cache_attention_with_fused_qkv"] = OpRule(
        "many-to-many", "Opaque", flops="kv_attention", bytes="kv_attention"
    )
    for name, pattern in NON_CALL_OPS.items():  # they move no data
        ops[name] = OpRule("reorganize", pattern, flops="zero", bytes="view")
    return ops


OPS: dict[str, OpRule] = _table()


@dataclasses.dataclass
class OpInfo:
    """One binding of the extended computational graph.

    ``op``: a Relax op name (``relax.matmul``), ``call_tir:<primfunc>``, ``call_dps_packed:<symbol>``
    (likewise ``call_pure_packed``/``call_packed``), ``call:<function>``, or a non-call binding
    (``tuple``, ``tuple_get_item``, ``alias``, ``constant``, ``shape``, ``prim_value``,
    ``match_cast``). ``inputs``: argument names (``<const>``/``<prim>``/``<shape>`` for literals);
    ``inputs_const`` and ``inputs_param`` index into it (constants; model weights, i.e.
    parameters after the function's ``num_input`` and what is taken out of them). ``shape``:
    ints and symbolic dims as strings, ``None`` if unknown; a tuple output gives one entry per
    field in ``shape`` and ``dtype``. Costs are expressions as strings, ``None`` if unknown.
    """

    name: str
    op: str
    mapping: Mapping
    tvm_pattern: str | None
    flops: str | None
    bytes_read: str | None
    bytes_written: str | None
    inputs: list[str]
    inputs_const: list[int]
    inputs_param: list[int]
    shape: list | None
    dtype: str | list | None
    _exprs: tuple = dataclasses.field(default=(None, None, None), repr=False, compare=False)

    def cost(self, bindings: dict[str, int]) -> tuple[int | None, int | None]:
        """``(flops, bytes_read + bytes_written)`` with symbolic dims bound by name."""
        flops, read, written = self.evaluate(bindings)
        return flops, None if read is None or written is None else read + written

    def evaluate(self, bindings: dict[str, int]) -> tuple[int | None, int | None, int | None]:
        """``(flops, bytes_read, bytes_written)`` with symbolic dims bound by name."""
        flops, read, written = (_evaluate(e, bindings) for e in self._exprs)
        return flops, read, written

    def cost_exprs(self) -> tuple[tvm.ir.Expr | None, tvm.ir.Expr | None]:
        """``(flops, bytes_read + bytes_written)`` as expressions over the symbolic dims (``None`` if unknown)."""
        flops, read, written = self._exprs
        return flops, None if read is None or written is None else read + written

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}


def classify_module(mod: tvm.IRModule) -> dict[str, list[OpInfo]]:
    """Every binding of every Relax function, in order, keyed by function name."""
    tir_rules: dict[str, OpRule] = {}
    return {
        gv.name_hint: _classify_function(mod, func, tir_rules)
        for gv, func in mod.functions_items()
        if isinstance(func, relax.Function)
    }


def classify_binding(binding: relax.Binding, mod: tvm.IRModule | None = None) -> OpInfo:
    """One binding on its own (``mod`` holds the PrimFuncs a ``call_tir`` calls); no inputs are marked
    as weights or constants, as that needs the function around it."""
    return _classify_binding(mod if mod is not None else tvm.IRModule(), binding, set(), set(), {})


@tvm.transform.module_pass(opt_level=0, name="Classify")
class Classify:
    """Classify every binding (``classify_module``) into ``self.result``; the module is returned unchanged."""

    def __init__(self) -> None:
        self.result: dict[str, list[OpInfo]] = {}

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.result = classify_module(mod)
        return mod


# ---- bindings ------------------------------------------------------------------------------------


def _classify_function(mod: tvm.IRModule, func: relax.Function, tir_rules: dict[str, OpRule]) -> list[OpInfo]:
    num_input = func.attrs.get("num_input") if func.attrs is not None else None
    weights = {p for p in (func.params[int(num_input) :] if num_input is not None else [])}
    consts: set[relax.Var] = set()
    infos = []
    for block in func.body.blocks:
        for binding in block.bindings:
            info = _classify_binding(mod, binding, weights, consts, tir_rules)
            infos.append(info)
            value = binding.value
            # Weights and constants flow through tuple plumbing and aliases (packed params).
            src = value.tuple_value if isinstance(value, relax.TupleGetItem) else value
            if isinstance(binding, relax.MatchCast) or isinstance(value, (relax.Var, relax.TupleGetItem)):
                if src in weights:
                    weights.add(binding.var)
                if src in consts:
                    consts.add(binding.var)
            if isinstance(value, relax.Constant):
                consts.add(binding.var)
    return infos


def _op_key(mod: tvm.IRModule, binding: relax.Binding) -> tuple[str, list[relax.Expr], tirx.PrimFunc | None]:
    """The op name, its arguments (tuples flattened), and the PrimFunc of a ``call_tir``."""
    value = binding.value
    if isinstance(binding, relax.MatchCast):
        return "match_cast", [value], None
    if not isinstance(value, relax.Call):
        kinds = {relax.Tuple: "tuple", relax.TupleGetItem: "tuple_get_item", relax.Var: "alias",
                 relax.Constant: "constant", relax.ShapeExpr: "shape", tirx.expr.ExprOp: "prim_value"}  # fmt: skip
        kind = next((k for t, k in kinds.items() if isinstance(value, t)), type(value).__name__)
        if isinstance(value, relax.Tuple):
            return kind, list(value.fields), None
        if isinstance(value, relax.TupleGetItem):
            return kind, [value.tuple_value], None
        return kind, [value] if isinstance(value, relax.Var) else [], None
    op = value.op
    args = _flatten(value.args)
    if isinstance(op, tvm.ir.Op):
        if op.name in ("relax.call_tir", "relax.call_tir_inplace"):
            gv = value.args[0]
            prim = mod[gv] if gv in mod else None
            return f"call_tir:{gv.name_hint}", _flatten(value.args[1:]), prim
        if op.name in ("relax.call_dps_packed", "relax.call_pure_packed", "relax.call_packed"):
            kind = op.name.removeprefix("relax.")
            callee = value.args[0]
            symbol = callee.global_symbol if isinstance(callee, relax.ExternFunc) else str(callee)
            return f"{kind}:{symbol}", args[1:], None
        return op.name, args, None
    name = op.name_hint if isinstance(op, (tvm.ir.GlobalVar, relax.Var)) else type(op).__name__
    return f"call:{name}", args, None


def _flatten(args: Sequence[relax.Expr]) -> list[relax.Expr]:
    out: list[relax.Expr] = []
    for a in args:
        out.extend(_flatten(a.fields) if isinstance(a, relax.Tuple) else [a])
    return out


def _classify_binding(mod: tvm.IRModule, binding: relax.Binding, weights: set, consts: set,
                      tir_rules: dict[str, OpRule]) -> OpInfo:
    """``tir_rules``: the rule of each PrimFunc classified so far, by op (a model calls each layer's
    kernels once a layer)."""
    op, args, prim = _op_key(mod, binding)
    out = binding.var.ty
    rule = OPS.get(op)
    if prim is not None:
        if op not in tir_rules:
            tir_rules[op] = OpRule(_tir_mapping(prim), _tir_pattern(prim), flops="tir", bytes="io")
        rule = tir_rules[op]
    flops = read = written = None
    # An op we can't classify has no cost we could trust either.
    known = _known(out) and all(_known(a.ty) for a in args if _is_tensor(a.ty))
    if rule is not None and rule.mapping != "opaque" and known:
        flops = _FLOPS[rule.flops](binding.value, args, out, prim) * rule.factor
        read, written = _BYTES[rule.bytes](args, out)
        flops, read, written = (_simplify(e) for e in (flops, read, written))
    shape, dtype = _describe(out)
    return OpInfo(
        name=binding.var.name,
        op=op,
        mapping=rule.mapping if rule is not None else "opaque",
        tvm_pattern=rule.tvm_pattern if rule is not None else None,
        flops=_to_str(flops),
        bytes_read=_to_str(read),
        bytes_written=_to_str(written),
        inputs=[_arg_name(a) for a in args],
        inputs_const=[i for i, a in enumerate(args) if isinstance(a, relax.Constant) or a in consts],
        inputs_param=[i for i, a in enumerate(args) if a in weights],
        shape=shape,
        dtype=dtype,
        _exprs=(flops, read, written),
    )


def _arg_name(a: relax.Expr) -> str:
    if isinstance(a, relax.Var):
        return a.name
    kinds = {
        relax.Constant: "<const>",
        tirx.expr.ExprOp: "<prim>",
        relax.ShapeExpr: "<shape>",
        relax.StringImm: "<str>",
    }
    return next((k for t, k in kinds.items() if isinstance(a, t)), "<expr>")


# ---- types and sizes -----------------------------------------------------------------------------


def _is_tensor(ty: relax.Type) -> bool:
    return isinstance(ty, relax.TensorType)


def _known(ty: relax.Type) -> bool:
    """Tensors (also inside tuples) have a known shape; other values (objects, shapes) cost nothing."""
    if isinstance(ty, relax.TupleType):
        return all(_known(f) for f in ty.fields)
    return not isinstance(ty, relax.TensorType) or (ty.shape is not None and isinstance(ty.shape, relax.ShapeExpr))


def _dims(ty: relax.TensorType) -> list[tvm.ir.Expr]:
    return list(ty.shape.values)


def _elems(ty: relax.Type) -> tvm.ir.Expr:
    if isinstance(ty, relax.TupleType):
        return sum((_elems(f) for f in ty.fields), tirx.IntImm("int64", 0))
    if not isinstance(ty, relax.TensorType):
        return tirx.IntImm("int64", 0)
    n: tvm.ir.Expr = tirx.IntImm("int64", 1)
    for d in _dims(ty):
        n = n * d
    return n


def _nbytes(ty: relax.Type) -> tvm.ir.Expr:
    if isinstance(ty, relax.TupleType):
        return sum((_nbytes(f) for f in ty.fields), tirx.IntImm("int64", 0))
    if not isinstance(ty, relax.TensorType) or _dtype(ty) is None:
        return tirx.IntImm("int64", 0)
    return _elems(ty) * _itemsize(ty)


def _dtype(ty: relax.TensorType) -> str | None:
    dtype = str(ty.dtype)
    return None if dtype in ("", "void") else dtype


def _itemsize(ty: relax.TensorType) -> int:
    t = tvm.DataType(_dtype(ty))
    return (t.bits * t.lanes + 7) // 8


def _describe(ty: relax.Type) -> tuple[list | None, str | list | None]:
    if isinstance(ty, relax.TupleType):
        fields = [_describe(f) for f in ty.fields]
        return [s for s, _ in fields], [d for _, d in fields]
    if not isinstance(ty, relax.TensorType):
        return None, None
    dtype = _dtype(ty)
    if ty.shape is None or not isinstance(ty.shape, relax.ShapeExpr):
        return None, dtype
    return [int(d) if isinstance(d, tirx.IntImm) else _to_str(d) for d in ty.shape.values], dtype


def _simplify(e: tvm.ir.Expr) -> tvm.ir.Expr:
    return arith.Analyzer().simplify(e)


def _to_str(e: tvm.ir.Expr | None) -> str | None:
    # The TVMScript printer writes int64 literals as T.int64(n); plain numbers read better.
    return None if e is None else re.sub(r"T\.int64\((-?\d+)\)", r"\1", str(e))


def _evaluate(e: tvm.ir.Expr | None, bindings: dict[str, int]) -> int | None:
    if e is None:
        return None
    free: dict[str, tirx.Var] = {}
    tirx.stmt_functor.post_order_visit(e, lambda n: free.setdefault(n.name, n) if isinstance(n, tirx.Var) else None)
    missing = sorted(set(free) - set(bindings))
    if missing:
        raise FuselightError(f"no value given for symbolic dim(s) {', '.join(missing)}")
    value = _simplify(
        tirx.stmt_functor.substitute(e, {v: tirx.IntImm(str(v.ty.dtype), bindings[n]) for n, v in free.items()})
    )
    return int(value)


# ---- cost rules ----------------------------------------------------------------------------------


def _tensor_args(args: list[relax.Expr]) -> list[relax.TensorType]:
    return [a.ty for a in args if _is_tensor(a.ty)]


def _distinct(args: list[relax.Expr]) -> list[relax.Expr]:
    """Each argument once: a tensor an op reads twice (x * x) moves once, as ``fusion_plan.estimate`` counts it."""
    return list({a: None for a in args})


def _flops_matmul(_call, args, out, _prim) -> tvm.ir.Expr:
    a = _tensor_args(args)[0]
    return 2 * _elems(out) * _dims(a)[-1]


def _flops_conv(call, args, out, _prim) -> tvm.ir.Expr:
    w = _tensor_args(args)[1]
    out_channels = _dims(w)[str(call.attrs.kernel_layout).index("O")]
    return 2 * _elems(out) * tirx.floordiv(_elems(w), out_channels)


def _flops_attention(_call, args, _out, _prim) -> tvm.ir.Expr:
    # q [B, Sq, H, D], k [B, Sk, H, D], v [B, Sk, H, Dv]: Q·K^T and P·V.
    q, k, v = _tensor_args(args)[:3]
    b, sq, h, d = _dims(q)
    return 2 * b * h * sq * _dims(k)[1] * (d + _dims(v)[3])


def _flops_kv_attention(_call, args, out, _prim) -> tvm.ir.Expr:
    # Q·K^T and P·V over the cached length for every query head: out is [seq, q_heads, head_dim].
    return 4 * _elems(out) * KV_LEN


def _bytes_kv_attention(args, out) -> tuple[tvm.ir.Expr, tvm.ir.Expr]:
    # Reads the fused qkv [seq, q+2kv heads, d] and K, V of kv_len positions; writes the output and
    # appends this step's K, V to the cache.
    qkv = _tensor_args(args)[0]
    seq, heads, d = _dims(qkv)
    kv_heads = tirx.floordiv(heads - _dims(out)[1], 2)
    kv_row = kv_heads * d * _itemsize(qkv)
    return _nbytes(qkv) + 2 * KV_LEN * kv_row, _nbytes(out) + 2 * seq * kv_row


def _flops_tir(_call, _args, _out, prim: tirx.PrimFunc) -> tvm.ir.Expr:
    """Arithmetic operations in each block's stored value, times the block's iteration count."""
    total: tvm.ir.Expr = tirx.IntImm("int64", 0)
    for block in _blocks(prim):
        if isinstance(block.body, tirx.BufferStore):
            n: tvm.ir.Expr = tirx.IntImm("int64", _count_arith(block.body.value))
            for iv in block.iter_vars:
                n = n * tirx.Cast("int64", iv.dom.extent)
            total = total + n
    return total


_ARITH = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.FloorDiv, tirx.FloorMod, tirx.Mod, tirx.Min, tirx.Max)


def _count_arith(e: tvm.ir.Expr) -> int:
    """Arithmetic nodes of a value, not counting index arithmetic inside buffer loads."""
    if isinstance(e, tirx.BufferLoad):
        return 0
    if isinstance(e, _ARITH):
        return 1 + _count_arith(e.a) + _count_arith(e.b)
    if isinstance(e, tvm.ir.Call):  # math intrinsics (exp, sqrt, ...)
        return 1 + sum(_count_arith(a) for a in e.args)
    if isinstance(e, tirx.Cast):
        return _count_arith(e.value)
    if isinstance(e, tirx.Select):
        return _count_arith(e.condition) + _count_arith(e.true_value) + _count_arith(e.false_value)
    return 0


_FLOPS: dict[str, Callable[..., tvm.ir.Expr]] = {
    "zero": lambda *_: tirx.IntImm("int64", 0),
    "per_output": lambda _call, _args, out, _prim: _elems(out),
    "per_input": lambda _call, args, _out, _prim: _elems(_tensor_args(args)[0]),
    "matmul": _flops_matmul,
    "conv": _flops_conv,
    "attention": _flops_attention,
    "kv_attention": _flops_kv_attention,
    "tir": _flops_tir,
}

_BYTES: dict[str, Callable[..., tuple[tvm.ir.Expr, tvm.ir.Expr]]] = {
    "io": lambda args, out: (sum((_nbytes(t) for t in _tensor_args(_distinct(args))), tirx.IntImm("int64", 0)), _nbytes(out)),
    "view": lambda args, out: (tirx.IntImm("int64", 0), tirx.IntImm("int64", 0)),
    # Reads the indices and the gathered rows, not the whole table.
    "gather": lambda args, out: (_nbytes(_tensor_args(args)[1]) + _nbytes(out), _nbytes(out)),
    "slice": lambda args, out: (_nbytes(out), _nbytes(out)),
    "kv_attention": _bytes_kv_attention,
}


# ---- call_tir ------------------------------------------------------------------------------------


def _blocks(prim: tirx.PrimFunc) -> list[tirx.SBlock]:
    found: list[tirx.SBlock] = []
    tirx.stmt_functor.post_order_visit(prim.body, lambda n: found.append(n) if isinstance(n, tirx.SBlock) else None)
    return [b for b in found if b.iter_vars]  # the root block has no iterators


def _tir_pattern(prim: tirx.PrimFunc) -> str | None:
    if prim.attrs is None or "op_pattern" not in prim.attrs:
        prim = relax.transform.AnnotateTIROpPattern()(tvm.IRModule({"f": prim}))["f"]
    return TVM_PATTERNS.get(int(prim.attrs["op_pattern"]))


def _tir_mapping(prim: tirx.PrimFunc) -> Mapping:
    """The class a PrimFunc provably has; ``opaque`` when the indexing doesn't show it."""
    if relax.analysis.has_reshape_pattern(prim):
        return "reorganize"
    blocks = _blocks(prim)
    if any(iv.iter_type == tirx.IterVar.CommReduce for b in blocks for iv in b.iter_vars):
        return "many-to-many"
    if len(blocks) != 1 or not isinstance(blocks[0].body, tirx.BufferStore):
        return "opaque"
    block = blocks[0]
    iters = [
        iv.var for iv in block.iter_vars if not (isinstance(iv.dom.extent, tirx.IntImm) and iv.dom.extent.value == 1)
    ]
    loads: list[tirx.BufferLoad] = []
    tirx.stmt_functor.post_order_visit(
        block.body.value, lambda n: loads.append(n) if isinstance(n, tirx.BufferLoad) else None
    )
    # Per load, the output iterators its indices use, in index order (positions in ``iters``).
    orders = []
    for load in loads:
        order = []
        for index in load.indices:
            used = [i for i, v in enumerate(iters) if _uses(index, v)]
            if len(used) > 1 or _has_load(index):
                return "opaque"  # fused or data-dependent indexing: not provable here
            order += used
        orders.append(order)
    every = list(range(len(iters)))
    if any(o != every and sorted(o) == every for o in orders):
        return "shuffle"
    # A load covering every output iterator in order makes it one-to-one (broadcast operands allowed).
    return "one-to-one" if every in orders else "one-to-many"


def _uses(e: tvm.ir.Expr, v: tirx.Var) -> bool:
    found = []
    tirx.stmt_functor.post_order_visit(
        e, lambda n: found.append(n) if isinstance(n, tirx.Var) and n.same_as(v) else None
    )
    return bool(found)


def _has_load(e: tvm.ir.Expr) -> bool:
    found = []
    tirx.stmt_functor.post_order_visit(e, lambda n: found.append(n) if isinstance(n, tirx.BufferLoad) else None)
    return bool(found)
