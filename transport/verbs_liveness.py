"""The TCP connection beside each verbs queue pair: the handshake's bounded reads, then the liveness
socket it stays as, what a readable one holds and what its hang-up means.

It exists so that both sides of the verbs transport (``transport/verbs_source.py`` and
``transport/verbs_sink.py``, with the cm thread in ``transport/verbs.py``) read and write that
connection by one set of rules; it imports nothing of pyverbs.

Handshake and liveness
----------------------
``connect`` creates the source QP, then exchanges QP information with the sink
over one short TCP connection to the listener the endpoint names (the bytes are in
``transport/verbs_hello.py``). That connection then stays open as a liveness
signal: when either side closes it, the other tears its QP down (a sink frees the
QP of a source that went away; a source fails its batches at once instead of
waiting for RC retries). Without memory windows it carries one byte at most:
``REVOKED``, which a sink's ``revoke`` sends just before it closes the connection,
so the source's error says why (any other byte is a protocol break and treated as
a close); with them it carries the frames of ``transport/windows.py``.
"""

from __future__ import annotations

import errno as errno_mod
import select
import socket
from collections.abc import Callable
from typing import Any

from .deadline import Deadline
from .errors import TransportError
from .windows import FRAME_REVOKED

__all__ = ["REVOKED", "SEND_TIMEOUT", "hangup", "hangup_error", "receiver", "recv_exact", "send_frame"]

REVOKED = FRAME_REVOKED  # sink → source on the liveness socket: "revoke killed your QP", then EOF
SEND_TIMEOUT = 1.0  # seconds a frame may wait for room in a liveness socket before the connection is cut


def send_frame(sock: socket.socket, data: bytes) -> bool:
    """Send a whole frame on a non-blocking liveness socket, waiting at most ``SEND_TIMEOUT`` for room;
    False if it could not (the peer is gone, or has not read for that long: the caller cuts it)."""
    view = memoryview(data)
    deadline = Deadline.after(SEND_TIMEOUT)
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


def receiver(sock: socket.socket, deadline: Deadline) -> Callable[[int], bytes]:
    """``recv(n)``: exactly ``n`` bytes of a handshake from ``sock``, each wait bounded by what is left
    of ``deadline``."""

    def recv(n: int) -> bytes:
        sock.settimeout(max(deadline.remaining(), 1e-3))
        return recv_exact(sock, n)

    return recv


def recv_exact(sock: socket.socket, n: int) -> bytes:
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


def hangup(sock: Any) -> bytes | None:
    """A liveness socket became readable: what it holds (frames, see ``transport/windows.py``), None if
    nothing yet, ``b""`` for EOF or a broken connection. Without memory windows any byte ends it."""
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""
    return bytes(data)


def hangup_error(said: bytes) -> TransportError:
    """The error a source's batches fail with when the sink hung up, after saying ``said``."""
    if said[:1] == REVOKED:
        return TransportError(
            "the sink revoked a grant of this source and moved this connection's QP to the error state "
            "(verbs has no memory windows here); connect again",
            op="write",
            errno=errno_mod.EACCES,
        )
    return TransportError("the peer closed the connection", op="write", errno=errno_mod.ECONNRESET)
