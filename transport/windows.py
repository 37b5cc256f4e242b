"""Memory windows of the verbs transport, the parts that need no device: which windows a grant
needs, the frames that carry their rkeys to the source, and the source's table of them.

A type 2 memory window gives one remote queue pair write access to one contiguous range of a
registered region, under its own rkey, until the sink invalidates it. ``transport/verbs_grants.py``
binds one window per contiguous range of a grant (``transport/verbs_regions.py`` posts the
binds), on the sink queue pair of each connection of the grant's source, and tells that source
the windows' rkeys over the connection's own TCP socket (the liveness socket): at announcement
time the source may not have connected yet, and a type 2 window can only be bound once the
queue pair it belongs to exists. This module holds what both sides compute and parse; it
imports nothing of pyverbs.

Frames on the liveness socket (after the handshake), little-endian:

* sink → source ``W`` key:u64 n:u32, then n × (addr:u64 length:u64 rkey:u32): grant ``key``'s
  windows on this connection. Sent in key order, so every key below the last ``W`` seen that
  has no windows is not this source's to use (never granted to it, or revoked).
* sink → source ``S`` key:u64: grant ``key`` is being revoked; write nothing more through it,
  and answer ``s`` key once no batch through it is in flight.
* source → sink ``s`` key:u64: the answer to ``S``.
* sink → source ``R``: the fallback without windows killed this connection's queue pair (then EOF).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "FRAME_WINDOWS",
    "FRAME_STOP",
    "FRAME_STOPPED",
    "FRAME_REVOKED",
    "FrameReader",
    "MAX_FRAME_WINDOWS",
    "SourceWindows",
    "WINDOWS_HEAD",
    "WINDOWS_ROW",
    "encode_stop",
    "encode_windows",
    "window_spans",
]

FRAME_WINDOWS = b"W"
FRAME_STOP = b"S"
FRAME_STOPPED = b"s"
FRAME_REVOKED = b"R"
WINDOWS_HEAD = _HEAD = struct.Struct("<cQI")  # W key count
WINDOWS_ROW = _ROW = struct.Struct("<QQI")  # addr length rkey
_KEY = struct.Struct("<cQ")  # S / s key
MAX_FRAME_WINDOWS = 1 << 16  # a parser bound: no grant the sink makes has more (its max_windows is lower)


def window_spans(ranges: Sequence[tuple[int, int]], regions: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The windows a grant of ``ranges`` (sorted, not overlapping) needs: ranges that touch are one
    window, unless the join crosses from one region (``(addr, end)`` pairs, sorted) into the next,
    since a window lies in one memory region. Never a span that covers a byte outside ``ranges``."""
    spans: list[tuple[int, int]] = []
    starts = [a for a, _ in regions]
    region_end = 0
    for addr, length in ranges:
        if spans and spans[-1][0] + spans[-1][1] == addr and addr < region_end:
            a, n = spans[-1]
            spans[-1] = (a, n + length)
            continue
        i = bisect.bisect_right(starts, addr) - 1
        region_end = regions[i][1] if i >= 0 else 0
        spans.append((addr, length))
    return spans


def encode_windows(key: int, rows: Sequence[tuple[int, int, int]]) -> bytes:
    """A ``W`` frame: grant ``key``'s windows as ``(addr, length, rkey)``."""
    return _HEAD.pack(FRAME_WINDOWS, key, len(rows)) + b"".join(_ROW.pack(*r) for r in rows)


def encode_stop(key: int, *, answer: bool = False) -> bytes:
    """An ``S`` frame (sink: stop writing through ``key``), or with ``answer`` the source's ``s``."""
    return _KEY.pack(FRAME_STOPPED if answer else FRAME_STOP, key)


class FrameReader:
    """Splits the bytes of a liveness socket into frames; ``ValueError`` for a byte that is no frame.

    ``feed`` returns the complete frames so far as ``(kind, key, rows)``; ``rows`` is ``()`` except
    for ``W``. ``R`` ends the stream (the caller hangs up), so it is returned with key 0.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, int, tuple[tuple[int, int, int], ...]]]:
        self._buf += data
        out: list[tuple[bytes, int, tuple[tuple[int, int, int], ...]]] = []
        buf = self._buf
        at = 0
        while at < len(buf):
            kind = bytes(buf[at : at + 1])
            if kind == FRAME_REVOKED:
                out.append((kind, 0, ()))
                at += 1
                break
            if kind in (FRAME_STOP, FRAME_STOPPED):
                if len(buf) - at < _KEY.size:
                    break
                _, key = _KEY.unpack_from(buf, at)
                out.append((kind, key, ()))
                at += _KEY.size
                continue
            if kind != FRAME_WINDOWS:
                raise ValueError(f"liveness socket: {kind!r} is not a frame of this protocol")
            if len(buf) - at < _HEAD.size:
                break
            _, key, count = _HEAD.unpack_from(buf, at)
            if count > MAX_FRAME_WINDOWS:
                raise ValueError(f"liveness socket: a grant of {count} windows (at most {MAX_FRAME_WINDOWS})")
            end = at + _HEAD.size + count * _ROW.size
            if len(buf) < end:
                break
            rows = tuple(_ROW.unpack_from(buf, at + _HEAD.size + i * _ROW.size) for i in range(count))
            out.append((kind, key, rows))
            at = end
        del buf[:at]
        return out


@dataclass(slots=True)
class _Grant:
    starts: list[int]
    rows: tuple[tuple[int, int, int], ...]


@dataclass(slots=True)
class SourceWindows:
    """A source connection's windows, by grant key, as the sink sent them. The caller locks.

    ``floor``: the highest key this connection has heard of (the sink's last key at the handshake,
    then every ``W``); a key at or below it without windows is not this source's to use.
    ``busy``: batches in flight per key; ``stopping``: keys the sink asked to stop, to be answered
    once their ``busy`` count is zero.
    """

    floor: int = 0
    grants: dict[int, _Grant] = field(default_factory=dict)
    busy: dict[int, int] = field(default_factory=dict)
    stopping: set[int] = field(default_factory=set)

    def add(self, key: int, rows: Sequence[tuple[int, int, int]]) -> None:
        ordered = tuple(sorted(rows))
        self.grants[key] = _Grant([a for a, _, _ in ordered], ordered)
        self.floor = max(self.floor, key)

    def stop(self, key: int) -> bool:
        """The sink revokes ``key``: forget its windows; True if the answer may go at once."""
        self.grants.pop(key, None)
        self.floor = max(self.floor, key)
        if self.busy.get(key, 0):
            self.stopping.add(key)
            return False
        return True

    def known(self, key: int) -> bool:
        """True once ``key`` either has windows or is certainly not usable (no waiting helps)."""
        return key in self.grants or key <= self.floor

    def rkey(self, key: int, addr: int, length: int) -> int | None:
        """The rkey of the window of grant ``key`` holding all of ``[addr, addr + length)``, or None."""
        g = self.grants.get(key)
        if g is None:
            return None
        i = bisect.bisect_right(g.starts, addr) - 1
        if i < 0:
            return None
        a, n, rkey = g.rows[i]
        return rkey if addr + length <= a + n else None

    def began(self, key: int) -> None:
        self.busy[key] = self.busy.get(key, 0) + 1

    def ended(self, key: int) -> bool:
        """A batch through ``key`` ended; True if that was the last one of a key being stopped."""
        left = self.busy[key] - 1
        if left:
            self.busy[key] = left
            return False
        del self.busy[key]
        if key in self.stopping:
            self.stopping.discard(key)
            return True
        return False
