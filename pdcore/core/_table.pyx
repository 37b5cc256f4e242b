# cython: language_level=3, embedsignature=True
"""Compiled per-request state table and the encode/decode halves of the agreement.

The behaviour is ``_table_py``'s, decided by ``_spec``: the transition grid and
the timers are copied into C arrays when this module is imported. Per round the
work is one pass over contiguous byte arrays; Python objects are created only
for events. Validation happens with the GIL held before any C loop runs.
"""

from libc.stdint cimport uint8_t, uint64_t, int64_t
from libc.stdlib cimport qsort
from libc.string cimport memcpy

import math
import threading

import numpy as np

from . import _spec
from ._spec import STATES, State, Timer, Trigger
from .errors import CapacityError, CollectiveError, LocalProtocolError
from .events import FAILED_ELSEWHERE, Bootstrapped, Failed, Succeeded
from ._hash import rid_hash
from .twin_common import FINGERPRINT_BYTES, MAX_CAPACITY, check_config, mismatch_message

__all__ = ["StateTable", "FINGERPRINT_BYTES", "MAX_CAPACITY", "rid_hash"]

cdef enum:
    N_STATES = 6
    N_TRIGGERS = 7
    FP = 12
    S_FAILED = 0
    S_BOOTSTRAPPING = 1
    T_ABORT = 6
    T_TIMEOUT = 5
    F_NONE = 0
    F_ARMED = 1
    F_DONE = 2
    C_FAILING = 0
    C_FAILED = 1
    C_BOOTSTRAPPED = 3
    C_SUCCESS = 6
    FREE = 255

cdef uint8_t TRANSITIONS[N_STATES][N_TRIGGERS]
cdef uint8_t TIMERS[N_STATES]
cdef bint ARMS[N_TRIGGERS]


cdef void _load_spec() except *:
    assert len(State) == N_STATES and len(Trigger) == N_TRIGGERS and _spec.FREE == FREE
    assert (Trigger.TIMEOUT, Trigger.ABORT) == (T_TIMEOUT, T_ABORT) and FINGERPRINT_BYTES == FP
    assert (_spec.CODE_FAILING, _spec.CODE_FAILED, _spec.CODE_SUCCESS) == (C_FAILING, C_FAILED, C_SUCCESS)
    assert _spec.code_of(State.BOOTSTRAPPED, 0, FREE) == C_BOOTSTRAPPED
    assert tuple(_spec.Fence) == (F_NONE, F_ARMED, F_DONE)
    cdef int s, t
    for s in range(N_STATES):
        TIMERS[s] = _spec.TIMERS[s]
        for t in range(N_TRIGGERS):
            TRANSITIONS[s][t] = _spec.TRANSITIONS[s][t]
    for t in range(N_TRIGGERS):
        ARMS[t] = t in _spec.ARMS_FENCE


_load_spec()


def compiled_spec():
    """The C copy of the grid, timers and fence triggers, for the test that checks it equals ``_spec``."""
    return (
        tuple(tuple(TRANSITIONS[s][t] for t in range(N_TRIGGERS)) for s in range(N_STATES)),
        tuple(TIMERS[s] for s in range(N_STATES)),
        frozenset(t for t in range(N_TRIGGERS) if ARMS[t]),
    )


cdef inline uint8_t _code_of(uint8_t state, uint8_t fence, uint8_t agreed) noexcept nogil:
    """``_spec.code_of``."""
    if state != S_FAILED:
        return state + 1
    return C_FAILED if fence != F_ARMED and agreed == C_FAILING else C_FAILING


cdef int _cmp_i64(const void* a, const void* b) noexcept nogil:
    cdef int64_t x = (<const int64_t*>a)[0]
    cdef int64_t y = (<const int64_t*>b)[0]
    return (x > y) - (x < y)


