"""The prefill role's protocol, sans-IO: rooms, announcements, writes, fences, tombstones.

Per room, on this rank: the scheduler registers the request (BOOTSTRAPPING);
each decode rank that pairs with this one (``pdcore.kv.routing``: the same tp
rank when the tp sizes match; with a ``KvLayout`` the ranks that hold its heads)
sends ``Register`` once per session and ``Announce`` per room; once every one
of them announced, the room is connected (BOOTSTRAPPED). Announcements that
come before the scheduler registered the room wait, per (room, sender), in the
bounded ``Parking``. The model executor hands the prefilled pages over
(``hand_over``: whole, or layer by layer); the engine plans coalesced writes
once per hand-over, posts them (TRANSFERRING, the fence armed) and, when the
transport confirmed every batch landed, sends ``Status`` with the first token
to each decode rank it writes to (SUCCESS). Where the transport carries notes
(``Services.notes``), that ``Status`` rides each decode rank's last batch
instead: the sink hands it to its engine once the batch's bytes landed, and no
control frame follows. A room that fails afterwards here (its ack lost, a fence
of the replica) may then have succeeded at decode: decode's KV is whole, and
only this rank counts a failure. ``usage`` recorded after the finishing
hand-over is too late for a status that rode. A room that fails is told to every
decode rank of it exactly once, whenever that rank announced (before the
failure, or after it, even after the room settled: from the tombstone).

A decode ``Abort`` fails the room and is acknowledged only once no write of
this rank to the room is in flight (fence before free: the source side's half;
the sink's revoke is the other). Rooms that failed stay as tombstones for
``tombstone_ttl``.

Inputs are the scheduler's calls (``register``, ``usage``, ``hand_over``,
``abort_room``, ``fence``, ``settled``), the decode ranks' frames (``message``),
the planes' verdicts (``peer_dead``, ``rooms_failed``), the data plane's
answers (``connected``, ``written``) and the clock (``tick``); every one takes
``now``. Outputs are actions (``take_actions``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transport.limits import MAX_NOTE
from transport.plan import Layout

from ..control import wire
from ..core._spec import State, Trigger
from ..core.errors import LocalProtocolError, PdError
from ..kv.layout import KvLayout
from ..kv.routing import Routing, routing
from .actions import Disconnect, Post
from .engine import DrivenTable, Engine, PrefillSettings, Services, Sink, ends
from .parking import Parking
from .tombstones import Tombstones

__all__ = ["PrefillEngine"]

log = logging.getLogger("pdcore.prefill")

Finish = tuple[int, tuple[int, ...] | None]  # first token, spec candidates


@dataclass(eq=False)
class _Dst:
    """A decode rank that announced a room here."""

    rank: int
    pages: Any  # its destination page ids (np.uint32: 4 bytes a page, not a tuple's ~36)
    grant: int  # its transport grant for those pages
    owed: bool  # this rank writes to it (False: it only told us of the room: MLA, replicated heads)
    noted: bool = False  # the room's success status rode its last write (``Post.note``): no ``Status`` follows
    handle: Any = None  # the data connection its batches went on
    moved: bool = False  # they went on two: a batch lost with the first cannot stop a note on the second


@dataclass(eq=False)
class _Room:
    rid: str
    room: int
    dsts: dict[str, _Dst] = field(default_factory=dict)  # decode control endpoint -> its announcement
    route: Routing | None = None  # the pairing of the announcing decode replica with ours
    cached_tokens: int = 0
    logprob: float | None = None
    inflight: int = 0  # batches posted and not completed
    landing: int = 0  # batches of the hand-over that have not landed yet
    ack_to: set[str] = field(default_factory=set)  # decode ranks owed an AbortAck once drained
    failure: str | None = None  # why the room failed here, first reason first
    told: set[str] = field(default_factory=set)  # decode ranks that heard of this room's end
    # the hand-over: whole (send) or layer by layer (begin, layers_done, finish)
    pages: Any = None  # the source page ids, prompt order
    plans: list[tuple[_Sink, _Dst, Any, int]] | None = None  # per owed decode rank: its writes, rows per buffer
    sent: int = 0  # buffers posted so far
    final: bool = False  # finish came: every buffer is posted, the first token is known
    first_token: int = 0
    candidates: tuple[int, ...] | None = None
    success_told: bool = False
    live: bool = True  # False once the scheduler's round settled it


@dataclass(eq=False)
class _Sink(Sink):
    """A decode rank that registered with us."""

    layout: Layout | None = None
    rank: int = 0  # its tp rank
    route: Routing | None = None  # how its replica pairs with ours


class PrefillEngine(Engine[PrefillSettings, DrivenTable]):
    """One prefill rank's PD protocol (``pdcore.pd.prefill.PrefillPeer`` drives it)."""

    ROLE = "prefill"

    def __init__(self, services: Services[PrefillSettings, DrivenTable]) -> None:
        super().__init__(services)
        cfg = self._config
        self._layout: Layout = services.layout  # type: ignore[assignment]  # a prefill peer always has one
        self._rooms: dict[int, _Room] = {}
        self._by_rid: dict[str, _Room] = {}
        self._pending = Parking(cfg.max_pending, cfg.max_parked_pages, cfg.max_parked_pages_total)
        self._tombstones = Tombstones(cfg.tombstone_ttl, 4 * cfg.max_pending)
        self._sinks: dict[str, _Sink] = {}
        self._per_layer = 1 if cfg.kv_layout is None else cfg.kv_layout.buffers // cfg.kv_layout.layers

    # -- what the simulator and the metrics read -------------------------------------------

    def held(self) -> dict[str, int]:
        """The per-request state the engine holds (all of it drains once every request ended)."""
        return {"rooms": len(self._rooms), "parked": len(self._pending)}

    def tombstones(self) -> int:
        """Rooms remembered as failed (they expire after ``tombstone_ttl``)."""
        return len(self._tombstones)

    def connected_peers(self) -> int:
        """Decode ranks with a data connection up."""
        return sum(1 for sink in list(self._sinks.values()) if sink.ready)

    def next_deadline(self) -> float:
        return min(self._pending.next_deadline(), self._tombstones.next_deadline())

    # -- the scheduler's calls ------------------------------------------------------------

    def register(self, rid: str, room: int, now: float) -> None:
        """The scheduler registered ``rid`` for ``room`` (its table holds it already)."""
        entry = _Room(rid, room)
        self._rooms[room] = entry
        self._by_rid[rid] = entry
        aborted = self._tombstones.pop(room)
        pending = self._pending.take(room)
        if aborted is not None:
            reason = f"room {room} ended before it registered here: {aborted}"
            self._fire(rid, Trigger.ABORT, now, reason)
            for sender, _ in pending:  # decode ranks that announced it meanwhile hear of its end
                self._status_failed(sender, room, reason)
        for sender, msg in pending if aborted is None else ():
            self._adopt(entry, sender, msg, now)

    def usage(self, rid: str, cached_tokens: int, logprob: float | None, now: float) -> None:
        entry = self._by_rid.get(rid)
        if entry is not None:
            entry.cached_tokens, entry.logprob = cached_tokens, logprob

    def abort_room(self, rid: str, room: int, now: float) -> None:
        """The prefill scheduler gave up ``rid`` (EPD: its embeddings failed): fail the room it holds,
        or answer the decode side of a room never registered here from a tombstone."""
        entry = self._rooms.get(room)
        if entry is not None:
            self._fire(entry.rid, Trigger.ABORT, now, "aborted by the prefill scheduler")
            return
        reason = f"request {rid!r} failed before it reached prefill"
        pending = self._pending.take(room)
        self._tombstones.add(room, reason, now)
        for sender, _ in pending:
            self._status_failed(sender, room, reason)

    def hand_over(self, rid: str, page_ids: Any, upto: int | None, finish: Finish | None,
                  usage: tuple[int, float | None] | None, now: float) -> None:
        """Post ``rid``'s writes of the buffers of layers ``[0, upto)`` not posted yet, or of every buffer
        with ``finish``, which ends the hand-over; ``page_ids`` (not None) names the source pages. The
        finishing one carries the ``usage`` (cached tokens, logprob) the scheduler recorded before it, if
        any: one input where two calls would take two."""
        entry = self._by_rid.get(rid)
        if entry is None:
            return  # the request ended meanwhile
        if usage is not None:
            entry.cached_tokens, entry.logprob = usage
        route = entry.route
        if route is None or len(entry.dsts) < len(route.expects(self._config.tp_rank)):
            # before Bootstrapped: with several decode ranks to a room, writing to the ones that announced
            # would succeed here while the others wait out their waiting timeout
            self._fail(entry, "pages handed over before a decode rank announced the room (every decode rank it "
                       "pairs with must: wait for Bootstrapped)", now)
            return
        if page_ids is not None and entry.pages is None:
            entry.pages = page_ids
        if entry.pages is None:
            self._fail(entry, "layers handed over before their pages (PrefillOutbox.begin)", now)
            return
        nbuf = len(self._layout.bases)
        if finish is not None:
            hi = nbuf
        elif len(entry.pages) < self._config.layerwise_min_pages:
            return  # a short prompt: its layers go at the end, with finish
        else:
            hi = min(nbuf, max(0, upto or 0) * self._per_layer)
        for endpoint, dst in list(entry.dsts.items()):
            sink = self._sinks.get(endpoint) if dst.owed else None
            if dst.owed and sink is None:
                self._fail(entry, f"decode rank {endpoint} was lost before the hand-over", now)
                return
            if sink is not None and not sink.ready:
                self._when_connected(endpoint, sink, entry, self.hand_over, (rid, page_ids, upto, finish, None), "")
                return
        if entry.plans is None and not self._plan(entry, route, now):
            return
        assert entry.plans is not None
        lo = entry.sent
        batches = [(sink, dst, writes[lo * rows : hi * rows]) for sink, dst, writes, rows in entry.plans if hi > lo]
        batches = [b for b in batches if len(b[2])]
        note = b""
        if finish is not None:
            entry.first_token, entry.candidates = finish
            if self.services.notes and batches:  # the status rides each decode rank's last batch
                success = self._success(entry, now)
                if success is None:
                    return  # failed here, nothing posted
                if len(success[1]) <= MAX_NOTE:  # (a longer one goes on the control plane)
                    note = success[1]
        entry.inflight += len(batches)  # counted before "writes posted": an abort in between must not ack "drained"
        entry.landing += len(batches)
        if self._fire(rid, Trigger.WRITES_POSTED, now) in (None, State.FAILED):
            entry.inflight -= len(batches)
            entry.landing -= len(batches)
            self._drained(entry, now)  # failed meanwhile: post nothing, and owe no ack for it
            return
        entry.sent = max(lo, hi)
        entry.final = entry.final or finish is not None
        wait = self._config.fence_timeout
        for sink, dst, batch in batches:
            dst.moved = dst.moved or (dst.handle is not None and dst.handle is not sink.handle)
            dst.handle = sink.handle
            # a note rides a write through a grant (so it vouches for its source), behind every earlier batch of the
            # room on the same connection (the sink hands it only if those landed, in order, none refused)
            rides = note if dst.grant and not dst.moved else b""
            dst.noted = dst.noted or bool(rides)
            self._out.append(Post(sink.handle, batch, dst.grant, entry, wait, rides))
        self._check_landed(entry, now)  # nothing was left to post (or it all landed already)

    def fence(self, rids: list[str], now: float) -> None:
        """The replica agreed these requests are failing: tell their decode ranks, close the fences once drained."""
        for rid in rids:
            entry = self._by_rid.get(rid)
            if entry is not None:
                self._notify_failed(entry, "failed on the prefill replica")
                self._drained(entry, now)

    def settled(self, events: list[Any], now: float) -> None:
        """A scheduler's round with these events ended requests; failed rooms leave a tombstone."""
        for rid, failed, reason in ends(events):
            entry = self._by_rid.pop(rid, None)
            if entry is None:
                continue
            entry.live = False
            del self._rooms[entry.room]
            if failed:  # late frames for it get a clear answer
                self._tombstones.add(entry.room, reason, now)
                self._notify_failed(entry, reason)

    def close(self, now: float) -> None:
        """The peer closes: every decode rank of a live room hears of it."""
        for entry in list(self._rooms.values()):
            self._notify_failed(entry, "prefill peer closed")

    # -- decode ranks' frames ---------------------------------------------------------------

    def message(self, sender: str, msg: wire.Message, now: float) -> None:
        kind = type(msg)
        if kind is wire.Announce:
            self._on_announce(sender, msg, now)  # type: ignore[arg-type]
        elif kind is wire.Register:
            self._on_register(sender, msg, now)  # type: ignore[arg-type]
        elif kind is wire.Abort:
            self._on_abort(sender, msg, now)  # type: ignore[arg-type]
        else:
            log.warning("prefill peer: unexpected %s from %s", kind.__name__, sender)

    def _on_register(self, sender: str, msg: wire.Register, now: float) -> None:
        cfg = self._config
        old = self._sinks.get(sender)
        if old is not None and (old.session_id, old.epoch) == (msg.session_id, msg.epoch):
            return  # idempotent
        if old is not None:
            self._lose_sink(sender, f"decode rank {sender} re-registered (session {msg.session_id})", now)
        error = ""
        layout = route = None
        try:
            kv = msg.layout.get("kv")
            theirs = None if kv is None else KvLayout.from_json(kv)
            if theirs != cfg.kv_layout:
                raise LocalProtocolError(f"decode KV layout {theirs} differs from this cache's {cfg.kv_layout}")
            route = routing(cfg.kv_layout, cfg.tp_size, msg.tp_size)
            if msg.tp_rank not in route.expects(cfg.tp_rank):
                raise LocalProtocolError(
                    f"decode rank {msg.tp_rank}/{msg.tp_size} does not pair with prefill rank {cfg.tp_rank}/{cfg.tp_size}"
                )
            layout = Layout(msg.layout["bases"], msg.layout["page_bytes"], msg.layout["num_pages"])
            own = self._layout.page_bytes
            want = own if cfg.kv_layout is None else (cfg.kv_layout.page_bytes(msg.tp_size),) * len(own)
            if layout.page_bytes != want:
                basis = "its own page_bytes" if cfg.kv_layout is None else f"its kv_layout at decode tp {msg.tp_size}"
                raise LocalProtocolError(
                    f"page sizes differ: decode rank {msg.tp_rank}/{msg.tp_size} has {list(layout.page_bytes)}, "
                    f"prefill rank {cfg.tp_rank}/{cfg.tp_size} expects {list(want)} ({basis})"
                )
        except LocalProtocolError as e:
            error = str(e)
        except (KeyError, TypeError, ValueError) as e:
            error = f"decode layout is malformed: {e}"
        if error:
            log.warning("prefill peer: %s", error)
        sink = _Sink(msg.session_id, msg.epoch, msg.endpoint, error=error, layout=layout, rank=msg.tp_rank, route=route)
        self._sinks[sender] = sink
        if not error and route is not None and route.owes(cfg.tp_rank, msg.tp_rank):
            self._connect(sender, sink)  # a rank we owe nothing only tells us of rooms: no data connection

    def _on_announce(self, sender: str, msg: wire.Announce, now: float) -> None:
        room = msg.room
        entry = self._rooms.get(room)
        if entry is not None:
            self._adopt(entry, sender, msg, now)
            return
        ended = self._tombstones.get(room)
        if ended is None:
            ended = self._pending.park(sender, msg, now + self._config.bootstrap_timeout)
            if not ended:
                return
        self._status_failed(sender, room, ended)

    def _adopt(self, entry: _Room, sender: str, msg: wire.Announce, now: float) -> None:
        if not entry.live or self._state(entry.rid) == State.FAILED:  # the announcer hears now, not at its timeout
            entry.told.add(sender)
            reason = (None if entry.live else self._tombstones.get(entry.room)) or entry.failure \
                or "failed on the prefill replica"
            self._status_failed(sender, entry.room, reason)
            return
        sink = self._sinks.get(sender)
        me = self._config.tp_rank
        owed = sink is not None and sink.route is not None and sink.route.owes(me, sink.rank)
        if owed and sink is not None and not sink.error and not sink.ready:  # Bootstrapped means the data path is up
            self._when_connected(sender, sink, entry, self._adopt, (entry, sender, msg), sender)
            return
        if sender in entry.dsts:
            reason = f"room {entry.room} was announced twice by {sender}"
        elif sink is None or sink.error or sink.route is None:
            reason = sink.error if sink else f"decode rank {sender} announced before registering (or was dropped)"
        elif entry.route is not None and entry.route is not sink.route:
            reason = f"room {entry.room} was announced by decode ranks of different tp sizes"
        else:
            entry.route = sink.route
            entry.dsts[sender] = _Dst(sink.rank, np.asarray(msg.page_ids, np.uint32), msg.grant, owed)
            if len(entry.dsts) == len(sink.route.expects(me)):  # every decode rank it pairs with announced
                self._fire(entry.rid, Trigger.PEERS_CONNECTED, now)
            return
        entry.told.add(sender)
        self._tell(sender, wire.Status(room=entry.room, state=State.FAILED, rank=me, reason=reason,
                                       register_again=sink is None))
        self._fire(entry.rid, Trigger.FAIL, now, reason)

    def _on_abort(self, sender: str, msg: wire.Abort, now: float) -> None:
        entry = self._rooms.get(msg.room)
        if entry is None:  # nothing of ours is in flight to it: acknowledge now
            self._pending.take_one(msg.room, sender)
            self._tombstones.add(msg.room, f"aborted by decode: {msg.reason}", now)
            self._tell(sender, wire.AbortAck(room=msg.room, rank=self._config.tp_rank))
            return
        entry.ack_to.add(sender)
        entry.told.add(sender)
        self._fire(entry.rid, Trigger.ABORT, now, f"aborted by decode: {msg.reason}")
        self._drained(entry, now)

    # -- data connections ---------------------------------------------------------------------

    def connected(self, token: tuple[str, _Sink], handle: Any, error: str, now: float) -> None:
        """The data connection a ``Connect`` asked for is up (``handle``) or could not be made (``error``)."""
        sender, sink = token
        if self._sinks.get(sender) is not sink:  # lost or replaced meanwhile
            if handle is not None:
                self._out.append(Disconnect(handle))
            return
        sink.handle, sink.connecting = handle, False
        waiting, sink.waiting = sink.waiting, []
        bug: Exception | None = None
        for entry, call, args, announcer in waiting:
            why = error
            if not why:
                try:
                    call(*args, now)
                    continue
                except Exception as e:  # a bug of ours: this room fails, the others still run
                    bug = bug or e
                    why = f"resuming the room failed: {e}"
            if entry.live:
                self._fail(entry, why, now)
            if announcer and announcer not in entry.told:  # its announcement was never adopted: it hears now,
                entry.told.add(announcer)  # not at its waiting timeout
                self._status_failed(announcer, entry.room, entry.failure or why)
        if error:
            log.warning("prefill peer: %s", error)
        if bug is not None:  # once every waiting room was seen to: the driver logs and counts it (work_errors)
            raise bug

    def _when_connected(self, sender: str, sink: _Sink, entry: _Room, call: Any, args: tuple[Any, ...],
                        announcer: str) -> None:
        """Run ``call(*args, now)`` once the data connection to ``sender`` is up (connecting it again if a
        transient failure dropped it); if it cannot be made, ``entry``'s room fails."""
        sink.waiting.append((entry, call, args, announcer))
        if not sink.connecting:
            self._connect(sender, sink)

    # -- writing ------------------------------------------------------------------------------

    def _plan(self, entry: _Room, route: Routing, now: float) -> bool:
        """Plan the writes to every decode rank this rank owes, once per hand-over; False if the room failed."""
        me = self._config.tp_rank
        plans = []
        pages = entry.pages
        for endpoint, dst in list(entry.dsts.items()):
            if not dst.owed:
                continue
            sink = self._sinks[endpoint]
            assert sink.layout is not None  # an owed rank registered without error: its layout is known
            if len(pages) < len(dst.pages):
                self._fail(entry, f"decode rank {dst.rank} announced {len(dst.pages)} pages, prefill handed over only "
                           f"{len(pages)}", now)
                return False
            try:  # decode may hold a prefix already: write the tail
                writes = route.plan(me, dst.rank, self._layout, sink.layout, pages[len(pages) - len(dst.pages) :], dst.pages)
            except PdError as e:
                self._fail(entry, f"cannot plan the transfer to decode rank {dst.rank}: {e}", now)
                return False
            plans.append((sink, dst, writes, len(writes) // len(self._layout.bases)))  # buffer-major, rows alike
        entry.plans = plans
        return True

    def written(self, entry: _Room, error: str | None, now: float) -> None:
        """A ``Post`` of ``entry``'s completed (``error`` None: every byte of it landed)."""
        entry.inflight -= 1
        entry.landing -= 1
        if error is not None:
            self._fail(entry, f"transfer failed: {error}", now)
        else:
            self._check_landed(entry, now)
        self._drained(entry, now)

    def _check_landed(self, entry: _Room, now: float) -> None:
        """Once the hand-over finished and every batch landed: the room succeeds here; its decode ranks hear,
        each one whose last batch did not carry the news already (``_Dst.noted``)."""
        if not entry.final or entry.landing or entry.success_told:
            return
        entry.success_told = True
        untold = [endpoint for endpoint, dst in entry.dsts.items() if dst.owed and not dst.noted]
        success = self._success(entry, now) if untold else None
        if untold and success is None:
            return
        if self._fire(entry.rid, Trigger.WRITES_LANDED, now) == State.SUCCESS and success is not None:
            # success is told only for a room still live here: never for one this rank already failed
            for endpoint in untold:
                self._tell(endpoint, success[0])

    def _success(self, entry: _Room, now: float) -> tuple[wire.Status, bytes] | None:
        """The room's success ``Status`` with the first token, and its frame: what its decode ranks are told, on
        the control plane or riding the last write. If it cannot be encoded, the room fails here and its decode
        ranks get a failure naming why (None), so the two sides never end one Succeeded (its scheduler would
        free the pages) and the other timed out."""
        status = wire.Status(
            room=entry.room,
            state=State.SUCCESS,
            rank=self._config.tp_rank,
            first_token=entry.first_token,
            cached_tokens=entry.cached_tokens,
            first_token_logprob=entry.logprob,
            spec_candidate_ids=entry.candidates,
        )
        try:
            frame = wire.encode(status)
        except LocalProtocolError as e:
            self._fail(entry, f"the first token's status cannot be sent: {e}"[: wire.MAX_REASON], now)
            return None
        return status, frame

    # -- failing ----------------------------------------------------------------------------

    def _fail(self, entry: _Room, reason: str, now: float) -> None:
        """Fail the room here and tell its decode ranks at once."""
        self._fire(entry.rid, Trigger.FAIL, now, reason)
        self._notify_failed(entry, reason)

    def _fire(self, rid: str, trigger: int, now: float, reason: str = "") -> int | None:
        state = super()._fire(rid, trigger, now, reason)
        if reason and state == State.FAILED:
            entry = self._by_rid.get(rid)
            if entry is not None and entry.failure is None:
                entry.failure = reason
        return state

    def _notify_failed(self, entry: _Room, reason: str, lost: str = "") -> None:
        """Tell every decode rank of the room that has not heard of its end (``lost`` is gone: nobody to tell)."""
        untold = [endpoint for endpoint in entry.dsts if endpoint not in entry.told and endpoint != lost]
        entry.told.update(untold)
        if lost:
            entry.told.add(lost)
        for endpoint in untold:
            self._status_failed(endpoint, entry.room, reason)

    def _status_failed(self, endpoint: str, room: int, reason: str) -> None:
        self._tell(endpoint, wire.Status(room=room, state=State.FAILED, rank=self._config.tp_rank,
                                         reason=reason[: wire.MAX_REASON]))

    def _drained(self, entry: _Room, now: float) -> None:
        """If the room failed and nothing of it is in flight: close the fence, acknowledge aborts."""
        if entry.inflight or not entry.live or self._state(entry.rid) != State.FAILED:
            return
        acks, entry.ack_to = entry.ack_to, set()
        self._fenced(entry.rid)
        for endpoint in acks:
            self._tell(endpoint, wire.AbortAck(room=entry.room, rank=self._config.tp_rank))

    # -- failures from outside -----------------------------------------------------------

    def peer_dead(self, endpoint: str, session_id: str | None, epoch: int | None, reason: str, now: float) -> None:
        """The control plane found the peer at ``endpoint`` dead: its rooms fail, its data connection goes."""
        self._lose_sink(endpoint, f"decode peer lost: {reason}", now)

    def _lose_sink(self, endpoint: str, reason: str, now: float) -> None:
        sink = self._sinks.pop(endpoint, None)
        bound = [e for e in self._rooms.values() if endpoint in e.dsts]
        self._pending.drop_sender(endpoint)
        if sink is not None:  # announcements waiting for its data connection name it too
            bound += [e for e, _call, _args, _who in sink.waiting if endpoint not in e.dsts and e.live]
            sink.waiting = []
        for entry in bound:
            self._fire(entry.rid, Trigger.FAIL, now, reason)
            self._notify_failed(entry, reason, lost=endpoint)  # the room's other decode ranks hear
        if sink is not None and sink.handle is not None:
            self._out.append(Disconnect(sink.handle))  # fails what is in flight, promptly
        for entry in bound:
            self._drained(entry, now)

    def rooms_failed(self, rooms: tuple[int, ...], reason: str, now: float) -> None:
        """The control plane could not deliver (or accept) frames of these rooms."""
        for room in rooms:
            entry = self._rooms.get(room)
            if entry is not None:
                self._fire(entry.rid, Trigger.FAIL, now, reason)

    def tick(self, now: float) -> None:
        self._tombstones.expire(now)
        for room, sender in self._pending.expire(now):
            self._status_failed(sender, room, f"prefill never registered room {room} within "
                                f"{self._config.bootstrap_timeout:g} s")
