"""Give FuseAddRMSNorm's add+RMSNorm kernels to the RowReduction rule: hand-scheduled -> plain, for ``rules.RowReduction``.

MLC-LLM's ``FuseAddRMSNorm`` (and fuselight's equivalent of it, ``fuselight.baseline``) replaces
``rms_norm(add(x, r), w)`` with a call to an already scheduled kernel: one block per row, 1024
threads, each holding a few elements. DLight and fuselight's rules skip scheduled functions, so
these kernels, about two thirds of the norms of a LLaMA decode step, would never reach the
RowReduction rule. This pass finds them by what they compute (not by name): a scheduled PrimFunc
``(x, r, w) -> (out, total)`` that stores ``x + r`` into registers, writes them to ``total``, sums
their squares in float32 and writes ``cast(rsqrt(sum / hidden + eps) * float32(total) *
float32(w))`` to ``out``. For each, it writes the same computation plainly
(``fuselight.computations.plain_add_rms_norm``: TOPI's add and rms_norm, over the kernel's own
parameter shapes and ``eps``) and, where the rule takes it (``RowReduction.takes``: analysis and
configs, nothing built), replaces the kernel in place with it (same signature, so the calls stay;
not marked scheduled, so phase 4 reaches it; tagged ``RULE_ATTR = "row_reduction"`` and opaque to
FuseOps): the rule schedules it in phase 4. Runs on the target in scope; elsewhere the module comes
back unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx
from tvm.tirx import stmt_functor

from ..computations import plain_add_rms_norm
from ..contracts import IS_SCHEDULED_ATTR, OP_PATTERN_ATTR, OPAQUE_OP_PATTERN, RULE_ATTR
from ..rules.row_reduction import RowReduction

_HALF = ("float16", "bfloat16")


def _stores(func: tirx.PrimFunc) -> list[tirx.BufferStore]:
    found: list[tirx.BufferStore] = []
    stmt_functor.post_order_visit(func.body, lambda n: found.append(n) if isinstance(n, tirx.BufferStore) else None)
    return found


def _load_of(expr: Any, buffer: Any = None) -> Any:
    """The buffer ``expr`` loads (``buffer`` if given), looking through one cast; else None."""
    if isinstance(expr, tirx.Cast):
        expr = expr.value
    if isinstance(expr, tirx.BufferLoad) and (buffer is None or expr.buffer.same_as(buffer)):
        return expr.buffer
    return None


def _norm_eps(value: Any, hidden: int, registers: Any, weight: Any) -> float | None:
    """``eps`` of ``cast(rsqrt(s * (1/hidden) + eps) * float32(registers) * float32(weight))``, or None."""
    if not isinstance(value, tirx.Cast):
        return None
    v = value.value
    if not (isinstance(v, tirx.Mul) and isinstance(v.a, tirx.Mul)):
        return None
    if _load_of(v.b, weight) is None or _load_of(v.a.b, registers) is None:
        return None
    r = v.a.a
    if not (isinstance(r, tvm.ir.Call) and r.op.name == "tirx.rsqrt" and isinstance(r.args[0], tirx.Add)):
        return None
    scaled, eps = r.args[0].a, r.args[0].b
    if not (isinstance(scaled, tirx.Mul) and isinstance(scaled.b, tirx.FloatImm) and isinstance(eps, tirx.FloatImm)):
        return None
    if not math.isclose(float(scaled.b.value), 1.0 / hidden, rel_tol=1e-6):
        return None
    return float(eps.value)


def _sum_of_squares(value: Any, registers: Any) -> bool:
    found: list[bool] = []

    def visit(n: Any) -> None:
        if isinstance(n, tirx.Mul) and _load_of(n.a, registers) is not None and _load_of(n.b, registers) is not None:
            found.append(True)

    stmt_functor.post_order_visit(value, visit)
    return bool(found)


def add_rms_norm_eps(func: tirx.PrimFunc) -> float | None:
    """``eps`` when ``func`` is a scheduled add+RMSNorm kernel (see the module docstring), else None."""
    if not isinstance(func, tirx.PrimFunc) or IS_SCHEDULED_ATTR not in (func.attrs or {}) or len(func.params) != 5:
        return None
    x, r, w, out, total = func.params
    dtype = str(x.dtype)
    rows_like = (x, r, out, total)
    if dtype not in _HALF or any(str(b.dtype) != dtype for b in (*rows_like, w)) or len(w.shape) != 1:
        return None
    hidden = x.shape[-1]
    if not isinstance(hidden, tirx.IntImm) or not isinstance(w.shape[0], tirx.IntImm) or int(w.shape[0]) != int(hidden):
        return None
    if any(not tvm_ffi.structural_equal(b.shape, x.shape) for b in rows_like):
        return None
    stores = _stores(func)
    to_out = [s for s in stores if s.buffer.same_as(out)]
    to_total = [s for s in stores if s.buffer.same_as(total)]
    if len(to_out) != 1 or len(to_total) != 1:
        return None
    registers = _load_of(to_total[0].value)
    if registers is None or any(registers.same_as(p) for p in func.params):
        return None
    filled = [s.value for s in stores if s.buffer.same_as(registers)]
    if len(filled) != 1 or not isinstance(filled[0], tirx.Add):
        return None
    summands = (_load_of(filled[0].a), _load_of(filled[0].b))
    if None in summands or not any(summands[0].same_as(a) and summands[1].same_as(b) for a, b in ((x, r), (r, x))):
        return None
    if not any(_sum_of_squares(s.value, registers) for s in stores):
        return None
    return _norm_eps(to_out[0].value, int(hidden), registers, w)


@tvm.transform.module_pass(opt_level=0, name="AddRMSNormKernels")
class AddRMSNormKernels:
    """Replace FuseAddRMSNorm's scheduled kernels with their plain computation where the RowReduction rule takes it."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is None:
            return mod
        replaced = {}
        for gv, func in mod.functions_items():
            eps = add_rms_norm_eps(func) if isinstance(func, tirx.PrimFunc) else None
            if eps is None:
                continue
            plain = plain_add_rms_norm(func, eps).without_attr("global_symbol")  # te names it "main"
            if RowReduction.takes(plain, target):
                plain = plain.with_attrs({RULE_ATTR: RowReduction.family, OP_PATTERN_ATTR: OPAQUE_OP_PATTERN})
                symbol = (func.attrs or {}).get("global_symbol")
                replaced[gv] = plain if symbol is None else plain.with_attr("global_symbol", symbol)
        if not replaced:
            return mod
        out = mod.clone()
        for gv, kernel in replaced.items():
            out.update_func(gv, kernel)
        return out
