"""Find MLC-LLM's compiler passes, installed or from a source checkout, and make them run on TVM 0.26.

MLC-LLM is optional: the baseline pipeline uses its own pass objects when this module finds them and
fuselight's equivalents (``fuselight.baseline``) otherwise. A source checkout is named by the
environment variable ``FUSELIGHT_MLC_LLM_SOURCE`` (the checkout's root or its ``python/`` folder);
its compiler side imports without MLC's C++ library, which only the serving engine needs.

TVM 0.26 changed a few things MLC's sources still use: ``fuselight.mlc.shims`` restores exactly
those, only where missing. ``fuselight.mlc.pipeline`` adds fuselight's passes and rules to MLC-LLM's
own registered pipeline, ``fuselight.mlc.cli`` runs ``mlc_llm compile`` with it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

from ..errors import FuselightError
from .shims import apply_tvm_shims

SOURCE_ENV = "FUSELIGHT_MLC_LLM_SOURCE"
# Tells MLC-LLM's package not to load its C++ library (the compiler passes are pure Python).
_SKIP_SO_ENV = "SKIP_LOADING_MLCLLM_SO"


def import_mlc_llm() -> types.ModuleType | None:
    """MLC-LLM's package with the TVM 0.26 shims applied, or None when it is neither installed nor named."""
    module = sys.modules.get("mlc_llm")
    if module is None:
        if importlib.util.find_spec("mlc_llm") is not None:
            module = _import_installed()
        elif os.environ.get(SOURCE_ENV):
            module = _import_from_source(Path(os.environ[SOURCE_ENV]))
        else:
            return None
    apply_tvm_shims()
    return module


# What MLC-LLM's compiler side imports besides TVM (its python/requirements.txt, compiler part).
MLC_REQUIREMENTS = ("tqdm", "requests", "safetensors", "ml_dtypes", "shortuuid", "sentencepiece", "tiktoken")


def import_mlc_module(name: str) -> types.ModuleType:
    """``importlib.import_module(name)`` for a module of MLC-LLM; a package it needs that is not
    installed is a FuselightError naming it (and the rest of MLC's requirements), not a traceback."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        if not missing or missing == "mlc_llm":
            raise
        raise FuselightError(
            f"MLC-LLM's {name} needs the Python package {missing!r}, which is not installed: "
            f"pip install {' '.join(MLC_REQUIREMENTS)}"
        ) from None


def source_package_dir(root: Path) -> Path:
    """``<checkout>/python/mlc_llm`` for a checkout root or its ``python/`` folder."""
    for candidate in (root / "python" / "mlc_llm", root / "mlc_llm"):
        if (candidate / "compiler_pass").is_dir():
            return candidate
    raise FuselightError(f"{SOURCE_ENV}={root}: no MLC-LLM sources there (expected python/mlc_llm/compiler_pass)")


def describe(module: types.ModuleType) -> str:
    """``mlc-llm@<git commit | version | "source">`` for the package ``import_mlc_llm`` returned."""
    return f"mlc-llm@{_checkout_commit(Path(module.__path__[0])) or getattr(module, '__version__', None) or 'source'}"


def _checkout_commit(package_dir: Path) -> str | None:
    """HEAD of the MLC-LLM git checkout holding ``package_dir`` (``<root>/python/mlc_llm``), if it is one."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(package_dir), *args], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()

    try:
        # Only the checkout's own repository: an installed package may sit inside an unrelated one.
        if Path(git("rev-parse", "--show-toplevel")).resolve() != package_dir.resolve().parent.parent:
            return None
        return git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None


def _import_installed() -> types.ModuleType:
    """The installed ``mlc_llm``; one line of error when it (or its C++ library) fails to load."""
    try:
        return importlib.import_module("mlc_llm")
    except (ImportError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FuselightError(
            f"the installed mlc_llm package fails to import ({type(err).__name__}: {first}); "
            f"uninstall it or fix its C++ library"
        ) from None


def _import_from_source(root: Path) -> types.ModuleType:
    package_dir = source_package_dir(root)
    os.environ[_SKIP_SO_ENV] = "1"
    # A bare package: MLC's __init__ imports its serving engine (and C++ library), which the compiler
    # passes do not need.
    module = types.ModuleType("mlc_llm")
    module.__spec__ = importlib.machinery.ModuleSpec("mlc_llm", None, is_package=True)
    module.__spec__.submodule_search_locations = [str(package_dir)]
    module.__path__ = [str(package_dir)]
    module.__file__ = str(package_dir / "__init__.py")
    before = set(sys.modules)
    sys.modules["mlc_llm"] = module
    try:
        module.__version__ = importlib.import_module("mlc_llm.libinfo").__version__
    except BaseException:
        # Leave no half-imported package behind: a later call would take it for a working one.
        for name in set(sys.modules) - before:
            if name == "mlc_llm" or name.startswith("mlc_llm."):
                del sys.modules[name]
        raise
    return module
