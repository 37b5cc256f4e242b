"""Bootstrap server (HTTP, one per prefill deployment) and its deadline-bound client.

Source ranks register where their control channel listens; sinks look up the
replica's parallel info and each rank's endpoint. The HTTP API (JSON bodies)::

    GET /health                    200 {"status": "ok"}                     never authenticated
    GET /metrics                   200 Prometheus text (given a registry)   never authenticated: counters only
    PUT /v1/ranks                  200 {"result": "created" | "unchanged" | "replaced"}
                                   400 malformed (names the field), 409 conflict,
                                   411 no Content-Length, 413 body too large
    GET /v1/parallel               200 ParallelInfo; 503 while no rank registered
    GET /v1/ranks/<dp>/<tp>        200 RankInfo; 404 unknown rank; 400 malformed
    any but GET /health, with a secret: 401 {"error": "authentication failed: <why>"}
    any, at the connection cap     503 with Retry-After: busy, the client backs off and retries

Rules (each closes a defect seen in other engines' bootstrap servers: registrations
that silently replace each other, and an unknown rank answered with a 500):

- A registration names its slot (dp_rank, tp_rank). It must agree with every
  *other* registered rank on tp_size, dp_size and layout (compared canonically)
  and must not reuse another rank's endpoint or session id; otherwise 409.
- Same slot, same epoch: identical data is an idempotent 200 ``unchanged``,
  anything else 409. A larger epoch replaces the slot (a restarted rank); a
  smaller one is stale (409).
- Validation is pure (``parse_registration``, ``parse_rank_path``,
  ``parse_parallel_info``, ``parse_rank_info``, ``Registry``) so the fuzzers
  drive it without sockets; each raises ``RemoteProtocolError`` naming the field.

Authentication (when the server and the client are given the deployment
secret; see ``pdcore.control.auth``). Without it the rules above let anyone who reaches
the port take a live rank's slot with a larger epoch, or register first and fix
the deployment's shape. With it, the key is ``derive_key(secret, "bootstrap")``
and:

- Every request but ``GET /health`` carries
  ``Authorization: PDCORE-HMAC-SHA256 t=<unix ms>,n=<32 hex nonce>,s=<64 hex MAC>``
  with MAC = ``mac(key, b"request", method, path, t, n, sha256(body))``. Reads
  are authenticated too: the registry reveals every rank's control endpoint and
  data-plane instance, which is what an attacker needs next. ``/health`` reveals
  nothing and load balancers probe it without a secret, so it stays open (and
  its answer is not signed). Unknown paths and methods are authenticated
  before they are told 404/405, so a prober learns nothing but 401.
- The server verifies before acting (``verify_request``, pure: the fuzzer
  drives it). It refuses with 401 and ``authentication failed: <why>``: no
  header, a malformed header, a bad signature, a timestamp outside ±``auth_window``
  (30 s), or a nonce already seen. Seen nonces live in a ``NonceCache`` until
  their timestamp leaves the window; only a verified request's nonce enters
  it, so forgeries cannot fill it. Its bound (``MAX_NONCES``) is handled by
  raising a floor, never by forgetting (see ``NonceCache``).
- Each response to an authenticated request carries
  ``X-Pdcore-Auth: <hex mac(key, b"response", n, status, sha256(body))>``; the
  client checks it, so a look-up answer cannot be forged or swapped either.
  A 401 is not signed (the server could not know the key was right); the
  client reports it as ``AuthenticationError`` and never retries it. An
  unsigned answer to a client with a secret is ``AuthenticationError`` too
  (a server without the secret, or someone in between); only the canned busy
  503 is taken unsigned, since all it does is make the client retry.
- Not covered: the MAC does not name the server, so a request captured on one
  bootstrap server could be replayed within the window to another one that
  shares the secret; give separate deployments separate secrets.
- ``BootstrapServer.stats`` counts verified requests, refusals by cause and
  evictions; refusals are logged at most once per source address every 10 s,
  naming the cause, never a key or a MAC.

Why the stdlib ``ThreadingHTTPServer``: the traffic is a handful of requests per
rank start, so an event loop buys nothing and costs a dependency. It is bounded
here: a cap on concurrent connections, a short deadline for the request head
(``header_timeout``) inside a total per-request deadline on reads, a body cap
read from Content-Length before any body byte, and HTTP/1.0 (one request per
connection, so no idle keep-alive threads). Idle or slow sockets cannot hold
the cap: at the cap, the oldest connection that has not yet delivered its
whole request is cut to make room (``stats.evicted``); it is never acted on,
and a client that was cut retries like after a reset. Only when every
connection is past its request does a newcomer get the busy 503. The serving
loop waits on the listening socket and a wake pipe, so ``close`` is prompt,
not polled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import hmac
import http.client
import io
import json
import logging
import math
import os
import random
import re
import secrets
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta
from transport.loglimit import LogLimit

from ..core.deadline import Deadline, DeadlineExceeded
from ..core.errors import LocalProtocolError, RemoteProtocolError, StartError
from . import auth
from .auth import AuthenticationError
from .metrics import BootstrapCollector, check_registry
from .wire import MAX_SESSION_ID, MAX_TP_SIZE, check_endpoint, check_json_object

__all__ = [
    "MAX_BODY_BYTES",
    "RankRegistration",
    "ParallelInfo",
    "RankInfo",
    "Registry",
    "parse_registration",
    "parse_rank_path",
    "parse_parallel_info",
    "parse_rank_info",
    "AUTH_HEADER",
    "RESPONSE_MAC_HEADER",
    "DEFAULT_AUTH_WINDOW",
    "MAX_NONCES",
    "RequestAuthError",
    "NonceCache",
    "sign_request",
    "verify_request",
    "sign_response",
    "BootstrapStats",
    "BootstrapServer",
    "BootstrapClient",
    "DEFAULT_PORT",
]

log = logging.getLogger("pdcore.bootstrap")

MAX_BODY_BYTES: Final = 1 << 20
MAX_RESPONSE_BYTES: Final = 2 * MAX_BODY_BYTES
DEFAULT_PORT: Final = 8998
_BACKOFF_FIRST: Final = 0.01  # seconds: the client's first pause after a busy or refused attempt
_BACKOFF_CAP: Final = 0.5  # ... doubling up to this, jittered
# The canned answer at the connection cap. Retry-After marks it as "busy", unlike the 503 of
# GET /v1/parallel before any rank registered (which is an answer, not a refusal).
_BUSY_BODY: Final = b'{"error":"busy: at the connection cap, retry","status":503}'
_BUSY_REPLY: Final = (
    b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
    b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\nConnection: close\r\n\r\n" + _BUSY_BODY
)

_U63 = (1 << 63) - 1
Size = Annotated[int, Meta(ge=1, le=MAX_TP_SIZE)]
Rank = Annotated[int, Meta(ge=0, le=MAX_TP_SIZE - 1)]
Epoch = Annotated[int, Meta(ge=0, le=_U63)]
SessionId = Annotated[str, Meta(min_length=1, max_length=MAX_SESSION_ID, pattern=r"^[!-~]+$")]
Endpoint = Annotated[str, Meta(min_length=1, max_length=255)]
Instance = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]  # a transport instance id, hex

Outcome = Literal["created", "unchanged", "replaced"]
PdErrorLike = LocalProtocolError | RemoteProtocolError


class RankRegistration(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a source rank PUTs: its control endpoint, place in the replica, layout."""

    session_id: SessionId
    epoch: Epoch
    endpoint: Endpoint
    tp_size: Size
    dp_size: Size
    tp_rank: Rank
    dp_rank: Rank
    layout: dict[str, Any]
    transport: Instance  # the rank's data-plane instance: what a sink grants its pages to


class ParallelInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The deployment's shape, as a sink sees it; ``complete`` once every rank registered.

    ``tp_sizes[g]`` is DP group ``g``'s tp size (groups may differ: DP attention with a tp size per
    group), 0 while none of its ranks registered. ``layout`` is group 0's (with a KV layout the
    groups' page sizes follow from their tp sizes; everything else is the same in every group).
    """

    dp_size: Size
    tp_sizes: Annotated[tuple[Annotated[int, Meta(ge=0, le=MAX_TP_SIZE)], ...], Meta(max_length=MAX_TP_SIZE)]
    layout: dict[str, Any]
    registered: Annotated[int, Meta(ge=1, le=MAX_TP_SIZE * MAX_TP_SIZE)]
    complete: bool

    def tp_size(self, dp_rank: int) -> int:
        """DP group ``dp_rank``'s tp size (0: not known yet)."""
        return self.tp_sizes[dp_rank]


class RankInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One registered rank: where its control channel listens."""

    dp_rank: Rank
    tp_rank: Rank
    endpoint: Endpoint
    session_id: SessionId
    epoch: Epoch
    transport: Instance


_REG_DECODER: Final = msgspec.json.Decoder(RankRegistration)
_PAR_DECODER: Final = msgspec.json.Decoder(ParallelInfo)
_RANK_DECODER: Final = msgspec.json.Decoder(RankInfo)
_ENCODER: Final = msgspec.json.Encoder(order="sorted")


def _decode_json(decoder: msgspec.json.Decoder[Any], body: bytes, what: str) -> Any:
    if len(body) > MAX_RESPONSE_BYTES:
        raise RemoteProtocolError(f"{what}: body of {len(body)} bytes is too large")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise RemoteProtocolError(f"{what}: {e}") from None
    except msgspec.DecodeError as e:
        raise RemoteProtocolError(f"{what}: not JSON: {e}") from None
    except RecursionError:
        raise RemoteProtocolError(f"{what}: nested too deeply") from None


def _relabel(what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except LocalProtocolError as e:  # bytes from outside: the fault is the sender's
        raise RemoteProtocolError(f"{what}.{e}") from None


def parse_registration(body: bytes) -> RankRegistration:
    """Validate a PUT /v1/ranks body. Raises ``RemoteProtocolError`` naming the field."""
    reg: RankRegistration = _decode_json(_REG_DECODER, body, "registration")
    if reg.tp_rank >= reg.tp_size:
        raise RemoteProtocolError(f"registration.tp_rank: {reg.tp_rank} is not below tp_size {reg.tp_size}")
    if reg.dp_rank >= reg.dp_size:
        raise RemoteProtocolError(f"registration.dp_rank: {reg.dp_rank} is not below dp_size {reg.dp_size}")
    _relabel("registration", check_endpoint, reg.endpoint)
    _relabel("registration", check_json_object, reg.layout, "layout")
    return reg


def parse_parallel_info(body: bytes) -> ParallelInfo:
    """Validate a GET /v1/parallel response (the client's door)."""
    info: ParallelInfo = _decode_json(_PAR_DECODER, body, "parallel_info")
    if len(info.tp_sizes) != info.dp_size:
        raise RemoteProtocolError(f"parallel_info.tp_sizes: {len(info.tp_sizes)} groups, dp_size {info.dp_size}")
    if info.registered > sum(info.tp_sizes) and all(info.tp_sizes):
        raise RemoteProtocolError(f"parallel_info.registered: {info.registered} exceeds the groups' tp sizes")
    if info.complete != (all(info.tp_sizes) and info.registered == sum(info.tp_sizes)):
        raise RemoteProtocolError("parallel_info.complete: disagrees with registered")
    _relabel("parallel_info", check_json_object, info.layout, "layout")
    return info


def parse_rank_info(body: bytes) -> RankInfo:
    """Validate a GET /v1/ranks/<dp>/<tp> response (the client's door)."""
    info: RankInfo = _decode_json(_RANK_DECODER, body, "rank_info")
    _relabel("rank_info", check_endpoint, info.endpoint)
    return info


def _canonical_int(text: str, field: str) -> int:
    if not (0 < len(text) <= 4 and text.isascii() and text.isdigit()) or text != str(int(text)):
        raise RemoteProtocolError(f"{field}: {text[:16]!r} is not a canonical integer")
    value = int(text)
    if value >= MAX_TP_SIZE:
        raise RemoteProtocolError(f"{field}: {value} is not below {MAX_TP_SIZE}")
    return value


def parse_rank_path(path: str) -> tuple[int, int] | None:
    """``/v1/ranks/<dp>/<tp>`` → (dp_rank, tp_rank); None if the path is not that route.

    Raises ``RemoteProtocolError`` naming ``dp_rank`` or ``tp_rank`` if malformed.
    """
    parts = path.split("/")
    if len(parts) != 5 or parts[0] != "" or parts[1] != "v1" or parts[2] != "ranks":
        return None
    return _canonical_int(parts[3], "dp_rank"), _canonical_int(parts[4], "tp_rank")


def _canonical_layout(layout: dict[str, Any]) -> bytes:
    return _ENCODER.encode(layout)


def _group_neutral(layout: dict[str, Any]) -> bytes:
    """What must match across DP groups: with a KV layout (``"kv"``) the page sizes follow from each group's
    tp size and may differ; everything else, and opaque pages' sizes, must match."""
    if "kv" in layout:
        layout = {k: v for k, v in layout.items() if k != "page_bytes"}
    return _canonical_layout(layout)


_ABSENT: Final = object()


def _first_difference(a: Any, b: Any, path: str, *, skip_pages: bool = False) -> tuple[str, Any, Any]:
    """The first place two JSON values differ: ``(path, a's value, b's value)`` (``_ABSENT`` where a key is
    missing). ``skip_pages``: a top-level ``page_bytes`` beside a ``kv`` layout may differ (DP groups)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if skip_pages and key == "page_bytes" and "kv" in a and "kv" in b:
                continue
            va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
            if _canonical_layout({"v": va} if va is not _ABSENT else {}) != _canonical_layout(
                    {"v": vb} if vb is not _ABSENT else {}):
                return _first_difference(va, vb, f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (va, vb) in enumerate(zip(a, b)):
            if _canonical_layout({"v": va}) != _canonical_layout({"v": vb}):
                return _first_difference(va, vb, f"{path}[{i}]")
    return path, a, b


def _short(value: Any) -> str:
    """A value for an error message: ``(absent)``, or its repr cut at 80 characters."""
    if value is _ABSENT:
        return "(absent)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Registry:
    """The server's state, pure and not thread-safe: the server holds a lock around it."""

    def __init__(self) -> None:
        self._slots: dict[tuple[int, int], tuple[RankRegistration, bytes]] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def register(self, reg: RankRegistration) -> Outcome:
        """Store a registration. Raises ``RemoteProtocolError`` (→ 409) on a conflict."""
        slot = (reg.dp_rank, reg.tp_rank)
        layout = _canonical_layout(reg.layout)
        for other_slot, (other, other_layout) in self._slots.items():
            if other_slot == slot:
                continue
            where = f"rank (dp {other.dp_rank}, tp {other.tp_rank})"
            if reg.dp_size != other.dp_size:
                raise RemoteProtocolError(
                    f"registration.dp_size: {reg.dp_size} disagrees with {other.dp_size} registered by {where}"
                )
            same_group = reg.dp_rank == other.dp_rank
            if same_group and reg.tp_size != other.tp_size:
                raise RemoteProtocolError(
                    f"registration.tp_size: {reg.tp_size} disagrees with {other.tp_size} registered by {where} "
                    f"of the same DP group"
                )
            if (layout if same_group else _group_neutral(reg.layout)) != (
                other_layout if same_group else _group_neutral(other.layout)
            ):
                path, mine, theirs = _first_difference(reg.layout, other.layout, "layout", skip_pages=not same_group)
                raise RemoteProtocolError(
                    f"registration.{path}: {_short(mine)} differs from {_short(theirs)} registered by {where}"
                )
            if reg.endpoint == other.endpoint:
                raise RemoteProtocolError(f"registration.endpoint: {reg.endpoint} is already used by {where}")
            if reg.session_id == other.session_id:
                raise RemoteProtocolError(f"registration.session_id: {reg.session_id} is already used by {where}")
        current = self._slots.get(slot)
        if current is not None:
            old = current[0]
            if reg.epoch < old.epoch:
                raise RemoteProtocolError(f"registration.epoch: {reg.epoch} is older than the registered {old.epoch}")
            if reg.epoch == old.epoch:
                for field in ("session_id", "endpoint", "tp_size", "dp_size", "transport"):
                    if getattr(reg, field) != getattr(old, field):
                        raise RemoteProtocolError(
                            f"registration.{field}: differs from the registration of the same epoch {old.epoch}"
                        )
                if layout != current[1]:
                    raise RemoteProtocolError(
                        f"registration.layout: differs from the registration of the same epoch {old.epoch}"
                    )
                return "unchanged"
        self._slots[slot] = (reg, layout)
        return "created" if current is None else "replaced"

    def parallel_info(self) -> ParallelInfo | None:
        """None while no rank registered."""
        if not self._slots:
            return None
        regs = [entry[0] for entry in self._slots.values()]
        dp_size = regs[0].dp_size
        tp_sizes = [0] * dp_size
        counts = [0] * dp_size
        for reg in regs:
            tp_sizes[reg.dp_rank] = reg.tp_size
            counts[reg.dp_rank] += 1
        layout = min(regs, key=lambda r: (r.dp_rank, r.tp_rank)).layout
        complete = all(size and count == size for size, count in zip(tp_sizes, counts))
        return ParallelInfo(
            dp_size=dp_size, tp_sizes=tuple(tp_sizes), layout=layout, registered=len(regs), complete=complete,
        )  # fmt: skip

    def lookup(self, dp_rank: int, tp_rank: int) -> RankInfo | None:
        entry = self._slots.get((dp_rank, tp_rank))
        if entry is None:
            return None
        reg = entry[0]
        return RankInfo(
            dp_rank=dp_rank, tp_rank=tp_rank, endpoint=reg.endpoint, session_id=reg.session_id, epoch=reg.epoch,
            transport=reg.transport,
        )  # fmt: skip


# --------------------------------------------------------------------------- request authentication (sans-IO)

AUTH_HEADER: Final = "Authorization"
AUTH_SCHEME: Final = "PDCORE-HMAC-SHA256"
RESPONSE_MAC_HEADER: Final = "X-Pdcore-Auth"
DEFAULT_AUTH_WINDOW: Final = 30.0  # seconds either side of the server's clock
MAX_NONCES: Final = 100_000  # the nonce cache's bound: ~3,300 verified requests/s sustained over a 30 s window
_KEY_LABEL: Final = "bootstrap"
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


def _response_signed(key: bytes, nonce: str, status: int, body: bytes, values: list[str]) -> bool:
    if len(values) != 1 or not _MAC_RE.fullmatch(values[0]):
        return False
    return hmac.compare_digest(sign_response(key, nonce, status, body), values[0])


# --------------------------------------------------------------------------- deadline-bound socket I/O


class _DeadlineReader(io.RawIOBase):
    """Socket reads that share one total deadline (a per-recv timeout lets a slow drip run forever).

    The server moves ``deadline`` from the request head's to the whole request's once the head is in.
    """

    def __init__(self, sock: socket.socket, deadline: Deadline, what: str) -> None:
        super().__init__()
        self._sock, self.deadline, self.what = sock, deadline, what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline.remaining()
        if remaining <= 0:
            raise DeadlineExceeded(f"{self.what}: deadline passed")
        self._sock.settimeout(remaining)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            raise DeadlineExceeded(f"{self.what}: deadline passed") from None


class _DeadlineWriter(io.RawIOBase):
    def __init__(self, sock: socket.socket, deadline: Deadline, what: str) -> None:
        super().__init__()
        self._sock, self._deadline, self._what = sock, deadline, what

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        remaining = self._deadline.remaining()
        if remaining <= 0:
            raise DeadlineExceeded(f"{self._what}: deadline passed")
        self._sock.settimeout(remaining)  # sendall: the timeout bounds the whole call
        try:
            self._sock.sendall(data)
        except TimeoutError:
            raise DeadlineExceeded(f"{self._what}: deadline passed") from None
        return len(data)


class _DeadlineSocket:
    """What ``http.client`` needs of a socket, with every operation under one deadline."""

    def __init__(self, sock: socket.socket, deadline: Deadline, what: str) -> None:
        self._sock, self._deadline, self._what = sock, deadline, what

    def sendall(self, data: Any) -> None:
        _DeadlineWriter(self._sock, self._deadline, self._what).write(data)

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:
        assert "r" in mode
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline, self._what))

    def close(self) -> None:
        self._sock.close()


