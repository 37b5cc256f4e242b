"""The deployment secret: where it comes from, the keys derived from it, one MAC rule.

One secret (bytes, at least ``MIN_SECRET_BYTES``) is shared by every rank of a
deployment and its bootstrap server. It comes from ``PeerConfig.secret``, else
from the file named by ``PDCORE_SECRET_FILE``. It is never logged: configs keep
it out of their repr, errors name the peer, never a key.

Each plane gets its own key, ``HMAC-SHA256(secret, "pdcore/<label>")`` (the
expand step of HKDF with the secret as the pseudo-random key), so a key that
leaks from one plane opens no other: ``"bootstrap"`` (request and response
MACs), ``"control-curve"`` (the ZeroMQ CURVE key pair), ``"tcp-hello"`` and
``"verbs-hello"`` (the data-plane handshakes, derived inside ``transport``,
which must not import pdcore; see ``transport.base.derive_key``).

Without a secret everything runs as before, and ``warn_unauthenticated`` says
so once per process.

Why the standard library: ``hmac``/``hashlib``/``secrets`` are constant-time
where it matters (``hmac.compare_digest``) and need nothing installed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from typing import Final

from .errors import PdError, StartError

__all__ = [
    "MIN_SECRET_BYTES",
    "SECRET_FILE_ENV",
    "AuthenticationError",
    "load_secret",
    "resolve_secret",
    "derive_key",
    "mac",
    "warn_unauthenticated",
]

log = logging.getLogger("pdcore.auth")

MIN_SECRET_BYTES: Final = 16
MAX_SECRET_BYTES: Final = 4096
SECRET_FILE_ENV: Final = "PDCORE_SECRET_FILE"


class AuthenticationError(PdError):
    """A peer could not prove that it holds the deployment's secret (or we could not prove it to the peer)."""


def check_secret(secret: object, where: str) -> bytes:
    """``secret`` as bytes, or ``StartError`` naming ``where`` (never the secret's value)."""
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise StartError(f"{where}: the secret must be bytes, got {type(secret).__name__}")
    value = bytes(secret)
    if not MIN_SECRET_BYTES <= len(value) <= MAX_SECRET_BYTES:
        raise StartError(f"{where}: the secret has {len(value)} bytes, need {MIN_SECRET_BYTES}..{MAX_SECRET_BYTES}")
    return value


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret stored in ``path`` (one trailing newline dropped, so ``echo``/``base64`` files work)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_BYTES + 3)
    except OSError as e:
        raise StartError(f"secret file {os.fspath(path)!r}: cannot read it: {e.strerror or e}") from None
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    return check_secret(data, f"secret file {os.fspath(path)!r}")


def resolve_secret(secret: bytes | None) -> bytes | None:
    """The configured secret, else the one in ``$PDCORE_SECRET_FILE``, else None (unauthenticated)."""
    if secret is not None:
        return check_secret(secret, "secret")
    path = os.environ.get(SECRET_FILE_ENV)
    return load_secret(path) if path else None


def derive_key(secret: bytes, label: str) -> bytes:
    """The 32-byte key of one plane (``label``), derived from the deployment secret."""
    return hmac.new(secret, b"pdcore/" + label.encode(), hashlib.sha256).digest()


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``parts``, each length-prefixed so no two part lists give the same input."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


_warned = False
_warned_lock = threading.Lock()


def warn_unauthenticated(component: str) -> None:
    """Say once per process (naming the first ``component`` to start) that it runs without a secret."""
    global _warned
    with _warned_lock:
        if _warned:
            return
        _warned = True
    log.warning(
        "%s: no deployment secret (PeerConfig.secret or $%s): the bootstrap, control and data planes "
        "are unauthenticated, anyone who reaches their ports can steer transfers",
        component,
        SECRET_FILE_ENV,
    )
