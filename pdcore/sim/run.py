"""``python -m pdcore simulate``: the role engines under a seeded simulator, seed after seed.

Each seed draws a deployment (prefill, decode and encode replicas of tp 1 to 4;
heterogeneous tp, MLA, layer-wise, EPD shards and full copies) and a mix of
faults, runs the real engines and tables over the simulated planes, and checks
the invariants after every step (``pdcore.sim.invariants`` lists them). A
violation prints its seed and the last steps before it; ``--seed N`` replays
that seed exactly. ``--json`` prints one object: ``lifecycles``,
``lifecycles_per_second``, ``roles``, ``seeds``, ``faults`` (counts by kind),
``violations`` (a list, empty when all held).

``--prefill M --decode N`` runs the control plane at scale instead (tp 1 ranks,
opaque pages; every decode rank talks to every prefill rank): messages per rank
per second when idle (heartbeats at the default 1 s interval) and per request,
and the engines' memory per rank divided by its peers, at 2, 8 and M peers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import tracemalloc
from collections import Counter
from typing import Any

from ..tools.cli import float_range, int_range
from .faults import TIMERS, Faults, Shape
from .workload import Simulation
from .world import Violation

__all__ = ["main", "simulate", "scale"]


def run_seed(seed: int, *, admit: float = 1.0, rate: float = 800.0) -> tuple[Simulation, dict[str, Any] | None, str]:
    """One seed: (the simulation, its counts or None, the violation or '')."""
    sim = Simulation(seed, rate=rate)
    try:
        return sim, sim.run(admit=admit), ""
    except Violation as v:
        return sim, None, str(v)


def _seeds(*, seconds: float | None, seeds: list[int] | None, admit: float, rate: float, first: int, step: int,
           stop_at_violation: bool, started: float) -> dict[str, Any]:
    """One process's share: ``seeds`` in turn, or ``first``, ``first + step``, ... until ``seconds`` after
    ``started``; its part of the report."""
    lifecycles, ran = 0, []
    faults: Counter[str] = Counter()
    roles: set[str] = set()
    violations: list[dict[str, Any]] = []
    seed = first
    todo = list(seeds) if seeds is not None else None
    while True:
        if todo is not None:
            if not todo:
                break
            seed = todo.pop(0)
        elif seconds is not None and time.perf_counter() - started >= seconds:
            break
        sim, out, violation = run_seed(seed, admit=admit, rate=rate)
        ran.append(seed)
        roles.update(["prefill", "decode"] + (["encode", "receiver"] if sim.shape.encode_tp else []))
        faults.update({k: v for k, v in sim.fault_counts.items()})
        for name, n in sim.planes.network.stats.items():
            if name in ("dropped", "duplicated", "reordered", "cut") and n:
                faults[name] += n
        for name in ("errors", "dropped", "refused", "frozen", "posts_refused", "grants_refused", "revokes_refused"):
            if sim.planes.fabric.stats[name]:
                faults[f"data_{name}"] += sim.planes.fabric.stats[name]
        faults.update({k: v for k, v in sim.planes.stats.items() if v})
        if out is not None:
            lifecycles += out["lifecycles"]
        else:
            violations.append({"seed": seed, "violation": violation, "shape": sim.shape.describe(),
                               "faults": sim.faults.kinds(), "trace": list(sim.world.trace)[-12:]})
            if stop_at_violation:
                break
        seed += step
    return {"lifecycles": lifecycles, "ran": ran, "faults": faults, "roles": roles, "violations": violations}


def simulate(*, seconds: float | None = None, seeds: list[int] | None = None, admit: float = 1.0,
             rate: float = 800.0, first: int = 0, stop_at_violation: bool = False, jobs: int = 1) -> dict[str, Any]:
    """Seeds in turn, for ``seconds`` of wall time (or exactly ``seeds``); the report.

    ``jobs`` processes share the seeds (each seed is a world of its own: a process takes every
    ``jobs``-th seed of a timed run, or of ``seeds``); their reports are merged, violations in seed order."""
    started = time.perf_counter()
    shares: list[dict[str, Any]]
    kw = dict(seconds=seconds, admit=admit, rate=rate, stop_at_violation=stop_at_violation, started=started)
    if jobs <= 1:
        shares = [_seeds(seeds=seeds, first=first, step=1, **kw)]  # type: ignore[arg-type]
    else:
        import multiprocessing

        parts = [dict(seeds=None if seeds is None else seeds[k::jobs], first=first + k, step=jobs, **kw)
                 for k in range(jobs)]
        with multiprocessing.get_context("fork").Pool(jobs) as pool:  # forked: the same hash seed (set orders)
            shares = pool.map(_share, parts)
    wall = time.perf_counter() - started
    lifecycles = sum(s["lifecycles"] for s in shares)
    ran = sorted(seed for s in shares for seed in s["ran"])
    faults: Counter[str] = Counter()
    for s in shares:
        faults.update(s["faults"])
    violations = sorted((v for s in shares for v in s["violations"]), key=lambda v: v["seed"])
    return {"lifecycles": lifecycles, "lifecycles_per_second": round(lifecycles / wall, 1) if wall else 0.0,
            "seconds": round(wall, 2), "roles": sorted(set().union(*(s["roles"] for s in shares))),
            "seeds": ran if len(ran) <= 50 else [ran[0], ran[-1]], "seeds_run": len(ran), "jobs": max(1, jobs),
            "faults": dict(sorted(faults.items())), "violations": violations}


def _share(kwargs: dict[str, Any]) -> dict[str, Any]:
    return _seeds(**kwargs)


def scale(prefill: int, decode: int, *, requests: int = 400) -> list[dict[str, Any]]:
    """The control plane at 2, 8 and ``prefill`` peers a side: messages and engine memory per rank."""
    rows = []
    most = max(prefill, decode)
    for n in sorted({k for k in (2, 8, most) if k <= most}):
        p, d = min(n, prefill), min(n, decode)
        shape = Shape(None, [1] * p, [1] * d, [], layerwise=False, shard_rows=False)
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        sim = Simulation(1, shape=shape, faults=Faults(), rate=requests / 1.0, wire_check=False)
        sim._admit_until = 0.0
        for rep in sim.decode:  # every decode rank talks to every prefill rank once: idle traffic at its peak
            for rank in rep.ranks:
                for prefill_rep in sim.prefill:
                    rank.channel.liveness.track(prefill_rep.ranks[0].endpoint, 0.0)
        sim.world.run(2.0)
        idle_beats = sim.planes.network.stats["heartbeats"]
        after = tracemalloc.take_snapshot()
        memory = sum(s.size_diff for s in after.compare_to(before, "filename") if "pdcore" in s.traceback[0].filename)
        tracemalloc.stop()
        sent0 = sim.planes.network.stats["sent"]
        out = sim.run(admit=3.0)
        ranks = p + d
        rows.append({
            "peers": n, "ranks": ranks,
            # heartbeats at the default heartbeat_interval (1 s; the simulation beats every TIMERS["heartbeat"])
            "idle_messages_per_rank_per_second": round(idle_beats / ranks / 2.0 * TIMERS["heartbeat"], 1),
            "messages_per_request": round((sim.planes.network.stats["sent"] - sent0) / max(1, out["counts"].get("pd", 1)), 2),
            "engine_memory_per_peer_bytes": int(memory / ranks / max(1, n)),
            "lifecycles": out["lifecycles"],
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None or sys.argv[1:] == ["simulate", *argv]
    if from_command_line and os.environ.get("PYTHONHASHSEED") != "0":  # set order follows string hashes: fix
        os.environ["PYTHONHASHSEED"] = "0"  # them, so a seed replays the same in every process
        os.execv(sys.executable, [sys.executable, "-m", "pdcore", *sys.argv[1:]])
    p = argparse.ArgumentParser(prog="python -m pdcore simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    seed = int_range(0, (1 << 63) - 1)
    p.add_argument("--seconds", type=float_range(0, 86400, lo_open=True), default=10.0,
                   help="wall seconds of seeds, in (0, 86400] (default 10)")
    p.add_argument("--seed", type=seed, action="append", help="run exactly this seed (repeatable): replays it")
    p.add_argument("--first-seed", type=seed, default=0, help="the first seed of a timed run (default 0)")
    p.add_argument("--admit", type=float_range(0, 60, lo_open=True), default=1.0,
                   help="simulated seconds each seed admits requests, with faults on, in (0, 60] (default 1.0)")
    p.add_argument("--rate", type=float_range(0, 100000, lo_open=True), default=800.0,
                   help="requests per simulated second, in (0, 100000] (default 800)")
    p.add_argument("--prefill", type=int_range(1, 256), help="scale mode: this many prefill peers, 1..256")
    p.add_argument("--decode", type=int_range(1, 256), help="scale mode: this many decode peers, 1..256")
    p.add_argument("--jobs", type=int_range(1, 256), default=os.cpu_count() or 1,
                   help="processes sharing the seeds, 1..256 (default: one per core)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", action="store_true", help="log the engines' warnings")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.CRITICAL)
    if args.prefill or args.decode:
        rows = scale(args.prefill or args.decode, args.decode or args.prefill)
        if args.json:
            print(json.dumps({"scale": rows}))
        else:
            print("peers  ranks  idle msgs/rank/s  msgs/request  engine bytes/peer   (idle: heartbeats at the "
                  "default 1 s interval, every decode rank talking to every prefill rank)")
            for r in rows:
                print(f"{r['peers']:5d}  {r['ranks']:5d}  {r['idle_messages_per_rank_per_second']:16.1f}  "
                      f"{r['messages_per_request']:12.2f}  {r['engine_memory_per_peer_bytes']:17d}")
        return 0
    report = simulate(seconds=None if args.seed else args.seconds, seeds=args.seed, admit=args.admit,
                      rate=args.rate, first=args.first_seed, jobs=1 if args.seed else args.jobs)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"simulate: {report['lifecycles']} lifecycles in {report['seconds']} s "
              f"({report['lifecycles_per_second']}/s, {report['jobs']} processes), {report['seeds_run']} seeds, "
              f"roles {report['roles']}")
        print(f"faults: {report['faults']}")
        for v in report["violations"]:
            print(f"VIOLATION seed {v['seed']} ({v['shape']}; faults {v['faults']}): {v['violation']}")
            print("  " + "\n  ".join(v["trace"]))
            print(f"  replay: python -m pdcore simulate --seed {v['seed']}")
        if not report["violations"]:
            print("simulate: every invariant held")
    return 1 if report["violations"] else 0
