"""Device-resident memory in the engines, sans-IO: a room written into host staging lands once a ``Land``
copied it into device memory (``scattered``), and a fence waits for that copy.

The copy itself (``transport.staging``) and the whole path over real peers are tested in
``tests/transport/test_staging.py`` and ``tests/test_device_kv.py``; here the engines' half of the promise:
the landing is not reported before the copy finished, a failed copy fails the room, and pages handed back
after a failure are never still being copied into.
"""

from __future__ import annotations

import dataclasses

from test_engine_defects import _bootstrapped, _decode, _info, _rank, _round
from transport.base import Grant

from pdcore.control import wire
from pdcore.core._spec import State
from pdcore.core.events import Failed
from pdcore.protocol.actions import Grant as GrantAction, Land, Revoke
from pdcore.protocol.decode import DecodeEngine, page_ranges

ROOM = 9


def _staged_decode() -> DecodeEngine:
    return DecodeEngine(dataclasses.replace(_decode().services, staged=True))


def _status_in(engine: DecodeEngine, rid: str) -> Land:
    """``rid`` bootstrapped, pages 1 and 3 announced and granted, its source's success status in: the ``Land``."""
    _bootstrapped(engine, rid, ROOM, _info((1,)))
    engine.announce(rid, (1, 3), 0, 0.1)
    (grant,) = [a for a in engine.take_actions() if type(a) is GrantAction]
    engine.granted(grant.token, Grant(1, grant.source, tuple(grant.ranges)), None, 0.1)
    engine.take_actions()
    engine.message(_rank(0, 0).endpoint, wire.Status(room=ROOM, state=State.SUCCESS, rank=0, first_token=3), 0.2)
    (land,) = [a for a in engine.take_actions() if type(a) is Land]
    return land


def test_a_staged_room_lands_only_once_its_pages_are_on_the_device() -> None:
    engine = _staged_decode()
    delivered: list[str] = []
    engine = DecodeEngine(dataclasses.replace(engine.services, deliver=lambda kind, key, value: delivered.append(key)))
    land = _status_in(engine, "r")
    assert land.ranges == page_ranges(engine.services.layout, (1, 3)), "the copy covers exactly the announced pages"
    assert engine.services.table.state("r") != State.SUCCESS and not delivered, "landed before the copy finished"
    engine.message(_rank(0, 0).endpoint, wire.Status(room=ROOM, state=State.SUCCESS, rank=0, first_token=3), 0.25)
    assert not [a for a in engine.take_actions() if type(a) is Land], "a repeated status copies again"
    engine.scattered(land.token, None, 0.3)
    assert engine.services.table.state("r") == State.SUCCESS and delivered == ["r"]


def test_a_failed_copy_fails_the_room_and_its_fence_revokes_the_grant() -> None:
    engine = _staged_decode()
    land = _status_in(engine, "r")
    engine.scattered(land.token, "the device copy failed", 0.3)
    assert engine.services.table.state("r") == State.FAILED
    revokes = [a for a in engine.take_actions() if type(a) is Revoke]
    assert len(revokes) == 1 and not revokes[0].settled
    engine.revoked(revokes[0].token, None, 0.4)
    failed = [e for e in _round(engine, 0.5) if type(e) is Failed]
    assert [e.rid for e in failed] == ["r"] and "device memory" in failed[0].reason


def test_a_room_aborted_while_its_pages_are_copied_is_fenced_only_after_the_copy() -> None:
    """The scheduler aborts the room while its pages are being copied into the device: its pages may go
    back only once no copy writes into them, so the fence's revoke waits for ``scattered``."""
    engine = _staged_decode()
    land = _status_in(engine, "r")
    engine.abort_room("r", ROOM, 0.3)
    events = _round(engine, 0.35)  # the replica agrees the room is failing: the fence is asked for
    engine.fence(["r"], 0.35)
    assert not [a for a in engine.take_actions() if type(a) is Revoke], "fenced while a copy writes into the pages"
    assert not [e for e in events + _round(engine, 0.4) if type(e) is Failed], "pages handed back during the copy"
    engine.scattered(land.token, None, 0.5)
    assert engine.services.table.state("r") == State.FAILED, "an aborted room landed after all"
    revokes = [a for a in engine.take_actions() if type(a) is Revoke]
    assert len(revokes) == 1
    engine.revoked(revokes[0].token, None, 0.6)
    assert [e.rid for e in _round(engine, 0.7) if type(e) is Failed] == ["r"]
