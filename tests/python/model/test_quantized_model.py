"""Our LLaMA with 4-bit weights (``fuselight.quantization``'s schemes, MLC-LLM's formats): its
numerics on the CPU against the float64 reference of the dequantized weights, and the check that no
kernel of a GPU build writes a dequantized weight to memory."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from conftest import compare_with_reference  # noqa: E402
from fuselight import config, mlc  # noqa: E402
from fuselight import pipeline as pl  # noqa: E402
from fuselight.compile import build  # noqa: E402
from fuselight.model.llama import export_module  # noqa: E402
from fuselight.model.weights import dequantize_weights, hf_config, random_weights  # noqa: E402
from fuselight.passes.weight_source import materialized_weights  # noqa: E402
from fuselight.quantization import SCHEMES, dequantize, random_quantized, te_dequantize  # noqa: E402
from fuselight.target import resolve, to_tvm  # noqa: E402
from tvm import relax, te  # noqa: E402

DECODE_STEPS = 4
# float16 weights and activations against float64 (the weights themselves exact in both).
TOLERANCE = {"baseline": 1e-2, "fuselight": 5e-3}


def tiny(scheme: str, **changes) -> config.ModelConfig:
    """tiny-llama with an intermediate size of whole groups (its 344 is not a multiple of 32)."""
    raw = {**hf_config(config.load("tiny-llama")), "intermediate_size": 352, **changes}
    return config.from_dict(raw, name="tiny-q").with_quantization(scheme)


def small_gpu(scheme: str) -> config.ModelConfig:
    """Two layers at hidden 1024, so FuseAddRMSNorm and fuse_norm_gemv apply on GPUs."""
    return tiny(scheme, hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
                head_dim=128, vocab_size=2000)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_te_dequantize_is_the_numpy_dequantize(name):
    s = SCHEMES[name]
    n, k = 24, 3 * s.group_size
    from fuselight.model.weights import numpy_dtype

    stored = tuple(a if dtype == "uint32" else a.astype(numpy_dtype(dtype)) for a, dtype in
                   zip(random_quantized(np.random.default_rng(1), n, k, 0.05, s), s.packed_dtypes()))
    tensors = tuple(te.placeholder(a.shape, dtype, name=f"p{i}") for i, (a, dtype) in enumerate(zip(stored, s.packed_dtypes())))
    w = te_dequantize(tensors, s)
    func = tvm.compile(te.create_prim_func([*tensors, w]), target="llvm")
    out = tvm.runtime.empty(tuple(int(d) for d in w.shape), s.model_dtype, tvm.cpu())
    func(*(tvm.runtime.tensor(a) for a in stored), out)
    got = out.numpy().astype(np.float64)
    want = dequantize(stored, s)  # float64, [N, K]
    want = want if s.layout == "NK" else want.T
    # One rounding of an exact product in both: (q - zero) * scale in the model dtype.
    np.testing.assert_array_equal(got, want.astype(numpy_dtype(s.model_dtype)).astype(np.float64))
    assert np.count_nonzero(got) > got.size // 2


def test_random_weights_have_the_float_init_std():
    cfg = tiny("q4f16_1")
    params = random_weights(cfg, seed=3)
    dense = dequantize_weights(cfg, params)
    w = dense["model.layers.0.mlp.down_proj.weight"]
    assert params["model.layers.0.mlp.down_proj.q_weight"].dtype == np.uint32
    from fuselight.model.weights import init_std

    assert abs(np.sqrt(np.mean(w**2)) / init_std("model.layers.0.mlp.down_proj.weight", cfg) - 1) < 0.05
    assert list(params) == list(cfg.weight_shapes())
    assert all(tuple(params[n].shape) == s for n, s in cfg.weight_shapes().items())


@pytest.mark.parametrize("pipeline", ["baseline", "fuselight"])
@pytest.mark.parametrize("scheme", ["q4f16_1", "q4f16_0", "q4f16_autoawq"])
def test_quantized_model_matches_reference_of_its_weights(pipeline, scheme):
    cfg = tiny(scheme, intermediate_size=384) if SCHEMES[scheme].group_size == 128 else tiny(scheme)
    built = build(cfg, resolve("llvm"), pipeline)
    vm = relax.VirtualMachine(built.executable, tvm.cpu())
    seed = 17 + len(pipeline) + (int(scheme[-1]) if scheme[-1].isdigit() else 2)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, 21)
    decode_ids = [int(t) for t in rng.integers(0, cfg.vocab_size, DECODE_STEPS)]
    errors = compare_with_reference(vm, tvm.cpu(), cfg, random_weights(cfg, seed=seed), prompt, decode_ids,
                                    max_total_seq_len=64, prefill_chunk_size=16)
    assert len(errors) == 1 + DECODE_STEPS
    assert max(errors) < TOLERANCE[pipeline], errors


def _through_phase_3(cfg: config.ModelConfig, target: tvm.target.Target, pipeline: str,
                     skip: str | None = None) -> tvm.IRModule:
    graph = {"graph_passes": pl.graph_passes(None, None), "rules": pl.fuselight_rules()} if pipeline == "fuselight" else {}
    mod, _ = export_module(cfg, target)
    with target:
        for stage in pl.stages(target, use_mlc=False, **graph):
            if stage.phase > 3:
                break
            if stage.name != skip:
                mod = stage.pass_(mod)
    return mod


@pytest.mark.parametrize("pipeline", ["fuselight", "baseline"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_no_kernel_writes_a_dequantized_weight_on_sm90(pipeline, scheme):
    target = to_tvm(resolve("cuda", "sm_90"))
    mod = _through_phase_3(small_gpu(scheme), target, pipeline)
    assert materialized_weights(mod) == []
    # Every linear layer and the embedding still read packed words: the check above sees them.
    packed = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)
              and any(str(p.ty.dtype) == "uint32" for p in f.params if isinstance(p.ty, tvm.tirx.BufferType))]
    assert len(packed) >= 5


def test_a_kn_decode_step_launches_what_an_nk_one_does_on_sm90():
    # q4f16_0 (KN) takes the same fusions as q4f16_1 at M = 1: each norm computed in the GEMV after
    # it, gate+up's SiLU-mul its epilogue; prefill (symbolic rows) keeps the baseline's functions.
    target = to_tvm(resolve("cuda", "sm_90"))
    calls = {}
    for scheme in ("q4f16_1", "q4f16_0"):
        mod = _through_phase_3(small_gpu(scheme), target, "fuselight")
        calls[scheme] = {fn: _called(mod[fn]) for fn in ("decode", "prefill")}
    layers = small_gpu("q4f16_0").num_hidden_layers
    for fn in ("decode", "prefill"):
        assert len(calls["q4f16_0"][fn]) == len(calls["q4f16_1"][fn])
    decode = calls["q4f16_0"]["decode"]
    assert sum(n.startswith("fused_rms_norm_gemv") for n in decode) == 2 * layers + 1
    assert not [n for n in decode if "norm" in n and not n.startswith("fused_rms_norm_gemv") or "silu" in n]
    assert not [n for n in calls["q4f16_0"]["prefill"] if n.startswith("fused_rms_norm_gemv")]


def _called(func: relax.Function) -> list[str]:
    names: list[str] = []
    call_tir = tvm.ir.Op.get("relax.call_tir")
    relax.analysis.post_order_visit(
        func, lambda e: names.append(e.args[0].name_hint) if isinstance(e, relax.Call) and e.op == call_tir else None)
    return names


def test_the_check_sees_an_unfused_dequantize():
    # Guards the test above: without FuseDequantizeMatmulEwise every linear layer's weight is written.
    target = to_tvm(resolve("cuda", "sm_90"))
    found = materialized_weights(_through_phase_3(small_gpu("q4f16_1"), target, "fuselight",
                                                  skip="FuseDequantizeMatmulEwise"))
    assert {m.function for m in found} >= {"prefill", "decode"}


def test_embedding_dequantizes_only_the_gathered_rows():
    mod = _through_phase_3(tiny("q4f16_1"), to_tvm(resolve("llvm")), "baseline")
    take = [f for gv, f in mod.functions.items() if "take" in gv.name_hint and isinstance(f, tvm.tirx.PrimFunc)]
    assert len(take) == 1
    blocks = []
    tvm.tirx.stmt_functor.post_order_visit(
        take[0].body, lambda n: blocks.append(n.name_hint) if isinstance(n, tvm.tirx.SBlock) else None)
    assert "dequantize" not in blocks  # inlined into the gather


@pytest.mark.parametrize("scheme", ["q4f16_1", "q4f16_0"])
def test_our_passes_merge_what_mlc_merges(scheme):
    if mlc.import_mlc_llm() is None:
        pytest.skip(f"MLC-LLM not available (install mlc_llm or set {mlc.SOURCE_ENV})")
    target = to_tvm(resolve("cuda", "sm_90"))
    cfg = tiny(scheme)

    def phase_3(use_mlc: bool) -> tvm.IRModule:
        mod, _ = export_module(cfg, target)
        with target:
            for stage in pl.stages(target, use_mlc=use_mlc):
                if stage.phase > 3:
                    break
                mod = stage.pass_(mod)
        return mod

    ours, theirs = phase_3(False), phase_3(True)

    for fn in ("embed", "prefill", "decode"):
        assert _called(ours[fn]) == _called(theirs[fn])
    import tvm_ffi

    name = next(gv.name_hint for gv in ours.functions if "take" in gv.name_hint)
    assert tvm_ffi.structural_equal(ours[name], theirs[name])


def test_loading_a_float_checkpoint_quantizes_it(tmp_path):
    from fuselight.model.weights import load_hf_checkpoint, save_hf_checkpoint

    cfg = tiny("q4f16_0")
    dense_cfg = cfg.with_quantization(None)
    dense = {n: w.astype(np.float32) for n, w in random_weights(dense_cfg, seed=9, dtype="float32").items()}
    save_hf_checkpoint(tmp_path, dense_cfg, dense)
    params = load_hf_checkpoint(tmp_path, cfg)
    assert list(params) == list(cfg.weight_shapes())
    assert params["lm_head.q_weight"].dtype == np.uint32 and params["lm_head.q_scale"].dtype == np.float16
    back = dequantize_weights(cfg, params)
    for name, w in dense.items():
        if name.endswith("norm.weight"):
            np.testing.assert_array_equal(back[name], w.astype(np.float16))
            continue
        # Within half a quantization step of the group (its largest magnitude / 7), and the scales
        # rounded to float16.
        groups = np.abs(w).reshape(w.shape[0], -1, 32).max(-1) / 7
        step = np.repeat(groups, 32, axis=1)
        assert np.all(np.abs(back[name] - w) <= step * (0.5 + 8 * 2**-11) + 1e-7), name
