"""The KV planner: which bytes prefill rank ``p`` writes to decode rank ``d``, for any pair of tp sizes.

``plan(layout, prefill_tp, p, decode_tp, d, src_bases, dst_bases, src_pages,
dst_pages)`` returns the coalesced writes (``(n, 3)`` ``uint64``: source
address, destination address, length) that move exactly the heads ``p`` owes
``d`` (``KvLayout.assignment``) from the source pages into the destination
pages, pairing ``src_pages[i]`` with ``dst_pages[i]``; an empty array when
``p`` owes ``d`` nothing. Inputs are checked here (naming the field); the
kernel is compiled (``_heads``) or its pure twin (``_heads_py``,
``PDCORE_PURE_PYTHON=1``), as ``pdcore/twins.py`` chooses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import LocalProtocolError
from ..twins import IMPLEMENTATION, load
from .layout import KvLayout

if TYPE_CHECKING:
    from ._heads_py import cut
else:
    cut = load("pdcore.kv._heads").cut

__all__ = ["IMPLEMENTATION", "plan", "cut"]


def _pages(name: str, pages: Any, limit: int) -> np.ndarray:
    arr = np.asarray(pages)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise LocalProtocolError(f"{name}: expected a 1-d sequence of page ids, got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        raise LocalProtocolError(f"{name}: page ids must be in 0..{limit - 1}")
    return np.ascontiguousarray(arr)


def plan(
    layout: KvLayout, prefill_tp: int, p: int, decode_tp: int, d: int,
    src_bases: Any, dst_bases: Any, src_pages: Any, dst_pages: Any,
    *, src_num_pages: int = 1 << 62, dst_num_pages: int = 1 << 62,
) -> np.ndarray:
    seg = layout.segments(prefill_tp, p, decode_tp, d)
    sb, db = list(src_bases), list(dst_bases)
    if len(sb) != layout.buffers or len(db) != layout.buffers:
        raise LocalProtocolError(
            f"the layout has {layout.buffers} buffers per rank; got {len(sb)} source and {len(db)} destination bases"
        )
    sp = _pages("src_pages", src_pages, src_num_pages)
    dp = _pages("dst_pages", dst_pages, dst_num_pages)
    if sp.size != dp.size:
        raise LocalProtocolError(f"{sp.size} source pages but {dp.size} destination pages; they pair up one to one")
    if seg is None:
        return np.zeros((0, 3), np.uint64)
    return cut(sb, db, sp, dp, seg)
