"""Bootstrap request and response signing, sans-IO: the HMAC header, the time window and the nonce cache.

The scheme is described in ``pdcore/control/bootstrap.py`` ("Authentication");
``verify_request`` is pure so the fuzzer drives it.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import re
from typing import Final, Literal

from ..core.errors import LocalProtocolError
from . import auth
from .auth import AuthenticationError


AUTH_HEADER: Final = "Authorization"
AUTH_SCHEME: Final = "PDCORE-HMAC-SHA256"
RESPONSE_MAC_HEADER: Final = "X-Pdcore-Auth"
DEFAULT_AUTH_WINDOW: Final = 30.0  # seconds either side of the server's clock
MAX_NONCES: Final = 100_000  # the nonce cache's bound: ~3,300 verified requests/s sustained over a 30 s window
KEY_LABEL: Final = "bootstrap"
# One exact form: no spaces to trim, no parameter order to normalise, lower-case hex only.
_AUTH_RE: Final = re.compile(r"PDCORE-HMAC-SHA256 t=(0|[1-9][0-9]{0,15}),n=([0-9a-f]{32}),s=([0-9a-f]{64})")
_NONCE_RE: Final = re.compile(r"[0-9a-f]{32}")
_MAC_RE: Final = re.compile(r"[0-9a-f]{64}")
_AUTH_FORM: Final = "expected 'PDCORE-HMAC-SHA256 t=<unix ms>,n=<32 hex>,s=<64 hex>'"

AuthFailure = Literal["missing", "malformed", "signature", "window", "replay"]


class RequestAuthError(AuthenticationError):
    """A request failed authentication (the server answers 401 with this message).

    ``kind`` says which check refused it: ``missing`` or ``malformed`` header,
    bad ``signature``, timestamp outside the ``window``, or ``replay`` (a nonce
    already seen, or a timestamp at or before the cache's floor). The message
    starts with ``authentication failed:`` and never contains a key or a MAC.
    """

    def __init__(self, kind: AuthFailure, reason: str) -> None:
        super().__init__(f"authentication failed: {reason}")
        self.kind: AuthFailure = kind


class NonceCache:
    """Nonces of verified requests whose timestamps are still inside the window; not thread-safe.

    An entry lives until its request's own timestamp leaves the window, so a
    replay is caught for as long as its timestamp would pass the window check.
    Expiring entries raises ``floor_ms`` to just below the cut, so if the clock
    steps back an expired nonce is still refused.

    At the bound (``capacity``, default ``MAX_NONCES``) the entry with the oldest
    timestamp is dropped early and ``floor_ms`` rises to that timestamp: from
    then on a request stamped at or before the floor is refused as a possible
    replay. A full cache therefore never lets a replay through; it narrows the
    window for late requests, and fresh ones still pass. Only requests whose
    MAC verified are inserted, so filling it takes the secret.
    """

    def __init__(self, capacity: int = MAX_NONCES) -> None:
        if capacity < 1:
            raise ValueError(f"nonce cache: capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.floor_ms = -1  # timestamps at or below are refused
        self.dropped = 0  # entries dropped at the bound before they expired
        self._seen: dict[str, int] = {}  # nonce -> its request's timestamp (ms)
        self._by_time: list[tuple[int, str]] = []  # heap over the same entries

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, nonce: object) -> bool:
        return nonce in self._seen

    def expire(self, cut_ms: int) -> None:
        """Forget the nonces stamped before ``cut_ms``: the window check refuses those timestamps now."""
        self.floor_ms = max(self.floor_ms, cut_ms - 1)
        while self._by_time and self._by_time[0][0] < cut_ms:
            _, nonce = heapq.heappop(self._by_time)
            del self._seen[nonce]

    def add(self, nonce: str, t_ms: int) -> None:
        """Remember a verified request's nonce (the caller checked it is new and above the floor)."""
        while len(self._seen) >= self.capacity:
            oldest, dropped = heapq.heappop(self._by_time)
            del self._seen[dropped]
            self.floor_ms = max(self.floor_ms, oldest)
            self.dropped += 1
        self._seen[nonce] = t_ms
        heapq.heappush(self._by_time, (t_ms, nonce))


def _sha256(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def _request_mac(key: bytes, method: bytes, path: bytes, t: bytes, nonce: bytes, body: bytes) -> bytes:
    return auth.mac(key, b"request", method, path, t, nonce, _sha256(body))


def sign_request(key: bytes, method: str, path: str, body: bytes, *, now: float, nonce: str) -> str:
    """The ``Authorization`` value for one request at unix time ``now`` with a fresh 32-hex ``nonce``."""
    if not _NONCE_RE.fullmatch(nonce):
        raise LocalProtocolError(f"sign_request: nonce must be 32 lower-case hex digits, got {len(nonce)} characters")
    t = str(max(0, math.floor(now * 1000)))
    sig = _request_mac(key, method.encode("latin-1"), path.encode("latin-1"), t.encode(), nonce.encode(), body)
    return f"{AUTH_SCHEME} t={t},n={nonce},s={sig.hex()}"


def verify_request(
    key: bytes,
    method: str,
    path: str,
    body: bytes,
    header: str | None,
    now: float,
    nonces: NonceCache,
    *,
    window: float = DEFAULT_AUTH_WINDOW,
) -> str:
    """Check one request's ``Authorization`` value at unix time ``now``; return its nonce.

    ``method`` and ``path`` are as the HTTP parser gives them (latin-1 text of
    the request line), ``body`` the bytes read (empty if none), ``header`` the
    value or None if absent. Checks, in order: present, well-formed, MAC (so a
    forgery is counted as one, never as a replay), timestamp within
    ±``window`` seconds, nonce not seen and timestamp above the cache's floor;
    only then is the nonce added to ``nonces``. Raises ``RequestAuthError``
    (an ``AuthenticationError``) and nothing else; ``nonces`` is unchanged then.
    """
    if header is None:
        raise RequestAuthError("missing", f"no {AUTH_HEADER} header: this server requires the deployment secret")
    m = _AUTH_RE.fullmatch(header)
    if m is None:
        raise RequestAuthError("malformed", f"malformed {AUTH_HEADER} header: {_AUTH_FORM}")
    t_text, nonce, sig = m.groups()
    try:
        method_bytes, path_bytes = method.encode("latin-1"), path.encode("latin-1")
    except UnicodeEncodeError:  # cannot come off the wire, which the parser decodes as latin-1
        raise RequestAuthError("malformed", "request line: not latin-1 text") from None
    expected = _request_mac(key, method_bytes, path_bytes, t_text.encode(), nonce.encode(), body)
    if not hmac.compare_digest(expected, bytes.fromhex(sig)):
        raise RequestAuthError("signature", "bad signature: is the secret the same on both sides?")
    t_ms, now_ms, window_ms = int(t_text), math.floor(now * 1000), round(window * 1000)
    if abs(t_ms - now_ms) > window_ms:
        raise RequestAuthError(
            "window",
            f"timestamp {(t_ms - now_ms) / 1000:+.1f} s from the server's clock, outside the "
            f"±{window:g} s window: a replayed request, or clocks out of sync",
        )
    nonces.expire(now_ms - window_ms)
    if nonce in nonces:
        raise RequestAuthError("replay", "nonce already used: a replayed request")
    if t_ms <= nonces.floor_ms:
        raise RequestAuthError(
            "replay", "timestamp at or before the replay floor (the nonce cache was full): a replay, or a late request"
        )
    nonces.add(nonce, t_ms)
    return nonce


def sign_response(key: bytes, nonce: str, status: int, body: bytes) -> str:
    """The ``X-Pdcore-Auth`` value of the answer ``status``/``body`` to the request that carried ``nonce``."""
    return auth.mac(key, b"response", nonce.encode(), str(status).encode(), _sha256(body)).hex()


def response_signed(key: bytes, nonce: str, status: int, body: bytes, values: list[str]) -> bool:
    if len(values) != 1 or not _MAC_RE.fullmatch(values[0]):
        return False
    return hmac.compare_digest(sign_response(key, nonce, status, body), values[0])
