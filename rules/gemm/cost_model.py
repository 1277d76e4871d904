"""The learned GEMM cost the dispatcher prices plans with: xgboost on measured plan times, on top of
the analytic estimate (``fuselight.tune.cost_model`` trains it; this is the part the rule uses).

``features`` describes one (plan, M, N, K): the analytic estimate of ``estimate``, the tile,
blocks, waves (blocks over the SMs' resident slots), bytes and flops. The booster predicts log time
with log(estimate) as its base margin. The model is kept as xgboost JSON in
``configs/gemm/cost-model-<arch>.json``; the dispatcher prices plans with it where
``configs/gemm/dispatch.json`` says ``"cost_model": "xgboost"`` (``load_model``). xgboost is imported
only when a model is loaded or trained.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from fuselight.errors import FuselightError
from fuselight.paths import config_dir

from .estimate import candidates, estimate_us, load_dispatch
from .operands import GemmOperands
from .wgmma import BLOCK_K, WgmmaPlan

FEATURES = (
    "log_estimate_us", "wgmma", "block_m", "block_n", "block_k", "threads", "stages", "split_k",
    "rest_block_m", "smem_kib", "resident", "log_blocks", "waves", "last_wave", "m_fill", "k_steps",
    "log_m", "log_n", "log_k", "log_flops", "log_bytes", "flops_per_byte",
)  # fmt: skip
ESTIMATE = FEATURES.index("log_estimate_us")
IN_BYTES = 2  # fp16 / bf16 operands and output


def model_path(arch: str) -> Path:
    """Where the trained model for ``arch`` lives."""
    return config_dir() / "gemm" / f"cost-model-{arch}.json"


def features(plan: Any, m: int, n: int, k: int, d: Any) -> list[float]:
    """The feature vector (``FEATURES``) of ``plan`` on an ``m x n x k`` GEMM under dispatch config ``d``."""
    if isinstance(plan, WgmmaPlan):
        tile = plan.tile
        wgmma, block_k, smem, split_k, rest_m = 1, BLOCK_K, tile.smem_bytes, plan.split_k, 0
    else:
        tile = plan.main
        wgmma, block_k, smem, split_k = 0, tile.block_k, tile.shared_bytes, plan.split_k
        rest_m = plan.rest.block_m if plan.rest is not None else 0
    # Blocks an SM holds at once, as the estimate counts them (shared memory and threads).
    resident = max(1, min(d.smem_per_sm // smem, d.threads_per_sm // tile.threads))
    row_tiles = math.ceil(m / tile.block_m)
    blocks = row_tiles * math.ceil(n / tile.block_n) * split_k
    waves = blocks / (d.sms * resident)
    flops = 2.0 * m * n * k
    moved = float(n * k + m * k + m * n) * IN_BYTES
    return [
        math.log(estimate_us(plan, m, n, k, d)), wgmma, tile.block_m, tile.block_n, block_k, tile.threads,
        tile.stages, split_k, rest_m, smem / 1024, resident, math.log(blocks), waves,
        waves / math.ceil(waves), m / (row_tiles * tile.block_m), k / (split_k * block_k),
        math.log(m), math.log(n), math.log(k), math.log(flops), math.log(moved), flops / moved,
    ]  # fmt: skip


class GemmCostModel:
    """A trained booster and the dispatch config its features are computed under."""

    def __init__(self, booster: Any, d: Any):
        self.booster = booster
        self.d = d
        self._by_shape: dict[tuple[int, int, int], dict[Any, float]] = {}

    def predict_log_us(self, x: np.ndarray) -> np.ndarray:
        """Log microseconds for feature rows ``x``."""
        import xgboost as xgb

        # One thread: a few rows a call, and no OpenMP team, which a forked build process
        # (``fuselight.forked_passes``) would wait on forever once its parent has started one.
        with xgb.config_context(nthread=1):
            return self.booster.inplace_predict(x, base_margin=x[:, ESTIMATE])

    def predict_us(self, plan: Any, m: int, n: int, k: int) -> float:
        """Predicted microseconds of ``plan`` on an ``m x n x k`` GEMM."""
        # One booster call costs about a millisecond however many rows it predicts: the shape's
        # candidates are predicted together, once, as the dispatcher asks for each of them in turn.
        if (m, n, k) not in self._by_shape:
            ops = GemmOperands(a=None, b=None, m=m, n=n, k=k, b_layout="NT", dtype="float16", out=None)
            plans = candidates(ops, self.d)
            self._by_shape[(m, n, k)] = dict(zip(plans, self._predict(plans, m, n, k)))
        cached = self._by_shape[(m, n, k)].get(plan)
        return cached if cached is not None else self._predict([plan], m, n, k)[0]

    def _predict(self, plans: list[Any], m: int, n: int, k: int) -> list[float]:
        if not plans:
            return []
        x = np.array([features(p, m, n, k, self.d) for p in plans])
        return [float(t) for t in np.exp(self.predict_log_us(x))]

    def save(self, path: Path, meta: dict[str, Any]) -> Path:
        """Write the model as xgboost JSON, with the feature names and ``meta`` (what it was trained on)."""
        self.booster.set_attr(features=json.dumps(FEATURES), meta=json.dumps(meta))
        path.parent.mkdir(parents=True, exist_ok=True)
        self.booster.save_model(str(path))
        return path


def load(path: Path, d: Any) -> GemmCostModel:
    """The model saved at ``path``; FuselightError when it is unreadable or has other features."""
    import xgboost as xgb

    booster = xgb.Booster()
    try:
        booster.load_model(str(path))
    except xgb.core.XGBoostError as err:
        raise FuselightError(f"{path}: not an xgboost model ({str(err).splitlines()[0]})") from None
    if booster.attr("features") != json.dumps(FEATURES):
        raise FuselightError(f"{path}: trained on other features; retrain it with 'fuselight tune gemm-model'")
    return GemmCostModel(booster, d)


def load_model(arch: str) -> GemmCostModel | None:
    """The committed model for ``arch``, or None when there is none (the dispatcher then estimates)."""
    path = model_path(arch)
    if not path.is_file():
        return None
    return _load_cached(path, path.stat().st_mtime_ns, arch)


@functools.lru_cache(maxsize=4)
def _load_cached(path: Path, _mtime_ns: int, arch: str) -> GemmCostModel:
    return load(path, load_dispatch(arch))
