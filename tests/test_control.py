"""The control planes over real loopback sockets; no sleeps, a deadline on every wait.

A test that takes ``plane`` (or ``pair``) runs on both planes, ``"zmq"`` and ``"tcp"``; the rest drive
ZeroMQ sockets by hand (``raw_dealer``), and ``tests/test_tcp_plane.py`` holds their TCP counterparts."""

from __future__ import annotations

import functools
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from pdcore.control import wire
from pdcore.control.channel import ControlChannel, DeadPeer, PeerLiveness
from pdcore.control.tcp_plane import TcpPlane
from pdcore.core.deadline import Deadline, DeadlineExceeded
from pdcore.core.errors import CapacityError, LocalProtocolError, PeerError, StartError

WAIT = 5.0  # seconds: every wait in this file is bounded by it


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = Deadline.after(WAIT)
    while not predicate():
        if deadline.expired():
            raise AssertionError(f"not within {WAIT} s: {what}")
        time.sleep(0.005)  # polling a counter with a deadline, not synchronising on time


PLANES = {"zmq": ControlChannel, "tcp": TcpPlane}


class Inbox:
    """Collects what a channel's callbacks report, for the test thread to wait on."""

    def __init__(self, plane: str = "zmq") -> None:
        self.plane = plane
        self.messages: queue.Queue[tuple[str, wire.Message]] = queue.Queue()
        self.failed: queue.Queue[tuple[tuple[int, ...], str]] = queue.Queue()
        self.dead: queue.Queue[DeadPeer] = queue.Queue()

    def channel(self, session_id: str, **kw: Any) -> ControlChannel:
        kw.setdefault("heartbeat_interval", 0.05)
        kw.setdefault("dead_after", 5.0)
        return PLANES[self.plane](
            lambda sender, msg: self.messages.put((sender, msg)),
            session_id=session_id,
            on_rooms_failed=lambda rooms, reason: self.failed.put((rooms, reason)),
            on_peer_dead=self.dead.put,
            **kw,
        )

    def next_message(self) -> tuple[str, wire.Message]:
        return self.messages.get(timeout=WAIT)


def control_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pdcore-control")]


@pytest.fixture
def pair(plane: str) -> Iterator[tuple[ControlChannel, Inbox, ControlChannel, Inbox]]:
    a_in, b_in = Inbox(plane), Inbox(plane)
    a, b = a_in.channel("prefill-0"), b_in.channel("decode-0")
    a.start()
    b.start()
    yield a, a_in, b, b_in
    a.close(Deadline.after(WAIT))
    b.close(Deadline.after(WAIT))
    assert control_threads() == []


@pytest.fixture
def raw_dealer() -> Iterator[Any]:
    """A hand-driven DEALER, for sending what a well-behaved channel never would."""
    ctx = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []

    def make(endpoint: str, ident: bytes = b"tcp://127.0.0.1:9") -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, ident)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDTIMEO, int(WAIT * 1000))
        sock.connect(endpoint)
        socks.append(sock)
        return sock

    yield make
    for sock in socks:
        sock.close()
    ctx.term()


def test_exchange_both_ways(pair: tuple[ControlChannel, Inbox, ControlChannel, Inbox]) -> None:
    a, a_in, b, b_in = pair
    register = wire.Register(
        session_id="decode-0", epoch=0, endpoint=b"qp", regions=(), layout={"page": 16}, tp_size=1, tp_rank=0
    )
    announce = wire.Announce(room=11, session_id="decode-0", epoch=0, page_ids=(3, 4), request_pool_index=2)
    b.send(a.endpoint, register)
    b.send(a.endpoint, announce)
    assert a_in.next_message() == (b.endpoint, register)  # FIFO per peer: registration first
    assert a_in.next_message() == (b.endpoint, announce)
    status = wire.Status(room=11, state=5, rank=0, first_token=42, cached_tokens=3, first_token_logprob=-0.1)
    a.send(b.endpoint, status)  # answer to the sender's identity
    assert b_in.next_message() == (a.endpoint, status)
    b.send(a.endpoint, wire.Abort(room=11, reason="timeout"))
    assert a_in.next_message()[1] == wire.Abort(room=11, reason="timeout")
    a.send(b.endpoint, wire.AbortAck(room=11, rank=0))
    assert b_in.next_message()[1] == wire.AbortAck(room=11, rank=0)
    assert a.stats.protocol_errors == b.stats.protocol_errors == 0


