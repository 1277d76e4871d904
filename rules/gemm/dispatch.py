"""Which GEMM plan serves which M: an analytic performance function, no search at compile time.

The plans and their analytic price (``estimate_us``) are ``estimate``'s.
``plan_ranges`` evaluates the price over an M grid and merges neighbours with the same best plan into
``(largest M, plan)`` ranges, which the Matmul rule turns into a host-side branch. A measured table
(``fuselight tune gemm-*``) checks the function against the GPU: its entries, where present for a
shape and valid for the operands, override the estimate. For other shapes the config's
``cost_model`` may name ``xgboost``: plans are then priced by the model learned from the measured
times (``cost_model``, trained by ``fuselight.tune.cost_model``) where the arch has one, else by the
estimate (cold start).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fuselight.device import device_model
from fuselight.errors import FuselightError
from fuselight.paths import config_dir
from tvm import tirx

from .. import arch_config
from ..arch_config import arch_entry
from .cost_model import load_model
from .estimate import Dispatch, Plan, candidates, estimate_us, fits, parse_plan, wgmma_name
from .operands import GemmOperands
from .plan import GemmTile, check_tile as check_gemm_tile, q4_tile_bytes
from .wgmma import WgmmaPlan, WgmmaTile
from .wgmma_q4 import RS_PREFIX, WgmmaQ4Plan, WgmmaQ4Tile


def _cost(plan: Plan, m: int, n: int, k: int, d: Dispatch) -> float:
    """What choosing compares: the learned model's prediction where the config asks for it and the
    arch has a trained model (``fuselight tune gemm-model``), else the estimate (cold start)."""
    if d.cost_model == "xgboost":
        model = load_model(d.arch)
        if model is not None:
            return model.predict_us(plan, m, n, k)
    return estimate_us(plan, m, n, k, d)


def _measured(ops: GemmOperands, d: Dispatch) -> list[tuple[int, Plan]] | None:
    """The measured ranges for ``ops``' shape, if the table has them and every plan fits ``ops``."""
    table = d.measured.get(f"{ops.n}x{ops.k}")
    return table if table and all(fits(plan, ops, d.smem_per_block) for _, plan in table) else None


def best_plan(
    ops: GemmOperands, m: int, d: Dispatch, plans: list[Plan] | None = None, lowest_m: int | None = None
) -> Plan | None:
    """The plan for ``m`` rows: the measured one for this shape if the table has it, else the cheapest estimate.

    lowest_m: the smallest M the plan will serve (default ``m``); a plan with a rest tile needs at
    least one whole main tile there.
    """
    table = _measured(ops, d)
    if table:
        return next((plan for upper, plan in table if m <= upper), table[-1][1])
    lowest = m if lowest_m is None else lowest_m
    plans = [
        p for p in (candidates(ops, d) if plans is None else plans)
        if isinstance(p, WgmmaPlan) or p.rest is None or lowest >= p.main.block_m
    ]
    if not plans:
        return None
    return min(plans, key=lambda p: _cost(p, m, ops.n, ops.k, d))


def plan_ranges(ops: GemmOperands, d: Dispatch) -> list[tuple[int, Plan]]:
    """``(largest M, plan)`` in increasing M; the last range also serves every larger M. Empty: no plan fits.

    A measured table for the shape is used as it is. Otherwise a range keeps the previous range's
    plan while that is within ``d.keep_within`` of the best, so a function compiles a few kernels,
    not one per grid point.
    """
    table = _measured(ops, d)
    if table and not _static(ops.m):
        return list(table)
    plans = candidates(ops, d)
    grid = [int(ops.m)] if _static(ops.m) else list(d.m_grid)
    ranges: list[tuple[int, Plan]] = []
    for i, m in enumerate(grid):
        lowest = grid[i - 1] + 1 if i else 1
        plan = best_plan(ops, m, d, plans, lowest)
        if plan is None:
            return []
        extend_ranges(ranges, m, plan, lambda p, m=m: _cost(p, m, ops.n, ops.k, d), d.keep_within)
    return ranges


def extend_ranges(
    ranges: list[tuple[int, Any]], m: int, best: Any, cost: Callable[[Any], float], keep_within: float
) -> None:
    """Add M-grid point ``m``, whose best plan is ``best``, to ``ranges`` of ``(largest M, plan)``: the
    last range grows over ``m`` while its plan costs at most ``keep_within`` more than the best there."""
    if ranges and cost(ranges[-1][1]) <= (1 + keep_within) * cost(best):
        best = ranges[-1][1]
    if ranges and ranges[-1][1] == best:
        ranges[-1] = (m, best)
    else:
        ranges.append((m, best))


def _static(m: Any) -> bool:
    return isinstance(m, (int, tirx.IntImm))


