"""What the transport tests share (a plain module: tests/ is not a package).

``TRANSPORTS`` lists the transports the conformance suite runs on: ``"tcp"``
always, and ``"tcp+secret"`` (the same transport with the ``secret`` option:
every connection authenticated); the verbs transport appends ``"verbs"`` when
an RDMA device is present, with its options (device name, ...) in
``TRANSPORT_OPTIONS``. An entry is ``name`` or ``name+variant``: ``variant()``
splits it into the registry name and the constructor options.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import transport
from pdcore.core.deadline import Deadline

from pdcore.core.errors import TransportError
from transport.base import Transport

#: The deployment secret of the suite's authenticated runs (a test value, nothing else uses it).
TEST_SECRET = b"pdcore-tests: conformance secret"
TRANSPORTS: list[Any] = ["tcp", "tcp+secret"]
#: Per-transport constructor options the suite needs.
TRANSPORT_OPTIONS: dict[str, dict[str, Any]] = {"tcp": {}}
#: Options a ``+variant`` suffix adds.
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {"secret": {"secret": TEST_SECRET}}


def variant(entry: str) -> tuple[str, dict[str, Any]]:
    """``"tcp+secret"`` -> ``("tcp", {**TRANSPORT_OPTIONS["tcp"], "secret": TEST_SECRET})``."""
    name, _, extra = entry.partition("+")
    return name, {**TRANSPORT_OPTIONS.get(name, {}), **(VARIANT_OPTIONS[extra] if extra else {})}

MakeTransport = Callable[..., Transport]


def transport_maker(name: str, defaults: dict[str, Any]) -> Iterator[MakeTransport]:
    """Body of a fixture: build ``name`` transports (``defaults`` under each call's options), close
    them all afterwards, and fail if any thread outlives them."""
    before = set(threading.enumerate())
    made: list[Transport] = []

    def make(**options: Any) -> Transport:
        t = transport.create(name, **{**defaults, **options})
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(deadline=Deadline.after(5.0))
    leaked = [th.name for th in set(threading.enumerate()) - before if th.is_alive()]
    assert not leaked, f"threads left behind after close(): {leaked}"


def wait_until(cond: Callable[[], Any], seconds: float, what: str) -> None:
    """Poll ``cond`` until it is true; fail naming ``what`` after ``seconds`` (a deadline, not a sleep)."""
    deadline = Deadline.after(seconds)
    while not cond():
        assert not deadline.expired(), f"{what} within {seconds} s"
        time.sleep(0.005)


def granted_link(src_t: Any, dst_t: Any, src: Any) -> tuple[Any, Any, Any, Any, Any]:
    """A source's bytes ``src`` and a sink's zeroed buffer of their size, registered (the sink's only
    through a grant), the sink's grant of all of it to the source, and the source connected:
    ``(dst, src_region, dst_region, grant, peer)``."""
    dst = np.zeros(src.nbytes, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst, require_grant=True)
    g = dst_t.grant(src_t.instance, [(rd.addr, src.nbytes)])
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    return dst, rs, rd, g, peer


class Collector:
    """Records completions from callbacks; ``wait(n)`` blocks until n arrived or ``seconds`` pass."""

    def __init__(self, seconds: float = 10.0) -> None:
        self.done: list[tuple[int, TransportError | None]] = []
        self.seconds = seconds
        self._cond = threading.Condition()

    def __call__(self, batch_id: int, error: TransportError | None) -> None:
        with self._cond:
            self.done.append((batch_id, error))
            self._cond.notify_all()

    def wait(self, n: int, seconds: float | None = None) -> list[tuple[int, TransportError | None]]:
        seconds = self.seconds if seconds is None else seconds
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.done) >= n, timeout=seconds)
            assert ok, f"only {len(self.done)} of {n} completions within {seconds} s"
            return list(self.done)


class Ledger:
    """Batches whose outcome can be read back from the sink's memory.

    The source buffer holds ``bulk`` random bytes, then one ``marker``-byte slot per batch filled
    with that batch's own value; the sink buffer has the same layout, zeroed. Batch ``i`` writes
    the bulk (the same bytes every time) and then its own marker slot. ``check`` compares every
    batch's completion with what landed: a batch that succeeded has its marker and the bulk in
    place; a failed one may have landed any subset of its bytes (the contract), so each of its
    bytes is either untouched or its own; no byte outside every batch's ranges changed.
    """

    def __init__(self, make: MakeTransport, batches: int, bulk: int, marker: int = 4096, **options: Any) -> None:
        import numpy as np

        self.batches, self.bulk, self.marker = batches, bulk, marker
        self.src_t, self.dst_t = make(**options), make(**options)
        n = bulk + batches * marker + marker  # a spare slot at the end: no batch writes it
        self.src = np.zeros(n, np.uint8)
        self.src[:bulk] = np.random.default_rng(5).integers(0, 256, bulk, dtype=np.uint8)
        for i in range(batches + 1):
            self.src[self._slot(i)] = self.fill(i)
        self.dst = np.zeros(n, np.uint8)
        self.rs, self.rd = self.src_t.register(self.src), self.dst_t.register(self.dst)
        self.peer = self.src_t.connect(self.dst_t.endpoint(), deadline=Deadline.after(5))

    def _slot(self, i: int) -> slice:
        return slice(self.bulk + i * self.marker, self.bulk + (i + 1) * self.marker)

    @staticmethod
    def fill(i: int) -> int:
        return i % 255 + 1

    def batch(self, i: int) -> list[tuple[int, int, int]]:
        off = self.bulk + i * self.marker
        return [(self.rs.addr, self.rd.addr, self.bulk), (self.rs.addr + off, self.rd.addr + off, self.marker)]

    def check(self, got: list[tuple[int, TransportError | None]], ids: list[int]) -> tuple[list[int], list[int]]:
        """``got`` the completions of the batches ``ids`` (batch i posted as ``ids[i]``); returns
        (indexes that succeeded, indexes that failed) after checking each against the bytes."""
        import numpy as np

        assert sorted(b for b, _ in got) == sorted(ids), "each batch completes exactly once"
        outcome = dict(got)
        ok, failed = [], []
        bulk_src, bulk_dst = self.src[: self.bulk], self.dst[: self.bulk]
        assert np.all((bulk_dst == 0) | (bulk_dst == bulk_src)), "bytes no batch wrote landed in the bulk"
        for i, bid in enumerate(ids):
            slot = self.dst[self._slot(i)]
            if outcome[bid] is None:
                ok.append(i)
                assert (slot == self.fill(i)).all(), f"batch {i} reported success, but its marker did not land"
                assert np.array_equal(bulk_dst, bulk_src), f"batch {i} reported success, but the bulk did not land"
            else:
                failed.append(i)
                assert isinstance(outcome[bid], TransportError), outcome[bid]
                assert set(np.unique(slot).tolist()) <= {0, self.fill(i)}, f"failed batch {i}: foreign bytes in its slot"
        assert not self.dst[self._slot(self.batches)].any(), "bytes landed past every batch's ranges"
        return ok, failed
