"""No blocking I/O on the protocol worker: a host that never answers delays only the rooms needing it.

A silent listener on loopback accepts TCP connections and never says a word:
a transport handshake or a bootstrap lookup against it waits out its deadline.
While one is waiting, each peer's worker must still run what is queued to it
(abort and ack handling go through it) within a second.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

import transport
from pdcore import BootstrapInfo
from pdcore.control import wire
from pd_pair import Pair, through_worker
from raw_control import RawControl

HOSTILE = "tcp://127.0.0.1:9"


@pytest.fixture(params=["zmq", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(control=request.param)
    yield p
    p.close()


@pytest.fixture
def silent() -> Iterator[socket.socket]:
    """A listener that never answers; ``accept`` on it tells that a client is now waiting on it."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        sock.settimeout(10.0)
        yield sock


def _wait_for_a_caller(silent: socket.socket) -> socket.socket:
    conn, _ = silent.accept()  # bounded by the listener's timeout
    return conn


def test_prefill_worker_runs_while_a_transport_connect_hangs(pair: Pair, silent: socket.socket) -> None:
    port = silent.getsockname()[1]
    fake = transport.Endpoint("tcp", b"z" * 16, f"127.0.0.1:{port}".encode(), ())
    dealer = RawControl(pair.prefill.control_endpoint, pair.plane, HOSTILE)
    try:
        layout = {"bases": [4096, 1 << 20], "page_bytes": [4096, 4096], "num_pages": 64}
        dealer.send(wire.encode(wire.Register(
            session_id="silent", epoch=1, endpoint=transport.encode_endpoint(fake), regions=(), layout=layout,
            tp_size=1, tp_rank=0,
        )))  # fmt: skip
        with _wait_for_a_caller(silent):  # prefill is now in the handshake with a host that never answers
            through_worker(pair.prefill, timeout=1.0)
            pair.register("meanwhile", 5)
            pair.drive(["meanwhile"], timeout=10.0)
            assert pair.ended("decode", "meanwhile") == "RemotePrefillDone" and pair.landed_intact("meanwhile")
    finally:
        dealer.close()


def test_decode_worker_runs_while_bootstrap_lookups_hang(pair: Pair, silent: socket.socket) -> None:
    port = silent.getsockname()[1]
    for i in range(20):
        pair.decode.register(f"stuck{i}", BootstrapInfo("127.0.0.1", port, 100 + i))
    with _wait_for_a_caller(silent):  # a lookup is waiting on the silent server
        through_worker(pair.decode, timeout=1.0)
        pair.register("meanwhile", 5)
        pair.drive(["meanwhile"], timeout=10.0)
        assert pair.ended("decode", "meanwhile") == "RemotePrefillDone" and pair.landed_intact("meanwhile")
    pair.decode.abort_room("stuck0", 100)
    pair.pump(lambda: bool(pair.ended("decode", "stuck0")), "the abort of a room waiting on the lookup", timeout=5.0)
