"""The TCP transport: one-sided writes over plain sockets, for machines without RDMA.

Payloads go from registered memory (``sendmsg`` of iovecs pointing into it, no
intermediate copy) straight into the target's registered memory (``recvmsg``
into iovecs pointing there). See ``transport/base.py`` for the contract; this
module only adds the wire and the threads.

Wire (little-endian), two TCP connections per (source, sink) pair: frames go out on
the data connection, acks come back on the ack connection (one socket per direction,
so a source's sends and its ack reader never wait for one socket's lock: on a
single socket each ack's reader slept on the lock the sender held, and the
sender paid its wake-up, about a quarter of the source's CPU on single 16 KiB
batches). The source opens the data connection, then, once it is in, the ack
connection; both hellos carry the same random pair token, by which the sink
joins them.

- hello, source → sink: ``"PDTC", version u8, sink instance [16], source instance [16],
  kind u8 (1 data, 2 acks), pair token [16]`` (a source without a secret), or ``"PDTA"``,
  the same fields and a source nonce [16] (a source with one);
  sink → source: a reply ``"PDTC", version u8, status u8``: 0 ok, 1 wrong instance,
  2 at its connection cap, 3 this sink needs the secret (the hello was ``PDTC``), 4 this
  sink has no secret (the hello was ``PDTA``), 5 the source's proof was wrong, 6 too many
  handshakes in progress and cut ones still ending (2 and 6 may come before the hello is
  read), 7 an ack connection no data connection of its source and pair token waits for
  (or a data connection whose pair token is in use).
- after a ``PDTA`` hello and a reply with status 0 (authentication, see below): the sink
  sends its nonce [16] and ``MAC("tcp/4 sink", sink instance, source instance, kind, pair
  token, source nonce, sink nonce)`` [32]; the source checks it (a wrong one fails
  ``connect``: the sink does not hold our secret) and sends ``MAC("tcp/4 source", same
  fields)`` [32]; the sink checks it and sends a second reply (0 ok, 2 at cap, 5 wrong
  proof, 7 no pair). The MAC is HMAC-SHA256 with the key ``derive_key(secret, "tcp-hello")``
  over length-prefixed fields (``transport.base.hello_mac``). Frames (on a data connection)
  and acks (on an ack connection) follow a reply with status 0 that is not followed by a
  challenge. A data connection holds one of the ``max_sinks`` places; it waits for its ack
  connection within its handshake's time, else the sink hangs up on it. An ack connection
  holds no place of its own, and the sink writes nothing on a data connection after its
  replies.
- batch frame, source → sink: ``seq u64, count u32, 0 u32, grant u64``, then
  ``count`` pairs ``(remote_addr u64, length u64)``, then the payload of every
  write in order.
- ack, sink → source on the ack connection, one per batch in the order received:
  ``seq u64, status u32 (0 ok), errno i32, message length u32``, then the UTF-8 message.

The sink validates every write of a frame *before* it lands any byte: inside
the live grant the frame names, given to this connection's source (or, with
grant 0, inside a region registered without ``require_grant``); if one is not,
it reads and discards the payload (the stream stays in sync) and acks with an
error. A frame that breaks the wire format closes the connection. ``revoke``
waits for frames landing through the grant, and cuts the connection of one
still landing at its deadline (a paused source), so nothing lands after it.

Authentication (``secret``): see ``transport/base.py``. The hello is parsed
and checked by pure functions (``decode_hello``, ``check_challenge``,
``check_proof``; ``fuzz/fuzz_hello.py`` fuzzes them); the sink threads only
move their bytes. A handshake has ``min(peer_timeout, 5 s)`` to finish, and
until it has, the connection holds none of the ``max_sinks`` places: at most
``_MAX_HELLOS`` (64) connections are in their handshake at once. A newcomer
past that takes the place of the oldest one whose client sent no byte yet (the
kernel's ``tcp_info`` says; the oldest of all if every one spoke), which is cut
without a word (``evicted_handshakes``; the control channel's rule too);
only while ``_MAX_HELLOS`` cut ones are still ending is a newcomer refused with
status 6 (``refused_connections``, which counts the ``max_sinks`` refusals
too). So an idle or unauthenticated socket holds a thread for at most that
long, and a flood of them that redials what it loses (a few thousand
connections a second in the tests) keeps no authenticated source out: it
sends its hello as its connect returns, so it is cut only by 64 newer
connections that all spoke. A data connection past its handshake waits
``min(peer_timeout, 5 s)`` more for its ack connection, whose SYN may wait out
retransmissions in a listen backlog the flood keeps full; a source whose
handshake was cut, refused as busy, or whose ack connection came too late
opens its pair again (three pairs at most, within its connect's deadline). Threads of the sink side stay
within ``max_sinks + 2 * _MAX_HELLOS``, and sockets within ``2 * max_sinks + 2 * _MAX_HELLOS``
(a data connection's ack connection is served by its thread).

Threads: one acceptor; per accepted data connection one sink thread (an ack
connection's thread ends once its handshake handed it over); per connected
peer one sender and one ack reader (as before the loops were
compiled: what changed is that none of them takes the GIL per batch).
``close()`` wakes and joins every one of them. An ``accept`` that fails for
want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM: the connection
stays queued and the listener readable) is tried again after a back-off, 10 ms
doubling to 1 s, earlier when one of the sink's own connections closes
(``base.AcceptBackoff``): counted in ``accept_failures`` and logged at most
every 10 s, never a spin.

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
   back to Python only to have a refused frame's ack worded (``_refusal``),
   and at the end. No GIL hand-off per frame.
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

A source's state lives in ``_fast.Source``: each of its methods is atomic to
other Python threads (the state changes with the GIL held; Python is called
out to only where no state is half-changed), and the syscalls work on what
only the caller owns meanwhile (the frames a send is using stay referenced;
a writer's socket is closed only once its send returned: ``Source.close``). A
queue-mode batch keeps its slot until ``completions()`` takes it
(``_fast.Completions``). Error messages are worded here, from the twins' result
codes, so both give the same ones.
"""

