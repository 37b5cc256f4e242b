"""Announcements parked until their room registers here, one per (room, sender), bounded.

A decode rank may announce a room before the prefill scheduler registered it;
the announcement waits here (up to its deadline). With heterogeneous TP or MLA
one prefill rank hears several decode ranks announce the same room, so an
entry is keyed by the room *and* its sender: every sender's announcement waits
and ``take(room)`` hands them all over at registration (a room keyed alone
would let the second announcement replace the first, and the displaced decode
rank would wait for nothing).

A peer controls how many announcements it sends and how large each is (up to
``wire.MAX_PAGES`` page ids), and without a secret it picks its routing id
freely, so every dimension is bounded: at most ``max_entries`` entries in all,
``max_pages`` page ids per sender and ``max_total_pages`` page ids in all; past
any of them, ``park`` refuses with the reason to tell the sender.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from ..control import wire

__all__ = ["Parking"]


class Parking:
    def __init__(self, max_entries: int, max_pages: int, max_total_pages: int) -> None:
        self._max_entries = max_entries
        self._max_pages = max_pages
        self._max_total = max_total_pages
        # (room, sender) -> (announcement, deadline), in deadline order (every deadline is now + one timeout)
        self._entries: OrderedDict[tuple[int, str], tuple[wire.Announce, float]] = OrderedDict()
        self._rooms: dict[int, dict[str, None]] = {}  # room -> its senders, in arrival order
        self._pages: Counter[str] = Counter()
        self._total = 0

    def park(self, sender: str, msg: wire.Announce, until: float) -> str:
        """Park ``msg`` from ``sender`` until ``until``; '' when parked, else why not (it was not).

        A sender that announces a parked room again replaces its own earlier announcement."""
        n = len(msg.page_ids)
        key = (msg.room, sender)
        old = self._entries.get(key)
        held = 0 if old is None else len(old[0].page_ids)
        if old is None and len(self._entries) >= self._max_entries:
            return f"prefill rank has {len(self._entries)} announcements waiting already"
        if self._pages[sender] - held + n > self._max_pages:
            return f"{sender} has {self._pages[sender]} announced pages waiting here; {n} more exceed {self._max_pages}"
        if self._total - held + n > self._max_total:
            return f"{self._total} announced pages wait here from all senders; {n} more exceed {self._max_total}"
        if old is not None:
            self._remove(key)
        self._entries[key] = (msg, until)
        self._rooms.setdefault(msg.room, {})[sender] = None
        self._pages[sender] += n
        self._total += n
        return ""

    def take(self, room: int) -> list[tuple[str, wire.Announce]]:
        """Remove and return every ``(sender, announcement)`` parked for ``room``, in arrival order."""
        senders = self._rooms.get(room)
        if not senders:
            return []
        out = []
        for sender in list(senders):
            msg = self._remove((room, sender))
            if msg is not None:
                out.append((sender, msg))
        return out

    def take_one(self, room: int, sender: str) -> wire.Announce | None:
        """Remove and return ``sender``'s announcement of ``room``, if parked."""
        return self._remove((room, sender))

    def drop_sender(self, sender: str) -> None:
        for key in [k for k in self._entries if k[1] == sender]:
            self._remove(key)

    def expire(self, now: float) -> list[tuple[int, str]]:
        """Remove and return ``(room, sender)`` of every announcement past its deadline."""
        out = []
        while self._entries:
            key, (_, until) = next(iter(self._entries.items()))
            if until > now:
                break
            self._remove(key)
            out.append(key)
        return out

    def next_deadline(self) -> float:
        """When the oldest announcement's deadline passes (inf: none is parked)."""
        return next(iter(self._entries.values()))[1] if self._entries else float("inf")

    def pages(self, sender: str | None = None) -> int:
        """Page ids parked for ``sender`` (None: for every sender)."""
        return self._total if sender is None else self._pages[sender]

    def _remove(self, key: tuple[int, str]) -> wire.Announce | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        room, sender = key
        senders = self._rooms[room]
        del senders[sender]
        if not senders:
            del self._rooms[room]
        n = len(entry[0].page_ids)
        self._total -= n
        self._pages[sender] -= n
        if self._pages[sender] <= 0:
            del self._pages[sender]
        return entry[0]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, room: object) -> bool:
        """Some sender's announcement of ``room`` is parked."""
        return room in self._rooms
