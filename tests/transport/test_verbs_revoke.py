"""The verbs sink's ``revoke`` when the device fails it: a revoke that could neither invalidate a
grant's memory windows nor cut the queue pair raises, and so does every retry until one really
stops that queue pair; it never reports success for what it did not do.

No RDMA device runs on this machine (nor pyverbs: ``transport.verbs.pv`` is None here), so these
tests drive the real ``VerbsTransport.grant``/``revoke``/``_cut`` bookkeeping over test doubles of
what the device does: a sink transport built without ``__init__`` (which opens a device) holding
only the state ``grant`` and ``revoke`` use, window operations whose invalidation fails while the
queue pair is "broken", and a queue pair whose move to the error state and destroy raise while it
is. tests/rdma/test_grants_verbs.py checks the same retry on a real device (soft-RoCE, in CI) for
the fallback without windows, where a failure can only be injected by patching the transport.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from transport import verbs, verbs_regions
from transport.deadline import Deadline
from transport.errors import TransportError
from transport.regions import GrantTable, Region, RegionTable

SOURCE = b"\x51" * 16
BASE, SIZE = 0x10000, 1 << 16


class FakeError(Exception):
    """What pyverbs raises (``pv.Error``)."""


FAKE_PV = SimpleNamespace(
    Error=FakeError,
    QPAttr=lambda **attr: attr,
    e=SimpleNamespace(IBV_QPS_ERR="error", IBV_QP_STATE=1),
)


class FakeQP:
    """A sink queue pair: while ``broken``, neither the move to the error state nor the destroy works."""

    def __init__(self) -> None:
        self.broken = False
        self.state = "rts"
        self.destroyed = False
        self.kills = 0  # attempts to move it to the error state

    def modify(self, attr: dict[str, Any], _mask: int) -> None:
        self.kills += 1
        if self.broken:
            raise FakeError("modify QP: injected failure")
        self.state = attr["qp_state"]

    def close(self) -> None:
        if self.broken:
            raise FakeError("destroy QP: injected failure")
        self.destroyed = True


class FakeMW:
    def close(self) -> None:
        pass


class FakeWindows:
    """``WindowOps``: binds always work; invalidating fails while the queue pair is broken."""

    def __init__(self) -> None:
        self.rkey = 0x100
        self.invalidations: list[tuple[int, bool]] = []  # (grant key, failed)

    def bind(self, qp: FakeQP, key: int, spans: list[tuple[int, int]], _regions: Any) -> list[Any]:
        made = []
        for a, n in spans:
            self.rkey += 1
            made.append((FakeMW(), a, n, self.rkey))
        return made

    def invalidate(self, qp: FakeQP, key: int, made: list[Any]) -> bool:
        self.invalidations.append((key, qp.broken))
        return qp.broken


class Sink:
    """A verbs sink transport's grant and revoke state over the doubles, one connection of SOURCE."""

    def __init__(self, windows: bool) -> None:
        t = object.__new__(verbs.VerbsTransport)  # __init__ opens a device
        t._closed = False
        t._windows = windows
        t._max_windows = 4096
        t._grants, t._grant_lock, t._last_grant, t._unconfirmed = GrantTable(), threading.Lock(), 0, {}
        t._mw_lock, t._lock = threading.Lock(), threading.Lock()
        t._drained = threading.Condition(t._lock)
        t._sinks = {}
        t._regions = RegionTable([Region(BASE, SIZE, 7)])
        t._mem = None
        t._mw = FakeWindows()
        t._cm_pending = deque()
        t._wake_r, t._wake_w = socket.socketpair()
        self.t = t
        self.sock, self.peer = socket.socketpair()  # the liveness socket: sink end, source end
        self.sock.setblocking(False)
        self.qp = FakeQP()
        self.conn = verbs._SinkConn(key=1, sock=self.sock, qp=self.qp, src=SOURCE)
        t._sinks[1] = self.conn

    def connected(self) -> bool:
        with self.t._lock:
            return self.t._sinks.get(1) is self.conn

    def close(self) -> None:
        for s in (self.sock, self.peer, self.t._wake_r, self.t._wake_w):
            s.close()


