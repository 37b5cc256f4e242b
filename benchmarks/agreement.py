"""Cost of one poll round: pdcore's agreement vs the reference pattern vs the bare all-reduce.

For N in-flight requests and replicas of 1, 2 and 4 real processes (gloo on
loopback), in one run and interleaved so drift hits all three alike:

- library: ``Agreement.round`` over the group (``agreement="group"``): deadline
  fold + vector + gloo all-reduce MIN + events;
- shm: ``Agreement.round`` through shared memory (``agreement="shm"``, every
  rank on this host): the same round with the compiled MIN and barrier over a
  segment instead of gloo;
- reference: N Python objects with ``poll()``, a list comprehension,
  ``torch.tensor(..., dtype=torch.uint8)``, ``all_reduce(MIN)``, ``.tolist()``
  and a Python loop turning agreed values into events;
- floor: the bare ``all_reduce(MIN)`` of a uint8 tensor of N;
- shm_floor: the bare shared-memory exchange (``ShmReducer.allreduce_min``) of
  the table's buffer, without the table's encode and decode.

In the first three, ~1% of the requests change state every round and
finish (Bootstrapped, then Succeeded) a few rounds later, then a new request
takes their place, so events are created every round. Prints median µs per
round (per rank: rank 0's) and the ratios; ``--json`` prints ``{"rows": [...]}``
with ``library_us``, ``shm_us``, ``reference_us`` and ``floor_us`` per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[0] != ROOT:  # ahead of benchmarks/, whose transport.py would shadow the package pdcore imports
    sys.path.insert(0, ROOT)

from benchmarks._pipeline import gloo_world  # noqa: E402

SIZES = (64, 1024, 8192)
WORLDS = (1, 2, 4)


class ReferencePoller:
    """One request as the reference keeps it: an object whose poll() returns its state."""

    __slots__ = ("rid", "value", "emitted")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.value = 1
        self.emitted = 1

    def poll(self) -> int:
        return self.value


def _workload(n: int):
    """Which requests change in round k: a rotating 1% (at least one)."""
    per_round = max(1, n // 100)
    return per_round


def _sync(group, world: int, barrier=None) -> None:
    """Start every rank's timed section together, so no rank times another's untimed work.

    ``barrier``: the shared-memory rows sync through a round of their own (a small
    segment), whose ranks leave within a few µs of each other; gloo's barrier lets
    them go tens of µs apart, which a 30 µs round would count as its own cost.
    """
    if world > 1:
        if barrier is not None:
            barrier()
            return
        import torch.distributed as dist

        dist.barrier(group=group)


def _shm_barrier(group, world: int):
    if world == 1:
        return None
    from pdcore.core.agreement import Agreement
    from pdcore.core.table import StateTable

    agreement = Agreement(StateTable(1), agreement="shm")
    return lambda: agreement.round(0.0, group)


def library_rounds(n: int, group, world: int, mode: str = "group") -> Iterator[float]:
    from pdcore.core._spec import Trigger
    from pdcore.core.agreement import Agreement
    from pdcore.core.table import StateTable

    table = StateTable(n, bootstrap_timeout=1e9, waiting_timeout=1e9)
    agreement = Agreement(table, agreement=mode)
    serial = 0
    for _ in range(n):
        table.register(f"req-{serial}", 0.0)
        serial += 1
    per_round = _workload(n)
    rids = [f"req-{i}" for i in range(n)]
    index = {rid: i for i, rid in enumerate(rids)}
    cursor = 0
    barrier = _shm_barrier(group, world) if mode == "shm" else None
    while True:
        # I/O threads' work (not timed): 1% move on; those already bootstrapped land
        for j in range(per_round):
            rid = rids[(cursor + j) % n]
            table.update(rid, Trigger.WRITES_LANDED if table.agreed(rid) >= 2 else Trigger.PEERS_CONNECTED, 1.0)
        cursor += per_round
        _sync(group, world, barrier)
        t0 = time.perf_counter()
        events = agreement.round(1.0, group if world > 1 else None)
        yield time.perf_counter() - t0
        # the scheduler admits new requests in place of the finished ones (not timed)
        for e in events:
            if type(e).__name__ == "Succeeded":
                i = index.pop(e.rid)
                rids[i] = f"req-{serial}"
                index[rids[i]] = i
                table.register(rids[i], 1.0)
                serial += 1


def reference_rounds(n: int, group, world: int) -> Iterator[float]:
    import torch
    import torch.distributed as dist

    from pdcore.core.events import Bootstrapped, Failed, Succeeded

    pollers = [ReferencePoller(f"req-{i}") for i in range(n)]
    serial = n
    per_round = _workload(n)
    cursor = 0
    while True:
        for j in range(per_round):
            p = pollers[(cursor + j) % len(pollers)]
            p.value = 5 if p.emitted >= 2 else 2
        cursor += per_round
        _sync(group, world)
        t0 = time.perf_counter()
        values = [p.poll() for p in pollers]
        tensor = torch.tensor(values, dtype=torch.uint8)
        if world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
        agreed = tensor.tolist()
        events = []
        done = []
        for i, (p, value) in enumerate(zip(pollers, agreed)):
            if value == p.emitted:
                continue
            if value == 0:
                events.append(Failed(p.rid))
                done.append(i)
                continue
            if p.emitted < 2 <= value:
                events.append(Bootstrapped(p.rid))
            if value == 5:
                events.append(Succeeded(p.rid))
                done.append(i)
            p.emitted = max(p.emitted, value)
        yield time.perf_counter() - t0
        for i in done:
            pollers[i] = ReferencePoller(f"req-{serial}")
            serial += 1


def floor_rounds(n: int, group, world: int) -> Iterator[float]:
    import torch
    import torch.distributed as dist

    tensor = torch.full((n,), 3, dtype=torch.uint8)
    while True:
        _sync(group, world)
        t0 = time.perf_counter()
        if world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
        yield time.perf_counter() - t0


def shm_rounds(n: int, group, world: int) -> Iterator[float]:
    return library_rounds(n, group, world, "shm")


def shm_floor_rounds(n: int, group, world: int) -> Iterator[float]:
    """The bare shared-memory exchange of the same buffer: what ``shm`` pays beyond the table's own work."""
    import numpy as np

    from pdcore.core.agreement import Agreement
    from pdcore.core.table import StateTable

    table = StateTable(n)
    agreement = Agreement(table, agreement="shm")
    agreement.round(0.0, group if world > 1 else None)  # attaches the segment
    reducer = agreement._shm  # the benchmark times the reducer alone, as floor times gloo alone
    buf = np.full(table.buffer.shape, 3, dtype=np.uint8)
    barrier = _shm_barrier(group, world)
    while True:
        _sync(group, world, barrier)
        t0 = time.perf_counter()
        if reducer is not None:
            reducer.allreduce_min(buf)
        yield time.perf_counter() - t0


