"""The control channel's CURVE handshake, sans-IO: the deployment's key pair, the answer to a ZAP
request, and what a socket monitor's event says about a handshake (``pdcore.control.channel`` owns
the sockets and applies these; the fuzzer and the tests call them directly).

Why its own room: these are pure functions of their inputs (a secret, a request, an event), so the
rule "only a client that holds the deployment's key gets in" and the words a failed handshake is
reported with can be read, fuzzed and tested without a socket.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import zmq
from zmq.utils import z85

from . import auth

__all__ = [
    "HANDSHAKE_FAILED", "PEER_CLOSED", "ROUTER_EVENTS", "DEALER_EVENTS", "OPENED", "curve_keys", "zap_reply",
    "handshake_failure",
]

HANDSHAKE_FAILED: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
ROUTER_EVENTS: Final = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED  # what the ROUTER's monitor reports, always
# a DEALER's monitor: its handshake's outcome, and whether its connection got a socket (see pdcore.control.fd_reserve)
DEALER_EVENTS: Final = (
    HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CONNECT_RETRIED
)
OPENED: Final = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED  # the connection has its socket
PEER_CLOSED: Final = "the peer closed the connection during the handshake: a different secret, or none"


def curve_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The deployment's CURVE key pair (public, secret), z85-encoded, derived from the secret."""
    secret_key = z85.encode(auth.derive_key(secret, "control-curve"))
    return zmq.curve_public(secret_key), secret_key


def zap_reply(request: list[bytes], public_key: bytes) -> tuple[list[bytes], str | None]:
    """ZAP (RFC 27), sans-IO: the reply to one request, and the refused client's address (None: admitted).

    Admits a CURVE client only if its long-term public key (raw, 32 bytes) is
    the deployment's; anything else, malformed requests included, is refused."""
    ok = len(request) == 7 and request[0] == b"1.0" and request[5] == b"CURVE" and request[6] == public_key
    request_id = request[1] if len(request) > 1 and len(request[1]) <= 255 else b""
    if ok:
        return [b"1.0", request_id, b"200", b"OK", b"", b""], None
    address = request[3][:64].decode("ascii", "replace") if len(request) > 3 else "?"
    return [b"1.0", request_id, b"400", b"not of this deployment", b"", b""], address


def handshake_failure(event: Mapping[str, object], *, server: bool = False) -> str:
    """Why a handshake failed, in words (from a monitor event)."""
    kind, value = event["event"], event["value"]
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "the peer's authentication handler refused our key"
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "one side runs without a secret"
    if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "the CURVE handshake did not decrypt: a different secret"
    if server:  # a client without a secret may see the mismatch first and hang up
        return "the client closed the connection during the handshake (no secret, or it went away)"
    return PEER_CLOSED
