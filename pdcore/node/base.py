"""What every role's peer runs on (prefill, decode, encode): its planes, its driver, its engines,
the registration with a bootstrap server. ``pdcore.pd.peer`` adds the PD transfer table and its
round; ``pdcore.epd.encode`` the encode rank's rooms.

A peer's protocol lives in its role engines (``pdcore.protocol``: sans-IO), run
by one ``Driver`` (``pdcore.node.driver``) on one thread. Threads of a peer:

- the **scheduler thread** calls ``register``/``poll``/``abort_room``/... They
  touch the state table (its calls are atomic) and submit inputs to the driver;
  they never wait on the network.
- the **driver thread** runs every engine input in order and performs the
  engines' actions: control frames, grants and revokes, posting writes. Each
  input is bounded; an exception is logged and counted, and the rest goes on.
- the driver's **I/O threads** (a few) do what may wait on another host:
  bootstrap look-ups and transport connects. Their results go back through the
  driver, so an unreachable endpoint delays only the rooms that need it.
- the control channel's **I/O thread** decodes frames and submits them; the
  transport's threads submit completions.

Everything here is bounded: the driver's inputs, the I/O queue, every wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

import transport as transport_mod

from ..control import wire
from ..control.auth import resolve_secret, warn_unauthenticated
from ..control.bootstrap import BootstrapClient, RankRegistration
from ..control import plane as control_plane
from ..control.liveness import DeadPeer
from ..core.deadline import Deadline, DeadlineExceeded
from ..core.errors import PdError, PeerError, StartError
from ..protocol.engine import EngineInputs, Services
from .config import NodeConfig
from .device import staged_transport
from .driver import Driver

__all__ = ["PeerBase"]

log = logging.getLogger("pdcore.peer")

_FAREWELL_WAIT = 1.0  # seconds close() waits for the engines' farewell frames to be queued


class PeerBase:
    """Resources and threads of one rank's peer; the roles (``pdcore.pd.peer.PdPeer``, ``EncodePeer``)
    add their engines and scheduler-side state through the hooks at the end."""

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
        self._owned = contextlib.ExitStack()
        self._closed = False
        self._driver: Driver | None = None
        self._engine: EngineInputs | None = None  # the role's engine (a prefill peer's receiver engine rides on the same driver)
        self._noted: Any = None  # ``noted`` of the engine that grants here, once a note looked it up (_on_note)
        self.stats: dict[str, int] = {"work_errors": 0, "protocol_errors": 0}
        self._staged = False  # the memory peers write into here is device memory (``pdcore.node.device``)

    # -- start and stop -----------------------------------------------------------------

    def _start(self) -> None:
        """Transport, registered memory, control channel, engines, driver; a half-built peer unwinds."""
        cfg = self._config
        options = dict(cfg.transport_options)
        if cfg.transport == "tcp":
            options.setdefault("host", cfg.host)
        if self._secret is not None:
            options.setdefault("secret", self._secret)
        with contextlib.ExitStack() as stack:
            self._transport = staged_transport(transport_mod.create(cfg.transport, **options), cfg, self._buffers())
            stack.callback(self._transport.close)
            self._register_memory()
            path = getattr(self._transport, "device_path", "host")
            if path != "host":
                log.info("%s peer: device memory reaches the transport through %s (%s)", self.ROLE, path,
                         getattr(self._transport, "device_path_reason", ""))
            self._channel = control_plane.create(
                cfg.control,
                self._on_frame,
                cfg.control_options,
                session_id=self.session_id,
                epoch=self.epoch,
                on_rooms_failed=self._on_rooms_failed,
                on_peer_dead=self._on_peer_dead,
                on_peer_back=self._on_peer_back,
                host=cfg.host,
                heartbeat_interval=cfg.heartbeat_interval,
                dead_after=cfg.dead_after,
                secret=self._secret,
            )
            self._driver = Driver(
                self.ROLE, transport=self._transport, channel=self._channel,
                secret=self._secret, max_inputs=16 * cfg.max_pending, io_queue=cfg.max_pending, stats=self.stats,
            )
            self._engine = self._make_engine(self._services())
            self._driver.attach(self._engine)
            self._transport.on_note(self._on_note)
            self._channel.start()
            stack.callback(self._channel.close)
            self._publish(stack)
            self._driver.start()
            stack.callback(self._driver.close)
            self._owned = stack.pop_all()

    def _services(self, **extra: Any) -> Services:
        """What this rank's engines are given (``pdcore.protocol.engine.Services``)."""
        regions = tuple(wire.Region(addr=r.addr, length=r.length, key=r.key) for r in self._transport.regions())
        base: dict[str, Any] = dict(config=self._config, session_id=self.session_id, epoch=self.epoch,
                                    table=getattr(self, "_table", None), endpoint=self._transport.endpoint(),
                                    regions=regions, layout=getattr(self, "_layout", None),
                                    counts=getattr(self, "counts", None), stats=self.stats, deliver=self._deliver,
                                    staged=self._staged, notes=self._config.data_path_completion and self._transport.carries_notes)
        base.update(extra)
        return Services(**base)

    @property
    def port(self) -> int:
        """The control socket's port."""
        return int(self._channel.endpoint.rsplit(":", 1)[1])

    @property
    def control_endpoint(self) -> str:
        return self._channel.endpoint

    def close(self) -> None:
        """Tell peers about rooms still in flight, stop every thread, free the registered memory."""
        if self._closed:
            return
        self._closed = True
        driver = self._driver
        if driver is not None:
            try:
                done = threading.Event()
                for engine in driver.engines:
                    driver.submit_result(engine.close)  # farewell frames, queued before the channel closes
                driver.call(done.set)
                done.wait(_FAREWELL_WAIT)
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

    def _check_open(self) -> None:
        if self._closed:
            raise PeerError(f"{self.ROLE} peer: closed")

    def quiesce(self, seconds: float = 5.0) -> bool:
        """Wait (at most ``seconds``) until the driver ran every input submitted before this call: the
        engines then hold what the scheduler's calls and rounds so far imply. False if it did not."""
        driver = self._driver
        if driver is None or self._closed:
            return True
        done = threading.Event()
        driver.call(done.set)
        return done.wait(seconds)

    def run_on_driver(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` (no ``now``) on the driver's thread, after every input submitted before this
        call: where the engines' state lives, so a benchmark or a test that reads or sets it there does not
        race the driver. ``PeerError`` once closed."""
        driver = self._driver
        if driver is None or self._closed:
            raise PeerError(f"{self.ROLE} peer: closed")
        driver.call(fn, *args)

    def _submit(self, fn: Any, *args: Any) -> None:
        """An input for the driver's thread (``fn(*args, now)``); ``PdError`` when it cannot take it."""
        driver = self._driver
        if driver is None or self._closed:
            raise PeerError(f"{self.ROLE} peer: closed")
        driver.submit(fn, *args)

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

    def wait_for_news(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for this rank's driver to run an input (a frame, a completion, a note, a look-up
        answer: what may change what ``poll`` reports) since the last call; whether one ran. For a scheduler with
        nothing to compute but transfers to wait for: its next step costs a wake-up, not a spin of empty rounds.
        It waits on this rank's driver alone, never on a peer, and never longer than ``seconds``."""
        driver = self._driver
        if driver is None:
            return False
        news = driver.news.wait(seconds)
        driver.news.clear()
        return news

    def handoffs(self) -> int:
        """Thread hand-offs so far, a cost metric the benchmarks divide by requests: the times the driver's
        thread took inputs from other threads (the scheduler's calls, control frames, completions, I/O
        results; what they queued while it worked counts once, ``pdcore.node.driver``'s lane, and
        ``stats["lane_inputs"]`` counts the inputs) plus frames handed to the control plane's thread (on a
        plane whose loop is the driver's, none). The transport's own threads are not counted."""
        stats = getattr(self._channel, "stats", None)
        hands_off = getattr(self._channel, "FRAMES_HAND_OFF", True)
        frames = 0 if stats is None or not hands_off else stats.sent - stats.heartbeats_sent
        return self.stats.get("handoffs", 0) + frames

    def control_sends(self) -> tuple[int, int]:
        """Frames and ZeroMQ messages the control channel sent so far, heartbeats aside (a cost metric, as
        ``handoffs``): frames to one peer in one pass of its thread share a message, so frames per message
        says how much the batching shared."""
        stats = getattr(self._channel, "stats", None)
        if stats is None:
            return 0, 0
        return stats.sent - stats.heartbeats_sent, stats.messages_sent - stats.heartbeats_sent

    def connected_peers(self) -> int:
        """Peers whose data connection is up (a metric)."""
        return int(getattr(self._engine, "connected_peers", lambda: 0)())

    def diagnostics(self) -> dict[str, Any]:
        """A read-only snapshot of what this rank holds and has counted, for metrics, tools and tests.

        Any thread may call it; it changes nothing and waits for nothing. Each figure is read once
        (the driver's thread goes on meanwhile, so figures of different parts may be a moment apart):

        - ``stats``: the peer's counters (``work_errors``, ``protocol_errors``, ``inputs``,
          ``handoffs``, ``posts_parked``);
        - ``queues``: inputs queued for the driver, I/O items, posts parked for full sinks, control
          frames queued to send;
        - ``engines``: per role engine, what it holds (rooms, requests, the grants it made and has not
          revoked, parked announcements, look-ups waiting, revokes to retry, ...), its tombstones and
          connected peers;
        - ``channel``: the control channel's counters; ``transport``: the data plane's;
        - the role's own parts (``table``, ``front``, ``receiver``).
        """
        driver, channel, transport = self._driver, getattr(self, "_channel", None), getattr(self, "_transport", None)
        out: dict[str, Any] = {"role": self.ROLE, "session_id": self.session_id, "epoch": self.epoch,
                               "closed": self._closed, "stats": dict(self.stats)}
        queues = {"inputs": 0, "io": 0, "parked_posts": 0, "control_out": 0}
        engines: dict[str, Any] = {}
        if driver is not None:
            queues.update(driver.depths(), parked_posts=driver.parked())
            engines = {engine.ROLE: _retry(engine.diagnostics) for engine in driver.engines}
        if channel is not None:
            queues["control_out"] = channel.queued()
            out["channel"] = dict(vars(channel.stats))
            faults = getattr(channel, "faults", None)
            if faults is not None:  # a faulty plane (chaos): what it did, and corrupted frames that still decoded
                out["control_faults"] = dict(faults)
                out["control_samples"] = list(getattr(channel, "samples", ()))
        out["queues"], out["engines"] = queues, engines
        if transport is not None:
            out["transport"] = {name: getattr(transport, name, 0) for name in (
                "revoke_method", "auth_failures", "evicted_handshakes", "refused_connections", "accept_failures",
                "windows_live")}
            out["transport"]["device_path"] = getattr(transport, "device_path", "host")  # pdcore.node.device
            faults = getattr(transport, "stats", None)
            if isinstance(faults, dict):
                out["transport"]["faults"] = dict(faults)
        self._diagnose(out)
        return out

    # -- role hooks -----------------------------------------------------------------------

    def _init_state(self) -> None:
        """The role's scheduler-side state, made before any thread starts (a role without any needs nothing)."""

    def _register_memory(self) -> None:
        """Register the role's memory with the transport (``self._transport``), before the channel opens."""
        raise NotImplementedError

    def _buffers(self) -> tuple[Any, ...]:
        """The memory this role's config gives the transport (device memory among it is staged)."""
        return ()

    def _make_engine(self, services: Services[Any, Any]) -> EngineInputs:
        """The role's engine (``pdcore.protocol``), given what it needs."""
        raise NotImplementedError

    def _publish(self, stack: contextlib.ExitStack) -> None:
        """Publish the role's metrics, if it has any; ``stack`` undoes it at close (or a failed start)."""

    def _route(self, msg: wire.Message) -> EngineInputs | None:
        """The engine a frame goes to (one engine per role; a prefill peer's receiver takes EPD statuses)."""
        return self._engine

    def _deliver(self, kind: str, key: Any, value: Any) -> None:
        """A value an engine hands the scheduler's side (``Services.deliver``; the driver's thread)."""

    def _diagnose(self, out: dict[str, Any]) -> None:
        """Add the role's parts to ``diagnostics()``'s snapshot."""

    # -- control-plane callbacks (its I/O thread): hand over to the driver, never block ---------

    def _on_frame(self, sender: str, msg: wire.Message) -> None:
        release = self._channel.hold()  # the frame counts against its sender's quota until handled
        engine = self._route(msg)
        try:
            self._driver.submit(_Frame(engine, release), sender, msg)  # type: ignore[union-attr]
        except PdError as e:
            release()
            self._on_rooms_failed(wire.rooms_of(msg), f"{self.ROLE} peer overloaded: {e}")

    def _on_note(self, grant: int, note: bytes) -> None:
        """A note rode a batch that landed here (a transport thread): the engine that grants what is written here
        hears (a decode rank's, or a prefill rank's EPD receiver; one a peer)."""
        driver = self._driver
        if driver is None:
            return
        noted = self._noted
        if noted is None:  # looked for once: a driver's engines are only ever added, and one of a peer grants
            noted = self._noted = next((e.noted for e in driver.engines if hasattr(e, "noted")), None)
            if noted is None:
                return
        driver.submit_result(noted, grant, note)

    def _on_rooms_failed(self, rooms: tuple[int, ...], reason: str) -> None:
        self.stats["protocol_errors"] += 1
        if self._driver is None or not rooms:
            return
        for engine in self._driver.engines:
            self._driver.submit_result(engine.rooms_failed, rooms, reason)

    def _on_peer_dead(self, dead: DeadPeer) -> None:
        if self._closed or self._driver is None:
            return  # closing: nothing left to fail
        for engine in self._driver.engines:
            self._driver.submit_result(engine.peer_dead, dead.endpoint, dead.session_id, dead.epoch, dead.reason)

    def _on_peer_back(self, endpoint: str, session_id: str, epoch: int) -> None:
        if self._closed or self._driver is None:
            return
        for engine in self._driver.engines:
            back = getattr(engine, "peer_back", None)
            if back is not None:
                self._driver.submit_result(back, endpoint, session_id, epoch)


class _Frame:
    """A frame for ``engine``: handled on the driver's thread, then released from its sender's quota."""

    __slots__ = ("__self__", "_release")

    def __init__(self, engine: Any, release: Any) -> None:
        self.__self__ = engine  # the driver performs this engine's actions after the input
        self._release = release

    def __call__(self, sender: str, msg: wire.Message, now: float) -> None:
        try:
            self.__self__.message(sender, msg, now)
        finally:
            self._release()


def _retry(read: Any) -> Any:
    """``read()`` on this thread while the driver's thread may be changing what it reads: a dict that changed
    size under an iteration is read again (a few times; then what it raised goes up)."""
    for _ in range(4):
        try:
            return read()
        except RuntimeError:
            continue
    return read()
