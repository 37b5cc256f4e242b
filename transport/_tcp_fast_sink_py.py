"""The pure twin's ``Sink``, the sink's landing table: part of ``transport._tcp_fast_py``, which
re-exports it (see there for the contract).

The regions and live grants every received frame is checked against (``GrantTable.check``'s rules;
``check`` says what a frame would get), and which connection is landing a frame through which grant
and into which regions: what ``revoke`` (``wait_grant``, ``cut_grant``) and ``deregister``
(``wait_region``) wait on. One ``threading.Condition`` guards it all; the connections' loops
(``_tcp_fast_sinkconn_py.SinkConn``) take it to check a frame and to clear their mark.
"""

from __future__ import annotations

import socket
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ._tcp_fast_frame_py import _PAIR, _U64_TOP, _array, _find, _of, _seconds, _u64

if TYPE_CHECKING:
    from ._tcp_fast_sinkconn_py import SinkConn

LAND_OK = 0
LAND_OUTSIDE_REGIONS = 1  # EFAULT: outside every region registered at the sink (or length 0)
LAND_NEEDS_GRANT = 2  # EACCES: grant 0, and the region requires one
LAND_GRANT_NOT_LIVE = 3  # EACCES: the grant is revoked or was never given
LAND_GRANT_OTHER_SOURCE = 4  # EACCES: the grant was given to another source
LAND_OUTSIDE_GRANT = 5  # EACCES: outside the grant's ranges


