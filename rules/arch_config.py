"""Every rule family's config for a target arch: the measured entry of ``configs/<family>/<name>.json``
where the arch has one, else the analytic one below, computed from the device model
(``fuselight.device``).

Only sm_90 is measured (the GPU host's); an arch that is described but unmeasured (sm_80, sm_86,
sm_89) gets configs that fit its shared memory, registers and threads, with grid sizes from its SM
count. An arch without a description gets no config: the
rules then leave its functions to DLight. A template's shared-memory formula stays with the
template; the analytic functions take it as an argument. The choices that do not depend on the
device (warps, unrolls, split bounds: those measured best on sm_90) are each file's ``analytic``
entry, not code.
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
ANALYTIC = "analytic"  # the key of a config file's arch-independent choices
PER_SM = "per_sm"  # a count written {"per_sm": k}: k x the device's SM count
Analytic = Callable[[DeviceModel, Any], Any]  # (device, the file's "analytic" entry) -> the arch's entry
TileBytes = Callable[[dict[str, int]], int]


def arch_entry(path: Path, arch: str, analytic: Analytic) -> tuple[Any, str]:
    """The config file ``path``'s entry for ``arch`` where measured, else, for a described arch,
    ``analytic(device, template)`` of the file's ``analytic`` entry (the arch-independent choices),
    with where it came from (for errors); FuselightError for an undescribed arch."""
    node: Any = read_json_object(path, missing=f"config not found: {path}")
    device = device_model(arch)
    if arch in node:
        where = f"{path}[{arch!r}]"
        return per_sm_counts(device, node[arch], where), where
    if device is None:
        raise FuselightError(f"{path}: no entry {arch!r} and no device description of it (unsupported target arch)")
    if not isinstance(node.get(ANALYTIC), dict):
        raise FuselightError(f"{path}: no entry {arch!r} and no {ANALYTIC!r} entry to derive one from")
    where = f"{path}[{ANALYTIC!r}]"
    try:
        entry = analytic(device, node[ANALYTIC])
    except (KeyError, TypeError, ValueError) as err:
        raise FuselightError(f"{where}: malformed ({err!r})") from None
    return per_sm_counts(device, entry, where), f"{where} for {arch}"


def per_sm_counts(device: DeviceModel | None, node: Any, where: str) -> Any:
    """``node`` (a config entry) with every ``{"per_sm": k}`` in it replaced by k x the device's SM
    count; FuselightError naming the entry for a bad k or where there is no device description."""
    if isinstance(node, list):
        return [per_sm_counts(device, v, f"{where}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if set(node) != {PER_SM}:
        return {k: per_sm_counts(device, v, f"{where}[{k!r}]") for k, v in node.items()}
    k = node[PER_SM]
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise FuselightError(f"{where}: {PER_SM!r} must be a positive integer, got {k!r}")
    if device is None:
        raise FuselightError(f"{where}: a count per SM, and no device description to resolve it")
    return k * device.sms


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
    """``cls(**node)`` where every field is a positive int, a boolean where its default is one, or a
    string where it is annotated one (a field with a default may be left out)."""
    if not isinstance(node, dict):
        raise FuselightError(f"{where}: must be an object")
    values = {}
    for field in dataclasses.fields(cls):
        if field.name not in node and field.default is not dataclasses.MISSING:
            continue
        v = node.get(field.name)
        if isinstance(field.default, bool):
            if not isinstance(v, bool):
                raise FuselightError(f"{where}: field {field.name!r} must be true or false, got {v!r}")
        elif str(field.type).startswith("str"):
            if not isinstance(v, str):
                raise FuselightError(f"{where}: field {field.name!r} must be a string, got {v!r}")
        elif not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise FuselightError(f"{where}: field {field.name!r} must be a positive integer, got {v!r}")
        values[field.name] = v
    return cls(**values)


# --- the analytic configs, one function per config file --------------------------------------


def _plain(t: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in t.items() if not k.startswith("_")}


def prefill(device: DeviceModel, t: dict, head_dims: tuple[int, ...], smem: Callable[[int, int, int], int]) -> dict:
    """Flash prefill: ``t["warps"]``, the first of ``t["tile_kv"]`` whose ``smem(warps, tile_kv,
    head_dim)`` fits the device's static shared memory of a block."""
    out = {}
    for head_dim in head_dims:
        tile_kv = next((kv for kv in t["tile_kv"] if smem(t["warps"], kv, head_dim) <= device.smem_per_block), None)
        if tile_kv is not None:
            out[str(head_dim)] = {"warps": t["warps"], "tile_kv": tile_kv}
    return out


