"""The decode side: ``DecodePeer`` (a ``TransferPeer``) and its ``DecodeInbox``.

Per request, on this rank: the scheduler registers it (BOOTSTRAPPING); the
I/O thread looks up the request's prefill deployment on its bootstrap server
(one lookup at a time per deployment, cached, bounded by deadlines, retried
until the bootstrap timeout: an unreachable server never delays the worker),
the worker finds the prefill rank that pairs with this one (same TP rank, DP
group ``room % dp_size``), sends it ``Register`` once per session, and the
request is connected (BOOTSTRAPPED). The scheduler allocates pages and
announces them through the inbox (WAITING_FOR_INPUT, the fence armed); the
prefill rank's ``Status`` with the first token lands it (SUCCESS).

Fence before free, enforced here: announcing a room's pages grants the
prefill rank's transport the right to write into exactly those pages (the
grant's key travels in ``Announce``). A failed request whose pages were
announced is reported ``Failed`` (and its pages handed back) only after this
rank revoked that grant in the data plane: from then on nothing the prefill
rank sends lands there, whether it is healthy, paused, partitioned or gone.
``Abort`` still tells the prefill rank to stop, but its answer is not awaited.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..control import wire
from ._peer import PdPeer, layout_json, wire_int
from ..core._spec import State, Trigger
from ..control.bootstrap import ParallelInfo
from ..control.lookup import Deployment, Lookups
from .config import DecodeConfig
from ..control.channel import DeadPeer
from ..core.deadline import Deadline
from ..core.errors import LocalProtocolError, PdError, PeerError
from ..kv.layout import KvLayout
from ..kv.routing import routing
from ..core.events import BootstrapInfo, Event, Failed, RemotePrefill, RemotePrefillDone, Succeeded

__all__ = ["DecodePeer", "DecodeInbox"]

log = logging.getLogger("pdcore.decode")

_REVOKE_WAIT = 1.0  # seconds a revoke waits for a write landing through the grant before it cuts it


def page_ranges(layout: Any, page_ids: Any) -> list[tuple[int, int]]:
    """The ``(addr, length)`` ranges of ``page_ids`` in every buffer of ``layout``, runs of adjacent
    pages merged, sorted by address. Plain Python: for the few runs of one request it is several
    times cheaper than numpy's per-call cost, and it runs on the scheduler thread per announce."""
    runs: list[list[int]] = []
    for p in sorted(set(page_ids)):
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [(base + s * size, n * size) for base, size in sorted(zip(layout.bases, layout.page_bytes)) for s, n in runs]


@dataclass(eq=False)
class _Link:
    """A prefill rank a request talks to: one that writes to this rank (``owes``), or one told only of the room."""

    endpoint: str
    owes: bool
    epoch: int = 0  # the incarnation its deployment's server listed
    grant: Any = None  # the transport grant of the announced pages, until revoked
    landed: wire.Status | None = None  # its success status


@dataclass(eq=False)
class _Request:
    rid: str
    room: int
    server: tuple[str, int]
    dp_rank: int | None = None  # the prefill DP group, when the router named it (else room % dp_size)
    links: tuple[_Link, ...] = ()  # the prefill ranks of the room, once bootstrapped (sources first)
    request_pool_index: int = -1
    abort_sent: bool = False
    mismatch: str = ""  # the deployments cannot pair: failing once its prefill ranks are told why
    rechecked: bool = False  # a verdict against one of its prefill ranks was checked with a fresh look-up


