"""Bootstrap server over real HTTP on loopback, its client, and its pure validators."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import pytest

from pdcore.control import bootstrap_server
from pdcore.control.bootstrap import (MAX_BODY_BYTES, BootstrapClient, BootstrapServer, RankRegistration, Registry,
                                      parse_parallel_info, parse_rank_info, parse_rank_path, parse_registration)
from pdcore.core.deadline import Deadline, DeadlineExceeded
from pdcore.core.errors import LocalProtocolError, RemoteProtocolError, StartError

LAYOUT = {"page_size": 16, "fields": [{"name": "k", "shape": [8, 128]}]}


def reg(tp_rank: int = 0, dp_rank: int = 0, **kw: Any) -> RankRegistration:
    base: dict[str, Any] = dict(
        session_id=f"p-{dp_rank}-{tp_rank}",
        epoch=1,
        endpoint=f"tcp://127.0.0.1:{7000 + 10 * dp_rank + tp_rank}",
        tp_size=2,
        dp_size=1,
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        layout=LAYOUT,
        transport=f"{dp_rank:02x}{tp_rank:02x}" * 8,
    )
    base.update(kw)
    return RankRegistration(**base)


def soon(seconds: float = 5.0) -> Deadline:
    return Deadline.after(seconds)


def served(srv: BootstrapServer) -> Iterator[BootstrapServer]:
    """A fixture's server: started, then closed, with no server thread left behind."""
    srv.start()
    yield srv
    srv.close(soon())
    assert not any(t.name.startswith("pdcore-bootstrap") for t in threading.enumerate())


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    yield from served(BootstrapServer("127.0.0.1", 0, max_body=64 * 1024, request_timeout=2.0))


@pytest.fixture
def client(server: BootstrapServer) -> BootstrapClient:
    return BootstrapClient("127.0.0.1", server.port)


