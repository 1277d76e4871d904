"""Audit a built library's machine code: does every kernel that waits for the grid before it
(programmatic dependent launch, ``fuselight.tir_pipeline``) touch memory only after the wait?

A kernel launched programmatically may start while the kernel before it still runs, so it must not
read that kernel's outputs, nor write what that kernel still reads, before ``griddepcontrol.wait``
(SASS ``ACQBULK``). The CUDA source orders them; ptxas schedules the SASS, and it moves read-only
(``ld.global.nc``) loads across the wait in both directions. Seen on the H100 with nvcc 13.0:
- loads the CUDA puts before the wait come out after it (the wait is the kernel's first instruction),
  so work placed before a wait overlaps nothing;
- with a branch between such loads and the wait, the wait stays after them, but loads the CUDA puts
  after the wait can come out before it: a race (an LLaMA-3-8B decode with such kernels generated
  wrong tokens).

fuselight's kernels therefore read nothing before their wait, and this audit checks what ptxas made
of them: in each kernel that waits, no global memory instruction before the first ``ACQBULK``. The
exceptions are in ``configs/pdl_audit.json``: kernels whose source loads, before the wait, inputs that
no kernel of the step writes (the decode attention's merge kernel reads the sequence lengths from the
page table there), each with the number of such global loads; more, or any other memory instruction,
is still out of order. It reads the SASS with ``cuobjdump`` (CUDA toolkit; on the GPU host when the
build host has none) from the fatbins ``fuselight compile`` writes beside a library.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

from .library import aot_dir, metadata_path
from .errors import FuselightError
from .jsonfile import read_json_object
from .paths import config_dir

WAIT_OPCODE = "ACQBULK"  # griddepcontrol.wait
# Opcodes that read or write global memory (generic LD/ST may too); local (LDL/STL) and shared
# (LDS/STS) memory are the block's own.
_MEMORY_OPCODES = frozenset({"LDG", "STG", "LD", "ST", "ATOM", "ATOMG", "RED", "LDGSTS", "UTMALDG", "UTMASTG", "UBLKCP"})
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")


@dataclasses.dataclass(frozen=True)
class KernelOrder:
    """One kernel's SASS: where its first wait is and the memory instructions before it."""

    kernel: str
    instructions: int
    wait_at: int | None  # index of the first ACQBULK; None: the kernel never waits
    memory_before_wait: tuple[str, ...]

    @property
    def ordered(self) -> bool:
        return self.wait_at is None or not self.memory_before_wait

    def allowed(self, allowances: list[Allowance]) -> bool:
        """Ordered, or what comes before its wait is at most the global loads an allowance grants it."""
        if self.ordered:
            return True
        loads = [t for t in self.memory_before_wait if t.split(" ", 1)[0].split(".", 1)[0] == "LDG"]
        return len(loads) == len(self.memory_before_wait) and any(
            fnmatch.fnmatchcase(self.kernel, a.kernel) and len(loads) <= a.loads for a in allowances)


@dataclasses.dataclass(frozen=True)
class Allowance:
    """Kernels (an fnmatch pattern) that may load this many values before their wait, and why."""

    kernel: str
    loads: int
    why: str


def load_allowances() -> list[Allowance]:
    """The allowances of ``configs/pdl_audit.json``; FuselightError naming a malformed entry."""
    path = config_dir() / "pdl_audit.json"
    entries = read_json_object(path, missing=f"PDL audit config not found: {path}").get("loads_before_wait")
    if not isinstance(entries, list):
        raise FuselightError(f"{path}: 'loads_before_wait' must be a list")
    found = []
    for i, e in enumerate(entries):
        if not (isinstance(e, dict) and isinstance(e.get("kernel"), str) and isinstance(e.get("loads"), int)
                and e["loads"] > 0 and isinstance(e.get("why"), str) and e["why"]):
            raise FuselightError(f"{path}: loads_before_wait[{i}] needs 'kernel' (a pattern), 'loads' (> 0) and 'why'")
        found.append(Allowance(e["kernel"], e["loads"], e["why"]))
    return found


def parse_sass(text: str) -> list[KernelOrder]:
    """Every kernel of ``cuobjdump -sass`` output, in order."""
    kernels = []
    for block in text.split("Function : ")[1:]:
        name = block.split("\n", 1)[0].strip()
        ops = [(m.group(1), (m.group(1) + m.group(2)).strip()) for m in _INSTRUCTION.finditer(block)]
        wait_at = next((i for i, (op, _) in enumerate(ops) if op == WAIT_OPCODE), None)
        before = () if wait_at is None else tuple(text for op, text in ops[:wait_at] if op in _MEMORY_OPCODES)
        kernels.append(KernelOrder(name, len(ops), wait_at, before))
    return kernels


def _carries_ptx(library: Path) -> bool:
    """Whether ``library``'s sidecar says its fatbins are PTX (``fuselight compile --ptx``): no SASS in them."""
    sidecar = metadata_path(Path(library))
    return sidecar.is_file() and read_json_object(sidecar, missing=str(sidecar)).get("ptx") is True


def fatbins(library: Path) -> list[Path]:
    """The fatbins ``fuselight compile`` wrote beside ``library`` (machine code, not ``--ptx``'s PTX)."""
    if _carries_ptx(library):
        raise FuselightError(f"{library}: built with --ptx, its SASS is made by the driver when loaded: nothing to audit")
    found = sorted(aot_dir(Path(library)).glob("*.fatbin"))
    if not found:
        raise FuselightError(f"{library}: no compiled CUDA beside it (expected {aot_dir(Path(library))}/*.fatbin)")
    return found


def audit_library(library: Path) -> list[KernelOrder]:
    """Every kernel of ``library``'s fatbins; needs ``cuobjdump``."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        raise FuselightError("cuobjdump not found: the audit reads SASS with the CUDA toolkit's cuobjdump")
    kernels = []
    for fatbin in fatbins(library):
        proc = subprocess.run([tool, "-sass", str(fatbin)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise FuselightError(f"cuobjdump failed on {fatbin}: {proc.stderr.strip()[:300]}")
        kernels += parse_sass(proc.stdout)
    return kernels


def summary(kernels: list[KernelOrder], allowances: list[Allowance] | None = None) -> dict:
    """Counts and the out-of-order kernels (past ``allowances``, default ``load_allowances()``), for
    results files and the CLI."""
    allowances = load_allowances() if allowances is None else allowances
    bad = [k for k in kernels if not k.allowed(allowances)]
    return {
        "kernels": len(kernels),
        "waiting": sum(k.wait_at is not None for k in kernels),
        "out_of_order": [{"kernel": k.kernel, "wait_at": k.wait_at, "memory_before_wait": list(k.memory_before_wait)} for k in bad],
    }


def audit_if_possible(library: Path) -> dict | None:
    """``summary`` of ``library``'s kernels, or None where it cannot be read here (no cuobjdump, or
    a library whose CUDA is compiled when loaded: without AOT fatbins, or with PTX ones, whose SASS
    the driver makes): for benchmarks, which record it beside their timings."""
    if shutil.which("cuobjdump") is None or not aot_dir(Path(library)).is_dir():
        return None
    if _carries_ptx(library):
        return None
    return summary(audit_library(library))
