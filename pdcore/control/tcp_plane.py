"""The ``"tcp"`` control plane: sealed frames over plain TCP, its loop run by the driver's own thread.

Why: on the ZeroMQ plane a lone message crosses four threads (the driver, the
channel's I/O thread and ZeroMQ's on each side) and costs about five
wake-ups. Here the driver's thread is the plane's loop (``serve``, called by
``pdcore.node.driver.Driver`` between its inputs): it waits on its inbox and its
control sockets together, sends each peer the frames a pass owes it in one
``send``, and reads frames where the engines run. One wake-up per side.

- **Connections:** a rank sends on connections it dials and receives on
  those it accepts, one each way per pair of ranks (as the ZeroMQ plane's
  DEALER and ROUTER): per-peer FIFO, and the dialer's hello names the
  endpoint answers go to. Dialing, accepting and handshakes run on the
  gatekeeper thread (``pdcore.control.tcp_gate``), never on the loop.
- **Authentication** (``secret``): a mutual challenge-response with a key
  derived from the deployment secret, then a keyed BLAKE2b tag over each frame
  and its sequence number (``pdcore.control.tcp_frames``, which also says
  what this gives up against CURVE). A refused frame is counted
  (``stats.frames_refused``) and ends its connection; the dialer dials again.
- **Bounds:** frames wait for a connection at most ``_CONNECT_WAIT`` (then
  their rooms fail), with dials retried at a growing interval; bytes a slow
  peer's socket has not taken are at most ``_MAX_REST`` (past it a frame's
  rooms fail: "full"); at most ``max_queue`` frames queued from other threads.
- **Liveness, quotas, delivery** are ``pdcore.control.plane_base``'s, as on
  the ZeroMQ plane.

Without a driver (tests, benchmarks) ``start()`` runs the loop on a thread of
its own; ``drive_externally()`` before ``start()`` hands it to the caller, who
then calls ``serve`` and ``wake``, and closes the plane after its loop ended.
"""

from __future__ import annotations

import collections
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

from transport.loglimit import LogLimit
from transport.threads import named_thread

from . import auth, tcp_frames as tf, wire
from .fd_reserve import fd_reserve
from .plane_base import PlaneBase, format_endpoint
from .tcp_gate import Gate, Ready
from ..core.deadline import Deadline, DeadlineExceeded
from ..core.errors import CapacityError, LocalProtocolError, PeerError, RemoteProtocolError, StartError

__all__ = ["TcpPlane"]

log = logging.getLogger("pdcore.control")

_CONNECT_WAIT: Final = 5.0  # seconds frames wait for a connection to their peer before their rooms fail
_MAX_REST: Final = 16 << 20  # bytes a peer's socket may owe us (it did not take them yet) before frames fail
_RECV_BYTES: Final = 1 << 18  # read per readable connection per pass, into one buffer the plane keeps
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0  # seconds between dials of a peer that refused or was not there
_REFUSED_LOG_EVERY: Final = 10.0


_READ: Final = select.EPOLLIN
_READ_WRITE: Final = select.EPOLLIN | select.EPOLLOUT
_WAKE: Final = object()  # what the wake-up socket stands for in the poller


class _Poller:
    """epoll and what each watched descriptor stands for. The loop waits here once per pass, so the
    ``selectors`` module's layers (a key object per ready descriptor, two look-ups, a mask translated) were
    Python on every frame's path: about 2 µs of a lone frame's round trip here."""

    __slots__ = ("_ep", "of")

    def __init__(self) -> None:
        self._ep = select.epoll()
        self.of: dict[int, Any] = {}

    def add(self, sock: socket.socket, what: Any) -> None:
        fd = sock.fileno()
        self._ep.register(fd, _READ)
        self.of[fd] = what

    def want_write(self, sock: socket.socket, write: bool) -> None:
        self._ep.modify(sock.fileno(), _READ_WRITE if write else _READ)

    def remove(self, sock: socket.socket) -> None:
        """Before ``sock`` closes (a descriptor number is used again at once)."""
        fd = sock.fileno()
        if self.of.pop(fd, None) is not None:
            self._ep.unregister(fd)

    def poll(self, timeout: float) -> list[tuple[int, int]]:
        return self._ep.poll(timeout)

    def close(self) -> None:
        self._ep.close()


