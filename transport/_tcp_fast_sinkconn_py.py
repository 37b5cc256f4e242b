"""The pure twin's ``SinkConn``, one sink connection and its loop: part of ``transport._tcp_fast_py``,
which re-exports it (see there for the contract).

``serve`` reads a frame (header, descriptors and note), checks it against the ``Sink`` (marking the
connection landing), receives its payload into place, clears the mark and gathers the ack; it returns
to the caller only to have a refused frame's ack worded (``refuse``), to hand on a landed frame's note
(before its ack goes out), or when the connection ends. Every read and send of the loop
goes through ``_io``, so each waits in ticks of the socket's kernel timeout and ends by the same rules.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from ._tcp_fast_frame_py import _ACK, _HEAD, _IOV_CHUNK, _PAIR, _TICK, FRAME_SIZE, MAX_NOTE, _of, _seconds, _u64
from ._tcp_fast_sink_py import LAND_OK, Sink, _total

SERVE_REFUSED = 0
SERVE_CLOSED = 1  # the peer closed the connection, or it broke (errno in the result)
SERVE_BROKEN = 2  # a frame broke the wire format: the stream cannot be trusted past it
SERVE_STALLED = 3  # the peer sent nothing for ``stall`` seconds mid-frame (or took no ack for that long)
SERVE_STOPPED = 4  # the transport is closing
SERVE_NOTED = 5  # a frame with a note landed: its ack is queued, not yet sent

_AHEAD = 40  # bytes a sink may read past a payload: the next frame's header and first descriptor
_ACK_GATHER = 16  # acks gathered at most under load
_ACK_GATHER_BYTES = 1 << 20
_DISCARD = 65536
# The most a sink connection keeps in its header buffer between frames: a frame of more writes (up to
# max_writes, 16 MiB of descriptors at the transport's default) grows it while it is read and checked,
# and it shrinks back once the frame is done, as does all else of the frame (the compiled twin's rule;
# see its _KEEP).
_KEEP = 24 + _AHEAD + 4096 * 16  # 64 KiB and a little: a frame of up to 4096 writes


class _End(Exception):
    """How a connection's loop ended: ``(SERVE_*, errno)``."""

    def __init__(self, code: int, err: int = 0) -> None:
        super().__init__(code, err)
        self.result = (code, err)


