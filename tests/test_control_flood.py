"""The control channel under a flood of idle connections from outside the deployment.

Before the bound, a ROUTER held every connection that never started its handshake for libzmq's
default 30 s, so a flood of idle TCP connections used up the process's file descriptors and no
peer could connect any more. Real processes, real sockets on loopback; every wait has a deadline.
"""

from __future__ import annotations

import os
import queue
import socket
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdcore.control import plane as control_plane
from pdcore.control import wire
from pdcore.core.deadline import Deadline

from _flood import Child, run_channel, run_flood
from test_control import WAIT, Inbox, control_threads
from test_control_auth import wait_for

SECRET = b"deployment-secret-0123456789abcdef"
NOFILE = 256  # the flooded process's open-file limit: the flood below is well over it
FLOOD = 400  # idle connections, redialled as they are dropped
ROUNDS = 10  # frames each way per peer while the flood lasts
PEERS = 5  # peers, each connecting anew through the flood
CHURN = 2000  # connections the flood has had cut before the peers come
EXCHANGE = 15.0  # seconds for all of them: well inside libzmq's default 30 s handshake interval
FAST_FLOODS = 4  # flood processes at once, against a channel whose I/O thread is slowed: a faster attacker
FAST_PEERS = 16  # peers one after the other through it, each a new connection
FAST_ROUNDS = 5  # pings each, one at a time
FAST_CHURN = 5000  # connections it has had cut before they come
ECHO_WAIT = 10.0  # seconds one echo may take (liveness, not speed: a peer's first may wait out a SYN retransmission)


def _port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


@pytest.fixture
def flooded(plane: str) -> Iterator[tuple[Child, str]]:
    """A channel in a process limited to ``NOFILE`` open files, under a flood of ``FLOOD`` idle
    connections that has got going: it holds more connections than the process has descriptors,
    and it has turned ``CHURN`` of them over (or 5 s passed: a channel without the bound cuts none)."""
    child = Child(run_channel, NOFILE, SECRET, {}, plane)
    flood: Child | None = None
    try:
        endpoint = child.wait("endpoint", 30)
        flood = Child(run_flood, "127.0.0.1", _port(endpoint), FLOOD)
        deadline = Deadline.after(30)
        while (live := flood.call("stats").get("live", 0)) < NOFILE:
            assert not deadline.expired(), f"the flood holds only {live} connections"
        going = Deadline.after(5)
        while flood.call("stats").get("dropped", 0) < CHURN and not going.expired():
            pass  # polling the flood's count against a deadline
        yield child, endpoint
    finally:
        if flood is not None:
            flood.close()
        child.close()


def test_authenticated_peers_get_in_and_are_answered_during_a_flood_of_idle_connections(
    flooded: tuple[Child, str], plane: str,
) -> None:
    """``PEERS`` peers one after the other, each a new connection through the flood (a handshake the
    flood's churn could cut), exchange ``ROUNDS`` frames each way with the flooded channel."""
    child, endpoint = flooded
    deadline = Deadline.after(EXCHANGE)
    for n in range(PEERS):
        inbox = Inbox(plane)
        peer = inbox.channel(f"prefill-{n}", secret=SECRET)
        peer.start()
        try:
            for room in range(ROUNDS):
                peer.send(endpoint, wire.Abort(room=room, reason="ping"))
            echoed = []
            while len(echoed) < ROUNDS:
                assert not deadline.expired(), (
                    f"peer {n}: only {len(echoed)} of {ROUNDS} echoes in {EXCHANGE} s: {child.call('stats')}"
                )
                try:
                    sender, msg = inbox.messages.get(timeout=max(deadline.remaining(), 0.01))
                except queue.Empty:
                    continue
                assert sender == endpoint and msg == wire.Abort(room=msg.room, reason="echo")  # type: ignore[union-attr]
                echoed.append(msg.room)  # type: ignore[union-attr]
            assert sorted(echoed) == list(range(ROUNDS))
            assert inbox.dead.empty(), inbox.dead.get_nowait()  # no peer's handshake was cut
        finally:
            peer.close(Deadline.after(WAIT))
    from pdcore.control.channel import MAX_PENDING  # (after the exchange: the check that failed before the bound)

    stats = child.call("stats")
    # bounded: the idle connections were cut to make room, the flood did not keep the process out of fds
    # (libzmq accepts up to the limit between two cuts, so one instant there is the flood's pace; the
    # child counts its descriptors within a second or says it could not)
    assert stats["pending"] <= MAX_PENDING, stats
    assert stats["pending_evicted"] > 0 and stats["accepted"] > FLOOD, stats
    assert isinstance(stats["fds"], int) and stats["fds"] <= NOFILE, stats
    assert stats["internal_errors"] == stats["callback_errors"] == 0, stats
    assert control_threads() == []


