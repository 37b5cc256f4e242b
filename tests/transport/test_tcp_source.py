"""The TCP source's batch path on its own (``_fast.Source``, ``_fast.Completions``), on both twins:
``post`` over one end of a loopback connection, a hand-written sink at the other end reading frames
and writing acks. What the transport builds on: a batch is checked, takes a slot and goes out from
the writer's own call; what a full socket leaves goes to ``send_blocking``; acks complete batches
oldest first (queue mode keeps the slot until the completion is taken); ``fail`` completes every
batch once, in order.
"""

from __future__ import annotations

import errno
import socket
import struct
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import tcp
from transport.completions import Completion
from transport.deadline import Deadline

TICK = 0.05  # the source socket's kernel timeouts
REMOTE = 1 << 40  # the fake sink's one region: [REMOTE, +1 GiB)


def _refused(status: int, err: int, message: bytes) -> tuple[str, int, int, bytes]:
    return ("refused", status, err, message)


class Pair:
    """A Source of ``impl`` over a loopback connection; ``peer`` is the sink's end, driven by the test."""

    def __init__(self, impl: ModuleType, max_inflight: int = 8, max_writes: int = 16, size: int = 1 << 16) -> None:
        self.impl = impl
        server = socket.create_server(("127.0.0.1", 0))
        self.sock = socket.create_connection(server.getsockname(), timeout=5)
        self.peer, _ = server.accept()
        server.close()
        self.peer.settimeout(5)
        tcp._kernel_timeouts(self.sock, TICK)
        self.ack_sock = self.sock.dup()
        self.src = impl.Source(self.sock, self.ack_sock, max_inflight, max_writes, _refused)
        self.queue = impl.Completions(Completion, _refused)
        self.mem = np.arange(size, dtype=np.uint64).view(np.uint8)[:size].copy()
        self.addr = int(self.mem.ctypes.data)
        self.local = (np.array([self.addr], np.uint64), np.array([size], np.uint64), [memoryview(self.mem)])
        self.remote = (np.array([REMOTE], np.uint64), np.array([1 << 30], np.uint64))

    def post(self, writes: Any, on_done: Any = None, batch_id: int = 0, grant: int = 0, note: bytes = b"") -> int:
        """Post with this ``batch_id``; the code (and the id is checked to be the one posted)."""
        batch = writes if not isinstance(writes, list) else np.array(writes, np.uint64).reshape(-1, 3)
        ids = iter([batch_id])
        code, got = self.src.post(batch, grant, on_done, ids, *self.local, *self.remote, note)
        if code in (self.impl.POST_SENT, self.impl.POST_WAKE):
            assert got == batch_id, (code, got)
        else:  # nothing posted: no id taken
            assert got is None and next(ids, None) == batch_id, (code, got)
        return code

    def write(self, offset: int, n: int, dest: int = 0) -> list[tuple[int, int, int]]:
        return [(self.addr + offset, REMOTE + dest, n)]

    def frame(self, note: bytes = b"") -> tuple[int, int, list[tuple[int, int]], bytes]:
        """The next frame on the wire, carrying ``note``: ``(seq, grant, [(remote addr, length)], payload)``."""
        seq, count, nnote, grant = tcp._FRAME.unpack(self.recv(tcp._FRAME.size))
        assert nnote == len(note)
        desc = [struct.unpack("<QQ", self.recv(16)) for _ in range(count)]
        if nnote:
            assert self.recv(nnote) == note
        return seq, grant, desc, self.recv(sum(n for _, n in desc))

    def recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.peer.recv(min(n - len(out), 1 << 20))
            assert chunk, "the source closed the connection"
            out += chunk
        return out

    def acks(self, *seqs: int) -> None:
        """Acks of these batches (all landed), in one send."""
        self.peer.sendall(b"".join(tcp._ACK.pack(seq, 0, 0, 0) for seq in seqs))

    def take_acks(self) -> tuple[int, list[Any], int]:
        """Run the ack loop once: ``(code, the callbacks it completed, detail)``. With only queue-mode
        batches acked it completes them and returns at the next tick."""
        code, detail = self.src.acks(self.queue)
        return code, self.src.callbacks() if code == self.impl.ACKS_GOT else [], detail

    def close(self) -> None:
        self.src.fail(self.queue, "closed")
        self.src.close()
        self.peer.close()


