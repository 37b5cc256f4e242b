"""The ``"tcp"`` control plane's gatekeeper: the one thread that accepts, dials and runs handshakes.

Handshakes wait on other hosts (a connect, a challenge), so they never run on
the plane's loop, which is the driver's thread: the gatekeeper runs every one
of them, non-blocking, in its own ``selectors`` loop, and hands each finished
connection to the loop (``on_ready``) with its frame key. Bounds, as the TCP
sink's hello has them:

- at most ``max_pending`` accepted connections in their handshake; a new one
  past it cuts the oldest whose client has sent nothing (the oldest of all if
  every one has spoken), so a flood of idle connections cannot keep a peer out;
- each handshake ends within ``handshake_timeout``, or it is cut;
- out of descriptors (``EMFILE``), accepting pauses briefly after cutting the
  oldest idle connection, rather than spinning on a listener that stays readable;
- a dial's socket may take the descriptors ``pdcore.control.fd_reserve`` keeps
  over the soft limit (the ZeroMQ plane's rule for its own connects): a
  process whose other users took every descriptor still reaches its peers.

A dial's failure is handed on with its reason (``auth`` true when the other side
proved it holds another secret, or refused ours); the loop decides what waits.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from transport.secret import MAC_BYTES, NONCE_BYTES
from transport.threads import named_thread

from . import tcp_frames as tf
from .channel_stats import ChannelStats
from .fd_reserve import fd_reserve
from ..core.deadline import Deadline

__all__ = ["Gate", "Ready"]

log = logging.getLogger("pdcore.control")

_ACCEPT_PAUSE: Final = 0.05  # seconds accepting pauses when no descriptor is left
_TICK: Final = 0.1  # the longest the gatekeeper sleeps while a handshake is in progress


@dataclass
class Ready:
    """What the gatekeeper hands the loop: an inbound connection (``kind="in"``: ``endpoint`` is the
    dialer's, ``extra`` bytes of its first frames came with the handshake), an outbound one (``"out"``),
    or a dial that failed (``"fail"``, ``sock`` None, ``reason`` why, ``auth`` if it was the secret)."""

    kind: str
    endpoint: str
    sock: socket.socket | None
    key: bytes = b""
    extra: bytes = b""
    reason: str = ""
    auth: bool = False


@dataclass
class _Shake:
    """One connection in its handshake."""

    sock: socket.socket
    since: float
    inbound: bool
    endpoint: str = ""  # the dialer's (inbound, once its hello is read) or the one dialled (outbound)
    buf: bytearray = field(default_factory=bytearray)
    need: int = tf.HELLO.size
    hello: tf.Hello | None = None
    nonce: bytes = b""  # the listener's
    connected: bool = False  # outbound: the connect finished


class Gate:
    """Accepts on ``listener`` and dials what ``dial`` asks for; finished connections go to ``on_ready``."""

    def __init__(
        self, listener: socket.socket, *, own_endpoint: str, key: bytes | None, max_pending: int,
        handshake_timeout: float, stats: ChannelStats, on_ready: Callable[[Ready], None],
    ) -> None:
        self._listener = listener
        self._own = own_endpoint
        self._key = key
        self._max_pending = max_pending
        self._timeout = handshake_timeout
        self._stats = stats
        self._on_ready = on_ready
        self._sel = selectors.DefaultSelector()
        self._shakes: dict[int, _Shake] = {}  # fd -> handshake (inbound and outbound)
        self._dials: collections.deque[str] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w, listener):
            s.setblocking(False)
        self._stop = False
        self._paused_until = 0.0
        self._thread = named_thread(self._run, f"pdcore-control-gate-{own_endpoint.rsplit(':', 1)[1]}")

    def start(self) -> None:
        self._thread.start()

    def dial(self, endpoint: str) -> None:
        """Open an authenticated connection to ``endpoint`` (any thread); the outcome comes through ``on_ready``."""
        self._dials.append(endpoint)
        self._wake()

    def pending(self) -> int:
        return sum(1 for s in list(self._shakes.values()) if s.inbound)

    def close(self, deadline: Deadline) -> bool:
        """Stop the thread and close every socket in a handshake; True if the thread ended by ``deadline``."""
        self._stop = True
        self._wake()
        self._thread.join(deadline.remaining())
        return not self._thread.is_alive()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake-up is pending) or closed (nothing to wake)
            pass

    # -- the gatekeeper's thread ----------------------------------------------------------------

    def _run(self) -> None:
        sel = self._sel
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        sel.register(self._listener, selectors.EVENT_READ, None)
        try:
            while not self._stop:
                timeout = _TICK if self._shakes or self._paused_until else None
                for key, _mask in sel.select(timeout):
                    if key.fileobj is self._wake_r:
                        self._drain_wake()
                    elif key.fileobj is self._listener:
                        self._accept()
                    else:
                        shake = self._shakes.get(key.fd)
                        if shake is not None:
                            self._step(shake)
                while self._dials:
                    self._start_dial(self._dials.popleft())
                self._expire(time.monotonic())
        except Exception:
            log.exception("control plane %s: the gatekeeper failed", self._own)
        finally:
            for shake in list(self._shakes.values()):
                self._drop(shake)
            sel.close()
            for s in (self._wake_r, self._wake_w):
                s.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):  # cut the oldest idle handshake, and pause
                    self._cut_one()
                    self._pause()
                return
            self._stats.accepted += 1
            if self.pending() >= self._max_pending:
                self._cut_one()
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            shake = _Shake(sock, time.monotonic(), inbound=True)
            self._shakes[sock.fileno()] = shake
            self._sel.register(sock, selectors.EVENT_READ, None)
            self._stats.pending_peak = max(self._stats.pending_peak, self.pending())

    def _pause(self) -> None:
        if not self._paused_until:
            self._sel.unregister(self._listener)
        self._paused_until = time.monotonic() + _ACCEPT_PAUSE

    def _cut_one(self) -> None:
        """Cut the oldest connection whose client has sent nothing (the oldest of all if every one spoke).
        Whether a client spoke is asked of its socket (a peek), not of this loop's reads: under a flood
        this thread accepts faster than it reads, and an honest hello waiting unread must not count as idle."""
        oldest: _Shake | None = None
        for shake in list(self._shakes.values()):  # in accept order: the oldest first
            if not shake.inbound:
                continue
            oldest = oldest or shake
            if shake.buf or shake.hello is not None:
                continue
            try:
                spoke = bool(shake.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
            except BlockingIOError:
                spoke = False
            except OSError:
                spoke = False  # broken: as good as idle
            if not spoke:
                self._stats.pending_evicted += 1
                self._drop(shake)
                return
            self._step(shake)  # its hello is here: read it now, before it could be taken for idle again
        if oldest is not None and oldest.sock.fileno() in self._shakes:
            self._stats.pending_evicted += 1
            self._drop(oldest)

    def _expire(self, now: float) -> None:
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        for shake in [s for s in self._shakes.values() if now - s.since > self._timeout]:
            self._stats.handshake_timeouts += 1
            self._fail(shake, f"no handshake within {self._timeout:g} s")

    def _drop(self, shake: _Shake) -> None:
        self._shakes.pop(shake.sock.fileno(), None)
        try:
            self._sel.unregister(shake.sock)
        except (KeyError, ValueError):
            pass
        shake.sock.close()

    def _fail(self, shake: _Shake, reason: str, *, auth: bool = False) -> None:
        self._drop(shake)
        if not shake.inbound:
            self._on_ready(Ready("fail", shake.endpoint, None, reason=reason, auth=auth))

    def _hand_over(self, shake: _Shake, key: bytes, extra: bytes = b"") -> None:
        self._shakes.pop(shake.sock.fileno(), None)
        self._sel.unregister(shake.sock)
        kind = "in" if shake.inbound else "out"
        if shake.inbound:
            self._stats.proven += 1
        self._on_ready(Ready(kind, shake.endpoint, shake.sock, key=key, extra=extra))

    # -- outbound ---------------------------------------------------------------------------------

    def _start_dial(self, endpoint: str) -> None:
        host, port = endpoint[6:].rsplit(":", 1)
        host = host.strip("[]")
        reserve = fd_reserve.open()  # our own connect: the descriptors kept over the soft limit may serve it
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            self._on_ready(Ready("fail", endpoint, None, reason=f"no socket: {e}"))
            return
        finally:
            if reserve:
                fd_reserve.close()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        shake = _Shake(sock, time.monotonic(), inbound=False, endpoint=endpoint, need=0)
        err = sock.connect_ex((host, int(port)))
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._on_ready(Ready("fail", endpoint, None, reason=f"cannot connect: {os.strerror(err)}"))
            return
        self._shakes[sock.fileno()] = shake
        self._sel.register(sock, selectors.EVENT_WRITE, None)

    def _step(self, shake: _Shake) -> None:
        try:
            if not shake.inbound and not shake.connected:
                self._connected(shake)
                return
            if not self._read(shake):
                return
            if shake.inbound:
                self._listener_step(shake)
            else:
                self._dialer_step(shake)
        except tf.HandshakeError as e:
            if shake.inbound:
                self._refuse(shake, tf.BAD_HELLO if shake.hello is None else tf.AUTH_FAILED, str(e))
            else:
                self._fail(shake, str(e), auth=True)
        except OSError as e:
            self._fail(shake, f"connection broke in the handshake: {e}")

    def _connected(self, shake: _Shake) -> None:
        err = shake.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._fail(shake, f"cannot connect: {os.strerror(err)}")
            return
        shake.connected = True
        shake.hello = tf.Hello(self._key is not None, os.urandom(NONCE_BYTES), self._own)
        shake.sock.send(tf.encode_hello(shake.hello))  # a few hundred bytes into an empty send buffer
        if self._key is None:
            self._hand_over(shake, tf.session_key(None, shake.hello.nonce, b""))
            return
        shake.need = tf.CHALLENGE_BYTES
        self._sel.modify(shake.sock, selectors.EVENT_READ, None)

    def _read(self, shake: _Shake) -> bool:
        """Read towards ``shake.need`` bytes (never past them: what follows is the frames'); True once there."""
        data = shake.sock.recv(shake.need - len(shake.buf))
        if not data:
            self._closed_early(shake)
            return False
        shake.buf += data
        return len(shake.buf) >= shake.need

    def _closed_early(self, shake: _Shake) -> None:
        if shake.inbound and shake.nonce:  # it hung up on our challenge: it holds another secret (or went away)
            self._stats.auth_failures += 1
            log.debug("control plane %s: %s hung up on our challenge", self._own, shake.endpoint)
        verdict = shake.buf[0] if not shake.inbound and len(shake.buf) == 1 else None
        if verdict in tf.VERDICTS:
            self._fail(shake, tf.VERDICTS[verdict], auth=True)
        else:
            self._fail(shake, "the other side closed the connection in the handshake")

    def _dialer_step(self, shake: _Shake) -> None:
        assert shake.hello is not None and self._key is not None
        nonce = tf.check_challenge(self._key, shake.hello, bytes(shake.buf))
        shake.sock.send(tf.proof(self._key, shake.hello, nonce))
        self._hand_over(shake, tf.session_key(self._key, shake.hello.nonce, nonce))

    def _listener_step(self, shake: _Shake) -> None:
        if shake.hello is None:
            if len(shake.buf) == tf.HELLO.size:
                shake.need = tf.hello_size(bytes(shake.buf))
                if len(shake.buf) < shake.need:
                    return
            hello = shake.hello = tf.decode_hello(bytes(shake.buf))
            shake.endpoint = hello.endpoint
            if hello.auth != (self._key is not None):
                self._refuse(shake, tf.AUTH_UNSUPPORTED if hello.auth else tf.AUTH_REQUIRED, "secret mismatch")
                return
            if self._key is None:
                shake.sock.send(bytes([tf.OK]))
                self._hand_over(shake, tf.session_key(None, hello.nonce, b""))
                return
            shake.nonce = os.urandom(NONCE_BYTES)
            shake.sock.send(tf.challenge(self._key, hello, shake.nonce))
            shake.buf = bytearray()
            shake.need = MAC_BYTES
            return
        assert self._key is not None
        tf.check_proof(self._key, shake.hello, shake.nonce, bytes(shake.buf))
        shake.sock.send(bytes([tf.OK]))
        self._hand_over(shake, tf.session_key(self._key, shake.hello.nonce, shake.nonce))

    def _refuse(self, shake: _Shake, verdict: int, why: str) -> None:
        self._stats.auth_failures += 1
        self._stats.auth_refused += 1
        log.debug("control plane %s: refused a handshake from %s: %s", self._own, shake.endpoint or "?", why)
        try:
            shake.sock.send(bytes([verdict]))
        except OSError:
            pass
        self._drop(shake)
