"""Faster TVMScript parsing: ``inspect``'s file-to-module cache pre-filled for pseudo file names.

TVMScript calls ``inspect.stack()`` for every ``T.prim_func`` it parses and for every macro it
expands. For each frame whose file ``inspect`` cannot map to a module through its cache,
``inspect.getmodule`` scans all of ``sys.modules``; frames of code compiled from strings
(``"<string>"``, ``"<ast>"``: TVMScript's own evaluation) or run by the import system
(``"<frozen importlib._bootstrap>"``) are never cached, so every call scans again. Importing TVM's
tensor intrinsics (DLight's matmul rule does on first use, e.g. when a tiny model builds for CUDA)
took 48 s in a fresh process and 138 s inside ``fuselight compile`` (7 s with the entries below).
No module's ``__file__`` is such a name, so the scan finds nothing for them: the entries map them
to no module (``sys.modules.get("")`` is None) and every answer stays what it was.
"""

from __future__ import annotations

import inspect

PSEUDO_FILES = (
    "<string>",
    "<ast>",
    "<frozen importlib._bootstrap>",
    "<frozen importlib._bootstrap_external>",
)
NO_MODULE = ""


def prime() -> None:
    """Map each of ``PSEUDO_FILES`` to no module in ``inspect``'s cache (once; idempotent)."""
    for name in PSEUDO_FILES:
        inspect.modulesbyfile.setdefault(name, NO_MODULE)
