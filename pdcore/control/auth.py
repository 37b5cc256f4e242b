"""The deployment secret: where it comes from, the keys derived from it, one MAC rule.

One secret (bytes, at least ``MIN_SECRET_BYTES``) is shared by every rank of a
deployment and its bootstrap server. It comes from ``PeerConfig.secret``, else
from the file named by ``PDCORE_SECRET_FILE``. It is never logged: configs keep
it out of their repr, errors name the peer, never a key.

Each plane gets its own key, ``HMAC-SHA256(secret, "pdcore/<label>")`` (the
expand step of HKDF with the secret as the pseudo-random key), so a key that
leaks from one plane opens no other: ``"bootstrap"`` (request and response
MACs), ``"control-curve"`` (the ZeroMQ CURVE key pair), ``"tcp-hello"`` and
``"verbs-hello"`` (the data-plane handshakes). The rule, the MAC and the
secret's bounds live in ``transport.base`` (the lower layer, which must not
import pdcore) and are re-exported here.

Without a secret everything runs as before, and ``warn_unauthenticated`` says
so once per process.

Why the standard library: ``hmac``/``hashlib``/``secrets`` are constant-time
where it matters (``hmac.compare_digest``) and need nothing installed.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Final

from transport.base import MAX_SECRET_BYTES, MIN_SECRET_BYTES, derive_key
from transport.base import check_secret as _check_option
from transport.base import hello_mac as mac

from ..core.errors import PdError, StartError

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

SECRET_FILE_ENV: Final = "PDCORE_SECRET_FILE"


class AuthenticationError(PdError):
    """A peer could not prove that it holds the deployment's secret (or we could not prove it to the peer)."""


def check_secret(secret: object, where: str) -> bytes:
    """``secret`` as bytes, or ``StartError`` naming ``where`` (never the secret's value)."""
    value = _check_option(secret, where) if secret is not None else None
    if value is None:
        raise StartError(f"{where}: the secret must be bytes, got None")
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
