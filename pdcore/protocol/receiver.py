"""The EPD receiver's protocol (a prefill rank receiving image embeddings), sans-IO.

Per-request codes, per-item states and the slot pool are the receive table
(``pdcore.epd.recv_table``); this engine asks and fences:

- each staged item that holds a slot (or needs none: an empty shard) is asked
  for: its encode rank — DP group ``room % encode dp``, rank ``tp_rank //
  (prefill tp / encode tp)`` of the deployment at the item's ``host:port``,
  looked up and cached — gets ``EmbedRegister`` once per session, a grant of
  the slot (``Grant``) and ``EmbedAsk`` naming it;
- ``EmbedStatus`` lands the item (its grant only goes: the writes completed) or
  fails the request; with device-resident slots (``services.staged``) the rows
  landed in host staging, and the item lands once a ``Land`` copied them into
  the device (``scattered``), its grant kept until then so a fence's revoke
  waits for that copy; a lost encode rank fails every request still waiting for
  it (and, until it registers again, those that need it later);
- when the replica settles a request failed, every encode rank of its items
  hears of it (``Abort``), those never asked too (their items waited for a
  slot), and each asked slot is fenced: its grant revoked in the data plane
  before the slot takes a new receive, so a late write from a paused or slow
  encode rank can never land in another request's rows.

Inputs: ``staged``, ``pump`` (slots were released), ``settled``, ``message``,
``granted``, ``revoked``, ``scattered``, ``looked_up``, ``peer_dead``, ``peer_back``,
``rooms_failed``, ``tick``, ``close``; each takes ``now``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..control import wire
from ..core.errors import LocalProtocolError, PdError
from .actions import Grant, Land, Revoke
from .engine import Engine, ReceiverSettings, ReceivingTable, Services, read_note
from .lookups import Deployment, Lookups
from .revokes import REVOKE_WAIT, LandedGrants, RetryRevokes

if TYPE_CHECKING:  # a value the look-ups carry: its module is the bootstrap's I/O, never imported here
    from ..control.bootstrap import ParallelInfo

__all__ = ["ReceiverEngine"]

log = logging.getLogger("pdcore.receiver")

ABORT_LOOKUP = 10.0  # seconds a failed request's abort may wait for its encode deployment's look-up


@dataclass(eq=False)
class _Item:
    rid: str
    item: Any  # EmbeddingItem
    slot: int | None = None
    row_start: int = 0
    row_count: int = 0
    source: str | None = None  # the encode rank's control endpoint, once asked
    grant: Any = None  # the transport grant of the slot, until landed or fenced
    landed: bool = False
    dropped: bool = False  # the request settled failed: never ask, never land
    abort_until: float = 0.0  # dropped before it was asked: its encode rank is told until then (look-up included)
    abort_why: str = ""
    rechecked: bool = False  # a verdict against its encode rank was checked with a fresh look-up


class ReceiverEngine(Engine[ReceiverSettings, ReceivingTable]):
    """One prefill rank's EPD receiving protocol (``pdcore.epd.receiver.Receiver`` drives it).

    ``services.config`` is the ``ReceiverConfig``; ``tp_rank``/``tp_size`` place this rank in its
    prefill replica; ``slots_addr``/``deep_addr`` are where the receive slots (and deepstack slots)
    start in registered memory."""

    ROLE = "receiver"

    def __init__(self, services: Services[ReceiverSettings, ReceivingTable], *, tp_rank: int, tp_size: int, slots_addr: int, deep_addr: int = 0) -> None:
        super().__init__(services)
        cfg = self._config
        self._rank, self._ranks = tp_rank, tp_size
        self._slots_addr, self._deep_addr = slots_addr, deep_addr
        self._slot_bytes = cfg.slot_rows * cfg.row_bytes
        self._deep_bytes = cfg.slot_rows * cfg.deepstack_row_bytes
        self._items: dict[tuple[str, int], _Item] = {}
        self._by_rid: dict[str, list[_Item]] = {}
        self._by_source: dict[tuple[str, int], _Item] = {}  # (encode endpoint, room) -> item
        self._by_grant: dict[int, _Item] = {}  # the grant key of an item asked and not landed -> the item
        self._slot_owner: dict[int, _Item] = {}
        self._early: dict[tuple[str, int], Any] = {}  # asks the table handed out before their ``staged`` input
        self._lookups = Lookups(self._lookup_keys, lambda record: record.item.room, self._looked_up, self._out.append)
        self._registered: set[str] = set()  # encode endpoints that have our EmbedRegister
        self._unrevoked: RetryRevokes[tuple[int, Any]] = RetryRevokes()  # (slot, grant): revoke not confirmed
        # grants of landed items a revoke failed for; while too many are, asks wait for them there, in order
        self._landed_grants: LandedGrants[_Item] = LandedGrants(4 * cfg.slots)
        self.stats = {"asks": 0, "landed": 0, "fenced": 0}

    def held(self) -> dict[str, int]:
        return {"items": len(self._items), "requests": len(self._by_rid), "sources": len(self._by_source),
                "grants": sum(1 for record in list(self._items.values()) if record.grant is not None),
                "early": len(self._early),
                "slot_owners": len(self._slot_owner), "unrevoked": len(self._unrevoked),
                "landed_grants": len(self._landed_grants), "waiting_asks": self._landed_grants.waiting(),
                "lookups": self._lookups.waiting()}

    def next_deadline(self) -> float:
        return min(self._unrevoked.next_deadline(), self._landed_grants.next_deadline(), self._lookups.next_deadline())

    # -- the scheduler's side ---------------------------------------------------------------

    def staged(self, rid: str, items: list[Any], now: float) -> None:
        """The scheduler staged ``rid`` (the table holds it): ask for whatever holds a slot now."""
        records = [_Item(rid, item) for item in items]
        self._by_rid[rid] = records
        for record in records:
            key = (rid, record.item.index)
            self._items[key] = record
            early = self._early.pop(key, None)
            if early is not None:  # the table leased it before this input came (a pump ran in between)
                self._take(record, early, now)
        self.pump(now)

    def pump(self, now: float) -> None:
        """Items that hold a slot now (staged, released, fenced) are asked for."""
        for ask in self._table.take_ready():
            record = self._items.get((ask.rid, ask.index))
            if record is None:  # staged in the table, its ``staged`` input still queued: it takes the ask
                self._early[(ask.rid, ask.index)] = ask
                continue
            self._take(record, ask, now)

    def _take(self, record: _Item, ask: Any, now: float) -> None:
        record.slot, record.row_start, record.row_count = ask.slot, ask.row_start, ask.row_count
        if ask.slot is not None:
            self._slot_owner[ask.slot] = record
        self._ask(record, now)

    def settled(self, landed: list[str], failed: list[tuple[str, str]], fencing: list[int], now: float) -> None:
        """The replica settled these requests (``landed`` rids, ``failed`` (rid, reason)); ``fencing`` are
        the slots of failed requests that may still receive a late write."""
        reasons = dict(failed)
        gone = [r for rid in landed for r in self._by_rid.pop(rid, ())]
        dropped = [r for rid, _ in failed for r in self._by_rid.pop(rid, ())]
        quarantined = set(fencing)
        for record in gone + dropped:
            self._items.pop((record.rid, record.item.index), None)
            if record.slot is not None and record.slot not in quarantined and self._slot_owner.get(record.slot) is record:
                del self._slot_owner[record.slot]
        for record in dropped:
            record.dropped = True
            if record.source is not None:
                self._by_source.pop((record.source, record.item.room), None)
                self._by_grant.pop(record.grant.key if record.grant is not None else 0, None)
            if record.landed:
                continue
            why = f"failed on the prefill replica: {reasons.get(record.rid, '')}"[: wire.MAX_REASON]
            if record.source is None:  # its encode rank, never asked, holds the room too
                self._abort_unasked(record, why, now)
            else:  # it takes an Abort from a rank that registered there: one whose ask it refused did not
                self._introduce(record.source)
                self._tell(record.source, wire.Abort(room=record.item.room, reason=why))
        if dropped:
            self._landed_grants.keep_waiting(lambda record: not record.dropped)
        for slot in fencing:
            owner = self._slot_owner.pop(slot, None)
            if owner is not None:
                owner.dropped = True
            self._fence(slot, owner.grant if owner is not None else None)
        self.pump(now)

    def close(self, now: float) -> None:
        for record in self._by_source.values():
            if not record.landed and record.source is not None:
                self._tell(record.source, wire.Abort(room=record.item.room, reason="prefill peer closed"))

    # -- asking -------------------------------------------------------------------------

    def _fail(self, rid: str, reason: str, now: float) -> None:
        try:
            self._table.fail(rid, reason, now)
        except PdError:
            pass  # settled meanwhile

    def _ask(self, record: _Item, now: float) -> None:
        item = record.item
        server = (item.host, item.port)
        try:
            target = self._target(self._lookups.get(server), item)
        except PdError as e:
            self._fail(record.rid, f"encode deployment {item.host}:{item.port}: {e}", now)
            return
        if target is None:
            self._lookups.wait(server, record, now)
            return
        endpoint, instance, epoch = target
        verdict = self._lookups.verdict(endpoint, epoch)
        if verdict and not record.rechecked:  # the server may list it anew (restarted): look once more
            record.rechecked = True
            self._lookups.forget(endpoint)
            self._lookups.wait(server, record, now)
            return
        if verdict:  # it died and has not come back: fail now, not after another dead_after
            self._fail(record.rid, f"encode rank {verdict}", now)
            return
        self._introduce(endpoint)
        if record.slot is None:
            self._send_ask(record, endpoint, 0, 0, None)
            return
        if self._landed_grants.full():  # the data plane keeps refusing revokes: grant no more for now
            self._landed_grants.wait(record)
            return
        ranges = self._slot_ranges(record)
        deep = ranges[1][0] if len(ranges) > 1 else 0
        self._out.append(Grant((record, endpoint, ranges[0][0], deep), instance, ranges))

    def _slot_ranges(self, record: _Item) -> list[tuple[int, int]]:
        """The ``(addr, length)`` ranges an item's rows land in: its slot's rows, and its deepstack rows."""
        cfg = self._config
        assert record.slot is not None
        ranges = [(self._slots_addr + record.slot * self._slot_bytes, record.row_count * cfg.row_bytes)]
        if cfg.deepstack_width:
            ranges.append((self._deep_addr + record.slot * self._deep_bytes, record.row_count * cfg.deepstack_row_bytes))
        return ranges

    def granted(self, token: tuple[_Item, str, int, int], grant: Any, error: str | None, now: float) -> None:
        """The answer to the ``Grant`` of an item's slot: the ask goes, naming it."""
        record, endpoint, addr, deep = token
        if error is not None:
            self._fail(record.rid, f"asking encode rank {endpoint} for room {record.item.room} failed: {error}", now)
            return
        record.grant = grant
        if record.dropped:  # settled failed meanwhile: its slot's fence revokes this grant
            return
        self._send_ask(record, endpoint, addr, deep, grant)

    def _send_ask(self, record: _Item, endpoint: str, addr: int, deep: int, grant: Any) -> None:
        cfg = self._config
        item = record.item
        services = self.services
        record.source = endpoint
        self._by_source[(endpoint, item.room)] = record
        if grant is not None:
            self._by_grant[grant.key] = record
        self._tell(endpoint, wire.EmbedAsk(
            room=item.room, session_id=services.session_id, epoch=services.epoch, rank=self._rank, ranks=self._ranks,
            sharded=cfg.shard_rows, rows=item.rows, row_start=record.row_start, row_count=record.row_count,
            hidden=cfg.hidden, dtype=cfg.dtype, deepstack_width=cfg.deepstack_width, addr=addr,
            deepstack_addr=deep, grant=grant.key if grant is not None else 0,
        ), token=record)
        self.stats["asks"] += 1

    def unsent(self, token: Any, why: str, now: float) -> None:
        if isinstance(token, _Item) and not token.dropped:
            self._fail(token.rid, f"asking encode rank {token.source} for room {token.item.room} failed: {why}", now)

    def _introduce(self, endpoint: str) -> None:
        """Send ``EmbedRegister`` to the encode rank at ``endpoint`` once per session."""
        if endpoint in self._registered:
            return
        services = self.services
        self._tell(endpoint, wire.EmbedRegister(
            session_id=services.session_id, epoch=services.epoch, endpoint=services.endpoint,
            tp_size=self._ranks, tp_rank=self._rank,
        ))
        self._registered.add(endpoint)

    def _target(self, deployment: Deployment, item: Any) -> tuple[str, bytes, int] | None:
        """The item's encode rank (endpoint, transport instance, epoch) as far as the cache knows; raises if none fits."""
        info = deployment.known()
        return None if info is None else deployment.ranks.get(self._key(info, item.room))

    def _key(self, info: ParallelInfo, room: int) -> tuple[int, int]:
        """The encode rank ``room`` goes to: DP group ``room % dp``, rank ``tp_rank // fan-out``; raises
        ``LocalProtocolError`` if none can (or the shape the server listed is malformed)."""
        tp = self._ranks
        try:
            if info.layout.get("role") != "encode":
                raise LocalProtocolError(f"it is not an encode deployment (layout {info.layout})")
            dp = room % info.dp_size
            etp = info.tp_size(dp)
            if etp <= 0 or tp % etp:
                raise LocalProtocolError(f"encode tp {etp} does not divide prefill tp {tp}")
            return dp, self._rank // (tp // etp)
        except PdError:
            raise
        except Exception as e:  # what the server listed is not what an encode rank registers
            raise LocalProtocolError(f"the encode deployment's shape is malformed: {e!r}") from e

    def _lookup_keys(self, info: ParallelInfo, room: int) -> tuple[tuple[int, int]]:
        return (self._key(info, room),)

    def _looked_up(self, record: _Item, why: str | None, now: float) -> None:
        if record.dropped:
            if why is None and record.abort_until:
                self._abort_unasked(record, "", now)
            return
        if why is not None:
            self._fail(record.rid, f"encode {why}", now)
        else:
            self._ask(record, now)

    def looked_up(self, server: tuple[str, int], info: Any, ranks: dict[Any, Any], error: str | None, now: float) -> None:
        self._lookups.looked_up(server, info, ranks, error, now)

    def _abort_unasked(self, record: _Item, why: str, now: float) -> None:
        """Tell the encode rank of an item never asked that its request failed, so it concludes the room
        now instead of at its park timeout (looked up first if its deployment is not known yet)."""
        item = record.item
        server = (item.host, item.port)
        try:
            target = self._target(self._lookups.get(server), item)
        except PdError:
            return  # that deployment cannot serve the room: nobody there holds it
        if target is None:  # not looked up yet (or not registered yet): wait for it, for a bounded time
            if not record.abort_until:
                record.abort_until, record.abort_why = now + ABORT_LOOKUP, why
            if now < record.abort_until:
                self._lookups.wait(server, record, now)
            return
        record.abort_until = 0.0
        self._introduce(target[0])
        self._tell(target[0], wire.Abort(room=item.room, reason=why or record.abort_why))

    # -- answers, losses, fences --------------------------------------------------------------

    def message(self, sender: str, msg: wire.Message, now: float) -> None:
        if type(msg) is not wire.EmbedStatus:
            log.warning("receiver: unexpected %s from %s", type(msg).__name__, sender)
            return
        record = self._by_source.get((sender, msg.room))
        if record is None or record.dropped:
            log.debug("receiver: status for unknown room %d from %s", msg.room, sender)
            return
        if not msg.ok:
            # a refusal may be the rank's word that it does not know us (our EmbedRegister was lost, or went to an
            # incarnation that died): the next frame to it registers again (a rank that knows us ignores that)
            self._registered.discard(sender)
            self._fail(record.rid, f"encode rank {sender} failed room {msg.room}: {msg.reason}", now)
            return
        if record.landed:
            return
        record.landed = True
        del self._by_source[(sender, msg.room)]
        self._by_grant.pop(record.grant.key if record.grant is not None else 0, None)
        if self.services.staged and record.slot is not None:  # in host staging: on the device, it lands
            self._out.append(Land(record, self._slot_ranges(record)))
            return
        self._landed(record, now)

    def noted(self, grant: int, note: bytes, now: float) -> None:
        """A note that rode an encode rank's write through ``grant`` (the transport's ``on_note``): every byte
        of it landed in the item's slot. It is that rank's success ``EmbedStatus``, as on the control plane,
        and as authentic as the rows: the grant is given to that rank's transport alone. One that is not its
        room's success fails the item's request (bad input of that rank), nothing else."""
        record = self._by_grant.get(grant)
        if record is None or record.source is None:
            return  # landed or dropped meanwhile: nothing waits for the note
        msg, why = read_note(note, wire.EmbedStatus, record.item.room, lambda status: status.ok)
        if why:
            self._bad_input()
            self._fail(record.rid, f"encode rank {record.source} sent a bad note: {why}"[: wire.MAX_REASON], now)
            return
        self.message(record.source, msg, now)

    def scattered(self, record: _Item, error: str | None, now: float) -> None:
        """The answer to a ``Land``: the item's rows are in device memory, or could not be copied there (its
        request fails). A request settled failed meanwhile has its slot fenced: the revoke of its grant,
        which the copy held back, says when the slot is free."""
        if record.dropped:
            return
        if error is not None:
            self._fail(record.rid, f"copying room {record.item.room}'s rows into device memory failed: {error}", now)
            return
        self._landed(record, now)

    def _landed(self, record: _Item, now: float) -> None:
        if record.grant is not None:  # every write through it completed: the grant only goes
            self._out.append(Revoke(("landed", record.grant), record.grant, True, REVOKE_WAIT))
            record.grant = None
        self.stats["landed"] += 1
        try:
            self._table.landed(record.rid, record.item.index, now)
        except PdError:
            pass  # settled meanwhile

    def _fence(self, slot: int, grant: Any) -> None:
        """Revoke ``slot``'s grant in the data plane; then (``revoked``) the slot takes new receives."""
        if grant is None:
            self._fenced_slot(slot)
        else:
            self._out.append(Revoke((slot, grant), grant, False, REVOKE_WAIT))

    def revoked(self, token: Any, error: str | None, now: float) -> None:
        if token[0] == "landed":  # a landed item's grant: nothing waits on it, it is tried again
            if error is not None:
                if not self._landed_grants:
                    log.warning("receiver: revoking a landed item's grant failed (tried again): %s", error)
                self._landed_grants.failed(token[1], now)
                return
            for record in self._landed_grants.confirmed(token[1]):  # asks that waited, a request settled since aside
                if not record.dropped and self._items.get((record.rid, record.item.index)) is record:
                    self._ask(record, now)
            return
        slot, grant = token
        if error is not None:  # not confirmed: the slot stays quarantined; the tick tries again
            log.warning("receiver: revoking slot %d's grant failed: %s", slot, error)
            self._unrevoked.add((slot, grant), now)
            return
        self._fenced_slot(slot)
        self.pump(now)

    def _fenced_slot(self, slot: int) -> None:
        self._table.fenced(slot)
        self.stats["fenced"] += 1

    def peer_dead(self, endpoint: str, session_id: str | None, epoch: int | None, reason: str, now: float) -> None:
        """An encode rank is gone: what still waits for it fails (its fence is the grants' revoke), and so
        does what needs it later, until it registers again."""
        self._registered.discard(endpoint)
        self._lookups.dead(endpoint, epoch, reason)
        for record in [r for r in self._by_source.values() if r.source == endpoint and not r.landed]:
            self._fail(record.rid, f"encode rank {endpoint} (room {record.item.room}) lost: {reason}", now)

    def peer_back(self, endpoint: str, session_id: str, epoch: int, now: float) -> None:
        """An encode rank introduced itself at ``endpoint`` while none was known there: a paused one that
        resumed, or a new incarnation (restarted at the same host:port) that may never have had our
        ``EmbedRegister`` (sent while nothing listened there, and no verdict came in between): the next frame
        to it registers again, or it would refuse our asks and ignore our aborts."""
        self._registered.discard(endpoint)
        self._lookups.pardon(endpoint, epoch)

    def rooms_failed(self, rooms: tuple[int, ...], reason: str, now: float) -> None:
        wanted = set(rooms)
        for record in [r for r in self._by_source.values() if r.item.room in wanted]:
            self._fail(record.rid, reason, now)

    def tick(self, now: float) -> None:
        self._lookups.tick(now, lambda record: not record.dropped or now < record.abort_until)
        for slot, grant in self._unrevoked.due(now):
            self._fence(slot, grant)
        for grant in self._landed_grants.due(now):
            self._out.append(Revoke(("landed", grant), grant, True, REVOKE_WAIT))
