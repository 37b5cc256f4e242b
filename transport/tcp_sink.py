"""The TCP transport's sink side: accepting connections, their handshakes, pairing, and serving frames.

``TcpTransport`` (``transport/tcp.py``) is this and the source side (``tcp_source.py``) over one
state; this part is what a transport does as a sink, apart from what it does as a source. The
regions, grants and ``revoke`` the sink checks frames against are ``tcp.py``'s.

Threads: one acceptor (``_accept_loop``); per accepted connection one sink thread
(``_sink_loop``): the handshake, then, for a data connection, its ack connection and the loop
that lands its frames (an ack connection's thread ends once its handshake handed it over to its
data connection's). An ``accept`` that fails for want of descriptors or memory (EMFILE, ENFILE,
ENOBUFS, ENOMEM: the connection stays queued and the listener readable) is tried again after a
back-off, 10 ms doubling to 1 s, earlier when one of the sink's own connections closes
(``base.AcceptBackoff``): counted in ``accept_failures`` and logged at most every 10 s, never a
spin.

The handshake (the hello is ``tcp_hello.py``'s; authentication: see ``transport/base.py``) has
``min(peer_timeout, 5 s)`` to finish, and until it has, the connection holds none of the
``max_sinks`` places: at most ``MAX_HELLOS`` (64) connections are in their handshake at once. A
newcomer past that takes the place of the oldest one whose client sent no byte yet (the kernel's
``tcp_info`` says; the oldest of all if every one spoke), which is cut without a word
(``evicted_handshakes``; the control channel's rule too); only while ``MAX_HELLOS`` cut ones are
still ending is a newcomer refused with status 6 (``refused_connections``, which counts the
``max_sinks`` refusals too). So an idle or unauthenticated socket holds a thread for at most that
long, and a flood of them that redials what it loses (a few thousand connections a second in the
tests) keeps no authenticated source out: it sends its hello as its connect returns, so it is cut
only by 64 newer connections that all spoke.

A data connection past its handshake holds one of the ``max_sinks`` places and waits
``min(peer_timeout, 5 s)`` more for its ack connection (the hello with its source's pair token),
whose SYN may wait out retransmissions in a listen backlog a flood keeps full; else the sink
hangs up on it. An ack connection holds no place of its own, and the sink writes nothing on a
data connection after its replies. Threads of the sink side stay within ``max_sinks + 2 *
MAX_HELLOS``, and sockets within ``2 * max_sinks + 2 * MAX_HELLOS`` (a data connection's ack
connection is served by its thread).

The sink validates every write of a frame *before* it lands any byte: inside the live grant the
frame names, given to this connection's source (or, with grant 0, inside a region registered
without ``require_grant``); if one is not, it reads and discards the payload (the stream stays in
sync) and acks with an error (worded here, ``_refusal``, so both twins give the same). A frame
that breaks the wire format closes the connection.

Notes (``transport/base.py``, "Notes"; the wire in ``tcp_wire.py``): the loop returns a landed
frame's note with its ack queued, not yet sent; ``_noted`` hands it to the owner's handler on this
thread, and the next ``serve()`` sends the ack, so a source that has the ack knows the handler
returned. Each connection keeps the grants its refused frames named (``_Refusals``): a later note
through one of them is withheld (``notes_withheld``), since the source cannot vouch that all of its
writes through that grant landed. A revoked grant leaves the record once it is full (no frame lands
through it again, so no note through it is handed anyway); past ``MAX_REFUSED_GRANTS`` grants still
live, the source misbehaves (a real one writes within its grants) and its connection is closed.
"""

from __future__ import annotations

import errno as errno_mod
import itertools
import os
import queue
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

