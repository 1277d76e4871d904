"""Our LLaMA model (``llama``, compiler side) and its weights (``weights``, NumPy only).

Importing this package loads no TVM, so ``fuselight.model.weights`` works where only the TVM
runtime is installed; ``export_module`` pulls in the compiler on first use.
"""

from typing import Any

__all__ = ["export_module"]


def __getattr__(name: str) -> Any:
    if name == "export_module":
        from .llama import export_module

        return export_module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
