"""Heterogeneous TP through the peers, in one process (real sockets, real threads; each rank polls alone).

Every prefill rank holds only its heads of each page (a function of buffer, token, head and byte that any
holder computes alike); every decode rank must end up with exactly its heads, whichever prefill ranks
wrote them: split heads, replicated heads (tp above the head count, evenly or not), HND and NHD pages,
MLA (one writer per decode rank, the other prefill ranks owing nothing). Cross-process replicas with the
agreement run in the demo and its tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_kv_plan import _page

from pdcore import BootstrapInfo, Bootstrapped, DecodeConfig, DecodePeer, Failed, PrefillConfig, PrefillPeer
from pdcore import RemotePrefillDone, Succeeded
from pd_pair import through_worker

from pdcore.control.bootstrap import BootstrapServer
from pdcore.core.deadline import Deadline
from pdcore.kv import KvLayout
from pdcore.kv.routing import routing

PAGES = 12
N = 3  # pages per request


class Hetero:
    def __init__(self, layout: KvLayout | None, p_tp: int, d_tp: int, *, decode_layout: Any = "same",
                 page_bytes: int | None = None, **prefill_knobs: Any) -> None:
        self.layout, self.p_tp, self.d_tp = layout, p_tp, d_tp
        dl = layout if decode_layout == "same" else decode_layout
        knobs = dict(num_pages=PAGES, heartbeat_interval=0.05, dead_after=30.0, bootstrap_timeout=20.0,
                     waiting_timeout=20.0)
        self.server = BootstrapServer()
        self.port = self.server.start()
        self.prefill: list[tuple[PrefillPeer, Any, list[np.ndarray]]] = []
        self.decode: list[tuple[DecodePeer, Any, list[np.ndarray]]] = []
        self.events: dict[tuple[str, int], list[Any]] = {}
        try:
            for p in range(p_tp):
                pb = page_bytes or layout.page_bytes(p_tp)
                cache = [np.zeros(PAGES * pb, np.uint8) for _ in range(layout.buffers if layout else 2)]
                peer, outbox = PrefillPeer.start(PrefillConfig(
                    kv_buffers=cache, page_bytes=pb, tp_size=p_tp, tp_rank=p, kv_layout=layout,
                    bootstrap_host="127.0.0.1", bootstrap_port=self.port, **knobs, **prefill_knobs))
                self.prefill.append((peer, outbox, cache))
            for d in range(d_tp):
                pb = page_bytes or dl.page_bytes(d_tp)
                cache = [np.zeros(PAGES * pb, np.uint8) for _ in range(dl.buffers if dl else 2)]
                peer, inbox = DecodePeer.start(DecodeConfig(
                    kv_buffers=cache, page_bytes=pb, tp_size=d_tp, tp_rank=d, kv_layout=dl, **knobs))
                self.decode.append((peer, inbox, cache))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for peer, _, _ in self.prefill + self.decode:
            peer.close()
        self.server.close()

    def run(self, rids: list[str], timeout: float = 20.0, *, decode_only: bool = False,
            order: str = "prefill first") -> dict[tuple[str, int, str], str]:
        """Every request through every rank; returns {(side, rank, rid): terminal event name (and reason)}.

        ``order`` is when the schedulers register: every prefill rank before decode (``"prefill first"``),
        every decode rank first with each prefill rank registering only once every announcement of the
        rooms reached it (``"decode first"``: they park), or ``"interleaved"`` (the even prefill ranks
        first, the odd ones after decode announced). ``decode_only``: done when every decode rank ended
        them (a prefill rank nobody pairs with waits for its bootstrap timeout)."""
        self._rids, self._ended = rids, {}
        early = [p for p in range(self.p_tp) if order == "prefill first" or (order == "interleaved" and p % 2 == 0)]
        late = [p for p in range(self.p_tp) if p not in early]
        self._register([self.prefill[p][0] for p in early] + [peer for peer, _, _ in self.decode])
        if late:
            self._until(lambda: all(self._announced_to(p) for p in late), "decode's announcements to reach prefill",
                        timeout, prefill=early)
            self._register([self.prefill[p][0] for p in late])
        want = len(rids) * (self.d_tp if decode_only else self.p_tp + self.d_tp)
        self._until(lambda: sum(1 for side, _, _ in self._ended if side == "decode" or not decode_only) >= want,
                    f"{want} rank-requests to end", timeout)
        return self._ended

    def _register(self, peers: list[Any]) -> None:
        for i, rid in enumerate(self._rids):
            for peer in peers:
                peer.register(rid, BootstrapInfo("127.0.0.1", self.port, 100 + i))

    def _announced_to(self, p: int) -> bool:
        """Prefill rank ``p``'s worker handled every Register and Announce its decode ranks send it."""
        peer = self.prefill[p][0]
        senders = len(routing(self.layout, self.p_tp, self.d_tp).expects(p))
        if peer.diagnostics()["channel"]["delivered"] < senders * (1 + len(self._rids)):
            return False
        through_worker(peer)
        return True

    def _until(self, done: Any, what: str, timeout: float, prefill: list[int] | None = None) -> None:
        """The schedulers' rounds (every decode rank, and the ``prefill`` ranks: all by default) until ``done()``."""
        deadline = Deadline.after(timeout)
        ranks = [("prefill", p, *self.prefill[p]) for p in (range(self.p_tp) if prefill is None else prefill)]
        ranks += [("decode", d, *self.decode[d]) for d in range(self.d_tp)]
        while not done():
            assert not deadline.expired(), f"timed out waiting for {what}: {sorted(self._ended.items())}"
            for side, rank, peer, port, cache in ranks:
                for event in peer.poll(None):
                    i = self._rids.index(event.rid)
                    if isinstance(event, Bootstrapped):
                        if side == "decode":
                            port.announce(event.rid, self.dst_pages(i), request_pool_index=i)
                        else:
                            self.fill(rank, cache, i)
                            port.send(event.rid, self.src_pages(i), first_token=7 + i)
                    elif isinstance(event, (Succeeded, RemotePrefillDone)):
                        self._ended[(side, rank, event.rid)] = type(event).__name__
                    elif isinstance(event, Failed):
                        self._ended[(side, rank, event.rid)] = f"Failed: {event.reason}"

    @staticmethod
    def src_pages(i: int) -> list[int]:
        return list(range(PAGES - N * (i + 1), PAGES - N * i))  # from the top

    @staticmethod
    def dst_pages(i: int) -> list[int]:
        return [2 * i + 1, 2 * i, 2 * i + 6][:N]  # not adjacent: some runs break

    def fill(self, rank: int, cache: list[np.ndarray], i: int) -> None:
        first, count = self.layout.heads(rank, self.p_tp)
        pb = self.layout.page_bytes(self.p_tp)
        for pair, page in enumerate(self.src_pages(i)):
            content = _page(self.layout, first, count, i * N + pair)
            for b, buf in enumerate(cache):
                buf[page * pb : (page + 1) * pb] = content[b]

    def intact(self, rank: int, i: int) -> bool:
        first, count = self.layout.heads(rank, self.d_tp)
        pb = self.layout.page_bytes(self.d_tp)
        cache = self.decode[rank][2]
        return all(
            np.array_equal(buf[page * pb : (page + 1) * pb], _page(self.layout, first, count, i * N + pair)[b])
            for pair, page in enumerate(self.dst_pages(i)) for b, buf in enumerate(cache)
        )


