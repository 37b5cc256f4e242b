"""Announcements parked until their room registers here, bounded in count and in pages per sender.

A decode rank may announce a room before the prefill scheduler registered it;
the announcement waits here (up to its deadline). A peer controls how many it
sends and how large each is (up to ``wire.MAX_PAGES`` page ids), so both are
bounded: at most ``max_rooms`` rooms in all and ``max_pages`` page ids per
sender; past either, ``park`` refuses with the reason to tell the sender.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from ..control import wire

__all__ = ["Parking"]


class Parking:
    def __init__(self, max_rooms: int, max_pages: int) -> None:
        self._max_rooms = max_rooms
        self._max_pages = max_pages
        self._rooms: OrderedDict[int, tuple[str, wire.Announce, float]] = OrderedDict()  # in deadline order
        self._pages: Counter[str] = Counter()

    def park(self, sender: str, msg: wire.Announce, until: float) -> str:
        """Park ``msg`` until ``until``; '' when parked, else why not (it was not)."""
        n = len(msg.page_ids)
        if len(self._rooms) >= self._max_rooms:
            return f"prefill rank has {len(self._rooms)} announcements waiting already"
        if self._pages[sender] + n > self._max_pages:
            return f"{sender} has {self._pages[sender]} announced pages waiting here; {n} more exceed {self._max_pages}"
        self.take(msg.room)
        self._rooms[msg.room] = (sender, msg, until)
        self._pages[sender] += n
        return ""

    def take(self, room: int) -> tuple[str, wire.Announce] | None:
        entry = self._rooms.pop(room, None)
        if entry is None:
            return None
        self._unpark(entry[0], entry[1])
        return entry[0], entry[1]

    def drop_sender(self, sender: str) -> None:
        for room in [r for r, (s, _, _) in self._rooms.items() if s == sender]:
            self.take(room)

    def expire(self, now: float) -> list[tuple[int, str]]:
        """Remove and return ``(room, sender)`` of every announcement past its deadline."""
        out = []
        while self._rooms:
            room, (sender, msg, until) = next(iter(self._rooms.items()))
            if until > now:
                break
            del self._rooms[room]
            self._unpark(sender, msg)
            out.append((room, sender))
        return out

    def pages(self, sender: str) -> int:
        return self._pages[sender]

    def _unpark(self, sender: str, msg: wire.Announce) -> None:
        self._pages[sender] -= len(msg.page_ids)
        if self._pages[sender] <= 0:
            del self._pages[sender]

    def __len__(self) -> int:
        return len(self._rooms)

    def __contains__(self, room: object) -> bool:
        return room in self._rooms
