"""The TCP sink's landing loop and table on their own (``_fast.Sink``, ``_fast.SinkConn``), on both
twins: a hand-written source on one end of a loopback connection, ``serve()`` on a thread at the
other. What the transport builds on: a frame is acked at once when nothing follows it, a refused one
lands nothing and keeps the stream in place, and the landing mark holds ``wait_grant`` and
``wait_region`` until the frame is in or its connection is cut (``cut_grant``), after which the loop
writes nothing more. A landed frame's note comes back from ``serve()`` before its ack goes out, and a
note the wire cannot carry ends the connection.
"""

from __future__ import annotations

import contextlib
import errno
import queue
import select
import socket
import struct
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from transport import tcp
from transport.deadline import Deadline

ME = b"S" * 16
TICK = 0.05  # the sink socket's kernel timeouts: a blocked call returns this often to check stop and stalls


def _frame(seq: int, writes: list[tuple[int, bytes]], grant: int = 0, note: bytes = b"") -> bytes:
    head = tcp._FRAME.pack(seq, len(writes), len(note), grant)
    desc = b"".join(struct.pack("<QQ", a, len(d)) for a, d in writes)
    return head + desc + note + b"".join(d for _, d in writes)


class Loop:
    """A sink table over one buffer (region key 1) and one connection served on a thread."""

    def __init__(self, impl: ModuleType, size: int = 1 << 16, guarded: bool = False, stall: float = 5.0,
                 max_writes: int = 1024) -> None:
        self.impl = impl
        self.mem = np.zeros(size, np.uint8)
        self.addr = int(self.mem.ctypes.data)
        self.sink = impl.Sink()
        self.sink.set_regions(np.array([self.addr], np.uint64), np.array([size], np.uint64),
                              np.array([guarded], np.uint8), np.array([1], np.uint64), [memoryview(self.mem)])
        server = socket.create_server(("127.0.0.1", 0))
        self.src = socket.create_connection(server.getsockname(), timeout=5)
        self.conn, _ = server.accept()
        server.close()
        tcp._kernel_timeouts(self.conn, TICK)
        self.served = self.sink.connection(self.conn, self.conn, ME, max_writes, stall)  # acks on the same socket
        self.results: queue.Queue[tuple[int, ...]] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.serve()

    def serve(self) -> None:
        assert self.thread is None or not self.thread.is_alive()
        self.thread = threading.Thread(target=lambda: self.results.put(self.served.serve()), daemon=True)
        self.thread.start()

    def result(self) -> tuple[int, ...]:
        return self.results.get(timeout=10)

    def ack(self) -> tuple[int, int, int, bytes]:
        seq, status, err, n = tcp._ACK.unpack(self.recv(tcp._ACK.size))
        return seq, status, err, self.recv(n)

    def recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.src.recv(n - len(out))  # the socket's 5 s timeout bounds every wait
            assert chunk, "the sink closed the connection"
            out += chunk
        return out

    def wait_landed(self, offset: int, value: int) -> None:
        deadline = Deadline.after(10)
        while self.mem[offset] != value:
            assert not deadline.expired(), f"byte {offset} never landed"
            threading.Event().wait(0.005)

    def close(self) -> None:
        self.sink.stop()
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.thread is not None:
            self.thread.join(10)
            assert not self.thread.is_alive(), "serve() did not end"
        self.served.close()
        self.conn.close()
        self.src.close()


@pytest.fixture
def loops(fast_impl: ModuleType) -> Iterator[Any]:
    made: list[Loop] = []

    def make(**kw: Any) -> Loop:
        made.append(Loop(fast_impl, **kw))
        return made[-1]

    yield make
    for loop in made:
        loop.close()


def test_a_lone_frame_is_acked_at_once_and_many_are_acked_in_order(loops: Any) -> None:
    loop = loops()
    loop.src.sendall(_frame(1, [(loop.addr + 8, b"\x11" * 8)]))
    assert loop.ack() == (1, 0, 0, b"")  # nothing follows it: acked without waiting for more
    assert (loop.mem[8:16] == 0x11).all()
    frames = [_frame(seq, [(loop.addr + 64 * seq, bytes([seq]) * 64), (loop.addr + 64 * seq + 32, bytes([seq]) * 8)])
              for seq in range(2, 42)]
    frames.insert(5, _frame(100, []))  # an empty batch: a header alone, then the next frame's
    loop.src.sendall(b"".join(frames))  # more than one gather (16) at once, headers read ahead of payloads
    assert [loop.ack()[:2] for _ in range(41)] == [(s, 0) for s in [*range(2, 7), 100, *range(7, 42)]]
    for seq in range(2, 42):
        assert (loop.mem[64 * seq : 64 * seq + 64] == seq).all()


