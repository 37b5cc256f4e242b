# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True
"""The KV planner's kernel, compiled twin of ``pdcore.kv._heads_py`` (read its docstring).

One pass per buffer over (page pair, slot) segments, merging a segment into
the previous write when both sides follow on directly; no Python object per
write. Inputs are converted and checked by the caller (``pdcore.kv.planner``).
"""

import numpy as np

from libc.stdint cimport int64_t, uint64_t

__all__ = ["cut"]


cdef Py_ssize_t _cut(const uint64_t[::1] sb, const uint64_t[::1] db, const int64_t[::1] sp, const int64_t[::1] dp,
                     Py_ssize_t slots, uint64_t src_off, uint64_t dst_off, uint64_t src_stride, uint64_t dst_stride,
                     uint64_t length, uint64_t src_page, uint64_t dst_page, uint64_t[:, ::1] out) noexcept nogil:
    cdef Py_ssize_t b, i, t, row = 0, first
    cdef uint64_t s, d
    for b in range(sb.shape[0]):
        first = row
        for i in range(sp.shape[0]):
            for t in range(slots):
                s = sb[b] + <uint64_t>sp[i] * src_page + src_off + <uint64_t>t * src_stride
                d = db[b] + <uint64_t>dp[i] * dst_page + dst_off + <uint64_t>t * dst_stride
                if row > first and out[row - 1, 0] + out[row - 1, 2] == s and out[row - 1, 1] + out[row - 1, 2] == d:
                    out[row - 1, 2] += length
                else:
                    out[row, 0] = s
                    out[row, 1] = d
                    out[row, 2] = length
                    row += 1
    return row


def cut(src_bases, dst_bases, src_pages, dst_pages, seg):
    sb = np.ascontiguousarray(src_bases, dtype=np.uint64)
    db = np.ascontiguousarray(dst_bases, dtype=np.uint64)
    sp = np.ascontiguousarray(src_pages, dtype=np.int64)
    dp = np.ascontiguousarray(dst_pages, dtype=np.int64)
    cdef Py_ssize_t slots = seg.slots
    out = np.empty((sb.shape[0] * sp.shape[0] * slots, 3), np.uint64)
    cdef const uint64_t[::1] sbv = sb
    cdef const uint64_t[::1] dbv = db
    cdef const int64_t[::1] spv = sp
    cdef const int64_t[::1] dpv = dp
    cdef uint64_t[:, ::1] o = out
    cdef uint64_t so = seg.src_off, do = seg.dst_off, ss = seg.src_stride, ds = seg.dst_stride
    cdef uint64_t ln = seg.length, spg = seg.src_page, dpg = seg.dst_page
    cdef Py_ssize_t n
    with nogil:
        n = _cut(sbv, dbv, spv, dpv, slots, so, do, ss, ds, ln, spg, dpg, o)
    return out[:n].copy() if n < out.shape[0] else out
