"""The RowReduction rule: which functions its analysis takes (LLaMA's norms, softmax, add+RMSNorm,
none of a zoo of other shapes), that its description is exactly what the function computes, that
its kernels build for sm_90 and nvcc compiles them, and the pass handing FuseAddRMSNorm's kernels
to it.

The description is checked numerically on the CPU: a plain loop body computing each row's
statistics and outputs from the description (through the same instantiation the GPU kernels use)
replaces the function's body and must match the original on random inputs, at odd row counts.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import compile_cuda_concurrently, needs_nvcc
import tvm
import tvm_ffi
from fuselight.computations import plain_add_rms_norm
from fuselight.config import load
from fuselight.contracts import OP_PATTERN_ATTR, OPAQUE_OP_PATTERN, RULE_ATTR
from fuselight.errors import FuselightError
from fuselight.passes.add_rms_norm_kernels import AddRMSNormKernels, add_rms_norm_eps
from fuselight.rules.reduce import rowwise
from fuselight.rules.reduce.analysis import RowReductionDesc, analyze_row_reduction
from fuselight.rules.row_reduction import RowReduction
from fuselight.target import resolve, to_tvm
from fuselight.tune.gemm import matmul_prim_func
from tvm import relax, te, tirx, topi
from tvm.s_tir import dlight as dl
from tvm.script import tirx as T



@pytest.fixture(scope="module")
def cuda():
    return to_tvm(resolve("cuda", "sm_90"))


def _legalized(build, *shapes_dtypes) -> tirx.PrimFunc:
    """The one PrimFunc LegalizeOps writes for ``build(*vars)`` over inputs of the given (shape, dtype)."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"p{i}", relax.TensorType(s, d)) for i, (s, d) in enumerate(shapes_dtypes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build(*params))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    funcs = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert len(funcs) == 1
    return funcs[0]


def rms_norm(rows, hidden: int, dtype: str = "float16") -> tirx.PrimFunc:
    return _legalized(lambda x, w: relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=1e-5),
                      ([1, rows, hidden], dtype), ([hidden], dtype))


def softmax(rows, cols: int, dtype: str) -> tirx.PrimFunc:
    return _legalized(lambda x: relax.op.nn.softmax(x, axis=-1), ([rows, cols], dtype))


def _plain_add(d0, d1, hidden: int) -> tirx.PrimFunc:
    xs = te.placeholder((d0, d1, hidden), "float16", "x")
    rs = te.placeholder((d0, d1, hidden), "float16", "r")
    ws = te.placeholder((hidden,), "float16", "w")
    total = topi.add(xs, rs)
    return te.create_prim_func([xs, rs, ws, topi.nn.rms_norm(total, ws, [2], 1e-6), total])


# fmt: off
# --- functions the analysis must refuse ---

