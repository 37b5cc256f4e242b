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
from pdcore.bootstrap import BootstrapServer
from pdcore.deadline import Deadline
from pdcore.kv import KvLayout

PAGES = 12
N = 3  # pages per request


class Hetero:
    def __init__(self, layout: KvLayout | None, p_tp: int, d_tp: int, *, decode_layout: Any = "same",
                 page_bytes: int | None = None) -> None:
        self.layout, self.p_tp, self.d_tp = layout, p_tp, d_tp
        dl = layout if decode_layout == "same" else decode_layout
        knobs = dict(num_pages=PAGES, heartbeat_interval=0.05, dead_after=30.0, bootstrap_timeout=20.0,
                     waiting_timeout=20.0)
        self.server = BootstrapServer()
        self.port = self.server.start()
        self.prefill: list[tuple[PrefillPeer, Any, list[np.ndarray]]] = []
        self.decode: list[tuple[DecodePeer, Any, list[np.ndarray]]] = []
        try:
            for p in range(p_tp):
                pb = page_bytes or layout.page_bytes(p_tp)
                cache = [np.zeros(PAGES * pb, np.uint8) for _ in range(layout.buffers if layout else 2)]
                peer, outbox = PrefillPeer.start(PrefillConfig(
                    kv_buffers=cache, page_bytes=pb, tp_size=p_tp, tp_rank=p, kv_layout=layout,
                    bootstrap_host="127.0.0.1", bootstrap_port=self.port, **knobs))
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

    def run(self, rids: list[str], timeout: float = 20.0, *, decode_only: bool = False) -> dict[tuple[str, int, str], str]:
        """Every request through every rank; returns {(side, rank, rid): terminal event name (and reason)}.

        ``decode_only``: done when every decode rank ended them (a prefill rank nobody pairs with waits for
        its bootstrap timeout)."""
        for i, rid in enumerate(rids):
            for peer, _, _ in self.prefill + self.decode:
                peer.register(rid, BootstrapInfo("127.0.0.1", self.port, 100 + i))
        ended: dict[tuple[str, int, str], str] = {}
        want = len(rids) * (self.d_tp if decode_only else self.p_tp + self.d_tp)
        deadline = Deadline.after(timeout)
        while sum(1 for side, _, _ in ended if side == "decode" or not decode_only) < want:
            assert not deadline.expired(), f"only {len(ended)} of {want} rank-requests ended: {sorted(ended)}"
            for side, ranks in (("prefill", self.prefill), ("decode", self.decode)):
                for rank, (peer, port, cache) in enumerate(ranks):
                    for event in peer.poll(None):
                        i = rids.index(event.rid)
                        if isinstance(event, Bootstrapped):
                            if side == "decode":
                                port.announce(event.rid, self.dst_pages(i), request_pool_index=i)
                            else:
                                self.fill(rank, cache, i)
                                port.send(event.rid, self.src_pages(i), first_token=7 + i)
                        elif isinstance(event, (Succeeded, RemotePrefillDone)):
                            ended[(side, rank, event.rid)] = type(event).__name__
                        elif isinstance(event, Failed):
                            ended[(side, rank, event.rid)] = f"Failed: {event.reason}"
        return ended

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


@pytest.mark.parametrize(("order", "heads", "p_tp", "d_tp"), CASES, ids=[f"{o}-H{h}-P{p}-D{d}" for o, h, p, d in CASES])
def test_every_decode_rank_gets_exactly_its_heads(order: str, heads: int, p_tp: int, d_tp: int) -> None:
    layout = KvLayout(order=order, kv_heads=heads, head_bytes=4, page_tokens=2, layers=2)
    h = Hetero(layout, p_tp, d_tp)
    try:
        rids = ["a", "b"]
        ended = h.run(rids)
        for rid in rids:
            for d in range(d_tp):
                assert ended[("decode", d, rid)] == "RemotePrefillDone", ended
                assert h.intact(d, rids.index(rid)), f"decode rank {d} holds wrong bytes for {rid}"
            for p in range(p_tp):
                assert ended[("prefill", p, rid)] == "Succeeded", ended
    finally:
        h.close()


def test_decode_tp_unlike_prefill_without_a_layout_fails_naming_why() -> None:
    h = Hetero(None, 1, 2, page_bytes=64)
    try:
        ended = h.run(["x"], decode_only=True)
        for d in range(2):
            assert "needs a KV layout" in ended[("decode", d, "x")], ended
    finally:
        h.close()


def test_layouts_that_differ_fail_naming_the_layout() -> None:
    ours = KvLayout(order="hnd", kv_heads=4, head_bytes=4, page_tokens=2, layers=2)
    theirs = KvLayout(order="nhd", kv_heads=4, head_bytes=4, page_tokens=2, layers=2)
    h = Hetero(ours, 2, 2, decode_layout=theirs)
    try:
        ended = h.run(["x"], decode_only=True)
        for d in range(2):
            assert "KV layout" in ended[("decode", d, "x")] and "differs" in ended[("decode", d, "x")], ended
    finally:
        h.close()
