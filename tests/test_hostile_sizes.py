"""Hostile sizes from a peer that follows the wire format: bounded memory, a clear error, other rooms fine.

A raw control client plays the hostile decode rank (claiming a control endpoint;
``raw_control``, on both planes), next to a real decode peer whose transfers must
go on untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import transport
from pdcore.control import wire
from pd_pair import Pair
from raw_control import RawControl

pytestmark = pytest.mark.timeout(120)

HOSTILE = "tcp://127.0.0.1:9"  # well-formed, nobody listens: answers to it go nowhere


@pytest.fixture
def pair(plane: str) -> Any:
    p = Pair(prefill={"max_parked_pages": 50_000}, control=plane)
    yield p
    p.close()


@pytest.fixture
def dealer(pair: Pair, plane: str) -> Any:
    raw = RawControl(pair.prefill.control_endpoint, plane, HOSTILE)
    yield raw
    raw.close()


def _announce(room: int, pages: int) -> bytes:
    return wire.encode(
        wire.Announce(room=room, session_id="hostile", epoch=1, page_ids=tuple(range(pages)), request_pool_index=0)
    )


def test_parked_announcements_are_bounded_per_sender(pair: Pair, dealer: Any) -> None:
    """Announcements for rooms prefill never registered: one of the largest legal size parks, and
    past the per-sender page budget the rest are refused, while real rooms go through."""
    dealer.send(_announce(1, wire.MAX_PAGES))  # 262,144 pages: over the budget on its own
    for room in range(100, 400):  # 300 x 500 pages = 150,000 pages: a third of them fits
        dealer.send(_announce(room, 500))
    dealer.send(wire.encode(wire.Abort(room=999)))  # a marker: handled after every announcement above
    parking = pair.prefill._engine._pending  # white-box: the budgets are the engine's parking, per sender
    pair.pump(lambda: pair.prefill._engine._tombstones.get(999) is not None, "the announcements to arrive")
    assert parking.pages(HOSTILE) <= 50_000 and len(parking) == 100, (parking.pages(HOSTILE), len(parking))
    assert 1 not in parking
    rids = [f"ok{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        pair.register(rid, 10 + i)
    pair.drive(rids)
    assert all(pair.ended("decode", rid) == "RemotePrefillDone" and pair.landed_intact(rid) for rid in rids)
    assert pair.prefill.stats["work_errors"] == 0


def test_parked_announcements_are_bounded_in_all_whatever_ids_senders_pick(plane: str) -> None:
    """Without a secret a sender picks its identity freely: many ids, each under its own page
    budget, together stop at the total budget, and real rooms still go through."""
    pair = Pair(prefill={"max_parked_pages": 1_000, "max_parked_pages_total": 2_500}, control=plane)
    socks = []
    try:
        for n in range(6):  # 6 x 800 pages: three fit in the total
            sock = RawControl(pair.prefill.control_endpoint, plane, f"tcp://127.0.0.1:{10 + n}")
            socks.append(sock)
            sock.send(_announce(1000 + n, 800))
            sock.send(wire.encode(wire.Abort(room=2000 + n)))  # a marker, handled after its announcement
        pair.pump(lambda: all(pair.prefill._engine._tombstones.get(2000 + n) is not None for n in range(6)),
                  "the announcements to arrive")
        parking = pair.prefill._engine._pending
        assert parking.pages() == 2_400 and len(parking) == 3, (parking.pages(), len(parking))
        pair.register("ok", 10)
        pair.drive(["ok"])
        assert pair.ended("decode", "ok") == "RemotePrefillDone" and pair.landed_intact("ok")
    finally:
        for sock in socks:
            sock.close()
        pair.close()


def test_a_huge_claimed_cache_fails_only_its_room(pair: Pair, dealer: Any) -> None:
    """A sink that claims 2**40 pages of 4 KiB: the room it announces fails with a clear reason;
    planning costs what is written, not what is claimed (no MemoryError), and nothing else fails."""
    sink = transport.create("tcp")
    try:
        buf = np.zeros(1 << 16, np.uint8)
        region = sink.register(buf)
        layout = {"bases": [region.addr, region.addr + 8192], "page_bytes": [4096, 4096], "num_pages": 1 << 40}
        dealer.send(wire.encode(wire.Register(
            session_id="hostile", epoch=1, endpoint=sink.endpoint(),
            regions=(wire.Region(addr=region.addr, length=region.length, key=region.key),),
            layout=layout, tp_size=1, tp_rank=0,
        )))  # fmt: skip
        rid, room = "claimed", 77
        pair.register(rid, room, decode=False)
        dealer.send(wire.encode(wire.Announce(
            room=room, session_id="hostile", epoch=1, page_ids=(5, (1 << 32) - 1),
            request_pool_index=0,
        )))  # fmt: skip
        pair.pump(lambda: pair.seen("prefill", "Bootstrapped", rid), "prefill to adopt the announcement")
        pair.prefill.record_usage(rid, 0, None)
        pair.outbox.send(rid, [0, 1], 7)
        pair.pump(lambda: bool(pair.ended("prefill", rid)), "prefill to end the room")
        assert pair.ended("prefill", rid) == "Failed"
        assert pair.prefill.stats["work_errors"] == 0
        pair.register("fine", 78)
        pair.drive(["fine"])
        assert pair.ended("decode", "fine") == "RemotePrefillDone" and pair.landed_intact("fine")
    finally:
        sink.close()
