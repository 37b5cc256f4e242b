"""TCP-specific tests: the sink's wire, driven by a hand-written peer over a real socket."""

from __future__ import annotations

import errno
import socket
import struct
import threading

import numpy as np
import pytest

import transport
from pdcore.deadline import Deadline
from transport import tcp
from pdcore.errors import TransportError
from transport.base import decode_endpoint


@pytest.fixture
def sink() -> transport.Transport:
    before = set(threading.enumerate())
    t = transport.create("tcp", peer_timeout=2.0)
    yield t
    t.close(deadline=Deadline.after(5))
    assert not [th for th in set(threading.enumerate()) - before if th.is_alive()]


def _dial(t: transport.Transport, instance: bytes | None = None) -> socket.socket:
    ep = decode_endpoint(t.endpoint())
    host, _, port = ep.address.decode().rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(tcp._HELLO.pack(tcp._MAGIC, tcp._VERSION, instance or ep.instance, b"\0" * 16))
    return s


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def _frame(seq: int, writes: list[tuple[int, bytes]]) -> bytes:
    head = tcp._FRAME.pack(seq, len(writes), 0)
    desc = b"".join(struct.pack("<QQ", addr, len(data)) for addr, data in writes)
    return head + desc + b"".join(data for _, data in writes)


def test_sink_validates_raw_frames_before_landing_anything(sink: transport.Transport) -> None:
    dst = np.zeros(4096, np.uint8)
    r = sink.register(dst)
    with _dial(sink) as s:
        assert tcp._HELLO_REPLY.unpack(_recv(s, tcp._HELLO_REPLY.size))[2] == 0
        # write 0 is fine, write 1 runs past the region's end: nothing lands
        s.sendall(_frame(1, [(r.addr, b"\x11" * 16), (r.addr + 4090, b"\x22" * 16)]))
        seq, status, err, n = tcp._ACK.unpack(_recv(s, tcp._ACK.size))
        msg = _recv(s, n).decode()
        assert (seq, status, err) == (1, 1, errno.EFAULT) and "write 1 of 2" in msg and "outside every region" in msg
        assert not dst.any()
        # a wild address far from any region, then a valid frame on the same connection
        s.sendall(_frame(2, [(8, b"\x33" * 8)]))
        s.sendall(_frame(3, [(r.addr + 100, b"\x44" * 8)]))
        acks = []
        for _ in range(2):
            seq, status, err, n = tcp._ACK.unpack(_recv(s, tcp._ACK.size))
            _recv(s, n)
            acks.append((seq, status))
        assert acks == [(2, 1), (3, 0)]
        assert (dst[100:108] == 0x44).all() and dst[:100].sum() == 0 and dst[108:].sum() == 0


def test_sink_refuses_another_instance_and_broken_frames(sink: transport.Transport) -> None:
    sink.register(np.zeros(64, np.uint8))
    with _dial(sink, instance=b"x" * 16) as s:
        assert tcp._HELLO_REPLY.unpack(_recv(s, tcp._HELLO_REPLY.size))[2] == 1
        assert s.recv(1) == b""  # and hangs up
    with _dial(sink) as s:
        _recv(s, tcp._HELLO_REPLY.size)
        s.sendall(tcp._FRAME.pack(1, (1 << 20) + 1, 0))  # more writes than a sink accepts
        assert s.recv(1) == b""  # the stream cannot be trusted: connection closed, nothing else


def test_connect_to_a_restarted_peer_fails_clearly(sink: transport.Transport) -> None:
    ep = sink.endpoint()
    other = transport.create("tcp")
    try:
        fake = decode_endpoint(ep)
        wrong = transport.encode_endpoint(transport.Endpoint(fake.transport, b"y" * 16, fake.address, fake.regions))
        with pytest.raises(TransportError, match="another transport instance"):
            other.connect(wrong, deadline=Deadline.after(5))
    finally:
        other.close()


def test_an_empty_batch_on_an_idle_peer_completes() -> None:
    """Regression: the caller's direct send of an empty batch (a header and an empty descriptor
    list) spun forever on the empty view; it must complete like any other batch."""
    src_t, dst_t = transport.create("tcp", peer_timeout=2.0), transport.create("tcp", peer_timeout=2.0)
    try:
        dst_t.register(np.zeros(4096, np.uint8))
        peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(5))
        posted = threading.Event()
        writer = threading.Thread(target=lambda: (src_t.write(peer, []), posted.set()), daemon=True)
        writer.start()
        assert posted.wait(5), "write() of an empty batch did not return"
        (completion,) = src_t.completions(deadline=Deadline.after(5))
        assert completion.error is None
    finally:
        src_t.close(deadline=Deadline.after(5))
        dst_t.close(deadline=Deadline.after(5))
