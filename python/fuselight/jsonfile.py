"""Reading a JSON file that must hold an object, with one-line errors (no TVM: the GPU host reads these too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import FuselightError


def read_json_object(path: Path, *, missing: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``missing`` is the error message when there is no such file."""
    path = Path(path)
    if not path.is_file():
        raise FuselightError(missing)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise FuselightError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(raw, dict):
        raise FuselightError(f"{path}: must be a JSON object")
    return raw
