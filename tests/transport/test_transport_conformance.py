"""The conformance suite: every transport runs it (``transport_name`` is parametrised in conftest).

Real loopback connections and real child processes; no sleeps as
synchronisation (events and deadlines), so the suite stays fast.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import transport
from pdcore.core.deadline import Deadline
from pdcore.core.errors import CapacityError, StartError, TransportError
from transport.base import Completion, PeerHandle, Region, Transport, decode_endpoint

import _transport_children
from _transport_support import Collector, Ledger, MakeTransport

SPAWN = mp.get_context("spawn")


def pair(make: MakeTransport, nbytes: int = 1 << 20, **options: Any) -> tuple[Transport, Transport, np.ndarray, np.ndarray, Region, Region, PeerHandle]:
    """A source and a sink transport with one registered buffer each, connected source → sink."""
    src_t, dst_t = make(**options), make(**options)
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(5))
    return src_t, dst_t, src, dst, rs, rd, peer


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


# ----------------------------------------------------------------------------- bytes land exactly


def test_bytes_land_exactly(make_transport: MakeTransport) -> None:
    src_t, _dst_t, src, dst, rs, rd, peer = pair(make_transport)
    page = 4096
    rng = np.random.default_rng(2)
    sp = rng.permutation(256)[:100]
    dp = rng.permutation(256)[:100]
    batch = [(rs.addr + int(s) * page, rd.addr + int(d) * page, page) for s, d in zip(sp, dp)]
    done = Collector()
    src_t.write(peer, batch, done)
    [(bid, err)] = done.wait(1)
    assert err is None
    expected = np.zeros_like(dst)
    for s, d in zip(sp, dp):
        expected[d * page : (d + 1) * page] = src[s * page : (s + 1) * page]
    assert digest(dst) == digest(expected)


def test_numpy_array_plan_batch_and_odd_sizes(make_transport: MakeTransport) -> None:
    """An (n, 3) uint64 array (the plan's output) is a batch; writes need not be aligned."""
    src_t, _dst_t, src, dst, rs, rd, peer = pair(make_transport)
    batch = np.array([[rs.addr + 1, rd.addr + 3, 1], [rs.addr + 17, rd.addr + 100, 999_999]], np.uint64)
    src_t.write(peer, batch)
    [c] = src_t.completions(deadline=Deadline.after(5))
    assert c.error is None
    assert dst[3] == src[1] and digest(dst[100 : 100 + 999_999]) == digest(src[17 : 17 + 999_999])
    assert not dst[:3].any() and not dst[4:100].any() and not dst[100 + 999_999 :].any()


def test_torch_and_raw_address_registrations(make_transport: MakeTransport) -> None:
    torch = pytest.importorskip("torch")
    src_t, dst_t = make_transport(), make_transport()
    src = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros(4096, dtype=torch.float32)
    rs = src_t.register(src)
    keep = np.zeros(src.nbytes, np.uint8)  # (addr, length): the caller keeps the memory alive
    rd = dst_t.register((int(keep.ctypes.data), int(keep.nbytes)))
    rd2 = dst_t.register(dst)
    assert (rs.length, rd.length, rd2.length) == (src.nbytes, keep.nbytes, dst.nbytes)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(5))
    done = Collector()
    src_t.write(peer, [(rs.addr, rd.addr, rs.length), (rs.addr, rd2.addr, rs.length)], done)
    assert done.wait(1)[0][1] is None
    assert torch.equal(dst, src)
    assert keep.tobytes() == src.numpy().tobytes()


def test_register_rejects_bad_buffers(make_transport: MakeTransport) -> None:
    t = make_transport()
    a = np.zeros((64, 64), np.uint8)
    with pytest.raises(ValueError, match="contiguous"):
        t.register(a[:, ::2])
    r = t.register(a)
    with pytest.raises(ValueError, match="overlaps"):
        t.register(a[10:20])
    with pytest.raises(TypeError, match="cannot register"):
        t.register(object())
    t.deregister(r)
    t.register(a[10:20])  # free again once deregistered


