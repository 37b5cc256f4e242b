"""Per-batch work of the TCP transport, pure-Python twin of ``transport._tcp_fast`` (same names,
signatures, results and errors; ``transport.tcp`` chooses, like ``transport.plan``).

A pure function, no I/O and no locks:

- ``frame`` (source): check a batch against the local and the remote regions and build its frame
  head (header with seq 0, then the descriptor pairs) and the payload views, in one pass.

the source's side, with its I/O and its lock:

- ``Source``: one connected peer's batches from ``post`` (``frame``'s checks, a slot, the seq; the
  writer that finds nobody sending sends the frame itself) to their completion: ``send_blocking``
  (the sender thread: what a full socket left), ``acks`` (the ack loop: acks complete frames oldest
  first), ``callbacks``, ``fail``.
- ``Completions``: the queue-mode completions of a transport's peers; a batch keeps its slot until
  ``take`` hands it out.

and the sink's side, with its I/O and its lock:

- ``Sink``: the regions and live grants every received frame is checked against (``GrantTable.check``'s
  rules, ``check`` says what a frame would get), and which connection is landing a frame through which
  grant and into which regions: what ``revoke`` (``wait_grant``, ``cut_grant``) and ``deregister``
  (``wait_region``) wait on.
- ``SinkConn``: one connection's loop (``serve``): read a frame, check it, receive its payload into
  place, ack; it returns to the caller only to have a refused frame's ack worded (``refuse``), or
  when the connection ends.

The compiled twin runs the loops (``serve``, ``acks``) and every syscall without the GIL, its shared
state behind pthread mutexes; this one behind ``threading`` locks, with the same results.

Regions are given as a snapshot: ``starts`` and ``lengths`` (``uint64`` arrays sorted by start,
not overlapping), and per region its view (a writable ``memoryview`` of all of it; the compiled twin
writes by address and only keeps it referenced), its key and whether it requires a grant
(``guarded``, ``uint8``). Every array is a C-contiguous, aligned, native-order numpy array
(``ValueError`` otherwise; ``TypeError`` for what is not an array, or not the
``bytes``/``bytearray``/``list`` asked for). Result codes, not messages: ``transport.tcp`` words the
errors, so both twins give the same ones.
"""

from __future__ import annotations

import bisect
import socket
import struct
import threading
import time
from collections import deque
from typing import Any

import numpy as np

__all__ = [
    "ACK_SIZE",
    "FRAME_SIZE",
    "FRAME_LOCAL_OUTSIDE",
    "FRAME_OK",
    "FRAME_REMOTE_OUTSIDE",
    "FRAME_ZERO_LENGTH",
    "LAND_GRANT_NOT_LIVE",
    "LAND_GRANT_OTHER_SOURCE",
    "LAND_NEEDS_GRANT",
    "LAND_OK",
    "LAND_OUTSIDE_GRANT",
    "LAND_OUTSIDE_REGIONS",
    "SERVE_BROKEN",
    "SERVE_CLOSED",
    "SERVE_REFUSED",
    "SERVE_STALLED",
    "SERVE_STOPPED",
    "Sink",
    "SinkConn",
    "ACKS_BAD",
    "ACKS_CLOSED",
    "ACKS_FAILED",
    "ACKS_GOT",
    "ACKS_ORDER",
    "ACKS_TICK",
    "Completions",
    "MAX_MSG",
    "POST_ARRAY",
    "POST_FAILED",
    "POST_FULL",
    "POST_TOO_MANY",
    "POST_SENT",
    "POST_WAKE",
    "Source",
    "frame",
]

FRAME_SIZE = 24  # seq u64, count u32, 0 u32, grant u64
ACK_SIZE = 20  # seq u64, status u32, errno i32, message length u32

FRAME_OK = 0
FRAME_ZERO_LENGTH = 1  # a write of length 0 (checked over the whole batch first)
FRAME_LOCAL_OUTSIDE = 2  # the local range is not inside one local region
FRAME_REMOTE_OUTSIDE = 3  # the remote range is not inside one region of the peer's endpoint

LAND_OK = 0
LAND_OUTSIDE_REGIONS = 1  # EFAULT: outside every region registered at the sink (or length 0)
LAND_NEEDS_GRANT = 2  # EACCES: grant 0, and the region requires one
LAND_GRANT_NOT_LIVE = 3  # EACCES: the grant is revoked or was never given
LAND_GRANT_OTHER_SOURCE = 4  # EACCES: the grant was given to another source
LAND_OUTSIDE_GRANT = 5  # EACCES: outside the grant's ranges

_HEAD = struct.Struct("<QIIQ")
_PAIR = struct.Struct("<QQ")
_ACK = struct.Struct("<QIiI")