from __future__ import annotations

import errno as errno_mod
import itertools
import logging
import os
import queue
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .base import (
    AcceptBackoff,
    auth_failed,
    Batch,
    Completion,
    Endpoint,
    Grant,
    HELLO_TIMEOUT,
    MAC_BYTES,
    NONCE_BYTES,
    AuthFailures,
    GrantTable,
    OnDone,
    PeerHandle,
    Region,
    RegionTable,
    Transport,
    as_batch,
    buffer_span,
    byte_view,
    check_secret,
    decode_endpoint,
    call_on_done,
    derive_key,
    encode_endpoint,
    new_instance_id,
)
from .accepting import client_spoke
from .deadline import Deadline
from .errors import CapacityError, StartError, TransportError
from .tcp_hello import (
    AT_CAP,
    AUTH_FAILED,
    AUTH_REQUIRED,
    AUTH_UNSUPPORTED,
    ACKS,
    BUSY,
    CHALLENGE,
    DATA,
    HELLO_REPLY,
    KEY_LABEL,
    MAGIC,
    NO_PAIR,
    OK,
    PAIR_BYTES,
    VERSION,
    WRONG_INSTANCE,
    Hello,
    HelloError,
    challenge,
    check_challenge,
    check_proof,
    decode_hello,
    encode_hello,
    hello_size,
)
from .twins import IMPLEMENTATION, load

# The per-batch work (a batch's frame, the sink's checks of a frame, the acks) has two twins,
# chosen by transport/twins.py.
if TYPE_CHECKING:
    from . import _tcp_fast_py as _fast
else:
    _fast = load("transport._tcp_fast")

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

_MAX_HELLOS = 64
_CONNECT_TRIES = 3  # pairs a connect opens at most when a flood makes the sink cut or refuse them (_Crowded)
_PAIR_POLL = 0.05  # seconds: how often a data connection waiting for its ack connection looks for its end
_FRAME = struct.Struct("<QIIQ")  # seq, count, 0, grant
_ACK = struct.Struct("<QIiI")
assert _FRAME.size == _fast.FRAME_SIZE and _ACK.size == _fast.ACK_SIZE
_NO_RANGES = np.zeros(0, np.uint64)
_NO_REGIONS: tuple[Any, ...] = (_NO_RANGES, _NO_RANGES, np.zeros(0, np.uint8), [], [])
_MAX_MSG = _fast.MAX_MSG
# Source.post's results, as plain module ints: write() compares one per batch
_POSTED, _POSTED_WAKE, _FULL, _FAILED = _fast.POST_SENT, _fast.POST_WAKE, _fast.POST_FULL, _fast.POST_FAILED
_ARRAY, _TOO_MANY = _fast.POST_ARRAY, _fast.POST_TOO_MANY


# Sockets are blocking with kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO = one poll interval): a call
# that waited that long raises BlockingIOError (EAGAIN), a "tick" on which the loops check for
# stop and stalls. Python-level socket timeouts would add a poll() before every recv/send.
_TICK = (BlockingIOError, TimeoutError)


def _usable(p: Any) -> None:
    """After waiting for a slot: the peer did not fail meanwhile."""
    if p.error is not None:
        raise TransportError(f"peer is unusable: {p.error}", op="write")


def _kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class _Crowded(TransportError):
    """A connect the sink cut or refused for want of room, as a flood of connections makes it do: its
    handshake cut without a word, ``_MAX_HELLOS`` handshakes in progress, or the ack connection late
    for its data connection (its SYN waited in a full listen backlog). ``connect`` opens the pair
    again, ``_CONNECT_TRIES`` times at most within its deadline; the last one is raised as it is."""


