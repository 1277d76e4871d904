"""What the GPU tier's test files share: where the build is, and whether a CUDA device is here."""

from __future__ import annotations

import os
from pathlib import Path

BUILD = Path(os.environ["FUSELIGHT_GPU_BUILD"]) if os.environ.get("FUSELIGHT_GPU_BUILD") else None
# FUSELIGHT_GPU_RESULTS names the kernel suite's results file; the paged-attention layouts' go beside it.
RESULTS = Path(os.environ["FUSELIGHT_GPU_RESULTS"]) if os.environ.get("FUSELIGHT_GPU_RESULTS") else None


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