def _array(a: Any, dtype: type, ndim: int) -> None:
    """``TypeError`` unless a numpy array; ``ValueError`` unless C-contiguous, aligned, native
    ``dtype`` of ``ndim`` dimensions (``(n, 3)`` when 2): what the compiled twin reads in C."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype or a.ndim != ndim or not (a.flags.c_contiguous and a.flags.aligned) or (ndim == 2 and a.shape[1] != 3):
        raise ValueError(
            f"expected a contiguous {'(n, 3)' if ndim == 2 else '1-d'} array of {np.dtype(dtype).name}, got {a.dtype} {a.shape}"
        )


def _of(value: Any, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{what} must be {kind.__name__}, got {type(value).__name__}")


def _find(starts: list[int], lengths: list[int], addr: int, length: int) -> int:
    """The index of the region holding all of ``[addr, addr + length)``, or -1."""
    i = bisect.bisect_right(starts, addr) - 1
    if i >= 0 and addr + length <= starts[i] + lengths[i]:
        return i
    return -1


def frame(
    batch: np.ndarray,
    grant: int,
    loc_starts: np.ndarray,
    loc_lengths: np.ndarray,
    loc_views: list[memoryview],
    rem_starts: np.ndarray,
    rem_lengths: np.ndarray,
) -> tuple[int, int, list[Any] | None]:
    """Check a batch (a C-contiguous ``(n, 3)`` ``uint64`` array) and build what goes on the wire.

    Returns ``(code, index, bufs)``: ``code`` 0 and ``bufs`` = ``[head, view, view, ...]`` (``head``
    a writable ``memoryview`` of a ``bytearray``: the frame header with seq 0, then the descriptor
    pairs; one local view per write), or a ``FRAME_*`` code, the index of the first write that
    fails it, and None. A zero length anywhere fails first; then, write by write, the local range,
    then the remote one.
    """
    _array(batch, np.uint64, 2)
    for a in (loc_starts, loc_lengths, rem_starts, rem_lengths):
        _array(a, np.uint64, 1)
    _of(loc_views, list, "loc_views")
    if len(loc_lengths) != len(loc_starts) or len(rem_lengths) != len(rem_starts) or len(loc_views) != len(loc_starts):
        raise ValueError("region starts, lengths and views differ in length")
    rows = batch.tolist()
    for i, (_la, _ra, n) in enumerate(rows):
        if n == 0:
            return FRAME_ZERO_LENGTH, i, None
    ls, ll = loc_starts.tolist(), loc_lengths.tolist()
    rs, rl = rem_starts.tolist(), rem_lengths.tolist()
    head = bytearray(FRAME_SIZE + _PAIR.size * len(rows))
    _HEAD.pack_into(head, 0, 0, len(rows), 0, grant)
    bufs: list[Any] = [memoryview(head)]
    for i, (la, ra, n) in enumerate(rows):
        j = _find(ls, ll, la, n)
        if j < 0:
            return FRAME_LOCAL_OUTSIDE, i, None
        if _find(rs, rl, ra, n) < 0:
            return FRAME_REMOTE_OUTSIDE, i, None
        _PAIR.pack_into(head, FRAME_SIZE + _PAIR.size * i, ra, n)
        off = la - ls[j]
        bufs.append(loc_views[j][off : off + n])
    return FRAME_OK, 0, bufs


# ---------------------------------------------------------------------------------------- the sink

SERVE_REFUSED = 0
SERVE_CLOSED = 1  # the peer closed the connection, or it broke (errno in the result)
SERVE_BROKEN = 2  # a frame broke the wire format: the stream cannot be trusted past it
SERVE_STALLED = 3  # the peer sent nothing for ``stall`` seconds mid-frame (or took no ack for that long)
SERVE_STOPPED = 4  # the transport is closing

_IOV_CHUNK = 512  # views per recvmsg_into: below IOV_MAX (1024 on Linux)
_AHEAD = 40  # bytes a sink may read past a payload: the next frame's header and first descriptor
_ACK_GATHER = 16  # acks gathered at most under load
_ACK_GATHER_BYTES = 1 << 20
_DISCARD = 65536
# The most a sink connection keeps in its header buffer between frames: a frame of more writes (up to
# max_writes, 16 MiB of descriptors at the transport's default) grows it while it is read and checked,
# and it shrinks back once the frame is done, as does all else of the frame (the compiled twin's rule;
# see its _KEEP).
_KEEP = 24 + _AHEAD + 4096 * 16  # 64 KiB and a little: a frame of up to 4096 writes
_U64_TOP = 1 << 64
_TICK = (BlockingIOError, TimeoutError)  # a read or send that waited one kernel timeout (SO_RCVTIMEO/SO_SNDTIMEO)


def _u64(value: Any, what: str) -> int:
    """What the compiled twin's ``uint64_t`` argument takes: ``TypeError`` for a non-integer,
    ``OverflowError`` outside [0, 2**64)."""
    if not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}")
    if not 0 <= value < _U64_TOP:
        raise OverflowError(f"{what} {value} is not an unsigned 64-bit value")
    return value


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"seconds must be a number, got {type(value).__name__}")
    return float(value)


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
        return SinkConn(self, sock, acks, source, max_writes, stall)


def _total(desc: bytes) -> int:
    """The payload bytes of a frame: the sum of its lengths, saturated at 2**64 - 1."""
    return min(sum(n for _a, n in _PAIR.iter_unpack(desc[: len(desc) // _PAIR.size * _PAIR.size])), _U64_TOP - 1)


class _End(Exception):
    """How a connection's loop ended: ``(SERVE_*, errno)``."""

    def __init__(self, code: int, err: int = 0) -> None:
        super().__init__(code, err)
        self.result = (code, err)