@dataclass
class _Out:
    """The way to one peer: its connection once dialled, and the frames that wait for it."""

    endpoint: str
    frames: list[tuple[bytes, tuple[int, ...]]] = field(default_factory=list)
    since: float | None = None  # when the oldest waiting frame began to wait for a connection
    sock: socket.socket | None = None
    sealer: tf.Sealer | None = None
    rest: bytearray = field(default_factory=bytearray)  # sealed bytes the socket did not take yet
    dialing: bool = False
    retry_at: float = 0.0
    backoff: float = _RETRY_FIRST
    verdict: bool = False  # the listener's verdict came (OK)


@dataclass
class _In:
    sock: socket.socket
    sender: str
    opener: tf.Opener


class TcpPlane(PlaneBase):
    """A control plane whose loop is ``serve`` (see the module docstring)."""

    FRAMES_HAND_OFF = False  # sent on the thread that runs the loop

    def __init__(self, on_message: Any, *, secret: bytes | None = None, linger: float = 1.0, **kwargs: Any) -> None:
        kwargs.pop("sndhwm", None)  # the ZeroMQ plane's: this one's bound is _MAX_REST
        super().__init__(on_message, **kwargs)
        self._key = auth.derive_key(auth.check_secret(secret, "control channel"), tf.KEY_LABEL) if secret is not None else None
        self._linger = linger
        self._poller: _Poller | None = None  # made at start
        self._outs: dict[str, _Out] = {}
        self._ins: dict[int, _In] = {}
        self._dirty: set[str] = set()  # endpoints with frames to send this pass
        self._foreign: collections.deque[tuple[str, bytes | None, tuple[int, ...]]] = collections.deque()
        self._ready: collections.deque[Ready] = collections.deque()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._wake_owed = False
        self._gate: Gate | None = None
        self._listener: socket.socket | None = None
        self._driven = False
        self._loop_ident: int | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._next_beat = self._last_tick = 0.0
        self._refused_logged = LogLimit(_REFUSED_LOG_EVERY, max_keys=64)
        # Reads land here: a fresh ``recv(_RECV_BYTES)`` allocates past malloc's mmap threshold, and costs an
        # mmap, an mremap and a munmap per read (measured: 3 of the 6 syscalls of a lone frame's crossing).
        self._rbuf = bytearray(_RECV_BYTES)
        self._rview = memoryview(self._rbuf)

    # -- caller side ----------------------------------------------------------------------------

    def drive_externally(self) -> None:
        """The caller's thread will run the loop (``serve``); before ``start``."""
        if self._listener is not None:
            raise StartError("control plane: drive_externally() after start()")
        self._driven = True

    def start(self) -> str:
        """Bind, start the gatekeeper (and the loop's own thread unless driven); returns the endpoint."""
        if self._listener is not None:
            raise StartError("control channel: start() may be called once")
        if self._advertise in ("0.0.0.0", "::", ""):
            raise StartError(f"control channel: bound to wildcard {self._host!r}; pass advertise_host")
        if self._key is None:
            auth.warn_unauthenticated("control channel")
        fd_reserve.setup()  # descriptors kept for our own dials (tcp_gate)
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self._host, 0))
            listener.listen(512)
            endpoint = format_endpoint(self._advertise, listener.getsockname()[1])
            wire.check_endpoint(endpoint)
        except (OSError, LocalProtocolError) as e:
            listener.close()
            raise StartError(f"control channel: cannot bind {self._host!r}: {e}") from e
        self._listener, self._endpoint = listener, endpoint
        self._poller = _Poller()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller.add(self._wake_r, _WAKE)
        self._gate = Gate(listener, own_endpoint=endpoint, key=self._key, max_pending=self._max_pending,
                          handshake_timeout=self._handshake_timeout, stats=self.stats,
                          on_ready=self._on_ready)
        self._gate.start()
        self._next_beat = self._last_tick = time.monotonic()
        if not self._driven:
            self._thread = named_thread(self._run_own, f"pdcore-control-{endpoint.rsplit(':', 1)[1]}")
            self._thread.start()
        return endpoint

    def _enqueue(self, endpoint: str, frame: bytes | None, rooms: tuple[int, ...]) -> None:
        if self._listener is None or self._stopping:
            raise PeerError("control channel: not running")
        if threading.get_ident() == self._loop_ident:
            self._queue(endpoint, frame, rooms)
            return
        if len(self._foreign) >= self._max_queue:
            raise CapacityError(f"control channel: {self._max_queue} frames already queued")
        self._foreign.append((endpoint, frame, rooms))
        self.wake()

    def wake(self) -> None:
        """Return the loop from its wait (any thread; one byte however many ask before it reads it)."""
        if not self._wake_owed and self._wake_w is not None:
            self._wake_owed = True
            try:
                self._wake_w.send(b"\0")
            except OSError:  # full: a wake-up is pending anyway; closed: nothing to wake
                pass

    def queued(self) -> int:
        """Frames queued from other threads for the loop now (a metric)."""
        return len(self._foreign)

    def pending_connections(self) -> int:
        """Accepted connections in their handshake now (at most ``max_pending``)."""
        return self._gate.pending() if self._gate is not None else 0

    def close(self, deadline: Deadline | None = None) -> None:
        """Stop the loop (its own thread; a driven loop must have ended) and the gatekeeper, send what is
        queued within ``linger``, close every socket. Idempotent; ``DeadlineExceeded`` if a thread lives on."""
        deadline = deadline or Deadline.after(5.0)
        if self._listener is None or self._closed:
            return
        if threading.get_ident() == self._loop_ident and self._thread is not None:
            raise RuntimeError("control channel: close() called from a callback")
        self._stopping = True
        assert self._gate is not None
        if not self._gate.close(deadline):  # first: nothing new comes from it, and the listener is its
            raise DeadlineExceeded("control channel: the gatekeeper did not stop by the deadline")
        thread = self._thread
        if thread is not None:
            self.wake()
            thread.join(deadline.remaining())
            if thread.is_alive():
                raise DeadlineExceeded("control channel: the loop thread did not stop by the deadline")
        else:
            self._shutdown(deadline)

    # -- the loop ---------------------------------------------------------------------------------

    def _run_own(self) -> None:
        try:
            while not self._stopping:
                self.serve(self._interval)
        except Exception:
            log.exception("control channel %s: loop failed", self._endpoint)
        finally:
            self._shutdown(Deadline.after(self._linger + 1.0))

    def serve(self, timeout: float) -> None:
        """One pass of the loop: send what is owed, wait up to ``timeout`` for a socket or a wake-up, read
        every readable connection (delivering its frames), send again, beat the heart when it is time."""
        if self._loop_ident is None:
            self._loop_ident = threading.get_ident()
        if self._stopping:
            return
        if self._foreign:
            self._take_foreign()
        if self._frames_waiting():
            self._flush()
        now = time.monotonic()
        wait = min(timeout, self._next_beat - now)
        if self._dirty:  # frames that wait for a connection: come back for its retry or their deadline
            wait = min(wait, self._waiting_due() - now)
        poller = self._poller
        assert poller is not None
        for fd, mask in poller.poll(max(0.0, wait)):
            what = poller.of.get(fd)  # None: closed by an earlier event of this pass
            if what is _WAKE:
                self._drain_wake()
            elif type(what) is _In:
                self._read_in(what)
            elif what is not None:
                self._out_event(what, mask)
        while self._ready:
            self._adopt(self._ready.popleft())
        if self._foreign:
            self._take_foreign()
        now = time.monotonic()
        if now >= self._next_beat:
            if now - self._last_tick > max(3 * self._interval, self._liveness.dead_after / 2):
                self._liveness.pardon(now)  # we were stopped: silence while we slept proves nothing
            self._tick(now)
            for out in self._outs.values():
                self._dial(out, now)  # the way to a peer we heard from, or one whose connection ended
            self._last_tick, self._next_beat = now, now + self._interval
        if self._frames_waiting():
            self._flush()

    def _frames_waiting(self) -> bool:
        """Frames to send this pass (a wrapper's held-back ones count too: ``pdcore.control.faulty``)."""
        return bool(self._dirty)

    def _waiting_due(self) -> float:
        """When the first of the frames waiting for a connection needs this loop: a dial to retry, or
        their ``_CONNECT_WAIT`` to end."""
        due = self._next_beat
        for endpoint in self._dirty:
            out = self._outs.get(endpoint)
            if out is not None and out.sock is None:
                due = min(due, (out.since or 0.0) + _CONNECT_WAIT)
                if not out.dialing:
                    due = min(due, out.retry_at)
        return due

    def _drain_wake(self) -> None:
        """One read: ``wake`` sends a byte only while none is owed, so one is all there is (a second read
        to find the socket empty was a syscall and an exception per wake-up; were there more, the socket
        would be readable again at the next wait)."""
        assert self._wake_r is not None
        try:
            self._wake_r.recv(64)
        except OSError:
            pass
        self._wake_owed = False  # after the read: a wake-up asked for from here on sends its byte

    def _on_ready(self, ready: Ready) -> None:
        """The gatekeeper's thread: a connection (or a failed dial) for the loop."""
        self._ready.append(ready)
        self.wake()

    def _take_foreign(self) -> None:
        foreign = self._foreign
        while foreign:
            self._queue(*foreign.popleft())

    def _queue(self, endpoint: str, frame: bytes | None, rooms: tuple[int, ...]) -> None:
        if frame is None:
            self._flush_one(endpoint)
            self._drop_peer(endpoint)
            return
        out = self._outs.get(endpoint)
        if out is None:
            out = self._out(endpoint)
            if out is None:
                self._fail_rooms(rooms, f"control channel: already connected to {self._max_peers} peers")
                return
        out.frames.append((frame, rooms))
        self._dirty.add(endpoint)

    def _out(self, endpoint: str) -> _Out | None:
        if len(self._outs) >= self._max_peers:
            return None
        out = self._outs[endpoint] = _Out(endpoint)
        self._liveness.track(endpoint, time.monotonic())
        return out

    # -- sending ------------------------------------------------------------------------------------

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for endpoint in dirty:
            self._flush_one(endpoint)

    def _flush_one(self, endpoint: str) -> None:
        out = self._outs.get(endpoint)
        if out is None or not out.frames:
            return
        if out.sock is None:
            now = time.monotonic()
            since = out.since = out.since or now
            if now - since > _CONNECT_WAIT:
                frames, out.frames, out.since = out.frames, [], None
                self.stats.send_failures += 1
                self._fail_rooms(tuple(r for _, rooms in frames for r in rooms),
                                 f"control channel to {endpoint}: no connection within {_CONNECT_WAIT:g} s")
            else:
                self._dial(out, now)
                self._dirty.add(endpoint)  # still waiting: the next pass looks again
            return
        frames, out.frames, out.since = out.frames, [], None
        self._send_now(endpoint, [f for f, _ in frames], tuple(r for _, rooms in frames for r in rooms))

    def _dial(self, out: _Out, now: float) -> None:
        if out.sock is None and not out.dialing and now >= out.retry_at and self._gate is not None:
            out.dialing = True
            self._gate.dial(out.endpoint)

    def _send_now(self, endpoint: str, frames: list[bytes], rooms: tuple[int, ...]) -> bool:
        """``frames`` to ``endpoint`` in one ``send``; where that cannot be, ``rooms`` fail."""
        out = self._outs.get(endpoint)
        if out is None or out.sock is None or out.sealer is None:
            return False  # a heartbeat with no connection yet: the next one goes
        size = sum(len(f) for f in frames) + len(frames) * tf.OVERHEAD
        if len(out.rest) + size > _MAX_REST:
            return self._send_failed(rooms, f"control channel to {endpoint} is full (peer slow or gone)")
        data = out.sealer.seal_all(frames)
        self.stats.sent += len(frames)
        self.stats.messages_sent += 1
        if out.rest:
            out.rest += data
            return True
        try:
            n = out.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError as e:
            self._lost(out, f"connection broke: {e}")
            return self._send_failed(rooms, f"control channel to {endpoint}: {e}")
        if n < len(data):
            out.rest += data[n:]
            self._poll().want_write(out.sock, True)
        return True

    def _send_failed(self, rooms: tuple[int, ...], reason: str) -> bool:
        self.stats.send_failures += 1
        log.warning("%s", reason)
        self._fail_rooms(rooms, reason)
        return False

    def _out_event(self, out: _Out, mask: int) -> None:
        sock = out.sock
        if sock is None:
            return
        if mask & ~select.EPOLLOUT:  # readable, or an error or hang-up (which the read reports)
            try:
                data = sock.recv(64)
            except BlockingIOError:
                data = None
            except OSError as e:
                self._lost(out, f"connection broke: {e}")
                return
            if data == b"":
                self._lost(out, "the peer closed the connection")
                return
            if data and not out.verdict:
                if data[0] != tf.OK:
                    why = tf.VERDICTS.get(data[0], f"verdict {data[0]}")
                    self._auth_failed(out.endpoint, why, dead=True)
                    return
                out.verdict = True
        if mask & ~select.EPOLLIN and out.rest:
            try:
                n = sock.send(out.rest)
            except BlockingIOError:
                return
            except OSError as e:
                self._lost(out, f"connection broke: {e}")
                return
            del out.rest[:n]
            if not out.rest:
                self._poll().want_write(sock, False)

    def _lost(self, out: _Out, why: str) -> None:
        """The connection to ``out`` ended: frames it had not sent are lost (as in a socket's buffer); the
        next frame dials again."""
        log.debug("control channel %s: connection to %s lost: %s", self._endpoint, out.endpoint, why)
        self._close_out(out)

    def _close_out(self, out: _Out) -> None:
        if out.sock is not None:
            self._poll().remove(out.sock)
            out.sock.close()
        out.sock, out.sealer, out.verdict = None, None, False
        out.rest = bytearray()

    def _adopt(self, ready: Ready) -> None:
        """A finished handshake from the gatekeeper."""
        if ready.kind == "in":
            assert ready.sock is not None
            self._adopt_in(ready.sock, ready.endpoint, ready.key, ready.extra)
            return
        out = self._outs.get(ready.endpoint)
        if ready.kind == "fail":
            if out is None:
                return
            out.dialing = False
            if ready.auth:
                self._auth_failed(ready.endpoint, ready.reason, dead=True)
                return
            self.stats.connect_retries += 1
            out.retry_at = time.monotonic() + out.backoff
            out.backoff = min(2 * out.backoff, _RETRY_MAX)
            if out.frames:
                self._dirty.add(out.endpoint)
            return
        assert ready.sock is not None
        if out is None or out.sock is not None or self._stopping:
            ready.sock.close()  # dropped (or closing) while it was dialled
            return
        out.sock, out.sealer, out.dialing, out.backoff = ready.sock, tf.Sealer(ready.key), False, _RETRY_FIRST
        self._poll().add(ready.sock, out)
        if self._send_now(out.endpoint, [self._heartbeat()], ()):  # first: who we are, before any frame
            self.stats.heartbeats_sent += 1
        self._dirty.add(out.endpoint)

    # -- receiving ----------------------------------------------------------------------------------

    def _adopt_in(self, sock: socket.socket, sender: str, key: bytes, extra: bytes) -> None:
        if len(self._ins) >= 2 * self._max_peers:
            oldest = next(iter(self._ins.values()))
            self._close_in(oldest)
        conn = _In(sock, sender, tf.Opener(key, wire.MAX_FRAME_BYTES))
        self._ins[sock.fileno()] = conn
        self._poll().add(sock, conn)
        if extra:
            self._deliver(conn, extra)

    def _read_in(self, conn: _In) -> None:
        try:
            n = conn.sock.recv_into(self._rbuf)
        except BlockingIOError:
            return
        except OSError:
            n = 0
        if not n:
            if conn.opener.partial:
                self.stats.frames_truncated += 1
                log.warning("control channel %s: the connection from %s ended mid-frame", self._endpoint, conn.sender)
            self._close_in(conn)
            return
        self._deliver(conn, self._rview[:n])

    def _deliver(self, conn: _In, data: bytes | memoryview) -> None:
        bodies, error = conn.opener.feed(data)
        if bodies:
            self.stats.received += 1  # reads that brought frames (as ZeroMQ messages on the other plane)
        for body in bodies:
            try:
                self._received(conn.sender, body, wire.decode(body))
            except RemoteProtocolError as e:
                self._protocol_error(e)
            except Exception:  # a bug of ours: logged and counted, the plane keeps serving
                self.stats.internal_errors += 1
                log.exception("control channel %s: failed to handle a frame", self._endpoint)
        if error is not None:
            self.stats.frames_refused += 1
            if self._refused_logged.ready(conn.sender) is not None:
                log.warning("control channel %s: refused a frame from %s: %s; its connection ends (more counted in "
                            "stats.frames_refused)", self._endpoint, conn.sender, error)
            self._close_in(conn)

    def _close_in(self, conn: _In) -> None:
        if self._ins.pop(conn.sock.fileno(), None) is not None:
            self._poll().remove(conn.sock)
            conn.sock.close()

    def _poll(self) -> _Poller:
        assert self._poller is not None, "started"
        return self._poller

    # -- the base's hooks -------------------------------------------------------------------------------

    def _on_loop(self) -> bool:
        return threading.get_ident() == self._loop_ident

    def _answer(self, sender: str) -> None:
        if sender in self._outs:
            return
        out = self._out(sender)
        if out is None:
            log.warning("control channel: cannot connect back to %s: already connected to %d peers", sender,
                        self._max_peers)
        else:
            self._dial(out, time.monotonic())

    def _peers_sent_to(self) -> list[str]:
        return [e for e, o in self._outs.items() if o.sock is not None]

    def _drop_peer(self, endpoint: str) -> None:
        out = self._outs.pop(endpoint, None)
        if out is not None:
            self._close_out(out)
        self._liveness.forget(endpoint)

    # -- the end --------------------------------------------------------------------------------------

    def _shutdown(self, deadline: Deadline) -> None:
        """Last flush; what the sockets owe goes within ``linger`` (and the deadline); close everything."""
        self._stopping = True
        try:
            self._take_foreign()
            self._flush()
            until = Deadline.after(min(self._linger, deadline.remaining()))
            for out in self._outs.values():
                if out.sock is not None and out.rest and not until.expired():
                    out.sock.settimeout(max(0.001, until.remaining()))
                    try:
                        out.sock.sendall(out.rest)
                    except OSError:
                        pass
        except Exception:
            log.exception("control channel: final flush failed")
        for out in list(self._outs.values()):
            self._close_out(out)
        for conn in list(self._ins.values()):
            self._close_in(conn)
        for ready in self._ready:
            if ready.sock is not None:
                ready.sock.close()
        self._closed = True
        self._poll().close()
        for s in (self._wake_r, self._wake_w, self._listener):
            if s is not None:
                s.close()
