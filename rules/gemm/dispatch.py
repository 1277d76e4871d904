"""Which GEMM plan serves which M: an analytic performance function, no search at compile time.

A plan is either a ``GemmPlan`` of the mma.sync template (tiles, rest tile, split-K: it fills the
GPU at small M) or a ``WgmmaPlan`` of the Hopper wgmma template (a tile and split-K: 128 x 256, the
fastest at large M; narrower or 64-row tiles, or K split, where few tiles would leave SMs idle).
``estimate_us`` prices a plan for (M, N, K) from the device numbers and per-tile efficiencies in ``configs/gemm/dispatch.json``: tensor-core
time per block wave (a wave is every SM running its resident blocks; the last one partly idle),
a block's operand streaming at one SM's rate (what few blocks at small M cannot hide), the DRAM
floor (weights, A and the output moved once), the split-K partials (written after the K loop, then
read by the reduction) and one launch gap per kernel.
``plan_ranges`` evaluates it over an M grid and merges neighbours with the same best plan into
``(largest M, plan)`` ranges, which the Matmul rule turns into a host-side branch. A measured table
(``fuselight tune gemm-*``) checks the function against the GPU: its entries, where present for a
shape and valid for the operands, override the estimate. For other shapes the config's
``cost_model`` may name ``xgboost``: plans are then priced by the model learned from the measured
times (``fuselight.tune.cost_model``) where the arch has one, else by the estimate (cold start).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

from fuselight.device import device_model, require_device
from fuselight.errors import FuselightError
from fuselight.jsonfile import read_json_object
from fuselight.paths import config_dir
from tvm import tirx

from .. import arch_config
from ..arch_config import arch_entry
from .operands import GemmOperands
from .plan import GemmPlan, GemmTile, check_plan, check_tile as check_gemm_tile, load_tiles, q4_tile_bytes
from .wgmma import WgmmaPlan, WgmmaTile, check_tile, load_wgmma_tiles

Plan = GemmPlan | WgmmaPlan
WGMMA = "wgmma"  # the default wgmma tile's name in tables; the others are "wgmma-<name>"; "/sk<k>": split-K
COST_MODELS = ("analytic", "xgboost")  # what may price the plans of a shape without a measured table


ACC_BYTES = 4  # a split-K partial is fp32
IN_BYTES = 2  # fp16 / bf16 operands and outputs


def _wgmma_name(tile_name: str) -> str:
    return WGMMA if tile_name == "default" else f"{WGMMA}-{tile_name}"



@dataclasses.dataclass(frozen=True)
class Dispatch:
    """The dispatch config of one arch: its device facts (``fuselight.device``) and the tunables of
    ``configs/gemm/dispatch.json`` (measured) or ``arch_config.dispatch`` (analytic)."""

    sms: int
    smem_per_sm: int  # bytes
    smem_per_block: int  # bytes a block may opt in to
    threads_per_sm: int
    peak_tflops: float  # mma.sync fp16 with fp32 accumulate, whole GPU (the device's peak x mma_sync_peak_fraction)
    wgmma_peak_tflops: float  # wgmma, the same
    dram_gbps: float
    sm_gbps: float  # operand streaming rate of one SM (mma.sync's cp.async pipeline), bounds small-M GEMMs
    wgmma_sm_gbps: float  # the same for wgmma's TMA pipeline
    launch_us: float
    min_static_m: int  # static M below this is a GEMV: left to the next rule
    m_grid: tuple[int, ...]  # M values the ranges are decided at
    split_k: tuple[int, ...]  # split-K factors tried
    keep_within: float  # a range keeps the previous plan while it is this close to the best (0.05: 5%)
    efficiency: dict[str, float]  # tile name -> fraction of the per-SM peak a block sustains
    tiles: dict[str, GemmTile]
    wgmma: dict[str, WgmmaTile]  # by name in tables (without split-K); empty: the arch has no wgmma config
    measured: dict[str, list[tuple[int, Plan]]]  # "NxK" -> measured best (largest M, plan)
    arch: str
    cost_model: str  # what prices plans of shapes without a measured table: "analytic" or "xgboost"


def load_dispatch(arch: str) -> Dispatch:
    """The dispatch config for ``arch`` (``sm_90``); FuselightError when it has none (no device
    description). Device facts come from the device model; wgmma plans only where the device has
    wgmma and measured wgmma tiles."""
    path = config_dir() / "gemm" / "dispatch.json"
    node: Any = read_json_object(path, missing=f"gemm dispatch config not found: {path}")
    device = require_device(arch)
    tiles = load_tiles(arch)
    measured_efficiency = {str(k): float(v) for entry in node.values() if isinstance(entry, dict)
                           for k, v in entry.get("efficiency", {}).items()}
    cfg, where = arch_entry(path, arch, lambda d, t: arch_config.dispatch(d, t, measured_efficiency, tiles))
    try:
        efficiency = {str(k): float(v) for k, v in cfg["efficiency"].items()}
        has_wgmma = WGMMA in efficiency and device.has("wgmma")
        wgmma_tiles = {_wgmma_name(n): t for n, t in load_wgmma_tiles(arch).items()} if has_wgmma else {}
        wgmma = {name: t for name, t in wgmma_tiles.items() if name in efficiency}
        # Without wgmma on the device its tiles' efficiencies are not asked for.
        unknown = sorted(k for k in efficiency if k not in tiles and k not in wgmma and (has_wgmma or not k.startswith(WGMMA)))
        if unknown:
            raise FuselightError(f"{where}: efficiency for unknown tiles {unknown}")
        cost_model = str(cfg.get("cost_model", "analytic"))
        if cost_model not in COST_MODELS:
            raise FuselightError(f"{where}: cost_model {cost_model!r} is not one of {list(COST_MODELS)}")
        measured = {
            shape: [(int(upper), _plan(tiles, wgmma, str(name))) for upper, name in table]
            for shape, table in cfg.get("measured", {}).items()
        }
        return Dispatch(
            sms=device.sms,
            smem_per_sm=device.smem_per_sm,
            smem_per_block=device.smem_per_block_optin,
            threads_per_sm=device.max_threads_per_sm,
            peak_tflops=device.fp16_tensor_tflops * float(cfg["mma_sync_peak_fraction"]),
            wgmma_peak_tflops=device.fp16_tensor_tflops if device.has("wgmma") else 0.0,
            dram_gbps=device.dram_gbps,
            sm_gbps=float(cfg["sm_gbps"]),
            wgmma_sm_gbps=float(cfg.get("wgmma_sm_gbps", cfg["sm_gbps"])),
            launch_us=device.launch_us,
            min_static_m=int(cfg["min_static_m"]),
            m_grid=tuple(int(m) for m in cfg["m_grid"]),
            split_k=tuple(int(s) for s in cfg["split_k"]),
            keep_within=float(cfg["keep_within"]),
            efficiency=efficiency,
            tiles={name: tiles[name] for name in efficiency if name in tiles},
            wgmma=wgmma,
            measured=measured,
            arch=arch,
            cost_model=cost_model,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise FuselightError(f"{where}: malformed dispatch config ({err!r})") from None


def plan_name(plan: Plan, d: Dispatch) -> str:
    """A plan's name in tables: ``wgmma[-<tile>][/sk<split>]`` or ``<main tile>[+<rest tile>][/sk<split>]``."""
    if isinstance(plan, WgmmaPlan):
        key = next(name for name, t in d.wgmma.items() if t == plan.tile)
    else:
        names = {t: name for name, t in d.tiles.items()}
        key = names[plan.main] + (f"+{names[plan.rest]}" if plan.rest is not None else "")
    return key + (f"/sk{plan.split_k}" if plan.split_k > 1 else "")