def test_a_burst_to_one_peer_travels_in_few_messages_in_order_and_a_lone_frame_at_once(
    pair: tuple[ControlChannel, Inbox, ControlChannel, Inbox]
) -> None:
    """The frames queued for one peer by the time the I/O thread flushes go as one message (at most 64
    frames each); the receiver takes them in order. A lone frame is not held for company."""
    a, _, b, b_in = pair
    a.send(b.endpoint, wire.Abort(room=0, reason="alone"))
    assert b_in.next_message() == (a.endpoint, wire.Abort(room=0, reason="alone"))
    before = (a.stats.sent - a.stats.heartbeats_sent, a.stats.messages_sent - a.stats.heartbeats_sent)
    n = 2000
    for room in range(1, n + 1):  # faster than the I/O thread's passes: several frames queue per pass
        a.send(b.endpoint, wire.Abort(room=room, reason="burst"))
    got = [b_in.next_message()[1].room for _ in range(n)]  # type: ignore[union-attr]
    assert got == list(range(1, n + 1))
    # (a heartbeat goes alone, as one message; the I/O thread counts a message once it left)
    wait_for(lambda: a.stats.sent - a.stats.heartbeats_sent - before[0] == n, "the sender to count every frame")
    frames = a.stats.sent - a.stats.heartbeats_sent - before[0]
    messages = a.stats.messages_sent - a.stats.heartbeats_sent - before[1]
    assert frames == n and messages < n, (frames, messages)
    assert isinstance(a, TcpPlane) or n / 64 <= messages  # ZeroMQ's messages hold at most 64 frames
    assert b.stats.received < n + 1 and b.stats.delivered == n + 1 and b.stats.protocol_errors == 0


def test_frames_of_many_sending_threads_all_leave_though_one_wake_up_serves_a_pass(plane: str) -> None:
    """A sender writes a wake-up byte only when none is owed yet; the I/O thread forgets the one it owed
    only after reading the bytes, before it flushes. Each of eight threads sends a frame, then waits for it
    to arrive before the next, so every frame needs a wake-up of its own pass; threads switching as often as
    the interpreter allows race the senders against that moment. No frame may wait with no wake-up coming."""
    senders, rounds = 8, 60
    arrived = {room: threading.Event() for room in range(senders * rounds)}
    a = Inbox(plane).channel("prefill-0")
    b = PLANES[plane](lambda sender, msg: arrived[msg.room].set(), session_id="decode-0",  # type: ignore[union-attr]
                      heartbeat_interval=0.05, dead_after=5.0)
    a.start()
    b.start()
    start = threading.Barrier(senders)
    stuck: list[int] = []

    def send(k: int) -> None:
        start.wait(WAIT)
        for r in range(rounds):
            room = k * rounds + r
            a.send(b.endpoint, wire.Abort(room=room, reason="race"))
            if not arrived[room].wait(WAIT):
                stuck.append(room)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=send, args=(k,)) for k in range(senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * WAIT)
    finally:
        sys.setswitchinterval(interval)
        a.close(Deadline.after(WAIT))
        b.close(Deadline.after(WAIT))
    assert not stuck, f"frames {stuck} never left (of {senders * rounds})"
    assert all(e.is_set() for e in arrived.values())


