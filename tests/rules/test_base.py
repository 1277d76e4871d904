"""rules.base's helpers for template kernels: a template written once per config (``built_once``), each
further branch a copy with definitions of its own (``fresh_definitions``)."""

from __future__ import annotations

import tvm_ffi
from fuselight.rules.base import built_once, fresh_definitions
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemm.gemv import body_config, config_for, gemv_body, load_gemv_configs
from fuselight.rules.gemv import symbolic_m_buckets
from fuselight.rules.matmul import Matmul
from fuselight.tune.gemm import matmul_prim_func
from tvm import tirx
from tvm.script import tirx as T


# As the templates write kernels: blocks without iteration variables, buffers allocated in them.
@T.prim_func(s_tir=True, check_well_formed=False)
def _scale(A: T.Buffer((13,), "float32"), n: T.int32):
    for i in range(13):
        with T.sblock("scale"):
            T.reads()
            T.writes()
            tmp = T.sblock_alloc_buffer((1,), "float32", scope="local")
            half: T.let[T.float32] = T.float32(n) * T.float32(0.5)
            tmp[0] = half
            A[i] = A[i] * tmp[0]


@T.prim_func(s_tir=True, check_well_formed=False)
def _scale_spatial(A: T.Buffer((13,), "float32"), n: T.int32):
    for i in range(13):
        with T.sblock("scale"):
            vi = T.axis.spatial(13, i)
            A[vi] = A[vi] * T.float32(n)


def _definitions(stmt: tirx.Stmt) -> list:
    found: list = []

    def visit(node) -> None:
        if isinstance(node, tirx.For):
            found.append(node.loop_var)
        elif isinstance(node, tirx.SBlock):
            found.extend([*node.alloc_buffers, *(iv.var for iv in node.iter_vars)])
        elif isinstance(node, tirx.Bind):
            found.append(node.var)

    tirx.stmt_functor.post_order_visit(stmt, visit)
    return found


def test_fresh_definitions_copies_a_statement_with_new_definitions_and_the_same_free_variables():
    body = _scale.body
    copy = fresh_definitions(body)
    assert tvm_ffi.structural_equal(copy, body)  # free variables compared as the same objects
    ours, theirs = _definitions(copy), _definitions(body)
    assert len(ours) == len(theirs) == 3  # the loop variable, the local buffer, the let variable
    assert not any(a.same_as(b) for a in ours for b in theirs)
    free = {v.name: v for v in tirx.analysis.undefined_vars(copy, [])}
    assert sorted(free) == ["A", "n"]
    assert free["A"].same_as(_scale.params[0]) and free["n"].same_as(_scale.params[1])
    # Both in one function: each defined once, as TVM requires.
    assert tirx.analysis.verify_well_formed(_scale.with_body(tirx.SeqStmt([body, copy])), assert_mode=False)
    assert not tirx.analysis.verify_well_formed(_scale.with_body(tirx.SeqStmt([body, body])), assert_mode=False)


def test_built_once_builds_each_config_once():
    built: list[int] = []

    def build(config: int) -> tirx.Stmt:
        built.append(config)
        return _scale.body

    body = built_once(build)
    first, again, other = body(3), body(3), body(5)
    assert built == [3, 5]
    assert first.same_as(_scale.body) and not again.same_as(first)
    assert tvm_ffi.structural_equal(again, first) and other.same_as(_scale.body)


def _leaves(stmt: tirx.Stmt) -> list[tirx.Stmt]:
    if isinstance(stmt, tirx.IfThenElse):
        return _leaves(stmt.then_case) + ([] if stmt.else_case is None else _leaves(stmt.else_case))
    return [stmt]


def test_matmul_rule_branches_are_the_templates_each_written_alone(cuda):
    # Llama's o_proj: the GEMV buckets for M <= 2, 4 and 8 write one mma template body (one token
    # tile), so they are one branch (M <= 8); two wgmma plans serve two ranges each: built once,
    # copied for the others.
    func = matmul_prim_func(4096, 4096, "float16").with_attr("target", cuda)
    scheduled = Matmul().apply(func, cuda, False).mod["main"]
    assert tirx.analysis.verify_well_formed(scheduled, assert_mode=False)  # nothing defined twice
    chain = scheduled.body.block.body  # root block > if M > 0 > the chain on M
    leaves = _leaves(chain.then_case)
    ops = analyze_matmul(func, dequant=True).operands
    buckets = symbolic_m_buckets(ops, cuda)
    configs = load_gemv_configs("sm_90")
    assert [b[0] for b in buckets] == [1, 8, 16] and len(leaves) == 10
    assert [c.max_m for c in configs if c.max_blocks is None and c.max_k is None] == [1, 2, 4, 8, 16]
    for m in (2, 4):  # the buckets folded into M <= 8 write its kernel
        assert tvm_ffi.structural_equal(gemv_body(ops, body_config(ops, config_for(configs, m))), leaves[1])
    for leaf, (_, cfg) in zip(leaves, buckets):
        assert tvm_ffi.structural_equal(leaf, gemv_body(ops, body_config(ops, cfg)))
    assert not tvm_ffi.structural_equal(leaves[1], leaves[2])  # two token tiles at M <= 16


def test_fresh_definitions_renews_block_iteration_variables():
    body = _scale_spatial.body
    copy = fresh_definitions(body)
    assert tvm_ffi.structural_equal(copy, body)
    ours, theirs = _definitions(copy), _definitions(body)
    assert len(ours) == len(theirs) == 2  # the loop variable and the block's vi
    assert not any(a.same_as(b) for a in ours for b in theirs)
    assert tirx.analysis.verify_well_formed(_scale_spatial.with_body(tirx.SeqStmt([body, copy])), assert_mode=False)
