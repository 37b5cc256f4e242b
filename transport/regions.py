"""Registered memory and grants: ``Region``, ``RegionTable`` (sorted, O(log n) look-ups), ``Grant``, ``GrantTable``.

A sink registers regions; a region registered with ``guarded=True`` takes only
writes a live grant covers (see ``transport/base.py``, "Grants"). Also the two
helpers that turn a buffer into an address range and back (``buffer_span``, ``byte_view``).
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .limits import U64_MAX


@dataclass(frozen=True, slots=True)
class Region:
    """Registered memory: ``[addr, addr + length)``; ``key`` is opaque per transport."""

    addr: int
    length: int
    key: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.addr <= U64_MAX and 0 < self.length and self.addr + self.length <= U64_MAX + 1):
            raise ValueError(f"a region needs a non-null address and a positive length, got {self!r}")
        if not 0 <= self.key <= U64_MAX:
            raise ValueError(f"a region key is an unsigned 64-bit value, got {self.key!r}")

    @property
    def end(self) -> int:
        return self.addr + self.length

    def contains(self, addr: int, length: int) -> bool:
        """True if ``[addr, addr + length)`` lies inside this region."""
        return self.addr <= addr and addr + length <= self.addr + self.length


@dataclass(frozen=True, slots=True)
class Grant:
    """A sink's permission for one source transport to write into ``ranges`` of the sink's regions.

    ``key`` (a non-zero u64, unique per sink) is what the source names in
    ``write(..., grant=key)``; ``source`` is the source transport's ``instance``;
    ``ranges`` are ``(addr, length)`` pairs sorted by address, not overlapping (a write must lie
    inside one of them).
    """

    key: int
    source: bytes
    ranges: tuple[tuple[int, int], ...]


def grant_ranges(ranges: Any) -> tuple[tuple[int, int], ...]:
    """Normalise grant ranges: ``(addr, length)`` pairs (or an ``(n, 2)`` int array), sorted by
    address; ``ValueError`` for an empty or wrapping range or overlapping ones. One pass: a decode
    rank grants every announced room's pages, so this runs per request."""
    rows = sorted(map(tuple, ranges.reshape(-1, 2).tolist()) if isinstance(ranges, np.ndarray) else ranges)
    end = 1
    for addr, length in rows:
        if type(addr) is not int or type(length) is not int:  # numpy integers and the like: converted once
            return grant_ranges([(int(a), int(n)) for a, n in rows])
        if addr < end or length <= 0 or addr + length > U64_MAX + 1:
            what = "overlap" if addr < end and addr > 0 and length > 0 else "need a non-null address and a positive length"
            raise ValueError(f"grant ranges {what}: ({addr:#x}, {length})")
        end = addr + length
    return tuple(rows)


class GrantTable:
    """A sink's live grants, by key; ``check`` is O(log ranges) per write. Callers hold their own lock."""

    def __init__(self) -> None:
        self._grants: dict[int, tuple[Grant, list[int]]] = {}
        self._keys = iter(range(1, U64_MAX))

    def add(self, source: bytes, ranges: Any) -> Grant:
        if len(source) != 16:
            raise ValueError(f"a grant names a source transport instance of 16 bytes, got {len(source)}")
        normal = grant_ranges(ranges)
        g = Grant(next(self._keys), bytes(source), normal)
        self._grants[g.key] = (g, [a for a, _ in normal])
        return g

    def pop(self, key: int) -> Grant | None:
        entry = self._grants.pop(key, None)
        return None if entry is None else entry[0]

    def get(self, key: int) -> Grant | None:
        entry = self._grants.get(key)
        return None if entry is None else entry[0]

    def check(self, key: int, source: bytes, addr: int, length: int) -> str:
        """'' if ``[addr, addr + length)`` may be written by ``source`` through grant ``key``; else why not."""
        entry = self._grants.get(key)
        if entry is None:
            return f"grant {key} is not live at the sink (revoked, or never granted)"
        g, starts = entry
        if g.source != source:
            return f"grant {key} was given to another source"
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or addr + length > g.ranges[i][0] + g.ranges[i][1]:
            return f"[{addr:#x}, +{length}) is outside grant {key}"
        return ""

    def of_source(self, source: bytes) -> list[Grant]:
        return [g for g, _ in self._grants.values() if g.source == source]


