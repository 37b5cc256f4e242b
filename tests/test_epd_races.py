"""EPD orders the failure tests do not produce by timing, forced here in one process.

A prefill rank (tp 1) with its embedding receiver and encode ranks (``_epd_children.Encoder``) run in
the test process over real sockets and real threads. An order is forced by holding the prefill
peer's driver inside a transport call (a wrapper around ``grant`` that waits for the test's go: white
box, the only way to hold that thread at that point), so the scheduler's calls and rounds run while
the protocol is mid-action.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from _epd_children import Encoder, pattern
from pdcore import EmbeddingItem, PrefillConfig, PrefillPeer, ReceiverConfig
from pdcore.control.bootstrap import BootstrapServer
from pdcore.core.deadline import Deadline

HOST = "127.0.0.1"
HIDDEN = 8
DTYPE = "torch.float32"
ROWS = 4
ROW_BYTES = HIDDEN * 4
FAR = 120.0  # every timer the tests do not exercise
KNOBS = dict(heartbeat_interval=0.25, dead_after=30.0)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def made() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.close()


def _server(made: list[Any]) -> int:
    server = BootstrapServer(host=HOST, port=0)
    made.append(server)
    return server.start()


def _prefill(made: list[Any], port: int, dead_after: float = KNOBS["dead_after"], **receiver: Any) -> tuple[PrefillPeer, Any]:
    peer, _ = PrefillPeer.start(PrefillConfig(
        kv_buffers=[np.zeros(4096, np.uint8)], page_bytes=4096, num_pages=1, bootstrap_host=HOST, bootstrap_port=port,
        **{**KNOBS, "dead_after": dead_after}))
    made.append(peer)
    recv = peer.embedding_receiver(ReceiverConfig(slot_rows=16, hidden=HIDDEN, dtype=DTYPE, timeout=FAR,
                                                  **{"slots": 1, **receiver}))
    return peer, recv


def _encoder(made: list[Any], port: int) -> Encoder:
    enc = Encoder(port, {**KNOBS, "park_timeout": FAR}, 1 << 16)
    made.append(enc)
    return enc


def _rounds(recv: Any, until: Any, what: str, seconds: float = 15.0) -> list[Any]:
    """The prefill scheduler's rounds until ``until(landed so far)``; returns every LandedRequest."""
    landed: list[Any] = []
    deadline = Deadline.after(seconds)
    while not until(landed):
        assert not deadline.expired(), f"timed out waiting for {what}; landed {[r.rid for r in landed]}"
        landed += recv.round(None)
        time.sleep(0.002)  # a scheduler's round
    return landed


