"""Revokes that were not confirmed, tried again: what a sink's fence does when the data plane refuses.

A sink (decode, the EPD receiver) frees memory only once the grant on it was revoked.
When a ``Revoke`` comes back with an error the fence stays armed and the memory held;
the engine puts what it revoked into a ``RetryRevokes`` and its tick sends the revokes
again ``RETRY`` seconds after the last failure, until one is confirmed. Sans-IO: time
is passed in.

The grants of what landed are revoked with nothing waiting on them (``LandedGrants``).
They too are tried again until one is confirmed, never forgotten: a forgotten grant
would stay live in the data plane for good. What bounds them is the engine granting
nothing new while ``bound`` of them are unconfirmed (``full``): a data plane that keeps
refusing revokes holds back new asks, it does not leave grants behind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["REVOKE_WAIT", "RETRY", "LandedGrants", "RetryRevokes"]

REVOKE_WAIT = 1.0  # seconds a revoke waits for a write landing through the grant before it cuts it
RETRY = 0.05  # seconds between tries of a revoke that was not confirmed

T = TypeVar("T")


class RetryRevokes(Generic[T]):
    def __init__(self) -> None:
        self._items: list[T] = []
        self._at = float("inf")

    def add(self, item: T, now: float) -> None:
        """``item``'s revoke failed: try it again (once, however often it failed) at most ``RETRY`` from now.
        The next try is the earliest one owed: later failures never postpone it (under a steady stream of
        them, the first would otherwise wait for ever)."""
        if item not in self._items:
            self._items.append(item)
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


class LandedGrants(Generic[T]):
    """The grants of landed rooms or items whose revoke was refused and is not confirmed yet (the module's
    docstring says why they are kept, and what bounds them), and what waits for them to fall under the bound
    (the engine's asks or announcements, in order)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._retry: RetryRevokes[Any] = RetryRevokes()
        self._keys: set[int] = set()
        self._waiting: list[T] = []

    def failed(self, grant: Any, now: float) -> None:
        """A revoke of ``grant`` was refused: it is tried again."""
        self._keys.add(grant.key)
        self._retry.add(grant, now)

    def confirmed(self, grant: Any) -> list[T]:
        """A revoke of ``grant`` went through (its first try, or a later one). What waited, in order, once
        under the bound again (taken out: the engine checks each is still wanted, and may make it wait again)."""
        self._keys.discard(grant.key)
        if self.full() or not self._waiting:
            return []
        waited, self._waiting = self._waiting, []
        return waited

    def full(self) -> bool:
        """Whether the engine should grant nothing new for now."""
        return len(self._keys) >= self.bound

    def wait(self, item: T) -> None:
        """``item`` waits for the bound (the engine found it ``full``)."""
        self._waiting.append(item)

    def keep_waiting(self, wanted: Callable[[T], bool]) -> None:
        """Only what is still ``wanted`` waits on (the rest ended meanwhile)."""
        if self._waiting:
            self._waiting = [w for w in self._waiting if wanted(w)]

    def waiting(self) -> int:
        return len(self._waiting)

    def due(self, now: float) -> list[Any]:
        """The grants to revoke again now (one confirmed meanwhile is not)."""
        return [g for g in self._retry.due(now) if g.key in self._keys]

    def next_deadline(self) -> float:
        return self._retry.next_deadline()

    def __len__(self) -> int:
        return len(self._keys)
