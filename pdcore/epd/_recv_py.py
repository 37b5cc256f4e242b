"""Pure-Python twin of ``pdcore.epd._recv``: the EPD receiver's state table and slot pool.

Same names, signatures, exceptions and results as the compiled module; the
oracle the property tests drive it against, and what runs under
``PDCORE_PURE_PYTHON=1``. Everything it decides comes from ``_recv_spec``; read
that module first.

Sans-IO: ``now`` is an argument, nothing here touches a socket or a clock.
``stage``/``encode``/``settle``/``release`` belong to the scheduler thread
(every rank calls ``stage`` and ``settle`` in the same order); ``landed``,
``fail``, ``take_ready``, ``take_fencing`` and ``fenced`` may come from the
peer's I/O threads: one lock guards the table.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from transport.limits import U64_MAX

from ..core.twin_common import FINGERPRINT_BYTES, describe_mismatch, rid_hash
from ..core.errors import CapacityError, CollectiveError, LocalProtocolError
from ..core.events import FAILED_ELSEWHERE
from . import _recv_spec
from ._recv_spec import shard  # noqa: F401  (the compiled table takes it from here)
from ._recv_spec import PAD, ILLEGAL, ITEM_STATES, REQUEST_STATES, ItemState, ItemTrigger, RequestState, RequestTrigger, SlotState, SlotTrigger
from .types import EmbeddingItem, LandedItem, LandedRequest

__all__ = ["ReceiveTable", "Ask", "FINGERPRINT_BYTES", "MAX_SLOTS", "MAX_REQUESTS", "MAX_ITEMS", "MAX_RECORDS"]

MAX_SLOTS = 1 << 16
MAX_REQUESTS = 1 << 20
MAX_ITEMS = 1 << 10
#: max_requests * max_items: the item records are preallocated, so their product is bounded.
MAX_RECORDS = 1 << 24


class Ask(NamedTuple):
    """An item whose receive request the peer must now send to its encode rank.

    ``slot`` is ``None`` for an empty shard (it still asks, for 0 rows: its
    request is the fan-out's "I am here").
    """

    rid: str
    index: int  # type: ignore[assignment]  # a field where tuple has a method: Ask.index is the item's position
    slot: int | None
    row_start: int
    row_count: int


def check_config(
    slots: int, slot_rows: int, max_requests: int, max_items: int, rank: int, ranks: int, sharded: bool, timeout: float
) -> None:
    """The constructor's checks, shared by both twins."""
    for name, value in (("slots", slots), ("slot_rows", slot_rows), ("max_requests", max_requests),
                        ("max_items", max_items), ("rank", rank), ("ranks", ranks)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 < slots <= MAX_SLOTS:
        raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {slots!r}")
    if not 0 < slot_rows < (1 << 62):
        raise ValueError(f"slot_rows must be a positive row count, got {slot_rows!r}")
    if not 0 < max_requests <= MAX_REQUESTS:
        raise ValueError(f"max_requests must be in 1..{MAX_REQUESTS}, got {max_requests!r}")
    if not 0 < max_items <= MAX_ITEMS:
        raise ValueError(f"max_items must be in 1..{MAX_ITEMS}, got {max_items!r}")
    if max_requests * max_items > MAX_RECORDS:
        raise ValueError(f"max_requests * max_items must be at most {MAX_RECORDS}, got {max_requests * max_items}")
    if not 0 < ranks <= 1 << 16 or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank!r} of ranks {ranks!r} is not a rank of the replica")
    if not isinstance(sharded, bool):
        raise ValueError(f"sharded must be a bool, got {sharded!r}")
    if not (timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def check_items(rid: object, items: object, slots: int, slot_rows: int, max_items: int, ranks: int, sharded: bool) -> None:
    """``stage``'s checks of its arguments, shared by both twins; each depends only on what every rank holds."""
    if not isinstance(rid, str) or not rid:
        raise LocalProtocolError(f"rid must be a non-empty str, got {rid!r}")
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise LocalProtocolError(f"items of {rid!r} must be a sequence of EmbeddingItem, got {type(items).__name__}")
    if len(items) > max_items:
        raise CapacityError(f"cannot stage {rid!r}: {len(items)} items, the table takes at most {max_items} a request")
    if len(items) > slots:
        raise CapacityError(
            f"cannot stage {rid!r}: {len(items)} items could never hold a receive slot each at once "
            f"(the pool has {slots})"
        )
    previous = -1
    for item in items:
        if type(item) is not EmbeddingItem:
            raise LocalProtocolError(f"items of {rid!r} hold a {type(item).__name__}, not an EmbeddingItem")
        if item.index <= previous:
            raise LocalProtocolError(
                f"items of {rid!r} must be in the request's order (strictly increasing index), "
                f"got {previous} then {item.index}"
            )
        previous = item.index
        need = -(-item.rows // ranks) if sharded else item.rows  # the largest shard: the same bound on every rank
        if need > slot_rows:
            raise CapacityError(
                f"cannot stage {rid!r}: item {item.index} needs {need} rows in a slot, slots hold {slot_rows}"
            )


def config_salt(ranks: int, sharded: bool) -> int:
    """The fingerprint's starting value: what decides how the ranks split each image.

    Ranks built with a different ``ranks`` or ``sharded`` would receive shares
    that do not tile the image; with the salt their fingerprints differ from
    the first round on, staged requests or not, so every rank raises
    ``CollectiveError`` at once instead of publishing torn rows.
    """
    return rid_hash(f"pdcore.epd receiver: ranks={ranks} sharded={bool(sharded)}", 0)


def mismatch_message(mine: bytes, lowest: bytes, highest: bytes) -> str:
    """Name what differs between the ranks: the number of staged requests, or which they are."""
    return describe_mismatch(
        mine, lowest, highest, agreement="EPD receiver", held="staged",
        not_same="(order, rid) set, or their tables split the images differently (ranks, sharded)",
        rule="Every rank must stage the same rids in the same order and settle the same codes.")


def _clock(now: object) -> float:
    """``now`` as the compiled twin's ``double`` argument takes it: a number, or ``TypeError``."""
    if isinstance(now, (str, bytes, bytearray)):
        raise TypeError(f"now must be a number of seconds, got {type(now).__name__} {now!r}")
    return float(now)  # type: ignore[arg-type]


def _item_step(rid: str, index: int, state: int, trigger: ItemTrigger) -> ItemState:
    new = _recv_spec.ITEM_TRANSITIONS[state][trigger]
    if new is ILLEGAL:
        raise LocalProtocolError(
            f"item {index} of {rid!r}: {trigger.name} is not allowed in {ItemState(state).name}"
        )
    return new


class ReceiveTable:
    """The EPD receiver's per-request codes, per-item states and receive-slot pool, on one rank.

    ``slots`` receive slots of ``slot_rows`` rows each (one buffer registered
    once, cut into fixed slots); at most ``max_requests`` staged requests of
    at most ``max_items`` items each. ``rank`` of ``ranks`` and ``sharded``
    say which rows of each image this rank receives. ``timeout`` seconds
    after ``stage`` a request that has not landed fails.
    """

    def __init__(
        self,
        slots: int,
        slot_rows: int,
        *,
        max_requests: int = 4096,
        max_items: int = 64,
        rank: int = 0,
        ranks: int = 1,
        sharded: bool = False,
        timeout: float = 300.0,
    ) -> None:
        check_config(slots, slot_rows, max_requests, max_items, rank, ranks, sharded, timeout)
        self._slots = slots
        self._slot_rows = slot_rows
        self._max_requests = max_requests
        self._max_items = max_items
        self._rank = rank
        self._ranks = ranks
        self._sharded = sharded
        self._timeout = float(timeout)
        self._lock = threading.Lock()
        # requests: one record each, rid -> record in staging order (dict order)
        self._rec_of: dict[str, int] = {}
        self._rid_of: list[str | None] = [None] * max_requests
        self._free_recs = list(range(max_requests - 1, -1, -1))  # pop() hands out the lowest first
        self._state = [PAD] * max_requests
        self._deadline = [math.inf] * max_requests
        self._hash = [0] * max_requests
        self._n_items = [0] * max_requests
        self._n_landed = [0] * max_requests
        self._reasons: dict[int, str] = {}
        # items: record r's k-th item is r * max_items + k
        n = max_requests * max_items
        self._istate = [0] * n
        self._islot = [-1] * n
        self._iindex = [0] * n
        self._istart = [0] * n
        self._icount = [0] * n
        self._irows = [0] * n
        self._n_pending = 0  # items PENDING that need a slot
        self._n_unasked = 0  # items LEASED, not yet asked
        # slots
        self._sstate = [SlotState.FREE] * slots
        self._n_free = slots
        self._n_held = 0
        self._fencing: list[int] = []
        # the round
        self._seq = 0
        self._fp_sum = config_salt(ranks, sharded)
        self._sent: list[int] | None = None  # this rank's codes at the last encode, until settle
        self._failed: list[tuple[str, str]] = []
        self._buffer = np.full(max_requests + 2 * FINGERPRINT_BYTES, PAD, dtype=np.uint8)

    # -- configuration ------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def slot_rows(self) -> int:
        return self._slot_rows

    @property
    def max_requests(self) -> int:
        return self._max_requests

    @property
    def max_items(self) -> int:
        return self._max_items

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def ranks(self) -> int:
        return self._ranks

    @property
    def sharded(self) -> bool:
        return self._sharded

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def buffer(self) -> np.ndarray:
        """The reduction buffer: ``max_requests`` code bytes (PAD past the staged), then the fingerprint pair."""
        return self._buffer

    # -- queries ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._rec_of)

    def __contains__(self, rid: object) -> bool:
        return rid in self._rec_of

    def rids(self) -> list[str]:
        """Staged requests in staging order."""
        with self._lock:
            return list(self._rec_of)

    def state(self, rid: str) -> RequestState:
        with self._lock:
            return REQUEST_STATES[self._state[self._rec(rid)]]

    def reason(self, rid: str) -> str:
        """Why ``rid`` failed on this rank; empty while it has not."""
        with self._lock:
            return self._reasons.get(self._rec(rid), "")

    def item_state(self, rid: str, index: int) -> ItemState:
        with self._lock:
            return ITEM_STATES[self._istate[self._item(rid, index)]]

    def slot_of(self, rid: str, index: int) -> int | None:
        with self._lock:
            slot = self._islot[self._item(rid, index)]
            return None if slot < 0 else slot

    def slot_state(self, slot: int) -> SlotState:
        with self._lock:
            self._check_slot(slot)
            return SlotState(self._sstate[slot])

    def free_slots(self) -> int:
        with self._lock:
            return self._n_free

    def awaiting_release(self) -> bool:
        """A landed slot still waits for its rows to be copied out."""
        return self._n_held > 0

    def failed(self) -> list[tuple[str, str]]:
        """The requests the last ``settle`` dropped as failed, (rid, reason) in staging order."""
        with self._lock:
            return list(self._failed)

    def _rec(self, rid: str) -> int:
        try:
            return self._rec_of[rid]
        except (KeyError, TypeError):
            raise LocalProtocolError(f"rid {rid!r} is not staged") from None

    def _item(self, rid: str, index: int) -> int:
        rec = self._rec(rid)
        base = rec * self._max_items
        if not isinstance(index, bool) and isinstance(index, int):
            for k in range(self._n_items[rec]):
                if self._iindex[base + k] == index:
                    return base + k
        raise LocalProtocolError(f"rid {rid!r} has no item {index!r}")

    def _check_slot(self, slot: object) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self._slots:
            raise LocalProtocolError(f"slot {slot!r} is not a slot of the pool (0..{self._slots - 1})")

    # -- staging and local updates -------------------------------------------------

    def stage(self, rid: str, items: Sequence[EmbeddingItem], now: float) -> None:
        """Start receiving ``rid``'s items; never blocks: items that find no free slot wait, on the request's clock."""
        now = _clock(now)  # as the compiled twin's ``double now``: a bad clock fails before anything changes
        check_items(rid, items, self._slots, self._slot_rows, self._max_items, self._ranks, self._sharded)
        with self._lock:
            if rid in self._rec_of:
                raise LocalProtocolError(f"rid {rid!r} is already staged")
            if not self._free_recs:
                raise CapacityError(f"cannot stage {rid!r}: all {self._max_requests} requests are in use")
            rec = self._free_recs.pop()
            self._rec_of[rid] = rec
            self._rid_of[rec] = rid
            self._state[rec] = RequestState.RECEIVING
            self._deadline[rec] = now + self._timeout
            self._hash[rec] = rid_hash(rid, self._seq)
            self._seq += 1
            self._fp_sum = (self._fp_sum + self._hash[rec]) & U64_MAX
            self._n_items[rec] = len(items)
            self._n_landed[rec] = 0
            base = rec * self._max_items
            for k, item in enumerate(items):
                i = base + k
                start, count = shard(item.rows, self._rank, self._ranks, self._sharded)
                self._iindex[i], self._irows[i], self._istart[i], self._icount[i] = item.index, item.rows, start, count
                self._istate[i] = ItemState.PENDING
                self._islot[i] = -1
                if count == 0:  # an empty shard needs no slot: it is leased at once
                    self._istate[i] = _item_step(rid, item.index, ItemState.PENDING, ItemTrigger.LEASE)
                    self._n_unasked += 1
                else:
                    self._n_pending += 1
            if not items:
                self._request_step(rec, RequestTrigger.ALL_LANDED, "")
            self._lease()

    def landed(self, rid: str, index: int, now: float) -> RequestState:
        """Item ``index`` of ``rid`` landed on this rank; returns the request's state."""
        now = _clock(now)
        with self._lock:
            i = self._item(rid, index)
            rec = i // self._max_items
            old = self._istate[i]
            self._istate[i] = _item_step(rid, index, old, ItemTrigger.LAND)
            if old != ItemState.LANDED:
                self._n_landed[rec] += 1
                if self._n_landed[rec] == self._n_items[rec]:
                    self._request_step(rec, RequestTrigger.ALL_LANDED, "")
            return REQUEST_STATES[self._state[rec]]

    def fail(self, rid: str, reason: str, now: float) -> RequestState:
        """``rid`` failed on this rank (``reason`` is kept); returns its state, FAILED."""
        now = _clock(now)
        with self._lock:
            rec = self._rec(rid)
            self._request_step(rec, RequestTrigger.FAIL, reason or "failed")
            return REQUEST_STATES[self._state[rec]]

    def _request_step(self, rec: int, trigger: RequestTrigger, reason: str) -> None:
        old = self._state[rec]
        new = _recv_spec.REQUEST_TRANSITIONS[old][trigger]
        if new != old:
            self._state[rec] = new
            if new == RequestState.FAILED:
                self._reasons[rec] = reason

    # -- the slot pool -------------------------------------------------------------

    def _slot_step(self, slot: int, trigger: SlotTrigger) -> None:
        old = self._sstate[slot]
        new = _recv_spec.SLOT_TRANSITIONS[old][trigger]
        if new is ILLEGAL:
            raise LocalProtocolError(f"slot {slot}: {trigger.name} is not allowed in {SlotState(old).name}")
        self._sstate[slot] = new
        self._n_free += (new == SlotState.FREE) - (old == SlotState.FREE)
        self._n_held += (new == SlotState.HELD) - (old == SlotState.HELD)
        if new == SlotState.FENCING:
            self._fencing.append(slot)

    def _lease(self) -> None:
        """Give free slots to waiting items, in staging order (strict FIFO), lowest slot first."""
        if self._n_pending == 0 or self._n_free == 0:
            return
        slot = 0
        for rec in self._rec_of.values():
            if self._state[rec] == RequestState.FAILED:
                continue
            base = rec * self._max_items
            for i in range(base, base + self._n_items[rec]):
                if self._istate[i] != ItemState.PENDING:
                    continue
                if self._n_free == 0:
                    return
                while self._sstate[slot] != SlotState.FREE:
                    slot += 1
                self._slot_step(slot, SlotTrigger.LEASE)
                self._istate[i] = _item_step(self._rid_of[rec], self._iindex[i], ItemState.PENDING, ItemTrigger.LEASE)  # type: ignore[arg-type]
                self._islot[i] = slot
                self._n_pending -= 1
                self._n_unasked += 1

    def take_ready(self) -> list[Ask]:
        """Items that now hold their slot (or need none), each returned once: the peer asks their encode rank.

        Items of a request that failed here are not returned: they are never asked.
        """
        with self._lock:
            out: list[Ask] = []
            if self._n_unasked == 0:
                return out
            for rid, rec in self._rec_of.items():
                if self._state[rec] == RequestState.FAILED:
                    continue
                base = rec * self._max_items
                for i in range(base, base + self._n_items[rec]):
                    if self._istate[i] == ItemState.LEASED:
                        self._istate[i] = _item_step(rid, self._iindex[i], ItemState.LEASED, ItemTrigger.ASK)
                        self._n_unasked -= 1
                        slot = self._islot[i]
                        out.append(Ask(rid, self._iindex[i], None if slot < 0 else slot, self._istart[i], self._icount[i]))
            return out

    def take_fencing(self) -> list[int]:
        """Slots quarantined since the last call, each returned once: the owner closes their fence, then ``fenced``."""
        with self._lock:
            out, self._fencing = self._fencing, []
            return out

    def fenced(self, slot: int) -> None:
        """Nothing from the encode side can land in ``slot`` any more (it must be FENCING): it takes new receives."""
        with self._lock:
            self._check_slot(slot)
            self._slot_step(slot, SlotTrigger.FENCED)
            self._lease()

    def release(self, slots: Sequence[int]) -> None:
        """The data plane copied these HELD slots' rows out; all or none: a bad slot changes nothing."""
        with self._lock:
            seen: set[int] = set()
            for slot in slots:
                self._check_slot(slot)
                if slot in seen:
                    raise LocalProtocolError(f"slot {slot} is released twice in one call")
                seen.add(slot)
                if _recv_spec.SLOT_TRANSITIONS[self._sstate[slot]][SlotTrigger.RELEASE] is ILLEGAL:
                    raise LocalProtocolError(
                        f"slot {slot}: RELEASE is not allowed in {SlotState(self._sstate[slot]).name}"
                    )
            for slot in slots:
                self._slot_step(slot, SlotTrigger.RELEASE)
            self._lease()

    # -- the round -----------------------------------------------------------------

    def fold(self, now: float) -> None:
        """Turn every passed deadline into a TIMEOUT transition."""
        now = _clock(now)
        with self._lock:
            self._fold(now)

    def _fold(self, now: float) -> None:
        for rec in self._rec_of.values():
            if self._state[rec] in _recv_spec.REQUEST_TIMED and self._deadline[rec] <= now:
                base = rec * self._max_items
                waiting = sum(1 for i in range(base, base + self._n_items[rec]) if self._istate[i] == ItemState.PENDING)
                why = f"timeout after {self._timeout:g} s"
                if waiting:
                    why += f" ({waiting} of {self._n_items[rec]} items still waiting for a receive slot)"
                self._request_step(rec, RequestTrigger.TIMEOUT, why)

    def _fingerprint(self) -> bytes:
        return self._fp_sum.to_bytes(8, "little") + len(self._rec_of).to_bytes(4, "little")

    def encode(self, now: float) -> np.ndarray:
        """Fold deadlines, then fill and return ``buffer`` for the all-reduce MIN (codes in staging order)."""
        now = _clock(now)
        with self._lock:
            self._fold(now)
            codes = [self._state[rec] for rec in self._rec_of.values()]
            n, cap = len(codes), self._max_requests
            buf = self._buffer
            buf[:n] = codes
            buf[n:cap] = PAD
            fp = self._fingerprint()
            buf[cap : cap + FINGERPRINT_BYTES] = list(fp)
            buf[cap + FINGERPRINT_BYTES :] = [255 - b for b in fp]
            self._sent = codes
            return buf

    def settle(self, agreed: Any) -> list[LandedRequest]:
        """Act on the replica's MIN of ``encode``'s buffer (or, unguarded, of its first ``len(self)`` codes).

        In staging order: 2 → the request is forgotten and returned, its
        slots HELD until ``release``; 0 → dropped (``failed()`` names it), its
        slots freed or quarantined until ``fenced``; 1 → nothing. Raises
        ``CollectiveError`` (changing nothing) when the ranks held different
        staged sets or a code is not a MIN that includes this rank's.
        """
        with self._lock:
            sent = self._sent
            if sent is None:
                raise LocalProtocolError("settle without an encode since the last settle")
            codes = self._check_agreed(agreed, sent)
            landed: list[LandedRequest] = []
            failed: list[tuple[str, str]] = []
            for (rid, rec), code in zip(list(self._rec_of.items()), codes):
                if code == _recv_spec.CODE_LANDED:
                    landed.append(self._hand_out(rid, rec))
                elif code == _recv_spec.CODE_FAILED:
                    failed.append((rid, self._reasons.get(rec, FAILED_ELSEWHERE)))
                    self._drop(rec)
                else:
                    continue
                self._forget(rid, rec)
            self._failed = failed
            self._sent = None
            self._lease()
            return landed

    def decode(self) -> list[LandedRequest]:
        """``settle(self.buffer)``: the round's second half when the reduction ran in place on ``buffer``.

        With it the table is what ``pdcore.core.agreement.Agreement`` drives
        (``encode(now)``, MIN of ``buffer`` across the replica, ``decode()``),
        over the group's collective or shared memory, mismatch guard included.
        """
        return self.settle(self._buffer)

    def _check_agreed(self, agreed: Any, sent: list[int]) -> list[int]:
        arr = np.asarray(agreed)
        if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):  # [] is a float array: no codes is fine
            raise LocalProtocolError(f"agreed codes must be a 1-d integer vector, got {arr.dtype} of shape {arr.shape}")
        n, cap = len(sent), self._max_requests
        if arr.shape[0] == self._buffer.shape[0]:
            lo = [int(b) for b in arr[cap : cap + FINGERPRINT_BYTES]]
            hi_inv = [int(b) for b in arr[cap + FINGERPRINT_BYTES :]]
            if any(a + b != 255 for a, b in zip(lo, hi_inv)) or any(int(c) != PAD for c in arr[n:cap]):
                raise CollectiveError(
                    mismatch_message(self._fingerprint(), bytes(min(max(b, 0), 255) for b in lo),
                                     bytes(min(max(255 - b, 0), 255) for b in hi_inv))
                )
        elif arr.shape[0] != n:
            raise LocalProtocolError(
                f"agreed codes hold {arr.shape[0]} values: expected the buffer's {self._buffer.shape[0]} "
                f"or the {n} staged requests' codes of the last encode"
            )
        codes = [int(c) for c in arr[:n]]
        for pos, (code, mine) in enumerate(zip(codes, sent)):
            if not 0 <= code <= mine:
                raise CollectiveError(
                    f"EPD receiver agreement refused: agreed code {code} for staged request {pos} is not a MIN "
                    f"that includes this rank's code {mine}"
                )
        return codes

    def _hand_out(self, rid: str, rec: int) -> LandedRequest:
        base = rec * self._max_items
        items = []
        for i in range(base, base + self._n_items[rec]):
            slot = self._islot[i]
            if slot >= 0:
                self._slot_step(slot, SlotTrigger.HAND_OUT)
            items.append(LandedItem(self._iindex[i], None if slot < 0 else slot, self._istart[i], self._icount[i],
                                    self._irows[i], self._sharded))
        return LandedRequest(rid, tuple(items))

    def _drop(self, rec: int) -> None:
        base = rec * self._max_items
        for i in range(base, base + self._n_items[rec]):
            state = self._istate[i]
            if state == ItemState.PENDING:
                self._n_pending -= 1
            elif state == ItemState.LEASED:
                self._n_unasked -= 1
            slot = self._islot[i]
            if slot >= 0:
                self._slot_step(slot, _recv_spec.DROP_TRIGGER[ItemState(state)])

    def _forget(self, rid: str, rec: int) -> None:
        del self._rec_of[rid]
        self._rid_of[rec] = None
        self._state[rec] = PAD
        self._deadline[rec] = math.inf
        self._fp_sum = (self._fp_sum - self._hash[rec]) & U64_MAX
        self._hash[rec] = 0
        self._reasons.pop(rec, None)
        base = rec * self._max_items
        for i in range(base, base + self._n_items[rec]):
            self._islot[i] = -1
            self._istate[i] = 0
        self._n_items[rec] = 0
        self._n_landed[rec] = 0
        self._free_recs.append(rec)
