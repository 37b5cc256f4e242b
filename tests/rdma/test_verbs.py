"""The verbs transport on a real device (soft-RoCE in CI): bytes, peers, error completions, teardown.

Every wait is bounded by a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

import numpy as np
import pytest

from pdcore.core.deadline import Deadline
from pdcore.core.errors import CapacityError, StartError, TransportError
from transport.base import Endpoint, Region, decode_endpoint, encode_endpoint

from _transport_support import Collector  # tests/rdma/conftest.py puts tests/transport on the path

pytestmark = pytest.mark.rdma

SLOW = 20.0  # seconds a completion may take on soft-RoCE under emulation


def _linked(src_t: Any, dst_t: Any, src: np.ndarray) -> tuple[np.ndarray, Any, Any, Any]:
    """A source's bytes ``src`` and a sink's zeroed buffer of their size, both registered, and the
    source connected to the sink: ``(dst, src_region, dst_region, peer)``."""
    dst = np.zeros(src.nbytes, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    return dst, rs, rd, peer


def _with_regions(endpoint: bytes, regions: list[Region]) -> bytes:
    ep = decode_endpoint(endpoint, expect="verbs")
    return encode_endpoint(Endpoint(ep.transport, ep.instance, ep.address, tuple(sorted(regions, key=lambda r: r.addr))))


# ----------------------------------------------------------------------------- device, port, GID


def test_device_port_and_gid_are_chosen_and_can_be_overridden(make_verbs: Any, verbs_device: str | None) -> None:
    t = make_verbs()
    name = t.device_name
    assert t.device.startswith(f"{name}/")
    ep = decode_endpoint(t.endpoint(), expect="verbs")
    gid = ep.address[:16]
    assert any(gid), "the endpoint carries the GID"
    if name.startswith("rxe"):  # soft-RoCE on dummy0 (10.99.0.1): the IPv4-mapped RoCE v2 GID
        assert gid[:12] == bytes(10) + b"\xff\xff", gid.hex()
    same = make_verbs(device=name, ib_port=1, gid_index=t.gid_index)
    assert same.device == t.device
    with pytest.raises(StartError, match="no RDMA device named 'no-such-dev0'"):
        make_verbs(device="no-such-dev0")


def test_endpoint_carries_rkeys_and_lengths(make_verbs: Any) -> None:
    t = make_verbs()
    bufs = [np.zeros(n, np.uint8) for n in (4096, 12345, 1 << 20)]
    regions = [t.register(b) for b in bufs]
    ep = decode_endpoint(t.endpoint(), expect="verbs")
    assert sorted(ep.regions, key=lambda r: r.addr) == sorted(regions, key=lambda r: r.addr)
    assert len({r.key for r in regions}) == 3 and all(r.key for r in regions)


# ----------------------------------------------------------------------------- bytes land exactly


def test_single_write_lands_exactly(make_verbs: Any) -> None:
    """Also: the sink registers a raw ``(addr, length)`` (the caller keeps the memory alive)."""
    src_t, dst_t = make_verbs(), make_verbs()
    src = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    rs, rd = src_t.register(src), dst_t.register((int(dst.ctypes.data), int(dst.nbytes)))
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    done = Collector(SLOW)
    bid = src_t.write(peer, [(rs.addr + 5, rd.addr + 1000, 300_001)], done)
    assert done.wait(1) == [(bid, None)]
    assert np.array_equal(dst[1000 : 1000 + 300_001], src[5 : 5 + 300_001])
    assert not dst[:1000].any() and not dst[1000 + 300_001 :].any()


@pytest.mark.parametrize("max_send_wr", [1024, 8])
def test_chained_writes_across_several_regions_land_exactly(make_verbs: Any, max_send_wr: int) -> None:
    """One batch of 150 writes across 2 source and 3 sink regions; with max_send_wr=8 it is posted in pieces."""
    src_t, dst_t = make_verbs(max_send_wr=max_send_wr), make_verbs()
    rng = np.random.default_rng(max_send_wr)
    srcs = [rng.integers(0, 256, 64 << 10, dtype=np.uint8) for _ in range(2)]
    dsts = [np.zeros(n, np.uint8) for n in (40 << 10, 64 << 10, 100 << 10)]
    rss = [src_t.register(s) for s in srcs]
    rds = [dst_t.register(d) for d in dsts]
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    expected = [np.zeros_like(d) for d in dsts]
    batch = []
    page = 512
    for i in range(150):
        si, di = i % 2, i % 3
        n = int(rng.integers(1, 3 * page))  # odd sizes, some over the 1024-byte MTU
        slot = i // 3  # every write of a sink region gets its own slot: no overlaps
        d_off = slot * (3 * page)
        if d_off + n > dsts[di].nbytes:
            continue
        s_off = int(rng.integers(0, srcs[si].nbytes - n))
        batch.append((rss[si].addr + s_off, rds[di].addr + d_off, n))
        expected[di][d_off : d_off + n] = srcs[si][s_off : s_off + n]
    assert len(batch) > 100 and (max_send_wr > 100 or len(batch) > 4 * max_send_wr)
    done = Collector(SLOW)
    first = src_t.write(peer, batch, done)
    fence = src_t.write(peer, [], done)  # an empty batch completes after the one before it
    got = done.wait(2)
    assert got == [(first, None), (fence, None)]
    for d, e in zip(dsts, expected):
        assert np.array_equal(d, e)


def test_many_batches_keep_order_and_queue_mode_works(make_verbs: Any) -> None:
    src_t, dst_t = make_verbs(max_send_wr=16, max_inflight=8), make_verbs()
    src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    rs, rd = src_t.register(src), dst_t.register(dst)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    chunk = src.nbytes // 64
    ids: list[int] = []
    got: list[Any] = []
    deadline = Deadline.after(30)
    for i in range(64):
        while True:  # queue-mode batches hold their slot until taken: take some when at the bound
            try:
                ids.append(src_t.write(peer, [(rs.addr + i * chunk, rd.addr + i * chunk, chunk)]))
                break
            except CapacityError:
                got += src_t.completions(deadline=deadline)
                assert not deadline.expired(), "no completion came back"
    while len(got) < 64 and not deadline.expired():
        got += src_t.completions(deadline=deadline)
    assert [c.batch_id for c in got] == ids
    assert all(c.error is None for c in got)
    assert np.array_equal(dst, src)


def test_two_peers_at_once(make_verbs: Any) -> None:
    """One source writes to two sinks at once, from two threads; each sink gets exactly its bytes."""
    src_t = make_verbs()
    sinks = [make_verbs(), make_verbs()]
    size = 512 << 10
    src = np.random.default_rng(3).integers(0, 256, 2 * size, dtype=np.uint8)
    rs = src_t.register(src)
    dsts = [np.zeros(size, np.uint8) for _ in sinks]
    rds = [t.register(d) for t, d in zip(sinks, dsts)]
    peers = [src_t.connect(t.endpoint(), deadline=Deadline.after(10)) for t in sinks]
    done = Collector(SLOW)
    errors: list[BaseException] = []

    def post(k: int) -> None:
        try:
            for i in range(8):
                off = i * (size // 8)
                src_t.write(peers[k], [(rs.addr + k * size + off, rds[k].addr + off, size // 8)], done, deadline=Deadline.after(20))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=post, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    assert all(e is None for _, e in done.wait(16))
    for k in range(2):
        assert np.array_equal(dsts[k], src[k * size : (k + 1) * size])


# ----------------------------------------------------------------------------- error completions


@pytest.mark.parametrize("how", ["bounds", "rkey", "deregistered"])
def test_write_outside_the_peers_regions_fails_its_batch_with_the_wc_status(make_verbs: Any, how: str) -> None:
    """The sink's device refuses the write; that batch fails naming the status, other peers carry on."""
    src_t, bad_sink, good_sink = make_verbs(), make_verbs(), make_verbs()
    src = np.full(64 << 10, 0x5A, np.uint8)
    rs = src_t.register(src)
    bad_dst, good_dst = np.zeros(16 << 10, np.uint8), np.zeros(16 << 10, np.uint8)
    r_bad, r_good = bad_sink.register(bad_dst), good_sink.register(good_dst)
    if how == "bounds":  # the source believes the region is 4x larger than it is
        ep = _with_regions(bad_sink.endpoint(), [Region(r_bad.addr, r_bad.length * 4, r_bad.key)])
        target = r_bad.addr + r_bad.length + 4096
    elif how == "rkey":  # a key the sink never handed out
        ep = _with_regions(bad_sink.endpoint(), [Region(r_bad.addr, r_bad.length, r_bad.key ^ 0x5A5A00)])
        target = r_bad.addr
    else:  # the sink revoked the region after the source learnt it
        ep = bad_sink.endpoint()
        target = r_bad.addr
    bad_peer = src_t.connect(ep, deadline=Deadline.after(10))
    good_peer = src_t.connect(good_sink.endpoint(), deadline=Deadline.after(10))
    if how == "deregistered":
        bad_sink.deregister(r_bad)
    done = Collector(SLOW)
    ok_first = src_t.write(bad_peer, [(rs.addr, r_bad.addr, 1024)], done) if how == "bounds" else None
    bad = src_t.write(bad_peer, [(rs.addr, target, 4096)], done)
    try:  # the error completion may already be in: then this raises at once instead
        after: int | None = src_t.write(bad_peer, [(rs.addr, r_bad.addr, 64)], done)
    except TransportError as e:
        assert "unusable" in str(e)
        after = None
    got = dict(done.wait(1 + (ok_first is not None) + (after is not None)))
    err = got[bad]
    assert isinstance(err, TransportError) and err.op == "write", got
    assert "IBV_WC_REM_ACCESS_ERR" in str(err) and err.errno == errno.EFAULT, str(err)
    if after is not None:
        assert isinstance(got[after], TransportError)  # the QP is in error: later batches fail too
    if ok_first is not None:
        assert got[ok_first] is None and (bad_dst[:1024] == 0x5A).all()
    with pytest.raises(TransportError, match="unusable"):  # fail fast until reconnected
        src_t.write(bad_peer, [(rs.addr, r_bad.addr, 64)], done)
    # the other peer is not disturbed
    more = Collector(SLOW)
    src_t.write(good_peer, [(rs.addr, r_good.addr, good_dst.nbytes)], more)
    assert more.wait(1) == [(more.done[0][0], None)] and (good_dst == 0x5A).all()


