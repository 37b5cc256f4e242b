"""The control channel: the ZeroMQ I/O edge that carries ``pdcore.control.wire`` frames.

Socket pattern: each channel binds one **ROUTER** (receive) and opens one
**DEALER** per peer endpoint it sends to (connect). Why not PUSH/PULL (as
other engines' disaggregation code uses):

- A ROUTER prefixes every frame with the sending connection's routing id,
  which each DEALER sets to its channel's own bound endpoint. So the receiver
  learns *who* sent a frame (and where to answer) from the transport, without
  a reply address inside every message.
- ``ROUTER_HANDOVER`` lets a restarted peer that comes back with the same
  identity take the route over at once. Handing over renames the old
  connection's pipe to a routing id libzmq generates (five bytes, the first
  zero): frames still queued on it arrive under that id. They are counted in
  ``stats.superseded_frames`` and fail the rooms they name, without a protocol
  error per frame.
- One DEALER per endpoint keeps per-peer FIFO (a registration is delivered
  before the announcements that follow it), as PUSH would.

Threads: one I/O thread owns every socket (ZMQ sockets are not thread-safe).
``send`` may be called from any thread: it encodes and validates the message
(raising ``LocalProtocolError`` to the caller), puts it on a bounded queue and
wakes the I/O thread through a socket pair; it never blocks. The I/O thread
sends with ``DONTWAIT`` under ``SNDHWM``; a frame that cannot be sent fails the
rooms it names through ``on_rooms_failed``. Received frames are decoded; a
``RemoteProtocolError`` is counted in ``stats.protocol_errors`` and fails the
rooms it names, and the thread carries on. Callbacks run on the I/O thread and
must not block; an exception in one is logged and counted, never fatal.

The rooms beside this one, each with the why of its rule:

- ``pdcore.control.quotas``: what a sender, and all senders together, may hold
  (``max_bytes_per_sender``, ``max_bytes_total``; ``hold()``'s release token).
- ``pdcore.control.pending``: the connections the ROUTER accepted that no frame
  came on yet, at most ``max_pending``, and how one is cut (never a socket that
  is not the connection its event named).
- ``pdcore.control.fd_reserve``: the descriptors kept for the channels' own
  sockets and connects, so that a proven peer is answered through a flood.
- ``pdcore.control.handshake``: the CURVE keys, the ZAP rule, and what a
  monitor event says about a handshake (sans-IO).

Authentication (``secret``): ZeroMQ's own CURVE mechanism with one key pair
derived from the deployment secret (``auth.derive_key(secret,
"control-curve")``), which every rank holds. The ROUTER is a CURVE server, every
DEALER a client of it; the I/O thread answers ZeroMQ's authentication requests
(ZAP, RFC 27) and admits only a client that proved it holds the deployment's
secret key. So only the deployment's ranks can connect, and then each frame is
encrypted and authenticated by CURVE (no forgery, no replay: a frame is bound
to its connection's short-term keys and nonce). Within the deployment a rank
is trusted to claim its own endpoint as routing id; an outsider cannot claim
any, nor take a live identity over through ``ROUTER_HANDOVER``. A failed
handshake is counted (``stats.auth_failures``) and logged at most once per
``AUTH_LOG_EVERY`` per endpoint; on the connecting side it declares that peer
dead with a reason that starts with "authentication failed", so the rooms
waiting on it fail at once. Without a secret the channel runs on ZeroMQ's NULL
mechanism, as before, and says so once per process; a secured peer that hangs
up on it may reset the connection before its greeting is read, so such a side
reports the peer gone "(it went away, or it requires a secret ...)".

Liveness: every channel sends a ``Heartbeat`` (session id, epoch, seq) to each
peer it has a DEALER to, every ``heartbeat_interval``. A peer that has sent
nothing for ``dead_after``, or that comes back with a newer epoch, is reported
once through ``on_peer_dead`` (``PeerLiveness`` is the sans-IO rule); a peer
that introduces itself while none is tracked at its endpoint (new, or heard
again after it was dropped: a paused process that resumed) through
``on_peer_back``. A process that was paused (SIGSTOP, a debugger, a swap storm) hears nothing while
it is stopped: on waking it gives every peer a fresh ``dead_after`` instead of
declaring them all dead for its own silence.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, Final

import zmq
from zmq.utils import monitor, z85

from transport.threads import named_thread

from . import auth, wire
from .channel_stats import ChannelStats
from .fd_reserve import FD_RESERVE, Spares, Windows, fd_reserve
from .handshake import (
    DEALER_EVENTS, HANDSHAKE_FAILED, OPENED, PEER_CLOSED, ROUTER_EVENTS, curve_keys, handshake_failure, zap_reply,
)
from .liveness import DeadPeer, PeerLiveness
from .pending import MAX_PENDING, PendingConnections
from .plane_base import HANDSHAKE_TIMEOUT, OnMessage, PlaneBase, format_endpoint
from ..core.deadline import Deadline, DeadlineExceeded
from ..core.errors import CapacityError, LocalProtocolError, PeerError, RemoteProtocolError, StartError

__all__ = [
    "ControlChannel", "ChannelStats", "DeadPeer", "PeerLiveness", "MAX_PENDING", "HANDSHAKE_TIMEOUT", "FD_RESERVE",
    "curve_keys", "zap_reply",
]

log = logging.getLogger("pdcore.control")

_RECV_BATCH: Final = 256  # messages handled per wake before the send queue gets a turn
_MAX_PARTS: Final = 64  # frames to one peer in one message (one pass's; more go as further messages)
_FD_WAIT: Final = 1.0  # seconds frames wait for a descriptor to make their peer's socket before they fail
_ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"  # where libzmq asks a context's authentication handler
_EVENTS: Final = int(zmq.EVENTS)  # plain ints: the enums cost a conversion per read on the hot path
_POLLIN: Final = int(zmq.POLLIN)
_NOBLOCK: Final = int(zmq.NOBLOCK)  # recv_multipart's flags and RCVMORE cost enum conversions per message: recv, Frame.more
_DONTWAIT: Final = int(zmq.DONTWAIT)
_MONITOR_RCVHWM: Final = 1 << 14  # events queued for the I/O thread: libzmq never waits on a full monitor pipe
_RETRY_LEAD: Final = 0.002  # seconds before libzmq's retry of a connect that the reserve opens for it
_CONNECT_WAIT: Final = 5.0  # seconds a new DEALER whose connection found no descriptor is made again, its frames held


class ControlChannel(PlaneBase):
    """One bound ROUTER, DEALERs to peers, and the I/O thread that runs them."""

    def __init__(
        self, on_message: OnMessage, *, sndhwm: int = 1000, linger: float = 1.0, secret: bytes | None = None,
        **options: Any,
    ) -> None:
        """``options``: ``PlaneBase``'s (``session_id``, the callbacks, ``host``, timing, bounds); ``sndhwm``
        bounds the ZeroMQ messages queued to one peer, ``linger`` what ``close`` waits for them."""
        super().__init__(on_message, **options)
        max_pending, handshake_timeout = self._max_pending, self._handshake_timeout
        self._conns = PendingConnections(max_pending, self.stats, self._handshake_failed)
        self._windows = Windows(self._conns)  # this channel's openings of the fd reserve
        self._spares = Spares(self._new_dealer, self._windows)  # DEALERs made ahead, with monitors
        self._handshake_ms = max(1, int(handshake_timeout * 1000))
        self._curve = curve_keys(auth.check_secret(secret, "control channel")) if secret is not None else None
        self._curve_key = z85.decode(self._curve[0]) if self._curve is not None else b""
        self._sndhwm = sndhwm
        self._linger_ms = int(linger * 1000)
        self._init_io_state()

    def _init_io_state(self) -> None:
        """What the I/O thread owns (sockets, the callers' queue, the connects to peers), empty until ``start``."""
        self._monitors: dict[zmq.Socket[bytes], str] = {}  # a DEALER's handshake monitor -> its endpoint
        self._monitor_of: dict[str, zmq.Socket[bytes]] = {}  # ... and back
        self._poller = zmq.Poller()
        self._zap: zmq.Socket[bytes] | None = None
        # frames the callers queued, for the I/O thread: a deque (append and popleft hold no lock of their own:
        # a bounded queue.Queue cost ~1.3 us a frame in locks); at most max_queue, plus one per thread
        # queueing at the same instant (the length is checked, then appended)
        self._outq: collections.deque[tuple[str, bytes | None, tuple[int, ...]]] = collections.deque()
        # frames whose peer's socket could not be made for want of descriptors: (first try, frames), tried each pass
        self._short_of_fds: dict[str, tuple[float, list[tuple[bytes, tuple[int, ...]]]]] = {}
        self._retries: dict[str, float] = {}  # endpoint -> when libzmq tries again a connect that found no descriptor
        self._opened: set[str] = set()  # endpoints whose latest connect has its socket
        self._connecting: dict[str, float] = {}  # endpoint -> first try of a new DEALER whose connect has no socket yet
        self._remake: set[str] = set()  # those whose DEALER was closed to be made again (its connect found no socket)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._senders: dict[bytes, str] = {}  # routing ids already validated (checked once, not per frame)
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._wake_owed = False  # a wake-up byte is on its way: a later frame of the same pass needs none
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._close_deadline = Deadline.never()

    # ------------------------------------------------------------------ caller side

    def start(self) -> str:
        """Bind the ROUTER to a port the OS picks, start the I/O thread; returns the endpoint."""
        if self._ctx is not None:
            raise StartError("control channel: start() may be called once")
        if self._advertise in ("0.0.0.0", "::", ""):
            raise StartError(f"control channel: bound to wildcard {self._host!r}; pass advertise_host")
        fd_reserve.setup()
        try:
            self._conns.open_slots()
        except OSError as e:
            self._conns.close_slots()
            raise StartError(f"control channel: cannot open {os.devnull}: {e}") from e
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()  # one I/O thread: see pdcore.control.pending
        self._ctx = ctx
        router = ctx.socket(zmq.ROUTER)
        try:
            if self._curve is not None:
                self._secure_router(ctx, router)
            else:
                auth.warn_unauthenticated("control channel")
            self._conns.monitor = self._monitor_router(ctx, router)  # before the bind: every connection is seen
            router.setsockopt(zmq.HANDSHAKE_IVL, self._handshake_ms)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES + 1024)
            # per sender, in frames: ZeroMQ's queue then holds at most about one quota of bytes
            router.setsockopt(zmq.RCVHWM, max(16, self._quotas.per_sender // wire.MAX_FRAME_BYTES))
            if ":" in self._host:
                router.setsockopt(zmq.IPV6, 1)
            bind_host = f"[{self._host}]" if ":" in self._host else self._host
            port = router.bind_to_random_port(f"tcp://{bind_host}")
            endpoint = format_endpoint(self._advertise, port)
            wire.check_endpoint(endpoint)
        except (zmq.ZMQError, LocalProtocolError) as e:
            router.close(0)
            for sock in (self._zap, self._conns.monitor):
                if sock is not None:
                    sock.close(0)
            ctx.term()
            self._conns.close_slots()
            raise StartError(f"control channel: cannot bind {self._host!r}: {e}") from e
        self._router = router
        self._conns.port = port
        self._endpoint = self._conns.label = self._spares.label = endpoint
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = named_thread(self._run, f"pdcore-control-{port}")
        self._thread.start()
        return endpoint

    def _secure_router(self, ctx: zmq.Context[zmq.Socket[bytes]], router: zmq.Socket[bytes]) -> None:
        """CURVE server with our handler behind ZAP (its monitor then reports failed handshakes too)."""
        assert self._curve is not None
        public, secret = self._curve
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)  # before the ROUTER binds: no handshake may go unchecked
        router.setsockopt(zmq.CURVE_SERVER, 1)
        router.setsockopt(zmq.CURVE_SECRETKEY, secret)
        router.setsockopt(zmq.CURVE_PUBLICKEY, public)
        router.setsockopt(zmq.ZAP_DOMAIN, b"pdcore")

    def _monitor_router(self, ctx: zmq.Context[zmq.Socket[bytes]], router: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
        """The ROUTER's monitor: connections accepted and gone (their fds), and with a secret the
        failed handshakes. Its pipe holds ``_MONITOR_RCVHWM`` events: libzmq's I/O thread sends
        them blocking, and one waiting on a full pipe while this thread waits for libzmq's monitor
        lock (``disable_monitor`` at close) would never wake."""
        address = f"inproc://pdcore-control-monitor-{id(self):x}"
        router.monitor(address, ROUTER_EVENTS | (HANDSHAKE_FAILED if self._curve is not None else 0))
        mon = ctx.socket(zmq.PAIR)
        mon.setsockopt(zmq.LINGER, 0)
        mon.setsockopt(zmq.RCVHWM, _MONITOR_RCVHWM)
        mon.connect(address)
        return mon

    def queued(self) -> int:
        """Frames queued for the I/O thread now (a metric)."""
        return len(self._outq)

    def pending_connections(self) -> int:
        """Connections accepted that no frame came on yet, as the last pass of the I/O thread that
        read the monitor to its end left them: at most ``max_pending`` (libzmq may have accepted a
        burst more since: the next pass cuts it)."""
        return self._conns.seen

    def _enqueue(self, endpoint: str, frame: bytes | None, rooms: tuple[int, ...]) -> None:
        if self._thread is None or self._stopping:
            raise PeerError("control channel: not running")
        if len(self._outq) >= self._max_queue:
            raise CapacityError(f"control channel: {self._max_queue} frames already queued")
        self._outq.append((endpoint, frame, rooms))
        if not self._wake_owed:  # cleared by the I/O thread only after it read the wake-ups, before it flushes
            self._wake_owed = True
            self._wake()

    def _wake(self) -> None:
        try:
            assert self._wake_w is not None
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):  # full: a wake-up is pending anyway; closed: nothing to wake
            pass

    def close(self, deadline: Deadline | None = None) -> None:
        """Stop the I/O thread and close every socket (queued frames get ``linger``). Idempotent.

        Raises ``DeadlineExceeded`` if the thread is alive at the deadline (default 5 s).
        """
        deadline = deadline or Deadline.after(5.0)
        thread = self._thread
        if thread is None:
            return
        if threading.current_thread() is thread:
            raise RuntimeError("control channel: close() called from a callback")
        self._close_deadline = deadline
        self._stopping = True
        self._wake()
        thread.join(deadline.remaining())
        if thread.is_alive():  # it still closes its sockets itself when it gets there
            raise DeadlineExceeded("control channel: the I/O thread did not stop by the deadline")

    # ------------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug in this module, not bad input: say so loudly
            log.exception("control channel %s: I/O thread failed", self._endpoint)
        finally:
            self._shutdown()

    def _loop(self) -> None:
        assert self._router is not None and self._wake_r is not None
        poller = self._poller
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        for sock in (self._zap, self._conns.monitor):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        next_beat = last_tick = time.monotonic()
        self._spares.fill()
        while not self._stopping:
            timeout_ms = max(0, int((next_beat - time.monotonic()) * 1000) + 1)
            if self._short_of_fds or self._windows.busy() or self._remake or self._spares.wanted():
                timeout_ms = min(timeout_ms, 10)  # something waits for a descriptor: come back soon
            if self._retries:
                due = min(self._retries.values()) - _RETRY_LEAD - time.monotonic()
                timeout_ms = min(timeout_ms, max(0, int(due * 1000)))
            ready = dict(poller.poll(timeout_ms))
            woken = self._wake_r.fileno() in ready
            if woken:
                self._drain_wake()
                self._wake_owed = False  # after the read: a frame queued from here on sends its own wake-up
            if self._stopping:
                break
            if self._zap is not None and self._zap in ready:
                self._answer_zap()
            if self._conns.monitor is not None and self._conns.monitor in ready:
                self._conns.read_events()
            if self._monitors:
                for sock in [s for s in ready if s in self._monitors]:
                    self._dealer_handshakes(sock)
            if woken or self._frames_waiting():  # every frame queued wakes this thread: no wake-up, nothing new
                self._flush()
            if self._router in ready:
                self._receive()
            if self._conns.crowded():
                self._conns.evict()
            if self._windows.busy() or self._retries or self._remake:
                self._watch_reserve()
            if self._spares.due():
                self._spares.fill()
            self._conns.note_pass()
            now = time.monotonic()
            if now >= next_beat:
                if now - last_tick > max(3 * self._interval, self._liveness.dead_after / 2):
                    self._liveness.pardon(now)  # we were stopped: silence while we slept proves nothing
                self._tick(now)
                last_tick, next_beat = now, now + self._interval

    def _frames_waiting(self) -> bool:
        """Frames from an earlier pass wait to be sent (for a file descriptor): this pass flushes even unwoken."""
        return bool(self._short_of_fds)

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        try:
            while len(self._wake_r.recv(4096)) == 4096:  # a short read took every byte there was
                pass
        except BlockingIOError:
            pass

    def _flush(self) -> None:
        """Send what the callers queued, in order: the frames one peer is owed in this pass go as the
        parts of one message (at most ``_MAX_PARTS``), so a burst costs each side one send and one
        receive per peer, and a lone frame still goes at once (a pass never waits for more). Frames
        that waited for a descriptor (see ``_send_gathered``) go first, before what came since."""
        waited, self._short_of_fds = self._short_of_fds, {}
        owed: dict[str, list[tuple[bytes, tuple[int, ...]]]] = {e: gathered for e, (_, gathered) in waited.items()}
        outq = self._outq
        while outq:
            endpoint, frame, rooms = outq.popleft()  # only this thread takes: a non-empty deque stays so
            if frame is None:  # a drop, after what was queued for that peer before it
                gathered = owed.pop(endpoint, None)
                if gathered:
                    self._send_gathered(endpoint, gathered, waited.get(endpoint, (None,))[0])
                self._drop_peer(endpoint)
                continue
            owed.setdefault(endpoint, []).append((frame, rooms))
        for endpoint, gathered in owed.items():
            self._send_gathered(endpoint, gathered, waited.get(endpoint, (None,))[0])

    def _send_gathered(self, endpoint: str, gathered: list[tuple[bytes, tuple[int, ...]]], since: float | None) -> None:
        """Send ``gathered`` to ``endpoint`` in messages of at most ``_MAX_PARTS`` frames. Where the socket to
        it cannot be made for want of file descriptors (a flood of connections holds them, and cuts free
        some every moment), the frames wait for a later pass, up to ``_FD_WAIT`` seconds from ``since``
        (their first try), before they fail: one unlucky instant must not cost a peer its frames. While a new
        DEALER's connection has no socket yet (``_connecting``), they wait for it in the same way, and go
        into its queue once it has one, or once it is no longer made again."""
        if endpoint not in self._dealers:
            try:
                self._dealer(endpoint)
            except zmq.ZMQError as e:
                now = time.monotonic()
                if e.errno in (errno.EMFILE, errno.ENFILE) and now - (since or now) < _FD_WAIT:
                    self._short_of_fds[endpoint] = (since or now, gathered)
                    return
            except CapacityError:
                pass  # _send_now names it
        if endpoint in self._connecting:  # its DEALER may be made again (_dealer_handshakes): they would go with it
            now = time.monotonic()
            if len(gathered) < self._max_queue and now - (since or now) < _CONNECT_WAIT:
                self._short_of_fds[endpoint] = (since or now, gathered)
                return
            del self._connecting[endpoint]  # into its queue after all: that DEALER stays (libzmq tries again)
        for start in range(0, len(gathered), _MAX_PARTS):
            part = gathered[start : start + _MAX_PARTS]
            self._send_now(endpoint, [frame for frame, _ in part], tuple(r for _, rooms in part for r in rooms))

    def _dealer(self, endpoint: str) -> zmq.Socket[bytes]:
        """The DEALER to ``endpoint``, connecting one if there is none: a spare, else one made now with
        the fd reserve open (``Spares.take``; see pdcore.control.fd_reserve). The reserve opens again just before
        the connect, for the socket libzmq's I/O thread opens when it takes it, and closes when the
        DEALER's monitor says it was taken; until its connection has a socket the DEALER is
        ``_connecting``, and one whose connect found none is made again (``_dealer_handshakes``)."""
        sock = self._dealers.get(endpoint)
        if sock is not None:
            return sock
        if len(self._dealers) >= self._max_peers:
            raise CapacityError(f"already connected to {self._max_peers} peers")
        sock, mon = self._spares.take()
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        self._monitors[mon] = endpoint
        self._monitor_of[endpoint] = mon
        self._poller.register(mon, zmq.POLLIN)
        self._windows.open(endpoint)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            self._close_dealer(endpoint, sock)
            raise
        self._dealers[endpoint] = sock
        self._remake.discard(endpoint)
        self._connecting.setdefault(endpoint, time.monotonic())
        self._liveness.track(endpoint, time.monotonic())
        return sock

    def _new_dealer(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """A DEALER not connected yet, and its monitor: three descriptors (the two sockets' mailboxes and
        libzmq's end of the monitor). Raises ``zmq.ZMQError`` (EMFILE: none), leaving nothing open."""
        assert self._ctx is not None and self._endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.ROUTING_ID, self._endpoint.encode())
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.RCVHWM, 16)  # peers never answer on this socket
            sock.setsockopt(zmq.LINGER, self._linger_ms)
            if self._curve is not None:
                public, secret = self._curve
                sock.setsockopt(zmq.CURVE_SERVERKEY, public)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            # with or without a secret: a mismatch is named; a success is answered with a heartbeat (the proof);
            # and when the connect was taken (the reserve closes then)
            return sock, sock.get_monitor_socket(DEALER_EVENTS)
        except zmq.ZMQError:
            sock.close(0)
            raise

    def _close_dealer(self, endpoint: str, sock: zmq.Socket[bytes], linger: int = 0) -> None:
        self._windows.close(endpoint)
        self._retries.pop(endpoint, None)
        self._opened.discard(endpoint)
        mon = self._monitor_of.pop(endpoint, None)
        if mon is not None:
            self._poller.unregister(mon)
            del self._monitors[mon]
            sock.disable_monitor()
            mon.close(0)
        sock.close(linger)

    def _drop_peer(self, endpoint: str) -> None:
        sock = self._dealers.pop(endpoint, None)
        if sock is not None:
            self._close_dealer(endpoint, sock)
        self._connecting.pop(endpoint, None)
        self._remake.discard(endpoint)
        self._short_of_fds.pop(endpoint, None)  # discarded, as the frames in its DEALER's queue are
        self._liveness.forget(endpoint)

    # ------------------------------------------------------------------ authentication

    def _answer_zap(self) -> None:
        assert self._zap is not None and self._curve is not None
        for _ in range(_RECV_BATCH):
            try:
                request = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply, refused = zap_reply(request, self._curve_key)
            if refused is not None:
                self.stats.auth_refused += 1
                self._auth_failed(f"tcp://{refused}", "a client that is not of this deployment", dead=False)
            self._zap.send_multipart(reply)

    # ------------------------------------------------------------------ connections and the fd reserve

    def _watch_reserve(self) -> None:
        """A pass's care of the reserve: close windows whose connect never reported (bounded), open one
        for each connect libzmq is about to try again while this process is short of descriptors (a
        connection that found none, or one to a peer that went away), and give back what the flood took."""
        now = time.monotonic()
        self._windows.expire(now)
        for endpoint, when in list(self._retries.items()):
            if now >= when - _RETRY_LEAD:
                del self._retries[endpoint]
                heard = self._liveness.heard_at(endpoint)
                if heard is not None and now - heard < 2 * self._interval and self._conns.short():  # a live peer's
                    self._windows.open(endpoint)  # closed by that try's report
        self._windows.give_back()
        for endpoint in list(self._remake):
            self._remake.discard(endpoint)
            if endpoint not in self._dealers:
                try:
                    self._dealer(endpoint)
                except (zmq.ZMQError, CapacityError) as e:
                    log.warning("control channel: cannot connect to %s: %s", endpoint, e)

    def _cut(self, fd: int, inode: int) -> bool:
        """Shut the connection at libzmq's ``fd`` down if it is still the socket ``inode`` names (see
        ``PendingConnections.cut``); True if it was."""
        return self._conns.cut(fd, inode)

    def _handshake_failed(self, event: Mapping[str, object]) -> None:
        """A handshake on our bound socket failed: counted and logged (the monitor cannot name the peer)."""
        if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # our own handler's refusals are counted there
            self._auth_failed(f"a client of {self._endpoint}", handshake_failure(event, server=True), dead=False)

    def _dealer_handshakes(self, mon: zmq.Socket[bytes]) -> None:
        """A handshake with a peer we send to succeeded: a heartbeat goes at once, so the peer's
        channel sees a frame on the new connection (it no longer counts as pending there). Or it
        failed: that peer is dead to us, with the reason."""
        endpoint = self._monitors[mon]
        failure = None
        succeeded = False
        while mon.poll(0):
            event = monitor.recv_monitor_message(mon)
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                failure, succeeded = None, True
            elif kind & HANDSHAKE_FAILED:
                failure = handshake_failure(event)
            else:  # the connect was taken: it has its socket (opened), or it is tried again in `value` ms
                self._windows.close(endpoint)
                if kind & OPENED:
                    self._opened.add(endpoint)
                    self._retries.pop(endpoint, None)
                    self._connecting.pop(endpoint, None)
                else:
                    self.stats.connect_retries += 1
                    if endpoint in self._opened:  # that try had its socket: refused, or its connection ended
                        self._opened.discard(endpoint)
                    elif endpoint in self._connecting:  # a new one's connect found no descriptor
                        if time.monotonic() - self._connecting[endpoint] < _CONNECT_WAIT:
                            self._remade(endpoint)  # on our clock, not libzmq's: nothing is in its queue
                            return
                        self._connecting.pop(endpoint)  # libzmq tries again; held frames go into its queue
                    else:  # its socket found no descriptor: the reserve opens for the next try
                        assert isinstance(event["value"], int)
                        self._retries[endpoint] = time.monotonic() + event["value"] / 1000
        if failure is None:
            if succeeded and self._send_now(endpoint, [self._heartbeat()], ()):
                self.stats.heartbeats_sent += 1
            return
        if self._curve is None and failure == PEER_CLOSED:
            # No secret here: the peer went away, or it wants a secret and hung up before we read its greeting
            # (its reset can discard the greeting that would have told us). The reason says both.
            reason = (
                f"control handshake with {endpoint}: the peer closed the connection during the handshake "
                "(it went away, or it requires a secret this side lacks: is the secret the same on both sides?)"
            )
            self._peer_dead(DeadPeer(endpoint, *self._liveness.known(endpoint), reason), drop=True)
        else:
            self._auth_failed(endpoint, failure, dead=True)

    def _remade(self, endpoint: str) -> None:
        """Close the DEALER of ``endpoint`` whose first connect found no descriptor (nothing of ours is in
        its queue but heartbeats: its frames wait in ``_short_of_fds``); the next pass makes another."""
        sock = self._dealers.pop(endpoint, None)
        if sock is not None:
            self._close_dealer(endpoint, sock)
        self._remake.add(endpoint)
        self.stats.connects_remade += 1

    def _send_now(self, endpoint: str, frames: list[bytes], rooms: tuple[int, ...]) -> bool:
        """``frames`` to ``endpoint`` as one message (a frame a part); a message that cannot leave fails ``rooms``."""
        try:
            dealer = self._dealer(endpoint)
            if len(frames) == 1:
                dealer.send(frames[0], _DONTWAIT)
            else:
                dealer.send_multipart(frames, _DONTWAIT)
        except zmq.Again:
            reason = f"control channel to {endpoint} is full (peer slow or gone)"
        except (zmq.ZMQError, CapacityError) as e:
            reason = f"control channel to {endpoint}: {e}"
        else:
            self.stats.sent += len(frames)
            self.stats.messages_sent += 1
            return True
        self.stats.send_failures += 1
        log.warning("%s", reason)
        self._fail_rooms(rooms, reason)
        return False

    def _receive(self) -> None:
        assert self._router is not None
        router = self._router
        for _ in range(_RECV_BATCH):
            try:
                frame = router.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [frame]
            while frame.more:  # a message's parts are delivered together: the rest is here already
                frame = router.recv(_NOBLOCK, copy=False)
                frames.append(frame)
            self.stats.received += 1
            self._conns.heard_on(frames[-1])
            parts = [frame.bytes for frame in frames]
            if len(parts) < 2:  # a ROUTER always prepends the routing id: a message with no frame at all
                self._protocol_error(RemoteProtocolError("frame: a message without a frame"))
                continue
            for data in parts[1:]:  # a sender's frames of one pass, in order; a bad one costs only itself
                try:
                    self._handle(parts[0], data)
                except RemoteProtocolError as e:
                    self._protocol_error(e)
                except Exception:  # a bug of ours: logged and counted, the channel keeps serving
                    self.stats.internal_errors += 1
                    log.exception("control channel %s: failed to handle a frame", self._endpoint)
            if not router.get(_EVENTS) & _POLLIN:  # type: ignore[operator]  # an int option; asked, not tried: a refused read costs an exception
                return

    def _handle(self, ident: bytes, data: bytes) -> None:
        msg = wire.decode(data)
        sender = self._senders.get(ident)
        if sender is None and len(ident) == 5 and ident[0] == 0:  # renamed by a hand-over, see the docstring
            self._superseded(msg)
            return
        if sender is None:
            try:
                sender = wire.check_endpoint(ident.decode("ascii"), "sender")
            except (UnicodeDecodeError, LocalProtocolError) as e:
                raise RemoteProtocolError(
                    f"sender: routing id is not a control endpoint: {e}", rooms=wire.rooms_of(msg)
                ) from None
            if len(self._senders) >= 2 * self._max_peers:  # bounded: forget them all, they re-validate
                self._senders.clear()
            self._senders[ident] = sender
        self._received(sender, data, msg)

    # ------------------------------------------------------------------ what fails rooms

    def _on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def _answer(self, sender: str) -> None:
        if sender not in self._dealers:
            try:
                self._dealer(sender)
            except (zmq.ZMQError, CapacityError) as e:
                log.warning("control channel: cannot connect back to %s: %s", sender, e)

    def _peers_sent_to(self) -> list[str]:
        return list(self._dealers)

    def _superseded(self, msg: wire.Message) -> None:
        self.stats.superseded_frames += 1
        if self.stats.superseded_frames == 1:
            log.info("control channel %s: frames of a replaced connection arrive; their rooms fail", self._endpoint)
        self._fail_rooms(wire.rooms_of(msg), "control channel: the frame came on a connection its peer has since replaced")

    def _shutdown(self) -> None:
        """On the I/O thread: last flush, bounded linger, close sockets, end the context."""
        try:
            self._flush()
        except Exception:
            log.exception("control channel: final flush failed")
        remaining_ms = self._close_deadline.remaining() * 500  # half: the rest is the margin for term and join
        linger = self._linger_ms if remaining_ms >= self._linger_ms else int(remaining_ms)
        for endpoint, sock in list(self._dealers.items()):
            self._close_dealer(endpoint, sock, linger)
        self._dealers.clear()
        self._spares.close_all()
        self._windows.close_all()
        if self._router is not None:
            if self._conns.monitor is not None:
                self._conns.read_events()  # room in its pipe: libzmq is not waiting on it while we disable it
                self._router.disable_monitor()
                self._conns.monitor.close(0)
            self._router.close(0)
        if self._zap is not None:
            self._zap.close(0)
        if self._ctx is not None:
            self._ctx.term()
        self._conns.close_slots()
        for wake in (self._wake_r, self._wake_w):
            if wake is not None:
                wake.close()  # a late send() then finds PeerError, a late wake-up an OSError it ignores
