"""Grants on the verbs transport (soft-RoCE in CI): the QP-to-error fallback of ``revoke``, and the sink QP cap.

Without memory windows (a device without them; here sinks built with ``memory_windows=False``) a
sink cannot check a write against a grant; ``revoke`` (not settled) kills every sink QP of the
grant's source instead (tests/rdma/test_windows_verbs.py checks the windows). These tests check
what the fallback promises: in-flight and
later writes of that source fail and land nothing after ``revoke`` returns, other sources carry on,
the source can connect again, ``settled=True`` keeps the QP, and ``max_sinks`` refuses clearly.
Every wait is bounded by a deadline.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

import numpy as np
import pytest

from pdcore.core.deadline import Deadline
from pdcore.core.errors import CapacityError, TransportError

from _transport_support import Collector, granted_link, wait_until  # tests/rdma/conftest.py puts tests/transport on the path

pytestmark = pytest.mark.rdma

SLOW = 20.0  # seconds a completion may take on soft-RoCE under emulation
CANARY = 0x5C


def _sink_qps(t: Any) -> int:
    with t._lock:
        return len(t._sinks)



def test_grant_bookkeeping_and_the_key_a_write_carries(make_verbs: Any) -> None:
    src_t, dst_t = make_verbs(), make_verbs(memory_windows=False)
    assert len(src_t.instance) == 16 and src_t.instance != dst_t.instance
    assert dst_t.revoke_method == "queue pair to error" and not dst_t.memory_windows
    with pytest.raises(AttributeError):
        dst_t.revoke_method = "memory window"
    src = np.full(8192, 0x31, np.uint8)
    dst = np.zeros(8192, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst, require_grant=True)
    with pytest.raises(ValueError, match="outside every registered region"):
        dst_t.grant(src_t.instance, [(rd.addr + 8000, 400)])
    with pytest.raises(ValueError):
        dst_t.grant(b"short", [(rd.addr, 16)])
    g = dst_t.grant(src_t.instance, [(rd.addr + 4096, 4096), (rd.addr, 4096)])
    assert g.key and g.source == src_t.instance and g.ranges == ((rd.addr, 4096), (rd.addr + 4096, 4096))  # sorted
    assert dst_t.grant(src_t.instance, [(rd.addr, 16)]).key != g.key
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    done = Collector(SLOW)
    for bad in (-1, 1 << 64, "7", 1.5):
        with pytest.raises(TransportError, match="grant key") as ei:
            src_t.write(peer, [(rs.addr, rd.addr, 16)], done, grant=bad)
        assert ei.value.op == "write"
    assert not done.done  # nothing was posted
    bid = src_t.write(peer, [(rs.addr, rd.addr, 8192)], done, grant=np.uint64(g.key))
    assert done.wait(1) == [(bid, None)] and (dst == 0x31).all()


def test_revoke_fails_in_flight_writes_and_nothing_lands_after_it(make_verbs: Any) -> None:
    """(a) Revoke while 4 MiB batches are in flight: they fail at the source, the source's later
    writes raise or fail, a canary written after revoke returned stays intact while the source
    keeps trying, and another source of the same sink is not disturbed."""
    src_t, other_t, dst_t = make_verbs(max_inflight=16), make_verbs(), make_verbs(memory_windows=False)
    size = 4 << 20
    src = np.full(size, 0xAA, np.uint8)
    dst = np.zeros(size, np.uint8)
    side = np.zeros(4096, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst, require_grant=True)
    r_side = dst_t.register(side, require_grant=True)
    other_src = np.full(4096, 0x0B, np.uint8)
    r_other = other_t.register(other_src)
    g = dst_t.grant(src_t.instance, [(rd.addr, size)])
    g_other = dst_t.grant(other_t.instance, [(r_side.addr, 4096)])
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    other = other_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    assert _sink_qps(dst_t) == 2
    done = Collector(SLOW)
    first = src_t.write(peer, [(rs.addr, rd.addr, 4096)], done, grant=g.key)
    assert done.wait(1) == [(first, None)]  # the grant works before it is revoked

    ids = [src_t.write(peer, [(rs.addr, rd.addr, size)], done, grant=g.key) for _ in range(8)]
    in_flight = len(ids) + 1 - len(done.done)
    assert in_flight > 0, "every batch completed before revoke: the test needs bigger batches"
    t0 = time.monotonic()
    dst_t.revoke(g, deadline=Deadline.after(5))
    took = time.monotonic() - t0
    dst[:] = CANARY  # from here on, no byte of the source may land

    later: list[int] = []
    raised: TransportError | None = None
    window, limit = Deadline.after(2.0), Deadline.after(10.0)
    while not (window.expired() and raised is not None) and not limit.expired():  # the source keeps trying
        try:
            later.append(src_t.write(peer, [(rs.addr, rd.addr, size)], done, grant=g.key))
        except CapacityError:
            pass
        except TransportError as e:
            raised = e
        assert (dst == CANARY).all(), "bytes landed after revoke returned"
        time.sleep(0.02)
    got = dict(done.wait(1 + len(ids) + len(later), seconds=15))
    assert (dst == CANARY).all(), "bytes landed after revoke returned"
    assert took < 5.0, f"revoke took {took:.2f} s"

    outcomes = [got[b] for b in ids]
    failed = [e for e in outcomes if e is not None]
    assert failed, f"none of the {in_flight} batches in flight at revoke failed"
    assert all(isinstance(e, TransportError) and e.op == "write" for e in failed), failed
    assert "revoked" in str(failed[0]) and failed[0].errno == errno.EACCES, str(failed[0])  # the sink said why
    k = outcomes.index(failed[0])
    assert all(e is not None for e in outcomes[k:]), "a batch succeeded after an earlier one failed"
    assert all(got[b] is not None for b in later), "a write posted after revoke succeeded"
    assert raised is not None and "unusable" in str(raised) and "revoked" in str(raised), f"not told: {raised!r}"
    with pytest.raises(TransportError, match="unusable"):
        src_t.write(peer, [(rs.addr, rd.addr, 16)], done, grant=g.key)

    wait_until(lambda: _sink_qps(dst_t) == 1, 5, "the revoked QP was not dropped")
    more = Collector(SLOW)  # the other source still writes through its own grant
    bid = other_t.write(other, [(r_other.addr, r_side.addr, 4096)], more, grant=g_other.key)
    assert more.wait(1) == [(bid, None)] and (side == 0x0B).all()
    dst_t.revoke(g)  # idempotent
    assert _sink_qps(dst_t) == 1


def test_revoke_holds_against_a_source_that_never_hears_of_it(make_verbs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source deaf to its liveness socket (as if paused when the sink closed it) keeps posting on its
    old QP after revoke: only the destroyed sink QP stands between it and the sink's memory. Nothing
    lands; its batches fail on the wire (the RC retries run out), not because it was told."""
    import transport.verbs as verbs

    src_t = make_verbs(max_inflight=16, qp_timeout=14, retry_cnt=3)  # ~0.07 s x 4 tries on the wire
    dst_t = make_verbs(memory_windows=False)
    size = 1 << 20
    src = np.full(size, 0xAB, np.uint8)
    dst, rs, rd, g, peer = granted_link(src_t, dst_t, src)
    deaf = peer.sock
    heard = verbs._hangup

    def not_hearing(sock: Any) -> bytes | None:
        if sock is deaf:  # on the source's cm thread: stop watching, never learn that the sink hung up
            src_t._sel_drop(sock)
            return None
        return heard(sock)

    monkeypatch.setattr(verbs, "_hangup", not_hearing)
    done = Collector(SLOW)
    ok = src_t.write(peer, [(rs.addr, rd.addr, size)], done, grant=g.key)
    assert done.wait(1) == [(ok, None)] and (dst == 0xAB).all()
    ids = [src_t.write(peer, [(rs.addr, rd.addr, size)], done, grant=g.key) for _ in range(4)]
    before = len(ids)
    dst_t.revoke(g)
    dst[:] = CANARY
    window = Deadline.after(1.5)
    while not window.expired():
        try:
            ids.append(src_t.write(peer, [(rs.addr, rd.addr, size)], done, grant=g.key))
        except CapacityError:
            pass
        except TransportError:
            break  # the retries ran out already
        assert (dst == CANARY).all(), "bytes landed after revoke returned"
        time.sleep(0.02)
    got = dict(done.wait(1 + len(ids), seconds=20))
    assert (dst == CANARY).all(), "bytes landed after revoke returned"
    outcomes = [got[b] for b in ids]
    failed = [e for e in outcomes if e is not None]
    assert failed and "IBV_WC_RETRY_EXC_ERR" in str(failed[0]), failed[:1]
    k = outcomes.index(failed[0])
    assert all(e is not None for e in outcomes[k:]) and k <= before, "a batch posted after revoke succeeded"
    with pytest.raises(TransportError, match="unusable"):
        src_t.write(peer, [(rs.addr, rd.addr, 16)], done)