class SinkConn:
    """One data connection past its handshake (acks go out on ``acks``, its ack connection, or the same
    socket): ``serve()`` runs its loop until a frame is refused (the caller words the ack: ``refuse()``,
    then ``serve()`` again) or the connection ends.

    Per frame: read its header and descriptors; check every write (``Sink`` lock held; on success the
    connection is marked landing through the frame's grant, into its regions); receive the payload
    straight into place (the lock not held), with up to 40 bytes more, the next frame's header and
    first descriptor when they are already there; clear the mark (waking a revoke or deregister that
    waits for it). Acks are gathered: sent when no further frame is already waiting, or after 16
    frames or 1 MiB. Reads and sends wait in ticks of the socket's kernel timeouts; mid-frame, or
    with acks the peer does not take, ``stall`` seconds without a byte end the connection."""

    def __init__(self, sink: Sink, sock: Any, acks: Any, source: bytes, max_writes: int, stall: float) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"sink must be a Sink, got {type(sink).__name__}")
        if sock is None or acks is None:
            raise TypeError("sock and acks must be sockets, got None")
        _of(source, bytes, "source")
        if len(source) != 16:
            raise ValueError(f"a source is 16 bytes, got {len(source)}")
        self._sink, self._sock, self._ack_sock, self._source = sink, sock, acks, source
        self._fd = sock.fileno()
        self._max_writes = _u64(max_writes, "max_writes")
        self._stall = _seconds(stall)
        self._hb = bytearray()  # the current frame's header and descriptors, as read so far
        self._acks: list[bytes] = []
        self._acked_bytes = 0
        self._discard = 0  # payload bytes of a refused frame still to read and drop
        self._landing = False
        self._grant = 0
        self._used: list[int] = []
        self._drained = False  # the last payload read found nothing after it: the socket was empty then
        with sink._cond:
            sink._conns.add(self)
        self._attached = True

    def close(self) -> None:
        """Leave the table (call before closing the socket: a revoke cuts only attached connections)."""
        if not self._attached:
            return
        with self._sink._cond:
            self._sink._conns.discard(self)
            self._attached = False
            if self._landing:
                self._landing = False
                self._sink._cond.notify_all()

    def retained(self) -> int:
        """The bytes this connection's buffers hold (see ``Sink.retained``)."""
        with self._sink._cond:
            return self._held()

    def _held(self) -> int:
        return self._hb.__alloc__() + sum(map(len, list(self._acks))) + 8 * len(self._used)

    def refuse(self, seq: int, err: int, message: bytes, nbytes: int) -> None:
        """Queue the error ack of a refused frame and drop its ``nbytes`` of payload (on the next ``serve()``)."""
        seq = _u64(seq, "seq")
        if not isinstance(err, int):
            raise TypeError(f"err must be an integer, got {type(err).__name__}")
        if not -(1 << 31) <= err < 1 << 31:
            raise OverflowError(f"err {err} is not a 32-bit value")
        _of(message, bytes, "message")
        nbytes = _u64(nbytes, "nbytes")
        if len(message) > 0xFFFFFFFF:
            raise ValueError("an ack message is shorter than 4 GiB")
        self._acks.append(_ACK.pack(seq, 1, err, len(message)) + message)
        self._discard = nbytes
        self._acked_bytes += nbytes  # counted as landed bytes are: the gather bound

    def serve(self) -> tuple[int, ...]:
        """Land frames until one is refused or the connection ends. Returns ``(SERVE_REFUSED, seq, code,
        index, count, addr, length, grant, total)`` for a refused frame (its header and descriptors
        read, its payload not yet: ``refuse()`` drops it), else ``(SERVE_*, errno)``."""
        if not self._attached:
            raise ValueError("serve() on a closed connection")
        try:
            return self._serve()
        except _End as e:
            return e.result

    def _serve(self) -> tuple[int, ...]:
        sock, hb = self._sock, self._hb
        while True:
            if hb.__alloc__() > _KEEP:  # between frames: at most _AHEAD bytes, of the next frame, are in it
                ahead = bytes(hb)
                hb.clear()  # gives the buffer back (a bytearray emptied is shrunk)
                hb += ahead
            if self._discard:
                self._drop()
                if len(self._acks) >= _ACK_GATHER or self._acked_bytes >= _ACK_GATHER_BYTES:
                    self._flush()
            if self._acks and len(hb) < FRAME_SIZE:  # more frames already here? then land them first, ack together
                if not hb and not self._drained:
                    try:
                        more = sock.recv(_AHEAD, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        more = None
                    except OSError as e:
                        raise _End(SERVE_CLOSED, e.errno or 0) from None
                    if more == b"":
                        raise _End(SERVE_CLOSED)
                    if more:
                        hb += more
                if not hb:
                    self._flush()
            if len(hb) < FRAME_SIZE:
                # a frame's first 40 bytes are never payload: its header and first descriptor, or (a frame
                # without writes) its header and the next frame's first bytes
                self._read_some(FRAME_SIZE)
            seq, count, _, grant = _HEAD.unpack_from(hb)
            if count > self._max_writes:
                raise _End(SERVE_BROKEN)
            need = FRAME_SIZE + _PAIR.size * count
            if len(hb) < need:
                hb += self._read(need - len(hb))
            desc = bytes(hb[FRAME_SIZE:need])
            self._drained = False
            used: list[int] = []
            with self._sink._cond:
                code, index, views = self._sink._check(desc, grant, self._source, used)
                if code == LAND_OK:
                    self._landing, self._grant, self._used = True, grant, used
            if code:
                hb.clear()  # a frame with writes: its descriptors end what was read ahead
                addr, length = _PAIR.unpack_from(desc, _PAIR.size * index)
                return SERVE_REFUSED, seq, code, index, count, addr, length, grant, _total(desc)
            total = 0
            if count:
                hb.clear()
                try:
                    total = self._payload(views)  # type: ignore[arg-type]  # views is set when code is LAND_OK
                finally:
                    self._landed()
            else:
                self._landed()
                del hb[:FRAME_SIZE]  # what came after the header is the next frame's
            # done with the frame: its descriptors and views (some 200 bytes a write) must not stay
            # alive while the loop waits for the next one
            del desc, views
            self._acks.append(_ACK.pack(seq, 0, 0, 0))
            self._acked_bytes += total
            if len(self._acks) >= _ACK_GATHER or self._acked_bytes >= _ACK_GATHER_BYTES:
                self._flush()

    def _tick(self, last: float, idle: bool) -> None:
        """A read or send waited one kernel timeout: go on, or end the connection."""
        with self._sink._cond:
            stopped = self._sink._stopped
        if stopped:
            raise _End(SERVE_STOPPED)
        if not idle and time.monotonic() - last >= self._stall:
            raise _End(SERVE_STALLED)

    def _read_some(self, want: int) -> None:
        """Read until ``hb`` holds ``want`` (<= ``_AHEAD``) bytes, taking up to ``_AHEAD``; with nothing
        of the frame here yet, wait without the stall rule."""
        hb = self._hb
        last = time.monotonic()
        while len(hb) < want:
            try:
                more = self._sock.recv(_AHEAD - len(hb))
            except _TICK:
                self._tick(last, not hb)
                continue
            except OSError as e:
                raise _End(SERVE_CLOSED, e.errno or 0) from None
            if not more:
                raise _End(SERVE_CLOSED)
            hb += more
            last = time.monotonic()

    def _read(self, n: int) -> bytes:
        """Receive exactly ``n`` bytes (mid-frame: the stall rule applies)."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        last = time.monotonic()
        while got < n:
            try:
                k = self._sock.recv_into(view[got:])
            except _TICK:
                self._tick(last, False)
                continue
            except OSError as e:
                raise _End(SERVE_CLOSED, e.errno or 0) from None
            if not k:
                raise _End(SERVE_CLOSED)
            got += k
            last = time.monotonic()
        return bytes(buf)

    def _flush(self) -> None:
        """Send the gathered acks."""
        data = memoryview(b"".join(self._acks))
        last = time.monotonic()
        while data:
            try:
                k = self._ack_sock.send(data, socket.MSG_NOSIGNAL)
            except _TICK:
                self._tick(last, False)
                continue
            except OSError as e:
                raise _End(SERVE_CLOSED, e.errno or 0) from None
            data = data[k:]
            last = time.monotonic()
        self._acks.clear()
        self._acked_bytes = 0

    def _drop(self) -> None:
        """Receive and drop the payload of a refused frame (the stream keeps its place)."""
        scratch = memoryview(bytearray(min(self._discard, _DISCARD)))
        last = time.monotonic()
        while self._discard:
            try:
                k = self._sock.recv_into(scratch[: min(self._discard, _DISCARD)])
            except _TICK:
                self._tick(last, False)
                continue
            except OSError as e:
                raise _End(SERVE_CLOSED, e.errno or 0) from None
            if not k:
                raise _End(SERVE_CLOSED)
            self._discard -= k
            last = time.monotonic()

    def _landed(self) -> None:
        """Clear the landing mark; wake a revoke or deregister waiting for it."""
        with self._sink._cond:
            self._landing, self._grant, self._used = False, 0, []
            self._sink._cond.notify_all()

    def _payload(self, views: list[Any]) -> int:
        """Receive the payload of a checked frame into place (``views``, one per write), with up to
        ``_AHEAD`` bytes after it into ``hb``. Returns the payload size."""
        total = sum(len(v) for v in views)
        i, n = 0, len(views)
        tail = memoryview(bytearray(_AHEAD))
        last = time.monotonic()
        while i < n:
            chunk = views[i : i + _IOV_CHUNK]
            ends = i + len(chunk) == n
            try:
                got = self._sock.recvmsg_into([*chunk, tail] if ends else chunk)[0]
            except _TICK:
                self._tick(last, False)
                continue
            except OSError as e:
                raise _End(SERVE_CLOSED, e.errno or 0) from None
            if not got:
                raise _End(SERVE_CLOSED)
            last = time.monotonic()
            while got and i < n:
                v = views[i]
                if got >= len(v):
                    got -= len(v)
                    i += 1
                else:
                    views[i] = v[got:]
                    got = 0
            if got:  # past the payload: the next frame's first bytes
                self._hb += tail[:got]
        # A read returns what is there up to what it asks: no byte past the payload means none was
        # there (with bytes to spare it would have filled the tail).
        self._drained = not self._hb
        return total


# -------------------------------------------------------------------------------------- the source

POST_SENT = 0  # posted: on the wire, or queued behind a send in progress that will take it
POST_WAKE = 4  # posted: the sender thread must send the rest (the socket was full)
POST_FULL = 5  # not posted: max_inflight batches in flight
POST_FAILED = 6  # not posted: the peer failed or was disconnected
POST_ARRAY = 7  # not posted: the batch is not a C-contiguous (n, 3) uint64 numpy array (as_batch makes one)
POST_TOO_MANY = 8  # not posted: more writes than max_writes
ACKS_GOT = 0  # acks completed batches with callbacks: callbacks() has them
ACKS_TICK = 1  # the read waited one kernel timeout
ACKS_CLOSED = 2  # the peer closed the connection, or it broke (errno in ``err``)
ACKS_BAD = 3  # an ack's message is longer than the bound (its length in the result)
ACKS_ORDER = 4  # an ack for another batch than the oldest in flight (its seq in the result)
ACKS_FAILED = 5  # the peer failed meanwhile (fail() completed what was left)
MAX_MSG = 4096  # the longest ack message a source accepts

_SEND_GATHER = 2048  # buffers of queued frames taken for one send at most (sent _IOV_CHUNK at a time)
_ACK_BUF = 65536
_TICKED = -1  # a send waited one kernel timeout (or would block)
_GONE = -3  # the peer failed while a send was under way


class _Frame:
    """One posted batch: its head and payload as buffers (the header and descriptors, then each
    write's local range), its place in line, and how it completes."""

    __slots__ = ("seq", "batch_id", "on_done", "callback", "bufs", "nbytes", "src", "status", "err", "msg", "error")

    def __init__(self, batch_id: Any, on_done: Any, bufs: list[Any], src: Source) -> None:
        self.seq = 0
        self.batch_id, self.on_done, self.bufs, self.src = batch_id, on_done, bufs, src
        self.callback = on_done is not None  # completed through on_done (else through the Completions queue)
        self.nbytes = sum(len(b) for b in bufs)
        self.status = self.err = 0  # its ack: status, errno and message of a refused batch
        self.msg = b""
        self.error: Any = None  # the failure it completes with (fail())


class Completions:
    """The completions of batches written without ``on_done``, oldest first, across a transport's
    peers, behind a lock: a source's ack loop adds to it. A batch keeps its in-flight slot until
    ``take`` hands its completion out (the queue stays bounded by the slots). ``make(batch_id,
    error)`` builds what ``take`` returns; ``refused(status, errno, message)`` the error of a batch
    the sink refused."""

    def __init__(self, make: Any, refused: Any) -> None:
        if make is None or refused is None:
            raise TypeError("make and refused must be callables, got None")
        self._cond = threading.Condition()
        self._done: deque[_Frame] = deque()
        self._waiters = 0
        self._make, self._refused = make, refused

    def __len__(self) -> int:
        return len(self._done)

    def _push(self, frames: list[_Frame]) -> None:
        """Queue completed frames; wake the waiters."""
        with self._cond:
            self._done.extend(frames)
            if self._waiters:
                self._cond.notify_all()

    def take(self, max_items: int) -> list[Any]:
        """Up to ``max_items`` completions, oldest first; their slots go back to their peers (whose
        ``on_slot`` runs when a writer waits for one)."""
        if not isinstance(max_items, int):
            raise TypeError(f"max_items must be an integer, got {type(max_items).__name__}")
        with self._cond:
            got = [self._done.popleft() for _ in range(min(max(max_items, 0), len(self._done)))]
        out: list[Any] = []
        woken: Source | None = None
        for f in got:
            if f.error is not None:
                error = f.error
            elif f.status:
                error = self._refused(f.status, f.err, f.msg)
            else:
                error = None
            out.append(self._make(f.batch_id, error))
            src = f.src
            with src._mu:
                src.slots -= 1
            if src.waiters and src is not woken:
                if woken is not None:
                    woken.on_slot()
                woken = src
        if woken is not None:
            woken.on_slot()
        return out

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a completion to take; True if one is there."""
        seconds = _seconds(seconds)
        with self._cond:
            self._waiters += 1
            try:
                self._cond.wait_for(lambda: self._done, timeout=max(seconds, 0.0))
            finally:
                self._waiters -= 1
            return bool(self._done)


class Source:
    """One connected peer's batches, from ``post`` to their completion: their seq, the in-flight
    slots, the frames not yet sent and those awaiting acks, and the ack stream.

    Locking: the frame lists (queued, in flight, completed with a callback not yet called) and the
    failed flag are behind a lock, which the ack loop (``acks``) takes to complete frames and every
    other method takes to change them; the rest changes as the compiled twin's does with the GIL
    held. The syscalls (``sendmsg`` of heads and payloads straight from registered memory, ``recv``
    of acks) work on what only the caller owns meanwhile: the frames a send is using stay
    referenced by it, and a socket is closed only once no send is under way (``close``).

    Threads: any writer (``post``; the first that finds nobody sending sends its frame itself,
    without waiting, and any queued behind it), one sender thread (``send_blocking``: what a full
    socket left over) and one ack reader (``acks``, ``callbacks``, ``idle``)."""

    def __init__(self, sock: Any, ack_sock: Any, max_inflight: int, max_writes: int, refused: Any) -> None:
        if sock is None or ack_sock is None or refused is None:
            raise TypeError("sock, ack_sock and refused must not be None")
        if not isinstance(max_inflight, int) or not isinstance(max_writes, int):
            raise TypeError("max_inflight and max_writes must be integers")
        self._sock, self._ack_sock = sock, ack_sock
        sock.fileno(), ack_sock.fileno()
        self._max_inflight = max_inflight
        self._max_writes = max_writes
        self._refused = refused
        self.slots = 0  # batches posted and not yet completed (queue mode: not yet taken)
        self.waiters = 0  # writers waiting for a slot: notify them (on_slot) when one frees
        self.on_slot: Any = None
        self.index = 0  # the failing write of the last post refused with a FRAME_* code
        self.err = 0  # errno of the last ACKS_CLOSED
        self._mu = threading.Lock()
        self._seq = 0
        self._unsent: deque[_Frame] = deque()  # posted, not yet taken by a send: oldest first
        self._flight: deque[_Frame] = deque()  # taken by a send (sent, or being sent): oldest first, acked in this order
        self._called: deque[_Frame] = deque()  # completed by acks, their callbacks not yet called
        self._nflight = 0
        self._failed = False
        self._sending = False  # a thread is sending (a writer, or the sender thread)
        self._closing = False
        self._closed = False
        self._out: list[_Frame] | None = None  # the frames of the send in progress (or its remainder)
        self._out_i = 0
        self._out_off = 0
        self.last_progress = time.monotonic()  # the last byte sent or ack taken
        self._last_byte = self.last_progress  # the last ack byte received
        self._abuf = bytearray(_ACK_BUF)
        self._aview = memoryview(self._abuf)
        self._astart = self._aend = 0
        self._detail = 0

    @property
    def in_flight(self) -> int:
        """Batches posted and not completed (queued, being sent, or awaiting their ack)."""
        return self._nflight

    @property
    def failed(self) -> bool:
        return self._failed

    def has_work(self) -> bool:
        """The sender thread's cue: nobody is sending, and something is left to send."""
        with self._mu:
            return not self._sending and (self._out is not None or bool(self._unsent))

    def post(self, batch: Any, grant: int, on_done: Any, ids: Any, loc_starts: np.ndarray,
             loc_lengths: np.ndarray, loc_views: list[Any], rem_starts: np.ndarray, rem_lengths: np.ndarray) -> tuple[int, Any]:
        """Check a batch (``POST_ARRAY`` unless it is a C-contiguous ``(n, 3)`` ``uint64`` numpy array,
        ``POST_TOO_MANY`` past ``max_writes``, then ``frame``'s checks and codes, the failing write's
        index in ``index``), take a slot, give it the next seq and the next batch id from ``ids`` (both
        at once: a peer's ids go up in the order its frames go out) and post it. Returns ``(code,
        batch id or None)``: ``POST_SENT``, ``POST_WAKE`` (wake the sender thread), ``POST_FULL``,
        ``POST_FAILED`` or a ``FRAME_*`` code. A writer that finds nobody sending sends it (and what
        queues behind it meanwhile) with ``MSG_DONTWAIT``."""
        if (type(batch) is not np.ndarray or batch.dtype != np.uint64 or batch.ndim != 2 or batch.shape[1] != 3
                or not (batch.flags.c_contiguous and batch.flags.aligned)):
            return POST_ARRAY, None
        if len(batch) > self._max_writes:
            return POST_TOO_MANY, None
        grant = _u64(grant, "grant")
        code, index, bufs = frame(batch, grant, loc_starts, loc_lengths, loc_views, rem_starts, rem_lengths)
        if bufs is None:
            self.index = index
            return code, None
        if self._failed:
            return POST_FAILED, None
        with self._mu:  # the slot counter changes under the lock (a thread may switch between any two steps)
            if self.slots >= self._max_inflight:
                return POST_FULL, None
            self.slots += 1
        f = _Frame(None, on_done, bufs, self)
        with self._mu:
            if self._failed:  # (it failed while the frame was built)
                self.slots -= 1
                return POST_FAILED, None
            try:
                f.batch_id = batch_id = next(ids)
            except BaseException:
                self.slots -= 1
                raise
            self._seq += 1
            f.seq = self._seq
            _HEAD.pack_into(bufs[0], 0, self._seq, len(bufs) - 1, 0, grant)
            if not self._nflight:
                self.last_progress = time.monotonic()
            self._nflight += 1
            self._unsent.append(f)
            if self._sending or self._out is not None:
                return POST_SENT, batch_id  # the thread sending takes it next (the sender thread is awake for a remainder)
            self._sending = True
        while True:
            code = self._pump(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            if self._sent(code):
                break
        if code == 0 or self._failed:
            return POST_SENT, batch_id  # (a batch of a peer that failed meanwhile completed with the failure)
        return POST_WAKE, batch_id  # the socket is full (or broke: the sender thread meets the error too)

    def _sent(self, code: int) -> bool:
        """A send returned ``code``: ``sending`` off (True), unless all went out and frames were queued
        meanwhile (False: the caller sends those too; their writers left them to it). A failure or a
        close that came meanwhile takes effect now. Under the lock, with the check: a frame queued
        after it sees ``sending`` off and sends itself."""
        with self._mu:
            if code == 0 and self._unsent and not self._failed:
                return False
            self._sending = False
            if self._failed:
                self._out = None
            closing = self._closing
        if closing:
            self._close()
        return True

    def _close(self) -> None:
        self._closed = True
        for s in (self._sock, self._ack_sock):
            try:
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        """Fail the peer (see ``fail``; call that first to complete its batches) and close its sockets, at
        once or, if a writer is sending, as its send returns: a descriptor is never closed (and maybe
        reused) under a send. Call after the sender and ack threads ended."""
        with self._mu:
            self._failed = True
            self._closing = True
            sending = self._sending
        if not sending:
            self._close()

    def _take(self) -> None:
        """Move queued frames (up to ``_SEND_GATHER`` buffers) in line for acks, as the next send's ``out``."""
        out: list[_Frame] = []
        nbufs = 0
        with self._mu:
            while self._unsent and (not out or nbufs + len(self._unsent[0].bufs) <= _SEND_GATHER):
                f = self._unsent.popleft()
                self._flight.append(f)
                out.append(f)
                nbufs += len(f.bufs)
        self._out, self._out_i, self._out_off = out, 0, 0

    def _pump(self, flags: int) -> int:
        """Send ``out`` and then every queued frame: 0 once all went out, ``_TICKED`` when the socket
        took no more (``MSG_DONTWAIT``, or a kernel timeout), ``_GONE`` if the peer failed meanwhile,
        else the errno. Holds ``sending``."""
        while True:
            if self._failed:
                return _GONE
            if self._out is None:
                if not self._unsent:
                    return 0
                self._take()
                if not self._out:
                    self._out = None
                    continue
            out = self._out
            views: list[Any] = []
            off = self._out_off
            for f in out[self._out_i :]:
                for b in f.bufs:
                    if off >= len(b):
                        off -= len(b)
                        continue
                    views.append(b[off:] if off else b)
                    off = 0
                    if len(views) == _IOV_CHUNK:
                        break
                if len(views) == _IOV_CHUNK:
                    break
            try:
                k = self._sock.sendmsg(views, [], flags)
            except _TICK:
                return _TICKED
            except OSError as e:
                return e.errno or 0
            if k > 0:
                self.last_progress = time.monotonic()
            while k and self._out is not None:
                f = self._out[self._out_i]
                if k >= f.nbytes - self._out_off:
                    k -= f.nbytes - self._out_off
                    self._out_i += 1
                    self._out_off = 0
                    if self._out_i == len(self._out):
                        self._out = None
                else:
                    self._out_off += k
                    k = 0

    def send_blocking(self) -> int:
        """The sender thread's turn: send the remainder and every queued frame, blocking in ticks of the
        socket's kernel timeout. 0 once all went out, -1 if the peer failed meanwhile, else the errno of
        a send that broke; 0 at once if another thread is sending (it sends what is left)."""
        with self._mu:
            if self._sending:
                return 0
            self._sending = True
        r = _GONE
        try:
            while True:
                r = self._pump(socket.MSG_NOSIGNAL)
                if r != _TICKED and self._sent(r):
                    break
        except BaseException:
            self._sent(_GONE)
            raise
        return -1 if r == _GONE else r

    def acks(self, queue: Completions) -> tuple[int, int]:
        """The ack loop: receive acks and complete the frames in flight they name, oldest first; a batch
        without ``on_done`` goes to ``queue`` (keeping its slot until taken). Returns ``(code, detail)``
        when the caller has something to do: ``ACKS_GOT`` (batches with ``on_done`` completed:
        ``callbacks()`` has them), ``ACKS_TICK`` (a kernel timeout passed), ``ACKS_CLOSED`` (errno in
        ``err``), ``ACKS_BAD`` / ``ACKS_ORDER`` (the message length / seq of the ack that broke the
        stream; the acks before it completed), ``ACKS_FAILED``."""
        if not isinstance(queue, Completions):
            raise TypeError(f"queue must be a Completions, got {type(queue).__name__}")
        if self._closed:
            return ACKS_CLOSED, 0
        while True:
            queued: list[_Frame] = []
            called = False
            broke = 0
            now = time.monotonic()
            with self._mu:
                while self._aend - self._astart >= ACK_SIZE and not self._failed:
                    seq, status, err, n = _ACK.unpack_from(self._abuf, self._astart)
                    if n > MAX_MSG:
                        self._detail, broke = n, ACKS_BAD
                        break
                    if self._aend - self._astart < ACK_SIZE + n:
                        break
                    if not self._flight or self._flight[0].seq != seq:
                        self._detail, broke = seq, ACKS_ORDER
                        break
                    f = self._flight.popleft()
                    self._nflight -= 1
                    f.status, f.err = status, err
                    if status and n:
                        f.msg = bytes(self._abuf[self._astart + ACK_SIZE : self._astart + ACK_SIZE + n])
                    self._astart += ACK_SIZE + n
                    self.last_progress = now
                    if f.callback:
                        self._called.append(f)
                        called = True
                    else:
                        queued.append(f)
                if queued:
                    queue._push(queued)  # under our lock: before any frame fail() queues after them
                failed = self._failed
            if failed:
                return ACKS_FAILED, self._detail
            if broke:
                return broke, self._detail
            if called:
                return ACKS_GOT, self._detail
            if self._astart == self._aend:
                self._astart = self._aend = 0
            elif _ACK_BUF - self._aend < ACK_SIZE + MAX_MSG:
                rest = self._aend - self._astart
                self._abuf[:rest] = self._abuf[self._astart : self._aend]
                self._astart, self._aend = 0, rest
            try:
                k = self._ack_sock.recv_into(self._aview[self._aend :])
            except _TICK:
                return ACKS_TICK, self._detail
            except OSError as e:
                self.err = e.errno or 0
                return ACKS_CLOSED, self._detail
            if k == 0:
                self.err = 0
                return ACKS_CLOSED, self._detail
            self._aend += k
            self._last_byte = time.monotonic()

    def callbacks(self) -> list[Any]:
        """The batches with ``on_done`` that acks completed, oldest first, as ``(on_done, batch_id,
        error)``; their slots come back."""
        with self._mu:
            got = list(self._called)
            self._called.clear()
        return self._calls(got)

    def _calls(self, got: list[_Frame]) -> list[Any]:
        out: list[Any] = []
        for f in got:
            if f.error is not None:
                error = f.error
            elif f.status:
                error = self._refused(f.status, f.err, f.msg)
            else:
                error = None
            out.append((f.on_done, f.batch_id, error))
            with self._mu:
                self.slots -= 1
        return out

    def idle(self, stall: float) -> int:
        """On a tick of the ack reader: 0, or 1 if part of an ack came and nothing more for ``stall``
        seconds, or 2 if batches are in flight and nothing progressed for ``stall`` seconds."""
        stall = _seconds(stall)
        now = time.monotonic()
        if self._astart != self._aend:
            return 1 if now - self._last_byte >= stall else 0
        if self._nflight and now - self.last_progress > stall:
            return 2
        return 0

    def fail(self, queue: Completions, error: Any) -> list[Any]:
        """The peer failed: no more posts; every batch in flight completes with ``error``, oldest
        first: those without ``on_done`` go to ``queue``, and ``(on_done, batch_id, error)`` of the
        others is returned, after those acks completed whose callbacks were not taken yet. Idempotent:
        a second call finds nothing left."""
        if not isinstance(queue, Completions):
            raise TypeError(f"queue must be a Completions, got {type(queue).__name__}")
        called: list[_Frame] = []
        queued: list[_Frame] = []
        with self._mu:
            self._failed = True
            if not self._sending:
                self._out = None  # a sender holds it until its send returns
            called.extend(self._called)
            self._called.clear()
            left = [*self._flight, *self._unsent]
            self._flight.clear()
            self._unsent.clear()
            self._nflight = 0
            for f in left:
                f.error = error
                (called if f.callback else queued).append(f)
            if queued:
                queue._push(queued)  # under our lock: after every frame the ack loop queued
        return self._calls(called)