# --------------------------------------------------------------------------- server



@dataclasses.dataclass
class BootstrapStats:
    """A server's counters since start (``BootstrapServer.stats`` returns a snapshot)."""

    authenticated: int = 0  # requests whose signature verified
    auth_failures: int = 0  # 401s, every cause (the next three are among them)
    bad_signatures: int = 0  # the MAC did not verify: a wrong secret or a forgery
    stale: int = 0  # signed, but the timestamp was outside the window (an old replay or a skewed clock)
    replays: int = 0  # signed and inside the window, but the nonce was used before (or below the floor)
    nonces_dropped: int = 0  # nonce-cache entries dropped at its bound (the floor rose instead)
    evicted: int = 0  # connections cut at the cap before they delivered their whole request
    busy: int = 0  # newcomers answered 503 busy: every connection at the cap was past its request


class _Conn:
    """One accepted connection: ``reading`` until its whole request is in, ``evicted`` once cut to make room."""

    __slots__ = ("sock", "addr", "reading", "evicted")

    def __init__(self, sock: socket.socket, addr: Any) -> None:
        self.sock, self.addr = sock, addr
        self.reading, self.evicted = True, False


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads
    server_version = "pdcore-bootstrap"
    sys_version = ""

    def __init__(self, conn: _Conn, server: _Server) -> None:
        self.conn = conn
        self._nonce: str | None = None  # the verified request's nonce: its answer is signed with it
        super().__init__(conn.sock, conn.addr, server)

    def setup(self) -> None:
        self._deadline = Deadline.after(self.server.request_timeout)
        head = Deadline.after(self.server.header_timeout).earliest(self._deadline)
        self.connection = self.request
        self._reader = _DeadlineReader(self.connection, head, "bootstrap request head")
        self.rfile = io.BufferedReader(self._reader)
        self.wfile = io.BufferedWriter(_DeadlineWriter(self.connection, self._deadline, "bootstrap response"))

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self._reader.deadline, self._reader.what = self._deadline, "bootstrap request"  # the head is in
        return ok

    def finish(self) -> None:
        try:
            self.wfile.flush()
        except (OSError, ValueError):
            pass
        finally:
            self.wfile.close()
            self.rfile.close()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _reply(self, code: int, payload: Any) -> None:
        body = _ENCODER.encode(payload)
        if self.request_version == "HTTP/0.9":  # garbage parsed as HTTP/0.9: still answer with a status line
            self.request_version = self.protocol_version
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        key = self.server.key
        if self._nonce is not None and key is not None:
            self.send_header(RESPONSE_MAC_HEADER, sign_response(key, self._nonce, code, body))
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Also called by the stdlib parser for a malformed request line or headers."""
        self.close_connection = True
        text = message or explain or HTTPStatus(code).phrase
        self.log_error("code %d, message %s", code, text)
        self._reply(code, {"error": text, "status": code})

    def _dispatch(self) -> None:
        """Every method: read the whole request, authenticate it, then act (GET /health skips the middle)."""
        srv, method, path = self.server, self.command, self.path
        if method == "GET" and path == "/health":  # open: reveals nothing, load balancers probe it
            if srv.begin_handling(self.conn):
                self._reply(200, {"status": "ok"})
            return
        if method == "GET" and path == "/metrics" and srv.metrics is not None:  # open: counters, no endpoints
            if srv.begin_handling(self.conn):
                self._metrics()
            return
        body = b""
        has_body = self.headers.get("Content-Length") is not None or self.headers.get("Transfer-Encoding") is not None
        if (method == "PUT" and path == "/v1/ranks") or (srv.key is not None and has_body):
            read = self._read_body()
            if read is None:
                return
            body = read
        if not srv.begin_handling(self.conn):
            self.close_connection = True  # cut at the cap while it was still sending: never acted on
            return
        if srv.key is not None:
            try:
                self._nonce = srv.authenticate(method, path, body, self.headers.get_all(AUTH_HEADER), self.conn.addr)
            except RequestAuthError as e:
                return self.send_error(401, str(e))
        if method == "GET":
            return self._get(path)
        if method == "PUT" and path == "/v1/ranks":
            return self._put(body)
        return self._not_found_or_not_allowed(method)

    do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = _dispatch

    def _metrics(self) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(self.server.metrics)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _get(self, path: str) -> None:
        if path == "/v1/parallel":
            with self.server.lock:
                info = self.server.registry.parallel_info()
            if info is None:
                return self.send_error(503, "no rank registered yet")
            return self._reply(200, info)
        try:
            ranks = parse_rank_path(path)
        except RemoteProtocolError as e:
            return self.send_error(400, str(e))
        if ranks is None:
            return self._not_found_or_not_allowed("GET")
        with self.server.lock:
            rank = self.server.registry.lookup(*ranks)
        if rank is None:
            return self.send_error(404, f"no rank (dp {ranks[0]}, tp {ranks[1]}) is registered")
        return self._reply(200, rank)

    def _put(self, body: bytes) -> None:
        try:
            reg = parse_registration(body)
        except RemoteProtocolError as e:
            return self.send_error(400, str(e))
        try:
            with self.server.lock:
                outcome = self.server.registry.register(reg)
        except RemoteProtocolError as e:
            return self.send_error(409, str(e))
        log.info("rank (dp %d, tp %d) %s at %s epoch %d", reg.dp_rank, reg.tp_rank, outcome, reg.endpoint, reg.epoch)
        return self._reply(200, {"result": outcome})

    def _read_body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding") is not None:
            self.send_error(400, "Transfer-Encoding: not supported, send Content-Length")
            return None
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            self.send_error(411, "Content-Length: required")
            return None
        text = lengths[0].strip()
        if len(lengths) != 1 or not (text.isascii() and text.isdigit()) or len(text) > 12:
            self.send_error(400, "Content-Length: not a single non-negative integer")
            return None
        n = int(text)
        cap = self.server.max_body
        if n > cap:
            self.send_error(413, f"Content-Length: {n} bytes exceeds the limit of {cap}")
            self._discard(min(n, 4 * cap))  # read a bounded amount so the reply is not lost to a reset
            return None
        body = self.rfile.read(n)
        if len(body) != n:
            self.send_error(400, f"body: {len(body)} bytes, Content-Length said {n}")
            return None
        return body

    def _discard(self, n: int) -> None:
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            while n > 0:
                chunk = self.rfile.read1(min(n, 65536))
                if not chunk:
                    break
                n -= len(chunk)
        except (OSError, ValueError):
            pass

    def _not_found_or_not_allowed(self, method: str) -> None:
        allowed = {"/health": "GET", "/v1/parallel": "GET", "/v1/ranks": "PUT"}.get(self.path)
        if allowed is None and self.path.startswith("/v1/ranks/"):
            allowed = "GET"
        if allowed is None:
            return self.send_error(404, f"path: no route {self.path[:64]!r}")
        return self.send_error(405, f"method: {method} not allowed on {self.path[:64]!r}, use {allowed}")


class _Server(ThreadingHTTPServer):
    """Bounded ThreadingHTTPServer: a cap on live connections, each tracked so close can cut it.

    At the cap, the oldest connection still sending its request is cut to make
    room; only when none is does the newcomer get the canned busy 503.
    """

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        *,
        key: bytes | None,
        max_body: int,
        request_timeout: float,
        header_timeout: float,
        max_connections: int,
        auth_window: float,
        clock: Callable[[], float],
        metrics: Any = None,
    ) -> None:
        self.key = key
        self.max_body = max_body
        self.request_timeout = request_timeout
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.auth_window = auth_window
        self.clock = clock
        self.metrics = metrics
        self.registry = Registry()
        self.lock = threading.Lock()  # the registry's
        self.nonces = NonceCache()
        self._auth_lock = threading.Lock()  # the nonce cache's
        self.stats = BootstrapStats()
        self.stats_lock = threading.Lock()
        self._warned = LogLimit()  # per source address: at most one warning every 10 s
        self._conns: dict[_Conn, threading.Thread] = {}  # holding a slot, in accept order
        self._handlers: set[threading.Thread] = set()  # every handler not yet joined (evicted ones too)
        self._live_lock = threading.Lock()
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)  # type: ignore[arg-type]  # built by _serve_one, not by the base class

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's version does a reverse DNS lookup
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def _count(self, **increments: int) -> None:
        with self.stats_lock:
            for name, n in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def process_request(self, request: Any, client_address: Any) -> None:
        conn = _Conn(request, client_address)
        thread: threading.Thread | None = None
        evicted = False
        with self._live_lock:
            if len(self._conns) >= self.max_connections:
                victim = next((c for c in self._conns if c.reading), None)  # the oldest still sending
                if victim is not None:  # its slot is the newcomer's; cut under the lock, before its handler closes it
                    victim.evicted, evicted = True, True
                    del self._conns[victim]
                    try:
                        victim.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            if len(self._conns) < self.max_connections:
                thread = threading.Thread(target=self._serve_one, args=(conn,), name="pdcore-bootstrap-conn", daemon=True)
                self._conns[conn] = thread
                self._handlers = {t for t in self._handlers if t.is_alive()}
                self._handlers.add(thread)
        if evicted:
            self._count(evicted=1)
        if thread is None:  # every connection is past its request: a canned 503, never a blocking write
            self._count(busy=1)
            try:
                request.setblocking(False)
                request.send(_BUSY_REPLY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            thread.start()
        except BaseException:
            with self._live_lock:
                self._conns.pop(conn, None)
                self._handlers.discard(thread)
            self.shutdown_request(request)
            raise

    def _serve_one(self, conn: _Conn) -> None:
        try:
            _Handler(conn, self)
        except Exception:
            if not conn.evicted:  # a cut connection fails its reads and writes: expected, not news
                log.exception("bootstrap: request from %s failed", conn.addr)
        finally:
            with self._live_lock:
                self._conns.pop(conn, None)  # before the close, so a client that saw EOF finds the slot free
            self.shutdown_request(conn.sock)

    def begin_handling(self, conn: _Conn) -> bool:
        """The whole request is in: from now on the connection cannot be evicted. False if it already was."""
        with self._live_lock:
            if conn.evicted:
                return False
            conn.reading = False
            return True

    def authenticate(self, method: str, path: str, body: bytes, headers: list[str] | None, addr: Any) -> str:
        """``verify_request`` under the cache's lock, counted; returns the nonce or raises ``RequestAuthError``."""
        assert self.key is not None
        try:
            if headers is not None and len(headers) > 1:
                raise RequestAuthError("malformed", f"{len(headers)} {AUTH_HEADER} headers, send one")
            with self._auth_lock:
                dropped = self.nonces.dropped
                nonce = verify_request(
                    self.key, method, path, body, headers[0] if headers else None, self.clock(), self.nonces,
                    window=self.auth_window,
                )  # fmt: skip
                dropped = self.nonces.dropped - dropped
        except RequestAuthError as e:
            self._refused(e, method, path, addr)
            raise
        self._count(authenticated=1, nonces_dropped=dropped)
        return nonce

    def _refused(self, error: RequestAuthError, method: str, path: str, addr: Any) -> None:
        kind = {"signature": "bad_signatures", "window": "stale", "replay": "replays"}.get(error.kind)
        source = str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)
        with self.stats_lock:
            self.stats.auth_failures += 1
            if kind is not None:
                setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        since = self._warned.ready(source)
        if since is None:
            return  # counted in stats; named within the last 10 s (or too many sources to name each)
        more = f" (and {since} more from it since the last warning)" if since else ""
        log.warning("bootstrap: refused %s %r from %s: %s%s", method, path[:64], source, error, more)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("bootstrap: error serving %s", client_address)

    def cut_connections(self) -> list[threading.Thread]:
        """Wake every handler blocked on its socket; return the threads to join."""
        with self._live_lock:
            for conn in self._conns:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return list(self._handlers)


