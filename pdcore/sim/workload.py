"""One seeded simulation: deployments, schedulers that call the API in drawn orders, faults, invariants.

A ``Shape`` (drawn per seed, ``pdcore.sim.faults``) says what runs: prefill and
decode replicas of tp 1 to 4 (with a ``KvLayout``: heterogeneous tp, MLA;
without one: opaque pages and equal tp), prefill replicas that are DP groups of
one deployment or deployments of their own, layer-wise hand-overs or whole
ones, and encode deployments feeding the prefill replicas' receivers (sharded
or full copies). ``Faults`` (drawn per seed too) say what goes wrong.

The schedulers are what a serving engine does with the public API, and they
call it: every scheduler call goes to the rank's front (``pdcore.pd.front``,
``pdcore.epd.front``), the object a real peer drives; every rank of a replica
gets the same calls in the same order; decode announces the pages it allocated
at ``Bootstrapped``; prefill fills each layer's pages just before it hands
that layer over, and the rest of its pages hold poison until then; both free
their pages at the terminal event and reuse them at once.

Invariants (``Violation`` names what broke; the world's trace says what came
before), judged on outcomes, never on a failure's wording:

- **fence**: no write lands in a decode page that is not held, right then, by
  the request whose grant the write came through, nor in a receive slot granted
  to another item since; and when a failed request's pages are handed back, no
  grant of that request is live;
- **agreement**: every rank of a replica gets the same events in the same round;
- **one end**: at most one ``Bootstrapped`` and exactly one terminal event per
  request per rank (none after it);
- **bytes**: a landed request's pages hold exactly what prefill sent, rows what
  encode sent, with the first token, usage and logprob it sent;
- **prompt**: once one side of a request ended, the other learns of it by a frame
  (its engine fails it), not by its own timer, when nothing that carries such a
  frame was lost;
- **no collateral**: in a run whose only faults befall processes (pauses, kills,
  stalls, clock jumps, exits), a request none of whose replicas was touched
  during its life lands: one rank's trouble never fails its siblings' requests;
- **liveness**: once faults stop, every request ends within its timeouts;
- **no leak**: at the end, fronts, tables, engines, grants, parked posts, slots,
  parked announcements and (after their TTL) tombstones are empty;
- **bounds**: parked announcements and tombstones within their bounds, no
  engine input that raised, no driver that would have waited on a full sink (the
  rank's input that did it raises), no scheduler call the API refused; and in a
  run without faults every request lands.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.events import BootstrapInfo, Bootstrapped, Failed, RemotePrefillDone
from ..epd.config import ReceiverConfig
from ..epd.types import EmbeddingChunk, EmbeddingItem
from ..kv.pattern import page_content
from ..epd._recv_spec import shard
from .cluster import Planes, Replica, SimRank, configs
from .faults import PROCESS_FAULTS, TIMERS, Faults, Shape, draw
from .world import Violation, World

__all__ = ["Shape", "Faults", "Simulation", "draw", "TIMERS"]

ROUND = 0.008  # a scheduler's round
PAGES = 48  # pages per rank's cache
HIDDEN = 4
DTYPE = "torch.float16"
ROW_BYTES = HIDDEN * 2
SLOTS = 6
SLOT_ROWS = 8
SEND_SLOTS = 32  # an encode rank's send slots; its scheduler begins images first come, first served
POISON = 0xA5  # what a page or send slot holds before its bytes are written (never a page's content)


def _seed_of(rid: str) -> int:
    return (zlib.crc32(rid.encode()) & 0x7FFF) + 1  # not hash(): that differs per process, a seed must replay


@dataclass(eq=False)
class PdRequest:
    rid: str
    room: int
    npages: int
    prefill: Replica
    decode: Replica
    born: float
    first_token: int
    cached: int
    logprob: float | None
    seed: int
    p_pages: list[int] = field(default_factory=list)
    d_pages: list[int] = field(default_factory=list)
    sent: bool = False  # a hand-over is scheduled
    handed: bool = False  # the hand-over began (it runs once)
    announced: bool = False
    ends: dict[tuple[str, int], str] = field(default_factory=dict)  # (side, rank) -> event name
    layer: int = 0  # layers handed over so far
    lost: set[str] = field(default_factory=set)  # sides whose replica was killed (or never held it): no end owed there
    early: bool = False
    aborted: bool = False
    faultless: bool = True
    counted: bool = False
    ended_at: dict[str, tuple[float, bool]] = field(default_factory=dict)  # side -> (when, learned by its own timer)
    usage: bool = True  # the scheduler recorded usage (it rides with the finishing hand-over)


@dataclass(eq=False)
class EpdRequest:
    rid: str
    images: list[tuple[int, int, int]]  # (room, rows, encode deployment)
    prefill: Replica
    born: float
    ends: dict[int, str] = field(default_factory=dict)  # prefill rank -> "landed" / "failed"
    lost: bool = False
    ended_at: float | None = None


class Simulation:
    """One seed's run; ``run(seconds)`` raises ``Violation`` or returns the counts."""

    def __init__(self, seed: int, *, shape: Shape | None = None, faults: Faults | None = None,
                 rate: float = 800.0, wire_check: bool = True) -> None:
        self.world = World(seed)
        drawn_shape, drawn_faults = draw(seed, self.world)
        self.shape = shape or drawn_shape
        self.faults = faults if faults is not None else drawn_faults
        self.rate = rate
        self.planes = Planes(self.world, heartbeat=TIMERS["heartbeat"], dead_after=TIMERS["dead_after"],
                             wire_check=wire_check)
        if self.faults.sink_full:
            self.planes.fabric.faults.max_inflight = self.world.rng.randint(1, 4)
        self._apply_faults(on=True)
        if self.faults.slow_lookups:
            self.planes.lookup_delay = self.planes.connect_delay = self.faults.slow_lookups * self.world.rng.random()
        self.planes.fabric.on_land = self._landed_check
        self.planes.fabric.on_grant = self._granted
        self._sinks: dict[Any, tuple[str, Replica, SimRank, int]] = {}  # transport -> (kind, replica, rank, index)
        self._grant_owner: dict[tuple[Any, int], Any] = {}
        self._slot_grant: dict[tuple[Any, int], int] = {}  # (sink, receive slot) -> the last grant of it
        self.prefill: list[Replica] = []
        self.decode: list[Replica] = []
        self.encode: list[list[SimRank]] = []  # per deployment
        self.servers: dict[str, tuple[str, int]] = {}
        self._owner: dict[Replica, list[str | None]] = {}  # decode replica: page -> rid
        self._p_pool: dict[Replica, list[int]] = {}
        self._d_pool: dict[Replica, list[int]] = {}
        self._pd: dict[str, PdRequest] = {}
        self._by_replica: dict[Replica, dict[str, PdRequest]] = {}
        self._epd: dict[str, EpdRequest] = {}
        self._epd_of: dict[Replica, dict[str, EpdRequest]] = {}
        self._send_free: dict[SimRank, list[int]] = {}
        self._to_begin: dict[SimRank, deque[tuple[int, int]]] = {}  # images waiting for a send slot, in order
        self._encode_kills: dict[int, tuple[float, float]] = {}  # deployment -> when a stale name may fail a request
        self._room_slot: dict[tuple[SimRank, int], int] = {}
        self._image_of: dict[int, EpdRequest] = {}
        self._contents: dict[tuple[int, int, int, int], list[bytes]] = {}
        self._bases: dict[tuple[int, int, int], np.ndarray] = {}
        self._rooms = iter(range(1000, 1 << 40))
        self._ids = iter(range(1 << 40))
        self.counts: Counter[str] = Counter()
        self.fault_counts: Counter[str] = Counter()
        self.faults_until = 0.0
        self._admit_until = 0.0
        self._touched: dict[str, list[tuple[float, float]]] = {}  # replica name -> when a fault befell it
        self._build()

    # -- building ----------------------------------------------------------------------------

    def _knobs(self, role: str) -> dict[str, Any]:
        common = dict(heartbeat_interval=TIMERS["heartbeat"], dead_after=TIMERS["dead_after"],
                      tombstone_ttl=TIMERS["tombstone"], max_pending=256)
        if role == "encode":
            return {**common, "park_timeout": TIMERS["park"], "max_rooms": 256}
        return {**common, "capacity": 256, "bootstrap_timeout": TIMERS["bootstrap"],
                "waiting_timeout": TIMERS["waiting"], "fence_timeout": TIMERS["fence"],
                **({"layerwise_min_pages": 1} if role == "prefill" else {})}

    def _page_bytes(self, tp: int) -> int:
        return self.shape.page_bytes if self.shape.layout is None else self.shape.layout.page_bytes(tp)

    def _buffers(self, tp: int, n: int) -> Any:
        nbuf = 2 if self.shape.layout is None else self.shape.layout.buffers
        pb = self._page_bytes(tp)
        return lambda rank: [np.full(n * pb, POISON, np.uint8) for _ in range(nbuf)]

    def _skew(self) -> float:
        """A new process's clock against the world's (any offset: monotonic clocks of processes are unrelated)."""
        return self.world.rng.uniform(0.0, 100.0) if self.faults.skew else 0.0

    def _server(self, role: str, index: int) -> tuple[str, int]:
        name = "P0" if role == "prefill" and self.shape.prefill_dp else f"{role[0].upper()}{index}"
        return self.servers.setdefault(name, (f"10.9.{index}.{1 + 'pde'.index(role[0])}", 9000 + index))

    def _make_replica(self, role: str, index: int, tp: int, epoch: int, endpoints: list[str] | None = None) -> Replica:
        name = f"{role[0].upper()}{index}"
        server = self._server(role, index)
        cfgs = configs(role, tp, self._buffers(tp, PAGES), page_bytes=self._page_bytes(tp), num_pages=PAGES,
                       kv_layout=self.shape.layout, knobs=self._knobs(role), server=server)
        receiver = None
        if role == "prefill" and self.shape.encode_tp:
            receiver = ReceiverConfig(slots=SLOTS, slot_rows=SLOT_ROWS, hidden=HIDDEN, dtype=DTYPE,
                                      shard_rows=self.shape.shard_rows, timeout=TIMERS["receive"])
        replica = Replica(name, role, [], server if role != "decode" else None, started=self.world.now)
        replica.epoch = epoch
        replica.dp_rank = index if role == "prefill" and self.shape.prefill_dp else None  # type: ignore[attr-defined]
        for rank, cfg in enumerate(cfgs):
            r = SimRank(self.planes, role, f"{name}.{rank}", cfg, epoch=epoch, buffers=cfg.kv_buffers,
                        receiver=receiver, endpoint=endpoints[rank] if endpoints else None, skew=self._skew())
            replica.ranks.append(r)
            self._sinks[r.transport] = ("kv", replica, r, rank)
        if role == "prefill":
            layout = {"page_bytes": list(replica.ranks[0].layout.page_bytes), "num_pages": PAGES}
            if self.shape.layout is not None:
                layout["kv"] = self.shape.layout.to_json()
            dp_size = len(self.shape.prefill_tp) if self.shape.prefill_dp else 1
            for r in replica.ranks:
                r.register_with(server, layout, dp_rank=replica.dp_rank or 0, dp_size=dp_size)  # type: ignore[attr-defined]
            self._p_pool[replica] = list(range(PAGES))
            self._by_replica[replica] = {}
            self._epd_of[replica] = {}
        else:
            self._d_pool[replica] = list(range(PAGES))
            self._owner[replica] = [None] * PAGES
            self._by_replica[replica] = {}
        self.world.after(ROUND * self.world.rng.random(), self._round, replica)
        return replica

    def _make_encoders(self, index: int, tp: int, epoch: int, endpoints: list[str] | None = None) -> list[SimRank]:
        name = f"E{index}"
        server = self.servers.setdefault(name, (f"10.9.{index}.3", 9500 + index))
        ranks = []
        nbytes = SEND_SLOTS * SLOT_ROWS * ROW_BYTES
        cfgs = configs("encode", tp, lambda rank: [np.zeros(nbytes, np.uint8)], page_bytes=0, num_pages=0,
                       kv_layout=None, knobs=self._knobs("encode"), server=server)
        for rank, cfg in enumerate(cfgs):
            r = SimRank(self.planes, "encode", f"{name}.{rank}", cfg, epoch=epoch, buffers=cfg.send_buffers,
                        endpoint=endpoints[rank] if endpoints else None, skew=self._skew())
            r.register_with(server, {"role": "encode"})
            self._send_free[r] = list(range(SEND_SLOTS))
            self._to_begin[r] = deque()
            ranks.append(r)
        self.world.after(ROUND * self.world.rng.random(), self._encode_round, index)
        return ranks

    def _build(self) -> None:
        for i, tp in enumerate(self.shape.prefill_tp):
            self.prefill.append(self._make_replica("prefill", i, tp, 1))
        for i, tp in enumerate(self.shape.decode_tp):
            self.decode.append(self._make_replica("decode", i, tp, 1))
        for i, tp in enumerate(self.shape.encode_tp):
            self.encode.append(self._make_encoders(i, tp, 1))

    def _apply_faults(self, on: bool) -> None:
        f = self.faults if on else Faults(delay=self.faults.delay)
        net, fab, planes = self.planes.network.faults, self.planes.fabric.faults, self.planes.faults
        net.drop, net.duplicate, net.reorder, net.delay = f.drop, f.duplicate, f.reorder, f.delay
        fab.error, fab.jitter = f.data_error, f.data_jitter
        fab.refuse_post, fab.refuse_grant, fab.refuse_revoke = f.refuse_post, f.refuse_grant, f.refuse_revoke
        for name in ("lookup_timeout", "lookup_partial", "lookup_error", "lookup_garbage", "connect_error",
                     "refuse_inputs"):
            setattr(planes, name, getattr(f, name))
        if not on:
            self.planes.network.cut.clear()

    # -- the router ---------------------------------------------------------------------------

    def _route(self) -> None:
        world = self.world
        if world.now >= self._admit_until:
            return
        if self.shape.encode_tp and world.rng.random() < 0.3:
            self._new_epd()
        else:
            self._new_pd()
        world.after(world.rng.expovariate(self.rate), self._route)

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
                        rng.randint(0, npages * 2), logprob, _seed_of(rid))
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

    # -- PD schedulers ---------------------------------------------------------------------------

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

    def _same_events(self, replica: Replica, events: list[list[Any]]) -> None:
        first = [(type(e).__name__, e.rid, getattr(e, "reason", None)) for e in events[0]]
        for rank, evs in enumerate(events[1:], 1):
            mine = [(type(e).__name__, e.rid, getattr(e, "reason", None)) for e in evs]
            if mine != first:
                raise Violation(f"agreement: {replica.name} rank {rank} got {mine}, rank 0 {first}")
        side = replica.role
        for kind, rid, _ in first:
            req = self._pd.get(rid)
            if req is None:
                raise Violation(f"one end: {replica.name} emitted {kind} for unknown {rid}")
            for rank in range(len(replica.ranks)):
                key = (side, rank)
                prev = req.ends.get(key)
                if kind == "Bootstrapped":
                    if prev is not None:
                        raise Violation(f"one end: {replica.name} rank {rank}: Bootstrapped for {rid} after {prev}")
                    req.ends[key] = "Bootstrapped"
                elif prev not in (None, "Bootstrapped"):
                    raise Violation(f"one end: {replica.name} rank {rank}: {kind} for {rid} after {prev}")
                else:
                    req.ends[key] = kind

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

    @property
    def lossless(self) -> bool:
        """Nothing that carries a request's end from one side to the other is lost or held in this run
        (frames dropped or cut, processes paused, look-ups failing, inputs refused: then a timer is a fair
        way to learn of the other side's end)."""
        f = self.faults
        return not (f.drop or f.partition or f.pause or f.lookup_timeout or f.lookup_partial or f.lookup_error
                    or f.lookup_garbage or f.refuse_inputs)

    def _learned_by_timer(self, req: PdRequest, replica: Replica) -> bool:
        """Whether ``replica``'s side of a failed request failed by the table's own timers: no rank's engine
        failed it first (a frame, a verdict, a refusal all do)."""
        return all(req.rid not in r.table.failed_at for r in replica.ranks)

    def _prompt(self, req: PdRequest, replica: Replica) -> None:
        """A side's end; the other side learns of it by a frame, not by its own timer (when no frame is lost)."""
        side = replica.role
        now = self.world.now
        timer = req.ends.get((side, 0)) == "Failed" and self._learned_by_timer(req, replica)
        for r in replica.ranks:
            r.table.failed_at.pop(req.rid, None)
        req.ended_at[side] = (now, timer)
        other = req.ended_at.get("decode" if side == "prefill" else "prefill")
        if other is None or not self.lossless or not timer or side in req.lost:
            return
        if side == "prefill" and req.prefill.epoch > 1 and \
                other[0] < req.prefill.started + TIMERS["dead_after"] + TIMERS["heartbeat"]:
            return  # decode may still have known the killed incarnation (its verdict comes dead_after late): it told that one
        if side == "decode" and not req.announced:
            return  # decode never had pages to announce (its pool was full): its timer is its only way
        if now - other[0] > TIMERS["dead_after"] + 0.1:
            raise Violation(f"prompt: {req.rid}'s {side} side learned only by its own timer that the other side "
                            f"ended {now - other[0]:.3f} s earlier")

    def _touch(self, name: str, start: float, end: float) -> None:
        """A fault befell replica (or encode deployment) ``name`` from ``start``; its effects last until ``end``."""
        self._touched.setdefault(name, []).append((start, end))

    def _collateral(self, req: PdRequest) -> None:
        """A failed request that no fault touched, in a run whose faults befall processes only, is collateral
        damage: some rank's trouble failed another's request."""
        if req.early or req.aborted or req.lost or not set(self.faults.kinds()) <= PROCESS_FAULTS:
            return
        until = self.world.now
        for replica in (req.prefill, req.decode):
            if any(start <= until and req.born <= end for start, end in self._touched.get(replica.name, ())):
                return
        raise Violation(f"collateral: {req.rid} ({req.prefill.name} -> {req.decode.name}) failed though no fault "
                        f"touched its replicas during its life (born {req.born:.3f})")

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

    def _check_landed(self, req: PdRequest, events: list[list[Any]]) -> None:
        replica = req.decode
        tp = len(replica.ranks)
        for rank, r in enumerate(replica.ranks):
            done = next(e for e in events[rank] if e.rid == req.rid)
            if type(done) is not RemotePrefillDone:
                raise Violation(f"bytes: {req.rid} landed on {r.name} as {type(done).__name__}, not RemotePrefillDone")
            remote = done.remote
            lp = remote.bootstrap_logprob
            same_lp = (lp is None and req.logprob is None) or (lp is not None and req.logprob is not None and (
                lp == req.logprob or (math.isnan(lp) and math.isnan(req.logprob))))
            if remote.bootstrap_token != req.first_token or remote.cached_tokens != req.cached or not same_lp:
                raise Violation(f"bytes: {req.rid} on {r.name} carried {remote}, prefill sent token "
                                f"{req.first_token}, cached {req.cached}, logprob {req.logprob}")
            pb = r.layout.page_bytes[0]
            for pair, page in enumerate(req.d_pages):
                want = self._content(req, rank, tp, pair)
                for b, view in enumerate(r.views):
                    if view[page * pb : (page + 1) * pb] != want[b]:
                        raise Violation(f"bytes: {req.rid} on {r.name}: page {page} buffer {b} is not what prefill sent")

    # -- the fence ---------------------------------------------------------------------------------

    def _granted(self, sink: Any, grant: Any) -> None:
        entry = self._sinks.get(sink)
        if entry is None:
            return
        _, replica, rank, _ = entry
        addr = grant.ranges[0][0]
        if rank.receiver is not None and rank.slots.ctypes.data <= addr < rank.slots.ctypes.data + rank.slots.nbytes:
            slot = (addr - rank.slots.ctypes.data) // (SLOT_ROWS * ROW_BYTES)
            self._grant_owner[(sink, grant.key)] = rank.receiver._slot_owner.get(slot)
            self._slot_grant[(sink, slot)] = grant.key
        elif replica.role == "decode":
            self._grant_owner[(sink, grant.key)] = self._owner[replica][self._page_of(rank, addr)]

    def _page_of(self, rank: SimRank, addr: int) -> int:
        for base, pb in zip(rank.layout.bases, rank.layout.page_bytes):
            if base <= addr < base + pb * PAGES:
                return (addr - base) // pb
        raise Violation(f"fence: address {addr:#x} is not in {rank.name}'s cache")

    def _fence_held(self, replica: Replica, req: PdRequest) -> None:
        """A failed request's pages go back to the scheduler: none of its grants may still be live."""
        for r in replica.ranks:
            for key in r.transport.live_grant_keys():
                if self._grant_owner.get((r.transport, key)) == req.rid:
                    raise Violation(f"fence: {req.rid}'s pages on {r.name} were handed back while its grant {key} "
                                    "was still live")

    def _landed_check(self, sink: Any, writes: list[list[int]], grant: int, src: Any) -> None:
        entry = self._sinks.get(sink)
        if entry is None:
            return
        _, replica, rank, _ = entry
        owner = self._grant_owner.get((sink, grant))
        for _local, remote, _length in writes:
            if rank.receiver is not None and rank.slots.ctypes.data <= remote < rank.slots.ctypes.data + rank.slots.nbytes:
                slot = (remote - rank.slots.ctypes.data) // (SLOT_ROWS * ROW_BYTES)
                if self._slot_grant.get((sink, slot)) != grant or owner is None:
                    # (a failed item's slot stays quarantined, held by nobody, until its grant's revoke is
                    # confirmed: a late write may land there; never once the slot was granted again)
                    now_owner = rank.receiver._slot_owner.get(slot)
                    raise Violation(f"fence: a write through grant {grant} landed in {rank.name}'s slot {slot}, "
                                    f"granted since by grant {self._slot_grant.get((sink, slot))} (held now by "
                                    f"{getattr(now_owner, 'rid', None)}), granted to {getattr(owner, 'rid', None)}")
            elif replica.role == "decode":
                page = self._page_of(rank, remote)
                holder = self._owner[replica][page]
                if owner is None or holder != owner:
                    raise Violation(f"fence: a write through grant {grant} (for {owner}) landed in {rank.name}'s page "
                                    f"{page}, held now by {holder}")

    # -- EPD --------------------------------------------------------------------------------------

    def _new_epd(self) -> None:
        rng = self.world.rng
        prefill = rng.choice([r for r in self.prefill if not r.killed] or [None])
        if prefill is None or prefill.ranks[0].receiver is None:
            return
        images = []
        for _ in range(rng.randint(1, 2)):
            deployment = rng.randrange(len(self.encode))
            images.append((next(self._rooms), rng.randint(1, SLOT_ROWS), deployment))
        rid = f"e{next(self._ids)}"
        req = EpdRequest(rid, images, prefill, self.world.now)
        self._epd[rid] = req
        self._epd_of[prefill][rid] = req
        self.counts["epd"] += 1
        for room, rows, dep in images:  # the encode schedulers: before or after the prefill ranks ask
            self._image_of[room] = req
            self.world.after(rng.random() * 0.03, self._encode_begin, dep, room, rows)
        items = [EmbeddingItem(index=i, host=self.servers[f"E{dep}"][0], port=self.servers[f"E{dep}"][1], room=room,
                               rows=rows) for i, (room, rows, dep) in enumerate(images)]
        for r in prefill.ranks:
            r.call(r.recv_front.stage, rid, items)

    def _encode_begin(self, dep: int, room: int, rows: int) -> None:
        rng = self.world.rng
        for r in self.encode[dep]:
            if not r.killed:
                self._to_begin[r].append((room, rows))
                self._encode_next(r)
        if self.faults.image_fail and rng.random() < self.faults.image_fail:
            self.fault_counts["image_fail"] += 1
            for r in self.encode[dep]:
                self.world.after(rng.random() * 0.02, self._encode_fail, r, room)

    def _encode_next(self, r: SimRank) -> None:
        """An encoder takes its images in the order they came, as send slots free up (first come, first
        served: a scheduler that let a later image take a freed slot could starve an earlier one that
        prefill already asked for, past the encode rank's begin timeout)."""
        waiting, free = self._to_begin[r], self._send_free[r]
        while waiting and free and r.running:  # a paused encoder's scheduler takes none
            self._encode_begin_one(r, *waiting.popleft())

    def _encode_begin_one(self, r: SimRank, room: int, rows: int) -> None:
        req = self._image_of.get(room)
        if req is None or req.lost or len(req.ends) == len(req.prefill.ranks):
            late = self.faults.late_image and self.world.rng.random() < self.faults.late_image
            if not late:
                return  # the router cancels the images of a request that ended before its encoder got to them
            self.fault_counts["late_image"] += 1  # ...or it does not, and the room must still conclude
        if not r.call(r.front.begin, room):
            return  # held by another request, or the rank is full (or it is paused: its scheduler is too)
        slot = self._send_free[r].pop()
        self._room_slot[(r, room)] = slot
        buf = r.buffers[0]
        start = slot * SLOT_ROWS * ROW_BYTES
        buf[start : start + rows * ROW_BYTES] = _rows(room, 0, rows)
        chunk = EmbeddingChunk(room=room, source=buf.ctypes.data + start, rows=rows, hidden=HIDDEN, dtype=DTYPE,
                               nbytes=rows * ROW_BYTES)
        self.world.after(self.world.rng.random() * 0.01, r.call, r.front.send, chunk)

    def _encode_fail(self, r: SimRank, room: int) -> None:
        if (r, room) in self._room_slot:
            r.call(r.front.fail, room, "the encoder could not read the image")

    def _concluded_by_now(self, dep: int, room: int, rid: str) -> None:
        """A failed request's images are concluded on their encode ranks soon after (not at their park timeout)."""
        for r in self.encode[dep]:
            if r.running and (r, room) in self._room_slot:
                raise Violation(f"prompt: {rid} failed on prefill, yet {r.name} still holds its image's room {room} "
                                f"{TIMERS['dead_after'] + 0.1:g} s later")

    def _encode_round(self, dep: int) -> None:
        for r in self.encode[dep]:
            for room in r.call(r.front.concluded) or ():
                slot = self._room_slot.pop((r, room), None)
                if slot is not None:
                    start = slot * SLOT_ROWS * ROW_BYTES
                    r.buffers[0][start : start + SLOT_ROWS * ROW_BYTES] = POISON  # reused at once
                    self._send_free[r].append(slot)
            self._encode_next(r)
        self.world.after(ROUND, self._encode_round, dep)

    def _recv_round(self, replica: Replica, now: float) -> None:
        landed = replica.round(now, recv=True)
        failed = replica.recv_failed()
        first = ([r.rid for r in landed[0]], [rid for rid, _ in failed[0]])
        for rank in range(1, len(replica.ranks)):
            mine = ([r.rid for r in landed[rank]], [rid for rid, _ in failed[rank]])
            if mine != first:
                raise Violation(f"agreement: {replica.name} rank {rank} settled {mine}, rank 0 {first}")
        if len({tuple(reason for _, reason in f) for f in failed}) > 1:
            raise Violation(f"agreement: {replica.name} ranks report different reasons: {failed}")
        for rank, r in enumerate(replica.ranks):
            r.call(r.recv_front.after_round, landed[rank], failed[rank])
            released = []
            for landed_request in landed[rank]:
                req = self._epd[landed_request.rid]
                for item in landed_request.items:
                    if item.slot is None:
                        continue
                    room, rows, _dep = req.images[item.index]
                    start, count = shard(rows, rank, len(replica.ranks), self.shape.shard_rows)
                    if (item.row_start, item.row_count) != (start, count):
                        raise Violation(f"bytes: {req.rid} item {item.index} on {r.name} got rows "
                                        f"[{item.row_start}, +{item.row_count}), its share is [{start}, +{count})")
                    base = item.slot * SLOT_ROWS * ROW_BYTES
                    got = r.slots[base : base + count * ROW_BYTES]
                    if not np.array_equal(got, _rows(room, start, count)):
                        raise Violation(f"bytes: {req.rid} item {item.index} on {r.name}: its rows are not encode's")
                    released.append(item.slot)
            if released:
                r.call(r.recv_front.release, released)
        for kind, names in (("landed", first[0]), ("failed", first[1])):
            for rid in names:
                req = self._epd[rid]
                for rank in range(len(replica.ranks)):
                    if rank in req.ends:
                        raise Violation(f"one end: {rid} {kind} on {replica.name} rank {rank} after {req.ends[rank]}")
                    req.ends[rank] = kind
                self._epd_of[replica].pop(rid, None)
                req.ended_at = self.world.now
                if kind == "failed" and self.lossless:
                    for room, _nrows, dep in req.images:
                        if self._restarting_encoders(dep):
                            continue  # its prefill ranks may have asked the killed incarnation: its timers conclude it
                        self.world.after(TIMERS["dead_after"] + 0.1, self._concluded_by_now, dep, room, rid)
                self.counts["lifecycles"] += 1
                self.counts[f"epd_{kind}"] += 1
                if not self.faults.any() and kind == "failed":
                    raise Violation(f"liveness: EPD {rid} failed in a run without faults: {failed[0]}")

    # -- faults ------------------------------------------------------------------------------------

    def _fault_loop(self) -> None:
        world, f = self.world, self.faults
        if world.now >= self.faults_until:
            return
        step = 0.05
        rng = world.rng
        ranks = [r for rep in self.prefill + self.decode if not rep.killed for r in rep.ranks] + \
                [r for dep in self.encode for r in dep if not r.killed]
        if f.partition and rng.random() < f.partition * step and len(ranks) > 1:
            a, b = rng.sample(ranks, 2)
            link = frozenset((a.endpoint, b.endpoint))
            self.planes.network.cut.add(link)
            self.fault_counts["partition"] += 1
            world.after(rng.choice([0.1, 1.0]), self.planes.network.cut.discard, link)
        if f.pause and rng.random() < f.pause * step and ranks:
            r = rng.choice(ranks)
            if not r.paused:
                r.pause()
                self.fault_counts["pause"] += 1
                length = rng.choice([0.05, 0.3, 1.0])
                world.after(length, r.resume)
                self._touch(r.name.split(".")[0], world.now, world.now + length + self._aftermath)
        if f.kill and rng.random() < f.kill * step:
            self._kill_one()
        if f.stall and rng.random() < f.stall * step:
            replica = rng.choice(self.prefill + self.decode)
            replica.stalled_until = world.now + rng.choice([0.2, 0.8])  # type: ignore[attr-defined]
            self.fault_counts["stall"] += 1
            self._touch(replica.name, world.now, replica.stalled_until + self._aftermath)  # type: ignore[attr-defined]
        if f.skew and rng.random() < f.skew * step and ranks:
            r = rng.choice(ranks)
            r.skew += rng.choice([0.05, 0.3, 1.0])  # its clock jumps forward (a VM paused, say)
            self.fault_counts["clock_jump"] += 1
            # every timer of a request alive now may fire that much early
            self._touch(r.name.split(".")[0], world.now - TIMERS["bootstrap"] - TIMERS["waiting"], world.now)
        world.after(step, self._fault_loop)

    @property
    def _aftermath(self) -> float:
        """How long a process's trouble may still fail requests after it ended: its peers' verdicts come
        ``dead_after`` late, and are taken back once it is heard from again."""
        return 2 * TIMERS["dead_after"] + TIMERS["heartbeat"] + 0.1

    def _endpoints(self, ranks: list[SimRank]) -> list[str] | None:
        """Where a restarted incarnation listens: the host:port of the one it replaces, or anew."""
        if self.faults.same_endpoint and self.world.rng.random() < self.faults.same_endpoint:
            self.fault_counts["same_endpoint"] += 1
            return [r.endpoint for r in ranks]
        return None

    def _kill_one(self) -> None:
        rng = self.world.rng
        choices = [rep for rep in self.prefill + self.decode if not rep.killed]
        if self.encode and rng.random() < 0.3:
            dep = rng.randrange(len(self.encode))
            ranks = self.encode[dep]
            if all(not r.killed for r in ranks):
                for r in ranks:
                    r.kill()
                self.fault_counts["kill"] += 1
                later = rng.choice([0.2, 0.8])
                self.world.after(later, self._restart_encoders, dep, ranks[0].epoch + 1, self._endpoints(ranks))
                # (checked dead_after + 0.1 after a failure: the window is shifted by as much)
                self._encode_kills[dep] = (self.world.now, self.world.now + later + 2 * TIMERS["dead_after"] +
                                           TIMERS["heartbeat"] + 0.1)
            return
        if not choices:
            return
        replica = rng.choice(choices)
        replica.killed = True
        for r in replica.ranks:
            r.kill()
        self.fault_counts["kill"] += 1
        side = replica.role
        for req in list(self._by_replica[replica].values()):
            req.lost.add(side)
            if not req.counted and self._pd_done(req):
                req.counted = True
                self.counts["lifecycles"] += 1
                self.counts["pd_lost"] += 1
        self._by_replica[replica].clear()
        for req in list(self._epd_of.get(replica, {}).values()):
            req.lost = True
        if replica in self._epd_of:
            self._epd_of[replica].clear()
        self.world.after(rng.choice([0.2, 0.8]), self._restart, replica, replica.ranks[0].epoch + 1,
                         self._endpoints(replica.ranks))

    def _exit(self) -> None:
        """Admission is over: the decode replicas stall (a long batch) while each prefill replica exits once
        its own side of every request ended; requests that landed on decode must still land there."""
        # long enough that a prefill replica still waiting for its unannounced requests' bootstrap timers
        # exits, and is found dead, while decode has yet to agree on what landed meanwhile
        stall = TIMERS["bootstrap"] + TIMERS["dead_after"] * 2 + 0.2
        for replica in self.decode:
            replica.stalled_until = self.world.now + stall  # type: ignore[attr-defined]
            self._touch(replica.name, self.world.now, replica.stalled_until + self._aftermath)  # type: ignore[attr-defined]
        self.fault_counts["exit"] += 1
        self._exiting()

    def _exiting(self) -> None:
        waiting = False
        for replica in self.prefill:
            if replica.killed:
                continue
            if any("prefill" not in req.ended_at for req in self._by_replica[replica].values()) or \
                    self._epd_of.get(replica):
                waiting = True
                continue
            replica.killed = True
            for r in replica.ranks:
                r.kill()
            for req in self._by_replica[replica].values():
                req.lost.add("prefill")
        if waiting:
            self.world.after(ROUND, self._exiting)

    def _restart(self, old: Replica, epoch: int, endpoints: list[str] | None) -> None:
        index = int(old.name[1:])
        tp = len(old.ranks)
        new = self._make_replica(old.role, index, tp, epoch, endpoints)
        self._touch(new.name, self.world.now, self.world.now + self._aftermath)  # its peers may still name the old one
        group = self.prefill if old.role == "prefill" else self.decode
        group[group.index(old)] = new

    def _restarting_encoders(self, dep: int) -> bool:
        """Whether encode deployment ``dep`` was killed recently enough that a prefill rank may still name its
        killed incarnation (until found dead: ``dead_after`` after its restart at the latest). A failure then
        reaches the incarnation that was asked; the restarted one concludes such rooms by its own timers."""
        window = self._encode_kills.get(dep)
        return window is not None and window[0] <= self.world.now <= window[1]

    def _restart_encoders(self, dep: int, epoch: int, endpoints: list[str] | None) -> None:
        self.encode[dep] = self._make_encoders(dep, len(self.encode[dep]), epoch, endpoints)

    # -- checks ------------------------------------------------------------------------------

    def _bounds(self, replica: Replica) -> None:
        for r in replica.ranks:
            cfg = r.config
            if replica.role == "prefill":
                parked = r.engine.held()["parked"]
                if parked > cfg.max_pending or r.engine.tombstones() > 4 * cfg.max_pending:
                    raise Violation(f"bounds: {r.name} holds {parked} parked, {r.engine.tombstones()} tombstones")

    def _liveness(self) -> None:
        late = [req for req in self._pd.values() if not self._pd_done(req)]
        if late:
            req = late[0]
            raise Violation(f"liveness: {len(late)} PD requests never ended, e.g. {req.rid} "
                            f"(born {req.born:.3f}, ends {req.ends}, lost {req.lost}, {req.prefill.name}->{req.decode.name})")
        open_epd = [req for req in self._epd.values() if not req.lost and len(req.ends) < len(req.prefill.ranks)]
        if open_epd:
            req = open_epd[0]
            raise Violation(f"liveness: {len(open_epd)} EPD requests never ended, e.g. {req.rid} {req.images}")

    def _leaks(self) -> None:
        for rep in self.prefill + self.decode:
            if rep.killed:
                continue
            for r in rep.ranks:
                held = {k: v for k, v in r.engine.held().items() if v}
                front = {k: v for k, v in r.front.diagnostics().items() if v and k != "lately_ended"}
                if len(r.table) or held or r.engine.tombstones() or front:
                    raise Violation(f"leak: {r.name} holds {len(r.table)} requests, {held}, "
                                    f"{r.engine.tombstones()} tombstones; its front {front}")
                if r.transport.live_grants():
                    raise Violation(f"leak: {r.name} still grants {r.transport.live_grants()} ranges")
                if r.performer.parked():
                    raise Violation(f"leak: {r.name} still has {r.performer.parked()} posts parked")
                if r.receiver is not None:
                    held = {k: v for k, v in r.receiver.held().items() if v}
                    if r.receiver.stats["asks"] < r.receiver.stats["landed"]:
                        raise Violation(f"bounds: {r.name} landed more items than it asked for")
                    if held or len(r.recv_table) or r.recv_table.free_slots() != SLOTS:
                        raise Violation(f"leak: {r.name}'s receiver holds {held}, {len(r.recv_table)} requests, "
                                        f"{SLOTS - r.recv_table.free_slots()} slots")
        for dep in self.encode:
            for r in dep:
                if not r.killed and (r.engine.held()["rooms"] or r.front.diagnostics()["begun"]):
                    raise Violation(f"leak: {r.name} still holds {r.engine.held()} rooms, {r.front.diagnostics()}")

    # -- running ------------------------------------------------------------------------------

    def run(self, admit: float = 1.0, faults: float | None = None) -> dict[str, Any]:
        """Admit requests for ``admit`` simulated seconds with faults on (for ``faults`` of them), heal,
        let every request end, let the tombstones expire; check everything; the counts."""
        self._admit_until = admit
        self.faults_until = admit if faults is None else faults
        self.world.after(0.0, self._route)
        self.world.after(0.0, self._fault_loop)
        self.world.run(self.faults_until)
        if self.faults.exit:
            self._exit()
        self._apply_faults(on=False)
        for rank in [r for rep in self.prefill + self.decode for r in rep.ranks] + [r for d in self.encode for r in d]:
            rank.resume()
        drain = TIMERS["bootstrap"] + TIMERS["waiting"] + TIMERS["dead_after"] * 2 + TIMERS["fence"] + 1.0
        self.world.run(max(admit, self.faults_until) + drain)
        self._liveness()
        self.world.run(self.world.now + TIMERS["tombstone"] + TIMERS["park"] + 0.5)
        self._leaks()
        counts = dict(self.counts)
        return {"lifecycles": self.counts["lifecycles"], "counts": counts,
                "faults": dict(self.fault_counts), "fault_kinds": self.faults.kinds(),
                "network": dict(self.planes.network.stats), "fabric": dict(self.planes.fabric.stats),
                "planes": dict(self.planes.stats)}


def _rows(room: int, start: int, count: int) -> np.ndarray:
    """The bytes of rows ``[start, start + count)`` of ``room``'s image (never POISON in every byte)."""
    r = np.arange(start, start + count, dtype=np.int64)[:, None]
    c = np.arange(ROW_BYTES, dtype=np.int64)[None, :]
    return ((room * 13 + r * 7 + c * 3) % 251).astype(np.uint8).reshape(-1)