CASES = [
    ("hnd", 4, 2, 4), ("nhd", 4, 2, 4), ("hnd", 4, 4, 2), ("nhd", 4, 4, 2), ("nhd", 2, 1, 3), ("hnd", 2, 4, 4),
    ("hnd", 2, 3, 2), ("mla", 1, 4, 2), ("mla", 1, 2, 4), ("nhd", 8, 2, 2),
]


ORDERS = ("prefill first", "decode first", "interleaved")
# make test runs each case once, the orders taking turns (every case and every order); make test-long the rest
MATRIX = [pytest.param(*case, registration, id=f"{case[0]}-H{case[1]}-P{case[2]}-D{case[3]}-{registration.replace(' ', '-')}",
                       marks=() if j == i % len(ORDERS) else pytest.mark.long)
          for i, case in enumerate(CASES) for j, registration in enumerate(ORDERS)]


@pytest.mark.parametrize(("order", "heads", "p_tp", "d_tp", "registration"), MATRIX)
def test_every_decode_rank_gets_exactly_its_heads(order: str, heads: int, p_tp: int, d_tp: int, registration: str) -> None:
    """Whichever side's scheduler registers first: announcements that arrive before a prefill rank
    registered the room wait for it, every decode rank's (several announce one room to one prefill rank)."""
    layout = KvLayout(order=order, kv_heads=heads, head_bytes=4, page_tokens=2, layers=2)
    h = Hetero(layout, p_tp, d_tp)
    try:
        rids = ["a", "b"]
        ended = h.run(rids, order=registration)
        for rid in rids:
            for d in range(d_tp):
                assert ended[("decode", d, rid)] == "RemotePrefillDone", ended
                assert h.intact(d, rids.index(rid)), f"decode rank {d} holds wrong bytes for {rid}"
            for p in range(p_tp):
                assert ended[("prefill", p, rid)] == "Succeeded", ended
    finally:
        h.close()


