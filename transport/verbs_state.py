"""What the rooms of the verbs transport share: a connection's state on either side, and the fields
of the transport itself, by the lock that guards each.

``VerbsTransport`` (``transport/verbs.py``) is one object composed of rooms, each a class of its own
module: the source side (``transport/verbs_source.py``: connect, write, completions), the sink's
side of the handshake (``transport/verbs_sink.py``) and its grants (``transport/verbs_grants.py``).
They share one set of fields, set by ``VerbsTransport.__init__`` and declared here once, so that a
room reads as what it does with them, and a type checker sees every room use the same field the
same way. A step one room takes for another (the cm thread's inbox, killing a sink QP, a grant
snapshot for a reply) is declared here too, and defined by the room whose idea it is.
"""

from __future__ import annotations

import abc
import itertools
import socket
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .base import (
    AcceptBackoff,
    AuthFailures,
    CompletionQueue,
    Grant,
    GrantTable,
    PeerHandle,
    RegionTable,
    Transport,
)
from .errors import TransportError
from .verbs_device import Device
from .verbs_qp import SendQueue, to_rts
from .verbs_regions import MemoryRegions, Window, WindowOps
from .windows import FrameReader, SourceWindows

__all__ = ["SinkConn", "VerbsPeer", "VerbsState"]


@dataclass(eq=False, slots=True)
class VerbsPeer(PeerHandle):
    """A sink as its source sees it: the queue pair's send side, the liveness socket, what the sink granted."""

    sq: SendQueue | None = None  # the QP's send side; guarded by ``lock``, None once the peer failed
    sock: socket.socket | None = None
    lock: threading.Condition = field(default_factory=threading.Condition)
    deliver: threading.RLock = field(default_factory=threading.RLock)
    slots: int = 0  # batches holding an in-flight slot
    error: TransportError | None = None
    last_progress: float = 0.0
    grant_floor: int = 0  # grant keys <= this that are not in grant_live were dead when we connected
    grant_live: frozenset[int] = frozenset()
    win: SourceWindows | None = None  # the sink binds memory windows: their rkeys by grant (under ``lock``)
    reader: FrameReader = field(default_factory=FrameReader)  # the liveness socket's frames (cm thread)
    tell: threading.Lock = field(default_factory=threading.Lock)  # one frame at a time onto the liveness socket


@dataclass(eq=False, slots=True)
class SinkConn:
    """An accepted source: its liveness socket, the sink QP, the source instance its hello named.

    Whoever removes it from ``VerbsTransport._sinks`` (under ``_lock``) owns its teardown.
    """

    key: int
    sock: socket.socket
    qp: Any
    src: bytes
    windows: dict[int, list[Window]] = field(default_factory=dict)  # grant -> its windows bound on this QP
    reader: FrameReader = field(default_factory=FrameReader)
    stopped: set[int] = field(default_factory=set)  # grants the source answered ``s`` for (under ``_lock``)
    # A cut of it failed (under ``_lock``): its QP was neither moved to the error state nor destroyed, and
    # its windows are forgotten, invalidated or not. Every revoke of its source's grants cuts it again.
    uncut: bool = False


class VerbsState(Transport):
    """The fields every room of ``VerbsTransport`` reads (set by its ``__init__``), and the steps one
    room takes for another."""

    # options, fixed at start
    _key: bytes | None  # derived from the deployment secret; None without one
    _max_inflight: int
    _peer_timeout: float
    _qp_timeout: int
    _retry_cnt: int
    _max_sinks: int
    _max_windows: int
    _max_send_wr: int
    _instance: bytes
    _windows: bool  # grants are memory windows (the device has type 2 windows, and they were not refused)

    # the device and what lives as long as the transport
    _ctx: Any
    _pd: Any
    _sink_cq: Any  # every sink QP's, for window binds and invalidations only
    _dev: Device
    _mem: MemoryRegions
    _regions: RegionTable  # _mem.table: read on every write
    _mrs: dict[int, Any]  # _mem.mrs: the MR of each region key
    _mw: WindowOps  # under _mw_lock
    _auth: AuthFailures
    _backoff: AcceptBackoff
    _queue: CompletionQueue  # bounded by the in-flight slots, which it holds

    # the cm thread's: its listener, selector and wake pair
    _listener: socket.socket
    _sel: Any
    _wake_r: socket.socket
    _wake_w: socket.socket
    _accept_again: float | None  # out of descriptors: when the listener is watched again

    # guarded by _lock
    _lock: threading.Lock
    _drained: threading.Condition  # on _lock: a source answered ``s``, or a sink went away
    _closed: bool
    _peers: dict[int, VerbsPeer]
    _sinks: dict[int, SinkConn]  # SinkConn.key -> accepted source
    _cm_pending: deque[tuple[socket.socket, Any]]  # sockets for the cm thread to watch (None: to drop)
    _peer_ids: itertools.count[int]
    _sink_ids: itertools.count[int]
    _batch_ids: itertools.count[int]
    refused_connections: int  # handshakes refused at max_sinks (as the tcp transport counts them)

    # guarded by _grant_lock
    _grant_lock: threading.Lock
    _grants: GrantTable
    _last_grant: int  # the last key grant() issued (keys only grow)
    _unconfirmed: dict[int, Grant]  # revokes that raised, by key

    _mw_lock: threading.Lock  # orders every bind, invalidation and sink-side frame (see grant); before _lock

    # the completion thread's wake-up
    _work: threading.Condition
    _posts: int  # bumped under _work by every write(): the completion thread waits for a change
    _stop: threading.Event

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransportError("transport is closed", op=op)

    def _to_rts(self, qp: Any, *, rqpn: int, rpsn: int, lpsn: int, gid: bytes, lid: int, mtu: int) -> None:
        to_rts(qp, self._dev, rqpn=rqpn, rpsn=rpsn, lpsn=lpsn, gid=gid, lid=lid, mtu=mtu,
               timeout=self._qp_timeout, retry_cnt=self._retry_cnt)

    # the cm thread's inbox (transport/verbs.py)

    @abc.abstractmethod
    def _watch(self, sock: socket.socket, what: Any) -> None:
        """Have the cm thread watch ``sock`` (a liveness socket) for ``what`` (its peer or sink)."""

    @abc.abstractmethod
    def _unwatch(self, sock: socket.socket) -> None:
        """Have the cm thread stop watching ``sock`` and close it."""

    @abc.abstractmethod
    def _sel_drop(self, sock: Any) -> None:
        """Stop watching ``sock`` (on the cm thread)."""

    @abc.abstractmethod
    def _kill_sink_qp(self, c: SinkConn) -> str:
        """Move a sink QP to the error state, free its windows, destroy it; '' if the QP stopped (transport/verbs.py)."""

    @abc.abstractmethod
    def _grant_snapshot(self, sink: SinkConn) -> bytes:
        """The grants an ``OK`` reply carries to ``sink``'s source (transport/verbs_grants.py). Under ``_mw_lock``."""
