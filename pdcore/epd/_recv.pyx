# cython: language_level=3, embedsignature=True
"""Compiled EPD receiver table: per-request codes, per-item states and the receive-slot pool.

The behaviour is ``_recv_py``'s, decided by ``_recv_spec``: the three grids, the
timed states and the drop rule are copied into C arrays when this module is
imported (``compiled_spec`` returns the copy for the test that checks it).
Per round (``encode``, ``settle``) the work is passes over contiguous arrays;
Python objects are created only for what is handed out (landed requests,
asks, failures). Argument checks are ``_recv_py``'s own functions, so both
twins refuse the same calls with the same errors.
"""

from libc.stdint cimport uint8_t, int32_t, int64_t, uint64_t
from libc.string cimport memcpy, memset

import math
import threading

import numpy as np

from ..core._hash import rid_hash
from ..core.twin_common import FINGERPRINT_BYTES
from ..core.errors import CapacityError, CollectiveError, LocalProtocolError
from ..core.events import FAILED_ELSEWHERE
from . import _recv_spec
from ._recv_spec import ITEM_STATES, REQUEST_STATES, ItemState, ItemTrigger, RequestState, RequestTrigger, SlotState, SlotTrigger
from .types import LandedItem, LandedRequest
from ._recv_py import (
    MAX_ITEMS,
    MAX_RECORDS,
    MAX_REQUESTS,
    MAX_SLOTS,
    Ask,
    check_config,
    check_items,
    config_salt,
    mismatch_message,
    shard,
)

__all__ = ["ReceiveTable", "Ask", "FINGERPRINT_BYTES", "MAX_SLOTS", "MAX_REQUESTS", "MAX_ITEMS", "MAX_RECORDS"]

cdef enum:
    N_RS = 3
    N_RT = 3
    N_IS = 4
    N_IT = 3
    N_SS = 4
    N_ST = 6
    BAD = 255
    PAD = 255
    FP = 12
    R_FAILED = 0
    R_RECEIVING = 1
    R_LANDED = 2
    RT_ALL_LANDED = 0
    RT_FAIL = 1
    RT_TIMEOUT = 2
    I_PENDING = 0
    I_LEASED = 1
    I_RECEIVING = 2
    I_LANDED = 3
    IT_LEASE = 0
    IT_ASK = 1
    IT_LAND = 2
    S_FREE = 0
    S_LEASED = 1
    S_HELD = 2
    S_FENCING = 3
    ST_LEASE = 0
    ST_HAND_OUT = 1
    ST_RELEASE = 4
    ST_FENCED = 5

cdef uint8_t RGRID[N_RS][N_RT]
cdef uint8_t IGRID[N_IS][N_IT]
cdef uint8_t SGRID[N_SS][N_ST]
cdef uint8_t DROP[N_IS]
cdef bint TIMED[N_RS]


cdef uint8_t _cell(object target):
    return BAD if target is None else <uint8_t>int(target)