@pytest.fixture
def pairs(fast_impl: ModuleType) -> Iterator[Any]:
    made: list[Pair] = []

    def make(**kw: Any) -> Pair:
        made.append(Pair(fast_impl, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_post_checks_a_batch_then_sends_it_from_the_callers_thread(pairs: Any) -> None:
    p = pairs(max_writes=4)
    impl = p.impl
    assert p.post([(p.addr, REMOTE, 8)] * 5) == impl.POST_TOO_MANY
    # a small list or tuple of int triples is taken as it is; anything else is as_batch's to make (or refuse)
    assert p.src.post([[1, 2, 3]], 0, None, iter([0]), *p.local, *p.remote) == (impl.FRAME_LOCAL_OUTSIDE, None)
    for other in ([[1.0, 2, 3]], [(1, 2)], [(1, 2, -3)], [(1, 2, 1 << 64)], [(np.uint64(1), 2, 3)], [1, 2, 3], ((1, 2, 3),) * 17, []):
        assert p.src.post(other, 0, None, iter([0]), *p.local, *p.remote) == (impl.POST_ARRAY, None), other
    assert p.post(np.array([[p.addr, REMOTE, 8]], np.int64)) == impl.POST_ARRAY
    assert p.post(np.zeros((2, 6), np.uint64)[:, ::2]) == impl.POST_ARRAY  # not C-contiguous
    assert p.post([*p.write(0, 8), (p.addr, REMOTE, 0)]) == impl.FRAME_ZERO_LENGTH and p.src.index == 1
    assert p.post([*p.write(0, 8), (p.addr + (1 << 16) - 4, REMOTE, 8)]) == impl.FRAME_LOCAL_OUTSIDE and p.src.index == 1
    assert p.post([(p.addr, REMOTE + (1 << 30) - 4, 8)]) == impl.FRAME_REMOTE_OUTSIDE and p.src.index == 0
    assert p.src.slots == 0 and p.src.in_flight == 0  # nothing refused took a slot
    assert p.post([*p.write(16, 8, 100), *p.write(0, 4, 200)], batch_id=11, grant=7) == impl.POST_SENT
    assert p.src.slots == 1 and not p.src.has_work()
    # on the wire already: no other thread ran
    assert p.frame() == (1, 7, [(REMOTE + 100, 8), (REMOTE + 200, 4)], bytes(p.mem[16:24]) + bytes(p.mem[0:4]))
    assert p.post([], batch_id=12) == impl.POST_SENT  # an empty batch: a header alone
    assert p.frame() == (2, 0, [], b"")


def test_acks_complete_batches_oldest_first_and_queue_mode_keeps_its_slot(pairs: Any) -> None:
    p = pairs(max_inflight=3)
    impl = p.impl
    called: list[Any] = []
    assert p.post(p.write(0, 8), batch_id=1) == impl.POST_SENT  # queue mode
    assert p.post(p.write(8, 8), on_done=called.append, batch_id=2) == impl.POST_SENT
    assert p.post(p.write(16, 8), batch_id=3) == impl.POST_SENT
    assert p.post(p.write(24, 8), batch_id=4) == impl.POST_FULL and p.src.slots == 3
    assert [p.frame()[0] for _ in range(3)] == [1, 2, 3]
    p.peer.sendall(tcp._ACK.pack(1, 0, 0, 0) + tcp._ACK.pack(2, 1, errno.EACCES, 2) + b"no")  # 2 refused
    assert p.take_acks()[:2] == (impl.ACKS_GOT, [(called.append, 2, ("refused", 1, errno.EACCES, b"no"))])
    assert p.src.slots == 2  # the callback's slot came back; the queued one's is held until taken
    assert len(p.queue) == 1 and p.src.in_flight == 1
    assert p.post(p.write(24, 8), batch_id=4) == impl.POST_SENT and p.src.slots == 3
    assert p.queue.take(10) == [Completion(1, None)] and p.src.slots == 2 and len(p.queue) == 0
    assert p.queue.take(10) == []
    p.acks(3, 4)
    assert p.take_acks()[:2] == (impl.ACKS_TICK, [])  # queue mode only: completed, back at the tick
    assert p.queue.take(1) == [Completion(3, None)] and p.queue.take(1) == [Completion(4, None)]
    assert p.src.slots == 0 and p.src.in_flight == 0


def test_a_writer_waiting_for_a_slot_is_told_when_one_comes_back(pairs: Any) -> None:
    p = pairs(max_inflight=1)
    woken: list[int] = []
    p.src.on_slot = lambda: woken.append(p.src.slots)
    assert p.post(p.write(0, 8), batch_id=1) == p.impl.POST_SENT
    p.frame()
    p.acks(1)
    p.take_acks()
    assert p.queue.take(1) == [Completion(1, None)] and woken == []  # nobody waited: nobody told
    assert p.post(p.write(0, 8), batch_id=2) == p.impl.POST_SENT
    p.frame()
    p.acks(2)
    p.take_acks()
    p.src.waiters = 1
    assert p.queue.take(1) == [Completion(2, None)] and woken == [0]


def test_an_ack_out_of_order_or_too_long_breaks_the_stream(pairs: Any) -> None:
    p = pairs()
    impl = p.impl
    for i in range(3):
        assert p.post(p.write(0, 8), batch_id=i + 1) == impl.POST_SENT
    p.acks(1, 3)  # 2 is the oldest in flight
    assert p.take_acks() == (impl.ACKS_ORDER, [], 3)
    assert p.queue.take(5) == [Completion(1, None)]
    q = pairs()
    assert q.post(q.write(0, 8), batch_id=1) == impl.POST_SENT
    q.peer.sendall(tcp._ACK.pack(1, 1, 0, impl.MAX_MSG + 1))
    assert q.take_acks() == (impl.ACKS_BAD, [], impl.MAX_MSG + 1)


def test_a_full_socket_leaves_the_rest_to_the_sender_thread(pairs: Any) -> None:
    """The sink reads nothing: a writer's send stops where the socket is full and hands the rest over
    (POST_WAKE); later posts queue behind it; send_blocking sends it all, in order, once the sink reads."""
    size = 4 << 20
    p = pairs(max_inflight=64, size=size)
    impl = p.impl
    codes = []
    for i in range(64):
        codes.append(p.post(p.write(0, size), batch_id=i))
        if codes[-1] == impl.POST_WAKE:
            break
    assert codes[-1] == impl.POST_WAKE and set(codes[:-1]) <= {impl.POST_SENT}, codes
    assert p.src.has_work()
    assert p.post(p.write(0, 8), batch_id=99) == impl.POST_SENT  # queued behind the remainder
    frames: list[Any] = []
    reader = threading.Thread(target=lambda: frames.extend(p.frame() for _ in range(len(codes) + 1)), daemon=True)
    reader.start()
    assert p.src.send_blocking() == 0
    assert not p.src.has_work()
    reader.join(30)
    assert [f[0] for f in frames] == list(range(1, len(codes) + 2))
    assert all(f[3] == bytes(p.mem) for f in frames[:-1]) and frames[-1][3] == bytes(p.mem[:8])


def test_fail_completes_every_batch_once_in_order(pairs: Any) -> None:
    p = pairs()
    impl = p.impl
    called: list[Any] = []
    modes = [None, called.append, None, called.append]
    for i, on_done in enumerate(modes):
        assert p.post(p.write(0, 8), on_done=on_done, batch_id=i) == impl.POST_SENT
    assert p.src.slots == 4
    assert p.src.fail(p.queue, "gone") == [(called.append, 1, "gone"), (called.append, 3, "gone")]
    assert p.src.failed and p.src.slots == 2 and p.src.in_flight == 0
    assert p.queue.take(10) == [Completion(0, "gone"), Completion(2, "gone")] and p.src.slots == 0
    assert p.src.fail(p.queue, "again") == [] and len(p.queue) == 0  # once
    assert p.post(p.write(0, 8), batch_id=9) == impl.POST_FAILED
    assert p.post(p.write(0, 0), batch_id=9) == impl.FRAME_ZERO_LENGTH  # a bad batch is still said first
    assert p.src.send_blocking() == -1


def test_fail_first_completes_what_acks_completed_and_nobody_called_yet(pairs: Any) -> None:
    """The ack loop completed a batch with a callback (GOT) and the peer failed before the ack thread
    took it: fail() returns it first, with its own outcome, then the rest with the failure; once."""
    p = pairs()
    impl = p.impl
    called: list[Any] = []
    for i in range(3):
        assert p.post(p.write(0, 8), on_done=called.append, batch_id=i) == impl.POST_SENT
    p.acks(1)
    assert p.src.acks(p.queue)[0] == impl.ACKS_GOT  # batch 0 completed, its callback not taken yet
    assert p.src.in_flight == 2 and p.src.slots == 3
    assert p.src.fail(p.queue, "gone") == [(called.append, 0, None), (called.append, 1, "gone"), (called.append, 2, "gone")]
    assert p.src.callbacks() == [] and p.src.slots == 0
    assert p.src.acks(p.queue)[0] == impl.ACKS_FAILED


def test_the_ack_loop_ticks_sees_a_stall_and_the_close(pairs: Any) -> None:
    p = pairs()
    impl = p.impl
    assert p.src.acks(p.queue)[0] == impl.ACKS_TICK and p.src.idle(60.0) == 0
    assert p.post(p.write(0, 8), batch_id=1) == impl.POST_SENT
    deadline = Deadline.after(10)
    while p.src.idle(0.1) != 2:  # in flight, nothing acked: no progress past the stall
        assert not deadline.expired(), "idle() never saw the stall"
        assert p.src.acks(p.queue)[0] == impl.ACKS_TICK
    p.peer.sendall(tcp._ACK.pack(1, 0, 0, 0)[:7])  # part of an ack, then nothing
    while p.src.idle(0.1) != 1:
        assert not deadline.expired(), "idle() never saw the partial ack stall"
        assert p.src.acks(p.queue)[0] == impl.ACKS_TICK
    assert p.src.in_flight == 1
    p.peer.sendall(tcp._ACK.pack(1, 0, 0, 0)[7:])  # the rest of it
    assert p.src.acks(p.queue)[0] == impl.ACKS_TICK and p.queue.take(5) == [Completion(1, None)]
    p.peer.shutdown(socket.SHUT_WR)
    assert p.src.acks(p.queue)[0] == impl.ACKS_CLOSED and p.src.err == 0


def test_a_waiter_for_completions_is_woken_by_the_ack_loop(pairs: Any) -> None:
    p = pairs()
    assert not p.queue.wait(0.0)
    assert p.post(p.write(0, 8), batch_id=5) == p.impl.POST_SENT
    p.frame()
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(p.queue.wait(30.0)), daemon=True)
    waiter.start()
    p.acks(1)
    p.take_acks()
    waiter.join(30)
    assert woke == [True] and p.queue.take(5) == [Completion(5, None)]


# --------------------------------------------------------------------- both twins, the same results

_OPS = st.lists(st.one_of(
    st.tuples(st.just("post"), st.sampled_from(["ok", "ok", "ok", "zero", "local", "remote", "many"]), st.booleans()),
    st.tuples(st.just("ack"), st.integers(1, 3), st.integers(0, 1)),
    st.tuples(st.just("take"), st.integers(1, 4)),
    st.tuples(st.just("fail"), st.just(0)),
), max_size=25)


def _run(impl: ModuleType, ops: list[tuple[Any, ...]]) -> list[Any]:
    """Apply ``ops`` to a fresh pair of ``impl``: everything each call returned, and the counters after it."""
    p = Pair(impl, max_inflight=4, max_writes=3)
    seen: list[Any] = []
    called: list[Any] = []
    posted = 0
    try:
        for op in ops:
            if op[0] == "post":
                batch = {"ok": p.write(8, 8), "zero": [(p.addr, REMOTE, 0)], "local": [(p.addr - 1, REMOTE, 8)],
                         "remote": [(p.addr, REMOTE - 8, 8)], "many": p.write(0, 8) * 4}[op[1]]
                code = p.post(batch, on_done=called.append if op[2] else None, batch_id=posted)
                if code == impl.POST_SENT:
                    posted += 1
                    p.frame()
                seen.append(("post", code, p.src.index if code in (1, 2, 3) else None))
            elif op[0] == "ack":
                n = min(op[1], p.src.in_flight)
                if n and not p.src.failed:
                    first = posted - p.src.in_flight + 1  # seqs are 1, 2, ...: the oldest in flight
                    p.peer.sendall(b"".join(tcp._ACK.pack(first + k, op[2], op[2] and errno.EFAULT, op[2]) + b"x" * op[2]
                                           for k in range(n)))
                    want = p.src.in_flight - n
                    completed: list[Any] = []
                    while p.src.in_flight > want:
                        code, _detail = p.src.acks(p.queue)
                        assert code in (impl.ACKS_GOT, impl.ACKS_TICK), code
                        completed += [(c[1], c[2]) for c in p.src.callbacks()]
                    seen.append(("ack", completed + [(c[1], c[2]) for c in p.src.callbacks()]))
            elif op[0] == "take":
                seen.append(("take", [tuple(c) for c in p.queue.take(op[1])]))
            else:
                seen.append(("fail", [(c[1], c[2]) for c in p.src.fail(p.queue, "gone")]))
            seen.append((p.src.slots, p.src.in_flight, len(p.queue), p.src.failed))
    finally:
        p.close()
    return seen


@settings(max_examples=60)
@given(ops=_OPS)
def test_source_twins_agree(ops: list[tuple[Any, ...]]) -> None:
    import importlib

    compiled, pure = importlib.import_module("transport._tcp_fast"), importlib.import_module("transport._tcp_fast_py")
    assert _run(compiled, ops) == _run(pure, ops)


def test_a_note_goes_out_after_its_frames_descriptors_and_a_bad_one_posts_nothing(pairs: Any) -> None:
    p = pairs()
    note = bytes(range(256)) * 16
    for bad, grant, writes in [(note + b"!", 7, p.write(0, 8)), (b"n", 0, p.write(0, 8)), (b"n", 7, [])]:
        with pytest.raises(ValueError):
            p.post(writes, grant=grant, note=bad)
        assert p.src.slots == 0 and p.src.in_flight == 0
    with pytest.raises(TypeError):
        p.post(p.write(0, 8), grant=7, note="n")  # type: ignore[arg-type]
    assert p.post(p.write(16, 8) + p.write(64, 4, dest=100), batch_id=1, grant=7, note=note) == p.impl.POST_SENT
    assert p.post(p.write(0, 2), batch_id=2, grant=7) == p.impl.POST_SENT
    assert p.frame(note) == (1, 7, [(REMOTE, 8), (REMOTE + 100, 4)], bytes(p.mem[16:24]) + bytes(p.mem[64:68]))
    assert p.frame() == (2, 7, [(REMOTE, 2)], bytes(p.mem[0:2]))
