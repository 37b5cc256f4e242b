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
- A registration's ``layout`` is a JSON object whose keys that peers read are
  checked by type (``check_layout``): ``page_bytes`` a list of positive ints
  and ``num_pages`` a positive int, together; ``kv`` what ``KvLayout.from_json``
  accepts; ``role`` a short string. Anything else in it stays opaque JSON. A
  malformed one is a 400 naming the field (``registration.layout.page_bytes:
  ...``), and a look-up answer carrying one is a ``RemoteProtocolError`` at the
  client, so no peer is handed a layout its pairing would trip over.
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

Where each part lives (this module gathers their public names):

- ``bootstrap_schema``: the values (``RankRegistration``, ``ParallelInfo``,
  ``RankInfo``), the ``parse_*`` functions and ``Registry`` (the rules above);
- ``request_signing``: the request and response MACs, ``verify_request``, ``NonceCache``;
- ``deadline_io``: socket reads and writes under one total deadline;
- ``bootstrap_server``: ``BootstrapServer`` (and its ``BootstrapStats``);
- ``bootstrap_client``: ``BootstrapClient``.
"""

from __future__ import annotations

from .bootstrap_client import BootstrapClient
from .bootstrap_schema import (
    DEFAULT_PORT,
    MAX_BODY_BYTES,
    ParallelInfo,
    RankInfo,
    RankRegistration,
    Registry,
    parse_parallel_info,
    parse_rank_info,
    parse_rank_path,
    parse_registration,
)
from .bootstrap_server import BootstrapServer, BootstrapStats
from .request_signing import (
    AUTH_HEADER,
    DEFAULT_AUTH_WINDOW,
    MAX_NONCES,
    RESPONSE_MAC_HEADER,
    NonceCache,
    RequestAuthError,
    sign_request,
    sign_response,
    verify_request,
)

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