def test_grant_ranges_are_sorted_checked_and_made_plain_ints() -> None:
    """What every transport's ``grant`` stores: ``(addr, length)`` pairs of Python ints sorted by address,
    from pairs, numpy integers or an ``(n, 2)`` array alike; an overlap, an empty or a wrapping range
    is a ``ValueError`` naming it."""
    from transport.regions import grant_ranges

    want = ((0x1000, 16), (0x2000, 8))
    for given in ([(0x2000, 8), (0x1000, 16)], [(np.uint64(0x2000), np.int64(8)), (0x1000, np.int32(16))],
                  np.array([[0x2000, 8], [0x1000, 16]], np.uint64)):
        got = grant_ranges(given)
        assert got == want and all(type(x) is int for pair in got for x in pair), given
    for bad, why in (([(0x1000, 16), (0x100F, 4)], "overlap"), ([(0x1000, 0)], "positive length"),
                     ([(np.uint64(0x1000), np.int64(-1))], "positive length"), ([((1 << 64) - 4, 8)], "positive length"),
                     ([(0, 8)], "non-null address")):
        with pytest.raises(ValueError, match=why):
            grant_ranges(bad)


# ----------------------------------------------------------------------------- many batches, many peers


def test_many_concurrent_batches_from_several_threads(make_transport: MakeTransport) -> None:
    src_t, _dst_t, src, dst, rs, rd, peer = pair(make_transport, nbytes=256 << 10, max_inflight=8)
    page, threads_n, per_thread = 1024, 4, 64  # 256 batches, each to its own page
    done = Collector()
    errors: list[BaseException] = []

    def post(k: int) -> None:
        try:
            for i in range(per_thread):
                p = k * per_thread + i
                src_t.write(peer, [(rs.addr + p * page, rd.addr + p * page, page)], done, deadline=Deadline.after(10))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    ths = [threading.Thread(target=post, args=(k,)) for k in range(threads_n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(20)
    assert not errors
    got = done.wait(threads_n * per_thread)
    assert all(e is None for _, e in got)
    assert len({b for b, _ in got}) == threads_n * per_thread
    assert digest(dst) == digest(src)


def test_completions_in_posting_order_and_empty_batch_is_a_fence(make_transport: MakeTransport) -> None:
    led = Ledger(make_transport, batches=5, bulk=4 << 20)
    done = Collector()
    ids = [led.src_t.write(led.peer, led.batch(i), done, deadline=Deadline.after(5)) for i in range(5)]
    fence = led.src_t.write(led.peer, [], done, deadline=Deadline.after(5))
    got = done.wait(6)
    assert [b for b, _ in got] == ids + [fence]
    assert got[-1][1] is None
    assert led.check(got[:-1], ids) == ([0, 1, 2, 3, 4], [])


def test_several_sources_and_sinks_at_once(make_transport: MakeTransport) -> None:
    sinks = [make_transport() for _ in range(2)]
    sources = [make_transport() for _ in range(2)]
    size = 256 << 10
    dsts = [np.zeros(size * 2, np.uint8) for _ in sinks]
    rds = [t.register(d) for t, d in zip(sinks, dsts)]
    srcs = [np.full(size, 10 + i, np.uint8) for i in range(2)]
    rss = [t.register(s) for t, s in zip(sources, srcs)]
    done = Collector()
    for i, s_t in enumerate(sources):
        for j, d_t in enumerate(sinks):
            peer = s_t.connect(d_t.endpoint(), deadline=Deadline.after(5))
            s_t.write(peer, [(rss[i].addr, rds[j].addr + i * size, size)], done)
    assert all(e is None for _, e in done.wait(4))
    for d in dsts:
        assert (d[:size] == 10).all() and (d[size:] == 11).all()


# ----------------------------------------------------------------------------- validation


def test_source_rejects_ranges_outside_regions_synchronously(make_transport: MakeTransport) -> None:
    src_t, _dst_t, _src, dst, rs, rd, peer = pair(make_transport, nbytes=4096)
    done = Collector()
    with pytest.raises(TransportError) as e1:  # a local range outside the local region
        src_t.write(peer, [(rs.addr + 4000, rd.addr, 200)], done)
    with pytest.raises(TransportError) as e2:  # a remote range outside the announced region
        src_t.write(peer, [(rs.addr, rd.addr + 4000, 200)], done)
    with pytest.raises(TransportError):  # an empty write
        src_t.write(peer, [(rs.addr, rd.addr, 0)], done)
    assert e1.value.op == e2.value.op == "write"
    assert not done.done and not dst.any()


def test_region_edges_are_exact_at_the_source(make_transport: MakeTransport) -> None:
    """A write that ends exactly at a region's end is inside it; one byte more (or one before its
    start, or across into the next region) is not, on either side: ``write`` raises before it
    posts anything, whether the range is a batch's first write or follows a valid one."""
    n = 4096
    src_t, dst_t = make_transport(), make_transport()
    src = np.random.default_rng(3).integers(1, 256, n, dtype=np.uint8)
    two = np.zeros(2 * n + 64, np.uint8)  # the sink: two adjacent regions, then 64 bytes nobody registered
    rs = src_t.register(src)
    rd, rd2 = dst_t.register(two[:n]), dst_t.register(two[n : 2 * n])
    assert rd.end == rd2.addr
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(5))
    done = Collector()
    refused = {
        "local, one byte past the end": (rs.addr + n - 7, rd.addr, 8),
        "local, starting at the end": (rs.addr + n, rd.addr, 1),
        "local, one byte before the start": (rs.addr - 1, rd.addr, 8),
        "local, the whole region and one byte": (rs.addr, rd.addr, n + 1),
        "remote, one byte past the last region's end": (rs.addr, rd2.addr + n - 7, 8),
        "remote, starting at the last region's end": (rs.addr, rd2.end, 1),
        "remote, one byte before the first region": (rs.addr, rd.addr - 1, 8),
        "remote, across two adjacent regions": (rs.addr, rd.end - 4, 8),
        "remote, the whole region and one byte": (rs.addr, rd.addr, n + 1),
    }
    for what, write in refused.items():
        for batch in ([write], [(rs.addr, rd.addr, 8), write]):  # alone, and after a valid write
            with pytest.raises(TransportError) as e:
                src_t.write(peer, batch, done)
            assert e.value.op == "write", what
            assert "not inside" in str(e.value), (what, str(e.value))
    assert not done.done and not two.any(), "a refused write posted something"
    # exactly at the edges: the last bytes of each region, and a whole region, land
    ok = [
        src_t.write(peer, [(rs.addr + n - 8, rd.addr + n - 8, 8)], done),
        src_t.write(peer, [(rs.addr, rd2.addr, n)], done),
        src_t.write(peer, [(rs.addr + n - 1, rd.addr, 1), (rs.addr, rd2.addr + n - 1, 1)], done),
    ]
    got = done.wait(3)
    assert [b for b, _ in got] == ok and all(e is None for _, e in got), got
    expected = np.zeros_like(two)
    expected[n - 8 : n] = src[n - 8 :]
    expected[n : 2 * n] = src
    expected[0] = src[n - 1]
    expected[2 * n - 1] = src[0]
    assert np.array_equal(two, expected)


@pytest.mark.transports("tcp")  # verbs: deregistering invalidates the rkey, tests/rdma checks that instead
def test_region_edges_are_exact_at_the_sink(make_transport: MakeTransport) -> None:
    """The source's endpoint is stale: the sink re-registered the same address one byte shorter.
    A write that fits the old region but ends one byte past the new end passes the source's check;
    the sink must refuse it with an error completion and land nothing, and the connection stays in
    sync: a write ending exactly at the new end, posted right after it, lands."""
    n = 4096
    src_t, dst_t = make_transport(), make_transport()
    src = np.random.default_rng(4).integers(1, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    rs = src_t.register(src)
    old = dst_t.register(dst)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(5))
    dst_t.deregister(old)
    new = dst_t.register(dst[: n - 1])
    assert new.addr == old.addr and new.end == old.end - 1
    done = Collector()
    past = src_t.write(peer, [(rs.addr + n - 8, new.addr + n - 8, 8)], done)  # one byte past the new end
    mixed = src_t.write(peer, [(rs.addr, new.addr, 8), (rs.addr + n - 2, new.addr + n - 2, 2)], done)
    edge = src_t.write(peer, [(rs.addr + n - 9, new.addr + n - 9, 8)], done)  # ends exactly at the new end
    after = src_t.write(peer, [(rs.addr, new.addr + 100, 16)], done)
    got = dict(done.wait(4))
    for refused in (past, mixed):
        err = got[refused]
        assert isinstance(err, TransportError) and err.op == "write" and "outside every region" in str(err), err
    assert got[edge] is None and got[after] is None, got
    expected = np.zeros_like(dst)
    expected[n - 9 : n - 1] = src[n - 9 : n - 1]
    expected[100:116] = src[:16]
    assert np.array_equal(dst, expected), "a refused write landed, or the stream lost its place"


@pytest.mark.transports("tcp")  # verbs: tests/rdma/test_verbs.py checks the work-completion status instead
def test_sink_refuses_writes_outside_its_regions_and_touches_nothing(make_transport: MakeTransport) -> None:
    """The source's view of the sink is stale (the sink deregistered a region): the sink must refuse."""
    src_t, dst_t = make_transport(), make_transport()
    src = np.full(8192, 0xAB, np.uint8)
    kept, dropped = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    rs = src_t.register(src)
    r_kept, r_dropped = dst_t.register(kept), dst_t.register(dropped)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(5))
    dst_t.deregister(r_dropped)
    done = Collector()
    # one valid write then one refused: the whole batch fails and no byte of it lands
    bad = src_t.write(peer, [(rs.addr, r_kept.addr, 4096), (rs.addr, r_dropped.addr, 4096)], done)
    good = src_t.write(peer, [(rs.addr, r_kept.addr, 100)], done)  # the connection survives
    got = dict(done.wait(2))
    err = got[bad]
    assert isinstance(err, TransportError) and err.op == "write"
    # (the TCP wording and errno are checked in test_transport_tcp.py)
    assert got[good] is None
    assert (kept[:100] == 0xAB).all() and not kept[100:].any() and not dropped.any()