def test_revoke_ignores_a_grant_of_another_sink(make_verbs: Any) -> None:
    """Grant keys are per sink: revoking sink B's grant on sink A (same key) changes nothing on A."""
    src_t, a_t, b_t = make_verbs(), make_verbs(memory_windows=False), make_verbs(memory_windows=False)
    dst = np.zeros(4096, np.uint8)
    rd = a_t.register(dst)
    other = np.zeros(4096, np.uint8)
    rb = b_t.register(other)
    ga = a_t.grant(src_t.instance, [(rd.addr, 4096)])
    gb = b_t.grant(src_t.instance, [(rb.addr, 4096)])
    assert ga.key == gb.key
    src_t.connect(a_t.endpoint(), deadline=Deadline.after(10))
    a_t.revoke(gb)
    assert _sink_qps(a_t) == 1
    a_t.revoke(ga)
    assert _sink_qps(a_t) == 0


def test_after_revoke_the_source_connects_again_and_writes_through_a_new_grant(make_verbs: Any) -> None:
    """(b) The revoked source's handle is dead; a new connection and new grants work, its kept grants
    work again, and the revoked key is refused on every later connection (the handshake says so)."""
    src_t, dst_t = make_verbs(), make_verbs(memory_windows=False)
    src = np.full(16384, 0x21, np.uint8)
    dst = np.zeros(16384, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst, require_grant=True)
    g = dst_t.grant(src_t.instance, [(rd.addr, 8192)])
    keep = dst_t.grant(src_t.instance, [(rd.addr + 8192, 8192)])  # stays in the table, useless until reconnect
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    done = Collector(SLOW)
    src_t.write(peer, [(rs.addr, rd.addr, 8192)], done, grant=g.key)
    assert done.wait(1)[0][1] is None
    dst_t.revoke(g)
    assert _sink_qps(dst_t) == 0

    def told() -> bool:
        try:
            src_t.write(peer, [(rs.addr, rd.addr + 8192, 16)], done, grant=keep.key)
        except TransportError as e:
            assert "unusable" in str(e)
            return True
        return False

    wait_until(told, 10, "the source did not learn that its QP was revoked")
    assert (dst[8192:] == 0).all()  # nothing landed through the other grant of the revoked connection

    g2 = dst_t.grant(src_t.instance, [(rd.addr, 4096)])  # before the reconnect
    again = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    g3 = dst_t.grant(src_t.instance, [(rd.addr + 4096, 4096)])  # after it
    src[:] = 0x22
    more = Collector(SLOW)
    bid = src_t.write(again, [(rs.addr, rd.addr, 4096)], more, grant=g2.key)
    assert more.wait(1) == [(bid, None)] and (dst[:4096] == 0x22).all()
    bid = src_t.write(again, [(rs.addr, rd.addr + 8192, 4096)], more, grant=keep.key)  # the kept grant again
    assert more.wait(2)[1] == (bid, None) and (dst[8192 : 8192 + 4096] == 0x22).all()
    bid = src_t.write(again, [(rs.addr, rd.addr + 4096, 4096)], more, grant=g3.key)
    assert more.wait(3)[2] == (bid, None) and (dst[4096:8192] == 0x22).all()
    # a paused source that resumes, reconnects and writes through its revoked grant: refused at the source
    src[:] = 0x23
    with pytest.raises(TransportError, match=f"grant {g.key} was not live") as ei:
        src_t.write(again, [(rs.addr, rd.addr, 4096)], more, grant=g.key)
    assert ei.value.errno == errno.EACCES and ei.value.op == "write"
    dst_t.revoke(g2, settled=True)  # settled: the QP stays, but a later connection refuses the key too
    third = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    with pytest.raises(TransportError, match=f"grant {g2.key} was not live"):
        src_t.write(third, [(rs.addr, rd.addr, 4096)], more, grant=g2.key)
    bid = src_t.write(third, [(rs.addr, rd.addr + 4096, 4096)], more, grant=g3.key)
    assert more.wait(4)[3] == (bid, None) and (dst[:4096] == 0x22).all() and (dst[4096:8192] == 0x23).all()
    src_t.disconnect(third)
    src_t.disconnect(peer)  # the dead handle can still be disconnected
    src_t.disconnect(again)