def raw(port: int, data: bytes, *, shut: bool = True) -> bytes:
    """Send bytes on a fresh connection and read the whole answer (bounded by a timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_and_json(answer: bytes) -> tuple[int, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else None


def put(port: int, body: bytes, *, headers: str | None = None) -> tuple[int, Any]:
    headers = headers if headers is not None else f"Content-Length: {len(body)}\r\n"
    return status_and_json(raw(port, b"PUT /v1/ranks HTTP/1.1\r\nHost: x\r\n" + headers.encode() + b"\r\n" + body))


# --------------------------------------------------------------------------- over HTTP


def test_register_lookup_health(client: BootstrapClient) -> None:
    assert client.health(soon())
    assert client.parallel_info(soon()) is None  # nothing registered yet
    assert client.rank(0, 0, soon()) is None
    assert client.register(reg(0), soon()) == "created"
    info = client.parallel_info(soon())
    assert info is not None and (info.tp_sizes, info.dp_size, info.registered, info.complete) == ((2,), 1, 1, False)
    assert info.layout == LAYOUT
    assert client.register(reg(1), soon()) == "created"
    info = client.parallel_info(soon())
    assert info is not None and info.complete and info.registered == 2
    rank = client.rank(0, 1, soon())
    assert rank is not None
    assert (rank.endpoint, rank.session_id, rank.epoch) == ("tcp://127.0.0.1:7001", "p-0-1", 1)


def test_idempotent_and_epochs(client: BootstrapClient) -> None:
    assert client.register(reg(0), soon()) == "created"
    assert client.register(reg(0), soon()) == "unchanged"
    with pytest.raises(LocalProtocolError, match="409.*endpoint"):
        client.register(reg(0, endpoint="tcp://127.0.0.1:9999"), soon())
    assert client.register(reg(0, epoch=2, endpoint="tcp://127.0.0.1:9999"), soon()) == "replaced"
    with pytest.raises(LocalProtocolError, match="409.*epoch"):
        client.register(reg(0, epoch=1), soon())
    rank = client.rank(0, 0, soon())
    assert rank is not None and (rank.epoch, rank.endpoint) == (2, "tcp://127.0.0.1:9999")


@pytest.mark.parametrize(
    ("second", "field"),
    [
        (dict(tp_size=4), "tp_size"),
        (dict(dp_size=2), "dp_size"),
        (dict(layout={"page_size": 32}), "layout"),
        (dict(endpoint="tcp://127.0.0.1:7000"), "endpoint"),
        (dict(session_id="p-0-0"), "session_id"),
    ],
)
def test_conflicts_are_409(server: BootstrapServer, client: BootstrapClient, second: dict[str, Any], field: str) -> None:
    client.register(reg(0), soon())
    body = msgspec.json.encode(reg(1, **second))
    status, payload = put(server.port, body)
    assert status == 409 and field in payload["error"]
    assert client.rank(0, 1, soon()) is None  # nothing was stored


def test_unknown_rank_404_and_bad_path_400(server: BootstrapServer, client: BootstrapClient) -> None:
    client.register(reg(0), soon())
    for path in (b"/v1/ranks/0/1", b"/v1/ranks/3/0"):
        status, payload = status_and_json(raw(server.port, b"GET " + path + b" HTTP/1.0\r\n\r\n"))
        assert status == 404 and "no rank" in payload["error"]
    for path, field in ((b"/v1/ranks/x/0", "dp_rank"), (b"/v1/ranks/0/01", "tp_rank"), (b"/v1/ranks/0/-1", "tp_rank")):
        status, payload = status_and_json(raw(server.port, b"GET " + path + b" HTTP/1.0\r\n\r\n"))
        assert status == 400 and field in payload["error"]
    status, _ = status_and_json(raw(server.port, b"GET /nope HTTP/1.0\r\n\r\n"))
    assert status == 404
    status, payload = status_and_json(raw(server.port, b"POST /v1/ranks HTTP/1.0\r\nContent-Length: 0\r\n\r\n"))
    assert status == 405 and "PUT" in payload["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"", "not JSON"),
        (b"{", "not JSON"),
        (b"[]", "Expected `object`"),
        (msgspec.json.encode({**msgspec.to_builtins(reg(0)), "tp_rank": 2}), "tp_rank"),
        (msgspec.json.encode({**msgspec.to_builtins(reg(0)), "dp_rank": 1}), "dp_rank"),
        (msgspec.json.encode({**msgspec.to_builtins(reg(0)), "tp_size": 0}), "$.tp_size"),
        (msgspec.json.encode({**msgspec.to_builtins(reg(0)), "epoch": -1}), "$.epoch"),
        (msgspec.json.encode({**msgspec.to_builtins(reg(0)), "endpoint": "10.0.0.1:5"}), "endpoint"),
        (msgspec.json.encode({**msgspec.to_builtins(reg(0)), "layout": [1]}), "$.layout"),
        (msgspec.json.encode({**msgspec.to_builtins(reg(0)), "bogus": 1}), "`bogus`"),
        (msgspec.json.encode({k: v for k, v in msgspec.to_builtins(reg(0)).items() if k != "session_id"}), "session_id"),
    ],
)
def test_malformed_is_400_naming_the_field(server: BootstrapServer, body: bytes, field: str) -> None:
    status, payload = put(server.port, body)
    assert status == 400 and field in payload["error"]


def test_length_rules(server: BootstrapServer) -> None:
    status, payload = put(server.port, b"{}", headers="")
    assert status == 411 and "Content-Length" in payload["error"]
    status, payload = put(server.port, b"", headers="Content-Length: 999999999\r\n")
    assert status == 413 and "Content-Length" in payload["error"]
    big = b" " * (64 * 1024 + 1)
    status, payload = put(server.port, big)
    assert status == 413
    status, payload = put(server.port, b"{}", headers="Content-Length: 1e3\r\n")
    assert status == 400 and "Content-Length" in payload["error"]
    status, payload = put(server.port, b"{}", headers="Content-Length: 10\r\n")  # body shorter than promised
    assert status == 400 and "body" in payload["error"]
    status, payload = put(server.port, b"{}", headers="Transfer-Encoding: chunked\r\n")
    assert status == 400


@pytest.mark.parametrize(
    "garbage",
    [b"\x00\xff\xfe garbage \r\n\r\n", b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"A" * 70000 + b"\r\n\r\n", b"\r\n"],
    ids=["binary", "no-path", "bad-version", "long-line", "blank"],
)
def test_garbage_then_next_request_served(server: BootstrapServer, client: BootstrapClient, garbage: bytes) -> None:
    answer = raw(server.port, garbage)
    if answer:  # a blank line is just a closed connection
        status, payload = status_and_json(answer)
        assert status in (400, 414, 431, 505) and payload["error"]
    assert client.health(soon())


def test_silent_client_is_cut_by_close() -> None:
    srv = BootstrapServer("127.0.0.1", 0, request_timeout=60.0)
    port = srv.start()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"PUT /v1/ranks HTTP/1.0\r\n")  # ... and then nothing
        BootstrapClient("127.0.0.1", port).health(soon())  # the server is not stuck behind it
        srv.close(soon(3.0))
    assert not any(t.name.startswith("pdcore-bootstrap") for t in threading.enumerate())
    srv.close(soon())  # idempotent


def test_connection_cap_answers_503() -> None:
    with held_at_cap() as (srv, hog, release):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as late:
            answer = late.recv(4096)  # answered at accept, before any request byte
        assert answer.startswith(b"HTTP/1.0 503 ")
        free_the_slot(hog, release)
        assert BootstrapClient("127.0.0.1", srv.port).health(soon())  # the slot was given back
        assert srv.stats.busy >= 2 and srv.stats.evicted == 0  # the probe and `late`; nobody was cut


def test_an_idle_connection_at_the_cap_is_evicted_not_the_newcomer() -> None:
    with BootstrapServer("127.0.0.1", 0, max_connections=1, request_timeout=60.0, header_timeout=60.0) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as idle:
            idle.sendall(b"PUT /v1/ranks HTTP/1.0\r\n")  # holds the only slot, still sending its request
            assert BootstrapClient("127.0.0.1", srv.port).health(soon())  # it took the idle one's slot
            assert idle.recv(4096) == b""  # cut, and never answered
        assert srv.stats.evicted == 1 and srv.stats.busy == 0


def test_request_deadline_on_server() -> None:
    with BootstrapServer("127.0.0.1", 0, request_timeout=0.3) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            sock.sendall(b"PUT /v1/ranks HTTP/1.0\r\nContent-Length: 10\r\n\r\n{")  # then a stall
            assert sock.recv(1) == b""  # the request deadline closed it; nothing was registered
        assert BootstrapClient("127.0.0.1", srv.port).health(soon())


def test_client_deadline_against_a_silent_server() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = BootstrapClient("127.0.0.1", port)
        with pytest.raises(DeadlineExceeded):
            client.health(Deadline.after(0.2))  # accepted by the backlog, never answered
        with pytest.raises(DeadlineExceeded):
            client.health(Deadline.after(0))


def test_client_unreachable_raises_oserror() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
    backoffs = Backoffs()
    deadline = Deadline.after(0.3)
    with pytest.raises(OSError, match="busy or down .connections refused or reset"):  # DeadlineExceeded is one
        BootstrapClient("127.0.0.1", port, rng=backoffs).health(deadline)
    assert deadline.expired() and backoffs.count >= 2  # retried, and gave up only at the deadline


class Backoffs(random.Random):
    """The client's jitter source, seeded, that tells the test every time the client backs off."""

    def __init__(self) -> None:
        super().__init__(7)
        self.count = 0
        self.backed_off = threading.Event()

    def uniform(self, a: float, b: float) -> float:
        self.count += 1
        self.backed_off.set()
        return super().uniform(a, b)


