"""A library's artefacts: the PTX build (``--ptx``) for an arch older than the GPU, its sidecar, its label.

The fatbins are read with a parser of their own here (the layout of CUDA's ``fatbinary_section.h``
and the entry headers cuobjdump reads), not with fuselight's code: each entry says whether it is
PTX or machine code (ELF) and for which arch.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
from fuselight import library, runtime
from fuselight.cli import main
from fuselight.cuda_compile import compile_cuda, nvcc_path

needs_nvcc = pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")

FATBIN_MAGIC = 0xBA55ED50
_HEADER = "<IHHQ"  # magic, version, header size, size of the entries after the header
_ENTRY = "<HHIQ"  # kind, -, entry header size, payload size
_ENTRY_ARCH = "<HHI"  # at offset 24: PTX ISA minor, major, arch (80 for sm_80 / compute_80)
_ENTRY_ARCH_OFFSET = 24
KIND = {1: "ptx", 2: "elf"}


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str
    arch: int
    isa: tuple[int, int]  # PTX ISA version of a PTX entry


def fatbin_entries(data: bytes) -> list[Entry]:
    magic, _, header, size = struct.unpack_from(_HEADER, data, 0)
    assert magic == FATBIN_MAGIC and header + size == len(data)
    entries, offset = [], header
    while offset < header + size:
        kind, _, entry_header, payload = struct.unpack_from(_ENTRY, data, offset)
        minor, major, arch = struct.unpack_from(_ENTRY_ARCH, data, offset + _ENTRY_ARCH_OFFSET)
        entries.append(Entry(KIND.get(kind, str(kind)), arch, (major, minor)))
        offset += entry_header + payload
    assert offset == header + size
    return entries


@needs_nvcc
def test_parser_tells_machine_code_from_ptx():
    """The check below means something: the same source built both ways reads differently."""
    source = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }\n'
    (elf,) = fatbin_entries(compile_cuda(source, "sm_86"))
    assert (elf.kind, elf.arch) == ("elf", 86)
    (ptx,) = fatbin_entries(compile_cuda(source, "sm_86", ptx=True))
    # compute_86 needs PTX ISA 7.1 or newer.
    assert (ptx.kind, ptx.arch) == ("ptx", 86) and ptx.isa >= (7, 1)


@pytest.fixture(scope="module")
def ptx_suite(tmp_path_factory) -> Path:
    """One case of the small kernel suite, both pipelines, built for sm_80 as PTX by the CLI."""
    if nvcc_path() is None:
        pytest.skip("nvcc not installed")
    out = tmp_path_factory.mktemp("ptx")
    assert main(["bench", "build", str(out), "--suite", "small", "--cases", "gemm-48x64", "--arch", "sm_80", "--ptx"]) == 0
    return out / "manifest.json"


def test_ptx_build_carries_sm80_ptx_only(ptx_suite):
    manifest = json.loads(ptx_suite.read_text())
    assert (manifest["arch"], manifest["ptx"]) == ("sm_80", True)
    libs = manifest["cases"][0]["libraries"]
    assert sorted(libs) == ["baseline", "fuselight"]
    for name in libs.values():
        lib = ptx_suite.parent / name
        meta = runtime.read_metadata(lib)
        assert (meta["target"], meta["arch"], meta["ptx"]) == ("cuda", "sm_80", True)
        assert meta["cuda_sources"]
        for fatbin in meta["cuda_sources"].values():
            entries = fatbin_entries((library.aot_dir(lib) / fatbin).read_bytes())
            # PTX for compute_80 alone, nothing for the GPU it will run on: the driver compiles it there.
            assert [(e.kind, e.arch) for e in entries] == [("ptx", 80)]
            assert entries[0].isa >= (7, 0)


def test_machine_code_build_records_no_ptx(tmp_path):
    """The sidecar says ``ptx`` false for a CUDA build without ``--ptx`` (llvm builds carry no CUDA)."""
    from fuselight.target import resolve

    class Executable:
        def export_library(self, path: str, addons: list[str]) -> None:
            assert addons == []  # no KV-cache wrappers in this stand-in
            Path(path).write_bytes(b"lib")

        def as_text(self) -> str:
            return ""

    lib = library.write_library(Executable(), tmp_path / "x.so", {"target": "cuda"}, resolve("cuda", "sm_89"),
                                aot_cuda=False)
    assert json.loads(library.metadata_path(lib).read_text())["ptx"] is False
    lib = library.write_library(Executable(), tmp_path / "y.so", {"target": "cuda"}, resolve("cuda", "sm_89", ptx=True),
                                aot_cuda=False)
    meta = json.loads(library.metadata_path(lib).read_text())
    # Without AOT fatbins the runtime compiles the source at load: as PTX, because the sidecar says so.
    assert (meta["ptx"], meta["cuda_sources"]) == (True, {})
    lib = library.write_library(Executable(), tmp_path / "z.so", {"target": "llvm"}, resolve("llvm"))
    assert "ptx" not in json.loads(library.metadata_path(lib).read_text())


def test_device_label_marks_the_proxy():
    name = "NVIDIA H100 80GB HBM3"
    assert library.device_label(name, {"arch": "sm_80", "ptx": True}) == "NVIDIA H100 80GB HBM3 (sm_80 PTX)"
    assert library.device_label(name, {"arch": "sm_90", "ptx": False}) == name
    assert library.device_label(name, {"target": "llvm"}) == name