def test_revoke_settled_keeps_the_queue_pair(make_verbs: Any) -> None:
    """(c) ``settled=True`` only forgets the grant: the connection and the other grants keep working."""
    src_t, dst_t = make_verbs(), make_verbs(memory_windows=False)
    src = np.full(8192, 0x41, np.uint8)
    dst = np.zeros(8192, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst, require_grant=True)
    g1 = dst_t.grant(src_t.instance, [(rd.addr, 4096)])
    g2 = dst_t.grant(src_t.instance, [(rd.addr + 4096, 4096)])
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    done = Collector(SLOW)
    b1 = src_t.write(peer, [(rs.addr, rd.addr, 4096)], done, grant=g1.key)
    assert done.wait(1) == [(b1, None)]
    dst_t.revoke(g1, settled=True)
    assert _sink_qps(dst_t) == 1
    b2 = src_t.write(peer, [(rs.addr, rd.addr + 4096, 4096)], done, grant=g2.key)
    fence = src_t.write(peer, [], done)
    assert done.wait(3)[1:] == [(b2, None), (fence, None)] and (dst == 0x41).all()
    dst_t.revoke(g1)  # already forgotten: nothing more happens, the QP stays
    assert _sink_qps(dst_t) == 1
    dst_t.revoke(g2)  # not settled: now the QP goes
    assert _sink_qps(dst_t) == 0


