"""The pure twin's ``Completions`` and a posted frame's record (``_Frame``): part of
``transport._tcp_fast_py``, which re-exports it (see there for the contract).

A frame moves from its ``Source``'s lists (queued, in flight, completed with a callback) to this queue
when an ack or ``fail`` completes it without ``on_done``; it keeps its in-flight slot until ``take``
hands its completion out, so the queue stays bounded by the slots.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from ._tcp_fast_frame_py import _seconds

if TYPE_CHECKING:
    from ._tcp_fast_source_py import Source


class _Frame:
    """One posted batch: its head and payload as buffers (the header and descriptors, then each
    write's local range), its place in line, and how it completes."""

    __slots__ = ("seq", "batch_id", "on_done", "callback", "bufs", "nbytes", "src", "status", "err", "msg", "error")

    def __init__(self, batch_id: Any, on_done: Any, bufs: list[Any], src: Source) -> None:
        self.seq = 0
        self.batch_id, self.on_done, self.bufs, self.src = batch_id, on_done, bufs, src
        self.callback = on_done is not None  # completed through on_done (else through the Completions queue)
        self.nbytes = sum(len(b) for b in bufs)
        self.status = self.err = 0  # its ack: status, errno and message of a refused batch
        self.msg = b""
        self.error: Any = None  # the failure it completes with (fail())


class Completions:
    """The completions of batches written without ``on_done``, oldest first, across a transport's
    peers, behind a lock: a source's ack loop adds to it. A batch keeps its in-flight slot until
    ``take`` hands its completion out (the queue stays bounded by the slots). ``make(batch_id,
    error)`` builds what ``take`` returns; ``refused(status, errno, message)`` the error of a batch
    the sink refused."""

    def __init__(self, make: Any, refused: Any) -> None:
        if make is None or refused is None:
            raise TypeError("make and refused must be callables, got None")
        self._cond = threading.Condition()
        self._done: deque[_Frame] = deque()
        self._waiters = 0
        self._make, self._refused = make, refused

    def __len__(self) -> int:
        return len(self._done)

    def _push(self, frames: list[_Frame]) -> None:
        """Queue completed frames; wake the waiters."""
        with self._cond:
            self._done.extend(frames)
            if self._waiters:
                self._cond.notify_all()

    def take(self, max_items: int) -> list[Any]:
        """Up to ``max_items`` completions, oldest first; their slots go back to their peers (whose
        ``on_slot`` runs when a writer waits for one)."""
        if not isinstance(max_items, int):
            raise TypeError(f"max_items must be an integer, got {type(max_items).__name__}")
        with self._cond:
            got = [self._done.popleft() for _ in range(min(max(max_items, 0), len(self._done)))]
        out: list[Any] = []
        woken: Source | None = None
        for f in got:
            out.append(self._make(f.batch_id, _error_of(f, self._refused)))
            src = f.src
            with src._mu:
                src.slots -= 1
            if src.waiters and src is not woken:
                if woken is not None:
                    woken.on_slot()
                woken = src
        if woken is not None:
            woken.on_slot()
        return out

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a completion to take; True if one is there."""
        seconds = _seconds(seconds)
        with self._cond:
            self._waiters += 1
            try:
                self._cond.wait_for(lambda: self._done, timeout=max(seconds, 0.0))
            finally:
                self._waiters -= 1
            return bool(self._done)


def _error_of(f: _Frame, refused: Any) -> Any:
    """What a completed frame completes with: the failure ``fail()`` gave it, else the error ``refused``
    words from a refusing ack's status, errno and message, else None (landed)."""
    if f.error is not None:
        return f.error
    if f.status:
        return refused(f.status, f.err, f.msg)
    return None
