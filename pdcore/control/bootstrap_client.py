"""The bootstrap client: deadline-bound registration and look-ups, retrying busy or refused attempts with back-off.

Every request carries the signature of ``request_signing`` when given the secret, and
every answer's signature is checked (``pdcore/control/bootstrap.py``, "Authentication").
"""

from __future__ import annotations

import http.client
import json
import random
import secrets
import socket
import time
from typing import Final

from ..core.deadline import Deadline, DeadlineExceeded
from ..core.errors import LocalProtocolError, RemoteProtocolError
from . import auth
from .auth import AuthenticationError
from .bootstrap_schema import (
    ENCODER,
    MAX_BODY_BYTES,
    MAX_RESPONSE_BYTES,
    Outcome,
    ParallelInfo,
    PdErrorLike,
    RankInfo,
    RankRegistration,
    parse_parallel_info,
    parse_rank_info,
)
from .deadline_io import DeadlineSocket
from .request_signing import AUTH_HEADER, KEY_LABEL, RESPONSE_MAC_HEADER, response_signed, sign_request


_BACKOFF_FIRST: Final = 0.01  # seconds: the client's first pause after a busy or refused attempt
_BACKOFF_CAP: Final = 0.5  # ... doubling up to this, jittered

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
        self.sock = DeadlineSocket(sock, self._deadline, f"bootstrap {self.host}:{self.port}")


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
        self._key = None if secret is None else auth.derive_key(auth.check_secret(secret, where), KEY_LABEL)
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
                if not response_signed(self._key, nonce, response.status, data, macs):
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
        body = ENCODER.encode(registration)
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
        return outcome

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
