"""A room's success rides its last write (``Services.notes``), sans-IO: the prefill engine puts its ``Status`` on
each decode rank's last batch and sends none on the control plane; the decode engine takes a note that came
through one of its live grants as that source's ``Status``, and a bad one fails that room alone. EPD alike: an
encode rank's ``EmbedStatus`` rides its write into the asker's slot, and the receiver takes it. The same engines
under the simulator run both completion paths (half the seeds each: ``Shape.notes``); ``tests/transport`` holds
the TCP sink's side of the promise, and ``test_peers.py`` real peers over it (prefill sends no frame a room)."""

from __future__ import annotations

from typing import Any

import pytest
from test_engine_defects import (_bootstrapped, _decode, _encode_room, _encoder, _Handle, _info, _prefill,
                                 _receiver, _recv_round, _register_decode, _stage, _to_encoder)
from transport.base import Grant

from pdcore.control import wire
from pdcore.core._spec import State
from pdcore.protocol.actions import Connect, Grant as GrantAction, Post, Send
from pdcore.protocol.decode import DecodeEngine
from pdcore.protocol.prefill import PrefillEngine

DECODE = "tcp://10.1.0.1:7000"


def _handed_over(engine: PrefillEngine, room: int, finish: tuple[int, Any], grant: int = 9) -> list[Post]:
    """``room`` registered, announced by one decode rank (tp 1; its pages granted as ``grant``, 0: none) and handed
    over whole: the posts."""
    engine.connected(_register_decode(engine, DECODE).token, _Handle(), "", 0.1)
    engine.services.table.register("r", 0.1)
    engine.register("r", room, 0.1)
    engine.message(DECODE, wire.Announce(room=room, session_id="decode-1", epoch=1, page_ids=(0, 1),
                                         request_pool_index=0, grant=grant), 0.2)
    engine.take_actions()
    engine.hand_over("r", (3, 4), None, finish, (5, -0.5), 0.3)
    posts = [a for a in engine.take_actions() if type(a) is Post]
    assert posts
    return posts


def _statuses(engine: Any) -> list[wire.Status]:
    return [a.msg for a in engine.take_actions() if type(a) is Send and type(a.msg) is wire.Status]


def test_the_success_rides_the_last_batch_and_no_status_follows_it() -> None:
    engine = _prefill(notes=True)
    (post,) = _handed_over(engine, 42, (7, (11, 12)))
    status = wire.decode(post.note)
    assert type(status) is wire.Status
    assert (status.room, status.state, status.rank, status.first_token, status.cached_tokens,
            status.first_token_logprob, status.spec_candidate_ids) == (42, State.SUCCESS, 0, 7, 5, -0.5, (11, 12))
    engine.written(post.token, None, 0.4)
    assert _statuses(engine) == []  # the note told decode already
    assert engine.services.table.state("r") == State.SUCCESS


@pytest.mark.parametrize(("notes", "grant"), [(False, 9), (True, 0)], ids=["no notes", "no grant"])
def test_without_notes_or_a_grant_the_success_goes_on_the_control_plane(notes: bool, grant: int) -> None:
    """A transport without notes, or pages announced without a grant (``unsafe_no_grants``: a note vouches for
    its source through the grant its write landed by)."""
    engine = _prefill(notes=notes)
    (post,) = _handed_over(engine, 42, (7, None), grant)
    assert post.note == b""
    engine.written(post.token, None, 0.4)
    assert [(m.room, m.state, m.first_token) for m in _statuses(engine)] == [(42, State.SUCCESS, 7)]


def test_a_batch_whose_note_failed_tells_decode_the_failure_on_the_control_plane() -> None:
    """The note may have gone (its ack lost after the bytes landed): decode then holds a landing and ignores
    the failure; if it did not go, decode hears of the failure at once rather than at its timeout."""
    engine = _prefill(notes=True)
    (post,) = _handed_over(engine, 42, (7, None))
    engine.written(post.token, "the connection broke", 0.4)
    assert [(m.room, m.state) for m in _statuses(engine)] == [(42, State.FAILED)]
    assert engine.services.table.state("r") == State.FAILED


def _announced(engine: DecodeEngine, rid: str, room: int, key: int) -> None:
    """``rid`` bootstrapped toward prefill tp 1, its pages granted (grant ``key``) and announced."""
    _bootstrapped(engine, rid, room, _info((1,)))
    engine.announce(rid, (1,), 0, 0.1)
    (grant,) = [a for a in engine.take_actions() if type(a) is GrantAction]
    engine.granted(grant.token, Grant(key, grant.source, tuple(grant.ranges)), None, 0.1)
    engine.take_actions()
    assert engine.services.table.state(rid) == State.WAITING_FOR_INPUT


def _note(room: int, **kw: Any) -> bytes:
    return wire.encode(wire.Status(room=room, state=State.SUCCESS, rank=0, first_token=3, **kw))


