"""Per-batch work of the TCP transport, pure-Python twin of ``transport._tcp_fast`` (same names,
signatures, results and errors; ``transport.tcp`` chooses, like ``transport.plan``).

Three pure functions, no I/O and no locks (the caller holds what it needs):

- ``frame`` (source): check a batch against the local and the remote regions and build its frame
  head (header with seq 0, then the descriptor pairs) and the payload views, in one pass.
- ``check_frame`` (sink): check every write of a received frame against the sink's regions and
  the grant it names, before a byte lands; on success, the views to receive the payload into.
- ``parse_acks`` (source): every whole ack in a buffer.

Regions are given as a snapshot: ``starts`` and ``lengths`` (``uint64`` arrays sorted by start,
not overlapping), and per region its view (a writable ``memoryview`` of all of it), its key and
whether it requires a grant (``guarded``, ``uint8``). Every array is a C-contiguous, aligned,
native-order numpy array (``ValueError`` otherwise; ``TypeError`` for what is not an array, or not
the ``bytes``/``bytearray``/``list`` asked for). Result codes, not messages: ``transport.tcp``
words the errors, so both twins give the same ones.
"""

from __future__ import annotations

import bisect
import struct
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
    "check_frame",
    "frame",
    "parse_acks",
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


def check_frame(
    desc: bytes,
    starts: np.ndarray,
    lengths: np.ndarray,
    guarded: np.ndarray,
    keys: list[int],
    views: list[memoryview],
    grant: int,
    grant_state: int,
    grant_starts: np.ndarray,
    grant_lengths: np.ndarray,
) -> tuple[int, int, int, list[memoryview] | None, list[int] | None]:
    """Check every write of a frame (``desc``: its ``(addr u64, length u64)`` pairs) before any lands.

    A write must lie inside one region; with ``grant`` 0 that region must not be guarded; with a
    grant, ``grant_state`` must be ``LAND_OK`` (else it is the code to fail with: the caller looked
    the grant up) and the write must lie inside one of the grant's ranges (``grant_starts``,
    ``grant_lengths``: sorted, not overlapping). Returns ``(code, index, total, views, keys)``:
    ``LAND_OK``, 0, the payload size, one view per write to receive into, and the keys of the
    regions written (each once, in order of first use); or a ``LAND_*`` code, the index of the
    first write that fails it, 0, None, None.
    """
    _of(desc, bytes, "desc")
    for a in (starts, lengths, grant_starts, grant_lengths):
        _array(a, np.uint64, 1)
    _array(guarded, np.uint8, 1)
    _of(keys, list, "keys")
    _of(views, list, "views")
    n = len(starts)
    if len(lengths) != n or len(guarded) != n or len(keys) != n or len(views) != n or len(grant_lengths) != len(grant_starts):
        raise ValueError("region starts, lengths, flags, keys and views differ in length")
    rs, rl = starts.tolist(), lengths.tolist()
    gs, gl = grant_starts.tolist(), grant_lengths.tolist()
    out: list[memoryview] = []
    used: list[int] = []
    total = 0
    last = -1
    for i in range(len(desc) // _PAIR.size):  # a trailing partial pair is ignored, as by the compiled twin
        addr, length = _PAIR.unpack_from(desc, _PAIR.size * i)
        if last < 0 or not length or not (rs[last] <= addr and addr + length <= rs[last] + rl[last]):
            last = _find(rs, rl, addr, length) if length else -1
            if last < 0:
                return LAND_OUTSIDE_REGIONS, i, 0, None, None
            if not grant and guarded[last]:
                return LAND_NEEDS_GRANT, i, 0, None, None
            if keys[last] not in used:
                used.append(keys[last])
        if grant:
            if grant_state:
                return grant_state, i, 0, None, None
            if _find(gs, gl, addr, length) < 0:
                return LAND_OUTSIDE_GRANT, i, 0, None, None
        off = addr - rs[last]
        out.append(views[last][off : off + length])
        total += length
    return LAND_OK, 0, total, out, used


def parse_acks(buf: Any, start: int, end: int, max_msg: int) -> tuple[list[tuple[int, int, int, bytes]], int, int]:
    """Every whole ack in ``buf[start:end]``: ``(acks, new start, bad)``; each ack is ``(seq, status,
    errno, message bytes)``. ``bad`` is the message length of an ack whose message is longer than
    ``max_msg`` (parsing stops before it; the acks before it are returned), else 0."""
    _of(buf, bytearray, "buf")
    if start < 0 or end > len(buf) or start > end:
        raise ValueError(f"[{start}, {end}) is not inside a buffer of {len(buf)} bytes")
    out: list[tuple[int, int, int, bytes]] = []
    while end - start >= ACK_SIZE:
        seq, status, err, n = _ACK.unpack_from(buf, start)
        if n > max_msg:
            return out, start, n
        if end - start < ACK_SIZE + n:
            break
        out.append((seq, status, err, bytes(buf[start + ACK_SIZE : start + ACK_SIZE + n])))
        start += ACK_SIZE + n
    return out, start, 0