@pytest.mark.parametrize("plane", ["zmq"])  # hand-driven ZeroMQ frames: tests/test_tcp_plane.py for tcp
def test_bad_frames_are_counted_and_the_thread_lives_on(
    pair: tuple[ControlChannel, Inbox, ControlChannel, Inbox], raw_dealer: Any
) -> None:
    a, a_in, _, _ = pair
    sock = raw_dealer(a.endpoint)
    good = wire.Status(room=9, state=5, rank=0)
    body = msgspec.msgpack.decode(wire.encode(wire.Status(room=7, state=5, rank=0))[7:])
    sock.send(b"\x00\xffgarbage")
    sock.send(wire.MAGIC + bytes([wire.PROTOCOL_VERSION + 1]) + msgspec.msgpack.encode(body))  # another version, room 7
    sock.send(wire.seal(msgspec.msgpack.encode({**body, "room": 8, "state": 99})))  # malformed, room 8
    # a sender's frames of one pass travel as one message: a malformed one (room 10) costs only itself
    sock.send_multipart([wire.seal(msgspec.msgpack.encode({**body, "room": 10, "state": 99})),
                         wire.encode(wire.Abort(room=13))])
    sock.send(b"")
    stranger = raw_dealer(a.endpoint, ident=b"\x00anonymous")
    stranger.send(wire.encode(wire.Abort(room=12)))  # an identity that is not an endpoint, room 12
    failed = {a_in.failed.get(timeout=WAIT)[0] for _ in range(4)}
    assert failed == {(7,), (8,), (10,), (12,)}
    assert a_in.next_message() == ("tcp://127.0.0.1:9", wire.Abort(room=13))  # the good frame beside the bad one
    sock.send(wire.encode(good))
    sender, msg = a_in.next_message()
    assert (sender, msg) == ("tcp://127.0.0.1:9", good)
    assert a.stats.protocol_errors == 6
    assert a_in.messages.empty()


@pytest.mark.parametrize("plane", ["zmq"])  # hand-driven ZeroMQ frames: tests/test_tcp_plane.py for tcp
def test_reasons_name_the_field(pair: tuple[ControlChannel, Inbox, ControlChannel, Inbox], raw_dealer: Any) -> None:
    a, a_in, _, _ = pair
    body = msgspec.msgpack.decode(wire.encode(wire.Status(room=5, state=5, rank=0))[7:])
    raw_dealer(a.endpoint).send(wire.seal(msgspec.msgpack.encode({**body, "rank": -4})))
    rooms, reason = a_in.failed.get(timeout=WAIT)
    assert rooms == (5,) and "$.rank" in reason


def test_a_failing_callback_is_counted_not_fatal(raw_dealer: Any) -> None:
    seen: queue.Queue[wire.Message] = queue.Queue()

    def on_message(sender: str, msg: wire.Message) -> None:
        if isinstance(msg, wire.Abort) and msg.room == 1:
            raise RuntimeError("scheduler bug")
        seen.put(msg)

    with ControlChannel(on_message, session_id="p") as channel:
        sock = raw_dealer(channel.endpoint)
        sock.send(wire.encode(wire.Abort(room=1)))
        sock.send(wire.encode(wire.Abort(room=2)))
        assert seen.get(timeout=WAIT) == wire.Abort(room=2)
        assert channel.stats.callback_errors == 1
    assert control_threads() == []


def test_send_validates_in_the_callers_thread(pair: tuple[ControlChannel, Inbox, ControlChannel, Inbox]) -> None:
    a, _, b, _ = pair
    with pytest.raises(LocalProtocolError, match="state"):
        a.send(b.endpoint, wire.Status(room=1, state=8, rank=0))
    with pytest.raises(LocalProtocolError, match="endpoint"):
        a.send("tcp://nowhere", wire.Abort(room=1))


def test_full_peer_fails_the_rooms() -> None:
    inbox = Inbox()
    with socket.socket() as silent:  # bound, never listening: connects are refused, frames stay queued
        silent.bind(("127.0.0.1", 0))
        port = silent.getsockname()[1]
        with inbox.channel("d", sndhwm=2, linger=0) as channel:
            # sndhwm counts messages (a pass's frames to one peer travel in one): one frame a pass here
            for room in range(1, 51):
                before = channel.stats.messages_sent + channel.stats.send_failures
                channel.send(f"tcp://127.0.0.1:{port}", wire.Abort(room=room))
                wait_for(lambda: channel.stats.messages_sent + channel.stats.send_failures > before, f"frame {room} flushed")
                if channel.stats.send_failures:
                    break
            rooms, reason = inbox.failed.get(timeout=WAIT)
            # (heartbeats queue there too: as many as went, fewer frames fit)
            assert "full" in reason and rooms == (room,) and room <= 3
            assert channel.stats.messages_sent - channel.stats.heartbeats_sent == room - 1
    assert control_threads() == []


