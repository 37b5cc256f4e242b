"""Rooms that ended here, remembered for ``ttl`` seconds so late frames get a clear answer.

Bounded: past ``limit`` entries the oldest go first. ``now`` is an argument.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Tombstones"]


class Tombstones:
    def __init__(self, ttl: float, limit: int) -> None:
        self._ttl = ttl
        self._limit = limit
        self._rooms: OrderedDict[int, tuple[float, str]] = OrderedDict()

    def add(self, room: int, reason: str, now: float) -> None:
        self._rooms.pop(room, None)
        self._rooms[room] = (now + self._ttl, reason)
        while len(self._rooms) > self._limit:
            self._rooms.popitem(last=False)

    def get(self, room: int) -> str | None:
        entry = self._rooms.get(room)
        return None if entry is None else entry[1]

    def pop(self, room: int) -> str | None:
        entry = self._rooms.pop(room, None)
        return None if entry is None else entry[1]

    def expire(self, now: float) -> None:
        while self._rooms:
            room, (until, _) = next(iter(self._rooms.items()))
            if until > now:
                return
            del self._rooms[room]

    def next_deadline(self) -> float:
        """When the oldest entry expires (inf: none is held)."""
        return next(iter(self._rooms.values()))[0] if self._rooms else float("inf")

    def __len__(self) -> int:
        return len(self._rooms)
