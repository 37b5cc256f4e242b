"""Recovery: a (prefill rank, decode rank) pairing that had one transient failure serves new rooms.

Real peers in one process over loopback; the failures are made from outside
the prefill side's logic: the data connection is cut at the decode sink's
socket, or prefill forgets decode's registration (as it does when decode's
heartbeats stopped for a while). And a rank restarted after its clock
stepped back still takes its slot.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import numpy as np
import pytest

from pdcore import PrefillConfig, PrefillPeer
from pdcore.control.bootstrap import BootstrapClient, BootstrapServer, RankRegistration
from pdcore.core.deadline import Deadline
from pdcore.core._spec import State
from pd_pair import Pair, through_worker, token


@pytest.fixture
def pair() -> Any:
    p = Pair()
    yield p
    p.close()


def _cut_data_connections(pair: Pair) -> int:
    sinks = list(pair.decode._transport._sinks.values())  # white-box: the sink's sockets, cut under it
    for conn, _thread in sinks:
        conn.shutdown(socket.SHUT_RDWR)
    return len(sinks)


def test_new_rooms_succeed_after_the_data_connection_dropped(pair: Pair) -> None:
    pair.register("before", 1)
    pair.drive(["before"])
    assert pair.ended("decode", "before") == "RemotePrefillDone"
    assert _cut_data_connections(pair) == 1
    handle = next(iter(pair.prefill._engine._sinks.values())).handle
    pair.pump(lambda: handle.closed, "prefill to notice the cut")
    rids = [f"after{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        pair.register(rid, 10 + i)
    pair.drive(rids)
    for rid in rids:
        assert pair.ended("decode", rid) == "RemotePrefillDone" and pair.landed_intact(rid), rid
        assert pair.ended("prefill", rid) == "Succeeded"


def test_decode_registers_again_when_prefill_forgot_it(pair: Pair) -> None:
    pair.register("before", 1)
    pair.drive(["before"])
    # white-box: prefill forgets its data connection to decode, as after decode looked dead for a while
    (endpoint,) = pair.prefill._engine._sinks
    pair.prefill._submit(pair.prefill._engine._lose_sink, endpoint, "decode looked dead for a while")
    through_worker(pair.prefill)
    assert not pair.prefill._engine._sinks
    pair.register("unlucky", 2)  # announced to a prefill rank that no longer knows decode: it fails...
    pair.drive(["unlucky"])
    assert pair.ended("decode", "unlucky") == "Failed"
    pair.register("next", 3)  # ...and tells decode to register again, so the next room goes through
    pair.drive(["next"])
    assert pair.ended("decode", "next") == "RemotePrefillDone" and pair.landed_intact("next")


def test_a_room_that_landed_settles_landed_after_its_prefill_rank_went_away() -> None:
    """Decode's next round comes only after the prefill rank finished the request and exited, and its
    silence outlasted ``dead_after``: the KV and the first token are here, so the room lands, intact.
    (Before, decode failed every room of the lost rank, landed ones too: the demo's slow checks lost
    requests this way.)"""
    pair = Pair(dead_after=1.0)
    try:
        pair.register("done", 1)
        pair.pump(lambda: pair.seen("decode", "Bootstrapped", "done"), "decode to bootstrap", sides=("decode",))
        pair.announce("done")  # from here on decode's scheduler runs no round until prefill is gone
        pair.pump(lambda: pair.seen("prefill", "Bootstrapped", "done"), "prefill to bootstrap", sides=("prefill",))
        pair.send("done")
        pair.pump(lambda: pair.ended("prefill", "done") == "Succeeded", "prefill to succeed", sides=("prefill",))
        pair.pump(lambda: pair.decode.state("done") == State.SUCCESS, "decode's worker to take the status",
                  sides=())  # no scheduler runs a round meanwhile
        assert not pair.events["decode"][1:]  # landed here, not yet settled by a round
        pair.prefill.close()  # the prefill rank is done: it exits
        pair.pump(lambda: pair.decode.diagnostics()["channel"]["peers_dead"] > 0, "decode to declare the silent prefill rank dead",
                  sides=())
        through_worker(pair.decode)  # the loss reached decode's worker
        pair.pump(lambda: pair.ended("decode", "done") is not None, "decode to settle the room", sides=("decode",))
        assert pair.ended("decode", "done") == "RemotePrefillDone", pair.reasons
        assert pair.landed_intact("done") and pair.landed["done"].bootstrap_token == token("done")
    finally:
        pair.close()


def test_a_rank_restarted_after_the_clock_stepped_back_still_registers() -> None:
    """The slot holds an incarnation whose epoch (microseconds of its clock) lies an hour ahead of
    this clock: the new rank starts past it instead of being refused as older."""
    server = BootstrapServer()
    port = server.start()
    try:
        ahead = time.time_ns() // 1000 + 3_600_000_000
        layout = {"page_bytes": [4096], "num_pages": 8}
        BootstrapClient("127.0.0.1", port).register(RankRegistration(
            session_id="prefill-before", epoch=ahead, endpoint="tcp://127.0.0.1:9", tp_size=1, dp_size=1,
            tp_rank=0, dp_rank=0, layout=layout, transport="00" * 16,
        ), Deadline.after(5))  # fmt: skip
        peer, _outbox = PrefillPeer.start(PrefillConfig(
            kv_buffers=[np.zeros(8 * 4096, np.uint8)], page_bytes=4096, num_pages=8,
            bootstrap_host="127.0.0.1", bootstrap_port=port, start_timeout=10.0,
        ))  # fmt: skip
        try:
            assert peer.epoch > ahead
            held = BootstrapClient("127.0.0.1", port).rank(0, 0, Deadline.after(5))
            assert held is not None and held.session_id == peer.session_id
        finally:
            peer.close()
    finally:
        server.close()


def test_a_prefill_rank_found_dead_fails_new_requests_at_once_until_it_registers_again() -> None:
    """Once decode found a prefill rank dead, requests toward it fail at once naming that verdict, not
    each after another ``dead_after`` (its bootstrap server keeps listing a rank that died without a
    word); a rank that registers again (newer epoch) serves requests at once."""
    dead_after = 4.0
    pair = Pair(heartbeat_interval=0.2, dead_after=dead_after)
    try:
        pair.register("first", 1)
        pair.drive(["first"])
        old = pair.prefill
        assert old is not None
        old.close()  # gone; the bootstrap server still lists it
        pair.register("lost", 2, prefill=False)
        pair.pump(lambda: bool(pair.ended("decode", "lost")), "decode to find the prefill rank dead",
                  timeout=3 * dead_after, sides=("decode",))
        assert "prefill peer lost" in pair.reasons[("decode", "lost")], pair.reasons
        rids = [f"next{i}" for i in range(3)]
        for i, rid in enumerate(rids):
            pair.register(rid, 10 + i, prefill=False)
        pair.pump(lambda: all(pair.ended("decode", rid) for rid in rids), "new requests to fail at once",
                  timeout=dead_after / 2, sides=("decode",))
        for rid in rids:
            assert pair.ended("decode", rid) == "Failed"
            assert "was found dead" in pair.reasons[("decode", rid)], pair.reasons
        pair.prefill, pair.outbox = PrefillPeer.start(PrefillConfig(
            kv_buffers=pair.p_cache, page_bytes=pair.p_cache[0].nbytes // 64, num_pages=64, bootstrap_host="127.0.0.1",
            bootstrap_port=pair.port, heartbeat_interval=0.2, dead_after=dead_after))
        assert pair.prefill.epoch > old.epoch
        pair.register("back", 20)
        pair.drive(["back"])
        assert pair.ended("decode", "back") == "RemotePrefillDone" and pair.landed_intact("back")
    finally:
        pair.close()