class Sink:
    """The sink's landing table: the regions and live grants every frame is checked against, and the
    mark of each connection landing a frame, behind one lock (a ``threading.Condition``) that the
    connections' loops (``SinkConn.serve``) and the transport's calls (``set_regions``, ``add_grant``,
    ``remove_grant``, ``wait_grant``, ``cut_grant``, ``wait_region``, ``stop``) both take."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._regions: tuple[list[int], list[int], list[int], list[int], list[Any]] = ([], [], [], [], [])
        self._grants: dict[int, tuple[bytes, list[int], list[int]]] = {}
        self._conns: set[SinkConn] = set()
        self._stopped = False

    def set_regions(self, starts: np.ndarray, lengths: np.ndarray, guarded: np.ndarray, keys: np.ndarray, views: list[Any]) -> None:
        """Replace the regions frames are checked against (sorted by start, not overlapping): a frame
        checked after this sees only these."""
        for a in (starts, lengths, keys):
            _array(a, np.uint64, 1)
        _array(guarded, np.uint8, 1)
        _of(views, list, "views")
        n = len(starts)
        if len(lengths) != n or len(guarded) != n or len(keys) != n or len(views) != n:
            raise ValueError("region starts, lengths, flags, keys and views differ in length")
        regions = (starts.tolist(), lengths.tolist(), guarded.tolist(), keys.tolist(), list(views))
        with self._cond:
            self._regions = regions

    def add_grant(self, key: int, source: bytes, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Make grant ``key`` live: ``source`` (16 bytes) may write inside its ranges (sorted, not
        overlapping). A key already live is replaced."""
        key = _u64(key, "key")
        _of(source, bytes, "source")
        _array(starts, np.uint64, 1)
        _array(lengths, np.uint64, 1)
        if len(lengths) != len(starts):
            raise ValueError("grant starts and lengths differ in length")
        if len(source) != 16:
            raise ValueError(f"a grant names a source of 16 bytes, got {len(source)}")
        with self._cond:
            self._grants[key] = (source, starts.tolist(), lengths.tolist())

    def remove_grant(self, key: int) -> bool:
        """Take grant ``key`` out: no frame checked from now on lands through it. True if it was live."""
        key = _u64(key, "key")
        with self._cond:
            return self._grants.pop(key, None) is not None

    def wait_grant(self, key: int, seconds: float) -> bool:
        """Wait up to ``seconds`` until no connection is landing a frame through grant ``key``; True if none is."""
        return self._wait(_u64(key, "key"), False, _seconds(seconds))

    def wait_region(self, key: int, seconds: float) -> bool:
        """Wait up to ``seconds`` until no connection is landing a frame into region ``key``; True if none is."""
        return self._wait(_u64(key, "key"), True, _seconds(seconds))

    def _wait(self, key: int, region: bool, seconds: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: not self._busy(key, region), timeout=max(seconds, 0.0))
            return not self._busy(key, region)

    def _busy(self, key: int, region: bool) -> bool:
        """Is a connection landing a frame through grant ``key`` (or into region ``key``)? Holds the lock."""
        return any(c._landing and (key in c._used if region else c._grant == key) for c in self._conns)

    def cut_grant(self, key: int) -> int:
        """Shut down (both ways) every connection landing a frame through grant ``key`` now: its loop
        stops receiving, clears its mark and ends. Returns how many. Under the lock, so a connection
        cut is one still marked, whose socket its owner has not closed."""
        key = _u64(key, "key")
        n = 0
        with self._cond:
            for c in self._conns:
                if c._landing and c._grant == key:
                    try:
                        c._sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    n += 1
        return n

    def check(self, desc: bytes, grant: int, source: bytes) -> tuple[int, int, int]:
        """What a frame of these descriptor pairs naming ``grant`` from ``source`` would get now:
        ``(code, index of the first failing write, total payload bytes)`` (``LAND_OK``, 0, total)."""
        _of(desc, bytes, "desc")
        grant = _u64(grant, "grant")
        _of(source, bytes, "source")
        if len(source) != 16:
            raise ValueError(f"a source is 16 bytes, got {len(source)}")
        with self._cond:
            code, index, _views = self._check(desc, grant, source, None)
        if code:
            return code, index, 0
        return LAND_OK, 0, _total(desc)

    def _check(self, desc: bytes, grant: int, source: bytes, used: list[int] | None) -> tuple[int, int, list[Any] | None]:
        """Check every write of a frame before any lands (holds the lock): ``(LAND_OK, 0, views to receive
        into, with ``used``)`` or the ``LAND_*`` refusal of the first failing write, its index, None. A write must lie
        inside one region; with grant 0 that region must not require grants; with a grant, the grant
        must be live, given to ``source``, and hold the write inside one of its ranges
        (``GrantTable.check``'s rules; the grant is looked up once, at the first write that needs it).
        With ``used``, the keys of the regions written are appended to it (each once)."""
        rs, rl, guarded, keys, views = self._regions
        out: list[Any] = []
        state = -1
        gs: list[int] = []
        gl: list[int] = []
        last = -1
        for i in range(len(desc) // _PAIR.size):  # a trailing partial pair is ignored, as by the compiled twin
            addr, length = _PAIR.unpack_from(desc, _PAIR.size * i)
            j = _find(rs, rl, addr, length) if length else -1
            if j < 0:
                return LAND_OUTSIDE_REGIONS, i, None
            if j != last:
                if not grant and guarded[j]:
                    return LAND_NEEDS_GRANT, i, None
                if used is not None and keys[j] not in used:
                    used.append(keys[j])
                last = j
            if grant:
                if state < 0:
                    g = self._grants.get(grant)
                    state = LAND_GRANT_NOT_LIVE if g is None else LAND_GRANT_OTHER_SOURCE if g[0] != source else LAND_OK
                    if g is not None:
                        gs, gl = g[1], g[2]
                if state:
                    return state, i, None
                if _find(gs, gl, addr, length) < 0:
                    return LAND_OUTSIDE_GRANT, i, None
            if used is not None:
                off = addr - rs[j]
                out.append(views[j][off : off + length])
        return LAND_OK, 0, out

    def retained(self) -> list[int]:
        """The bytes each attached connection holds in its own buffers (a frame's header and descriptors,
        gathered acks, its landing marks), in no particular order (diagnostics): between frames, once
        its acks went out, at most ``_KEEP`` (64 KiB) in each, whatever the frames were. As each twin
        allocates them: the figures differ between the twins, the bound does not."""
        with self._cond:
            return [c._held() for c in self._conns]

    def stop(self) -> None:
        """The transport is closing: every loop ends at its next tick."""
        with self._cond:
            self._stopped = True

    def connection(self, sock: Any, acks: Any, source: bytes, max_writes: int, stall: float) -> SinkConn:
        """A connection past its handshake, from ``source``, and the one its acks go out on: see ``SinkConn``."""
        from ._tcp_fast_sinkconn_py import SinkConn  # (that module imports this one)

        return SinkConn(self, sock, acks, source, max_writes, stall)


def _total(desc: bytes) -> int:
    """The payload bytes of a frame: the sum of its lengths, saturated at 2**64 - 1."""
    return min(sum(n for _a, n in _PAIR.iter_unpack(desc[: len(desc) // _PAIR.size * _PAIR.size])), _U64_TOP - 1)
