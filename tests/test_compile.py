"""`fuselight compile` end to end (CUDA with ahead-of-time cubins) and the demo (the README's main job)."""

import json
import shutil

import pytest
from fuselight import compile as fc
from fuselight import library
from fuselight.cli import main
from fuselight.config import load
from fuselight.errors import FuselightError
from fuselight.target import resolve

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


@needs_nvcc
def test_compile_tiny_for_sm90_with_aot_cubins(tmp_path, capsys):
    lib = tmp_path / "tiny.so"
    argv = ["compile", "--model", "tiny-llama", "--target", "cuda", "--arch", "sm_90", "--dtype", "float16"]
    assert main([*argv, "--pipeline", "fuselight", "-o", str(lib)]) == 0
    assert "launches/decode-step=" in capsys.readouterr().out
    meta = json.loads(library.metadata_path(lib).read_text())
    assert (meta["target"], meta["arch"], meta["pipeline"]) == ("cuda", "sm_90", "fuselight")
    assert meta["model"]["dtype"] == "float16" and meta["model"]["name"] == "tiny-llama"
    assert meta["cuda_sources"], "no CUDA source was compiled ahead of time"
    for name in meta["cuda_sources"].values():
        assert (library.aot_dir(lib) / name).stat().st_size > 0
    stats = meta["stats"]
    kernels = stats["decode_kernels"]
    assert kernels and any("matmul" in name for name in kernels), kernels
    # The launches beyond decode's own kernels are the paged KV cache's: one attention call per layer,
    # with TVM's one-kernel decode attention (head dim 32 has no fuselight kernel) and the fused
    # RoPE + append kernel (fuselight.passes.fuse_rope_append): two a layer.
    kv_cache_launches = stats["launches_per_decode_step"] - len(kernels)
    attention_calls, rest = divmod(kv_cache_launches, 2)
    assert rest == 0 and attention_calls == load("tiny-llama").num_hidden_layers
    assert lib.stat().st_size > 0
    assert meta["cuda_graph"] is False  # every kernel launches programmatically on sm_90: no graphs


def test_graphs_by_default_unless_every_kernel_launches_programmatically():
    cuda = resolve("cuda", "sm_90")
    assert fc.graphs_by_default(cuda, programmatic_launch=False)  # the baseline, as MLC-LLM's O2
    assert not fc.graphs_by_default(cuda, programmatic_launch=True)
    assert fc.graphs_by_default(resolve("cuda", "sm_80"), programmatic_launch=True)  # no PDL before sm_90
    assert not fc.graphs_by_default(resolve("llvm"), programmatic_launch=False)


def test_cuda_graph_captures_decode_and_needs_cuda():
    spec = resolve("cuda", "sm_90")
    cfg = load("tiny-llama").with_dtype("float16")
    with_graph, without = (fc.build(cfg, spec, "fuselight", cuda_graph=g) for g in (True, False))
    assert "decode_cuda_graph_capture" in with_graph.executable.as_text()
    assert "cuda_graph" not in without.executable.as_text()
    # Kernels replayed from a graph still count as launches of the step, in the same order.
    assert with_graph.stats == without.stats
    with pytest.raises(FuselightError, match="CUDA graphs need a cuda target"):
        fc.build(cfg, resolve("llvm"), "baseline", cuda_graph=True)


def test_demo_shows_fuselight_changes(capsys):
    from fuselight.demo import run_demo

    out = run_demo(load("tiny-llama").with_dtype("float16"), prompt_len=7, decode_steps=3, seed=3)
    text = capsys.readouterr().out
    for row in ("kernels (PrimFuncs)", "launches per decode step", "logits rel. error vs float32", "accumulate_matmul_fp32"):
        assert row in text
    # fp32 accumulation is the change: closer to the float32 build than the baseline, and close to it.
    assert out["errors"]["fuselight"] < out["errors"]["baseline"]
    assert out["errors"]["fuselight"] < 2e-3
    assert out["agreement"] < 2e-2
