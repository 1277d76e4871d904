"""The Matmul rule's analysis: which functions it takes, and that its GEMM + epilogue description is
exactly what the function computes.

The description is checked numerically on the CPU: a plain loop body that computes
``out[index(r, c)] = value(r, c, sum_k A[r, k] B[c, k])`` from the description replaces the
function's body (as the GPU templates do) and must match the original on random inputs, with odd
and prime sizes for the symbolic M.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from fuselight.config import load
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemm.operands import GemmOperands
from fuselight.target import resolve, to_tvm
from tvm import tirx
from tvm.script import tirx as T

# fmt: off


@T.prim_func(private=True, s_tir=True)
def cast_only(a: T.handle, B: T.Buffer((T.int64(48), T.int64(64)), "float16"), o: T.handle):
    n = T.int64()
    A = T.match_buffer(a, (T.int64(1), n, T.int64(64)), "float16")
    O = T.match_buffer(o, (T.int64(1), n, T.int64(48)), "float16")
    C = T.sblock_alloc_buffer((T.int64(1), n, T.int64(48)))
    for i0, i1, i2, k in T.grid(T.int64(1), n, T.int64(48), T.int64(64)):
        with T.sblock("NT_matmul"):
            v0, v1, v2, vk = T.axis.remap("SSSR", [i0, i1, i2, k])
            with T.init():
                C[v0, v1, v2] = T.float32(0)
            C[v0, v1, v2] = C[v0, v1, v2] + T.Cast("float32", A[v0, v1, vk]) * T.Cast("float32", B[v2, vk])
    for i0, i1, i2 in T.grid(T.int64(1), n, T.int64(48)):
        with T.sblock("cast"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            O[v0, v1, v2] = T.Cast("float16", C[v0, v1, v2])


@T.prim_func(private=True, s_tir=True)
def bias_silu(a: T.handle, B: T.Buffer((T.int64(40), T.int64(32)), "float16"), bias: T.Buffer((T.int64(40),), "float16"), o: T.handle):
    n = T.int64()
    A = T.match_buffer(a, (n, T.int64(32)), "float16")
    O = T.match_buffer(o, (n, T.int64(40)), "float16")
    C = T.sblock_alloc_buffer((n, T.int64(40)))
    E1 = T.sblock_alloc_buffer((n, T.int64(40)), "float16")
    E2 = T.sblock_alloc_buffer((n, T.int64(40)), "float16")
    for i, j, k in T.grid(n, T.int64(40), T.int64(32)):
        with T.sblock("NT_matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + T.Cast("float32", B[vj, vk]) * T.Cast("float32", A[vi, vk])
    for i, j in T.grid(n, T.int64(40)):
        with T.sblock("cast"):
            vi, vj = T.axis.remap("SS", [i, j])
            E1[vi, vj] = T.Cast("float16", C[vi, vj])
    for i, j in T.grid(n, T.int64(40)):
        with T.sblock("bias"):
            vi, vj = T.axis.remap("SS", [i, j])
            E2[vi, vj] = E1[vi, vj] + bias[vj]
    for i, j in T.grid(n, T.int64(40)):
        with T.sblock("silu"):
            vi, vj = T.axis.remap("SS", [i, j])
            O[vi, vj] = E2[vi, vj] * T.sigmoid(E2[vi, vj])


@T.prim_func(private=True, s_tir=True)
def nn_residual(a: T.handle, B: T.Buffer((T.int64(32), T.int64(24)), "float16"), r: T.handle, o: T.handle):
    n = T.int64()
    A = T.match_buffer(a, (T.int64(2), n, T.int64(32)), "float16")
    R = T.match_buffer(r, (T.int64(2), n, T.int64(24)), "float16")
    O = T.match_buffer(o, (T.int64(2), n, T.int64(24)), "float16")
    C = T.sblock_alloc_buffer((T.int64(2), n, T.int64(24)))
    for b, i, j, k in T.grid(T.int64(2), n, T.int64(24), T.int64(32)):
        with T.sblock("matmul"):
            vb, vi, vj, vk = T.axis.remap("SSSR", [b, i, j, k])
            with T.init():
                C[vb, vi, vj] = T.float32(0)
            C[vb, vi, vj] = C[vb, vi, vj] + T.Cast("float32", A[vb, vi, vk]) * T.Cast("float32", B[vk, vj])
    for b, i, j in T.grid(T.int64(2), n, T.int64(24)):
        with T.sblock("add"):
            vb, vi, vj = T.axis.remap("SSS", [b, i, j])
            O[vb, vi, vj] = T.Cast("float16", C[vb, vi, vj]) + R[vb, vi, vj]


@T.prim_func(private=True, s_tir=True)
def static_double_cast(A: T.Buffer((T.int64(1), T.int64(7), T.int64(16)), "float16"), B: T.Buffer((T.int64(24), T.int64(16)), "float16"), O: T.Buffer((T.int64(1), T.int64(7), T.int64(24)), "float32")):
    C = T.sblock_alloc_buffer((T.int64(1), T.int64(7), T.int64(24)))
    E = T.sblock_alloc_buffer((T.int64(1), T.int64(7), T.int64(24)), "float16")
    for i0, i1, i2, k in T.grid(T.int64(1), T.int64(7), T.int64(24), T.int64(16)):
        with T.sblock("NT_matmul"):
            v0, v1, v2, vk = T.axis.remap("SSSR", [i0, i1, i2, k])
            with T.init():
                C[v0, v1, v2] = T.float32(0)
            C[v0, v1, v2] = C[v0, v1, v2] + T.Cast("float32", A[v0, v1, vk]) * T.Cast("float32", B[v2, vk])
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(7), T.int64(24)):
        with T.sblock("c1"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            E[v0, v1, v2] = T.Cast("float16", C[v0, v1, v2])
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(7), T.int64(24)):
        with T.sblock("c2"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            O[v0, v1, v2] = T.Cast("float32", E[v0, v1, v2])


# --- functions the analysis must refuse ---

@T.prim_func(private=True, s_tir=True)
def a_transposed(A: T.Buffer((T.int64(16), T.int64(8)), "float16"), B: T.Buffer((T.int64(24), T.int64(16)), "float16"), O: T.Buffer((T.int64(8), T.int64(24)), "float32")):
    for i, j, k in T.grid(T.int64(8), T.int64(24), T.int64(16)):
        with T.sblock("matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                O[vi, vj] = T.float32(0)
            O[vi, vj] = O[vi, vj] + T.Cast("float32", A[vk, vi]) * T.Cast("float32", B[vj, vk])


@T.prim_func(private=True, s_tir=True)
def batched_b(A: T.Buffer((T.int64(2), T.int64(8), T.int64(16)), "float16"), B: T.Buffer((T.int64(2), T.int64(24), T.int64(16)), "float16"), O: T.Buffer((T.int64(2), T.int64(8), T.int64(24)), "float32")):
    for b, i, j, k in T.grid(T.int64(2), T.int64(8), T.int64(24), T.int64(16)):
        with T.sblock("bmm"):
            vb, vi, vj, vk = T.axis.remap("SSSR", [b, i, j, k])
            with T.init():
                O[vb, vi, vj] = T.float32(0)
            O[vb, vi, vj] = O[vb, vi, vj] + T.Cast("float32", A[vb, vi, vk]) * T.Cast("float32", B[vb, vj, vk])


@T.prim_func(private=True, s_tir=True)
def float32_inputs(A: T.Buffer((T.int64(8), T.int64(16)), "float32"), B: T.Buffer((T.int64(24), T.int64(16)), "float32"), O: T.Buffer((T.int64(8), T.int64(24)), "float32")):
    for i, j, k in T.grid(T.int64(8), T.int64(24), T.int64(16)):
        with T.sblock("matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                O[vi, vj] = T.float32(0)
            O[vi, vj] = O[vi, vj] + A[vi, vk] * B[vj, vk]


@T.prim_func(private=True, s_tir=True)
def epilogue_reads_another_column(A: T.Buffer((T.int64(8), T.int64(16)), "float16"), B: T.Buffer((T.int64(24), T.int64(16)), "float16"), O: T.Buffer((T.int64(8), T.int64(24)), "float16")):
    C = T.sblock_alloc_buffer((T.int64(8), T.int64(24)))
    for i, j, k in T.grid(T.int64(8), T.int64(24), T.int64(16)):
        with T.sblock("matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast("float32", B[vj, vk])
    for i, j in T.grid(T.int64(8), T.int64(24)):
        with T.sblock("flip"):
            vi, vj = T.axis.remap("SS", [i, j])
            O[vi, vj] = T.Cast("float16", C[vi, T.int64(23) - vj])


@T.prim_func(private=True, s_tir=True)
def reduction_after(A: T.Buffer((T.int64(8), T.int64(16)), "float16"), B: T.Buffer((T.int64(24), T.int64(16)), "float16"), O: T.Buffer((T.int64(8),), "float32")):
    C = T.sblock_alloc_buffer((T.int64(8), T.int64(24)))
    for i, j, k in T.grid(T.int64(8), T.int64(24), T.int64(16)):
        with T.sblock("matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast("float32", B[vj, vk])
    for i, j in T.grid(T.int64(8), T.int64(24)):
        with T.sblock("rowsum"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                O[vi] = T.float32(0)
            O[vi] = O[vi] + C[vi, vj]


@T.prim_func(private=True, s_tir=True)
def output_also_read(A: T.Buffer((T.int64(8), T.int64(16)), "float16"), B: T.Buffer((T.int64(24), T.int64(16)), "float16"), C: T.Buffer((T.int64(8), T.int64(24)), "float32"), O: T.Buffer((T.int64(8), T.int64(24)), "float16")):
    for i, j, k in T.grid(T.int64(8), T.int64(24), T.int64(16)):
        with T.sblock("matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast("float32", B[vj, vk])
    for i, j in T.grid(T.int64(8), T.int64(24)):
        with T.sblock("cast"):
            vi, vj = T.axis.remap("SS", [i, j])
            O[vi, vj] = T.Cast("float16", C[vi, vj])


@T.prim_func(private=True, s_tir=True)
def elementwise_only(A: T.Buffer((T.int64(8), T.int64(16)), "float16"), O: T.Buffer((T.int64(8), T.int64(16)), "float16")):
    for i, j in T.grid(T.int64(8), T.int64(16)):
        with T.sblock("add"):
            vi, vj = T.axis.remap("SS", [i, j])
            O[vi, vj] = A[vi, vj] + T.float16(1)


def reference_body(ops: GemmOperands, a_index, b_index) -> tirx.Stmt:
    """A plain loop body computing what ``ops`` describes (A and B indexed by the test's own maps)."""

    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        for r in T.serial(ops.m):
            for c in T.serial(ops.n):
                with T.sblock("ref"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    acc[0] = T.float32(0)
                    for kk in T.serial(ops.k):
                        acc[0] = acc[0] + T.Cast("float32", ops.a[a_index(r, kk)]) * T.Cast("float32", ops.b[b_index(c, kk)])
                    ops.out.buffer[ops.out.index(r, c)] = ops.out.value(r, c, acc[0])

    return body.body
# fmt: on


def _zero():
    return T.int64(0)


CASES = {
    # name: (function, A index, B index, M of the run for each symbolic dim)
    "cast_only": (cast_only, lambda r, k: (_zero(), r, k), lambda c, k: (c, k), 37),
    "bias_silu": (bias_silu, lambda r, k: (r, k), lambda c, k: (c, k), 13),
    "nn_residual": (nn_residual, lambda r, k: (r // 11, r % 11, k), lambda c, k: (k, c), 11),
    "static_double_cast": (static_double_cast, lambda r, k: (_zero(), r, k), lambda c, k: (c, k), None),
}


def _args(func: tirx.PrimFunc, n: int | None, rng: np.random.Generator) -> list[np.ndarray]:
    args = []
    for p in func.params:
        bt = p.ty
        shape = [int(x) if isinstance(x, tirx.IntImm) else n for x in bt.shape]
        args.append((rng.standard_normal(shape) * 0.5 + 0.1).astype(str(bt.dtype)))
    return args


def _run(func: tirx.PrimFunc, args: list[np.ndarray]) -> np.ndarray:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    dev = tvm.cpu()
    tensors = [tvm.runtime.tensor(a, dev) for a in args]
    lib["main"](*tensors)
    return tensors[-1].numpy()


@pytest.mark.parametrize("name", sorted(CASES))
def test_description_computes_what_the_function_computes(name):
    func, a_index, b_index, n = CASES[name]
    desc = analyze_matmul(func)
    assert desc is not None
    ops = desc.operands
    rebuilt = tirx.PrimFunc(func.params, reference_body(ops, a_index, b_index), func.ret_type, func.attrs)
    rng = np.random.default_rng(7)
    args = _args(func, n, rng)
    expect = _run(func, [a.copy() for a in args])
    args[-1][...] = np.nan  # the rebuilt body must write every output element
    got = _run(rebuilt, args)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float64), expect.astype(np.float64), rtol=2e-3, atol=2e-3)


def test_description_fields():
    desc = analyze_matmul(bias_silu)
    assert (desc.operands.n, desc.operands.k, desc.operands.b_layout) == (40, 32, "NT")
    assert desc.epilogue_stages == ("cast", "bias", "silu") and desc.m_static is None
    assert isinstance(desc.operands.m, tirx.Var)  # symbolic M stays symbolic
    assert analyze_matmul(nn_residual).operands.b_layout == "NN"
    assert analyze_matmul(static_double_cast).m_static == 7
    assert analyze_matmul(static_double_cast).out_dtype == "float32"


@pytest.mark.parametrize(
    "func",
    [a_transposed, batched_b, float32_inputs, epilogue_reads_another_column, reduction_after,
     output_also_read, elementwise_only],
    ids=lambda f: str(f.attrs["global_symbol"]) if "global_symbol" in (f.attrs or {}) else None,
)
def test_refuses_what_it_does_not_own(func):
    assert analyze_matmul(func) is None


def test_takes_every_matmul_of_the_llama_model():
    from fuselight import pipeline as pl
    from fuselight.model.llama import export_module

    target = to_tvm(resolve("cuda", "sm_90"))
    mod = export_module(load("tiny-llama").with_dtype("float16"), target)[0]
    stages = pl.stages(target, graph_passes=pl.graph_passes(None, None), rules=pl.fuselight_rules())
    with target:
        mod = tvm.transform.Sequential([s.pass_ for s in stages if s.phase <= 3])(mod)
    # Scheduled kernels (the KV cache's) never reach the rules; fuse_norm_gemv's (a norm prologue) are
    # not the Matmul rule's.
    names = {gv.name_hint: analyze_matmul(f) for gv, f in mod.functions.items()
             if isinstance(f, tirx.PrimFunc) and "tirx.is_scheduled" not in (f.attrs or {})}
    matmuls = {n: d for n, d in names.items() if "matmul" in n}
    assert matmuls and all(d is not None for d in matmuls.values()), matmuls
    assert any(d.m_static is None for d in matmuls.values())  # prefill: M = seq_len
    # nothing but matmuls is taken
    assert all(d is None for n, d in names.items() if "matmul" not in n)