def test_back_pressure_bounds_batches_in_flight(make_transport: MakeTransport) -> None:
    src_t, _dst_t, _src, _dst, rs, rd, peer = pair(make_transport, nbytes=4096, max_inflight=2)
    # queue-mode completions hold their slot until taken, so this is deterministic
    src_t.write(peer, [(rs.addr, rd.addr, 64)])
    src_t.write(peer, [(rs.addr, rd.addr, 64)])
    with pytest.raises(CapacityError):
        src_t.write(peer, [(rs.addr, rd.addr, 64)])
    t0 = time.monotonic()
    with pytest.raises(CapacityError):
        src_t.write(peer, [(rs.addr, rd.addr, 64)], deadline=Deadline.after(0.2))
    assert 0.15 <= time.monotonic() - t0 < 3
    got: list[Completion] = []
    while len(got) < 2:
        got += src_t.completions(deadline=Deadline.after(5))
    assert [c.error for c in got] == [None, None]
    src_t.write(peer, [(rs.addr, rd.addr, 64)])  # slots free again


def test_bad_endpoints_are_clear_errors(make_transport: MakeTransport, transport_name: str) -> None:
    t, other = make_transport(), make_transport()
    with pytest.raises(TransportError, match="malformed") as e:
        t.connect(b"garbage", deadline=Deadline.after(1))
    assert e.value.op == "endpoint"
    ep = decode_endpoint(other.endpoint(), expect=transport_name)
    assert ep.transport == transport_name
    truncated = other.endpoint()[:-1] if ep.regions else other.endpoint() + b"x"
    with pytest.raises(TransportError, match="malformed"):
        t.connect(truncated, deadline=Deadline.after(1))


