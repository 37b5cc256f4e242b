"""The PD schedulers: what a serving engine's prefill and decode schedulers do with the public API.

A room of ``Simulation`` (``pdcore.sim.workload``; its state is set up there). The router admits a
request to one prefill and one decode replica; every scheduler call goes to the rank's front
(``pdcore.pd.front``), the object a real peer drives, and every rank of a replica gets the same calls
in the same order. Each round a replica agrees on its events; decode announces the pages it allocated
at ``Bootstrapped``; prefill fills each layer's pages just before it hands that layer over (the rest
hold poison until then); both free their pages at the terminal event and reuse them at once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..core.events import BootstrapInfo, Bootstrapped, Failed
from ..kv.pattern import page_content
from .cluster import Replica
from .records import ROUND, PdRequest, seed_of
from .world import Violation


class PdSchedulers:
    """The router's PD half, the prefill and decode schedulers' rounds, and the bytes their pages hold."""

    # -- admitting a request -------------------------------------------------------------------

    def _new_pd(self) -> None:
        rng = self.world.rng
        prefill = rng.choice([r for r in self.prefill if not r.killed] or [None])
        decode = rng.choice([r for r in self.decode if not r.killed] or [None])
        if prefill is None or decode is None:
            return
        npages = rng.randint(1, 4)
        if len(self._p_pool[prefill]) < npages:
            return  # the prefill replica is full: the router sends it elsewhere (here: nowhere)
        rid = f"r{next(self._ids)}"
        logprob = rng.choice([-0.5, None, -math.inf, math.nan])
        req = PdRequest(rid, next(self._rooms), npages, prefill, decode, self.world.now, rng.randint(0, 50000),
                        rng.randint(0, npages * 2), logprob, seed_of(rid))
        if req.seed % 4 == 0:  # the scheduler never records usage (no draw: a seed's orders stay as they were)
            req.usage, req.cached, req.logprob = False, 0, None
        req.p_pages = [self._p_pool[prefill].pop() for _ in range(npages)]
        req.faultless = not self.faults.any()
        self._pd[rid] = req
        self._by_replica[prefill][rid] = req
        self._by_replica[decode][rid] = req
        self.counts["pd"] += 1
        order = rng.random()  # who registers first: prefill, decode, or both at once
        gap = rng.random() * 0.05
        if self.faults.unregistered_abort and rng.random() < self.faults.unregistered_abort:
            self.fault_counts["unregistered_abort"] += 1  # it failed before prefill's scheduler got to it
            self.world.after(gap, self._abort_unregistered, prefill, req)
        else:
            self.world.after(0.0 if order < 0.5 else gap, self._register, prefill, req)
        self.world.after(0.0 if order >= 0.5 else gap, self._register, decode, req)

    def _bootstrap_info(self, req: PdRequest) -> BootstrapInfo:
        host, port = self._server("prefill", int(req.prefill.name[1:]))
        return BootstrapInfo(host, port, req.room, dp_rank=req.prefill.dp_rank)  # type: ignore[attr-defined]

    def _register(self, replica: Replica, req: PdRequest) -> None:
        if replica.killed or replica not in (req.prefill, req.decode):
            return
        info = self._bootstrap_info(req)
        for r in replica.ranks:
            r.call(r.front.register, req.rid, info)
        rng = self.world.rng
        if replica.role == "prefill" and self.faults.early_send and rng.random() < self.faults.early_send:
            req.early = True
            self.fault_counts["early_send"] += 1
            # a scheduler mistake: before Bootstrapped (at once, or once some decode ranks may have announced)
            self.world.after(rng.choice([0.0, rng.random() * 0.003, rng.random() * 0.01]), self._hand_over, req)
        if self.faults.abort and rng.random() < self.faults.abort:
            req.aborted = True
            self.fault_counts["abort"] += 1
            self.world.after(rng.random() * 0.05, self._abort, replica, req)

    def _abort(self, replica: Replica, req: PdRequest) -> None:
        if replica.killed or req.rid not in self._by_replica[replica]:
            return
        for r in replica.ranks:
            r.call(r.front.abort_room, req.rid, req.room)

    def _abort_unregistered(self, replica: Replica, req: PdRequest) -> None:
        """Prefill's scheduler gives up a request it never registered (EPD: its images failed first): it
        aborts the room, so the decode side hears at once instead of at its timeouts."""
        self._by_replica[replica].pop(req.rid, None)
        self._p_pool[replica].extend(req.p_pages)
        req.lost.add("prefill")
        req.ended_at["prefill"] = (self.world.now, False)
        if replica.killed:
            return
        for r in replica.ranks:
            r.call(r.front.abort_room, req.rid, req.room)

    # -- rounds --------------------------------------------------------------------------------

    def _round(self, replica: Replica) -> None:
        if replica.killed:
            return
        now = self.world.now
        running = [r for r in replica.ranks if r.running]
        if now < getattr(replica, "stalled_until", 0.0):
            pass  # the scheduler is busy elsewhere (a long forward pass): no round, the engines go on
        elif len(running) != len(replica.ranks):
            pass  # a paused rank holds its replica's collective: no round
        elif not any(len(r.table) for r in replica.ranks) and not (
                replica.ranks[0].receiver is not None and any(len(r.recv_table) for r in replica.ranks)):
            pass  # nothing registered anywhere: the round would agree on nothing
        else:
            agreed = replica.round(now)
            events = [r.call(r.front.after_round, evs) for r, evs in zip(replica.ranks, agreed)]
            self._same_events(replica, events)
            for event in events[0]:
                self._pd_event(replica, event, events)
            if replica.role == "prefill" and replica.ranks[0].receiver is not None:
                self._recv_round(replica, now)
            if self.world.steps % 8 == 0:  # (what exceeds a bound stays exceeded a while: a sample finds it)
                self._bounds(replica)
        self.world.after(ROUND, self._round, replica)

    def _pd_event(self, replica: Replica, event: Any, events: list[list[Any]]) -> None:
        req = self._pd[event.rid]
        kind = type(event)
        if kind is not Bootstrapped:
            self._prompt(req, replica)
            if kind is Failed and replica.role == "decode" and not req.aborted and \
                    all(req.rid in r.landed for r in replica.ranks):
                raise Violation(f"liveness: {req.rid} landed on every rank of {replica.name} and then failed: "
                                f"{event.reason}")
        if replica.role == "prefill":
            if kind is Bootstrapped:
                if not req.sent:  # after the forward pass: a few milliseconds in which anything may arrive
                    req.sent = True
                    self.world.after(self.world.rng.random() * 0.003, self._hand_over, req)
            else:
                self._p_pool[replica].extend(req.p_pages)
                self._by_replica[replica].pop(req.rid, None)
                self._ended(req)
            return
        if kind is Bootstrapped:
            self._announce(req)
            return
        owner = self._owner[replica]
        if kind is Failed:
            self._fence_held(replica, req)
        else:  # RemotePrefillDone
            self._check_landed(req, events)
        for p in req.d_pages:
            owner[p] = None
        for r in replica.ranks:
            r.landed.discard(req.rid)
        self._d_pool[replica].extend(req.d_pages)
        req.d_pages = []
        self._by_replica[replica].pop(req.rid, None)
        self._ended(req)

    def _ended(self, req: PdRequest) -> None:
        if not req.counted and self._pd_done(req):
            req.counted = True
            if req.ends.get(("decode", 0)) != "RemotePrefillDone":
                self._collateral(req)
            self.counts["lifecycles"] += 1
            self.counts["pd_landed" if req.ends.get(("decode", 0)) == "RemotePrefillDone" else "pd_failed"] += 1
            if req.faultless and not self.faults.any() and req.ends.get(("decode", 0)) != "RemotePrefillDone":
                raise Violation(f"liveness: {req.rid} failed in a run without faults")

    def _pd_done(self, req: PdRequest) -> bool:
        for side, replica in (("prefill", req.prefill), ("decode", req.decode)):
            if side in req.lost:
                continue
            if any(req.ends.get((side, r)) in (None, "Bootstrapped") for r in range(len(replica.ranks))):
                return False
        return True

    def _announce(self, req: PdRequest) -> None:
        replica = req.decode
        if req.rid not in self._by_replica[replica] or replica.killed:
            return
        pool = self._d_pool[replica]
        if len(pool) < req.npages:
            self.world.after(ROUND, self._announce, req)  # full: it waits (its waiting timeout bounds it)
            return
        req.d_pages = [pool.pop() for _ in range(req.npages)]
        owner = self._owner[replica]
        for p in req.d_pages:
            owner[p] = req.rid
        req.announced = True
        pages = tuple(req.d_pages)
        for r in replica.ranks:
            r.call(r.front.announce, req.rid, pages, 0)

    # -- the hand-over -------------------------------------------------------------------------

    def _live_on_prefill(self, req: PdRequest) -> bool:
        replica = req.prefill
        return not replica.killed and req.rid in self._by_replica[replica]

    def _hand_over(self, req: PdRequest) -> None:
        """The forward pass: each layer's pages are filled just before that layer is handed over (whole: all
        at once, with the first token), so a write of a layer not handed over yet carries poison."""
        if not self._live_on_prefill(req) or req.handed:
            return
        req.sent = req.handed = True
        replica = req.prefill
        pages = np.asarray(req.p_pages, np.int64)
        if not self.shape.layerwise or self._layers_of() == 1:
            self._fill(req, 0, self._layers_of())
            self._usage(req)
            for r in replica.ranks:
                r.call(r.front.send, req.rid, pages, req.first_token, None)
            return
        for r in replica.ranks:
            r.call(r.front.begin, req.rid, pages)
        self._layers(req)

    def _layers_of(self) -> int:
        return self.shape.layout.layers if self.shape.layout is not None else 1

    def _layers(self, req: PdRequest) -> None:
        if not self._live_on_prefill(req):
            return
        replica = req.prefill
        layers = self._layers_of()
        self._fill(req, req.layer, req.layer + 1)
        req.layer += 1
        if req.layer >= layers:
            self._usage(req)
            for r in replica.ranks:
                r.call(r.front.finish, req.rid, req.first_token, None)
            return
        for r in replica.ranks:
            r.call(r.front.layers_done, req.rid, req.layer)
        self.world.after(ROUND, self._layers, req)

    def _usage(self, req: PdRequest) -> None:
        if req.usage:  # recorded before the finishing hand-over: it rides with it
            for r in req.prefill.ranks:
                r.call(r.front.record_usage, req.rid, req.cached, req.logprob)

    # -- what the pages hold -------------------------------------------------------------------

    def _content(self, req: PdRequest, rank: int, tp: int, pair: int) -> list[bytes]:
        """What each buffer of page pair ``pair`` holds on prefill rank ``rank`` of ``tp`` (its heads' bytes)."""
        key = (req.seed, rank, tp, pair)
        got = self._contents.get(key)
        if got is None:
            if len(self._contents) > 1 << 12:
                self._contents.clear()
            got = self._contents[key] = self._compute(req, rank, tp, pair)
        return got

    def _compute(self, req: PdRequest, rank: int, tp: int, pair: int) -> list[bytes]:
        layout = self.shape.layout
        if layout is None:
            pb = self.shape.page_bytes
            return [bytes([(req.seed * 31 + b * 7 + pair) % 251]) * pb for b in range(2)]
        # page_content's bytes are seed 0's plus 17 * seed (mod 251): one add per page, not its whole formula
        base = self._bases.get((rank, tp, pair))
        if base is None:
            first, count = layout.heads(rank, tp)
            base = self._bases[(rank, tp, pair)] = page_content(layout, 0, first, count, pair).astype(np.uint16)
        page = ((base + req.seed * 17 % 251) % 251).astype(np.uint8)
        return [row.tobytes() for row in page]

    def _fill(self, req: PdRequest, lo: int, hi: int) -> None:
        """Write layers ``[lo, hi)`` of the request's prefill pages."""
        replica = req.prefill
        tp = len(replica.ranks)
        per_layer = len(replica.ranks[0].buffers) // self._layers_of()
        for rank, r in enumerate(replica.ranks):
            pb = r.layout.page_bytes[0]
            for pair, page in enumerate(req.p_pages):
                content = self._content(req, rank, tp, pair)
                for b in range(lo * per_layer, hi * per_layer):
                    r.views[b][page * pb : (page + 1) * pb] = content[b]
