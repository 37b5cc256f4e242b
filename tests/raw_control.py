"""A hand-driven control client of either plane, for sending a running peer what a well-behaved peer never
would: ``RawControl(endpoint, plane, me)`` then ``send(*frames)`` (``wire`` frames, or any bytes).

- ``"zmq"``: a ZeroMQ DEALER whose routing id is ``me``; the frames of one ``send`` are the parts of one message.
- ``"tcp"``: a TCP connection that runs the ``"tcp"`` plane's handshake by hand, claiming ``me`` in its hello
  (with ``secret``, the deployment's or another); the frames of one ``send`` are sealed and go in one write.

Also the two white-box questions tests ask of a running peer's plane, whichever it is.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import zmq

from pdcore.control import tcp_frames as tf
from pdcore.control.auth import derive_key

WAIT = 5.0


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


class RawControl:
    def __init__(self, endpoint: str, plane: str, me: bytes | str, *, secret: bytes | None = None) -> None:
        self.plane = plane
        me_bytes = me.encode() if isinstance(me, str) else me
        if plane == "zmq":
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 1000)
            self._sock.setsockopt(zmq.ROUTING_ID, me_bytes)
            self._sock.connect(endpoint)
            return
        host, port = endpoint[6:].rsplit(":", 1)
        self.tcp = socket.create_connection((host.strip("[]"), int(port)), timeout=WAIT)
        key = derive_key(secret, tf.KEY_LABEL) if secret is not None else None
        nonce = os.urandom(16)
        # (a hello whose endpoint is not a control endpoint: built by hand, as a hostile client would)
        self.tcp.sendall(tf.HELLO.pack(tf.MAGIC, tf.VERSION, 1 if key else 0, nonce, len(me_bytes)) + me_bytes)
        listener_nonce = b""
        if key is not None:
            hello = tf.Hello(True, nonce, me_bytes.decode("ascii", "replace"))
            challenge = recv_exact(self.tcp, tf.CHALLENGE_BYTES)
            if len(challenge) == tf.CHALLENGE_BYTES:
                listener_nonce = challenge[:16]
                self.tcp.sendall(tf.proof(key, hello, listener_nonce))
        self.verdict = recv_exact(self.tcp, 1)
        self.sealer = tf.Sealer(tf.session_key(key, nonce, listener_nonce))

    def send(self, *frames: bytes) -> None:
        if self.plane == "zmq":
            self._sock.send_multipart(list(frames))
            return
        try:
            self.tcp.sendall(self.sealer.seal_all(list(frames)))
        except OSError:
            pass  # the plane ended this connection (it refused the hello or a frame): as a hostile client sees it

    def close(self) -> None:
        if self.plane == "zmq":
            self._ctx.destroy(linger=0)
        else:
            self.tcp.close()


def knows_sender(channel: Any, endpoint: str) -> bool:
    """White-box: whether ``channel`` (either plane) reads frames from ``endpoint`` already."""
    if hasattr(channel, "_senders"):
        return endpoint in channel._senders.values()
    return any(conn.sender == endpoint for conn in list(channel._ins.values()))


def plane_alive(channel: Any) -> bool:
    """White-box: whether ``channel``'s threads are alive (the ``"tcp"`` plane's loop is its driver's)."""
    if hasattr(channel, "_senders"):
        return bool(channel._thread.is_alive())
    return bool(channel._gate._thread.is_alive()) and not channel._closed
