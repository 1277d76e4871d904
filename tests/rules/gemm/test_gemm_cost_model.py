"""The learned GEMM cost model: features, training, save/load, the held-out evaluation, and the
dispatcher's choice between it and the analytic estimate (cold start without a model)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from fuselight.cli import main
from fuselight.errors import FuselightError
from fuselight.rules.gemm import dispatch, estimate
from fuselight.rules.gemm.operands import GemmOperands
from fuselight.rules.gemm import cost_model as predictor
from fuselight.tune import cost_model
from fuselight.tune.gemm import read_dataset, timings, write_dataset

ARCH = "sm_90"


def _ops(n: int, k: int, m: int = 64) -> GemmOperands:
    return GemmOperands(a=None, b=None, m=m, n=n, k=k, b_layout="NT", dtype="float16", out=None)


@pytest.fixture(scope="module")
def d() -> estimate.Dispatch:
    return estimate.load_dispatch(ARCH)


@pytest.fixture(scope="module")
def dataset() -> dict:
    """The committed measurements, cut to M <= 512 (fast to train on, still every plan and shape)."""
    full = read_dataset(cost_model.dataset_path(ARCH), ARCH)
    return {**full, "rows": [r for r in full["rows"] if r["m"] <= 512]}


@pytest.fixture(scope="module")
def quick() -> dict:
    cfg = copy.deepcopy(cost_model.settings())
    cfg["rounds"] = 20
    return cfg


def test_features_describe_the_plan_and_the_estimate(d):
    wgmma = estimate.WgmmaPlan(d.wgmma["wgmma"])  # 128 x 256
    x = dict(zip(cost_model.FEATURES, cost_model.features(wgmma, 200, 4096, 4096, d)))
    assert len(x) == len(cost_model.FEATURES)
    assert x["log_estimate_us"] == pytest.approx(math.log(estimate.estimate_us(wgmma, 200, 4096, 4096, d)))
    assert (x["wgmma"], x["block_m"], x["block_n"], x["split_k"], x["rest_block_m"]) == (1, 128, 256, 1, 0)
    assert x["log_blocks"] == pytest.approx(math.log(2 * 16))  # 2 row tiles x 16 column tiles
    assert x["m_fill"] == pytest.approx(200 / 256)
    tile = d.tiles["m64n128k64w2x2s4"]
    plan = estimate.GemmPlan(main=tile, rest=d.tiles["m32n128k64w1x4s5"], split_k=4)
    y = dict(zip(cost_model.FEATURES, cost_model.features(plan, 64, 4096, 14336, d)))
    assert (y["wgmma"], y["block_k"], y["split_k"], y["rest_block_m"]) == (0, 64, 4, 32)
    assert y["k_steps"] == 14336 / (4 * 64)
    split = dict(zip(cost_model.FEATURES, cost_model.features(estimate.WgmmaPlan(d.wgmma["wgmma"], 4), 200, 4096, 4096, d)))
    assert (split["wgmma"], split["split_k"], split["k_steps"]) == (1, 4, 4096 / (4 * 64))
    assert split["log_blocks"] == pytest.approx(math.log(2 * 16 * 4))
    assert y["log_blocks"] == pytest.approx(math.log(1 * 32 * 4))


def test_spearman():
    a = np.array([1.0, 2.0, 3.0, 4.0])
    assert cost_model.spearman(a, a * 10) == pytest.approx(1.0)
    assert cost_model.spearman(a, -a) == pytest.approx(-1.0)
    assert cost_model.spearman(np.array([1.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(cost_model.spearman(a, np.ones(4)))


def test_train_save_load_round_trip(dataset, d, quick, tmp_path):
    s = cost_model.samples(dataset, d)
    assert s.skipped == 0 and len(s.log_us) == len(dataset["rows"])
    model = cost_model.fit(s, d, quick)
    fitted = model.predict_log_us(s.x)
    # It learns the measurements better than the estimate it starts from.
    assert np.abs(fitted - s.log_us).mean() < 0.5 * np.abs(s.x[:, cost_model.ESTIMATE] - s.log_us).mean()
    path = model.save(tmp_path / "model.json", {"device": dataset["device"]})
    back = cost_model.load(path, d)
    np.testing.assert_allclose(back.predict_log_us(s.x), fitted, rtol=1e-6)
    plan, m = d.tiles["m32n128k64w1x4s5"], 48
    gemm = estimate.GemmPlan(main=plan, rest=None, split_k=2)
    assert back.predict_us(gemm, m, 4096, 4096) == pytest.approx(model.predict_us(gemm, m, 4096, 4096), rel=1e-6)
    # A plan outside the shape's candidates (no such split-K) is predicted on its own.
    odd = estimate.GemmPlan(main=plan, rest=None, split_k=8)
    assert model.predict_us(odd, m, 4096, 4096) > 0


def test_load_refuses_other_models(dataset, d, quick, tmp_path):
    model = cost_model.fit(cost_model.samples(dataset, d), d, quick)
    path = model.save(tmp_path / "model.json", {})
    raw = json.loads(path.read_text())
    raw["learner"]["attributes"]["features"] = json.dumps(["log_m"])
    path.write_text(json.dumps(raw))
    with pytest.raises(FuselightError, match="other features"):
        cost_model.load(path, d)
    path.write_text("{}")
    with pytest.raises(FuselightError, match="not an xgboost model"):
        cost_model.load(path, d)


def _fake_estimate(plan, m, n, k, d) -> float:
    """An estimate whose ranking is known by hand: the narrowest tile first, then the least split."""
    tile = plan.tile if isinstance(plan, estimate.WgmmaPlan) else plan.main
    return float(tile.block_n * 100 + plan.split_k)


def test_evaluation_fields(dataset, d, quick, monkeypatch):
    # The analytic choice is the timed plan of lowest estimate: under the fake estimate, the
    # narrowest tile (then the least split), found here from the plans' names alone.
    monkeypatch.setattr(predictor, "estimate_us", _fake_estimate)
    report = cost_model.evaluate(dataset, d, quick)
    shapes = {(r["n"], r["k"]) for r in dataset["rows"]}
    assert [f["n_train"] + f["n_heldout"] for f in report["folds"]] == [len(dataset["rows"])] * len(shapes)
    for name in ("xgboost", "analytic"):
        r = report[name]
        for field in ("spearman", "regret_median", "regret_max", "n_train", "n_heldout", "device"):
            assert field in r, (name, field)
        assert r["n_heldout"] == len(dataset["rows"]) and r["device"] == dataset["device"]
        assert 0 <= r["regret_median"] <= r["regret_max"]
        assert -1 <= r["spearman"] <= 1
        assert len(r["choices"]) == sum(len(by_m) for by_m in timings(dataset).values())

    def rank(name: str) -> tuple[int, int]:
        plan = estimate.parse_plan(d.tiles, d.wgmma, name)
        tile = plan.tile if isinstance(plan, estimate.WgmmaPlan) else plan.main
        return tile.block_n, plan.split_k

    for choice in report["analytic"]["choices"]:
        n, k = (int(v) for v in choice["shape"].split("x"))
        timed = timings(dataset)[(n, k)][choice["m"]]
        assert rank(choice["chosen"]) == min(rank(name) for name in timed)
        assert choice["regret"] == pytest.approx(timed[choice["chosen"]] / min(timed.values()) - 1)


def test_gemm_model_cli_writes_the_evaluation(dataset, tmp_path, capsys):
    small = {**dataset, "rows": [r for r in dataset["rows"] if r["m"] in (16, 128, 512)]}
    write_dataset(small, tmp_path / "data.json")
    out = tmp_path / "tuning.json"
    assert main(["tune", "gemm-model", str(tmp_path / "data.json"), "--eval", "--results", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["xgboost"]["n_heldout"] == len(small["rows"]) and "analytic" in report
    assert "xgboost" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text(json.dumps({"suite": "kernels"}))
    assert main(["tune", "gemm-model", str(tmp_path / "bad.json")]) == 2


def test_dataset_round_trip_and_earlier_form(dataset, d, tmp_path):
    write_dataset(dataset, tmp_path / "data.json")
    assert read_dataset(tmp_path / "data.json")["rows"] == dataset["rows"]
    legacy = {"suite": "gemm_tune", "device": "GPU", "git_commit": "abc",
              "timings": {"4096x4096": {"64": {"wgmma": 30.0, "m32n128k64w1x4s5/sk2": 20.0, "torch": 25.0}}}}
    (tmp_path / "legacy.json").write_text(json.dumps(legacy))
    converted = read_dataset(tmp_path / "legacy.json", ARCH)
    assert converted["torch"] == [{"n": 4096, "k": 4096, "m": 64, "median_us": 25.0}]
    row = next(r for r in converted["rows"] if r["plan"] == "m32n128k64w1x4s5/sk2")
    assert (row["template"], row["block_m"], row["split_k"], row["median_us"]) == ("mma_sync", 32, 2, 20.0)
    legacy["timings"]["4096x4096"]["64"]["m8n8k8w1x1s1"] = 1.0
    (tmp_path / "legacy.json").write_text(json.dumps(legacy))
    with pytest.raises(FuselightError, match="m8n8k8w1x1s1"):
        read_dataset(tmp_path / "legacy.json", ARCH)


class _Favours:
    """A stand-in model that prices one plan far below the rest."""

    def __init__(self, plan):
        self.plan = plan

    def predict_us(self, plan, m, n, k):
        return 1.0 if plan == self.plan else 1000.0


def test_dispatch_uses_the_model_only_when_asked_and_present(d, monkeypatch, tmp_path):
    ops = _ops(2048, 8192)  # no measured table for this shape
    analytic = dataclasses.replace(d, cost_model="analytic", measured={})
    learned = dataclasses.replace(d, cost_model="xgboost", measured={})
    expected = dispatch.best_plan(ops, 64, analytic)
    odd = estimate.GemmPlan(main=d.tiles["m128n256k64w2x4s3"], rest=None, split_k=1)
    assert odd != expected
    monkeypatch.setattr(dispatch, "load_model", lambda arch: _Favours(odd))
    assert dispatch.best_plan(ops, 64, learned) == odd
    assert dispatch.best_plan(ops, 64, analytic) == expected  # the config says analytic
    # Cold start: no model file for the arch -> the estimate decides.
    monkeypatch.undo()
    monkeypatch.setattr(predictor, "model_path", lambda arch: tmp_path / f"none-{arch}.json")
    assert predictor.load_model(ARCH) is None
    assert dispatch.best_plan(ops, 64, learned) == expected
    assert dispatch.plan_ranges(ops, learned) == dispatch.plan_ranges(ops, analytic)


def test_committed_model_predicts_the_measurements(d, dataset):
    model = cost_model.load_model(ARCH)
    assert model is not None
    s = cost_model.samples(dataset, d)
    ratio = np.exp(np.abs(model.predict_log_us(s.x) - s.log_us))
    assert np.median(ratio) < 1.1


def test_bad_cost_model_config_names_it(tmp_path, monkeypatch):
    from fuselight import paths

    src = paths.config_dir()
    (tmp_path / "gemm").mkdir()
    cfg = json.loads((src / "gemm" / "dispatch.json").read_text())
    cfg[ARCH]["cost_model"] = "oracle"
    (tmp_path / "gemm" / "dispatch.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(estimate, "config_dir", lambda: tmp_path)
    with pytest.raises(FuselightError, match="oracle"):
        estimate.load_dispatch(ARCH)


def test_dispatch_import_leaves_xgboost_alone():
    code = "import sys, fuselight.rules.gemm.dispatch, fuselight.rules.matmul; print('xgboost' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
