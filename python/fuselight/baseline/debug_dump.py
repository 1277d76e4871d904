"""Mirrors MLC-LLM's ``DebugDump``: write the module's TVMScript to a file between pipeline phases."""

from __future__ import annotations

from pathlib import Path

import tvm


@tvm.transform.module_pass(opt_level=0, name="DebugDump")
class DebugDump:
    """Write ``mod.script()`` to ``directory / file_name``; the module passes through unchanged."""

    def __init__(self, directory: Path, file_name: str) -> None:
        self.path = Path(directory) / file_name

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(mod.script(show_meta=False), encoding="utf-8")
        return mod
