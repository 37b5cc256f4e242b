"""Batches and their completions: the batch shape, ``as_batch``, and one completion per batch.

``on_done(batch_id, error)`` is called, or the completion is put on the transport's
``CompletionQueue`` (bounded, deadline-aware); ``deliver`` and ``call_on_done`` are the
one place either happens, and a callback that raises is reported, never lost silently.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeAlias

import numpy as np

from .deadline import Deadline
from .errors import CapacityError, TransportError


#: A batch: a sequence of ``(local_addr, remote_addr, length)`` triples, or an
#: ``(n, 3)`` integer numpy array (the transfer plan's output is ``uint64``).
Batch: TypeAlias = "Sequence[tuple[int, int, int]] | np.ndarray"
#: ``on_done(batch_id, error)``; ``error`` is ``None`` when every byte landed.
OnDone: TypeAlias = Callable[[int, "TransportError | None"], None]


class Completion(NamedTuple):
    """One batch's outcome, as taken from a completion queue."""

    batch_id: int
    error: TransportError | None


def as_batch(batch: Batch) -> np.ndarray:
    """Normalise a batch to a C-contiguous ``(n, 3)`` ``uint64`` array; lengths must be positive."""
    if isinstance(batch, np.ndarray):
        if batch.ndim != 2 or batch.shape[1] != 3:
            raise TransportError(f"a batch array has shape (n, 3), got {batch.shape}", op="write")
        if batch.dtype.kind not in "iu":
            raise TransportError(f"a batch array holds integers, got dtype {batch.dtype}", op="write")
        if batch.dtype.kind == "i" and batch.size and int(batch.min()) < 0:
            raise TransportError("a batch holds no negative addresses or lengths", op="write")
        arr = np.ascontiguousarray(batch, dtype=np.uint64)
    else:
        try:
            arr = np.array(batch, dtype=np.uint64).reshape(-1, 3) if len(batch) else np.empty((0, 3), np.uint64)
        except (ValueError, TypeError, OverflowError) as e:
            raise TransportError(f"a batch is a sequence of (local, remote, length) triples: {e}", op="write") from e
    # (count_nonzero, not min(): a batch is often a few triples, for which a ufunc reduction's set-up
    # was most of as_batch's cost)
    if np.count_nonzero(arr[:, 2]) != len(arr):
        raise TransportError("a write in the batch has length 0", op="write")
    return arr


class CompletionQueue:
    """A bounded queue of completions with a deadline-aware ``get``."""

    def __init__(self, maxsize: int) -> None:
        self._items: deque[tuple[Completion, Callable[[], None]]] = deque()
        self._maxsize = maxsize
        self._cond = threading.Condition()

    def put(self, completion: Completion, release: Callable[[], None]) -> None:
        """``release`` runs when the completion is taken (it frees the batch's in-flight slot)."""
        with self._cond:
            self._items.append((completion, release))
            self._cond.notify()

    def get(self, max_items: int, deadline: Deadline | None) -> list[Completion]:
        with self._cond:
            if deadline is not None:
                self._cond.wait_for(lambda: self._items, timeout=deadline.remaining())
            out: list[Completion] = []
            releases = []
            while self._items and len(out) < max_items:
                c, r = self._items.popleft()
                out.append(c)
                releases.append(r)
        for r in releases:
            r()
        return out

    def __len__(self) -> int:
        return len(self._items)


def deliver(queue: CompletionQueue, peer: Any, batch_id: int, on_done: OnDone | None, error: TransportError | None) -> None:
    """Report one batch's completion and free its in-flight slot (``peer.slots`` under ``peer.lock``, a Condition).

    Queue mode keeps the slot until the completion is taken, so the queue stays
    bounded. A callback's exception is the caller's bug: it goes to
    ``threading.excepthook`` and the transport thread carries on.
    """

    def release() -> None:
        with peer.lock:
            peer.slots -= 1
            peer.lock.notify_all()

    if on_done is None:
        queue.put(Completion(batch_id, error), release)
        return
    release()
    call_on_done(on_done, batch_id, error)


def call_on_done(on_done: OnDone, batch_id: int, error: TransportError | None) -> None:
    """Run a completion callback on a transport thread; its exception is the caller's bug, reported
    through ``threading.excepthook``, and the thread carries on."""
    try:
        on_done(batch_id, error)
    except Exception:
        exc_type, exc, tb = sys.exc_info()
        threading.excepthook(threading.ExceptHookArgs((exc_type, exc, tb, threading.current_thread())))


def take_slot(peer: Any, limit: int, deadline: Deadline | None, check_usable: Callable[[Any], None]) -> None:
    """Take one of ``peer``'s ``limit`` in-flight slots (the caller holds ``peer.lock``, a Condition that
    every completion notifies): at once, or waiting up to ``deadline`` for one; with no deadline a full
    peer is a ``CapacityError`` at once. ``check_usable(peer)`` raises if the peer failed meanwhile."""
    if peer.slots >= limit:
        if deadline is None:
            raise CapacityError(
                f"{limit} batches already in flight to this peer "
                "(queue-mode batches hold their slot until completions() takes them)"
            )
        peer.lock.wait_for(lambda: peer.slots < limit or peer.error is not None, timeout=deadline.remaining())
        check_usable(peer)
        if peer.slots >= limit:
            raise CapacityError(f"{limit} batches still in flight to this peer at the deadline")
    peer.slots += 1
