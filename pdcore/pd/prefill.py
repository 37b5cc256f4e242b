"""The prefill side: ``PrefillPeer`` (a ``TransferPeer``) and its ``PrefillOutbox``.

Per room, on this rank: the scheduler registers the request (BOOTSTRAPPING);
the decode rank that pairs with this one (same TP rank, DP group ``room %
dp_size``) sends ``Register`` once per session and ``Announce`` per room; the
announcement connects the room (BOOTSTRAPPED). The model executor hands the
prefilled pages to the outbox; the worker plans coalesced writes, posts them
(TRANSFERRING, the fence armed) and, when the transport confirms every byte
landed, sends ``Status`` with the first token to the decode rank (SUCCESS).

A decode ``Abort`` fails the room and is acknowledged only once no write of
this rank to the room is in flight (fence before free). Rooms that ended stay
as tombstones for ``tombstone_ttl`` so late frames get a clear answer.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from transport.plan import Layout

from ..control import wire
from ._peer import PdPeer, check_logprob, wire_int
from ..core._spec import State, Trigger
from .parking import Parking
from .config import PrefillConfig
from ..control.channel import DeadPeer
from ..core.deadline import Deadline
from ..core.errors import CapacityError, LocalProtocolError, PdError, PeerError, StartError
from ..kv.layout import KvLayout
from ..kv.routing import Routing, routing
from ..core.events import BootstrapInfo, Event, Failed, Succeeded

if TYPE_CHECKING:
    from ..epd.config import ReceiverConfig
    from ..epd.receiver import Receiver

__all__ = ["PrefillPeer", "PrefillOutbox"]

log = logging.getLogger("pdcore.prefill")


@dataclass(eq=False)
class _Dst:
    """A decode rank that announced a room here."""

    rank: int
    pages: Any  # its destination page ids (np.uint32: 4 bytes a page, not a tuple's ~36)
    grant: int  # its transport grant for those pages
    owed: bool  # this rank writes to it (False: it only told us of the room: MLA, replicated heads)


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
    # the hand-over (PrefillOutbox): whole (send) or layer by layer (begin, layers_done, finish)
    pages: Any = None  # the source page ids, prompt order
    plans: list[tuple[_Sink, _Dst, Any, int]] | None = None  # per owed decode rank: its writes, rows per buffer
    sent: int = 0  # buffers posted so far
    final: bool = False  # finish came: every buffer is posted, the first token is known
    first_token: int = 0
    candidates: tuple[int, ...] | None = None
    success_told: bool = False


@dataclass(eq=False)
class _Sink:
    """A decode rank that registered with us."""

    session_id: str
    epoch: int
    layout: Layout | None
    handle: Any | None  # transport PeerHandle; None while the I/O thread connects
    error: str = ""
    rank: int = 0  # its tp rank
    route: Routing | None = None  # how its replica pairs with ours
    endpoint: bytes = b""  # its transport endpoint: a handle lost to a transient failure is connected again
    connecting: bool = False
    waiting: list[tuple[Any, ...]] = field(default_factory=list)  # (room entry, worker call, args) awaiting the connection

    @property
    def ready(self) -> bool:
        return not self.connecting and self.handle is not None and not self.handle.closed


class PrefillPeer(PdPeer):
    """A prefill rank's PD transfer peer."""

    ROLE = "prefill"
    _TERMINAL = (Succeeded, Failed)

    def __init__(self, config: PrefillConfig) -> None:
        super().__init__(config)
        self._rooms: dict[int, _Room] = {}
        self._by_rid: dict[str, _Room] = {}
        self._pending = Parking(config.max_pending, config.max_parked_pages, config.max_parked_pages_total)
        self._sinks: dict[str, _Sink] = {}
        self._receiver: Receiver | None = None

    @classmethod
    def start(cls, config: PrefillConfig) -> tuple[PrefillPeer, PrefillOutbox]:
        """Start the transport, register the cache, open the control socket, start the threads and
        register with the bootstrap server (retrying until ``config.start_timeout``)."""
        peer = cls(config)
        deadline = Deadline.after(config.start_timeout)
        peer._follow_epoch(deadline)
        peer._start()
        try:
            layout = {"page_bytes": list(peer._layout.page_bytes), "num_pages": peer._layout.num_pages}
            if config.kv_layout is not None:
                layout["kv"] = config.kv_layout.to_json()
            peer._register_with_bootstrap(layout, deadline)
        except BaseException:
            peer.close()
            raise
        return peer, PrefillOutbox(peer)

    def embedding_receiver(self, config: ReceiverConfig) -> Receiver:
        """EPD: this rank's receiver of the encode nodes' embeddings, over this peer's planes (one per peer).

        Its receive slots are registered with the transport now and for the receiver's life."""
        if self._receiver is not None:
            raise LocalProtocolError("embedding_receiver: this prefill peer has its receiver already")
        if self._closed:
            raise PeerError("prefill peer: closed")
        from ..epd.receiver import Receiver

        try:
            self._receiver = Receiver(self, config)
        except (ValueError, TypeError) as e:  # the transport refused the slots' memory (overlap, ...)
            raise StartError(f"embedding_receiver: the transport refused the receive buffers: {e}") from e
        return self._receiver

    # -- the scheduler's calls ------------------------------------------------------------

    def register(self, rid: str, bootstrap: BootstrapInfo) -> None:
        """Track an admitted request, before the scheduler can plan it; never blocks.

        ``bootstrap.room`` joins this request to its decode side (decode registers the same
        room): it must be unique among this rank's live requests (``LocalProtocolError``
        otherwise). ``PeerError`` after ``close``.
        """
        if self._closed:
            raise PeerError("prefill peer: closed")
        room = bootstrap.room
        with self._lock:
            if room in self._rooms:
                raise LocalProtocolError(f"room {room} is already held by rid {self._rooms[room].rid!r}", rooms=(room,))
            self._table.register(rid, time.monotonic())
            if self.counts is not None:
                self.counts.born(rid)
            entry = _Room(rid, room)
            self._rooms[room] = entry
            self._by_rid[rid] = entry
            aborted = self._tombstones.pop(room)
            pending = self._pending.take(room)
        if aborted is not None:
            reason = f"room {room} ended before it registered here: {aborted}"
            self._fire(rid, Trigger.ABORT, reason)
            for sender, _ in pending:  # decode ranks that announced it meanwhile hear of its end
                self._tell(sender, wire.Status(room=room, state=State.FAILED, rank=self._config.tp_rank, reason=reason))
        elif pending:
            self._submit_or_fail(rid, self._adopt_parked, entry, pending)

    def record_usage(self, rid: str, cached_tokens: int, bootstrap_logprob: float | None) -> None:
        """A committed prompt's usage, sent to the decode node with the first token (``Status``).

        Call it before the hand-over's ``send``/``finish``. ``cached_tokens`` is an int in
        0..2**31-1; ``bootstrap_logprob`` the first token's log-probability: a finite float,
        ``-inf`` or NaN (all reach decode's ``RemotePrefill.bootstrap_logprob``), or None.
        A value the status frame cannot carry (``+inf``, a count past 2**31-1) raises
        ``LocalProtocolError`` here, naming the field, and changes nothing. An unknown rid raises;
        one that ended here within ``tombstone_ttl`` is ignored (see ``PdPeer._accepts``).
        """
        where = f"record_usage({rid!r})"
        cached = wire_int(where, "cached_tokens", cached_tokens, wire.MAX_COUNT)
        logprob = check_logprob(where, bootstrap_logprob)
        if not self._accepts(rid, "record_usage"):
            return
        with self._lock:
            entry = self._by_rid.get(rid)
            if entry is None:
                return  # it ended since _accepts looked
            entry.cached_tokens = cached
            entry.logprob = logprob

    def abort_room(self, rid: str, room: int) -> None:
        """EPD: tell the decode node waiting on ``room`` that ``rid`` failed before it could register.

        Best effort: a decode rank that already announced hears now; one that
        announces later is answered from the tombstone.
        """
        with self._lock:
            entry = self._rooms.get(room)
        if entry is not None:
            self._fire(entry.rid, Trigger.ABORT, "aborted by the prefill scheduler")
            return
        try:
            self._submit(self._abort_unregistered, room, f"request {rid!r} failed before it reached prefill")
        except PdError as e:
            log.warning("abort_room(%r, %d) dropped: %s", rid, room, e)

    def _abort_unregistered(self, room: int, reason: str) -> None:
        with self._lock:
            pending = self._pending.take(room)
            self._tombstones.add(room, reason, time.monotonic())
        for sender, _ in pending:
            self._tell(sender, wire.Status(room=room, state=State.FAILED, rank=self._config.tp_rank, reason=reason))

    # -- the outbox's call ------------------------------------------------------------------

    def _live(self, rid: str) -> bool:
        return rid in self._by_rid

    def _hand_over(self, rid: str, page_ids: np.ndarray, first_token: int, candidates: tuple[int, ...] | None) -> None:
        """Post on the caller's thread when the transport has room; else the worker waits for room."""
        finish = (first_token, candidates)
        if not self._post(rid, page_ids, None, finish, wait=False):
            self._submit_or_fail(rid, self._post, rid, page_ids, None, finish)

    def _stream(self, rid: str, page_ids: Any, upto: int | None, finish: tuple[int, tuple[int, ...] | None] | None) -> None:
        """Layer-wise hand-over (``PrefillOutbox.begin``/``layers_done``/``finish``): the worker posts, in order."""
        self._submit_or_fail(rid, self._post, rid, page_ids, upto, finish)

    @property
    def _buffers_per_layer(self) -> int:
        layout = self._config.kv_layout
        return 2 if layout is not None and layout.order != "mla" else 1

    def _submit_or_fail(self, rid: str, fn: Any, *args: Any) -> None:
        try:
            self._submit(fn, *args)
        except PdError as e:
            self._fire(rid, Trigger.FAIL, str(e))

    # -- worker: messages from decode ranks ---------------------------------------------------

    def _on_message(self, sender: str, msg: wire.Message) -> None:
        if isinstance(msg, wire.Register):
            self._on_register(sender, msg)
        elif isinstance(msg, wire.Announce):
            self._on_announce(sender, msg)
        elif isinstance(msg, wire.Abort):
            self._on_abort(sender, msg)
        elif isinstance(msg, wire.EmbedStatus) and self._receiver is not None:
            self._receiver._on_status(sender, msg)
        else:
            log.warning("prefill peer: unexpected %s from %s", type(msg).__name__, sender)

    def _on_register(self, sender: str, msg: wire.Register) -> None:
        cfg = self._config
        old = self._sinks.get(sender)
        if old is not None and (old.session_id, old.epoch) == (msg.session_id, msg.epoch):
            return  # idempotent
        if old is not None:
            self._lose_sink(sender, f"decode rank {sender} re-registered (session {msg.session_id})")
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
            want = self._layout.page_bytes if cfg.kv_layout is None else (cfg.kv_layout.page_bytes(msg.tp_size),) * len(
                self._layout.page_bytes)
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
        sink = _Sink(msg.session_id, msg.epoch, layout, None, error, rank=msg.tp_rank, route=route, endpoint=msg.endpoint)
        self._sinks[sender] = sink
        if not error and route is not None and route.owes(cfg.tp_rank, msg.tp_rank):
            self._connect(sender, sink)  # a rank we owe nothing only tells us of rooms: no data connection

    # -- data connections: made on the I/O thread, adopted by the worker -----------------------

    def _connect(self, sender: str, sink: _Sink) -> None:
        sink.connecting = True
        try:
            self._submit_io(self._connect_io, sender, sink, sink.handle)
        except PdError as e:
            self._connected(sender, sink, None, f"cannot queue the transport connect to {sender}: {e}")

    def _connect_io(self, sender: str, sink: _Sink, old: Any) -> None:
        """I/O thread: (re)connect the transport to a decode rank; the worker adopts the outcome."""
        handle, error = None, ""
        try:
            if old is not None:
                self._transport.disconnect(old, deadline=Deadline.after(1.0))
            handle = self._transport.connect(sink.endpoint, deadline=Deadline.after(self._config.start_timeout))
        except Exception as e:  # whatever it was, the rooms waiting for it must hear (else they wait forever)
            if not isinstance(e, PdError):
                log.exception("prefill peer: connecting to %s failed unexpectedly", sender)
            error = f"cannot connect the transport to {sender}: {e}"
        self._from_io(self._connected, sender, sink, handle, error)

    def _connected(self, sender: str, sink: _Sink, handle: Any, error: str) -> None:
        if self._sinks.get(sender) is not sink:  # lost or replaced meanwhile
            if handle is not None:
                self._transport.disconnect(handle)
            return
        sink.handle, sink.connecting = handle, False
        waiting, sink.waiting = sink.waiting, []
        for entry, fn, args in waiting:
            why = error
            if not why:
                try:
                    fn(*args)
                    continue
                except Exception as e:  # a bug of ours: this room fails, the others still run
                    log.exception("prefill peer: resuming room %d failed", entry.room)
                    why = f"resuming the room failed: {e}"
            if self._by_rid.get(entry.rid) is entry:
                self._fail(entry, why)
        if error:
            log.warning("prefill peer: %s", error)

    def _when_connected(self, sender: str, sink: _Sink, entry: _Room, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the worker once the data connection to ``sender`` is up (connecting it
        again if a transient failure dropped it); if it cannot be made, ``entry``'s room fails."""
        sink.waiting.append((entry, fn, args))
        if not sink.connecting:
            self._connect(sender, sink)

    def _on_announce(self, sender: str, msg: wire.Announce) -> None:
        room = msg.room
        with self._lock:
            entry = self._rooms.get(room)
            ended = None if entry is not None else self._tombstones.get(room)
            if entry is None and ended is None:
                ended = self._pending.park(sender, msg, time.monotonic() + self._config.bootstrap_timeout)
                if not ended:
                    return
        if entry is None:
            self._tell(sender, wire.Status(room=room, state=State.FAILED, rank=self._config.tp_rank, reason=ended or ""))
            return
        self._adopt(entry, sender, msg)

    def _adopt_parked(self, entry: _Room, parked: list[tuple[str, wire.Announce]]) -> None:
        """Worker: the announcements that waited for the room's registration, every sender's."""
        for sender, msg in parked:
            self._adopt(entry, sender, msg)

    def _adopt(self, entry: _Room, sender: str, msg: wire.Announce) -> None:
        with self._lock:
            settled = self._by_rid.get(entry.rid) is not entry
            reason = self._tombstones.get(entry.room) if settled else None
        if settled or self._failed_here(entry):  # the announcer hears now, not at its waiting timeout
            with self._lock:
                entry.told.add(sender)
            reason = reason or entry.failure or "failed on the prefill replica"
            self._tell(sender, wire.Status(room=entry.room, state=State.FAILED, rank=self._config.tp_rank, reason=reason))
            return
        sink = self._sinks.get(sender)
        me = self._config.tp_rank
        owed = sink is not None and sink.route is not None and sink.route.owes(me, sink.rank)
        if owed and not sink.error and not sink.ready:  # Bootstrapped means the data path is up
            self._when_connected(sender, sink, entry, self._adopt, entry, sender, msg)
            return
        complete = False
        with self._lock:
            if sender in entry.dsts:
                reason = f"room {entry.room} was announced twice by {sender}"
            elif sink is None or sink.error or sink.route is None:
                reason = sink.error if sink else f"decode rank {sender} announced before registering (or was dropped)"
            elif entry.route is not None and entry.route is not sink.route:
                reason = f"room {entry.room} was announced by decode ranks of different tp sizes"
            else:
                entry.route = sink.route
                entry.dsts[sender] = _Dst(sink.rank, np.asarray(msg.page_ids, np.uint32), msg.grant, owed)
                complete = len(entry.dsts) == len(sink.route.expects(me))
                reason = ""
        if reason:
            status = wire.Status(
                room=entry.room, state=State.FAILED, rank=self._config.tp_rank, reason=reason, register_again=sink is None
            )
            self._tell(sender, status)
            self._fire(entry.rid, Trigger.FAIL, reason)
            return
        if complete:  # every decode rank this rank pairs with for the room announced
            self._fire(entry.rid, Trigger.PEERS_CONNECTED)

    def _on_abort(self, sender: str, msg: wire.Abort) -> None:
        with self._lock:
            entry = self._rooms.get(msg.room)
            if entry is None:  # nothing of ours is in flight to it: acknowledge now
                self._pending.take_one(msg.room, sender)
                self._tombstones.add(msg.room, f"aborted by decode: {msg.reason}", time.monotonic())
            else:
                entry.ack_to.add(sender)
                entry.told.add(sender)
        if entry is None:
            self._tell(sender, wire.AbortAck(room=msg.room, rank=self._config.tp_rank))
            return
        self._fire(entry.rid, Trigger.ABORT, f"aborted by decode: {msg.reason}")
        self._drained(entry)

    # -- worker: sending --------------------------------------------------------------------

    def _post(
        self,
        rid: str,
        page_ids: Any,
        upto: int | None,
        finish: tuple[int, tuple[int, ...] | None] | None,
        wait: bool = True,
    ) -> bool:
        """Post ``rid``'s writes of the buffers of layers ``[0, upto)`` not posted yet, or of every buffer
        with ``finish`` (first token, candidates), which ends the hand-over; ``page_ids`` (not None) names the
        source pages. False only when not ``wait``-ing and the transport is at its bound (nothing posted).

        The worker waits (up to ``fence_timeout``) for room; the outbox's caller never does.
        """
        with self._lock:
            entry = self._by_rid.get(rid)
        if entry is None:
            return True  # the request ended meanwhile
        route = entry.route
        if route is None or len(entry.dsts) < len(route.expects(self._config.tp_rank)):
            # before Bootstrapped: with several decode ranks to a room, writing to the ones that announced
            # would succeed here while the others wait out their waiting timeout
            self._fail(entry, "pages handed over before a decode rank announced the room (every decode rank it "
                       "pairs with must: wait for Bootstrapped)")
            return True
        if page_ids is not None and entry.pages is None:
            entry.pages = page_ids
        if entry.pages is None:
            self._fail(entry, "layers handed over before their pages (PrefillOutbox.begin)")
            return True
        nbuf = len(self._layout.bases)
        if finish is not None:
            hi = nbuf
        elif len(entry.pages) < self._config.layerwise_min_pages:
            return True  # a short prompt: its layers go at the end, with finish
        else:
            hi = min(nbuf, max(0, upto or 0) * self._buffers_per_layer)
        for endpoint, dst in list(entry.dsts.items()):
            sink = self._sinks.get(endpoint) if dst.owed else None
            if dst.owed and sink is None:
                self._fail(entry, f"decode rank {endpoint} was lost before the hand-over")
                return True
            if sink is not None and not sink.ready:
                if not wait:
                    return False  # the worker parks it until the data connection is up
                self._when_connected(endpoint, sink, entry, self._post, rid, page_ids, upto, finish)
                return True
        if entry.plans is None and not self._plan(entry, route):
            return True
        assert entry.plans is not None
        lo = entry.sent
        batches = [(sink, dst, writes[lo * rows : hi * rows]) for sink, dst, writes, rows in entry.plans if hi > lo]
        batches = [b for b in batches if len(b[2])]
        if len(batches) > 1 and not wait:
            return False  # several decode ranks: the worker posts them, waiting for room
        with self._lock:  # counted before "writes posted": an abort in between must not ack "drained"
            entry.inflight += len(batches)
            entry.landing += len(batches)
        if self._fire(rid, Trigger.WRITES_POSTED) in (None, State.FAILED):
            with self._lock:
                entry.inflight -= len(batches)
                entry.landing -= len(batches)
            self._drained(entry)  # failed meanwhile: post nothing, and owe no ack for it
            return True
        entry.sent = max(lo, hi)
        if finish is not None:
            with self._lock:
                entry.final = True
                entry.first_token, entry.candidates = finish
        done = functools.partial(self._landed, entry)
        for i, (sink, dst, batch) in enumerate(batches):
            try:
                self._transport.write(
                    sink.handle,
                    batch,
                    done,
                    deadline=Deadline.after(self._config.fence_timeout) if wait else None,
                    grant=dst.grant,
                )
                if self.counts is not None:
                    self.counts.writes_posted += len(batch)
                    self.counts.bytes_posted += int(batch[:, 2].sum())
            except PdError as e:
                with self._lock:
                    entry.inflight -= len(batches) - i
                    entry.landing -= len(batches) - i
                if isinstance(e, CapacityError) and not wait:  # the only batch: nothing was posted
                    with self._lock:
                        entry.final = False
                    entry.sent = lo
                    return False  # the worker posts it, waiting for room
                if isinstance(e, CapacityError):
                    self._fail(entry, f"the transport had no room for {self._config.fence_timeout:g} s")
                else:
                    self._fail(entry, f"posting the writes failed: {e}")
                self._drained(entry)
                return True
        self._check_landed(entry)  # nothing was left to post (or it all landed already)
        return True

    def _plan(self, entry: _Room, route: Routing) -> bool:
        """Plan the writes to every decode rank this rank owes, once per hand-over; False if the room failed."""
        me = self._config.tp_rank
        plans = []
        pages = entry.pages
        for endpoint, dst in list(entry.dsts.items()):
            if not dst.owed:
                continue
            sink = self._sinks[endpoint]
            if len(pages) < len(dst.pages):
                self._fail(entry, f"decode rank {dst.rank} announced {len(dst.pages)} pages, prefill handed over only "
                           f"{len(pages)}")
                return False
            try:  # decode may hold a prefix already: write the tail
                writes = route.plan(me, dst.rank, self._layout, sink.layout, pages[len(pages) - len(dst.pages) :], dst.pages)
            except PdError as e:
                self._fail(entry, f"cannot plan the transfer to decode rank {dst.rank}: {e}")
                return False
            plans.append((sink, dst, writes, len(writes) // len(self._layout.bases)))  # buffer-major, rows alike
        entry.plans = plans
        return True

    def _landed(self, entry: _Room, _batch: int, error: Any) -> None:
        """Transport thread: a batch completed. Only table updates and queued frames here."""
        with self._lock:
            entry.inflight -= 1
            entry.landing -= 1
        if error is not None:
            self._fail(entry, f"transfer failed: {error}")
        else:
            self._check_landed(entry)
        self._drained(entry)

    def _check_landed(self, entry: _Room) -> None:
        """Once the hand-over finished and every batch landed: the room succeeds here; its decode ranks hear.

        The ``Status`` is built and encoded first: if it cannot be sent, the room fails here and
        its decode ranks get a failure naming why, so the two sides never end one Succeeded and
        the other timed out."""
        with self._lock:
            if not entry.final or entry.landing or entry.success_told:
                return
            entry.success_told = True
        status = wire.Status(
            room=entry.room,
            state=State.SUCCESS,
            rank=self._config.tp_rank,
            first_token=entry.first_token,
            cached_tokens=entry.cached_tokens,
            first_token_logprob=entry.logprob,
            spec_candidate_ids=entry.candidates,
        )
        try:  # before the room may succeed: a status that cannot leave must not end as Succeeded here
            wire.encode(status)  # (its scheduler would free the pages) while decode waits out waiting_timeout
        except LocalProtocolError as e:
            self._fail(entry, f"the first token's status cannot be sent: {e}"[: wire.MAX_REASON])
            return
        if self._fire(entry.rid, Trigger.WRITES_LANDED) == State.SUCCESS:
            # success is told only for a room still live here: never for one this rank already failed
            for endpoint, dst in list(entry.dsts.items()):
                if dst.owed:
                    self._tell(endpoint, status)

    def _fail(self, entry: _Room, reason: str) -> None:
        """Fail the room here and tell its decode rank at once."""
        self._fire(entry.rid, Trigger.FAIL, reason)
        self._notify_failed(entry, reason)

    def _notify_failed(self, entry: _Room, reason: str, lost: str = "") -> None:
        """Tell every decode rank of the room that has not heard of its end (``lost`` is gone: nobody to tell)."""
        with self._lock:
            untold = [endpoint for endpoint in entry.dsts if endpoint not in entry.told and endpoint != lost]
            entry.told.update(untold)
            if lost:
                entry.told.add(lost)
        for endpoint in untold:
            self._tell(endpoint, wire.Status(room=entry.room, state=State.FAILED, rank=self._config.tp_rank, reason=reason))

    def _fire(self, rid: str, trigger: int, reason: str = "") -> int | None:
        state = super()._fire(rid, trigger, reason)
        if reason and state == State.FAILED:
            entry = self._by_rid.get(rid)
            if entry is not None and entry.failure is None:
                entry.failure = reason
        return state

    def _failed_here(self, entry: _Room) -> bool:
        try:
            return self._table.state(entry.rid) == State.FAILED
        except PdError:  # settled meanwhile
            return False

    def _drained(self, entry: _Room) -> None:
        """If the room failed and nothing of it is in flight: close the fence, acknowledge aborts."""
        with self._lock:
            if entry.inflight or self._by_rid.get(entry.rid) is not entry:
                return
            acks, entry.ack_to = entry.ack_to, set()
        try:
            if self._table.state(entry.rid) != State.FAILED:
                return
        except PdError:
            return
        self._fenced(entry.rid)
        for endpoint in acks:
            self._tell(endpoint, wire.AbortAck(room=entry.room, rank=self._config.tp_rank))

    def _close_fence(self, rid: str) -> None:
        with self._lock:
            entry = self._by_rid.get(rid)
        if entry is not None:
            self._notify_failed(entry, "failed on the prefill replica")
            self._drained(entry)

    def _tell(self, endpoint: str, msg: wire.Message) -> None:
        try:
            self._channel.send(endpoint, msg)
        except PdError as e:
            log.warning("prefill peer: cannot tell %s about room %s: %s", endpoint, wire.rooms_of(msg), e)

    # -- failures from outside -----------------------------------------------------------

    def connected_peers(self) -> int:
        """Decode ranks with a data connection up (a metric)."""
        return sum(1 for sink in list(self._sinks.values()) if sink.ready)

    def _peer_lost(self, dead: DeadPeer) -> None:
        self._lose_sink(dead.endpoint, f"decode peer lost: {dead.reason}")
        if self._receiver is not None:
            self._receiver._lose_source(dead.endpoint, dead.reason, dead.epoch)

    def _lose_sink(self, endpoint: str, reason: str) -> None:
        sink = self._sinks.pop(endpoint, None)
        with self._lock:
            bound = [e for e in self._rooms.values() if endpoint in e.dsts]
            self._pending.drop_sender(endpoint)
        if sink is not None:  # announcements waiting for its data connection name it too
            bound += [e for e, _fn, _args in sink.waiting if endpoint not in e.dsts and self._by_rid.get(e.rid) is e]
            sink.waiting = []
        for entry in bound:
            self._fire(entry.rid, Trigger.FAIL, reason)
            self._notify_failed(entry, reason, lost=endpoint)  # the room's other decode ranks hear
        if sink is not None and sink.handle is not None:
            self._transport.disconnect(sink.handle)  # fails what is in flight, promptly
        for entry in bound:
            self._drained(entry)

    def _rooms_failed(self, rooms: tuple[int, ...], reason: str) -> None:
        for room in rooms:
            entry = self._rooms.get(room)
            if entry is not None:
                self._fire(entry.rid, Trigger.FAIL, reason)
        if self._receiver is not None:
            self._receiver._rooms_failed(rooms, reason)

    def _tick(self, now: float) -> None:
        super()._tick(now)
        if self._receiver is not None:
            self._receiver._tick(now)
        with self._lock:
            expired = self._pending.expire(now)
        for room, sender in expired:
            reason = f"prefill never registered room {room} within {self._config.bootstrap_timeout:g} s"
            self._tell(sender, wire.Status(room=room, state=State.FAILED, rank=self._config.tp_rank, reason=reason))

    def _farewell(self) -> None:
        if self._receiver is not None:
            self._receiver._farewell()
        with self._lock:
            live = list(self._rooms.values())
        for entry in live:
            self._notify_failed(entry, "prefill peer closed")

    # -- the round ---------------------------------------------------------------------------

    def _settle(self, events: list[Event]) -> list[Event]:
        now = time.monotonic()
        failed = []
        with self._lock:  # once per round, not per event: a round may end hundreds of requests
            for event in events:
                kind = type(event)
                if kind is Succeeded or kind is Failed:
                    entry = self._by_rid.pop(event.rid)
                    del self._rooms[entry.room]
                    if kind is Failed:  # late frames for it get a clear answer
                        self._tombstones.add(entry.room, event.reason, now)
                        failed.append((entry, event.reason))
        for entry, reason in failed:
            self._notify_failed(entry, reason)
        return events


class PrefillOutbox:
    """The model executor's side of a prefill peer: hand over a request's prefilled pages.

    Whole (``send``, after the forward pass), or layer by layer so the writes
    overlap the forward pass: ``begin`` with the pages, ``layers_done`` as each
    layer's KV is written, ``finish`` with the first token. A prompt of fewer
    than ``PrefillConfig.layerwise_min_pages`` pages is sent at ``finish``
    whatever ``layers_done`` says (short prompts lose by streaming). A room
    that fails meanwhile is fenced as any other: partially streamed layers included.

    Hand a request over only after its ``Bootstrapped`` event: a hand-over before
    every decode rank it pairs with announced the room fails the room, and every
    decode rank hears of it (one that announced at once, one that announces later
    in answer, or, past ``tombstone_ttl``, as a room never registered once
    ``bootstrap_timeout`` passed). Decode may announce fewer
    pages than are handed over (it holds a prefix already: only the tail is written,
    into the announced pages); more fails the room, naming both counts.

    Every call checks its arguments against what the status frame carries (first
    token and candidates 0..2**31-1, at most 256 candidates) and raises
    ``LocalProtocolError`` naming the field, changing nothing. A rid this peer never
    registered (or that ended more than ``tombstone_ttl`` ago) raises
    ``LocalProtocolError``; one that ended here within ``tombstone_ttl`` is a race the
    scheduler cannot avoid (it hears of the end a round later) and the call does nothing.
    After ``close`` every call raises ``PeerError``.
    """

    def __init__(self, peer: PrefillPeer) -> None:
        self._peer = peer

    def begin(self, rid: str, page_ids: Any) -> None:
        """Layer-wise: the pages (prompt order) the forward pass is filling for ``rid``. Never blocks."""
        pages = _page_ids(page_ids)
        if self._peer._accepts(rid, "begin"):
            self._peer._stream(rid, pages, None, None)

    def layers_done(self, rid: str, upto: int) -> None:
        """Layers ``[0, upto)`` of ``rid``'s pages are final: their writes may start. Never blocks."""
        if isinstance(upto, bool) or not isinstance(upto, int) or upto < 0:
            raise LocalProtocolError(f"layers_done({rid!r}): upto must be an int >= 0, got {upto!r}")
        if self._peer._accepts(rid, "layers_done"):
            self._peer._stream(rid, None, upto, None)

    def finish(self, rid: str, first_token: int, spec_candidate_ids: Any = None) -> None:
        """The forward pass is done: the remaining layers go, then the first token. Never blocks."""
        finish = _finish("finish", rid, first_token, spec_candidate_ids)
        if self._peer._accepts(rid, "finish"):
            self._peer._stream(rid, None, None, finish)

    def send(
        self, rid: str, page_ids: Any, first_token: int, spec_candidate_ids: Any = None
    ) -> None:
        """Write ``rid``'s KV ``page_ids`` (in prompt order) to its decode rank, then send the first token.

        Never blocks; the pages must stay unchanged until the request's
        ``Succeeded`` or ``Failed`` event. ``first_token`` becomes decode's
        ``RemotePrefill.bootstrap_token``; ``spec_candidate_ids`` (None, or up to 256
        token ids) its ``spec_candidate_ids``.
        """
        first, candidates = _finish("send", rid, first_token, spec_candidate_ids)
        pages = _page_ids(page_ids)
        if self._peer._accepts(rid, "send"):
            self._peer._hand_over(rid, pages, first, candidates)


def _page_ids(page_ids: Any) -> np.ndarray:
    return page_ids if isinstance(page_ids, np.ndarray) else np.fromiter(page_ids, np.int64)


def _finish(call: str, rid: str, first_token: int, spec_candidate_ids: Any) -> tuple[int, tuple[int, ...] | None]:
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
