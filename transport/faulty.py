"""A fault-injecting wrapper around any transport, for chaos runs and tests.

``FaultyTransport(inner, seed=..., fail_rate=..., land_rate=..., delay=...)``
forwards the whole :class:`~transport.base.Transport` interface to ``inner``
(registrations, grants, endpoints, connects, writes, completions, close) and
injects two faults into ``write``:

- **failed batches**: a seeded random fraction ``fail_rate`` of non-empty
  batches completes with a ``TransportError``. Of those, a fraction
  ``land_rate`` is first *posted* to the inner transport (a random non-empty
  prefix of the batch's writes, often all of them), so some or all of its
  bytes land at the sink although the source hears "failed" (a lost ack, a
  connection cut mid-batch); the rest never reach the inner transport at all
  (nothing lands). Both are outcomes the interface allows: "after a failed
  batch, any subset of its bytes may have landed".
- **late completions**: every completion (failed or not) is delivered after an
  extra random ``[0, delay]`` seconds.

A batch's note (``write(..., note=...)``) goes to the inner transport only with
the whole batch: a batch failed before posting, or of which only a prefix is
posted, carries no note (its sink hears nothing of it, as the contract allows
for a failed batch); a batch failed after posting all of it keeps its note, so
the sink may have handed it although the source hears "failed" (also allowed).
After a batch through a grant was failed without posting all of it, no later
batch to that peer through that grant carries its note: the sink would take the
note as the word that every byte written through the grant landed (a real sink
withholds one after a refused frame; a lost connection takes the later frames
with it).

By name: ``transport.create("faulty:tcp", seed=1, fail_rate=0.05, **tcp_options)``;
the registry hands the options named in :data:`WRAPPER_OPTIONS` to the wrapper
and every other option to the inner transport (``create("tcp", **tcp_options)``),
``secret`` among them: the inner transport authenticates its handshakes, and
``auth_failures`` reads its count (``evicted_handshakes``, ``refused_connections``
and ``accept_failures`` read the inner transport's too).

What still holds through the wrapper: exactly one completion per batch;
completions to one peer in posting order (an empty batch is still a fence:
it completes after every batch posted before it, failed or not); callbacks
run on a wrapper thread, never inside ``write``; ``close`` fails every batch
still in flight. What is looser: a batch failed *before* posting is checked
only for its shape (the inner transport never sees it, so a bad address gives
a failed completion instead of a synchronous ``TransportError``), and batches
whose completion is being delayed no longer count against the inner
transport's ``max_inflight``.

The fault decisions come from one ``random.Random(seed)`` drawn in ``write``
call order, so a single-threaded caller sees the same faults for the same seed
(the delays come from another one, drawn in completion order).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

from .base import (
    Batch,
    Completion,
    CompletionQueue,
    Grant,
    OnDone,
    PeerHandle,
    Region,
    Transport,
    as_batch,
    call_on_done,
)
from .deadline import Deadline
from .errors import StartError, TransportError
from .threads import named_thread
from .wrapping import SpoiledGrants, Wrapping

__all__ = ["FaultyTransport", "WRAPPER_OPTIONS"]

#: Options of ``create("faulty:<inner>", ...)`` that configure the wrapper; the others go to the inner transport.
WRAPPER_OPTIONS = ("seed", "fail_rate", "land_rate", "delay")
_MAX_SPOILED = 1 << 16  # (peer, grant) pairs remembered as spoiled (the oldest go first)


@dataclass(eq=False, slots=True)
class _Entry:
    """One batch posted through the wrapper, waiting for its turn to complete."""

    batch_id: int
    on_done: OnDone | None
    injected: TransportError | None  # the fault to report, whatever the inner transport says
    resolved: bool = False
    error: TransportError | None = None


class FaultyTransport(Wrapping, Transport):
    """Wraps ``inner``; see the module docstring. ``stats`` counts the faults injected."""

    name: ClassVar[str] = "faulty"

    def __init__(
        self,
        inner: Transport,
        *,
        seed: int = 0,
        fail_rate: float = 0.0,
        land_rate: float = 0.5,
        delay: float = 0.0,
    ) -> None:
        if not (0.0 <= fail_rate <= 1.0 and 0.0 <= land_rate <= 1.0 and delay >= 0.0):
            raise StartError(f"faulty transport: need 0 <= fail_rate, land_rate <= 1 and delay >= 0, "
                             f"got {fail_rate}, {land_rate}, {delay}")
        self.inner = inner
        self._rng = random.Random(seed)  # fault decisions, drawn in write() call order
        self._delay_rng = random.Random(seed ^ 0x5EED)  # delays, drawn in completion order (threads)
        self._fail_rate = float(fail_rate)
        self._land_rate = float(land_rate)
        self._delay = float(delay)
        self._lock = threading.Lock()
        self._ids = iter(range(1, 1 << 62))
        self._order: dict[int, deque[_Entry]] = {}  # peer.id -> its batches in posting order
        self._queue = CompletionQueue(1 << 30)
        # completions ready to deliver, in delivery order: (due time, entry)
        self._ready: deque[tuple[float, _Entry]] = deque()
        self._last_due = 0.0
        self._cond = threading.Condition(self._lock)
        self._closing = False
        self._closed = False
        self.stats = {"batches": 0, "failed_unposted": 0, "failed_posted": 0, "delayed": 0}
        # (peer id, grant) a batch was failed through without posting all of it: its later notes stay here
        self._spoiled = SpoiledGrants(_MAX_SPOILED)
        self._thread = named_thread(self._deliver_loop, "pdcore-faulty-deliver")
        self._thread.start()

    # ------------------------------------------------------------------ pass-through

    def register(self, buf: Any, *, require_grant: bool = False) -> Region:
        return self.inner.register(buf, require_grant=require_grant)

    def revoke(self, grant: Grant, *, deadline: Deadline | None = None, settled: bool = False) -> None:
        self.inner.revoke(grant, deadline=deadline, settled=settled)

    def deregister(self, region: Region, *, deadline: Deadline | None = None) -> None:
        self.inner.deregister(region, deadline=deadline)

    def disconnect(self, peer: PeerHandle, *, deadline: Deadline | None = None) -> None:
        self.inner.disconnect(peer, deadline=deadline)  # fails what is posted; our own entries follow in order

    def completions(self, max_items: int = 1024, *, deadline: Deadline | None = None) -> list[Completion]:
        return self._queue.get(max_items, deadline)

    # ------------------------------------------------------------------ writes

    def write(self, peer: PeerHandle, batch: Batch, on_done: OnDone | None = None, *,
              deadline: Deadline | None = None, grant: int = 0, note: bytes = b"") -> int:
        arr = as_batch(batch)
        if note or type(note) is not bytes:
            self._check_note(note, len(arr), grant)
        with self._lock:
            if self._closing:
                raise TransportError("transport is closed", op="write")
            fail = len(arr) > 0 and self._rng.random() < self._fail_rate
            post_prefix = len(arr)
            if fail:
                if self._rng.random() < self._land_rate:  # posted, so bytes land, but reported failed
                    post_prefix = len(arr) if self._rng.random() < 0.5 else self._rng.randint(1, len(arr))
                else:
                    post_prefix = 0
            entry = _Entry(next(self._ids), on_done, None)
            if fail:
                how = "after posting" if post_prefix else "before posting"
                entry.injected = TransportError(f"injected fault: batch failed {how}", op="write")
            whole = post_prefix == len(arr)  # only a whole batch carries its note: a prefix did not all land
            if not whole and grant:
                self._spoiled.spoil((peer.id, grant))
            whole = whole and (peer.id, grant) not in self._spoiled
            self.stats["batches"] += 1
            order = self._order.setdefault(peer.id, deque())
            order.append(entry)
        if fail and post_prefix == 0:
            self.stats["failed_unposted"] += 1
            self._resolve(peer, entry, None)
            return entry.batch_id
        try:
            self.inner.write(
                peer, arr[:post_prefix], lambda _bid, error: self._resolve(peer, entry, error), deadline=deadline, grant=grant,
                note=note if whole else b"",
            )
        except BaseException:
            with self._lock:  # nothing was posted: forget the entry (later ones may now be first)
                order.remove(entry)
                self._advance(order)
            raise
        if fail:
            self.stats["failed_posted"] += 1
        return entry.batch_id

    def _resolve(self, peer: PeerHandle, entry: _Entry, error: TransportError | None) -> None:
        """The inner transport completed ``entry``'s batch (or it was never posted)."""
        with self._lock:
            entry.resolved = True
            entry.error = entry.injected or error
            order = self._order.get(peer.id)
            if order is not None:
                self._advance(order)

    def _advance(self, order: deque[_Entry]) -> None:
        """Move resolved batches at the head of one peer's order to the delivery queue. Holds ``_lock``."""
        now = time.monotonic()
        moved = False
        while order and order[0].resolved:
            entry = order.popleft()
            extra = self._delay_rng.random() * self._delay if self._delay else 0.0
            if extra:
                self.stats["delayed"] += 1
            self._last_due = max(self._last_due, now + extra)  # one FIFO: order per peer survives the delay
            self._ready.append((self._last_due, entry))
            moved = True
        if moved:
            self._cond.notify_all()

    def _deliver_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._ready:
                        due, entry = self._ready[0]
                        wait = due - time.monotonic()
                        if wait <= 0 or self._closing:
                            self._ready.popleft()
                            break
                        self._cond.wait(wait)
                    elif self._closed:
                        return
                    else:
                        self._cond.wait()
            if entry.on_done is None:
                self._queue.put(Completion(entry.batch_id, entry.error), _no_op)
                continue
            call_on_done(entry.on_done, entry.batch_id, entry.error)

    # ------------------------------------------------------------------ lifecycle

    def close(self, *, deadline: Deadline | None = None) -> None:
        deadline = deadline or Deadline.after(5.0)
        with self._lock:
            self._closing = True  # no new writes; delays are skipped from now on
            self._cond.notify_all()
        error: BaseException | None = None
        try:
            self.inner.close(deadline=deadline)  # fails every posted batch: their completions come to us
        except BaseException as e:
            error = e
        with self._lock:
            closed_error = TransportError("transport closed with the batch in flight", op="close")
            for order in self._order.values():  # the inner transport failed what it held; fail the rest
                for entry in order:
                    if not entry.resolved:
                        entry.resolved = True
                        entry.error = entry.injected or closed_error
                self._advance(order)
            self._order.clear()
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(deadline.remaining())
        if error is not None:
            raise error
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            raise TransportError("close: the faulty wrapper's delivery thread is still running", op="close")

    def __repr__(self) -> str:
        return f"<FaultyTransport fail_rate={self._fail_rate} delay={self._delay} inner={self.inner!r}>"


def _no_op() -> None:
    pass


WRAPPER = FaultyTransport  # what ``transport.create("<prefix><inner>")`` wraps the inner transport in
