"""The TCP transport: one-sided writes over plain sockets, for machines without RDMA.

Payloads go from registered memory (``sendmsg`` of iovecs pointing into it, no
intermediate copy) straight into the target's registered memory (``recvmsg``
into iovecs pointing there). See ``transport/base.py`` for the contract; this
transport only adds the wire and the threads, in rooms of their own:
``TcpTransport`` here is a source side (``tcp_source.py``: connect, write, the
sender and ack reader of each peer) and a sink side (``tcp_sink.py``: the
acceptor, handshakes, pairing, the loop that lands frames) over one state, with
the regions, grants and lifecycle they share. The hello is ``tcp_hello.py``'s
(sans-IO), the frames and acks ``tcp_wire.py``'s.

Two TCP connections per (source, sink) pair: frames go out on the data
connection, acks come back on the ack connection (wire v4; one socket per
direction, so a source's sends and its ack reader never wait for one socket's
lock: on a single socket each ack's reader slept on the lock the sender held,
and the sender paid its wake-up, about a quarter of the source's CPU on single
16 KiB batches). The source opens the data connection, then, once it is in, the
ack connection; both hellos carry the same random pair token, by which the sink
joins them.

Threads: one acceptor; per accepted data connection one sink thread (an ack
connection's thread ends once its handshake handed it over; ``tcp_sink.py``); per
connected peer one sender and one ack reader (``tcp_source.py``; as before the
loops were compiled: what changed is that none of them takes the GIL per batch).
``close()`` wakes and joins every one of them.

A batch's path, and the threads it crosses. The per-batch work is compiled
(``transport._tcp_fast``; its pure twin ``_tcp_fast_py`` under
``PDCORE_PURE_PYTHON=1``, ``IMPLEMENTATION`` names the one in use), and every
syscall on it runs without the GIL:

1. ``write`` (the caller's thread) hands the batch to ``Source.post``, which
   checks every local and remote range, takes an in-flight slot, gives the
   batch its seq and builds its head (header and descriptors) in one pass in C.
   A writer that finds nobody sending sends the frame itself — one ``sendmsg``
   of the head and the payload's iovecs with ``MSG_DONTWAIT`` — and any frame
   other writers queued meanwhile. No hand-off. Only what a full socket leaves
   goes to the sender thread (``POST_WAKE``; one hand-off for everything
   queued until the socket drains, which it sends gathered, up to 2,048 iovecs
   a ``sendmsg``).
2. The sink thread (the other process) wakes when bytes come, unless it is
   already busy: its loop (``_fast.SinkConn.serve``) lands frame after frame
   without the GIL. Per frame: read the header and descriptors; check every
   write against the regions and the live grant the frame names
   (``_fast.Sink``: both in C behind a pthread mutex, which register,
   deregister, grant and revoke take too; ``GrantTable.check``'s rules, the
   grant looked up once per frame) and, on success, mark the connection
   landing through that grant, into those regions; ``recvmsg`` the payload
   straight into place with up to 40 bytes more, the next frame's header and
   first descriptor when they are already there (one call per pipelined frame);
   clear the mark. Acks are gathered while further frames are already waiting
   (at most 16 batches or 1 MiB) and sent before the loop would block: at
   once for a lone batch (its payload read found nothing after it). It comes
   back to Python only to have a refused frame's ack worded (``tcp_sink._refusal``), to
   hand a landed frame's note to the owner's handler before its ack goes out
   (``tcp_sink._noted``; a frame without a note never comes back), and at the end.
   No GIL hand-off per frame.
3. The source's ack reader wakes for the acks (one hand-off per group: it
   takes every ack that came in one ``recv``). Its loop (``Source.acks``) runs
   without the GIL: it matches each ack against the oldest frame in flight and
   moves that frame, as a C pointer under the source's mutex, onto the
   transport's completion queue (``_fast.Completions``, behind its own mutex),
   or, for a batch with ``on_done``, onto the source's list of callbacks due;
   only then does it take the GIL, to call those, oldest first. Queue-mode
   completions never take the GIL on this thread.
4. Queue mode only: a thread waiting in ``completions()`` with nothing queued
   (it waits without the GIL, on the queue's pthread condition) is woken: one
   hand-off per wait, not per batch. Under load the queue is not empty when
   ``completions()`` is called, and nothing wakes. A writer waiting for a slot
   is woken likewise, only when one waits.

So a lone batch crosses two threads (sink, ack reader; three in queue mode
when the caller already waits in ``completions()``), as a raw request and
reply over sockets would, and no GIL hand-over on the way (the callbacks of
callback mode aside); pipelined batches share those wake-ups when acks queue
up. In ``benchmarks/transport.py``'s single 16 KiB pages the sink keeps up
with the source, so most acks go alone: the ack reader spends about 2 µs of CPU
a batch and the writer about 9.5 µs, against 4.5 and 11.5 µs while acks came
back on the data socket (the floor's writer: about 8.5). Before the loops were
compiled, the same three threads each also took the GIL per batch: the sink
thread for its receive, check and ack, the ack reader per completion, and the
completion queue's Python condition — a GIL hand-over per step in each
process, ~30 µs a single-page batch against the floor's ~5-15 µs. A
queue-mode caller could read the acks itself and save step 3's wake-up, but
the ack reader must stay for callbacks (they run on a transport thread) and
for liveness, and two readers of one socket would wait for each other's lock
as the sender and the ack reader did.

``revoke`` takes the grant out of the sink's table (no frame through it is
checked from then on), then waits for the mark of a frame already landing
through it. At its deadline it shuts down the connections still marked
(``Sink.cut_grant``, under the mutex: a marked connection's loop has not ended,
so its socket is not closed nor its descriptor reused) and returns once their
loops stopped receiving and cleared the mark; they write nothing after that
(``tests/transport/test_tcp_sink.py`` drives the loop and the table directly on
both twins). ``deregister`` waits for the marks into its region the same way.
The sink's loop writes by address: a region whose deregister timed out keeps
its memory referenced (``_stuck``), and so do all of them after a ``close()``
whose threads did not end.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .base import (
    AcceptBackoff,
    Completion,
    Endpoint,
    Grant,
    AuthFailures,
    GrantTable,
    NoteHandler,
    Region,
    RegionTable,
    Transport,
    buffer_span,
    byte_view,
    check_handler,
    check_secret,
    close_once,
    derive_key,
    encode_endpoint,
    new_instance_id,
)
from .deadline import Deadline
from .errors import StartError, TransportError
from .tcp_hello import (
    KEY_LABEL,
    Hello,
    HelloError,
    check_challenge,
    check_proof,
    decode_hello,
    encode_hello,
)
from .tcp_sink import SinkSide
from .tcp_source import SourceSide, _TcpPeer, refused
from .tcp_wire import NO_RANGES, fast as _fast, ranges as _ranges
from .threads import named_thread
from .twins import IMPLEMENTATION
# Read here by the tests and the fuzzer, as before the sides had modules of their own.
from .tcp_hello import MAGIC  # noqa: F401
from .tcp_wire import ACK as _ACK, FRAME as _FRAME, MAX_HELLOS as _MAX_HELLOS, kernel_timeouts as _kernel_timeouts  # noqa: F401

__all__ = [
    "IMPLEMENTATION",
    "Hello",
    "HelloError",
    "TcpTransport",
    "check_challenge",
    "check_proof",
    "decode_hello",
    "encode_hello",
]

log = logging.getLogger("transport.tcp")

_NO_REGIONS: tuple[Any, ...] = (NO_RANGES, NO_RANGES, np.zeros(0, np.uint8), [], [])


@dataclass(slots=True)
class _Local:
    region: Region
    view: memoryview
    owner: Any


class TcpTransport(SourceSide, SinkSide, Transport):
    """The TCP transport. Options: ``host`` (bind address, default 127.0.0.1), ``port`` (0: any),
    ``advertise_host`` (address peers dial, default ``host``), ``max_inflight`` (64 batches per
    peer), ``peer_timeout`` (10 s without progress = dead peer), ``max_batch_writes`` (writes per
    batch a sink accepts, 1 Mi), ``max_sinks`` (authenticated connections at once, 1024: past it
    a new one is refused), ``secret`` (bytes of 16..4096, default None: the deployment secret;
    with it every connection handshake is a mutual challenge-response, see the module
    docstrings; failed handshakes are counted in ``auth_failures``).

    It carries notes (``carries_notes``): a batch's note rides its frame, after the descriptors, and
    the sink hands it to the ``on_note`` handler before the frame's ack goes out (``tcp_wire.py``).
    ``notes_dropped`` counts the notes that came while no handler was installed, ``notes_withheld``
    those not handed because an earlier frame of their connection was refused through their grant."""

    name: ClassVar[str] = "tcp"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        max_inflight: int = 64,
        peer_timeout: float = 10.0,
        max_batch_writes: int = 1 << 20,
        max_sinks: int = 1024,
        secret: bytes | None = None,
    ) -> None:
        if max_inflight < 1 or peer_timeout <= 0 or max_batch_writes < 1 or max_sinks < 1:
            raise StartError(
                f"tcp transport: max_inflight ({max_inflight}), peer_timeout ({peer_timeout}) and "
                f"max_batch_writes ({max_batch_writes}) and max_sinks ({max_sinks}) must be positive"
            )
        secret = check_secret(secret, "tcp transport")
        self._key = derive_key(secret, KEY_LABEL) if secret is not None else None
        del secret  # only the derived key is kept
        self._auth = AuthFailures("tcp transport", log)
        self._max_sinks = max_sinks
        self.refused_connections = 0  # past max_sinks (or with _MAX_HELLOS cut handshakes still ending) and closed
        self.evicted_handshakes = 0  # handshakes cut to make room for a newcomer (_MAX_HELLOS in progress)
        self.notes_dropped = 0  # notes that landed while no handler was installed (on_note)
        self.notes_withheld = 0  # notes through a grant one of their connection's earlier frames was refused through
        self._note_handler: NoteHandler | None = None
        self._max_inflight = max_inflight
        self._peer_timeout = float(peer_timeout)
        self._poll = min(0.25, self._peer_timeout / 4)
        self._max_batch_writes = max_batch_writes
        self._instance = new_instance_id()
        self._regions = RegionTable()
        self._locals: dict[int, _Local] = {}
        self._keys = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._peer_ids = itertools.count(1)
        self._grants = GrantTable()  # the API's record of live grants, guarded by _table_lock
        self._guarded: set[int] = set()  # keys of regions registered with require_grant
        # What every frame is checked against (regions, live grants) and which connections are landing
        # one, in C behind the mutex the sink loops take without the GIL (see _fast.Sink).
        self._table = _fast.Sink()
        self._table_lock = threading.Lock()  # one register/deregister/grant/revoke changes the table at a time
        self._stuck: list[Any] = []  # owners of regions deregistered while a frame still landed into them
        # The registered regions as the source's fast path reads them: starts, lengths, guarded
        # flags, keys, views. Replaced whole, under _table_lock, by register/deregister.
        self._snap: tuple[Any, ...] = _NO_REGIONS
        self._peers: dict[int, _TcpPeer] = {}
        self._sinks: dict[int, tuple[socket.socket, threading.Thread]] = {}  # every accepted connection
        self._live: set[int] = set()  # the sids among them past their handshake: what max_sinks bounds
        self._hellos: dict[int, socket.socket] = {}  # those in their handshake, oldest first: what _MAX_HELLOS bounds
        # data connections past their handshake waiting for their ack connection, by (source, pair): a
        # live one each, so at most max_sinks
        self._pairs: dict[tuple[bytes, bytes], queue.SimpleQueue[socket.socket | None]] = {}
        self._evicting: set[int] = set()  # sids cut to make room whose thread has not ended yet
        self._freed = threading.Event()  # a sink connection closed (a descriptor is free), or close()
        self._backoff = AcceptBackoff("tcp transport", log)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._done = _fast.Completions(Completion, refused)  # bounded by the in-flight slots, which it holds
        try:
            self._listener = socket.create_server((host, port), backlog=4096)
        except OSError as e:
            raise StartError(f"tcp transport: cannot listen on {host}:{port}: {e}") from e
        self._address = f"{advertise_host or host}:{self._listener.getsockname()[1]}".encode()
        self._wake_r, self._wake_w = socket.socketpair()
        self._acceptor = named_thread(self._accept_loop, "pdcore-tcp-accept")
        self._acceptor.start()

    # ------------------------------------------------------------------ registrations

    @property
    def instance(self) -> bytes:
        return self._instance

    @property
    def auth_failures(self) -> int:
        """Handshakes this sink refused for authentication: a wrong or missing proof of the secret,
        a secret on one side only, or a source that hung up or stalled once challenged."""
        return self._auth.count

    @property
    def accept_failures(self) -> int:
        """Accepts that failed for want of descriptors or memory (each followed by a back-off)."""
        return self._backoff.count

    @property
    def sink_buffers(self) -> list[int]:
        """The bytes each data connection this sink serves holds in its own buffers now (a frame's
        header and descriptors, gathered acks, a refused payload's scratch), one figure per
        connection (diagnostics). Between frames each stays within a small bound (its header buffer
        64 KiB), however many writes the batches it received held: a batch of ``max_batch_writes``
        writes (16 MiB of descriptors at the default) is held only while it is read and checked."""
        return list(self._table.retained())

    @property
    def revoke_method(self) -> str:
        """How ``revoke`` enforces: ``"sink check"`` (the sink checks every write against its grant)."""
        return "sink check"

    @property
    def carries_notes(self) -> bool:
        """True: a note rides its batch's frame (``tcp_wire.py``)."""
        return True

    def on_note(self, handler: NoteHandler | None) -> None:
        """Install the handler every sink thread hands landed notes to (read once per note: a change
        applies to the next one)."""
        self._note_handler = check_handler(handler)

    def register(self, buf: Any, *, require_grant: bool = False) -> Region:
        self._check_open("register")
        addr, length, owner = buffer_span(buf)
        region = Region(addr, length, next(self._keys))
        self._locals[region.key] = _Local(region, byte_view(addr, length, owner), owner)
        if require_grant:
            self._guarded.add(region.key)
        self._regions.add(region)
        with self._table_lock:
            self._resnap()
        return region

    def _resnap(self) -> None:
        """Rebuild ``_snap`` and the sink table's regions from the region table (holds ``_table_lock``):
        a deregistered region takes no frame checked after this."""
        regions = [(r, local) for r in self._regions.snapshot() if (local := self._locals.get(r.key)) is not None]
        starts, lengths = _ranges(tuple(r for r, _ in regions))
        guarded = np.array([r.key in self._guarded for r, _ in regions], np.uint8)
        keys = [r.key for r, _ in regions]
        views = [local.view for _, local in regions]
        self._table.set_regions(starts, lengths, guarded, np.array(keys, np.uint64), views)
        self._snap = (starts, lengths, guarded, keys, views)

    def grant(self, source: bytes, ranges: Any) -> Grant:
        self._check_open("grant")
        with self._table_lock:
            g = self._grants.add(source, ranges)
            bad = self._regions.outside(g.ranges)
            if bad is not None:
                self._grants.pop(g.key)
                raise ValueError(f"grant range [{bad[0]:#x}, +{bad[1]}) is outside every registered region")
            starts = np.fromiter([a for a, _ in g.ranges], np.uint64, len(g.ranges))
            lengths = np.fromiter([n for _, n in g.ranges], np.uint64, len(g.ranges))
            self._table.add_grant(g.key, g.source, starts, lengths)
        return g

    def revoke(self, grant: Grant, *, deadline: Deadline | None = None, settled: bool = False) -> None:
        deadline = deadline or Deadline.after(1.0)
        key = grant.key
        with self._table_lock:
            if self._grants.get(key) not in (None, grant):
                return  # another sink's grant: keys are per sink
            self._grants.pop(key)
            # No frame through it is checked in from now on; one checked before is marked landing (a
            # second revoke still waits for it).
            self._table.remove_grant(key)
        if self._table.wait_grant(key, deadline.remaining()):
            return
        # A frame still landing at the deadline (a paused or stalled source): cut its connection; its
        # loop stops receiving and clears the mark, after which it writes nothing more.
        self._table.cut_grant(key)
        if not self._table.wait_grant(key, self._poll * 4 + 1.0):
            raise TransportError(f"revoke: a write through grant {key} is still landing", op="revoke")

    def deregister(self, region: Region, *, deadline: Deadline | None = None) -> None:
        if not self._regions.remove(region):
            return
        deadline = deadline or Deadline.after(self._peer_timeout)
        with self._table_lock:
            self._resnap()
        idle = self._table.wait_region(region.key, deadline.remaining())
        self._guarded.discard(region.key)
        local = self._locals.pop(region.key, None)
        if not idle:
            # The sink loop writes by address: the memory stays referenced while a frame may still land.
            self._stuck.append(local)
            raise TransportError(
                f"deregister: {region} still has writes landing after the deadline", op="deregister"
            )

    def regions(self) -> tuple[Region, ...]:
        return self._regions.snapshot()

    def endpoint(self) -> bytes:
        return encode_endpoint(Endpoint(self.name, self._instance, self._address, self._regions.snapshot()))

    # ------------------------------------------------------------------ lifecycle

    def close(self, *, deadline: Deadline | None = None) -> None:
        deadline = deadline or Deadline.after(5.0)
        first, peers = close_once(self)
        if first:
            self._stop.set()
            self._table.stop()
            self._freed.set()
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
        for p in peers:
            self._fail_peer(p, TransportError("transport closed with the batch in flight", op="close"))
        with self._lock:
            sinks = list(self._sinks.values())
        for conn, _t in sinks:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        threads = [self._acceptor] + [t for p in peers for t in p.threads] + [t for _c, t in sinks]
        self._join(threads, deadline)
        if first:
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
            for p in peers:
                p.src.close()  # its sockets, once no writer is sending on them
        alive = [t.name for t in threads if t.is_alive()]
        for region in self._regions.clear():
            local = self._locals.pop(region.key, None)
            if alive:  # a sink thread may still be landing by address: keep the memory referenced
                self._stuck.append(local)
        with self._table_lock:
            self._resnap()
        # completions nobody will take still hold slots; they are dropped with the transport
        if alive:
            raise TransportError(f"close: threads still running at the deadline: {alive}", op="close")

    def _join(self, threads: list[threading.Thread], deadline: Deadline) -> None:
        me = threading.current_thread()
        for t in threads:
            if t is not me and t.ident is not None:
                t.join(deadline.remaining())

    # ------------------------------------------------------------------ helpers

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransportError("transport is closed", op=op)

    def __repr__(self) -> str:
        return f"<TcpTransport {self._address.decode()} regions={len(self._regions)} peers={len(self._peers)}>"
