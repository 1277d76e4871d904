"""How TVM's paged KV cache lays a sequence out: the one length formula its kernels share, and
the static buffer dimensions its kernels' interfaces are recognised by."""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T


def static_dim(dim: tvm.ir.PrimExpr) -> int | None:
    """A buffer dimension's value where it is static, else None."""
    return int(dim) if isinstance(dim, tirx.IntImm) else None


def paged_kv_len(page_indptr, last_page_len, b, page_size: int):
    """KV rows of sequence ``b``: full pages plus the used part of its last page (0 without pages)."""
    n_pages = page_indptr[b + 1] - page_indptr[b]
    return T.if_then_else(n_pages > 0, (n_pages - 1) * page_size + last_page_len[b], 0)
