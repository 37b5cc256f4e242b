"""The prefill side of EPD: ``Receiver`` (an ``EmbeddingReceiver``), over a ``PrefillPeer``'s planes.

The receive slots are cut from one buffer (and one deepstack buffer)
registered once with the peer's transport for the receiver's life, written
only through grants. Per-request codes, per-item states and the slot pool are
the compiled ``ReceiveTable`` (``pdcore.epd.table``); this module does the I/O:

- ``stage`` puts a request in the table (scheduler thread, never waits); each
  item that holds a slot (or needs none: an empty shard) is handed to the
  worker, which finds its encode rank — DP group ``room % encode dp``, rank
  ``tp_rank // (prefill tp / encode tp)`` of the deployment at the item's
  ``host:port``, looked up on an I/O thread and cached — sends it
  ``EmbedRegister`` once per session, grants it the slot and sends
  ``EmbedAsk``.
- ``EmbedStatus`` from the encode rank lands the item (its grant is dropped:
  the writes completed) or fails the request; a lost encode rank fails every
  request still waiting for it.
- ``poll``/``settle`` (or ``round``, which runs poll → replica MIN → settle
  through ``pdcore.core.agreement`` with the table's mismatch guard) settle the
  agreed codes. A request that failed is told to its encode ranks (``Abort``)
  and each asked slot is fenced: its grant revoked in the data plane before
  the slot takes a new receive, so a late write from a paused or slow encode
  rank can never land in another request's rows.

The scheduler aborts a failed request toward its decode node with
``PrefillPeer.abort_room`` (it knows the decode room; this module does not).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from transport.base import byte_view

from ..control import wire
from ..core.agreement import Agreement
from ..control.bootstrap import ParallelInfo
from ..control.lookup import Deployment, Lookups
from ..core.deadline import Deadline
from ..core.errors import LocalProtocolError, PdError, StartError
from ..core.replica import check_replica
from ..node.base import PeerBase
from .config import ReceiverConfig
from .table import ReceiveTable
from .types import EmbeddingItem, LandedRequest

__all__ = ["Receiver"]

log = logging.getLogger("pdcore.receiver")

_REVOKE_WAIT = 1.0
_ABORT_LOOKUP = 10.0  # seconds a failed request's abort may wait for its encode deployment's look-up


@dataclass(eq=False)
class _Item:
    rid: str
    item: EmbeddingItem
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


def _slot_memory(buf: Any, nbytes: int, name: str) -> Any:
    if buf is None:
        return np.zeros(max(nbytes, 1), dtype=np.uint8)
    length = np.asarray(buf).nbytes if not hasattr(buf, "nbytes") else int(buf.nbytes)
    if length < nbytes:
        raise StartError(f"ReceiverConfig.{name}: holds {length} bytes, the slots need {nbytes}")
    return buf


class Receiver:
    """A prefill rank's receiver of image embeddings (the seed's ``EmbeddingReceiver``).

    Made by ``PrefillPeer.embedding_receiver``; every rank of the replica
    stages the same requests in the same order and settles the same codes.
    ``rows(slot, count)`` and ``deepstack_rows(slot, count)`` view a landed item's rows
    (``LandedItem.slot``, ``LandedItem.row_count``) until ``release`` hands the slot back.
    """

    def __init__(self, peer: PeerBase, config: ReceiverConfig) -> None:
        pcfg = peer._config
        self._peer = peer
        self._config = config
        self._lock = threading.Lock()
        self._table = ReceiveTable(
            config.slots, config.slot_rows, max_requests=config.max_requests, max_items=config.max_items,
            rank=pcfg.tp_rank, ranks=pcfg.tp_size, sharded=config.shard_rows, timeout=config.timeout,
        )
        self._agreement = Agreement(self._table, agreement=pcfg.agreement, shm_timeout=pcfg.agreement_timeout)
        transport = peer._transport
        self._slot_bytes = config.slot_rows * config.row_bytes
        self._deep_bytes = config.slot_rows * config.deepstack_row_bytes
        self._memory = _slot_memory(config.buffer, config.slots * self._slot_bytes, "buffer")
        self._region = transport.register(self._memory, require_grant=True)
        self._deep_region = self._deep_memory = None
        if config.deepstack_width:
            self._deep_memory = _slot_memory(config.deepstack_buffer, config.slots * self._deep_bytes, "deepstack_buffer")
            try:
                self._deep_region = transport.register(self._deep_memory, require_grant=True)
            except BaseException:
                transport.deregister(self._region)
                raise
        self._items: dict[tuple[str, int], _Item] = {}
        self._by_rid: dict[str, list[_Item]] = {}
        self._by_source: dict[tuple[str, int], _Item] = {}  # (encode endpoint, room) -> item
        self._slot_owner: dict[int, _Item] = {}
        self._lookups = Lookups(
            peer, "receiver", lambda info, rooms: {self._key(info, room) for room in rooms},
            lambda record: record.item.room, self._looked_up,
        )
        self._registered: set[str] = set()  # encode endpoints that have our EmbedRegister
        self._unrevoked: list[tuple[int, Any]] = []  # (slot, grant) whose revoke could not be confirmed
        self._backlog: list[tuple[list[_Item], list[int], dict[str, str]]] = []  # drops the full work queue refused
        self.stats = {"asks": 0, "landed": 0, "fenced": 0}
        self._failed: list[tuple[str, str]] | None = None  # the last round's failures, reasons agreed
        self._checked_replica: object = None  # the last replica round() accepted

    # -- the scheduler's calls (EmbeddingReceiver) ---------------------------------------------

    def stage(self, rid: str, items: list[EmbeddingItem] | tuple[EmbeddingItem, ...]) -> None:
        """Start receiving ``rid``'s items' embeddings; never blocks (an item with no free slot waits)."""
        records = [_Item(rid, item) for item in items if isinstance(item, EmbeddingItem)]
        with self._lock:  # before the table: the worker may lease its slots as soon as it is staged
            if rid in self._by_rid:
                raise LocalProtocolError(f"rid {rid!r} is already staged")
            self._by_rid[rid] = records
            for record in records:
                self._items[(rid, record.item.index)] = record
        try:
            self._table.stage(rid, items, time.monotonic())
        except BaseException:
            with self._lock:
                del self._by_rid[rid]
                for record in records:
                    self._items.pop((rid, record.item.index), None)
            raise
        self._pump()

    def poll(self) -> list[int]:
        """Every staged request's code on this rank, in staging order: 0 failed, 1 receiving, 2 landed."""
        buf = self._table.encode(time.monotonic())
        return buf[: len(self._table)].tolist()  # type: ignore[no-any-return]

    def settle(self, codes: Any) -> list[LandedRequest]:
        """Act on the replica-agreed ``codes`` (``poll`` order, or the reduced buffer of ``table.encode``)."""
        if isinstance(codes, (list, tuple)):
            try:  # codes are bytes on every rank: this is 3x faster than numpy's conversion of a list
                codes = np.frombuffer(bytes(codes), np.uint8)
            except (TypeError, ValueError):  # not bytes: the table names the code that is wrong
                codes = np.asarray(codes, dtype=np.int64)
        landed = self._table.settle(codes)
        self._failed = None  # this rank's own reasons: no replica to agree them with here
        self._settled(landed)
        return landed

    def round(self, replica: object = None) -> list[LandedRequest]:
        """``poll`` → MIN across ``replica`` (a gloo group; None for one rank) → ``settle``, with the
        table's mismatch guard: ranks that staged different requests raise ``CollectiveError`` on every rank.
        Every rank reports the same reason for a request that failed (``failed``): the lowest rank's that
        failed it itself (``Agreement.agree_reasons``)."""
        if replica is not None and replica is not self._checked_replica:
            check_replica(replica, "receiver: round")
            self._checked_replica = replica
        landed = self._agreement.round(time.monotonic(), replica)
        failed = self._table.failed()
        self._failed = None
        if failed:
            agreed = self._agreement.agree_reasons(replica, [reason for _, reason in failed])
            self._failed = [(rid, reason) for (rid, _), reason in zip(failed, agreed)]
        self._settled(landed)
        return landed  # type: ignore[no-any-return]

    def release(self, slots: Any) -> None:
        """The data plane copied these slots' rows out: they take new receives."""
        self._table.release([int(s) for s in slots])
        self._pump()

    def awaiting_release(self) -> bool:
        """A landed slot still waits for its rows to be copied out (``release``)."""
        return self._table.awaiting_release()

    def failed(self) -> list[tuple[str, str]]:
        """The requests the last settle dropped as failed: (rid, reason)."""
        return self._failed if self._failed is not None else self._table.failed()

    def rows(self, slot: int, count: int) -> np.ndarray:
        """The first ``count`` rows of ``slot`` as a ``(count, row bytes)`` uint8 view (copy them out, then ``release``)."""
        return self._view(self._region, self._memory, self._slot_bytes, self._config.row_bytes, slot, count)

    def deepstack_rows(self, slot: int, count: int) -> np.ndarray:
        """The first ``count`` deepstack rows of ``slot`` as a ``(count, deepstack row bytes)`` uint8 view
        (``LocalProtocolError`` if the receiver has no deepstack buffer); copy them out, then ``release``."""
        if not self._config.deepstack_width:
            raise LocalProtocolError("deepstack_rows: the receiver has no deepstack buffer")
        return self._view(self._deep_region, self._deep_memory, self._deep_bytes, self._config.deepstack_row_bytes, slot, count)

    def _view(self, region: Any, owner: Any, slot_bytes: int, row_bytes: int, slot: int, count: int) -> np.ndarray:
        if not 0 <= slot < self._config.slots or not 0 <= count <= self._config.slot_rows:
            raise LocalProtocolError(f"slot {slot} / {count} rows is outside the pool")
        view = byte_view(region.addr + slot * slot_bytes, count * row_bytes, owner)
        return np.frombuffer(view, dtype=np.uint8).reshape(count, row_bytes)

    @property
    def table(self) -> ReceiveTable:
        return self._table

    # -- handing work to the peer's worker --------------------------------------------------------

    def _pump(self) -> None:
        """Items that now hold a slot go to the worker, which asks their encode ranks."""
        asks = self._table.take_ready()
        if not asks:
            return
        with self._lock:
            records = [self._items[(a.rid, a.index)] for a in asks]
            for record, ask in zip(records, asks):
                record.slot, record.row_start, record.row_count = ask.slot, ask.row_start, ask.row_count
                if ask.slot is not None:
                    self._slot_owner[ask.slot] = record
        try:
            self._peer._submit(self._ask_all, records)
        except PdError as e:
            for rid in {r.rid for r in records}:
                self._fail(rid, f"cannot queue the receive requests: {e}")

    def _settled(self, landed: list[LandedRequest]) -> None:
        failed = self.failed()
        fencing = self._table.take_fencing()
        reasons = dict(failed)
        with self._lock:
            gone = [r for req in landed for r in self._by_rid.pop(req.rid, ())]
            dropped = [r for rid, _ in failed for r in self._by_rid.pop(rid, ())]
            for record in gone + dropped:
                self._items.pop((record.rid, record.item.index), None)
                if record.slot is not None and record.slot not in fencing and self._slot_owner.get(record.slot) is record:
                    del self._slot_owner[record.slot]
        if dropped or fencing:
            try:
                self._peer._submit(self._drop, dropped, fencing, reasons)
            except PdError:  # the queue is full (or closing): the worker's tick drops and fences them
                # Only the worker reads a record's grant (it makes them: an ask may be granting right now),
                # so here the records are only marked, and the drop waits for the worker.
                with self._lock:
                    for record in dropped:
                        record.dropped = True
                    self._backlog.append((dropped, fencing, reasons))
        if fencing or landed or failed:
            self._pump()

    def _fail(self, rid: str, reason: str) -> None:
        try:
            self._table.fail(rid, reason, time.monotonic())
        except PdError:
            pass  # settled meanwhile

    # -- worker: asking ------------------------------------------------------------------------

    def _ask_all(self, records: list[_Item]) -> None:
        for record in records:
            if not record.dropped:
                self._ask(record)

    def _ask(self, record: _Item) -> None:
        item = record.item
        server = (item.host, item.port)
        try:
            target = self._target(self._lookups.get(server), item)
        except PdError as e:
            self._fail(record.rid, f"encode deployment {item.host}:{item.port}: {e}")
            return
        if target is None:
            self._lookups.wait(server, record)
            return
        endpoint, instance, epoch = target
        verdict = self._verdict(target)
        if verdict and not record.rechecked:  # the server may list it anew (restarted): look once more
            record.rechecked = True
            self._lookups.forget(endpoint)
            self._lookups.wait(server, record)
            return
        if verdict:  # it died and has not come back: fail now, not after another dead_after
            self._fail(record.rid, f"encode rank {verdict}")
            return
        peer = self._peer
        pcfg = peer._config
        cfg = self._config
        try:
            self._introduce(endpoint)
            addr = deep = 0
            if record.slot is not None:
                addr = self._region.addr + record.slot * self._slot_bytes
                ranges = [(addr, record.row_count * cfg.row_bytes)]
                if self._deep_region is not None:
                    deep = self._deep_region.addr + record.slot * self._deep_bytes
                    ranges.append((deep, record.row_count * cfg.deepstack_row_bytes))
                grant = peer._transport.grant(instance, ranges)
                with self._lock:  # the request may have been dropped while this rank granted
                    dropped = record.dropped
                    record.grant = grant
                if dropped:  # its drop fences the slot after this item: the grant goes first, nothing is asked
                    self._revoke(record)
                    return
            record.source = endpoint
            with self._lock:
                self._by_source[(endpoint, item.room)] = record
            peer._channel.send(endpoint, wire.EmbedAsk(
                room=item.room, session_id=peer.session_id, epoch=peer.epoch, rank=pcfg.tp_rank, ranks=pcfg.tp_size,
                sharded=cfg.shard_rows, rows=item.rows, row_start=record.row_start, row_count=record.row_count,
                hidden=cfg.hidden, dtype=cfg.dtype, deepstack_width=cfg.deepstack_width, addr=addr,
                deepstack_addr=deep, grant=record.grant.key if record.grant is not None else 0,
            ))
            self.stats["asks"] += 1
        except (PdError, ValueError) as e:
            self._fail(record.rid, f"asking encode rank {endpoint} for room {item.room} failed: {e}")

    def _introduce(self, endpoint: str) -> None:
        """Send ``EmbedRegister`` to the encode rank at ``endpoint`` once per session."""
        if endpoint in self._registered:
            return
        peer = self._peer
        pcfg = peer._config
        peer._channel.send(endpoint, wire.EmbedRegister(
            session_id=peer.session_id, epoch=peer.epoch, endpoint=peer._transport.endpoint(),
            tp_size=pcfg.tp_size, tp_rank=pcfg.tp_rank,
        ))
        self._registered.add(endpoint)

    def _revoke(self, record: _Item) -> None:
        """Worker: revoke ``record``'s grant now; one not confirmed stays on the record for its slot's fence."""
        try:
            self._peer._transport.revoke(record.grant, deadline=Deadline.after(_REVOKE_WAIT))
        except PdError as e:
            log.warning("receiver: revoking room %d's grant failed: %s", record.item.room, e)
            return
        record.grant = None

    def _verdict(self, rank: tuple[str, bytes, int]) -> str | None:
        """Why the looked-up encode rank is known dead, or None (as ``DecodePeer._verdict``)."""
        why = self._lookups.verdict(rank[0], rank[2])
        if why is not None:
            epoch = self._peer._channel.introduced(rank[0])[1]
            if epoch is not None and epoch >= rank[2]:
                self._lookups.pardon(rank[0])
                return None
        return why

    def _target(self, deployment: Deployment, item: EmbeddingItem) -> tuple[str, bytes, int] | None:
        """The item's encode rank (endpoint, transport instance) as far as the cache knows; raises if none fits."""
        info = deployment.known()
        return None if info is None else deployment.ranks.get(self._key(info, item.room))

    def _key(self, info: ParallelInfo, room: int) -> tuple[int, int]:
        """The encode rank ``room`` goes to: DP group ``room % dp``, rank ``tp_rank // fan-out``; raises if none can."""
        tp = self._peer._config.tp_size
        if info.layout.get("role") != "encode":
            raise LocalProtocolError(f"it is not an encode deployment (layout {info.layout})")
        dp = room % info.dp_size
        etp = info.tp_size(dp)
        if tp % etp:
            raise LocalProtocolError(f"encode tp {etp} does not divide prefill tp {tp}")
        return dp, self._peer._config.tp_rank // (tp // etp)

    def _looked_up(self, record: _Item, why: str | None) -> None:
        """Worker: the lookup an item waited for ended."""
        if record.dropped:
            if why is None and record.abort_until:
                self._abort_unasked(record, "")
            return
        if why is not None:
            self._fail(record.rid, f"encode {why}")
        else:
            self._ask(record)

    # -- worker: answers, losses, fences -----------------------------------------------------------

    def _on_status(self, sender: str, msg: wire.EmbedStatus) -> None:
        with self._lock:
            record = self._by_source.get((sender, msg.room))
        if record is None or record.dropped:
            log.debug("receiver: status for unknown room %d from %s", msg.room, sender)
            return
        if not msg.ok:
            self._fail(record.rid, f"encode rank {sender} failed room {msg.room}: {msg.reason}")
            return
        if record.landed:
            return
        record.landed = True
        if record.grant is not None:  # every write through it completed: the grant only goes
            self._peer._transport.revoke(record.grant, deadline=Deadline.after(_REVOKE_WAIT), settled=True)
            record.grant = None
        with self._lock:
            self._by_source.pop((sender, msg.room), None)
        self.stats["landed"] += 1
        try:
            self._table.landed(record.rid, record.item.index, time.monotonic())
        except PdError:
            pass  # settled meanwhile

    def _drop(self, dropped: list[_Item], fencing: list[int], reasons: dict[str, str]) -> None:
        """Worker: tell the encode ranks of failed requests (asked or not yet), then fence their asked slots."""
        for record in dropped:
            with self._lock:
                record.dropped = True
                if record.source is not None:
                    self._by_source.pop((record.source, record.item.room), None)
            if record.landed:
                continue
            why = f"failed on the prefill replica: {reasons.get(record.rid, '')}"[: wire.MAX_REASON]
            if record.source is None:  # its encode rank, never asked, holds the room too
                self._abort_unasked(record, why)
                continue
            try:
                self._peer._channel.send(record.source, wire.Abort(room=record.item.room, reason=why))
            except PdError as e:
                log.debug("receiver: cannot tell %s that room %d failed: %s", record.source, record.item.room, e)
        for slot in fencing:
            with self._lock:
                owner = self._slot_owner.pop(slot, None)
            if owner is not None:
                owner.dropped = True
            self._fence(slot, owner.grant if owner is not None else None)

    def _abort_unasked(self, record: _Item, why: str) -> None:
        """Worker: tell the encode rank of an item never asked that its request failed, so it concludes the
        room now instead of at its park timeout (looked up first if its deployment is not known yet)."""
        item = record.item
        server = (item.host, item.port)
        try:
            target = self._target(self._lookups.get(server), item)
        except PdError:
            return  # that deployment cannot serve the room: nobody there holds it
        if target is None:  # not looked up yet (or not registered yet): wait for it, for a bounded time
            now = time.monotonic()
            if not record.abort_until:
                record.abort_until, record.abort_why = now + _ABORT_LOOKUP, why
            if now < record.abort_until:
                self._lookups.wait(server, record)
            return
        record.abort_until = 0.0
        try:
            self._introduce(target[0])
            self._peer._channel.send(target[0], wire.Abort(room=item.room, reason=why or record.abort_why))
        except PdError as e:
            log.debug("receiver: cannot tell %s that room %d failed: %s", target[0], item.room, e)

    def _fence(self, slot: int, grant: Any) -> None:
        """Revoke ``slot``'s grant in the data plane, then the slot takes new receives."""
        if grant is not None:
            try:
                self._peer._transport.revoke(grant, deadline=Deadline.after(_REVOKE_WAIT))
            except PdError as e:  # not confirmed: the slot stays quarantined; the tick tries again
                log.warning("receiver: revoking slot %d's grant failed: %s", slot, e)
                with self._lock:
                    self._unrevoked.append((slot, grant))
                return
        self._table.fenced(slot)
        self.stats["fenced"] += 1
        self._pump()

    def _lose_source(self, endpoint: str, reason: str, epoch: int | None = None) -> None:
        """Worker: an encode rank is gone: what still waits for it fails (its fence is the grants' revoke),
        and so does what needs it later, until it registers again."""
        self._registered.discard(endpoint)
        self._lookups.dead(endpoint, epoch, reason)
        with self._lock:
            bound = [r for r in self._by_source.values() if r.source == endpoint and not r.landed]
        for record in bound:
            self._fail(record.rid, f"encode rank {endpoint} (room {record.item.room}) lost: {reason}")

    def _rooms_failed(self, rooms: tuple[int, ...], reason: str) -> None:
        wanted = set(rooms)
        with self._lock:
            hit = [r for r in self._by_source.values() if r.item.room in wanted]
        for record in hit:
            self._fail(record.rid, reason)

    def _tick(self, now: float) -> None:
        with self._lock:
            backlog, self._backlog = self._backlog, []
        for dropped, fencing, reasons in backlog:
            self._drop(dropped, fencing, reasons)
        self._lookups.tick(lambda record: not record.dropped or now < record.abort_until)
        with self._lock:
            retry, self._unrevoked = self._unrevoked, []
        for slot, grant in retry:
            self._fence(slot, grant)

    def _farewell(self) -> None:
        with self._lock:
            asked = [r for r in self._by_source.values() if not r.landed]
        for record in asked:
            try:
                self._peer._channel.send(record.source, wire.Abort(room=record.item.room, reason="prefill peer closed"))
            except PdError:
                pass
        self._agreement.close()