def _break_sink_qps(sink: Any) -> int:
    """Move every QP the sink holds for its sources to the error state, keeping its sockets open.

    The source then sees only silence on the wire, as from a crashed host: the RC retries run out and
    the device reports the error completion.
    """
    with sink._lock:
        conns = list(sink._sinks.values())
    for conn in conns:
        sink._qp_to_error(conn.qp)
    return len(conns)


def test_peer_torn_down_mid_batch_gives_an_error_completion_not_a_hang(make_verbs: Any) -> None:
    src_t = make_verbs(peer_timeout=20.0, qp_timeout=14, retry_cnt=3)  # ~0.07 s x 4 tries on the wire
    dst_t = make_verbs()
    size = 4 << 20
    src = np.ones(size, np.uint8)
    dst, rs, rd, peer = _linked(src_t, dst_t, src)
    done = Collector(SLOW)
    ids = [src_t.write(peer, [(rs.addr, rd.addr, size)], done) for _ in range(8)]
    done.wait(1)  # under way
    t0 = time.monotonic()
    assert _break_sink_qps(dst_t) == 1
    got = done.wait(8, seconds=15)
    elapsed = time.monotonic() - t0
    assert [b for b, _ in got] == ids
    failed = [e for _, e in got if e is not None]
    assert failed and all(isinstance(e, TransportError) and e.op == "write" for e in failed)
    assert "IBV_WC_RETRY_EXC_ERR" in str(failed[0]) and failed[0].errno == errno.ETIMEDOUT, str(failed[0])
    assert elapsed < 15
    with pytest.raises(TransportError, match="unusable"):
        src_t.write(peer, [(rs.addr, rd.addr, 1)], done)


