"""The programmatic-launch SASS audit (``fuselight.pdl_audit``): parsing cuobjdump's listing, which
instructions count as touching memory before the wait, and the CLI's errors. Reading real fatbins
needs cuobjdump (the GPU host); the committed audit of the LLaMA-3-8B library is in bench/results/h100/e2e-llama-3-8b.json (meta.pdl_audit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fuselight.cli import main
from fuselight.errors import FuselightError
from fuselight.library import aot_dir, metadata_path
from fuselight.pdl_audit import audit_if_possible, fatbins, parse_sass, summary


def _line(addr: int, text: str) -> str:
    # cuobjdump -sass: address, instruction, encoding; a second line carries the rest of the encoding
    return f"        /*{addr:04x}*/                   {text} ;   /* 0x000000000000782e */\n{' ' * 86}/* 0x000fe20000000800 */\n"


def _function(name: str, instructions: list[str]) -> str:
    body = "".join(_line(16 * i, text) for i, text in enumerate(instructions))
    return f"\t\tFunction : {name}\n\t.headerflags\t@\"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\"\n{body}\t\t..........\n\n"


LISTING = "\n\tcode for sm_90\n\t.target\tsm_90\n\n" + "".join([
    # wait first, loads after: ordered
    _function("wait_first", ["LDC R1, c[0x0][0x28]", "S2R R0, SR_TID.X", "ACQBULK", "LDG.E.128.CONSTANT R4, desc[UR4][R2.64]", "EXIT"]),
    # a read-only load scheduled above the wait: out of order
    _function("load_first", ["S2R R0, SR_TID.X", "LDG.E.128.CONSTANT R4, desc[UR4][R2.64]", "@!P0 BRA 0x130", "ACQBULK", "EXIT"]),
    # a predicated store and a generic load before the wait: both count
    _function("store_first", ["@P0 STG.E desc[UR4][R2.64], R5", "LD.E R6, [R8.64]", "ACQBULK", "EXIT"]),
    # local and shared memory are the block's own: not counted
    _function("local_first", ["STL [R1], R4", "LDS R5, [R6]", "ACQBULK", "LDG.E R7, desc[UR4][R2.64]", "EXIT"]),
    # no wait at all (launched normally): nothing to order
    _function("no_wait", ["LDG.E R7, desc[UR4][R2.64]", "STG.E desc[UR4][R2.64], R7", "EXIT"]),
])


def test_parse_sass_finds_each_kernel_and_its_wait():
    kernels = {k.kernel: k for k in parse_sass(LISTING)}
    assert list(kernels) == ["wait_first", "load_first", "store_first", "local_first", "no_wait"]
    assert kernels["wait_first"].wait_at == 2 and kernels["wait_first"].instructions == 5
    assert kernels["wait_first"].ordered and kernels["wait_first"].memory_before_wait == ()
    assert kernels["load_first"].wait_at == 3 and not kernels["load_first"].ordered
    assert kernels["load_first"].memory_before_wait == ("LDG.E.128.CONSTANT R4, desc[UR4][R2.64]",)
    assert kernels["store_first"].memory_before_wait == ("STG.E desc[UR4][R2.64], R5", "LD.E R6, [R8.64]")
    assert kernels["local_first"].ordered
    assert kernels["no_wait"].wait_at is None and kernels["no_wait"].ordered


def test_summary_lists_only_the_out_of_order_kernels():
    found = summary(parse_sass(LISTING))
    assert (found["kernels"], found["waiting"]) == (5, 4)
    assert [k["kernel"] for k in found["out_of_order"]] == ["load_first", "store_first"]
    assert found["out_of_order"][0]["wait_at"] == 3


def test_a_library_without_compiled_cuda_is_a_clear_error(tmp_path: Path, capsys):
    lib = tmp_path / "model.so"
    lib.write_bytes(b"not a library")
    with pytest.raises(Exception, match=r"no compiled CUDA beside it"):
        fatbins(lib)
    assert main(["audit-pdl", str(lib)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and ("no compiled CUDA" in err or "cuobjdump not found" in err)


def test_a_ptx_library_has_no_sass_to_audit(tmp_path: Path):
    lib = tmp_path / "model.so"
    lib.write_bytes(b"not a library")
    aot_dir(lib).mkdir()
    (aot_dir(lib) / "k.fatbin").write_bytes(b"PTX")
    metadata_path(lib).write_text(json.dumps({"target": "cuda", "arch": "sm_80", "ptx": True}))
    with pytest.raises(FuselightError, match=r"built with --ptx, its SASS is made by the driver"):
        fatbins(lib)
    assert audit_if_possible(lib) is None
    metadata_path(lib).write_text(json.dumps({"target": "cuda", "arch": "sm_90", "ptx": False}))
    assert fatbins(lib) == [aot_dir(lib) / "k.fatbin"]


def test_an_allowance_grants_a_kernel_that_many_loads_before_its_wait_and_nothing_else():
    from fuselight.pdl_audit import Allowance

    lengths = ["LDG.E.CONSTANT R0, desc[UR8][R2.64]", "LDG.E.CONSTANT R7, desc[UR8][R2.64+0x4]"]
    listing = "".join([
        _function("attn_kernel_1", [*lengths, "ACQBULK", "LDG.E.128.CONSTANT R4, desc[UR4][R6.64]", "EXIT"]),
        _function("attn_kernel_2", [*lengths, "LDG.E.CONSTANT R9, desc[UR8][R4.64]", "ACQBULK", "EXIT"]),  # one too many
        _function("attn_kernel_3", [lengths[0], "STG.E desc[UR4][R2.64], R5", "ACQBULK", "EXIT"]),  # a store
        _function("other_kernel", [*lengths, "ACQBULK", "EXIT"]),  # not granted
    ])
    granted = [Allowance("attn_kernel_?", 2, "lengths the host uploads")]
    found = summary(parse_sass(listing), granted)
    assert [k["kernel"] for k in found["out_of_order"]] == ["attn_kernel_2", "attn_kernel_3", "other_kernel"]
    assert len(summary(parse_sass(listing), [])["out_of_order"]) == 4


def test_shipped_allowances_cover_only_the_decode_merge_kernels():
    from fuselight.pdl_audit import load_allowances

    (merge,) = load_allowances()
    assert merge.loads == 3 and merge.why
    kernels = parse_sass("".join(_function(name, ["LDG.E.CONSTANT R0, desc[UR8][R2.64]", "ACQBULK", "EXIT"]) for name in
                                 ["fuselight_decode_paged_kv_kernel_1", "fuselight_rope_append_decode_paged_kv_kernel_1",
                                  "fuselight_decode_paged_kv_kernel", "fused_NT_matmul1_astype_kernel"]))
    assert [k.allowed([merge]) for k in kernels] == [True, True, False, False]


def test_a_malformed_allowance_is_a_clear_error(tmp_path: Path, monkeypatch):
    import json

    from fuselight import pdl_audit

    (tmp_path / "pdl_audit.json").write_text(json.dumps({"loads_before_wait": [{"kernel": "x", "loads": 0, "why": "w"}]}))
    monkeypatch.setattr(pdl_audit, "config_dir", lambda: tmp_path)
    with pytest.raises(Exception, match=r"loads_before_wait\[0\] needs 'kernel'"):
        pdl_audit.load_allowances()
