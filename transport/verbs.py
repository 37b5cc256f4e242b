"""The verbs transport: one-sided RDMA WRITEs over RC queue pairs, through pyverbs.

``transport.create("verbs")`` imports this module, and with it pyverbs; where pyverbs or
an RDMA device is missing, building the transport raises ``StartError`` saying what to
install or load. See ``transport/base.py`` for the contract. This module is the transport
itself, composed of its rooms: its options and resources, its lifecycle, and the cm thread
that watches the listener and every liveness socket. Each room, and each idea they build on,
has a module of its own:

- ``transport/verbs_source.py``: the source side: ``connect``, ``write`` and the completion
  thread;
- ``transport/verbs_sink.py``: the sink's side of the handshake (accepting a source, its sink QP);
- ``transport/verbs_grants.py``: ``grant`` and ``revoke``, the memory windows of a grant on each
  connection, the cut ("Grants and revoke");
- ``transport/verbs_state.py``: what the rooms share (a connection's state on either side, the
  transport's fields by the lock that guards them);
- ``transport/verbs_liveness.py``: the TCP connection beside each queue pair, from the handshake's
  reads to its hang-up ("Handshake and liveness");
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
and reaps their completions itself, see "Grants and revoke" in ``transport/verbs_grants.py``).

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
import selectors
import socket
import threading
import time
from collections import deque
from typing import Any, ClassVar

from .base import (
    AcceptBackoff,
    AuthFailures,
    CompletionQueue,
    Endpoint,
    GrantTable,
    NoteHandler,
    Region,
    check_handler,
    check_secret,
    close_once,
    derive_key,
    encode_endpoint,
    new_instance_id,
)
from . import verbs_hello as hello
from .deadline import Deadline
from .errors import StartError, TransportError
from .threads import named_thread
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
from .verbs_grants import VerbsGrants
from .verbs_liveness import REVOKED, hangup as _hangup, hangup_error as _hangup_error
from .verbs_qp import qp_to_error, wc_status_name
from .verbs_regions import SINK_WR, MemoryRegions, WindowOps, free_windows, probe_windows
from .verbs_sink import VerbsSink
from .verbs_source import VerbsSource
from .verbs_state import SinkConn, VerbsPeer
from .windows import FRAME_STOPPED, FRAME_WINDOWS, encode_stop

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
# a connection's state on either side, under the names tests/transport/test_verbs_revoke.py uses
_VerbsPeer, _SinkConn = VerbsPeer, SinkConn
# The cm thread reads a liveness socket through this module's ``_hangup`` (transport/verbs_liveness.py's
# ``hangup``): tests/rdma/test_grants_verbs.py patches it here to make a source deaf to its sink.


class VerbsTransport(VerbsSource, VerbsSink, VerbsGrants):
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
    ``ValueError``), see "Grants and revoke" in ``transport/verbs_grants.py``.
    """

    name: ClassVar[str] = "verbs"
    _note_handler: NoteHandler | None = None  # on_note's: kept, never called (carries_notes)

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
        self._qp_timeout = _checked_options(
            max_inflight, peer_timeout, max_send_wr, qp_timeout, retry_cnt, max_sinks, memory_windows, max_windows
        )
        self._max_windows = max_windows
        self._max_inflight = max_inflight
        self._peer_timeout = float(peer_timeout)
        self._retry_cnt = retry_cnt
        self._instance = new_instance_id()
        self._batch_ids = itertools.count(1)
        self._peer_ids = itertools.count(1)
        self._peers = {}
        self._sinks = {}
        self._sink_ids = itertools.count(1)
        self._max_sinks = max_sinks
        self.refused_connections = 0
        self._backoff = AcceptBackoff("verbs transport", log)
        self._accept_again = None
        self._grants = GrantTable()
        self._grant_lock = threading.Lock()
        self._last_grant = 0
        self._unconfirmed = {}
        self._mw_lock = threading.Lock()
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._work = threading.Condition()
        self._posts = 0
        self._stop = threading.Event()
        self._closed = False
        self._queue = CompletionQueue(1 << 30)
        self._cm_pending = deque()
        with contextlib.ExitStack() as stack:  # what is open so far closes if a later step raises
            self._open_device(stack, device, ib_port, gid_index, memory_windows, max_send_wr)
            self._listen(stack, host, port, advertise_host)
            self._start_threads(stack)
            self._owned = stack.pop_all()

    def _open_device(
        self,
        stack: contextlib.ExitStack,
        device: str | None,
        ib_port: int | None,
        gid_index: int | None,
        memory_windows: bool | None,
        max_send_wr: int,
    ) -> None:
        """Open the device, its PD and the sink CQ; choose how grants are enforced (``memory_windows``)."""
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

    def _listen(self, stack: contextlib.ExitStack, host: str, port: int, advertise_host: str | None) -> None:
        """Open the handshake listener; the address the endpoint carries names it."""
        try:
            self._listener = socket.create_server((host, port), backlog=128)
        except OSError as ex:
            raise StartError(f"verbs transport: cannot listen on {host}:{port}: {ex}") from ex
        stack.callback(self._listener.close)
        self._listener.setblocking(False)
        hostport = f"{advertise_host or host}:{self._listener.getsockname()[1]}"
        self._address = hello.encode_address(self._dev.gid, self._dev.lid, self._dev.mtu, self._dev.link_layer, hostport)
        self._hostport = hostport

    def _start_threads(self, stack: contextlib.ExitStack) -> None:
        """The cm thread's selector and wake pair, then both threads."""
        self._wake_r, self._wake_w = socket.socketpair()
        stack.callback(self._wake_r.close)
        stack.callback(self._wake_w.close)
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        stack.callback(self._sel.close)
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._cq_thread = named_thread(self._cq_loop, "pdcore-verbs-cq")
        self._cm_thread = named_thread(self._cm_loop, "pdcore-verbs-cm")
        self._cq_thread.start()
        stack.callback(self._stop_threads)
        self._cm_thread.start()

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
    def carries_notes(self) -> bool:
        """False: a batch's WRITEs land without the sink's CPU, so nothing at the sink sees a batch
        complete to hand its note on. (A WRITE with immediate as the batch's last work request could
        carry one, at the cost of a receive queue per sink QP: not done.) ``write(..., note=...)``
        with a note raises; the layer above says "landed" on its control channel instead."""
        return False

    def on_note(self, handler: NoteHandler | None) -> None:
        """Kept, never called: this transport carries no notes (``carries_notes``)."""
        self._note_handler = check_handler(handler)

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
        device cannot enforce ``require_grant`` ("Grants and revoke" in ``transport/verbs_grants.py``)."""
        self._check_open("register")
        return self._mem.register(buf, require_grant)

    def deregister(self, region: Region, *, deadline: Deadline | None = None) -> None:
        self._mem.deregister(region)

    def regions(self) -> tuple[Region, ...]:
        return self._regions.snapshot()

    def endpoint(self) -> bytes:
        """With memory windows a region that requires a grant travels with key 0: no source learns its rkey."""
        return encode_endpoint(Endpoint(self.name, self._instance, self._address, self._mem.advertised()))

    _qp_to_error = staticmethod(qp_to_error)  # tests/rdma break a sink QP through it

    # ------------------------------------------------------------------ the cm thread (listener, liveness sockets)

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
                elif isinstance(what, VerbsPeer):
                    said = self._heard_from_sink(what, key.fileobj)
                    if said is not None:
                        self._sel_drop(key.fileobj)
                        self._fail_peer(what, _hangup_error(said))
                elif isinstance(what, SinkConn):
                    if not self._heard_from_source(what, key.fileobj):
                        self._drop_sink(what)
            if self._accept_again is not None and time.monotonic() >= self._accept_again:
                self._accept_again = None
                self._sel.register(self._listener, selectors.EVENT_READ, "listen")

    def _heard_from_sink(self, p: VerbsPeer, sock: Any) -> bytes | None:
        """A source's liveness socket is readable: apply ``W`` and ``S`` frames; None while it stays
        open, else what ended it (``REVOKED``, or ``b""`` for EOF or a byte that is no frame)."""
        data = _hangup(sock)
        if not data or p.win is None:
            return data
        try:
            frames = p.reader.feed(data)
        except ValueError:
            return b""
        for kind, key, rows in frames:
            if kind == REVOKED:
                return REVOKED
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

    def _heard_from_source(self, c: SinkConn, sock: Any) -> bool:
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

    # ------------------------------------------------------------------ lifecycle

    def close(self, *, deadline: Deadline | None = None) -> None:
        deadline = deadline or Deadline.after(5.0)
        first, peers = close_once(self)
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

    def _kill_sink_qp(self, c: SinkConn) -> str:
        """Move a sink QP to the error state, free its windows, destroy it; '' if the QP stopped.

        A revoke's cut and a dropped source take this teardown one QP at a time; ``close`` the same
        for all of them. (It reads this module's ``pv``: tests/transport/test_verbs_revoke.py doubles it.)"""
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

    def __repr__(self) -> str:
        return f"<VerbsTransport {self.device} {self._hostport} regions={len(self._regions)} peers={len(self._peers)}>"


def _checked_options(
    max_inflight: int,
    peer_timeout: float,
    max_send_wr: int,
    qp_timeout: int | None,
    retry_cnt: int,
    max_sinks: int,
    memory_windows: bool | None,
    max_windows: int,
) -> int:
    """``StartError`` for an option out of its range; the ack timeout exponent to use."""
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
    if qp_timeout is None:
        # ack timeout * (retries + 1) well inside peer_timeout: the QP reports a dead peer first
        budget = peer_timeout / 2 / (retry_cnt + 1)
        qp_timeout = max(n for n in range(8, 21) if 4.096e-6 * 2**n <= budget or n == 8)
    if not 1 <= qp_timeout <= 31:
        raise StartError(f"verbs transport: qp_timeout ({qp_timeout}) must be in 1..31")
    return qp_timeout