# Decode finds the mismatch when it looks prefill up; prefill's ranks hold the room too and must hear why at
# once (an abort naming it), not at their bootstrap timeout (20 s here, beyond the 10 s these runs wait).

def test_decode_tp_unlike_prefill_without_a_layout_fails_naming_why_on_both_sides() -> None:
    h = Hetero(None, 1, 2, page_bytes=64)
    try:
        ended = h.run(["x"], timeout=10.0)
        for side, rank in [("decode", 0), ("decode", 1), ("prefill", 0)]:
            assert "needs a KV layout" in ended[(side, rank, "x")], ended
    finally:
        h.close()


def test_layouts_that_differ_fail_naming_the_layout_on_both_sides() -> None:
    ours = KvLayout(order="hnd", kv_heads=4, head_bytes=4, page_tokens=2, layers=2)
    theirs = KvLayout(order="nhd", kv_heads=4, head_bytes=4, page_tokens=2, layers=2)
    h = Hetero(ours, 2, 2, decode_layout=theirs)
    try:
        ended = h.run(["x", "y"], timeout=10.0)
        for (side, _rank, _rid), outcome in ended.items():
            assert "KV layout" in outcome and "differs" in outcome and "'nhd'" in outcome, (side, ended)
        assert len(ended) == 2 * 4
    finally:
        h.close()


# -- layer-wise streaming ------------------------------------------------------------------------------------

LAYERWISE = KvLayout(order="hnd", kv_heads=4, head_bytes=4, page_tokens=2, layers=3)


def _poll_until(h: Hetero, cond: Any, what: str, timeout: float = 10.0) -> dict[tuple[str, int], Any]:
    """Poll every rank until ``cond(events)``; events: {(side, rank): [event, ...]}."""
    deadline = Deadline.after(timeout)
    while not cond(h.events):
        assert not deadline.expired(), f"timed out waiting for {what}: {h.events}"
        for side, ranks in (("prefill", h.prefill), ("decode", h.decode)):
            for rank, (peer, _, _) in enumerate(ranks):
                h.events.setdefault((side, rank), []).extend(peer.poll(None))
    return h.events


def _bootstrapped(h: Hetero, rid: str) -> None:
    for i, (peer, _, _) in enumerate(h.prefill + h.decode):
        peer.register(rid, BootstrapInfo("127.0.0.1", h.port, 500))
    h.events = {}
    _poll_until(h, lambda ev: all(any(isinstance(e, Bootstrapped) for e in ev.get(("decode", d), []))
                                  for d in range(h.d_tp)), "decode to bootstrap")
    for d, (_, inbox, _) in enumerate(h.decode):
        inbox.announce(rid, h.dst_pages(0), request_pool_index=0)
    _poll_until(h, lambda ev: all(any(isinstance(e, Bootstrapped) for e in ev.get(("prefill", p), []))
                                  for p in range(h.p_tp)), "prefill to bootstrap")


def _layer_landed(h: Hetero, layer: int) -> bool:
    """Every decode rank holds layer ``layer``'s K and V of request 0 exactly."""
    pb = h.layout.page_bytes(h.d_tp)
    for d, (_, _, cache) in enumerate(h.decode):
        first, count = h.layout.heads(d, h.d_tp)
        for pair, page in enumerate(h.dst_pages(0)):
            want = _page(h.layout, first, count, pair)
            for b in (2 * layer, 2 * layer + 1):
                if not np.array_equal(cache[b][page * pb : (page + 1) * pb], want[b]):
                    return False
    return True


