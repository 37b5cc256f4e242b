"""Bad input from outside, sent to running peers and a running bootstrap server.

Control frames go in through a raw client of the peer's control plane (a ZeroMQ
DEALER, or a TCP connection that runs the handshake by hand: ``raw_control``), on
both planes, the way a broken or hostile peer would send them; HTTP garbage goes in through a
raw socket to the bootstrap server. Each must get a clear error (a counter, a
status code and a message naming the problem), lose nothing else: every thread
stays alive, only a room a bad frame names fails, and the transfers around it
complete with every byte.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import msgspec
import pytest
import zmq

from pdcore.control import wire
from pdcore.control.bootstrap import BootstrapClient
from pdcore.core.deadline import Deadline
from pd_pair import Pair, through_worker
from raw_control import RawControl, knows_sender, plane_alive

pytestmark = pytest.mark.timeout(120)

FAKE_PEER = "tcp://127.0.0.1:9"  # a well-formed endpoint nobody listens on


@pytest.fixture(params=["zmq", "tcp"])
def pair(request: pytest.FixtureRequest) -> Any:
    p = Pair(control=request.param)
    yield p
    p.close()


def _body(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


def _bad_frames(live_room: int) -> list[tuple[str, list[bytes], tuple[int, ...]]]:
    """(what, zmq parts, rooms the frame names) for each malformed or foreign frame."""
    good = wire.encode(wire.Abort(room=123456789, reason="x"))
    return [
        ("not a pdcore frame", [b"GET / HTTP/1.1\r\n\r\n"], ()),
        ("header only, truncated", [b"pd"], ()),
        ("empty frame", [b""], ()),
        ("the next protocol version", [wire.MAGIC + bytes([wire.PROTOCOL_VERSION + 1]) + good[7:]], (123456789,)),
        ("version 0 naming a room", [wire.MAGIC + b"\x00" + _body(type="abort", room=987654321)], (987654321,)),
        ("body not msgpack", [wire.seal(b"\xc1\xc1\xc1")], ()),
        ("unknown message type", [wire.seal(_body(type="shutdown", room=5))], (5,)),
        ("room of the wrong type", [wire.seal(_body(type="abort", room="five"))], ()),
        ("negative room", [wire.seal(_body(type="abort", room=-1))], ()),
        ("unknown field", [wire.seal(_body(type="abort", room=11, reason="", extra=1))], (11,)),
        ("status state out of range", [wire.seal(_body(type="status", room=12, state=9, rank=0))], (12,)),
        # a sender's frames of one pass travel as one message: the bad frame fails its room, the good one lands
        ("one message, a bad frame beside a good one", [wire.seal(_body(type="status", room=13, state=9, rank=0)), good],
         (13,)),
        # an announcement naming a live room, with a page twice: that room (and only it) fails
        ("announce with a duplicate page", [wire.seal(_body(type="announce", room=live_room, session_id="s", epoch=1,
                                                          page_ids=[1, 1], request_pool_index=0))], (live_room,)),
    ]


def _wait(cond: Any, what: str, pair: Pair, timeout: float = 15.0) -> None:
    pair.pump(cond, what, timeout)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_malformed_control_frames_fail_only_what_they_name(pair: Pair, side: str) -> None:
    rids = [f"ok{i}" for i in range(6)]
    victim = "victim"
    pair.register_each(rids, 2000)
    pair.register(victim, room=2999)
    pair.pump(lambda: all(pair.seen("decode", "Bootstrapped", rid) for rid in [*rids, victim]), "decode to bootstrap")
    peer = getattr(pair, side)
    before = (peer.diagnostics()["channel"]["protocol_errors"], peer.stats["protocol_errors"])
    frames = _bad_frames(live_room=2999)
    if side == "decode":  # decode takes no announcements: a bad status for its live room instead
        frames[-1] = ("status naming a live room, state out of range",
                      [wire.seal(_body(type="status", room=2999, state=17, rank=0))], (2999,))
    # a sender whose identity is no control endpoint: ZeroMQ's routing id is only checked with its first
    # frame, which then fails naming the sender (+1 error, +1 room named); the tcp plane's hello carries it,
    # and its handshake refuses it (an authentication failure, no frame read)
    spoof = 1 if pair.plane == "zmq" else 0
    raws = []
    try:
        raws.append(sock := RawControl(peer.control_endpoint, pair.plane, FAKE_PEER))
        for _, parts, _ in frames:
            sock.send(*parts)
        raws.append(junk := RawControl(peer.control_endpoint, pair.plane, b"\xffnot an endpoint"))
        junk.send(wire.encode(wire.Abort(room=2998, reason="spoof")))
        expected = len(frames) + spoof
        _wait(lambda: peer.diagnostics()["channel"]["protocol_errors"] - before[0] >= expected
              and peer.diagnostics()["channel"]["auth_failures"] == 1 - spoof, "every bad frame counted", pair)
        # ... while a real transfer runs on the same peers
        pair.drive(rids)
    finally:
        for raw in raws:
            raw.close()
    assert peer.diagnostics()["channel"]["protocol_errors"] - before[0] == expected
    assert peer.diagnostics()["channel"]["internal_errors"] == 0 and peer.diagnostics()["channel"]["callback_errors"] == 0
    naming = sum(1 for _, _, rooms in frames if rooms) + spoof
    assert peer.stats["protocol_errors"] - before[1] == naming, "each frame naming a room reaches the peer once"
    assert peer.stats["work_errors"] == 0
    # the named live room failed (on both sides: the other peer hears of it); nothing else did
    pair.drive([victim], hold=[victim], timeout=10.0)  # prefill's own timers are 30 s away
    assert pair.ended("prefill", victim) == "Failed" and pair.ended("decode", victim) == "Failed"
    for rid in rids:
        assert pair.ended("prefill", rid) == "Succeeded" and pair.ended("decode", rid) == "RemotePrefillDone"
        assert pair.landed_intact(rid), rid
    # every thread is alive and the peer still serves: a new request goes through
    for p in (pair.prefill, pair.decode):
        assert p._driver._thread.is_alive() and plane_alive(p._channel)  # white-box: the threads themselves
    pair.register("after", room=3000)
    pair.drive(["after"])
    assert pair.ended("decode", "after") == "RemotePrefillDone" and pair.landed_intact("after")


def _http(port: int, raw: bytes, *, half_close: bool = True) -> tuple[int | None, dict[str, Any] | None]:
    """Send raw bytes, read the answer to the end (bounded); (status, JSON body) or (None, None)."""
    deadline = Deadline.after(10.0)
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        sock.sendall(raw)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while not deadline.expired():
            sock.settimeout(max(0.01, deadline.remaining()))
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    data = b"".join(chunks)
    if not data:
        return None, None
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else None


def _registration(pair: Pair, **changes: Any) -> bytes:
    reg = {
        "session_id": "intruder", "epoch": 1, "endpoint": "tcp://127.0.0.1:9", "tp_size": 1, "dp_size": 1,
        "tp_rank": 0, "dp_rank": 0, "layout": {"page_bytes": [4096, 4096], "num_pages": 64}, "transport": "00" * 16,
    }
    reg.update(changes)
    return json.dumps(reg).encode()


def test_garbage_http_to_the_bootstrap_server_gets_clear_errors(pair: Pair) -> None:
    port = pair.port
    endpoint = pair.prefill.control_endpoint

    def put(body: bytes) -> bytes:
        return b"PUT /v1/ranks HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    cases: list[tuple[str, bytes, int, str]] = [
        ("binary junk", b"\x00\x01\x02\xff\xfe garbage\r\n\r\n", 400, ""),
        ("unknown path", b"GET /v2/everything HTTP/1.0\r\n\r\n", 404, "path"),
        ("rank path not numbers", b"GET /v1/ranks/x/0 HTTP/1.0\r\n\r\n", 400, ""),
        ("unknown rank", b"GET /v1/ranks/0/7 HTTP/1.0\r\n\r\n", 404, "no rank"),
        ("wrong method", b"DELETE /v1/ranks HTTP/1.0\r\n\r\n", 405, "method"),
        ("no Content-Length", b"PUT /v1/ranks HTTP/1.0\r\n\r\n", 411, "Content-Length"),
        ("Content-Length not a number", b"PUT /v1/ranks HTTP/1.0\r\nContent-Length: ten\r\n\r\n", 400, "Content-Length"),
        ("body over the cap", b"PUT /v1/ranks HTTP/1.0\r\nContent-Length: 99999999\r\n\r\n", 413, "Content-Length"),
        ("short body", b"PUT /v1/ranks HTTP/1.0\r\nContent-Length: 100\r\n\r\n{", 400, "body"),
        ("body not JSON", put(b"{not json"), 400, ""),
        ("registration missing a field", put(b'{"session_id": "x"}'), 400, ""),
        ("registration with a bad endpoint", put(_registration(pair, endpoint="http://evil")), 400, "endpoint"),
        # a well-formed registration that contradicts the registered rank's slot (tp size): refused
        ("conflicting replica shape", put(_registration(pair, tp_size=2, tp_rank=1)), 409, ""),
        ("another session in a taken slot", put(_registration(pair)), 409, ""),
    ]
    for what, raw, status, word in cases:
        got, body = _http(port, raw)
        assert got == status, f"{what}: expected {status}, got {got} ({body})"
        assert body is not None and body.get("status") == status and body.get("error"), f"{what}: no error text"
        assert word.lower() in body["error"].lower(), f"{what}: {body['error']!r} does not name {word!r}"
    # a request cut in the middle and a connection that says nothing: answered or dropped, no harm
    got, _ = _http(port, b"GET /heal")
    assert got in (None, 400, 404), got
    with socket.create_connection(("127.0.0.1", port), timeout=5.0):
        pass
    # the server still serves, the registry is untouched, its thread is alive
    client = BootstrapClient("127.0.0.1", port)
    assert client.health(Deadline.after(5.0))
    info = client.parallel_info(Deadline.after(5.0))
    assert info is not None and (info.tp_sizes, info.dp_size) == ((1,), 1)
    rank = client.rank(0, 0, Deadline.after(5.0))
    assert rank is not None and rank.endpoint == endpoint
    assert pair.server._thread.is_alive()  # white-box: the server names no thread of its own
    # and transfers that look the prefill rank up afresh go through
    rids = [f"r{i}" for i in range(4)]
    pair.register_each(rids, 4000)
    pair.drive(rids)
    assert all(pair.ended("decode", rid) == "RemotePrefillDone" and pair.landed_intact(rid) for rid in rids)
    through_worker(pair.decode)


@pytest.mark.parametrize("receiver", ["prefill", "decode"])
def test_a_malformed_frame_from_a_registered_peer_fails_only_the_room_it_names(pair: Pair, receiver: str) -> None:
    """The peer on the other side, registered and holding live rooms, sends one malformed frame
    naming room X (through its own control connection, so the receiver knows the sender). A bad
    frame is that room's problem, not proof that the peer is gone: only X fails, every other
    room of that peer lands intact, and the peer is not declared dead."""
    rids = [f"live{i}" for i in range(6)]
    victim = "room-x"
    pair.register_each(rids, 5000)
    pair.register(victim, room=5999)
    sender_side = "decode" if receiver == "prefill" else "prefill"
    to, frm = getattr(pair, receiver), getattr(pair, sender_side)
    # (white-box: the receiving channel has learned the sender's endpoint, so its frames reach the engine)
    pair.pump(lambda: all(pair.seen("decode", "Bootstrapped", rid) for rid in [*rids, victim])
              and knows_sender(to._channel, frm.control_endpoint), f"decode to bootstrap, {receiver} to know {sender_side}")
    if receiver == "prefill":  # an announcement for X with a page twice
        bad = wire.seal(_body(type="announce", room=5999, session_id="s", epoch=1, page_ids=[1, 1], request_pool_index=0))
    else:  # a status for X with a state out of range
        bad = wire.seal(_body(type="status", room=5999, state=17, rank=0))
    with pytest.raises(Exception):
        wire.decode(bad)  # it really is malformed
    errors, dead = to.diagnostics()["channel"]["protocol_errors"], (to.diagnostics()["channel"]["peers_dead"], frm.diagnostics()["channel"]["peers_dead"])
    frm._channel._enqueue(to.control_endpoint, bad, ())  # raw bytes on the sender's own connection
    _wait(lambda: to.diagnostics()["channel"]["protocol_errors"] > errors, "the malformed frame to be counted", pair)
    pair.drive(rids)
    pair.drive([victim], hold=[victim], timeout=10.0)  # X: nobody sends it; its failure ends it on both sides
    assert to.diagnostics()["channel"]["protocol_errors"] == errors + 1
    assert (to.diagnostics()["channel"]["peers_dead"], frm.diagnostics()["channel"]["peers_dead"]) == dead, "a peer was declared dead"
    assert pair.ended("prefill", victim) == "Failed" and pair.ended("decode", victim) == "Failed"
    for rid in rids:
        assert pair.ended("prefill", rid) == "Succeeded" and pair.ended("decode", rid) == "RemotePrefillDone", rid
        assert pair.landed_intact(rid), rid
    # the same peers still talk to each other: a new room goes through
    pair.register("after", room=6000)
    pair.drive(["after"])
    assert pair.ended("decode", "after") == "RemotePrefillDone" and pair.landed_intact("after")
    assert (to.diagnostics()["channel"]["peers_dead"], frm.diagnostics()["channel"]["peers_dead"]) == dead
    # the receiver failed X for what was wrong with the frame, not for a lost peer
    assert ("page appears twice" if receiver == "prefill" else "bad status frame") in pair.reasons[(receiver, victim)]


SECRET = b"pd-bad-input: a deployment secret"


def test_zap_admits_exactly_the_deployments_key() -> None:
    """The ZAP verdict (sans-IO): only a CURVE client whose long-term key is the deployment's."""
    from zmq.utils import z85

    from pdcore.control.channel import curve_keys, zap_reply

    key = z85.decode(curve_keys(SECRET)[0])
    other = z85.decode(zmq.curve_keypair()[0])

    def request(mechanism: bytes = b"CURVE", credential: bytes = key) -> list[bytes]:
        return [b"1.0", b"id-1", b"pdcore", b"127.0.0.1", b"", mechanism, credential]

    assert zap_reply(request(), key) == ([b"1.0", b"id-1", b"200", b"OK", b"", b""], None)
    for bad in (request(credential=other), request(credential=key[:-1]), request(mechanism=b"NULL"),
                request()[:6], [b"0.9", *request()[1:]], []):
        reply, refused = zap_reply(bad, key)
        assert reply[2] == b"400" and refused is not None, bad