def as_written(device: DeviceModel, t: dict) -> dict:
    """The ``analytic`` entry as written (split-KV decode, the 4-bit GEMV buckets): no field depends
    on the device but its counts per SM (``per_sm_counts``)."""
    del device
    return _plain(t)


def rope_append(device: DeviceModel, t: dict) -> dict:
    """RoPE + append: ``warps`` warps a block."""
    return {"threads": t["warps"] * device.warp_size}


def rowwise(device: DeviceModel, t: dict) -> dict:
    """Row reductions: block sizes in warps."""
    row, split = _plain(t["row"]), _plain(t["split"])
    return {
        "row": {**row, "block_threads": row.pop("block_warps") * device.warp_size},
        "split": {**split, "split_threads": split.pop("split_warps") * device.warp_size},
    }


def gemv(device: DeviceModel, t: dict) -> dict:
    """GEMV buckets: the L2 prefetch ahead of the grid wait (TMA's bulk prefetch, then
    griddepcontrol.wait) only where the device has both."""
    prefetch = device.has("tma") and device.has("griddepcontrol")
    drop = () if prefetch else ("prefetch_l2_percent",)
    return {name: {k: v for k, v in fields.items() if k not in drop} for name, fields in _plain(t).items()}


def tile_name(t: dict[str, int], prefix: str = "") -> str:
    """``mMnNkKwWMxWNsS`` (the configs' naming)."""
    return f"{prefix}m{t['block_m']}n{t['block_n']}k{t['block_k']}w{t['warps_m']}x{t['warps_n']}s{t['stages']}"


def _shape(name: str) -> str:
    """A tile's name without its stages."""
    return name.rsplit("s", 1)[0]


def fitted_tiles(device: DeviceModel, tiles: dict[str, dict], tile_bytes: TileBytes, prefix: str = "") -> dict[str, dict]:
    """Each tile with the most stages (at most its own, at least 2) whose ``tile_bytes`` fit the
    device's opt-in shared memory of a block, renamed for them; a tile whose threads exceed a block
    or that fits with no stages is left out."""
    fitted = {}
    for fields in tiles.values():
        if fields["warps_m"] * fields["warps_n"] * device.warp_size > device.max_threads_per_block:
            continue
        for stages in range(fields["stages"], 1, -1):
            f = {**fields, "stages": stages}
            if tile_bytes(f) <= device.smem_per_block_optin:
                fitted[tile_name(f, prefix)] = f
                break
    return fitted


def mma_sync(device: DeviceModel, t: dict, tile_bytes: TileBytes) -> dict:
    """The mma.sync GEMM's candidate tiles (``fitted_tiles``)."""
    return fitted_tiles(device, _plain(t), tile_bytes)


def dispatch(device: DeviceModel, t: dict, tiles: dict[str, Any]) -> dict:
    """GEMM dispatch: ``t`` with, for each candidate tile, ``t["efficiency"]``'s value for its shape
    at any stage count (fitted to another arch's measured times; the lowest for a shape never
    measured: no unmeasured tile wins on a guess)."""
    del device  # its facts enter the Dispatch directly (rules/gemm/dispatch.py)
    by_shape = {_shape(name): e for name, e in _plain(t["efficiency"]).items()}
    fallback = min(by_shape.values())
    return {**_plain(t), "efficiency": {name: by_shape.get(_shape(name), fallback) for name in tiles}}


def mma_sync_q4(device: DeviceModel, t: dict, tile_bytes: TileBytes) -> dict:
    """The 4-bit GEMM: ``t``'s tiles fitted (``fitted_tiles``); each range keeps the plans whose
    tiles (named without stages, ``main+rest``) all fit."""
    tiles = fitted_tiles(device, t["tiles"], tile_bytes, prefix="q4-")
    by_shape = {_shape(name): name for name in tiles}

    def fitted(plan: str) -> str | None:
        names = [by_shape.get(part) for part in plan.split("+")]
        return None if None in names else "+".join(names)

    ranges = [[upper, [f for f in map(fitted, plans) if f is not None]] for upper, plans in t["ranges"]]
    return {"tiles": tiles, "ranges": [r for r in ranges if r[1]], "split_k": t["split_k"],
            "min_blocks": t["min_blocks"]}
