"""The control planes' trust boundary: only holders of the deployment secret get a frame in.

Each attack here worked on a channel without authentication (a forged frame
from a raw ZeroMQ socket claiming a live peer's routing id was delivered as
that peer's); with a secret each ends in a counted rejection, the live peer
undisturbed, every thread alive. Each runs on both planes (``plane``); the
``"tcp"`` plane's own frame attacks are in ``tests/test_tcp_plane.py``. Real
sockets on loopback; every wait bounded.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from pdcore.control import wire
from pdcore.control.channel import ControlChannel, curve_keys
from pdcore.core.deadline import Deadline

from raw_control import RawControl
from test_control import PLANES, WAIT, Inbox, control_threads, wait_for

SECRET = b"deployment-secret-0123456789abcdef"
OTHER = b"another-deployment-secret-0000000"


@pytest.fixture
def trusted(plane: str) -> Iterator[tuple[ControlChannel, Inbox, ControlChannel, Inbox]]:
    """A receiving channel and a peer of the same deployment that has introduced itself."""
    a_in, b_in = Inbox(plane), Inbox(plane)
    a, b = a_in.channel("decode-0", secret=SECRET), b_in.channel("prefill-0", secret=SECRET)
    a.start()
    b.start()
    b.send(a.endpoint, wire.Abort(room=1, reason="hello"))
    assert a_in.next_message() == (b.endpoint, wire.Abort(room=1, reason="hello"))
    yield a, a_in, b, b_in
    a.close(Deadline.after(WAIT))
    b.close(Deadline.after(WAIT))
    assert control_threads() == []


@pytest.fixture
def raw() -> Iterator[Callable[..., zmq.Socket[bytes]]]:
    """Hand-driven DEALERs, optionally with CURVE keys of some (other) secret."""
    ctx = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []

    def make(endpoint: str, ident: bytes, secret: bytes | None = None) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, ident)
        sock.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            public, private = curve_keys(secret)
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = public, public, private
        sock.connect(endpoint)
        socks.append(sock)
        return sock

    yield make
    for sock in socks:
        sock.close(0)
    ctx.term()


FORGERIES = [
    wire.Heartbeat(session_id="prefill-intruder", epoch=1, seq=1),  # "the peer restarted": fail its rooms
    wire.AbortAck(room=7, rank=0),  # "nothing in flight": close a fence
    wire.Status(room=7, state=5, rank=0, first_token=42),  # "success": complete a room whose KV never landed
    wire.Announce(room=7, session_id="prefill-0", epoch=0, page_ids=(1, 2), request_pool_index=0, grant=9),
]


@pytest.mark.parametrize("keys", [None, OTHER], ids=["no-secret", "other-secret"])
def test_forged_frames_claiming_a_live_peer_are_refused(
    trusted: tuple[ControlChannel, Inbox, ControlChannel, Inbox], raw: Any, keys: bytes | None, plane: str
) -> None:
    a, a_in, b, _ = trusted
    if plane == "tcp":  # its hello claims the live peer's endpoint, with no secret or another
        tcp = RawControl(a.endpoint, plane, b.endpoint, secret=keys)
        tcp.send(*(wire.encode(msg) for msg in FORGERIES))
    else:
        intruder = raw(a.endpoint, b.endpoint.encode(), keys)  # claims the live peer's identity (ROUTER_HANDOVER)
        for msg in FORGERIES:
            try:
                intruder.send(wire.encode(msg), zmq.DONTWAIT)
            except zmq.Again:  # its handshake failed already and took its pipe with it: refused before it left
                pass
    wait_for(lambda: a.stats.auth_failures >= 1, "the intruder's handshake is counted as failed")
    # the live peer still speaks as itself, after the intruder tried to take its identity over
    b.send(a.endpoint, wire.Abort(room=2, reason="still me"))
    assert a_in.next_message() == (b.endpoint, wire.Abort(room=2, reason="still me"))
    assert a_in.messages.empty()  # none of the forgeries was delivered
    assert a_in.dead.empty() and a_in.failed.empty()  # no peer declared dead, no room failed
    assert a.stats.protocol_errors == 0 and a.stats.superseded_frames == 0
    assert len(control_threads()) == (2 if plane == "zmq" else 4)  # (the tcp plane: a loop and a gatekeeper each)
    if plane == "tcp":
        tcp.close()


def test_a_replayed_connection_is_refused(
    trusted: tuple[ControlChannel, Inbox, ControlChannel, Inbox], plane: str,
) -> None:
    """Replay every byte a member sent on one connection, on a new one: CURVE's fresh keys refuse it (on
    the tcp plane, the listener's fresh challenge nonce: the recorded proof no longer verifies)."""
    a, a_in, _, _ = trusted
    host, port = a.endpoint[len("tcp://"):].rsplit(":", 1)
    recorded = bytearray()
    relay = socket.create_server(("127.0.0.1", 0))
    relay_port = relay.getsockname()[1]
    stop = threading.Event()

    def forward() -> None:  # a recording relay between a member's DEALER and the channel
        client, _ = relay.accept()
        upstream = socket.create_connection((host, int(port)))
        for s in (client, upstream):
            s.settimeout(0.05)
        while not stop.is_set():
            for src, dst, record in ((client, upstream, True), (upstream, client, False)):
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    stop.set()
                    break
                if record:
                    recorded.extend(data)
                dst.sendall(data)
        client.close()
        upstream.close()

    relay_thread = threading.Thread(target=forward, daemon=True)
    relay_thread.start()
    member_in = Inbox(plane)
    member = member_in.channel("prefill-1", secret=SECRET)
    member.start()
    try:
        member.send(f"tcp://127.0.0.1:{relay_port}", wire.Status(room=9, state=5, rank=0, first_token=1))
        sender, msg = a_in.next_message()
        assert msg == wire.Status(room=9, state=5, rank=0, first_token=1)
    finally:
        member.close(Deadline.after(WAIT))
    stop.set()
    relay_thread.join(WAIT)
    relay.close()
    assert len(recorded) > (200 if plane == "zmq" else 100)  # greeting or hello, the handshake and the frame
    failures = a.stats.auth_failures
    with socket.create_connection((host, int(port)), timeout=WAIT) as replay:
        replay.sendall(bytes(recorded))
        wait_for(lambda: a.stats.auth_failures > failures, "the replayed handshake is refused")
    assert a_in.messages.empty()  # the frame was not delivered a second time


