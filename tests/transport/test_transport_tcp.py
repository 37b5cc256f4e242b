"""TCP-specific tests: the sink's wire, driven by a hand-written peer over a real socket."""

from __future__ import annotations

import errno
import socket
import struct
import threading
import time

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


def _dial(t: transport.Transport, instance: bytes | None = None, source: bytes = b"\0" * 16) -> socket.socket:
    ep = decode_endpoint(t.endpoint())
    host, _, port = ep.address.decode().rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(tcp._HELLO.pack(tcp._MAGIC, tcp._VERSION, instance or ep.instance, source))
    return s


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def _frame(seq: int, writes: list[tuple[int, bytes]], grant: int = 0) -> bytes:
    head = tcp._FRAME.pack(seq, len(writes), 0, grant)
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
        s.sendall(tcp._FRAME.pack(1, (1 << 20) + 1, 0, 0))  # more writes than a sink accepts
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


def _ack(s: socket.socket) -> tuple[int, int, int, str]:
    seq, status, err, n = tcp._ACK.unpack(_recv(s, tcp._ACK.size))
    return seq, status, err, _recv(s, n).decode()


def test_sink_checks_each_frame_against_the_grant_it_names(sink: transport.Transport) -> None:
    """Regions registered with require_grant take writes only through a live grant of this very
    source, inside its ranges; every refusal lands nothing and keeps the stream in sync."""
    dst = np.zeros(4096, np.uint8)
    r = sink.register(dst, require_grant=True)
    me, other = b"S" * 16, b"T" * 16
    g = sink.grant(me, [(r.addr + 1024, 1024)])
    theirs = sink.grant(other, [(r.addr, 4096)])
    with _dial(sink, source=me) as s:
        assert tcp._HELLO_REPLY.unpack(_recv(s, tcp._HELLO_REPLY.size))[2] == 0
        s.sendall(_frame(1, [(r.addr + 1024, b"\x11" * 8)]))  # no grant named
        s.sendall(_frame(2, [(r.addr + 1024, b"\x22" * 8)], grant=theirs.key))  # another source's grant
        s.sendall(_frame(3, [(r.addr + 1024, b"\x33" * 8), (r.addr + 2047, b"\x33" * 2)], grant=g.key))  # 1 byte out
        s.sendall(_frame(4, [(r.addr + 2040, b"\x44" * 8)], grant=g.key))  # inside: lands
        acks = [_ack(s) for _ in range(4)]
        assert [a[:2] for a in acks] == [(1, 1), (2, 1), (3, 1), (4, 0)]
        assert "requires one" in acks[0][3] and "another source" in acks[1][3] and "outside grant" in acks[2][3]
        assert acks[0][2] == errno.EACCES
        assert (dst[2040:2048] == 0x44).all() and int(dst.astype(bool).sum()) == 8
        sink.revoke(g, deadline=Deadline.after(5))
        s.sendall(_frame(5, [(r.addr + 1024, b"\x55" * 8)], grant=g.key))  # revoked: refused
        seq, status, _err, msg = _ack(s)
        assert (seq, status) == (5, 1) and "not live" in msg
        assert int(dst.astype(bool).sum()) == 8
    with pytest.raises(ValueError, match="outside every registered region"):
        sink.grant(me, [(r.addr + 4000, 200)])


def test_revoke_cuts_a_frame_stalled_mid_payload_and_nothing_lands_after_it(sink: transport.Transport) -> None:
    """A paused source in the middle of a frame: revoke returns within its deadline, and the rest
    of the payload, sent after revoke returned, lands nowhere."""
    dst = np.zeros(1 << 16, np.uint8)
    r = sink.register(dst, require_grant=True)
    me = b"P" * 16
    g = sink.grant(me, [(r.addr, 1 << 16)])
    s = _dial(sink, source=me)
    try:
        assert tcp._HELLO_REPLY.unpack(_recv(s, tcp._HELLO_REPLY.size))[2] == 0
        frame = _frame(1, [(r.addr, b"\x66" * (1 << 16))], grant=g.key)
        head = len(frame) - (1 << 16)
        s.sendall(frame[: head + 100])  # the header and 100 bytes of payload, then the source "pauses"
        deadline = Deadline.after(10)
        while not (dst[:100] == 0x66).all():  # the sink is now landing the frame
            assert not deadline.expired(), "the first bytes never landed"
            threading.Event().wait(0.01)
        before = time.monotonic()
        sink.revoke(g, deadline=Deadline.after(0.5))
        assert time.monotonic() - before < 5.0
        snapshot = dst.copy()
        try:
            s.sendall(frame[head + 100 :])  # the source resumes: the connection is cut, or the bytes go nowhere
        except OSError:
            pass
        quiet = Deadline.after(0.5)
        while not quiet.expired():
            assert (dst == snapshot).all(), "bytes landed after revoke returned"
            threading.Event().wait(0.05)
    finally:
        s.close()