def test_unknown_transport_lists_the_known_ones() -> None:
    with pytest.raises(StartError, match="known transports: .*tcp"):
        transport.create("carrier-pigeon")


def test_verbs_is_imported_only_when_chosen() -> None:
    code = "import sys, transport, transport.tcp, transport.plan; assert 'transport.verbs' not in sys.modules and 'pyverbs' not in sys.modules"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=60)


# ----------------------------------------------------------------------------- peers that die, close()


def _spawn_sink(name: str, nbytes: int, options: dict[str, Any]) -> tuple[Any, Any, bytes]:
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_transport_children.run_sink, args=(child, name, options, nbytes), daemon=True)
    proc.start()
    if not parent.poll(30):
        proc.kill()
        pytest.fail("the sink child did not start within 30 s")
    return proc, parent, parent.recv()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", pytest.param("frozen", marks=pytest.mark.transports("tcp"))])
def test_peer_that_disappears_mid_transfer_fails_in_flight_batches(
    make_transport: MakeTransport, transport_name: str, transport_options: dict[str, Any], how: str
) -> None:
    """A real child process is the sink; it is SIGKILLed (or SIGSTOPped, a hung peer) mid-transfer."""
    peer_timeout = 1.0
    # 512 MiB in flight: the transfer outlasts the gap between the first completion and the
    # SIGSTOP even when this process is descheduled in it (128 MiB could all land first on loopback)
    size, batches = 16 << 20, 32
    opts = {**transport_options, "peer_timeout": peer_timeout}
    proc, pipe, ep = _spawn_sink(transport_name, size, opts)
    try:
        src_t = make_transport(peer_timeout=peer_timeout, max_inflight=batches)
        src = np.ones(size, np.uint8)
        rs = src_t.register(src)
        peer = src_t.connect(ep, deadline=Deadline.after(5))
        remote = peer.remote.regions[0]
        done = Collector()
        ids = [src_t.write(peer, [(rs.addr, remote.addr, size)], done) for _ in range(batches)]
        done.wait(1)  # the transfer is under way
        os.kill(proc.pid, signal.SIGSTOP)  # freeze it mid-transfer: the rest cannot complete now
        t0 = time.monotonic()
        if how == "killed":
            os.kill(proc.pid, signal.SIGKILL)
        got = done.wait(batches, seconds=peer_timeout + 5)
        elapsed = time.monotonic() - t0
        assert [b for b, _ in got] == ids  # each batch exactly once, in order
        failed = [e for _, e in got if e is not None]
        assert failed, "no batch failed although the peer vanished mid-transfer"
        assert all(isinstance(e, TransportError) and e.op == "write" for e in failed)
        assert elapsed < peer_timeout + 3
        with pytest.raises(TransportError):  # the peer is dead: later writes fail at once
            src_t.write(peer, [(rs.addr, remote.addr, 1)], done)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        pipe.close()


