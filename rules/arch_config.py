"""Reading a kernel template's tile config for a target arch from ``configs/<family>/<name>.json``."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from fuselight.errors import FuselightError
from fuselight.jsonfile import read_json_object
from fuselight.paths import config_dir

C = TypeVar("C")


def load_arch_config(family: str, name: str, arch: str, cls: type[C], *keys: str) -> C:
    """``cls`` built from ``configs/<family>/<name>.json`` at ``[arch][keys...]``; every field a positive
    int (a field with a default may be left out).

    family: the template family (``attention``, ``gemm``); name: the config file in it.
    """
    path = config_dir() / family / f"{name}.json"
    node: Any = read_json_object(path, missing=f"{family} config not found: {path}")
    where = str(path)
    for key in (arch, *keys):
        if not isinstance(node, dict) or key not in node:
            raise FuselightError(f"{where}: no entry {key!r} (unsupported target arch or shape)")
        node, where = node[key], f"{where}[{key!r}]"
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