def test_a_refused_frame_lands_nothing_and_keeps_the_stream_in_place(loops: Any) -> None:
    loop = loops()
    bad = _frame(7, [(loop.addr, b"\x22" * 16), (loop.addr + (1 << 16) - 4, b"\x22" * 8)])  # write 1 runs past the end
    loop.src.sendall(bad + _frame(8, [(loop.addr + 100, b"\x33" * 4)]))
    result = loop.result()
    assert result == (loop.impl.SERVE_REFUSED, 7, loop.impl.LAND_OUTSIDE_REGIONS, 1, 2, loop.addr + (1 << 16) - 4, 8, 0, 24)
    assert not loop.mem.any()
    loop.served.refuse(7, errno.EFAULT, b"why", 24)  # its ack, and its 24 bytes of payload dropped
    loop.serve()
    assert loop.ack() == (7, 1, errno.EFAULT, b"why")
    assert loop.ack() == (8, 0, 0, b"")
    assert (loop.mem[100:104] == 0x33).all() and int(loop.mem.astype(bool).sum()) == 4


def test_grants_are_checked_per_frame_and_a_revoked_one_refuses(loops: Any) -> None:
    loop = loops(guarded=True)
    loop.sink.add_grant(5, ME, np.array([loop.addr + 4096], np.uint64), np.array([4096], np.uint64))
    loop.sink.add_grant(6, b"T" * 16, np.array([loop.addr], np.uint64), np.array([1 << 16], np.uint64))
    expect = [
        (_frame(1, [(loop.addr + 4096, b"\x01")]), loop.impl.LAND_NEEDS_GRANT),
        (_frame(2, [(loop.addr + 4096, b"\x02")], grant=6), loop.impl.LAND_GRANT_OTHER_SOURCE),
        (_frame(3, [(loop.addr + 4096, b"\x03"), (loop.addr + 8191, b"\x03\x03")], grant=5), loop.impl.LAND_OUTSIDE_GRANT),
        (_frame(4, [(loop.addr + 4096, b"\x04")], grant=9), loop.impl.LAND_GRANT_NOT_LIVE),
    ]
    for frame, code in expect:
        loop.src.sendall(frame)
        result = loop.result()
        assert result[0] == loop.impl.SERVE_REFUSED and result[2] == code, (result, code)
        loop.served.refuse(result[1], errno.EACCES, b"", result[8])
        loop.serve()
        assert loop.ack()[:2] == (result[1], 1)
    loop.src.sendall(_frame(5, [(loop.addr + 8190, b"\x05\x05")], grant=5))
    assert loop.ack() == (5, 0, 0, b"")
    assert loop.sink.remove_grant(5)
    loop.src.sendall(_frame(6, [(loop.addr + 8190, b"\x06\x06")], grant=5))
    result = loop.result()
    assert result[:3] == (loop.impl.SERVE_REFUSED, 6, loop.impl.LAND_GRANT_NOT_LIVE)
    assert int(loop.mem.astype(bool).sum()) == 2 and (loop.mem[8190:8192] == 5).all()


KEEP = 1 << 16  # what a sink connection keeps in its header buffer between frames (_KEEP, both twins)
HELD = 4 * KEEP  # its header, ack and refused-payload buffers and landing marks: each within KEEP


