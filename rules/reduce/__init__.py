"""Row-reduction templates (RMSNorm, add+RMSNorm, softmax and their kin) for the RowReduction rule.

``analysis`` recognises the computation; ``rowwise`` writes the kernels (one row per warp or per
block, or each row split over several blocks and merged); configs in ``configs/reduction/``.
"""