def test_dead_peer_is_reported_with_its_session(plane: str) -> None:
    a_in, b_in = Inbox(plane), Inbox(plane)
    with a_in.channel("prefill-0", dead_after=0.5) as a:
        b = b_in.channel("decode-7", epoch=3, dead_after=0.5)
        b.start()
        b.send(a.endpoint, wire.Heartbeat(session_id="decode-7", epoch=3, seq=0))
        b.send(a.endpoint, wire.Abort(room=1))
        assert a_in.next_message()[1] == wire.Abort(room=1)  # the heartbeat is consumed, not delivered
        b.close(Deadline.after(WAIT))
        dead = a_in.dead.get(timeout=WAIT)
        assert (dead.endpoint, dead.session_id, dead.epoch) == (b.endpoint, "decode-7", 3)
        # heard of by its silence, or at once when our reconnect finds it gone: never as an auth failure
        assert "no traffic" in dead.reason or "went away" in dead.reason, dead.reason
        assert a.stats.auth_failures == 0
    assert control_threads() == []


def test_restart_with_a_newer_epoch_reports_the_old_incarnation(plane: str) -> None:
    a_in, b_in = Inbox(plane), Inbox(plane)
    with a_in.channel("prefill-0") as a, b_in.channel("decode-7", epoch=1) as old:
        register = wire.Register(session_id="decode-7", epoch=1, endpoint=b"e", regions=(), layout={}, tp_size=1, tp_rank=0)
        old.send(a.endpoint, register)
        assert a_in.next_message()[0] == old.endpoint
        with b_in.channel("decode-7", epoch=2) as new:
            new.send(a.endpoint, msgspec.structs.replace(register, epoch=2))
            dead = a_in.dead.get(timeout=WAIT)
            assert (dead.endpoint, dead.session_id, dead.epoch) == (old.endpoint, "decode-7", 1)
            assert "restarted" in dead.reason
            assert a_in.next_message()[0] == new.endpoint
    assert control_threads() == []


def test_close_within_deadline_leaves_nothing(plane: str) -> None:
    inbox = Inbox(plane)
    channel = inbox.channel("p", linger=10.0)
    channel.start()
    channel.send("tcp://127.0.0.1:1", wire.Abort(room=1))  # a peer that is not there: linger would wait
    deadline = Deadline.after(1.0)
    channel.close(deadline)
    assert not deadline.expired()
    assert control_threads() == []
    channel.close()  # idempotent
    with pytest.raises(PeerError):
        channel.send("tcp://127.0.0.1:1", wire.Abort(room=1))


def test_lifecycle_errors(plane: str) -> None:
    make = PLANES[plane]
    channel = make(lambda s, m: None, session_id="p")
    with pytest.raises(PeerError):
        channel.send("tcp://127.0.0.1:1", wire.Abort(room=1))
    with pytest.raises(PeerError):
        channel.endpoint
    channel.close()  # never started: nothing to do
    with pytest.raises(StartError, match="advertise_host"):
        make(lambda s, m: None, session_id="p", host="0.0.0.0").start()
    with pytest.raises(LocalProtocolError, match="session_id"):
        make(lambda s, m: None, session_id="has space")
    with pytest.raises(ValueError):
        make(lambda s, m: None, session_id="p", heartbeat_interval=2.0, dead_after=1.0)


