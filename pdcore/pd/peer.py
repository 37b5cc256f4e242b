"""What the prefill and decode peers share on top of ``pdcore.node.base.PeerBase``: the transfer
table and its replica round (``poll``), the registered KV cache, fences, tombstones.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

from transport.plan import Layout

from ..control.metrics import Counts, PeerCollector, check_registry
from ..core._spec import State
from ..core.agreement import Agreement
from ..core.errors import StartError
from ..core.events import BootstrapInfo, Event
from ..core.replica import check_replica
from ..core.table import StateTable
from ..node.base import PeerBase
from ..node.device import stages
from ..protocol.engine import Services
from .config import TransferConfig
from .front import PdFront, check_logprob, wire_int

__all__ = ["TransferPeer", "PdPeer", "wire_int", "check_logprob"]


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


def kv_layout(regions: list[Any], config: TransferConfig) -> Layout:
    return Layout([r.addr for r in regions], config.page_bytes_per_buffer, config.num_pages)


class PdPeer(PeerBase):
    """A PD rank's peer: the scheduler's side of ``PrefillPeer`` and ``DecodePeer`` over the real planes.

    The scheduler-side rules are the role's front (``pdcore.pd.front``), driven from the scheduler's
    thread; the protocol is the role's engine, on the driver's thread. This class adds the replica's
    agreement (``poll``), the registered KV cache and the metrics."""

    _FRONT: type[PdFront] = PdFront
    _ENGINE: type = object

    def _init_state(self) -> None:
        config = self._config
        assert isinstance(config, TransferConfig)
        self._table = StateTable(
            config.capacity, bootstrap_timeout=config.bootstrap_timeout, waiting_timeout=config.waiting_timeout
        )
        self._agreement = Agreement(self._table, agreement=config.agreement, shm_timeout=config.agreement_timeout)
        self._checked_replica: object = None  # the last replica poll() accepted
        # what the metrics read; None without a registry, so a peer without metrics pays nothing for them
        self.counts = Counts() if config.metrics is not None else None
        self.front: Any = None  # made with the engine (``_make_engine``)

    def _make_engine(self, services: Services) -> Any:
        engine = self._ENGINE(services)
        driver = self._driver
        assert driver is not None
        self.front = self._FRONT(table=self._table, engine=engine, config=self._config, submit=driver.submit,
                                 result=driver.submit_result, counts=self.counts)
        return engine

    def _deliver(self, kind: str, key: Any, value: Any) -> None:
        self.front.deliver(kind, key, value)

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
            self._staged = self._staged or stages(self._transport, region)
        self._layout = kv_layout(regions, cfg)

    def _buffers(self) -> tuple[Any, ...]:
        return tuple(self._config.kv_buffers)

    def close(self) -> None:
        if self.front is not None:
            self.front.close()
        super().close()

    # -- the scheduler's calls ----------------------------------------------------------------

    def register(self, rid: str, bootstrap: BootstrapInfo) -> None:
        """Track an admitted request, before the scheduler can plan it; never blocks.

        ``bootstrap.room`` joins this request to its other side (both register the same room): it
        must be unique among this rank's live requests (``LocalProtocolError`` otherwise).
        ``PeerError`` after ``close``; ``CapacityError`` past ``capacity`` requests.
        """
        self._check_open()
        self.front.register(rid, bootstrap, time.monotonic())

    def abort_room(self, rid: str, room: int) -> None:
        self._check_open()
        self.front.abort_room(rid, room, time.monotonic())

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
        return self.front.after_round(events, time.monotonic())

    def has_in_flight(self) -> bool:
        """A transfer is still tracked: it may yet read or write the cache."""
        return self._table.has_in_flight()

    def state(self, rid: str) -> State:
        """What this rank's table says of ``rid`` now (a read-only look for tools and tests: the scheduler
        learns of a request from ``poll``'s events); ``PdError`` if it does not track ``rid``."""
        return self._table.state(rid)

    def _diagnose(self, out: dict[str, Any]) -> None:
        out["table"] = {"tracked": len(self._table), "in_flight": self._table.has_in_flight()}
        if self.front is not None:
            out["front"] = self.front.diagnostics()
