"""The bootstrap server: the HTTP edge of ``Registry``, bounded (connection cap with eviction, deadlines, body cap).

The API, its rules and why the stdlib server are in ``pdcore/control/bootstrap.py``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from transport.loglimit import LogLimit
from transport.threads import named_thread

from ..core.deadline import Deadline, DeadlineExceeded
from ..core.errors import RemoteProtocolError, StartError
from . import auth
from .metrics import BootstrapCollector, check_registry
from .bootstrap_schema import ENCODER, MAX_BODY_BYTES, Registry, parse_rank_path, parse_registration
from .deadline_io import DeadlineReader, DeadlineWriter
from .request_signing import (
    AUTH_HEADER,
    DEFAULT_AUTH_WINDOW,
    KEY_LABEL,
    NonceCache,
    RESPONSE_MAC_HEADER,
    RequestAuthError,
    sign_response,
    verify_request,
)

log = logging.getLogger("pdcore.bootstrap")


# The canned answer at the connection cap. Retry-After marks it as "busy", unlike the 503 of
# GET /v1/parallel before any rank registered (which is an answer, not a refusal).
_BUSY_BODY: Final = b'{"error":"busy: at the connection cap, retry","status":503}'
_BUSY_REPLY: Final = (
    b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
    b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\nConnection: close\r\n\r\n" + _BUSY_BODY
)


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
        self._reader = DeadlineReader(self.connection, head, "bootstrap request head")
        self.rfile = io.BufferedReader(self._reader)
        self.wfile = io.BufferedWriter(DeadlineWriter(self.connection, self._deadline, "bootstrap response"))

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
        body = ENCODER.encode(payload)
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
                thread = named_thread(self._serve_one, "pdcore-bootstrap-conn", (conn,))
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
        self._key = None if secret is None else auth.derive_key(auth.check_secret(secret, "bootstrap server"), KEY_LABEL)
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
        self._thread = named_thread(self._serve, "pdcore-bootstrap")
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
