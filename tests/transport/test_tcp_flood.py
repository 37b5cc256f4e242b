"""The TCP transport's data plane under a fast flood of idle connections to its data port.

The control channel's defence held against one flood process and failed against a faster one
(issue #42: a proven peer's answers needed a descriptor the flood always took first). This is the
same attack on the data plane's hello: a sink caps the connections in their handshake at
``tcp._MAX_HELLOS`` and cuts the oldest for a newcomer, so a flood faster than the sink could cut a
legitimate source's handshake, or (a sink that got eviction wrong) its live connections. Real
processes, real sockets on loopback; every wait has a deadline.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

import transport
from pdcore.core.deadline import Deadline
from transport.base import decode_endpoint

from _flood import Child, run_flood, run_granting_sink
from _transport_support import Collector

SECRET = b"pdcore-tests: the right secret!!"
NOFILE = 256  # the sink's open-file limit, as the control channel's flood test has it
FLOODS = 4  # flood processes at once
FLOOD = 400  # idle connections each, redialled as they are dropped
CHURN = 5000  # handshakes the sink has cut before the source comes
CONNECTS = 5  # the source's connects through the flood, one after the other
BATCHES = 10  # batches each connection writes, one at a time
SIZE = 1 << 16  # the sink's region; every batch fills it with its own byte, in WRITES writes
WRITES = 4
WAIT = 10.0  # seconds a connect or a batch may take (liveness, not speed)


def _spread(seconds: list[float]) -> str:
    ms = sorted(1000 * s for s in seconds)
    return f"min/median/max {ms[0]:.1f}/{statistics.median(ms):.1f}/{ms[-1]:.1f} ms ({len(ms)})"


@pytest.mark.long  # four flood processes on two cores: CI runs it in make test-long
def test_a_granted_source_connects_and_its_writes_land_through_a_fast_flood() -> None:
    """``FLOODS`` flood processes hold idle connections to a sink's data port (in a process slowed to
    one CPU at niceness 10, limited to ``NOFILE`` files: the flood is faster than its acceptor and
    hello threads). A source with the deployment secret connects ``CONNECTS`` times, each time
    writing ``BATCHES`` batches through its grant, one at a time: every connect and every batch
    completes within ``WAIT``, and every batch lands whole (the sink says so). The latencies and the
    flood's rate are printed.

    What holds: nothing of the flood's touches a source once it is in (its batches complete in
    milliseconds and land whole), and a connect gets through: the sink cuts the oldest handshake
    whose client sent nothing (a source sends its hello as its connect returns), a source whose
    handshake was cut or whose ack connection came late opens its pair again, and the ack connection
    gets a pairing window of its own after its data connection's handshake; the listen backlog (4,096)
    holds the flood's connections with a source's behind them, so a connect waits its turn there
    rather than SYN retransmissions (up to 7 s with a backlog of 128). Before (cutting the
    oldest handshake, one pair, one window from the accept) a connect failed in about one run in
    three here; the mutant ``tcp_sink_cuts_handshakes_by_age_alone`` plants the first half of that.
    A sink whose eviction took a live connection failed this test too: a write failed ("peer
    lost"), or the ack connection was refused at once (its data connection, waiting for it, was
    cut); checked by a temporary break of ``TcpTransport._evict`` that cut the oldest connection
    not already cut, live ones too."""
    child = Child(run_granting_sink, NOFILE, SECRET, SIZE)
    floods: list[Child] = []
    source = transport.create("tcp", secret=SECRET, peer_timeout=5.0)
    try:
        endpoint = child.wait("endpoint", 30)
        host, _, port = decode_endpoint(endpoint).address.decode().rpartition(":")
        key, remote = child.call("grant", source.instance)
        src = np.zeros(SIZE, np.uint8)
        local = source.register(src)
        floods = [Child(run_flood, host, int(port), FLOOD) for _ in range(FLOODS)]
        deadline = Deadline.after(30)
        while child.call("stats")["evicted_handshakes"] < CHURN:
            assert not deadline.expired(), f"the flood is not going: {child.call('stats')}, {[f.call('stats') for f in floods]}"
        before, start = child.call("stats"), time.monotonic()
        dialled = sum(f.call("stats").get("dials", 0) for f in floods)
        connects: list[float] = []
        batches: list[float] = []
        chunk = SIZE // WRITES
        for i in range(CONNECTS):
            began = time.monotonic()
            peer = source.connect(endpoint, deadline=Deadline.after(WAIT))
            connects.append(time.monotonic() - began)
            for j in range(BATCHES):
                value = (i * BATCHES + j) % 255 + 1
                src[:] = value
                done = Collector(WAIT)
                began = time.monotonic()
                source.write(peer, [(local.addr + k * chunk, remote + k * chunk, chunk) for k in range(WRITES)], done, grant=key)
                [(_, error)] = done.wait(1)
                batches.append(time.monotonic() - began)
                assert error is None, f"connect {i}, batch {j}: {error}; the sink: {child.call('stats')}"
                assert child.call("landed", value), f"connect {i}, batch {j} did not land whole"
            source.disconnect(peer)
        elapsed = time.monotonic() - start
        after = child.call("stats")
        dialled = sum(f.call("stats").get("dials", 0) for f in floods) - dialled
    finally:
        for flood in floods:
            flood.close()
        child.close()
        source.close(deadline=Deadline.after(5))
    cut = after["evicted_handshakes"] - before["evicted_handshakes"]
    print(
        f"flood of {FLOODS} x {FLOOD} idle connections: {dialled / elapsed:.0f} dials/s, {cut / elapsed:.0f} "
        f"handshakes cut/s, over {elapsed:.1f} s; the source's connects {_spread(connects)}, its batches "
        f"({WRITES} x {chunk} bytes) {_spread(batches)}; the sink: {after}"
    )
    assert cut > 500, after  # the flood was cut all along while the source connected and wrote
    assert after["auth_failures"] == 0, after  # a cut handshake is no failed authentication
