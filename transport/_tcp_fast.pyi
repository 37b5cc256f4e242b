"""Typed surface of the compiled TCP fast path (``_tcp_fast.pyx`` and its ``.pxi`` rooms);
``_tcp_fast_py`` is the same API (``transport.twins`` lists the names both define)."""

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

FRAME_SIZE: int
ACK_SIZE: int
FRAME_OK: int
FRAME_ZERO_LENGTH: int
FRAME_LOCAL_OUTSIDE: int
FRAME_REMOTE_OUTSIDE: int
LAND_OK: int
LAND_OUTSIDE_REGIONS: int
LAND_NEEDS_GRANT: int
LAND_GRANT_NOT_LIVE: int
LAND_GRANT_OTHER_SOURCE: int
LAND_OUTSIDE_GRANT: int
SERVE_REFUSED: int
SERVE_CLOSED: int
SERVE_BROKEN: int
SERVE_STALLED: int
SERVE_STOPPED: int
SERVE_NOTED: int
MAX_NOTE: int
POST_SENT: int
POST_WAKE: int
POST_FULL: int
POST_FAILED: int
POST_ARRAY: int
POST_TOO_MANY: int
ACKS_GOT: int
ACKS_TICK: int
ACKS_CLOSED: int
ACKS_BAD: int
ACKS_ORDER: int
ACKS_FAILED: int
MAX_MSG: int

def frame(
    batch: np.ndarray,
    grant: int,
    loc_starts: np.ndarray,
    loc_lengths: np.ndarray,
    loc_views: list[Any],
    rem_starts: np.ndarray,
    rem_lengths: np.ndarray,
    note: bytes = b"",
) -> tuple[int, int, list[Any] | None]: ...

class Sink:
    def __init__(self) -> None: ...
    def set_regions(
        self, starts: np.ndarray, lengths: np.ndarray, guarded: np.ndarray, keys: np.ndarray, views: list[Any]
    ) -> None: ...
    def add_grant(self, key: int, source: bytes, starts: np.ndarray, lengths: np.ndarray) -> None: ...
    def remove_grant(self, key: int) -> bool: ...
    def wait_grant(self, key: int, seconds: float) -> bool: ...
    def wait_region(self, key: int, seconds: float) -> bool: ...
    def cut_grant(self, key: int) -> int: ...
    def check(self, desc: bytes, grant: int, source: bytes) -> tuple[int, int, int]: ...
    def retained(self) -> list[int]: ...
    def stop(self) -> None: ...
    def connection(self, sock: Any, acks: Any, source: bytes, max_writes: int, stall: float) -> SinkConn: ...

class SinkConn:
    def __init__(self, sink: Sink, sock: Any, acks: Any, source: bytes, max_writes: int, stall: float) -> None: ...
    def close(self) -> None: ...
    def retained(self) -> int: ...
    def serve(self) -> tuple[Any, ...]: ...
    def refuse(self, seq: int, err: int, message: bytes, nbytes: int) -> None: ...

class Completions:
    def __init__(self, make: Callable[[Any, Any], Any], refused: Callable[[int, int, bytes], Any]) -> None: ...
    def __len__(self) -> int: ...
    def take(self, max_items: int) -> list[Any]: ...
    def wait(self, seconds: float) -> bool: ...

class Source:
    slots: int
    waiters: int
    on_slot: Any
    index: int
    err: int
    last_progress: float
    def __init__(
        self, sock: Any, ack_sock: Any, max_inflight: int, max_writes: int, refused: Callable[[int, int, bytes], Any]
    ) -> None: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def failed(self) -> bool: ...
    def has_work(self) -> bool: ...
    def post(
        self,
        batch: Any,
        grant: int,
        on_done: Any,
        ids: Iterator[Any],
        loc_starts: np.ndarray,
        loc_lengths: np.ndarray,
        loc_views: list[Any],
        rem_starts: np.ndarray,
        rem_lengths: np.ndarray,
        note: bytes = b"",
    ) -> tuple[int, Any]: ...
    def close(self) -> None: ...
    def send_blocking(self) -> int: ...
    def acks(self, queue: Completions) -> tuple[int, int]: ...
    def callbacks(self) -> list[Any]: ...
    def idle(self, stall: float) -> int: ...
    def fail(self, queue: Completions, error: Any) -> list[Any]: ...