def test_a_client_that_knows_the_public_key_but_not_the_secret_gets_nothing_in() -> None:
    """The deployment's CURVE public key is not a secret a client can prove: an outsider that
    has it (and its own key pair) completes CURVE's cryptography, and only the ZAP check keeps
    it out. Its frames, claiming a peer's identity, are never delivered."""
    from pdcore.control.channel import curve_keys

    from test_control import WAIT, Inbox

    inbox = Inbox()
    channel = inbox.channel("decode-0", secret=SECRET)
    channel.start()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, FAKE_PEER.encode())
        public, own_secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve_keys(SECRET)[0], public, own_secret
        sock.connect(channel.endpoint)
        for room in (1, 2, 3):
            sock.send(wire.encode(wire.Abort(room=room, reason="forged")), zmq.DONTWAIT)
        deadline = Deadline.after(WAIT)
        while channel.stats.auth_failures < 1:
            assert not deadline.expired(), "the outsider's handshake was not refused"
            threading.Event().wait(0.005)
        sock.close(0)
        assert inbox.messages.empty() and inbox.failed.empty(), "a frame of the outsider got in"
        assert channel.stats.delivered == 0 and channel.stats.protocol_errors == 0
    finally:
        ctx.destroy(linger=0)
        channel.close(Deadline.after(WAIT))
