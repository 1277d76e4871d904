"""ApplyFusionPlan: planned groups outlined as Primitive functions, one PrimFunc each after FuseTIR,
layout changes folded, same results on the CPU; where it sits in the pipeline; what it leaves alone
(an op it can't classify, a dynamic-rank tensor, a graph fused already, a group it can't build) and
that ``explain`` says so."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from fuselight import pipeline as pl
from fuselight.explain import explain_module
from fuselight.passes import ApplyFusionPlan, cost_model
from fuselight.passes.apply_fusion_plan import PRIMITIVE_ATTR
from fuselight.passes.classify import classify_module
from fuselight.errors import FuselightError
from fuselight.passes.fusion_plan import Estimate, estimate, plan_fusion
from fuselight.relax_rewrite import module_with_unique_binding_names
from fuselight.target import resolve, to_tvm
from relax_module import single_function as _module
from tvm import relax, tirx
from tvm.relax import op as O

N = tirx.Var("n", "int64")


def _t(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(shape, dtype))


def _layer():
    """x [n, 16] -> exp -> matmul with a transposed weight -> + bias -> transpose -> relu, and the
    exp and bias-added results as outputs too: a prologue, a folded weight transpose, an epilogue, a
    group with two outputs, and a transpose no schedule rule inlines after a matmul."""
    x, w, b = _t("x", [N, 16]), _t("w", [8, 16]), _t("b", [8])

    def make(bb, x, w, b):
        e = bb.emit(O.exp(x))
        m = bb.emit(O.matmul(e, bb.emit(O.permute_dims(w, [1, 0]))))
        a = bb.emit(O.add(m, b))
        r = bb.emit(O.nn.relu(bb.emit(O.permute_dims(a, [1, 0]))))
        return relax.Tuple([r, a, e])

    return _module([x, w, b], make)


def _primitive(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, relax.Function) and f.attrs is not None and PRIMITIVE_ATTR in f.attrs}


def _fuse(mod):
    seq = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    return tvm.transform.Sequential(seq)(mod)


def _called_prims(mod):
    calls = []
    relax.analysis.post_order_visit(
        mod["main"].body,
        lambda e: calls.append(e.args[0].name_hint) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_tir" else None,
    )
    return calls


def _run(mod, args):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return [o.numpy() for o in out]  # _layer returns a tuple


def test_groups_become_one_primfunc_each_and_compute_the_same():
    mod = _layer()
    p = ApplyFusionPlan({"n": 4})
    lowered = p(mod)
    assert p.skipped == []
    assert [(g.members, g.classes) for g in p.applied] == [
        (["lv", "lv1", "lv2", "lv3"], ["one-to-one", "shuffle", "many-to-many", "one-to-one"]),
        (["lv4", "lv5"], ["shuffle", "one-to-one"]),
    ]
    prims = _primitive(lowered)
    assert sorted(prims) == sorted(g.fused for g in p.applied)
    assert len(prims[p.applied[0].fused].ret_ty.fields) == 2  # exp and the bias-added result
    # FuseOps leaves the outlined groups alone; FuseTIR makes each one PrimFunc. The weight transpose
    # is indexing inside the matmul's PrimFunc, not a copy of its own.
    fused = _fuse(lowered)
    assert sorted(_called_prims(fused)) == sorted(g.fused for g in p.applied)
    assert not any("transpose" == name for name in _called_prims(fused))
    rng = np.random.default_rng(0)
    args = [rng.uniform(-1, 1, s).astype("float32") for s in ((5, 16), (8, 16), (8,))]
    outs, refs = _run(lowered, args), _run(mod, args)
    assert len(outs) == len(refs) == 3
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape and np.abs(ref).max() > 0.1
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_pipeline_slot():
    cuda = to_tvm(resolve("cuda", "sm_90"))
    names = [s.name for s in pl.stages(cuda, use_mlc=False, graph_passes=["fusion_plan"])]
    assert names.index("fusion_plan") + 1 == names.index("LegalizeOps")
    assert "fusion_plan" not in [s.name for s in pl.stages(cuda, use_mlc=False)]
    assert next(s.phase for s in pl.stages(cuda, use_mlc=False, graph_passes=["fusion_plan"]) if s.name == "fusion_plan") == 2


def _unchanged(mod):
    p = ApplyFusionPlan({"n": 4})
    out = p(mod)
    assert tvm_ffi.structural_equal(out, mod), out
    assert p.applied == [] and p.skipped == []  # nothing planned, not just skipped
    return p


def _untouched(mod):
    return explain_module(mod, ["main"], 4)["untouched"]


def test_op_it_cannot_classify_stays_alone():
    x = _t("x", [N, 16])

    def make(bb, x):
        e = bb.emit(O.exp(x))
        s = bb.emit(O.sort(e, axis=1))  # not in the classifier's table: opaque
        k = bb.emit(relax.call_dps_packed("my.kernel", [s], relax.TensorType([N, 16], "float32")))
        return O.negative(k)

    mod = _module([x], make)
    _unchanged(mod)
    untouched = _untouched(mod)
    assert {(u["binding"], u["op"]) for u in untouched} == {("lv1", "relax.sort"), ("lv2", "call_dps_packed:my.kernel")}
    assert all("not classified" in u["reason"] for u in untouched)


def test_dynamic_rank_stays_alone():
    x = relax.Var("x", relax.TensorType(ndim=-1, dtype="float32"))
    mod = _module([x], lambda bb, x: O.negative(bb.emit(O.exp(x))))
    _unchanged(mod)
    untouched = _untouched(mod)
    assert [u["binding"] for u in untouched] == ["lv", "gv"]
    assert all("unknown shape or rank" in u["reason"] for u in untouched)


def test_graph_fused_by_another_pipeline_stays_alone():
    fused = relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(_layer())))
    _unchanged(fused)
    untouched = _untouched(fused)
    primitive = sorted(_primitive(fused))
    assert sorted(u["function"] for u in untouched if "binding" not in u) == primitive
    assert all("already fused" in u["reason"] for u in untouched if "binding" not in u)
    calls = [u for u in untouched if "binding" in u]
    assert calls and all(u["op"].startswith("call:fused_") for u in calls)


def test_group_it_cannot_build_is_skipped_and_said():
    """zeros([m, 16]) + c: m comes from a shape argument, which an outlined function would not take."""
    m = tirx.Var("m", "int64")
    shape = relax.Var("s", relax.ShapeType([m, 16]))

    def make(bb, s):
        z = bb.emit(O.zeros(relax.ShapeExpr([m, 16]), "float32"))
        return O.add(z, relax.const(np.arange(16, dtype="float32")))

    mod = _module([shape], make)
    p = ApplyFusionPlan({"m": 4})
    out = p(mod)
    assert tvm_ffi.structural_equal(out, mod)
    assert [(g.members, g.reason) for g in p.skipped] == [(["lv", "gv"], "uses a symbolic dim its inputs do not define")]


def test_transformer_layers_same_results_on_cpu():
    """The zoo's BERT and ViT layers (float32, as the CPU runs them) after PropertyRewrite and the
    lowered plan compute what they did: compiled with TVM's default CPU pipeline, FuseTIR merging
    the outlined groups."""
    import dataclasses

    from fuselight.model import zoo
    from fuselight.passes import PropertyRewrite

    rng = np.random.default_rng(2)
    for name in ("bert-encoder", "vit-block"):
        config = dataclasses.replace(zoo.load(name), dtype="float32")
        mod = zoo.export_module(config)
        p = ApplyFusionPlan({"seq_len": 8})
        lowered = p(PropertyRewrite()(mod))
        assert len(p.applied) >= 4 and p.skipped == [], name
        seq = 8 if isinstance(config.seq_len, str) else config.seq_len
        args = [rng.standard_normal([1, seq, config.hidden_size]).astype("float32")]
        args += [(rng.standard_normal([int(d) for d in q.ty.shape.values]) * 0.05).astype("float32") for q in mod["forward"].params[1:]]
        tensors = [tvm.runtime.tensor(a) for a in args]
        out, ref = (relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())["forward"](*tensors).numpy() for m in (lowered, mod))
        assert np.abs(ref).max() > 0.1
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4, err_msg=name)


def test_group_with_unused_result_is_skipped():
    x = _t("x", [N, 16])

    def make(bb, x):
        bb.emit(O.negative(bb.emit(O.exp(x))))  # dead: nothing reads it
        return O.sigmoid(x)

    p = ApplyFusionPlan({"n": 4})
    p(_module([x], make))
    assert [(g.members, g.reason) for g in p.skipped] == [(["lv", "lv1"], "its result is unused")]


def test_a_groups_parameters_follow_its_calls_reads_so_a_matmuls_operands_come_first():
    # A decode step's down projection after the fused norm GEMV: x + r comes out of a two-output
    # kernel as a tuple field the group takes in, and is read after the matmul. The matmul's
    # operands lead the outlined function's parameters (MLC-LLM's FuseDequantizeMatmulEwise looks
    # for the dequantized weight second), whatever order the fields were taken in.
    from fuselight.baseline.fuse_transpose_matmul import nt_matmul
    from q4_dequantize import dequantize
    from tvm import te

    k = 64

    def two_out(x, r):
        total = te.compute(x.shape, lambda *i: x(*i) + r(*i), name="total")
        return [te.compute(x.shape, lambda *i: total(*i) * tirx.const(2, "float16"), name="y"), total]

    params = [_t("x", [1, 1, k], "float16"), _t("r", [1, 1, k], "float16"), _t("q", [k, k // 8], "uint32"),
              _t("s", [k, k // 32], "float16")]

    def make(bb, x, r, q, s):
        pair = bb.emit_te(two_out, x, r, primfunc_name_hint="two_outputs")
        total = bb.emit(relax.TupleGetItem(pair, 1))  # taken first, read last
        y = bb.emit(relax.TupleGetItem(pair, 0))
        w = bb.emit_te(dequantize, q, s, primfunc_name_hint="dequantize")
        mm = bb.emit_te(lambda a, b: nt_matmul(a, b, "float32"), y, w, primfunc_name_hint="NT_matmul")
        return bb.emit(O.add(bb.emit(O.astype(mm, "float16")), total))

    mod = _module(params, make)
    gv = mod.get_global_var("two_outputs")
    mod[gv] = mod[gv].with_attr("op_pattern", 8)  # opaque, as the fused norm GEMV is
    plan = ApplyFusionPlan({})
    lowered = plan(mod)
    bindings = lowered["main"].body.blocks[0].bindings
    group = next(g for g in plan.applied if "NT_matmul" in g.fused)
    call = next(b.value for b in bindings if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.GlobalVar)
                and b.value.op.name_hint == group.fused)
    y = next(b.var for b in bindings if isinstance(b.value, relax.TupleGetItem) and b.value.index == 0)
    w = next(b.var for b in bindings if isinstance(b.value, relax.Call) and len(b.value.args) > 1
             and isinstance(b.value.args[0], tvm.ir.GlobalVar) and b.value.args[0].name_hint == "dequantize")
    pair = next(b.var for b in bindings if isinstance(b.value, relax.Call) and len(b.value.args) > 1
                and isinstance(b.value.args[0], tvm.ir.GlobalVar) and b.value.args[0].name_hint == "two_outputs")
    assert [a.same_as(v) for a, v in zip(call.args, (y, w, pair))] == [True, True, True]
    # After FuseTIR the PrimFunc reads them in that order: x, then the weight (its dequantize fused later).
    fused = _fuse(lowered)
    kernel_call = next(b.value for b in fused["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)
                       and isinstance(b.value.args[0], tvm.ir.GlobalVar) and b.value.args[0].name_hint.startswith("fused_")
                       and "NT_matmul" in b.value.args[0].name_hint)
    assert [str(a.ty.dtype) for a in kernel_call.args[1].fields][:2] == ["float16", "float16"]
    assert [int(d) for d in kernel_call.args[1].fields[1].ty.shape.values] == [k, k]


def _binds_lv_twice() -> relax.Function:
    """exp(exp(a)) over a [1, 8] float32, both bindings named ``lv`` (as a BlockBuilder may name them)."""
    a = _t("a", [1, 8])
    bb = relax.BlockBuilder()
    first, second = relax.DataflowVar("lv", a.ty), relax.DataflowVar("lv", a.ty)
    out = relax.Var("gv", a.ty)
    block = relax.DataflowBlock([relax.VarBinding(first, bb.normalize(O.exp(a))),
                                 relax.VarBinding(second, bb.normalize(O.exp(first))), relax.VarBinding(out, second)])
    return relax.Function([a], relax.SeqExpr([block], out), a.ty)


def test_groups_name_the_functions_own_bindings_beside_one_that_repeats_names():
    """Issue 28 (the property test, hypothesis seed 757358387). Its minimal graph: x [1, 8] float32,
    x*x + x*x, which PropertyRewrite's factor_common turns into ``lv = x + x; gv = x * lv``, beside
    other graphs of the same module, one of which binds a name twice. ApplyFusionPlan renamed every
    binding of the module to make names unique, so ``applied`` named ``lv_2``, ``gv_1``: bindings
    ``main`` does not have, and the estimate of ``main`` with those groups was the unfused one. Only
    a function's own repeats need new names (the plan is per function).

    By hand, 4-byte floats, [1, 8] tensors of 32 bytes: one kernel reads x and writes gv, 64 bytes;
    unfused, x + x reads x once and writes lv (64), x * lv reads both and writes gv (96): 160."""
    x = _t("x", [1, 8])

    def make(bb, x):
        return O.multiply(x, bb.emit(O.add(x, x)))

    mod = _module([x], make)
    mod[tvm.ir.GlobalVar("before")] = _binds_lv_twice()  # sorts before main
    plan = ApplyFusionPlan({}, "sm_90")
    plan(mod)
    groups = [g.members for g in plan.applied if g.function == "main"]
    config = cost_model.load("sm_90")
    infos = classify_module(mod)["main"]
    assert estimate(mod["main"], infos, groups, {}, config) == Estimate(kernels=1, bytes=64, recompute_flops=0)
    assert estimate(mod["main"], infos, [], {}, config) == Estimate(kernels=2, bytes=160, recompute_flops=0)
    assert groups == [["lv", "gv"]]


def test_plan_refuses_a_function_that_repeats_a_name():
    # The plan names bindings by their vars: a function binding "lv" twice would get groups that name
    # the wrong one, so plan_fusion says so; ApplyFusionPlan (and `fuselight explain`) rename first.
    mod = tvm.IRModule({tvm.ir.GlobalVar("twice"): _binds_lv_twice()})
    with pytest.raises(FuselightError, match="'twice' binds 'lv' twice"):
        plan_fusion(mod, {}, "sm_90")
    renamed = module_with_unique_binding_names(mod)
    assert [b.var.name for b in renamed["twice"].body.blocks[0].bindings] == ["lv", "lv_1", "gv"]
    assert set(plan_fusion(renamed, {}, "sm_90")) == {"twice"}
