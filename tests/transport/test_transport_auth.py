"""Authenticated TCP handshakes (the ``secret`` option), over real loopback sockets.

A sink's memory has a canary pattern; every attack checks that no byte of it
changes, that the sink counts the refusal (``auth_failures``), that its
handshake threads end, and that a legitimate source connected to the same sink
carries on undisturbed. Every wait is bounded by a deadline; nothing sleeps to
synchronise.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import transport
from pdcore.control import auth as pdcore_auth
from pdcore.core.deadline import Deadline
from pdcore.core.errors import StartError, TransportError
from transport import tcp, tcp_hello
from transport.base import Endpoint, Grant, PeerHandle, Region, Transport, decode_endpoint, derive_key, encode_endpoint

from _transport_support import Collector, MakeTransport, transport_maker

SECRET = b"pdcore-tests: the right secret!!"
OTHER = b"pdcore-tests: another secret..!!"
CANARY = 0x5C
SIZE = 1 << 16


@pytest.fixture
def make() -> Iterator[MakeTransport]:
    """TCP transports, all closed after the test; no thread may outlive them."""
    yield from transport_maker("tcp", {"peer_timeout": 5.0})


def _hostport(t: Transport) -> str:
    return decode_endpoint(t.endpoint()).address.decode()


def _wait(cond: Any, what: str, seconds: float = 10.0) -> None:
    deadline = Deadline.after(seconds)
    while not cond():
        assert not deadline.expired(), f"{what} within {seconds} s"
        threading.Event().wait(0.01)


def _sink_threads(t: Any) -> int:
    with t._lock:
        return len(t._sinks)


class Scene:
    """A sink (canary-filled region that requires grants) with a legitimate source connected
    through a live grant; ``check_bystander`` proves that source is still undisturbed."""

    def __init__(self, make: MakeTransport, secret: bytes | None, **sink_options: Any) -> None:
        self.sink = make(secret=secret, **sink_options)
        self.dst = np.full(SIZE, CANARY, np.uint8)
        self.region: Region = self.sink.register(self.dst, require_grant=True)
        self.legit = make(secret=secret)
        self.src = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
        self.local: Region = self.legit.register(self.src)
        # the bystander's own quarter of the region; attacks aim at the rest
        self.mine = (self.region.addr + SIZE * 3 // 4, SIZE // 4)
        self.grant: Grant = self.sink.grant(self.legit.instance, [(self.region.addr, SIZE)])
        self.peer: PeerHandle = self.legit.connect(self.sink.endpoint(), deadline=Deadline.after(5))
        self.rounds = 0
        self.check_bystander()
        _wait(lambda: _sink_threads(self.sink) == 1, "the legitimate source's sink thread is up")
        self.canary = self.dst[: SIZE * 3 // 4].copy()

    def check_bystander(self) -> None:
        """The legitimate source writes its quarter (a new pattern each round) on its first connection."""
        self.rounds += 1
        off = SIZE * 3 // 4
        self.src[off:] = (np.arange(SIZE // 4) + self.rounds).astype(np.uint8)
        done = Collector()
        self.legit.write(self.peer, [(self.local.addr + off, self.mine[0], self.mine[1])], done, grant=self.grant.key)
        [(_bid, err)] = done.wait(1)
        assert err is None
        assert (self.dst[off:] == self.src[off:]).all()

    def untouched(self) -> bool:
        return bool((self.dst[: SIZE * 3 // 4] == self.canary).all())


def _assert_auth_error(e: TransportError, sink: Transport) -> None:
    msg = str(e)
    assert msg.startswith("authentication failed:"), msg
    assert _hostport(sink) in msg, msg
    assert e.errno == errno.EACCES and e.op == "connect"


# ----------------------------------------------------------------------------- the good path


def test_same_secret_writes_land(make: MakeTransport) -> None:
    scene = Scene(make, SECRET)
    assert scene.sink.auth_failures == 0
    other = make(secret=bytearray(SECRET))  # any bytes-like value
    buf = np.full(4096, 0xA7, np.uint8)
    r = other.register(buf)
    g = scene.sink.grant(other.instance, [(scene.region.addr + 4096, 4096)])
    peer = other.connect(scene.sink.endpoint(), deadline=Deadline.after(5))
    done = Collector()
    other.write(peer, [(r.addr, scene.region.addr + 4096, 4096)], done, grant=g.key)
    assert done.wait(1)[0][1] is None
    assert (scene.dst[4096:8192] == 0xA7).all()
    assert (scene.dst[:4096] == CANARY).all() and (scene.dst[8192 : SIZE * 3 // 4] == CANARY).all()
    scene.check_bystander()
    assert scene.sink.auth_failures == 0


def test_faulty_wrapper_passes_the_secret_to_the_inner_transport() -> None:
    sink = transport.create("faulty:tcp", secret=SECRET, seed=1)
    sources = [transport.create("tcp", secret=SECRET), transport.create("tcp")]
    try:
        sink.register(np.zeros(64, np.uint8))
        sources[0].connect(sink.endpoint(), deadline=Deadline.after(5))
        with pytest.raises(TransportError, match="^authentication failed:"):
            sources[1].connect(sink.endpoint(), deadline=Deadline.after(5))
        _wait(lambda: sink.auth_failures == 1, "the wrapper reports the inner sink's count")
    finally:
        for t in (*sources, sink):
            t.close(deadline=Deadline.after(5))


def test_the_key_is_pdcore_auths_derivation() -> None:
    for secret in (SECRET, bytes(range(256)) * 16):
        for label in ("tcp-hello", "verbs-hello"):
            assert derive_key(secret, label) == pdcore_auth.derive_key(secret, label)


@pytest.mark.parametrize(
    "secret, why",
    [(b"x" * 15, "15 bytes"), (b"x" * 4097, "4097 bytes"), ("a str, not bytes!", "must be bytes"), (12345678901234567890, "must be bytes")],
)
def test_a_bad_secret_option_is_a_start_error_that_does_not_echo_it(secret: Any, why: str) -> None:
    with pytest.raises(StartError, match="secret") as ei:
        transport.create("tcp", secret=secret)
    assert why in str(ei.value)
    assert str(secret)[:15] not in str(ei.value)


# ----------------------------------------------------------------------------- mismatches


@pytest.mark.parametrize(
    "sink_secret, source_secret",
    [(SECRET, OTHER), (SECRET, None), (None, SECRET)],
    ids=["different-secrets", "source-without", "sink-without"],
)
def test_a_mismatch_fails_connect_and_lands_nothing(
    make: MakeTransport, sink_secret: bytes | None, source_secret: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="transport.tcp")
    scene = Scene(make, sink_secret)
    intruder = make(secret=source_secret)
    buf = np.full(SIZE, 0xEE, np.uint8)
    intruder.register(buf)
    scene.sink.grant(intruder.instance, [(scene.region.addr, SIZE // 2)])  # even a granted source needs the secret
    with pytest.raises(TransportError) as ei:
        intruder.connect(scene.sink.endpoint(), deadline=Deadline.after(5))
    _assert_auth_error(ei.value, scene.sink)
    _wait(lambda: scene.sink.auth_failures == 1, "the sink counts the failed handshake")
    _wait(lambda: _sink_threads(scene.sink) == 1, "the handshake's sink thread ends")
    assert scene.untouched()
    scene.check_bystander()
    assert scene.sink.auth_failures == 1
    [record] = [r for r in caplog.records if "authentication failed" in r.getMessage()]
    assert "127.0.0.1:" in record.getMessage()
    for secret in (SECRET, OTHER):  # never in a message, a log line or a repr
        for text in (str(ei.value), caplog.text, repr(scene.sink), repr(intruder)):
            assert secret.decode() not in text and secret.hex() not in text


def test_a_flood_of_bad_handshakes_is_counted_but_logged_once(make: MakeTransport, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="transport.tcp")
    scene = Scene(make, SECRET)
    intruders = [make(secret=OTHER), make()]
    for i in range(10):
        with pytest.raises(TransportError, match="^authentication failed:"):
            intruders[i % 2].connect(scene.sink.endpoint(), deadline=Deadline.after(5))
    _wait(lambda: scene.sink.auth_failures == 10, "every failed handshake is counted")
    assert len([r for r in caplog.records if "authentication failed" in r.getMessage()]) == 1
    _wait(lambda: _sink_threads(scene.sink) == 1, "the handshakes' sink threads end")
    assert scene.untouched()
    scene.check_bystander()


# ----------------------------------------------------------------------------- raw sockets


def _dial(t: Transport) -> socket.socket:
    host, _, port = _hostport(t).rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _recv_all(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def _until_eof(s: socket.socket) -> bytes:
    """Everything the sink sends until it hangs up (the socket's timeout bounds each wait)."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(4096):
            out += chunk
    return out


def _frame(seq: int, addr: int, data: bytes, grant: int) -> bytes:
    return tcp._FRAME.pack(seq, 1, 0, grant) + struct.pack("<QQ", addr, len(data)) + data


@pytest.mark.parametrize("how", ["plain-hello", "forged-proof"])
def test_a_raw_socket_knowing_the_instance_and_the_grant_key_lands_nothing(make: MakeTransport, how: str) -> None:
    """The intruder knows the sink's instance id, the legitimate source's instance id and its live
    grant key (all of them travel in the clear); it lacks only the secret."""
    scene = Scene(make, SECRET)
    nonce = os.urandom(16) if how == "forged-proof" else b""
    hello = tcp_hello.Hello(scene.sink.instance, scene.legit.instance, tcp_hello.DATA, os.urandom(16), nonce)
    frame = _frame(1, scene.region.addr, b"\xee" * 4096, scene.grant.key)
    with _dial(scene.sink) as s:
        if how == "plain-hello":
            s.sendall(tcp_hello.encode_hello(hello) + frame)
            reply = _until_eof(s)
            assert tcp_hello.HELLO_REPLY.unpack(reply[: tcp_hello.HELLO_REPLY.size])[2] == tcp_hello.AUTH_REQUIRED
        else:
            s.sendall(tcp_hello.encode_hello(hello))
            assert tcp_hello.HELLO_REPLY.unpack(_recv_all(s, tcp_hello.HELLO_REPLY.size))[2] == tcp_hello.OK
            _recv_all(s, tcp_hello.CHALLENGE.size)  # the sink's nonce and MAC: no use without the key
            s.sendall(os.urandom(32) + frame)
            reply = _until_eof(s)
            assert tcp_hello.HELLO_REPLY.unpack(reply[: tcp_hello.HELLO_REPLY.size])[2] == tcp_hello.AUTH_FAILED
        assert len(reply) == tcp_hello.HELLO_REPLY.size  # no ack: the frame was never read as one
    _wait(lambda: scene.sink.auth_failures == 1, "the sink counts the rejection")
    _wait(lambda: _sink_threads(scene.sink) == 1, "the intruder's sink thread ends")
    assert scene.untouched()
    scene.check_bystander()


class Forwarder:
    """A loopback TCP forwarder for a source's two connections that records what the client sent on
    the first (its data connection)."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(5)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}".encode()
        self.sent = bytearray()  # client -> server bytes of the data connection
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._run, daemon=True)]
        self._threads[0].start()

    def _run(self) -> None:
        for record in (self.sent, None):  # the data connection, then the ack connection
            client, _ = self._listener.accept()
            server = socket.create_connection(self._target, timeout=5)
            self._socks += [client, server]
            for a, b, r in ((server, client, None), (client, server, record)):
                t = threading.Thread(target=self._pump, args=(a, b, r), daemon=True)
                self._threads.append(t)
                t.start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket, record: bytearray | None) -> None:
        a.settimeout(10)
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                if record is not None:
                    record += data
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(10)
        assert not any(t.is_alive() for t in self._threads)
        for s in (*self._socks, self._listener):
            s.close()


def test_a_replayed_handshake_is_refused(make: MakeTransport) -> None:
    """Record a legitimate source's bytes (hello, proof, one frame) through a forwarder, then replay
    them on a new connection: the sink's nonce is new, so the proof does not verify."""
    scene = Scene(make, SECRET)
    victim = make(secret=SECRET)
    buf = np.full(4096, 0xD1, np.uint8)
    r = victim.register(buf)
    g = scene.sink.grant(victim.instance, [(scene.region.addr, 4096)])
    fwd = Forwarder(_hostport(scene.sink))
    try:
        ep = decode_endpoint(scene.sink.endpoint())
        via = encode_endpoint(Endpoint(ep.transport, ep.instance, fwd.address, ep.regions))
        peer = victim.connect(via, deadline=Deadline.after(5))
        done = Collector()
        victim.write(peer, [(r.addr, scene.region.addr, 4096)], done, grant=g.key)
        assert done.wait(1)[0][1] is None
        assert (scene.dst[:4096] == 0xD1).all()
        victim.disconnect(peer)
    finally:
        fwd.close()
    recorded = bytes(fwd.sent)
    assert recorded.startswith(b"PDTA") and len(recorded) > tcp_hello.HELLO_AUTH.size + 32 + 4096
    scene.dst[:4096] = CANARY  # the sink's memory is back to the canary: a replay that landed would show
    _wait(lambda: _sink_threads(scene.sink) == 1, "the victim's sink thread ends")
    for _ in range(2):
        with _dial(scene.sink) as s:
            s.sendall(recorded)
            reply = _until_eof(s)
        assert len(reply) == tcp_hello.HELLO_REPLY.size + tcp_hello.CHALLENGE.size + tcp_hello.HELLO_REPLY.size
        assert tcp_hello.HELLO_REPLY.unpack(reply[-tcp_hello.HELLO_REPLY.size :])[2] == tcp_hello.AUTH_FAILED
    _wait(lambda: scene.sink.auth_failures == 2, "the sink counts both replays")
    _wait(lambda: _sink_threads(scene.sink) == 1, "the replays' sink threads end")
    assert scene.untouched()
    scene.check_bystander()


# ----------------------------------------------------------------------------- idle sockets


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
def test_an_idle_socket_keeps_no_source_out_and_is_dropped_in_time(make: MakeTransport, secret: bytes | None) -> None:
    sink = make(secret=secret, max_sinks=1, peer_timeout=1.0)
    sink.register(np.zeros(64, np.uint8))
    legit = make(secret=secret)
    idle = _dial(sink)  # never sends a hello
    try:
        _wait(lambda: _sink_threads(sink) == 1, "the sink took the idle connection")
        peer = legit.connect(sink.endpoint(), deadline=Deadline.after(2))  # max_sinks=1, yet it gets in
        legit.write(peer, [])
        assert legit.completions(deadline=Deadline.after(5))[0].error is None
        idle.settimeout(5)  # the sink drops it after min(peer_timeout, 5 s) = 1 s
        assert _until_eof(idle) == b""
        _wait(lambda: _sink_threads(sink) == 1, "only the legitimate connection holds a sink thread")
        assert sink.auth_failures == 0  # silence is not a failed authentication
    finally:
        idle.close()


def _handshakes(t: Any) -> int:
    with t._lock:
        return len(t._sinks) - len(t._live)


def test_handshakes_in_progress_are_bounded_and_the_oldest_is_cut(make: MakeTransport) -> None:
    """Past ``_MAX_HELLOS`` idle connections a newcomer gets in and the oldest handshake is cut (the
    newcomer is not refused); the count of connections in their handshake stays at the bound."""
    sink = make(secret=SECRET, peer_timeout=5.0)
    sink.register(np.zeros(64, np.uint8))
    legit = make(secret=SECRET)
    idle = [_dial(sink) for _ in range(tcp._MAX_HELLOS)]
    try:
        _wait(lambda: _sink_threads(sink) == tcp._MAX_HELLOS, "the sink took every idle connection")
        peer = legit.connect(sink.endpoint(), deadline=Deadline.after(5))
        legit.write(peer, [])
        assert legit.completions(deadline=Deadline.after(5))[0].error is None
        # its data connection's handshake cut the oldest without a word; its ack connection's came
        # once that one was over (a place free again)
        assert sink.evicted_handshakes == 1 and sink.refused_connections == 0
        assert _until_eof(idle[0]) == b""
        late = [_dial(sink), _dial(sink)]  # the first takes the legitimate one's place, the second cuts
        try:
            assert _until_eof(idle[1]) == b""  # the next oldest
            assert sink.evicted_handshakes == 2
            _wait(lambda: _handshakes(sink) <= tcp._MAX_HELLOS, "at most _MAX_HELLOS handshakes")
        finally:
            for s in late:
                s.close()
        assert sink.auth_failures == 0  # a cut handshake is not a failed authentication
    finally:
        for s in idle:
            s.close()


def test_the_oldest_silent_handshake_is_cut_not_an_older_one_whose_client_spoke(make: MakeTransport) -> None:
    """A flood of idle connections faster than the hello threads must cut its own connections, not
    a source's whose hello has come and not been read yet: with the oldest handshake place held by a
    client that sent part of a hello and the rest by idle ones, a newcomer cuts the oldest idle one,
    and the talker's connection stays open."""
    sink = make(secret=SECRET, peer_timeout=5.0)
    sink.register(np.zeros(64, np.uint8))
    talker = _dial(sink)
    talker.sendall(tcp.MAGIC[:3])  # a hello begun: the sink's thread waits for the rest
    idle = [_dial(sink) for _ in range(tcp._MAX_HELLOS - 1)]
    late = None
    try:
        _wait(lambda: _sink_threads(sink) == tcp._MAX_HELLOS, "the sink took every connection")
        late = _dial(sink)
        _wait(lambda: sink.evicted_handshakes == 1, "one handshake cut for the newcomer")
        assert _until_eof(idle[0]) == b""  # the oldest silent one, cut without a word
        talker.setblocking(False)
        with pytest.raises(BlockingIOError):  # open, nothing sent to it: not cut
            talker.recv(1, socket.MSG_PEEK)
        assert sink.evicted_handshakes == 1
    finally:
        for s in [talker, *idle, *([late] if late else [])]:
            s.close()


def test_a_flood_of_idle_sockets_keeps_no_authenticated_source_out(make: MakeTransport) -> None:
    """More idle sockets than there are handshake places, from another process and redialled as the
    sink drops them: every one of ``CONNECTS`` authenticated connects gets in within its deadline
    (and carries a batch), and the sink counts what it cut to make room."""
    from _flood import Child, run_flood

    connects = 40
    sink = make(secret=SECRET, peer_timeout=5.0)
    dst = np.zeros(4096, np.uint8)
    region = sink.register(dst)
    legit = make(secret=SECRET)
    local = legit.register(np.full(4096, 7, np.uint8))
    host, _, port = _hostport(sink).rpartition(":")
    flood = Child(run_flood, host, int(port), tcp._MAX_HELLOS + 16)
    try:
        _wait(lambda: _handshakes(sink) >= tcp._MAX_HELLOS, "the flood fills every handshake place")
        for i in range(connects):
            peer = legit.connect(sink.endpoint(), deadline=Deadline.after(5))  # raises past its deadline
            done = Collector()
            legit.write(peer, [(local.addr, region.addr, 4096)], done)
            assert done.wait(1)[0][1] is None, f"connect {i}"
            legit.disconnect(peer)
        stats = flood.call("stats")
        assert stats["dropped"] > 0 and sink.evicted_handshakes > 0, (stats, sink.evicted_handshakes)
        assert (dst == 7).all()
        assert sink.auth_failures == 0
    finally:
        flood.close()
    _wait(lambda: _sink_threads(sink) == 0, "the flood's connections end with it")


# ----------------------------------------------------------------------------- the sans-IO hello


def test_the_hello_codec_accepts_only_exact_authentic_bytes() -> None:
    key, wrong = derive_key(SECRET, "tcp-hello"), derive_key(OTHER, "tcp-hello")
    hello = tcp_hello.Hello(b"K" * 16, b"S" * 16, tcp_hello.DATA, b"p" * 16, b"n" * 16)
    assert tcp_hello.decode_hello(tcp_hello.encode_hello(hello)) == hello
    plain = tcp_hello.Hello(b"K" * 16, b"S" * 16, tcp_hello.ACKS, b"p" * 16)
    assert tcp_hello.decode_hello(tcp_hello.encode_hello(plain)) == plain
    wire = tcp_hello.encode_hello(hello)
    kind_at = tcp_hello.HELLO_AUTH.size - 16 - 16 - 1  # before the pair token and the nonce
    no_kind = wire[:kind_at] + b"\x03" + wire[kind_at + 1 :]
    for bad in (b"", b"PDTA", wire[:-1], wire + b"x", b"XXXX" + wire[4:], no_kind):
        with pytest.raises(tcp_hello.HelloError):
            tcp_hello.decode_hello(bad)
    body = tcp_hello.challenge(key, hello, b"k" * 16)
    nonce, answer = tcp_hello.check_challenge(key, hello, body)
    assert nonce == b"k" * 16
    tcp_hello.check_proof(key, hello, nonce, answer)
    with pytest.raises(tcp_hello.HelloError):
        tcp_hello.check_challenge(wrong, hello, body)
    with pytest.raises(tcp_hello.HelloError):  # a sink's MAC is no source proof: the roles differ
        tcp_hello.check_proof(key, hello, nonce, body[16:])
    with pytest.raises(tcp_hello.HelloError):  # bound to the source's nonce
        tcp_hello.check_challenge(key, tcp_hello.Hello(b"K" * 16, b"S" * 16, tcp_hello.DATA, b"p" * 16, b"m" * 16), body)
    with pytest.raises(tcp_hello.HelloError):  # and to the sink's
        tcp_hello.check_proof(key, hello, b"j" * 16, answer)
    for other in (tcp_hello.Hello(b"K" * 16, b"S" * 16, tcp_hello.ACKS, b"p" * 16, b"n" * 16),
                  tcp_hello.Hello(b"K" * 16, b"S" * 16, tcp_hello.DATA, b"q" * 16, b"n" * 16)):
        with pytest.raises(tcp_hello.HelloError):  # and to the connection's kind and pair token
            tcp_hello.check_proof(key, other, nonce, answer)