def q4_plan_ranges(ops: GemmOperands, arch: str) -> list[tuple[int, Plan]]:
    """``(largest M, plan)`` in increasing M for a matmul whose B is dequantized in the kernel
    (``ops.dequant``), from ``configs/gemm/mma_sync_q4.json``; the last range also serves every
    larger M. A range names a plan or a list of plans, the first that can serve ``ops`` taken (a
    wgmma plan first, an mma.sync one where wgmma cannot: a symbolic N, the LM head; a "q4rs-"
    name is a tile of ``wgmma_rs_tiles``, the template with the weight in registers, ``wgmma_q4``,
    which serves fp16 with a static N and leaves the rest to the names after it). The arch's
    ``by_shape`` ranges (measured, keyed ``NxK``) replace ``ranges`` for that shape where every
    plan they name can serve ``ops``. Empty: the arch has no entry, or no plan of a range can serve
    ``ops`` (the function is left to the next rule). Neighbouring ranges that come to the same plan
    are one. A static M gets the one range holding it."""
    device = device_model(arch)
    if ops.dequant is None or device is None:
        return []
    cfg, where = arch_entry(config_dir() / "gemm" / "mma_sync_q4.json", arch,
                            lambda d, t: arch_config.mma_sync_q4(d, t, q4_tile_bytes))
    limit = device.smem_per_block_optin
    try:
        tiles = {str(name): GemmTile(**fields) for name, fields in cfg["tiles"].items()}
        for name, tile in tiles.items():
            check_gemm_tile(tile, name)  # its 4-bit shared memory is checked against ``limit`` by fits
        wgmma = ({wgmma_name(str(name)): WgmmaTile(**fields) for name, fields in cfg.get("wgmma_tiles", {}).items()}
                 if device.has("wgmma") else {})
        # The weight-in-registers wgmma template's tiles (``wgmma_q4``), named "q4rs-..." in ranges.
        rs = ({str(name): WgmmaQ4Tile(**fields) for name, fields in cfg.get("wgmma_rs_tiles", {}).items()}
              if device.has("wgmma") else {})
        if any(not name.startswith(RS_PREFIX) for name in rs):
            raise ValueError(f"wgmma_rs_tiles names must start with {RS_PREFIX!r}")

        def plan_of(name: str) -> Plan:
            return WgmmaQ4Plan(rs[name]) if name in rs else parse_plan(tiles, wgmma, name)
        tables = [_q4_table(cfg["ranges"], plan_of)]
        shape = cfg.get("by_shape", {}).get(f"{ops.n}x{ops.k}") if isinstance(ops.n, int) else None
        if shape is not None:
            tables.insert(0, _q4_table(shape, plan_of))
        splits = [int(s) for s in cfg["split_k"]]
        min_blocks = int(cfg["min_blocks"])
    except (KeyError, TypeError, ValueError) as err:
        raise FuselightError(f"{where}: malformed config ({err!r})") from None
    for table in tables:
        ranges = _q4_resolve(ops, table, plan_of, splits, min_blocks, limit)
        if ranges:
            break
    else:
        return []
    if _static(ops.m):
        m = int(ops.m)
        return [next((r for r in ranges if m <= r[0]), ranges[-1])]
    return ranges


def _q4_table(entries: list, plan_of: Callable[[str], Plan]) -> list[tuple[int | None, list[str]]]:
    """A config's ``[largest M, plan or plans]`` list, checked: names known, one ``[null, ...]`` last."""
    table = [
        (None if upper is None else int(upper), [str(n) for n in (names if isinstance(names, list) else [names])])
        for upper, names in entries
    ]
    if not table or table[-1][0] is not None or any(u is None for u, _ in table[:-1]):
        raise ValueError("ranges must end with one [null, plan]")
    if any(not names for _, names in table):
        raise ValueError("a range names no plan")
    for _, names in table:
        for name in names:
            plan_of(name)
    return table


def _q4_resolve(ops: GemmOperands, table: list[tuple[int | None, list[str]]], plan_of: Callable[[str], Plan],
                splits: list[int], min_blocks: int, limit: int) -> list[tuple[int, Plan]]:
    """``table``'s ranges with each range's first plan that serves ``ops`` (split K until the range's
    largest M has ``min_blocks`` blocks, static N only); empty if a range has none."""
    ranges: list[tuple[int, Plan]] = []
    for i, (upper, names) in enumerate(table):
        plan = next((p for p in map(plan_of, names) if fits(p, ops, limit)), None)
        if plan is None:
            return []
        if i == len(table) - 1:
            upper = 2**31 - 1  # every larger M
        elif isinstance(ops.n, int) and plan.split_k == 1:
            # Split K until the range's largest M fills the GPU (where K allows it).
            tile = plan.tile if isinstance(plan, (WgmmaPlan, WgmmaQ4Plan)) else plan.main
            for split in splits:
                blocks = -(-upper // tile.block_m) * (ops.n // tile.block_n) * split
                if fits(dataclasses.replace(plan, split_k=split), ops, limit):
                    plan = dataclasses.replace(plan, split_k=split)
                    if blocks >= min_blocks:
                        break
        if ranges and ranges[-1][1] == plan:  # neighbours that chose the same plan: one kernel
            ranges[-1] = (upper, plan)
        else:
            ranges.append((upper, plan))
    return ranges