class SinkConn:
    """One data connection past its handshake (acks go out on ``acks``, its ack connection, or the same
    socket): ``serve()`` runs its loop until a frame is refused (the caller words the ack: ``refuse()``,
    then ``serve()`` again), a frame with a note landed (the caller hands the note on, then ``serve()``
    again sends its ack) or the connection ends.

    Per frame: read its header, descriptors and note (one read: the note follows the descriptors); a
    note longer than ``MAX_NOTE``, or on a frame without writes or without a grant, breaks the wire
    format. Check every write (``Sink`` lock held; on success the
    connection is marked landing through the frame's grant, into its regions); receive the payload
    straight into place (the lock not held), with up to 40 bytes more, the next frame's header and
    first descriptor when they are already there; clear the mark (waking a revoke or deregister that
    waits for it). Acks are gathered: sent when no further frame is already waiting, or after 16
    frames or 1 MiB. Reads and sends wait in ticks of the socket's kernel timeouts; mid-frame, or
    with acks the peer does not take, ``stall`` seconds without a byte end the connection."""

    def __init__(self, sink: Sink, sock: Any, acks: Any, source: bytes, max_writes: int, stall: float) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"sink must be a Sink, got {type(sink).__name__}")
        if sock is None or acks is None:
            raise TypeError("sock and acks must be sockets, got None")
        _of(source, bytes, "source")
        if len(source) != 16:
            raise ValueError(f"a source is 16 bytes, got {len(source)}")
        self._sink, self._sock, self._ack_sock, self._source = sink, sock, acks, source
        self._fd = sock.fileno()
        self._max_writes = _u64(max_writes, "max_writes")
        self._stall = _seconds(stall)
        self._hb = bytearray()  # the current frame's header and descriptors, as read so far
        self._acks: list[bytes] = []
        self._acked_bytes = 0
        self._discard = 0  # payload bytes of a refused frame still to read and drop
        self._landing = False
        self._grant = 0
        self._used: list[int] = []
        self._drained = False  # the last payload read found nothing after it: the socket was empty then
        with sink._cond:
            sink._conns.add(self)
        self._attached = True

    def close(self) -> None:
        """Leave the table (call before closing the socket: a revoke cuts only attached connections)."""
        if not self._attached:
            return
        with self._sink._cond:
            self._sink._conns.discard(self)
            self._attached = False
            if self._landing:
                self._landing = False
                self._sink._cond.notify_all()

    def retained(self) -> int:
        """The bytes this connection's buffers hold (see ``Sink.retained``)."""
        with self._sink._cond:
            return self._held()

    def _held(self) -> int:
        return self._hb.__alloc__() + sum(map(len, list(self._acks))) + 8 * len(self._used)

    def refuse(self, seq: int, err: int, message: bytes, nbytes: int) -> None:
        """Queue the error ack of a refused frame and drop its ``nbytes`` of payload (on the next ``serve()``)."""
        seq = _u64(seq, "seq")
        if not isinstance(err, int):
            raise TypeError(f"err must be an integer, got {type(err).__name__}")
        if not -(1 << 31) <= err < 1 << 31:
            raise OverflowError(f"err {err} is not a 32-bit value")
        _of(message, bytes, "message")
        nbytes = _u64(nbytes, "nbytes")
        if len(message) > 0xFFFFFFFF:
            raise ValueError("an ack message is shorter than 4 GiB")
        self._acks.append(_ACK.pack(seq, 1, err, len(message)) + message)
        self._discard = nbytes
        self._acked_bytes += nbytes  # counted as landed bytes are: the gather bound

    def serve(self) -> tuple[Any, ...]:
        """Land frames until one is refused, one with a note landed, or the connection ends. Returns
        ``(SERVE_REFUSED, seq, code, index, count, addr, length, grant, total)`` for a refused frame (its
        header, descriptors and note read, its payload not yet: ``refuse()`` drops it), ``(SERVE_NOTED,
        grant, note)`` for a frame with a note whose every byte landed (its ack queued: the next
        ``serve()`` sends it), else ``(SERVE_*, errno)``."""
        if not self._attached:
            raise ValueError("serve() on a closed connection")
        try:
            return self._serve()
        except _End as e:
            return e.result

    def _serve(self) -> tuple[Any, ...]:
        hb = self._hb
        while True:
            self._between()
            if len(hb) < FRAME_SIZE:
                # a frame's first 40 bytes are never payload: its header and first descriptor, or (a frame
                # without writes) its header and the next frame's first bytes
                self._read_some(FRAME_SIZE)
            seq, count, nnote, grant = _HEAD.unpack_from(hb)
            if count > self._max_writes:
                raise _End(SERVE_BROKEN)
            if nnote and (nnote > MAX_NOTE or not count or not grant):
                raise _End(SERVE_BROKEN)  # no source sends it: a note vouches for writes landed through a grant
            ends = FRAME_SIZE + _PAIR.size * count
            need = ends + nnote  # the note follows the descriptors: read with them
            if len(hb) < need:
                hb += self._read(need - len(hb))
            desc = bytes(hb[FRAME_SIZE:ends])
            note = bytes(hb[ends:need]) if nnote else b""
            self._drained = False
            code, index, views = self._mark(desc, grant)
            if code:
                hb.clear()  # a frame with writes: its descriptors end what was read ahead
                addr, length = _PAIR.unpack_from(desc, _PAIR.size * index)
                return SERVE_REFUSED, seq, code, index, count, addr, length, grant, _total(desc)
            total = 0
            if count:
                hb.clear()
                try:
                    total = self._payload(views)  # type: ignore[arg-type]  # views is set when code is LAND_OK
                finally:
                    self._landed()
            else:
                self._landed()
                del hb[:FRAME_SIZE]  # what came after the header is the next frame's
            # done with the frame: its descriptors and views (some 200 bytes a write) must not stay
            # alive while the loop waits for the next one
            del desc, views
            self._acks.append(_ACK.pack(seq, 0, 0, 0))
            self._acked_bytes += total
            if nnote:  # its ack waits in the queue until the caller has handed the note on
                return SERVE_NOTED, grant, note
            self._flush_full()

    def _between(self) -> None:
        """Between frames: trim the header buffer, drop a refused frame's payload, and send the gathered
        acks unless the next frame is already here (then it lands first, and its ack goes out with them)."""
        hb = self._hb
        if hb.__alloc__() > _KEEP:  # between frames: at most _AHEAD bytes, of the next frame, are in it
            ahead = bytes(hb)
            hb.clear()  # gives the buffer back (a bytearray emptied is shrunk)
            hb += ahead
        if self._discard:
            self._drop()
            self._flush_full()
        if self._acks and len(hb) < FRAME_SIZE:  # more frames already here? then land them first, ack together
            if not hb and not self._drained:
                try:
                    more = self._sock.recv(_AHEAD, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    more = None
                except OSError as e:
                    raise _End(SERVE_CLOSED, e.errno or 0) from None
                if more == b"":
                    raise _End(SERVE_CLOSED)
                if more:
                    hb += more
            if not hb:
                self._flush()

    def _mark(self, desc: bytes, grant: int) -> tuple[int, int, list[Any] | None]:
        """Check a frame's writes (``Sink._check``, its lock held) and, if it may land, mark the
        connection landing through ``grant`` into the regions it writes, in the same hold: a revoke or
        deregister that finds no mark finds no frame writing. ``Sink._check``'s result."""
        used: list[int] = []
        with self._sink._cond:
            code, index, views = self._sink._check(desc, grant, self._source, used)
            if code == LAND_OK:
                self._landing, self._grant, self._used = True, grant, used
        return code, index, views

    def _flush_full(self) -> None:
        """Send the gathered acks if they reached the gather bound (16 acks, or 1 MiB acked)."""
        if len(self._acks) >= _ACK_GATHER or self._acked_bytes >= _ACK_GATHER_BYTES:
            self._flush()

    def _tick(self, last: float, idle: bool) -> None:
        """A read or send waited one kernel timeout: go on, or end the connection."""
        with self._sink._cond:
            stopped = self._sink._stopped
        if stopped:
            raise _End(SERVE_STOPPED)
        if not idle and time.monotonic() - last >= self._stall:
            raise _End(SERVE_STALLED)

    def _io(self, last: float, idle: bool, call: Any, *args: Any) -> Any:
        """One read or send of the loop, ``call(*args)`` (the last byte moved at ``last``; ``idle``: none
        of the frame has come yet): what it returned, or None after a tick ``_tick`` lets go on (the
        caller tries again). An error, or nothing read (the peer closed), ends the connection."""
        try:
            k = call(*args)
        except _TICK:
            self._tick(last, idle)
            return None
        except OSError as e:
            raise _End(SERVE_CLOSED, e.errno or 0) from None
        if not k:
            raise _End(SERVE_CLOSED)
        return k

    def _read_some(self, want: int) -> None:
        """Read until ``hb`` holds ``want`` (<= ``_AHEAD``) bytes, taking up to ``_AHEAD``; with nothing
        of the frame here yet, wait without the stall rule."""
        hb = self._hb
        last = time.monotonic()
        while len(hb) < want:
            more = self._io(last, not hb, self._sock.recv, _AHEAD - len(hb))
            if more is not None:
                hb += more
                last = time.monotonic()

    def _read(self, n: int) -> bytes:
        """Receive exactly ``n`` bytes (mid-frame: the stall rule applies)."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        last = time.monotonic()
        while got < n:
            k = self._io(last, False, self._sock.recv_into, view[got:])
            if k is not None:
                got += k
                last = time.monotonic()
        return bytes(buf)

    def _flush(self) -> None:
        """Send the gathered acks."""
        data = memoryview(b"".join(self._acks))
        last = time.monotonic()
        while data:
            k = self._io(last, False, self._ack_sock.send, data, socket.MSG_NOSIGNAL)
            if k is not None:
                data = data[k:]
                last = time.monotonic()
        self._acks.clear()
        self._acked_bytes = 0

    def _drop(self) -> None:
        """Receive and drop the payload of a refused frame (the stream keeps its place)."""
        scratch = memoryview(bytearray(min(self._discard, _DISCARD)))
        last = time.monotonic()
        while self._discard:
            k = self._io(last, False, self._sock.recv_into, scratch[: min(self._discard, _DISCARD)])
            if k is not None:
                self._discard -= k
                last = time.monotonic()

    def _landed(self) -> None:
        """Clear the landing mark; wake a revoke or deregister waiting for it."""
        with self._sink._cond:
            self._landing, self._grant, self._used = False, 0, []
            self._sink._cond.notify_all()

    def _payload(self, views: list[Any]) -> int:
        """Receive the payload of a checked frame into place (``views``, one per write), with up to
        ``_AHEAD`` bytes after it into ``hb``. Returns the payload size."""
        total = sum(len(v) for v in views)
        i, n = 0, len(views)
        tail = memoryview(bytearray(_AHEAD))
        last = time.monotonic()
        while i < n:
            chunk = views[i : i + _IOV_CHUNK]
            ends = i + len(chunk) == n
            got = self._io(last, False, _recvmsg_into, self._sock, [*chunk, tail] if ends else chunk)
            if got is None:
                continue
            last = time.monotonic()
            while got and i < n:
                v = views[i]
                if got >= len(v):
                    got -= len(v)
                    i += 1
                else:
                    views[i] = v[got:]
                    got = 0
            if got:  # past the payload: the next frame's first bytes
                self._hb += tail[:got]
        # A read returns what is there up to what it asks: no byte past the payload means none was
        # there (with bytes to spare it would have filled the tail).
        self._drained = not self._hb
        return total


def _recvmsg_into(sock: Any, buffers: list[Any]) -> int:
    """``sock.recvmsg_into(buffers)``'s byte count (the loop's ``_io`` takes a call that returns it)."""
    return sock.recvmsg_into(buffers)[0]
