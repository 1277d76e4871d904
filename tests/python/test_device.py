"""The device model (``fuselight.device``, ``configs/targets/devices.json``): its descriptions, and
that no code or config restates one of its facts."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fuselight import device as dm
from fuselight.errors import FuselightError
from fuselight.paths import config_dir

ROOT = Path(__file__).resolve().parents[2]
CODE = [ROOT / "rules", ROOT / "passes", ROOT / "python" / "fuselight"]
# Configs not scanned: the device model itself, the models' shapes (a vocabulary of 49152 is no
# shared-memory size) and the trained GEMM cost model (tree ids and split thresholds).
CONFIG_SKIP = ("targets", "models")
TRAINED = re.compile(r"cost-model-")
ARCH = re.compile(r"sm_\d+")
# Facts distinctive enough that a literal equal to one is a copy (a warp of 32 or 1024 threads is
# not: those numbers mean many other things).
FACTS = ("sms", "smem_per_block", "smem_per_block_optin", "smem_per_sm", "l2_bytes", "regs_per_sm",
         "dram_peak_gbps", "dram_measured_gbps", "fp16_tensor_tflops", "fp32_tflops")


def device_facts() -> dict[float, str]:
    """value -> "arch.field" of every distinctive fact of every description."""
    return {float(getattr(d, f)): f"{d.arch}.{f}" for d in dm.devices() for f in FACTS if getattr(d, f) is not None}


def restated_facts(source: str, facts: dict[float, str]) -> list[tuple[int, str]]:
    """(line, fact) for each number in ``source``'s code (not its strings) equal to a fact: a
    literal, or a product of literals (``48 * 1024``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        value = None
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            value = node.value
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
              and all(isinstance(x, ast.Constant) and isinstance(x.value, int) for x in (node.left, node.right))):
            value = node.left.value * node.right.value
        if value is not None and float(value) in facts:
            found.append((node.lineno, facts[float(value)]))
    return found


def restated_in_config(node: Any, facts: dict[float, str], arch: str | None = None, where: str = "") -> Iterator[str]:
    """``where: fact`` for each number of a config (not its ``_doc`` strings) equal to a fact, or, in
    an arch's entry (``arch``, or a key ``sm_NN``), a multiple of that arch's SM count: a grid size
    the config should write as ``{"per_sm": k}``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not key.startswith("_"):
                inner = key if ARCH.fullmatch(key) else arch
                yield from restated_in_config(value, facts, inner, f"{where}[{key!r}]")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from restated_in_config(value, facts, arch, f"{where}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        device = dm.device_model(arch)
        if float(node) in facts:
            yield f"{where}: {facts[float(node)]}"
        elif device is not None and node > 0 and node % device.sms == 0:
            yield f"{where}: {node // device.sms} x {arch}.sms"


def test_no_config_restates_a_device_fact():
    facts = device_facts()
    offenders = []
    for path in sorted(config_dir().rglob("*.json")):
        rel = path.relative_to(config_dir())
        if rel.parts[0] in CONFIG_SKIP or TRAINED.match(path.name):
            continue
        arch = ARCH.search(path.stem)  # a measured table of one arch (measured-sm_90.json)
        found = restated_in_config(json.loads(path.read_text()), facts, arch and arch.group())
        offenders += [f"{rel}{f}" for f in found]
    assert offenders == []


def test_the_config_check_finds_a_restated_fact():
    facts = device_facts()
    config = {"_doc": "132 SMs", "analytic": {"smem": 232448, "warps": 4},
              "sm_90": {"max_blocks": 264, "target_blocks": {"per_sm": 2}, "rows": [256, 1056]}}
    assert list(restated_in_config(config, facts)) == [
        "['analytic']['smem']: sm_90.smem_per_block_optin", "['sm_90']['max_blocks']: 2 x sm_90.sms",
        "['sm_90']['rows'][1]: 8 x sm_90.sms"]
    assert list(restated_in_config([216, 256], facts, "sm_80")) == ["[0]: 2 x sm_80.sms"]


def test_no_code_restates_a_device_fact():
    facts = device_facts()
    offenders = [f"{path.relative_to(ROOT)}:{line}: {fact}"
                 for root in CODE for path in sorted(root.rglob("*.py"))
                 for line, fact in restated_facts(path.read_text(), facts)]
    assert offenders == []


def test_the_check_finds_a_restated_fact():
    facts = device_facts()
    source = 'SMEM = 232448\nSTATIC = 48 * 1024\nSMS = 108\n"""132 SMs in a docstring is prose"""\nWARP = 32\n'
    assert restated_facts(source, facts) == [(1, "sm_90.smem_per_block_optin"), (2, "sm_90.smem_per_block"),
                                             (3, "sm_80.sms")]


def test_descriptions_are_the_datasheets():
    h100, a100, a10, l40s = (dm.device_model(a) for a in ("sm_90", "sm_80", "sm_86", "sm_89"))
    assert (h100.sms, a100.sms, a10.sms, l40s.sms) == (132, 108, 72, 142)
    assert h100.dram_gbps == 3000.0 and h100.dram_peak_gbps == 3350.0  # the measured copy rate is used
    assert a100.dram_gbps == a100.dram_peak_gbps == 2039.0  # unmeasured: the datasheet's
    assert h100.host_launch_us == 6.0 and a100.host_launch_us is None
    assert h100.smem_per_block_optin == 227 * 1024 and a100.smem_per_block_optin == 163 * 1024
    assert a10.smem_per_block_optin == l40s.smem_per_block_optin == 99 * 1024
    assert dm.warp_size() == 32 and dm.described_archs() == ("sm_80", "sm_86", "sm_89", "sm_90")


@pytest.mark.parametrize("cap", ["wgmma", "tma", "setmaxnreg", "griddepcontrol"])
def test_hopper_capabilities_are_sm90s_only(cap):
    assert [d.arch for d in dm.devices() if d.has(cap)] == ["sm_90"]


@pytest.mark.parametrize("cap", ["ldmatrix", "cp.async", "mma.sync"])
def test_ampere_capabilities_are_everyones(cap):
    assert all(d.has(cap) for d in dm.devices())


def test_unknown_capability_and_bad_description_are_named(tmp_path, monkeypatch):
    with pytest.raises(FuselightError, match="unknown device capability 'wmma'"):
        dm.device_model("sm_90").has("wmma")
    raw = json.loads((config_dir() / "targets" / "devices.json").read_text())
    del raw["sm_80"]["sms"]
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "devices.json").write_text(json.dumps(raw))
    monkeypatch.setattr(dm, "config_dir", lambda: tmp_path)
    with pytest.raises(FuselightError, match=r"devices.json\['sm_80'\]: a bad device description \('sms'\)"):
        dm.device_model("sm_80")
    assert dm.device_model("sm_75") is None
    with pytest.raises(FuselightError, match="no device description for 'sm_75'"):
        dm.require_device("sm_75")


def test_the_json_doc_is_at_most_three_lines():
    raw = json.loads((config_dir() / "targets" / "devices.json").read_text())
    assert isinstance(raw["_doc"], list) and len(raw["_doc"]) <= 3
