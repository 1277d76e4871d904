"""Test helper: what a scheduled PrimFunc launches, read from its TIR (as DLight's own tests read
the IR after a rule rather than the generated source).

A kernel is a loop nest bound to ``blockIdx.*`` (a ``thread_binding`` loop or a ``thread_extent``
attribute) outside any other: ``kernels(func)`` lists, for each, its launch extents, the buffers it
allocates (scope, dtype, shape), the intrinsics it calls, and which buffers it stores to. Extents
are ints where constant, else their expression as text (a symbolic token count)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from tvm import tirx
from tvm.ir.expr import Call
from tvm.tirx import stmt_functor

_EXTERN_OPS = ("tirx.call_extern", "tirx.call_pure_extern")


@dataclasses.dataclass
class Kernel:
    launch: dict[str, Any]  # thread tag -> extent, e.g. {"blockIdx.x": 256, "threadIdx.x": 512}
    allocs: dict[str, tuple[str, str, tuple]]  # buffer name -> (scope, dtype, shape)
    calls: Counter  # op name (an extern call: its function name) -> call sites
    call_args: dict[str, list]  # op name -> the argument lists of its call sites
    stores: set[str]  # names of the buffers stored to
    vectorized: Counter  # extents of vectorized loops (8 halves: a 16-byte access)
    attrs: dict[str, Any]  # attribute statements inside the kernel (launch bounds), key -> value
    values: dict[str, list]  # buffer name -> the expressions stored to it
    loads: dict[str, list]  # buffer name -> the index expressions it is read at
    bounds: Counter  # constants c of the comparisons ``x < c`` (the guards of ragged edges)

    @property
    def outputs(self) -> set[str]:
        """The buffers it stores to that it does not allocate (the function's)."""
        return self.stores - set(self.allocs)

    def scopes(self) -> Counter:
        """How many buffers of each storage scope the kernel allocates."""
        return Counter(scope for scope, _, _ in self.allocs.values())

    @property
    def threads(self) -> int:
        return _product(v for k, v in self.launch.items() if k.startswith("threadIdx"))


def _product(values: Any) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _extent(value: Any) -> Any:
    return int(value) if isinstance(value, tirx.IntImm) else str(value)


def _shape(buffer: Any) -> tuple:
    return tuple(_extent(s) for s in buffer.shape)


def _scope(buffer: Any) -> str:
    return buffer.scope() if callable(getattr(buffer, "scope", None)) else "global"


def _is_grid(node: Any) -> bool:
    if isinstance(node, tirx.For) and node.thread_binding is not None:
        return node.thread_binding.thread_tag.startswith("blockIdx")
    return (
        isinstance(node, tirx.AttrStmt)
        and node.attr_key == "thread_extent"
        and node.node.thread_tag.startswith("blockIdx")
    )


def _kernel(root: Any) -> Kernel:
    k = Kernel({}, {}, Counter(), {}, set(), Counter(), {}, {}, {}, Counter())

    def visit(node: Any) -> None:
        if isinstance(node, tirx.For) and node.thread_binding is not None:
            k.launch[node.thread_binding.thread_tag] = _extent(node.extent)
        elif isinstance(node, tirx.For) and node.kind == tirx.ForKind.VECTORIZED:
            k.vectorized[_extent(node.extent)] += 1
        elif isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
            k.launch[node.node.thread_tag] = _extent(node.value)
        elif isinstance(node, tirx.AttrStmt):
            k.attrs[node.attr_key] = _extent(node.value)
        elif isinstance(node, tirx.SBlock):
            for buf in node.alloc_buffers:
                k.allocs[buf.name] = (_scope(buf), str(buf.dtype), _shape(buf))
        elif isinstance(node, tirx.AllocBuffer):
            k.allocs[node.buffer.name] = (_scope(node.buffer), str(node.buffer.dtype), _shape(node.buffer))
        elif isinstance(node, tirx.BufferLoad):
            k.loads.setdefault(node.buffer.name, []).extend(node.indices)
        elif isinstance(node, tirx.LT) and isinstance(node.b, tirx.IntImm):
            k.bounds[int(node.b)] += 1
        elif isinstance(node, tirx.BufferStore):
            k.stores.add(node.buffer.name)
            k.values.setdefault(node.buffer.name, []).append(node.value)
        elif isinstance(node, Call) and hasattr(node.op, "name"):
            name = node.op.name
            if name in _EXTERN_OPS and isinstance(node.args[0], tirx.StringImm):
                name = node.args[0].value
            k.calls[name] += 1
            k.call_args.setdefault(name, []).append(list(node.args))

    stmt_functor.post_order_visit(root, visit)
    return k


def constants(expr: Any) -> set[int]:
    """The integer constants an expression contains."""
    found: set[int] = set()
    stmt_functor.post_order_visit(expr, lambda n: found.add(int(n)) if isinstance(n, tirx.IntImm) else None)
    return found


def evaluate(expr: Any, values: dict[str, int]) -> int:
    """``expr`` with its variables (by name) set to ``values``, folded to an int."""
    from tvm import arith

    names: dict[str, Any] = {}
    stmt_functor.post_order_visit(expr, lambda n: names.setdefault(n.name, n) if isinstance(n, tirx.Var) else None)
    missing = set(names) - set(values)
    assert not missing, f"no value for {sorted(missing)} in {expr}"
    bound = stmt_functor.substitute(expr, {v: tirx.const(values[name], v.ty.dtype if hasattr(v.ty, "dtype") else "int32")
                                           for name, v in names.items()})
    folded = arith.Analyzer().simplify(bound)
    return int(folded) if isinstance(folded, tirx.IntImm) else _fold(folded)


# The bitwise intrinsics the analyzer leaves unfolded (a swizzle's xor), by op name.
_BITWISE = {"tirx.bitwise_xor": lambda a, b: a ^ b, "tirx.bitwise_and": lambda a, b: a & b,
            "tirx.bitwise_or": lambda a, b: a | b, "tirx.shift_left": lambda a, b: a << b,
            "tirx.shift_right": lambda a, b: a >> b}
# Integer arithmetic on non-negative values (truncating and floor division agree there), by node type.
_ARITH = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
          "FloorDiv": lambda a, b: a // b, "FloorMod": lambda a, b: a % b, "Div": lambda a, b: a // b,
          "Mod": lambda a, b: a % b, "Min": min, "Max": max}


