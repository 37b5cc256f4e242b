"""One seeded simulation: deployments, schedulers that call the API in drawn orders, faults, invariants.

A ``Shape`` (drawn per seed) says what runs: prefill and decode replicas of tp 1
to 4 (with a ``KvLayout``: heterogeneous tp, MLA; without one: opaque pages and
equal tp), layer-wise hand-overs or whole ones, and encode deployments feeding
the prefill replicas' receivers (sharded or full copies). ``Faults`` (drawn per
seed too: which kinds are on, and how often — swarm testing) say what goes
wrong: control frames delayed, reordered, duplicated, dropped or cut by a
partition; batches delayed or failed at the sink; ranks paused past
``dead_after``; replicas killed and restarted with a newer epoch; schedulers
that hand over before Bootstrapped, abort from either side, fail an image.

The scheduler models are what a serving engine does with the public API,
applied straight to the engines and tables (the peers' scheduler-side rules, as
``pdcore.pd`` and ``pdcore.epd`` apply them): every rank of a replica gets the
same calls in the same order; decode announces the pages it allocated at
``Bootstrapped``; prefill fills its pages and hands them over; both free their
pages at the terminal event and reuse them at once.

Invariants (``Violation`` names what broke; the world's trace says what came
before):

- **fence**: no write lands in a decode page or a receive slot that is not held,
  right then, by the request whose grant the write came through (pages handed
  back, reused, or of a request that ended);
- **agreement**: every rank of a replica gets the same events in the same round;
- **one end**: at most one ``Bootstrapped`` and exactly one terminal event per
  request per rank (none after it);
- **bytes**: a landed request's pages hold exactly what prefill sent, rows what
  encode sent, with the first token, usage and logprob it sent;
- **liveness**: once faults stop, every request ends within its timeouts;
- **no leak**: at the end, tables, engines, grants, slots, parked
  announcements and (after their TTL) tombstones are empty;
- **bounds**: parked announcements and tombstones within their bounds, no
  engine input that raised; and in a run without faults every request lands.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.events import Bootstrapped, Failed
from ..epd.config import ReceiverConfig
from ..epd.types import EmbeddingChunk, EmbeddingItem
from ..kv.layout import KvLayout
from ..kv.pattern import page_content
from ..epd._recv_spec import shard
from .cluster import Planes, Replica, SimRank, configs
from .world import Violation, World

__all__ = ["Shape", "Faults", "Simulation", "draw"]

# Timers (simulated seconds): short, so a request's every path ends quickly in simulated time.
TIMERS = dict(heartbeat=0.1, dead_after=0.5, bootstrap=1.0, waiting=1.5, fence=0.5, tombstone=1.0, park=1.0,
              receive=1.5)
ROUND = 0.008  # a scheduler's round
PAGES = 48  # pages per rank's cache
HIDDEN = 4
DTYPE = "torch.float16"
ROW_BYTES = HIDDEN * 2
SLOTS = 6
SLOT_ROWS = 8
SEND_SLOTS = 32  # an encode rank's send slots; its scheduler begins images first come, first served


@dataclass
class Shape:
    layout: KvLayout | None
    prefill_tp: list[int]
    decode_tp: list[int]
    encode_tp: list[int]  # one deployment each (dp 1); empty: no EPD
    layerwise: bool
    shard_rows: bool
    page_bytes: int = 16  # opaque pages (no layout)

    def describe(self) -> str:
        lay = "opaque" if self.layout is None else f"{self.layout.order} H{self.layout.kv_heads}"
        epd = f" E{self.encode_tp}{' sharded' if self.shard_rows else ' full'}" if self.encode_tp else ""
        return f"P{self.prefill_tp} D{self.decode_tp} {lay}{' layerwise' if self.layerwise else ''}{epd}"


@dataclass
class Faults:
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay: float = 0.0005
    partition: float = 0.0  # partitions per simulated second
    data_error: float = 0.0
    data_jitter: float = 0.0
    pause: float = 0.0  # pauses per simulated second
    kill: float = 0.0  # replica kills (and restarts) per simulated second
    stall: float = 0.0  # scheduler stalls per simulated second (a replica runs no round for a while; its peers go on)
    exit: float = 0.0  # 1: once admission ends, prefill replicas exit when their requests ended, decode stalls
    slow_lookups: float = 0.0  # bootstrap look-ups and connects take up to this long (seconds)
    early_send: float = 0.0  # share of hand-overs before Bootstrapped
    abort: float = 0.0  # share of requests aborted by a scheduler
    image_fail: float = 0.0  # share of images an encode scheduler fails

    def any(self) -> bool:
        return any(v for k, v in vars(self).items() if k != "delay")

    def kinds(self) -> list[str]:
        return [k for k, v in vars(self).items() if v and k != "delay"]


#: Each fault kind a seed may switch on, in the order the seed draws them: the chance it is on, and the
#: rates it then draws one of (None: on at 1.0, no draw). Image failures need an encode stage.
_FAULT_DRAWS: tuple[tuple[str, float, tuple[float, ...] | None], ...] = (
    ("drop", 0.4, (0.001, 0.01, 0.05)),
    ("duplicate", 0.3, (0.005, 0.05)),
    ("reorder", 0.3, (0.01, 0.1)),
    ("delay", 0.3, (0.002, 0.01)),
    ("partition", 0.25, (0.5, 2.0)),
    ("data_error", 0.3, (0.005, 0.05)),
    ("data_jitter", 0.3, (0.002, 0.02)),
    ("pause", 0.3, (0.5, 2.0)),
    ("kill", 0.2, (0.3, 1.0)),
    ("stall", 0.25, (1.0, 4.0)),
    ("exit", 0.15, None),
    ("slow_lookups", 0.3, (0.01, 0.05)),
    ("early_send", 0.25, (0.01, 0.1)),
    ("abort", 0.3, (0.01, 0.1)),
    ("image_fail", 0.3, (0.02, 0.2)),
)


def draw(seed: int, world: World, *, scale: int = 0) -> tuple[Shape, Faults]:
    """The seed's deployment and faults (each kind on with some chance, at a drawn rate)."""
    rng = world.rng
    layout: KvLayout | None = None
    if rng.random() < 0.75:
        order = rng.choice(["hnd", "nhd", "mla"])
        heads = 1 if order == "mla" else rng.choice([1, 2, 4])
        layout = KvLayout(order=order, kv_heads=heads, head_bytes=4, page_tokens=2, layers=rng.choice([1, 2]))
    tps = [1, 2, 4] if layout is not None else [rng.choice([1, 2])]
    n_p = scale or rng.choice([1, 1, 2])
    n_d = scale or rng.choice([1, 1, 2])
    prefill_tp = [rng.choice(tps) for _ in range(n_p)] if not scale else [1] * n_p
    decode_tp = [rng.choice(tps) for _ in range(n_d)] if not scale else [1] * n_d
    encode_tp: list[int] = []
    if not scale and rng.random() < 0.5:
        common = min(prefill_tp)
        encode_tp = [rng.choice([t for t in (1, 2, 4) if t <= common and common % t == 0 and
                                 all(p % t == 0 for p in prefill_tp)]) for _ in range(rng.choice([1, 2]))]
    shape = Shape(layout, prefill_tp, decode_tp, encode_tp, layerwise=rng.random() < 0.3, shard_rows=rng.random() < 0.5)
    f = Faults()
    if rng.random() < 0.15:
        return shape, f  # a clean run: every request must land
    for name, chance, rates in _FAULT_DRAWS:
        if rng.random() < chance and (name != "image_fail" or encode_tp):
            setattr(f, name, 1.0 if rates is None else rng.choice(rates))
    return shape, f


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
    sent: bool = False
    announced: bool = False
    ends: dict[tuple[str, int], str] = field(default_factory=dict)  # (side, rank) -> event name
    layer: int = 0
    lost: set[str] = field(default_factory=set)  # sides whose replica was killed: no end owed there
    early: bool = False
    aborted: bool = False
    faultless: bool = True
    counted: bool = False
    ended_at: dict[str, tuple[float, str]] = field(default_factory=dict)  # side -> (when, reason) of its end
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
        self._apply_faults(on=True)
        if self.faults.slow_lookups:
            self.planes.lookup_delay = self.planes.connect_delay = self.faults.slow_lookups * self.world.rng.random()
        self.planes.fabric.on_land = self._landed_check
        self.planes.fabric.on_grant = self._granted
        self._sinks: dict[Any, tuple[str, Replica, SimRank, int]] = {}  # transport -> (kind, replica, rank, index)
        self._grant_owner: dict[tuple[Any, int], Any] = {}
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
        self._contents: dict[tuple[int, int, int, int], np.ndarray] = {}
        self._rooms = iter(range(1000, 1 << 40))
        self._ids = iter(range(1 << 40))
        self.counts: Counter[str] = Counter()
        self.fault_counts: Counter[str] = Counter()
        self.faults_until = 0.0
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
        return lambda rank: [np.zeros(n * pb, np.uint8) for _ in range(nbuf)]

    def _make_replica(self, role: str, index: int, tp: int, epoch: int) -> Replica:
        name = f"{role[0].upper()}{index}"
        server = self.servers.setdefault(name, (f"10.9.{index}.{1 + 'pde'.index(role[0])}", 9000 + index))
        cfgs = configs(role, tp, self._buffers(tp, PAGES), page_bytes=self._page_bytes(tp), num_pages=PAGES,
                       kv_layout=self.shape.layout, knobs=self._knobs(role), server=server)
        receiver = None
        if role == "prefill" and self.shape.encode_tp:
            receiver = ReceiverConfig(slots=SLOTS, slot_rows=SLOT_ROWS, hidden=HIDDEN, dtype=DTYPE,
                                      shard_rows=self.shape.shard_rows, timeout=TIMERS["receive"])
        replica = Replica(name, role, [], server if role != "decode" else None, started=self.world.now)
        replica.epoch = epoch
        for rank, cfg in enumerate(cfgs):
            landed: dict[str, Any] = {}
            r = SimRank(self.planes, role, f"{name}.{rank}", cfg, epoch=epoch, buffers=cfg.kv_buffers,
                        receiver=receiver, deliver=lambda kind, key, value, d=landed: d.__setitem__(key, value))
            r.landed = landed  # type: ignore[attr-defined]
            replica.ranks.append(r)
            self._sinks[r.transport] = ("kv", replica, r, rank)
        if role == "prefill":
            layout = {"page_bytes": list(replica.ranks[0].layout.page_bytes), "num_pages": PAGES}
            if self.shape.layout is not None:
                layout["kv"] = self.shape.layout.to_json()
            for r in replica.ranks:
                r.register_with(server, layout)
            self._p_pool[replica] = list(range(PAGES))
            self._by_replica[replica] = {}
            self._epd_of[replica] = {}
        else:
            self._d_pool[replica] = list(range(PAGES))
            self._owner[replica] = [None] * PAGES
            self._by_replica[replica] = {}
        self.world.after(ROUND * self.world.rng.random(), self._round, replica)
        return replica

    def _make_encoders(self, index: int, tp: int, epoch: int) -> list[SimRank]:
        name = f"E{index}"
        server = self.servers.setdefault(name, (f"10.9.{index}.3", 9500 + index))
        ranks = []
        nbytes = SEND_SLOTS * SLOT_ROWS * ROW_BYTES
        cfgs = configs("encode", tp, lambda rank: [np.zeros(nbytes, np.uint8)], page_bytes=0, num_pages=0,
                       kv_layout=None, knobs=self._knobs("encode"), server=server)
        for rank, cfg in enumerate(cfgs):
            concluded: list[int] = []
            r = SimRank(self.planes, "encode", f"{name}.{rank}", cfg, epoch=epoch, buffers=cfg.send_buffers,
                        deliver=lambda kind, key, value, c=concluded: c.append(key))
            r.concluded = concluded  # type: ignore[attr-defined]
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
        net, fab = self.planes.network.faults, self.planes.fabric.faults
        net.drop, net.duplicate, net.reorder, net.delay = f.drop, f.duplicate, f.reorder, f.delay
        fab.error, fab.jitter = f.data_error, f.data_jitter
        if not on:
            self.planes.network.cut.clear()

    # -- the router ---------------------------------------------------------------------------

    def _route(self) -> None:
        world = self.world
        if world.now < self._admit_until:
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
        self.world.after(0.0 if order < 0.5 else gap, self._register, prefill, req)
        self.world.after(0.0 if order >= 0.5 else gap, self._register, decode, req)

    def _register(self, replica: Replica, req: PdRequest) -> None:
        if replica.killed or replica not in (req.prefill, req.decode):
            return
        now = self.world.now
        server = self.servers[req.prefill.name]
        for r in replica.ranks:
            r.table.register(req.rid, now)
            if replica.role == "prefill":
                r.input(r.engine.register, req.rid, req.room)
            else:
                r.input(r.engine.register, req.rid, req.room, server, None)
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
            r.input(r.engine.abort_room, req.rid, req.room)

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
            events = replica.round(now)
            self._same_events(replica, events)
            for rank, evs in zip(replica.ranks, events):
                fencing = rank.table.take_fencing()
                if fencing:
                    rank.input(rank.engine.fence, fencing)
                if any(type(e) is not Bootstrapped for e in evs):
                    rank.input(rank.engine.settled, evs)
            for event in events[0]:
                self._pd_event(replica, event)
            if replica.role == "prefill" and replica.ranks[0].receiver is not None:
                self._recv_round(replica, now)
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

    def _pd_event(self, replica: Replica, event: Any) -> None:
        req = self._pd[event.rid]
        kind = type(event)
        if kind is not Bootstrapped:
            self._prompt(req, replica.role, getattr(event, "reason", ""))
            if kind is Failed and replica.role == "decode" and "peer lost" in event.reason and \
                    all(req.rid in r.landed for r in replica.ranks):  # type: ignore[attr-defined]
                raise Violation(f"liveness: {req.rid} landed on {replica.name} and then failed because its prefill "
                                f"rank went away: {event.reason}")
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
            for p in req.d_pages:
                owner[p] = None
        else:  # RemotePrefillDone (the table's Succeeded)
            self._check_landed(req)
            for p in req.d_pages:
                owner[p] = None
        self._d_pool[replica].extend(req.d_pages)
        req.d_pages = []
        self._by_replica[replica].pop(req.rid, None)
        self._ended(req)

    @property
    def lossless(self) -> bool:
        """No frame is lost or held in this run (drops, partitions and pauses are what make a timer a fair
        way to learn of the other side's end)."""
        return not (self.faults.drop or self.faults.partition or self.faults.pause)

    def _prompt(self, req: PdRequest, side: str, reason: str) -> None:
        """A side's end; the other side learns of it by a frame, not by its own timer (when no frame is lost)."""
        now = self.world.now
        req.ended_at[side] = (now, reason)
        other = req.ended_at.get("decode" if side == "prefill" else "prefill")
        told = reason.startswith(("prefill failed the room", "aborted by decode"))  # by a frame, naming the cause
        if other is None or not self.lossless or "timeout after" not in reason or told:
            return
        if "peer lost" in other[1] or "found dead" in other[1]:
            return  # the other side lost contact (a killed incarnation): there was nobody to tell it
        if side == "prefill" and req.prefill.epoch > 1 and \
                other[0] < req.prefill.started + TIMERS["dead_after"] + TIMERS["heartbeat"]:
            return  # decode may still have known the killed incarnation (its verdict comes dead_after late): it told that one
        if side == "decode" and not req.announced:
            return  # decode never had pages to announce (its pool was full): its timer is its only way
        if now - other[0] > TIMERS["dead_after"] + 0.1:
            raise Violation(f"liveness: {req.rid}'s {side} side learned only by its own timer ({reason}) that the "
                            f"other side ended {now - other[0]:.3f} s earlier ({other[1]})")

    def _ended(self, req: PdRequest) -> None:
        if not req.counted and self._pd_done(req):
            req.counted = True
            self.counts["lifecycles"] += 1
            self.counts["pd_landed" if req.ends.get(("decode", 0)) == "Succeeded" else "pd_failed"] += 1
            if req.faultless and not self.faults.any() and req.ends.get(("decode", 0)) != "Succeeded":
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
        pool = self._d_pool[replica]
        if len(pool) < req.npages:
            self.world.after(ROUND, self._announce, req)  # full: it waits (its waiting timeout bounds it)
            return
        if req.rid not in self._by_replica[replica] or replica.killed:
            return
        req.d_pages = [pool.pop() for _ in range(req.npages)]
        owner = self._owner[replica]
        for p in req.d_pages:
            owner[p] = req.rid
        req.announced = True
        for r in replica.ranks:
            r.input(r.engine.announce, req.rid, tuple(req.d_pages), 0)

    def _hand_over(self, req: PdRequest) -> None:
        replica = req.prefill
        if replica.killed or req.rid not in self._by_replica[replica] or replica.ranks[0].killed:
            return
        req.sent = True
        self._fill(req)
        pages = np.asarray(req.p_pages, np.int64)
        if not self.shape.layerwise:
            self._finish(req, pages)
            return
        for r in replica.ranks:
            r.input(r.engine.hand_over, req.rid, pages, None, None)
        self._layers(req)

    def _layers(self, req: PdRequest) -> None:
        replica = req.prefill
        if replica.killed or req.rid not in self._by_replica[replica]:
            return
        layers = self.shape.layout.layers if self.shape.layout is not None else 1
        req.layer += 1
        last = req.layer >= layers
        if last:
            self._finish(req, None)
            return
        for r in replica.ranks:
            r.input(r.engine.hand_over, req.rid, None, req.layer, None)
        self.world.after(ROUND, self._layers, req)

    def _finish(self, req: PdRequest, pages: np.ndarray | None) -> None:
        """The finishing hand-over as ``PrefillPeer`` makes it: one ``hand_over_used`` input carrying the usage
        the scheduler recorded before it (None when it recorded none)."""
        usage = (req.cached, req.logprob) if req.usage else None
        for r in req.prefill.ranks:
            r.input(r.engine.hand_over_used, req.rid, pages, None, (req.first_token, None), usage)

    # -- what the pages hold -------------------------------------------------------------------

    def _content(self, req: PdRequest, rank: int, tp: int, pair: int) -> np.ndarray:
        key = (req.seed, rank, tp, pair)
        got = self._contents.get(key)
        if got is None:
            got = self._contents[key] = self._compute(req, rank, tp, pair)
            if len(self._contents) > 4096:
                self._contents.clear()
        return got

    def _compute(self, req: PdRequest, rank: int, tp: int, pair: int) -> np.ndarray:
        layout = self.shape.layout
        if layout is None:
            pb = self.shape.page_bytes
            return np.array([[(req.seed * 31 + b * 7 + pair) % 251] * pb for b in range(2)], np.uint8)
        first, count = layout.heads(rank, tp)
        return page_content(layout, req.seed, first, count, pair)

    def _fill(self, req: PdRequest) -> None:
        replica = req.prefill
        tp = len(replica.ranks)
        for rank, r in enumerate(replica.ranks):
            pb = r.layout.page_bytes[0]
            for pair, page in enumerate(req.p_pages):
                content = self._content(req, rank, tp, pair)
                for b, buf in enumerate(r.buffers):
                    buf[page * pb : (page + 1) * pb] = content[b]

    def _check_landed(self, req: PdRequest) -> None:
        replica = req.decode
        tp = len(replica.ranks)
        for rank, r in enumerate(replica.ranks):
            remote = r.landed.pop(req.rid, None)  # type: ignore[attr-defined]
            if remote is None:
                raise Violation(f"bytes: {req.rid} landed on {r.name} without its first token")
            lp = remote.bootstrap_logprob
            same_lp = (lp is None and req.logprob is None) or (lp is not None and req.logprob is not None and (
                lp == req.logprob or (math.isnan(lp) and math.isnan(req.logprob))))
            if remote.bootstrap_token != req.first_token or remote.cached_tokens != req.cached or not same_lp:
                raise Violation(f"bytes: {req.rid} on {r.name} carried {remote}, prefill sent token "
                                f"{req.first_token}, cached {req.cached}, logprob {req.logprob}")
            pb = r.layout.page_bytes[0]
            for pair, page in enumerate(req.d_pages):
                want = self._content(req, rank, tp, pair)
                for b, buf in enumerate(r.buffers):
                    if not np.array_equal(buf[page * pb : (page + 1) * pb], want[b]):
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
        elif replica.role == "decode":
            self._grant_owner[(sink, grant.key)] = self._owner[replica][self._page_of(rank, addr)]

    def _page_of(self, rank: SimRank, addr: int) -> int:
        for base, pb in zip(rank.layout.bases, rank.layout.page_bytes):
            if base <= addr < base + pb * PAGES:
                return (addr - base) // pb
        raise Violation(f"fence: address {addr:#x} is not in {rank.name}'s cache")

    def _landed_check(self, sink: Any, rows: np.ndarray, grant: int, src: Any) -> None:
        entry = self._sinks.get(sink)
        if entry is None:
            return
        _, replica, rank, _ = entry
        owner = self._grant_owner.get((sink, grant))
        for _local, remote, _length in rows.tolist():
            if rank.receiver is not None and rank.slots.ctypes.data <= remote < rank.slots.ctypes.data + rank.slots.nbytes:
                slot = (remote - rank.slots.ctypes.data) // (SLOT_ROWS * ROW_BYTES)
                now_owner = rank.receiver._slot_owner.get(slot)
                if now_owner is not owner or owner is None:
                    raise Violation(f"fence: a write through grant {grant} landed in {rank.name}'s slot {slot}, held "
                                    f"now by {getattr(now_owner, 'rid', None)}, granted to {getattr(owner, 'rid', None)}")
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
        now = self.world.now
        for room, rows, dep in images:  # the encode schedulers: before or after the prefill ranks ask
            self._image_of[room] = req
            self.world.after(rng.random() * 0.03, self._encode_begin, dep, room, rows)
        items = [EmbeddingItem(index=i, host=self.servers[f"E{dep}"][0], port=self.servers[f"E{dep}"][1], room=room,
                               rows=rows) for i, (room, rows, dep) in enumerate(images)]
        for r in prefill.ranks:
            r.recv_table.stage(rid, items, now)
            r.input(r.receiver.staged, rid, items)

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
        while waiting and free and not r.killed:
            self._encode_begin_one(r, *waiting.popleft())

    def _encode_begin_one(self, r: SimRank, room: int, rows: int) -> None:
        req = self._image_of.get(room)
        if req is None or req.lost or len(req.ends) == len(req.prefill.ranks):
            return  # the router cancels the images of a request that ended before its encoder got to them
        slot = self._send_free[r].pop()
        self._room_slot[(r, room)] = slot
        buf = r.buffers[0]
        start = slot * SLOT_ROWS * ROW_BYTES
        buf[start : start + rows * ROW_BYTES] = _rows(room, 0, rows)
        r.input(r.engine.begin, room)
        chunk = EmbeddingChunk(room=room, source=buf.ctypes.data + start, rows=rows, hidden=HIDDEN, dtype=DTYPE,
                               nbytes=rows * ROW_BYTES)
        self.world.after(self.world.rng.random() * 0.01, r.input, r.engine.send, chunk)

    def _encode_fail(self, r: SimRank, room: int) -> None:
        if (r, room) in self._room_slot:
            r.input(r.engine.fail, room, "the encoder could not read the image")

    def _concluded_by_now(self, dep: int, room: int, rid: str) -> None:
        """A failed request's images are concluded on their encode ranks soon after (not at their park timeout)."""
        for r in self.encode[dep]:
            if r.running and (r, room) in self._room_slot and r.engine._rooms.begun(room):
                raise Violation(f"liveness: {rid} failed on prefill, yet {r.name} still holds its image's room {room} "
                                f"{TIMERS['dead_after'] + 0.1:g} s later")

    def _encode_round(self, dep: int) -> None:
        for r in self.encode[dep]:
            concluded = r.concluded  # type: ignore[attr-defined]
            while concluded:
                room = concluded.pop()
                slot = self._room_slot.pop((r, room), None)
                if slot is not None:
                    start = slot * SLOT_ROWS * ROW_BYTES
                    r.buffers[0][start : start + SLOT_ROWS * ROW_BYTES] = 0xA5  # poison: reused at once
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
            fencing = r.recv_table.take_fencing()
            if landed[rank] or failed[rank] or fencing:
                r.input(r.receiver.settled, [x.rid for x in landed[rank]], list(failed[rank]), fencing)
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
                r.recv_table.release(released)
                r.input(r.receiver.pump)
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
                world.after(rng.choice([0.05, 0.3, 1.0]), r.resume)
        if f.kill and rng.random() < f.kill * step:
            self._kill_one()
        if f.stall and rng.random() < f.stall * step:
            replica = rng.choice(self.prefill + self.decode)
            replica.stalled_until = world.now + rng.choice([0.2, 0.8])  # type: ignore[attr-defined]
            self.fault_counts["stall"] += 1
        world.after(step, self._fault_loop)

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
                self.world.after(later, self._restart_encoders, dep, ranks[0].epoch + 1)
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
        self.world.after(rng.choice([0.2, 0.8]), self._restart, replica, replica.ranks[0].epoch + 1)

    def _exit(self) -> None:
        """Admission is over: the decode replicas stall (a long batch) while each prefill replica exits once
        its own side of every request ended; requests that landed on decode must still land there."""
        for replica in self.decode:
            replica.stalled_until = self.world.now + TIMERS["dead_after"] * 2  # type: ignore[attr-defined]
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

    def _restart(self, old: Replica, epoch: int) -> None:
        index = int(old.name[1:])
        tp = len(old.ranks)
        new = self._make_replica(old.role, index, tp, epoch)
        group = self.prefill if old.role == "prefill" else self.decode
        group[group.index(old)] = new

    def _restarting_encoders(self, dep: int) -> bool:
        """Whether encode deployment ``dep`` was killed recently enough that a prefill rank may still name its
        killed incarnation (until found dead: ``dead_after`` after its restart at the latest). A failure then
        reaches the incarnation that was asked; the restarted one concludes such rooms by its own timers."""
        window = self._encode_kills.get(dep)
        return window is not None and window[0] <= self.world.now <= window[1]

    def _restart_encoders(self, dep: int, epoch: int) -> None:
        self.encode[dep] = self._make_encoders(dep, len(self.encode[dep]), epoch)

    # -- checks ------------------------------------------------------------------------------

    def _bounds(self, replica: Replica) -> None:
        for r in replica.ranks:
            cfg = r.config
            if replica.role == "prefill":
                if len(r.engine._pending) > cfg.max_pending or r.engine.tombstones() > 4 * cfg.max_pending:
                    raise Violation(f"bounds: {r.name} holds {len(r.engine._pending)} parked, "
                                    f"{r.engine.tombstones()} tombstones")

    def _check(self) -> None:
        if self.planes.work_errors:
            raise Violation(f"bounds: an engine input raised ({self.planes.work_errors}; see the log)")

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
                if len(r.table) or held or r.engine.tombstones():
                    raise Violation(f"leak: {r.name} holds {len(r.table)} requests, {held}, "
                                    f"{r.engine.tombstones()} tombstones")
                if r.transport.live_grants():
                    raise Violation(f"leak: {r.name} still grants {r.transport.live_grants()} ranges")
                if r.receiver is not None:
                    held = {k: v for k, v in r.receiver.held().items() if v}
                    if r.receiver.stats["asks"] < r.receiver.stats["landed"]:
                        raise Violation(f"bounds: {r.name} landed more items than it asked for")
                    if held or len(r.recv_table) or r.recv_table.free_slots() != SLOTS:
                        raise Violation(f"leak: {r.name}'s receiver holds {held}, {len(r.recv_table)} requests, "
                                        f"{SLOTS - r.recv_table.free_slots()} slots")

        for dep in self.encode:
            for r in dep:
                if not r.killed and r.engine.held()["rooms"]:
                    raise Violation(f"leak: {r.name} still holds {r.engine.held()} rooms")

    # -- running ------------------------------------------------------------------------------

    def run(self, admit: float = 1.0, faults: float | None = None) -> dict[str, Any]:
        """Admit requests for ``admit`` simulated seconds with faults on (for ``faults`` of them), heal,
        let every request end, let the tombstones expire; check everything; the counts."""
        self._admit_until = admit
        self.faults_until = admit if faults is None else faults
        self.world.after(0.0, self._route)
        self.world.after(0.0, self._fault_loop)
        self.world.run(self.faults_until, self._check)
        if self.faults.exit:
            self._exit()
        self._apply_faults(on=False)
        for rank in [r for rep in self.prefill + self.decode for r in rep.ranks] + [r for d in self.encode for r in d]:
            rank.resume()
        drain = TIMERS["bootstrap"] + TIMERS["waiting"] + TIMERS["dead_after"] * 2 + TIMERS["fence"] + 1.0
        self.world.run(max(admit, self.faults_until) + drain, self._check)
        self._liveness()
        self.world.run(self.world.now + TIMERS["tombstone"] + TIMERS["park"] + 0.5, self._check)
        self._leaks()
        return {"lifecycles": self.counts["lifecycles"], "counts": dict(self.counts),
                "faults": dict(self.fault_counts), "fault_kinds": self.faults.kinds(),
                "network": dict(self.planes.network.stats), "fabric": dict(self.planes.fabric.stats)}


def _rows(room: int, start: int, count: int) -> np.ndarray:
    """The bytes of rows ``[start, start + count)`` of ``room``'s image (never 0xA5 in every byte)."""
    r = np.arange(start, start + count, dtype=np.int64)[:, None]
    c = np.arange(ROW_BYTES, dtype=np.int64)[None, :]
    return ((room * 13 + r * 7 + c * 3) % 251).astype(np.uint8).reshape(-1)
