"""Library metadata: one shape for models and kernel cases; the e2e suite refuses another model's library."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from fuselight import config
from fuselight.errors import FuselightError

tvm = pytest.importorskip("tvm")
from fuselight import compile as fc  # noqa: E402
from fuselight.bench import e2e  # noqa: E402
from fuselight.bench import kernels_build as kb  # noqa: E402
from fuselight.bench.kernels import load_suite  # noqa: E402
from fuselight.target import resolve  # noqa: E402


def _meta_for(cfg: config.ModelConfig) -> dict:
    return {"model": json.loads(json.dumps(dataclasses.asdict(cfg)))}


def test_e2e_accepts_a_library_of_the_same_model_under_another_name() -> None:
    cfg = config.load("llama-3.1-8b")
    e2e._check_library(_meta_for(dataclasses.replace(cfg, name="renamed")), cfg, Path("lib.so"))


def test_e2e_refuses_llama3_library_for_llama31() -> None:
    # The two differ only in rope_scaling and max_position_embeddings.
    with pytest.raises(FuselightError, match="lib.so: library built for (rope_scaling|max_position_embeddings)="):
        e2e._check_library(_meta_for(config.load("llama-3-8b")), config.load("llama-3.1-8b"), Path("lib.so"))


@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps", "max_position_embeddings"])
def test_e2e_checks_every_field_but_the_name(field) -> None:
    cfg = config.load("tiny-llama")
    meta = _meta_for(cfg)
    meta["model"][field] = meta["model"][field] * 2
    with pytest.raises(FuselightError, match=f"built for {field}="):
        e2e._check_library(meta, cfg, Path("lib.so"))
    del meta["model"][field]
    with pytest.raises(FuselightError, match=f"built for {field}='<missing>'"):
        e2e._check_library(meta, cfg, Path("lib.so"))


def test_bfloat16_causal_attention_module_builds() -> None:
    case = next(c for c in load_suite("full") if c.op == "attention_prefill")
    kb.relax_module(dataclasses.replace(case, dtype="bfloat16"))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert kb._lowest("bfloat16") == float(ml_dtypes.finfo(ml_dtypes.bfloat16).min)
    assert kb._lowest("float16") == -65504.0


def test_kernel_and_model_metadata_share_one_helper(monkeypatch, tmp_path) -> None:
    spec = resolve("llvm", None)
    case = load_suite("full")[0]
    seen = {}
    monkeypatch.setattr(kb, "compile_case", lambda *a: "exe")
    monkeypatch.setattr(kb, "write_library", lambda exe, path, meta, spec: seen.setdefault("meta", meta) and path)
    kb.export_case(case, "baseline", spec, tmp_path)
    meta = seen["meta"]
    want = fc.library_metadata(spec, "baseline", meta["baseline_source"], case=case.to_dict())
    assert meta == want
    assert {"format", "target", "arch", "pipeline", "baseline_source", "tvm_version", "git_commit"} <= set(meta)


def test_model_metadata_uses_the_baseline_source_recorded_at_build(monkeypatch) -> None:
    from fuselight import pipeline as pl

    def boom(*a, **k):
        raise AssertionError("baseline_source recomputed at export")

    monkeypatch.setattr(pl, "baseline_source", boom)
    built = fc.Built(
        config=config.load("tiny-llama"),
        target=resolve("llvm", None),
        pipeline="baseline",
        executable=None,
        stats=fc.KernelStats(kernels=1, launches_per_decode_step=1, decode_kernels=("k",)),
        compile_seconds=1.0,
        param_names=["w"],
        prefill_chunk_size=64,
        baseline_source="mlc-llm@recorded",
    )
    meta = fc.metadata(built)
    assert meta["baseline_source"] == "mlc-llm@recorded"
    assert meta["model"]["name"] == "tiny-llama" and meta["prefill_chunk_size"] == 64
    base = fc.library_metadata(built.target, "baseline", "mlc-llm@recorded")
    assert {k: meta[k] for k in base} == base


def test_build_reads_the_prefill_chunk_from_runtime_config(monkeypatch) -> None:
    from fuselight import engine
    from fuselight import pipeline as pl

    assert not hasattr(fc, "DEFAULT_PREFILL_CHUNK")
    monkeypatch.setattr(engine, "runtime_config", lambda: {"prefill_chunk_size": 123})
    monkeypatch.setattr(pl, "baseline_source", lambda *a, **k: "fuselight-equivalents")

    class Stop(Exception):
        pass

    def capture(pipeline, target, bounds, options=None):
        raise Stop(bounds)

    monkeypatch.setattr(fc, "pipeline_pass", capture)
    with pytest.raises(Stop) as err:
        fc.build(config.load("tiny-llama"), resolve("llvm", None), "baseline")
    assert err.value.args[0] == {"seq_len": 123}