@contextlib.contextmanager
def _python_allocations() -> Iterator[Callable[[], int]]:
    """Bytes of Python objects allocated since entering and still alive (``tracemalloc``): what the pure
    twin keeps of a frame, which ``retained()`` (its buffers) does not count. The compiled twin's
    buffers are ``malloc``'d and not traced: its ``retained()`` counts them."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        yield lambda: tracemalloc.get_traced_memory()[0] - start
    finally:
        if not tracing:
            tracemalloc.stop()


def test_a_frame_of_many_writes_is_not_held_once_it_is_done(loops: Any) -> None:
    """Regression: a connection's header buffer grew to a frame's descriptors (16 bytes a write: 16 MiB
    at the transport's max_batch_writes) and never shrank, so every connection that once received a
    big batch held it for good (the pure twin: its descriptors and a view per write, some 200 bytes a
    write, until the next frame came). Once the frame is done (landed, or refused and its ack
    worded), what the connection holds is back within a small bound, before its ack goes out."""
    n = 1 << 15  # 512 KiB of descriptors, 64 KiB of payload
    loop = loops(max_writes=n)
    assert loop.sink.retained() == [loop.served.retained()] and loop.served.retained() <= HELD
    writes = [(loop.addr + 2 * i, bytes([1 + i % 251]) * 2) for i in range(n)]
    assert 16 * n > HELD
    landed = _frame(1, writes)
    writes[-1] = (loop.addr + (1 << 16) - 1, b"\x05\x05")  # its last write runs past the region: refused
    refused = _frame(2, writes)
    with _python_allocations() as allocated:
        loop.src.sendall(landed)
        assert loop.ack() == (1, 0, 0, b"")
        assert loop.mem[-1] == 1 + (n - 1) % 251
        held = loop.served.retained()
        assert held <= HELD, f"a connection holds {held} bytes after a frame of {n} writes"
        assert allocated() <= HELD, f"{allocated()} bytes of Python objects stay alive after a frame of {n} writes"
        loop.src.sendall(refused)
        result = loop.result()
        assert result[:5] == (loop.impl.SERVE_REFUSED, 2, loop.impl.LAND_OUTSIDE_REGIONS, n - 1, n)
        loop.served.refuse(2, errno.EFAULT, b"why", result[8])
        loop.serve()
        assert loop.ack() == (2, 1, errno.EFAULT, b"why")
        held = loop.served.retained()
        assert held <= HELD, f"a connection holds {held} bytes after a refused frame of {n} writes"
        assert allocated() <= HELD, f"{allocated()} bytes of Python objects stay alive after a refused frame"
    loop.src.sendall(_frame(3, [(loop.addr, b"\x09")]))  # and lands the next frame as before
    assert loop.ack() == (3, 0, 0, b"") and loop.mem[0] == 9


def _landing(loop: Loop, grant: int) -> bytes:
    """Start a frame of 32 KiB through ``grant`` and stop after its first 100 bytes of payload, once they
    landed (the loop is then in the middle of the frame). Returns the rest of the frame."""
    frame = _frame(1, [(loop.addr, b"\x66" * (1 << 15))], grant=grant)
    head = len(frame) - (1 << 15)
    loop.src.sendall(frame[: head + 100])
    loop.wait_landed(99, 0x66)
    return frame[head + 100 :]


def test_revoke_waits_for_a_frame_landing_through_the_grant_and_it_may_finish(loops: Any) -> None:
    """A frame checked before the grant was taken out lands whole; wait_grant holds until it has,
    and the next frame through the grant is refused."""
    loop = loops(guarded=True)
    loop.sink.add_grant(5, ME, np.array([loop.addr], np.uint64), np.array([1 << 16], np.uint64))
    rest = _landing(loop, 5)
    assert loop.sink.remove_grant(5)
    assert not loop.sink.wait_grant(5, 0.05), "revoke would not wait for the frame landing through its grant"
    assert not loop.sink.wait_region(1, 0.0), "deregister would not wait for the frame landing into its region"
    assert loop.sink.wait_grant(6, 0.0) and loop.sink.wait_region(2, 0.0)  # others are not held
    waited: queue.Queue[bool] = queue.Queue()
    threading.Thread(target=lambda: waited.put(loop.sink.wait_grant(5, 10.0)), daemon=True).start()
    loop.src.sendall(rest)
    assert waited.get(timeout=15), "the mark was not cleared once the frame landed"
    assert loop.ack() == (1, 0, 0, b"")
    assert (loop.mem[: 1 << 15] == 0x66).all()
    loop.src.sendall(_frame(2, [(loop.addr + 40000, b"\x77")], grant=5))
    assert loop.result()[:3] == (loop.impl.SERVE_REFUSED, 2, loop.impl.LAND_GRANT_NOT_LIVE)
    assert loop.mem[40000] == 0


def test_cut_grant_stops_a_stalled_frame_and_nothing_lands_after_it(loops: Any) -> None:
    """A source paused mid-frame: the cut shuts its connection, the loop clears its mark and ends,
    and the rest of the payload, sent afterwards, lands nowhere."""
    loop = loops(guarded=True)
    loop.sink.add_grant(5, ME, np.array([loop.addr], np.uint64), np.array([1 << 16], np.uint64))
    rest = _landing(loop, 5)
    loop.sink.remove_grant(5)
    assert loop.sink.cut_grant(6) == 0  # no frame lands through another grant
    assert not loop.sink.wait_grant(5, 0.05)
    assert loop.sink.cut_grant(5) == 1
    assert loop.sink.wait_grant(5, 10.0), "the cut connection's loop did not clear its mark"
    assert loop.result()[0] == loop.impl.SERVE_CLOSED
    snapshot = loop.mem.copy()
    try:
        loop.src.sendall(rest)
    except OSError:
        pass
    assert np.array_equal(loop.mem, snapshot), "bytes landed after the cut"
    assert loop.sink.cut_grant(5) == 0  # ended: nothing to cut


def test_stop_ends_an_idle_loop_and_a_stall_or_a_broken_frame_ends_a_connection(loops: Any) -> None:
    idle = loops()
    idle.sink.stop()
    assert idle.result() == (idle.impl.SERVE_STOPPED, 0)
    stalled = loops(stall=0.2)
    stalled.src.sendall(_frame(1, [(stalled.addr, b"\x01" * 64)])[:-10])  # 10 bytes short, then nothing
    assert stalled.result() == (stalled.impl.SERVE_STALLED, 0)
    broken = loops(max_writes=4)
    broken.src.sendall(tcp._FRAME.pack(1, 5, 0, 0))
    assert broken.result() == (broken.impl.SERVE_BROKEN, 0)
    closed = loops()
    closed.src.shutdown(socket.SHUT_WR)
    assert closed.result() == (closed.impl.SERVE_CLOSED, 0)
    closed.served.close()
    with pytest.raises(ValueError):
        closed.served.serve()


def _nothing_to_read(sock: socket.socket) -> bool:
    """Whether no byte waits on ``sock`` now (an ack not sent yet)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


def test_a_landed_notes_frame_returns_its_note_before_its_ack_goes_out(loops: Any) -> None:
    """``serve()`` hands back a landed frame's note with its ack queued, not sent: the next ``serve()``
    sends it. Frames without a note around it land and ack as before, in order."""
    loop = loops(guarded=True)
    loop.sink.add_grant(5, ME, np.array([loop.addr], np.uint64), np.array([1 << 16], np.uint64))
    note = bytes(range(256)) * 16  # MAX_NOTE bytes, every byte value
    assert len(note) == loop.impl.MAX_NOTE
    writes = [(loop.addr + 64 * i, bytes([i + 1]) * 48) for i in range(3)]
    loop.src.sendall(_frame(1, writes, grant=5, note=note))
    assert loop.result() == (loop.impl.SERVE_NOTED, 5, note)
    assert all((loop.mem[64 * i : 64 * i + 48] == i + 1).all() for i in range(3)), "the note came before its bytes"
    assert _nothing_to_read(loop.src), "the ack went out before the note was handed on"
    loop.serve()
    assert loop.ack() == (1, 0, 0, b"")
    loop.src.sendall(_frame(2, [(loop.addr + 4000, b"\x02")], grant=5) + _frame(3, writes[:1], grant=5, note=b"3"))
    assert loop.result() == (loop.impl.SERVE_NOTED, 5, b"3")
    loop.serve()
    assert [loop.ack() for _ in range(2)] == [(2, 0, 0, b""), (3, 0, 0, b"")] and loop.mem[4000] == 2
    loop.src.sendall(_frame(4, [(loop.addr + 9000, b"\x04")], grant=5))  # no note: no return from serve()
    assert loop.ack() == (4, 0, 0, b"") and loop.mem[9000] == 4
    assert loop.results.empty()


def test_a_refused_frame_with_a_note_returns_no_note_and_keeps_the_stream_in_place(loops: Any) -> None:
    loop = loops(guarded=True)
    loop.sink.add_grant(5, ME, np.array([loop.addr], np.uint64), np.array([4096], np.uint64))
    outside = _frame(1, [(loop.addr + 4090, b"\x01" * 16)], grant=5, note=b"all of room 1 landed")
    loop.src.sendall(outside + _frame(2, [(loop.addr + 8, b"\x02" * 8)], grant=5, note=b"two"))
    result = loop.result()
    assert result[:3] == (loop.impl.SERVE_REFUSED, 1, loop.impl.LAND_OUTSIDE_GRANT) and result[7:] == (5, 16)
    loop.served.refuse(1, errno.EACCES, b"", result[8])
    loop.serve()
    assert loop.result() == (loop.impl.SERVE_NOTED, 5, b"two")  # the stream kept its place past the note
    loop.serve()
    assert [loop.ack()[:2] for _ in range(2)] == [(1, 1), (2, 0)]
    assert not loop.mem[4090:4106].any() and (loop.mem[8:16] == 2).all()


@pytest.mark.parametrize("bad", ["too long", "no writes", "no grant"])
def test_a_note_the_wire_cannot_carry_breaks_the_connection(loops: Any, bad: str) -> None:
    """A real source never sends one (``write`` refuses it): the stream cannot be trusted past it."""
    loop = loops(guarded=bad != "no grant")
    loop.sink.add_grant(5, ME, np.array([loop.addr], np.uint64), np.array([1 << 16], np.uint64))
    limit = loop.impl.MAX_NOTE
    frame = {
        "too long": _frame(1, [(loop.addr, b"\x01" * 8)], grant=5, note=b"n" * (limit + 1)),
        "no writes": _frame(1, [], grant=5, note=b"n"),
        "no grant": _frame(1, [(loop.addr, b"\x01" * 8)], grant=0, note=b"n"),
    }[bad]
    loop.src.sendall(frame)
    assert loop.result() == (loop.impl.SERVE_BROKEN, 0)
    assert not loop.mem.any()
