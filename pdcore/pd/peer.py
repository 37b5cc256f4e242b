"""What the prefill and decode peers share on top of ``pdcore.node.base.PeerBase``: the transfer
table and its replica round (``poll``), the registered KV cache, fences, tombstones.
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
from collections import OrderedDict
from typing import Any, Protocol

from transport.plan import Layout

from ..control.metrics import Counts, PeerCollector, check_registry
from ..core.agreement import Agreement
from ..core._spec import Trigger
from ..core.errors import LocalProtocolError, PdError, PeerError, StartError
from ..core.events import BootstrapInfo, Event, Failed, Succeeded
from ..core.replica import check_replica
from ..core.table import StateTable
from ..node.base import PeerBase
from .config import PeerConfig

__all__ = ["TransferPeer", "PdPeer", "wire_int", "check_logprob"]

_ENDS = (Succeeded, Failed)


class TransferPeer(Protocol):
    """The scheduler's view of a peer (the ``TransferPeer`` trait): ``PrefillPeer`` and ``DecodePeer``.

    Every rank of a replica registers the same requests in the same order and calls ``poll``
    in the same rounds; the events (``Bootstrapped``, then ``Succeeded`` / ``RemotePrefillDone``
    or ``Failed``) come out alike on every rank. The README's "The scheduler's contract" has
    the whole story.
    """

    def register(self, rid: str, bootstrap: BootstrapInfo) -> None:
        """Track an admitted request: ``rid`` names it on this side, ``bootstrap.room`` joins it to
        the other side (prefill and decode register the same room). Never blocks; ``PeerError``
        after ``close``."""
        ...

    def poll(self, replica: object = None) -> list[Event]:
        """One scheduler round: the replica agrees (MIN over ``replica``, a gloo process group, or
        None for one rank) and the requests whose state changed come back as events, alike on
        every rank. Free a request's pages only at its terminal event."""
        ...

    def record_usage(self, rid: str, cached_tokens: int, bootstrap_logprob: float | None) -> None:
        """Prefill: what decode's ``RemotePrefill`` carries besides the first token (cached tokens,
        the first token's logprob); call it before the hand-over. Decode: does nothing."""
        ...

    def has_in_flight(self) -> bool:
        """A request is still tracked here: a transfer may yet read or write the KV cache."""
        ...

    def abort_room(self, rid: str, room: int) -> None:
        """Fail the request now: prefill fails the room it holds (or, if none is registered, answers
        its decode side from a tombstone), decode fails ``rid``. Its terminal ``Failed`` comes out
        of a later ``poll`` on every rank of the replica, once nothing can land in its pages."""
        ...

    def close(self) -> None:
        """Tell peers about requests still in flight, stop every thread, release the registered
        memory. Idempotent; ``register``, ``poll`` and the outbox's / inbox's calls raise
        ``PeerError`` after it."""
        ...


def kv_layout(regions: list[Any], config: PeerConfig) -> Layout:
    return Layout([r.addr for r in regions], config.page_bytes_per_buffer, config.num_pages)


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


