"""The pure twin's ``Source``, one connected peer's batches: part of ``transport._tcp_fast_py``, which
re-exports it (see there for the contract).

From ``post`` (``frame``'s checks, a slot, the seq; the writer that finds nobody sending sends the
frame itself) through ``send_blocking`` (the sender thread: what a full socket left) to ``acks`` (the
ack loop: acks complete frames oldest first, into ``callbacks`` or onto ``Completions``) and ``fail``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ._tcp_fast_completions_py import Completions, _error_of, _Frame
from ._tcp_fast_frame_py import _ACK, _IOV_CHUNK, _SEQ, _TICK, ACK_SIZE, _seconds, _u64, frame

POST_SENT = 0  # posted: on the wire, or queued behind a send in progress that will take it
POST_WAKE = 4  # posted: the sender thread must send the rest (the socket was full)
POST_FULL = 5  # not posted: max_inflight batches in flight
POST_FAILED = 6  # not posted: the peer failed or was disconnected
POST_ARRAY = 7  # not posted: the batch is not a C-contiguous (n, 3) uint64 numpy array (as_batch makes one)
POST_TOO_MANY = 8  # not posted: more writes than max_writes
ACKS_GOT = 0  # acks completed batches with callbacks: callbacks() has them
ACKS_TICK = 1  # the read waited one kernel timeout
ACKS_CLOSED = 2  # the peer closed the connection, or it broke (errno in ``err``)
ACKS_BAD = 3  # an ack's message is longer than the bound (its length in the result)
ACKS_ORDER = 4  # an ack for another batch than the oldest in flight (its seq in the result)
ACKS_FAILED = 5  # the peer failed meanwhile (fail() completed what was left)
MAX_MSG = 4096  # the longest ack message a source accepts

_SEND_GATHER = 2048  # buffers of queued frames taken for one send at most (sent _IOV_CHUNK at a time)
_ACK_BUF = 65536
_TICKED = -1  # a send waited one kernel timeout (or would block)
_GONE = -3  # the peer failed while a send was under way


_SMALL_BATCH = 16  # writes a list or tuple batch may hold to be taken as it is (an EPD item's: one or two)


def _small_batch(batch: Any) -> np.ndarray | None:
    """A ``list`` or ``tuple`` of 1 to ``_SMALL_BATCH`` ``(local, remote, length)`` triples of ``int`` (each a
    ``tuple`` or ``list``) in 0..2**64-1, as a ``(n, 3)`` ``uint64`` array; None for anything else, which then
    goes through ``as_batch`` (its conversion and its error messages). The compiled twin copies such a batch
    without making an array (an EPD encode rank posts one triple per item)."""
    if type(batch) is not list and type(batch) is not tuple or not 0 < len(batch) <= _SMALL_BATCH:
        return None
    for triple in batch:
        if (type(triple) is not tuple and type(triple) is not list) or len(triple) != 3:
            return None
        if not all(type(v) is int and 0 <= v < 1 << 64 for v in triple):
            return None
    return np.array(batch, dtype=np.uint64)


class Source:
    """One connected peer's batches, from ``post`` to their completion: their seq, the in-flight
    slots, the frames not yet sent and those awaiting acks, and the ack stream.

    Locking: the frame lists (queued, in flight, completed with a callback not yet called) and the
    failed flag are behind a lock, which the ack loop (``acks``) takes to complete frames and every
    other method takes to change them; the rest changes as the compiled twin's does with the GIL
    held. The syscalls (``sendmsg`` of heads and payloads straight from registered memory, ``recv``
    of acks) work on what only the caller owns meanwhile: the frames a send is using stay
    referenced by it, and a socket is closed only once no send is under way (``close``).

    Threads: any writer (``post``; the first that finds nobody sending sends its frame itself,
    without waiting, and any queued behind it), one sender thread (``send_blocking``: what a full
    socket left over) and one ack reader (``acks``, ``callbacks``, ``idle``)."""

    def __init__(self, sock: Any, ack_sock: Any, max_inflight: int, max_writes: int, refused: Any) -> None:
        if sock is None or ack_sock is None or refused is None:
            raise TypeError("sock, ack_sock and refused must not be None")
        if not isinstance(max_inflight, int) or not isinstance(max_writes, int):
            raise TypeError("max_inflight and max_writes must be integers")
        self._sock, self._ack_sock = sock, ack_sock
        sock.fileno(), ack_sock.fileno()
        self._max_inflight = max_inflight
        self._max_writes = max_writes
        self._refused = refused
        self.slots = 0  # batches posted and not yet completed (queue mode: not yet taken)
        self.waiters = 0  # writers waiting for a slot: notify them (on_slot) when one frees
        self.on_slot: Any = None
        self.index = 0  # the failing write of the last post refused with a FRAME_* code
        self.err = 0  # errno of the last ACKS_CLOSED
        self._mu = threading.Lock()
        self._seq = 0
        self._unsent: deque[_Frame] = deque()  # posted, not yet taken by a send: oldest first
        self._flight: deque[_Frame] = deque()  # taken by a send (sent, or being sent): oldest first, acked in this order
        self._called: deque[_Frame] = deque()  # completed by acks, their callbacks not yet called
        self._nflight = 0
        self._failed = False
        self._sending = False  # a thread is sending (a writer, or the sender thread)
        self._closing = False
        self._closed = False
        self._out: list[_Frame] | None = None  # the frames of the send in progress (or its remainder)
        self._out_i = 0
        self._out_off = 0
        self.last_progress = time.monotonic()  # the last byte sent or ack taken
        self._last_byte = self.last_progress  # the last ack byte received
        self._abuf = bytearray(_ACK_BUF)
        self._aview = memoryview(self._abuf)
        self._astart = self._aend = 0
        self._detail = 0

    @property
    def in_flight(self) -> int:
        """Batches posted and not completed (queued, being sent, or awaiting their ack)."""
        return self._nflight

    @property
    def failed(self) -> bool:
        return self._failed

    def has_work(self) -> bool:
        """The sender thread's cue: nobody is sending, and something is left to send."""
        with self._mu:
            return not self._sending and (self._out is not None or bool(self._unsent))

    def post(self, batch: Any, grant: int, on_done: Any, ids: Any, loc_starts: np.ndarray, loc_lengths: np.ndarray,
             loc_views: list[Any], rem_starts: np.ndarray, rem_lengths: np.ndarray, note: bytes = b"") -> tuple[int, Any]:
        """Check a batch (``POST_ARRAY`` unless it is a C-contiguous ``(n, 3)`` ``uint64`` numpy array or a
        small one of ``int`` triples: ``_small_batch``), ``POST_TOO_MANY`` past ``max_writes``, then ``frame``'s checks and codes, the failing write's
        index in ``index``; its ``note`` as ``frame`` does, a ``ValueError``), take a slot, give it the next seq and the next batch id from ``ids`` (both
        at once: a peer's ids go up in the order its frames go out) and post it. Returns ``(code,
        batch id or None)``: ``POST_SENT``, ``POST_WAKE`` (wake the sender thread), ``POST_FULL``,
        ``POST_FAILED`` or a ``FRAME_*`` code. A writer that finds nobody sending sends it (and what
        queues behind it meanwhile) with ``MSG_DONTWAIT``."""
        if type(batch) is not np.ndarray:
            batch = _small_batch(batch)
            if batch is None:
                return POST_ARRAY, None
        elif (batch.dtype != np.uint64 or batch.ndim != 2 or batch.shape[1] != 3
                or not (batch.flags.c_contiguous and batch.flags.aligned)):
            return POST_ARRAY, None
        if len(batch) > self._max_writes:
            return POST_TOO_MANY, None
        grant = _u64(grant, "grant")
        code, index, bufs = frame(batch, grant, loc_starts, loc_lengths, loc_views, rem_starts, rem_lengths, note)
        if bufs is None:
            self.index = index
            return code, None
        if self._failed:
            return POST_FAILED, None
        with self._mu:  # the slot counter changes under the lock (a thread may switch between any two steps)
            if self.slots >= self._max_inflight:
                return POST_FULL, None
            self.slots += 1
        f = _Frame(None, on_done, bufs, self)
        with self._mu:
            if self._failed:  # (it failed while the frame was built)
                self.slots -= 1
                return POST_FAILED, None
            try:
                f.batch_id = batch_id = next(ids)
            except BaseException:
                self.slots -= 1
                raise
            self._seq += 1
            f.seq = self._seq
            _SEQ.pack_into(bufs[0], 0, self._seq)  # (frame wrote the rest of the header, and the note)
            if not self._nflight:
                self.last_progress = time.monotonic()
            self._nflight += 1
            self._unsent.append(f)
            if self._sending or self._out is not None:
                return POST_SENT, batch_id  # the thread sending takes it next (the sender thread is awake for a remainder)
            self._sending = True
        while True:
            code = self._pump(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            if self._sent(code):
                break
        if code == 0 or self._failed:
            return POST_SENT, batch_id  # (a batch of a peer that failed meanwhile completed with the failure)
        return POST_WAKE, batch_id  # the socket is full (or broke: the sender thread meets the error too)

    def _sent(self, code: int) -> bool:
        """A send returned ``code``: ``sending`` off (True), unless all went out and frames were queued
        meanwhile (False: the caller sends those too; their writers left them to it). A failure or a
        close that came meanwhile takes effect now. Under the lock, with the check: a frame queued
        after it sees ``sending`` off and sends itself."""
        with self._mu:
            if code == 0 and self._unsent and not self._failed:
                return False
            self._sending = False
            if self._failed:
                self._out = None
            closing = self._closing
        if closing:
            self._close()
        return True

    def _close(self) -> None:
        self._closed = True
        for s in (self._sock, self._ack_sock):
            try:
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        """Fail the peer (see ``fail``; call that first to complete its batches) and close its sockets, at
        once or, if a writer is sending, as its send returns: a descriptor is never closed (and maybe
        reused) under a send. Call after the sender and ack threads ended."""
        with self._mu:
            self._failed = True
            self._closing = True
            sending = self._sending
        if not sending:
            self._close()

    def _take(self) -> None:
        """Move queued frames (up to ``_SEND_GATHER`` buffers) in line for acks, as the next send's ``out``."""
        out: list[_Frame] = []
        nbufs = 0
        with self._mu:
            while self._unsent and (not out or nbufs + len(self._unsent[0].bufs) <= _SEND_GATHER):
                f = self._unsent.popleft()
                self._flight.append(f)
                out.append(f)
                nbufs += len(f.bufs)
        self._out, self._out_i, self._out_off = out, 0, 0

    def _pump(self, flags: int) -> int:
        """Send ``out`` and then every queued frame: 0 once all went out, ``_TICKED`` when the socket
        took no more (``MSG_DONTWAIT``, or a kernel timeout), ``_GONE`` if the peer failed meanwhile,
        else the errno. Holds ``sending``."""
        while True:
            if self._failed:
                return _GONE
            if self._out is None:
                if not self._unsent:
                    return 0
                self._take()
                if not self._out:
                    self._out = None
                    continue
            out = self._out
            views: list[Any] = []
            off = self._out_off
            for f in out[self._out_i :]:
                for b in f.bufs:
                    if off >= len(b):
                        off -= len(b)
                        continue
                    views.append(b[off:] if off else b)
                    off = 0
                    if len(views) == _IOV_CHUNK:
                        break
                if len(views) == _IOV_CHUNK:
                    break
            try:
                k = self._sock.sendmsg(views, [], flags)
            except _TICK:
                return _TICKED
            except OSError as e:
                return e.errno or 0
            if k > 0:
                self.last_progress = time.monotonic()
            while k and self._out is not None:
                f = self._out[self._out_i]
                if k >= f.nbytes - self._out_off:
                    k -= f.nbytes - self._out_off
                    self._out_i += 1
                    self._out_off = 0
                    if self._out_i == len(self._out):
                        self._out = None
                else:
                    self._out_off += k
                    k = 0

    def send_blocking(self) -> int:
        """The sender thread's turn: send the remainder and every queued frame, blocking in ticks of the
        socket's kernel timeout. 0 once all went out, -1 if the peer failed meanwhile, else the errno of
        a send that broke; 0 at once if another thread is sending (it sends what is left)."""
        with self._mu:
            if self._sending:
                return 0
            self._sending = True
        r = _GONE
        try:
            while True:
                r = self._pump(socket.MSG_NOSIGNAL)
                if r != _TICKED and self._sent(r):
                    break
        except BaseException:
            self._sent(_GONE)
            raise
        return -1 if r == _GONE else r

    def acks(self, queue: Completions) -> tuple[int, int]:
        """The ack loop: receive acks and complete the frames in flight they name, oldest first; a batch
        without ``on_done`` goes to ``queue`` (keeping its slot until taken). Returns ``(code, detail)``
        when the caller has something to do: ``ACKS_GOT`` (batches with ``on_done`` completed:
        ``callbacks()`` has them), ``ACKS_TICK`` (a kernel timeout passed), ``ACKS_CLOSED`` (errno in
        ``err``), ``ACKS_BAD`` / ``ACKS_ORDER`` (the message length / seq of the ack that broke the
        stream; the acks before it completed), ``ACKS_FAILED``."""
        if not isinstance(queue, Completions):
            raise TypeError(f"queue must be a Completions, got {type(queue).__name__}")
        if self._closed:
            return ACKS_CLOSED, 0
        while True:
            code = self._complete(queue)
            if code >= 0:
                return code, self._detail
            if self._astart == self._aend:
                self._astart = self._aend = 0
            elif _ACK_BUF - self._aend < ACK_SIZE + MAX_MSG:
                rest = self._aend - self._astart
                self._abuf[:rest] = self._abuf[self._astart : self._aend]
                self._astart, self._aend = 0, rest
            try:
                k = self._ack_sock.recv_into(self._aview[self._aend :])
            except _TICK:
                return ACKS_TICK, self._detail
            except OSError as e:
                self.err = e.errno or 0
                return ACKS_CLOSED, self._detail
            if k == 0:
                self.err = 0
                return ACKS_CLOSED, self._detail
            self._aend += k
            self._last_byte = time.monotonic()

    def _complete(self, queue: Completions) -> int:
        """Complete the frame of every whole ack received, oldest first, under the lock: a frame with a
        callback into ``called``, the others onto ``queue`` in one push (in the same hold, so before any
        frame ``fail()`` queues after them). ``ACKS_FAILED``, ``ACKS_BAD`` / ``ACKS_ORDER`` (``detail``
        set), ``ACKS_GOT`` if callbacks are due, else -1: no whole ack is left, receive more."""
        queued: list[_Frame] = []
        called = False
        broke = 0
        now = time.monotonic()
        with self._mu:
            while self._aend - self._astart >= ACK_SIZE and not self._failed:
                seq, status, err, n = _ACK.unpack_from(self._abuf, self._astart)
                if n > MAX_MSG:
                    self._detail, broke = n, ACKS_BAD
                    break
                if self._aend - self._astart < ACK_SIZE + n:
                    break
                if not self._flight or self._flight[0].seq != seq:
                    self._detail, broke = seq, ACKS_ORDER
                    break
                f = self._flight.popleft()
                self._nflight -= 1
                f.status, f.err = status, err
                if status and n:
                    f.msg = bytes(self._abuf[self._astart + ACK_SIZE : self._astart + ACK_SIZE + n])
                self._astart += ACK_SIZE + n
                self.last_progress = now
                if f.callback:
                    self._called.append(f)
                    called = True
                else:
                    queued.append(f)
            if queued:
                queue._push(queued)  # under our lock: before any frame fail() queues after them
            failed = self._failed
        if failed:
            return ACKS_FAILED
        if broke:
            return broke
        if called:
            return ACKS_GOT
        return -1

    def callbacks(self) -> list[Any]:
        """The batches with ``on_done`` that acks completed, oldest first, as ``(on_done, batch_id,
        error)``; their slots come back."""
        with self._mu:
            got = list(self._called)
            self._called.clear()
        return self._calls(got)

    def _calls(self, got: list[_Frame]) -> list[Any]:
        """``(on_done, batch_id, error)`` of each frame of ``got``; their slots come back."""
        out: list[Any] = []
        for f in got:
            out.append((f.on_done, f.batch_id, _error_of(f, self._refused)))
            with self._mu:
                self.slots -= 1
        return out

    def idle(self, stall: float) -> int:
        """On a tick of the ack reader: 0, or 1 if part of an ack came and nothing more for ``stall``
        seconds, or 2 if batches are in flight and nothing progressed for ``stall`` seconds."""
        stall = _seconds(stall)
        now = time.monotonic()
        if self._astart != self._aend:
            return 1 if now - self._last_byte >= stall else 0
        if self._nflight and now - self.last_progress > stall:
            return 2
        return 0

    def fail(self, queue: Completions, error: Any) -> list[Any]:
        """The peer failed: no more posts; every batch in flight completes with ``error``, oldest
        first: those without ``on_done`` go to ``queue``, and ``(on_done, batch_id, error)`` of the
        others is returned, after those acks completed whose callbacks were not taken yet. Idempotent:
        a second call finds nothing left."""
        if not isinstance(queue, Completions):
            raise TypeError(f"queue must be a Completions, got {type(queue).__name__}")
        called: list[_Frame] = []
        queued: list[_Frame] = []
        with self._mu:
            self._failed = True
            if not self._sending:
                self._out = None  # a sender holds it until its send returns
            called.extend(self._called)
            self._called.clear()
            left = [*self._flight, *self._unsent]
            self._flight.clear()
            self._unsent.clear()
            self._nflight = 0
            for f in left:
                f.error = error
                (called if f.callback else queued).append(f)
            if queued:
                queue._push(queued)  # under our lock: after every frame the ack loop queued
        return self._calls(called)