def test_reconnect_after_failure_works(make_verbs: Any) -> None:
    src_t, dst_t = make_verbs(), make_verbs()
    src = np.full(8192, 0x11, np.uint8)
    dst = np.zeros(8192, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst)
    stale = _with_regions(dst_t.endpoint(), [Region(rd.addr, rd.length * 2, rd.key)])
    peer = src_t.connect(stale, deadline=Deadline.after(10))
    done = Collector(SLOW)
    src_t.write(peer, [(rs.addr, rd.addr + rd.length, 4096)], done)
    assert isinstance(done.wait(1)[0][1], TransportError)
    with pytest.raises(TransportError, match="unusable"):
        src_t.write(peer, [(rs.addr, rd.addr, 16)], done)
    again = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    src[:] = 0x22
    src_t.write(again, [(rs.addr, rd.addr, rd.length)], done)
    assert done.wait(2)[1][1] is None and (dst == 0x22).all()
    src_t.disconnect(peer)  # the failed handle can still be disconnected (idempotent)
    src_t.disconnect(again)


def test_sink_close_fails_the_source_fast(make_verbs: Any) -> None:
    src_t, dst_t = make_verbs(peer_timeout=30.0), make_verbs()
    size = 4 << 20
    src = np.ones(size, np.uint8)
    dst, rs, rd, peer = _linked(src_t, dst_t, src)
    done = Collector(SLOW)
    for _ in range(16):
        src_t.write(peer, [(rs.addr, rd.addr, size)], done)
    t0 = time.monotonic()
    dst_t.close(deadline=Deadline.after(5))
    got = done.wait(16, seconds=10)
    assert time.monotonic() - t0 < 10  # the liveness socket, not the 30 s peer_timeout
    assert any(e is not None for _, e in got)


def test_close_fails_everything_in_flight_within_its_deadline(make_verbs: Any) -> None:
    src_t, dst_t = make_verbs(max_inflight=32), make_verbs()
    size = 8 << 20
    src = np.ones(size, np.uint8)
    dst, rs, rd, peer = _linked(src_t, dst_t, src)
    done = Collector(SLOW)
    ids = [src_t.write(peer, [(rs.addr, rd.addr, size)], done) for _ in range(32)]
    t0 = time.monotonic()
    src_t.close(deadline=Deadline.after(3))
    assert time.monotonic() - t0 < 3
    got = done.wait(32, seconds=1)
    assert sorted(b for b, _ in got) == ids
    assert any(isinstance(e, TransportError) and e.op == "close" for _, e in got)
    assert src_t.regions() == ()
    src_t.close()  # idempotent