cdef class StateTable:
    """Per-request transfer states of one rank, and its half of the replica agreement.

    ``register``/``remove``/``encode``/``decode`` belong to the scheduler thread
    (every rank calls them in the same order); ``update`` may be called from any
    thread. A round is ``encode(now)`` (fold deadlines, fill ``buffer``), an
    all-reduce MIN of ``buffer`` across the replica, then ``decode()``.
    """

    cdef Py_ssize_t _capacity
    cdef double _timeouts[3]
    cdef object _lock
    cdef dict _slots
    cdef list _rid_of
    cdef dict _reasons
    cdef list _fencing
    cdef uint8_t[::1] _local
    cdef uint8_t[::1] _fence
    cdef uint8_t[::1] _code
    cdef uint8_t[::1] _agreed
    cdef double[::1] _deadline
    cdef uint64_t[::1] _hash
    cdef int64_t[::1] _seq
    cdef int64_t[::1] _changed
    cdef Py_ssize_t[::1] _free
    cdef Py_ssize_t _n_free
    cdef int64_t _next_seq
    cdef uint64_t _fp_sum
    cdef double _next_deadline  # no deadline before this: the fold can skip its pass
    cdef object _buffer
    cdef uint8_t[::1] _buf

    def __init__(self, Py_ssize_t capacity, *, double bootstrap_timeout=120.0, double waiting_timeout=300.0):
        check_config(capacity, bootstrap_timeout, waiting_timeout)
        self._capacity = capacity
        self._timeouts[0] = math.inf
        self._timeouts[1] = bootstrap_timeout
        self._timeouts[2] = waiting_timeout
        self._lock = threading.Lock()
        self._slots = {}
        self._rid_of = [None] * capacity
        self._reasons = {}
        self._fencing = []
        self._local = np.full(capacity, FREE, dtype=np.uint8)
        self._fence = np.zeros(capacity, dtype=np.uint8)
        self._code = np.full(capacity, FREE, dtype=np.uint8)
        self._agreed = np.full(capacity, FREE, dtype=np.uint8)
        self._deadline = np.full(capacity, math.inf, dtype=np.float64)
        self._hash = np.zeros(capacity, dtype=np.uint64)
        self._seq = np.zeros(capacity, dtype=np.int64)
        self._changed = np.zeros(capacity, dtype=np.int64)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.intp)
        self._n_free = capacity
        self._next_seq = 0
        self._fp_sum = 0
        self._next_deadline = math.inf
        self._buffer = np.full(capacity + 2 * FP, FREE, dtype=np.uint8)
        self._buf = self._buffer

    # -- registry -----------------------------------------------------------------

    @property
    def capacity(self):
        return self._capacity

    @property
    def buffer(self):
        """The reduction buffer: ``capacity`` state bytes, then the fingerprint pair."""
        return self._buffer

    def __len__(self):
        return len(self._slots)

    def __contains__(self, rid):
        return rid in self._slots

    def has_in_flight(self):
        """A request is still tracked: its transfer may yet read or write memory."""
        return bool(self._slots)

    def rids(self):
        """Live requests in registration order."""
        with self._lock:
            return list(self._slots)

    def register(self, rid, double now):
        """Track ``rid`` from BOOTSTRAPPING and return its slot."""
        if not isinstance(rid, str) or not rid:
            raise LocalProtocolError(f"rid must be a non-empty str, got {rid!r}")
        cdef Py_ssize_t slot
        with self._lock:
            if rid in self._slots:
                raise LocalProtocolError(f"rid {rid!r} is already registered (slot {self._slots[rid]})")
            if self._n_free == 0:
                raise CapacityError(f"cannot register {rid!r}: all {self._capacity} slots are in use")
            h = rid_hash(rid, self._free[self._n_free - 1])
            self._n_free -= 1
            slot = self._free[self._n_free]
            self._slots[rid] = slot
            self._rid_of[slot] = rid
            self._local[slot] = S_BOOTSTRAPPING
            self._agreed[slot] = S_BOOTSTRAPPING + 1
            self._code[slot] = S_BOOTSTRAPPING + 1
            self._arm(slot, now + self._timeouts[1])
            self._hash[slot] = h
            self._fp_sum += self._hash[slot]
            self._seq[slot] = self._next_seq
            self._next_seq += 1
            return slot

    def remove(self, rid):
        """Stop tracking ``rid`` without an event (every rank must remove it in the same round)."""
        with self._lock:
            self._free_slot(self._slot_of(rid))

    cdef Py_ssize_t _slot_of(self, rid) except -1:
        try:
            return self._slots[rid]
        except (KeyError, TypeError):
            raise LocalProtocolError(f"rid {rid!r} is not registered") from None

    cdef int _free_slot(self, Py_ssize_t slot) except -1:
        del self._slots[self._rid_of[slot]]
        self._rid_of[slot] = None
        self._local[slot] = FREE
        self._fence[slot] = F_NONE
        self._code[slot] = FREE
        self._agreed[slot] = FREE
        self._deadline[slot] = math.inf
        self._fp_sum -= self._hash[slot]
        self._hash[slot] = 0
        if self._reasons:
            self._reasons.pop(slot, None)
        self._free[self._n_free] = slot
        self._n_free += 1
        return 0

    # -- local updates ------------------------------------------------------------

    def update(self, rid, trigger, double now, reason=""):
        """Fire ``trigger`` for ``rid`` on this rank; returns the new local state.

        Safe from any thread. ``reason`` is kept, as ``str``, when the request fails here.
        """
        if not isinstance(trigger, int) or not 0 <= trigger < N_TRIGGERS:
            raise LocalProtocolError(f"trigger {trigger!r} for rid {rid!r} is not a Trigger (0..{N_TRIGGERS - 1})")
        cdef Py_ssize_t slot
        with self._lock:
            slot = self._slot_of(rid)
            if self._apply(slot, trigger, now):
                self._reasons[slot] = str(reason) if reason else Trigger(trigger).name.lower()
            return STATES[self._local[slot]]

    cdef int _apply(self, Py_ssize_t slot, int trigger, double now) except -1:
        """One table step; 1 when it moved the slot into FAILED (the caller keeps the reason)."""
        cdef uint8_t old = self._local[slot]
        cdef uint8_t new = TRANSITIONS[old][trigger]
        cdef int failed = 0
        if ARMS[trigger] and old != S_FAILED and self._fence[slot] == F_NONE:
            self._fence[slot] = F_ARMED
        if new != old:
            self._local[slot] = new
            if TIMERS[new] != TIMERS[old]:
                self._arm(slot, now + self._timeouts[TIMERS[new]])
            if new == S_FAILED:
                failed = 1
                if self._fence[slot] == F_ARMED:
                    self._fencing.append(self._rid_of[slot])
        self._code[slot] = _code_of(new, self._fence[slot], self._agreed[slot])
        return failed

    def fenced(self, rid):
        """Confirm that nothing can land in or leave ``rid``'s memory any more (it must have failed)."""
        cdef Py_ssize_t slot
        with self._lock:
            slot = self._slot_of(rid)
            if self._local[slot] != S_FAILED:
                raise LocalProtocolError(
                    f"rid {rid!r} is {State(self._local[slot]).name}, not FAILED: nothing to fence"
                )
            self._fence[slot] = F_DONE
            self._code[slot] = _code_of(S_FAILED, F_DONE, self._agreed[slot])

    def take_fencing(self):
        """Failed rids whose armed fence the owner must now close, each returned once."""
        with self._lock:
            out, self._fencing = self._fencing, []
            return out

    def fence(self, rid):
        with self._lock:
            return _spec.Fence(self._fence[self._slot_of(rid)])

    cdef inline void _arm(self, Py_ssize_t slot, double at) noexcept:
        self._deadline[slot] = at
        if at < self._next_deadline:
            self._next_deadline = at

    def state(self, rid):
        """This rank's local state of ``rid``."""
        with self._lock:
            return STATES[self._local[self._slot_of(rid)]]

    def agreed(self, rid):
        """The highest state the replica agreed on for ``rid`` so far (FAILED once it is failing)."""
        with self._lock:
            return _spec.state_of_code(self._agreed[self._slot_of(rid)])

    def slot(self, rid):
        with self._lock:
            return self._slot_of(rid)

    # -- the round ----------------------------------------------------------------

    def fold(self, double now):
        """Turn every passed deadline into a TIMEOUT transition."""
        with self._lock:
            self._fold(now)

    cdef int _fold(self, double now) except -1:
        cdef Py_ssize_t slot, n = 0, k
        cdef uint8_t timer
        cdef double* deadline = &self._deadline[0]
        cdef int64_t* due = &self._changed[0]
        cdef double later = math.inf
        if now < self._next_deadline:
            return 0
        with nogil:
            for slot in range(self._capacity):
                if deadline[slot] <= now:
                    due[n] = slot
                    n += 1
                elif deadline[slot] < later:
                    later = deadline[slot]
        self._next_deadline = later
        for k in range(n):
            slot = self._changed[k]
            timer = TIMERS[self._local[slot]]
            if self._apply(slot, T_TIMEOUT, now):
                self._reasons[slot] = f"{Timer(timer).name.lower()} timeout after {self._timeouts[timer]:g} s"
        return 0

    def encode(self, double now):
        """Fold deadlines, then fill and return ``buffer`` for the all-reduce MIN."""
        cdef Py_ssize_t cap = self._capacity, j
        cdef uint8_t fp[FP]
        cdef uint64_t count
        with self._lock:
            self._fold(now)
            count = len(self._slots)
            with nogil:
                memcpy(&self._buf[0], &self._code[0], cap)
                for j in range(8):
                    fp[j] = (self._fp_sum >> (8 * j)) & 0xFF
                for j in range(4):
                    fp[8 + j] = (count >> (8 * j)) & 0xFF
                for j in range(FP):
                    self._buf[cap + j] = fp[j]
                    self._buf[cap + FP + j] = 255 - fp[j]
            return self._buffer

    def decode(self):
        """Act on the reduced ``buffer``: emit events for every agreed change, in registration order.

        Raises ``CollectiveError`` (and changes nothing) when the replica's ranks
        hold different request sets.
        """
        cdef Py_ssize_t cap = self._capacity, slot, j, n = 0, k
        cdef uint8_t value, previous
        cdef bint consistent = True
        cdef list events = []
        cdef const uint8_t* buf = &self._buf[0]
        cdef const uint8_t* agreed = &self._agreed[0]
        cdef const int64_t* seq = &self._seq[0]
        cdef int64_t* changed = &self._changed[0]
        cdef uint64_t word_a, word_b
        with self._lock:
            with nogil:
                for j in range(FP):
                    if buf[cap + j] + buf[cap + FP + j] != 255:
                        consistent = False
                slot = 0
                while slot < cap:
                    if slot + 8 <= cap:  # skip unchanged runs eight slots at a time
                        memcpy(&word_a, buf + slot, 8)
                        memcpy(&word_b, agreed + slot, 8)
                        if word_a == word_b:
                            slot += 8
                            continue
                    value = buf[slot]
                    previous = agreed[slot]
                    if previous != FREE and value != previous:
                        if value > C_SUCCESS:
                            consistent = False
                        changed[n] = (seq[slot] << 21) | slot
                        n += 1
                    slot += 1
            if not consistent:
                self._raise_mismatch()
            if n > 1:
                qsort(&self._changed[0], n, sizeof(int64_t), _cmp_i64)
            for k in range(n):
                slot = self._changed[k] & ((1 << 21) - 1)
                value = self._buf[slot]
                previous = self._agreed[slot]
                rid = self._rid_of[slot]
                if value == C_FAILING:  # the replica stops this request: fail here too, no event yet
                    self._agreed[slot] = C_FAILING
                    if self._apply(slot, T_ABORT, 0.0):
                        self._reasons[slot] = FAILED_ELSEWHERE
                    continue
                if value == C_FAILED:
                    events.append(Failed(rid, self._reasons.get(slot, FAILED_ELSEWHERE)))
                else:
                    if previous < C_BOOTSTRAPPED <= value:
                        events.append(Bootstrapped(rid))
                    if value == C_SUCCESS:
                        events.append(Succeeded(rid))
                if value == C_FAILED or value == C_SUCCESS:
                    self._free_slot(slot)
                elif value > previous:
                    self._agreed[slot] = value
            return events

    cdef int _raise_mismatch(self) except -1:
        cdef Py_ssize_t cap = self._capacity
        lo = bytes(self._buffer[cap : cap + FP])
        hi = bytes(255 - int(b) for b in self._buffer[cap + FP :])
        mine = self._fp_sum.to_bytes(8, "little") + len(self._slots).to_bytes(4, "little")
        raise CollectiveError(mismatch_message(mine, lo, hi))
