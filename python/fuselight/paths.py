"""Where the shipped configs live (inside the installed package, or at the source tree's root), and
where benchmark results go."""

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def config_dir() -> Path:
    """The ``configs/`` directory: installed copy first, else the source checkout's (editable)."""
    for cand in (_PKG / "configs", _PKG.parent.parent / "configs"):
        if (cand / "models").is_dir():
            return cand
    raise FileNotFoundError("fuselight configs/ not found next to the package or the checkout")


def results_dir() -> Path:
    """``bench/results/`` of the source checkout the package runs from, else of the working directory."""
    checkout = _PKG.parent.parent / "bench" / "results"
    return checkout if checkout.is_dir() else Path.cwd() / "bench" / "results"