@pytest.mark.slow
def test_sink_survives_a_source_killed_mid_batch(
    make_transport: MakeTransport, transport_name: str, transport_options: dict[str, Any]
) -> None:
    sink = make_transport()
    dst = np.zeros(8 << 20, np.uint8)
    rd = sink.register(dst)
    parent, child = SPAWN.Pipe()
    opts = {**transport_options, "peer_timeout": 5.0, "max_inflight": 64}
    proc = SPAWN.Process(
        target=_transport_children.run_source, args=(child, transport_name, opts, sink.endpoint(), 8 << 20, 64), daemon=True
    )
    proc.start()
    try:
        assert parent.poll(30), "source child did not post in time"
        proc.kill()
        proc.join(10)
        # the sink still serves another source, into the same region
        src_t = make_transport()
        src = np.full(4096, 3, np.uint8)
        rs = src_t.register(src)
        peer = src_t.connect(sink.endpoint(), deadline=Deadline.after(5))
        done = Collector()
        src_t.write(peer, [(rs.addr, rd.addr, 4096)], done)
        assert done.wait(1)[0][1] is None and (dst[:4096] == 3).all()
        sink.deregister(rd, deadline=Deadline.after(5))  # nothing is stuck landing into it
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        parent.close()


def test_close_with_batches_in_flight_returns_in_time_and_fails_them(make_transport: MakeTransport) -> None:
    """256 MB posted, then ``close``: it returns in time and every batch completes once, in order; some fail.
    A thread descheduled between its writes and its ``close`` (a loaded machine) may see all 256 MB land
    first, so the run is tried up to three times: a ``close`` that never fails a batch fails every try."""
    for _ in range(3):
        led = Ledger(make_transport, batches=32, bulk=8 << 20, max_inflight=32)
        src_t, dst_t, peer = led.src_t, led.dst_t, led.peer
        done = Collector()
        ids = [src_t.write(peer, led.batch(i), done) for i in range(32)]
        t0 = time.monotonic()
        src_t.close(deadline=Deadline.after(3))
        assert time.monotonic() - t0 < 3
        got = done.wait(32, seconds=1)  # every batch completed exactly once by the time close returned
        assert [b for b, _ in got] == ids  # in posting order, failures included
        ok, failed = led.check(got, ids)
        src_t.close()  # idempotent
        with pytest.raises(TransportError):
            src_t.register(np.zeros(16, np.uint8))
        assert src_t.regions() == ()
        dst_t.close(deadline=Deadline.after(3))
        assert dst_t.regions() == ()
        if failed:
            break
    assert failed, "close() with 256 MB in flight failed no batch, three times"
    # make_transport's teardown asserts that no thread outlived close()