class RegionTable:
    """Non-overlapping regions sorted by address; thread-safe. ``find`` is O(log n)."""

    def __init__(self, regions: Sequence[Region] = ()) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._regions: list[Region] = []
        for r in regions:
            self.add(r)

    def add(self, region: Region) -> None:
        """Insert; raise ``ValueError`` if it overlaps a region already present."""
        with self._lock:
            i = bisect.bisect_right(self._starts, region.addr)
            if i > 0 and self._regions[i - 1].end > region.addr:
                raise ValueError(f"{region} overlaps registered {self._regions[i - 1]}")
            if i < len(self._regions) and self._regions[i].addr < region.end:
                raise ValueError(f"{region} overlaps registered {self._regions[i]}")
            self._starts.insert(i, region.addr)
            self._regions.insert(i, region)

    def remove(self, region: Region) -> bool:
        """Remove exactly this region; False if it was not present."""
        with self._lock:
            i = bisect.bisect_left(self._starts, region.addr)
            if i < len(self._regions) and self._regions[i] == region:
                del self._starts[i], self._regions[i]
                return True
            return False

    def find(self, addr: int, length: int) -> Region | None:
        """The region holding all of ``[addr, addr + length)``, or None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i >= 0 and self._regions[i].contains(addr, length):
                return self._regions[i]
            return None

    def outside(self, ranges: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
        """The first of ``ranges`` (sorted by address) that lies in no one region, or None. One lock for
        all of them: a grant has a range per buffer and run of pages (a decode rank grants per request)."""
        lo = hi = 0
        with self._lock:
            starts, regions = self._starts, self._regions
            for addr, length in ranges:  # consecutive ranges mostly share a region: look up only when one leaves it
                if not (lo <= addr and addr + length <= hi):
                    i = bisect.bisect_right(starts, addr) - 1
                    if i < 0 or not regions[i].contains(addr, length):
                        return addr, length
                    lo, hi = regions[i].addr, regions[i].end
        return None

    def snapshot(self) -> tuple[Region, ...]:
        with self._lock:
            return tuple(self._regions)

    def clear(self) -> tuple[Region, ...]:
        with self._lock:
            out = tuple(self._regions)
            self._starts.clear()
            self._regions.clear()
            return out

    def __len__(self) -> int:
        return len(self._regions)


def buffer_span(buf: Any) -> tuple[int, int, Any]:
    """``(addr, length, owner)`` of a buffer to register; ``owner`` keeps the memory alive.

    Accepts a contiguous numpy array, a contiguous CPU torch tensor (duck-typed:
    ``data_ptr``/``nbytes``/``is_contiguous``/``device``; torch is never
    imported here), an ``(addr, length)`` pair of ints (the caller keeps that
    memory alive until ``deregister``), or any writable buffer-protocol object.
    """
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(x, int) for x in buf):
        addr, length = buf
        owner: Any = None
    elif isinstance(buf, np.ndarray):
        if not (buf.flags.c_contiguous or buf.flags.f_contiguous):
            raise ValueError("register needs a contiguous numpy array (np.ascontiguousarray makes one)")
        addr, length, owner = int(buf.ctypes.data), int(buf.nbytes), buf
    elif hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):
        device = getattr(getattr(buf, "device", None), "type", "cpu")
        if device != "cpu":
            raise ValueError(f"register needs a CPU tensor, got one on {device!r}")
        if not buf.is_contiguous():
            raise ValueError("register needs a contiguous tensor (.contiguous() makes one)")
        addr, owner = int(buf.data_ptr()), buf
        length = int(buf.nbytes) if hasattr(buf, "nbytes") else int(buf.numel() * buf.element_size())
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except TypeError as e:
            raise TypeError(
                f"cannot register {type(buf).__name__}: pass a numpy array, a CPU torch tensor, "
                "(addr, length), or a buffer-protocol object"
            ) from e
        addr, length, owner = int(arr.ctypes.data), int(arr.nbytes), (buf, arr)
    if addr <= 0 or length <= 0:
        raise ValueError(f"cannot register an empty or null buffer (addr={addr:#x}, length={length})")
    return addr, length, owner


def byte_view(addr: int, length: int, owner: Any = None) -> memoryview:
    """A writable ``memoryview`` of raw memory that keeps ``owner`` alive (every slice of it does too).

    With ``owner=None`` the caller guarantees the memory stays mapped and alive.
    """
    raw = (ctypes.c_char * length).from_address(addr)
    raw._pdcore_owner = owner  # type: ignore[attr-defined]  # a ctypes object keeps what it references
    return memoryview(raw).cast("B")