cdef void _load_spec() except *:
    assert (len(RequestState), len(RequestTrigger), len(ItemState), len(ItemTrigger)) == (N_RS, N_RT, N_IS, N_IT)
    assert (len(SlotState), len(SlotTrigger), _recv_spec.PAD, FINGERPRINT_BYTES) == (N_SS, N_ST, PAD, FP)
    assert (RequestState.FAILED, RequestState.RECEIVING, RequestState.LANDED) == (R_FAILED, R_RECEIVING, R_LANDED)
    assert (RequestTrigger.ALL_LANDED, RequestTrigger.FAIL, RequestTrigger.TIMEOUT) == (RT_ALL_LANDED, RT_FAIL, RT_TIMEOUT)
    assert tuple(ItemState) == (I_PENDING, I_LEASED, I_RECEIVING, I_LANDED)
    assert (ItemTrigger.LEASE, ItemTrigger.ASK, ItemTrigger.LAND) == (IT_LEASE, IT_ASK, IT_LAND)
    assert tuple(SlotState) == (S_FREE, S_LEASED, S_HELD, S_FENCING)
    assert (SlotTrigger.LEASE, SlotTrigger.HAND_OUT, SlotTrigger.RELEASE, SlotTrigger.FENCED) == (
        ST_LEASE, ST_HAND_OUT, ST_RELEASE, ST_FENCED)
    cdef int s, t
    for s in range(N_RS):
        TIMED[s] = RequestState(s) in _recv_spec.REQUEST_TIMED
        for t in range(N_RT):
            RGRID[s][t] = _cell(_recv_spec.REQUEST_TRANSITIONS[s][t])
    for s in range(N_IS):
        DROP[s] = _cell(_recv_spec.DROP_TRIGGER.get(ItemState(s)))
        for t in range(N_IT):
            IGRID[s][t] = _cell(_recv_spec.ITEM_TRANSITIONS[s][t])
    for s in range(N_SS):
        for t in range(N_ST):
            SGRID[s][t] = _cell(_recv_spec.SLOT_TRANSITIONS[s][t])


_load_spec()


def compiled_spec():
    """The C copy of the grids (``None`` where illegal), the timed states and the drop rule."""
    def cell(uint8_t v):
        return None if v == BAD else v
    return (
        tuple(tuple(RGRID[s][t] for t in range(N_RT)) for s in range(N_RS)),
        tuple(tuple(cell(IGRID[s][t]) for t in range(N_IT)) for s in range(N_IS)),
        tuple(tuple(cell(SGRID[s][t]) for t in range(N_ST)) for s in range(N_SS)),
        frozenset(s for s in range(N_RS) if TIMED[s]),
        tuple(cell(DROP[s]) for s in range(N_IS)),
    )