@contextlib.contextmanager
def held_at_cap() -> Iterator[tuple[BootstrapServer, socket.socket, threading.Event]]:
    """A real server with one connection slot, held until the test sets the event.

    The hog's whole request is in (an idle or half-sent one would be evicted to
    make room): its handler is held just after it starts handling, so the cap
    is full of connections past their request and a newcomer gets 503 busy.
    """
    entered, release = threading.Event(), threading.Event()
    begin_handling = bootstrap_server._Server.begin_handling

    def held(server: Any, conn: Any) -> bool:
        ok = begin_handling(server, conn)
        if not entered.is_set():
            entered.set()
            release.wait(30.0)
        return ok

    with mock.patch.object(bootstrap_server._Server, "begin_handling", held):
        with BootstrapServer("127.0.0.1", 0, max_connections=1, request_timeout=60.0) as srv:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as hog:
                try:
                    hog.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                    assert entered.wait(5.0)  # its handler holds the slot, past its request
                    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as probe:
                        assert probe.recv(4096).startswith(b"HTTP/1.0 503 ")
                    yield srv, hog, release
                finally:
                    release.set()


def free_the_slot(hog: socket.socket, release: threading.Event) -> None:
    release.set()
    assert b" 200 " in b"".join(iter(lambda: hog.recv(4096), b""))  # to EOF: its handler gave the slot back


