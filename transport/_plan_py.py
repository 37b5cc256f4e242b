"""Transfer plan, pure-Python twin of ``transport._plan`` (same names, signatures and errors).

``plan`` turns (source page, destination page) pairs into write triples
``(local_addr, remote_addr, length)`` for every buffer of the layout,
coalescing each run of pairs where both sides advance by one page into a
single write. Output is buffer-major: all runs of buffer 0, then buffer 1, ...
``naive_plan`` is the one-write-per-page-per-buffer reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._layout import Layout, PlanError, validate

__all__ = ["Layout", "PlanError", "count_runs", "naive_plan", "plan"]


def _run_starts(s: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Indices where a new run begins: the first pair, and every pair not adjacent to its predecessor on both sides."""
    if s.size == 0:
        return np.zeros(0, np.int64)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    return np.concatenate(([0], breaks)).astype(np.int64)


def count_runs(src_pages: Any, dst_pages: Any) -> int:
    """Number of maximal runs of pairs adjacent on both sides (= writes per buffer of ``plan``)."""
    s = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    d = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if s.shape != d.shape:
        raise PlanError(f"{s.shape[0]} source pages but {d.shape[0]} destination pages; the lists pair up one to one")
    return int(_run_starts(s, d).size)


def plan(src: Layout, dst: Layout, src_pages: Any, dst_pages: Any) -> np.ndarray:
    """Coalesced writes as an ``(n, 3)`` ``uint64`` array: one write per run per buffer."""
    s, d, sb, db, pb = validate(src, dst, src_pages, dst_pages)
    starts = _run_starts(s, d)
    lengths = np.diff(np.append(starts, s.size)).astype(np.uint64)
    s0 = s[starts].astype(np.uint64)
    d0 = d[starts].astype(np.uint64)
    nb, nr = sb.size, starts.size
    out = np.empty((nb, nr, 3), np.uint64)
    out[:, :, 0] = sb[:, None] + s0[None, :] * pb[:, None]
    out[:, :, 1] = db[:, None] + d0[None, :] * pb[:, None]
    out[:, :, 2] = lengths[None, :] * pb[:, None]
    return out.reshape(nb * nr, 3)


def naive_plan(src: Layout, dst: Layout, src_pages: Any, dst_pages: Any) -> np.ndarray:
    """One write per page per buffer, as an ``(n, 3)`` ``uint64`` array (the reference for ``plan``)."""
    s, d, sb, db, pb = validate(src, dst, src_pages, dst_pages)
    su, du = s.astype(np.uint64), d.astype(np.uint64)
    nb, n = sb.size, s.size
    out = np.empty((nb, n, 3), np.uint64)
    out[:, :, 0] = sb[:, None] + su[None, :] * pb[:, None]
    out[:, :, 1] = db[:, None] + du[None, :] * pb[:, None]
    out[:, :, 2] = pb[:, None]
    return out.reshape(nb * n, 3)