def _plan(tiles: dict[str, GemmTile], wgmma: dict[str, WgmmaTile], name: str) -> Plan:
    """The plan ``plan_name`` gives ``name``."""
    main, _, split = name.partition("/sk")
    if main.startswith(WGMMA):
        if main not in wgmma:
            raise FuselightError(f"measured plan {name!r} has no wgmma tile with an efficiency")
        return WgmmaPlan(tile=wgmma[main], split_k=int(split or 1))
    main, _, rest = main.partition("+")
    return GemmPlan(main=tiles[main], rest=tiles[rest] if rest else None, split_k=int(split or 1))


def _resident(tile: GemmTile | WgmmaTile, smem: int, d: Dispatch) -> int:
    return max(1, min(d.smem_per_sm // smem, d.threads_per_sm // tile.threads))


def _name(tile: GemmTile, d: Dispatch) -> str:
    return next(name for name, t in d.tiles.items() if t == tile)


def _waves_us(block_m: int, block_n: int, blocks: int, k: float, resident: int, tflops_per_sm: float,
              sm_gbps: float, d: Dispatch) -> float:
    """Time of ``blocks`` blocks of ``block_m x block_n x k``, ``resident`` sharing an SM: a block
    takes the longer of its tensor-core work and streaming its operands at one SM's rate."""
    compute_us = 2 * block_m * block_n * k / (tflops_per_sm * 1e6)
    stream_us = (block_m + block_n) * k * IN_BYTES / (sm_gbps * 1e3)
    return math.ceil(blocks / (d.sms * resident)) * resident * max(compute_us, stream_us)


def estimate_us(plan: Plan, m: int, n: int, k: int, d: Dispatch) -> float:
    """Estimated microseconds of ``plan`` for an ``m x n x k`` GEMM (see the module docstring)."""
    moved = (n * k + m * k + m * n) * IN_BYTES
    if isinstance(plan, WgmmaPlan):
        tile = plan.tile
        blocks = math.ceil(m / tile.block_m) * math.ceil(n / tile.block_n) * plan.split_k
        per_sm = d.wgmma_peak_tflops * d.efficiency[plan_name(WgmmaPlan(tile), d)] / d.sms
        compute = _waves_us(tile.block_m, tile.block_n, blocks, k / plan.split_k,
                            _resident(tile, tile.smem_bytes, d), per_sm, d.wgmma_sm_gbps, d)
    else:
        main, rest = plan.main, plan.rest or plan.main
        whole = m // main.block_m if plan.rest is not None else 0
        left = m - whole * main.block_m
        compute = 0.0
        for tile, rows_tiles in ((main, whole), (rest, math.ceil(left / rest.block_m))):
            if rows_tiles == 0:
                continue
            blocks = rows_tiles * math.ceil(n / tile.block_n) * plan.split_k
            per_sm = d.peak_tflops * d.efficiency[_name(tile, d)] / d.sms
            compute += _waves_us(tile.block_m, tile.block_n, blocks, k / plan.split_k,
                                 _resident(tile, tile.shared_bytes, d), per_sm, d.sm_gbps, d)
    reduce_us = 0.0
    if plan.split_k > 1:
        # The GEMM writes fp32 partials after its K loop (nothing left to overlap them with); a
        # second kernel reads them and runs the epilogue.
        partials = plan.split_k * m * n * ACC_BYTES
        reduce_us = (2 * partials + m * n * IN_BYTES) / (d.dram_gbps * 1e3) + d.launch_us
    return max(compute, moved / (d.dram_gbps * 1e3)) + d.launch_us + reduce_us


def _cost(plan: Plan, m: int, n: int, k: int, d: Dispatch) -> float:
    """What choosing compares: the learned model's prediction where the config asks for it and the
    arch has a trained model (``fuselight tune gemm-model``), else the estimate (cold start)."""
    if d.cost_model == "xgboost":
        # Imported here: xgboost only where a config asks for the model.
        from .cost_model import load_model

        model = load_model(d.arch)
        if model is not None:
            return model.predict_us(plan, m, n, k)
    return estimate_us(plan, m, n, k, d)


def _fits(plan: Plan, ops: GemmOperands, smem_limit: int | None = None) -> bool:
    try:
        if isinstance(plan, WgmmaPlan):
            check_tile(plan.tile, ops, plan.split_k)
        else:
            check_plan(plan, ops, smem_limit)
    except FuselightError:
        return False
    return True


def _measured(ops: GemmOperands, d: Dispatch) -> list[tuple[int, Plan]] | None:
    """The measured ranges for ``ops``' shape, if the table has them and every plan fits ``ops``."""
    table = d.measured.get(f"{ops.n}x{ops.k}")
    return table if table and all(_fits(plan, ops, d.smem_per_block) for _, plan in table) else None


def candidates(ops: GemmOperands, d: Dispatch) -> list[Plan]:
    """Every plan the config allows that can tile ``ops``."""
    tiles = list(d.tiles.values())
    plans: list[Plan] = [WgmmaPlan(tile, split) for tile, split in itertools.product(d.wgmma.values(), d.split_k)]
    for main, rest, split in itertools.product(tiles, [None, *tiles], d.split_k):
        if rest is None or (rest.block_m < main.block_m and rest.block_n == main.block_n):
            plans.append(GemmPlan(main=main, rest=rest, split_k=split))
    return [p for p in plans if _fits(p, ops, d.smem_per_block)]


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
    wgmma plan first, an mma.sync one where wgmma cannot: a symbolic N, the LM head). Empty: the
    arch has no entry, or no plan of a range can serve ``ops`` (the function is left to the next
    rule). A static M gets the one range holding it."""
    device = device_model(arch)
    if ops.dequant is None or device is None:
        return []
    cfg, where = arch_entry(config_dir() / "gemm" / "mma_sync_q4.json", arch,
                            lambda d, t: arch_config.mma_sync_q4(d, t, q4_tile_bytes))
    limit = device.smem_per_block_optin
    try:
        tiles = {str(name): GemmTile(**fields) for name, fields in cfg["tiles"].items()}
        for name, tile in tiles.items():
            check_gemm_tile(tile, name)  # its 4-bit shared memory is checked against ``limit`` by _fits
        wgmma = ({_wgmma_name(str(name)): WgmmaTile(**fields) for name, fields in cfg.get("wgmma_tiles", {}).items()}
                 if device.has("wgmma") else {})
        table = [
            (None if upper is None else int(upper), [str(n) for n in (names if isinstance(names, list) else [names])])
            for upper, names in cfg["ranges"]
        ]
        splits = [int(s) for s in cfg["split_k"]]
        min_blocks = int(cfg["min_blocks"])
        if not table or table[-1][0] is not None or any(u is None for u, _ in table[:-1]):
            raise ValueError("ranges must end with one [null, plan]")
        if any(not names for _, names in table):
            raise ValueError("a range names no plan")
        for _, names in table:
            for name in names:
                _plan(tiles, wgmma, name)
    except (KeyError, TypeError, ValueError) as err:
        raise FuselightError(f"{where}: malformed config ({err!r})") from None
    ranges: list[tuple[int, Plan]] = []
    for i, (upper, names) in enumerate(table):
        plan = next((p for p in (_plan(tiles, wgmma, name) for name in names) if _fits(p, ops, limit)), None)
        if plan is None:
            return []
        if i == len(table) - 1:
            upper = 2**31 - 1  # every larger M
        elif isinstance(ops.n, int) and plan.split_k == 1:
            # Split K until the range's largest M fills the GPU (where K allows it).
            tile = plan.tile if isinstance(plan, WgmmaPlan) else plan.main
            for split in splits:
                blocks = -(-upper // tile.block_m) * (ops.n // tile.block_n) * split
                if _fits(dataclasses.replace(plan, split_k=split), ops, limit):
                    plan = dataclasses.replace(plan, split_k=split)
                    if blocks >= min_blocks:
                        break
        ranges.append((upper, plan))
    if _static(ops.m):
        m = int(ops.m)
        return [next((r for r in ranges if m <= r[0]), ranges[-1])]
    return ranges