@T.prim_func(private=True, s_tir=True)
def column_sum(X: T.Buffer((T.int64(8), T.int64(16)), "float32"), O: T.Buffer((T.int64(8), T.int64(16)), "float32")):
    S = T.sblock_alloc_buffer((T.int64(16),))
    for j, i in T.grid(T.int64(16), T.int64(8)):
        with T.sblock("colsum"):
            vj, vi = T.axis.remap("SR", [j, i])
            with T.init():
                S[vj] = T.float32(0)
            S[vj] = S[vj] + X[vi, vj]
    for i, j in T.grid(T.int64(8), T.int64(16)):
        with T.sblock("scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            O[vi, vj] = X[vi, vj] / S[vj]


@T.prim_func(private=True, s_tir=True)
def symbolic_cols(x: T.handle, o: T.handle):
    n = T.int64()
    X = T.match_buffer(x, (T.int64(4), n), "float32")
    O = T.match_buffer(o, (T.int64(4), n), "float32")
    S = T.sblock_alloc_buffer((T.int64(4),))
    for i, k in T.grid(T.int64(4), n):
        with T.sblock("sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                S[vi] = T.float32(0)
            S[vi] = S[vi] + X[vi, vk]
    for i, j in T.grid(T.int64(4), n):
        with T.sblock("scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            O[vi, vj] = X[vi, vj] / S[vi]


@T.prim_func(private=True, s_tir=True)
def statistic_written_out(X: T.Buffer((T.int64(8), T.int64(16)), "float32"), S: T.Buffer((T.int64(8),), "float32"), O: T.Buffer((T.int64(8), T.int64(16)), "float32")):
    for i, k in T.grid(T.int64(8), T.int64(16)):
        with T.sblock("sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                S[vi] = T.float32(0)
            S[vi] = S[vi] + X[vi, vk]
    for i, j in T.grid(T.int64(8), T.int64(16)):
        with T.sblock("scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            O[vi, vj] = X[vi, vj] / S[vi]


@T.prim_func(private=True, s_tir=True)
def reversed_row(X: T.Buffer((T.int64(8), T.int64(16)), "float32"), O: T.Buffer((T.int64(8), T.int64(16)), "float32")):
    S = T.sblock_alloc_buffer((T.int64(8),))
    for i, k in T.grid(T.int64(8), T.int64(16)):
        with T.sblock("sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                S[vi] = T.float32(0)
            S[vi] = S[vi] + X[vi, vk]
    for i, j in T.grid(T.int64(8), T.int64(16)):
        with T.sblock("scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            O[vi, vj] = X[vi, T.int64(15) - vj] / S[vi]


@T.prim_func(private=True, s_tir=True)
def middle_axis(X: T.Buffer((T.int64(4), T.int64(8), T.int64(16)), "float32"), O: T.Buffer((T.int64(4), T.int64(8), T.int64(16)), "float32")):
    S = T.sblock_alloc_buffer((T.int64(4), T.int64(16)))
    for i, k, j in T.grid(T.int64(4), T.int64(8), T.int64(16)):
        with T.sblock("sum"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                S[vi, vj] = T.float32(0)
            S[vi, vj] = S[vi, vj] + X[vi, vk, vj]
    for i, k, j in T.grid(T.int64(4), T.int64(8), T.int64(16)):
        with T.sblock("scale"):
            vi, vk, vj = T.axis.remap("SSS", [i, k, j])
            O[vi, vk, vj] = X[vi, vk, vj] / S[vi, vj]


@T.prim_func(private=True, s_tir=True)
def row_sum_only(X: T.Buffer((T.int64(8), T.int64(16)), "float32"), S: T.Buffer((T.int64(8),), "float32")):
    for i, k in T.grid(T.int64(8), T.int64(16)):
        with T.sblock("sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                S[vi] = T.float32(0)
            S[vi] = S[vi] + X[vi, vk]


@T.prim_func(private=True, s_tir=True)
def product_reduction(X: T.Buffer((T.int64(8), T.int64(16)), "float32"), O: T.Buffer((T.int64(8), T.int64(16)), "float32")):
    S = T.sblock_alloc_buffer((T.int64(8),))
    for i, k in T.grid(T.int64(8), T.int64(16)):
        with T.sblock("prod"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                S[vi] = T.float32(1)
            S[vi] = S[vi] * X[vi, vk]
    for i, j in T.grid(T.int64(8), T.int64(16)):
        with T.sblock("scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            O[vi, vj] = X[vi, vj] / S[vi]


matmul = matmul_prim_func(24, 16, "float16", m=8)
_x = te.placeholder((8, 16), "float16", "A")
elementwise = te.create_prim_func([_x, topi.add(_x, tvm.tirx.const(1, "float16"))])
# fmt: on


ZOO = [column_sum, symbolic_cols, statistic_written_out, reversed_row, middle_axis, row_sum_only,
       product_reduction, matmul, elementwise]


@pytest.mark.parametrize("func", ZOO, ids=[
    "column_sum", "symbolic_cols", "statistic_written_out", "reversed_row", "middle_axis", "row_sum_only",
    "product_reduction", "matmul", "elementwise"])
def test_refuses_what_it_does_not_own(func):
    assert analyze_row_reduction(func) is None


def test_recognises_the_shapes_by_their_stages():
    n = tirx.Var("n", "int64")
    norm = analyze_row_reduction(rms_norm(n, 4096))
    assert norm.kind == "rms_norm" and norm.cols == 4096 and [s.reducer for s in norm.stats] == ["sum"]
    assert len(norm.row_inputs) == 1 and len(norm.col_inputs) == 1 and norm.rows_static is None
    sm = analyze_row_reduction(softmax(n, 128256, "float32"))
    assert sm.kind == "softmax" and sm.online_softmax and [s.reducer for s in sm.stats] == ["max", "sum"]
    both = analyze_row_reduction(_plain_add(n, tirx.IntImm("int64", 1), 4096))
    assert both.kind == "add_rms_norm" and len(both.outputs) == 2 and len(both.row_inputs) == 2
    assert analyze_row_reduction(softmax(7, 96, "float16")).rows_static == 7


def test_takes_the_norms_of_the_llama_model_and_nothing_else():
    from fuselight import pipeline as pl
    from fuselight.model.llama import export_module

    target = to_tvm(resolve("cuda", "sm_90"))
    mod = export_module(load("tiny-llama").with_dtype("float16"), target)[0]
    stages = pl.stages(target, graph_passes=pl.graph_passes(None, None), rules=pl.fuselight_rules())
    with target:
        mod = tvm.transform.Sequential([s.pass_ for s in stages if s.phase <= 3])(mod)
    funcs = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    taken = {n: analyze_row_reduction(f) for n, f in funcs.items()}
    norms = {n: d for n, d in taken.items() if n.startswith("rms_norm")}
    # Prefill's (rows = seq_len); decode's first norm is computed inside its QKV GEMV (fuse_norm_gemv).
    assert len(norms) == 1 and all(d is not None and d.kind == "rms_norm" for d in norms.values())
    assert all(d.rows_static is None for d in norms.values())
    # FuseAddRMSNorm's kernels, where it applies (hidden % 1024 == 0: not tiny-llama's), would be
    # handed to the rule plainly by add_rms_norm_kernels.
    handed = {n for n, f in funcs.items() if str((f.attrs or {}).get(RULE_ATTR, "")) == "row_reduction"}
    assert all(taken[n] is not None and taken[n].kind == "add_rms_norm" for n in handed)
    assert all(d is None for n, d in taken.items() if n not in norms and n not in handed)


def _reference_body(desc: RowReductionDesc) -> tirx.Stmt:
    """Each row's statistics in order, then its outputs, plainly from the description."""
    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        for r in T.serial(desc.rows):
            with T.sblock("row"):
                T.reads()
                T.writes()
                stats = rowwise._stat_locals(desc)
                at = T.meta_var(rowwise.RowAt(desc, r))
                _reference_stats(desc, at, stats)
                for c in T.serial(desc.cols):
                    _reference_outputs(desc, at, stats, c)

    return body.body


def _reference_stats(desc: RowReductionDesc, at, stats) -> None:
    for s, buf in zip(desc.stats, stats):
        T.buffer_store(buf, s.init, [0])
        with T.serial(desc.cols) as c:
            value = at.expr(s.element, c, [], [], 0, stats)
            load = tirx.BufferLoad(buf, [0])
            T.buffer_store(buf, tirx.Max(load, value) if s.reducer == "max" else load + value, [0])


def _reference_outputs(desc: RowReductionDesc, at, stats, c) -> None:
    for out in desc.outputs:
        T.buffer_store(out.buffer, at.expr(out.value, c, [], [], 0, stats), at.index(c))


def _run_llvm(func: tirx.PrimFunc, args: list[np.ndarray]) -> list[np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*tensors)
    return [t.numpy() for t in tensors]


@pytest.mark.parametrize("make,rows", [
    (lambda n: rms_norm(n, 64), 7),
    (lambda n: softmax(n, 96, "float32"), 5),
    (lambda n: softmax(n, 40, "float16"), 3),
    (lambda n: _plain_add(n, tirx.IntImm("int64", 1), 32), 3),
])
def test_description_computes_what_the_function_does(make, rows):
    func = make(tirx.Var("n", "int64"))
    desc = analyze_row_reduction(func)
    ours = tirx.PrimFunc(func.params, tirx.SBlockRealize([], True, tirx.SBlock([], [], [], "root", _reference_body(desc))),
                         func.ret_type, func.attrs)
    rng = np.random.default_rng(rows)
    outputs = {id(o.buffer) for o in desc.outputs}
    args = []
    for p in func.params:
        shape = [rows if not isinstance(d, tirx.IntImm) else int(d) for d in p.shape]
        args.append(rng.standard_normal(shape).astype(str(p.dtype)))
    out_index = [i for i, p in enumerate(func.params) if any(p.same_as(o.buffer) for o in desc.outputs)]
    assert out_index and len(outputs) == len(out_index)
    expected = _run_llvm(func, [a.copy() for a in args])
    got = _run_llvm(ours, [a.copy() for a in args])
    for i in out_index:
        tol = 1e-2 if str(func.params[i].dtype) == "float16" else 1e-5
        np.testing.assert_allclose(got[i].astype("float64"), expected[i].astype("float64"), rtol=tol, atol=tol)
        assert np.abs(expected[i]).max() > 0


def _cuda_source(func: tirx.PrimFunc, target) -> str:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    return lib.mod.imports[0].inspect_source("cuda")


@pytest.mark.parametrize("make,kernels,vector", [
    (lambda: rms_norm(tirx.Var("n", "int64"), 4096), 1, "uint4"),  # a block per row, in registers
    (lambda: rms_norm(tirx.Var("n", "int64"), 128), 1, "uint4"),  # a warp per row
    (lambda: softmax(tirx.Var("n", "int64"), 4096, "float16"), 1, "uint4"),
    (lambda: softmax(tirx.Var("n", "int64"), 128256, "float32"), 3, "float4"),  # split or not, by rows
    (lambda: softmax(8, 128256, "float32"), 2, "float4"),  # few rows: split
    (lambda: softmax(512, 32768, "float32"), 1, "float4"),  # many rows: one launch, re-reads
    (lambda: _plain_add(tirx.Var("b", "int64"), tirx.IntImm("int64", 1), 4096), 1, "uint4"),
])
def test_rule_output_builds_for_sm90(make, kernels, vector, cuda):
    func = make()
    sch = RowReduction().apply(func, cuda, False)
    assert sch is not None
    kernel = sch.mod["main"]
    assert [p.name for p in kernel.params] == [p.name for p in func.params]  # the signature stays
    source = _cuda_source(kernel, cuda)
    assert len(set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))) == kernels
    assert f"*({vector}*)" in source  # vectorised loads and stores
    assert "__shfl_down_sync" in source


@needs_nvcc
def test_nvcc_compiles_the_kernels(cuda):
    funcs = (softmax(tirx.Var("n", "int64"), 128256, "float32"), _plain_add(tirx.Var("b", "int64"), tirx.IntImm("int64", 1), 4096))
    assert all(compile_cuda_concurrently((_cuda_source(RowReduction().apply(f, cuda, False).mod["main"], cuda), "sm_90") for f in funcs))


def test_rule_leaves_cpu_and_unconfigured_archs_to_the_next_rule():
    func = rms_norm(tirx.Var("n", "int64"), 4096)
    assert RowReduction().apply(func, to_tvm(resolve("llvm")), False) is None
    assert RowReduction().apply(func, to_tvm(resolve("cuda", "sm_75")), False) is None  # no device description
    with pytest.raises(FuselightError, match="sm_75"):
        rowwise.load_row_config("sm_75")


def test_configs_decide_the_kernel_shape():
    cfg, split = rowwise.load_row_config("sm_90"), rowwise.load_split_config("sm_90")
    desc = analyze_row_reduction(softmax(tirx.Var("n", "int64"), 128256, "float32"))
    assert rowwise.use_split(desc, split) and rowwise.vector_width(desc, cfg.load_bytes) == 4
    assert not rowwise.use_split(analyze_row_reduction(rms_norm(tirx.Var("n", "int64"), 131072)), split)
    assert rowwise.vector_width(analyze_row_reduction(softmax(3, 36, "float16")), cfg.load_bytes) == 4


def _add_norm_module(shape):
    bb = relax.BlockBuilder()
    x, r = (relax.Var(n, relax.TensorType(shape, "float16")) for n in "xr")
    w = relax.Var("w", relax.TensorType([shape[-1]], "float16"))
    with bb.function("main", [x, r, w]):
        with bb.dataflow():
            total = bb.emit(relax.op.add(x, r))
            out = bb.emit_output(relax.Tuple([relax.op.nn.rms_norm(total, w, axes=[-1], epsilon=1e-6), total]))
        bb.emit_func_output(out)
    return bb.get()


def _fuse_add_rms_norm(which: str):
    """FuseAddRMSNorm's class: fuselight's equivalent, or MLC-LLM's own (skipped where unavailable)."""
    if which == "fuselight":
        from fuselight.baseline.fuse_add_rms_norm import FuseAddRMSNorm

        return FuseAddRMSNorm
    from fuselight import mlc

    if mlc.import_mlc_llm() is None:
        pytest.skip(f"MLC-LLM not available (install mlc_llm or set {mlc.SOURCE_ENV})")
    from mlc_llm.compiler_pass.fuse_add_norm import FuseAddRMSNorm

    return FuseAddRMSNorm


@pytest.mark.parametrize("which,shape", [
    ("fuselight", [1, "n", 4096]), ("mlc", [1, "n", 4096]), ("mlc", ["n", 1, 4096])])
def test_pass_hands_fuse_add_rms_norm_kernels_to_the_rule(which, shape, cuda):
    shape = [tirx.Var(d, "int64") if isinstance(d, str) else d for d in shape]
    mod = _fuse_add_rms_norm(which)(cuda)(_add_norm_module(shape))
    (gv, fused), = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert add_rms_norm_eps(fused) == pytest.approx(1e-6)
    assert analyze_row_reduction(plain_add_rms_norm(fused, 1e-6)).kind == "add_rms_norm"
    assert AddRMSNormKernels()(mod).same_as(mod)  # no target in scope: unchanged
    with cuda:
        out = AddRMSNormKernels()(mod)
    plain = out[gv]
    assert all(tvm_ffi.structural_equal(a.shape, b.shape) and a.dtype == b.dtype for a, b in zip(plain.params, fused.params))
    # The plain computation, for the rule in phase 4: not marked scheduled (ApplyDefaultSchedule skips
    # those), tagged, and opaque to FuseOps.
    assert "tirx.is_scheduled" not in plain.attrs and add_rms_norm_eps(plain) is None
    assert plain.attrs[RULE_ATTR] == "row_reduction" and int(plain.attrs[OP_PATTERN_ATTR]) == OPAQUE_OP_PATTERN
    with cuda:
        out = dl.ApplyDefaultSchedule(RowReduction())(out)
    kernel = out[gv]
    assert "tirx.HoistIfThenElseExprWithBlock" in kernel.attrs  # the rule's, not the hand-scheduled one
    tvm.compile(out, target=cuda)  # the calls fit the new kernel
    assert "__shfl_down_sync" in _cuda_source(kernel, cuda)
    # functions that only look alike are left alone
    assert all(add_rms_norm_eps(f) is None for f in (rms_norm(5, 64), softmax(3, 96, "float32")))