class _PeerGone(Exception):
    """The connection ended or broke; carries the errno when there is one."""

    def __init__(self, message: str, err: int | None) -> None:
        super().__init__(message)
        self.errno = err


def _recv_by(sock: socket.socket, n: int, deadline: Deadline, stop: threading.Event) -> bytes:
    """Read exactly ``n`` bytes of a handshake before ``deadline`` (the whole of it has one), in ticks
    of the socket's timeout; ``stop`` set = the transport is closing."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except _TICK:
            if stop.is_set():
                raise _PeerGone("transport closing", None) from None
            if deadline.expired():
                raise _PeerGone(f"the handshake did not finish in time ({got} of {n} bytes)", errno_mod.ETIMEDOUT) from None
            continue
        except OSError as e:
            raise _PeerGone(f"connection broke: {e}", e.errno) from e
        if k == 0:
            raise _PeerGone("peer closed the connection", errno_mod.ECONNRESET)
        got += k
    return bytes(buf)










def _tune(sock: socket.socket, peer_timeout: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (
        ("TCP_KEEPIDLE", max(1, int(peer_timeout))),
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", max(1000, int(peer_timeout * 1000))),
    ):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


@dataclass(slots=True)
class _Local:
    region: Region
    view: memoryview
    owner: Any


@dataclass(eq=False, slots=True)
class _TcpPeer(PeerHandle):
    sock: socket.socket | None = None
    ack_sock: socket.socket | None = None
    # Its batches from post to completion (seq, slots, frames to send and awaiting acks, the ack
    # stream): _fast.Source, whose methods are each atomic to Python threads and send and receive
    # without the GIL.
    src: Any = None
    # One mutex, two conditions: ``lock`` wakes writers waiting for a slot (notified only when one
    # waits), ``wake`` only the sender thread (a full socket left it a remainder, or an error).
    mutex: threading.RLock = field(default_factory=threading.RLock)
    lock: threading.Condition = field(init=False)
    wake: threading.Condition = field(init=False)
    deliver: threading.RLock = field(default_factory=threading.RLock)  # one peer's completions, in order
    error: TransportError | None = None
    threads: list[threading.Thread] = field(default_factory=list)
    remote_ranges: tuple[np.ndarray, np.ndarray] = (_NO_RANGES, _NO_RANGES)  # the endpoint's regions: starts, lengths

    def __post_init__(self) -> None:
        self.lock = threading.Condition(self.mutex)
        self.wake = threading.Condition(self.mutex)

    def slot_freed(self) -> None:
        """A slot came back and a writer waits for one (``Source.on_slot``)."""
        with self.lock:
            self.lock.notify_all()


def _ranges(regions: tuple[Region, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of regions sorted by address, as the fast path's ``uint64`` arrays."""
    return np.array([r.addr for r in regions], np.uint64), np.array([r.length for r in regions], np.uint64)


