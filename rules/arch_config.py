"""Every rule family's config for a target arch: the measured entry of ``configs/<family>/<name>.json``
where the arch has one, else the analytic one below, computed from the device model
(``fuselight.device``).

Only sm_90 is measured (the GPU host's); an arch that is described but unmeasured (sm_80, sm_86,
sm_89) gets configs that fit its shared memory, registers and threads, with grid sizes from its SM
count; the template-level choices (warps, unrolls, split bounds) are the ones measured best on
sm_90, none of which depends on a Hopper feature. An arch without a description gets no config: the
rules then leave its functions to DLight. A template's shared-memory formula stays with the
template; the analytic functions take it as an argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fuselight.device import DeviceModel, device_model
from fuselight.errors import FuselightError
from fuselight.jsonfile import read_json_object
from fuselight.paths import config_dir

C = TypeVar("C")
Analytic = Callable[[DeviceModel], Any]
TileBytes = Callable[[dict[str, int]], int]


def arch_entry(path: Path, arch: str, analytic: Analytic) -> tuple[Any, str]:
    """The config file ``path``'s entry for ``arch`` where measured, else ``analytic(device)`` for a
    described arch, with where it came from (for errors); FuselightError for an undescribed one."""
    node: Any = read_json_object(path, missing=f"config not found: {path}")
    if arch in node:
        return node[arch], f"{path}[{arch!r}]"
    device = device_model(arch)
    if device is None:
        raise FuselightError(f"{path}: no entry {arch!r} and no device description of it (unsupported target arch)")
    return analytic(device), f"{path.name} for {arch} (analytic, from configs/targets/devices.json)"


def load_arch_config(family: str, name: str, arch: str, cls: type[C], *keys: str, analytic: Analytic) -> C:
    """``cls`` built from the arch's entry (``arch_entry``) at ``[keys...]``; every field a positive
    int (a field with a default may be left out).

    family: the template family (``attention``, ``gemm``); name: the config file in it.
    """
    node, where = arch_entry(config_dir() / family / f"{name}.json", arch, analytic)
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            raise FuselightError(f"{where}: no entry {key!r} (unsupported shape)")
        node, where = node[key], f"{where}[{key!r}]"
    return from_fields(cls, node, where)


def from_fields(cls: type[C], node: Any, where: str) -> C:
    """``cls(**node)`` where every field is a positive int (a field with a default may be left out)."""
    if not isinstance(node, dict):
        raise FuselightError(f"{where}: must be an object")
    values = {}
    for field in dataclasses.fields(cls):
        if field.name not in node and field.default is not dataclasses.MISSING:
            continue
        v = node.get(field.name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise FuselightError(f"{where}: field {field.name!r} must be a positive integer, got {v!r}")
        values[field.name] = v
    return cls(**values)


# --- the analytic configs, one function per config file --------------------------------------


def prefill(device: DeviceModel, head_dims: tuple[int, ...], smem: Callable[[int, int, int], int]) -> dict:
    """Flash prefill: 4 warps (64 query rows), the longest KV tile (128, 64, 32, 16 rows) whose
    ``smem(warps, tile_kv, head_dim)`` fits the static shared memory of a block."""
    warps = 4
    out = {}
    for head_dim in head_dims:
        tile_kv = next((t for t in (128, 64, 32, 16) if smem(warps, t, head_dim) <= device.smem_per_block), None)
        if tile_kv is not None:
            out[str(head_dim)] = {"warps": warps, "tile_kv": tile_kv}
    return out


def decode(device: DeviceModel) -> dict:
    """Split-KV decode: split until 8 blocks an SM (a few waves of 4-warp blocks, as on sm_90)."""
    return {"warps": 4, "rows_per_step": 2, "target_blocks": 8 * device.sms, "max_splits": 64,
            "min_rows_per_split": 32, "merge_groups": 16}


def rope_append(device: DeviceModel) -> dict:
    """RoPE + append: 8 warps a block."""
    return {"threads": 8 * device.warp_size}


def rowwise(device: DeviceModel) -> dict:
    """Row reductions: 8-warp blocks; rows split while there are fewer than two blocks an SM."""
    return {
        "row": {"block_threads": 8 * device.warp_size, "warp_max_cols": 1024, "warp_rows_per_block": 4,
                "max_reg_elements": 32, "load_bytes": 16},
        "split": {"split_threads": 16 * device.warp_size, "below_rows": 2 * device.sms, "min_cols": 16384,
                  "target_blocks": 2 * device.sms, "min_chunk": 4096, "max_splits": 64},
    }


def gemv(device: DeviceModel) -> dict:
    """GEMV buckets (fp16 weights): at M = 1 the row template, 16 warps a block where the grid is
    at most 2 (one resident block an SM) or 4 (two) blocks an SM, else 8 warps at 2 blocks an SM;
    the mma template above. The L2 prefetch ahead of the grid wait needs TMA's bulk prefetch and
    griddepcontrol."""
    row16 = {"max_m": 1, "rows_per_warp": 1, "warps": 16, "unroll": 4}
    buckets = {
        "m1_2_per_sm_k4096": {**row16, "max_blocks": 2 * device.sms, "max_k": 4096, "min_blocks_per_sm": 1},
        "m1_2_per_sm": {**row16, "max_blocks": 2 * device.sms, "min_blocks_per_sm": 1},
        "m1_4_per_sm": {**row16, "max_blocks": 4 * device.sms, "min_blocks_per_sm": 2},
        "m1": {"max_m": 1, "rows_per_warp": 1, "warps": 8, "unroll": 8, "min_blocks_per_sm": 2},
        **{f"m{m}": {"max_m": m, "warps": 16, "unroll": 4, "min_blocks_per_sm": 1, "lane_run": 2} for m in (2, 4, 8)},
        "m16": {"max_m": 16, "warps": 4, "unroll": 4, "min_blocks_per_sm": 1, "lane_run": 2},
    }
    if device.has("tma") and device.has("griddepcontrol"):
        buckets["m1_2_per_sm_k4096"]["prefetch_l2_percent"] = 25
    return buckets


def gemv_q4(device: DeviceModel) -> dict:
    """GEMV buckets (4-bit weights): 8 warps at 2 blocks an SM, the row template at M = 1."""
    del device  # the same on every described arch: 512 threads at 2 blocks fit every SM's threads
    return {
        "m1": {"max_m": 1, "rows_per_warp": 2, "warps": 8, "unroll": 4, "min_blocks_per_sm": 2},
        **{f"m{m}": {"max_m": m, "warps": 8, "unroll": 1, "min_blocks_per_sm": 2, "lane_run": 1} for m in (2, 4, 8, 16)},
    }


# mma.sync tile shapes (block_m, block_n, block_k, warps_m, warps_n) and the most stages worth having.
MMA_SHAPES = ((128, 256, 64, 2, 4, 3), (256, 128, 64, 4, 2, 3), (128, 128, 64, 2, 2, 4), (128, 128, 32, 2, 2, 5),
              (64, 256, 64, 2, 4, 4), (32, 256, 64, 1, 8, 4), (64, 128, 64, 2, 2, 4), (32, 128, 64, 1, 4, 5),
              (16, 128, 64, 1, 4, 6))
Q4_SHAPES = ((128, 256, 64, 2, 4, 4), (32, 256, 64, 1, 8, 4), (128, 128, 64, 2, 2, 4), (128, 128, 64, 2, 4, 4),
             (64, 128, 64, 2, 2, 4), (32, 128, 64, 1, 4, 5))


def tile_name(t: dict[str, int], prefix: str = "") -> str:
    """``mMnNkK wWMxWN sS`` (the configs' naming)."""
    return (f"{prefix}m{t['block_m']}n{t['block_n']}k{t['block_k']}w{t['warps_m']}x{t['warps_n']}s{t['stages']}")


def fitted_tiles(device: DeviceModel, shapes: tuple, tile_bytes: TileBytes, prefix: str = "") -> dict[str, dict]:
    """Each shape with the most stages (at least 2) whose ``tile_bytes`` fit the block's opt-in shared
    memory and whose threads fit a block; shapes that fit with no stages are left out."""
    tiles = {}
    for bm, bn, bk, wm, wn, most in shapes:
        if wm * wn * device.warp_size > device.max_threads_per_block:
            continue
        for stages in range(most, 1, -1):
            t = {"block_m": bm, "block_n": bn, "block_k": bk, "warps_m": wm, "warps_n": wn, "stages": stages}
            if tile_bytes(t) <= device.smem_per_block_optin:
                tiles[tile_name(t, prefix)] = t
                break
    return tiles


def mma_sync(device: DeviceModel, tile_bytes: TileBytes) -> dict:
    """The mma.sync GEMM's candidate tiles (``fitted_tiles`` of ``MMA_SHAPES``)."""
    return fitted_tiles(device, MMA_SHAPES, tile_bytes)


def dispatch(device: DeviceModel, defaults: dict[str, Any], measured_efficiency: dict[str, float],
             tiles: dict[str, Any]) -> dict:
    """GEMM dispatch where the arch has no measured entry: ``defaults`` (dispatch.json's ``analytic``
    entry) and, for each candidate tile, the efficiency measured on another arch for its shape at any
    stage count (the lowest measured one for a shape never measured: no unmeasured tile wins on a guess)."""
    del device  # its facts enter the Dispatch directly (rules/gemm/dispatch.py)
    by_shape = {_shape(name): e for name, e in measured_efficiency.items() if not name.startswith("wgmma")}
    fallback = min(by_shape.values())
    return {**{k: v for k, v in defaults.items() if not k.startswith("_")},
            "efficiency": {name: by_shape.get(_shape(name), fallback) for name in tiles}}


def _shape(name: str) -> str:
    return name.rsplit("s", 1)[0]


def mma_sync_q4(device: DeviceModel, tile_bytes: TileBytes) -> dict:
    """The 4-bit GEMM: the mma.sync tiles of ``Q4_SHAPES`` that fit, by M range as measured on
    sm_90 (32-row tiles to 64, 64-row to 256, 128-row beyond), split-K until a range fills every SM."""
    tiles = fitted_tiles(device, Q4_SHAPES, tile_bytes, prefix="q4-")

    def pick(*shapes: str) -> list[str]:
        return [n for s in shapes for n in tiles if _shape(n) == s]

    big, rest = pick("q4-m128n256k64w2x4"), pick("q4-m32n256k64w1x8")
    ranges = [[64, pick("q4-m32n128k64w1x4")], [256, pick("q4-m64n128k64w2x2")],
              [1024, pick("q4-m128n128k64w2x4", "q4-m64n128k64w2x2")],
              [None, [f"{big[0]}+{rest[0]}"] if big and rest else pick("q4-m128n128k64w2x4", "q4-m64n128k64w2x2")]]
    return {"tiles": tiles, "ranges": [[upper, names] for upper, names in ranges if names],
            "split_k": [1, 2, 4], "min_blocks": device.sms}
