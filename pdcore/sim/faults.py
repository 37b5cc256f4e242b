"""What a seed draws: the deployment (``Shape``) and what goes wrong in it (``Faults``), swarm-style.

Each fault kind is on with some chance per seed, at a rate drawn for that seed
(TigerBeetle's swarm testing: rare combinations get explored instead of one
average mix); about one seed in seven is clean, and there every request must
land. The kinds cover the network (frames dropped, duplicated, reordered,
delayed, partitions), the data plane (batches failed or late at the sink,
data connections that break, sinks that fill up, posts, grants and revokes
refused; memory in a device, staged through host mirrors, and its copies
failing), the bootstrap servers
(look-ups that time out, answer for some ranks only, fail, or carry a garbled
shape), data connects that fail, drivers that refuse inputs, processes
(paused, killed and restarted, on a new or the same host:port), clocks (skewed
per rank, jumping forward), and schedulers (hand-overs before Bootstrapped,
aborts from either side, a prefill abort of a room it never registered, images
failed by encode or begun after their request ended).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..kv.layout import KvLayout
from .world import World

__all__ = ["TIMERS", "Shape", "Faults", "draw", "PROCESS_FAULTS"]

# Timers (simulated seconds): short, so a request's every path ends quickly in simulated time.
TIMERS = dict(heartbeat=0.1, dead_after=0.5, bootstrap=1.0, waiting=1.5, fence=0.5, tombstone=1.0, park=1.0,
              receive=1.5)


@dataclass
class Shape:
    layout: KvLayout | None
    prefill_tp: list[int]
    decode_tp: list[int]
    encode_tp: list[int]  # one deployment each (dp 1); empty: no EPD
    layerwise: bool
    shard_rows: bool
    page_bytes: int = 16  # opaque pages (no layout)
    prefill_dp: bool = False  # the prefill replicas are the DP groups of one deployment (one bootstrap server)
    notes: bool = False  # the transport carries notes (TCP's): a room's success rides its last write

    def describe(self) -> str:
        lay = "opaque" if self.layout is None else f"{self.layout.order} H{self.layout.kv_heads}"
        epd = f" E{self.encode_tp}{' sharded' if self.shard_rows else ' full'}" if self.encode_tp else ""
        dp = " dp" if self.prefill_dp else ""
        notes = " notes" if self.notes else ""
        return f"P{self.prefill_tp}{dp} D{self.decode_tp} {lay}{' layerwise' if self.layerwise else ''}{epd}{notes}"


@dataclass
class Faults:
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay: float = 0.0005
    partition: float = 0.0  # partitions per simulated second
    data_error: float = 0.0
    data_jitter: float = 0.0
    connection_drop: float = 0.0  # share of batches whose data connection breaks (the next write connects again)
    staged: float = 0.0  # on: every rank's memory is device memory its transport stages (not a fault: it stays on)
    copy_error: float = 0.0  # share of copies into device memory that fail (staged runs)
    sink_full: float = 0.0  # on: a connection takes only a few batches in flight (drawn 1..4)
    refuse_post: float = 0.0  # share of writes the transport refuses
    refuse_grant: float = 0.0  # share of grants refused
    refuse_revoke: float = 0.0  # share of revokes that fail (retried)
    lookup_timeout: float = 0.0  # share of look-ups the server does not answer in time
    lookup_partial: float = 0.0  # share of ranks a look-up finds "not registered"
    lookup_error: float = 0.0  # share of look-ups the server fails
    lookup_garbage: float = 0.0  # share of look-ups whose shape is garbled
    connect_error: float = 0.0  # share of data connects that fail
    refuse_inputs: float = 0.0  # share of scheduler calls the driver refuses (full)
    pause: float = 0.0  # pauses per simulated second
    kill: float = 0.0  # replica kills (and restarts) per simulated second
    same_endpoint: float = 0.0  # share of restarts on the host:port of the incarnation they replace
    skew: float = 0.0  # on: every rank's clock is skewed, and jumps forward this often per simulated second
    stall: float = 0.0  # scheduler stalls per simulated second (a replica runs no round for a while; its peers go on)
    exit: float = 0.0  # 1: once admission ends, prefill replicas exit when their requests ended, decode stalls
    slow_lookups: float = 0.0  # bootstrap look-ups and connects take up to this long (seconds)
    early_send: float = 0.0  # share of hand-overs before Bootstrapped
    abort: float = 0.0  # share of requests aborted by a scheduler
    unregistered_abort: float = 0.0  # share of requests prefill never registers, aborting the room instead
    image_fail: float = 0.0  # share of images an encode scheduler fails
    late_image: float = 0.0  # share of images an encode scheduler begins after their request ended

    def any(self) -> bool:
        return any(v for k, v in vars(self).items() if k != "delay")

    def kinds(self) -> list[str]:
        return [k for k, v in vars(self).items() if v and k != "delay"]


#: Each fault kind a seed may switch on, in the order the seed draws them: the chance it is on, and the
#: rates it then draws one of (None: on at 1.0, no draw). Image faults need an encode stage.
_FAULT_DRAWS: tuple[tuple[str, float, tuple[float, ...] | None], ...] = (
    ("drop", 0.4, (0.001, 0.01, 0.05)),
    ("duplicate", 0.3, (0.005, 0.05)),
    ("reorder", 0.3, (0.01, 0.1)),
    ("delay", 0.3, (0.002, 0.01)),
    ("partition", 0.25, (0.5, 2.0)),
    ("data_error", 0.3, (0.005, 0.05)),
    ("data_jitter", 0.3, (0.002, 0.02)),
    ("sink_full", 0.3, None),
    ("refuse_post", 0.15, (0.01, 0.05)),
    ("refuse_grant", 0.15, (0.01, 0.05)),
    ("refuse_revoke", 0.15, (0.05, 0.3)),
    ("lookup_timeout", 0.15, (0.05, 0.3)),
    ("lookup_partial", 0.15, (0.05, 0.3)),
    ("lookup_error", 0.15, (0.02, 0.1)),
    ("lookup_garbage", 0.1, (0.05, 0.2)),
    ("connect_error", 0.15, (0.05, 0.3)),
    ("refuse_inputs", 0.1, (0.005, 0.02)),
    ("pause", 0.3, (0.5, 2.0)),
    ("kill", 0.2, (0.3, 1.0)),
    ("same_endpoint", 0.5, (0.5, 1.0)),
    ("skew", 0.25, (0.2, 1.0)),
    ("stall", 0.25, (1.0, 4.0)),
    ("exit", 0.15, None),
    ("slow_lookups", 0.3, (0.01, 0.05)),
    ("early_send", 0.25, (0.01, 0.1)),
    ("abort", 0.3, (0.01, 0.1)),
    ("unregistered_abort", 0.15, (0.02, 0.1)),
    ("image_fail", 0.3, (0.02, 0.2)),
    ("late_image", 0.2, (0.05, 0.3)),
)
#: kinds drawn from a stream of their own (``_draw_late_kinds``), after the others and never with process faults alone
_LATE_DRAWS: tuple[tuple[str, float, tuple[float, ...]], ...] = (
    ("connection_drop", 0.2, (0.005, 0.05)),
    ("staged", 0.3, (1.0,)),  # the ranks' memory is device memory, staged through host mirrors
    ("copy_error", 0.3, (0.01, 0.05)),  # (only where staged) copies into device memory that fail
)
_NEEDS_ENCODE = ("image_fail", "late_image")
#: the kinds that befall processes only (no frame, batch or look-up goes wrong): a seed may draw from these alone,
#: and then a request no fault touched must land (the simulator's "no collateral" check)
PROCESS_FAULTS = frozenset({"pause", "kill", "same_endpoint", "stall", "skew", "exit", "slow_lookups"})


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
    shape = Shape(layout, prefill_tp, decode_tp, encode_tp, layerwise=rng.random() < 0.3,
                  shard_rows=rng.random() < 0.5)
    # DP groups of one deployment need one layout for all; without a KV layout, one page size: one tp
    shape.prefill_dp = not scale and n_p > 1 and (layout is not None or len(set(prefill_tp)) == 1) and \
        rng.random() < 0.7
    # both completion paths, half the seeds each, from a stream of its own (the world's stream stays the same)
    shape.notes = random.Random(f"notes:{seed}").random() < 0.5
    f = Faults()
    mix = rng.random()
    if mix < 0.15:
        return shape, f  # a clean run: every request must land
    for name, chance, rates in _FAULT_DRAWS:
        if mix < 0.35 and name not in PROCESS_FAULTS:
            continue  # processes in trouble, nothing else: every request they do not touch must land
        if rng.random() < chance and (name not in _NEEDS_ENCODE or encode_tp):
            setattr(f, name, 1.0 if rates is None else rng.choice(rates))
    if mix >= 0.35:
        _draw_late_kinds(seed, f)
    return shape, f


def _draw_late_kinds(seed: int, f: Faults) -> None:
    """Kinds added after the fixed seeds were chosen, drawn from a stream of their own: a seed that draws
    none of them plays out exactly as it did before they existed (the world's stream is untouched)."""
    rng = random.Random(f"late-kinds:{seed}")
    for name, chance, rates in _LATE_DRAWS:
        if rng.random() < chance:
            setattr(f, name, rng.choice(rates))
    if not f.staged:
        f.copy_error = 0.0