METHODS = {
    "library": library_rounds,
    "shm": shm_rounds,
    "reference": reference_rounds,
    "floor": floor_rounds,
    "shm_floor": shm_floor_rounds,
}


def measure(world: int, rounds: int, repeats: int, group=None) -> list[dict]:
    """Medians per (N, method); the methods take turns round by round, so noise hits all alike."""
    rows = []
    names = list(METHODS)
    for n in SIZES:
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        gens = {name: fn(n, group, world) for name, fn in METHODS.items()}
        for k in range(rounds * repeats):
            first = k % len(names)
            for name in names[first:] + names[:first]:  # rotate who goes first
                dt = next(gens[name])
                if k >= rounds // 10:  # drop warm-up
                    samples[name].append(dt)
        med = {m: statistics.median(s) * 1e6 for m, s in samples.items()}
        rows.append(
            {
                "world": world,
                "requests": n,
                "library_us": round(med["library"], 2),
                "shm_us": round(med["shm"], 2),
                "reference_us": round(med["reference"], 2),
                "floor_us": round(med["floor"], 2),
                "shm_floor_us": round(med["shm_floor"], 2),
            }
        )
    return rows


def _measure_rank(group, rank: int, world: int, rounds: int, repeats: int) -> list[dict]:
    """``measure`` as a ``gloo_rank`` runs it."""
    return measure(world, rounds, repeats, group)