class PdPeer(PeerBase):
    """A PD rank's peer: the scheduler's side of ``PrefillPeer`` and ``DecodePeer``.

    The scheduler's thread owns what is here: the table's registrations and rounds, the live
    rids, the rids that ended lately (a late call for one is a no-op). The protocol is the role's
    engine, on the driver's thread: each scheduler call becomes an input there, and each round's
    fences and ends too (``fence``, ``settled``)."""

    _TERMINAL: tuple[type, ...] = ()  # the events that end a request on this side (metrics)

    def _init_state(self) -> None:
        config = self._config
        assert isinstance(config, PeerConfig)
        self._table = StateTable(
            config.capacity, bootstrap_timeout=config.bootstrap_timeout, waiting_timeout=config.waiting_timeout
        )
        self._agreement = Agreement(self._table, agreement=config.agreement, shm_timeout=config.agreement_timeout)
        self._live_rids: set[str] = set()  # registered and not yet ended (the scheduler's thread)
        # rids that ended here lately (tombstone_ttl, the last 4 * max_pending): a late scheduler call is a no-op
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._ended_limit = 4 * config.max_pending
        self._checked_replica: object = None  # the last replica poll() accepted
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
            try:
                region = self._transport.register(buf, require_grant=not cfg.unsafe_no_grants)
            except (ValueError, TypeError) as e:  # e.g. overlapping another registered buffer
                raise StartError(f"{type(cfg).__name__}.kv_buffers[{i}]: the transport refused it: {e}") from e
            if region.length < page * cfg.num_pages:
                raise StartError(f"kv_buffers[{i}] holds {region.length} bytes, less than {cfg.num_pages} pages of {page}")
            regions.append(region)
        self._layout = kv_layout(regions, cfg)

    # -- the scheduler's calls: what a rid may be ------------------------------------------

    def _registered(self, rid: str) -> None:
        """The table takes ``rid`` (the scheduler's thread, in registration order on every rank)."""
        self._check_open()
        self._table.register(rid, time.monotonic())
        self._live_rids.add(rid)
        self._ended.pop(rid, None)  # a rid used again: its next end goes to the back
        if self.counts is not None:
            self.counts.born(rid)

    def _accepts(self, rid: str, call: str) -> bool:
        """Whether the scheduler's ``call`` for ``rid`` goes ahead.

        True for a live request. False (the call does nothing) for one that ended here within
        ``tombstone_ttl`` (and among the last ``4 * max_pending`` to end): the scheduler hears of
        an end one round late, so a ``send`` or ``announce`` racing it is not its mistake.
        ``LocalProtocolError`` for a rid this peer never registered, or forgot; ``PeerError``
        after ``close``.
        """
        self._check_open()
        if rid in self._live_rids:
            return True
        until = self._ended.get(rid)
        if until is not None and until > time.monotonic():
            return False
        raise LocalProtocolError(
            f"{call}({rid!r}): no such request on this {self.ROLE} peer (never registered here, or it ended "
            f"more than tombstone_ttl = {self._config.tombstone_ttl:g} s ago)"
        )

    def _input(self, rid: str, fn: Any, *args: Any) -> None:
        """Hand a scheduler call for ``rid`` to the engine; one it cannot take fails the request."""
        try:
            self._submit(fn, *args)
        except PeerError:
            raise
        except PdError as e:
            self._table.update(rid, Trigger.FAIL, time.monotonic(), f"{self.ROLE} peer overloaded: {e}")

    # -- the round ---------------------------------------------------------------------------

    def poll(self, replica: object = None) -> list[Event]:
        """The transfers whose state the replica agreed changed; every rank calls it in the same rounds.

        ``replica`` is the replica's ``torch.distributed`` process group (gloo), or None for a
        replica of one rank; anything else is a ``LocalProtocolError``. ``PeerError`` after ``close``.
        Never waits on the network: the round's fences and ends go to the engine as inputs.
        """
        self._check_open()
        if replica is not None and replica is not self._checked_replica:
            check_replica(replica, f"{self.ROLE} peer: poll")
            self._checked_replica = replica
        counts = self.counts
        if counts is None:
            events = self._agreement.round(time.monotonic(), replica)
        else:
            started = time.perf_counter()
            events = self._agreement.round(time.monotonic(), replica)
            counts.rounds.observe(time.perf_counter() - started)
        fencing = self._table.take_fencing()
        if fencing:
            self._result(self._engine.fence, fencing)
        recent = self._ended
        now = time.monotonic()
        while recent and next(iter(recent.values())) <= now:
            recent.popitem(last=False)
        if not events:
            return events
        ended = [event.rid for event in events if type(event) in _ENDS]
        if ended:  # in bulk: this runs every round, on the scheduler's thread
            self._live_rids.difference_update(ended)
            recent.update(dict.fromkeys(ended, now + self._config.tombstone_ttl))
            for _ in range(len(recent) - self._ended_limit):
                recent.popitem(last=False)
            self._result(self._engine.settled, events)
        settled = self._settle(events, ended)
        if counts is not None:
            counts.ended(settled, self._TERMINAL)
        return settled

    def _result(self, fn: Any, *args: Any) -> None:
        """An input the round owes the engine (fences, ends): never refused, never lost."""
        if self._driver is not None:
            self._driver.submit_result(fn, *args)

    def has_in_flight(self) -> bool:
        """A transfer is still tracked: it may yet read or write the cache."""
        return self._table.has_in_flight()

    def _settle(self, events: list[Event], ended: list[str]) -> list[Event]:
        """The role's events as the scheduler gets them (decode: a landing's first token); ``ended``:
        the rids among them that ended."""
        return events
