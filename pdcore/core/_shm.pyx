# cython: language_level=3, embedsignature=True
"""Compiled same-host round: all-reduce MIN and barrier through a shared segment, C11 atomics.

The protocol, the layout and the failure detection are ``_shm_py``'s (read its
docstring): this module is the same round with the control word swapped by
``__atomic_compare_exchange_n`` and the wait and the MIN in C, without the GIL.
"""

from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

import numpy as np

from ._shm_py import (
    ABORTED, ARRIVED_MASK, DEAD, EXITED, GEN_MASK, GEN_SHIFT, LATE, LIVENESS_EVERY, LOCK_BASE, MAX_NAP,
    OK, OUT_OF_STEP, SPIN_SECONDS, TIMED_OUT, YIELD_SECONDS, CONTROL, Segment, round_error,
)
from .errors import CollectiveError

__all__ = ["ShmReducer"]

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #include <time.h>
    #include <sched.h>
    #include <fcntl.h>

    static inline uint64_t pd_load(uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

    static inline int pd_cas(uint64_t *p, uint64_t *expected, uint64_t desired) {
        return __atomic_compare_exchange_n(p, expected, desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }

    static inline void pd_relax(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }

    static inline double pd_now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    }

    static inline void pd_nap(double seconds) {
        struct timespec ts;
        ts.tv_sec = (time_t)seconds;
        ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
        nanosleep(&ts, NULL);
    }

    /* 1 when no open file description holds a lock on byte `off` of fd's file (its holder died or left) */
    static int pd_holder_gone(int fd, long long off) {
        struct flock fl;
        memset(&fl, 0, sizeof fl);
        fl.l_type = F_WRLCK;
        fl.l_whence = SEEK_SET;
        fl.l_start = off;
        fl.l_len = 1;
        if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return 0;
        return fl.l_type == F_UNLCK;
    }

    /* dst[i] = min(slot 0, ..., slot world-1)[i]: a loop the compiler vectorises */
    static void pd_min_slots(uint8_t *restrict dst, const uint8_t *restrict slots, size_t stride,
                             int world, size_t n) {
        memcpy(dst, slots, n);
        for (int r = 1; r < world; r++) {
            const uint8_t *restrict s = slots + (size_t)r * stride;
            for (size_t i = 0; i < n; i++) {
                uint8_t a = dst[i], b = s[i];
                dst[i] = b < a ? b : a;
            }
        }
    }
    """
    uint64_t pd_load(uint64_t* p) noexcept nogil
    bint pd_cas(uint64_t* p, uint64_t* expected, uint64_t desired) noexcept nogil
    void pd_relax() noexcept nogil
    double pd_now() noexcept nogil
    void pd_nap(double seconds) noexcept nogil
    int pd_holder_gone(int fd, long long off) noexcept nogil
    int sched_yield() noexcept nogil
    void pd_min_slots(uint8_t* dst, const uint8_t* slots, size_t stride, int world, size_t n) noexcept nogil

cdef uint64_t C_ABORTED = ABORTED
cdef uint64_t C_DEAD = DEAD
cdef uint64_t C_ARRIVED = ARRIVED_MASK
cdef uint64_t C_GEN_MASK = GEN_MASK
cdef int C_GEN_SHIFT = GEN_SHIFT
cdef long long C_LOCK_BASE = LOCK_BASE
cdef double C_SPIN = SPIN_SECONDS
cdef double C_YIELD = YIELD_SECONDS
cdef double C_MAX_NAP = MAX_NAP
cdef double C_LIVENESS = LIVENESS_EVERY
cdef int S_OK = OK, S_TIMED_OUT = TIMED_OUT, S_EXITED = EXITED, S_LATE = LATE, S_OUT_OF_STEP = OUT_OF_STEP


cdef class ShmReducer:
    """All-reduce MIN of one rank's buffer with the other ranks of its segment (compiled twin)."""

    cdef object _seg
    cdef object _broken
    cdef uint8_t[::1] _view
    cdef uint8_t* _base
    cdef uint64_t* _word
    cdef int _fd
    cdef int _rank
    cdef int _world
    cdef size_t _nbytes
    cdef size_t _stride
    cdef size_t _data
    cdef uint64_t _full
    cdef uint64_t _gen
    cdef double _timeout

    def __init__(self, segment, double timeout=5.0):
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(segment, Segment):
            raise TypeError("segment must be a pdcore.core._shm_py.Segment")
        self._seg = segment
        self._broken = None
        self._view = segment.view
        self._base = &self._view[0]
        self._word = <uint64_t*>(self._base + <size_t>CONTROL)
        self._fd = segment.fd
        self._rank = segment.rank
        self._world = segment.world
        self._nbytes = segment.nbytes
        self._stride = segment.stride
        self._data = segment.data
        self._full = (<uint64_t>1 << self._world) - 1
        self._gen = 0
        self._timeout = timeout

    @property
    def rounds(self):
        return self._gen

    def close(self):
        """Release the view, then close the segment (which drops this rank's lock). Idempotent."""
        self._base = NULL
        self._word = NULL
        self._view = None
        self._seg.close()

    def allreduce_min(self, buf):
        """Replace ``buf`` (uint8, ``nbytes`` long) with the MIN over every rank's ``buf`` of this round."""
        if self._broken is not None:
            raise self._broken
        if self._base == NULL or self._seg.closed:
            raise CollectiveError("the shared-memory agreement is closed")
        if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.shape != (self._nbytes,):
            raise ValueError(f"buf must be a uint8 array of {self._nbytes} bytes")
        cdef uint8_t[::1] out = buf
        cdef uint64_t missing = 0
        cdef int status
        self._gen += 1
        with nogil:
            status = self._round(&out[0], &missing)
        if status != S_OK:
            self._broken = round_error(self._seg, status, self._gen, missing, self._timeout)
            raise self._broken

    cdef int _round(self, uint8_t* buf, uint64_t* missing) noexcept nogil:
        cdef uint64_t g = self._gen & C_GEN_MASK
        cdef uint64_t prev = (self._gen - 1) & C_GEN_MASK
        cdef uint64_t bit = <uint64_t>1 << self._rank
        cdef uint64_t full = self._full
        cdef uint8_t* slots = self._base + self._data + (self._gen & 1) * self._world * self._stride
        cdef uint64_t w, want, flag, absent, gone
        cdef double started, now, deadline, next_liveness, nap = 5e-6
        cdef int r
        memcpy(slots + self._rank * self._stride, buf, self._nbytes)
        # arrive: add our bit to round g, or open round g over the finished word of round g - 1
        w = pd_load(self._word)
        while True:
            if (w >> C_GEN_SHIFT) == g and not (w & C_ABORTED):
                want = w | bit
            elif (w >> C_GEN_SHIFT) == prev and (w & C_ARRIVED) == full and not (w & C_ABORTED):
                want = (g << C_GEN_SHIFT) | bit
            else:
                missing[0] = full & ~(w & C_ARRIVED)
                return S_LATE if ((w >> C_GEN_SHIFT) == g and (w & C_ABORTED)) else S_OUT_OF_STEP
            if pd_cas(self._word, &w, want):  # on failure w holds the word now: decide again
                break
        started = pd_now()
        deadline = started + self._timeout
        next_liveness = started + C_LIVENESS
        while True:
            w = pd_load(self._word)
            if (w >> C_GEN_SHIFT) != g or (w & C_ARRIVED) == full:
                break  # everyone arrived (or the word already moved on to the next round)
            if w & C_ABORTED:
                missing[0] = full & ~(w & C_ARRIVED)
                return S_EXITED if (w & C_DEAD) else S_TIMED_OUT
            now = pd_now()
            gone = 0
            if now >= next_liveness:
                next_liveness = now + C_LIVENESS
                absent = full & ~(w & C_ARRIVED)
                for r in range(self._world):
                    if (absent >> r) & 1 and pd_holder_gone(self._fd, C_LOCK_BASE + r):
                        gone |= <uint64_t>1 << r
            if gone or now >= deadline:
                flag = C_ABORTED | (C_DEAD if gone else 0)
                # fails when the word changed (a rank arrived, or another waiter aborted): read it again
                pd_cas(self._word, &w, w | flag)
                continue
            if now - started < C_SPIN:
                pd_relax()
            elif now - started < C_YIELD:
                sched_yield()  # returns at once on an idle core; gives the core to a rank that needs it
            else:
                nap = nap * 2 if nap * 2 < C_MAX_NAP else C_MAX_NAP
                pd_nap(nap)
        pd_min_slots(buf, slots, self._stride, self._world, self._nbytes)
        return S_OK
