"""The deployment secret on the data plane: its checks, the derived keys and the handshake MACs.

Both sides of a data connection prove they hold the secret with MACs over fresh
nonces (``hello_mac``); ``AuthFailures`` counts a sink's failed handshakes and
names each peer host at most once every 10 s.
"""

from __future__ import annotations

import errno as errno_mod
import hashlib
import hmac
import logging
import threading
from typing import Any


from .errors import StartError, TransportError
from .loglimit import LogLimit


MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
#: bytes of a handshake nonce (each side draws its own from ``os.urandom``) and of a handshake MAC
NONCE_BYTES = 16
MAC_BYTES = 32
#: a handshake (hello to the last reply) finishes within min(peer_timeout, this) or the sink drops it
HELLO_TIMEOUT = 5.0


def check_secret(secret: object, where: str) -> bytes | None:
    """The ``secret`` option as bytes (None: unauthenticated); ``StartError`` naming the option, never its value."""
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise StartError(f"{where}: the secret option must be bytes, got {type(secret).__name__}")
    value = bytes(secret)
    if not MIN_SECRET_BYTES <= len(value) <= MAX_SECRET_BYTES:
        raise StartError(
            f"{where}: the secret option has {len(value)} bytes, need {MIN_SECRET_BYTES}..{MAX_SECRET_BYTES}"
        )
    return value


def derive_key(secret: bytes, label: str) -> bytes:
    """The 32-byte key of one plane, ``HMAC-SHA256(secret, "pdcore/" + label)``: the same bytes as
    ``pdcore.control.auth.derive_key`` (this package does not import it). ``"tcp-hello"``, ``"verbs-hello"``."""
    return hmac.new(secret, b"pdcore/" + label.encode(), hashlib.sha256).digest()


def hello_mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``parts``, each prefixed with its length (u64 LE), so no two part lists give
    the same input (``pdcore.control.auth.mac``'s rule). Callers put a role label first."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def auth_failed(where: str, why: str) -> TransportError:
    """A handshake that did not authenticate: what ``connect`` raises, naming the sink ``where`` (host:port)."""
    return TransportError(f"authentication failed: {where}: {why}", op="connect", errno=errno_mod.EACCES)


def same_mac(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(a, b)


class AuthFailures:
    """A sink's failed handshakes: a count, and at most one warning per peer host every ``every``
    seconds (a flood of bad handshakes cannot flood the log). Thread-safe; memory is bounded."""

    def __init__(self, what: str, logger: logging.Logger, every: float = 10.0) -> None:
        self._what, self._log = what, logger
        self._lock = threading.Lock()
        self._limit = LogLimit(every)  # per peer host
        self.count = 0

    def failed(self, peer: tuple[Any, ...] | None, why: str) -> None:
        host = str(peer[0]) if peer else "?"
        where = f"{host}:{peer[1]}" if peer and len(peer) > 1 else host
        with self._lock:
            self.count += 1
            count = self.count
        if self._limit.ready(host) is None:
            return  # counted; that host was named within the last `every` seconds (or too many hosts fail)
        self._log.warning(
            "%s: authentication failed for the connection from %s: %s (%d failed handshakes so far; "
            "further failures from %s are not logged for %g s)",
            self._what, where, why, count, host, self._limit.every,
        )
