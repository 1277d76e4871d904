"""Training the learned GEMM cost (``fuselight.rules.gemm.cost_model``, where the dispatcher uses it).

``features`` describes one (plan, M, N, K): the analytic estimate of ``rules.gemm.estimate``, the
tile, blocks, waves (blocks over the SMs' resident slots), bytes and flops. The booster is trained
on log time with log(estimate) as its base margin, so it learns how far measured times stray from
the estimate: on a shape it has not seen, the estimate's scaling carries over (trees do not
extrapolate, the estimate does). ``train`` fits a dataset (``fuselight tune gemm-run``);
``evaluate`` holds out one shape at a time and reports, per (shape, M), how well the model and the
bare estimate rank the plans and what the plan each chooses costs over the measured best (regret).
The model is kept as xgboost JSON in ``configs/gemm/cost-model-<arch>.json``; the dispatcher
prices plans with it where ``configs/gemm/dispatch.json`` says ``"cost_model": "xgboost"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FuselightError
from ..jsonfile import read_json_object
from ..paths import config_dir
# (load and load_model: the trained model as the dispatcher reads it, reached through here as well)
from ..rules.gemm.cost_model import ESTIMATE, FEATURES, GemmCostModel, features, load, load_model, model_path
from ..rules.gemm.estimate import candidates, load_dispatch, plan_name
from ..rules.gemm.operands import GemmOperands
from .gemm import read_dataset, write_dataset

def dataset_path(arch: str) -> Path:
    """Where the dataset the model was trained on lives."""
    return config_dir() / "gemm" / f"measured-{arch}.json"


def settings() -> dict[str, Any]:
    """Training settings: ``configs/gemm/cost_model.json``."""
    path = config_dir() / "gemm" / "cost_model.json"
    return read_json_object(path, missing=f"cost model settings not found: {path}")


@dataclasses.dataclass
class Samples:
    """Dataset rows the config can price: features, log median time, and what each row is."""

    x: np.ndarray  # rows x len(FEATURES)
    log_us: np.ndarray
    shape: list[tuple[int, int]]  # (N, K)
    m: list[int]
    plan: list[str]
    skipped: int  # rows whose plan the config no longer has


def samples(dataset: dict[str, Any], d: Any) -> Samples:
    """The rows of ``dataset`` (``tune.gemm.run``'s form) as features under dispatch config ``d``."""
    plans: dict[tuple[int, int], dict[str, Any]] = {}
    x, log_us, shape, ms, names, skipped = [], [], [], [], [], 0
    for row in dataset["rows"]:
        n, k, m = int(row["n"]), int(row["k"]), int(row["m"])
        if (n, k) not in plans:
            ops = GemmOperands(a=None, b=None, m=m, n=n, k=k, b_layout="NT", dtype="float16", out=None)
            plans[(n, k)] = {plan_name(p, d): p for p in candidates(ops, d)}
        plan = plans[(n, k)].get(row["plan"])
        if plan is None:
            skipped += 1
            continue
        if not row["median_us"] > 0:
            raise FuselightError(f"dataset row {n}x{k} m={m} {row['plan']}: median_us must be positive")
        x.append(features(plan, m, n, k, d))
        log_us.append(math.log(row["median_us"]))
        shape.append((n, k))
        ms.append(m)
        names.append(row["plan"])
    if not x:
        raise FuselightError("the dataset has no rows of plans the dispatch config knows")
    return Samples(np.array(x), np.array(log_us), shape, ms, names, skipped)


def fit(s: Samples, d: Any, cfg: dict[str, Any] | None = None) -> GemmCostModel:
    """Train on all of ``s`` with the settings ``cfg`` (default ``configs/gemm/cost_model.json``)."""
    import xgboost as xgb

    cfg = cfg or settings()
    best: dict[tuple[Any, int], float] = {}
    for shape, m, t in zip(s.shape, s.m, s.log_us):
        best[(shape, m)] = min(best.get((shape, m), math.inf), t)
    gap = s.log_us - np.array([best[(shape, m)] for shape, m in zip(s.shape, s.m)])
    data = xgb.DMatrix(s.x, label=s.log_us, base_margin=s.x[:, ESTIMATE], weight=np.exp(-gap / cfg["near_best_log"]),
                       feature_names=list(FEATURES))
    booster = xgb.train(dict(cfg["xgboost"]), data, num_boost_round=int(cfg["rounds"]))
    booster.feature_names = None  # predictions take plain arrays in FEATURES order
    return GemmCostModel(booster, d)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (ties share their mean rank); NaN when either side is constant."""
    ra, rb = _ranks(np.asarray(a)), _ranks(np.asarray(b))
    if ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(len(v))
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranks) / counts)[inverse]


def _choices(predicted: np.ndarray, s: Samples) -> list[dict[str, Any]]:
    """Per (shape, M) group: the plan chosen by the lowest prediction, its regret, the rank correlation."""
    groups: dict[tuple[Any, int], list[int]] = {}
    for i in range(len(s.log_us)):
        groups.setdefault((s.shape[i], s.m[i]), []).append(i)
    choices = []
    for (shape, m), idx in sorted(groups.items()):
        measured, pred = s.log_us[idx], predicted[idx]
        best, chosen = int(np.argmin(measured)), int(np.argmin(pred))
        choices.append({
            "shape": f"{shape[0]}x{shape[1]}", "m": m, "best": s.plan[idx[best]], "chosen": s.plan[idx[chosen]],
            "regret": math.exp(measured[chosen] - measured[best]) - 1, "spearman": spearman(pred, measured),
        })  # fmt: skip
    return choices


def _summary(choices: list[dict[str, Any]], predicted: np.ndarray, measured: np.ndarray) -> dict[str, Any]:
    regrets = np.array([c["regret"] for c in choices])
    ranks = np.array([c["spearman"] for c in choices])
    return {
        "spearman": float(np.nanmedian(ranks)),
        "spearman_pooled": spearman(predicted, measured),
        "regret_median": float(np.median(regrets)),
        "regret_max": float(regrets.max()),
        "regret_mean": float(regrets.mean()),
        "n_groups": len(choices),
    }


def evaluate(dataset: dict[str, Any], d: Any, cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """Leave one shape out: train on the others, choose a plan per M of the held-out shape by the
    lowest prediction; the same for the analytic estimate (no training). Rank correlation is per
    (shape, M) group (the median is ``spearman``) and over all held-out rows (``spearman_pooled``)."""
    s = samples(dataset, d)
    shapes = sorted(set(s.shape))
    if len(shapes) < 2:
        raise FuselightError("leave-one-shape-out needs a dataset of at least two shapes")
    xgb_pred = np.empty(len(s.log_us))
    folds = []
    for held in shapes:
        test = np.array([i for i, sh in enumerate(s.shape) if sh == held])
        train = np.array([i for i, sh in enumerate(s.shape) if sh != held])
        part = Samples(s.x[train], s.log_us[train], [s.shape[i] for i in train], [s.m[i] for i in train],
                       [s.plan[i] for i in train], 0)
        xgb_pred[test] = fit(part, d, cfg).predict_log_us(s.x[test])
        folds.append({"heldout": f"{held[0]}x{held[1]}", "n_train": len(train), "n_heldout": len(test)})
    device = dataset.get("device")
    out: dict[str, Any] = {"protocol": "leave-one-shape-out", "folds": folds, "skipped_rows": s.skipped}
    for name, predicted, n_train in (
        ("xgboost", xgb_pred, min(f["n_train"] for f in folds)),
        ("analytic", s.x[:, ESTIMATE], 0),
    ):
        choices = _choices(predicted, s)
        out[name] = {**_summary(choices, predicted, s.log_us), "n_train": n_train, "n_heldout": len(s.log_us),
                     "device": device, "choices": choices}
    return out


def gemm_model(data: Path, arch: str = "sm_90", do_eval: bool = False, write: bool = False,
               results: Path | None = None) -> dict[str, Any]:
    """``fuselight tune gemm-model``: train on the dataset ``data``; with ``do_eval`` evaluate
    (leave one shape out) and write ``results``; with ``write`` store the model and the dataset in
    ``configs/gemm/``. Returns the evaluation (empty without ``do_eval``)."""
    dataset = read_dataset(Path(data), arch)
    d = load_dispatch(arch)
    cfg = settings()
    report: dict[str, Any] = {}
    if do_eval:
        report = {"suite": "tuning", "family": "gemm", "arch": arch, "device": dataset.get("device"),
                  "versions": dataset.get("versions", {}), "target": cfg["target"], "settings": cfg,
                  "note": "analytic: not fitted to the rows (n_train 0), but its per-tile efficiencies in "
                          "configs/gemm/dispatch.json were calibrated on measurements of these shapes",
                  **evaluate(dataset, d, cfg)}
        print(f"{'model':>9} {'spearman':>8} {'pooled':>7} {'regret median':>13} {'regret max':>10} "
              f"{'n_train':>7} {'n_heldout':>9}")
        for name in ("xgboost", "analytic"):
            r = report[name]
            print(f"{name:>9} {r['spearman']:8.3f} {r['spearman_pooled']:7.3f} {r['regret_median']:13.3f} "
                  f"{r['regret_max']:10.3f} {r['n_train']:7d} {r['n_heldout']:9d}")
        if results is not None:
            results.parent.mkdir(parents=True, exist_ok=True)
            results.write_text(json.dumps(report, indent=1) + "\n")
            print(f"evaluation written: {results}")
    s = samples(dataset, d)
    model = fit(s, d, cfg)
    if write:
        meta = {"device": dataset.get("device"), "versions": dataset.get("versions", {}), "n_train": len(s.log_us),
                "shapes": sorted({f"{n}x{k}" for n, k in s.shape})}
        print(f"model written: {model.save(model_path(arch), meta)}")
        path = dataset_path(arch)
        write_dataset(dataset, path)
        print(f"dataset written: {path}")
    return report