def test_sink_close_with_incoming_batches_in_flight(make_transport: MakeTransport) -> None:
    led = Ledger(make_transport, batches=32, bulk=8 << 20, max_inflight=32)
    done = Collector()
    ids = [led.src_t.write(led.peer, led.batch(i), done) for i in range(32)]
    t0 = time.monotonic()
    led.dst_t.close(deadline=Deadline.after(3))
    assert time.monotonic() - t0 < 3
    got = done.wait(32, seconds=8)
    assert [b for b, _ in got] == ids
    led.check(got, ids)  # (the sink's buffer is still ours to read: close() only deregistered it)


def test_disconnect_fails_in_flight_and_later_writes(make_transport: MakeTransport) -> None:
    led = Ledger(make_transport, batches=16, bulk=8 << 20, max_inflight=16)
    src_t, rs, rd, peer = led.src_t, led.rs, led.rd, led.peer
    done = Collector()
    ids = [src_t.write(peer, led.batch(i), done) for i in range(16)]
    src_t.disconnect(peer, deadline=Deadline.after(3))
    got = done.wait(16, seconds=1)
    assert [b for b, _ in got] == ids
    led.check(got, ids)
    src_t.disconnect(peer)  # idempotent
    with pytest.raises(TransportError):
        src_t.write(peer, [(rs.addr, rd.addr, 1)], done)


def test_callbacks_may_post_and_a_raising_callback_is_reported(make_transport: MakeTransport, monkeypatch: pytest.MonkeyPatch) -> None:
    src_t, _dst_t, src, dst, rs, rd, peer = pair(make_transport, nbytes=64 << 10, max_inflight=2)
    page, n = 1024, 64
    done = threading.Event()
    hooked: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: hooked.append(args.exc_value))

    def chain(k: int) -> Any:
        def on_done(_bid: int, err: TransportError | None) -> None:
            assert err is None
            if k + 1 < n:
                src_t.write(peer, [(rs.addr + (k + 1) * page, rd.addr + (k + 1) * page, page)], chain(k + 1))
            else:
                done.set()
            if k == 3:
                raise RuntimeError("a buggy callback")

        return on_done

    src_t.write(peer, [(rs.addr, rd.addr, page)], chain(0))
    assert done.wait(10)
    assert digest(dst) == digest(src)
    assert len(hooked) == 1 and isinstance(hooked[0], RuntimeError)


# ----------------------------------------------------------------------------- grants: the sink's authority


def granted_pair(make: MakeTransport, nbytes: int = 1 << 20) -> tuple[Transport, Transport, np.ndarray, np.ndarray, Region, Region, PeerHandle]:
    """Like ``pair``, but the sink's buffer takes writes only through grants."""
    src_t, dst_t = make(), make()
    src = np.random.default_rng(1).integers(1, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst, require_grant=True)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(5))
    return src_t, dst_t, src, dst, rs, rd, peer


def test_writes_through_a_live_grant_land(make_transport: MakeTransport) -> None:
    src_t, dst_t, src, dst, rs, rd, peer = granted_pair(make_transport)
    g = dst_t.grant(src_t.instance, [(rd.addr + 4096, 8192)])
    assert g.key and g.source == src_t.instance and g.ranges == ((rd.addr + 4096, 8192),)
    done = Collector()
    src_t.write(peer, [(rs.addr, rd.addr + 4096, 8192)], done, grant=g.key)
    assert done.wait(1)[0][1] is None
    assert digest(dst[4096:12288]) == digest(src[:8192]) and not dst[:4096].any() and not dst[12288:].any()
    dst_t.revoke(g, deadline=Deadline.after(5))
    dst_t.revoke(g, deadline=Deadline.after(5))  # idempotent


