"""The pure twin's batch checks and frame head (``frame``), and the argument checks and wire formats
that its sink and source modules share: part of ``transport._tcp_fast_py``, which re-exports it (see
there for the contract). A pure function, no I/O and no locks: the source's ``Source.post`` calls
``frame`` for its checks and head, so the two cannot check differently.
"""

from __future__ import annotations

import bisect
import struct
from typing import Any

import numpy as np

from .limits import MAX_NOTE

FRAME_SIZE = 24  # seq u64, count u32, note length u32, grant u64 (the note follows the descriptors)
ACK_SIZE = 20  # seq u64, status u32, errno i32, message length u32

FRAME_OK = 0
FRAME_ZERO_LENGTH = 1  # a write of length 0 (checked over the whole batch first)
FRAME_LOCAL_OUTSIDE = 2  # the local range is not inside one local region
FRAME_REMOTE_OUTSIDE = 3  # the remote range is not inside one region of the peer's endpoint

_HEAD = struct.Struct("<QIIQ")
_SEQ = struct.Struct("<Q")  # a frame head's first field, written once the frame has its seq
_PAIR = struct.Struct("<QQ")
_ACK = struct.Struct("<QIiI")

_IOV_CHUNK = 512  # buffers per recvmsg_into or sendmsg: below IOV_MAX (1024 on Linux)
_U64_TOP = 1 << 64
_TICK = (BlockingIOError, TimeoutError)  # a read or send that waited one kernel timeout (SO_RCVTIMEO/SO_SNDTIMEO)


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
    """``TypeError`` unless ``value`` is a ``kind``: what the compiled twin's typed argument refuses."""
    if not isinstance(value, kind):
        raise TypeError(f"{what} must be {kind.__name__}, got {type(value).__name__}")


def _find(starts: list[int], lengths: list[int], addr: int, length: int) -> int:
    """The index of the region holding all of ``[addr, addr + length)``, or -1."""
    i = bisect.bisect_right(starts, addr) - 1
    if i >= 0 and addr + length <= starts[i] + lengths[i]:
        return i
    return -1


def _u64(value: Any, what: str) -> int:
    """What the compiled twin's ``uint64_t`` argument takes: ``TypeError`` for a non-integer,
    ``OverflowError`` outside [0, 2**64)."""
    if not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}")
    if not 0 <= value < _U64_TOP:
        raise OverflowError(f"{what} {value} is not an unsigned 64-bit value")
    return value


def _seconds(value: Any) -> float:
    """What the compiled twin's ``double`` argument takes: a number (not a bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"seconds must be a number, got {type(value).__name__}")
    return float(value)


def _check_note(note: bytes, n: int, grant: int) -> None:
    """``ValueError`` unless ``note`` may ride a frame of ``n`` writes through ``grant``: a sink breaks
    the connection on any other (``transport.tcp`` words the caller's error first)."""
    if not note:
        return
    if len(note) > MAX_NOTE:
        raise ValueError(f"a note holds at most {MAX_NOTE} bytes, got {len(note)}")
    if n == 0:
        raise ValueError("a note rides a frame of at least one write")
    if grant == 0:
        raise ValueError("a note rides a frame through a grant (grant 0)")


def frame(
    batch: np.ndarray,
    grant: int,
    loc_starts: np.ndarray,
    loc_lengths: np.ndarray,
    loc_views: list[memoryview],
    rem_starts: np.ndarray,
    rem_lengths: np.ndarray,
    note: bytes = b"",
) -> tuple[int, int, list[Any] | None]:
    """Check a batch (a C-contiguous ``(n, 3)`` ``uint64`` array) and its ``note`` (``ValueError``:
    longer than ``MAX_NOTE``, or on a frame without writes or without a grant) and build what goes on
    the wire.

    Returns ``(code, index, bufs)``: ``code`` 0 and ``bufs`` = ``[head, view, view, ...]`` (``head``
    a writable ``memoryview`` of a ``bytearray``: the frame header with seq 0, then the descriptor
    pairs, then the note; one local view per write), or a ``FRAME_*`` code, the index of the first
    write that fails it, and None. A zero length anywhere fails first; then, write by write, the
    local range, then the remote one.
    """
    _array(batch, np.uint64, 2)
    for a in (loc_starts, loc_lengths, rem_starts, rem_lengths):
        _array(a, np.uint64, 1)
    _of(loc_views, list, "loc_views")
    if len(loc_lengths) != len(loc_starts) or len(rem_lengths) != len(rem_starts) or len(loc_views) != len(loc_starts):
        raise ValueError("region starts, lengths and views differ in length")
    _of(note, bytes, "note")
    _check_note(note, len(batch), grant)
    rows = batch.tolist()
    for i, (_la, _ra, n) in enumerate(rows):
        if n == 0:
            return FRAME_ZERO_LENGTH, i, None
    ls, ll = loc_starts.tolist(), loc_lengths.tolist()
    rs, rl = rem_starts.tolist(), rem_lengths.tolist()
    head = bytearray(FRAME_SIZE + _PAIR.size * len(rows) + len(note))
    _HEAD.pack_into(head, 0, 0, len(rows), len(note), grant)
    head[FRAME_SIZE + _PAIR.size * len(rows) :] = note
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

