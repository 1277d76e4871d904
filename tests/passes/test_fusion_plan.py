"""FusionPlan (analysis): the class-pair table, groups grown by it, the analytic yellow cost and its
hook, and refusals (several consumers, two many-to-many ops, packed calls, unknown dims)."""

import pytest
from fuselight.errors import FuselightError
from fuselight.passes.classify import MAPPINGS
from fuselight.passes.fusion_plan import CLASS_PAIRS, kernels, plan_fusion
from relax_module import single_function as _module
from tvm import relax, tirx
from tvm.relax import op as O

N = tirx.Var("n", "int64")


def _t(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(shape, dtype))


def _groups(mod, dims=None, **kw):
    return [g.members for g in plan_fusion(mod, {"n": 4} if dims is None else dims, **kw)["main"]]


def test_table():
    assert set(CLASS_PAIRS) == {(p, c) for p in MAPPINGS for c in MAPPINGS}
    expected = {
        ("one-to-one", "one-to-one"): "green",
        ("many-to-many", "one-to-one"): "green",  # epilogue
        ("shuffle", "many-to-many"): "green",  # a transpose folds into the matmul's indexing
        ("reorganize", "many-to-many"): "green",
        ("one-to-one", "many-to-many"): "yellow",  # prologue, recomputed per tile
        ("one-to-many", "many-to-many"): "yellow",
        ("many-to-many", "shuffle"): "yellow",
        ("many-to-many", "many-to-many"): "red",
        ("opaque", "one-to-one"): "red",
        ("one-to-one", "opaque"): "red",
    }
    for pair, color in expected.items():
        assert CLASS_PAIRS[pair] == color, pair


def _mlp(n_out=8):
    """matmul -> + bias -> silu -> matmul -> softmax: an epilogue chain, a prologue, and a red pair."""
    x, w1, b, w2 = _t("x", [N, 16]), _t("w1", [16, 16]), _t("b", [16]), _t("w2", [16, n_out])

    def make(bb, x, w1, b, w2):
        h = bb.emit(O.matmul(x, w1))
        h = bb.emit(O.add(h, b))
        s = bb.emit(O.nn.silu(h))
        y = bb.emit(O.matmul(s, w2))
        return O.nn.softmax(y)

    return _module([x, w1, b, w2], make)


def test_epilogues_before_prologues_and_red():
    # add and silu are epilogues of the first matmul (no recompute) rather than a prologue of the
    # second; the softmax may not join a matmul.
    groups = _groups(_mlp())
    assert groups == [["lv", "lv1", "lv2"], ["lv3"], ["gv"]]
    assert kernels(plan_fusion(_mlp(), {"n": 4})["main"]) == 3


def _prologue(n_out):
    """exp(x) feeding a matmul with n_out outputs per row: a prologue and nothing else."""
    x, w = _t("x", [N, 16]), _t("w", [16, n_out])
    return _module([x, w], lambda bb, x, w: O.matmul(bb.emit(O.exp(x)), w))


