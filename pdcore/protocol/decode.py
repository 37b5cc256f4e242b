"""The decode role's protocol, sans-IO: look-ups, announcements and grants, landings, fences.

Per request, on this rank: the scheduler registers it (BOOTSTRAPPING); the
engine finds the request's prefill ranks through its bootstrap server (a
``LookUp``, once per deployment, cached; a rank found dead fails the requests
that need it at once), sends each ``Register`` once per session, and the
request is connected (BOOTSTRAPPED). The scheduler announces the pages it
allocated (``announce``): each prefill rank that writes here is *granted*
exactly those pages in the data plane (WAITING_FOR_INPUT, the fence armed), and
the grant's key travels in ``Announce``. Every source's ``Status`` with the
first token lands it (SUCCESS); the landing's value goes to the scheduler's side
(``services.deliver("landed", rid, RemotePrefill)``) before the table can agree on it.

Fence before free, enforced here: a failed request whose pages were announced
is reported ``Failed`` only after this rank revoked every grant of it in the
data plane (``Revoke``, answered by ``revoked``): from then on nothing the
prefill rank sends lands there, whether it is healthy, paused, partitioned or
gone. ``Abort`` still tells the prefill rank to stop, but its answer is not
awaited. A landed request's grants only go (no write is owed through them).

A request that cannot pair with its prefill deployment (layout, page sizes, tp
without a layout) is told to the prefill ranks of its DP group too (``Abort``
naming the mismatch), so they fail it at once instead of at their bootstrap
timeout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transport.plan import Layout

from ..control import wire
from ..core._spec import State, Trigger
from ..core.errors import LocalProtocolError, PdError
from ..core.events import RemotePrefill
from ..kv.layout import KvLayout
from ..kv.routing import routing
from .actions import Grant, Land, Revoke
from .engine import DecodeSettings, DrivenTable, Engine, Services, ends, read_note
from .lookups import Deployment, Lookups
from .revokes import REVOKE_WAIT, LandedGrants, RetryRevokes

if TYPE_CHECKING:  # a value the look-ups carry: its module is the bootstrap's I/O, never imported here
    from ..control.bootstrap import ParallelInfo

__all__ = ["DecodeEngine", "page_ranges", "layout_json"]

log = logging.getLogger("pdcore.decode")



def page_ranges(layout: Any, page_ids: Any) -> list[tuple[int, int]]:
    """The ``(addr, length)`` ranges of ``page_ids`` in every buffer of ``layout``, runs of adjacent
    pages merged, sorted by address. Plain Python: for the few runs of one request it is several
    times cheaper than numpy's per-call cost."""
    runs: list[list[int]] = []
    for p in sorted(set(page_ids)):
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [(base + s * size, n * size) for base, size in sorted(zip(layout.bases, layout.page_bytes)) for s, n in runs]


def layout_json(layout: Any, kv: Any = None) -> dict[str, Any]:
    """What a peer needs to plan writes into our cache: its pages, and what they hold (``KvLayout``) if known."""
    out = {"bases": list(layout.bases), "page_bytes": list(layout.page_bytes), "num_pages": layout.num_pages}
    if kv is not None:
        out["kv"] = kv.to_json()
    return out


@dataclass(eq=False)
class _Link:
    """A prefill rank a request talks to: one that writes to this rank (``owes``), or one told only of the room."""

    endpoint: str
    owes: bool
    epoch: int = 0  # the incarnation its deployment's server listed
    instance: bytes = b""  # its transport instance, as looked up with it: what its pages are granted to
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
    page_ids: tuple[int, ...] = ()
    granting: int = 0  # grants asked for and not answered yet: the fence waits for their answers
    grant_error: str = ""  # why a grant was refused (the request failed; the others are revoked once answered)
    announced: bool = False  # its pages were announced to its prefill ranks (only then may they land)
    scattering: bool = False  # its landed bytes are being copied from host staging into device memory (``Land``)
    abort_sent: bool = False
    mismatch: str = ""  # the deployments cannot pair: failing once its prefill ranks are told why
    rechecked: bool = False  # a verdict against one of its prefill ranks was checked with a fresh look-up
    live: bool = True
    untold: bool = False  # ended here before its prefill ranks were known: told once a look-up finds them
    untold_lookups: int = 0  # look-ups waited for to tell them (bounded: the shape, then the ranks)


