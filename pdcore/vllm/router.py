"""``python -m pdcore.vllm.router``: an OpenAI-compatible front of one prefill and one decode vLLM server.

Each completion request gets a fresh room; both instances get it in ``kv_transfer_params``
together with the prefill deployment's bootstrap address (``pdcore.vllm.params``; other keys the
client put there are passed on). The prefill
copy runs with one output token and no stream; the decode copy is the client's request, and its
answer (a stream or one body) is what the client gets. Both are sent at once (Mooncake-style):
decode announces its blocks and waits, prefill writes them after its forward pass.

A client that goes away is noticed while the answer is awaited, not only when it is written:
both upstream connections are closed then, which makes each vLLM abort its copy, so pdcore fails
the room on both sides and every block is handed back after the fence. Standard library only
(threads, ``http.client``); every wait has a timeout.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import secrets
import select
import socket
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from .params import BOOTSTRAP_KEY, ROOM_KEY, split_address, transfer_params

__all__ = ["Router", "main", "prefill_body", "decode_body", "room_params", "serve"]

log = logging.getLogger("pdcore.vllm.router")

_COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
# what an upstream connection cut under http.client (the client went away: ``_Upstream.cut``) surfaces as
_CUT = (OSError, http.client.HTTPException, ValueError, AttributeError)


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's copy: one output token, no stream, the room's ``kv_transfer_params``."""
    out = dict(body)
    for key in ("stream", "stream_options"):
        out.pop(key, None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["n"] = 1
    out["kv_transfer_params"] = params
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The decode instance's copy: the client's request with the room's ``kv_transfer_params``."""
    out = dict(body)
    out["kv_transfer_params"] = params
    return out


def room_params(body: dict[str, Any], room: int, bootstrap: tuple[str, int]) -> dict[str, Any]:
    """The room's ``kv_transfer_params``: the client's own keys kept, the room and bootstrap address set."""
    client = body.get("kv_transfer_params")
    keep = {k: v for k, v in client.items() if k not in (ROOM_KEY, BOOTSTRAP_KEY)} if isinstance(client, dict) else {}
    return {**keep, **transfer_params(room, *bootstrap)}


class _Upstream:
    """One HTTP request to a vLLM server whose connection another thread may cut (client gone)."""

    def __init__(self, base: tuple[str, int], timeout: float) -> None:
        self.conn = http.client.HTTPConnection(base[0], base[1], timeout=timeout)
        self._lock = threading.Lock()
        self._cut = False

    def post(self, path: str, body: dict[str, Any]) -> http.client.HTTPResponse:
        data = json.dumps(body).encode()
        self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        return self.conn.getresponse()

    def cut(self) -> None:
        with self._lock:
            if self._cut:
                return
            self._cut = True
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conn.close()


class Router:
    """The routing state: the two servers, the bootstrap address, the room counter."""

    def __init__(self, prefill: str, decode: str, bootstrap: str, timeout: float = 600.0) -> None:
        self.prefill = _base(prefill, "--prefill")
        self.decode = _base(decode, "--decode")
        self.bootstrap = split_address(bootstrap, "--bootstrap")
        if not timeout > 0:
            raise ValueError(f"--timeout must be a positive number of seconds, got {timeout}")
        self.timeout = timeout
        # rooms must be unique among the prefill deployment's live requests and not reused soon after a
        # failure: a counter from a random start (63 bits) gives both, also across router restarts
        self._rooms = itertools.count(secrets.randbits(62))
        self._lock = threading.Lock()
        self.stats = {"routed": 0, "cancelled": 0, "prefill_errors": 0}

    def next_room(self) -> int:
        with self._lock:
            return next(self._rooms) % (1 << 63)

    def count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1


def _base(url: str, where: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"{where} must be http://host:port, got {url!r}")
    return parts.hostname, parts.port or 80


def _client_gone(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        router = self.server.router
        if self.path == "/health":
            ok = all(_get(base, "/health", 10.0)[0] == 200 for base in (router.prefill, router.decode))
            self._reply(200 if ok else 503, {"prefill_and_decode": "ok" if ok else "unhealthy"})
        elif self.path == "/v1/models":
            status, data = _get(router.decode, "/v1/models", 10.0)
            self._reply(status, json.loads(data or b"{}"))
        elif self.path == "/stats":
            self._reply(200, dict(router.stats))
        else:
            self._reply(404, {"error": f"no route {self.path!r}; the router serves {list(_COMPLETIONS)}"})

    def do_POST(self) -> None:  # noqa: N802
        router = self.server.router
        if self.path not in _COMPLETIONS:
            self._reply(404, {"error": f"no route {self.path!r}; the router serves {list(_COMPLETIONS)}"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length))
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            self._reply(400, {"error": f"bad request body: {e}"})
            return
        room = router.next_room()
        params = room_params(body, room, router.bootstrap)
        prefill = _Upstream(router.prefill, router.timeout)
        decode = _Upstream(router.decode, router.timeout)
        done = threading.Event()
        threading.Thread(target=self._prefill, args=(prefill, body, params, done), daemon=True,
                         name=f"prefill-{room}").start()
        threading.Thread(target=self._watch, args=(prefill, decode, done, room), daemon=True,
                         name=f"watch-{room}").start()
        router.count("routed")
        try:
            self._relay(decode, decode_body(body, params))
        except _CUT as e:
            if not done.is_set():
                log.info("room %d: ended early: %s", room, e)
            prefill.cut()
            decode.cut()
            self.close_connection = True
        finally:
            done.set()
            decode.conn.close()

    def _prefill(self, up: _Upstream, body: dict[str, Any], params: dict[str, Any], done: threading.Event) -> None:
        try:
            resp = up.post(self.path, prefill_body(body, params))
            data = resp.read()
            if resp.status != 200:
                self.server.router.count("prefill_errors")
                log.warning("room %d: prefill answered %d: %s", params["pdcore_room"], resp.status, data[:300])
        except _CUT as e:
            if not done.is_set():
                self.server.router.count("prefill_errors")
                log.warning("room %d: prefill request failed: %s", params["pdcore_room"], e)
        finally:
            up.conn.close()

    def _watch(self, prefill: _Upstream, decode: _Upstream, done: threading.Event, room: int) -> None:
        """Until the answer is relayed: a client that closed its connection cancels both copies."""
        sock = self.connection
        while not done.is_set():
            try:
                readable, _, _ = select.select([sock], [], [], 0.2)
            except (OSError, ValueError):
                return
            if readable and _client_gone(sock):
                if not done.is_set():
                    log.info("room %d: the client went away: cancelling prefill and decode", room)
                    self.server.router.count("cancelled")
                    decode.cut()
                    prefill.cut()
                return

    def _relay(self, up: _Upstream, body: dict[str, Any]) -> None:
        resp = up.post(self.path, body)
        chunked = resp.getheader("Transfer-Encoding", "").lower() == "chunked" or resp.getheader("Content-Length") is None
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", resp.getheader("Content-Length", "0"))
        self.end_headers()
        while True:
            chunk = resp.read1(65536) if chunked else resp.read(65536)
            if not chunk:
                break
            if chunked:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            else:
                self.wfile.write(chunk)
            self.wfile.flush()
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], router: Router) -> None:
        self.router = router
        super().__init__(address, _Handler)