cdef class ReceiveTable:
    """The EPD receiver's per-request codes, per-item states and receive-slot pool, on one rank.

    ``slots`` receive slots of ``slot_rows`` rows each (one buffer registered
    once, cut into fixed slots); at most ``max_requests`` staged requests of
    at most ``max_items`` items each. ``rank`` of ``ranks`` and ``sharded``
    say which rows of each image this rank receives. ``timeout`` seconds
    after ``stage`` a request that has not landed fails.
    """

    cdef Py_ssize_t _slots, _max_requests, _max_items, _rank, _ranks
    cdef int64_t _slot_rows
    cdef bint _sharded
    cdef double _timeout
    cdef object _lock
    cdef dict _rec_of
    cdef list _rid_of
    cdef dict _reasons
    cdef list _fencing
    cdef list _failed
    # requests
    cdef int32_t[::1] _free_rec
    cdef Py_ssize_t _n_free_rec
    cdef int32_t[::1] _order  # records in staging order
    cdef Py_ssize_t _n
    cdef uint8_t[::1] _state
    cdef double[::1] _deadline
    cdef uint64_t[::1] _hash
    cdef int32_t[::1] _n_items
    cdef int32_t[::1] _n_landed
    # items: record r's k-th item is r * max_items + k
    cdef uint8_t[::1] _istate
    cdef int32_t[::1] _islot
    cdef int64_t[::1] _iindex
    cdef int64_t[::1] _istart
    cdef int64_t[::1] _icount
    cdef int64_t[::1] _irows
    cdef Py_ssize_t _n_pending, _n_unasked
    # slots
    cdef uint8_t[::1] _sstate
    cdef Py_ssize_t _n_free, _n_held
    # the round
    cdef uint64_t _seq, _fp_sum
    cdef double _next_deadline
    cdef Py_ssize_t _n_sent  # -1: no encode since the last settle
    cdef uint8_t[::1] _sent
    cdef object _buffer
    cdef uint8_t[::1] _buf

    def __init__(self, slots, slot_rows, *, max_requests=4096, max_items=64, rank=0, ranks=1, sharded=False,
                 timeout=300.0):
        check_config(slots, slot_rows, max_requests, max_items, rank, ranks, sharded, timeout)
        self._slots = slots
        self._slot_rows = slot_rows
        self._max_requests = max_requests
        self._max_items = max_items
        self._rank = rank
        self._ranks = ranks
        self._sharded = sharded
        self._timeout = timeout
        self._lock = threading.Lock()
        self._rec_of = {}
        self._rid_of = [None] * max_requests
        self._reasons = {}
        self._fencing = []
        self._failed = []
        self._free_rec = np.arange(max_requests - 1, -1, -1, dtype=np.int32)
        self._n_free_rec = max_requests
        self._order = np.zeros(max_requests, dtype=np.int32)
        self._n = 0
        self._state = np.full(max_requests, PAD, dtype=np.uint8)
        self._deadline = np.full(max_requests, math.inf, dtype=np.float64)
        self._hash = np.zeros(max_requests, dtype=np.uint64)
        self._n_items = np.zeros(max_requests, dtype=np.int32)
        self._n_landed = np.zeros(max_requests, dtype=np.int32)
        n = max_requests * max_items
        self._istate = np.zeros(n, dtype=np.uint8)
        self._islot = np.full(n, -1, dtype=np.int32)
        self._iindex = np.zeros(n, dtype=np.int64)
        self._istart = np.zeros(n, dtype=np.int64)
        self._icount = np.zeros(n, dtype=np.int64)
        self._irows = np.zeros(n, dtype=np.int64)
        self._n_pending = 0
        self._n_unasked = 0
        self._sstate = np.zeros(slots, dtype=np.uint8)
        self._n_free = slots
        self._n_held = 0
        self._seq = 0
        self._fp_sum = config_salt(ranks, sharded)
        self._next_deadline = math.inf
        self._n_sent = -1
        self._sent = np.zeros(max_requests, dtype=np.uint8)
        self._buffer = np.full(max_requests + 2 * FP, PAD, dtype=np.uint8)
        self._buf = self._buffer

    # -- configuration ------------------------------------------------------------

    @property
    def slots(self):
        return self._slots

    @property
    def slot_rows(self):
        return self._slot_rows

    @property
    def max_requests(self):
        return self._max_requests

    @property
    def max_items(self):
        return self._max_items

    @property
    def rank(self):
        return self._rank

    @property
    def ranks(self):
        return self._ranks

    @property
    def sharded(self):
        return self._sharded

    @property
    def timeout(self):
        return self._timeout

    @property
    def buffer(self):
        """The reduction buffer: ``max_requests`` code bytes (PAD past the staged), then the fingerprint pair."""
        return self._buffer

    # -- queries ------------------------------------------------------------------

    def __len__(self):
        return self._n

    def __contains__(self, rid):
        return rid in self._rec_of

    def rids(self):
        """Staged requests in staging order."""
        with self._lock:
            return [self._rid_of[self._order[j]] for j in range(self._n)]

    def state(self, rid):
        with self._lock:
            return REQUEST_STATES[self._state[self._rec(rid)]]

    def reason(self, rid):
        """Why ``rid`` failed on this rank; empty while it has not."""
        with self._lock:
            return self._reasons.get(self._rec(rid), "")

    def item_state(self, rid, index):
        with self._lock:
            return ITEM_STATES[self._istate[self._item(rid, index)]]

    def slot_of(self, rid, index):
        cdef int32_t slot
        with self._lock:
            slot = self._islot[self._item(rid, index)]
            return None if slot < 0 else slot

    def slot_state(self, slot):
        with self._lock:
            self._check_slot(slot)
            return SlotState(self._sstate[slot])

    def free_slots(self):
        with self._lock:
            return self._n_free

    def awaiting_release(self):
        """A landed slot still waits for its rows to be copied out."""
        return self._n_held > 0

    def failed(self):
        """The requests the last ``settle`` dropped as failed, (rid, reason) in staging order."""
        with self._lock:
            return list(self._failed)

    cdef Py_ssize_t _rec(self, rid) except -1:
        try:
            return self._rec_of[rid]
        except (KeyError, TypeError):
            raise LocalProtocolError(f"rid {rid!r} is not staged") from None

    cdef Py_ssize_t _item(self, rid, index) except -1:
        cdef Py_ssize_t rec = self._rec(rid), base, k
        base = rec * self._max_items
        if not isinstance(index, bool) and isinstance(index, int) and -(1 << 63) <= index < (1 << 63):
            for k in range(self._n_items[rec]):
                if self._iindex[base + k] == index:
                    return base + k
        raise LocalProtocolError(f"rid {rid!r} has no item {index!r}")

    cdef int _check_slot(self, slot) except -1:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self._slots:
            raise LocalProtocolError(f"slot {slot!r} is not a slot of the pool (0..{self._slots - 1})")
        return 0

    # -- steps ---------------------------------------------------------------------

    cdef uint8_t _item_step(self, Py_ssize_t i, uint8_t state, int trigger) except 255:
        cdef uint8_t new = IGRID[state][trigger]
        if new == BAD:
            rec = i // self._max_items
            raise LocalProtocolError(
                f"item {self._iindex[i]} of {self._rid_of[rec]!r}: {ItemTrigger(trigger).name} "
                f"is not allowed in {ItemState(state).name}"
            )
        return new

    cdef int _slot_step(self, Py_ssize_t slot, int trigger) except -1:
        cdef uint8_t old = self._sstate[slot]
        cdef uint8_t new = SGRID[old][trigger]
        if new == BAD:
            raise LocalProtocolError(f"slot {slot}: {SlotTrigger(trigger).name} is not allowed in {SlotState(old).name}")
        self._sstate[slot] = new
        self._n_free += (new == S_FREE) - (old == S_FREE)
        self._n_held += (new == S_HELD) - (old == S_HELD)
        if new == S_FENCING:
            self._fencing.append(slot)
        return 0

    cdef int _request_step(self, Py_ssize_t rec, int trigger, reason) except -1:
        cdef uint8_t old = self._state[rec]
        cdef uint8_t new = RGRID[old][trigger]
        if new != old:
            self._state[rec] = new
            if new == R_FAILED:
                self._reasons[rec] = reason
        return 0

    # -- staging and local updates -------------------------------------------------

    def stage(self, rid, items, double now):
        """Start receiving ``rid``'s items; never blocks: items that find no free slot wait, on the request's clock."""
        check_items(rid, items, self._slots, self._slot_rows, self._max_items, self._ranks, self._sharded)
        cdef Py_ssize_t rec, base, i, k
        cdef double at
        with self._lock:
            if rid in self._rec_of:
                raise LocalProtocolError(f"rid {rid!r} is already staged")
            if self._n_free_rec == 0:
                raise CapacityError(f"cannot stage {rid!r}: all {self._max_requests} requests are in use")
            h = rid_hash(rid, self._seq)
            self._n_free_rec -= 1
            rec = self._free_rec[self._n_free_rec]
            self._rec_of[rid] = rec
            self._rid_of[rec] = rid
            self._order[self._n] = rec
            self._n += 1
            self._state[rec] = R_RECEIVING
            at = now + self._timeout
            self._deadline[rec] = at
            if at < self._next_deadline:
                self._next_deadline = at
            self._hash[rec] = h
            self._seq += 1
            self._fp_sum += self._hash[rec]
            self._n_items[rec] = len(items)
            self._n_landed[rec] = 0
            base = rec * self._max_items
            for k, item in enumerate(items):
                i = base + k
                start, count = shard(item.rows, self._rank, self._ranks, self._sharded)
                self._iindex[i] = item.index
                self._irows[i] = item.rows
                self._istart[i] = start
                self._icount[i] = count
                self._istate[i] = I_PENDING
                self._islot[i] = -1
                if count == 0:  # an empty shard needs no slot: it is leased at once
                    self._istate[i] = self._item_step(i, I_PENDING, IT_LEASE)
                    self._n_unasked += 1
                else:
                    self._n_pending += 1
            if not items:
                self._request_step(rec, RT_ALL_LANDED, "")
            self._lease()

    def landed(self, rid, index, double now):
        """Item ``index`` of ``rid`` landed on this rank; returns the request's state."""
        cdef Py_ssize_t i, rec
        cdef uint8_t old
        with self._lock:
            i = self._item(rid, index)
            rec = i // self._max_items
            old = self._istate[i]
            self._istate[i] = self._item_step(i, old, IT_LAND)
            if old != I_LANDED:
                self._n_landed[rec] += 1
                if self._n_landed[rec] == self._n_items[rec]:
                    self._request_step(rec, RT_ALL_LANDED, "")
            return REQUEST_STATES[self._state[rec]]

    def fail(self, rid, reason, double now):
        """``rid`` failed on this rank (``reason`` is kept); returns its state, FAILED."""
        cdef Py_ssize_t rec
        with self._lock:
            rec = self._rec(rid)
            self._request_step(rec, RT_FAIL, reason or "failed")
            return REQUEST_STATES[self._state[rec]]

    # -- the slot pool -------------------------------------------------------------

    cdef int _lease(self) except -1:
        """Give free slots to waiting items, in staging order (strict FIFO), lowest slot first."""
        cdef Py_ssize_t j, rec, i, base, end, slot = 0
        if self._n_pending == 0 or self._n_free == 0:
            return 0
        for j in range(self._n):
            rec = self._order[j]
            if self._state[rec] == R_FAILED:
                continue
            base = rec * self._max_items
            end = base + self._n_items[rec]
            for i in range(base, end):
                if self._istate[i] != I_PENDING:
                    continue
                if self._n_free == 0:
                    return 0
                while self._sstate[slot] != S_FREE:
                    slot += 1
                self._slot_step(slot, ST_LEASE)
                self._istate[i] = self._item_step(i, I_PENDING, IT_LEASE)
                self._islot[i] = slot
                self._n_pending -= 1
                self._n_unasked += 1
        return 0

    def take_ready(self):
        """Items that now hold their slot (or need none), each returned once: the peer asks their encode rank.

        Items of a request that failed here are not returned: they are never asked.
        """
        cdef Py_ssize_t j, rec, i, base
        cdef int32_t slot
        cdef list out = []
        with self._lock:
            if self._n_unasked == 0:
                return out
            for j in range(self._n):
                rec = self._order[j]
                if self._state[rec] == R_FAILED:
                    continue
                base = rec * self._max_items
                for i in range(base, base + self._n_items[rec]):
                    if self._istate[i] == I_LEASED:
                        self._istate[i] = self._item_step(i, I_LEASED, IT_ASK)
                        self._n_unasked -= 1
                        slot = self._islot[i]
                        out.append(Ask(self._rid_of[rec], self._iindex[i], None if slot < 0 else slot,
                                       self._istart[i], self._icount[i]))
            return out

    def take_fencing(self):
        """Slots quarantined since the last call, each returned once: the owner closes their fence, then ``fenced``."""
        with self._lock:
            out, self._fencing = self._fencing, []
            return out

    def fenced(self, slot):
        """Nothing from the encode side can land in ``slot`` any more (it must be FENCING): it takes new receives."""
        with self._lock:
            self._check_slot(slot)
            self._slot_step(slot, ST_FENCED)
            self._lease()

    def release(self, slots):
        """The data plane copied these HELD slots' rows out; all or none: a bad slot changes nothing."""
        with self._lock:
            seen = set()
            for slot in slots:
                self._check_slot(slot)
                if slot in seen:
                    raise LocalProtocolError(f"slot {slot} is released twice in one call")
                seen.add(slot)
                if SGRID[self._sstate[slot]][ST_RELEASE] == BAD:
                    raise LocalProtocolError(
                        f"slot {slot}: RELEASE is not allowed in {SlotState(self._sstate[slot]).name}"
                    )
            for slot in slots:
                self._slot_step(slot, ST_RELEASE)
            self._lease()

    # -- the round -----------------------------------------------------------------

    def fold(self, double now):
        """Turn every passed deadline into a TIMEOUT transition."""
        with self._lock:
            self._fold(now)

    cdef int _fold(self, double now) except -1:
        cdef Py_ssize_t j, rec, i, base, waiting
        cdef double later = math.inf
        if now < self._next_deadline:
            return 0
        for j in range(self._n):
            rec = self._order[j]
            if not TIMED[self._state[rec]]:
                continue
            if self._deadline[rec] <= now:
                base = rec * self._max_items
                waiting = 0
                for i in range(base, base + self._n_items[rec]):
                    waiting += self._istate[i] == I_PENDING
                why = f"timeout after {self._timeout:g} s"
                if waiting:
                    why += f" ({waiting} of {self._n_items[rec]} items still waiting for a receive slot)"
                self._request_step(rec, RT_TIMEOUT, why)
            elif self._deadline[rec] < later:
                later = self._deadline[rec]
        self._next_deadline = later
        return 0

    cdef bytes _fingerprint(self):
        return (<object>self._fp_sum).to_bytes(8, "little") + (<object>self._n).to_bytes(4, "little")

    def encode(self, double now):
        """Fold deadlines, then fill and return ``buffer`` for the all-reduce MIN (codes in staging order)."""
        cdef Py_ssize_t j, n, cap = self._max_requests
        cdef uint8_t fp[FP]
        with self._lock:
            self._fold(now)
            n = self._n
            for j in range(n):
                self._buf[j] = self._state[self._order[j]]
            if cap > n:
                memset(&self._buf[n], PAD, cap - n)
            for j in range(8):
                fp[j] = (self._fp_sum >> (8 * j)) & 0xFF
            for j in range(4):
                fp[8 + j] = (<uint64_t>n >> (8 * j)) & 0xFF
            for j in range(FP):
                self._buf[cap + j] = fp[j]
                self._buf[cap + FP + j] = 255 - fp[j]
            if n:
                memcpy(&self._sent[0], &self._buf[0], n)
            self._n_sent = n
            return self._buffer

    def settle(self, agreed):
        """Act on the replica's MIN of ``encode``'s buffer (or, unguarded, of its first ``len(self)`` codes).

        In staging order: 2 → the request is forgotten and returned, its
        slots HELD until ``release``; 0 → dropped (``failed()`` names it), its
        slots freed or quarantined until ``fenced``; 1 → nothing. Raises
        ``CollectiveError`` (changing nothing) when the ranks held different
        staged sets or a code is not a MIN that includes this rank's.
        """
        cdef Py_ssize_t j, keep = 0, n, rec
        cdef int64_t code
        cdef int64_t[::1] codes
        cdef list landed = []
        cdef list failed = []
        with self._lock:
            if self._n_sent < 0:
                raise LocalProtocolError("settle without an encode since the last settle")
            codes = self._check_agreed(agreed)
            n = self._n_sent
            for j in range(n):
                rec = self._order[j]
                code = codes[j]
                if code == R_RECEIVING:
                    self._order[keep] = rec
                    keep += 1
                    continue
                rid = self._rid_of[rec]
                if code == R_LANDED:
                    landed.append(self._hand_out(rid, rec))
                else:
                    failed.append((rid, self._reasons.get(rec, FAILED_ELSEWHERE)))
                    self._drop(rec)
                self._forget(rid, rec)
            for j in range(n, self._n):  # staged after the encode: kept, in order
                self._order[keep] = self._order[j]
                keep += 1
            self._n = keep
            self._failed = failed
            self._n_sent = -1
            self._lease()
            return landed

    def decode(self):
        """``settle(self.buffer)``: the round's second half when the reduction ran in place on ``buffer``.

        With it the table is what ``pdcore.core.agreement.Agreement`` drives
        (``encode(now)``, MIN of ``buffer`` across the replica, ``decode()``),
        over the group's collective or shared memory, mismatch guard included.
        """
        return self.settle(self._buffer)

    cdef int64_t[::1] _check_agreed(self, agreed):
        cdef Py_ssize_t n = self._n_sent, cap = self._max_requests, j, length
        cdef int64_t[::1] a
        cdef bint consistent = True
        arr = np.asarray(agreed)
        if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):  # [] is a float array: no codes is fine
            raise LocalProtocolError(f"agreed codes must be a 1-d integer vector, got {arr.dtype} of shape {arr.shape}")
        length = arr.shape[0]
        if arr.dtype.kind == "u" and arr.dtype.itemsize == 8:
            arr = np.minimum(arr, 1 << 62)  # keep huge unsigned values huge when they become int64
        a = np.ascontiguousarray(arr, dtype=np.int64)
        if length == cap + 2 * FP:
            for j in range(FP):
                if a[cap + j] + a[cap + FP + j] != 255:
                    consistent = False
            for j in range(n, cap):
                if a[j] != PAD:
                    consistent = False
            if not consistent:
                lo = bytes(min(max(int(a[cap + j]), 0), 255) for j in range(FP))
                hi = bytes(min(max(255 - int(a[cap + FP + j]), 0), 255) for j in range(FP))
                raise CollectiveError(mismatch_message(self._fingerprint(), lo, hi))
        elif length != n:
            raise LocalProtocolError(
                f"agreed codes hold {length} values: expected the buffer's {cap + 2 * FP} "
                f"or the {n} staged requests' codes of the last encode"
            )
        for j in range(n):
            if not 0 <= a[j] <= self._sent[j]:
                raise CollectiveError(
                    f"EPD receiver agreement refused: agreed code {a[j]} for staged request {j} is not a MIN "
                    f"that includes this rank's code {self._sent[j]}"
                )
        return a

    cdef object _hand_out(self, rid, Py_ssize_t rec):
        cdef Py_ssize_t base = rec * self._max_items, i
        cdef int32_t slot
        items = []
        for i in range(base, base + self._n_items[rec]):
            slot = self._islot[i]
            if slot >= 0:
                self._slot_step(slot, ST_HAND_OUT)
            items.append(LandedItem(self._iindex[i], None if slot < 0 else slot, self._istart[i], self._icount[i],
                                    self._irows[i], self._sharded))
        return LandedRequest(rid, tuple(items))

    cdef int _drop(self, Py_ssize_t rec) except -1:
        cdef Py_ssize_t base = rec * self._max_items, i
        cdef uint8_t state
        cdef int32_t slot
        for i in range(base, base + self._n_items[rec]):
            state = self._istate[i]
            if state == I_PENDING:
                self._n_pending -= 1
            elif state == I_LEASED:
                self._n_unasked -= 1
            slot = self._islot[i]
            if slot >= 0:
                self._slot_step(slot, DROP[state])
        return 0

    cdef int _forget(self, rid, Py_ssize_t rec) except -1:
        cdef Py_ssize_t base = rec * self._max_items, i
        del self._rec_of[rid]
        self._rid_of[rec] = None
        self._state[rec] = PAD
        self._deadline[rec] = math.inf
        self._fp_sum -= self._hash[rec]
        self._hash[rec] = 0
        if self._reasons:
            self._reasons.pop(rec, None)
        for i in range(base, base + self._n_items[rec]):
            self._islot[i] = -1
            self._istate[i] = 0
        self._n_items[rec] = 0
        self._n_landed[rec] = 0
        self._free_rec[self._n_free_rec] = rec
        self._n_free_rec += 1
        return 0
