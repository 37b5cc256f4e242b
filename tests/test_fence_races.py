"""The three orders that once broke fence before free, each forced in one process.

Real peers over real sockets; each test holds one step open on purpose (a transport call the peer's
driver makes, wrapped so it waits, or a posted batch whose completion is held back) and runs the
other side's steps meanwhile:

- decode hands a failed request's pages back only once its revoke completed: a round that runs
  while the revoke is still under way (once, a full work queue made it so) frees nothing;
- prefill acknowledges an abort ("drained") only once no batch of the room is in flight: an abort
  that arrives after "writes posted" waits for the write;
- prefill never tells decode "success" for a room it failed, even if the room's last batch lands
  after the failure.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pdcore.control import wire
from pdcore.core._spec import State
from pd_pair import Pair, through_worker


@pytest.fixture
def pair() -> Any:
    # success on the control plane: these orders are about the prefill side's word, which a success that
    # rides the last write (the default over TCP) does not wait for
    p = Pair(data_path_completion=False)
    yield p
    p.close()


def _announced(pair: Pair, rid: str, room: int) -> None:
    pair.register(rid, room)
    pair.pump(lambda: pair.seen("decode", "Bootstrapped", rid), "decode to bootstrap")
    pair.announce(rid)
    pair.pump(lambda: pair.seen("prefill", "Bootstrapped", rid), "prefill to hear the announcement")


def _told(peer: Any) -> list[Any]:
    """Record every control message ``peer`` sends (a wrapper around its channel's ``send``)."""
    sent: list[Any] = []
    real = peer._channel.send

    def send(endpoint: str, msg: Any) -> None:
        sent.append(msg)
        real(endpoint, msg)

    peer._channel.send = send
    return sent


def _held_completions(peer: Any) -> tuple[list[Any], Any]:
    """Post for real but keep the completions back until ``release(error)``."""
    transport = peer._transport
    real = transport.write
    held: list[Any] = []

    def write(handle: Any, batch: Any, on_done: Any = None, **kw: Any) -> int:
        return real(handle, batch, lambda b, e, d=on_done: held.append((d, b, e)), **kw)

    transport.write = write

    def release() -> None:
        del transport.write
        for on_done, b, e in held:
            on_done(b, e)

    return held, release


def _posted_and_held(pair: Pair, rid: str, room: int) -> tuple[list[Any], Any]:
    """Announce the room and hand it over: prefill posted its writes, their completions are held back.
    Every control message prefill sends from the announcement on, and the ``release`` of the writes."""
    _announced(pair, rid, room)
    told = _told(pair.prefill)
    held, release = _held_completions(pair.prefill)
    pair.send(rid)
    pair.pump(lambda: bool(held), "prefill to post its writes", sides=())
    return told, release


def test_pages_come_back_only_once_the_revoke_completed(pair: Pair) -> None:
    rid, room = "burst", 10
    _announced(pair, rid, room)
    decode = pair.decode
    [link] = decode._engine._requests[rid].links
    grant = link.grant
    entered, go = threading.Event(), threading.Event()
    real_revoke = decode._transport.revoke

    def revoke(g: Any, **kw: Any) -> None:
        entered.set()
        assert go.wait(20), "the test never let the revoke go"
        real_revoke(g, **kw)

    decode._transport.revoke = revoke
    decode.abort_room(rid, room)
    pair.pump(entered.is_set, "decode's driver to start the revoke", sides=("decode",))
    pair.rounds(5)  # rounds while the revoke is under way
    assert not pair.ended("decode", rid), "decode handed the pages back before its revoke completed"
    assert decode._transport._grants.get(grant.key) is not None  # white-box: the transport's own grant record
    go.set()
    pair.pump(lambda: bool(pair.ended("decode", rid)), "decode to fail the room")
    assert pair.ended("decode", rid) == "Failed"
    assert decode._transport._grants.get(grant.key) is None, "Failed with the grant still live"


def test_an_abort_after_writes_posted_is_acknowledged_only_once_the_writes_completed(pair: Pair) -> None:
    rid, room = "window", 11
    told, release = _posted_and_held(pair, rid, room)
    pair.decode.abort_room(rid, room)
    pair.pump(lambda: pair.prefill.state(rid) == State.FAILED, "prefill to hear the abort")
    through_worker(pair.prefill)
    assert not [m for m in told if isinstance(m, wire.AbortAck)], "acknowledged with a batch in flight"
    release()
    pair.pump(lambda: any(isinstance(m, wire.AbortAck) for m in told), "prefill to acknowledge the abort")


def test_prefill_never_tells_success_for_a_room_it_failed(pair: Pair) -> None:
    rid, room = "late", 12
    told, release = _posted_and_held(pair, rid, room)
    pair.prefill.abort_room(rid, room)  # the room fails here first...
    through_worker(pair.prefill)
    assert pair.prefill.state(rid) == State.FAILED
    release()  # ...then its last batch reports success
    through_worker(pair.prefill)
    assert not [m for m in told if isinstance(m, wire.Status) and m.state == State.SUCCESS], told
