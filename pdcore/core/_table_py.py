"""Pure-Python twin of ``pdcore.core._table``: same names, signatures, exceptions, events.

It is the oracle the property tests compare the compiled table against, and
what runs under ``PDCORE_PURE_PYTHON=1``. Everything it decides comes from
``_spec``; read that module first.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from transport.limits import U64_MAX

from . import _spec
from ._spec import CODE_FAILING, FREE, STATES, Fence, State, Timer, Trigger, code_of, state_of_code
from .errors import CapacityError, CollectiveError, LocalProtocolError
from .events import FAILED_ELSEWHERE, Bootstrapped, Event, Failed, Succeeded
from .twin_common import FINGERPRINT_BYTES, check_config, mismatch_message, rid_hash

__all__ = ["StateTable"]



class StateTable:
    """Per-request transfer states of one rank, and its half of the replica agreement.

    ``register``/``remove``/``encode``/``decode`` belong to the scheduler thread
    (every rank calls them in the same order); ``update``, ``fenced`` and
    ``take_fencing`` may be called from any thread. A round is ``encode(now)``
    (fold deadlines, fill ``buffer`` with the codes of ``_spec``), an all-reduce
    MIN of ``buffer`` across the replica, then ``decode()``.
    """

    def __init__(self, capacity: int, *, bootstrap_timeout: float = 120.0, waiting_timeout: float = 300.0) -> None:
        check_config(capacity, bootstrap_timeout, waiting_timeout)
        self._capacity = capacity
        self._timeouts = (math.inf, float(bootstrap_timeout), float(waiting_timeout))
        self._lock = threading.Lock()
        self._slots: dict[str, int] = {}  # insertion order = registration order
        self._rid_of: list[str | None] = [None] * capacity
        self._local = [FREE] * capacity
        self._fence = [Fence.NONE] * capacity
        self._code = [FREE] * capacity  # what this rank contributes to the MIN
        self._agreed = [FREE] * capacity  # the last agreed code acted on
        self._fencing: list[str] = []
        self._deadline = [math.inf] * capacity
        self._hash = [0] * capacity
        self._reasons: dict[int, str] = {}
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest slot first
        self._fp_sum = 0
        self._buffer = np.full(capacity + 2 * FINGERPRINT_BYTES, FREE, dtype=np.uint8)

    # -- registry -----------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def buffer(self) -> np.ndarray:
        """The reduction buffer: ``capacity`` state bytes, then the fingerprint pair."""
        return self._buffer

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, rid: object) -> bool:
        return rid in self._slots

    def has_in_flight(self) -> bool:
        """A request is still tracked: its transfer may yet read or write memory."""
        return bool(self._slots)

    def rids(self) -> list[str]:
        """Live requests in registration order."""
        with self._lock:
            return list(self._slots)

    def register(self, rid: str, now: float) -> int:
        """Track ``rid`` from BOOTSTRAPPING and return its slot."""
        if not isinstance(rid, str) or not rid:
            raise LocalProtocolError(f"rid must be a non-empty str, got {rid!r}")
        with self._lock:
            if rid in self._slots:
                raise LocalProtocolError(f"rid {rid!r} is already registered (slot {self._slots[rid]})")
            if not self._free:
                raise CapacityError(f"cannot register {rid!r}: all {self._capacity} slots are in use")
            slot = self._free.pop()
            self._slots[rid] = slot
            self._rid_of[slot] = rid
            self._local[slot] = State.BOOTSTRAPPING
            self._agreed[slot] = code_of(State.BOOTSTRAPPING, Fence.NONE, FREE)
            self._refresh(slot)
            self._deadline[slot] = now + self._timeouts[Timer.BOOTSTRAP]
            self._hash[slot] = rid_hash(rid, slot)
            self._fp_sum = (self._fp_sum + self._hash[slot]) & U64_MAX
            return slot

    def remove(self, rid: str) -> None:
        """Stop tracking ``rid`` without an event (every rank must remove it in the same round)."""
        with self._lock:
            self._free_slot(self._slot_of(rid))

    def _slot_of(self, rid: str) -> int:
        try:
            return self._slots[rid]
        except (KeyError, TypeError):
            raise LocalProtocolError(f"rid {rid!r} is not registered") from None

    def _free_slot(self, slot: int) -> None:
        rid = self._rid_of[slot]
        assert rid is not None
        del self._slots[rid]
        self._rid_of[slot] = None
        self._local[slot] = FREE
        self._fence[slot] = Fence.NONE
        self._code[slot] = FREE
        self._agreed[slot] = FREE
        self._deadline[slot] = math.inf
        self._fp_sum = (self._fp_sum - self._hash[slot]) & U64_MAX
        self._hash[slot] = 0
        self._reasons.pop(slot, None)
        self._free.append(slot)

    # -- local updates ----------------------------------------------------------------

    def update(self, rid: str, trigger: int, now: float, reason: str = "") -> State:
        """Fire ``trigger`` for ``rid`` on this rank; returns the new local state.

        Safe from any thread. ``reason`` is kept, as ``str``, when the request fails here.
        """
        if not isinstance(trigger, int) or not 0 <= trigger < len(Trigger):
            raise LocalProtocolError(f"trigger {trigger!r} for rid {rid!r} is not a Trigger (0..{len(Trigger) - 1})")
        with self._lock:
            slot = self._slot_of(rid)
            self._apply(slot, trigger, now, str(reason) if reason else Trigger(trigger).name.lower())
            return STATES[self._local[slot]]

    def _apply(self, slot: int, trigger: int, now: float, reason: str) -> None:
        old = self._local[slot]
        new = _spec.TRANSITIONS[old][trigger]
        if trigger in _spec.ARMS_FENCE and old != State.FAILED and self._fence[slot] == Fence.NONE:
            self._fence[slot] = Fence.ARMED
        if new != old:
            self._local[slot] = new
            if _spec.TIMERS[new] != _spec.TIMERS[old]:
                self._deadline[slot] = now + self._timeouts[_spec.TIMERS[new]]
            if new == State.FAILED:
                self._reasons[slot] = reason
                if self._fence[slot] == Fence.ARMED:
                    self._fencing.append(self._rid_of[slot])  # type: ignore[arg-type]
        self._refresh(slot)

    def _refresh(self, slot: int) -> None:
        self._code[slot] = code_of(self._local[slot], self._fence[slot], self._agreed[slot])

    def fenced(self, rid: str) -> None:
        """Confirm that nothing can land in or leave ``rid``'s memory any more (it must have failed)."""
        with self._lock:
            slot = self._slot_of(rid)
            if self._local[slot] != State.FAILED:
                raise LocalProtocolError(f"rid {rid!r} is {State(self._local[slot]).name}, not FAILED: nothing to fence")
            self._fence[slot] = Fence.DONE
            self._refresh(slot)

    def take_fencing(self) -> list[str]:
        """Failed rids whose armed fence the owner must now close, each returned once."""
        with self._lock:
            out, self._fencing = self._fencing, []
            return out

    def fence(self, rid: str) -> Fence:
        with self._lock:
            return Fence(self._fence[self._slot_of(rid)])

    def state(self, rid: str) -> State:
        """This rank's local state of ``rid``."""
        with self._lock:
            return STATES[self._local[self._slot_of(rid)]]

    def agreed(self, rid: str) -> State:
        """The highest state the replica agreed on for ``rid`` so far (FAILED once it is failing)."""
        with self._lock:
            return state_of_code(self._agreed[self._slot_of(rid)])

    def slot(self, rid: str) -> int:
        with self._lock:
            return self._slot_of(rid)

    # -- the round ----------------------------------------------------------------------

    def fold(self, now: float) -> None:
        """Turn every passed deadline into a TIMEOUT transition."""
        with self._lock:
            self._fold(now)

    def _fold(self, now: float) -> None:
        for slot in sorted(slot for slot in self._slots.values() if self._deadline[slot] <= now):  # slot order
            timer = _spec.TIMERS[self._local[slot]]
            seconds = self._timeouts[timer]
            self._apply(slot, Trigger.TIMEOUT, now, f"{Timer(timer).name.lower()} timeout after {seconds:g} s")

    def encode(self, now: float) -> np.ndarray:
        """Fold deadlines, then fill and return ``buffer`` for the all-reduce MIN."""
        with self._lock:
            self._fold(now)
            cap = self._capacity
            self._buffer[:cap] = self._code
            fp = self._fingerprint()
            self._buffer[cap : cap + FINGERPRINT_BYTES] = list(fp)
            self._buffer[cap + FINGERPRINT_BYTES :] = [255 - b for b in fp]
            return self._buffer

    def _fingerprint(self) -> bytes:
        return self._fp_sum.to_bytes(8, "little") + len(self._slots).to_bytes(4, "little")

    def decode(self) -> list[Event]:
        """Act on the reduced ``buffer``: emit events for every agreed change, in registration order.

        Raises ``CollectiveError`` (and changes nothing) when the replica's ranks
        hold different request sets.
        """
        with self._lock:
            self._check_fingerprint()
            buf = self._buffer
            events: list[Event] = []
            for rid, slot in list(self._slots.items()):
                value = int(buf[slot])
                previous = self._agreed[slot]
                if value == previous:
                    continue
                if value == CODE_FAILING:  # the replica stops this request: fail here too, no event yet
                    self._agreed[slot] = CODE_FAILING
                    self._apply(slot, Trigger.ABORT, 0.0, FAILED_ELSEWHERE)
                    continue
                for kind in _spec.events_for(previous, value):
                    if kind == _spec.EventKind.BOOTSTRAPPED:
                        events.append(Bootstrapped(rid))
                    elif kind == _spec.EventKind.SUCCEEDED:
                        events.append(Succeeded(rid))
                    else:
                        events.append(Failed(rid, self._reasons.get(slot, FAILED_ELSEWHERE)))
                if value in (_spec.CODE_FAILED, _spec.CODE_SUCCESS):
                    self._free_slot(slot)
                elif value > previous:
                    self._agreed[slot] = value
            return events

    def _check_fingerprint(self) -> None:
        cap = self._capacity
        lo = self._buffer[cap : cap + FINGERPRINT_BYTES]
        hi_inv = self._buffer[cap + FINGERPRINT_BYTES :]
        if all(int(a) + int(b) == 255 for a, b in zip(lo, hi_inv)):
            live_over_range = [slot for slot in self._slots.values() if self._buffer[slot] > _spec.CODE_SUCCESS]
            if not live_over_range:
                return
        raise CollectiveError(mismatch_message(self._fingerprint(), bytes(lo), bytes(255 - int(b) for b in hi_inv)))
