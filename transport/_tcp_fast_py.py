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
- ``SinkConn``: one connection's loop (``serve``): read a frame (and its note), check it, receive its
  payload into place, ack; it returns to the caller only to have a refused frame's ack worded
  (``refuse``), to hand on a landed frame's note (``SERVE_NOTED``, before its ack goes out), or when
  the connection ends.

The twin is written in rooms, each a module of its own that this one re-exports (every name the
twin loader, ``transport.tcp`` and the tests use is importable from here): ``_tcp_fast_frame_py``
(``frame``, the argument checks and wire formats the others share), ``_tcp_fast_sink_py``
(``Sink``), ``_tcp_fast_sinkconn_py`` (``SinkConn``), ``_tcp_fast_completions_py`` (``Completions``)
and ``_tcp_fast_source_py`` (``Source``), as the compiled twin's ``.pxi`` rooms are.

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

from ._tcp_fast_completions_py import Completions
from ._tcp_fast_frame_py import (
    ACK_SIZE,
    FRAME_LOCAL_OUTSIDE,
    FRAME_OK,
    FRAME_REMOTE_OUTSIDE,
    FRAME_SIZE,
    FRAME_ZERO_LENGTH,
    MAX_NOTE,
    frame,
)
from ._tcp_fast_sink_py import (
    LAND_GRANT_NOT_LIVE,
    LAND_GRANT_OTHER_SOURCE,
    LAND_NEEDS_GRANT,
    LAND_OK,
    LAND_OUTSIDE_GRANT,
    LAND_OUTSIDE_REGIONS,
    Sink,
)
from ._tcp_fast_sinkconn_py import (SERVE_BROKEN, SERVE_CLOSED, SERVE_NOTED, SERVE_REFUSED, SERVE_STALLED, SERVE_STOPPED,
                                    SinkConn)
from ._tcp_fast_source_py import (
    ACKS_BAD,
    ACKS_CLOSED,
    ACKS_FAILED,
    ACKS_GOT,
    ACKS_ORDER,
    ACKS_TICK,
    MAX_MSG,
    POST_ARRAY,
    POST_FAILED,
    POST_FULL,
    POST_SENT,
    POST_TOO_MANY,
    POST_WAKE,
    Source,
)

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
    "MAX_NOTE",
    "SERVE_BROKEN",
    "SERVE_NOTED",
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