def _fold(expr: Any) -> int:
    """A constant integer expression the analyzer did not fold (bitwise calls inside), folded here."""
    if isinstance(expr, tirx.IntImm):
        return int(expr)
    if isinstance(expr, tirx.Cast):
        return _fold(expr.value)
    if isinstance(expr, Call) and expr.op.name in _BITWISE:
        return _BITWISE[expr.op.name](*(_fold(a) for a in expr.args))
    kind = type(expr).__name__
    assert kind in _ARITH, f"not a constant: {expr}"
    a, b = _fold(expr.a), _fold(expr.b)
    assert min(a, b) >= 0 or kind in ("Add", "Sub", "Mul", "Min", "Max"), f"negative operand in {expr}"
    return _ARITH[kind](a, b)


def kernels(func: tirx.PrimFunc) -> list[Kernel]:
    """The kernels ``func`` launches, in program order (both arms of a host-side branch included)."""
    roots: list[Any] = []

    def visit(node: Any) -> bool:
        if _is_grid(node):
            roots.append(node)
            return False  # its inner loops belong to this kernel
        return True

    stmt_functor.pre_order_visit(func.body, visit)
    return [_kernel(r) for r in roots]


def kernel(func: tirx.PrimFunc) -> Kernel:
    """The one kernel ``func`` launches (fails if it launches more or none)."""
    found = kernels(func)
    assert len(found) == 1, f"{len(found)} kernels"
    return found[0]