def test_a_write_outside_its_grant_fails_its_batch_and_lands_nothing(make_transport: MakeTransport) -> None:
    src_t, dst_t, _src, dst, rs, rd, peer = granted_pair(make_transport)
    g = dst_t.grant(src_t.instance, [(rd.addr, 4096)])
    done = Collector()
    src_t.write(peer, [(rs.addr, rd.addr, 4096), (rs.addr, rd.addr + 4096, 1)], done, grant=g.key)  # 1 byte out
    src_t.write(peer, [(rs.addr, rd.addr, 16)], done)  # no grant named at all
    (_, e1), (_, e2) = done.wait(2)
    assert isinstance(e1, TransportError) and "outside grant" in str(e1)
    assert isinstance(e2, TransportError) and "requires one" in str(e2)
    assert not dst.any()


def test_nothing_lands_through_a_grant_after_revoke_returns(make_transport: MakeTransport, transport_name: str) -> None:
    """A source streams through the grant while the sink revokes it: each write landed entirely
    before ``revoke`` returned or not at all (tcp), and no byte lands after it returned."""
    src_t, dst_t, src, dst, rs, rd, peer = granted_pair(make_transport, nbytes=4 << 20)
    slot = 64 << 10
    g = dst_t.grant(src_t.instance, [(rd.addr, dst.nbytes)])
    done = Collector(seconds=20)
    posted = 0
    stop = threading.Event()
    refused = threading.Event()  # a write refused at once counts as a failed batch

    def stream() -> None:
        nonlocal posted
        i = 0
        while not stop.is_set():
            off = (i % 64) * slot
            try:
                src_t.write(peer, [(rs.addr + off, rd.addr + off, slot)], done, deadline=Deadline.after(10), grant=g.key)
            except TransportError:
                refused.set()  # the sink cut this source off (verbs)
                return
            posted += 1
            i += 1

    writer = threading.Thread(target=stream, daemon=True)
    writer.start()
    done.wait(16)  # the stream is under way
    dst_t.revoke(g, deadline=Deadline.after(1.0))
    snapshot = dst.copy()
    done.wait(min(posted, 40))  # more batches reach the sink (or fail) after the revoke
    failed = Deadline.after(20)  # on a loaded machine every batch posted so far may have landed before the revoke
    def any_failed() -> bool:
        return refused.is_set() or any(e is not None for _, e in list(done.done))

    while not any_failed() and not failed.expired():
        threading.Event().wait(0.01)
    stop.set()
    writer.join(15)
    assert not writer.is_alive()
    assert digest(dst) == digest(snapshot), "bytes landed through a revoked grant"
    assert any_failed(), "no batch failed after the revoke"
    if transport_name == "tcp":
        for i in range(64):
            part = dst[i * slot : (i + 1) * slot]
            assert not part.any() or digest(part) == digest(src[i * slot : (i + 1) * slot]), f"write {i} landed in part"


@pytest.mark.slow
def test_revoke_of_a_paused_source_returns_within_its_deadline(
    make_transport: MakeTransport, transport_name: str, transport_options: dict[str, Any]
) -> None:
    """A child process streams through a grant and is SIGSTOPped mid-stream; revoke returns within
    its deadline (plus the cut), and once the source is continued nothing more lands."""
    sink = make_transport()
    nbytes = 4 << 20
    dst = np.zeros(nbytes, np.uint8)
    rd = sink.register(dst, require_grant=True)
    parent, child = SPAWN.Pipe()
    opts = {**transport_options, "peer_timeout": 30.0}
    proc = SPAWN.Process(
        target=_transport_children.run_grant_source, args=(child, transport_name, opts, sink.endpoint(), nbytes), daemon=True
    )
    proc.start()
    try:
        assert parent.poll(30), "the source child did not connect in time"
        g = sink.grant(parent.recv(), [(rd.addr, nbytes)])
        parent.send((g.key, rd.addr))
        assert parent.poll(30) and parent.recv() == "streaming"
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        sink.revoke(g, deadline=Deadline.after(1.0))
        assert time.monotonic() - t0 < 1.0 + 3.0
        snapshot = dst.copy()
        os.kill(proc.pid, signal.SIGCONT)
        parent.send("stop")
        proc.join(15)
        assert digest(dst) == digest(snapshot), "bytes landed after revoke returned"
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.join(10)
        parent.close()