class DecodePeer(PdPeer):
    """A decode rank's PD transfer peer."""

    ROLE = "decode"
    _TERMINAL = (RemotePrefillDone, Failed)

    def __init__(self, config: DecodeConfig) -> None:
        super().__init__(config)
        self._requests: dict[str, _Request] = {}
        self._by_source: dict[tuple[str, int], _Request] = {}
        self._lookups = Lookups(
            self, "decode peer", lambda info, needs: {key for need in needs for key in self._lookup_keys(info, *need)},
            lambda request: (request.room, request.dp_rank), self._looked_up,
        )
        self._registered: set[str] = set()  # prefill endpoints that have our Register
        self._unrevoked: list[_Request] = []  # revokes that could not be confirmed: retried every tick
        self._landed_grants: list[Any] = []  # grants of landed rooms still to revoke: the worker's, every tick

    @classmethod
    def start(cls, config: DecodeConfig) -> tuple[DecodePeer, DecodeInbox]:
        """Start the transport, register the cache, open the control socket and start the threads."""
        peer = cls(config)
        peer._start()
        return peer, DecodeInbox(peer)

    # -- the scheduler's calls ------------------------------------------------------------

    def register(self, rid: str, bootstrap: BootstrapInfo) -> None:
        """Track an admitted request; its prefill rank is looked up off the scheduler thread. Never blocks.

        ``bootstrap`` names the prefill deployment's bootstrap server and the room, which
        the prefill side registers too: the room, not the rid, joins the two sides.
        ``PeerError`` after ``close``.
        """
        if self._closed:
            raise PeerError("decode peer: closed")
        with self._lock:
            self._table.register(rid, time.monotonic())
            if self.counts is not None:
                self.counts.born(rid)
            request = _Request(rid, bootstrap.room, (bootstrap.host, bootstrap.port), bootstrap.dp_rank)
            self._requests[rid] = request
        links = self._known_links(request)
        if links is not None:  # the common case: a deployment we already talk to
            self._connected(request, links)
            return
        try:
            self._submit(self._bootstrap, request)
        except PdError as e:
            self._fire(rid, Trigger.FAIL, str(e))

    def _known_links(self, request: _Request) -> tuple[_Link, ...] | None:
        """The room's prefill ranks if they are cached and all have our Register; never does I/O."""
        deployment = self._lookups.deployments.get(request.server)
        if deployment is None:
            return None
        try:
            links = self._links_of(deployment, request)
        except PdError:
            return None  # the worker's bootstrap fails it, naming why
        if links is None or any(link.endpoint not in self._registered for link in links):
            return None
        if any(self._lookups.suspect(link.endpoint) for link in links):
            return None  # found dead once: the worker judges it (a read here: the worker owns the look-ups)
        return links

    def _connected(self, request: _Request, links: tuple[_Link, ...]) -> None:
        with self._lock:
            request.links = links
            for link in links:
                self._by_source[(link.endpoint, request.room)] = request
        self._fire(request.rid, Trigger.PEERS_CONNECTED)

    def _live(self, rid: str) -> bool:
        return rid in self._requests

    def record_usage(self, rid: str, cached_tokens: int, bootstrap_logprob: float | None) -> None:
        """Prefill role only: usage travels from prefill to decode. Here it changes nothing."""

    def abort_room(self, rid: str, room: int) -> None:
        """Fail ``rid`` now (its prefill rank is told, and the pages wait for the fence)."""
        self._fire(rid, Trigger.ABORT, f"aborted by the decode scheduler (room {room})")


    # -- worker: bootstrap ------------------------------------------------------------------

    def _bootstrap(self, request: _Request) -> None:
        if self._requests.get(request.rid) is not request:
            return
        deployment = self._lookups.get(request.server)
        try:
            links = self._links_of(deployment, request)
        except PdError as e:
            self._cannot_pair(deployment, request, f"bootstrap {request.server[0]}:{request.server[1]}: {e}")
            return
        if links is None:  # not looked up (or not up) yet: the table's bootstrap timeout bounds the wait
            self._lookups.wait(request.server, request)
            return
        for link in links:
            verdict = self._verdict(link)
            if verdict and not request.rechecked:  # the server may list it anew (restarted): look once more
                request.rechecked = True
                self._lookups.forget(link.endpoint)
                self._lookups.wait(request.server, request)
                return
            if verdict:  # it died and has not come back: fail now, not after another dead_after
                self._fire(request.rid, Trigger.FAIL, f"prefill rank {verdict}")
                return
        for source in [link.endpoint for link in links if link.endpoint not in self._registered]:
            cfg = self._config
            self._channel.send(
                source,
                wire.Register(
                    session_id=self.session_id,
                    epoch=self.epoch,
                    endpoint=self._transport.endpoint(),
                    regions=tuple(wire.Region(addr=r.addr, length=r.length, key=r.key) for r in self._transport.regions()),
                    layout=layout_json(self._layout, cfg.kv_layout),
                    tp_size=cfg.tp_size,
                    tp_rank=cfg.tp_rank,
                ),
            )
            self._registered.add(source)
        self._connected(request, links)

    def _group(self, info: ParallelInfo, room: int, dp_rank: int | None) -> int:
        """The prefill DP group of ``room``; ``LocalProtocolError`` if the router named one that does not exist."""
        dp = room % info.dp_size if dp_rank is None else dp_rank
        if dp >= info.dp_size:
            raise LocalProtocolError(f"BootstrapInfo.dp_rank {dp} is not a DP group of the prefill deployment "
                                     f"(dp_size {info.dp_size})")
        return dp

    def _pairs(self, info: ParallelInfo, room: int, dp_rank: int | None) -> list[tuple[tuple[int, int], bool]]:
        """The (dp rank, tp rank) of every prefill rank of ``room`` this rank talks to, and whether it owes
        this rank bytes (sources first); raises ``LocalProtocolError`` if the deployments cannot pair."""
        cfg = self._config
        dp = self._group(info, room, dp_rank)
        kv = info.layout.get("kv")
        theirs = None if kv is None else KvLayout.from_json(kv)
        if theirs != cfg.kv_layout:
            raise LocalProtocolError(f"KV layout: prefill's {theirs} differs from decode's {cfg.kv_layout}")
        route = routing(cfg.kv_layout, info.tp_size(dp), cfg.tp_size)
        if cfg.kv_layout is None and list(info.layout.get("page_bytes", [])) != list(self._layout.page_bytes):
            raise LocalProtocolError(f"page sizes: prefill's {info.layout.get('page_bytes')} differ from decode's "
                                     f"{list(self._layout.page_bytes)}")
        d = cfg.tp_rank
        return [((dp, p), True) for p in route.sources(d)] + [((dp, p), False) for p in route.notified(d)]

    def _lookup_keys(self, info: ParallelInfo, room: int, dp_rank: int | None) -> list[tuple[int, int]]:
        """The prefill ranks to look up for ``room``: those it pairs with, or, when the deployments cannot
        pair, every rank of its DP group (to tell them why); raises if the group itself does not exist."""
        try:
            return [key for key, _ in self._pairs(info, room, dp_rank)]
        except LocalProtocolError:
            dp = self._group(info, room, dp_rank)
            return [(dp, p) for p in range(info.tp_size(dp))]

    def _cannot_pair(self, deployment: Deployment, request: _Request, why: str) -> None:
        """Worker: the request cannot pair with its prefill deployment. The prefill ranks of its DP group
        hold the room too: they are told why (an ``Abort`` naming it), so they fail it now instead of at
        their bootstrap timeout; their ranks are looked up first if the cache lacks them."""
        info = deployment.known()
        keys: list[tuple[int, int]] = []
        if info is not None:
            try:
                keys = self._lookup_keys(info, request.room, request.dp_rank)
            except PdError:
                keys = []  # no such group: nobody there holds the room
        missing = [key for key in keys if key not in deployment.ranks]
        if missing and not request.mismatch:
            request.mismatch = why  # once: a second pass tells whom the look-up found
            self._lookups.wait(request.server, request)
            return
        for key in keys:
            rank = deployment.ranks.get(key)
            if rank is None:
                continue
            try:
                self._channel.send(rank[0], wire.Abort(room=request.room, reason=f"decode cannot pair: {why}"[: wire.MAX_REASON]))
            except PdError as e:
                log.debug("decode peer: cannot tell %s that room %d cannot pair: %s", rank[0], request.room, e)
        request.abort_sent = True  # told already: the settle owes no second abort
        self._fire(request.rid, Trigger.FAIL, request.mismatch or why)

    def _links_of(self, deployment: Deployment, request: _Request) -> tuple[_Link, ...] | None:
        """The room's prefill ranks as far as the cache knows (None: look them up); raises if it cannot pair."""
        info = deployment.known()
        if info is None:
            return None
        links = []
        for key, owes in self._pairs(info, request.room, request.dp_rank):
            rank = deployment.ranks.get(key)
            if rank is None:
                return None
            links.append(_Link(rank[0], owes, rank[2]))
        return tuple(links)

    def _verdict(self, link: _Link) -> str | None:
        """Why the prefill rank of ``link`` is known dead, or None (never found dead, registered again with
        a newer epoch, or heard from again since: a paused process that resumed)."""
        why = self._lookups.verdict(link.endpoint, link.epoch)
        if why is not None:
            epoch = self._channel.introduced(link.endpoint)[1]
            if epoch is not None and epoch >= link.epoch:
                self._lookups.pardon(link.endpoint)
                return None
        return why

    def _looked_up(self, request: _Request, why: str | None) -> None:
        """Worker: the lookup a request waited for ended."""
        if why is not None:
            self._fire(request.rid, Trigger.FAIL, request.mismatch or why)
        else:
            self._bootstrap(request)

    # -- announcing ------------------------------------------------------------------------

    def _announce(self, rid: str, page_ids: tuple[int, ...], request_pool_index: int) -> None:
        """On the caller's thread: a table update and a queued frame, nothing that waits."""
        request = self._requests.get(rid)
        if request is None:
            return
        if not request.links:
            self._fire(rid, Trigger.FAIL, "pages announced before the request was bootstrapped")
            return
        if self._fire(rid, Trigger.PAGES_ANNOUNCED) in (None, State.FAILED):
            return  # failed meanwhile: announce nothing
        request.request_pool_index = request_pool_index
        try:
            if not self._config.unsafe_no_grants:
                ranges = page_ranges(self._layout, page_ids)
                for link in request.links:
                    if link.owes:
                        link.grant = self._transport.grant(self._lookups.instance(link.endpoint), ranges)
        except (KeyError, ValueError, PdError) as e:
            self._fire(rid, Trigger.FAIL, f"cannot grant the pages to the prefill rank: {e}")
            self._revoke(request)  # the grants made before this one
            return
        if self._fire(rid, Trigger.PAGES_ANNOUNCED) in (None, State.FAILED):
            # the worker failed the room meanwhile (its revoke may have run before the grants existed)
            self._revoke(request)
            return
        try:
            for link in request.links:
                self._channel.send(
                    link.endpoint,
                    wire.Announce(
                        room=request.room,
                        session_id=self.session_id,
                        epoch=self.epoch,
                        page_ids=page_ids if link.owes else (),  # a rank that owes nothing only hears of the room
                        request_pool_index=request_pool_index,
                        grant=link.grant.key if link.grant is not None else 0,
                    ),
                )
        except PdError as e:
            self._fire(rid, Trigger.FAIL, f"announcing the pages failed: {e}")

    # -- worker: messages from prefill ranks ------------------------------------------------------

    def _on_message(self, sender: str, msg: wire.Message) -> None:
        if isinstance(msg, (wire.Status, wire.Abort, wire.AbortAck)):
            request = self._by_source.get((sender, msg.room))
            if request is None:
                log.debug("decode peer: %s for unknown room %d from %s", type(msg).__name__, msg.room, sender)
                return
            if isinstance(msg, wire.AbortAck):
                return  # the prefill rank stopped; the fence is this rank's revoke, not its word
            if isinstance(msg, wire.Status) and msg.register_again:
                self._registered.discard(sender)  # the next request registers again
            if isinstance(msg, wire.Abort) or msg.state == State.FAILED:
                self._fire(request.rid, Trigger.FAIL, f"prefill failed the room: {msg.reason}")
            elif msg.state == State.SUCCESS:
                link = next((l for l in request.links if l.endpoint == sender), None)
                if link is None or not link.owes:
                    return  # only a rank that writes here reports a landing
                if msg.first_token is None:
                    self._fire(request.rid, Trigger.FAIL, "prefill reported a landing without a first token")
                    return
                link.landed = msg
                if all(l.landed is not None for l in request.links if l.owes):  # every source's bytes landed
                    self._fire(request.rid, Trigger.WRITES_LANDED)
        else:
            log.warning("decode peer: unexpected %s from %s", type(msg).__name__, sender)

    def _close_fence(self, rid: str) -> None:
        request = self._requests.get(rid)
        if request is None:
            return
        if request.links and not request.abort_sent:
            request.abort_sent = True
            for link in request.links:
                try:
                    self._channel.send(link.endpoint, wire.Abort(room=request.room, reason="failed on the decode replica"))
                except PdError as e:
                    log.warning("decode peer: cannot ask %s to stop room %d: %s", link.endpoint, request.room, e)
        self._revoke(request)

    def _revoke(self, request: _Request) -> None:
        """Take the room's grants back, then close its fence: from here nothing lands in its pages."""
        for link in request.links:
            if link.grant is None:
                continue
            try:
                self._transport.revoke(link.grant, deadline=Deadline.after(_REVOKE_WAIT))
            except PdError as e:  # not confirmed: the fence stays armed, the next tick tries again
                log.warning("decode peer: revoking room %d's grant failed: %s", request.room, e)
                if request not in self._unrevoked:
                    self._unrevoked.append(request)
                return
            link.grant = None
        self._fenced(request.rid)

    def _abort_unannounced(self, request: _Request) -> None:
        """A room that failed here before its pages were announced armed no fence, so no ``Abort``
        went to its prefill rank: tell it (best effort), or its room waits there for its bootstrap
        timer. Prefill answers with an ``AbortAck`` for a room this rank no longer tracks (ignored)."""
        for link in request.links:
            if link.endpoint not in self._registered:  # lost, or never sent our Register
                continue
            try:
                self._channel.send(
                    link.endpoint, wire.Abort(room=request.room, reason="failed on the decode replica before announcing")
                )
            except PdError as e:
                log.debug("decode peer: cannot tell %s that room %d failed: %s", link.endpoint, request.room, e)

    # -- failures from outside -------------------------------------------------------------------

    def _peer_lost(self, dead: DeadPeer) -> None:
        self._lose_source(dead.endpoint, f"prefill peer lost: {dead.reason}", dead.epoch)

    def _lose_source(self, endpoint: str, reason: str, epoch: int | None = None) -> None:
        """The prefill rank is gone: its rooms fail, and with it gone nothing more lands (the fence).

        A room that already landed here (SUCCESS: every source's writes and status arrived) owes
        that rank nothing more: it stays landed and settles as such, however late the scheduler's
        next round comes (a prefill replica may finish its requests and exit before then)."""
        self._registered.discard(endpoint)
        self._lookups.dead(endpoint, epoch, reason)
        with self._lock:
            bound = [r for r in self._requests.values() if any(l.endpoint == endpoint for l in r.links)]
        for request in bound:
            if self._landed_here(request.rid):
                continue
            request.abort_sent = True  # nobody to tell
            self._fire(request.rid, Trigger.FAIL, reason)
            self._revoke(request)

    def _landed_here(self, rid: str) -> bool:
        try:
            return self._table.state(rid) == State.SUCCESS
        except PdError:  # settled meanwhile
            return False

    def _rooms_failed(self, rooms: tuple[int, ...], reason: str) -> None:
        wanted = set(rooms)
        for request in list(self._requests.values()):
            if request.room in wanted:
                self._fire(request.rid, Trigger.FAIL, reason)

    def _tick(self, now: float) -> None:
        super()._tick(now)
        self._lookups.tick(lambda request: self._requests.get(request.rid) is request)
        retry, self._unrevoked = self._unrevoked, []
        for request in retry:
            if self._requests.get(request.rid) is request:
                self._revoke(request)
        self._release_landed()

    def _release_landed(self) -> None:
        """Worker: revoke the grants of rooms that landed (every byte is there: nothing waits on them).
        One that fails is tried again next tick; past ``4 * max_pending`` of those the oldest are given up."""
        with self._lock:
            grants, self._landed_grants = self._landed_grants, []
        failed = []
        for grant in grants:
            try:
                self._transport.revoke(grant, deadline=Deadline.after(_REVOKE_WAIT), settled=True)
            except PdError as e:
                if not failed:
                    log.warning("decode peer: revoking a landed room's grant failed (tried again): %s", e)
                failed.append(grant)
        if failed:
            with self._lock:
                self._landed_grants[:0] = failed
                del self._landed_grants[: max(0, len(self._landed_grants) - 4 * self._config.max_pending)]

    def _farewell(self) -> None:
        for request in list(self._requests.values()):
            for link in request.links:
                try:
                    self._channel.send(link.endpoint, wire.Abort(room=request.room, reason="decode peer closed"))
                except PdError:
                    pass

    # -- the round -----------------------------------------------------------------------------

    def _settle(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        released = False
        for event in events:
            if isinstance(event, (Succeeded, Failed)):
                with self._lock:
                    request = self._requests.pop(event.rid)
                    for link in request.links:
                        self._by_source.pop((link.endpoint, request.room), None)
                if isinstance(event, Failed) and request.links and not request.abort_sent:
                    self._abort_unannounced(request)
                if isinstance(event, Succeeded):
                    # every byte landed: the grant only goes, on the worker (a transport call may wait on the
                    # network or raise, and the scheduler thread does neither)
                    grants = [link.grant for link in request.links if link.grant is not None]
                    if grants:
                        with self._lock:
                            self._landed_grants += grants
                        released = True
                    landed = next(l.landed for l in request.links if l.owes)
                    assert landed is not None and landed.first_token is not None  # checked when it arrived
                    event = RemotePrefillDone(
                        RemotePrefill(
                            rid=event.rid,
                            bootstrap_token=landed.first_token,
                            cached_tokens=landed.cached_tokens,
                            bootstrap_logprob=landed.first_token_logprob,
                            spec_candidate_ids=landed.spec_candidate_ids,
                            request_pool_index=request.request_pool_index,
                        )
                    )
            out.append(event)
        if released:
            try:
                self._submit(self._release_landed)
            except PdError:  # full or closing: the worker's next tick takes them
                pass
        return out


class DecodeInbox:
    """The decode scheduler's side: announce an admitted request's destination pages (``announce``)."""

    def __init__(self, peer: DecodePeer) -> None:
        self._peer = peer

    def announce(self, rid: str, page_ids: Any, request_pool_index: int) -> None:
        """Ask ``rid``'s prefill rank to write its KV into ``page_ids`` (prompt order). Never blocks.

        Call it after ``rid``'s ``Bootstrapped`` event; earlier, a request whose prefill ranks
        are not known yet fails.
        Announce as many pages as prefill hands over, or fewer when this rank holds
        a prefix of the prompt already: prefill then writes its last ``len(page_ids)``
        pages into them; more than prefill hands over fails the room. The pages belong
        to the transfer (the prefill rank's transport is granted exactly them) until
        the request's ``RemotePrefillDone`` or ``Failed`` event.

        ``request_pool_index`` (0..2**31-1) is the scheduler's own number for the
        request, returned unchanged in ``RemotePrefill.request_pool_index``. Bad page
        ids or index raise ``LocalProtocolError`` and change nothing; an unknown rid
        raises, one that ended within ``tombstone_ttl`` does nothing
        (``PrefillOutbox`` explains why); ``PeerError`` after ``close``.
        """
        pages = tuple(map(int, page_ids.tolist() if isinstance(page_ids, np.ndarray) else page_ids))
        num_pages = self._peer._config.num_pages
        if pages and (min(pages) < 0 or max(pages) >= num_pages):
            raise LocalProtocolError(f"announce({rid!r}): page ids must be in 0..{num_pages - 1}")
        index = wire_int(f"announce({rid!r})", "request_pool_index", request_pool_index, wire.MAX_COUNT)
        if self._peer._accepts(rid, "announce"):
            self._peer._announce(rid, pages, index)
