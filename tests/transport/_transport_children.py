"""Code run in child processes (multiprocessing spawn) by the conformance suite."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import numpy as np


def run_sink(conn: Connection, name: str, options: dict[str, Any], nbytes: int) -> None:
    """Register ``nbytes`` of zeros, send the endpoint, then serve until told to stop (or killed)."""
    import transport

    t = transport.create(name, **options)
    buf = np.zeros(nbytes, np.uint8)
    t.register(buf)
    conn.send(t.endpoint())
    conn.recv()  # "stop" or EOF; a killed child never gets here
    t.close()


def run_source(conn: Connection, name: str, options: dict[str, Any], endpoint: bytes, nbytes: int, batches: int) -> None:
    """Connect to ``endpoint`` and post ``batches`` writes of ``nbytes``, then wait to be killed."""
    import transport
    from pdcore.core.deadline import Deadline

    t = transport.create(name, **options)
    buf = np.full(nbytes, 7, np.uint8)
    r = t.register(buf)
    peer = t.connect(endpoint, deadline=Deadline.after(10))
    remote = peer.remote.regions[0]
    for _ in range(batches):
        t.write(peer, [(r.addr, remote.addr, nbytes)], deadline=Deadline.after(10))
    conn.send("posted")
    conn.recv()


def run_grant_source(conn: Connection, name: str, options: dict[str, Any], endpoint: bytes, nbytes: int) -> None:
    """Connect to ``endpoint``, send this transport's instance, receive ``(grant key, remote addr)``,
    then write ``nbytes`` of 9s through the grant, batch after batch, until stopped or killed."""
    import transport
    from pdcore.core.deadline import Deadline
    from pdcore.core.errors import TransportError

    t = transport.create(name, **options)
    buf = np.full(nbytes, 9, np.uint8)
    r = t.register(buf)
    peer = t.connect(endpoint, deadline=Deadline.after(10))
    conn.send(t.instance)
    key, addr = conn.recv()
    sent = 0
    while not conn.poll(0):
        try:
            t.write(peer, [(r.addr, addr, nbytes)], deadline=Deadline.after(10), grant=key)
        except TransportError:
            break  # revoked: the sink cut us off
        sent += 1
        if sent == 8:
            conn.send("streaming")
    t.close()