def _get(base: tuple[str, int], path: str, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(base[0], base[1], timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException):
        return 503, b""
    finally:
        conn.close()


def serve(router: Router, host: str, port: int) -> ThreadingHTTPServer:
    """Bind the router's HTTP server (``serve_forever`` runs it); port 0 picks a free one."""
    return _Server((host, port), router)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pdcore.vllm.router --prefill URL --decode URL --bootstrap HOST:PORT [--host H] [--port P]``."""
    parser = argparse.ArgumentParser(
        prog="python -m pdcore.vllm.router",
        description="OpenAI-compatible router in front of a prefill (kv_producer) and a decode (kv_consumer) vLLM "
        "server joined by pdcore: each request gets a room; decode's answer is returned.")
    parser.add_argument("--prefill", required=True, help="the prefill server, http://host:port")
    parser.add_argument("--decode", required=True, help="the decode server, http://host:port")
    parser.add_argument("--bootstrap", required=True,
                        help="the prefill deployment's bootstrap server, host:port (its kv_connector_extra_config)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind, 0 = any free port (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds an upstream request may take (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        router = Router(args.prefill, args.decode, args.bootstrap, args.timeout)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server = serve(router, args.host, args.port)
    except OSError as e:
        print(f"error: cannot bind {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    print(f"pdcore router listening on {args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
