"""What every role's peer runs on (prefill, decode, encode): resources, the worker and I/O threads,
the control channel, the registration with a bootstrap server. ``pdcore.pd._peer`` adds the PD
transfer table and its round; ``pdcore.epd.encode`` the encode rank's rooms.

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

Everything here is bounded: the work queue, the I/O queue, every wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import transport as transport_mod

from ..control import wire
from ..control.auth import resolve_secret, warn_unauthenticated
from ..control.bootstrap import BootstrapClient, RankRegistration
from ..control.channel import ControlChannel, DeadPeer
from ..core.deadline import Deadline, DeadlineExceeded
from ..core.errors import CapacityError, PdError, PeerError, StartError
from .config import NodeConfig

__all__ = ["PeerBase"]

log = logging.getLogger("pdcore.peer")

_TICK = 0.05  # the worker's period for deadlines when idle
_IO_THREADS = 4


class PeerBase:
    """Resources and threads of one rank's peer; the roles (``pdcore.pd._peer.PdPeer``, ``EncodePeer``)
    add their state and protocol through the hooks at the end."""

    ROLE = "peer"

    def __init__(self, config: NodeConfig) -> None:
        self._config: Any = config
        self._secret = resolve_secret(config.secret)  # before the first word with anyone
        if self._secret is None:
            warn_unauthenticated(f"{self.ROLE} peer")
        self.session_id = f"{self.ROLE}-{os.urandom(6).hex()}"
        self.epoch = time.time_ns() // 1000  # a restarted rank comes back with a larger epoch
        self._agreement: Any = None  # a role with a replica round sets it; close() releases it
        self._init_state()
        self._lock = threading.RLock()
        self._work: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.Queue(4 * config.max_pending)
        self._io_work: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue(config.max_pending)
        self._stop = threading.Event()
        self._owned = contextlib.ExitStack()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._io_threads: list[threading.Thread] = []
        self.stats: dict[str, int] = {"work_errors": 0, "protocol_errors": 0}

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
            self._publish(stack)
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

    def connected_peers(self) -> int:
        """Peers this rank has a control connection to (a metric)."""
        return len(self._channel._dealers)

    # -- role hooks -----------------------------------------------------------------------

    def _init_state(self) -> None:
        """The role's own state, made before any thread starts (a role without any needs nothing)."""

    def _register_memory(self) -> None:
        """Register the role's memory with the transport (``self._transport``), before the channel opens."""
        raise NotImplementedError

    def _publish(self, stack: contextlib.ExitStack) -> None:
        """Publish the role's metrics, if it has any; ``stack`` undoes it at close (or a failed start)."""

    def _tick(self, now: float) -> None:
        """Worker, every ``_TICK`` when idle and at least that often when busy: the role's deadlines."""

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
