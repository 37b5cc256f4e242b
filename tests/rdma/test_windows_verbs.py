"""Memory windows on the verbs transport (soft-RoCE in CI): a revoke costs only its own grant.

rxe binds type 2 windows, so the transport uses them by default: a region that requires a grant
is registered without remote write and its rkey never leaves the sink; each grant is one window
per contiguous range, bound on the queue pair of its source; revoke asks the source to stop,
waits for its answer, and invalidates the windows. These tests check what that promises, from
the outside of one process with two transports and a real device: writes through a grant land;
a revoke of one of 16 grants in flight fails nothing of the others and keeps the queue pair;
nothing lands through a revoked grant; a source that does not run this code (its window table
forged here, the only way to make it post an rkey it was not given) lands nothing with the
region's rkey, an invented one or a revoked window's, and sees a remote access error; a source
that never answers is cut at the deadline; and invalidation stops a multi-packet WRITE already
under way. Every wait is bounded by a deadline.
"""

from __future__ import annotations

import errno
import time
from typing import Any

import numpy as np
import pytest

from pdcore.core.deadline import Deadline
from pdcore.core.errors import TransportError
from transport.endpoint import decode_endpoint

from _transport_support import Collector, granted_link, wait_until  # tests/rdma/conftest.py puts tests/transport on the path

pytestmark = pytest.mark.rdma

SLOW = 30.0  # seconds a completion may take on soft-RoCE under emulation
CANARY = 0x5C
ROOM = 4 << 20


def _sinks(t: Any) -> list[Any]:
    with t._lock:
        return list(t._sinks.values())



def test_windows_are_the_default_and_a_guarded_rkey_never_leaves_the_sink(make_verbs: Any) -> None:
    src_t, dst_t = make_verbs(), make_verbs()
    assert dst_t.memory_windows and dst_t.revoke_method == "memory window"
    src = np.full(3 * 4096, 0x31, np.uint8)
    dst = np.zeros(3 * 4096, np.uint8)
    open_ = np.zeros(4096, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst, require_grant=True)
    ro = dst_t.register(open_)
    keys = {r.addr: r.key for r in decode_endpoint(dst_t.endpoint()).regions}
    assert keys[rd.addr] == 0 and keys[ro.addr] == ro.key != 0  # only the open region's rkey travels
    early = dst_t.grant(src_t.instance, [(rd.addr, 4096), (rd.addr + 4096, 4096)])  # touching: one window
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    late = dst_t.grant(src_t.instance, [(rd.addr + 8192, 4096)])  # after the connection: sent as a frame
    assert dst_t.windows_live == 2
    done = Collector(SLOW)
    a = src_t.write(peer, [(rs.addr, rd.addr, 8192)], done, grant=early.key)
    b = src_t.write(peer, [(rs.addr, rd.addr + 8192, 4096)], done, grant=late.key, deadline=Deadline.after(5))
    c = src_t.write(peer, [(rs.addr, ro.addr, 4096)], done)  # no grant: the open region takes the MR's rkey
    d = src_t.write(peer, [(rs.addr, rd.addr, 8193)], done, grant=early.key)  # one byte past its window
    e = src_t.write(peer, [(rs.addr, rd.addr, 16)], done)  # no grant into the guarded region
    got = dict(done.wait(5))
    assert got[a] is None and got[b] is None and got[c] is None, got
    assert isinstance(got[d], TransportError) and "outside grant" in str(got[d]) and got[d].errno == errno.EACCES
    assert isinstance(got[e], TransportError) and "requires one" in str(got[e])
    assert (dst == 0x31).all() and (open_ == 0x31).all()
    with pytest.raises(TransportError, match="not live at the sink") as ei:  # another source's key, or none
        src_t.write(peer, [(rs.addr, rd.addr, 16)], done, grant=late.key + 100, deadline=Deadline.after(0.2))
    assert ei.value.errno == errno.EACCES
    dst_t.revoke(early)
    dst_t.revoke(late, settled=True)
    assert dst_t.windows_live == 0 and len(_sinks(dst_t)) == 1  # the queue pair stays
    wait_until(lambda: not peer.win.grants, 5, "the source did not forget the windows of its revoked grants")
    with pytest.raises(TransportError, match=f"grant {early.key} is not live"):
        src_t.write(peer, [(rs.addr, rd.addr, 16)], done, grant=early.key)
    small = make_verbs(max_windows=2)
    spread = np.zeros(3 * 4096, np.uint8)
    r = small.register(spread, require_grant=True)
    with pytest.raises(ValueError, match="max_windows=2"):  # three ranges apart: three windows
        small.grant(src_t.instance, [(r.addr, 16), (r.addr + 4096, 16), (r.addr + 8192, 16)])
    assert small.grant(src_t.instance, [(r.addr, 16), (r.addr + 16, 16)]).key  # touching: one window