def test_mismatched_secrets_fail_the_senders_rooms_with_a_clear_reason(plane: str) -> None:
    """First contact with a peer of another secret: the sender declares it dead, saying why and naming it."""
    a_in, b_in = Inbox(plane), Inbox(plane)
    a, b = a_in.channel("decode-0", secret=SECRET), b_in.channel("prefill-0", secret=OTHER)
    plain_in = Inbox(plane)
    plain = plain_in.channel("prefill-1")
    for ch in (a, b, plain):
        ch.start()
    try:
        b.send(a.endpoint, wire.Status(room=3, state=5, rank=0, first_token=1))
        dead = b_in.dead.get(timeout=WAIT)
        assert dead.endpoint == a.endpoint
        assert dead.reason.startswith("authentication failed") and a.endpoint in dead.reason
        assert b.stats.auth_failures >= 1
        # Without a secret the sender reads the mismatch from the peer's greeting, unless the peer's reset
        # discarded it first: then it cannot tell a peer that hung up from one that went away, and says both.
        plain.send(a.endpoint, wire.Status(room=3, state=5, rank=0, first_token=1))
        dead = plain_in.dead.get(timeout=WAIT)
        assert dead.endpoint == a.endpoint and a.endpoint in dead.reason
        assert "secret" in dead.reason, dead.reason
        wait_for(lambda: a.stats.auth_failures >= 2, "the receiver counts both failed handshakes")
        assert a_in.messages.empty()
    finally:
        for ch in (a, b, plain):
            ch.close(Deadline.after(WAIT))
    assert control_threads() == []


