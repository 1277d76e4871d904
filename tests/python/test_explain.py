"""``fuselight explain``: the JSON report of our tiny LLaMA and of the zoo's transformer layers
(pipelines compared), the text tables, bad input."""

import json

from fuselight.cli import main


def test_explain_json(capsys):
    assert main(["explain", "--model", "tiny-llama", "--json", "--prompt-len", "37"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("model", "functions", "rewrites_available", "rewrites_applied", "after_rewrite", "weight_transforms",
                "groups", "groups_skipped", "untouched", "pipelines"):  # fmt: skip
        assert key in report, key
    assert report["model"] == "tiny-llama"
    _check_pipelines(report)
    # The groups the fuselight pipeline lowered, e.g. an output projection with its residual add.
    decode_groups = [g for g in report["groups"] if g["function"] == "decode"]
    assert all(len(g["members"]) > 1 and len(g["classes"]) == len(g["members"]) and g["fused"] for g in report["groups"])
    assert any(g["classes"][-2:] == ["many-to-many", "one-to-one"] for g in decode_groups)
    assert report["groups_skipped"] == [] and report["untouched"] == []
    assert report["after_rewrite"]["decode"]["planned_kernels"] < report["after_rewrite"]["decode"]["operators"]
    available = report["rewrites_available"]
    assert len(available) >= 15 and all(set(r) == {"name", "law", "precision"} for r in available)
    # Our model's only rewrites: the two reshape pairs around attention, per layer and entry point
    # (prefill, decode, and decode_attend, which holds every layer's attention too).
    assert report["rewrites_applied"] == [{"name": "reshape_reshape", "count": 12}]
    assert report["rewrites_refused"] == []
    names = [r["name"] for r in available]
    assert "merge_sibling_matmuls" in names and "fold_norm_weight" in names
    # Not applied (they change the weights): where they would apply. qkv and gate_up are fused already;
    # every norm feeds linear layers but prefill's final one (it goes through the last-position gather):
    # 2 a layer and the final one in prefill and decode, and once more split over decode_attend and
    # decode_greedy.
    assert report["weight_transforms"] == [
        {"name": "merge_sibling_matmuls", "count": 0},
        {"name": "fold_norm_weight", "count": 4 * 2 + 1 + 2 * 2 + 1},
    ]
    for name in ("prefill", "decode"):
        after, before = report["after_rewrite"][name], report["functions"][name]
        assert after["operators"] == len(before["operators"]) - 4, name
        assert (after["est_flops"], after["est_bytes"]) == (before["est_flops"], before["est_bytes"]), name
    functions = report["functions"]
    assert list(functions) == ["embed", "prefill", "decode"]
    for name, fn in functions.items():
        assert sum(fn["counts"].values()) == len(fn["operators"]) > 0, name
        assert fn["est_flops"] is not None and fn["est_bytes"] > 0, name
        assert fn["counts"]["opaque"] == 0, name
        assert fn["est_bytes"] == sum(op["est_bytes"] for op in fn["operators"]), name
    assert functions["prefill"]["evaluated_at"] == {"seq_len": 37, "kv_len": 37}
    assert functions["decode"]["evaluated_at"] == {"kv_len": 37}
    # Two layers: 4 matmuls each plus lm_head; 2 RMSNorms each plus the final one; 2 attentions.
    assert functions["decode"]["counts"]["many-to-many"] == 9 + 5 + 2
    # Prefill runs 37 tokens through the layers where decode runs one.
    assert functions["prefill"]["est_flops"] > 30 * functions["decode"]["est_flops"]
    matmul = next(op for op in functions["prefill"]["operators"] if op["op"] == "relax.matmul")
    assert matmul["shape"][1] == "seq_len" and "seq_len" in matmul["flops"]
    assert matmul["est_flops"] == 2 * 37 * 128 * 256  # tiny-llama's fused qkv: hidden 128 -> 256


FIELDS = ("operators", "kernels", "launches_per_decode_step", "est_bytes_per_decode_step")


def _check_pipelines(report):
    pipelines = report["pipelines"]
    assert set(pipelines) == {"baseline", "fuselight", "fuselight_without_fusion_plan", "graph_passes_only"}
    for name, counts in pipelines.items():
        assert all(isinstance(counts[f], int) and counts[f] > 0 for f in FIELDS), name
    base, ours, unplanned = pipelines["baseline"], pipelines["fuselight"], pipelines["fuselight_without_fusion_plan"]
    alone = pipelines["graph_passes_only"]
    assert "fusion_plan" in ours["passes"] and "fusion_plan" not in unplanned["passes"]
    assert alone["passes"] == ["property_rewrite", "fusion_plan"] and alone["groups"]
    assert ours["launches_per_decode_step"] <= min(base["launches_per_decode_step"], unplanned["launches_per_decode_step"])
    assert ours["est_bytes_per_decode_step"] <= unplanned["est_bytes_per_decode_step"] <= base["est_bytes_per_decode_step"]
    assert ours["kernels"] <= unplanned["kernels"]
    assert alone["launches_per_decode_step"] <= base["launches_per_decode_step"]
    assert alone["est_bytes_per_decode_step"] <= base["est_bytes_per_decode_step"]


def test_explain_graphs(capsys):
    for graph in ("bert-encoder", "vit-block"):
        assert main(["explain", "--graph", graph, "--json", "--prompt-len", "197"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["model"] == graph and list(report["functions"]) == ["forward"]
        _check_pipelines(report)
        base, ours = report["pipelines"]["baseline"], report["pipelines"]["fuselight"]
        alone = report["pipelines"]["graph_passes_only"]
        assert ours["launches_per_decode_step"] < base["launches_per_decode_step"], graph
        assert alone["launches_per_decode_step"] < base["launches_per_decode_step"], graph
        assert alone["est_bytes_per_decode_step"] < base["est_bytes_per_decode_step"], graph
        # Without an attention kernel, the head transposes fold into the attention matmuls' loads.
        assert any(g["classes"][:2] == ["shuffle", "many-to-many"] for g in alone["groups"]), graph
        assert report["untouched"] == [] and report["groups_skipped"] == []
        assert report["rewrites_applied"], graph  # e.g. the head transposes' permute pair
    assert main(["explain", "--graph", "gpt-99"]) == 2
    assert "gpt-99" in capsys.readouterr().err
    assert main(["explain", "--graph", "vit-block", "--model", "tiny-llama"]) == 2
    assert "either --model or --graph" in capsys.readouterr().err


def test_explain_text(capsys):
    assert main(["explain", "--model", "tiny-llama"]) == 0
    out = capsys.readouterr().out
    assert "decode  [kv_len=128]" in out and "relax.nn.rms_norm" in out and "many-to-many" in out
    assert "applied: reshape_reshape x12" in out
    assert "fuselight_without_fusion_plan" in out and "fusion groups lowered:" in out


def test_explain_bad_input(capsys):
    assert main(["explain", "--model", "llama-99b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "llama-99b" in err
    assert main(["explain", "--model", "tiny-llama", "--prompt-len", "0"]) == 2
    assert "prompt-len" in capsys.readouterr().err


def test_a_fused_chain_of_reshapes_counts_as_a_view_and_arithmetic_does_not():
    from tvm import te, topi

    from fuselight.explain import _is_view

    x = te.placeholder((4, 6), "float32", name="x")
    chain = topi.reshape(topi.reshape(x, (2, 12)), (24,))
    assert _is_view(te.create_prim_func([x, chain]))  # what FuseOps makes of a reshape pair
    scaled = topi.reshape(topi.multiply(x, 2.0), (24,))
    assert not _is_view(te.create_prim_func([x, scaled]))
