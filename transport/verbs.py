"""The verbs transport: one-sided RDMA WRITEs over RC queue pairs, through pyverbs.

``transport.create("verbs")`` imports this module, and with it pyverbs; where pyverbs or
an RDMA device is missing, building the transport raises ``StartError`` saying what to
install or load. See ``transport/base.py`` for the contract. This module is the transport
itself: its options and resources, ``connect`` and the sink's side of the handshake, ``write``,
grants and revoke, and its two threads. Each idea it builds on has a module of its own:

- ``transport/verbs_device.py``: the one checked import of pyverbs, and which device, port and
  GID to use ("Device, port and GID"; ``describe_device``, ``unavailable_reason``);
- ``transport/verbs_hello.py``: the handshake's wire, sans-IO: the endpoint address, the hello,
  the reply, the grants an ``OK`` reply carries ("Authentication");
- ``transport/verbs_qp.py``: queue pairs, and a source QP's send side from posting to reaping
  ("Writes and completions");
- ``transport/verbs_regions.py``: memory regions and the memory windows bound over them ("What
  invalidation promises on rxe");
- ``transport/windows.py``: what of the windows needs no device (the ``W``/``S`` frames, the
  source's table of rkeys).

Resources
---------
One device context and one protection domain per transport. ``register`` makes
one memory region (see ``transport/verbs_regions.py``; with memory windows, a
region that requires grants gets no remote access). Each connected peer (source
side) owns one RC queue pair and its own completion queue (so one peer's flushes
can never overrun another's CQ); the sink side owns one RC QP per connected source,
all on one small CQ (a sink posts only the binds and invalidations of memory windows,
and reaps their completions itself, see "Grants and revoke").

Handshake and liveness
----------------------
``connect`` creates the source QP, then exchanges QP information with the sink
over one short TCP connection to the listener the endpoint names (the bytes are in
``transport/verbs_hello.py``). That connection then stays open as a liveness
signal: when either side closes it, the other tears its QP down (a sink frees the
QP of a source that went away; a source fails its batches at once instead of
waiting for RC retries). Without memory windows it carries one byte at most:
``_REVOKED``, which a sink's ``revoke`` sends just before it closes the connection,
so the source's error says why (any other byte is a protocol break and treated as
a close); with them it carries the frames of ``transport/windows.py``.

Grants and revoke
-----------------
``grant(source, ranges)`` checks that every range lies in a registered region
(``ValueError`` otherwise) and keeps the grant in a ``GrantTable``. What
enforces it depends on the device, chosen at start (``memory_windows``,
``revoke_method``; a device without type 2 windows is logged once):

**Memory windows** (``revoke_method == "memory window"``; rxe has them). A
region registered with ``require_grant=True`` is opened only by a grant's
windows, one type 2 window per contiguous range, bound on the sink QP of each
connection of the grant's source (``transport/verbs_regions.py``). Their rkeys
reach the source over the connection's liveness socket (``transport/windows.py``
has the frames): in the handshake's reply for the grants live then, and as a
``W`` frame sent before ``grant`` returns for later ones, so they are on the way
before the announcement that names the key; a ``write`` naming a key whose
windows have not arrived waits for them (at most its deadline or 1 s). Each
WRITE carries its window's rkey; a write outside the grant's windows fails its
batch before anything is posted; a key that is not this connection's (revoked,
another source's) raises ``EACCES``.

``revoke(grant)`` costs only that grant: the sink sends ``S`` key; the source
stops posting through it and answers ``s`` key once none of its batches
through it is in flight (those land first: they are before the revoke
returns); the sink then invalidates the windows with ``IBV_WR_LOCAL_INV`` and
frees them, and returns. Other grants and the queue pair carry on. A source
that does not answer by the revoke's deadline (default 1 s: paused, deaf, or
not running this code) has the windows invalidated and its queue pair cut (to
the error state, destroyed), as the fallback below does, so nothing of it
lands once ``revoke`` returns. ``revoke(..., settled=True)`` invalidates
without asking (every write through the grant completed at the source). What
the device then promises is "What invalidation promises on rxe" in
``transport/verbs_regions.py``.

**Queue pair to error** (the fallback, ``revoke_method == "queue pair to
error"``). The RDMA WRITE carries the region's rkey, and the sink's device
checks writes against the MR and nothing finer; ``require_grant`` changes
nothing on the wire. ``revoke(grant)`` forgets the grant and moves every sink
QP whose handshake named the grant's source instance to the error state and
destroys it (under the transport lock, so the cm thread never races it; the
cm thread closes the liveness sockets, which tells the source at once).
``ibv_destroy_qp`` returns only once the device has stopped using the QP, so
once ``revoke`` returns nothing more from that source lands over those QPs,
even if the source never hears of it (paused, or deaf to its liveness
socket). The price: every in-flight and later write of that source fails,
**all** of its rooms with them, and it must ``connect`` again. Its other
grants stay in the table but are useless until it reconnects; once it has,
they work again. A reconnected source could still write into a revoked
grant's ranges (the rkey covers the whole region). So that a source that was
merely paused or slow (it runs this code, unmodified) cannot do that by naming
the old key, the handshake's ``OK`` reply carries the last grant key the sink
issued and the keys of that source's live grants; on that connection
``write`` raises ``TransportError(op="write", errno=EACCES)``, posting
nothing, for a key at or below that floor that was not live (revoked, settled
or not). Keys issued later pass. The sink takes that snapshot after the new
QP is revocable, so a revoke racing the handshake either kills the new QP or
is in the snapshot. A source that does not run this code, or writes with
``grant=0``, is not held back. ``revoke(..., settled=True)`` only forgets the
grant and keeps the QPs.

Threads: ``pdcore-verbs-cq`` (completions, posting, watchdog) and
``pdcore-verbs-cm`` (listener, handshakes, liveness sockets). ``close()``
fails every batch in flight, moves every QP to the error state, joins both
threads, then destroys QPs, CQs, MRs, the PD and the context, in that order.
An ``accept`` that fails for want of descriptors or memory takes the listener
out of the cm thread's selector for a back-off (10 ms doubling to 1 s, ended
early when a sink's socket closes; ``accept_failures``), instead of a spin on
a listener that stays readable.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import itertools
import logging
import operator
import os
import select
import selectors
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ClassVar

from .base import (
    AcceptBackoff,
    auth_failed,
    HELLO_TIMEOUT,
    NONCE_BYTES,
    AuthFailures,
    Batch,
    Completion,
    CompletionQueue,
    Endpoint,
    Grant,
    GrantTable,
    OnDone,
    PeerHandle,
    Region,
    RegionTable,
    Transport,
    as_batch,
    check_secret,
    decode_endpoint,
    deliver,
    derive_key,
    encode_endpoint,
    new_instance_id,
    take_slot,
)
from . import verbs_hello as hello
from .deadline import Deadline
from .errors import StartError, TransportError
from .limits import U64_MAX
from .verbs_device import (
    DEVICE_HINT,
    INSTALL_HINT,
    describe_device,
    missing_pyverbs,
    open_device,
    pv,
    rdma_errno,
    unavailable_reason,
)
from .verbs_qp import SendQueue, Wr, WrBatch, make_qp, qp_to_error, to_rts, wc_status_name
from .verbs_regions import SINK_WR, MemoryRegions, Window, WindowOps, free_windows, probe_windows, windows_frame
from .windows import (
    FRAME_REVOKED,
    FRAME_STOPPED,
    FRAME_WINDOWS,
    FrameReader,
    SourceWindows,
    encode_stop,
    window_spans,
)

__all__ = [
    "DEVICE_HINT",
    "INSTALL_HINT",
    "VerbsTransport",
    "describe_device",
    "unavailable_reason",
    "wc_status_name",
]

log = logging.getLogger("transport.verbs")

# the handshake's wire names under which tests/rdma/test_auth_verbs.py reads them from this module
_ADDR, _HELLO, _MAGIC, _VERSION, _REPLY, _AUTH_REQUIRED = (
    hello.ADDR, hello.HELLO, hello.MAGIC, hello.VERSION, hello.REPLY, hello.AUTH_REQUIRED
)
_REVOKED = FRAME_REVOKED  # sink → source on the liveness socket: "revoke killed your QP", then EOF
_SEND_TIMEOUT = 1.0  # seconds a frame may wait for room in a liveness socket before the connection is cut
_IDLE_WAIT = 0.1  # completion thread, nothing in flight: re-check the stop flag this often


# ---------------------------------------------------------------------- per-peer state


@dataclass(eq=False, slots=True)
class _VerbsPeer(PeerHandle):
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
class _SinkConn:
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


class VerbsTransport(Transport):
    """RDMA WRITEs over RC QPs (pyverbs). Options:

    ``device`` (default: the first device with an active port), ``ib_port``, ``gid_index``
    (default: chosen as ``transport/verbs_device.py`` says); ``host``/``port``/``advertise_host`` of the
    handshake listener (default 127.0.0.1, any port, ``host``); ``max_inflight`` (64 batches per
    peer); ``peer_timeout`` (10 s without a completion while batches are in flight = dead peer);
    ``max_send_wr`` (1024 outstanding WRs per QP, capped by the device); ``qp_timeout`` (the ack
    timeout exponent, 4.096 us * 2**n; default: derived from ``peer_timeout``) and ``retry_cnt``
    (6; 7 would mean "retry forever" on rxe); ``max_sinks`` (1024 sink QPs, one per connected
    source; a handshake beyond it is refused and that source's ``connect`` raises); ``secret``
    (bytes of 16..4096, default None: the deployment secret; with it every handshake is a mutual
    challenge-response before any QP information moves, see "Authentication" in
    ``transport/verbs_hello.py``; refused handshakes are counted in ``auth_failures``); ``memory_windows`` (default
    None: where the device has type 2 windows; False: never, True: ``StartError`` without them) and
    ``max_windows`` (4096 windows per grant, one per contiguous range; a grant needing more raises
    ``ValueError``), see "Grants and revoke".
    """

    name: ClassVar[str] = "verbs"

    def __init__(
        self,
        *,
        device: str | None = None,
        ib_port: int | None = None,
        gid_index: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        max_inflight: int = 64,
        peer_timeout: float = 10.0,
        max_send_wr: int = 1024,
        qp_timeout: int | None = None,
        retry_cnt: int = 6,
        max_sinks: int = 1024,
        secret: bytes | None = None,
        memory_windows: bool | None = None,
        max_windows: int = 4096,
    ) -> None:
        secret = check_secret(secret, "verbs transport")
        self._key = derive_key(secret, hello.KEY_LABEL) if secret is not None else None
        del secret  # only the derived key is kept
        self._auth = AuthFailures("verbs transport", log)
        why = missing_pyverbs()
        if why is not None:
            raise StartError(f"verbs transport: {why}")
        if max_inflight < 1 or peer_timeout <= 0 or max_send_wr < 2 or not 0 <= retry_cnt <= 7:
            raise StartError(
                f"verbs transport: max_inflight ({max_inflight}) and peer_timeout ({peer_timeout}) must be "
                f"positive, max_send_wr ({max_send_wr}) at least 2, retry_cnt ({retry_cnt}) in 0..7"
            )
        if not isinstance(max_sinks, int) or max_sinks < 1:
            raise StartError(f"verbs transport: max_sinks ({max_sinks!r}) must be a positive int")
        if memory_windows not in (None, True, False) or not isinstance(max_windows, int) or max_windows < 1:
            raise StartError(
                f"verbs transport: memory_windows ({memory_windows!r}) must be None, True or False and "
                f"max_windows ({max_windows!r}) a positive int"
            )
        self._max_windows = max_windows
        if qp_timeout is None:
            # ack timeout * (retries + 1) well inside peer_timeout: the QP reports a dead peer first
            budget = peer_timeout / 2 / (retry_cnt + 1)
            qp_timeout = max(n for n in range(8, 21) if 4.096e-6 * 2**n <= budget or n == 8)
        if not 1 <= qp_timeout <= 31:
            raise StartError(f"verbs transport: qp_timeout ({qp_timeout}) must be in 1..31")
        self._max_inflight = max_inflight
        self._peer_timeout = float(peer_timeout)
        self._qp_timeout = qp_timeout
        self._retry_cnt = retry_cnt
        self._instance = new_instance_id()
        self._batch_ids = itertools.count(1)
        self._peer_ids = itertools.count(1)
        self._peers: dict[int, _VerbsPeer] = {}
        self._sinks: dict[int, _SinkConn] = {}  # _SinkConn.key -> accepted source; guarded by _lock
        self._sink_ids = itertools.count(1)
        self._max_sinks = max_sinks
        self.refused_connections = 0  # handshakes refused at max_sinks (as the tcp transport counts them)
        self._backoff = AcceptBackoff("verbs transport", log)
        self._accept_again: float | None = None  # out of descriptors: when the listener is watched again
        self._grants = GrantTable()  # guarded by _grant_lock
        self._grant_lock = threading.Lock()
        self._last_grant = 0  # the last key grant() issued (keys only grow); guarded by _grant_lock
        self._unconfirmed: dict[int, Grant] = {}  # revokes that raised, by key; guarded by _grant_lock
        self._mw_lock = threading.Lock()  # orders every bind, invalidation and sink-side frame (see grant)
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)  # a source answered ``s``, or a sink went away
        self._work = threading.Condition()  # wakes the completion thread
        self._posts = 0  # bumped under _work by every write(): the completion thread waits for a change
        self._stop = threading.Event()
        self._closed = False
        self._queue = CompletionQueue(1 << 30)  # bounded by the in-flight slots, which it holds

        with contextlib.ExitStack() as stack:
            try:
                self._ctx, self._dev = open_device(device, ib_port, gid_index)
                stack.callback(self._ctx.close)
                self._pd = pv.PD(self._ctx)
                stack.callback(self._pd.close)
                self._sink_cq = pv.CQ(self._ctx, SINK_WR + 16)
                stack.callback(self._sink_cq.close)
            except pv.Error as ex:
                raise StartError(f"verbs transport: cannot open the device: {ex}") from ex
            self._windows, why = probe_windows(self._ctx, self._pd, memory_windows)
            if not self._windows:
                if memory_windows:
                    raise StartError(f"verbs transport: memory_windows=True, but {why}")
                if memory_windows is None:
                    log.warning("verbs transport on %s: %s; revoke moves the source's queue pairs to the error "
                                "state instead (revoke_method)", self._dev.name, why)
            self._mem = MemoryRegions(self._pd, self._windows)
            self._regions, self._mrs = self._mem.table, self._mem.mrs  # read on every write
            self._mw = WindowOps(self._pd, self._sink_cq)  # under _mw_lock
            self._max_send_wr = max(2, min(max_send_wr, self._dev.max_qp_wr, self._dev.max_cqe - 1))
            try:
                self._listener = socket.create_server((host, port), backlog=128)
            except OSError as ex:
                raise StartError(f"verbs transport: cannot listen on {host}:{port}: {ex}") from ex
            stack.callback(self._listener.close)
            self._listener.setblocking(False)
            hostport = f"{advertise_host or host}:{self._listener.getsockname()[1]}"
            self._address = hello.encode_address(self._dev.gid, self._dev.lid, self._dev.mtu, self._dev.link_layer, hostport)
            self._hostport = hostport
            self._wake_r, self._wake_w = socket.socketpair()
            stack.callback(self._wake_r.close)
            stack.callback(self._wake_w.close)
            self._wake_r.setblocking(False)
            self._sel = selectors.DefaultSelector()
            stack.callback(self._sel.close)
            self._sel.register(self._listener, selectors.EVENT_READ, "listen")
            self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            self._cm_pending: deque[tuple[socket.socket, Any]] = deque()  # sockets for the cm thread to watch
            self._cq_thread = threading.Thread(target=self._cq_loop, name="pdcore-verbs-cq", daemon=True)
            self._cm_thread = threading.Thread(target=self._cm_loop, name="pdcore-verbs-cm", daemon=True)
            self._cq_thread.start()
            stack.callback(self._stop_threads)
            self._cm_thread.start()
            self._owned = stack.pop_all()

    @property
    def device(self) -> str:
        """``"rxe0/1 gid 1"``: the device, port and GID index in use."""
        return f"{self._dev.name}/{self._dev.port} gid {self._dev.gid_index}"

    @property
    def device_name(self) -> str:
        return self._dev.name

    @property
    def gid_index(self) -> int:
        return self._dev.gid_index

    # ------------------------------------------------------------------ registrations

    @property
    def instance(self) -> bytes:
        return self._instance

    @property
    def auth_failures(self) -> int:
        """Handshakes this sink refused for authentication (a wrong or missing proof of the secret,
        a secret on one side only, or a source that went quiet once challenged)."""
        return self._auth.count

    @property
    def accept_failures(self) -> int:
        """Accepts that failed for want of descriptors or memory (each followed by a back-off)."""
        return self._backoff.count

    @property
    def revoke_method(self) -> str:
        """How ``revoke`` (not settled) enforces: ``"memory window"`` (the grant's windows are
        invalidated), or on a device without type 2 windows ``"queue pair to error"``."""
        return "memory window" if self._windows else "queue pair to error"

    @property
    def memory_windows(self) -> bool:
        """True if grants are memory windows (chosen at start: the device and ``memory_windows``)."""
        return self._windows

    @property
    def windows_live(self) -> int:
        """Memory windows bound now, over every connected source."""
        with self._mw_lock:
            with self._lock:
                return sum(len(w) for s in self._sinks.values() for w in s.windows.values())

    @property
    def max_sinks(self) -> int:
        return self._max_sinks

    def register(self, buf: Any, *, require_grant: bool = False) -> Region:
        """With memory windows, a ``require_grant`` region is registered without remote write: only a
        grant's windows open it, and the endpoint withholds its rkey (key 0). Without windows the
        device cannot enforce ``require_grant`` (module docstring)."""
        self._check_open("register")
        return self._mem.register(buf, require_grant)

    def deregister(self, region: Region, *, deadline: Deadline | None = None) -> None:
        self._mem.deregister(region)

    def regions(self) -> tuple[Region, ...]:
        return self._regions.snapshot()

    # ------------------------------------------------------------------ grants (sink side)

    def grant(self, source: bytes, ranges: Any) -> Grant:
        """Record the grant; with memory windows also bind one window per contiguous range on every
        connected queue pair of ``source`` and send it their rkeys (``W``) before returning, so
        they are there before the announcement that names the key. Keys are issued and bound under
        one lock: each connection hears of its grants in key order."""
        self._check_open("grant")
        with self._mw_lock:
            with self._grant_lock:
                g = self._grants.add(bytes(source), ranges)
                self._last_grant = g.key
                bad = self._regions.outside(g.ranges)
                if bad is not None:
                    self._grants.pop(g.key)
                    raise ValueError(f"grant range [{bad[0]:#x}, +{bad[1]}) is outside every registered region")
                spans = self._spans_of(g) if self._windows else []
                if len(spans) > self._max_windows:
                    self._grants.pop(g.key)
                    raise ValueError(
                        f"a grant of {len(g.ranges)} ranges needs {len(spans)} memory windows, more than "
                        f"max_windows={self._max_windows}: grant fewer, longer ranges, or raise max_windows"
                    )
            if self._windows:
                with self._lock:
                    sinks = [c for c in self._sinks.values() if c.src == g.source]
                broken = [c for c in sinks if not self._open_windows(c, g.key, spans, send=True)]
                self._cut(broken, say=b"")
        return g

    def _grant_snapshot(self, sink: _SinkConn) -> bytes:
        """For an ``OK`` reply: the last key issued and the source's live grants: their keys, or with
        memory windows the windows bound for them on this connection (``W`` frames). Under ``_mw_lock``."""
        with self._grant_lock:
            live = sorted(self._grants.of_source(sink.src), key=lambda g: g.key)[: hello.MAX_LIVE_GRANTS]
            floor = self._last_grant
        if not self._windows:
            return hello.encode_grant_keys(floor, [g.key for g in live])
        frames = []
        for g in live:
            if not self._open_windows(sink, g.key, self._spans_of(g), send=False):
                raise OSError(errno_mod.EIO, f"binding the memory windows of grant {g.key} failed")
            frames.append(windows_frame(g.key, sink.windows[g.key]))
        return hello.encode_grant_windows(floor, frames)

    def revoke(self, grant: Grant, *, deadline: Deadline | None = None, settled: bool = False) -> None:
        """Forget ``grant``; unless ``settled``, make sure nothing more lands through it once this returns.

        With memory windows: ask each connection of the source to stop (``S``), wait until it
        answered that nothing of this grant is in flight (``s``) or ``deadline`` (default 1 s) passed,
        then invalidate the grant's windows; a connection that did not answer in time, or whose
        invalidation failed, is cut (its queue pair to the error state and destroyed), as is every
        connection without windows (module docstring). Other grants and connections stay.
        Revoking a grant that is not live (revoked already, or not this transport's) does nothing.
        ``TransportError(op="revoke")`` if a queue pair could be neither moved to the error state nor
        destroyed (its windows' invalidation failed too, or it had none); calling ``revoke`` again
        tries again, that queue pair included, and raises until it is stopped. ``settled`` too.
        """
        with self._grant_lock:
            live = self._grants.get(grant.key)
            if live is None:
                live = self._unconfirmed.get(grant.key)  # a revoke that raised: try again
            if live is None or live != grant:  # keys are per sink: another sink's grant may share this one's
                return
            self._grants.pop(grant.key)
        if settled:
            failures = self._revoke_settled(live)
        elif self._windows:
            failures = self._revoke_windows(live, deadline or Deadline.after(1.0))
        else:
            failures = self._revoke_by_qp(live)
        with self._grant_lock:
            if failures:
                self._unconfirmed[grant.key] = live
            else:
                self._unconfirmed.pop(grant.key, None)
        if failures:
            raise TransportError(
                f"revoke: {len(failures)} QP(s) of the source could not be stopped: {failures[0]}", op="revoke"
            )

    def _revoke_settled(self, g: Grant) -> list[str]:
        """Every write through ``g`` completed: invalidate its windows without waiting for an answer
        (the source forgets them on ``S``; its answer is ignored); cut a connection whose invalidation
        failed, and any of the source's a cut failed for before."""
        with self._mw_lock:
            with self._lock:
                sinks = [c for c in self._sinks.values() if g.key in c.windows]
                uncut = self._uncut_of(g.source, sinks) if self._windows else []  # without: QPs stay
            for c in sinks:
                _send_frame(c.sock, encode_stop(g.key))
            failed = [c for c in sinks if self._close_windows(c, g.key)]
            return self._cut([*failed, *uncut], say=b"")

    def _uncut_of(self, source: bytes, besides: list[_SinkConn]) -> list[_SinkConn]:
        """The connections of ``source`` a cut failed for (not in ``besides``): a revoke cuts them again,
        since what they may still land through is unknown. Under ``_lock``."""
        return [c for c in self._sinks.values() if c.uncut and c.src == source and c not in besides]

    def _revoke_windows(self, g: Grant, deadline: Deadline) -> list[str]:
        key = g.key
        with self._mw_lock:
            with self._lock:
                sinks = [c for c in self._sinks.values() if key in c.windows]
                uncut = self._uncut_of(g.source, sinks)  # their windows are gone from c.windows: not asked
                for c in sinks:
                    c.stopped.discard(key)
            mute = [c for c in sinks if not _send_frame(c.sock, encode_stop(key))]
        with self._drained:
            self._drained.wait_for(
                lambda: all(key in c.stopped or self._sinks.get(c.key) is not c for c in sinks),
                timeout=deadline.remaining(),
            )
        with self._mw_lock:
            with self._lock:
                unanswered = [c for c in sinks if key not in c.stopped and c not in mute]
                for c in sinks:
                    c.stopped.discard(key)
            failed = [c for c in sinks if self._close_windows(c, key)]
            cut = list({c.key: c for c in (*mute, *unanswered, *failed, *uncut)}.values())
            if unanswered:
                log.warning("verbs transport: revoke of grant %d: %d source connection(s) did not answer within the "
                            "deadline; their queue pairs are cut", key, len(unanswered))
            return self._cut(cut, say=_REVOKED)

    def _revoke_by_qp(self, g: Grant) -> list[str]:
        """The fallback without memory windows: cut every connection of the grant's source."""
        with self._lock:
            sinks = [c for c in self._sinks.values() if c.src == g.source]
        return self._cut(sinks, say=_REVOKED)

    def _cut(self, sinks: list[_SinkConn], *, say: bytes) -> list[str]:
        """Kill each connection's QP (to the error state, its windows freed, destroyed), tell the source
        ``say``, hang up. ``ibv_destroy_qp`` returns once the device stopped using the QP, so nothing
        more lands through it. Returns why a QP could not be stopped (that connection stays, marked
        ``uncut``, so the next revoke of its source's grants tries again)."""
        failures: list[str] = []
        victims = []
        with self._lock:  # the cm thread drops connections under this lock too: one owner per connection
            closed = self._closed
            for c in sinks:
                if self._sinks.get(c.key) is not c:
                    continue  # dropped meanwhile
                why = self._kill_sink_qp(c)
                if why:
                    c.uncut = True
                    failures.append(why)
                    continue
                del self._sinks[c.key]
                victims.append(c)
                if say:  # say why before the hang-up (the QP is dead already)
                    with contextlib.suppress(OSError):
                        c.sock.send(say)
            if victims and not closed:  # the cm thread unwatches and closes the sockets: the source sees EOF
                self._cm_pending.extend((c.sock, None) for c in victims)
            self._drained.notify_all()
        if victims:
            if closed:
                for c in victims:
                    c.sock.close()
            else:
                with contextlib.suppress(OSError):
                    self._wake_w.send(b"r")
        return failures

    def _kill_sink_qp(self, c: _SinkConn) -> str:
        """Move a sink QP to the error state, free its windows, destroy it; '' if the QP stopped."""
        errors = []
        try:
            c.qp.modify(pv.QPAttr(qp_state=pv.e.IBV_QPS_ERR), pv.e.IBV_QP_STATE)
        except pv.Error as ex:
            errors.append(f"to error: {ex}")
        free_windows([w for ws in c.windows.values() for w in ws])
        c.windows.clear()
        try:
            c.qp.close()
        except pv.Error as ex:
            errors.append(f"destroy: {ex}")
        return "; ".join(errors) if len(errors) == 2 else ""

    # ------------------------------------------------------------------ memory windows (sink side, under _mw_lock)

    def _spans_of(self, g: Grant) -> list[tuple[int, int]]:
        """The ranges of grant ``g``'s windows (one per contiguous range within one region)."""
        return window_spans(g.ranges, [(r.addr, r.end) for r in self._regions.snapshot()])

    def _open_windows(self, c: _SinkConn, key: int, spans: list[tuple[int, int]], *, send: bool) -> bool:
        """Bind grant ``key``'s windows (one per span) on ``c``'s QP (and with ``send`` tell the source:
        ``W``); False if that failed (the caller cuts the connection)."""
        made = self._mw.bind(c.qp, key, spans, self._mem)
        if made is None:
            return False
        c.windows[key] = made
        return not send or _send_frame(c.sock, windows_frame(key, made))

    def _close_windows(self, c: _SinkConn, key: int) -> bool:
        """Invalidate grant ``key``'s windows on ``c`` and free them; True if that failed (cut ``c``)."""
        made = c.windows.pop(key, None)
        return bool(made and self._mw.invalidate(c.qp, key, made))

    def endpoint(self) -> bytes:
        """With memory windows a region that requires a grant travels with key 0: no source learns its rkey."""
        return encode_endpoint(Endpoint(self.name, self._instance, self._address, self._mem.advertised()))

    # ------------------------------------------------------------------ QPs

    def _to_rts(self, qp: Any, *, rqpn: int, rpsn: int, lpsn: int, gid: bytes, lid: int, mtu: int) -> None:
        to_rts(qp, self._dev, rqpn=rqpn, rpsn=rpsn, lpsn=lpsn, gid=gid, lid=lid, mtu=mtu,
               timeout=self._qp_timeout, retry_cnt=self._retry_cnt)

    _qp_to_error = staticmethod(qp_to_error)  # tests/rdma break a sink QP through it

    # ------------------------------------------------------------------ source side

    def connect(self, peer_endpoint: bytes, *, deadline: Deadline) -> PeerHandle:
        self._check_open("connect")
        remote = decode_endpoint(peer_endpoint, expect=self.name)
        addr = hello.decode_address(remote.address)
        if addr.link_layer != self._dev.link_layer:
            raise TransportError(
                f"peer link layer {addr.link_layer} differs from ours ({self._dev.link_layer}): no route", op="connect"
            )
        where = f"{addr.host}:{addr.port}"
        psn = int.from_bytes(os.urandom(3), "little")
        with contextlib.ExitStack() as stack:
            try:
                sq = SendQueue(self._ctx, self._pd, self._max_send_wr)
            except pv.Error as ex:
                raise TransportError(f"creating a QP failed: {ex}", op="connect", errno=rdma_errno(ex)) from ex
            stack.callback(sq.close)
            try:
                sock = socket.create_connection((addr.host, addr.port), timeout=max(deadline.remaining(), 1e-3))
            except OSError as ex:
                raise TransportError(f"cannot reach the peer's handshake listener {where}: {ex}", op="connect", errno=ex.errno) from ex
            stack.callback(sock.close)
            recv = _receiver(sock, deadline)
            info = hello.QP_INFO.pack(sq.qp.qp_num, psn, self._dev.gid, self._dev.lid, self._dev.mtu)
            try:
                reply = self._hello(sock, where, hello.Hello(remote.instance, self._instance, info=info), deadline)
            except OSError as ex:
                raise TransportError(f"handshake with {where} failed: {ex}", op="connect", errno=ex.errno) from ex
            refused = hello.refusal(reply, where)
            if refused is not None:
                raise refused
            try:
                floor, live, win = hello.read_grants(recv, where)
            except OSError as ex:
                raise TransportError(f"handshake with {where} failed: {ex}", op="connect", errno=ex.errno) from ex
            try:
                self._to_rts(sq.qp, rqpn=reply.qpn, rpsn=reply.psn, lpsn=psn, gid=addr.gid, lid=addr.lid,
                             mtu=min(reply.mtu, self._dev.mtu))
            except pv.Error as ex:
                raise TransportError(f"moving the QP to RTS failed: {ex}", op="connect", errno=rdma_errno(ex)) from ex
            sock.setblocking(False)
            peer = _VerbsPeer(
                next(self._peer_ids), remote, RegionTable(remote.regions), sq=sq, sock=sock,
                grant_floor=floor, grant_live=live, win=win,
            )
            peer.last_progress = time.monotonic()
            with self._lock:
                if self._closed:
                    raise TransportError("transport is closed", op="connect")
                self._peers[peer.id] = peer
            stack.pop_all()
        self._watch(sock, peer)
        return peer

    def _hello(self, sock: socket.socket, where: str, h: hello.Hello, deadline: Deadline) -> hello.Reply:
        """Send the hello ``h`` (with a secret: without its QP information, then check the sink's challenge
        and send our proof, which carries it); return the sink's last reply."""
        recv = _receiver(sock, deadline)
        key = self._key
        sock.settimeout(max(deadline.remaining(), 1e-3))
        if key is None:
            sock.sendall(hello.encode_hello(h))
            return hello.decode_reply(recv(hello.REPLY.size))
        h = hello.Hello(h.sink, h.source, os.urandom(NONCE_BYTES), h.info)
        sock.sendall(hello.encode_hello(h))
        reply = hello.decode_reply(recv(hello.REPLY.size))
        if reply.magic != hello.MAGIC or reply.version != hello.VERSION or reply.status != hello.OK:
            return reply
        proof = hello.prove(key, h, recv(hello.CHALLENGE.size))
        if proof is None:
            raise auth_failed(where, "it could not prove that it holds the deployment secret (different secrets?)")
        sock.sendall(proof)
        return hello.decode_reply(recv(hello.REPLY.size))

    def refresh(self, peer: PeerHandle, peer_endpoint: bytes) -> None:
        remote = decode_endpoint(peer_endpoint, expect=self.name)
        if remote.instance != peer.remote.instance:
            raise TransportError("refresh: the endpoint is of another transport instance", op="refresh")
        peer.remote, peer.regions = remote, RegionTable(remote.regions)

    def disconnect(self, peer: PeerHandle, *, deadline: Deadline | None = None) -> None:
        p = self._own(peer, "disconnect")
        self._fail_peer(p, TransportError("peer disconnected", op="disconnect", errno=errno_mod.ECANCELED))
        with self._lock:
            self._peers.pop(p.id, None)

    def write(
        self,
        peer: PeerHandle,
        batch: Batch,
        on_done: OnDone | None = None,
        *,
        deadline: Deadline | None = None,
        grant: int = 0,
    ) -> int:
        """With memory windows each WRITE carries the rkey of grant ``grant``'s window that holds it (a
        write outside them fails its batch; an unknown or revoked key raises ``EACCES``; a key whose
        windows have not arrived yet waits for them, at most ``deadline`` or 1 s). Without windows
        ``grant`` is not sent (the WRITE carries the region's rkey); it must be a u64, and not a key
        the sink had revoked when this connection was made (module docstring)."""
        p = self._own(peer, "write")
        try:
            key = operator.index(grant)
        except TypeError:
            raise TransportError(f"a grant key is an unsigned 64-bit int, got {grant!r}", op="write") from None
        if not 0 <= key <= U64_MAX:
            raise TransportError(f"a grant key is an unsigned 64-bit value, got {grant!r}", op="write")
        if p.win is None and key and key <= p.grant_floor and key not in p.grant_live:
            raise TransportError(
                f"grant {key} was not live at the sink when this connection was made (revoked): nothing is posted",
                op="write",
                errno=errno_mod.EACCES,
            )
        wrs: list[Wr] = []
        remote = p.regions
        local = self._regions
        for la, ra, n in _rows(batch):
            loc = local.find(la, n)
            if loc is None:
                raise TransportError(f"local range [{la:#x}, +{n}) is not inside a registered region", op="write")
            rem = remote.find(ra, n)
            if rem is None:
                raise TransportError(f"remote range [{ra:#x}, +{n}) is not inside a region the peer announced", op="write")
            mr = self._mrs.get(loc.key)
            if mr is None:
                raise TransportError(f"local range [{la:#x}, +{n}) was deregistered", op="write")
            step = self._dev.max_msg  # rxe: 8 MiB; a longer message fails the QP at the sink
            for off in range(0, n, step):
                wrs.append((la + off, mr.lkey, ra + off, rem.key, min(step, n - off)))
        with p.lock:
            self._check_usable(p)
            refused = None
            if p.win is not None:
                wrs, refused = self._through_windows(p, key, wrs, deadline)
            take_slot(p, self._max_inflight, deadline, self._check_usable)
            sq = p.sq
            assert sq is not None  # set until the peer fails, and _check_usable saw it had not
            batch_id = next(self._batch_ids)
            b = WrBatch(batch_id, wrs, on_done, error=refused)
            if key and p.win is not None and refused is None:
                b.grant = key
                p.win.began(key)
            if not sq.inflight:
                p.last_progress = time.monotonic()
            sq.inflight.append(b)
            sq.unposted.append(b)
            failure = sq.post()
        if failure is not None:
            self._fail_peer(p, failure)
        else:
            with self._work:
                self._posts += 1
                self._work.notify()
        return batch_id

    def _through_windows(
        self, p: _VerbsPeer, key: int, wrs: list[Wr], deadline: Deadline | None
    ) -> tuple[list[Wr], TransportError | None]:
        """``wrs`` with each remote rkey replaced by its window's (holding ``p.lock``), or why the batch fails."""
        win = p.win
        assert win is not None
        if key:
            if not win.known(key):  # the sink sent the windows before the key was announced: they are on the way
                wait = min(deadline.remaining() if deadline is not None else 1.0, self._peer_timeout)
                p.lock.wait_for(lambda: win.known(key) or p.error is not None or p.closed, timeout=wait)
                self._check_usable(p)
            if key not in win.grants:
                raise TransportError(
                    f"grant {key} is not live at the sink for this connection (revoked, not granted to this "
                    f"source, or its windows did not arrive): nothing is posted",
                    op="write",
                    errno=errno_mod.EACCES,
                )
        out = []
        for i, (la, lkey, ra, rkey, n) in enumerate(wrs):
            if key:
                windowed = win.rkey(key, ra, n)
                if windowed is None:
                    return [], TransportError(f"write {i} of {len(wrs)}: [{ra:#x}, +{n}) is outside grant {key}",
                                              op="write", errno=errno_mod.EACCES)
                rkey = windowed
            elif rkey == 0:
                return [], TransportError(f"write {i} of {len(wrs)} targets [{ra:#x}, +{n}) without a grant; its "
                                          f"region requires one", op="write", errno=errno_mod.EACCES)
            out.append((la, lkey, ra, rkey, n))
        return out, None

    def completions(self, max_items: int = 1024, *, deadline: Deadline | None = None) -> list[Completion]:
        return self._queue.get(max_items, deadline)

    # ------------------------------------------------------------------ completions

    def _cq_loop(self) -> None:
        idle_polls = 0
        next_watchdog = time.monotonic()
        while not self._stop.is_set():
            with self._work:  # write() appends, then notifies under this lock: no lost wake-up
                with self._lock:
                    active = [p for p in self._peers.values() if (sq := p.sq) is not None and sq.inflight]
                if not active:
                    if not self._stop.is_set():
                        self._work.wait(_IDLE_WAIT)
                    idle_polls = 0
                    continue
                seen = self._posts
            progressed = False
            for p in active:
                progressed |= self._reap(p)
            now = time.monotonic()
            if now >= next_watchdog:
                next_watchdog = now + min(0.05, self._peer_timeout / 10)
                for p in active:
                    sq = p.sq
                    busy = sq is not None and sq.inflight and p.error is None
                    if busy and now - p.last_progress > self._peer_timeout:
                        self._fail_peer(
                            p,
                            TransportError(
                                f"no completion from the peer for {self._peer_timeout:g} s", op="write", errno=errno_mod.ETIMEDOUT
                            ),
                        )
            if progressed:
                idle_polls = 0
            else:
                idle_polls += 1
                # pyverbs 44 cannot wait for a completion event without holding the GIL: back off, but
                # wake at once when a write posts (on soft-RoCE its completion is often there already)
                if idle_polls < 8:
                    time.sleep(0)
                else:
                    with self._work:
                        if self._posts == seen and not self._stop.is_set():
                            self._work.wait(min(1e-3, 2e-5 * idle_polls))

    def _reap(self, p: _VerbsPeer) -> bool:
        """Poll one peer's CQ; complete, fail and post as the completions say. True if it found any."""
        answers: list[int] = []  # grants being revoked whose last batch just completed: tell the sink
        with p.deliver:
            with p.lock:
                sq = p.sq
                if sq is None or p.error is not None:
                    return False
                found, done, failure = sq.reap()
                if found:
                    p.last_progress = time.monotonic()
                if p.win is not None:
                    answers = [b.grant for b in done if b.grant and p.win.ended(b.grant)]
            for b in done:
                self._deliver(p, b, b.error)
            for k in answers:
                self._tell(p, encode_stop(k, answer=True))
            if failure is not None:
                self._fail_peer(p, failure)
        return found or failure is not None

    @staticmethod
    def _tell(p: _VerbsPeer, frame: bytes) -> None:
        """A frame to the sink on the liveness socket (lost if it is gone: then so is its QP)."""
        with p.tell:
            sock = p.sock
            if sock is not None:
                _send_frame(sock, frame)

    def _deliver(self, p: _VerbsPeer, b: WrBatch, error: TransportError | None) -> None:
        deliver(self._queue, p, b.batch_id, b.on_done, error)

    def _fail_peer(self, p: _VerbsPeer, error: TransportError) -> None:
        """Fail every batch in flight to ``p`` (in order), tear its QP down, close its socket. Idempotent.

        The first failing batch gets ``error``; the later ones an error that names it as the cause.
        """
        with p.deliver:
            with p.lock:
                if p.error is None:
                    p.error = error
                p.closed = True
                sq, sock = p.sq, p.sock
                p.sq = p.sock = None
                items: list[WrBatch] = []
                if sq is not None:
                    items = list(sq.inflight)
                    sq.close()
                p.lock.notify_all()
            if sock is not None:
                self._unwatch(sock)
            cause = p.error
            for i, b in enumerate(items):
                err = cause if i == 0 else TransportError(
                    f"not completed: an earlier batch to this peer failed: {cause}", op=cause.op, errno=cause.errno
                )
                self._deliver(p, b, err)

    # ------------------------------------------------------------------ sink side + liveness (cm thread)

    def _watch(self, sock: socket.socket, what: Any) -> None:
        with self._lock:
            self._cm_pending.append((sock, what))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"w")

    def _unwatch(self, sock: socket.socket) -> None:
        with self._lock:
            self._cm_pending.append((sock, None))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"u")

    def _cm_loop(self) -> None:
        while not self._stop.is_set():
            again = self._accept_again
            timeout = 1.0 if again is None else min(1.0, max(0.0, again - time.monotonic()))
            for key, _ in self._sel.select(timeout=timeout):
                if self._stop.is_set():
                    return
                what = key.data
                if what == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    self._cm_apply_pending()
                elif what == "listen":
                    self._cm_accept()
                elif isinstance(what, _VerbsPeer):
                    said = self._heard_from_sink(what, key.fileobj)
                    if said is not None:
                        self._sel_drop(key.fileobj)
                        self._fail_peer(what, _hangup_error(said))
                elif isinstance(what, _SinkConn):
                    if not self._heard_from_source(what, key.fileobj):
                        self._drop_sink(what)
            if self._accept_again is not None and time.monotonic() >= self._accept_again:
                self._accept_again = None
                self._sel.register(self._listener, selectors.EVENT_READ, "listen")

    def _heard_from_sink(self, p: _VerbsPeer, sock: Any) -> bytes | None:
        """A source's liveness socket is readable: apply ``W`` and ``S`` frames; None while it stays
        open, else what ended it (``_REVOKED``, or ``b""`` for EOF or a byte that is no frame)."""
        data = _hangup(sock)
        if not data or p.win is None:
            return data
        try:
            frames = p.reader.feed(data)
        except ValueError:
            return b""
        for kind, key, rows in frames:
            if kind == _REVOKED:
                return _REVOKED
            if kind == FRAME_STOPPED:
                return b""  # the sink's to hear, not ours
            with p.lock:
                if kind == FRAME_WINDOWS:
                    p.win.add(key, rows)
                    p.lock.notify_all()
                    answer = False
                else:
                    answer = p.win.stop(key)
            if answer:
                self._tell(p, encode_stop(key, answer=True))
        return None

    def _heard_from_source(self, c: _SinkConn, sock: Any) -> bool:
        """A sink's liveness socket is readable: record ``s`` answers; False if it ended or broke protocol."""
        data = _hangup(sock)
        if not data:
            return data is None
        try:
            frames = c.reader.feed(data)
        except ValueError:
            return False
        with self._lock:
            for kind, key, _rows in frames:
                if kind != FRAME_STOPPED:
                    return False
                if key in c.windows:  # only an answer to a revoke under way counts (bounded)
                    c.stopped.add(key)
            self._drained.notify_all()
        return True

    def _cm_apply_pending(self) -> None:
        while True:
            with self._lock:
                if not self._cm_pending:
                    return
                sock, what = self._cm_pending.popleft()
            if what is None:
                self._sel_drop(sock)
                sock.close()
            elif sock.fileno() >= 0:
                self._sel.register(sock, selectors.EVENT_READ, what)

    def _sel_drop(self, sock: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)

    def _cm_accept(self) -> None:
        try:
            conn, addr = self._listener.accept()
        except OSError as ex:
            delay = self._backoff.failed(ex)
            if delay is not None:  # out of descriptors: the listener stays readable, watching it would spin
                self._sel_drop(self._listener)
                self._accept_again = time.monotonic() + delay
            return
        self._backoff.succeeded()
        sink: _SinkConn | None = None
        deadline = Deadline.after(min(HELLO_TIMEOUT, self._peer_timeout))  # the whole handshake
        recv = _receiver(conn, deadline)

        def answer(reply: bytes) -> None:
            conn.sendall(reply)
            conn.close()

        def refuse(status: int) -> None:
            answer(hello.encode_reply(status, err=errno_mod.EACCES))

        try:
            prefix = recv(5)
            size = hello.hello_size(prefix)
            if size is None:
                conn.close()
                return
            h = hello.decode_hello(prefix + recv(size - 5))
            if h.sink != self._instance:
                answer(hello.encode_reply(hello.WRONG_INSTANCE))
                return
            key = self._key
            if key is None and h.nonce:
                self._auth.failed(addr, "the source authenticates and this sink has no secret")
                refuse(hello.AUTH_UNSUPPORTED)
                return
            if key is not None and not h.nonce:
                self._auth.failed(addr, "the source sent no proof of the deployment secret (it has none)")
                refuse(hello.AUTH_REQUIRED)
                return
            info = h.info
            if key is not None:  # no QP, no QPN, no grant key before the source proved it holds the secret
                mine = os.urandom(NONCE_BYTES)
                conn.sendall(hello.challenge(key, h, mine))
                try:
                    proof = recv(hello.PROOF.size)
                except OSError as ex:
                    self._auth.failed(addr, f"challenged, it sent no proof of the deployment secret ({ex})")
                    conn.close()
                    return
                checked = hello.check_proof(key, h, mine, proof)
                if checked is None:
                    self._auth.failed(addr, "its proof of the deployment secret is wrong")
                    refuse(hello.AUTH_FAILED)
                    return
                info = checked
            qpn, psn, gid, lid, mtu = hello.QP_INFO.unpack(info)
            with self._lock:
                full = len(self._sinks) >= self._max_sinks  # only this thread adds sinks: the count holds
            if full:
                self.refused_connections += 1
                answer(hello.encode_reply(hello.TOO_MANY, qpn=min(self._max_sinks, 0xFFFFFFFF), err=errno_mod.ECONNREFUSED))
                return
            mypsn = int.from_bytes(os.urandom(3), "little")
            path_mtu = min(mtu, self._dev.mtu)
            qp = None
            try:
                qp = make_qp(self._pd, self._sink_cq, SINK_WR)  # a sink QP posts only window binds and invalidations
                self._to_rts(qp, rqpn=qpn, rpsn=psn, lpsn=mypsn, gid=gid, lid=lid, mtu=path_mtu)
            except pv.Error as ex:
                if qp is not None:
                    qp.close()
                answer(hello.encode_reply(hello.QP_FAILED, err=rdma_errno(ex) or errno_mod.EIO))
                return
            # revocable before the source can use it: in _sinks before the reply with our QPN leaves
            sink = _SinkConn(next(self._sink_ids), conn, qp, h.source)
            with self._mw_lock:  # no grant binds, and no revoke invalidates, between the snapshot and the reply
                with self._lock:
                    if self._closed:
                        qp.close()
                        conn.close()
                        return
                    self._sinks[sink.key] = sink
                # snapshot after the QP is revocable: a revoke either finds this QP or misses the snapshot
                grants = self._grant_snapshot(sink)
                conn.sendall(hello.encode_reply(hello.OK, qp.qp_num, mypsn, path_mtu) + grants)
            conn.setblocking(False)
        except (OSError, struct.error):
            if sink is not None:
                self._drop_sink(sink)
            else:
                conn.close()
            return
        self._sel.register(conn, selectors.EVENT_READ, sink)

    def _drop_sink(self, sink: _SinkConn) -> None:
        """Tear an accepted source down (cm thread); a no-op for the QP if ``revoke`` took it first."""
        with self._mw_lock, self._lock:
            mine = self._sinks.get(sink.key) is sink
            if mine:
                del self._sinks[sink.key]
                self._kill_sink_qp(sink)
            self._drained.notify_all()
        self._sel_drop(sink.sock)
        sink.sock.close()
        if self._accept_again is not None:
            self._accept_again = time.monotonic()  # a descriptor is free: try the listener again now

    # ------------------------------------------------------------------ lifecycle

    def close(self, *, deadline: Deadline | None = None) -> None:
        deadline = deadline or Deadline.after(5.0)
        with self._lock:
            first = not self._closed
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        if not first:
            if self._cq_thread.is_alive() or self._cm_thread.is_alive():
                self._join(deadline)
            return
        for p in peers:
            self._fail_peer(p, TransportError("transport closed with the batch in flight", op="close", errno=errno_mod.ECANCELED))
        self._join(deadline)
        alive = [t.name for t in (self._cq_thread, self._cm_thread) if t.is_alive()]
        if alive:
            # the threads may still touch the CQs and QPs: leave the verbs objects alone rather than crash
            raise TransportError(f"close: threads still running at the deadline: {alive}", op="close")
        with self._lock:
            sinks = list(self._sinks.values())
            self._sinks.clear()
            pending = list(self._cm_pending)
            self._cm_pending.clear()
        for sink in sinks:
            qp_to_error(sink.qp)
            free_windows([w for ws in sink.windows.values() for w in ws])  # a bound window holds its QP
            sink.windows.clear()
        errors: list[Exception] = []
        for sink in sinks:
            try:
                sink.qp.close()
            except pv.Error as ex:
                errors.append(ex)
            sink.sock.close()
        for sock, _what in pending:
            sock.close()
        errors += self._mem.close()
        try:
            self._owned.close()  # selector, wake pair, listener, sink CQ, PD, context (reverse order)
        except pv.Error as ex:
            errors.append(ex)
        if errors:
            raise TransportError(f"close: freeing verbs resources failed: {errors[0]}", op="close", errno=rdma_errno(errors[0]))

    def _stop_threads(self) -> None:
        self._stop.set()
        with self._work:
            self._work.notify_all()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _join(self, deadline: Deadline) -> None:
        self._stop_threads()
        me = threading.current_thread()
        for t in (self._cq_thread, self._cm_thread):
            if t is not me and t.ident is not None:
                t.join(deadline.remaining())

    # ------------------------------------------------------------------ helpers

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransportError("transport is closed", op=op)

    @staticmethod
    def _check_usable(p: _VerbsPeer) -> None:
        if p.error is not None:
            raise TransportError(f"peer is unusable until it is connected again: {p.error}", op="write", errno=p.error.errno)
        if p.closed:
            raise TransportError("peer is disconnected", op="write", errno=errno_mod.ENOTCONN)

    def _own(self, peer: PeerHandle, op: str) -> _VerbsPeer:
        if not isinstance(peer, _VerbsPeer) or self._peers.get(peer.id) is not peer:
            if isinstance(peer, _VerbsPeer) and peer.closed:
                return peer  # write() on it raises a clear "unusable" error; disconnect is idempotent
            raise TransportError("not a peer of this transport", op=op)
        return peer

    def __repr__(self) -> str:
        return f"<VerbsTransport {self.device} {self._hostport} regions={len(self._regions)} peers={len(self._peers)}>"


def _send_frame(sock: socket.socket, data: bytes) -> bool:
    """Send a whole frame on a non-blocking liveness socket, waiting at most ``_SEND_TIMEOUT`` for room;
    False if it could not (the peer is gone, or has not read for that long: the caller cuts it)."""
    view = memoryview(data)
    deadline = Deadline.after(_SEND_TIMEOUT)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            if deadline.expired():
                return False
            select.select([], [sock], [], deadline.remaining())
        except OSError:
            return False
    return True


def _rows(batch: Batch) -> list[tuple[int, int, int]] | list[list[int]]:
    """The batch's ``(local, remote, length)`` rows; plain int triples skip numpy (cheaper per small batch)."""
    if isinstance(batch, (list, tuple)):
        try:
            if all(
                type(la) is int and type(ra) is int and type(n) is int and la >= 0 and ra >= 0 and n > 0
                for la, ra, n in batch
            ):
                return list(batch)
        except (TypeError, ValueError):
            pass  # not triples: as_batch says what is wrong
    return as_batch(batch).tolist()


def _receiver(sock: socket.socket, deadline: Deadline) -> Callable[[int], bytes]:
    """``recv(n)``: exactly ``n`` bytes of a handshake from ``sock``, each wait bounded by what is left
    of ``deadline``."""

    def recv(n: int) -> bytes:
        sock.settimeout(max(deadline.remaining(), 1e-3))
        return _recv_exact(sock, n)

    return recv


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes (the socket's timeout bounds each wait); EOF raises ``ConnectionResetError``."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError(errno_mod.ECONNRESET, "peer closed the connection during the handshake")
        got += k
    return bytes(buf)


def _hangup(sock: Any) -> bytes | None:
    """A liveness socket became readable: what it holds (frames, see ``transport/windows.py``), None if
    nothing yet, ``b""`` for EOF or a broken connection. Without memory windows any byte ends it."""
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""
    return bytes(data)


def _hangup_error(said: bytes) -> TransportError:
    """The error a source's batches fail with when the sink hung up, after saying ``said``."""
    if said[:1] == _REVOKED:
        return TransportError(
            "the sink revoked a grant of this source and moved this connection's QP to the error state "
            "(verbs has no memory windows here); connect again",
            op="write",
            errno=errno_mod.EACCES,
        )
    return TransportError("the peer closed the connection", op="write", errno=errno_mod.ECONNRESET)