class TcpTransport(Transport):
    """The TCP transport. Options: ``host`` (bind address, default 127.0.0.1), ``port`` (0: any),
    ``advertise_host`` (address peers dial, default ``host``), ``max_inflight`` (64 batches per
    peer), ``peer_timeout`` (10 s without progress = dead peer), ``max_batch_writes`` (writes per
    batch a sink accepts, 1 Mi), ``max_sinks`` (authenticated connections at once, 1024: past it
    a new one is refused), ``secret`` (bytes of 16..4096, default None: the deployment secret;
    with it every connection handshake is a mutual challenge-response, see the module
    docstrings; failed handshakes are counted in ``auth_failures``)."""

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
        self._done = _fast.Completions(Completion, _refused)  # bounded by the in-flight slots, which it holds
        try:
            self._listener = socket.create_server((host, port), backlog=4096)
        except OSError as e:
            raise StartError(f"tcp transport: cannot listen on {host}:{port}: {e}") from e
        self._address = f"{advertise_host or host}:{self._listener.getsockname()[1]}".encode()
        self._wake_r, self._wake_w = socket.socketpair()
        self._acceptor = threading.Thread(target=self._accept_loop, name="pdcore-tcp-accept", daemon=True)
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

    # ------------------------------------------------------------------ source side

    def connect(self, peer_endpoint: bytes, *, deadline: Deadline) -> PeerHandle:
        self._check_open("connect")
        remote = decode_endpoint(peer_endpoint, expect=self.name)
        host, _, port_s = remote.address.decode("ascii", "replace").rpartition(":")
        try:
            port = int(port_s)
        except ValueError:
            raise TransportError(f"tcp endpoint address {remote.address!r} is not host:port", op="connect") from None
        for tries_left in range(_CONNECT_TRIES - 1, -1, -1):
            pair = os.urandom(PAIR_BYTES)  # names this source's two connections to each other at the sink
            try:
                sock = self._open(host, port, remote.instance, DATA, pair, deadline)
                try:
                    ack_sock = self._open(host, port, remote.instance, ACKS, pair, deadline)
                except BaseException:
                    sock.close()
                    raise
                break
            except _Crowded:
                if not tries_left or deadline.expired():
                    raise
        peer = _TcpPeer(next(self._peer_ids), remote, RegionTable(remote.regions), sock=sock, ack_sock=ack_sock)
        peer.remote_ranges = _ranges(remote.regions)
        peer.src = _fast.Source(sock, ack_sock, self._max_inflight, self._max_batch_writes, _refused)
        peer.src.on_slot = peer.slot_freed
        with self._lock:
            if self._closed:
                sock.close()
                ack_sock.close()
                raise TransportError("transport is closed", op="connect")
            self._peers[peer.id] = peer
        for target, role in ((self._send_loop, "send"), (self._ack_loop, "ack")):
            t = threading.Thread(target=target, args=(peer,), name=f"pdcore-tcp-{role}-{peer.id}", daemon=True)
            peer.threads.append(t)
            t.start()
        return peer

    def _open(self, host: str, port: int, sink: bytes, kind: int, pair: bytes, deadline: Deadline) -> socket.socket:
        """One of a source's two connections (``kind`` ``DATA`` or ``ACKS``), past its handshake."""
        try:
            sock = socket.create_connection((host, port), timeout=max(deadline.remaining(), 1e-3))
        except OSError as e:
            raise TransportError(f"cannot connect to {host}:{port}: {e}", op="connect", errno=e.errno) from e
        try:
            self._hello(sock, f"{host}:{port}", Hello(sink, self._instance, kind, pair), deadline)
            _tune(sock, self._peer_timeout)
            _kernel_timeouts(sock, self._poll)
        except (_PeerGone, OSError) as e:  # OSError: a send to a sink that already hung up
            sock.close()
            hung_up = e.errno in (errno_mod.ECONNRESET, errno_mod.EPIPE)  # a sink cuts a handshake without a word
            raise (_Crowded if hung_up else TransportError)(
                f"handshake with {host}:{port} failed: {e}", op="connect", errno=e.errno
            ) from e
        except BaseException:
            sock.close()
            raise
        return sock

    def _hello(self, sock: socket.socket, where: str, hello: Hello, deadline: Deadline) -> None:
        """The source's side of the handshake; returns once the sink said "frames may follow"."""
        key = self._key
        if key is not None:
            hello = replace(hello, nonce=os.urandom(NONCE_BYTES))
        sock.settimeout(max(deadline.remaining(), 1e-3))
        sock.sendall(encode_hello(hello))
        status = self._reply(sock, where, deadline)
        if status == OK and key is not None:
            sock.settimeout(max(deadline.remaining(), 1e-3))
            body = _recv_by(sock, CHALLENGE.size, deadline, self._stop)
            try:
                _nonce, answer = check_challenge(key, hello, body)
            except HelloError:
                raise auth_failed(where, "it could not prove that it holds the deployment secret (different secrets?)") from None
            sock.sendall(answer)
            status = self._reply(sock, where, deadline)
        if status == OK:
            return
        if status == AT_CAP:
            raise TransportError(
                f"{where} refused the connection: it is at its cap of data connections", op="connect", errno=errno_mod.ECONNREFUSED
            )
        if status == BUSY:
            raise _Crowded(
                f"{where} refused the connection: {_MAX_HELLOS} handshakes are in progress there", op="connect", errno=errno_mod.ECONNREFUSED
            )
        if status == WRONG_INSTANCE:
            raise TransportError(f"{where} is another transport instance than the endpoint names (restarted?)", op="connect")
        if status == NO_PAIR:
            raise _Crowded(
                f"{where} refused the ack connection: no data connection of this source waits for it (it gave up waiting?)",
                op="connect", errno=errno_mod.ECONNREFUSED,
            )
        if status == AUTH_REQUIRED:
            raise auth_failed(where, "it requires the deployment secret and this transport has none (its secret option is unset)")
        if status == AUTH_UNSUPPORTED:
            raise auth_failed(where, "it has no deployment secret and this transport authenticates every connection")
        if status == AUTH_FAILED:
            raise auth_failed(where, "it did not accept this transport's proof of the deployment secret")
        raise TransportError(f"{where} answered the hello with unknown status {status}", op="connect", errno=errno_mod.EPROTO)

    def _reply(self, sock: socket.socket, where: str, deadline: Deadline) -> int:
        sock.settimeout(max(deadline.remaining(), 1e-3))
        magic, version, status = HELLO_REPLY.unpack(_recv_by(sock, HELLO_REPLY.size, deadline, self._stop))
        if magic != MAGIC or version != VERSION:
            raise TransportError(f"{where} does not speak pdcore tcp v{VERSION}", op="connect", errno=errno_mod.EPROTO)
        return int(status)

    def refresh(self, peer: PeerHandle, peer_endpoint: bytes) -> None:
        remote = decode_endpoint(peer_endpoint, expect=self.name)
        if remote.instance != peer.remote.instance:
            raise TransportError("refresh: the endpoint is of another transport instance", op="refresh")
        new = RegionTable(remote.regions)
        peer.remote, peer.regions = remote, new
        if isinstance(peer, _TcpPeer):
            peer.remote_ranges = _ranges(remote.regions)

    def disconnect(self, peer: PeerHandle, *, deadline: Deadline | None = None) -> None:
        p = self._own(peer)
        self._fail_peer(p, TransportError("peer disconnected", op="disconnect"))
        with self._lock:
            owned = self._peers.pop(p.id, None) is p
        if owned:
            self._join(p.threads, deadline or Deadline.after(5.0))
            p.src.close()  # its sockets, once no writer is sending on them

    def write(
        self,
        peer: PeerHandle,
        batch: Batch,
        on_done: OnDone | None = None,
        *,
        deadline: Deadline | None = None,
        grant: int = 0,
    ) -> int:
        p = self._own(peer)
        if not 0 <= grant < 1 << 64:
            raise TransportError(f"a grant key is an unsigned 64-bit value, got {grant!r}", op="write")
        snap = self._snap
        rem_starts, rem_lengths = p.remote_ranges
        src = p.src
        while True:
            # one pass: every local and remote range checked, a slot taken, the head (header with its
            # seq, descriptors) built, and the frame sent from this thread if nobody is sending
            code, batch_id = src.post(batch, grant, on_done, self._batch_ids, snap[0], snap[1], snap[4], rem_starts, rem_lengths)
            if code == _POSTED:
                return batch_id
            if code == _POSTED_WAKE:  # the socket is full: the sender thread sends the rest when it drains
                with p.mutex:
                    p.wake.notify()
                return batch_id
            if code == _FULL:
                self._wait_slot(p, deadline)
                continue
            if code == _FAILED:
                raise TransportError(f"peer is unusable: {p.error or 'disconnected'}", op="write")
            if code == _ARRAY:  # not the plan's (n, 3) uint64 array: as_batch makes one (or says why not)
                arr = batch
                batch = as_batch(batch)
                if batch is arr:
                    raise TransportError("a batch array that as_batch cannot make C-contiguous", op="write")
                continue
            if code == _TOO_MANY:
                as_batch(batch)  # a zero length is reported first, as for any batch
                raise TransportError(f"a batch holds at most {self._max_batch_writes} writes, got {len(batch)}", op="write")
            la, ra, n = (int(x) for x in batch[src.index])
            if code == _fast.FRAME_ZERO_LENGTH:
                raise TransportError("a write in the batch has length 0", op="write")
            if code == _fast.FRAME_LOCAL_OUTSIDE:
                raise TransportError(f"local range [{la:#x}, +{n}) is not inside a registered region", op="write")
            raise TransportError(f"remote range [{ra:#x}, +{n}) is not inside a region the peer announced", op="write")

    def _wait_slot(self, p: _TcpPeer, deadline: Deadline | None) -> None:
        """``p`` is at ``max_inflight``: without a deadline that is a ``CapacityError`` at once; with one,
        wait for a slot (every completion that frees one while a writer waits notifies ``p.lock``) and
        return for the caller to post again. A slot seen free here is not held: another writer's post
        (which takes no lock here) may take it first, so only the deadline's passing is a ``CapacityError``."""
        limit, src = self._max_inflight, p.src
        if deadline is None:
            raise CapacityError(
                f"{limit} batches already in flight to this peer "
                "(queue-mode batches hold their slot until completions() takes them)"
            )
        with p.lock:
            src.waiters += 1
            try:
                p.lock.wait_for(lambda: src.slots < limit or src.failed, timeout=deadline.remaining())
            finally:
                src.waiters -= 1
        _usable(p)
        if src.slots >= limit and deadline.expired():
            raise CapacityError(f"{limit} batches still in flight to this peer at the deadline")

    def completions(self, max_items: int = 1024, *, deadline: Deadline | None = None) -> list[Completion]:
        done = self._done
        out = done.take(max_items)
        while not out and deadline is not None and not deadline.expired():
            done.wait(deadline.remaining())  # without the GIL; an ack loop's push wakes it
            out = done.take(max_items)
        return out

    def _send_loop(self, p: _TcpPeer) -> None:
        """What a full socket left over: the writer that met it handed the rest here (``wake``)."""
        src = p.src
        while True:
            with p.mutex:
                p.wake.wait_for(lambda: p.error is not None or src.has_work())
                if p.error is not None:
                    return
            err = src.send_blocking()  # without the GIL, in ticks of the socket's kernel timeout
            if err > 0:
                self._fail_peer(p, TransportError(f"sending to peer failed: {_oserror(err)}", op="write", errno=err))
                return
            if err < 0:
                return  # failed elsewhere (ack reader, disconnect, close)

    def _ack_loop(self, p: _TcpPeer) -> None:
        """Every ack the sink sends: ``Source.acks`` reads them and completes their batches without the
        GIL (queue-mode ones straight onto the transport's queue), and comes back here only to have
        callbacks called, on each tick of the socket's kernel timeout (the peer's liveness), or at the end."""
        src, done = p.src, self._done
        while True:
            got, detail = src.acks(done)
            if got == _fast.ACKS_GOT:
                with p.deliver:
                    callbacks = src.callbacks()  # their slots are back
                    if src.waiters:
                        p.slot_freed()
                    for on_done, batch_id, error in callbacks:
                        call_on_done(on_done, batch_id, error)
                continue
            if got == _fast.ACKS_FAILED:
                return  # failed elsewhere (disconnect, close, the sender): it completed the rest
            if got == _fast.ACKS_TICK:
                if p.error is not None:
                    return
                if self._stop.is_set():
                    self._fail_peer(p, TransportError("peer lost: transport closing", op="write"))
                    return
                why = src.idle(self._peer_timeout)
                if why:
                    what = "peer sent nothing" if why == 1 else "no progress"
                    error = TransportError(f"peer lost: {what} for {self._peer_timeout:g} s", op="write", errno=errno_mod.ETIMEDOUT)
                    self._fail_peer(p, error)
                    return
                continue
            if got == _fast.ACKS_CLOSED:
                err = src.err
                what = f"connection broke: {_oserror(err)}" if err else "peer closed the connection"
                error = TransportError(f"peer lost: {what}", op="write", errno=err or errno_mod.ECONNRESET)
            elif got == _fast.ACKS_BAD:
                error = TransportError(f"peer lost: ack message of {detail} bytes", op="write", errno=errno_mod.EPROTO)
            else:
                error = TransportError(f"peer acked batch {detail} out of order", op="write", errno=errno_mod.EPROTO)
            self._fail_peer(p, error)  # after the callbacks of the acks before the break, in order
            return

    def _fail_peer(self, p: _TcpPeer, error: TransportError) -> None:
        """Fail every batch in flight to ``p`` (in order) and shut its socket. Idempotent."""
        with p.deliver:
            with p.mutex:
                if p.error is None:
                    p.error = error
                p.closed = True
                callbacks = p.src.fail(self._done, p.error)  # queue-mode ones queued (which wakes completions())
                p.lock.notify_all()
                p.wake.notify_all()
            for s in (p.sock, p.ack_sock):
                if s is not None:
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            for on_done, batch_id, err in callbacks:
                call_on_done(on_done, batch_id, err)

    # ------------------------------------------------------------------ sink side

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r or self._stop.is_set():
                        return
                    try:
                        conn, addr = self._listener.accept()
                    except OSError as e:
                        delay = self._backoff.failed(e)
                        if delay is not None:  # out of descriptors: retrying at once would spin
                            self._freed.wait(delay)
                            self._freed.clear()
                        continue
                    self._backoff.succeeded()
                    with self._lock:
                        if self._closed:
                            conn.close()
                            return
                        # bounded threads and sockets, whoever dials: authenticated ones, and handshakes
                        # (a data connection waiting for its ack connection lets one more in: that one)
                        full = AT_CAP if len(self._live) - len(self._pairs) >= self._max_sinks else 0
                        if not full and len(self._hellos) >= _MAX_HELLOS:
                            if len(self._evicting) < _MAX_HELLOS:
                                self._evict()
                            else:  # as many cut ones still ending: no more threads now
                                full = BUSY
                        if full:
                            self.refused_connections += 1
                            try:
                                conn.send(HELLO_REPLY.pack(MAGIC, VERSION, full), socket.MSG_DONTWAIT)
                            except OSError:
                                pass
                            conn.close()
                            continue
                        sid = next(self._peer_ids)
                        t = threading.Thread(
                            target=self._sink_loop, args=(sid, conn, addr), name=f"pdcore-tcp-sink-{sid}", daemon=True
                        )
                        self._sinks[sid] = (conn, t)
                        self._hellos[sid] = conn
                    t.start()
        finally:
            sel.close()

    def _evict(self) -> None:
        """Make room for a newcomer (holds ``_lock``): cut the oldest handshake whose client sent no
        byte yet, else the oldest. A source sends its hello as its connect returns, so a flood of idle
        connections faster than the hello threads cuts its own, not a source's whose thread has not
        run yet. The victim's thread reads the end of the stream and goes; until then it counts in
        ``_evicting``."""
        victim = next((sid for sid, conn in self._hellos.items() if not client_spoke(conn)), None)
        if victim is None:
            victim = next(iter(self._hellos))
        conn = self._hellos.pop(victim)
        self._evicting.add(victim)
        self.evicted_handshakes += 1
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _sink_hello(self, sid: int, conn: socket.socket, addr: Any, deadline: Deadline,
                    waiter: queue.SimpleQueue[socket.socket | None]) -> Hello | None:
        """The sink's side of the handshake, within ``deadline``: the hello once the connection is in,
        else None (hang up). A data connection then holds one of the ``max_sinks`` places, and
        ``waiter`` waits in ``_pairs`` for its ack connection; an ack connection was put on the
        ``waiter`` of its data connection."""
        stop = self._stop
        key = self._key

        def reply(status: int) -> None:
            conn.sendall(HELLO_REPLY.pack(MAGIC, VERSION, status), socket.MSG_NOSIGNAL)

        prefix = _recv_by(conn, 5, deadline, stop)
        try:
            hello = decode_hello(prefix + _recv_by(conn, hello_size(prefix) - 5, deadline, stop))
        except HelloError:
            return None  # not our protocol (or another version): hang up without a word
        if hello.sink != self._instance:
            reply(WRONG_INSTANCE)
            return None
        if key is None and hello.nonce:
            self._auth.failed(addr, "the source authenticates and this sink has no secret")
            reply(AUTH_UNSUPPORTED)
            return None
        if key is not None and not hello.nonce:
            self._auth.failed(addr, "the source sent no proof of the deployment secret (it has none)")
            reply(AUTH_REQUIRED)
            return None
        if key is not None:
            nonce = os.urandom(NONCE_BYTES)
            conn.sendall(HELLO_REPLY.pack(MAGIC, VERSION, OK) + challenge(key, hello, nonce), socket.MSG_NOSIGNAL)
            try:
                check_proof(key, hello, nonce, _recv_by(conn, MAC_BYTES, deadline, stop))
            except HelloError:
                self._auth.failed(addr, "its proof of the deployment secret is wrong")
                reply(AUTH_FAILED)
                return None
            except _PeerGone as e:
                with self._lock:
                    cut = sid in self._evicting
                if not stop.is_set() and not cut:  # one cut to make room did not fail: it was cut
                    self._auth.failed(addr, f"challenged, it sent no proof of the deployment secret ({e})")
                return None
        pair = (hello.source, hello.pair)
        with self._lock:
            if sid in self._evicting:
                return None  # cut to make room just now: its socket is shut
            self._hellos.pop(sid, None)
            if hello.kind == ACKS:  # no place of its own: it is its data connection's other half
                waiting = self._pairs.pop(pair, None)
                status = NO_PAIR if waiting is None else OK
            elif pair in self._pairs:
                status = NO_PAIR  # a pair token in use: never a real source's (they are random)
            elif len(self._live) >= self._max_sinks:
                status = AT_CAP
                self.refused_connections += 1
            else:
                status = OK
                self._live.add(sid)
                self._pairs[pair] = waiter
        if status == OK and hello.kind == ACKS:
            assert waiting is not None  # OK for an ack connection: its data connection waits
            replied = False
            try:
                reply(OK)  # before the hand-over: once the data connection has it, only acks go out on it
                replied = True
            finally:
                waiting.put(conn if replied else None)  # None: the data connection gives up at once
            return hello
        try:
            reply(status)
        except OSError:
            if status == OK:
                early = self._unpair(pair, waiter)  # an ack connection that came before our reply went
                if early is not None:
                    early.close()
            raise
        return hello if status == OK else None

    def _unpair(self, pair: tuple[bytes, bytes], waiter: queue.SimpleQueue[socket.socket | None]) -> socket.socket | None:
        """A data connection stops waiting for its ack connection: the one handed over meanwhile, or None."""
        with self._lock:
            if self._pairs.get(pair) is waiter:
                del self._pairs[pair]
                return None
        try:  # taken out of _pairs: its thread puts it (or None) right after its reply
            return waiter.get(timeout=HELLO_TIMEOUT)
        except queue.Empty:
            return None

    def _await_acks(self, conn: socket.socket, pair: tuple[bytes, bytes],
                    waiter: queue.SimpleQueue[socket.socket | None], deadline: Deadline) -> socket.socket | None:
        """A data connection's ack connection, within the handshake's ``deadline``; None if it did not
        come, or if the data connection sent anything meanwhile (a source sends no frame before its ack
        connection is in: that is its end, or not a source), which frees its place at once."""
        while not self._stop.is_set() and not deadline.expired():
            try:
                return waiter.get(timeout=min(_PAIR_POLL, deadline.remaining()))
            except queue.Empty:
                pass
            try:
                conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                pass
            break
        return self._unpair(pair, waiter)

    def _sink_loop(self, sid: int, conn: socket.socket, addr: Any) -> None:
        """One accepted connection: the handshake; then, for a data connection, its ack connection
        (the source opens it once this one is in) and ``_fast.SinkConn.serve``, which lands its
        frames without the GIL and acks on the other, returning here only to have a refused frame's
        ack worded, or at the end. An ack connection's thread ends once it handed the socket over."""
        served = acks = None
        handed = False
        waiter: queue.SimpleQueue[socket.socket | None] = queue.SimpleQueue()
        try:
            _kernel_timeouts(conn, self._poll)
            _tune(conn, self._peer_timeout)
            deadline = Deadline.after(min(self._peer_timeout, HELLO_TIMEOUT))
            hello = self._sink_hello(sid, conn, addr, deadline, waiter)
            if hello is None:
                return
            if hello.kind == ACKS:
                handed = True
                return
            # a window of its own: the ack connection's SYN may wait out retransmissions in a listen
            # backlog a flood keeps full (1 s, then 3 s more)
            pair_deadline = Deadline.after(min(self._peer_timeout, HELLO_TIMEOUT))
            acks = self._await_acks(conn, (hello.source, hello.pair), waiter, pair_deadline)
            if acks is None:
                return
            served = self._table.connection(conn, acks, hello.source, self._max_batch_writes, self._peer_timeout)
            while True:
                result = served.serve()
                if result[0] != _fast.SERVE_REFUSED:
                    return  # the source lost its connection (or broke the wire): it fails its own batches
                _, seq, code, index, count, target, length, grant, total = result
                err, message = _refusal(code, index, count, target, length, grant)
                served.refuse(seq, err, message.encode()[:_MAX_MSG], total)
        except (_PeerGone, OSError):
            pass  # the source lost its connection: it fails its own batches
        finally:
            if served is not None:
                served.close()  # before the sockets close: a revoke cuts only attached connections
            if not handed:
                conn.close()
            if acks is not None:
                acks.close()
            with self._lock:
                self._sinks.pop(sid, None)
                self._live.discard(sid)
                self._hellos.pop(sid, None)
                self._evicting.discard(sid)
            self._freed.set()  # an acceptor backing off for want of descriptors may try again

    # ------------------------------------------------------------------ lifecycle

    def close(self, *, deadline: Deadline | None = None) -> None:
        deadline = deadline or Deadline.after(5.0)
        with self._lock:
            first = not self._closed
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
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

    def _own(self, peer: PeerHandle) -> _TcpPeer:
        if not isinstance(peer, _TcpPeer) or self._peers.get(peer.id) is not peer:
            if isinstance(peer, _TcpPeer) and peer.closed:
                return peer  # write() on it raises a clear "unusable" error; disconnect is idempotent
            raise TransportError("not a peer of this transport", op="write")
        return peer

    def __repr__(self) -> str:
        return f"<TcpTransport {self._address.decode()} regions={len(self._regions)} peers={len(self._peers)}>"


