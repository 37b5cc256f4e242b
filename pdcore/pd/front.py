"""The scheduler's side of a PD rank, sans-IO: what a scheduler's call does before the engine hears of it.

A front holds the rules between the public API and the role's engine, once:
which rids are live, which ended lately (a late call for one is a no-op), the
registration with the transfer table (on the scheduler's thread, in the same
order on every rank), the checks of every argument, the hand-over's usage, and
the plumbing of a round (the fences and ends the replica agreed go to the
engine; decode's ``RemotePrefillDone`` is assembled from what the engine
delivered). It does no I/O and reads no clock: ``now`` is passed in, and what
the engine must hear goes through the two callables it is given:

- ``submit(fn, *args)``: an engine input the scheduler's call makes (the real
  driver's ``submit``: it may refuse with ``CapacityError``, which fails the
  request here, or raise ``PeerError`` once closed);
- ``result(fn, *args)``: an input the round owes the engine (fences, ends):
  never refused, never lost.

``pdcore.pd.PrefillPeer``/``DecodePeer`` drive a front from the scheduler's
thread over the real driver; the simulator (``pdcore.sim``) drives the same
object over its own. What the simulator does not run, it cannot check.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from ..control import wire
from ..core._spec import Trigger
from ..core.errors import LocalProtocolError, PeerError, refusal
from ..core.events import BootstrapInfo, Event, Failed, RemotePrefill, RemotePrefillDone, Succeeded

__all__ = ["PdFront", "PrefillFront", "DecodeFront", "wire_int", "check_logprob"]

_ENDS = (Succeeded, Failed)
Finish = tuple[int, tuple[int, ...] | None]  # first token, spec candidates


def wire_int(where: str, name: str, value: Any, limit: int) -> int:
    """``value`` as an int in ``0..limit`` (what the status frame carries), else ``LocalProtocolError``
    naming the field and the limit. numpy and torch integers are ints here; bools and floats are not."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise LocalProtocolError(f"{where}: {name} must be an int, got {type(value).__name__}")
    v = operator.index(value)
    if not 0 <= v <= limit:
        raise LocalProtocolError(f"{where}: {name} {v} is outside 0..{limit} (what the status frame carries)")
    return v


def check_logprob(where: str, value: Any) -> float | None:
    """A first token's log-probability as the status frame carries it: None, a finite float, -inf or NaN."""
    if value is None:
        return None
    if isinstance(value, (bool, str, bytes)) or not hasattr(type(value), "__float__"):
        raise LocalProtocolError(f"{where}: bootstrap_logprob must be a float or None, got {type(value).__name__}")
    v = float(value)
    if v == math.inf:
        raise LocalProtocolError(f"{where}: bootstrap_logprob inf is not a log-probability (finite, -inf or NaN)")
    return v


