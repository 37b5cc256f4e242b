"""The ``"tcp"`` control plane against hand-driven sockets: what a well-behaved plane never sends.

Real sockets on loopback, a deadline on every wait. A raw client speaks the handshake with
``pdcore.control.tcp_frames`` (so it can be the deployment's, or an outsider), then sends sealed
frames, forged, replayed, reordered, cut or oversized ones; a raw listener plays an impostor. The
plane must refuse and count each, end only that connection, and keep serving honest peers.
(``tests/test_control.py`` runs the planes' common tests on both planes.)
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pdcore.control import tcp_frames as tf, tcp_plane, wire
from pdcore.control.tcp_plane import TcpPlane
from pdcore.core.deadline import Deadline
from raw_control import RawControl, recv_exact
from test_control import WAIT, Inbox, control_threads, wait_for

SECRET = b"the deployment secret, 32 bytes."
OTHER = b"another deployment's secret....."
ME = "tcp://127.0.0.1:9"  # the raw client's claimed endpoint (nobody listens there)


_OPEN: list[socket.socket] = []  # the raw dialers' sockets, closed after each test


@pytest.fixture(autouse=True)
def _close_raw_sockets() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


class RawDialer(RawControl):
    """``raw_control``'s tcp client (the handshake by hand, with ``secret``: the deployment's, another, or
    none), with frames built one by one and a check that the plane ended the connection."""

    def __init__(self, endpoint: str, secret: bytes | None = SECRET, me: str = ME) -> None:
        super().__init__(endpoint, "tcp", me, secret=secret)
        self.sock = self.tcp
        _OPEN.append(self.sock)

    def frame(self, msg: wire.Message) -> bytes:
        head, body = self.sealer.seal(wire.encode(msg))
        return head + body

    def closed_by_peer(self) -> bool:
        """True once the plane ended this connection (EOF or reset within ``WAIT``)."""
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return False


@pytest.fixture
def listener() -> Iterator[tuple[TcpPlane, Inbox]]:
    inbox = Inbox("tcp")
    plane = inbox.channel("prefill-0", secret=SECRET)
    plane.start()
    yield plane, inbox
    plane.close(Deadline.after(WAIT))
    assert control_threads() == []


def honest_frame_arrives(plane: TcpPlane, inbox: Inbox, room: int) -> None:
    """A fresh authenticated connection still delivers (the plane serves on after what came before)."""
    dialer = RawDialer(plane.endpoint)
    dialer.sock.sendall(dialer.frame(wire.Abort(room=room)))
    assert inbox.next_message() == (ME, wire.Abort(room=room))
    dialer.sock.close()


def test_an_authenticated_dialer_is_answered_ok_and_its_frames_arrive_in_order(listener: Any) -> None:
    plane, inbox = listener
    dialer = RawDialer(plane.endpoint)
    assert dialer.verdict == bytes([tf.OK])
    dialer.sock.sendall(b"".join(dialer.frame(wire.Abort(room=r)) for r in range(5)))
    assert [inbox.next_message()[1].room for _ in range(5)] == list(range(5))  # type: ignore[union-attr]
    assert plane.stats.frames_refused == plane.stats.auth_failures == 0


@pytest.mark.parametrize("attack", ["forged", "replayed", "reordered", "oversized"])
def test_a_bad_frame_is_refused_counted_and_ends_only_its_connection(listener: Any, attack: str) -> None:
    plane, inbox = listener
    dialer = RawDialer(plane.endpoint)
    first = dialer.frame(wire.Abort(room=1))
    second = dialer.frame(wire.Abort(room=2))
    if attack == "forged":  # the body changed after sealing: the tag no longer verifies
        bad = second[:-1] + bytes([second[-1] ^ 1])
        wire_bytes, delivered = first + bad, [1]
    elif attack == "replayed":
        wire_bytes, delivered = first + first, [1]
    elif attack == "reordered":
        wire_bytes, delivered = second + first, []
    else:
        wire_bytes, delivered = struct.pack("<IQ", wire.MAX_FRAME_BYTES + 1, 0) + b"\0" * 16, []
    dialer.sock.sendall(wire_bytes)
    assert dialer.closed_by_peer(), "the connection carrying the bad frame was not ended"
    got = []
    while not inbox.messages.empty():
        got.append(inbox.messages.get_nowait()[1].room)  # type: ignore[union-attr]
    assert got == delivered and plane.stats.frames_refused == 1
    honest_frame_arrives(plane, inbox, 7)


def test_a_connection_that_ends_mid_frame_is_counted_truncated(listener: Any) -> None:
    plane, inbox = listener
    dialer = RawDialer(plane.endpoint)
    frame = dialer.frame(wire.Abort(room=1))
    dialer.sock.sendall(frame[: len(frame) - 3])
    dialer.sock.close()
    wait_for(lambda: plane.stats.frames_truncated == 1, "the truncated frame to be counted")
    assert inbox.messages.empty()
    honest_frame_arrives(plane, inbox, 2)


@pytest.mark.parametrize("secret, verdict", [(OTHER, tf.AUTH_FAILED), (None, tf.AUTH_REQUIRED)], ids=["wrong", "none"])
def test_a_dialer_without_the_secret_is_refused_and_gets_nothing_in(listener: Any, secret: bytes | None,
                                                                  verdict: int) -> None:
    plane, inbox = listener
    dialer = RawDialer(plane.endpoint, secret)
    assert dialer.verdict == bytes([verdict])
    try:
        dialer.sock.sendall(dialer.frame(wire.Abort(room=1)))
    except OSError:
        pass  # already closed by the plane
    wait_for(lambda: plane.stats.auth_refused == 1, "the refusal to be counted")
    assert inbox.messages.empty() and plane.stats.auth_failures == 1
    honest_frame_arrives(plane, inbox, 3)


def test_a_plane_with_another_secret_fails_its_peer_as_an_authentication_failure() -> None:
    a_in, b_in = Inbox("tcp"), Inbox("tcp")
    with a_in.channel("prefill-0", secret=SECRET) as a, b_in.channel("decode-0", secret=OTHER) as b:
        b.send(a.endpoint, wire.Abort(room=5))
        dead = b_in.dead.get(timeout=WAIT)
        assert dead.endpoint == a.endpoint and dead.reason.startswith("authentication failed"), dead.reason
        assert a_in.messages.empty() and b.stats.auth_failures >= 1
    assert control_threads() == []


def test_an_impostor_listener_gets_the_hello_and_no_frame() -> None:
    """A listener that does not hold the secret answers with a challenge it cannot make: the dialer
    refuses it, sends no proof and no frame, and fails the peer as an authentication failure."""
    inbox = Inbox("tcp")
    impostor = socket.create_server(("127.0.0.1", 0))
    seen = bytearray()
    done = threading.Event()

    def play() -> None:
        conn, _ = impostor.accept()
        conn.settimeout(WAIT)
        seen.extend(recv_exact(conn, tf.HELLO.size))
        seen.extend(recv_exact(conn, tf.hello_size(bytes(seen)) - tf.HELLO.size))
        conn.sendall(os.urandom(tf.CHALLENGE_BYTES))
        try:
            while chunk := conn.recv(4096):
                seen.extend(chunk)
        except OSError:
            pass
        conn.close()
        done.set()

    threading.Thread(target=play, daemon=True).start()
    endpoint = f"tcp://127.0.0.1:{impostor.getsockname()[1]}"
    with inbox.channel("decode-0", secret=SECRET) as plane:
        plane.send(endpoint, wire.Abort(room=9))
        dead = inbox.dead.get(timeout=WAIT)
        assert dead.endpoint == endpoint and dead.reason.startswith("authentication failed"), dead.reason
        assert done.wait(WAIT)
    impostor.close()
    assert bytes(seen) == bytes(seen[: tf.hello_size(bytes(seen))]), "the dialer sent more than its hello"


def test_a_flood_of_idle_connections_stays_bounded_and_an_honest_peer_gets_in() -> None:
    inbox = Inbox("tcp")
    idle: list[socket.socket] = []
    with inbox.channel("prefill-0", secret=SECRET, max_pending=8) as plane:
        host, port = plane.endpoint[6:].rsplit(":", 1)
        for _ in range(100):
            idle.append(socket.create_connection((host, int(port)), timeout=WAIT))
        wait_for(lambda: plane.stats.accepted >= 100, "the flood to be accepted")
        assert plane.pending_connections() <= 8 and plane.stats.pending_evicted >= 92
        honest_frame_arrives(plane, inbox, 4)
    for s in idle:
        s.close()
    assert control_threads() == []


def test_a_handshake_that_stalls_is_cut_at_its_timeout() -> None:
    inbox = Inbox("tcp")
    with inbox.channel("prefill-0", secret=SECRET, handshake_timeout=0.3) as plane:
        host, port = plane.endpoint[6:].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=WAIT) as half:
            half.sendall(tf.encode_hello(tf.Hello(True, b"n" * 16, ME))[:10])
            assert half.recv(1) == b""  # cut
        assert plane.stats.handshake_timeouts == 1 and plane.pending_connections() == 0


def test_frames_for_a_peer_that_never_answers_fail_their_rooms_at_the_connect_wait(monkeypatch: Any) -> None:
    monkeypatch.setattr(tcp_plane, "_CONNECT_WAIT", 0.5)
    inbox = Inbox("tcp")
    with socket.socket() as nobody:  # bound, never listening: every dial is refused
        nobody.bind(("127.0.0.1", 0))
        with inbox.channel("decode-0") as plane:
            plane.send(f"tcp://127.0.0.1:{nobody.getsockname()[1]}", wire.Abort(room=6))
            rooms, reason = inbox.failed.get(timeout=WAIT)
            assert rooms == (6,) and "no connection within" in reason
            assert plane.stats.connect_retries >= 1


def test_a_peer_that_stops_reading_fails_the_rooms_past_the_bound(monkeypatch: Any) -> None:
    """A peer that finished its handshake and never reads: what its socket does not take waits, up to
    ``_MAX_REST`` bytes; past it a frame's rooms fail ("full"), and the plane goes on."""
    monkeypatch.setattr(tcp_plane, "_MAX_REST", 1 << 20)
    inbox = Inbox("tcp")
    silent = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def accept() -> None:
        conn, _ = silent.accept()
        conns.append(conn)
        recv_exact(conn, tf.HELLO.size)
        conn.sendall(bytes([tf.OK]))  # no secret: the verdict, then never a read again

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    endpoint = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    big = wire.Abort(room=0, reason="x" * 200)
    with inbox.channel("decode-0") as plane:
        room = 0
        deadline = Deadline.after(3 * WAIT)
        while inbox.failed.empty() and not deadline.expired():
            room += 1
            plane.send(endpoint, wire.Abort(room=room, reason=big.reason))
            if room % 256 == 0:
                wait_for(lambda: plane.queued() == 0, "the loop to take the frames")
        rooms, reason = inbox.failed.get(timeout=WAIT)
        assert "full" in reason and len(rooms) >= 1
    th.join(WAIT)
    for c in conns:
        c.close()
    silent.close()
