"""What both control planes do alike, whatever carries their frames: options, liveness, quotas, delivery.

``ControlChannel`` (``"zmq"``) and ``TcpPlane`` (``"tcp"``) differ in their sockets
and threads; a frame that reached either is the same work from here on: a
``Heartbeat``, ``Register`` or ``EmbedRegister`` introduces its sender (a
new incarnation declares the old one dead, a sender not tracked is "back"),
any other frame refreshes it, a frame over its sender's byte quota fails its
rooms, and the rest go to ``on_message`` with a ``Release`` token that
``hold()`` keeps past the callback. Callbacks run on the plane's loop thread
and never take it down: an exception is logged and counted.

A subclass provides ``_on_loop()`` (whether the caller runs the loop),
``_answer(sender)`` (open the way back to a sender we heard from),
``_send_now(endpoint, frames, rooms)``, ``_peers_sent_to()`` and
``_drop_peer(endpoint)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Final, Self

from transport.loglimit import LogLimit

from . import wire
from .channel_stats import ChannelStats
from .liveness import DeadPeer, PeerLiveness
from .pending import MAX_PENDING
from .quotas import Quotas, Release
from ..core.deadline import Deadline
from ..core.errors import PeerError, RemoteProtocolError

__all__ = ["PlaneBase", "format_endpoint", "HANDSHAKE_TIMEOUT", "AUTH_LOG_EVERY"]

log = logging.getLogger("pdcore.control")

HANDSHAKE_TIMEOUT: Final = 5.0  # default handshake_timeout, seconds (libzmq's own default is 30)
AUTH_LOG_EVERY: Final = 10.0  # seconds between two warnings about failed handshakes of one endpoint

OnMessage = Callable[[str, wire.Message], None]
OnRoomsFailed = Callable[[tuple[int, ...], str], None]
OnPeerDead = Callable[[DeadPeer], None]
OnPeerBack = Callable[[str, str, int], None]


def format_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _check_options(
    session_id: str, epoch: int, heartbeat_interval: float, dead_after: float, max_bytes_per_sender: int,
    max_bytes_total: int | None, max_pending: int, handshake_timeout: float,
) -> int:
    """A plane's options checked before anything is made (``ValueError``; ``LocalProtocolError`` for a
    session id or epoch no heartbeat could carry); returns the total quota (default four per sender)."""
    wire.encode(wire.Heartbeat(session_id=session_id, epoch=epoch, seq=0))  # validates both, early
    if not 0 < heartbeat_interval < dead_after:
        raise ValueError("need 0 < heartbeat_interval < dead_after")
    if max_bytes_per_sender < wire.MAX_FRAME_BYTES:
        raise ValueError(
            f"max_bytes_per_sender must be at least one frame ({wire.MAX_FRAME_BYTES}), got {max_bytes_per_sender}"
        )
    total = 4 * max_bytes_per_sender if max_bytes_total is None else max_bytes_total
    if total < wire.MAX_FRAME_BYTES:
        raise ValueError(f"max_bytes_total must be at least one frame ({wire.MAX_FRAME_BYTES}), got {total}")
    if max_pending < 1 or not handshake_timeout > 0:
        raise ValueError(
            f"max_pending ({max_pending}) and handshake_timeout ({handshake_timeout}) must be positive"
        )
    return total


class PlaneBase:
    """The planes' common state and rules (see the module docstring)."""

    #: whether each frame sent crosses to another thread (a hand-off ``PeerBase.handoffs`` counts)
    FRAMES_HAND_OFF: bool = True

    def __init__(
        self,
        on_message: OnMessage,
        *,
        session_id: str,
        epoch: int = 0,
        on_rooms_failed: OnRoomsFailed | None = None,
        on_peer_dead: OnPeerDead | None = None,
        on_peer_back: OnPeerBack | None = None,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        heartbeat_interval: float = 1.0,
        dead_after: float = 10.0,
        max_queue: int = 4096,
        max_peers: int = 1024,
        max_bytes_per_sender: int = 64 << 20,
        max_bytes_total: int | None = None,
        max_pending: int = MAX_PENDING,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        total = _check_options(
            session_id, epoch, heartbeat_interval, dead_after, max_bytes_per_sender, max_bytes_total, max_pending,
            handshake_timeout,
        )
        self.stats = ChannelStats()
        self._quotas = Quotas(max_bytes_per_sender, total, self.stats)
        self._auth_logged = LogLimit(AUTH_LOG_EVERY, max_keys=max_peers)  # per endpoint
        self._delivering: Release | None = None  # the frame whose on_message is running (loop thread)
        self._on_message = on_message
        self._on_rooms_failed = on_rooms_failed
        self._on_peer_dead = on_peer_dead
        self._on_peer_back = on_peer_back
        self.session_id = session_id
        self.epoch = epoch
        self._host = host
        self._advertise = advertise_host or host
        self._interval = heartbeat_interval
        self._liveness = PeerLiveness(dead_after)
        self._max_peers = max_peers
        self._max_queue = max_queue
        self._max_pending = max_pending
        self._handshake_timeout = handshake_timeout
        self._endpoint: str | None = None
        self._endpoints: set[str] = set()  # endpoints ``send`` validated already (the callers' threads)
        self._seq = 0

    # -- what each plane does its own way ----------------------------------------------------------

    def start(self) -> str:
        raise NotImplementedError

    def close(self, deadline: Deadline | None = None) -> None:
        raise NotImplementedError

    def queued(self) -> int:
        raise NotImplementedError

    def pending_connections(self) -> int:
        raise NotImplementedError


    def _on_loop(self) -> bool:
        raise NotImplementedError

    def _answer(self, sender: str) -> None:
        raise NotImplementedError

    def _send_now(self, endpoint: str, frames: list[bytes], rooms: tuple[int, ...]) -> bool:
        raise NotImplementedError

    def _peers_sent_to(self) -> Iterable[str]:
        raise NotImplementedError

    def _drop_peer(self, endpoint: str) -> None:
        raise NotImplementedError

    def _enqueue(self, endpoint: str, frame: bytes | None, rooms: tuple[int, ...]) -> None:
        """``frame`` (None: forget ``endpoint``) for the loop, or ``PeerError``/``CapacityError``."""
        raise NotImplementedError

    # -- caller side ----------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` this plane receives on (also its identity towards peers)."""
        if self._endpoint is None:
            raise PeerError("control channel: not started")
        return self._endpoint

    def send(self, endpoint: str, msg: wire.Message) -> None:
        """Queue ``msg`` for the peer at ``endpoint``; never blocks.

        Raises ``LocalProtocolError`` (bad message or endpoint), ``CapacityError``
        (outgoing queue full: the caller fails the rooms), ``PeerError`` (closed
        or not started). Frames that cannot leave later fail via ``on_rooms_failed``.
        """
        frame = wire.encode(msg)
        if type(endpoint) is not str or endpoint not in self._endpoints:  # checked once per endpoint, as senders are
            wire.check_endpoint(endpoint)
            if len(self._endpoints) >= 2 * self._max_peers:  # bounded: forget them all, they are checked again
                self._endpoints.clear()
            self._endpoints.add(endpoint)
        self._enqueue(endpoint, frame, wire.rooms_of(msg))

    def forget(self, endpoint: str) -> None:
        """Drop the way to ``endpoint`` (frames queued for it are discarded) and stop watching it."""
        self._enqueue(endpoint, None, ())

    def __enter__(self) -> Self:
        if self._endpoint is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hold(self) -> Callable[[], None]:
        """Inside ``on_message``: keep the frame being delivered counted against its sender after
        the callback returns, until the returned ``release()`` is called (from any thread, once is enough)."""
        current = self._delivering
        if current is None or not self._on_loop():
            raise RuntimeError("control channel: hold() may only be called from inside on_message")
        current.kept = True  # not released when the callback returns
        return current

    def held_bytes(self, sender: str | None = None) -> int:
        """Wire bytes counted against ``sender`` now (all senders together if None)."""
        return self._quotas.held(sender)

    # -- the loop thread ------------------------------------------------------------------------

    def _received(self, sender: str, data: Any, msg: wire.Message) -> None:
        """A frame of ``len(data)`` bytes that ``sender`` sent, decoded: liveness, quota, delivery."""
        now = time.monotonic()
        if isinstance(msg, (wire.Heartbeat, wire.Register, wire.EmbedRegister)):
            back = self._liveness.known(sender)[0] is None  # new here, or heard again after it was dropped
            for dead in self._liveness.introduced(sender, msg.session_id, msg.epoch, now):
                self._peer_dead(dead, drop=dead.endpoint != sender)
            if back and self._on_peer_back is not None:
                self._call(self._on_peer_back, sender, msg.session_id, msg.epoch)
            self._answer(sender)  # answer its heartbeats, so it can tell we are alive
        else:
            self._liveness.heard(sender, now)
        if isinstance(msg, wire.Heartbeat):
            return  # consumed here
        over = self._quotas.charge(sender, len(data))
        if over is not None:
            reason = self._quotas.dropped(sender, len(data), msg, total=over)
            self._fail_rooms(wire.rooms_of(msg), reason)
            return
        self.stats.delivered += 1
        token = self._delivering = Release(self._quotas, sender, len(data))
        try:
            self._call(self._on_message, sender, msg)
        finally:
            self._delivering = None
            if not token.kept:
                self._quotas.release(token)

    def _fail_rooms(self, rooms: tuple[int, ...], reason: str) -> None:
        if rooms and self._on_rooms_failed is not None:
            self._call(self._on_rooms_failed, rooms, reason)

    def _protocol_error(self, error: RemoteProtocolError) -> None:
        self.stats.protocol_errors += 1
        log.warning("control channel %s: %s (rooms %s)", self._endpoint, error, error.rooms)
        self._fail_rooms(error.rooms, str(error))

    def _heartbeat(self) -> bytes:
        return wire.encode(wire.Heartbeat(session_id=self.session_id, epoch=self.epoch, seq=self._seq))

    def _tick(self, now: float) -> None:
        """Every heartbeat interval: a heartbeat to each peer we send to; the silent ones are dead."""
        self._seq += 1
        beat = self._heartbeat()
        for endpoint in list(self._peers_sent_to()):
            if self._send_now(endpoint, [beat], ()):
                self.stats.heartbeats_sent += 1
        for dead in self._liveness.expire(now):
            self._peer_dead(dead, drop=True)

    def _peer_dead(self, dead: DeadPeer, *, drop: bool, quiet: bool = False) -> None:
        self.stats.peers_dead += 1
        if not quiet:
            log.warning("control channel: peer %s (session %s) is dead: %s (this channel's counters: %s)", dead.endpoint,
                        dead.session_id, dead.reason, {k: v for k, v in vars(self.stats).items() if v})
        if drop:
            self._drop_peer(dead.endpoint)
        if self._on_peer_dead is not None:
            self._call(self._on_peer_dead, dead)

    def _auth_failed(self, peer: str, why: str, *, dead: bool) -> None:
        self.stats.auth_failures += 1
        reason = f"authentication failed: control handshake with {peer}: {why}; is the secret the same on both sides?"
        if self._auth_logged.ready(peer) is not None:
            log.warning("control channel %s: %s (more counted in stats.auth_failures)", self._endpoint, reason)
        if dead:  # the incarnation we knew there (a peer that went away fails its reconnect's handshake too)
            self._peer_dead(DeadPeer(peer, *self._liveness.known(peer), reason), drop=True, quiet=True)

    def _call(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            self.stats.callback_errors += 1
            log.exception("control channel: callback %r failed", getattr(fn, "__qualname__", fn))