def test_a_sink_at_its_connection_cap_refuses_more_with_a_clear_error() -> None:
    sink = transport.create("tcp", max_sinks=2)
    sources = [transport.create("tcp") for _ in range(3)]
    try:
        sink.register(np.zeros(64, np.uint8))
        first = [src.connect(sink.endpoint(), deadline=Deadline.after(5)) for src in sources[:2]]
        for src, peer in zip(sources, first):  # both connections are served (their sink threads hold a place)
            src.write(peer, [])
            assert src.completions(deadline=Deadline.after(5))[0].error is None
        with pytest.raises(TransportError, match="cap of data connections"):
            sources[2].connect(sink.endpoint(), deadline=Deadline.after(5))
        assert sink.refused_connections == 1
        sources[0].disconnect(first[0])  # a place frees up: a new connection is served again
        deadline = Deadline.after(5)
        while True:
            try:
                peer = sources[2].connect(sink.endpoint(), deadline=Deadline.after(5))
                break
            except TransportError:
                assert not deadline.expired(), "the sink never freed the place of a closed connection"
                threading.Event().wait(0.05)
        sources[2].write(peer, [])
        assert sources[2].completions(deadline=Deadline.after(5))[0].error is None
    finally:
        for t in (*sources, sink):
            t.close(deadline=Deadline.after(5))


def test_raw_frames_at_the_exact_edge_of_a_region(sink: transport.Transport) -> None:
    """One byte past a region's end (or across into the adjacent region) is refused by the sink,
    EFAULT with a message naming the write, nothing of the frame lands, and the stream keeps its
    place (the payload is read and dropped): the next frame, ending exactly at the end, lands."""
    n = 4096
    mem = np.zeros(2 * n + 16, np.uint8)
    r1, r2 = sink.register(mem[:n]), sink.register(mem[n : 2 * n])  # adjacent regions, then 16 bytes of nothing
    assert r1.end == r2.addr
    refused = [
        [(r2.addr + n - 7, b"\x11" * 8)],  # one byte past the last region's end
        [(r2.end, b"\x12")],  # starts at the end
        [(r1.addr - 1, b"\x13" * 2)],  # one byte before the first region
        [(r1.end - 1, b"\x14" * 2)],  # across the boundary of two regions
        [(r1.addr, b"\x15" * 8), (r1.end - 3, b"\x16" * 4)],  # a valid write, then one byte past
    ]
    with _dial(sink) as s:
        assert tcp._HELLO_REPLY.unpack(_recv(s, tcp._HELLO_REPLY.size))[2] == 0
        for seq, writes in enumerate(refused, 1):
            s.sendall(_frame(seq, writes))
            got = _ack(s)
            assert got[:3] == (seq, 1, errno.EFAULT), (writes, got)
            assert f"write {len(writes) - 1} of {len(writes)}" in got[3] and "outside every region" in got[3], got
            assert not mem.any(), f"frame {seq} landed bytes"
        # exactly at the ends, then a write spanning all of r2: all land, acks in order
        s.sendall(_frame(10, [(r1.end - 8, b"\x21" * 8)]) + _frame(11, [(r2.end - 1, b"\x22")])
                  + _frame(12, [(r1.addr, b"\x23")]))
        assert [_ack(s)[:2] for _ in range(3)] == [(10, 0), (11, 0), (12, 0)]
    expected = np.zeros_like(mem)
    expected[n - 8 : n] = 0x21
    expected[2 * n - 1] = 0x22
    expected[0] = 0x23
    assert np.array_equal(mem, expected)