def test_revoke_for_a_source_that_never_connected_returns_at_once(make_verbs: Any) -> None:
    """(d) No QP of that source: revoke only forgets the grant; other sources are untouched."""
    src_t, dst_t = make_verbs(), make_verbs()
    src = np.full(4096, 0x51, np.uint8)
    dst = np.zeros(8192, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    ghost = dst_t.grant(b"N" * 16, [(rd.addr, 4096)])
    t0 = time.monotonic()
    dst_t.revoke(ghost, deadline=Deadline.after(5))
    assert time.monotonic() - t0 < 1.0  # no QP to kill: dictionary work only
    assert _sink_qps(dst_t) == 1
    done = Collector(SLOW)
    bid = src_t.write(peer, [(rs.addr, rd.addr + 4096, 4096)], done)
    assert done.wait(1) == [(bid, None)] and (dst[4096:] == 0x51).all() and not dst[:4096].any()


def test_sink_qp_cap_refuses_clearly_and_frees_slots(make_verbs: Any) -> None:
    """(e) ``max_sinks`` QPs at most: one more handshake fails the source's connect naming the cap;
    a source that disconnects, or a revoke, frees slots."""
    dst_t = make_verbs(max_sinks=2, memory_windows=False)  # the fallback: a revoke frees the QP
    assert dst_t.max_sinks == 2
    a_t, b_t = make_verbs(), make_verbs()
    dst = np.zeros(4096, np.uint8)
    rd = dst_t.register(dst)
    ep = dst_t.endpoint()
    a1 = a_t.connect(ep, deadline=Deadline.after(10))
    a_t.connect(ep, deadline=Deadline.after(10))
    with pytest.raises(TransportError, match=r"maximum of 2 source QPs \(its max_sinks=2\)") as ei:
        b_t.connect(ep, deadline=Deadline.after(10))
    assert ei.value.op == "connect"
    assert _sink_qps(dst_t) == 2 and dst_t.refused_connections == 1

    a_t.disconnect(a1)  # the sink sees the liveness socket close and frees the QP
    wait_until(lambda: _sink_qps(dst_t) == 1, 10, "the disconnected source's QP was not freed")
    b1 = b_t.connect(ep, deadline=Deadline.after(10))
    with pytest.raises(TransportError, match="max_sinks=2"):
        b_t.connect(ep, deadline=Deadline.after(10))

    dst_t.revoke(dst_t.grant(a_t.instance, [(rd.addr, 4096)]))  # frees a's remaining QP
    assert _sink_qps(dst_t) == 1
    b_t.connect(ep, deadline=Deadline.after(10))
    src = np.full(4096, 0x61, np.uint8)
    rs = b_t.register(src)
    done = Collector(SLOW)
    bid = b_t.write(b1, [(rs.addr, rd.addr, 4096)], done)
    assert done.wait(1) == [(bid, None)] and (dst == 0x61).all()
    with pytest.raises(Exception, match="max_sinks"):
        make_verbs(max_sinks=0)


def test_revoke_races_the_source_going_away(make_verbs: Any) -> None:
    """revoke (caller's thread) and the cm thread (the source's socket closing) drop the same QP at
    once: exactly one of them tears it down, nothing raises, and close() is clean afterwards."""
    src_t, dst_t = make_verbs(), make_verbs()
    dst = np.zeros(4096, np.uint8)
    rd = dst_t.register(dst)
    errors: list[BaseException] = []
    for _ in range(6):
        peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
        g = dst_t.grant(src_t.instance, [(rd.addr, 4096)])
        go = threading.Barrier(2)

        def leave(p: Any = peer) -> None:
            try:
                go.wait(5)
                src_t.disconnect(p)
            except BaseException as e:  # noqa: BLE001 - surfaced below
                errors.append(e)

        th = threading.Thread(target=leave)
        th.start()
        go.wait(5)
        dst_t.revoke(g)
        th.join(10)
        assert not th.is_alive()
        wait_until(lambda: _sink_qps(dst_t) == 0, 10, "a QP was left behind")
    assert not errors


def test_a_revoke_that_could_not_stop_the_qp_raises_and_the_next_one_tries_again(
    make_verbs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller retries an unconfirmed revoke (decode does, every tick): the retry must act, not
    find the grant gone and report success."""
    src_t, dst_t = make_verbs(), make_verbs(memory_windows=False)
    dst = np.zeros(4096, np.uint8)
    rd = dst_t.register(dst)
    g = dst_t.grant(src_t.instance, [(rd.addr, 4096)])
    src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    monkeypatch.setattr(dst_t, "_kill_sink_qp", lambda qp: "to error: injected; destroy: injected")
    with pytest.raises(TransportError, match="could not be stopped: to error: injected") as ei:
        dst_t.revoke(g)
    assert ei.value.op == "revoke" and _sink_qps(dst_t) == 1
    monkeypatch.undo()
    dst_t.revoke(g)
    assert _sink_qps(dst_t) == 0
    dst_t.revoke(g)  # confirmed now: nothing more to do
