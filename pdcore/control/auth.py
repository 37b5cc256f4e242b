"""The deployment secret: where it comes from, the keys derived from it, one MAC rule.

One secret (bytes, ``MIN_SECRET_BYTES``..``MAX_SECRET_BYTES``) is shared by every
rank of a deployment and its bootstrap server. It comes from ``TransferConfig.secret``,
else from the file named by ``PDCORE_SECRET_FILE``. It is never logged: configs
keep it out of their repr, errors name the peer, never a key.

Only an *unset* ``PDCORE_SECRET_FILE`` means "no secret". A variable that is set
but empty, or names a file that is missing, unreadable, a directory, or holds
fewer than 16 or more than 4096 bytes, is a ``StartError`` at start naming the
variable: an operator who meant to authenticate and mistyped must not get an
open deployment with a warning in a log nobody reads. A secret file that group
or others may read is used, with one warning per file (``chmod 600`` it).

Each plane gets its own key, ``HMAC-SHA256(secret, "pdcore/<label>")`` (the
expand step of HKDF with the secret as the pseudo-random key), so a key that
leaks from one plane opens no other: ``"bootstrap"`` (request and response
MACs), ``"control-curve"`` (the ZeroMQ CURVE key pair), ``"tcp-hello"`` and
``"verbs-hello"`` (the data-plane handshakes). The rule, the MAC and the
secret's bounds live in ``transport.base`` (the lower layer, which must not
import pdcore) and are re-exported here.

Without a secret everything runs unauthenticated, and ``warn_unauthenticated``
says so once per process.

Why the standard library: ``hmac``/``hashlib``/``secrets`` are constant-time
where it matters (``hmac.compare_digest``) and need nothing installed.
"""

from __future__ import annotations

import logging
import os
import stat
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
_warned_lock = threading.Lock()

SECRET_FILE_ENV: Final = "PDCORE_SECRET_FILE"


class AuthenticationError(PdError):
    """A peer could not prove that it holds the deployment's secret (or we could not prove it to the peer)."""


def check_secret(secret: object, where: str) -> bytes:
    """``secret`` as bytes, or ``StartError`` naming ``where`` (never the secret's value)."""
    value = _check_option(secret, where) if secret is not None else None
    if value is None:
        raise StartError(f"{where}: the secret must be bytes, got None")
    return value


def load_secret(path: str | os.PathLike[str], where: str = "") -> bytes:
    """The secret stored in ``path`` (one trailing newline dropped, so ``echo``/``base64`` files work).

    ``StartError`` for a missing or unreadable file, a directory, or a secret outside
    ``MIN_SECRET_BYTES``..``MAX_SECRET_BYTES``; the message starts with ``where`` (the option or
    variable that named the file, e.g. ``"$PDCORE_SECRET_FILE"``) and names the file, never its content.
    A file that group or others may read is used, with a warning (once per file)."""
    name = f"secret file {os.fspath(path)!r}"
    label = f"{where}: {name}" if where else name
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if stat.S_ISDIR(mode):
                raise StartError(f"{label}: is a directory, not a file holding the secret")
            data = f.read(MAX_SECRET_BYTES + 3)
    except IsADirectoryError:
        raise StartError(f"{label}: is a directory, not a file holding the secret") from None
    except OSError as e:
        raise StartError(f"{label}: cannot read it: {e.strerror or e}") from None
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not MIN_SECRET_BYTES <= len(data) <= MAX_SECRET_BYTES:
        size = f"more than {MAX_SECRET_BYTES}" if len(data) > MAX_SECRET_BYTES else str(len(data))
        raise StartError(f"{label}: holds {size} bytes of secret, need {MIN_SECRET_BYTES}..{MAX_SECRET_BYTES}")
    if mode & 0o077:
        _warn_exposed(os.fspath(path), mode)
    return data


def resolve_secret(secret: bytes | None) -> bytes | None:
    """The configured secret, else the one in ``$PDCORE_SECRET_FILE``, else None (unauthenticated).

    None only when the variable is unset: set but empty, or naming a file ``load_secret`` refuses,
    is a ``StartError`` naming the variable."""
    if secret is not None:
        return check_secret(secret, "secret")
    path = os.environ.get(SECRET_FILE_ENV)
    if path is None:
        return None
    if not path:
        raise StartError(
            f"${SECRET_FILE_ENV} is set but empty: name the file holding the deployment secret, "
            "or unset the variable to run unauthenticated"
        )
    return load_secret(path, f"${SECRET_FILE_ENV}")


_exposed_warned: set[str] = set()


def _warn_exposed(path: str, mode: int) -> None:
    """Say once per file that a secret file is readable beyond its owner."""
    with _warned_lock:
        if path in _exposed_warned:
            return
        _exposed_warned.add(path)
    log.warning(
        "secret file %r has mode %o: group or others may read the deployment secret (chmod 600 it)",
        path,
        stat.S_IMODE(mode),
    )


_warned = False


def warn_unauthenticated(component: str) -> None:
    """Say once per process (naming the first ``component`` to start) that it runs without a secret."""
    global _warned
    with _warned_lock:
        if _warned:
            return
        _warned = True
    log.warning(
        "%s: no deployment secret (TransferConfig.secret or $%s): the bootstrap, control and data planes "
        "are unauthenticated, anyone who reaches their ports can steer transfers",
        component,
        SECRET_FILE_ENV,
    )
