"""Bootstrap server (HTTP, one per prefill deployment) and its deadline-bound client.

Source ranks register where their control channel listens; sinks look up the
replica's parallel info and each rank's endpoint. The HTTP API (JSON bodies)::

    GET /health                    200 {"status": "ok"}
    PUT /v1/ranks                  200 {"result": "created" | "unchanged" | "replaced"}
                                   400 malformed (names the field), 409 conflict,
                                   411 no Content-Length, 413 body too large
    GET /v1/parallel               200 ParallelInfo; 503 while no rank registered
    GET /v1/ranks/<dp>/<tp>        200 RankInfo; 404 unknown rank; 400 malformed
    any, at the connection cap     503 with Retry-After: busy, the client backs off and retries

Rules (spec §12.13, §12.15 are the reference's defects this fixes):

- A registration names its slot (dp_rank, tp_rank). It must agree with every
  *other* registered rank on tp_size, dp_size and layout (compared canonically)
  and must not reuse another rank's endpoint or session id; otherwise 409.
- Same slot, same epoch: identical data is an idempotent 200 ``unchanged``,
  anything else 409. A larger epoch replaces the slot (a restarted rank); a
  smaller one is stale (409).
- Validation is pure (``parse_registration``, ``parse_rank_path``,
  ``parse_parallel_info``, ``parse_rank_info``, ``Registry``) so the fuzzers
  drive it without sockets; each raises ``RemoteProtocolError`` naming the field.

Why the stdlib ``ThreadingHTTPServer``: the traffic is a handful of requests per
rank start, so an event loop buys nothing and costs a dependency. It is bounded
here: a cap on concurrent connections, a total per-request deadline on reads,
a body cap read from Content-Length before any body byte, and HTTP/1.0 (one
request per connection, so no idle keep-alive threads). The serving loop waits
on the listening socket and a wake pipe, so ``close`` is prompt, not polled.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import logging
import os
import random
import selectors
import signal
import socket
import socketserver
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated, Any, Final, Literal, Sequence

import msgspec
from msgspec import Meta

from .deadline import Deadline, DeadlineExceeded
from .errors import LocalProtocolError, RemoteProtocolError, StartError
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
    "BootstrapServer",
    "BootstrapClient",
    "main",
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
    """The deployment's shape, as a sink sees it; ``complete`` once every rank registered."""

    tp_size: Size
    dp_size: Size
    layout: dict[str, Any]
    registered: Annotated[int, Meta(ge=1, le=MAX_TP_SIZE * MAX_TP_SIZE)]
    complete: bool


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
    if info.registered > info.tp_size * info.dp_size:
        raise RemoteProtocolError(f"parallel_info.registered: {info.registered} exceeds tp_size * dp_size")
    if info.complete != (info.registered == info.tp_size * info.dp_size):
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


class Registry:
    """The server's state, pure and not thread-safe: the server holds a lock around it."""

    def __init__(self) -> None:
        self._slots: dict[tuple[int, int], tuple[RankRegistration, bytes]] = {}

    def register(self, reg: RankRegistration) -> Outcome:
        """Store a registration. Raises ``RemoteProtocolError`` (→ 409) on a conflict."""
        slot = (reg.dp_rank, reg.tp_rank)
        layout = _canonical_layout(reg.layout)
        for other_slot, (other, other_layout) in self._slots.items():
            if other_slot == slot:
                continue
            where = f"rank (dp {other.dp_rank}, tp {other.tp_rank})"
            if (reg.tp_size, reg.dp_size) != (other.tp_size, other.dp_size):
                raise RemoteProtocolError(
                    f"registration.tp_size/dp_size: {reg.tp_size}/{reg.dp_size} disagree with "
                    f"{other.tp_size}/{other.dp_size} registered by {where}"
                )
            if layout != other_layout:
                raise RemoteProtocolError(f"registration.layout: differs from the layout registered by {where}")
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
        reg = next(iter(self._slots.values()))[0]
        n = len(self._slots)
        return ParallelInfo(
            tp_size=reg.tp_size, dp_size=reg.dp_size, layout=reg.layout,
            registered=n, complete=n == reg.tp_size * reg.dp_size,
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


# --------------------------------------------------------------------------- deadline-bound socket I/O


class _DeadlineReader(io.RawIOBase):
    """Socket reads that share one total deadline (a per-recv timeout lets a slow drip run forever)."""

    def __init__(self, sock: socket.socket, deadline: Deadline, what: str) -> None:
        super().__init__()
        self._sock, self._deadline, self._what = sock, deadline, what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline.remaining()
        if remaining <= 0:
            raise DeadlineExceeded(f"{self._what}: deadline passed")
        self._sock.settimeout(remaining)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            raise DeadlineExceeded(f"{self._what}: deadline passed") from None


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


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads
    server_version = "pdcore-bootstrap"
    sys_version = ""

    def setup(self) -> None:
        deadline = Deadline.after(self.server.request_timeout)
        self.connection = self.request
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline, "bootstrap request"))
        self.wfile = io.BufferedWriter(_DeadlineWriter(self.connection, deadline, "bootstrap response"))

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
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Also called by the stdlib parser for a malformed request line or headers."""
        self.close_connection = True
        text = message or explain or HTTPStatus(code).phrase
        self.log_error("code %d, message %s", code, text)
        self._reply(code, {"error": text, "status": code})

    def do_GET(self) -> None:
        path = self.path
        if path == "/health":
            return self._reply(200, {"status": "ok"})
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

    def do_PUT(self) -> None:
        if self.path != "/v1/ranks":
            return self._not_found_or_not_allowed("PUT")
        body = self._read_body()
        if body is None:
            return
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

    def _method_not_allowed(self) -> None:
        self._not_found_or_not_allowed(self.command)

    do_POST = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed


class _Server(ThreadingHTTPServer):
    """Bounded ThreadingHTTPServer: a cap on live connections, each tracked so close can cut it."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], *, max_body: int, request_timeout: float, max_connections: int):
        self.max_body = max_body
        self.request_timeout = request_timeout
        self.registry = Registry()
        self.lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._live: dict[threading.Thread, socket.socket] = {}  # handlers still on their socket
        self._handlers: set[threading.Thread] = set()  # every handler not yet joined
        self._live_lock = threading.Lock()
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's version does a reverse DNS lookup
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:  # over the cap: a canned 503, never a blocking write
                request.setblocking(False)
                request.send(_BUSY_REPLY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self._serve_one, args=(request, client_address), name="pdcore-bootstrap-conn", daemon=True
        )
        with self._live_lock:
            self._live[thread] = request
            self._handlers = {t for t in self._handlers if t.is_alive()}
            self._handlers.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._live_lock:
                self._live.pop(thread, None)
                self._handlers.discard(thread)
            self._slots.release()
            self.shutdown_request(request)
            raise

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            log.exception("bootstrap: request from %s failed", client_address)
        finally:
            with self._live_lock:
                self._live.pop(threading.current_thread(), None)
            self._slots.release()  # before the close, so a client that saw EOF finds the slot free
            self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("bootstrap: error serving %s", client_address)

    def cut_connections(self) -> list[threading.Thread]:
        """Wake every handler blocked on its socket; return the threads to join."""
        with self._live_lock:
            live = list(self._live.values())
            threads = list(self._handlers)
        for sock in live:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return threads