def _spread(seconds: list[float]) -> str:
    ms = sorted(1000 * s for s in seconds)
    return f"min/median/max {ms[0]:.1f}/{statistics.median(ms):.1f}/{ms[-1]:.1f} ms ({len(ms)} exchanges)"


def _echoes(plane: str, endpoint: str, peers: int, rounds: int, child: Child, during: str) -> list[list[float]]:
    """``peers`` peers of the control plane ``plane`` (heartbeats every second, as deployed), one after
    the other, each a new connection; each sends ``rounds`` pings one at a time and waits for each
    echo (at most ``ECHO_WAIT``). Returns each peer's latencies, ping to echo, in seconds; its first
    exchange includes its connects."""
    latencies: list[list[float]] = []
    for n in range(peers):
        inbox = Inbox()
        peer: Any = control_plane.create(
            plane, lambda sender, msg: inbox.messages.put((sender, msg)), session_id=f"prefill-{n}", secret=SECRET,
            on_rooms_failed=lambda rooms, reason: inbox.failed.put((rooms, reason)), on_peer_dead=inbox.dead.put,
        )
        peer.start()
        mine: list[float] = []
        latencies.append(mine)
        try:
            for room in range(rounds):
                sent = time.monotonic()
                peer.send(endpoint, wire.Abort(room=room, reason="ping"))
                deadline = Deadline.after(ECHO_WAIT)
                while True:
                    try:
                        sender, msg = inbox.messages.get(timeout=max(deadline.remaining(), 0.01))
                    except queue.Empty:
                        assert not deadline.expired(), (
                            f"{during}: peer {n} had no echo of ping {room} within {ECHO_WAIT} s (echoes so far: "
                            f"{_spread([x for xs in latencies for x in xs]) if mine or n else 'none'}); "
                            f"the channel: {child.call('stats')}"
                        )
                        continue
                    assert sender == endpoint and msg == wire.Abort(room=room, reason="echo"), (sender, msg)
                    mine.append(time.monotonic() - sent)
                    break
            assert inbox.failed.empty(), inbox.failed.get_nowait()
            assert inbox.dead.empty(), inbox.dead.get_nowait()  # its handshake was not cut, nor the channel silent
        finally:
            peer.close(Deadline.after(WAIT))
    return latencies


