"""``faulty:zmq`` and ``faulty:tcp``: a control plane with faults on the way out, for chaos runs.

``Faults`` gives a plane (``FaultyChannel``: the ZeroMQ one; ``FaultyTcpPlane``: the TCP one)
outgoing frames that are are dropped, held
back (per-peer order kept), duplicated or corrupted (1 to 3 bytes of the encoded
frame flipped, before any seal) at seeded rates (``seed``, ``drop``, ``delay`` with
``max_delay`` seconds, ``dup``, ``corrupt``). Frames leave through the plane's
send step, so the faults sit there; held-back frames go out from the
flush the plane's loop runs at least every heartbeat interval. ``faults`` counts
what was done; ``samples`` keeps corrupted frames that still decoded (what
became what), which the wire's CRC-32 should make rare.
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from typing import Any

from . import wire
from .channel import ControlChannel
from .tcp_plane import TcpPlane

__all__ = ["Faults", "FaultyChannel", "FaultyTcpPlane"]


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Faults:
    """The faults, over whichever plane comes after it in the bases."""

    def __init__(self, *args: Any, seed: int = 0, drop: float = 0.0, delay: float = 0.0, max_delay: float = 0.2,
                 dup: float = 0.0, corrupt: float = 0.0, **kwargs: Any) -> None:
        for name, rate in (("drop", drop), ("delay", delay), ("dup", dup), ("corrupt", corrupt)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"faulty control channel: {name} must be in 0..1, got {rate!r}")
        super().__init__(*args, **kwargs)
        self._rates = (drop, delay, max_delay, dup, corrupt)
        self._rng = random.Random(seed)
        self._delayed: dict[str, deque[tuple[float, bytes, tuple[int, ...]]]] = {}
        self.faults: Counter[str] = Counter()
        self.samples: list[str] = []

    def _send_now(self, endpoint: str, frames: list[bytes], rooms: tuple[int, ...]) -> bool:
        """Each frame of the message meets its own faults; what is neither lost nor held back goes on as one message."""
        out = [copy for frame in frames for copy in self._faults(endpoint, frame, rooms)]
        return super()._send_now(endpoint, out, rooms) if out else True  # type: ignore[misc]  # all "sent": lost or held on the way

    def _faults(self, endpoint: str, frame: bytes, rooms: tuple[int, ...]) -> list[bytes]:
        """The copies of ``frame`` that go now (none: dropped, or held back behind the peer's held frames)."""
        drop, delay, max_delay, dup, corrupt = self._rates
        rng = self._rng
        held = self._delayed.get(endpoint)
        if rng.random() < drop:
            self.faults["dropped"] += 1
            return []
        if rng.random() < corrupt:
            self.faults["corrupted"] += 1
            data = bytearray(frame)
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= rng.randint(1, 255)
            try:  # the wire's CRC-32 should refuse it; one that still decodes is noted
                after = wire.decode(bytes(data))
            except Exception:
                pass
            else:
                self.faults["corrupted_still_valid"] += 1
                if len(self.samples) < 20:
                    self.samples.append(f"{_short(repr(wire.decode(frame)))} -> {_short(repr(after))}")
            frame = bytes(data)
        copies = 2 if rng.random() < dup else 1
        if copies == 2:
            self.faults["duplicated"] += 1
        if held or rng.random() < delay:
            due = time.monotonic() + rng.random() * max_delay
            queue = self._delayed.setdefault(endpoint, deque())
            if queue:
                due = max(due, queue[-1][0])
            else:
                self.faults["delayed"] += 1
            for _ in range(copies):
                queue.append((due, frame, rooms))
            return []
        return [frame] * copies

    def _frames_waiting(self) -> bool:
        return bool(self._delayed) or super()._frames_waiting()  # type: ignore[misc]

    def _flush(self) -> None:
        now = time.monotonic()
        for endpoint, queue in list(self._delayed.items()):
            while queue and queue[0][0] <= now:
                _, frame, rooms = queue.popleft()
                super()._send_now(endpoint, [frame], rooms)  # type: ignore[misc]
            if not queue:
                del self._delayed[endpoint]
        super()._flush()  # type: ignore[misc]

    def _drop_peer(self, endpoint: str) -> None:
        self._delayed.pop(endpoint, None)
        super()._drop_peer(endpoint)  # type: ignore[misc]


class FaultyChannel(Faults, ControlChannel):
    """``faulty:zmq``."""


class FaultyTcpPlane(Faults, TcpPlane):
    """``faulty:tcp``."""