def test_a_note_through_a_live_grant_lands_its_room_as_the_sources_status_would() -> None:
    landed: list[Any] = []
    engine = _decode(deliver=lambda kind, rid, value: landed.append((kind, rid, value)))
    _announced(engine, "r", 5, key=1)
    engine.noted(1, _note(5, cached_tokens=4), 0.2)
    assert engine.services.table.state("r") == State.SUCCESS
    ((kind, rid, remote),) = landed
    assert (kind, rid, remote.bootstrap_token, remote.cached_tokens) == ("landed", "r", 3, 4)


@pytest.mark.parametrize("bad", [b"", b"garbage", "another room", "a failure", "an abort"])
def test_a_bad_note_fails_its_room_and_nothing_else(bad: Any) -> None:
    """A note is the source's input like a frame: one that is no success status of its own room costs that
    room (bad input from outside), never the other rooms, and is counted."""
    stats: dict[str, int] = {}
    engine = _decode(stats=stats)
    _announced(engine, "victim", 5, key=1)
    _announced(engine, "bystander", 6, key=2)
    note = {"another room": _note(6), "a failure": wire.encode(wire.Status(room=5, state=State.FAILED, rank=0)),
            "an abort": wire.encode(wire.Abort(room=5, reason="x"))}.get(bad, bad)
    engine.noted(1, note, 0.2)
    assert engine.services.table.state("victim") == State.FAILED
    assert engine.services.table.state("bystander") == State.WAITING_FOR_INPUT
    assert stats == {"protocol_errors": 1}
    engine.noted(2, _note(6), 0.3)
    assert engine.services.table.state("bystander") == State.SUCCESS


def test_a_note_through_a_grant_no_longer_live_changes_nothing() -> None:
    """Revoked (its room failed and fenced) or never made: nothing waits for it."""
    engine = _decode()
    _announced(engine, "r", 5, key=1)
    engine.noted(7, _note(5), 0.2)  # a grant this rank never made
    assert engine.services.table.state("r") == State.WAITING_FOR_INPUT
    engine.fence(["r"], 0.3)
    (revoke,) = [a for a in engine.take_actions() if type(a).__name__ == "Revoke"]
    engine.revoked(revoke.token, None, 0.3)
    engine.noted(1, _note(5), 0.4)
    assert engine.services.table.state("r") != State.SUCCESS



# -- EPD: an encode rank's write into a prefill rank's slot ------------------------------------------------------


def _asked_and_posted(notes: bool, **receiver_services: Any) -> tuple[Any, Any, Any, list[int], Post]:
    """A prefill rank's receiver stages one image (room 5) and asks the encode rank, which has its rows: the
    receiver, its table, the encoder, the rooms the encoder concluded, and its post of the rows."""
    receiver, table = _receiver(**receiver_services)
    encoder, concluded = _encoder(epoch=1, notes=notes)
    _encode_room(encoder, 5, 0.0)
    actions = _to_encoder(encoder, _stage(receiver, table, "r", 5, 0.0), 0.1)
    (connect,) = [a for a in actions if type(a) is Connect]
    encoder.connected(connect.token, _Handle(), "", 0.1)
    (post,) = [a for a in encoder.take_actions() if type(a) is Post]
    return receiver, table, encoder, concluded, post


def test_an_encode_ranks_success_rides_its_write_and_lands_the_item() -> None:
    receiver, table, encoder, concluded, post = _asked_and_posted(notes=True)
    status = wire.decode(post.note)
    assert type(status) is wire.EmbedStatus and (status.room, status.ok, status.rank) == (5, True, 0)
    receiver.noted(post.grant, post.note, 0.2)  # the sink hands it before the write's ack
    encoder.written(post.token, None, 0.3)
    assert [a for a in encoder.take_actions() if type(a) is Send] == []  # the note told the asker already
    assert concluded == [5]
    assert table.settle(table.encode(0.4))[0].rid == "r"  # the receiver's round lands the request


def test_without_notes_the_encode_ranks_success_goes_on_the_control_plane() -> None:
    _, _, encoder, _, post = _asked_and_posted(notes=False)
    assert post.note == b""
    encoder.written(post.token, None, 0.3)
    told = [a.msg for a in encoder.take_actions() if type(a) is Send]
    assert [(type(m), m.room, m.ok) for m in told] == [(wire.EmbedStatus, 5, True)]


def test_a_receivers_bad_note_fails_its_request_and_is_counted() -> None:
    stats: dict[str, int] = {}
    receiver, table, _, _, post = _asked_and_posted(notes=True, stats=stats)
    receiver.noted(post.grant, wire.encode(wire.EmbedStatus(room=6, ok=True, rank=0)), 0.2)  # another room's
    receiver.noted(post.grant + 1, post.note, 0.2)  # a grant the receiver never made: nothing
    assert [rid for rid, _ in _recv_round(receiver, table, 0.3)] == ["r"]
    assert stats == {"protocol_errors": 1}
