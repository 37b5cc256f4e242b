# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True
"""Transfer plan, compiled twin of ``transport._plan_py`` (same names, signatures and errors).

``plan`` turns (source page, destination page) pairs into write triples
``(local_addr, remote_addr, length)`` for every buffer of the layout,
coalescing each run of pairs where both sides advance by one page into a
single write. Output is buffer-major: all runs of buffer 0, then buffer 1, ...
``naive_plan`` is the one-write-per-page-per-buffer reference.

Validation is shared Python (``transport._layout.validate``), done holding the
GIL; the loops then run on typed memoryviews without it.
"""

import numpy as np

from libc.stdint cimport int64_t, uint64_t

from ._layout import Layout, PlanError, validate

__all__ = ["Layout", "PlanError", "count_runs", "naive_plan", "plan"]


cdef Py_ssize_t _run_starts(const int64_t[::1] s, const int64_t[::1] d, int64_t[::1] starts) noexcept nogil:
    """Write the index where each run begins into ``starts``; return the number of runs."""
    cdef Py_ssize_t i, k = 0, n = s.shape[0]
    if n == 0:
        return 0
    starts[0] = 0
    k = 1
    for i in range(1, n):
        # unsigned: no signed-overflow UB at INT64_MAX, and the same wrap-around as numpy's diff
        if <uint64_t>s[i] != <uint64_t>s[i - 1] + 1 or <uint64_t>d[i] != <uint64_t>d[i - 1] + 1:
            starts[k] = i
            k += 1
    return k


def count_runs(src_pages, dst_pages) -> int:
    """Number of maximal runs of pairs adjacent on both sides (= writes per buffer of ``plan``)."""
    s = np.ascontiguousarray(np.asarray(src_pages, dtype=np.int64).reshape(-1))
    d = np.ascontiguousarray(np.asarray(dst_pages, dtype=np.int64).reshape(-1))
    if s.shape[0] != d.shape[0]:
        raise PlanError(f"{s.shape[0]} source pages but {d.shape[0]} destination pages; the lists pair up one to one")
    starts = np.empty(s.shape[0], np.int64)
    cdef const int64_t[::1] sv = s
    cdef const int64_t[::1] dv = d
    cdef int64_t[::1] st = starts
    cdef Py_ssize_t k
    with nogil:
        k = _run_starts(sv, dv, st)
    return int(k)


def plan(src, dst, src_pages, dst_pages):
    """Coalesced writes as an ``(n, 3)`` ``uint64`` array: one write per run per buffer."""
    s, d, sb, db, pb = validate(src, dst, src_pages, dst_pages)
    starts = np.empty(s.shape[0], np.int64)
    cdef const int64_t[::1] sv = s
    cdef const int64_t[::1] dv = d
    cdef int64_t[::1] st = starts
    cdef const uint64_t[::1] sbv = sb
    cdef const uint64_t[::1] dbv = db
    cdef const uint64_t[::1] pbv = pb
    cdef Py_ssize_t n = sv.shape[0], nb = sbv.shape[0], nr, b, r, row, end
    with nogil:
        nr = _run_starts(sv, dv, st)
    out = np.empty((nb * nr, 3), np.uint64)
    cdef uint64_t[:, ::1] o = out
    with nogil:
        row = 0
        for b in range(nb):
            for r in range(nr):
                end = st[r + 1] if r + 1 < nr else n
                o[row, 0] = sbv[b] + <uint64_t>sv[st[r]] * pbv[b]
                o[row, 1] = dbv[b] + <uint64_t>dv[st[r]] * pbv[b]
                o[row, 2] = <uint64_t>(end - st[r]) * pbv[b]
                row += 1
    return out


def naive_plan(src, dst, src_pages, dst_pages):
    """One write per page per buffer, as an ``(n, 3)`` ``uint64`` array (the reference for ``plan``)."""
    s, d, sb, db, pb = validate(src, dst, src_pages, dst_pages)
    cdef const int64_t[::1] sv = s
    cdef const int64_t[::1] dv = d
    cdef const uint64_t[::1] sbv = sb
    cdef const uint64_t[::1] dbv = db
    cdef const uint64_t[::1] pbv = pb
    cdef Py_ssize_t n = sv.shape[0], nb = sbv.shape[0], b, i, row
    out = np.empty((nb * n, 3), np.uint64)
    cdef uint64_t[:, ::1] o = out
    with nogil:
        row = 0
        for b in range(nb):
            for i in range(n):
                o[row, 0] = sbv[b] + <uint64_t>sv[i] * pbv[b]
                o[row, 1] = dbv[b] + <uint64_t>dv[i] * pbv[b]
                o[row, 2] = pbv[b]
                row += 1
    return out
