"""One seeded simulation: deployments, schedulers that call the API in drawn orders, faults, invariants.

A ``Shape`` (drawn per seed, ``pdcore.sim.faults``) says what runs: prefill and
decode replicas of tp 1 to 4 (with a ``KvLayout``: heterogeneous tp, MLA;
without one: opaque pages and equal tp), prefill replicas that are DP groups of
one deployment or deployments of their own, layer-wise hand-overs or whole
ones, and encode deployments feeding the prefill replicas' receivers (sharded
or full copies). ``Faults`` (drawn per seed too) say what goes wrong.

``Simulation`` builds the deployments, routes requests and runs a seed; its rooms, one idea each:

- ``pdcore.sim.pd_schedulers``: what prefill's and decode's schedulers do with
  the public API (every call goes to the rank's front, the object a real peer
  drives; every rank of a replica gets the same calls in the same order), and
  the bytes their pages hold;
- ``pdcore.sim.epd_schedulers``: the encoders' schedulers and the prefill
  ranks' receivers;
- ``pdcore.sim.fault_loop``: the drawn faults acted out (partitions, pauses,
  kills and restarts, stalls, clock jumps, the prefill replicas' exit);
- ``pdcore.sim.invariants``: what a run is judged by (fence, agreement, one
  end, bytes, prompt, no collateral, liveness, no leak, bounds);
- ``pdcore.sim.records``: the per-request records and the sizes they share.

The rooms share one object's state (set up in ``Simulation.__init__``) and call
one another in the orders a seed draws: a seed replays only if every draw from
the world's generator comes in the same order, so the rooms split the methods,
not the state.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

import numpy as np

from ..epd.config import ReceiverConfig
from .cluster import Planes, Replica, SimRank, configs
from .epd_schedulers import EpdSchedulers
from .fault_loop import FaultLoop
from .faults import TIMERS, Faults, Shape, draw
from .invariants import Invariants
from .pd_schedulers import PdSchedulers
from .records import HIDDEN, DTYPE, PAGES, POISON, ROUND, ROW_BYTES, SEND_SLOTS, SLOT_ROWS, SLOTS, EpdRequest, PdRequest
from .world import World

__all__ = ["Shape", "Faults", "Simulation", "draw", "TIMERS"]


class Simulation(PdSchedulers, EpdSchedulers, FaultLoop, Invariants):
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
        self.planes.fabric.faults.notes = self.shape.notes  # the deployment's transport, not a fault
        self._apply_faults(on=True)
        if self.faults.slow_lookups:
            self.planes.lookup_delay = self.planes.connect_delay = self.faults.slow_lookups * self.world.rng.random()
        self.planes.fabric.on_land = self._landed_check
        self.planes.fabric.on_grant = self._granted
        self.planes.on_landed = self._delivered_check
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

    # -- building ------------------------------------------------------------------------------

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

    # -- the router ----------------------------------------------------------------------------

    def _route(self) -> None:
        world = self.world
        if world.now >= self._admit_until:
            return
        if self.shape.encode_tp and world.rng.random() < 0.3:
            self._new_epd()
        else:
            self._new_pd()
        world.after(world.rng.expovariate(self.rate), self._route)

    # -- running -------------------------------------------------------------------------------

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