def test_a_dropped_requests_slot_is_reused_only_after_every_grant_naming_it_was_revoked() -> None:
    """The driver is inside the ask of request A's item (granting its slot) when A fails, the scheduler's
    round settles it and B is staged. Whatever the order, the slot must not take B's receive while a
    grant of A that names it is live: else the encode rank, asked for A, writes A's rows into B's rows.
    Checked with the bytes: B's rows stay B's. (Before the driver, a full work queue made the scheduler
    thread fence the slot while the worker was still granting.)"""
    made: list[Any] = []
    try:
        pport, eport = _server(made), _server(made)
        peer, recv = _prefill(made, pport)
        enc = _encoder(made, eport)
        entered, go = threading.Event(), threading.Event()
        real_grant = peer._transport.grant
        calls = []

        def held_grant(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 1:  # A's ask: hold the worker here
                entered.set()
                assert go.wait(30), "the test never let the worker go"
            return real_grant(*args, **kwargs)

        peer._transport.grant = held_grant
        recv.stage("A", [EmbeddingItem(index=0, host=HOST, port=eport, room=1, rows=ROWS)])
        assert entered.wait(15), "the worker never reached A's grant"
        recv.table.fail("A", "failed by the test", time.monotonic())  # as a timeout or another item would
        assert recv.round(None) == [] and [rid for rid, _ in recv.failed()] == ["A"]
        recv.stage("B", [EmbeddingItem(index=0, host=HOST, port=eport, room=2, rows=ROWS)])
        go.set()
        assert enc.begin(2)
        enc.put(2, ROWS, HIDDEN, DTYPE)
        landed = _rounds(recv, lambda got: any(r.rid == "B" for r in got), "B to land")
        (item,) = [r for r in landed if r.rid == "B"][0].items
        want = pattern(2, ROWS * ROW_BYTES).reshape(ROWS, ROW_BYTES)
        assert np.array_equal(recv.rows(item.slot, ROWS), want), "B's rows are not its encode rank's rows"
        # A's encode rank gets A's rows late (a slow encoder): whatever it was asked, nothing lands in B's slot
        assert enc.begin(1)
        enc.put(1, ROWS, HIDDEN, DTYPE)
        enc.wait_concluded({1}, 5.0)  # it writes (and concludes) only if it was asked for A with a live grant
        _rounds(recv, lambda _got: True, "one more round")
        assert np.array_equal(recv.rows(item.slot, ROWS), want), \
            "A's late write landed in the slot B holds: A's grant was live when the slot was reused"
    finally:
        for thing in reversed(made):
            thing.close()


def _hold_a_slot(recv: Any, enc: Encoder, port: int) -> None:
    """Request X lands in one of the two slots and is not released: the next request's second item waits."""
    recv.stage("X", [EmbeddingItem(index=0, host=HOST, port=port, room=5, rows=ROWS)])
    assert enc.begin(5)
    enc.put(5, ROWS, HIDDEN, DTYPE)
    _rounds(recv, lambda got: any(r.rid == "X" for r in got), "X to land")


def _one_slot_free(made: list[Any]) -> tuple[Any, Encoder, Encoder, int, int]:
    """A prefill rank whose receiver has two slots, one held (``_hold_a_slot``), and two encode
    deployments: the receiver, both encoders and their bootstrap servers' ports."""
    pport, e1port, e2port = _server(made), _server(made), _server(made)
    _, recv = _prefill(made, pport, slots=2)
    e1, e2 = _encoder(made, e1port), _encoder(made, e2port)
    _hold_a_slot(recv, e1, e1port)
    return recv, e1, e2, e1port, e2port


def _r_fails_at_its_first_item(recv: Any, e1: Encoder, e1port: int, e2port: int) -> None:
    """Request R has one item on each encode deployment (rooms 10 and 20, the second waiting for a slot);
    the first one's encode scheduler fails room 10, and R fails on the receiver: room 20 was never asked."""
    recv.stage("R", [EmbeddingItem(index=0, host=HOST, port=e1port, room=10, rows=ROWS),
                     EmbeddingItem(index=1, host=HOST, port=e2port, room=20, rows=ROWS)])
    assert e1.begin(10)
    e1.fail(10, "the encoder could not read the image")
    _rounds(recv, lambda _got: any(rid == "R" for rid, _ in recv.failed()), "R to fail")


def test_a_failed_request_is_told_to_the_encode_ranks_not_asked_yet() -> None:
    """Request R has two items from two encode deployments and the receiver one free slot: the second
    item waits for it. When R fails (its first encode rank fails the room), the second item's encode rank,
    never asked, must hear of it too and conclude its room within seconds (its park timeout is 120 s)."""
    made: list[Any] = []
    try:
        recv, e1, e2, e1port, e2port = _one_slot_free(made)
        assert e2.begin(20)  # the encode scheduler of the second image has its rows ready
        e2.put(20, ROWS, HIDDEN, DTYPE)
        _r_fails_at_its_first_item(recv, e1, e1port, e2port)
        concluded = e2.wait_concluded({20}, 10.0)
        assert 20 in concluded, "the encode rank never asked for R's second image still holds its room"
    finally:
        for thing in reversed(made):
            thing.close()


def test_an_abort_that_arrives_before_the_encode_scheduler_begins_the_room_concludes_it_at_begin() -> None:
    """The prefill replica fails a request before the encode scheduler even began the room: the encode
    rank is told, and when its scheduler begins the room later the room concludes at once (its send
    slot is not held until the park timeout)."""
    made: list[Any] = []
    try:
        recv, e1, e2, e1port, e2port = _one_slot_free(made)
        _r_fails_at_its_first_item(recv, e1, e1port, e2port)
        deadline = Deadline.after(10)
        while e2.peer.stats.get("aborts_before_begin", 0) == 0:
            assert not deadline.expired(), "the encode rank never heard that R failed"
            time.sleep(0.005)
        assert e2.begin(20)
        assert 20 in e2.wait_concluded({20}, 5.0), "a room prefill already aborted was held after begin"
    finally:
        for thing in reversed(made):
            thing.close()


def test_an_encode_rank_found_dead_fails_new_requests_at_once() -> None:
    """Once the receiver found an encode rank dead, items toward it fail at once naming the verdict,
    not each after another ``dead_after`` (its bootstrap server keeps listing it)."""
    dead_after = 4.0
    made: list[Any] = []
    try:
        pport, eport = _server(made), _server(made)
        peer, recv = _prefill(made, pport, dead_after=dead_after)
        enc = _encoder(made, eport)
        recv.stage("A", [EmbeddingItem(index=0, host=HOST, port=eport, room=1, rows=ROWS)])
        assert enc.begin(1)
        enc.put(1, ROWS, HIDDEN, DTYPE)
        _rounds(recv, lambda got: any(r.rid == "A" for r in got), "A to land")
        recv.release([0])
        enc.close()  # gone without a word to its bootstrap server
        recv.stage("B", [EmbeddingItem(index=0, host=HOST, port=eport, room=2, rows=ROWS)])
        _rounds(recv, lambda _got: any(rid == "B" for rid, _ in recv.failed()), "B to fail", seconds=3 * dead_after)
        recv.stage("C", [EmbeddingItem(index=0, host=HOST, port=eport, room=3, rows=ROWS)])
        _rounds(recv, lambda _got: any(rid == "C" for rid, _ in recv.failed()), "C to fail at once",
                seconds=dead_after / 2)
        assert "was found dead" in dict(recv.failed())["C"], recv.failed()
    finally:
        for thing in reversed(made):
            thing.close()