@pytest.mark.long  # four flood processes on two cores: CI runs it in make test-long
def test_a_proven_peer_is_answered_through_a_flood_faster_than_its_channel(plane: str) -> None:
    """Issue #42: on a 16-core host the flood outran the channel, and a peer that proved itself got
    none of its echoes: the channel answers a peer on a connection of its own (a DEALER to the
    peer's endpoint), whose sockets and TCP connection need descriptors, and libzmq's I/O thread
    accepted the flood into every descriptor the moment one was freed. The same balance on two cores:
    ``FAST_FLOODS`` flood processes, and the channel's I/O thread at niceness 19 on one CPU
    (``_flood.slow_thread``; libzmq's I/O thread, which accepts, keeps its speed). ``FAST_PEERS`` peers,
    each a new connection through the flood, exchange ``FAST_ROUNDS`` pings and echoes one at a time:
    every echo must come within ``ECHO_WAIT`` (liveness; the latencies are printed, with the flood's
    rate and a run without the flood for comparison) and no frame of the channel's may fail."""
    child = Child(run_channel, NOFILE, SECRET, {}, plane, True)
    floods: list[Child] = []
    try:
        endpoint = child.wait("endpoint", 30)
        calm = [x for xs in _echoes(plane, endpoint, 1, 2 * FAST_ROUNDS, child, "without a flood") for x in xs]
        floods = [Child(run_flood, "127.0.0.1", _port(endpoint), FLOOD) for _ in range(FAST_FLOODS)]
        deadline = Deadline.after(30)
        while (live := sum(f.call("stats").get("live", 0) for f in floods)) < NOFILE:
            assert not deadline.expired(), f"the floods hold only {live} connections"
        going = Deadline.after(5)
        while sum(f.call("stats").get("dropped", 0) for f in floods) < FAST_CHURN and not going.expired():
            pass  # polling the floods' count against a deadline
        before, start = child.call("stats"), time.monotonic()
        latencies = _echoes(plane, endpoint, FAST_PEERS, FAST_ROUNDS, child, "during the flood")
        after, elapsed = child.call("stats"), time.monotonic() - start
    finally:
        for flood in floods:
            flood.close()
        child.close()
    rate = (after["accepted"] - before["accepted"]) / elapsed
    report = (
        f"flood of {FAST_FLOODS} x {FLOOD} idle connections: {rate:.0f} connections/s accepted, "
        f"{after['pending_evicted'] - before['pending_evicted']} cut, over {elapsed:.1f} s; echo latency "
        f"without the flood {_spread(calm)}; during it, a peer's first exchange (its connects too) "
        f"{_spread([xs[0] for xs in latencies])}, the later ones {_spread([x for xs in latencies for x in xs[1:]])}; "
        f"the channel's connects retried {after.get('connect_retries')}, made again {after.get('connects_remade')}, "
        f"reserve cuts {after.get('reserve_cuts')}"
    )
    print(report)
    assert after["send_failures"] == 0, f"{report}: {after}"  # no answer of the channel's was given up
    # the flood was faster than the channel: it held the process at its descriptor limit and was cut all along
    assert after["pending_evicted"] - before["pending_evicted"] > 1000, f"{report}: {after}"
    assert after["pending"] <= 64 and after["internal_errors"] == after["callback_errors"] == 0, after
    assert control_threads() == []


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
def test_pending_connections_stay_bounded_and_cuts_touch_no_other_socket(secret: bytes | None) -> None:
    """In-process: well over the bound of idle connections; the channel keeps at most ``max_pending``
    of them, cuts the oldest first, and its cut refuses a file descriptor the event did not name."""
    inbox = Inbox()
    channel = inbox.channel("decode-0", secret=secret, max_pending=8)
    channel.start()
    port = _port(channel.endpoint)
    idle: list[socket.socket] = []
    other_a, other_b = socket.socketpair()
    try:
        for _ in range(40):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT))
        wait_for(
            lambda: channel.stats.pending_evicted >= 32 and channel.pending_connections() <= 8,
            f"32 of 40 idle connections cut: {channel.stats}",
        )
        assert channel.stats.pending_evicted == 32 and channel.stats.auth_failures == 0  # a cut is no failed handshake
        # the oldest were cut: each of the first 32 sees its end (after libzmq's greeting bytes)
        for s in idle[:32]:
            s.settimeout(WAIT)
            while s.recv(4096):
                pass
        # a cut through a file descriptor that is not the socket the event named does nothing
        st = os.fstat(other_a.fileno())
        assert not channel._cut(other_a.fileno(), st.st_ino)  # a socket, but not one of this channel's
        assert not channel._cut(other_a.fileno(), st.st_ino + 1)  # not the inode the event named
        other_b.sendall(b"still here")
        assert other_a.recv(64) == b"still here"
    finally:
        for s in idle:
            s.close()
        other_a.close()
        other_b.close()
        channel.close(Deadline.after(WAIT))
    assert control_threads() == []