def test_yellow_cost_and_hook():
    # 8 outputs share each exp element: one recompute per 128-wide tile, i.e. none: fused.
    assert _groups(_prologue(8)) == [["lv", "gv"]]
    # 1M outputs: 8191 recomputes per element outweigh the 2 x 4 bytes it saves.
    assert _groups(_prologue(2**20)) == [["lv"], ["gv"]]
    seen = []

    def hook(producer, consumer, cost):
        seen.append((producer.name, consumer.name, cost.recompute_flops, cost.saved_bytes))
        return True

    assert _groups(_prologue(2**20), decide_yellow=hook) == [["lv", "gv"]]
    assert seen == [("lv", "gv", 4 * 16 * (2**20 // 128 - 1), 2 * 4 * 16 * 4)]
    # Without a value for n nothing can be decided: yellow edges stay unfused.
    assert _groups(_prologue(8), dims={}) == [["lv"], ["gv"]]


def test_shared_producer_and_two_anchors():
    x, w = _t("x", [N, 16]), _t("w", [16, 16])

    def make(bb, x, w):
        e = bb.emit(O.exp(x))
        a = bb.emit(O.matmul(e, w))
        c = bb.emit(O.add(e, e))  # a second consumer of e in another kernel
        s = bb.emit(O.sum(a, axis=[1]))  # many-to-many after many-to-many
        return relax.Tuple([c, s])

    groups = _groups(_module([x, w], make))
    assert ["lv"] in groups and ["lv1"] in groups and ["lv3"] in groups


def test_packed_call_not_fused():
    x = _t("x", [N, 16])

    def make(bb, x):
        e = bb.emit(O.exp(x))
        k = bb.emit(relax.call_dps_packed("my.kernel", [e], relax.TensorType([N, 16], "float32")))
        return O.negative(k)

    assert _groups(_module([x], make)) == [["lv"], ["lv1"], ["gv"]]


def test_tiny_llama_decode():
    from fuselight import config
    from fuselight.model.llama import export_module
    from fuselight.target import resolve, to_tvm

    cfg = config.load("tiny-llama")
    mod, _ = export_module(cfg, to_tvm(resolve("llvm")))
    groups = plan_fusion(mod, {"kv_len": 64, "seq_len": 64})["decode"]
    by_member = {m: g for g in groups for m in g.members}
    # The MLP's split is no epilogue a schedule rule can inline after the gate/up projection: split,
    # silu and multiply are one kernel. Residual adds are epilogues of the output projections; each
    # rms_norm stays its own kernel (its matmul is another many-to-many) and the attention, an
    # extern call, too.
    assert by_member["matmul11"].members == ["permute_dims11", "matmul11"]  # the weight transpose folds in
    assert by_member["silu2"].members == ["split2", "split_02", "split_12", "silu2", "mul2"]
    assert by_member["add4"].anchor == "matmul10" and by_member["add5"].anchor == "matmul12"
    assert by_member["rms_norm5"].members == ["rms_norm5"] and by_member["lv3"].members == ["lv3"]
    assert all(sum(c == "many-to-many" for c in g.classes) <= 1 for g in groups)
    layers = cfg.num_hidden_layers
    # Per layer: norm, qkv, attention, o_proj, norm, gate_up, split+silu*up, down; plus final norm and lm_head.
    assert kernels(groups) == 8 * layers + 2


def test_groups_a_schedule_rule_can_take():
    """After a many-to-many anchor only elementwise/broadcast ops (DLight inlines them into its
    output); before it, those and views. A transpose after a matmul and a split before one stay out."""
    x, w = _t("x", [N, 16]), _t("w", [16, 16])

    def after(bb, x, w):
        m = bb.emit(O.matmul(x, w))
        return O.permute_dims(bb.emit(O.exp(m)), [1, 0])

    # exp is the matmul's epilogue; the transpose after it is no epilogue a rule inlines.
    assert _groups(_module([x, w], after)) == [["lv", "lv1"], ["gv"]]

    def before(bb, x, w):
        t = bb.emit(O.permute_dims(x, [1, 0]))  # a view: folds into the matmul's loads
        s = bb.emit(O.split(t, 2, axis=0))
        a = bb.emit(O.add(bb.emit(relax.TupleGetItem(s, 0)), bb.emit(relax.TupleGetItem(s, 1))))
        return O.matmul(bb.emit(O.permute_dims(a, [1, 0])), bb.emit(O.strided_slice(w, [0], [0], [8])))

    groups = _groups(_module([x, w], before))
    assert ["lv", "lv1", "lv2", "lv3", "lv4"] in groups  # the split's kernel: its transpose and the add
    assert any("gv" in g and "lv5" in g for g in groups)  # the transpose folds into the matmul


def test_estimate_fused_never_more():
    from fuselight.passes import cost_model
    from fuselight.passes.classify import classify_module
    from fuselight.passes.fusion_plan import estimate

    mod = _mlp()
    infos = classify_module(mod)["main"]
    config = cost_model.load("sm_90")
    groups = [g.members for g in plan_fusion(mod, {"n": 4})["main"]]
    alone = estimate(mod["main"], infos, [], {"n": 4}, config)
    fused = estimate(mod["main"], infos, groups, {"n": 4}, config)
    assert (alone.kernels, fused.kernels) == (5, 3)
    # matmul -> add -> silu in one kernel: the [4, 16] float32 results of the matmul and the add
    # are neither written nor read back (4 x 4 x 16 x 4 bytes).
    assert alone.bytes - fused.bytes == 4 * 4 * 16 * 4
    assert fused.recompute_flops == 0 and fused.total(config) < alone.total(config)


def test_bad_arch():
    with pytest.raises(FuselightError, match="sm_00"):
        plan_fusion(_mlp(), {"n": 4}, arch="sm_00")
