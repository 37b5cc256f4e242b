"""Revokes that were not confirmed, tried again: what a sink's fence does when the data plane refuses.

A sink (decode, the EPD receiver) frees memory only once the grant on it was revoked.
When a ``Revoke`` comes back with an error the fence stays armed and the memory held;
the engine puts what it revoked into a ``RetryRevokes`` and its tick sends the revokes
again ``RETRY`` seconds after the last failure, until one is confirmed. Sans-IO: time
is passed in. ``limit`` bounds what nothing waits on (the grants of rooms that already
landed): past it the oldest are dropped, never a fence a room waits for.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["REVOKE_WAIT", "RETRY", "RetryRevokes"]

REVOKE_WAIT = 1.0  # seconds a revoke waits for a write landing through the grant before it cuts it
RETRY = 0.05  # seconds between tries of a revoke that was not confirmed

T = TypeVar("T")


class RetryRevokes(Generic[T]):
    def __init__(self, limit: int | None = None) -> None:
        self._items: list[T] = []
        self._limit = limit
        self._at = float("inf")

    def add(self, item: T, now: float) -> None:
        """``item``'s revoke failed: try it again (once, however often it failed) at most ``RETRY`` from now.
        The next try is the earliest one owed: later failures never postpone it (under a steady stream of
        them, the first would otherwise wait for ever, and the bound drop it)."""
        if item not in self._items:
            self._items.append(item)
            if self._limit is not None:
                del self._items[: max(0, len(self._items) - self._limit)]
        self._at = min(self._at, now + RETRY)

    def next_deadline(self) -> float:
        return self._at if self._items else float("inf")

    def due(self, now: float) -> list[T]:
        """What to revoke again now (taken out: a failure adds it back)."""
        if not self._items or now < self._at:
            return []
        items, self._items = self._items, []
        self._at = float("inf")
        return items

    def __len__(self) -> int:
        return len(self._items)
