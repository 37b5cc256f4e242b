"""``staged:<inner>``: device memory staged through pinned host mirrors (``transport/staging.py``).

The real TCP transport on loopback underneath, and the stand-in copier: CPU tensors play device
memory, and every gather and scatter completes late and out of submission order (seeded), so the
ordering the wrapper promises is exercised, not assumed. ``hold()`` keeps copies pending
deterministically where a test needs one pending. The CUDA tests run only where a GPU exists.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import transport
from transport.deadline import Deadline
from transport.device_copy import INDEX_MIN_SPANS, StandInCopier, buffer_path, plan_spans
from transport.errors import CapacityError, TransportError
from transport.staging import StagedTransport

from _transport_support import Collector, MakeTransport, transport_maker

PAGE = 4096


@pytest.fixture
def make_staged() -> Iterator[MakeTransport]:
    """``staged:tcp`` transports with the stand-in copier; closed after the test, no thread may outlive them."""
    yield from transport_maker("staged:tcp", {"device": "standin", "peer_timeout": 5.0, "max_delay": 0.003})


def _copier(t: Any) -> StandInCopier:
    copier = t.copier()
    assert isinstance(copier, StandInCopier)
    return copier


class Lands:
    """Counts ``land`` completions; ``wait(n)`` until n arrived."""

    def __init__(self) -> None:
        self.errors: list[str | None] = []
        self._cond = threading.Condition()

    def __call__(self, error: str | None) -> None:
        with self._cond:
            self.errors.append(error)
            self._cond.notify_all()

    def wait(self, n: int, seconds: float = 10.0) -> list[str | None]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.errors) >= n, timeout=seconds), f"{len(self.errors)} of {n} lands"
            return list(self.errors)


class Link:
    """A source tensor of random pages and a sink tensor of zeroed pages, both stand-in device memory
    registered through staged transports (the sink's behind a grant), the source connected."""

    def __init__(self, make: MakeTransport, pages: int = 64, seed: int = 1, device: str = "cpu", **options: Any) -> None:
        self.pages = pages
        self.src_t, self.dst_t = make(seed=seed, **options), make(seed=seed + 100, **options)
        rng = np.random.default_rng(seed)
        self.src = torch.from_numpy(rng.integers(0, 256, pages * PAGE, dtype=np.uint8)).to(device)
        self.dst = torch.zeros(pages * PAGE, dtype=torch.uint8, device=device)
        self.rs = self.src_t.register(self.src)
        self.rd = self.dst_t.register(self.dst, require_grant=True)
        self.grant = self.dst_t.grant(self.src_t.instance, [(self.rd.addr, self.rd.length)])
        self.peer = self.src_t.connect(self.dst_t.endpoint(), deadline=Deadline.after(10))
        self.perm = rng.permutation(pages)  # source page p goes to sink page perm[p]: each sink page has one value

    def batch(self, pages: Any) -> list[tuple[int, int, int]]:
        return [(self.rs.addr + int(p) * PAGE, self.rd.addr + int(self.perm[p]) * PAGE, PAGE) for p in pages]

    def remote(self, batch: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        return [(r, n) for _, r, n in batch]

    def expected(self, written: set[int]) -> torch.Tensor:
        want = torch.zeros_like(self.dst).cpu()
        src = self.src.cpu()
        for p in written:
            d = int(self.perm[p])
            want[d * PAGE : (d + 1) * PAGE] = src[p * PAGE : (p + 1) * PAGE]
        return want


def _random_batches(link: Link, n: int, seed: int) -> list[list[int]]:
    """Page lists: mostly a few scattered pages (one copy each after coalescing), every fifth one
    many pages of one length (moved as rows: one index_select on a GPU)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = INDEX_MIN_SPANS + 4 if i % 5 == 0 else int(rng.integers(1, 6))
        out.append(sorted(rng.choice(link.pages, size=k, replace=False).tolist()))
    return out


# ----------------------------------------------------------------------------- byte-exact, in order


@pytest.mark.parametrize("mode", ["callback", "queue"])
def test_device_to_device_bytes_exact_and_completions_in_posting_order(make_staged: MakeTransport, mode: str) -> None:
    link = Link(make_staged, seed=3)
    batches = _random_batches(link, 120, seed=4)
    done = Collector()
    ids = []
    for pages in batches:  # more than max_inflight (64): writers wait for slots
        if mode == "callback":
            ids.append(link.src_t.write(link.peer, link.batch(pages), done, grant=link.grant.key, deadline=Deadline.after(20)))
            continue
        while True:  # queue mode: a slot frees when its completion is taken
            try:
                ids.append(link.src_t.write(link.peer, link.batch(pages), grant=link.grant.key))
                break
            except CapacityError:
                done.done.extend(link.src_t.completions(deadline=Deadline.after(10)))
    if mode == "queue":
        deadline = Deadline.after(20)
        while len(done.done) < len(ids) and not deadline.expired():
            done.done.extend(link.src_t.completions(deadline=deadline))
    got = done.wait(len(ids))
    assert [b for b, _ in got] == ids, "completions to one peer come in posting order"
    assert all(err is None for _, err in got), [err for _, err in got if err]
    assert _copier(link.src_t).reordered > 0, "the stand-in completed no gather out of order: the test proves nothing"

    lands = Lands()
    for pages in batches:  # all pending at once, completing out of order
        assert link.dst_t.land(link.remote(link.batch(pages)), lands) is False
    assert lands.wait(len(batches)) == [None] * len(batches)
    assert torch.equal(link.dst, link.expected({p for pages in batches for p in pages})), "device bytes differ"

    src_stats = link.src_t.stats  # type: ignore[attr-defined]
    assert src_stats["gathers"] == len(batches) and src_stats["bytes_gathered"] == PAGE * sum(map(len, batches))
    assert link.dst_t.stats["scatters"] == len(batches)  # type: ignore[attr-defined]
    assert link.dst_t.device_path == "staging" and link.dst_t.device_path_reason  # type: ignore[attr-defined]


def test_mirror_bytes_are_not_device_bytes_until_landed(make_staged: MakeTransport) -> None:
    """What the network delivers is in the sink's mirror; the device pages change only through land."""
    link = Link(make_staged, seed=5)
    done = Collector()
    batch = link.batch(range(8))
    link.src_t.write(link.peer, batch, done, grant=link.grant.key)
    assert done.wait(1)[0][1] is None
    assert not link.dst.any(), "bytes reached device memory without land()"
    lands = Lands()
    link.dst_t.land(link.remote(batch), lands)
    assert lands.wait(1) == [None]
    assert torch.equal(link.dst, link.expected(set(range(8))))


# ----------------------------------------------------------------------------- host memory bypasses staging


def test_host_batches_bypass_staging_and_still_wait_their_turn(make_staged: MakeTransport) -> None:
    src_t = make_staged(stand_in=lambda b: isinstance(b, torch.Tensor))
    dst_t = make_staged(stand_in=lambda b: isinstance(b, torch.Tensor))
    host_src = np.random.default_rng(6).integers(0, 256, 16 * PAGE, dtype=np.uint8)
    host_dst = np.zeros_like(host_src)
    dev_src = torch.arange(4 * PAGE, dtype=torch.uint8)
    dev_dst = torch.zeros(4 * PAGE, dtype=torch.uint8)
    rhs, rhd = src_t.register(host_src), dst_t.register(host_dst)
    rds, rdd = src_t.register(dev_src), dst_t.register(dev_dst)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    assert src_t.paths()[rhs] == ("host", "") and src_t.paths()[rds][0] == "staging"  # type: ignore[attr-defined]

    done = Collector()
    ids = [src_t.write(peer, [(rhs.addr + i * PAGE, rhd.addr + i * PAGE, PAGE)], done) for i in range(16)]
    assert [b for b, _ in done.wait(16)] == ids and all(e is None for _, e in done.done)
    assert np.array_equal(host_src, host_dst)
    lands = Lands()
    assert dst_t.land([(rhd.addr, rhd.length)], lands) is True and lands.errors == [None]  # nothing to copy
    stats = {**src_t.stats, **{f"dst_{k}": v for k, v in dst_t.stats.items()}}  # type: ignore[attr-defined]
    assert not any(stats.values()), f"host batches were staged: {stats}"

    # Behind a batch still gathering, a host batch and an empty one (a fence) wait their turn.
    done = Collector()
    with _copier(src_t).hold():
        first = src_t.write(peer, [(rds.addr, rdd.addr, rds.length)], done)
        host = src_t.write(peer, [(rhs.addr, rhd.addr, PAGE)], done)
        fence = src_t.write(peer, [], done)
    assert [b for b, _ in done.wait(3)] == [first, host, fence]
    assert src_t.stats["gathers"] == 1  # type: ignore[attr-defined]


def test_overlapping_writes_land_in_posting_order(make_staged: MakeTransport) -> None:
    """Batches reach the inner transport in posting order, whatever order their gathers finish in and
    whether they need one: several batches writing the same sink page leave the last one's bytes."""
    src_t = make_staged(seed=21, stand_in=lambda b: isinstance(b, torch.Tensor))
    dst_t = make_staged(seed=22)
    rng = np.random.default_rng(23)
    dev_src = torch.from_numpy(rng.integers(0, 256, 64 * PAGE, dtype=np.uint8))
    host_src = rng.integers(0, 256, 64 * PAGE, dtype=np.uint8)
    dst = torch.zeros(16 * PAGE, dtype=torch.uint8)
    rdev, rhost, rd = src_t.register(dev_src), src_t.register(host_src), dst_t.register(dst)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    done = Collector()
    last: dict[int, bytes] = {}
    n = 0
    for _round in range(6):
        for target in rng.permutation(16).tolist():
            page = int(rng.integers(0, 64))
            on_device = bool(rng.integers(0, 2))
            base, mem = (rdev.addr, dev_src.numpy()) if on_device else (rhost.addr, host_src)
            src_t.write(peer, [(base + page * PAGE, rd.addr + target * PAGE, PAGE)], done, deadline=Deadline.after(20))
            last[target] = mem[page * PAGE : (page + 1) * PAGE].tobytes()
            n += 1
    done.wait(n)
    # A host batch behind a held device batch to the same page: the device batch lands first.
    with _copier(src_t).hold():
        src_t.write(peer, [(rdev.addr, rd.addr, PAGE)], done)
        src_t.write(peer, [(rhost.addr + PAGE, rd.addr, PAGE)], done)
        last[0] = host_src[PAGE : 2 * PAGE].tobytes()
        n += 2
    assert all(err is None for _, err in done.wait(n))
    lands = Lands()
    dst_t.land([(rd.addr, rd.length)], lands)
    assert lands.wait(1) == [None]
    got = {t: dst[t * PAGE : (t + 1) * PAGE].numpy().tobytes() for t in range(16)}
    assert [t for t in range(16) if got[t] != last[t]] == [], "a batch landed after one posted later"


# ----------------------------------------------------------------------------- the fence


def test_revoke_waits_for_a_pending_scatter_and_nothing_lands_after_it(make_staged: MakeTransport) -> None:
    link = Link(make_staged, pages=16, seed=7)
    batch = link.batch(range(16))
    done = Collector()
    link.src_t.write(link.peer, batch, done, grant=link.grant.key)
    assert done.wait(1)[0][1] is None
    lands = Lands()
    copier = _copier(link.dst_t)
    returned_after: list[list[str | None]] = []
    with copier.hold():
        assert link.dst_t.land(link.remote(batch), lands) is False
        with pytest.raises(TransportError) as info:
            link.dst_t.revoke(link.grant, deadline=Deadline.after(0.2))
        assert info.value.op == "revoke"
        assert not lands.errors and not link.dst.any(), "the held scatter ran"

        def revoke() -> None:
            link.dst_t.revoke(link.grant, deadline=Deadline.after(20))
            returned_after.append(list(lands.errors))

        t = threading.Thread(target=revoke)
        t.start()
        # While the revoke waits, a land overlapping the grant is refused (its room is failing).
        refused = Lands()

        def refused_now() -> bool:
            return link.dst_t.land(link.remote(batch[:1]), refused) is True

        from _transport_support import wait_until

        wait_until(refused_now, 10, "a land during the revoke refused")
        assert refused.errors[-1] and "revoked" in str(refused.errors[-1])
        assert t.is_alive(), "revoke returned with a scatter into its pages still pending"
    t.join(20)
    assert not t.is_alive()
    assert returned_after and returned_after[0] and all(e is None for e in returned_after[0]), (
        "revoke returned before the pending scatters finished")
    assert torch.equal(link.dst, link.expected(set(range(16))))

    # After revoke: the network cannot write through the grant, so the mirror and the device keep their bytes.
    before = link.dst.clone()
    mirror_before = link.dst_t.mirror_of(link.rd).tobytes()  # type: ignore[attr-defined]
    done = Collector()
    link.src_t.write(link.peer, link.batch(range(16)), done, grant=link.grant.key)
    assert isinstance(done.wait(1)[0][1], TransportError)
    assert bytes(link.dst_t.inner._locals[link.rd.key].view) == mirror_before  # type: ignore[attr-defined]
    assert torch.equal(link.dst, before)


# ----------------------------------------------------------------------------- failures and back-pressure


def test_a_failed_gather_fails_exactly_its_batch(make_staged: MakeTransport) -> None:
    link = Link(make_staged, seed=8)
    batches = _random_batches(link, 30, seed=9)
    done = Collector()
    ids = []
    for i, pages in enumerate(batches):
        if i == 11:
            _copier(link.src_t).fail_next("gather")
        ids.append(link.src_t.write(link.peer, link.batch(pages), done, grant=link.grant.key))
    got = done.wait(len(ids))
    assert [b for b, _ in got] == ids
    failed = [i for i, (_, err) in enumerate(got) if err is not None]
    assert failed == [11], failed
    assert isinstance(got[11][1], TransportError) and "gather" in str(got[11][1])
    assert link.src_t.stats["copy_errors"] == 1  # type: ignore[attr-defined]
    lands = Lands()
    ok_pages = {p for i, pages in enumerate(batches) if i != 11 for p in pages}
    link.dst_t.land([(link.rd.addr + int(link.perm[p]) * PAGE, PAGE) for p in sorted(ok_pages)], lands)
    assert lands.wait(1) == [None]
    want = link.expected(ok_pages)
    for p in set(batches[11]) - ok_pages:  # the failed batch's own pages: nothing, or (never here) its bytes
        d = int(link.perm[p])
        assert not link.dst[d * PAGE : (d + 1) * PAGE].any()
    assert torch.equal(link.dst, want)


def test_capacity_error_at_the_in_flight_bound(make_staged: MakeTransport) -> None:
    link = Link(make_staged, pages=8, seed=10, max_inflight=4)  # the inner transport's bound, adopted
    assert link.src_t.max_inflight == 4  # type: ignore[attr-defined]
    done = Collector()
    with _copier(link.src_t).hold():
        ids = [link.src_t.write(link.peer, link.batch([i]), done, grant=link.grant.key) for i in range(4)]
        with pytest.raises(CapacityError):
            link.src_t.write(link.peer, link.batch([4]), done, grant=link.grant.key)
        with pytest.raises(CapacityError):
            link.src_t.write(link.peer, link.batch([4]), done, grant=link.grant.key, deadline=Deadline.after(0.05))
    assert [b for b, _ in done.wait(4)] == ids
    ids.append(link.src_t.write(link.peer, link.batch([4]), done, grant=link.grant.key, deadline=Deadline.after(10)))
    assert [b for b, _ in done.wait(5)] == ids and all(e is None for _, e in done.done)


def test_bad_ranges_are_refused_before_anything_is_copied(make_staged: MakeTransport) -> None:
    link = Link(make_staged, pages=4, seed=11)
    with pytest.raises(TransportError) as info:
        link.src_t.write(link.peer, [(link.rs.addr + link.rs.length, link.rd.addr, PAGE)], grant=link.grant.key)
    assert info.value.op == "write"
    with pytest.raises(TransportError) as info:
        link.src_t.write(link.peer, [(link.rs.addr, link.rd.addr + link.rd.length, PAGE)], grant=link.grant.key)
    assert info.value.op == "write"
    with pytest.raises(ValueError):
        link.dst_t.land([(link.rd.addr + link.rd.length - 1, 2)], Lands())
    assert _copier(link.src_t).pending() == 0 and not any(link.src_t.stats.values())  # type: ignore[attr-defined]


def test_deregister_waits_for_pending_copies(make_staged: MakeTransport) -> None:
    link = Link(make_staged, pages=4, seed=12)
    done = Collector()
    with _copier(link.src_t).hold():
        link.src_t.write(link.peer, link.batch([0, 1]), done, grant=link.grant.key)
        with pytest.raises(TransportError) as info:
            link.src_t.deregister(link.rs, deadline=Deadline.after(0.05))
        assert info.value.op == "deregister"
        assert link.rs in link.src_t.regions(), "a region with a pending gather was deregistered"
    assert done.wait(1)[0][1] is None
    link.src_t.deregister(link.rs, deadline=Deadline.after(10))
    assert link.rs not in link.src_t.regions()


# ----------------------------------------------------------------------------- close


def test_close_with_copies_pending_fails_them_and_stops_every_thread() -> None:
    before = set(threading.enumerate())
    src_t = transport.create("staged:tcp", device="standin", seed=13, peer_timeout=5.0)
    dst_t = transport.create("staged:tcp", device="standin", seed=14, peer_timeout=5.0)
    try:
        src = torch.arange(8 * PAGE, dtype=torch.uint8)
        dst = torch.zeros_like(src)
        rs, rd = src_t.register(src), dst_t.register(dst)
        peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
        done = Collector()
        src_t.write(peer, [(rs.addr, rd.addr, PAGE)], done)
        assert done.wait(1)[0][1] is None
        lands = Lands()
        queued: list[int] = []
        with _copier(src_t).hold(), _copier(dst_t).hold():
            assert dst_t.land([(rd.addr, PAGE)], lands) is False
            ids = [src_t.write(peer, [(rs.addr + i * PAGE, rd.addr + i * PAGE, PAGE)], done) for i in range(1, 8)]
            queued.append(src_t.write(peer, [(rs.addr, rd.addr, PAGE)]))  # queue mode
            dst_t.close(deadline=Deadline.after(10))
            src_t.close(deadline=Deadline.after(10))
        got = done.wait(8)
        assert [b for b, _ in got[1:]] == ids and all(isinstance(e, TransportError) for _, e in got[1:])
        assert lands.wait(1) != [None], "a scatter pending at close reported success"
        [(bid, err)] = src_t.completions()
        assert bid == queued[0] and isinstance(err, TransportError)
        assert not dst.any(), "a scatter ran after close"
        with pytest.raises(TransportError):
            src_t.write(peer, [(rs.addr, rd.addr, PAGE)])
    finally:
        src_t.close()
        dst_t.close()
    leaked = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not leaked, f"threads left after close(): {leaked}"


# ----------------------------------------------------------------------------- the pieces


def test_plan_spans_coalesces_and_moves_many_equal_pages_as_rows() -> None:
    plan = plan_spans([(2 * PAGE, PAGE), (0, PAGE), (PAGE, PAGE)], 8 * PAGE)
    assert plan.spans == ((0, 3 * PAGE),) and plan.rows is None  # adjacent pages: one copy
    scattered = [(i * 2 * PAGE, PAGE) for i in range(INDEX_MIN_SPANS)]
    plan = plan_spans(scattered[::-1], 2 * INDEX_MIN_SPANS * PAGE)
    assert plan.rows is not None and plan.length == PAGE and plan.rows.tolist() == list(range(0, 2 * INDEX_MIN_SPANS, 2))
    assert plan_spans(scattered[:-1], 2 * INDEX_MIN_SPANS * PAGE).rows is None  # too few: one copy each
    with pytest.raises(ValueError):
        plan_spans([(7 * PAGE, PAGE + 1)], 8 * PAGE)


def test_buffer_path_says_why_dma_buf_is_not_used() -> None:
    class FakeCuda:  # what buffer_path duck-types: a tensor on a CUDA device
        device = type("D", (), {"type": "cuda"})()

        def data_ptr(self) -> int:
            return 1

    assert buffer_path(np.zeros(4, np.uint8), "tcp") == ("host", "")
    path, why = buffer_path(FakeCuda(), "tcp")
    assert path == "staging" and "verbs" in why
    path, why = buffer_path(FakeCuda(), "verbs")
    assert path == "staging" and why  # pyverbs missing or without DmaBufMR here, or not implemented
    assert buffer_path(np.zeros(4, np.uint8), "tcp", device="standin")[0] == "staging"


def test_host_only_auto_mode_needs_no_copier() -> None:
    t = transport.create("staged:tcp", peer_timeout=5.0)
    try:
        assert isinstance(t, StagedTransport)
        t.register(np.zeros(PAGE, np.uint8))
        assert t.device_path == "host" and t.copiers() == ()
    finally:
        t.close()


# ----------------------------------------------------------------------------- CUDA (GPU machines only)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_to_device_bytes_exact_in_order() -> None:
    made: list[Any] = []

    def make(**options: Any) -> Any:
        options.pop("seed", None)
        t = transport.create("staged:tcp", device="auto", peer_timeout=5.0, **options)
        made.append(t)
        return t

    try:
        link = Link(make, pages=256, seed=15, device="cuda")
        batches = _random_batches(link, 80, seed=16)
        done = Collector()
        ids = [link.src_t.write(link.peer, link.batch(p), done, grant=link.grant.key, deadline=Deadline.after(20)) for p in batches]
        got = done.wait(len(ids), 30)
        assert [b for b, _ in got] == ids and all(e is None for _, e in got), got
        lands = Lands()
        for pages in batches:
            link.dst_t.land(link.remote(link.batch(pages)), lands)
        assert lands.wait(len(batches), 30) == [None] * len(batches)
        torch.cuda.synchronize()
        assert torch.equal(link.dst.cpu(), link.expected({p for pages in batches for p in pages}))
        assert link.src_t.device_path == "staging"
    finally:
        for t in made:
            t.close()