class BootstrapServer:
    """The bootstrap HTTP server on its own thread: ``start()`` binds and returns the port.

    ``secret`` is the raw deployment secret (checked with ``auth.check_secret``;
    this class does not read the environment): with it, every request but
    ``GET /health`` must be signed and every answer to one is signed (module
    docstring). None serves unauthenticated, as before, and ``start`` warns once.
    ``header_timeout`` bounds the request head (line and headers), inside
    ``request_timeout`` for the whole request. ``auth_window`` is the accepted
    clock difference in seconds; ``clock`` (unix seconds) is for tests.
    ``stats`` is a snapshot of the counters (``BootstrapStats``).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        max_body: int = MAX_BODY_BYTES,
        request_timeout: float = 5.0,
        header_timeout: float = 2.0,
        max_connections: int = 64,
        auth_window: float = DEFAULT_AUTH_WINDOW,
        clock: Callable[[], float] = time.time,
        metrics: Any = None,
    ) -> None:
        for name, value in (("request_timeout", request_timeout), ("header_timeout", header_timeout),
                            ("auth_window", auth_window)):  # fmt: skip
            if not (value >= 0 and math.isfinite(value)):
                raise StartError(f"bootstrap server: {name} must be a finite number of seconds >= 0, got {value!r}")
        if max_connections < 1:
            raise StartError(f"bootstrap server: max_connections must be at least 1, got {max_connections}")
        self.host = host
        self._port = port
        self._key = None if secret is None else auth.derive_key(auth.check_secret(secret, "bootstrap server"), _KEY_LABEL)
        self._max_body = max_body
        self._request_timeout = request_timeout
        self._header_timeout = header_timeout
        self._max_connections = max_connections
        self._auth_window = auth_window
        self._clock = clock
        if metrics is not None:
            check_registry(metrics, "bootstrap server: metrics")
        self._metrics = metrics
        self._collector = BootstrapCollector(self)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._closed = False

    @property
    def port(self) -> int:
        if self._server is None:
            raise StartError("bootstrap server: not started")
        return int(self._server.server_address[1])

    @property
    def authenticated(self) -> bool:
        """True if requests must be signed (a secret was given)."""
        return self._key is not None

    @property
    def registered_ranks(self) -> int:
        """Ranks in the registry now."""
        server = self._server
        if server is None:
            return 0
        with server.lock:
            return len(server.registry)

    @property
    def stats(self) -> BootstrapStats:
        """A snapshot of the counters (all zero before ``start``)."""
        server = self._server
        if server is None:
            return BootstrapStats()
        with server.stats_lock:
            return dataclasses.replace(server.stats)

    def start(self) -> int:
        """Bind and serve; returns the bound port. Raises ``StartError`` if it cannot bind."""
        if self._server is not None or self._closed:
            raise StartError("bootstrap server: start() may be called once")
        try:
            server = _Server(
                (self.host, self._port),
                key=self._key,
                max_body=self._max_body,
                request_timeout=self._request_timeout,
                header_timeout=self._header_timeout,
                max_connections=self._max_connections,
                auth_window=self._auth_window,
                clock=self._clock,
                metrics=self._metrics,
            )
        except OSError as e:
            raise StartError(f"bootstrap server: cannot bind {self.host}:{self._port}: {e}") from e
        if self._key is None:
            auth.warn_unauthenticated("bootstrap server")
        if self._metrics is not None:
            self._metrics.register(self._collector)
        server.timeout = 0  # handle_request() is called only once the listening socket is readable
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._server = server
        self._thread = threading.Thread(target=self._serve, name="pdcore-bootstrap", daemon=True)
        self._thread.start()
        return self.port

    def _serve(self) -> None:
        assert self._server is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._server.socket, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                keys = [key for key, _ in sel.select()]
                if any(key.fileobj == self._wake_r for key in keys):
                    return
                try:
                    self._server.handle_request()
                except Exception:  # accept errors (EMFILE, ...) must not end the server
                    log.exception("bootstrap: accept failed")

    def close(self, deadline: Deadline | None = None) -> None:
        """Stop serving, cut open connections, join every thread. Idempotent.

        Raises ``DeadlineExceeded`` if a thread is still alive at the deadline
        (default 5 s).
        """
        deadline = deadline or Deadline.after(5.0)
        if self._closed:
            return
        self._closed = True
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        if threading.current_thread() is thread:
            raise RuntimeError("bootstrap server: close() called from its own thread")
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass
        thread.join(deadline.remaining())
        handlers = server.cut_connections()
        for handler in handlers:
            handler.join(deadline.remaining())
        server.server_close()
        if self._metrics is not None:
            self._metrics.unregister(self._collector)
        os.close(self._wake_r)
        os.close(self._wake_w)
        alive = [t.name for t in [thread, *handlers] if t.is_alive()]
        if alive:
            raise DeadlineExceeded(f"bootstrap server: threads {alive} did not stop by the deadline")

    def __enter__(self) -> BootstrapServer:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- client


class _Connection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, deadline: Deadline) -> None:
        super().__init__(host, port)
        self._deadline = deadline

    def connect(self) -> None:
        remaining = self._deadline.remaining()
        if remaining <= 0:
            raise DeadlineExceeded("bootstrap: deadline passed before connecting")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=remaining)
        except TimeoutError:
            raise DeadlineExceeded(f"bootstrap: connect to {self.host}:{self.port} timed out") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = _DeadlineSocket(sock, self._deadline, f"bootstrap {self.host}:{self.port}")


class BootstrapClient:
    """Talks to one bootstrap server; every call takes a ``Deadline`` that bounds it whole.

    Blocking, but bounded: call it from a peer's I/O thread, never from the
    scheduler thread. A server at its connection cap (503 with Retry-After), a
    refused or a reset connection are transient: the call retries with
    jittered exponential back-off (every request is idempotent) and raises
    ``DeadlineExceeded`` only at the deadline, saying the server was busy or
    refusing. Other errors: ``DeadlineExceeded`` when the deadline passes,
    ``OSError`` when the server cannot be reached otherwise,
    ``LocalProtocolError`` when the server rejects what we sent
    (400/409/411/413: the message says why), and ``RemoteProtocolError`` when
    the server's answer is malformed or unexpected. ``rng`` draws the jitter.

    ``secret`` is the raw deployment secret (checked with ``auth.check_secret``;
    this class does not read the environment). With it, every request but
    ``health`` is signed and every answer must carry the server's signature.
    ``AuthenticationError`` (never retried), naming the server: a 401 (the
    server's reason, e.g. a different secret; or this client has none while
    the server has one), or an answer without a valid signature (a server
    without the secret, or someone in between).
    """

    def __init__(
        self, host: str, port: int, *, secret: bytes | None = None, rng: random.Random | None = None
    ) -> None:
        self.host = host
        self.port = port
        where = f"bootstrap client of {host}:{port}"
        self._key = None if secret is None else auth.derive_key(auth.check_secret(secret, where), _KEY_LABEL)
        self._rng = rng if rng is not None else random.Random()

    def _request(self, method: str, path: str, deadline: Deadline, body: bytes | None = None) -> tuple[int, bytes]:
        """One exchange, retried while the server is busy or refusing, until ``deadline``."""
        delay, attempts, busy, last = _BACKOFF_FIRST, 0, False, ""
        while True:
            if attempts and deadline.expired():
                what = "was busy (503: at its connection cap)" if busy else "was busy or down (connections refused or reset)"
                raise DeadlineExceeded(
                    f"bootstrap {method} {path}: server {self.host}:{self.port} {what} until the deadline "
                    f"({attempts} attempts, last: {last})"
                )
            attempts += 1
            try:
                status, data, retry_later = self._exchange(method, path, deadline, body)
            except ConnectionError as e:  # refused, reset, broken pipe: a busy server cuts this way too
                last = f"{type(e).__name__}: {e}"
            except DeadlineExceeded:
                if attempts == 1:
                    raise
                continue  # the deadline passed mid-attempt: report why we were still retrying
            else:
                if not retry_later:
                    return status, data
                busy, last = True, "503 busy"
            time.sleep(min(self._rng.uniform(delay / 2, delay), deadline.remaining()))
            delay = min(2 * delay, _BACKOFF_CAP)

    def _exchange(
        self, method: str, path: str, deadline: Deadline, body: bytes | None
    ) -> tuple[int, bytes, bool]:
        """One request on a fresh connection: (status, body, the server said "busy, retry later").

        Each attempt is signed afresh (new timestamp and nonce): a retry is a new request, not a replay.
        """
        conn = _Connection(self.host, self.port, deadline)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            nonce = None
            if self._key is not None and path != "/health":
                nonce = secrets.token_hex(16)
                headers[AUTH_HEADER] = sign_request(self._key, method, path, body or b"", now=time.time(), nonce=nonce)
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > MAX_RESPONSE_BYTES:
                raise RemoteProtocolError(f"bootstrap {method} {path}: response of {length} bytes is too large")
            data = response.read(MAX_RESPONSE_BYTES + 1)
            if len(data) > MAX_RESPONSE_BYTES:
                raise RemoteProtocolError(f"bootstrap {method} {path}: response is too large")
            busy = response.status == 503 and (response.getheader("Retry-After") is not None or not data)
            if busy:  # unsigned even from a server with the secret; all it does is make us retry
                return response.status, data, True
            if response.status == 401:
                raise self._refused(method, path, data)
            if nonce is not None and self._key is not None:
                macs = response.msg.get_all(RESPONSE_MAC_HEADER) or []
                if not _response_signed(self._key, nonce, response.status, data, macs):
                    raise self._unsigned(method, path, response.status, data, bool(macs))
            return response.status, data, False
        except ConnectionError:  # http.client.RemoteDisconnected is one too: retried, not a protocol error
            raise
        except http.client.HTTPException as e:
            raise RemoteProtocolError(f"bootstrap {method} {path}: bad HTTP response: {e!r}") from None
        finally:
            conn.close()

    def _refused(self, method: str, path: str, data: bytes) -> AuthenticationError:
        reason = self._error_text(data).removeprefix("authentication failed:").strip()
        mine = "" if self._key is not None else "; this client has no secret (pass secret=, or set $PDCORE_SECRET_FILE)"
        return AuthenticationError(
            f"authentication failed: bootstrap server {self.host}:{self.port} refused {method} {path} "
            f"(401): {reason}{mine}"
        )

    def _unsigned(self, method: str, path: str, status: int, data: bytes, tagged: bool) -> AuthenticationError:
        said = f"; it said: {self._error_text(data)[:200]}" if status != 200 else ""
        why = (
            "a wrong signature: is the secret the same on both sides, or is someone in between?"
            if tagged
            else "no signature: is the server running without the secret, or is someone in between?"
        )
        return AuthenticationError(
            f"authentication failed: bootstrap server {self.host}:{self.port} answered {method} {path} "
            f"({status}) with {why}{said}"
        )

    @staticmethod
    def _error_text(data: bytes) -> str:
        try:
            payload = json.loads(data)
            return str(payload["error"])[:1024]
        except Exception:  # whatever the body is, the status code already says it failed
            return data[:256].decode("utf-8", "replace")

    def _fail(self, method: str, path: str, status: int, data: bytes) -> PdErrorLike:
        text = f"bootstrap {method} {path}: {status} {self._error_text(data)}"
        if status in (400, 409, 411, 413):
            return LocalProtocolError(text)
        return RemoteProtocolError(text)

    def health(self, deadline: Deadline) -> bool:
        """True if the server answers /health with 200."""
        status, _ = self._request("GET", "/health", deadline)
        return status == 200

    def register(self, registration: RankRegistration, deadline: Deadline) -> Outcome:
        """PUT this rank; returns ``created``, ``unchanged`` (idempotent) or ``replaced`` (newer epoch)."""
        body = _ENCODER.encode(registration)
        if len(body) > MAX_BODY_BYTES:
            raise LocalProtocolError(f"registration: {len(body)} bytes exceeds {MAX_BODY_BYTES}")
        status, data = self._request("PUT", "/v1/ranks", deadline, body)
        if status != 200:
            raise self._fail("PUT", "/v1/ranks", status, data)
        try:
            outcome = json.loads(data)["result"]
        except Exception:
            outcome = None
        if outcome not in ("created", "unchanged", "replaced"):
            raise RemoteProtocolError(f"bootstrap PUT /v1/ranks: bad answer {data[:128]!r}")
        return outcome  # type: ignore[no-any-return]

    def parallel_info(self, deadline: Deadline) -> ParallelInfo | None:
        """The replica's parallel info; None while no rank registered (retry later)."""
        status, data = self._request("GET", "/v1/parallel", deadline)
        if status == 503:
            return None
        if status != 200:
            raise self._fail("GET", "/v1/parallel", status, data)
        return parse_parallel_info(data)

    def rank(self, dp_rank: int, tp_rank: int, deadline: Deadline) -> RankInfo | None:
        """One rank's endpoint; None if that rank has not registered (yet)."""
        path = f"/v1/ranks/{int(dp_rank)}/{int(tp_rank)}"
        status, data = self._request("GET", path, deadline)
        if status == 404:
            return None
        if status != 200:
            raise self._fail("GET", path, status, data)
        info = parse_rank_info(data)
        if (info.dp_rank, info.tp_rank) != (dp_rank, tp_rank):
            raise RemoteProtocolError(f"bootstrap GET {path}: answered for rank ({info.dp_rank}, {info.tp_rank})")
        return info


# --------------------------------------------------------------------------- CLI
