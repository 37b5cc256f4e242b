"""The bootstrap server with the deployment secret: the attacks that worked without it, over real sockets.

Each attack test is written against the unauthenticated server's behaviour
(hijack answered "replaced", squat answered "created", a replay answered
"unchanged", idle sockets held the cap until request_timeout) and checks that
it is refused now, that nothing changed, that it was counted, and that the
server still serves legitimate requests afterwards. The pure verifier is tested
with an explicit ``now``; the server's clock is injected, never slept on.
"""

from __future__ import annotations

import json
import logging
import os
import random
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import pytest

from pdcore.control.auth import AuthenticationError, derive_key
from pdcore.control.bootstrap import (
    AUTH_HEADER,
    RESPONSE_MAC_HEADER,
    BootstrapClient,
    BootstrapServer,
    NonceCache,
    RequestAuthError,
    sign_request,
    sign_response,
    verify_request,
)
from pdcore.core.deadline import Deadline
from pdcore.core.errors import StartError

from test_bootstrap import LAYOUT, cli_server, raw, reg, run_cli, served, soon

SECRET = b"deployment-secret-0123456789abcdef"
OTHER = b"another-secret-0123456789abcdefgh"
KEY = derive_key(SECRET, "bootstrap")
class Clock:
    """The server's clock: real time plus a skew the test sets."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return time.time() + self.skew


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def server(clock: Clock) -> Iterator[BootstrapServer]:
    yield from served(BootstrapServer("127.0.0.1", 0, secret=SECRET, request_timeout=5.0, clock=clock))


@pytest.fixture
def client(server: BootstrapServer) -> BootstrapClient:
    return BootstrapClient("127.0.0.1", server.port, secret=SECRET)


def parse(answer: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


def request_bytes(method: str, path: str, body: bytes = b"", auth: str | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.0\r\nHost: x\r\n"
    if body or method == "PUT":
        head += f"Content-Length: {len(body)}\r\n"
    if auth is not None:
        head += f"{AUTH_HEADER}: {auth}\r\n"
    return head.encode("latin-1") + b"\r\n" + body


def signed(method: str, path: str, body: bytes = b"", *, key: bytes = KEY, now: float | None = None) -> bytes:
    header = sign_request(key, method, path, body, now=time.time() if now is None else now, nonce=os.urandom(16).hex())
    return request_bytes(method, path, body, header)


def assert_refused(answer: bytes, why: str) -> None:
    status, headers, payload = parse(answer)
    assert status == 401, (status, payload)
    assert payload["error"].startswith("authentication failed:") and why in payload["error"], payload
    assert RESPONSE_MAC_HEADER not in headers  # a refusal is not signed


def assert_serving(server: BootstrapServer) -> None:
    """Every server thread is alive and a legitimate client is still served."""
    assert server._thread is not None and server._thread.is_alive()  # white-box: the server names no thread of its own
    client = BootstrapClient("127.0.0.1", server.port, secret=SECRET)
    assert client.health(soon())
    client.parallel_info(soon())  # answered, and the answer's signature checked (None while nobody registered)
    client.rank(0, 0, soon())


class Relay:
    """Someone in the middle: forwards ``count`` connections to the server, keeps what the
    client sent, and may rewrite the server's answer before passing it on."""

    def __init__(self, target: int, count: int = 1, rewrite: Callable[[bytes], bytes] | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target, self.count, self.rewrite = target, count, rewrite
        self.sent: list[bytes] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with self.listener:
            for _ in range(self.count):
                conn, _ = self.listener.accept()
                with conn, socket.create_connection(("127.0.0.1", self.target), timeout=5) as up:
                    sent, answer = bytearray(), bytearray()
                    with selectors.DefaultSelector() as sel:
                        sel.register(conn, selectors.EVENT_READ)
                        sel.register(up, selectors.EVENT_READ)
                        while True:
                            ready = [key.fileobj for key, _ in sel.select(timeout=5)]
                            assert ready, "relay: nothing moved for 5 s"
                            if conn in ready:
                                data = conn.recv(65536)
                                if data:
                                    sent += data
                                    up.sendall(data)
                                else:
                                    sel.unregister(conn)
                            if up in ready:
                                data = up.recv(65536)
                                if not data:
                                    break  # HTTP/1.0: the server closes after its answer
                                answer += data
                    self.sent.append(bytes(sent))
                    conn.sendall(self.rewrite(bytes(answer)) if self.rewrite else bytes(answer))

    def join(self) -> None:
        self.thread.join(5)
        assert not self.thread.is_alive()


# --------------------------------------------------------------------------- the attacks


def test_hijack_a_live_rank_with_a_larger_epoch_is_refused(server: BootstrapServer, client: BootstrapClient) -> None:
    assert client.register(reg(0), soon()) == "created"
    evil = msgspec.json.encode(reg(0, epoch=99, endpoint="tcp://10.6.6.6:6666", session_id="evil"))
    assert_refused(raw(server.port, request_bytes("PUT", "/v1/ranks", evil)), "no Authorization header")
    assert_refused(raw(server.port, signed("PUT", "/v1/ranks", evil, key=derive_key(OTHER, "bootstrap"))), "bad signature")
    with pytest.raises(AuthenticationError, match=rf"^authentication failed: bootstrap server 127\.0\.0\.1:{server.port} "):
        BootstrapClient("127.0.0.1", server.port, secret=OTHER).register(reg(0, epoch=99, session_id="evil"), soon())
    rank = client.rank(0, 0, soon())
    assert rank is not None and (rank.epoch, rank.endpoint, rank.session_id) == (1, "tcp://127.0.0.1:7000", "p-0-0")
    stats = server.stats
    assert (stats.auth_failures, stats.bad_signatures) == (3, 2)
    assert_serving(server)


def test_squat_the_first_registration_is_refused(server: BootstrapServer, client: BootstrapClient) -> None:
    squat = msgspec.json.encode(reg(0, tp_size=1, layout={"page_size": 1}, endpoint="tcp://10.6.6.6:1"))
    assert_refused(raw(server.port, request_bytes("PUT", "/v1/ranks", squat)), "no Authorization header")
    with pytest.raises(AuthenticationError, match="authentication failed"):
        BootstrapClient("127.0.0.1", server.port).register(reg(0, tp_size=1), soon())
    assert client.parallel_info(soon()) is None  # the deployment's shape is still open
    assert client.register(reg(0), soon()) == "created"  # ... for the real ranks
    assert client.register(reg(1), soon()) == "created"
    info = client.parallel_info(soon())
    assert info is not None and (info.tp_sizes, info.layout, info.complete) == ((2,), LAYOUT, True)
    assert server.stats.auth_failures == 2
    assert_serving(server)


def test_replay_of_a_captured_signed_put_is_refused(server: BootstrapServer, client: BootstrapClient) -> None:
    relay = Relay(server.port)
    through = BootstrapClient("127.0.0.1", relay.port, secret=SECRET)
    assert through.register(reg(0), soon()) == "created"
    relay.join()
    (captured,) = relay.sent
    assert captured.startswith(b"PUT /v1/ranks ") and AUTH_HEADER.encode() in captured
    assert client.register(reg(0, epoch=2, endpoint="tcp://127.0.0.1:7100"), soon()) == "replaced"  # a restart
    assert_refused(raw(server.port, captured), "nonce already used")  # the exact bytes again
    rank = client.rank(0, 0, soon())
    assert rank is not None and (rank.epoch, rank.endpoint) == (2, "tcp://127.0.0.1:7100")
    assert (server.stats.replays, server.stats.auth_failures) == (1, 1)
    assert_serving(server)


def test_replay_after_the_window_is_refused_as_stale(server: BootstrapServer, clock: Clock) -> None:
    relay = Relay(server.port)
    assert BootstrapClient("127.0.0.1", relay.port, secret=SECRET).register(reg(0), soon()) == "created"
    relay.join()
    clock.skew = 31.0  # the server's clock moved on past the window
    assert_refused(raw(server.port, relay.sent[0]), "outside the ±30 s window")
    assert (server.stats.stale, server.stats.replays) == (1, 0)
    clock.skew = 0.0
    assert_serving(server)


def test_a_captured_read_cannot_be_replayed_either(server: BootstrapServer, client: BootstrapClient) -> None:
    client.register(reg(0), soon())
    relay = Relay(server.port)
    assert BootstrapClient("127.0.0.1", relay.port, secret=SECRET).rank(0, 0, soon()) is not None
    relay.join()
    assert_refused(raw(server.port, relay.sent[0]), "replayed")


def test_stale_timestamp_is_refused_and_the_client_says_so(server: BootstrapServer, clock: Clock) -> None:
    client = BootstrapClient("127.0.0.1", server.port, secret=SECRET, rng=NoBackoff())
    clock.skew = -45.0  # the server's clock is 45 s behind this client's
    with pytest.raises(AuthenticationError, match=r"\(401\): timestamp \+4\d\.\d s from the server's clock, outside"):
        client.register(reg(0), soon())
    clock.skew = 0.0
    assert_refused(raw(server.port, signed("GET", "/v1/parallel", now=time.time() - 61)), "outside the ±30 s window")
    assert server.stats.stale == 2 and server.stats.authenticated == 0
    assert client.register(reg(0), soon()) == "created"


def test_wrong_secret_client_raises_naming_the_server(server: BootstrapServer) -> None:
    wrong = BootstrapClient("127.0.0.1", server.port, secret=OTHER, rng=NoBackoff())
    for call in (lambda d: wrong.register(reg(0), d), wrong.parallel_info, lambda d: wrong.rank(0, 0, d)):
        with pytest.raises(AuthenticationError) as info:
            call(soon())
        text = str(info.value)
        assert text.startswith(f"authentication failed: bootstrap server 127.0.0.1:{server.port} refused ")
        assert "bad signature: is the secret the same on both sides?" in text
    assert server.stats.bad_signatures == 3
    assert_serving(server)


def test_client_without_a_secret_is_refused(server: BootstrapServer) -> None:
    bare = BootstrapClient("127.0.0.1", server.port, rng=NoBackoff())
    assert bare.health(soon())  # /health stays open
    for call in (lambda d: bare.register(reg(0), d), bare.parallel_info, lambda d: bare.rank(0, 0, d)):
        with pytest.raises(AuthenticationError, match=rf"^authentication failed: bootstrap server 127\.0\.0\.1:{server.port} .*this client has no secret"):
            call(soon())
    assert server.stats.auth_failures == 3


def test_server_without_a_secret_fails_a_client_with_one() -> None:
    with BootstrapServer("127.0.0.1", 0) as plain:
        client = BootstrapClient("127.0.0.1", plain.port, secret=SECRET, rng=NoBackoff())
        assert client.health(soon())  # /health is never signed
        for call in (lambda d: client.register(reg(0), d), client.parallel_info, lambda d: client.rank(0, 0, d)):
            with pytest.raises(AuthenticationError, match=rf"^authentication failed: bootstrap server 127\.0\.0\.1:{plain.port} answered .* no signature"):
                call(soon())


def test_a_forged_or_swapped_answer_fails_the_client(server: BootstrapServer, client: BootstrapClient) -> None:
    client.register(reg(0), soon())

    def redirect(answer: bytes) -> bytes:  # someone in between points the sink at their own endpoint
        forged = answer.replace(b"tcp://127.0.0.1:7000", b"tcp://10.66.6.6:7000")
        assert forged != answer
        return forged

    relay = Relay(server.port, rewrite=redirect)
    with pytest.raises(AuthenticationError, match="wrong signature"):
        BootstrapClient("127.0.0.1", relay.port, secret=SECRET).rank(0, 0, soon())
    relay.join()


def test_reads_and_unknown_routes_need_the_secret_health_does_not(server: BootstrapServer, client: BootstrapClient) -> None:
    client.register(reg(0), soon())
    for method, path in (("GET", "/v1/parallel"), ("GET", "/v1/ranks/0/0"), ("GET", "/v1/ranks/9/9"),
                         ("GET", "/nope"), ("POST", "/v1/ranks"), ("DELETE", "/v1/ranks/0/0")):  # fmt: skip
        assert_refused(raw(server.port, request_bytes(method, path)), "no Authorization header")
    status, headers, payload = parse(raw(server.port, request_bytes("GET", "/health")))
    assert (status, payload) == (200, {"status": "ok"}) and RESPONSE_MAC_HEADER not in headers
    assert server.stats.auth_failures == 6
    # signed, the routes answer as before, and the answer is signed with the request's nonce
    nonce = "ab" * 16
    header = sign_request(KEY, "GET", "/v1/ranks/9/9", b"", now=time.time(), nonce=nonce)
    answer = raw(server.port, request_bytes("GET", "/v1/ranks/9/9", auth=header))
    status, headers, payload = parse(answer)
    assert status == 404 and headers[RESPONSE_MAC_HEADER] == sign_response(KEY, nonce, 404, answer.partition(b"\r\n\r\n")[2])


@pytest.mark.parametrize(
    "header",
    [
        "",
        "Bearer x",
        "PDCORE-HMAC-SHA256 t=1,n=00,s=00",
        "PDCORE-HMAC-SHA256  t=1,n=" + "0" * 32 + ",s=" + "0" * 64,
        "PDCORE-HMAC-SHA256 t=01,n=" + "0" * 32 + ",s=" + "0" * 64,
        "PDCORE-HMAC-SHA256 n=" + "0" * 32 + ",t=1,s=" + "0" * 64,
        "PDCORE-HMAC-SHA256 t=1,n=" + "A" * 32 + ",s=" + "0" * 64,
        "pdcore-hmac-sha256 t=1,n=" + "0" * 32 + ",s=" + "0" * 64,
    ],
)
def test_malformed_authorization_is_401(server: BootstrapServer, header: str) -> None:
    assert_refused(raw(server.port, request_bytes("GET", "/v1/parallel", auth=header)), "malformed Authorization header")
    assert_serving(server)


def test_two_authorization_headers_are_401(server: BootstrapServer) -> None:
    one = sign_request(KEY, "GET", "/v1/parallel", b"", now=time.time(), nonce="cd" * 16)
    data = request_bytes("GET", "/v1/parallel", auth=one).replace(b"\r\n\r\n", f"\r\n{AUTH_HEADER}: {one}\r\n\r\n".encode())
    assert_refused(raw(server.port, data), "2 Authorization headers")


def test_a_tampered_body_or_path_is_a_bad_signature(server: BootstrapServer, client: BootstrapClient) -> None:
    body = msgspec.json.encode(reg(0))
    header = sign_request(KEY, "PUT", "/v1/ranks", body, now=time.time(), nonce="ef" * 16)
    evil = body.replace(b"7000", b"6666")
    assert_refused(raw(server.port, request_bytes("PUT", "/v1/ranks", evil, header)), "bad signature")
    assert_refused(raw(server.port, request_bytes("GET", "/v1/ranks/0/0", auth=header)), "bad signature")
    assert client.rank(0, 0, soon()) is None
    # refused requests never enter the nonce cache: the untampered bytes verify, once
    status, _, payload = parse(raw(server.port, request_bytes("PUT", "/v1/ranks", body, header)))
    assert (status, payload) == (200, {"result": "created"})
    assert_refused(raw(server.port, request_bytes("PUT", "/v1/ranks", body, header)), "nonce already used")
    assert (server.stats.bad_signatures, server.stats.replays, server.stats.authenticated) == (2, 1, 2)


def test_a_401_is_not_retried(server: BootstrapServer) -> None:
    backoffs = NoBackoff()
    with pytest.raises(AuthenticationError):
        BootstrapClient("127.0.0.1", server.port, secret=OTHER, rng=backoffs).register(reg(0), soon())
    assert backoffs.count == 0 and server.stats.auth_failures == 1


class NoBackoff(random.Random):
    """The client's jitter source; counts back-offs (a refused request must not be retried)."""

    def __init__(self) -> None:
        super().__init__(3)
        self.count = 0

    def uniform(self, a: float, b: float) -> float:
        self.count += 1
        return super().uniform(a, b)


def test_refusals_are_logged_once_per_source_without_secrets(
    server: BootstrapServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pdcore.bootstrap")
    sent = [signed("GET", "/v1/parallel", key=derive_key(OTHER, "bootstrap")) for _ in range(5)]
    for data in sent:
        assert_refused(raw(server.port, data), "bad signature")
    warnings = [r for r in caplog.records if r.name == "pdcore.bootstrap" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "127.0.0.1" in warnings[0].getMessage() and "bad signature" in warnings[0].getMessage()
    text = caplog.text
    for data in sent:
        mac = data.split(b",s=")[1][:64].decode()
        assert mac not in text
    assert SECRET.decode() not in text and KEY.hex() not in text
    assert server.stats.bad_signatures == 5


# --------------------------------------------------------------------------- slow clients


def test_idle_sockets_at_the_cap_do_not_keep_legit_clients_out() -> None:
    # header_timeout 30 s: only eviction can free a slot before the client's deadline (10 s)
    with BootstrapServer(
        "127.0.0.1", 0, secret=SECRET, max_connections=64, request_timeout=60.0, header_timeout=30.0
    ) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(64)]
        try:
            for i, sock in enumerate(idle):
                if i % 2:
                    sock.sendall(b"PUT /v1/ranks HTTP/1.0\r\nContent-Length: 100\r\n")  # a slow drip, or nothing
            client = BootstrapClient("127.0.0.1", srv.port, secret=SECRET)
            deadline = Deadline.after(10.0)  # well inside request_timeout (60 s) and header_timeout (30 s)
            assert client.register(reg(0), deadline) == "created"
            rank = client.rank(0, 0, deadline)
            assert rank is not None and rank.endpoint == "tcp://127.0.0.1:7000"
            assert srv.stats.evicted >= 1 and srv.stats.busy == 0  # the look-up may reuse the slot the PUT freed
            assert idle[0].recv(1) == b""  # the oldest was cut, and never answered
        finally:
            for sock in idle:
                sock.close()
        assert_serving(srv)


def test_request_head_has_its_own_short_deadline() -> None:
    with BootstrapServer("127.0.0.1", 0, secret=SECRET, request_timeout=60.0, header_timeout=0.3) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(b"GET /v1/parallel HTTP/1.0\r\nHost: x\r\n")  # ... and the rest never comes
            started = time.monotonic()
            assert sock.recv(1) == b""  # cut at the head deadline, not the request deadline
            assert time.monotonic() - started < 30.0
        assert_serving(srv)


# --------------------------------------------------------------------------- the pure verifier


def test_verify_request_window_edges_and_order() -> None:
    now = 1_700_000_000.0
    nonces = NonceCache()

    def check(t: float, nonce: str, at: float = now) -> str:
        header = sign_request(KEY, "GET", "/v1/parallel", b"", now=t, nonce=nonce)
        return verify_request(KEY, "GET", "/v1/parallel", b"", header, at, nonces, window=30.0)

    assert check(now - 30.0, "01" * 16) == "01" * 16  # the edges are inside
    assert check(now + 30.0, "02" * 16) == "02" * 16
    for t in (now - 30.001, now + 30.001):
        with pytest.raises(RequestAuthError) as info:
            check(t, "03" * 16)
        assert info.value.kind == "window"
    with pytest.raises(RequestAuthError) as info:
        check(now, "01" * 16)
    assert info.value.kind == "replay"
    assert len(nonces) == 2  # refused requests never enter the cache
    # once the first nonce's timestamp leaves the window its timestamp is refused, and a verified request forgets it
    with pytest.raises(RequestAuthError) as info:
        check(now - 30.0, "01" * 16, at=now + 0.5)
    assert info.value.kind == "window"
    check(now + 0.5, "04" * 16, at=now + 0.5)
    assert "01" * 16 not in nonces and "02" * 16 in nonces and len(nonces) == 2
    # if the clock then steps back, the forgotten nonce is still refused (the floor rose when it expired)
    with pytest.raises(RequestAuthError) as info:
        check(now - 30.0, "01" * 16, at=now)
    assert info.value.kind == "replay"


def test_verify_request_checks_each_signed_part() -> None:
    now, nonce = 1_700_000_000.0, "9a" * 16
    body = b'{"x":1}'
    header = sign_request(KEY, "PUT", "/v1/ranks", body, now=now, nonce=nonce)
    tampered = [
        ("GET", "/v1/ranks", body, header),
        ("PUT", "/v1/ranks/", body, header),
        ("PUT", "/v1/ranks", body + b" ", header),
        ("PUT", "/v1/ranks", body, header.replace("t=", "t=1")),
        ("PUT", "/v1/ranks", body, header.replace(f"n={nonce}", "n=" + "9b" * 16)),
    ]
    for method, path, b, h in tampered:
        with pytest.raises(RequestAuthError) as info:
            verify_request(KEY, method, path, b, h, now, NonceCache())
        assert info.value.kind in ("signature", "malformed")
    with pytest.raises(RequestAuthError) as info:
        verify_request(derive_key(OTHER, "bootstrap"), "PUT", "/v1/ranks", body, header, now, NonceCache())
    assert info.value.kind == "signature"
    with pytest.raises(RequestAuthError) as info:
        verify_request(KEY, "PUT", "/v1/ranks", body, None, now, NonceCache())
    assert info.value.kind == "missing"
    with pytest.raises(RequestAuthError) as info:
        verify_request(KEY, "PUT", "/v1/ranks\u0100", body, header, now, NonceCache())
    assert info.value.kind == "malformed"
    assert verify_request(KEY, "PUT", "/v1/ranks", body, header, now, NonceCache()) == nonce


def test_nonce_cache_at_its_bound_raises_a_floor_never_forgets() -> None:
    now = 1_700_000_000.0
    nonces = NonceCache(capacity=3)

    def check(t: float, nonce: str) -> None:
        header = sign_request(KEY, "GET", "/health", b"", now=t, nonce=nonce)
        verify_request(KEY, "GET", "/health", b"", header, now, nonces)

    for i in range(3):
        check(now - 10 + i, f"{i:032x}")
    check(now, f"{3:032x}")  # the cache is full: the oldest (t = now - 10) is dropped, the floor rises to it
    assert len(nonces) == 3 and nonces.dropped == 1 and nonces.floor_ms == round((now - 10) * 1000)
    with pytest.raises(RequestAuthError) as info:
        check(now - 10, f"{0:032x}")  # the dropped one, replayed: refused by the floor
    assert info.value.kind == "replay" and "floor" in str(info.value)
    with pytest.raises(RequestAuthError) as info:
        check(now - 10, f"{9:032x}")  # any request stamped at the floor
    assert info.value.kind == "replay"
    check(now - 9 + 0.5, f"{10:032x}")  # above the floor and new: fine
    with pytest.raises(ValueError):
        NonceCache(capacity=0)


def test_secrets_are_checked_at_construction() -> None:
    with pytest.raises(StartError, match="bootstrap server: the secret option has 3 bytes"):
        BootstrapServer(secret=b"abc")
    with pytest.raises(StartError, match="the secret option must be bytes"):
        BootstrapClient("127.0.0.1", 1, secret="text")  # type: ignore[arg-type]


def test_unauthenticated_server_warns_at_start() -> None:
    with mock.patch("pdcore.control.bootstrap_server.auth.warn_unauthenticated") as warn:
        server = BootstrapServer("127.0.0.1", 0)
        warn.assert_not_called()  # at start, not at construction
        with server:
            warn.assert_called_once_with("bootstrap server")
        with BootstrapServer("127.0.0.1", 0, secret=SECRET) as srv:
            assert srv.authenticated
        warn.assert_called_once()


# --------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("via", ["option", "env"])
@pytest.mark.parametrize("content", [None, b"short\n"], ids=["missing", "too-short"])
def test_cli_bad_secret_file_is_one_line_naming_it(tmp_path: Path, via: str, content: bytes | None) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    args, env = (("--secret-file", str(path)), None) if via == "option" else ((), {"PDCORE_SECRET_FILE": str(path)})
    proc = run_cli(tmp_path, *args, env=env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, err
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "error: " in lines[0] and f"secret file '{path}'" in lines[0], err
    assert b"Traceback" not in err and b"short" not in err and out == b""


@pytest.mark.parametrize("via", ["option", "env"])
def test_cli_serves_with_the_secret(tmp_path: Path, via: str) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    args, env = (("--secret-file", str(path)), None) if via == "option" else ((), {"PDCORE_SECRET_FILE": str(path)})
    with cli_server(tmp_path, *args, env=env) as port:
        assert BootstrapClient("127.0.0.1", port, secret=SECRET).register(reg(0), soon()) == "created"
        with pytest.raises(AuthenticationError):
            BootstrapClient("127.0.0.1", port).rank(0, 0, soon())