def _refusal(code: int, i: int, count: int, addr: int, length: int, grant: int) -> tuple[int, str]:
    """The errno and message of the ack of a frame the sink refused (``_fast.LAND_*`` ``code``, at write
    ``i`` of ``count``, ``[addr, +length)``): EFAULT for a target outside every region, EACCES for a
    grant refusal. Worded here, so both twins give the same."""
    if code == _fast.LAND_OUTSIDE_REGIONS:
        return errno_mod.EFAULT, f"write {i} of {count} targets [{addr:#x}, +{length}), outside every region registered at the sink"
    if code == _fast.LAND_NEEDS_GRANT:
        return errno_mod.EACCES, f"write {i} of {count} targets [{addr:#x}, +{length}) without a grant; its region requires one"
    if code == _fast.LAND_GRANT_NOT_LIVE:
        return errno_mod.EACCES, f"write {i} of {count}: grant {grant} is not live at the sink (revoked, or never granted)"
    if code == _fast.LAND_GRANT_OTHER_SOURCE:
        return errno_mod.EACCES, f"write {i} of {count}: grant {grant} was given to another source"
    return errno_mod.EACCES, f"write {i} of {count}: [{addr:#x}, +{length}) is outside grant {grant}"


def _refused(status: int, err: int, message: bytes) -> TransportError:
    """The error of a batch the sink refused (its ack's status, errno and message)."""
    return TransportError(f"peer refused the batch: {message.decode('utf-8', 'replace')}", op="write", errno=err or None)


def _oserror(err: int) -> str:
    """An errno as ``str(OSError)`` words it."""
    return f"[Errno {err}] {os.strerror(err)}"
