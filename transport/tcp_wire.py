"""The TCP transport's frames and acks, and the socket plumbing both of its sides use.

Both sides of ``transport/tcp.py`` (the source in ``tcp_source.py``, the sink in ``tcp_sink.py``)
speak the layouts below through the same compiled loops, and block on their sockets the same way;
they sit here so that neither side imports the other. The hello that opens each connection is
``tcp_hello.py``'s.

Wire (little-endian), after a connection's handshake:

- batch frame, source → sink on the data connection: ``seq u64, count u32, note length u32,
  grant u64`` (``FRAME``), then ``count`` pairs ``(remote_addr u64, length u64)``, then the note
  (``note length`` bytes, 0 for a batch without one), then the payload of every write in order. The
  sink reads the header, the descriptors and the note as one header read, checks the writes, then
  lands the payload. A frame whose note length exceeds ``MAX_NOTE`` (4096), or that carries a note
  with ``count == 0`` or ``grant == 0``, breaks the wire format (the connection closes; no source
  sends it). A note is handed to the sink's handler (``on_note``) only once every write of its frame
  landed through the frame's grant (live, given to that connection's source, every write inside it),
  only if no earlier frame through that grant on this data connection was refused (the sink keeps
  those grants per connection, ``MAX_REFUSED_GRANTS`` of them at most, past which it closes the
  connection as a misbehaving source), and before the frame's ack is sent: a source that has the
  ack knows the sink's handler returned.
- ack, sink → source on the ack connection, one per batch in the order received:
  ``seq u64, status u32 (0 ok), errno i32, message length u32`` (``ACK``), then the UTF-8 message
  (at most ``MAX_MSG`` bytes).

The per-batch work (a batch's frame, the sink's checks of a frame, the acks) has two twins,
chosen by ``transport/twins.py``: ``fast`` is the one in use (``transport._tcp_fast``, or its
pure twin ``_tcp_fast_py`` under ``PDCORE_PURE_PYTHON=1``).

Sockets are blocking with kernel timeouts (``SO_RCVTIMEO``/``SO_SNDTIMEO`` = one poll interval,
``kernel_timeouts``): a call that waited that long raises ``BlockingIOError`` (EAGAIN), a "tick"
(``TICK``) on which the loops check for stop and stalls. Python-level socket timeouts would add a
``poll()`` before every recv/send. A handshake is read in those ticks too (``recv_by``), against
the one deadline the whole of it has.
"""

from __future__ import annotations

import errno as errno_mod
import socket
import struct
import threading
from typing import TYPE_CHECKING

import numpy as np

from .base import Region
from .deadline import Deadline
from .limits import MAX_NOTE
from .twins import load

if TYPE_CHECKING:
    from . import _tcp_fast_py as fast
else:
    fast = load("transport._tcp_fast")

# Handshakes a sink runs at once (its BUSY status, and the source's word for it, name this bound).
MAX_HELLOS = 64
FRAME = struct.Struct("<QIIQ")  # seq, count, note length, grant
ACK = struct.Struct("<QIiI")
assert FRAME.size == fast.FRAME_SIZE and ACK.size == fast.ACK_SIZE and fast.MAX_NOTE == MAX_NOTE
MAX_MSG = fast.MAX_MSG
# Grants one data connection's frames were refused through, kept for its notes' sake (see the wire
# above). Revoked ones are forgotten when the record is full (nothing lands through them again); a
# source refused through more live grants than this writes outside what it was given: not a real one.
MAX_REFUSED_GRANTS = 1024
NO_RANGES = np.zeros(0, np.uint64)
TICK = (BlockingIOError, TimeoutError)


def ranges(regions: tuple[Region, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of regions sorted by address, as the fast path's ``uint64`` arrays."""
    return np.array([r.addr for r in regions], np.uint64), np.array([r.length for r in regions], np.uint64)


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def tune(sock: socket.socket, peer_timeout: float) -> None:
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


class PeerGone(Exception):
    """The connection ended or broke; carries the errno when there is one."""

    def __init__(self, message: str, err: int | None) -> None:
        super().__init__(message)
        self.errno = err


def recv_by(sock: socket.socket, n: int, deadline: Deadline, stop: threading.Event) -> bytes:
    """Read exactly ``n`` bytes of a handshake before ``deadline`` (the whole of it has one), in ticks
    of the socket's timeout; ``stop`` set = the transport is closing."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TICK:
            if stop.is_set():
                raise PeerGone("transport closing", None) from None
            if deadline.expired():
                raise PeerGone(f"the handshake did not finish in time ({got} of {n} bytes)", errno_mod.ETIMEDOUT) from None
            continue
        except OSError as e:
            raise PeerGone(f"connection broke: {e}", e.errno) from e
        if k == 0:
            raise PeerGone("peer closed the connection", errno_mod.ECONNRESET)
        got += k
    return bytes(buf)
