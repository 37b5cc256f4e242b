"""What the prefill and decode peers share on top of ``pdcore.node.base.PeerBase``: the transfer
table and its replica round (``poll``), the registered KV cache, fences, tombstones.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from typing import Any, Protocol

from transport.plan import Layout

from ..control.metrics import Counts, PeerCollector, check_registry
from ..core.agreement import Agreement
from ..core.errors import CapacityError, PdError, PeerError, StartError
from ..core.events import BootstrapInfo, Event
from ..core.table import StateTable
from ..node.base import PeerBase
from .config import PeerConfig

__all__ = ["TransferPeer", "Tombstones", "PdPeer"]


class TransferPeer(Protocol):
    """The scheduler's view of a peer (the seed's ``TransferPeer``)."""

    def register(self, rid: str, bootstrap: BootstrapInfo) -> None: ...
    def poll(self, replica: object = None) -> list[Event]: ...
    def record_usage(self, rid: str, cached_tokens: int, bootstrap_logprob: float | None) -> None: ...
    def has_in_flight(self) -> bool: ...
    def abort_room(self, rid: str, room: int) -> None: ...
    def close(self) -> None: ...


class Tombstones:
    """Rooms that ended here, remembered for ``ttl`` seconds so late frames get a clear answer.

    Bounded: past ``limit`` entries the oldest go first. ``now`` is an argument.
    """

    def __init__(self, ttl: float, limit: int) -> None:
        self._ttl = ttl
        self._limit = limit
        self._rooms: OrderedDict[int, tuple[float, str]] = OrderedDict()

    def add(self, room: int, reason: str, now: float) -> None:
        self._rooms.pop(room, None)
        self._rooms[room] = (now + self._ttl, reason)
        while len(self._rooms) > self._limit:
            self._rooms.popitem(last=False)

    def get(self, room: int) -> str | None:
        entry = self._rooms.get(room)
        return None if entry is None else entry[1]

    def pop(self, room: int) -> str | None:
        entry = self._rooms.pop(room, None)
        return None if entry is None else entry[1]

    def expire(self, now: float) -> None:
        while self._rooms:
            room, (until, _) = next(iter(self._rooms.items()))
            if until > now:
                return
            del self._rooms[room]

    def __len__(self) -> int:
        return len(self._rooms)


def kv_layout(regions: list[Any], config: PeerConfig) -> Layout:
    return Layout([r.addr for r in regions], config.page_bytes_per_buffer, config.num_pages)


def layout_json(layout: Layout, kv: Any = None) -> dict[str, Any]:
    """What a peer needs to plan writes into our cache: its pages, and what they hold (``KvLayout``) if known."""
    out = {"bases": list(layout.bases), "page_bytes": list(layout.page_bytes), "num_pages": layout.num_pages}
    if kv is not None:
        out["kv"] = kv.to_json()
    return out


class PdPeer(PeerBase):
    """A PD rank's peer: ``PrefillPeer`` and ``DecodePeer`` add their side of the protocol."""

    _TERMINAL: tuple[type, ...] = ()  # the events that end a request on this side (metrics)

    def _init_state(self) -> None:
        config = self._config
        assert isinstance(config, PeerConfig)
        self._table = StateTable(
            config.capacity, bootstrap_timeout=config.bootstrap_timeout, waiting_timeout=config.waiting_timeout
        )
        self._agreement = Agreement(self._table, agreement=config.agreement, shm_timeout=config.agreement_timeout)
        self._tombstones = Tombstones(config.tombstone_ttl, 4 * config.max_pending)
        self._fence_backlog: list[str] = []  # fences the full work queue could not take yet
        # what the metrics read; None without a registry, so a peer without metrics pays nothing for them
        self.counts = Counts() if config.metrics is not None else None

    def _publish(self, stack: contextlib.ExitStack) -> None:
        registry = self._config.metrics
        if registry is not None:
            check_registry(registry, f"{type(self._config).__name__}.metrics")
            collector = PeerCollector(self)
            registry.register(collector)
            stack.callback(registry.unregister, collector)

    def _register_memory(self) -> None:
        """Register the KV cache with the transport: written through grants."""
        cfg = self._config
        regions = []
        for i, (buf, page) in enumerate(zip(cfg.kv_buffers, cfg.page_bytes_per_buffer)):
            region = self._transport.register(buf, require_grant=not cfg.unsafe_no_grants)
            if region.length < page * cfg.num_pages:
                raise StartError(f"kv_buffers[{i}] holds {region.length} bytes, less than {cfg.num_pages} pages of {page}")
            regions.append(region)
        self._layout = kv_layout(regions, cfg)

    def _tick(self, now: float) -> None:
        with self._lock:
            self._tombstones.expire(now)

    # -- the table -------------------------------------------------------------------------

    def _fire(self, rid: str, trigger: int, reason: str = "") -> int | None:
        """Fire a trigger for ``rid`` if it is still tracked; returns the new state or None."""
        try:
            return int(self._table.update(rid, trigger, time.monotonic(), reason))
        except PdError:  # the request ended meanwhile (a race with the scheduler thread)
            return None

    def _fenced(self, rid: str) -> None:
        try:
            self._table.fenced(rid)
        except PdError:
            pass

    def poll(self, replica: object = None) -> list[Event]:
        """The transfers whose state the replica agreed changed; every rank calls it in the same rounds."""
        if self._closed:
            raise PeerError(f"{self.ROLE} peer: closed")
        counts = self.counts
        if counts is None:
            events = self._agreement.round(time.monotonic(), replica)
        else:
            started = time.perf_counter()
            events = self._agreement.round(time.monotonic(), replica)
            counts.rounds.observe(time.perf_counter() - started)
        fencing = self._table.take_fencing()
        if self._fence_backlog:
            fencing, self._fence_backlog = self._fence_backlog + fencing, []
        for rid in fencing:
            try:
                self._submit(self._close_fence, rid)
            except CapacityError:  # the queue is full: the fence stays armed and is queued next round
                self._fence_backlog.append(rid)
            except PdError:  # closing: no worker, and the transport goes down with the peer
                self._fenced(rid)
        if not events:
            return events
        settled = self._settle(events)
        if counts is not None:
            counts.ended(settled, self._TERMINAL)
        return settled

    def has_in_flight(self) -> bool:
        """A transfer is still tracked: it may yet read or write the cache."""
        return self._table.has_in_flight()


    # -- the protocol's hooks ---------------------------------------------------------------

    def _settle(self, events: list[Event]) -> list[Event]:
        raise NotImplementedError

    def _close_fence(self, rid: str) -> None:
        raise NotImplementedError