def run_world(world: int, rounds: int, repeats: int) -> list[dict]:
    if world == 1:
        return measure(1, rounds, repeats)
    rows = gloo_world(world, "pdcore-bench-", _measure_rank, rounds, repeats)
    if isinstance(rows, dict):
        raise RuntimeError(f"agreement benchmark, world {world}: {rows['error']}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: finishes in under 45 s")
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    args = parser.parse_args(argv)
    rounds, repeats = (150, 2) if args.quick else (600, 5)

    from pdcore.core.table import IMPLEMENTATION

    rows = [row for world in args.worlds for row in run_world(world, rounds, repeats)]
    for row in rows:
        row["library_vs_floor"] = round(row["library_us"] / row["floor_us"], 3) if row["world"] > 1 else None
        row["shm_vs_floor"] = round(row["shm_us"] / row["floor_us"], 3) if row["world"] > 1 else None
        row["reference_vs_library"] = round(row["reference_us"] / row["library_us"], 2)
    if args.json:
        print(json.dumps({"implementation": IMPLEMENTATION, "rows": rows}))
        return 0
    print(f"pdcore agreement round, {IMPLEMENTATION} table, median µs per round ({rounds} rounds × {repeats})")
    print(
        f"{'world':>5} {'N':>6} {'library':>9} {'shm':>8} {'reference':>10} {'floor':>8} {'lib/floor':>10} "
        f"{'shm/floor':>10} {'ref/lib':>8} {'shm bare':>9}"
    )
    for r in rows:
        lf = f"{r['library_vs_floor']:.2f}×" if r["library_vs_floor"] is not None else "-"
        sf = f"{r['shm_vs_floor']:.3f}×" if r["shm_vs_floor"] is not None else "-"
        print(
            f"{r['world']:>5} {r['requests']:>6} {r['library_us']:>9.1f} {r['shm_us']:>8.1f} {r['reference_us']:>10.1f} "
            f"{r['floor_us']:>8.1f} {lf:>10} {sf:>10} {r['reference_vs_library']:>7.1f}× {r['shm_floor_us']:>9.1f}"
        )
    print("round cost per rank (µs, median; group = gloo all-reduce, shm = shared memory):")
    for r in rows:
        if r["requests"] in (64, 8192) and r["world"] > 1:
            print(
                f"  world {r['world']} N={r['requests']:>5}: group {r['library_us']:.1f}, shm {r['shm_us']:.1f} "
                f"(bare exchange {r['shm_floor_us']:.1f}; gloo floor {r['floor_us']:.1f})"
            )
    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    for r in rows:
        if r["requests"] == 8192 and r["world"] == 2:
            print(f"target N=8192 world 2: library ≤ 1.15× floor: {r['library_vs_floor']:.2f}× "
                  f"{verdict(r['library_vs_floor'] <= 1.15)}; shm ≤ 0.1× floor and ≤ 30 µs: "
                  f"{r['shm_vs_floor']:.3f}×, {r['shm_us']:.1f} µs {verdict(r['shm_vs_floor'] <= 0.1 and r['shm_us'] <= 30)}")
        if r["requests"] == 8192 and r["world"] == 1:
            print(f"target N=8192 world 1: reference/library ≥ 30×: {r['reference_vs_library']:.1f}× "
                  f"{verdict(r['reference_vs_library'] >= 30)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