class PdFront:
    """What both PD roles' fronts share: live and lately ended rids, inputs that may be refused, the round.

    ``table`` is the rank's transfer table, ``engine`` its role engine, ``config`` its ``TransferConfig``;
    ``counts`` the metrics (None: none)."""

    ROLE = "pd"
    _TERMINAL: tuple[type[Succeeded | RemotePrefillDone | Failed], ...] = ()

    def __init__(self, *, table: Any, engine: Any, config: Any, submit: Callable[..., None],
                 result: Callable[..., None], counts: Any = None) -> None:
        self.table = table
        self.engine = engine
        self.config = config
        self._submit = submit
        self._result = result
        self.counts = counts
        self.closed = False
        self._live: set[str] = set()  # registered and not yet ended
        self._rooms: dict[int, str] = {}  # room -> rid of the live requests
        self._room_of: dict[str, int] = {}
        # rids that ended here lately (tombstone_ttl, the last 4 * max_pending): a late scheduler call is a no-op
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._ended_limit = 4 * config.max_pending

    # -- what every call checks ----------------------------------------------------------------

    def check_open(self) -> None:
        if self.closed:
            raise PeerError(f"{self.ROLE} peer: closed")

    def close(self) -> None:
        """Every later call raises ``PeerError``."""
        self.closed = True

    def lately_ended(self, rid: str) -> bool:
        """``rid`` ended here within ``tombstone_ttl`` (a scheduler call for it is a no-op)."""
        return rid in self._ended

    def accepts(self, rid: str, call: str, now: float) -> bool:
        """Whether the scheduler's ``call`` for ``rid`` goes ahead.

        True for a live request. False (the call does nothing) for one that ended here within
        ``tombstone_ttl`` (and among the last ``4 * max_pending`` to end): the scheduler hears of
        an end one round late, so a ``send`` or ``announce`` racing it is not its mistake.
        ``LocalProtocolError`` for a rid this peer never registered, or forgot; ``PeerError``
        after ``close``.
        """
        self.check_open()
        if rid in self._live:
            return True
        until = self._ended.get(rid)
        if until is not None and until > now:
            return False
        raise LocalProtocolError(
            f"{call}({rid!r}): no such request on this {self.ROLE} peer (never registered here, or it ended "
            f"more than tombstone_ttl = {self.config.tombstone_ttl:g} s ago)"
        )

    def _register(self, rid: str, room: int, now: float) -> None:
        """The table takes ``rid`` (in registration order on every rank) for ``room``, which must be unique among
        the live requests (the room, not the rid, joins the two sides: two requests on one room would take
        each other's frames)."""
        self.check_open()
        held = self._rooms.get(room)
        if held is not None:
            raise LocalProtocolError(f"room {room} is already held by rid {held!r}", rooms=(room,))
        self.table.register(rid, now)
        self._rooms[room] = rid
        self._room_of[rid] = room
        self._live.add(rid)
        self._ended.pop(rid, None)  # a rid used again: its next end goes to the back
        if self.counts is not None:
            self.counts.born(rid)

    def _input(self, rid: str, fn: Any, *args: Any, now: float) -> bool:
        """Hand a scheduler call for ``rid`` to the engine; one it cannot take fails the request (False)."""
        refused = refusal(self._submit, fn, *args)
        if refused is not None:
            self.table.update(rid, Trigger.FAIL, now, f"{self.ROLE} peer overloaded: {refused}")
        return refused is None

    # -- the round ---------------------------------------------------------------------------

    def after_round(self, events: list[Event], now: float) -> list[Event]:
        """The replica agreed on a round with ``events`` (every rank, the same): hand the engine its fences
        and ends, and the scheduler its events (decode: a landing's ``RemotePrefillDone``)."""
        fencing = self.table.take_fencing()
        if fencing:
            self._result(self.engine.fence, fencing)
        recent = self._ended
        while recent and next(iter(recent.values())) <= now:
            recent.popitem(last=False)
        if not events:
            return events
        ended = [event.rid for event in events if isinstance(event, _ENDS)]  # events are never subclassed
        if ended:
            self._live.difference_update(ended)
            for rid in ended:
                room = self._room_of.pop(rid, None)
                if room is not None:
                    del self._rooms[room]
            recent.update(dict.fromkeys(ended, now + self.config.tombstone_ttl))
            for _ in range(len(recent) - self._ended_limit):
                recent.popitem(last=False)
            self._result(self.engine.settled, events)
        settled = self._settle(events, ended)
        if self.counts is not None:
            self.counts.ended(settled, self._TERMINAL)
        return settled

    def _settle(self, events: list[Event], ended: list[str]) -> list[Event]:
        return events

    def deliver(self, kind: str, key: Any, value: Any) -> None:
        """A value the engine hands the scheduler's side at once (``Services.deliver``; the driver's thread)."""

    def diagnostics(self) -> dict[str, int]:
        """What the front holds: live requests and their rooms, rids that ended lately, the role's own maps."""
        return {"live": len(self._live), "rooms": len(self._rooms), "lately_ended": len(self._ended), **self._held()}

    def _held(self) -> dict[str, int]:
        return {}


class PrefillFront(PdFront):
    """A prefill rank's scheduler side: ``register``, ``record_usage``, ``abort_room`` and the hand-over
    (``send``; or ``begin``, ``layers_done``, ``finish``)."""

    ROLE = "prefill"
    _TERMINAL = (Succeeded, Failed)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # rid -> the usage recorded before its finishing hand-over, which carries it (one input, not two);
        # None once that hand-over went (a later record goes as an input of its own). Live rids only.
        self._usage: dict[str, tuple[int, float | None] | None] = {}

    def register(self, rid: str, bootstrap: BootstrapInfo, now: float) -> None:
        """Track an admitted request; ``bootstrap.room`` must be unique among the live requests."""
        room = bootstrap.room
        self._register(rid, room, now)
        if not self._input(rid, self.engine.register, rid, room, now=now):
            # the engine never heard of the room: it hears of its end (never refused), so the decode side of it
            # is answered at once, not when its own timers fire
            self._result(self.engine.abort_room, rid, room)

    def record_usage(self, rid: str, cached_tokens: Any, bootstrap_logprob: Any, now: float) -> None:
        where = f"record_usage({rid!r})"
        cached = wire_int(where, "cached_tokens", cached_tokens, wire.MAX_COUNT)
        logprob = check_logprob(where, bootstrap_logprob)
        if not self.accepts(rid, "record_usage", now):
            return
        if self._usage.get(rid, ()) is None:  # after the hand-over's finish: the status may not have gone yet
            self._input(rid, self.engine.usage, rid, cached, logprob, now=now)
        else:
            self._usage[rid] = (cached, logprob)

    def abort_room(self, rid: str, room: int, now: float) -> None:
        """The engine fails the room it holds, or answers its decode side from a tombstone. Never refused: an
        abort the driver cannot take now goes as the round's inputs do (bounded by the scheduler's requests)."""
        self.check_open()
        if refusal(self._submit, self.engine.abort_room, rid, room) is not None:
            self._result(self.engine.abort_room, rid, room)

    # -- the hand-over (the model executor's side) ------------------------------------------------

    def begin(self, rid: str, page_ids: Any, now: float) -> None:
        pages = _page_ids(page_ids)
        if self.accepts(rid, "begin", now):
            self._hand_over(rid, pages, None, None, now)

    def layers_done(self, rid: str, upto: Any, now: float) -> None:
        if isinstance(upto, bool) or not isinstance(upto, int) or upto < 0:
            raise LocalProtocolError(f"layers_done({rid!r}): upto must be an int >= 0, got {upto!r}")
        if self.accepts(rid, "layers_done", now):
            self._hand_over(rid, None, upto, None, now)

    def finish(self, rid: str, first_token: Any, spec_candidate_ids: Any, now: float) -> None:
        finish = _finish("finish", rid, first_token, spec_candidate_ids)
        if self.accepts(rid, "finish", now):
            self._hand_over(rid, None, None, finish, now)

    def send(self, rid: str, page_ids: Any, first_token: Any, spec_candidate_ids: Any, now: float) -> None:
        finish = _finish("send", rid, first_token, spec_candidate_ids)
        pages = _page_ids(page_ids)
        if self.accepts(rid, "send", now):
            self._hand_over(rid, pages, None, finish, now)

    def _hand_over(self, rid: str, page_ids: Any, upto: int | None, finish: Finish | None, now: float) -> None:
        usage = None
        if finish is not None:
            usage, self._usage[rid] = self._usage.get(rid), None
        self._input(rid, self.engine.hand_over, rid, page_ids, upto, finish, usage, now=now)

    def _held(self) -> dict[str, int]:
        return {"usage": len(self._usage)}

    def _settle(self, events: list[Event], ended: list[str]) -> list[Event]:
        for rid in ended:
            self._usage.pop(rid, None)
        return events