def test_a_busy_server_is_retried_until_the_cap_frees() -> None:
    with held_at_cap() as (srv, hog, release):
        backoffs = Backoffs()
        client = BootstrapClient("127.0.0.1", srv.port, rng=backoffs)
        outcome: queue.Queue[object] = queue.Queue()

        def register() -> None:
            try:
                outcome.put(client.register(reg(0), soon(10.0)))
            except Exception as e:
                outcome.put(e)

        thread = threading.Thread(target=register, daemon=True)
        thread.start()
        assert backoffs.backed_off.wait(5.0)  # it was turned away at least once ...
        assert outcome.empty()  # ... and did not give up
        free_the_slot(hog, release)
        assert outcome.get(timeout=10.0) == "created"
        thread.join(5.0)
        assert not thread.is_alive()
        rank = client.rank(0, 0, soon())
        assert rank is not None and rank.session_id == "p-0-0"


def test_a_server_busy_past_the_deadline_is_a_clear_error_at_the_deadline() -> None:
    with held_at_cap() as (srv, hog, release):
        backoffs = Backoffs()
        client = BootstrapClient("127.0.0.1", srv.port, rng=backoffs)
        deadline = Deadline.after(0.5)
        with pytest.raises(DeadlineExceeded, match=r"PUT /v1/ranks: server 127.0.0.1:\d+ was busy \(503: at its connection cap\) until the deadline"):
            client.register(reg(0), deadline)
        assert deadline.expired()  # not before it
        assert backoffs.count >= 2
        free_the_slot(hog, release)
        assert client.rank(0, 0, soon()) is None  # nothing was registered


def test_no_rank_yet_503_is_an_answer_not_a_busy_server(client: BootstrapClient, server: BootstrapServer) -> None:
    backoffs = Backoffs()
    quick = BootstrapClient("127.0.0.1", server.port, rng=backoffs)
    assert quick.parallel_info(soon()) is None
    assert backoffs.count == 0