def test_liveness_rules() -> None:
    live = PeerLiveness(dead_after=10.0)
    live.track("tcp://h:1", now=0.0)
    assert live.expire(now=9.0) == []
    live.heard("tcp://h:1", now=9.0)
    assert live.introduced("tcp://h:1", "s", 1, now=9.5) == []
    assert live.introduced("tcp://h:1", "s", 0, now=9.6) == []  # stale epoch: ignored
    [dead] = live.introduced("tcp://h:1", "s", 2, now=10.0)
    assert (dead.session_id, dead.epoch) == ("s", 1)
    [dead] = live.introduced("tcp://h:1", "t", 0, now=11.0)
    assert dead.session_id == "s" and "replaced" in dead.reason
    [dead] = live.introduced("tcp://h:2", "t", 5, now=12.0)  # session t moved to another endpoint
    assert dead.endpoint == "tcp://h:1" and dead.session_id == "t"
    assert "tcp://h:1" not in live
    [dead] = live.expire(now=30.0)
    assert (dead.endpoint, dead.session_id, dead.epoch) == ("tcp://h:2", "t", 5)
    assert live.expire(now=60.0) == []  # reported once


def test_stuck_callback_bounds_the_queue_and_close(raw_dealer: Any) -> None:
    entered, release = threading.Event(), threading.Event()

    def on_message(sender: str, msg: wire.Message) -> None:
        entered.set()
        release.wait(WAIT)  # a misbehaving scheduler callback (bounded, so the test cannot hang)

    channel = ControlChannel(on_message, session_id="p", max_queue=2)
    channel.start()
    raw_dealer(channel.endpoint).send(wire.encode(wire.Abort(room=1)))
    assert entered.wait(WAIT)  # the I/O thread is now stuck in the callback
    channel.send("tcp://127.0.0.1:1", wire.Abort(room=2))
    channel.send("tcp://127.0.0.1:1", wire.Abort(room=3))
    with pytest.raises(CapacityError):
        channel.send("tcp://127.0.0.1:1", wire.Abort(room=4))  # bounded queue: the caller is told, not blocked
    with pytest.raises(DeadlineExceeded):
        channel.close(Deadline.after(0.1))
    release.set()
    channel.close(Deadline.after(WAIT))
    assert control_threads() == []


# --------------------------------------------------------------------------- per-sender byte quota

HOSTILE, HONEST = "tcp://127.0.0.1:9", "tcp://127.0.0.1:10"
FLOOD_WAIT = 60.0  # seconds: decoding floods of maximal frames on a loaded machine; still a bound


@functools.cache
def _maximal_body() -> dict[str, Any]:
    top = 1 << 32
    ids = tuple(range(top - wire.MAX_PAGES, top))
    frame = wire.encode(wire.Announce(room=0, session_id="hostile", epoch=0, page_ids=ids, request_pool_index=0))
    return dict(msgspec.msgpack.decode(frame[7:]))


def maximal_announce(room: int) -> bytes:
    """The largest announce the wire allows: MAX_PAGES page ids, each a 5-byte msgpack uint32 (validated once)."""
    return wire.seal(msgspec.msgpack.encode({**_maximal_body(), "room": room}))


class Keeper(Inbox):
    """A consumer that keeps every message past the callback (like a peer's work queue) and says so."""

    def __init__(self) -> None:
        super().__init__()
        self.releases: dict[str, list[Any]] = {}
        self.seen: dict[int, threading.Event] = {}

    def watch(self, room: int) -> threading.Event:
        return self.seen.setdefault(room, threading.Event())

    def channel(self, session_id: str, **kw: Any) -> ControlChannel:
        def on_message(sender: str, msg: wire.Message) -> None:
            self.releases.setdefault(sender, []).append(channel.hold())
            self.messages.put((sender, msg))
            self._saw(getattr(msg, "room", None))

        def on_rooms_failed(rooms: tuple[int, ...], reason: str) -> None:
            self.failed.put((rooms, reason))
            for room in rooms:
                self._saw(room)

        channel = ControlChannel(on_message, session_id=session_id, on_rooms_failed=on_rooms_failed, **kw)
        return channel

    def _saw(self, room: object) -> None:
        event = self.seen.get(room)  # type: ignore[arg-type]
        if event is not None:
            event.set()

    def drain(self, q: queue.Queue[Any]) -> list[Any]:
        out = []
        while not q.empty():
            out.append(q.get_nowait())
        return out


