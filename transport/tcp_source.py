"""The TCP transport's source side: a peer's two connections, its writes, their sending and their acks.

``TcpTransport`` (``transport/tcp.py``) is this and the sink side (``tcp_sink.py``) over one
state; this part is what a transport does as a source, apart from what it does as a sink.

``connect`` opens the data connection, then, once it is in, the ack connection; both hellos
(``tcp_hello.py``) carry the same random pair token, by which the sink joins them. With a
secret, the source checks the sink's challenge (a wrong one fails ``connect``: the sink does not
hold our secret) before it sends its proof. A sink cuts a handshake without a word to make room
for a newcomer, refuses one as busy while ``MAX_HELLOS`` cut ones still end, and refuses an ack
connection that came too late for its data connection (its SYN may wait out retransmissions in a
listen backlog a flood keeps full): a source meeting any of these (``_Crowded``) opens its pair
again, three pairs at most, within its connect's deadline.

Per connected peer two threads: a sender (``_send_loop``: what a full socket left over) and an
ack reader (``_ack_loop``: the acks, the callbacks, and the peer's liveness). A batch's path
through them is told in ``transport/tcp.py``.

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
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from .base import (
    auth_failed,
    Batch,
    Completion,
    NONCE_BYTES,
    OnDone,
    PeerHandle,
    RegionTable,
    as_batch,
    check_note,
    decode_endpoint,
    call_on_done,
)
from .deadline import Deadline
from .errors import CapacityError, TransportError
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
    MAGIC,
    NO_PAIR,
    OK,
    PAIR_BYTES,
    VERSION,
    WRONG_INSTANCE,
    Hello,
    HelloError,
    check_challenge,
    encode_hello,
)
from .tcp_wire import MAX_HELLOS, NO_RANGES, PeerGone, fast as _fast, kernel_timeouts, ranges, recv_by, tune
from .threads import named_thread

_CONNECT_TRIES = 3  # pairs a connect opens at most when a flood makes the sink cut or refuse them (_Crowded)
# Source.post's results, as plain module ints: write() compares one per batch
_POSTED, _POSTED_WAKE, _FULL, _FAILED = _fast.POST_SENT, _fast.POST_WAKE, _fast.POST_FULL, _fast.POST_FAILED
_ARRAY, _TOO_MANY = _fast.POST_ARRAY, _fast.POST_TOO_MANY


def _usable(p: Any) -> None:
    """After waiting for a slot: the peer did not fail meanwhile."""
    if p.error is not None:
        raise TransportError(f"peer is unusable: {p.error}", op="write")


class _Crowded(TransportError):
    """A connect the sink cut or refused for want of room, as a flood of connections makes it do: its
    handshake cut without a word, ``MAX_HELLOS`` handshakes in progress, or the ack connection late
    for its data connection (its SYN waited in a full listen backlog). ``connect`` opens the pair
    again, ``_CONNECT_TRIES`` times at most within its deadline; the last one is raised as it is."""


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
    remote_ranges: tuple[np.ndarray, np.ndarray] = (NO_RANGES, NO_RANGES)  # the endpoint's regions: starts, lengths

    def __post_init__(self) -> None:
        self.lock = threading.Condition(self.mutex)
        self.wake = threading.Condition(self.mutex)

    def slot_freed(self) -> None:
        """A slot came back and a writer waits for one (``Source.on_slot``)."""
        with self.lock:
            self.lock.notify_all()


class SourceSide:
    """``TcpTransport``'s source side (a mixin): ``connect``, ``write`` and the two threads of each peer.
    What it reads of the transport's state is declared here; ``TcpTransport.__init__`` sets it."""

    name: ClassVar[str]
    _instance: bytes
    _key: bytes | None
    _max_inflight: int
    _max_batch_writes: int
    _peer_timeout: float
    _poll: float
    _batch_ids: itertools.count[int]
    _peer_ids: itertools.count[int]
    _snap: tuple[Any, ...]
    _peers: dict[int, _TcpPeer]
    _lock: threading.Lock
    _stop: threading.Event
    _closed: bool
    _done: Any  # _fast.Completions: the queue completions() takes from
    _check_open: Callable[[str], None]
    _join: Callable[[list[threading.Thread], Deadline], None]

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
        peer.remote_ranges = ranges(remote.regions)
        peer.src = _fast.Source(sock, ack_sock, self._max_inflight, self._max_batch_writes, refused)
        peer.src.on_slot = peer.slot_freed
        with self._lock:
            if self._closed:
                sock.close()
                ack_sock.close()
                raise TransportError("transport is closed", op="connect")
            self._peers[peer.id] = peer
        for target, role in ((self._send_loop, "send"), (self._ack_loop, "ack")):
            t = named_thread(target, f"pdcore-tcp-{role}-{peer.id}", (peer,))
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
            tune(sock, self._peer_timeout)
            kernel_timeouts(sock, self._poll)
        except (PeerGone, OSError) as e:  # OSError: a send to a sink that already hung up
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
            body = recv_by(sock, CHALLENGE.size, deadline, self._stop)
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
                f"{where} refused the connection: {MAX_HELLOS} handshakes are in progress there", op="connect", errno=errno_mod.ECONNREFUSED
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
        magic, version, status = HELLO_REPLY.unpack(recv_by(sock, HELLO_REPLY.size, deadline, self._stop))
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
            peer.remote_ranges = ranges(remote.regions)

    def disconnect(self, peer: PeerHandle, *, deadline: Deadline | None = None) -> None:
        p = self._own(peer)
        self._fail_peer(p, TransportError("peer disconnected", op="disconnect"))
        with self._lock:
            owned = self._peers.pop(p.id, None) is p
        if owned:
            self._join(p.threads, deadline or Deadline.after(5.0))
            p.src.close()  # its sockets, once no writer is sending on them

    def write(self, peer: PeerHandle, batch: Batch, on_done: OnDone | None = None, *,
              deadline: Deadline | None = None, grant: int = 0, note: bytes = b"") -> int:
        """A ``note`` goes at the end of the frame's head, in the same ``sendmsg`` (``tcp_wire.py``)."""
        p = self._own(peer)
        if not 0 <= grant < 1 << 64:
            raise TransportError(f"a grant key is an unsigned 64-bit value, got {grant!r}", op="write")
        if note or type(note) is not bytes:  # (a batch without a note pays for this test alone)
            if type(batch) is not list and type(batch) is not tuple:  # (a list's length is its writes already:
                batch = as_batch(batch)  # post takes a small one as it is, as_batch makes the rest an array)
            check_note(note, len(batch), grant, True, self.name)
        snap = self._snap
        rem_starts, rem_lengths = p.remote_ranges
        src = p.src
        while True:
            # one pass: every local and remote range checked, a slot taken, the head (header with its
            # seq, descriptors) built, and the frame sent from this thread if nobody is sending
            code, batch_id = src.post(batch, grant, on_done, self._batch_ids, snap[0], snap[1], snap[4], rem_starts, rem_lengths,
                                      note)
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

    def _own(self, peer: PeerHandle) -> _TcpPeer:
        if not isinstance(peer, _TcpPeer) or self._peers.get(peer.id) is not peer:
            if isinstance(peer, _TcpPeer) and peer.closed:
                return peer  # write() on it raises a clear "unusable" error; disconnect is idempotent
            raise TransportError("not a peer of this transport", op="write")
        return peer


def refused(status: int, err: int, message: bytes) -> TransportError:
    """The error of a batch the sink refused (its ack's status, errno and message)."""
    return TransportError(f"peer refused the batch: {message.decode('utf-8', 'replace')}", op="write", errno=err or None)


def _oserror(err: int) -> str:
    """An errno as ``str(OSError)`` words it."""
    return f"[Errno {err}] {os.strerror(err)}"