@contextlib.contextmanager
def canned_server(*answers: bytes) -> Iterator[int]:
    """The port of a fake server that reads each of its next connections' request and answers it with
    the next of ``answers`` (raw bytes, whatever was asked); on exit it must have given them all."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve() -> None:
            for answer in answers:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(answer)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        yield listener.getsockname()[1]
        thread.join(5)
        assert not thread.is_alive()


def test_client_rejects_a_bad_answer() -> None:
    answers = [
        b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\n{bad}",
        b"HTTP/1.0 200 OK\r\nContent-Length: 17\r\n\r\n{\"tp_size\": true}",
        b"NOT HTTP\r\n\r\n",
    ]
    with canned_server(*answers) as port:
        client = BootstrapClient("127.0.0.1", port)
        for _ in answers:
            with pytest.raises(RemoteProtocolError):
                client.parallel_info(soon())


def test_start_errors() -> None:
    with BootstrapServer("127.0.0.1", 0) as first:
        with pytest.raises(StartError, match="cannot bind"):
            BootstrapServer("127.0.0.1", first.port).start()
        with pytest.raises(StartError):
            first.start()


def test_close_makes_port_reusable() -> None:
    srv = BootstrapServer("127.0.0.1", 0)
    port = srv.start()
    srv.close(soon())
    again = BootstrapServer("127.0.0.1", port)
    assert again.start() == port
    again.close(soon())


def run_cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m pdcore bootstrap`` on any port (``$PDCORE_SECRET_FILE`` only if ``env`` sets it)."""
    repo = Path(__file__).resolve().parents[1]
    full_env = {k: v for k, v in os.environ.items() if k != "PDCORE_SECRET_FILE"}
    full_env.update({"PYTHONPATH": str(repo), **(env or {})})
    return subprocess.Popen(
        [sys.executable, "-m", "pdcore", "bootstrap", "--host", "127.0.0.1", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env, cwd=tmp_path,
    )  # fmt: skip


@contextlib.contextmanager
def cli_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[int]:
    """The CLI server's port; on exit it must stop cleanly on SIGTERM."""
    proc = run_cli(tmp_path, *args, env=env)
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=20), "the CLI did not print its port"
        line = proc.stdout.readline().decode()
        assert "listening on 127.0.0.1:" in line, line
        yield int(line.rsplit(":", 1)[1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_cli_serves_until_sigterm(tmp_path: Path) -> None:
    with cli_server(tmp_path) as port:
        assert BootstrapClient("127.0.0.1", port).health(soon())


# --------------------------------------------------------------------------- pure validators


def test_registry_rules() -> None:
    r = Registry()
    assert r.parallel_info() is None
    assert r.register(reg(0, tp_size=1)) == "created"
    # the only rank may come back with another shape under a newer epoch
    assert r.register(reg(0, tp_size=2, epoch=2)) == "replaced"
    assert r.register(reg(1, epoch=7)) == "created"
    with pytest.raises(RemoteProtocolError, match="tp_size"):
        r.register(reg(1, tp_size=4, epoch=8))
    info = r.parallel_info()
    assert info is not None and info.complete
    assert r.lookup(0, 1) is not None and r.lookup(1, 0) is None


def test_dp_groups_may_have_their_own_tp_size() -> None:
    """DP attention with a tp size per group: ranks of one group agree on it, groups may differ; with a KV
    layout the groups' page sizes follow from their tp sizes, everything else in the layout must match."""
    kv = {"order": "hnd", "kv_heads": 4, "head_bytes": 8, "page_tokens": 4, "layers": 1}
    r = Registry()
    assert r.register(reg(0, tp_size=2, dp_size=2, dp_rank=0, layout={"page_bytes": [64], "kv": kv})) == "created"
    assert r.register(reg(0, tp_size=4, dp_size=2, dp_rank=1, layout={"page_bytes": [32], "kv": kv})) == "created"
    with pytest.raises(RemoteProtocolError, match="tp_size"):
        r.register(reg(1, tp_size=2, dp_size=2, dp_rank=1, layout={"page_bytes": [32], "kv": kv}))
    with pytest.raises(RemoteProtocolError, match="layout"):
        r.register(reg(1, tp_size=4, dp_size=2, dp_rank=1, layout={"page_bytes": [32], "kv": {**kv, "kv_heads": 8}}))
    opaque = Registry()
    opaque.register(reg(0, dp_size=2, dp_rank=0, layout={"page_bytes": [64]}))
    with pytest.raises(RemoteProtocolError, match="layout"):  # opaque pages: the sizes must match across groups
        opaque.register(reg(0, tp_size=4, dp_size=2, dp_rank=1, layout={"page_bytes": [32]}))
    info = r.parallel_info()
    assert info is not None and info.tp_sizes == (2, 4) and not info.complete
    r.register(reg(1, tp_size=2, dp_size=2, dp_rank=0, layout={"page_bytes": [64], "kv": kv}))
    for t in (1, 2, 3):
        r.register(reg(t, tp_size=4, dp_size=2, dp_rank=1, layout={"page_bytes": [32], "kv": kv}))
    info = r.parallel_info()
    assert info is not None and info.complete and info.registered == 6 and info.tp_size(1) == 4


def test_layout_compared_canonically() -> None:
    r = Registry()
    r.register(reg(0, layout={"a": 1, "b": [1, 2]}))
    assert r.register(reg(1, layout={"b": [1, 2], "a": 1})) == "created"  # key order does not matter
    with pytest.raises(RemoteProtocolError, match="layout"):
        r.register(reg(1, layout={"b": [1, 2], "a": 1.0}, epoch=2))  # 1 is not 1.0


def test_parse_rank_path() -> None:
    assert parse_rank_path("/v1/ranks/0/3") == (0, 3)
    assert parse_rank_path("/v1/ranks") is None
    assert parse_rank_path("/v1/ranks/0/1/2") is None
    for bad, field in (("/v1/ranks/00/1", "dp_rank"), ("/v1/ranks/1/1024", "tp_rank"), ("/v1/ranks/٣/1", "dp_rank")):
        with pytest.raises(RemoteProtocolError, match=field):
            parse_rank_path(bad)


def test_parse_responses() -> None:
    good = b'{"tp_sizes":[2],"dp_size":1,"layout":{},"registered":1,"complete":false}'
    assert parse_parallel_info(good).registered == 1
    with pytest.raises(RemoteProtocolError, match="complete"):
        parse_parallel_info(good.replace(b"false", b"true"))
    with pytest.raises(RemoteProtocolError, match="registered"):
        parse_parallel_info(good.replace(b'"registered":1', b'"registered":3'))
    with pytest.raises(RemoteProtocolError, match="tp_sizes"):
        parse_parallel_info(good.replace(b'"tp_sizes":[2]', b'"tp_sizes":[2,2]'))
    rank = b'{"dp_rank":0,"tp_rank":1,"endpoint":"tcp://[::1]:5","session_id":"s","epoch":0,"transport":"00000000000000000000000000000000"}'
    assert parse_rank_info(rank).endpoint == "tcp://[::1]:5"
    with pytest.raises(RemoteProtocolError, match="endpoint"):
        parse_rank_info(rank.replace(b"tcp://[::1]:5", b"tcp://::1:5"))


def test_deep_json_is_a_protocol_error() -> None:
    with pytest.raises(RemoteProtocolError):
        parse_registration(b'{"layout":' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def test_body_cap_constant() -> None:
    assert MAX_BODY_BYTES == 1 << 20


@pytest.mark.parametrize(
    "args, named",
    [(["--port", "99999"], "--port"), (["--request-timeout", "-1"], "--request-timeout"),
     (["--max-body", "0"], "--max-body"), (["--port", "x"], "--port")],
)  # fmt: skip
def test_cli_refuses_a_bad_option_in_one_line(tmp_path: Path, args: list[str], named: str) -> None:
    proc = run_cli(tmp_path, *args)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    last = err.decode().strip().splitlines()[-1]
    assert named in last and "Traceback" not in err.decode()


def test_cli_serves_metrics_when_asked(tmp_path: Path) -> None:
    import urllib.request

    with cli_server(tmp_path, "--metrics") as port:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    assert "pdcore_bootstrap_ranks 0.0" in text and "pdcore_bootstrap_busy_total" in text


def test_a_mixed_layout_is_refused_naming_the_field_and_both_values() -> None:
    kv = {"order": "hnd", "kv_heads": 4, "head_bytes": 8, "page_tokens": 4, "layers": 1}
    r = Registry()
    r.register(reg(0, tp_size=2, layout={"page_bytes": [64], "kv": kv}))
    with pytest.raises(RemoteProtocolError) as e:
        r.register(reg(1, tp_size=2, layout={"page_bytes": [64], "kv": {**kv, "order": "nhd"}}))
    assert "registration.layout.kv.order: 'nhd' differs from 'hnd'" in str(e.value), e.value
    with pytest.raises(RemoteProtocolError) as e:  # opaque pages of another size
        r.register(reg(1, tp_size=2, layout={"page_bytes": [32], "kv": kv}))
    assert "registration.layout.page_bytes[0]: 32 differs from 64" in str(e.value), e.value
    with pytest.raises(RemoteProtocolError) as e:  # a key one side lacks
        r.register(reg(1, tp_size=2, layout={"page_bytes": [64]}))
    assert "registration.layout.kv: (absent) differs from {" in str(e.value), e.value


# --------------------------------------------------------------------------- layouts checked by type

KV = {"order": "hnd", "kv_heads": 4, "head_bytes": 8, "page_tokens": 4, "layers": 1}
PREFILL_LAYOUT = {"page_bytes": [64, 64], "num_pages": 8, "kv": KV}  # what a prefill rank registers


def test_a_numeric_page_bytes_is_400_naming_it_and_costs_nothing(server: BootstrapServer, client: BootstrapClient) -> None:
    """The reported defect: ``"page_bytes": 4096`` was stored and served to decode ranks, whose pairing then
    raised TypeError. It is refused at the door; the server stores nothing, keeps serving, and the same
    slot registers once the rank sends what a prefill rank sends."""
    bad = reg(0, layout={"page_bytes": 4096, "num_pages": 8})
    status, payload = put(server.port, msgspec.json.encode(bad))
    assert status == 400, payload
    assert payload["error"].startswith("registration.layout.page_bytes: expected a list of 1..4096 positive ints"), payload
    assert "got int 4096" in payload["error"]
    with pytest.raises(LocalProtocolError, match=r"400 registration\.layout\.page_bytes: .* got int 4096"):
        client.register(bad, soon())  # the client's view of the same refusal
    assert server.registered_ranks == 0
    assert client.parallel_info(soon()) is None and client.rank(0, 0, soon()) is None
    assert client.health(soon())
    good = reg(0, layout={"page_bytes": [4096], "num_pages": 8})  # the same slot, epoch, session and endpoint
    assert client.register(good, soon()) == "created"
    info = client.parallel_info(soon())
    assert info is not None and info.layout == {"page_bytes": [4096], "num_pages": 8}
    rank = client.rank(0, 0, soon())
    assert rank is not None and rank.session_id == good.session_id


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ({"page_bytes": [64]}, "registration.layout.num_pages: missing beside page_bytes"),
        ({"num_pages": 8}, "registration.layout.page_bytes: missing beside num_pages"),
        ({"page_bytes": [], "num_pages": 8}, "registration.layout.page_bytes: expected"),
        ({"page_bytes": "64", "num_pages": 8}, "registration.layout.page_bytes: expected"),
        ({"page_bytes": [64] * 4097, "num_pages": 8}, "got a list of 4097"),
        ({"page_bytes": [64, True], "num_pages": 8}, "registration.layout.page_bytes[1]: expected a positive int below 2**40, got bool True"),
        ({"page_bytes": [64, 0], "num_pages": 8}, "registration.layout.page_bytes[1]: expected"),
        ({"page_bytes": [64, 1.5], "num_pages": 8}, "registration.layout.page_bytes[1]: expected"),
        ({"page_bytes": [64], "num_pages": [1]}, "registration.layout.num_pages: expected a positive int below 2**40, got list [1]"),
        ({"page_bytes": [64], "num_pages": 1 << 40}, "registration.layout.num_pages: expected"),
        ({"page_bytes": [64], "num_pages": 8.0}, "registration.layout.num_pages: expected"),
        ({**PREFILL_LAYOUT, "kv": "hnd"}, "registration.layout.kv: expected an object, got str"),
        ({**PREFILL_LAYOUT, "kv": None}, "registration.layout.kv: expected an object, got NoneType"),
        ({**PREFILL_LAYOUT, "kv": {**KV, "order": "xyz"}}, "registration.layout.kv.order: 'xyz' is not one of"),
        ({**PREFILL_LAYOUT, "kv": {**KV, "layers": True}}, "registration.layout.kv.layers: must be a positive int"),
        ({**PREFILL_LAYOUT, "kv": {**KV, "extra": 1}}, "registration.layout.kv: unknown field 'extra'"),
        ({**PREFILL_LAYOUT, "kv": {"order": "hnd"}}, "registration.layout.kv: missing field 'kv_heads'"),
        ({"role": 1}, "registration.layout.role: expected a string of 1..64 printable ASCII characters, got int 1"),
        ({"role": ""}, "registration.layout.role: expected"),
        ({"role": "x" * 65}, "registration.layout.role: expected"),
        ({"role": "en code"}, "registration.layout.role: expected"),
    ],
)
def test_a_malformed_layout_is_400_naming_the_field(
    server: BootstrapServer, client: BootstrapClient, layout: dict[str, Any], named: str
) -> None:
    status, payload = put(server.port, msgspec.json.encode(reg(0, layout=layout)))
    assert status == 400 and named in payload["error"], payload
    assert server.registered_ranks == 0 and client.rank(0, 0, soon()) is None


@pytest.mark.parametrize(
    "layout",
    [
        PREFILL_LAYOUT,
        {"page_bytes": [4096], "num_pages": 8},  # opaque pages: no KV layout
        {**PREFILL_LAYOUT, "kv": {**KV, "fused_kv": True}},
        {"role": "encode"},
        {},
        {**PREFILL_LAYOUT, "note": {"any": ["json", 1.5, None]}},  # keys no peer reads stay opaque JSON
    ],
)
def test_the_layouts_ranks_register_are_accepted(client: BootstrapClient, layout: dict[str, Any]) -> None:
    assert client.register(reg(0, layout=layout), soon()) == "created"
    info = client.parallel_info(soon())
    assert info is not None and info.layout == layout


def parallel_body(layout: Any) -> bytes:
    return msgspec.json.encode({"tp_sizes": [2], "dp_size": 1, "layout": layout, "registered": 1, "complete": False})


def test_parse_parallel_info_refuses_a_layout_a_peer_would_trip_over() -> None:
    """The shapes the simulator's garbling server lists (``pdcore/sim/cluster.py``), and more: each is a
    RemoteProtocolError naming the field at the client's door, not a TypeError in a peer's pairing later."""
    assert parse_parallel_info(parallel_body(PREFILL_LAYOUT)).layout == PREFILL_LAYOUT
    assert parse_parallel_info(parallel_body({"role": "encode"})).layout == {"role": "encode"}
    for layout, named in [
        ({**PREFILL_LAYOUT, "page_bytes": 4096}, "parallel_info.layout.page_bytes: expected a list"),
        ({**PREFILL_LAYOUT, "kv": "hnd"}, "parallel_info.layout.kv: expected an object"),
        ({**PREFILL_LAYOUT, "num_pages": [1]}, "parallel_info.layout.num_pages: expected a positive int"),
        ({"page_bytes": [64, "64"], "num_pages": 8}, "parallel_info.layout.page_bytes[1]: expected a positive int"),
        ({"page_bytes": [64]}, "parallel_info.layout.num_pages: missing"),
        ({**PREFILL_LAYOUT, "kv": {**KV, "kv_heads": 0}}, "parallel_info.layout.kv.kv_heads: must be a positive int"),
        ({"role": ["encode"]}, "parallel_info.layout.role: expected a string"),
    ]:
        with pytest.raises(RemoteProtocolError) as e:
            parse_parallel_info(parallel_body(layout))
        assert named in str(e.value), (layout, e.value)


def test_the_client_refuses_a_served_malformed_layout() -> None:
    """A server that lists a malformed layout (an older one, or a bug): ``parallel_info`` raises
    RemoteProtocolError naming the field, over real HTTP."""
    body = parallel_body({"page_bytes": 4096, "num_pages": 8})
    answer = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with canned_server(answer) as port:
        with pytest.raises(RemoteProtocolError, match=r"parallel_info\.layout\.page_bytes: .* got int 4096"):
            BootstrapClient("127.0.0.1", port).parallel_info(soon())
