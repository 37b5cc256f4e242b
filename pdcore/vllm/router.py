"""``python -m pdcore.vllm.router``: an OpenAI-compatible front of one prefill and one decode vLLM server.

Each completion request gets a fresh room; both instances get it in ``kv_transfer_params``
together with the prefill deployment's bootstrap address (``pdcore.vllm.params``; other keys the
client put there are passed on). The prefill
copy runs with one output token and no stream; the decode copy is the client's request, and its
answer (a stream or one body) is what the client gets. Both are sent at once (Mooncake-style):
decode announces its blocks and waits, prefill writes them after its forward pass.

A prefill copy that cannot be served (prefill down: its connection refused; or it answers an
error) fails fast: unless decode's answer has begun, decode's copy is cut (vLLM aborts it, pdcore
fences its blocks) and sent again without the room, so decode computes the prompt itself at once
instead of waiting out its transfer timeouts; ``/stats`` counts them (``local``).

A client that goes away is noticed while the answer is awaited, not only when it is written:
both upstream connections are closed then, which makes each vLLM abort its copy, so pdcore fails
the room on both sides and every block is handed back after the fence. A client that closes its
connection after its answer was whole is not counted as cancelled. Standard library only
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

from transport.threads import named_thread

from .params import BOOTSTRAP_KEY, ROOM_KEY, split_address, transfer_params

__all__ = ["Router", "main", "prefill_body", "decode_body", "local_body", "room_params", "serve"]

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


def local_body(body: dict[str, Any]) -> dict[str, Any]:
    """Decode's copy when prefill cannot serve the room: the client's request without a room (decode computes
    the prompt itself); the client's own ``kv_transfer_params`` keys are kept."""
    out = dict(body)
    client = body.get("kv_transfer_params")
    keep = {k: v for k, v in client.items() if k not in (ROOM_KEY, BOOTSTRAP_KEY)} if isinstance(client, dict) else {}
    if keep:
        out["kv_transfer_params"] = keep
    else:
        out.pop("kv_transfer_params", None)
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
        self.conn.auto_open = 0  # connected once, by ``post``: a cut connection is never opened again behind it
        self._lock = threading.Lock()
        self._cut = False

    def post(self, path: str, body: dict[str, Any]) -> http.client.HTTPResponse:
        data = json.dumps(body).encode()
        if self._cut:  # cut before it was sent (its prefill failed at once): never sent
            raise ConnectionAbortedError("cut before it was sent")
        self.conn.connect()
        with self._lock:  # a cut while it connected found no socket to shut: this one is not sent either
            if self._cut:
                self.conn.close()
                raise ConnectionAbortedError("cut before it was sent")
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
        self.stats = {"routed": 0, "cancelled": 0, "prefill_errors": 0, "decode_errors": 0, "local": 0}

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