class DecodeEngine(Engine[DecodeSettings, DrivenTable]):
    """One decode rank's PD protocol (``pdcore.pd.decode.DecodePeer`` drives it)."""

    ROLE = "decode"

    def __init__(self, services: Services[DecodeSettings, DrivenTable]) -> None:
        super().__init__(services)
        self._layout: Layout = services.layout  # type: ignore[assignment]  # a decode peer always has one
        self._requests: dict[str, _Request] = {}
        self._by_source: dict[tuple[str, int], _Request] = {}
        self._by_grant: dict[int, tuple[_Request, _Link]] = {}  # live grant key -> its request and source
        self._lookups = Lookups(
            self._lookup_keys, lambda request: (request.room, request.dp_rank), self._looked_up, self._out.append,
        )
        self._registered: set[str] = set()  # prefill endpoints that have our Register
        # (id(info), dp group) -> (info, its pairs): a deployment's pairing, checked once per looked-up shape
        self._pair_memo: dict[tuple[int, int], tuple[Any, tuple[tuple[tuple[int, int], bool], ...]]] = {}
        self._unrevoked: RetryRevokes[_Request] = RetryRevokes()  # fences whose revoke was not confirmed
        # grants of landed requests a revoke failed for; while too many are, announcements wait there, in order
        self._landed_grants: LandedGrants[_Request] = LandedGrants(4 * self._config.max_pending)

    def held(self) -> dict[str, int]:
        return {"requests": len(self._requests), "sources": len(self._by_source),
                "grants": sum(1 for r in list(self._requests.values()) for link in r.links if link.grant is not None),
                "unrevoked": len(self._unrevoked),
                "landed_grants": len(self._landed_grants), "waiting_announcements": self._landed_grants.waiting(),
                "lookups": self._lookups.waiting()}

    def next_deadline(self) -> float:
        return min(self._unrevoked.next_deadline(), self._landed_grants.next_deadline(),
                   self._lookups.next_deadline())

    # -- the scheduler's calls ------------------------------------------------------------

    def register(self, rid: str, room: int, server: tuple[str, int], dp_rank: int | None, now: float) -> None:
        request = _Request(rid, room, server, dp_rank)
        self._requests[rid] = request
        self._bootstrap(request, now)

    def abort_room(self, rid: str, room: int, now: float) -> None:
        self._fire(rid, Trigger.ABORT, now, f"aborted by the decode scheduler (room {room})")

    def announce(self, rid: str, page_ids: tuple[int, ...], request_pool_index: int, now: float) -> None:
        """The scheduler allocated ``page_ids`` for ``rid``: grant them to its sources, then announce them."""
        request = self._requests.get(rid)
        if request is None:
            return
        if not request.links:
            self._fire(rid, Trigger.FAIL, now, "pages announced before the request was bootstrapped")
            return
        if self._fire(rid, Trigger.PAGES_ANNOUNCED, now) in (None, State.FAILED):
            return  # failed meanwhile: announce nothing
        request.request_pool_index, request.page_ids = request_pool_index, page_ids
        self._grant(request, now)

    def _grant(self, request: _Request, now: float) -> None:
        """Grant the announced pages to the sources that owe them, then announce; or wait, while the data plane
        keeps refusing the revokes of landed rooms' grants (``LandedGrants``)."""
        owed = [link for link in request.links if link.owes]
        if self._config.unsafe_no_grants or not owed:
            self._send_announce(request, now)
            return
        if self._landed_grants.full():
            self._landed_grants.wait(request)
            return
        ranges = page_ranges(self._layout, request.page_ids)
        request.granting = len(owed)
        for link in owed:
            self._out.append(Grant((request, link), link.instance, ranges))

    def granted(self, token: tuple[_Request, _Link], grant: Any, error: str | None, now: float) -> None:
        """The answer to a ``Grant`` of one source's pages; once every source's is in, the announcement goes, or,
        if one was refused or the request failed meanwhile, every grant made is revoked before the fence closes
        (a grant answered after the fence closed would outlive it: the fence waits for the last answer)."""
        request, link = token
        request.granting -= 1
        if grant is not None:
            link.grant = grant
            self._by_grant[grant.key] = (request, link)
        if error is not None and not request.grant_error:
            request.grant_error = error
            self._fire(request.rid, Trigger.FAIL, now, f"cannot grant the pages to the prefill rank: {error}")
        if request.granting > 0:
            return
        if request.grant_error or self._state(request.rid) in (None, State.FAILED):
            self._revoke(request, now)
            return
        self._send_announce(request, now)

    def _send_announce(self, request: _Request, now: float) -> None:
        request.announced = True
        for link in request.links:
            self._tell(link.endpoint, wire.Announce(
                room=request.room,
                session_id=self.services.session_id,
                epoch=self.services.epoch,
                page_ids=request.page_ids if link.owes else (),  # a rank that owes nothing only hears of the room
                request_pool_index=request.request_pool_index,
                grant=link.grant.key if link.grant is not None else 0,
            ), token=request)

    def unsent(self, token: Any, why: str, now: float) -> None:
        if isinstance(token, _Request):
            self._fire(token.rid, Trigger.FAIL, now, f"announcing the pages failed: {why}")

    def fence(self, rids: list[str], now: float) -> None:
        """The replica agreed these requests are failing: ask their prefill ranks to stop, revoke, fence."""
        for rid in rids:
            request = self._requests.get(rid)
            if request is None:
                continue
            if request.links and not request.abort_sent:
                request.abort_sent = True
                for link in request.links:
                    self._tell(link.endpoint, wire.Abort(room=request.room, reason="failed on the decode replica"))
            self._revoke(request, now)

    def settled(self, events: list[Any], now: float) -> None:
        """A scheduler's round with these events ended requests."""
        for rid, failed, _reason in ends(events):
            request = self._requests.pop(rid, None)
            if request is None:
                continue
            request.live = False
            for link in request.links:
                self._by_source.pop((link.endpoint, request.room), None)
            if failed and not request.abort_sent:
                if request.links:
                    self._abort_unannounced(request)
                else:
                    self._abort_unbootstrapped(request, now)
            if not failed:  # every byte landed: the grants only go
                for link in request.links:
                    if link.grant is not None:
                        self._out.append(Revoke(("landed", link.grant), link.grant, True, REVOKE_WAIT))
                        self._ungrant(link)
        self._landed_grants.keep_waiting(lambda request: request.live)

    def close(self, now: float) -> None:
        for request in self._requests.values():
            for link in request.links:
                self._tell(link.endpoint, wire.Abort(room=request.room, reason="decode peer closed"))

    # -- bootstrap ------------------------------------------------------------------------

    def _bootstrap(self, request: _Request, now: float) -> None:
        if not request.live:
            return
        deployment = self._lookups.get(request.server)
        try:
            links = self._links_of(deployment, request)
        except PdError as e:
            self._cannot_pair(deployment, request, f"bootstrap {request.server[0]}:{request.server[1]}: {e}", now)
            return
        if links is None:  # not looked up (or not up) yet: the table's bootstrap timeout bounds the wait
            self._lookups.wait(request.server, request, now)
            return
        for link in links:
            verdict = self._lookups.verdict(link.endpoint, link.epoch)
            if verdict and not request.rechecked:  # the server may list it anew (restarted): look once more
                request.rechecked = True
                self._lookups.forget(link.endpoint)
                self._lookups.wait(request.server, request, now)
                return
            if verdict:  # it died and has not come back: fail now, not after another dead_after
                self._fire(request.rid, Trigger.FAIL, now, f"prefill rank {verdict}")
                return
        cfg = self._config
        for source in [link.endpoint for link in links if link.endpoint not in self._registered]:
            self._tell(source, wire.Register(
                session_id=self.services.session_id,
                epoch=self.services.epoch,
                endpoint=self.services.endpoint,
                regions=self.services.regions,
                layout=layout_json(self._layout, cfg.kv_layout),
                tp_size=cfg.tp_size,
                tp_rank=cfg.tp_rank,
            ))
            self._registered.add(source)
        request.links = links
        for link in links:
            self._by_source[(link.endpoint, request.room)] = request
        self._fire(request.rid, Trigger.PEERS_CONNECTED, now)

    def _group(self, info: ParallelInfo, room: int, dp_rank: int | None) -> int:
        """The prefill DP group of ``room``; ``LocalProtocolError`` if the router named one that does not exist."""
        dp = room % info.dp_size if dp_rank is None else dp_rank
        if dp >= info.dp_size or dp >= len(info.tp_sizes):
            raise LocalProtocolError(f"BootstrapInfo.dp_rank {dp} is not a DP group of the prefill deployment "
                                     f"(dp_size {info.dp_size})")
        return dp

    def _pairs(self, info: ParallelInfo, room: int, dp_rank: int | None) -> tuple[tuple[tuple[int, int], bool], ...]:
        """The (dp rank, tp rank) of every prefill rank of ``room`` this rank talks to, and whether it owes
        this rank bytes (sources first); raises ``LocalProtocolError`` if the deployments cannot pair.
        Remembered per looked-up ``info`` and DP group (a request costs a dict look-up; a refusal is not
        remembered, and a new look-up is a new ``info``)."""
        dp = self._group(info, room, dp_rank)
        memo = self._pair_memo.get((id(info), dp))
        if memo is not None and memo[0] is info:
            return memo[1]
        try:
            pairs = self._pairing(info, dp)
        except PdError:
            raise
        except Exception as e:  # what the server listed is not what a prefill rank registers
            raise LocalProtocolError(f"the prefill deployment's shape is malformed: {e!r}") from e
        if len(self._pair_memo) >= 64:  # bounded: deployments x DP groups seen lately
            self._pair_memo.clear()
        self._pair_memo[(id(info), dp)] = (info, pairs)
        return pairs

    def _pairing(self, info: ParallelInfo, dp: int) -> tuple[tuple[tuple[int, int], bool], ...]:
        cfg = self._config
        kv = info.layout.get("kv")
        theirs = None if kv is None else KvLayout.from_json(kv)
        if theirs != cfg.kv_layout:
            raise LocalProtocolError(f"KV layout: prefill's {theirs} differs from decode's {cfg.kv_layout}")
        route = routing(cfg.kv_layout, info.tp_size(dp), cfg.tp_size)
        if cfg.kv_layout is None and list(info.layout.get("page_bytes", [])) != list(self._layout.page_bytes):
            raise LocalProtocolError(f"page sizes: prefill's {info.layout.get('page_bytes')} differ from decode's "
                                     f"{list(self._layout.page_bytes)}")
        d = cfg.tp_rank
        return tuple([((dp, p), True) for p in route.sources(d)] + [((dp, p), False) for p in route.notified(d)])

    def _lookup_keys(self, info: ParallelInfo, need: tuple[int, int | None]) -> list[tuple[int, int]]:
        """The prefill ranks to look up for ``need`` (a room, and the DP group a router named): those it pairs
        with, or, when the deployments cannot pair, every rank of its DP group (to tell them why); raises if
        the group itself does not exist."""
        room, dp_rank = need
        try:
            return [key for key, _ in self._pairs(info, room, dp_rank)]
        except LocalProtocolError:
            dp = self._group(info, room, dp_rank)
            return [(dp, p) for p in range(info.tp_size(dp))]

    def _room_ranks(self, deployment: Deployment, request: _Request) -> tuple[list[str], bool]:
        """The control endpoints of the prefill ranks that hold the request's room (those it pairs with, or
        every rank of its DP group when the deployments cannot pair), as far as the cache knows, and
        whether it knows them all (no such group: nobody, all known)."""
        info = deployment.known()
        if info is None:
            return [], False
        try:
            keys = self._lookup_keys(info, (request.room, request.dp_rank))
        except PdError:
            return [], True
        ranks = [deployment.ranks.get(key) for key in keys]
        return [rank[0] for rank in ranks if rank is not None], None not in ranks

    def _cannot_pair(self, deployment: Deployment, request: _Request, why: str, now: float) -> None:
        """The request cannot pair with its prefill deployment. The prefill ranks of its DP group hold the
        room too: they are told why (an ``Abort`` naming it), so they fail it now instead of at their
        bootstrap timeout; their ranks are looked up first if the cache lacks them."""
        endpoints, known = self._room_ranks(deployment, request)
        if not known and not request.mismatch:
            request.mismatch = why  # once: a second pass tells whom the look-up found
            self._lookups.wait(request.server, request, now)
            return
        for endpoint in endpoints:
            self._tell(endpoint, wire.Abort(room=request.room, reason=f"decode cannot pair: {why}"[: wire.MAX_REASON]))
        request.abort_sent = True  # told already: the settle owes no second abort
        self._lookups.refresh(request.server)  # the deployment may register anew: the next request looks again
        self._fire(request.rid, Trigger.FAIL, now, request.mismatch or why)

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
            links.append(_Link(rank[0], owes, rank[2], rank[1]))
        return tuple(links)

    def _looked_up(self, request: _Request, why: str | None, now: float) -> None:
        if not request.live:  # ended meanwhile: its prefill ranks may still be owed word of it
            if request.untold and why is None:
                self._abort_unbootstrapped(request, now)
            return
        if why is not None:
            self._fire(request.rid, Trigger.FAIL, now, request.mismatch or why)
        else:
            self._bootstrap(request, now)

    def looked_up(self, server: tuple[str, int], info: Any, ranks: dict[Any, Any], error: str | None, now: float) -> None:
        """The driver's answer to a ``LookUp``."""
        self._lookups.looked_up(server, info, ranks, error, now)

    # -- prefill ranks' frames -----------------------------------------------------------------

    def message(self, sender: str, msg: wire.Message, now: float) -> None:
        kind = type(msg)
        if kind is not wire.Status and kind is not wire.Abort and kind is not wire.AbortAck:
            log.warning("decode peer: unexpected %s from %s", kind.__name__, sender)
            return
        request = self._by_source.get((sender, msg.room))  # type: ignore[union-attr]
        if request is None:
            log.debug("decode peer: %s for unknown room %d from %s", kind.__name__, msg.room, sender)  # type: ignore[union-attr]
            return
        if kind is wire.AbortAck:
            return  # the prefill rank stopped; the fence is this rank's revoke, not its word
        if kind is wire.Status and msg.register_again:  # type: ignore[union-attr]
            self._registered.discard(sender)  # the next request registers again
        if kind is wire.Abort or msg.state == State.FAILED:  # type: ignore[union-attr]
            if self._state(request.rid) == State.SUCCESS:
                return  # landed already (every source's bytes and status are here): prefill's late word changes nothing
            self._fire(request.rid, Trigger.FAIL, now, f"prefill failed the room: {msg.reason}")  # type: ignore[union-attr]
        elif msg.state == State.SUCCESS:  # type: ignore[union-attr]
            link = next((l for l in request.links if l.endpoint == sender), None)
            if link is None or not link.owes or not request.announced:
                return  # only a rank that writes here reports a landing, and only of pages announced to it
            if link.landed is not None:  # a rank reports its landing once: a repeat (a duplicated frame) would
                return  # land the room again, copying into device memory pages the scheduler may have reused
            if msg.first_token is None:  # type: ignore[union-attr]
                self._fire(request.rid, Trigger.FAIL, now, "prefill reported a landing without a first token")
                return
            link.landed = msg  # type: ignore[assignment]
            if self._state(request.rid) in (None, State.FAILED):
                return  # failed here meanwhile (a lost source, an abort): a late landing changes nothing
            if request.scattering or not all(l.landed is not None for l in request.links if l.owes):
                return  # a source's bytes are still on their way, or they all landed and are being copied
            if self.services.staged:  # the bytes landed in host staging: the room lands once they are on the device
                request.scattering = True
                self._out.append(Land(request, page_ranges(self._layout, request.page_ids)))
                return
            self._landed(request, now)

    def noted(self, grant: int, note: bytes, now: float) -> None:
        """A note that rode a batch through ``grant`` (the transport's ``on_note``): every byte of that batch,
        and of the batches through it before, landed. It is the source's success ``Status``, as on the control
        plane (failures travel there only), and as authentic as the bytes: the grant is given to that source's
        transport alone. A note that is not its room's success fails the room (bad input of that source),
        nothing else."""
        found = self._by_grant.get(grant)
        if found is None:
            return  # revoked meanwhile: its request ended, nothing waits for the note
        request, link = found
        msg, why = read_note(note, wire.Status, request.room, lambda status: status.state == State.SUCCESS)
        if why:
            self._bad_input()
            self._fire(request.rid, Trigger.FAIL, now, f"prefill rank {link.endpoint} sent a bad note: {why}"[: wire.MAX_REASON])
            return
        self.message(link.endpoint, msg, now)

    def scattered(self, request: _Request, error: str | None, now: float) -> None:
        """The answer to a ``Land``: the room's pages are in device memory (or could not be copied there).
        A fence asked for meanwhile waited for this answer (``_revoke``): it goes on now."""
        request.scattering = False
        if error is not None:
            self._fire(request.rid, Trigger.FAIL, now, f"copying the landed pages into device memory failed: {error}")
        elif request.live and self._state(request.rid) not in (None, State.FAILED):
            self._landed(request, now)
            return
        if self._state(request.rid) in (None, State.FAILED):
            self._revoke(request, now)

    def _landed(self, request: _Request, now: float) -> None:
        """Every source's bytes are where the scheduler reads them: the landing goes to its side, then to the table."""
        first = next(l.landed for l in request.links if l.owes)
        assert first is not None and first.first_token is not None
        self.services.deliver("landed", request.rid, RemotePrefill(
            rid=request.rid,
            bootstrap_token=first.first_token,
            cached_tokens=first.cached_tokens,
            bootstrap_logprob=first.first_token_logprob,
            spec_candidate_ids=first.spec_candidate_ids,
            request_pool_index=request.request_pool_index,
        ))
        self._fire(request.rid, Trigger.WRITES_LANDED, now)

    # -- fences ---------------------------------------------------------------------------

    def _revoke(self, request: _Request, now: float) -> None:
        """Take the room's grants back, one at a time, then close its fence: from there nothing lands in its pages.
        While grants are still being answered the fence waits: the last answer revokes them (``granted``);
        so does it while landed bytes are being copied into device memory (``scattered``)."""
        if request.granting > 0 or request.scattering:
            return
        link = next((l for l in request.links if l.grant is not None), None)
        if link is None:
            self._fenced(request.rid)
            return
        self._out.append(Revoke((request, link), link.grant, False, REVOKE_WAIT))

    def revoked(self, token: Any, error: str | None, now: float) -> None:
        """The answer to a ``Revoke``: not confirmed, the fence stays armed and the next tick tries again."""
        if token[0] == "landed":
            if error is not None:
                if not self._landed_grants:
                    log.warning("decode peer: revoking a landed room's grant failed (tried again): %s", error)
                self._landed_grants.failed(token[1], now)
                return
            # announcements that waited; one that ended meanwhile had nothing granted for its fence to take back
            for request in self._landed_grants.confirmed(token[1]):
                if request.live and self._requests.get(request.rid) is request and self._state(request.rid) not in (
                        None, State.FAILED):
                    self._grant(request, now)
            return
        request, link = token
        if error is not None:
            log.warning("decode peer: revoking room %d's grant failed: %s", request.room, error)
            self._unrevoked.add(request, now)
            return
        if link.grant is not None:
            self._ungrant(link)
            self._revoke(request, now)

    def _ungrant(self, link: _Link) -> None:
        """``link``'s grant is revoked (or on its way): a note through it is nobody's now."""
        self._by_grant.pop(link.grant.key, None)
        link.grant = None

    def _abort_unannounced(self, request: _Request) -> None:
        """A room that failed here before its pages were announced armed no fence, so no ``Abort``
        went to its prefill rank: tell it (best effort), or its room waits there for its bootstrap
        timer. Prefill answers with an ``AbortAck`` for a room this rank no longer tracks (ignored)."""
        for link in request.links:
            if link.endpoint in self._registered:  # lost, or never sent our Register: nobody to tell
                self._tell(link.endpoint, wire.Abort(room=request.room, reason="failed on the decode replica before announcing"))

    def _abort_unbootstrapped(self, request: _Request, now: float) -> None:
        """A request that ended here before its prefill ranks were known (the scheduler aborted it, say,
        while its look-up was on the way): the prefill ranks of its room hold it too and would wait for
        their bootstrap timeout. Tell them (an ``Abort``, which they take without a ``Register``) once
        the deployment's ranks are known: now if cached, else after the look-ups of its shape and ranks;
        whom they do not find is not told (best effort, bounded by two look-ups)."""
        deployment = self._lookups.get(request.server)
        endpoints, known = self._room_ranks(deployment, request)
        if not known and request.untold_lookups < 2:
            request.untold = True
            request.untold_lookups += 1
            if request not in deployment.waiting:
                self._lookups.wait(request.server, request, now)
            return
        request.abort_sent, request.untold = True, False
        for endpoint in endpoints:
            self._tell(endpoint, wire.Abort(room=request.room, reason="failed on the decode replica before it was bootstrapped"))

    # -- failures from outside -------------------------------------------------------------------

    def peer_dead(self, endpoint: str, session_id: str | None, epoch: int | None, reason: str, now: float) -> None:
        """The prefill rank is gone: its rooms fail, and with it gone nothing more lands (the fence).

        A room that already landed here (SUCCESS: every source's writes and status arrived) owes
        that rank nothing more: it stays landed and settles as such, however late the scheduler's
        next round comes (a prefill replica may finish its requests and exit before then; a prefill
        rank that lost us meanwhile may say it failed the room: ``message`` ignores that too). The
        verdict holds against later requests until the rank registers again or is heard from."""
        why = f"prefill peer lost: {reason}"
        self._registered.discard(endpoint)
        self._lookups.dead(endpoint, epoch, why)
        for request in [r for r in self._requests.values() if any(l.endpoint == endpoint for l in r.links)]:
            if self._state(request.rid) == State.SUCCESS:
                continue
            request.abort_sent = True  # nobody to tell
            self._fire(request.rid, Trigger.FAIL, now, why)
            self._revoke(request, now)

    def peer_back(self, endpoint: str, session_id: str, epoch: int, now: float) -> None:
        """The control plane hears from ``endpoint`` again (a paused process resumed): no verdict holds."""
        self._lookups.pardon(endpoint, epoch)

    def rooms_failed(self, rooms: tuple[int, ...], reason: str, now: float) -> None:
        wanted = set(rooms)
        for request in list(self._requests.values()):
            if request.room in wanted:
                self._fire(request.rid, Trigger.FAIL, now, reason)

    def tick(self, now: float) -> None:
        self._lookups.tick(now, lambda request: request.live or request.untold)
        for request in self._unrevoked.due(now):
            if request.live:
                self._revoke(request, now)
        for grant in self._landed_grants.due(now):
            self._out.append(Revoke(("landed", grant), grant, True, REVOKE_WAIT))
