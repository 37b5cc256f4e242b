"""The KV planner's kernel, pure-Python twin of ``pdcore.kv._heads`` (same names, signatures, results).

``cut(src_bases, dst_bases, src_pages, dst_pages, seg)`` cuts every (buffer,
page pair) into ``seg.slots`` segments (``pdcore.kv.layout.Segments``) and
merges each segment into the previous one of the same buffer when both its
source and its destination follow on directly: whole pages in runs of
adjacent pages become one write, a head block of HND pages one write per page,
an NHD head slice one write per token slot. Output: an ``(n, 3)`` ``uint64``
array of ``(source address, destination address, length)``, buffer-major.
Never merged across buffers: each write stays inside one registered buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["cut"]


def cut(src_bases: Any, dst_bases: Any, src_pages: Any, dst_pages: Any, seg: Any) -> np.ndarray:
    sb = np.asarray(src_bases, np.uint64)
    db = np.asarray(dst_bases, np.uint64)
    sp = np.asarray(src_pages, np.int64).astype(np.uint64)
    dp = np.asarray(dst_pages, np.int64).astype(np.uint64)
    n, nb, k = sp.size, sb.size, seg.slots
    if n == 0 or nb == 0:
        return np.zeros((0, 3), np.uint64)
    t = np.arange(k, dtype=np.uint64)
    # (page, slot) offsets within one buffer, in write order
    so = (sp[:, None] * np.uint64(seg.src_page) + np.uint64(seg.src_off) + t[None, :] * np.uint64(seg.src_stride)).reshape(-1)
    do = (dp[:, None] * np.uint64(seg.dst_page) + np.uint64(seg.dst_off) + t[None, :] * np.uint64(seg.dst_stride)).reshape(-1)
    length = np.uint64(seg.length)
    starts = np.concatenate(([0], np.flatnonzero((so[1:] != so[:-1] + length) | (do[1:] != do[:-1] + length)) + 1))
    runs = np.diff(np.append(starts, so.size)).astype(np.uint64) * length
    m = starts.size
    out = np.empty((nb, m, 3), np.uint64)
    out[:, :, 0] = sb[:, None] + so[starts][None, :]
    out[:, :, 1] = db[:, None] + do[starts][None, :]
    out[:, :, 2] = runs[None, :]
    return out.reshape(nb * m, 3)