def test_a_flooding_sender_is_held_to_its_quota_and_an_honest_one_still_gets_through(raw_dealer: Any) -> None:
    quota = wire.MAX_FRAME_BYTES  # the smallest allowed: 3 maximal announces fit
    keeper = Keeper()
    channel = keeper.channel("prefill-0", max_bytes_per_sender=quota)
    channel.start()
    try:
        hostile, honest = raw_dealer(channel.endpoint, HOSTILE.encode()), raw_dealer(channel.endpoint, HONEST.encode())
        rooms = range(1000, 1008)
        frames = [maximal_announce(room) for room in rooms]
        size = len(frames[0])
        assert size > 1 << 20 and len(frames) * size > 2 * quota
        last, honest_last = keeper.watch(1999), keeper.watch(5)
        for frame in frames:
            hostile.send(frame)
        hostile.send(wire.encode(wire.Abort(room=1999)))  # per-sender FIFO: once it is seen, so were all the above
        honest_msgs = [wire.Abort(room=room, reason="honest") for room in range(1, 6)]
        for msg in honest_msgs:
            honest.send(wire.encode(msg))
        assert last.wait(FLOOD_WAIT) and honest_last.wait(FLOOD_WAIT)
        got = keeper.drain(keeper.messages)
        assert [m for s, m in got if s == HONEST] == honest_msgs  # not one lost, in order
        delivered = {m.room for s, m in got if s == HOSTILE}
        failed = keeper.drain(keeper.failed)
        dropped = {rooms[0] for rooms, _ in failed}
        assert all("quota" in reason and HOSTILE in reason for _, reason in failed)
        assert delivered | dropped == set(rooms) | {1999} and not delivered & dropped  # each frame one way
        assert len(delivered - {1999}) == quota // size  # exactly what fits, the rest refused
        assert channel.stats.quota_drops == len(dropped)
        assert channel.stats.quota_dropped_bytes >= len(dropped - {1999}) * size
        # retained memory, by the channel's own count: the quota, never the flood
        assert channel.held_bytes(HOSTILE) <= quota and channel.stats.held_peak <= quota
        assert channel.held_bytes(HOSTILE) >= (quota // size) * size
        assert channel.held_bytes(HONEST) == sum(len(wire.encode(m)) for m in honest_msgs)  # counted apart
        # the consumer lets go: the sender is welcome again, and the channel never stopped serving
        for release in keeper.releases[HOSTILE]:
            release()
            release()  # idempotent
        assert channel.held_bytes(HOSTILE) == 0
        again = keeper.watch(2000)
        hostile.send(maximal_announce(2000))
        assert again.wait(FLOOD_WAIT)
        sender, msg = keeper.messages.get(timeout=FLOOD_WAIT)
        assert (sender, getattr(msg, "room", None)) == (HOSTILE, 2000)
        assert channel.stats.internal_errors == channel.stats.callback_errors == 0
    finally:
        channel.close(Deadline.after(WAIT))
    assert control_threads() == []


@pytest.mark.parametrize("total", [None, 2 * wire.MAX_FRAME_BYTES], ids=["default", "explicit"])
def test_senders_with_distinct_routing_ids_are_held_to_the_total_quota(raw_dealer: Any, total: int | None) -> None:
    """Without a secret a sender picks its routing id: each of many ids stays under its own quota,
    together they are over the total; what is past the total is dropped with a "quota" reason."""
    quota = wire.MAX_FRAME_BYTES
    bound = 4 * quota if total is None else total  # the default: four times the per-sender quota
    keeper = Keeper()
    options = {} if total is None else {"max_bytes_total": total}
    channel = keeper.channel("prefill-0", max_bytes_per_sender=quota, **options)
    channel.start()
    try:
        size = len(maximal_announce(0))
        senders = [f"tcp://127.0.0.1:{100 + i}" for i in range(bound // size + 4)]  # 4 frames more than fit
        rooms = {sender: 3000 + i for i, sender in enumerate(senders)}
        marks = [keeper.watch(4000 + i) for i in range(len(senders))]
        for i, sender in enumerate(senders):
            sock = raw_dealer(channel.endpoint, sender.encode())
            sock.send(maximal_announce(rooms[sender]))  # one frame each: every sender under its own quota
            sock.send(wire.encode(wire.Abort(room=4000 + i)))  # per-sender FIFO: once seen, so was the announce
        assert all(mark.wait(FLOOD_WAIT) for mark in marks)
        got = keeper.drain(keeper.messages)
        failed = keeper.drain(keeper.failed)
        delivered = {m.room for _, m in got if m.room < 4000}  # type: ignore[union-attr]
        dropped = {r[0] for r, _ in failed}
        assert all("quota" in reason and "total" in reason for _, reason in failed)
        assert delivered | dropped >= set(rooms.values()) and not delivered & dropped
        assert len(dropped & set(rooms.values())) >= 4  # at least the frames past the total
        assert channel.stats.quota_drops == channel.stats.total_quota_drops == len(failed)
        # what the process holds: the total, never the flood; and the total was used, not wasted
        assert channel.held_bytes() <= bound and channel.stats.held_total_peak <= bound
        assert channel.held_bytes() > bound - size
        assert all(channel.held_bytes(sender) <= quota for sender in senders)
        for releases in keeper.releases.values():
            for release in releases:
                release()
        assert channel.held_bytes() == 0
        again = keeper.watch(5000)
        raw_dealer(channel.endpoint, b"tcp://127.0.0.1:99").send(maximal_announce(5000))
        assert again.wait(FLOOD_WAIT) and keeper.failed.empty()  # below the total again: welcome
    finally:
        channel.close(Deadline.after(WAIT))
    assert control_threads() == []


def test_without_hold_a_frame_is_released_when_its_callback_returns(raw_dealer: Any) -> None:
    """Today's consumers (no hold()) are never refused: the channel itself retains one frame at a time."""
    inbox = Inbox()
    with inbox.channel("prefill-0", max_bytes_per_sender=wire.MAX_FRAME_BYTES) as channel:
        sock = raw_dealer(channel.endpoint)
        frames = [maximal_announce(room) for room in range(5)]  # more than the quota, one at a time
        for frame in frames:
            sock.send(frame)
        rooms = [inbox.messages.get(timeout=FLOOD_WAIT)[1].room for _ in frames]  # type: ignore[union-attr]
        assert rooms == list(range(5))
        assert channel.stats.quota_drops == 0 and inbox.failed.empty()
        assert channel.held_bytes() == 0 and channel.stats.held_peak == len(frames[0])
    assert control_threads() == []


def test_hold_is_only_for_inside_the_callback_and_the_quota_holds_a_frame(plane: str) -> None:
    channel = PLANES[plane](lambda s, m: None, session_id="p")
    with pytest.raises(RuntimeError, match="inside on_message"):
        channel.hold()
    with pytest.raises(ValueError, match="at least one frame"):
        PLANES[plane](lambda s, m: None, session_id="p", max_bytes_per_sender=wire.MAX_FRAME_BYTES - 1)


def test_frames_of_a_connection_replaced_by_a_hand_over_are_recognised() -> None:
    """A frame read under an id libzmq generated (five bytes, the first zero) is no protocol error.

    When a peer reconnects with the same identity, ROUTER_HANDOVER renames the old connection's
    pipe to such an id, and frames still read from it carry it (libzmq's router.cpp). Provoking
    that rename is timing-dependent, so this drives the channel's frame handler directly with
    the ids it would see: the frame's rooms fail with a reason, nothing counts as a protocol error."""
    inbox = Inbox()
    channel = inbox.channel("d")
    frame = wire.encode(wire.Abort(room=3))
    channel._handle(b"\x00\x00\x00\x00\x07", frame)  # before start(): nothing else runs
    assert inbox.failed.get_nowait() == ((3,), "control channel: the frame came on a connection its peer has since replaced")
    assert channel.stats.superseded_frames == 1 and channel.stats.protocol_errors == 0 and inbox.messages.empty()
    with pytest.raises(Exception, match="routing id is not a control endpoint"):
        channel._handle(b"\x01\x00\x00\x00\x07", frame)  # any other non-endpoint id still is one