def _first_layer_lands(h: Hetero, rid: str) -> None:
    """Every prefill rank begins ``rid`` with layer 0 final (layers 1 and 2 still "computing"); poll
    until the bytes of layer 0 landed on every decode rank, before the forward pass finished."""
    for p, (_, outbox, cache) in enumerate(h.prefill):
        h.fill(p, cache, 0)
        outbox.begin(rid, h.src_pages(0))
        outbox.layers_done(rid, 1)
    deadline = Deadline.after(10)
    while not _layer_landed(h, 0):
        assert not deadline.expired(), "layer 0 did not land before finish"
        for peer, _, _ in h.prefill + h.decode:
            peer.poll(None)


def test_layers_land_while_later_layers_compute_and_equal_a_whole_send() -> None:
    h = Hetero(LAYERWISE, 2, 4, layerwise_min_pages=1)
    try:
        _bootstrapped(h, "s")
        _first_layer_lands(h, "s")
        assert not _layer_landed(h, 2), "layer 2 landed before it was handed over"
        for _, outbox, _ in h.prefill:
            outbox.layers_done("s", 2)
            outbox.finish("s", first_token=9)
        _poll_until(h, lambda ev: all(any(isinstance(e, RemotePrefillDone) for e in ev.get(("decode", d), []))
                                      for d in range(h.d_tp)), "decode to land")
        assert all(h.intact(d, 0) for d in range(h.d_tp)), "the streamed bytes differ from the whole request's"
    finally:
        h.close()


def test_a_short_prompt_waits_for_finish() -> None:
    h = Hetero(LAYERWISE, 2, 2, layerwise_min_pages=N + 1)
    try:
        _bootstrapped(h, "short")
        posted: list[int] = []
        for p, (peer, outbox, cache) in enumerate(h.prefill):
            real = peer._transport.write
            peer._transport.write = lambda *a, _real=real, **k: (posted.append(1), _real(*a, **k))[1]
            h.fill(p, cache, 0)
            outbox.begin("short", h.src_pages(0))
            outbox.layers_done("short", 3)
            through_worker(peer)
        assert not posted, "a prompt below layerwise_min_pages streamed"
        for _, outbox, _ in h.prefill:
            outbox.finish("short", first_token=3)
        _poll_until(h, lambda ev: all(any(isinstance(e, RemotePrefillDone) for e in ev.get(("decode", d), []))
                                      for d in range(h.d_tp)), "decode to land")
        assert posted and all(h.intact(d, 0) for d in range(h.d_tp))
    finally:
        h.close()


def test_a_room_aborted_after_some_layers_landed_is_fenced() -> None:
    h = Hetero(LAYERWISE, 2, 4, layerwise_min_pages=1)
    try:
        _bootstrapped(h, "cut")
        _first_layer_lands(h, "cut")
        for peer, _, _ in h.decode:
            peer.abort_room("cut", 500)
        _poll_until(h, lambda ev: all(any(isinstance(e, Failed) for e in ev.get(("decode", d), []))
                                      for d in range(h.d_tp)), "decode to fail the room")
        pb = LAYERWISE.page_bytes(4)
        for _, _, cache in h.decode:  # the pages are handed back: the scheduler reuses them (a canary)
            for buf in cache:
                for page in h.dst_pages(0):
                    buf[page * pb : (page + 1) * pb] = 0xA5
        for peer, outbox, _ in h.prefill:  # the prefill side goes on as if nothing happened
            outbox.layers_done("cut", 3)
            outbox.finish("cut", first_token=1)
            through_worker(peer)
        _poll_until(h, lambda ev: all(any(isinstance(e, Failed) for e in ev.get(("prefill", p), []))
                                      for p in range(h.p_tp)), "prefill to fail the room")
        for _, _, cache in h.decode:
            for buf in cache:
                for page in h.dst_pages(0):
                    assert (buf[page * pb : (page + 1) * pb] == 0xA5).all(), "a byte landed after the fence"
    finally:
        h.close()