def test_revoking_one_of_16_grants_in_flight_fails_none_of_the_others(make_verbs: Any) -> None:
    """16 rooms of 4 MiB in flight, one grant each; the sink revokes room 5's while they stream. Every
    other room lands whole, the queue pair stays, nothing lands in room 5 after revoke returned,
    and room 5's key is refused at the source from then on."""
    src_t, dst_t = make_verbs(max_inflight=32), make_verbs()
    rooms = 16
    rng = np.random.default_rng(5)
    src = rng.integers(1, 256, rooms * ROOM, dtype=np.uint8)
    dst = np.zeros(rooms * ROOM, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst, require_grant=True)
    grants = [dst_t.grant(src_t.instance, [(rd.addr + i * ROOM, ROOM)]) for i in range(rooms)]
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    done = Collector(SLOW * 2)
    ids = [src_t.write(peer, [(rs.addr + i * ROOM, rd.addr + i * ROOM, ROOM)], done, grant=g.key)
           for i, g in enumerate(grants)]
    victim = 5
    dst_t.revoke(grants[victim], deadline=Deadline.after(SLOW))
    view = dst.reshape(rooms, ROOM)
    view[victim] = CANARY
    with pytest.raises(TransportError, match="not live") as ei:
        src_t.write(peer, [(rs.addr, rd.addr + victim * ROOM, 16)], done, grant=grants[victim].key)
    assert ei.value.errno == errno.EACCES
    got = dict(done.wait(rooms))
    assert (view[victim] == CANARY).all(), "bytes landed through a grant after revoke returned"
    for i in range(rooms):
        if i != victim:
            assert got[ids[i]] is None, f"room {i}: {got[ids[i]]}"
            assert np.array_equal(view[i], src.reshape(rooms, ROOM)[i]), f"room {i} did not land whole"
    assert len(_sinks(dst_t)) == 1 and not peer.closed  # no reconnect: the queue pair carried on
    more = Collector(SLOW)
    bid = src_t.write(peer, [(rs.addr, rd.addr, 4096)], more, grant=grants[0].key)
    assert more.wait(1) == [(bid, None)]


def _forge(src_t: Any, peer: Any, key: int, addr: int, length: int, rkey: int) -> None:
    """Make the source post ``rkey`` for ``key``: what a source that does not run this code can do."""
    with peer.lock:
        peer.win.add(key, [(addr, length, rkey)])


@pytest.mark.parametrize("which", ["region rkey", "region lkey", "invented rkey", "revoked window"])
def test_a_source_with_an_rkey_it_was_not_given_lands_nothing(make_verbs: Any, which: str) -> None:
    src_t, dst_t = make_verbs(), make_verbs()
    src = np.full(65536, 0xEE, np.uint8)
    dst = np.full(65536, CANARY, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst, require_grant=True)
    g = dst_t.grant(src_t.instance, [(rd.addr, 4096)])
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    done = Collector(SLOW)
    if which == "region rkey":
        rkey = dst_t._mrs[rd.key].rkey  # the MR's own (registered without remote access: rxe gives 0)
    elif which == "region lkey":
        rkey = dst_t._mrs[rd.key].lkey
    elif which == "invented rkey":
        rkey = 0x00ABCD17
    else:
        with peer.lock:
            rkey = peer.win.rkey(g.key, rd.addr, 4096)
        dst_t.revoke(g, deadline=Deadline.after(SLOW))
    forged = g.key + 1000
    _forge(src_t, peer, forged, rd.addr, 65536, rkey)
    bid = src_t.write(peer, [(rs.addr, rd.addr, 65536)], done, grant=forged)
    (got_id, err), = done.wait(1)
    assert got_id == bid and isinstance(err, TransportError), err
    assert "IBV_WC_REM_ACCESS_ERR" in str(err), str(err)
    assert (dst == CANARY).all(), f"{which}: bytes landed"