def test_a_process_out_of_descriptors_still_connects_to_a_peer_through_the_reserve(plane: str) -> None:
    """Deterministic (the fast flood above only samples it by timing): every descriptor under the
    process's soft limit is taken (by anything: here the child itself), and the channel must open a new
    connection to a peer it never talked to. The tcp plane's dial takes a descriptor of the reserve
    (``pdcore.control.fd_reserve``: ``FD_RESERVE`` descriptors between the soft and the hard limit,
    opened only for the planes' own connects); without it nothing ever frees one and the frame never
    leaves. The ZeroMQ plane gets there with the reserve, or, when nothing else takes descriptors (no
    flood), by making its DEALER again, which frees three: only the flood above tells the two apart."""
    child = Child(run_channel, NOFILE, SECRET, {}, plane)
    inbox = Inbox(plane)
    peer = inbox.channel("prefill-0", secret=SECRET)
    peer.start()
    try:
        child.wait("endpoint", 30)
        taken = child.call("exhaust")
        assert taken > 0
        child.call("send", peer.endpoint, 5)
        sender, msg = inbox.messages.get(timeout=WAIT)
        assert msg == wire.Abort(room=5, reason="from the exhausted"), msg
        stats = child.call("stats")
        assert stats["send_failures"] == 0 and stats["internal_errors"] == 0, stats
    finally:
        peer.close(Deadline.after(WAIT))
        child.close()


def test_a_peer_connection_stops_being_pending_at_once() -> None:
    """A connection a frame came on is no longer pending (the frame names its fd); and each side's
    DEALER sends a heartbeat as soon as its handshake succeeds, so the connection a channel opens to
    answer a peer is proven long before its first periodic heartbeat (30 s here)."""
    a_in, b_in = Inbox(), Inbox()
    slow = {"secret": SECRET, "heartbeat_interval": 30.0, "dead_after": 60.0}
    a, b = a_in.channel("decode-0", **slow), b_in.channel("prefill-0", **slow)
    a.start()
    b.start()
    try:
        b.send(a.endpoint, wire.Abort(room=1, reason="hello"))
        assert a_in.next_message() == (b.endpoint, wire.Abort(room=1, reason="hello"))
        # b's heartbeat on its handshake made a connect back to b: that connection is proven too
        for side, name in ((a, "a"), (b, "b")):
            wait_for(lambda: side.stats.proven == 1, f"{name}'s one connection proven: {side.stats}")
            assert side.stats.accepted == 1 and side.stats.pending_evicted == 0
    finally:
        a.close(Deadline.after(WAIT))
        b.close(Deadline.after(WAIT))
    assert control_threads() == []


def test_the_oldest_idle_connection_is_cut_not_an_older_one_whose_client_spoke() -> None:
    """In-process and deterministic (the flood test above only samples it by timing): a client that
    sent the first byte of its greeting is older than every idle one, yet the idle ones are cut
    first, oldest first. A channel that cuts by age alone cuts the talker, and with it a real peer's
    handshake in progress under a redialling flood."""
    inbox = Inbox()
    channel = inbox.channel("decode-0", secret=SECRET, max_pending=4)
    channel.start()
    port = _port(channel.endpoint)
    talker = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    idle: list[socket.socket] = []
    try:
        talker.sendall(b"\xff")  # a ZMTP signature's first byte: a handshake begun, not finished
        wait_for(lambda: channel.stats.accepted == 1, f"the talker accepted: {channel.stats}")
        for _ in range(10):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT))
        wait_for(lambda: channel.stats.pending_evicted >= 7, f"7 of 11 pending connections cut: {channel.stats}")
        assert channel.stats.pending_evicted == 7, channel.stats
        for s in idle[:7]:  # the oldest idle ones, each to its end (after libzmq's greeting bytes)
            s.settimeout(WAIT)
            while s.recv(4096):
                pass
        # cut before idle[0] were it cut at all: its end would be readable by now
        talker.setblocking(False)
        try:
            while True:
                assert talker.recv(4096), "the connection whose client spoke was cut before idle ones"
        except BlockingIOError:
            pass  # open: nothing more to read, no end of stream
    finally:
        talker.close()
        for s in idle:
            s.close()
        channel.close(Deadline.after(WAIT))
    assert control_threads() == []