class BootstrapServer:
    """The bootstrap HTTP server on its own thread: ``start()`` binds and returns the port."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_body: int = MAX_BODY_BYTES,
        request_timeout: float = 5.0,
        max_connections: int = 64,
    ) -> None:
        self.host = host
        self._port = port
        self._max_body = max_body
        self._request_timeout = request_timeout
        self._max_connections = max_connections
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._closed = False

    @property
    def port(self) -> int:
        if self._server is None:
            raise StartError("bootstrap server: not started")
        return int(self._server.server_address[1])

    def start(self) -> int:
        """Bind and serve; returns the bound port. Raises ``StartError`` if it cannot bind."""
        if self._server is not None or self._closed:
            raise StartError("bootstrap server: start() may be called once")
        try:
            server = _Server(
                (self.host, self._port),
                max_body=self._max_body,
                request_timeout=self._request_timeout,
                max_connections=self._max_connections,
            )
        except OSError as e:
            raise StartError(f"bootstrap server: cannot bind {self.host}:{self._port}: {e}") from e
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
    """

    def __init__(self, host: str, port: int, *, rng: random.Random | None = None) -> None:
        self.host = host
        self.port = port
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
        """One request on a fresh connection: (status, body, the server said "busy, retry later")."""
        conn = _Connection(self.host, self.port, deadline)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > MAX_RESPONSE_BYTES:
                raise RemoteProtocolError(f"bootstrap {method} {path}: response of {length} bytes is too large")
            data = response.read(MAX_RESPONSE_BYTES + 1)
            if len(data) > MAX_RESPONSE_BYTES:
                raise RemoteProtocolError(f"bootstrap {method} {path}: response is too large")
            busy = response.status == 503 and (response.getheader("Retry-After") is not None or not data)
            return response.status, data, busy
        except ConnectionError:  # http.client.RemoteDisconnected is one too: retried, not a protocol error
            raise
        except http.client.HTTPException as e:
            raise RemoteProtocolError(f"bootstrap {method} {path}: bad HTTP response: {e!r}") from None
        finally:
            conn.close()

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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pdcore bootstrap --host H --port P``: serve until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m pdcore bootstrap", description="Run the PD bootstrap server.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind, 0 = any (default: %(default)s)")
    parser.add_argument("--max-body", type=int, default=MAX_BODY_BYTES, help="request body limit in bytes")
    parser.add_argument("--request-timeout", type=float, default=5.0, help="seconds allowed per request")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = {signal.SIGINT, signal.SIGTERM}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # threads started below inherit the mask
    try:
        server = BootstrapServer(
            args.host, args.port, max_body=args.max_body, request_timeout=args.request_timeout
        )
        try:
            port = server.start()
        except StartError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"bootstrap server listening on {args.host}:{port}", flush=True)
        received = signal.sigwait(stop)
        log.info("bootstrap server: %s, closing", signal.Signals(received).name)
        server.close(Deadline.after(10.0))
        return 0
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


if __name__ == "__main__":
    sys.exit(main())