def test_a_secret_that_is_not_bytes_or_too_short_is_refused_at_construction(plane: str) -> None:
    from pdcore.core.errors import StartError

    for bad in (b"too-short-secret"[:15], "a str, not bytes, of enough length"):
        with pytest.raises(StartError, match="secret") as info:
            PLANES[plane](lambda s, m: None, session_id="x", secret=bad)
        assert str(bad)[2:12] not in str(info.value)  # the value itself is never echoed


def test_a_paused_process_does_not_declare_its_peers_dead_on_waking(tmp_path: Any, plane: str) -> None:
    """SIGSTOP a real process past dead_after, then SIGCONT: it must not blame a peer for its own sleep.

    The child talks to two peers: ``quiet`` heartbeats every 30 s, so nothing of it reaches the child
    during the pause (a frame queued meanwhile would refresh its clock on waking, whatever the child's
    rule); ``watcher`` heartbeats every 0.1 s and tells us when the child has been silent past
    dead_after (1 s), so the pause is long enough. On waking, only the pause explains ``quiet``'s
    silence: a child that blamed it would list it."""
    import signal
    import subprocess
    import sys

    quiet_in, watcher_in = Inbox(plane), Inbox(plane)
    quiet = quiet_in.channel("decode-0", secret=SECRET, heartbeat_interval=30.0, dead_after=60.0)
    watcher = watcher_in.channel("decode-1", secret=SECRET, heartbeat_interval=0.1, dead_after=1.0)
    quiet.start()
    watcher.start()
    code = f"""
import sys, time
sys.path[:0] = {sys.path!r}
from pdcore.control import wire
from pdcore.control import plane
dead = []
ch = plane.create({plane!r}, lambda s, m: None, session_id="prefill-9", secret={SECRET!r},
                    heartbeat_interval=0.1, dead_after=1.0, on_peer_dead=dead.append)
ch.start()
for peer in ({quiet.endpoint!r}, {watcher.endpoint!r}):
    ch.send(peer, wire.Abort(room=5))
until = time.monotonic() + 10
while not all(ch._liveness.known(p)[0] for p in ({quiet.endpoint!r}, {watcher.endpoint!r})):
    assert time.monotonic() < until, "the peers' heartbeats did not come"
    time.sleep(0.01)          # polling its own state against a deadline
print("ready", flush=True)    # both peers' first heartbeats are in: nothing more of quiet's comes
sys.stdin.readline()          # the parent resumed us
time.sleep(0.5)               # a few ticks after waking (this child's own pace, not a test sync)
print("dead", [d.endpoint for d in dead], flush=True)
ch.close()
"""
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "ready"
            for inbox in (quiet_in, watcher_in):
                assert inbox.next_message()[1] == wire.Abort(room=5)
            os.kill(child.pid, signal.SIGSTOP)
            gone = watcher_in.dead.get(timeout=WAIT)  # the stopped child went silent past dead_after: correct
            assert gone.session_id == "prefill-9"
            os.kill(child.pid, signal.SIGCONT)
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "dead []"  # it did not declare us dead for its own pause
            assert child.wait(WAIT) == 0
            assert quiet_in.dead.empty()
        finally:
            child.kill()
            quiet.close(Deadline.after(WAIT))
            watcher.close(Deadline.after(WAIT))


def test_curve_keys_are_derived_from_the_secret() -> None:
    assert curve_keys(SECRET) == curve_keys(SECRET)
    assert curve_keys(SECRET)[0] != curve_keys(OTHER)[0]
    assert all(len(k) == 40 for k in curve_keys(SECRET))  # z85 of 32 bytes
