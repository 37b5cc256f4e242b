"""Authenticated verbs handshakes (the ``secret`` option) on a real device (soft-RoCE in CI).

Only a source that proved it holds the deployment secret gets a sink QP: with a wrong or missing
secret ``connect`` raises "authentication failed: host:port: ...", the sink holds no QP for it,
counts the refusal, and no byte of its memory changes; a legitimate source carries on.
Every wait is bounded by a deadline.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from typing import Any

import numpy as np
import pytest

from pdcore.core.deadline import Deadline
from pdcore.core.errors import TransportError
from transport import verbs
from transport.base import decode_endpoint

from _transport_support import Collector  # tests/rdma/conftest.py puts tests/transport on the path

pytestmark = pytest.mark.rdma

SLOW = 20.0  # seconds a completion may take on soft-RoCE under emulation
SECRET = b"pdcore-tests: the right secret!!"
OTHER = b"pdcore-tests: another secret..!!"
CANARY = 0x5C


def _sink_qps(t: Any) -> int:
    with t._lock:
        return len(t._sinks)


def _hostport(t: Any) -> str:
    return decode_endpoint(t.endpoint(), expect="verbs").address[verbs._ADDR.size :].decode()


def _wait(cond: Any, what: str, seconds: float = SLOW) -> None:
    deadline = Deadline.after(seconds)
    while not cond():
        assert not deadline.expired(), f"{what} within {seconds} s"
        threading.Event().wait(0.01)


def _write(src_t: Any, peer: Any, batch: list[tuple[int, int, int]]) -> None:
    done = Collector(SLOW)
    src_t.write(peer, batch, done)
    [(_bid, err)] = done.wait(1)
    assert err is None


def test_same_secret_writes_land(make_verbs: Any) -> None:
    src_t, dst_t = make_verbs(secret=SECRET), make_verbs(secret=SECRET)
    src = np.full(8192, 0x31, np.uint8)
    dst = np.full(3 * 8192, CANARY, np.uint8)
    rs, rd = src_t.register(src), dst_t.register(dst)
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(SLOW))
    assert _sink_qps(dst_t) == 1
    _write(src_t, peer, [(rs.addr, rd.addr + 8192, 8192)])
    assert (dst[8192:16384] == 0x31).all()
    assert (dst[:8192] == CANARY).all() and (dst[16384:] == CANARY).all()
    assert dst_t.auth_failures == 0


@pytest.mark.parametrize(
    "sink_secret, source_secret",
    [(SECRET, OTHER), (SECRET, None), (None, SECRET)],
    ids=["different-secrets", "source-without", "sink-without"],
)
def test_a_mismatch_fails_connect_and_connects_no_qp(make_verbs: Any, sink_secret: bytes | None, source_secret: bytes | None) -> None:
    dst_t = make_verbs(secret=sink_secret)
    legit, intruder = make_verbs(secret=sink_secret), make_verbs(secret=source_secret)
    dst = np.full(2 * 8192, CANARY, np.uint8)
    rd = dst_t.register(dst)
    mine = np.full(8192, 0x42, np.uint8)
    theirs = np.full(8192, 0xEE, np.uint8)
    rl, _ri = legit.register(mine), intruder.register(theirs)
    peer = legit.connect(dst_t.endpoint(), deadline=Deadline.after(SLOW))
    assert _sink_qps(dst_t) == 1
    with pytest.raises(TransportError) as ei:
        intruder.connect(dst_t.endpoint(), deadline=Deadline.after(SLOW))
    msg = str(ei.value)
    assert msg.startswith("authentication failed:") and _hostport(dst_t) in msg, msg
    assert ei.value.errno == errno.EACCES and ei.value.op == "connect"
    _wait(lambda: dst_t.auth_failures == 1, "the sink counts the refusal")
    assert _sink_qps(dst_t) == 1  # the legitimate source's QP, and no other
    assert (dst == CANARY).all()
    _write(legit, peer, [(rl.addr, rd.addr + 8192, 8192)])  # the legitimate source is not disturbed
    assert (dst[8192:] == 0x42).all() and (dst[:8192] == CANARY).all()
    for secret in (SECRET, OTHER):
        assert secret.decode() not in msg and secret.decode() not in repr(dst_t)


def test_a_raw_hello_with_qp_information_gets_no_qp(make_verbs: Any) -> None:
    """An intruder that knows the sink's instance id sends a well-formed unauthenticated hello (QP
    information included): refused before any QP exists; the sink's QPN never leaves."""
    dst_t = make_verbs(secret=SECRET)
    dst = np.full(8192, CANARY, np.uint8)
    dst_t.register(dst)
    host, _, port = _hostport(dst_t).rpartition(":")
    ep = decode_endpoint(dst_t.endpoint(), expect="verbs")
    hello = verbs._HELLO.pack(verbs._MAGIC, verbs._VERSION, ep.instance, os.urandom(16), 0x1234, 7, bytes(16), 0, 3)
    with socket.create_connection((host, int(port)), timeout=SLOW) as s:
        s.sendall(hello)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    _m, _v, status, qpn, psn, _mtu, _err = verbs._REPLY.unpack(reply[: verbs._REPLY.size])
    assert len(reply) == verbs._REPLY.size and status == verbs._AUTH_REQUIRED and qpn == psn == 0
    _wait(lambda: dst_t.auth_failures == 1, "the sink counts the refusal")
    assert _sink_qps(dst_t) == 0 and (dst == CANARY).all()