from .accepting import client_spoke
from .base import HELLO_TIMEOUT, MAC_BYTES, NONCE_BYTES, AcceptBackoff, AuthFailures, GrantTable, NoteHandler, call_on_note
from .deadline import Deadline
from .tcp_hello import (AT_CAP, AUTH_FAILED, AUTH_REQUIRED, AUTH_UNSUPPORTED, ACKS, BUSY, HELLO_REPLY, MAGIC, NO_PAIR,
                        OK, VERSION, WRONG_INSTANCE, Hello, HelloError, challenge, check_proof, decode_hello,
                        hello_size)
from .tcp_wire import MAX_HELLOS, MAX_MSG, MAX_REFUSED_GRANTS, PeerGone, fast as _fast, kernel_timeouts, recv_by, tune
from .threads import named_thread

_PAIR_POLL = 0.05  # seconds: how often a data connection waiting for its ack connection looks for its end


class SinkSide:
    """``TcpTransport``'s sink side (a mixin): the acceptor and one thread per accepted connection.
    What it reads of the transport's state is declared here; ``TcpTransport.__init__`` sets it."""

    refused_connections: int
    evicted_handshakes: int
    notes_dropped: int
    notes_withheld: int
    _note_handler: NoteHandler | None
    _grants: GrantTable  # the live grants, guarded by _table_lock
    _table_lock: threading.Lock
    _instance: bytes
    _key: bytes | None
    _auth: AuthFailures
    _max_sinks: int
    _max_batch_writes: int
    _peer_timeout: float
    _poll: float
    _peer_ids: itertools.count[int]
    _table: Any  # _fast.Sink: regions, live grants, and the connections landing through them
    _listener: socket.socket
    _wake_r: socket.socket
    _backoff: AcceptBackoff
    _freed: threading.Event
    _lock: threading.Lock
    _stop: threading.Event
    _closed: bool
    _sinks: dict[int, tuple[socket.socket, threading.Thread]]
    _live: set[int]
    _hellos: dict[int, socket.socket]
    _pairs: dict[tuple[bytes, bytes], queue.SimpleQueue[socket.socket | None]]
    _evicting: set[int]

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
                        if not full and len(self._hellos) >= MAX_HELLOS:
                            if len(self._evicting) < MAX_HELLOS:
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
                        t = named_thread(self._sink_loop, f"pdcore-tcp-sink-{sid}", (sid, conn, addr))
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
        prefix = recv_by(conn, 5, deadline, stop)
        try:
            hello = decode_hello(prefix + recv_by(conn, hello_size(prefix) - 5, deadline, stop))
        except HelloError:
            return None  # not our protocol (or another version): hang up without a word
        if hello.sink != self._instance:
            _reply(conn, WRONG_INSTANCE)
            return None
        if not self._authenticated(sid, conn, addr, hello, deadline):
            return None
        return self._admit(sid, conn, hello, waiter)

    def _authenticated(self, sid: int, conn: socket.socket, addr: Any, hello: Hello, deadline: Deadline) -> bool:
        """Whether the source of ``hello`` holds the secret this sink holds: both hold none, or its proof
        answers our challenge. Else the failure is counted in ``auth_failures`` (a handshake cut to make
        room did not fail: it was cut), the reason replied while the connection stands, and False."""
        key = self._key
        if key is None and hello.nonce:
            self._auth.failed(addr, "the source authenticates and this sink has no secret")
            _reply(conn, AUTH_UNSUPPORTED)
            return False
        if key is not None and not hello.nonce:
            self._auth.failed(addr, "the source sent no proof of the deployment secret (it has none)")
            _reply(conn, AUTH_REQUIRED)
            return False
        if key is None:
            return True
        nonce = os.urandom(NONCE_BYTES)
        conn.sendall(HELLO_REPLY.pack(MAGIC, VERSION, OK) + challenge(key, hello, nonce), socket.MSG_NOSIGNAL)
        try:
            check_proof(key, hello, nonce, recv_by(conn, MAC_BYTES, deadline, self._stop))
        except HelloError:
            self._auth.failed(addr, "its proof of the deployment secret is wrong")
            _reply(conn, AUTH_FAILED)
            return False
        except PeerGone as e:
            with self._lock:
                cut = sid in self._evicting
            if not self._stop.is_set() and not cut:  # one cut to make room did not fail: it was cut
                self._auth.failed(addr, f"challenged, it sent no proof of the deployment secret ({e})")
            return False
        return True

    def _admit(self, sid: int, conn: socket.socket, hello: Hello,
               waiter: queue.SimpleQueue[socket.socket | None]) -> Hello | None:
        """An authentic hello's connection, in or out (the reply says which): a data connection takes
        one of the ``max_sinks`` places and puts ``waiter`` in ``_pairs``; an ack connection takes the
        waiter of its pair's data connection and is handed over on it. The hello once in, else None."""
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
                _reply(conn, OK)  # before the hand-over: once the data connection has it, only acks go out on it
                replied = True
            finally:
                waiting.put(conn if replied else None)  # None: the data connection gives up at once
            return hello
        try:
            _reply(conn, status)
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
        ack worded or a landed frame's note handed on (``_noted``), or at the end. An ack connection's
        thread ends once it handed the socket over."""
        served = acks = None
        handed = False
        waiter: queue.SimpleQueue[socket.socket | None] = queue.SimpleQueue()
        try:
            kernel_timeouts(conn, self._poll)
            tune(conn, self._peer_timeout)
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
            refusals = _Refusals(self._live_grant)
            while True:
                result = served.serve()
                if result[0] == _fast.SERVE_NOTED:
                    self._noted(result[1], result[2], refusals)  # before serve() sends its frame's ack
                    continue
                if result[0] != _fast.SERVE_REFUSED:
                    return  # the source lost its connection (or broke the wire): it fails its own batches
                _, seq, code, index, count, target, length, grant, total = result
                if not refusals.add(grant):
                    return  # refused through too many live grants: a misbehaving source
                err, message = _refusal(code, index, count, target, length, grant)
                served.refuse(seq, err, message.encode()[:MAX_MSG], total)
        except (PeerGone, OSError):
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

    def _noted(self, grant: int, note: bytes, refusals: _Refusals) -> None:
        """A frame with a note landed through ``grant`` (its ack not yet sent): hand the note to the
        owner's handler, unless an earlier frame of this connection was refused through that grant
        (withheld) or no handler is installed (dropped)."""
        if grant in refusals:
            with self._lock:
                self.notes_withheld += 1
            return
        handler = self._note_handler
        if handler is None:
            with self._lock:
                self.notes_dropped += 1
            return
        call_on_note(handler, grant, note)

    def _live_grant(self, key: int) -> bool:
        """Whether grant ``key`` is live at this sink now (a revoked one never is again: keys are not reused)."""
        with self._table_lock:
            return self._grants.get(key) is not None


class _Refusals:
    """One data connection's record of the grants its refused frames named: a note through one of them
    is withheld. Bounded: once ``MAX_REFUSED_GRANTS`` are kept, the ones no longer live (``live``) are
    forgotten (every later frame through them is refused anyway), and a source still past the bound
    through live grants is cut (``add`` says so)."""

    def __init__(self, live: Callable[[int], bool]) -> None:
        self._grants: set[int] = set()
        self._live = live

    def __contains__(self, grant: int) -> bool:
        return grant in self._grants

    def add(self, grant: int) -> bool:
        """Record a refusal through ``grant`` (0, no grant: nothing to record); False past the bound."""
        if not grant:
            return True
        self._grants.add(grant)
        if len(self._grants) > MAX_REFUSED_GRANTS:
            self._grants = {g for g in self._grants if self._live(g)}
        return len(self._grants) <= MAX_REFUSED_GRANTS


def _reply(conn: socket.socket, status: int) -> None:
    """A hello reply with ``status`` (``tcp_hello``'s ``OK``, ``AT_CAP``, ...)."""
    conn.sendall(HELLO_REPLY.pack(MAGIC, VERSION, status), socket.MSG_NOSIGNAL)


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
