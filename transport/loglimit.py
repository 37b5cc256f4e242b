"""``LogLimit``: at most one warning per key every so many seconds, so a flood cannot flood the log.

Every edge that outside input can hit many times a second (failed handshakes,
refused bootstrap requests, accepts without descriptors, connections cut) warns
through one of these: the first occurrence is logged at once, later ones for the
same key within ``every`` seconds are only counted, and the next line says how
many were held back. The keys remembered are bounded (``max_keys``): past it,
keys whose quiet time is over are forgotten, and a new key beyond that stays
quiet (its caller still counts it in its stats). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable

__all__ = ["LogLimit"]


class LogLimit:
    def __init__(self, every: float = 10.0, max_keys: int = 4096) -> None:
        if not every > 0 or max_keys < 1:
            raise ValueError(f"LogLimit: every ({every!r}) and max_keys ({max_keys!r}) must be positive")
        self.every = every
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._keys: dict[Hashable, tuple[float, int]] = {}  # key -> (when last logged, held back since)

    def ready(self, key: Hashable = None, now: float | None = None) -> int | None:
        """None: stay quiet this time (held back). Otherwise log now: the count held back for ``key``
        since its last line (0 the first time)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            keys = self._keys
            entry = keys.get(key)
            if entry is not None and now - entry[0] < self.every:
                keys[key] = (entry[0], entry[1] + 1)
                return None
            if entry is None and len(keys) >= self._max_keys:
                self._keys = keys = {k: v for k, v in keys.items() if now - v[0] < self.every}
                if len(keys) >= self._max_keys:
                    return None
            keys[key] = (now, 0)
            return 0 if entry is None else entry[1]
