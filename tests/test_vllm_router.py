"""``pdcore.vllm.router`` against two stand-in servers (no vLLM): what each copy of a request carries,
that decode's stream comes back whole, that a client going away cancels both copies (and one that
closes after its answer does not count as cancelled), and that a prefill that cannot serve a room
fails fast: decode's copy is sent again without it."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdcore.vllm.params import transfer_of
from pdcore.vllm.router import Router, prefill_body, serve

WAIT = 20.0


class _Listening(ThreadingHTTPServer):
    request_queue_size = 1024  # a burst's connections, as vLLM's server takes them (socketserver's default: 5)


class Upstream:
    """A stand-in vLLM server: records bodies; decode streams three chunks, or holds (``hold``) until
    its client (the router) goes away, which it records."""

    def __init__(self, name: str, hold: bool = False, status: int = 200, hold_rooms: bool = False) -> None:
        """``hold``: every request waits for its client to go away; ``hold_rooms``: those with a room do (a
        decode waiting for a transfer that never comes); ``status``: what the others answer."""
        self.bodies: list[dict] = []
        self.got = threading.Event()
        self.cancelled = threading.Event()
        up = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                up.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                up.got.set()
                if hold or (hold_rooms and "pdcore_room" in up.bodies[-1].get("kv_transfer_params", {})):
                    ready, _, _ = select.select([self.connection], [], [], WAIT)
                    if ready and self.connection.recv(1) == b"":
                        up.cancelled.set()
                    return
                if up.bodies[-1].get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    data = json.dumps({"who": name}).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

        self.server = _Listening(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def setup():
    made = []

    def make(hold: bool = False, prefill_status: int = 200, prefill_down: bool = False):
        prefill, decode = Upstream("prefill", status=prefill_status), Upstream("decode", hold=hold,
                                                                                hold_rooms=prefill_status != 200 or prefill_down)
        url = prefill.url
        if prefill_down:
            prefill.close()  # nothing listens there any more: connections are refused
        router = Router(url, decode.url, "10.1.2.3:8998", timeout=WAIT)
        server = serve(router, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        made.append((prefill, decode, server))
        return prefill, decode, router, server.server_address[1]

    yield make
    for prefill, decode, server in made:
        server.shutdown()
        server.server_close()
        for up in (prefill, decode):
            if up.server.socket.fileno() != -1:
                up.close()


def post(port: int, body: dict) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_both_copies_carry_one_room_and_decode_answers(setup) -> None:
    prefill, decode, _, port = setup()
    status, data = post(port, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "stream": True,
                               "kv_transfer_params": {"mine": 1, "pdcore_room": 5}})
    assert status == 200 and data == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert prefill.got.wait(WAIT)
    p, d = prefill.bodies[0], decode.bodies[0]
    assert transfer_of(p["kv_transfer_params"]) == transfer_of(d["kv_transfer_params"])
    assert transfer_of(d["kv_transfer_params"]).host == "10.1.2.3" and d["kv_transfer_params"]["mine"] == 1
    assert d["kv_transfer_params"]["pdcore_room"] != 5  # the router's room, never the client's
    assert p["max_tokens"] == 1 and "stream" not in p and d["max_tokens"] == 8 and d["stream"] is True
    status, data = post(port, {"model": "m", "prompt": [4]})
    assert json.loads(data) == {"who": "decode"}
    rooms = {b["kv_transfer_params"]["pdcore_room"] for b in decode.bodies}
    assert len(rooms) == 2  # a fresh room per request


def test_a_client_going_away_cancels_both_copies(setup) -> None:
    prefill, decode, router, port = setup(hold=True)
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    body = json.dumps({"model": "m", "prompt": [1], "max_tokens": 4}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert decode.got.wait(WAIT)
    s.close()
    assert decode.cancelled.wait(WAIT), "the router kept decode's copy after its client went away"
    assert router.stats["cancelled"] == 1


def test_bad_requests_and_addresses_are_refused_naming_them(setup) -> None:
    *_, port = setup()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    c.request("POST", "/v1/completions", body=b"[1]", headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 400 and b"JSON object" in r.read()
    c.close()
    with pytest.raises(ValueError, match="--prefill"):
        Router("localhost:1", "http://h:2", "h:3")
    with pytest.raises(ValueError, match="--bootstrap"):
        Router("http://h:1", "http://h:2", "h")
    assert prefill_body({"max_completion_tokens": 9, "n": 3}, {})["max_completion_tokens"] == 1


@pytest.mark.parametrize("how", ["down", "error"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_that_cannot_serve_the_room_fails_fast(setup, how: str, stream: bool) -> None:
    """Prefill is down (its connections refused) or answers an error: decode's copy, which would wait for a
    transfer that never comes (here: until its client goes away), is cut at once and sent again without the
    room; the client gets that one answer, whole, long before any of decode's transfer timeouts."""
    prefill, decode, router, port = setup(prefill_status=500, prefill_down=how == "down")
    status, data = post(port, {"model": "m", "prompt": [1, 2], "max_tokens": 4, "stream": stream,
                               "kv_transfer_params": {"mine": 7}})
    assert status == 200
    assert data == (b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n" if stream else json.dumps({"who": "decode"}).encode())
    *first, again = decode.bodies  # (a prefill refused at once may cut decode's first copy before it went)
    assert again["kv_transfer_params"] == {"mine": 7} and len(first) <= 1
    if first:
        assert "pdcore_room" in first[0]["kv_transfer_params"]
        assert decode.cancelled.wait(WAIT), "decode's first copy was not cut"
    assert router.stats["local"] == 1 and router.stats["prefill_errors"] == 1 and router.stats["cancelled"] == 0


def test_a_client_closing_after_its_whole_answer_is_not_a_cancellation(setup) -> None:
    """Clients close their connection once the answer is in: that is no cancellation (the router counted
    those, so its ``cancelled`` read 4-5 where 2 clients went away)."""
    _, _, router, port = setup()
    for stream in (False, True):
        for _ in range(5):
            assert post(port, {"model": "m", "prompt": [1], "stream": stream})[0] == 200
    assert router.stats["cancelled"] == 0 and router.stats["routed"] == 10


def test_a_burst_of_clients_is_served_not_reset(setup) -> None:
    """64 clients connect at once (a load run's first burst): each gets its answer (the listen backlog of
    socketserver's default, 5, reset the connections it could not hold)."""
    import concurrent.futures

    _, _, router, port = setup()
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        statuses = list(pool.map(lambda i: post(port, {"model": "m", "prompt": [i]})[0], range(64)))
    assert statuses == [200] * 64 and router.stats["routed"] == 64


def test_a_decode_server_that_cannot_be_reached_is_a_502_not_a_dropped_connection(setup) -> None:
    prefill, decode, router, port = setup()
    decode.close()  # nothing listens at decode's address any more
    status, data = post(port, {"model": "m", "prompt": [1]})
    assert status == 502 and b"decode server did not answer" in data and router.stats["decode_errors"] == 1
