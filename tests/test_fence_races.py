"""Regression tests for the three races that broke fence before free (one test each).

Each opens the race's window on purpose, in one process, by wrapping one
internal step of a peer (real sockets and threads otherwise); each fails on
the code before its fix:

- a full work queue made ``poll`` treat "could not queue the fence" as "fence
  closed", freeing pages with the grant still live;
- prefill fired "writes posted" before counting the batch in flight, so an
  abort handled in between was acknowledged as drained before the write;
- prefill told decode "success" for a room it had already failed.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdcore.control import wire
from pdcore.core._spec import State, Trigger
from pdcore.core.errors import CapacityError
from pd_pair import Pair, through_worker, token


@pytest.fixture
def pair() -> Any:
    p = Pair()
    yield p
    p.close()


def _announced(pair: Pair, rid: str, room: int) -> None:
    pair.register(rid, room)
    pair.pump(lambda: pair.seen("decode", "Bootstrapped", rid), "decode to bootstrap")
    pair.announce(rid)
    pair.pump(lambda: pair.seen("prefill", "Bootstrapped", rid), "prefill to hear the announcement")


def test_a_full_work_queue_keeps_the_fence_armed(pair: Pair) -> None:
    rid, room = "burst", 10
    _announced(pair, rid, room)
    decode = pair.decode
    [link] = decode._requests[rid].links
    grant = link.grant
    real_submit = decode._submit
    refusing = [True]

    def submit(fn: Any, *args: Any) -> None:
        if refusing[0] and getattr(fn, "__name__", "") == "_close_fence":
            raise CapacityError("decode peer: the work queue is full")
        real_submit(fn, *args)

    decode._submit = submit  # type: ignore[method-assign]
    decode.abort_room(rid, room)
    pair.rounds(5)
    assert not pair.ended("decode", rid), "decode handed the pages back without closing the fence"
    assert decode._transport._grants.get(grant.key) is not None
    refusing[0] = False  # the queue has room again: the fence closes through the worker
    pair.pump(lambda: bool(pair.ended("decode", rid)), "decode to fail the room")
    assert pair.ended("decode", rid) == "Failed"
    assert decode._transport._grants.get(grant.key) is None, "Failed with the grant still live"


def test_an_abort_between_writes_posted_and_the_post_waits_for_the_write(pair: Pair) -> None:
    rid, room = "window", 11
    _announced(pair, rid, room)
    prefill = pair.prefill
    entry = prefill._by_rid[rid]
    posted: list[int] = []
    acks: list[tuple[int, int]] = []  # (writes posted, batches in flight) when the AbortAck went out
    real_fire, real_tell, real_write = prefill._fire, prefill._tell, prefill._transport.write

    def fire(rid_: str, trigger: int, reason: str = "") -> Any:
        state = real_fire(rid_, trigger, reason)
        if trigger == Trigger.WRITES_POSTED:  # decode's Abort is handled right here, inside the window
            prefill._on_abort(next(iter(entry.dsts)), wire.Abort(room=room, reason="race"))
        return state

    def tell(endpoint: str, msg: Any) -> None:
        if isinstance(msg, wire.AbortAck):
            acks.append((len(posted), entry.inflight))
        real_tell(endpoint, msg)

    def write(*args: Any, **kw: Any) -> int:
        posted.append(1)
        return real_write(*args, **kw)

    prefill._fire, prefill._tell, prefill._transport.write = fire, tell, write  # type: ignore[method-assign]
    pair.send(rid)
    pair.pump(lambda: bool(acks), "prefill to acknowledge the abort")
    assert acks[0] == (1, 0), f"acknowledged as drained with (posted, in flight) = {acks[0]}"


def test_prefill_never_tells_success_for_a_room_it_failed(pair: Pair) -> None:
    rid, room = "late", 12
    _announced(pair, rid, room)
    prefill = pair.prefill
    entry = prefill._by_rid[rid]
    told: list[Any] = []
    real_tell = prefill._tell

    def tell(endpoint: str, msg: Any) -> None:
        told.append(msg)
        real_tell(endpoint, msg)

    prefill._tell = tell  # type: ignore[method-assign]
    prefill.abort_room(rid, room)  # the room fails here first
    assert prefill._table.state(rid) == State.FAILED
    entry.inflight += 1  # the last batch of its finished hand-over was in flight...
    entry.landing += 1
    entry.final, entry.first_token = True, token(rid)
    prefill._landed(entry, 1, None)  # ...and reports success
    through_worker(prefill)
    assert not [m for m in told if isinstance(m, wire.Status) and m.state == State.SUCCESS], told
