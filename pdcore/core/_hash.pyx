# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True
"""``rid_hash`` compiled: the twin of ``pdcore.core.twin_common.rid_hash`` (read its docstring).

The compiled tables (``_table``, ``pdcore.epd._recv``) hash each request id they take: in Python the
FNV-1a loop ran once per byte, 5 µs for a vLLM request id of 43 characters, on the scheduler's thread
(``register``, ``stage``). Here the 64-bit arithmetic wraps as the twin's masks make it, so both give
the same hash and ranks of either build agree on a replica's fingerprints.
"""

from libc.stdint cimport uint64_t

__all__ = ["rid_hash"]


def rid_hash(rid, uint64_t slot):
    """A process-independent 64-bit hash of (slot, rid): FNV-1a, then a splitmix64 finaliser."""
    cdef bytes data = rid.encode("utf-8")
    cdef const unsigned char* p = data
    cdef Py_ssize_t i
    cdef uint64_t h = 0xCBF29CE484222325ULL
    for i in range(len(data)):
        h = (h ^ p[i]) * 0x100000001B3ULL
    h = h ^ (slot * 0x9E3779B97F4A7C15ULL)
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ULL
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBULL
    return h ^ (h >> 31)
