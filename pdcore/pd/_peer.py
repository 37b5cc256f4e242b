"""What the prefill and decode peers share: resources, the worker thread, tombstones, the round.

Threads of a peer (DESIGN §2):

- the **scheduler thread** calls ``register``/``poll``/``abort_room``/... They
  touch the state table and enqueue work; they never wait on the network.
- the **worker thread** runs that work in order: protocol messages, planning
  and posting writes, fences. Each item is bounded by a deadline; an exception
  fails the rooms the item concerns and nothing more.
- the **I/O threads** (a few) do what may wait on another host: bootstrap
  lookups and transport connects. They hand each result back to the worker,
  so an unreachable endpoint delays only the rooms that need it, never an
  abort, and one silent host holds one I/O thread, not all of them.
- the control channel's **I/O thread** decodes frames and hands them to the
  worker; the transport's threads report completions (``on_done``) that only
  update the table and queue frames.

Everything here is bounded: the work queue, the tombstones, every wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import transport as transport_mod
from transport.plan import Layout

from ..control import wire
from ..core.agreement import Agreement
from ..control.auth import resolve_secret, warn_unauthenticated
from ..control.metrics import Counts, PeerCollector, check_registry
from .config import NodeConfig, PeerConfig
from ..control.channel import ControlChannel, DeadPeer
from ..control.bootstrap import BootstrapClient, RankRegistration
from ..core.deadline import Deadline, DeadlineExceeded
from ..core.errors import CapacityError, PdError, PeerError, StartError
from ..core.events import BootstrapInfo, Event
from ..core.table import StateTable

__all__ = ["TransferPeer", "Tombstones"]

log = logging.getLogger("pdcore.peer")

_TICK = 0.05  # the worker's period for deadlines when idle
_IO_THREADS = 4


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


class PeerBase:
    """Resources and threads of one rank's peer; ``PrefillPeer``/``DecodePeer`` add the protocol."""

    ROLE = "peer"

    def __init__(self, config: NodeConfig) -> None:
        self._config: Any = config
        self._secret = resolve_secret(config.secret)  # before the first word with anyone
        if self._secret is None:
            warn_unauthenticated(f"{self.ROLE} peer")
        self.session_id = f"{self.ROLE}-{os.urandom(6).hex()}"
        self.epoch = time.time_ns() // 1000  # a restarted rank comes back with a larger epoch
        self._init_table()
        self._lock = threading.RLock()
        self._work: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.Queue(4 * config.max_pending)
        self._io_work: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue(config.max_pending)
        self._stop = threading.Event()
        self._tombstones = Tombstones(config.tombstone_ttl, 4 * config.max_pending)
        self._owned = contextlib.ExitStack()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._io_threads: list[threading.Thread] = []
        self.stats: dict[str, int] = {"work_errors": 0, "protocol_errors": 0}
        # what the metrics read; None without a registry, so a peer without metrics pays nothing for them
        self.counts = Counts() if self._metrics is not None else None
        self._fence_backlog: list[str] = []  # fences the full work queue could not take yet

    @property
    def _metrics(self) -> Any:
        return getattr(self._config, "metrics", None)

    def _init_table(self) -> None:
        """The PD transfer table and its agreement (the encode peer has neither)."""
        config = self._config
        assert isinstance(config, PeerConfig)
        self._table = StateTable(
            config.capacity, bootstrap_timeout=config.bootstrap_timeout, waiting_timeout=config.waiting_timeout
        )
        self._agreement: Any = Agreement(
            self._table, agreement=config.agreement, shm_timeout=config.agreement_timeout
        )

    def _register_memory(self) -> None:
        """Register the KV cache with the transport: written through grants."""
        cfg = self._config
        assert isinstance(cfg, PeerConfig)
        regions = []
        for i, (buf, page) in enumerate(zip(cfg.kv_buffers, cfg.page_bytes_per_buffer)):
            region = self._transport.register(buf, require_grant=not cfg.unsafe_no_grants)
            if region.length < page * cfg.num_pages:
                raise StartError(f"kv_buffers[{i}] holds {region.length} bytes, less than {cfg.num_pages} pages of {page}")
            regions.append(region)
        self._layout = kv_layout(regions, cfg)

    # -- start and stop -----------------------------------------------------------------

    def _start(self) -> None:
        """Transport, registered cache, control channel, worker thread; a half-built peer unwinds."""
        cfg = self._config
        options = dict(cfg.transport_options)
        if cfg.transport == "tcp":
            options.setdefault("host", cfg.host)
        if self._secret is not None:
            options.setdefault("secret", self._secret)
        with contextlib.ExitStack() as stack:
            self._transport = transport_mod.create(cfg.transport, **options)
            stack.callback(self._transport.close)
            self._register_memory()
            self._channel = ControlChannel(
                self._on_frame,
                session_id=self.session_id,
                epoch=self.epoch,
                on_rooms_failed=self._on_rooms_failed,
                on_peer_dead=self._on_peer_dead,
                host=cfg.host,
                heartbeat_interval=cfg.heartbeat_interval,
                dead_after=cfg.dead_after,
                secret=self._secret,
            )
            self._channel.start()
            stack.callback(self._channel.close)
            registry = self._metrics
            if registry is not None:
                check_registry(registry, f"{type(cfg).__name__}.metrics")
                collector = PeerCollector(self)
                registry.register(collector)
                stack.callback(registry.unregister, collector)
            self._thread = threading.Thread(target=self._run, name=f"pdcore-{self.ROLE}-worker", daemon=True)
            self._io_threads = [
                threading.Thread(target=self._io_run, name=f"pdcore-{self.ROLE}-io-{i}", daemon=True)
                for i in range(_IO_THREADS)
            ]
            self._thread.start()
            for t in self._io_threads:
                t.start()
            stack.callback(self._join_worker)
            self._owned = stack.pop_all()

    def _join_worker(self, deadline: Deadline | None = None) -> None:
        self._stop.set()
        for _ in self._io_threads:
            try:
                self._io_work.put_nowait(None)  # wake an idle I/O thread at once
            except queue.Full:
                break  # busy threads see the stop between items
        deadline = deadline or Deadline.after(5.0)
        for thread in (self._thread, *self._io_threads):
            if thread is not None and thread is not threading.current_thread():
                thread.join(deadline.remaining())
                if thread.is_alive():
                    raise PeerError(f"{self.ROLE} peer: the {thread.name} thread did not stop by the deadline")

    @property
    def port(self) -> int:
        """The control socket's port."""
        return int(self._channel.endpoint.rsplit(":", 1)[1])

    @property
    def control_endpoint(self) -> str:
        return self._channel.endpoint

    def close(self) -> None:
        """Tell peers about rooms still in flight, stop every thread, free the cache registration."""
        if self._closed:
            return
        self._closed = True
        try:
            self._farewell()
        except Exception:  # best effort: closing must go on
            log.exception("%s peer: telling peers about in-flight rooms failed", self.ROLE)
        try:
            self._owned.close()
        finally:
            if self._agreement is not None:
                self._agreement.close()  # the other ranks hear of it at once, not at their next deadline

    def __enter__(self) -> PeerBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- registering with this deployment's bootstrap server (prefill and encode ranks) ------------

    def _follow_epoch(self, deadline: Deadline) -> None:
        """Start past the epoch the server holds for this slot: a rank restarted after the clock
        stepped back would otherwise be refused as older than its own previous incarnation."""
        cfg = self._config
        held = self._ask_bootstrap("this rank's slot", lambda c, d: c.rank(cfg.dp_rank, cfg.tp_rank, d), deadline)
        if held is not None and held.epoch >= self.epoch:
            self.epoch = held.epoch + 1

    def _register_with_bootstrap(self, layout: dict[str, Any], deadline: Deadline) -> None:
        cfg = self._config
        registration = RankRegistration(
            session_id=self.session_id,
            epoch=self.epoch,
            endpoint=self.control_endpoint,
            tp_size=cfg.tp_size,
            dp_size=cfg.dp_size,
            tp_rank=cfg.tp_rank,
            dp_rank=cfg.dp_rank,
            layout=layout,
            transport=self._transport.instance.hex(),
        )
        self._ask_bootstrap("this rank", lambda c, d: c.register(registration, d), deadline)

    def _ask_bootstrap(self, what: str, call: Any, deadline: Deadline) -> Any:
        """``call(client, slice)`` in slices of at most 2 s until it answers or ``deadline`` passes: the
        server may not be up yet. A refusal is a ``StartError`` naming ``what``."""
        cfg = self._config
        client = BootstrapClient(cfg.bootstrap_host, cfg.bootstrap_port, secret=self._secret)
        last: Exception | None = None
        while not deadline.expired():
            try:
                return call(client, Deadline.after(min(2.0, deadline.remaining())).earliest(deadline))
            except (OSError, DeadlineExceeded) as e:  # not up yet: retry
                last = e
                time.sleep(min(0.1, max(0.0, deadline.remaining())))
            except PdError as e:
                raise StartError(f"{self.ROLE} peer: the bootstrap server refused {what}: {e}") from e
        raise StartError(f"{self.ROLE} peer: bootstrap server {cfg.bootstrap_host}:{cfg.bootstrap_port} unreachable: {last}")

    # -- the worker ------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Queue work for the worker thread; never blocks. ``CapacityError`` when the queue is full."""
        if self._stop.is_set():
            raise PeerError(f"{self.ROLE} peer: closed")
        try:
            self._work.put_nowait((fn, args))
        except queue.Full:
            raise CapacityError(f"{self.ROLE} peer: {self._work.maxsize} work items already queued") from None

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                fn, args = self._work.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                pass
            else:
                self._guarded(fn, *args)
            now = time.monotonic()
            if now >= next_tick:
                self._guarded(self._tick, now)
                next_tick = now + _TICK

    def _submit_io(self, fn: Callable[..., None], *args: Any) -> None:
        """Queue work that may wait on another host for the I/O thread; ``CapacityError`` when full.

        ``fn`` runs there and hands its result back with ``_from_io``."""
        if self._stop.is_set():
            raise PeerError(f"{self.ROLE} peer: closed")
        try:
            self._io_work.put_nowait((fn, args))
        except queue.Full:
            raise CapacityError(f"{self.ROLE} peer: {self._io_work.maxsize} I/O items already queued") from None

    def _from_io(self, fn: Callable[..., None], *args: Any) -> None:
        """On the I/O thread: queue a result for the worker, waiting for room rather than losing it."""
        while not self._stop.is_set():
            try:
                self._work.put((fn, args), timeout=_TICK)
                return
            except queue.Full:
                continue

    def _io_run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._io_work.get(timeout=1.0)  # close() wakes it with a None
            except queue.Empty:
                continue
            if item is not None:
                self._guarded(item[0], *item[1])

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # a bug of ours or an unexpected failure: logged, counted, never fatal
            self.stats["work_errors"] += 1
            log.exception("%s peer: work item %s failed", self.ROLE, getattr(fn, "__name__", fn))

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

    def connected_peers(self) -> int:
        """Peers this rank has a control connection to (a metric)."""
        return len(self._channel._dealers)

    # -- role hooks -----------------------------------------------------------------------

    def _settle(self, events: list[Event]) -> list[Event]:
        raise NotImplementedError

    def _close_fence(self, rid: str) -> None:
        raise NotImplementedError

    def _on_message(self, sender: str, msg: wire.Message) -> None:
        raise NotImplementedError

    def _peer_lost(self, dead: DeadPeer) -> None:
        raise NotImplementedError

    def _rooms_failed(self, rooms: tuple[int, ...], reason: str) -> None:
        raise NotImplementedError

    def _farewell(self) -> None:
        raise NotImplementedError

    # -- control-channel callbacks: hand over to the worker, never block --------------------

    def _on_frame(self, sender: str, msg: wire.Message) -> None:
        release = self._channel.hold()  # the frame counts against its sender's quota until handled
        try:
            self._submit(self._handle_frame, sender, msg, release)
        except PdError as e:
            release()
            self._on_rooms_failed(wire.rooms_of(msg), f"{self.ROLE} peer overloaded: {e}")

    def _handle_frame(self, sender: str, msg: wire.Message, release: Callable[[], None]) -> None:
        try:
            self._on_message(sender, msg)
        finally:
            release()

    def _on_rooms_failed(self, rooms: tuple[int, ...], reason: str) -> None:
        self.stats["protocol_errors"] += 1
        with self._lock:
            self._rooms_failed(rooms, reason)

    def _on_peer_dead(self, dead: DeadPeer) -> None:
        if self._stop.is_set():
            return  # closing: nothing left to fail
        try:
            self._submit(self._peer_lost, dead)
        except PdError:
            log.error("%s peer: could not queue the loss of %s", self.ROLE, dead.endpoint)