def test_dp_groups_of_different_tp_and_a_router_named_group() -> None:
    """DP attention: one prefill deployment of two DP groups, tp 2 and tp 4, feeding decode tp 4. Rooms route
    by ``room % 2``, or to the group the router named (``BootstrapInfo.dp_rank``); every decode rank gets
    exactly its heads from the group that served the request."""
    layout = KvLayout(order="hnd", kv_heads=4, head_bytes=4, page_tokens=2, layers=2)
    knobs = dict(num_pages=PAGES, heartbeat_interval=0.05, dead_after=30.0, bootstrap_timeout=20.0, waiting_timeout=20.0)
    server = BootstrapServer()
    port = server.start()
    groups: list[list[tuple[PrefillPeer, Any, list[np.ndarray]]]] = [[], []]
    decode: list[tuple[DecodePeer, Any, list[np.ndarray]]] = []
    try:
        for g, tp in enumerate((2, 4)):
            for p in range(tp):
                cache = [np.zeros(PAGES * layout.page_bytes(tp), np.uint8) for _ in range(layout.buffers)]
                peer, outbox = PrefillPeer.start(PrefillConfig(
                    kv_buffers=cache, page_bytes=layout.page_bytes(tp), tp_size=tp, tp_rank=p, dp_size=2, dp_rank=g,
                    kv_layout=layout, bootstrap_host="127.0.0.1", bootstrap_port=port, **knobs))
                groups[g].append((peer, outbox, cache))
        for d in range(4):
            cache = [np.zeros(PAGES * layout.page_bytes(4), np.uint8) for _ in range(layout.buffers)]
            peer, inbox = DecodePeer.start(DecodeConfig(kv_buffers=cache, page_bytes=layout.page_bytes(4), tp_size=4,
                                                        tp_rank=d, kv_layout=layout, **knobs))
            decode.append((peer, inbox, cache))
        # (rid, room, router-named group or None, the group that serves it)
        requests = [("even", 10, None, 0), ("odd", 11, None, 1), ("named", 12, 1, 1)]
        for i, (rid, room, named, g) in enumerate(requests):
            for peer, _, _ in groups[g]:
                peer.register(rid, BootstrapInfo("127.0.0.1", port, room))
            for peer, _, _ in decode:
                peer.register(rid, BootstrapInfo("127.0.0.1", port, room, dp_rank=named))
        index = {rid: i for i, (rid, *_rest) in enumerate(requests)}
        done: set[tuple[int, str]] = set()
        deadline = Deadline.after(20)
        while len(done) < 4 * len(requests):
            assert not deadline.expired(), f"landed only {sorted(done)}"
            for g, ranks in enumerate(groups):
                for p, (peer, outbox, cache) in enumerate(ranks):
                    for event in peer.poll(None):
                        if isinstance(event, Bootstrapped):
                            i = index[event.rid]
                            first, count = layout.heads(p, len(ranks))
                            pb = layout.page_bytes(len(ranks))
                            for pair, page in enumerate(Hetero.src_pages(i)):
                                content = _page(layout, first, count, i * N + pair)
                                for b, buf in enumerate(cache):
                                    buf[page * pb : (page + 1) * pb] = content[b]
                            outbox.send(event.rid, Hetero.src_pages(i), first_token=1)
                        assert not isinstance(event, Failed), (g, p, event)
            for d, (peer, inbox, cache) in enumerate(decode):
                for event in peer.poll(None):
                    assert not isinstance(event, Failed), (d, event)
                    if isinstance(event, Bootstrapped):
                        inbox.announce(event.rid, Hetero.dst_pages(index[event.rid]), request_pool_index=0)
                    elif isinstance(event, RemotePrefillDone):
                        done.add((d, event.rid))
        for d, (_, _, cache) in enumerate(decode):
            first, count = layout.heads(d, 4)
            pb = layout.page_bytes(4)
            for rid, i in index.items():
                for pair, page in enumerate(Hetero.dst_pages(i)):
                    want = _page(layout, first, count, i * N + pair)
                    for b, buf in enumerate(cache):
                        assert np.array_equal(buf[page * pb : (page + 1) * pb], want[b]), (d, rid, b)
    finally:
        for peer, _, _ in [x for g in groups for x in g] + decode:
            peer.close()
        server.close()


def test_a_router_named_group_that_does_not_exist_fails_naming_it() -> None:
    h = Hetero(KvLayout(order="hnd", kv_heads=4, head_bytes=4, page_tokens=2, layers=1), 2, 2)
    try:
        for peer, _, _ in h.decode:
            peer.register("lost", BootstrapInfo("127.0.0.1", h.port, 3, dp_rank=5))
        deadline = Deadline.after(10)
        reasons: dict[int, str] = {}
        while len(reasons) < 2:
            assert not deadline.expired(), reasons
            for d, (peer, _, _) in enumerate(h.decode):
                for event in peer.poll(None):
                    if isinstance(event, Failed):
                        reasons[d] = event.reason
        assert all("dp_rank 5 is not a DP group" in r for r in reasons.values()), reasons
    finally:
        h.close()
