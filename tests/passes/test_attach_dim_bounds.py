"""AttachDimBounds: each PrimFunc gets the upper bounds its Relax callers declare
(``tir_var_upper_bound``) for its own symbolic variables, only where every reference to it is a
``call_tir`` whose dims the callers bound. It rewrites nothing."""

from __future__ import annotations

import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi
from fuselight.contracts import DIM_UPPER_BOUND_ATTR
from fuselight.passes import AttachDimBounds
from fuselight.passes.attach_dim_bounds import prim_func_dim_bounds
from tvm import relax, te, tirx


def _scale(rows, cols, name: str) -> tirx.PrimFunc:
    """``out[i, j] = 2 * x[i, j]`` over a ``[rows, cols]`` buffer (rows, cols: the callee's own sizes)."""
    x = te.placeholder((rows, cols), "float32", name="x")
    out = te.compute((rows, cols), lambda i, j: x[i, j] * 2.0, name="out")
    return te.create_prim_func([x, out]).with_attr("global_symbol", name)


def _module(calls, extra=None) -> tuple[tvm.IRModule, dict[str, tvm.ir.GlobalVar]]:
    """Relax functions ``f0(size: [n], x), f1, ...``: ``calls[i] = (bounds or None, shape of x in n, callee name)``;
    ``extra(bb, gvs, x)`` may emit more into ``f0``."""
    bb = relax.BlockBuilder()
    m, k = tirx.Var("m", "int64"), tirx.Var("k", "int64")
    gvs = {
        "rows": bb.add_func(_scale(m, 8, "rows"), "rows"),
        "square": bb.add_func(_scale(m, m, "square"), "square"),
        "both": bb.add_func(_scale(m, k, "both"), "both"),
    }
    for i, (bounds, shape, callee) in enumerate(calls):
        n = tirx.Var("n", "int64")
        size = relax.Var("size", relax.TensorType([n], "float32"))  # defines n
        x = relax.Var("x", relax.TensorType(shape(n), "float32"))
        with bb.function(f"f{i}", [size, x]):
            with bb.dataflow():
                out = bb.emit(relax.call_tir(gvs[callee], [x], relax.TensorType(shape(n), "float32")))
                if extra is not None and i == 0:
                    extra(bb, gvs, x)
                out = bb.emit_output(out)
            bb.emit_func_output(out)
        if bounds is not None:
            gv = bb.get().get_global_var(f"f{i}")
            bb.update_func(gv, bb.get()[gv].with_attr("tir_var_upper_bound", bounds))
    return bb.get(), gvs


def _bounds(mod: tvm.IRModule) -> dict[str, dict[str, int]]:
    return {gv.name_hint: {str(k): int(v) for k, v in found.items()} for gv, found in prim_func_dim_bounds(mod).items()}


def test_a_callee_takes_its_callers_bound_by_its_own_variable_name():
    mod, _ = _module([({"n": 16}, lambda n: [n, 8], "rows")])
    assert _bounds(mod) == {"rows": {"m": 16}}
    out = AttachDimBounds()(mod)
    assert {str(k): int(v) for k, v in out[out.get_global_var("rows")].attrs[DIM_UPPER_BOUND_ATTR].items()} == {"m": 16}


def test_an_expression_of_bounded_variables_is_bounded_by_its_largest_value():
    mod, _ = _module([({"n": 16}, lambda n: [n * 3 + 1, 8], "rows")])
    assert _bounds(mod) == {"rows": {"m": 49}}


def test_the_largest_over_callers_and_none_where_one_caller_is_unbounded():
    two, _ = _module([({"n": 16}, lambda n: [n, 8], "rows"), ({"n": 64}, lambda n: [n, 8], "rows")])
    assert _bounds(two) == {"rows": {"m": 64}}
    unbounded, _ = _module([({"n": 16}, lambda n: [n, 8], "rows"), (None, lambda n: [n, 8], "rows")])
    assert _bounds(unbounded) == {}
    other_name, _ = _module([({"seq_len": 16}, lambda n: [n, 8], "rows")])  # the caller bounds another variable
    assert _bounds(other_name) == {}


def test_a_variable_sizing_two_dims_takes_the_smaller_bound():
    # square(m, m) called on [n, n] with n <= 16, and on [4, 4]: m is at most 16.
    mod, _ = _module([({"n": 16}, lambda n: [n, n], "square"), ({"n": 16}, lambda n: [4, 4], "square")])
    assert _bounds(mod) == {"square": {"m": 16}}
    # both(m, k) on [n, 5]: m <= 16, k = 5.
    mod, _ = _module([({"n": 16}, lambda n: [n, 5], "both")])
    assert _bounds(mod) == {"both": {"m": 16, "k": 5}}


def test_a_callee_referenced_other_than_by_call_tir_gets_no_bound():
    def hand_to_a_builtin(bb, gvs, x):
        bb.emit(relax.call_pure_packed("vm.builtin.some_consumer", gvs["rows"], x, ty_args=relax.ObjectType()))

    mod, _ = _module([({"n": 16}, lambda n: [n, 8], "rows")], extra=hand_to_a_builtin)
    assert _bounds(mod) == {}


def test_nothing_is_rewritten_but_the_attribute():
    mod, _ = _module([({"n": 16}, lambda n: [n, 8], "rows")])
    before = mod["rows"]
    out = AttachDimBounds()(tvm.IRModule(dict(mod.functions_items())))
    assert tvm_ffi.structural_equal(out["rows"].without_attr(DIM_UPPER_BOUND_ATTR), before)
    assert tvm_ffi.structural_equal(out["f0"], mod["f0"])