class _Exchange:
    """One client request's state, shared by the handler's thread, its prefill thread and its watcher."""

    def __init__(self, decode: _Upstream) -> None:
        self._lock = threading.Lock()
        self.decode = decode  # the decode copy being answered (a fallback replaces it)
        self.relayed = 0  # bytes of decode's answer written to the client
        self.answered = threading.Event()  # decode's answer was read whole: a close after it is no cancel
        self.done = threading.Event()  # the handler is through (answered, failed or cancelled)
        self.prefill_failed = threading.Event()
        self.client_gone = False
        self.chunked_out: bool | None = None  # how the answer goes to the client, once its headers went

    def cut_decode_for_prefill(self) -> bool:
        """Prefill could not serve the room: cut decode's copy if its answer has not begun (True)."""
        with self._lock:
            self.prefill_failed.set()
            if self.relayed or self.done.is_set():
                return False
            decode = self.decode
        decode.cut()
        return True

    def fallback(self, base: tuple[str, int], timeout: float) -> _Upstream | None:
        """A fresh decode copy to send without the room, if the cut one was cut for prefill's failure."""
        with self._lock:
            if not self.prefill_failed.is_set() or self.relayed or self.client_gone:
                return None
            self.decode = _Upstream(base, timeout)
            return self.decode

    def wrote(self, n: int) -> None:
        with self._lock:
            self.relayed += n

    def client_went(self) -> _Upstream:
        with self._lock:
            self.client_gone = True
            return self.decode


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
        ex = _Exchange(_Upstream(router.decode, router.timeout))
        named_thread(self._prefill, f"prefill-{room}", (prefill, body, params, ex)).start()
        named_thread(self._watch, f"watch-{room}", (prefill, ex, room)).start()
        router.count("routed")
        try:
            self._answer(ex, decode_body(body, params), local_body(body), room)
        except _CUT as e:
            if not ex.done.is_set():
                log.info("room %d: ended early: %s", room, e)
            prefill.cut()
            ex.decode.cut()
            if ex.chunked_out is None and not ex.client_gone:  # decode failed before it answered: say so
                router.count("decode_errors")
                try:
                    self._reply(502, {"error": f"the decode server did not answer: {e!r}"})
                except OSError:
                    pass
            self.close_connection = True
        finally:
            ex.done.set()
            ex.decode.conn.close()

    def _answer(self, ex: _Exchange, body: dict[str, Any], local: dict[str, Any], room: int) -> None:
        """Relay decode's answer; if its copy is cut because prefill failed before it began, send it again
        without the room and relay that one instead (the client sees one answer)."""
        router = self.server.router
        up = ex.decode
        while True:
            resp = None
            try:
                resp = up.post(self.path, body)
                self._relay(resp, ex)
                return
            except _CUT:
                fresh = ex.fallback(router.decode, router.timeout)
                if fresh is None:
                    raise
                router.count("local")
                log.warning("room %d: prefill could not serve it: decode computes the prompt itself", room)
                up, body = fresh, local
            finally:
                if resp is not None:
                    resp.close()  # (a cut answer holds its socket until closed)

    def _prefill(self, up: _Upstream, body: dict[str, Any], params: dict[str, Any], ex: _Exchange) -> None:
        room = params["pdcore_room"]
        try:
            resp = up.post(self.path, prefill_body(body, params))
            data = resp.read()
            if resp.status == 200:
                return
            self.server.router.count("prefill_errors")
            log.warning("room %d: prefill answered %d: %s", room, resp.status, data[:300])
        except _CUT as e:
            if ex.done.is_set():
                return
            self.server.router.count("prefill_errors")
            log.warning("room %d: prefill request failed: %s", room, e)
        finally:
            up.conn.close()
        ex.cut_decode_for_prefill()

    def _watch(self, prefill: _Upstream, ex: _Exchange, room: int) -> None:
        """Until the answer is relayed: a client that closed its connection cancels both copies."""
        sock = self.connection
        while not ex.done.is_set():
            try:
                readable, _, _ = select.select([sock], [], [], 0.2)
            except (OSError, ValueError):
                return
            if readable and _client_gone(sock):
                if not ex.done.is_set() and not ex.answered.is_set():
                    log.info("room %d: the client went away: cancelling prefill and decode", room)
                    self.server.router.count("cancelled")
                    ex.client_went().cut()
                    prefill.cut()
                return

    def _relay(self, resp: http.client.HTTPResponse, ex: _Exchange) -> None:
        """Copy one upstream answer to the client: its status and headers, unless a copy cut before it began
        sent them already (its framing then stays: a body comes as one chunk of a chunked answer)."""
        chunked = resp.getheader("Transfer-Encoding", "").lower() == "chunked" or resp.getheader("Content-Length") is None
        data = b""
        if not chunked:  # one body: read it whole first, so the client cannot have it all before it counts as answered
            data = resp.read()
            ex.answered.set()
        if ex.chunked_out is None:
            ex.chunked_out = chunked
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
        while True:
            if chunked:
                data = resp.read1(65536)
                if not data:
                    ex.answered.set()
            if data:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if ex.chunked_out else data)
                self.wfile.flush()
                ex.wrote(len(data))
            if not chunked or not data:
                break
        if ex.chunked_out:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: socketserver's 5 reset connections of a burst of clients

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
