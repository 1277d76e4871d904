"""fuselight: operator-class fusion passes and DLight-style schedule rules for LLaMA-class models.

Importing this package pulls in nothing from TVM: the GPU host runs a runtime-only TVM, and the
runtime and benchmark modules must import there. The compiler side (``fuselight.pipeline``,
``fuselight.model``, ``fuselight.passes``, ``fuselight.rules``) is imported on first use.
"""

__version__ = "0.1.0"

from . import inspect_cache
from .errors import FuselightError

inspect_cache.prime()  # before any TVMScript is parsed (see the module)

__all__ = ["FuselightError", "__version__"]