class DecodeFront(PdFront):
    """A decode rank's scheduler side: ``register``, ``announce``, ``abort_room``; the round assembles each
    landing's ``RemotePrefillDone`` from what the engine delivered before the table could agree on it."""

    ROLE = "decode"
    _TERMINAL = (RemotePrefillDone, Failed)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._landed: dict[str, RemotePrefill] = {}  # what the engine delivered before the table could agree

    def register(self, rid: str, bootstrap: BootstrapInfo, now: float) -> None:
        """Track an admitted request; ``bootstrap.room`` must be unique among the live requests."""
        room = bootstrap.room
        self._register(rid, room, now)
        self._input(rid, self.engine.register, rid, room, (bootstrap.host, bootstrap.port), bootstrap.dp_rank, now=now)

    def abort_room(self, rid: str, room: int, now: float) -> None:
        self.check_open()
        if rid in self._live:  # an unknown or ended rid: nothing to abort
            self._input(rid, self.engine.abort_room, rid, room, now=now)

    def announce(self, rid: str, page_ids: Any, request_pool_index: Any, now: float) -> None:
        pages = tuple(map(int, page_ids.tolist() if isinstance(page_ids, np.ndarray) else page_ids))
        num_pages = self.config.num_pages
        if pages and (min(pages) < 0 or max(pages) >= num_pages):
            raise LocalProtocolError(f"announce({rid!r}): page ids must be in 0..{num_pages - 1}")
        index = wire_int(f"announce({rid!r})", "request_pool_index", request_pool_index, wire.MAX_COUNT)
        if self.accepts(rid, "announce", now):
            self._input(rid, self.engine.announce, rid, pages, index, now=now)

    def _held(self) -> dict[str, int]:
        return {"landed": len(self._landed)}

    def deliver(self, kind: str, key: Any, value: Any) -> None:
        if kind == "landed":
            self._landed[key] = value

    def _settle(self, events: list[Event], ended: list[str]) -> list[Event]:
        if not ended:
            return events
        out: list[Event] = []
        for event in events:
            if type(event) is Succeeded:
                event = RemotePrefillDone(self._landed.pop(event.rid))  # delivered before the table could land
            elif type(event) is Failed:
                self._landed.pop(event.rid, None)
            out.append(event)
        return out


def _page_ids(page_ids: Any) -> np.ndarray:
    return page_ids if isinstance(page_ids, np.ndarray) else np.fromiter(page_ids, np.int64)


def _finish(call: str, rid: str, first_token: Any, spec_candidate_ids: Any) -> Finish:
    where = f"{call}({rid!r})"
    first = wire_int(where, "first_token", first_token, wire.MAX_TOKEN_ID)
    if spec_candidate_ids is None:
        return first, None
    if isinstance(spec_candidate_ids, np.ndarray):
        spec_candidate_ids = spec_candidate_ids.tolist()
    if isinstance(spec_candidate_ids, (str, bytes)) or not hasattr(spec_candidate_ids, "__iter__"):
        raise LocalProtocolError(f"{where}: spec_candidate_ids must be a sequence of token ids or None, "
                                 f"got {type(spec_candidate_ids).__name__}")
    candidates = tuple(spec_candidate_ids)
    if len(candidates) > wire.MAX_CANDIDATES:
        raise LocalProtocolError(f"{where}: spec_candidate_ids has {len(candidates)} ids, at most "
                                 f"{wire.MAX_CANDIDATES} fit in the status frame")
    return first, tuple(wire_int(where, f"spec_candidate_ids[{i}]", c, wire.MAX_TOKEN_ID)
                        for i, c in enumerate(candidates))