def test_a_source_that_never_answers_is_cut_at_the_deadline(make_verbs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The source stops reading its liveness socket (as if paused) with writes in flight: revoke waits
    until its deadline, invalidates, cuts the queue pair; nothing lands after it returned."""
    src_t, dst_t = make_verbs(max_inflight=16), make_verbs()
    size = 4 << 20
    src = np.full(size, 0xAB, np.uint8)
    dst, rs, rd, g, peer = granted_link(src_t, dst_t, src)

    def deaf(p: Any, sock: Any) -> None:
        src_t._sel_drop(sock)  # never learns of the stop, nor of the hang-up
        return None

    monkeypatch.setattr(src_t, "_heard_from_sink", deaf)
    done = Collector(SLOW)
    ids = [src_t.write(peer, [(rs.addr, rd.addr, size)], done, grant=g.key) for _ in range(6)]
    t0 = time.monotonic()
    dst_t.revoke(g, deadline=Deadline.after(0.3))
    took = time.monotonic() - t0
    dst[:] = CANARY
    got = dict(done.wait(len(ids), seconds=60))
    assert (dst == CANARY).all(), "bytes landed after revoke returned"
    assert took < 10, f"revoke took {took:.1f} s"
    assert not _sinks(dst_t), "the connection that did not answer was not cut"
    failed = [got[b] for b in ids if got[b] is not None]
    assert failed, "every batch completed before the deadline: the test needs bigger writes"


def test_invalidation_stops_a_write_already_on_the_wire(make_verbs: Any) -> None:
    """What invalidation promises on rxe, measured: an 8 MiB WRITE (thousands of packets) is under
    way when the sink invalidates its window; the rest of it lands nothing (rxe checks the rkey on
    every packet, not only the first), and the source sees a remote access error."""
    src_t, dst_t = make_verbs(), make_verbs()
    size = 8 << 20  # rxe's largest message
    src = np.full(size, 0x77, np.uint8)
    dst, rs, rd, g, peer = granted_link(src_t, dst_t, src)
    done = Collector(SLOW * 2)
    bid = src_t.write(peer, [(rs.addr, rd.addr, size)], done, grant=g.key)
    probe = 256 << 10
    wait_until(lambda: dst[probe] != 0, SLOW, "the write did not pass its first 256 KiB")
    (conn,) = _sinks(dst_t)
    with dst_t._mw_lock:  # the sink's half of revoke alone: no stop asked, the write is mid-flight
        # True (failed) when the next packet's access error moved the QP to the error state before the
        # invalidation's completion was reported (it then completes as flushed): nothing lands either way
        dst_t._close_windows(conn, g.key)
    at_invalidation = int(np.count_nonzero(dst))
    (got_id, err), = done.wait(1)
    after = int(np.count_nonzero(dst))
    print(f"\ninvalidation at {at_invalidation} of {size} bytes; {after - at_invalidation} bytes landed after it")
    assert got_id == bid and isinstance(err, TransportError) and "IBV_WC_REM_ACCESS_ERR" in str(err), err
    assert at_invalidation < size, "the write completed before the invalidation: make it bigger"
    assert after - at_invalidation <= 4096, f"{after - at_invalidation} bytes landed after the invalidation completed"


def test_a_write_longer_than_the_ports_largest_message_lands_whole(make_verbs: Any) -> None:
    """rxe's ports take messages of 8 MiB at most; a longer one would fail the queue pair at the sink.
    The transport posts it as several WRs, through the window like any other."""
    src_t, dst_t = make_verbs(), make_verbs()
    size = 2 * dst_t._dev.max_msg + 4099
    src = np.random.default_rng(3).integers(1, 256, size, dtype=np.uint8)
    dst, rs, rd, g, peer = granted_link(src_t, dst_t, src)
    done = Collector(SLOW * 2)
    bid = src_t.write(peer, [(rs.addr, rd.addr, size)], done, grant=g.key)
    assert done.wait(1) == [(bid, None)] and np.array_equal(dst, src)
