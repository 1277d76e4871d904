"""RowReduction: schedule row reductions (RMSNorm, add+RMSNorm, softmax, ...) with fuselight's kernels.

``analyze`` (``rules.reduce.analysis``) recognises, by its stages and not by any name, a function
that reduces each row of a [rows, cols] tensor (leading dims folded into rows, cols static) to
statistics and then writes elementwise functions of the row and its statistics. ``schedule``
writes ``rules.reduce.rowwise``'s kernels over the function's own buffers: one row per warp or per
block, read once where it fits in registers; softmax-shaped long rows, when there are too few rows
to fill the GPU, are split over several blocks and merged by a second launch, behind a host-side
branch on the row count. Targets without a config in ``configs/reduction/`` are left to the next
rule.
"""

from __future__ import annotations

from tvm import tirx
from tvm.target import Target

from ..errors import FuselightError
from ..target import arch_of
from .base import AnalyzeScheduleRule, host_branch, with_kernels
from .reduce.analysis import RowReductionDesc, analyze_row_reduction
from .reduce.rowwise import MAX_OUTPUTS, MAX_STATS, load_row_config, load_split_config, row_kernel, split_softmax_kernels, use_split


class RowReduction(AnalyzeScheduleRule):
    """Swap row-reduction functions for fuselight's row kernels (see the module docstring)."""

    family = "row_reduction"

    @staticmethod
    def analyze(func: tirx.PrimFunc) -> RowReductionDesc | None:
        """The row statistics and outputs ``func`` computes, or None."""
        return analyze_row_reduction(func)

    @classmethod
    def supports(cls, desc: RowReductionDesc, target: Target) -> bool:
        """Whether ``schedule`` builds ``desc`` on ``target``: CUDA, within the kernels' limits, with a
        reduction config for the arch."""
        if target.kind.name != "cuda" or len(desc.stats) > MAX_STATS or len(desc.outputs) > MAX_OUTPUTS:
            return False
        try:
            arch = arch_of(target)
            load_row_config(arch), load_split_config(arch)
        except FuselightError:
            return False  # no reduction config for this arch
        return True

    def schedule(self, func: tirx.PrimFunc, desc: RowReductionDesc, target: Target) -> tirx.PrimFunc | None:
        """``func`` with its body replaced by the row kernels for ``desc`` on ``target``, or None."""
        if not self.supports(desc, target):
            return None
        arch = arch_of(target)
        row_cfg, split_cfg = load_row_config(arch), load_split_config(arch)
        body = row_kernel(desc, row_cfg)
        if use_split(desc, split_cfg):
            split = split_softmax_kernels(desc, split_cfg, row_cfg.load_bytes)
            if desc.rows_static is not None:
                body = split if desc.rows_static < split_cfg.below_rows else body
            else:
                body = host_branch(desc.rows < split_cfg.below_rows, split, body)  # on the row count
        if desc.rows_static is None:
            body = host_branch(desc.rows > 0, body)  # no empty grids
        return with_kernels(func, body)