@pytest.fixture
def make_sink(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(verbs, "pv", FAKE_PV)
    monkeypatch.setattr(verbs_regions, "pv", FAKE_PV)  # free_windows
    made: list[Sink] = []

    def make(windows: bool = True) -> Sink:
        made.append(Sink(windows))
        return made[-1]

    yield make
    for s in made:
        s.close()


NOW = 0.0  # a revoke's deadline for the source's answer: none comes (the doubles have no source)


@pytest.mark.parametrize("settled", [False, True], ids=["asked", "settled"])
def test_a_revoke_whose_invalidation_and_cut_failed_keeps_raising_until_the_qp_is_stopped(
    make_sink: Any, settled: bool
) -> None:
    """The defect: the first revoke forgot the connection's windows (invalidation failed) and then its
    windows altogether (the cut failed), raised, and a retry found no connection holding the grant's
    windows and returned as if revoked, the queue pair still alive. (``settled`` did not even raise.)"""
    s = make_sink()
    g = s.t.grant(SOURCE, [(BASE, 4096)])
    assert s.t.windows_live == 1
    s.qp.broken = True
    for attempt in range(3):
        kills = s.qp.kills
        with pytest.raises(TransportError, match="could not be stopped") as ei:
            s.t.revoke(g, deadline=Deadline.after(NOW), settled=settled)
        assert ei.value.op == "revoke"
        assert s.qp.kills == kills + 1, f"attempt {attempt}: the retry did not try to cut the queue pair again"
        assert s.connected() and not s.qp.destroyed
    assert s.t._mw.invalidations[0] == (g.key, True)  # the first try did try to invalidate, and failed
    s.qp.broken = False  # the device recovers: the next retry stops the queue pair and returns
    s.t.revoke(g, deadline=Deadline.after(NOW), settled=settled)
    assert s.qp.state == "error" and s.qp.destroyed and not s.connected()
    kills = s.qp.kills
    s.t.revoke(g, deadline=Deadline.after(NOW), settled=settled)  # confirmed now: nothing more to do
    assert s.qp.kills == kills


def test_a_connection_whose_cut_failed_is_cut_by_the_revoke_of_another_grant_of_its_source(make_sink: Any) -> None:
    """The failed cut forgot every window of the connection, invalidated or not: a revoke of another
    grant of the same source must not find nothing to do while that queue pair is alive."""
    s = make_sink()
    g1 = s.t.grant(SOURCE, [(BASE, 4096)])
    g2 = s.t.grant(SOURCE, [(BASE + 8192, 4096)])
    s.qp.broken = True
    with pytest.raises(TransportError, match="could not be stopped"):
        s.t.revoke(g1, deadline=Deadline.after(NOW))
    with pytest.raises(TransportError, match="could not be stopped"):
        s.t.revoke(g2, deadline=Deadline.after(NOW))
    s.qp.broken = False
    s.t.revoke(g2, deadline=Deadline.after(NOW))
    assert s.qp.destroyed and not s.connected()
    s.t.revoke(g1, deadline=Deadline.after(NOW))  # its connection is gone: confirmed


def test_without_windows_a_failed_cut_raises_until_a_retry_stops_the_qp(make_sink: Any) -> None:
    """The fallback (no memory windows) cuts every connection of the source; a retry tries again."""
    s = make_sink(windows=False)
    g = s.t.grant(SOURCE, [(BASE, 4096)])
    s.qp.broken = True
    for _ in range(2):
        with pytest.raises(TransportError, match="could not be stopped"):
            s.t.revoke(g)
        assert s.connected()
    s.qp.broken = False
    s.t.revoke(g)
    assert s.qp.destroyed and not s.connected()
    s.t.revoke(g)
