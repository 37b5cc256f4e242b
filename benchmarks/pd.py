"""End-to-end PD transfer benchmark: 1P1D and 2P2D on loopback against the TCP transport floor, and poll().

    python benchmarks/pd.py [--quick] [--json] [--requests N] [--repeats R] [--tp T] ...

Everything below is measured in one run on this machine.

``e2e`` rows: ``pdcore.tools.demo.run`` with ``verify=False`` (page contents are
neither filled nor checked, so only the transfer and the protocol around it
are timed): real processes, one per rank, a bootstrap server per prefill
replica, the prefill and decode peers and their miniature scheduler loops
(each loop iteration sleeps 1 ms, as a forward pass would). ``1P1D`` is one
prefill and one decode replica, ``2P2D`` two of each (request ``i`` goes from
prefill ``i % 2`` to decode ``i % 2``), each replica of ``--tp`` ranks (1 by
default, so no gloo round trip is timed). Requests come from
``demo.make_requests`` (1..``--max-pages`` pages each, uniform);
``--layers`` buffers of ``--page-bytes`` per page, so a page of a request is
``layers x page_bytes`` bytes.

- ``seconds``: from every rank ready to the last request's final event in
  any rank's log; ``run_seconds`` is ``Outcome.seconds`` as ``run()``
  returns it, which also counts the ranks' shutdown (``peer.close()`` and
  process exit) after the last event: ``shutdown_tail_seconds`` is the
  difference, measured as ``time.time()`` when ``run()`` returned minus the
  last event's ``time.time()`` stamp.
- ``e2e_GBps``: bytes landed on the decode side / ``seconds`` (GB = 1e9
  bytes); ``e2e_requests_per_s``: requests / ``seconds``. Medians over
  ``--repeats`` runs.

The floor in the same run (``floor_GBps``): the TCP transport alone, through
its API (``write``, ``completions``), between two processes (a source and a
sink, each with the same ``layers`` registered buffers as a rank's cache),
replaying exactly the writes of the e2e run just before it: the plan records
each request's source and destination pages (``Plan.record_pages``), and the
floor posts, in the prefill's hand-over order, the same coalesced batches the
prefill peer posts (``transport.plan.plan`` per request, one batch per
request), pipelined up to the transport's in-flight bound (``benchmarks/transport.py``'s
helpers time one repeated batch in one registered buffer, so the floor here
has its own small source and sink). For 2P2D the
floor is the two (prefill, decode) pairs in parallel, each its own source
and sink process, timed from the first start to the last completion.
``ratio_e2e_vs_floor`` = e2e GB/s / floor GB/s (medians); the target is
>= 0.8. The floor runs ``--floor-repeats`` times after each e2e run
(interleaved), its median is quoted; ``ratio_per_run`` compares each e2e
run with the floor runs right after it. Every cache, the e2e ranks' and the
floor's, is written once before timing (``Plan.prefault``), so no side pays
first-touch page faults inside the timed part.

Thread hand-offs (``handoffs_per_request``): every rank's takes of inputs from other threads by its
driver thread (the scheduler's calls, control frames, completions, look-up results; what they queued
while the driver worked is one take) plus the frames it handed to its control channel's thread,
summed over the ranks, per request (the transport's internal threads are not counted;
``PeerBase.handoffs``). ``handed_inputs_per_request``: the inputs in those takes.

Control planes (``zmq_GBps``, ``ratio_tcp_vs_zmq``, ``zmq_handoffs_per_request``): every e2e run is on
the default control plane, ``"tcp"`` (its loop on the driver's thread); the same requests run again on
``"zmq"`` (a ZeroMQ I/O thread), both planes in the same run, taking turns.

Control frames per message (``frames_per_message``): every rank's control frames over the
messages that carried them, heartbeats aside (``PeerBase.control_sends``): the frames one peer is
owed in one pass of a control channel's thread share a message, which costs a fraction of a lone
one (``benchmarks/control.py``).

Wake-ups (Linux; ``wakeups_per_request``, ``floor_wakeups_per_request``): the voluntary
context switches of every thread of the rank processes (sampled as the CPU below, per thread)
and of the floor's processes (before and after each floor run), per request. Each is a thread
that went to sleep waiting (a queue, a socket, a timer) and was woken: on this 2-core VM one
costs ~20-30 µs of CPU (a Python thread-to-thread hand-off measured ~21 µs, ``time.sleep(0)``
~30 µs), so they are the part of the per-request CPU that the Python work does not explain.

Per thread (``threads_per_request``, printed as one line per configuration, the busiest first):
the CPU µs and wake-ups of each ``"<process> <thread>"`` of the ranks (``decode tcp-sink``,
``prefill prefill-driver``, ``decode main``: the scheduler's loop), summed over the ``"tcp"``
runs (``benchmarks/_usage.py`` says how threads are named and read).

CPU (Linux): ``e2e_cpu_s_per_GB`` is the user + system CPU of every rank
process (sampled from ``/proc`` every 50 ms, interpolated to the first and
last event, scaled to ``seconds``) per GB moved; ``floor_cpu_s_per_GB`` the
same for the floor's processes (exact, before and after each floor run).
``*_cpu_cores`` = CPU seconds / wall seconds. On a small machine the
throughput ratio follows the CPU ratio (``cpu_ratio_floor_vs_e2e`` = floor
CPU s/GB / e2e CPU s/GB): what the peers, the control channel and the
scheduler loops spend per request competes with the transport's copies. On a
machine loaded from elsewhere the wall-clock ratio drifts (a process with
more threads gets a larger share of a contended CPU); the CPU ratio is the
steadier figure of the two.

Grants (``no_grants_GBps``, ``ratio_grants_vs_none``): after each e2e run the
same requests run again with ``Plan(grants=False)`` (decode's
``unsafe_no_grants``: no grant per announced room, no revoke, no per-write
grant check at the sink); ratio = e2e GB/s with grants / without (medians),
target >= 0.95.

Authentication (``open_GBps``, ``ratio_secret_vs_open``): every e2e run holds
a deployment secret (CURVE on the control channel, signed bootstrap requests,
the data connections' challenge-response), as the demo does; after each, the
same requests run again without a secret. Ratio = GB/s with / without
(medians), target >= 0.97. The poll rows time a peer with a secret and one
without (``open_poll_us``) in the same rounds: the scheduler's round never
touches the secret, so the two should match.

``poll`` rows: the scheduler-thread cost of ``poll()`` with ``--poll-requests``
(8,192) requests in flight: a ``PrefillPeer`` (capacity = that many, started
against an in-process bootstrap server) holding them all, a rotating ~1% of
them changing state every round, as the worker would make them
(``PEERS_CONNECTED`` if not yet bootstrapped, else ``WRITES_LANDED``: a
Bootstrapped or a Succeeded event each), finished requests replaced by new
registrations between rounds (not timed). Beside it, in the same rounds and with the same workload, the bare
gloo agreement round (``Agreement.round`` with ``agreement="group"`` on a bare
``StateTable`` of the same size); they take turns going first. The peers
agree with the default ``agreement="auto"``: at world 2 both ranks share a
host, so their round goes through shared memory and ``peer/bare`` below 1 is
what that saves over gloo. ``world`` 1 is in-process with
``replica=None``; ``world`` 2 is a 2-rank gloo replica in two processes, each
timed call preceded by a barrier. Median µs per call; ``peer_overhead_us`` is
the median over rounds of (peer - bare) in the same round.

``--quick`` (2 e2e runs of 1,000 requests per configuration, 400 poll rounds)
takes about 30 s on an idle 2-core machine; the default (5 runs of 3,000
requests, 2,000 rounds) a few minutes. ``--json`` prints one object
``{"rows": [...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[0] != ROOT:  # ahead of benchmarks/, whose transport.py would shadow the package
    sys.path.insert(0, ROOT)

from benchmarks._pipeline import RunClock, gloo_world, post_pipelined, say  # noqa: E402
from benchmarks._usage import CpuSampler, Usage, add_spent, per_unit, thread_lines  # noqa: E402

TARGET_RATIO = 0.8  # end to end vs its floor, 1P1D and 2P2D
GRANTS_TARGET = 0.95  # grants may cost at most 5% of end-to-end throughput
SECRET_TARGET = 0.97  # authentication may cost at most 3% of end-to-end throughput
SECRET = b"benchmarks/pd.py deployment secret"
CONFIGS = (("1P1D", 1, 1), ("2P2D", 2, 2))


# ----------------------------------------------------------------------------- the transport floor


def _floor_sink(conn: Connection, layers: int, buffer_bytes: int) -> None:
    """A decode rank's cache without the peer: ``layers`` registered buffers behind a TCP transport."""
    import transport

    t = transport.create("tcp", host="127.0.0.1")
    bufs = [np.full(buffer_bytes, 0, np.uint8) for _ in range(layers)]  # resident, like the e2e caches
    regions = [t.register(b) for b in bufs]
    conn.send({"endpoint": t.endpoint(), "bases": [r.addr for r in regions]})
    try:
        conn.recv()  # "stop"
    finally:
        t.close()


def _floor_source(conn: Connection, layers: int, page_bytes: int, num_pages: int, sink: dict[str, Any]) -> None:
    """A prefill rank's cache without the peer: replays a run's batches on command and times them."""
    import transport
    from pdcore.core.deadline import Deadline
    from transport.plan import Layout, plan

    t = transport.create("tcp", host="127.0.0.1")
    bufs = [np.full(num_pages * page_bytes, 0, np.uint8) for _ in range(layers)]
    regions = [t.register(b) for b in bufs]
    peer = t.connect(sink["endpoint"], deadline=Deadline.after(60))
    src = Layout([r.addr for r in regions], [page_bytes] * layers, num_pages)
    dst = Layout(sink["bases"], [page_bytes] * layers, num_pages)
    conn.send("ready")
    batches: list[np.ndarray] = []
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd == "load":  # [(source pages, destination pages)] per request, in hand-over order
                batches = [plan(src, dst, np.asarray(s, np.int64), np.asarray(d, np.int64)) for s, d in arg]
                post_pipelined(t, peer, batches[: min(8, len(batches))], 300, "floor batch completions")  # warm: connection and buffers
                conn.send((sum(int(b[:, 2].sum()) for b in batches), sum(len(b) for b in batches)))
            elif cmd == "go":
                while time.monotonic() < arg:  # start with the other pairs
                    time.sleep(0.0005)
                t0 = time.monotonic()
                post_pipelined(t, peer, batches, 300, "floor batch completions")
                conn.send((t0, time.monotonic()))
    finally:
        t.close()


class Floor:
    """Source/sink process pairs of the bare TCP transport, kept for the whole benchmark."""

    def __init__(self, pairs: int, layers: int, page_bytes: int, num_pages: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.sinks: list[Connection] = []
        self.sources: list[Connection] = []
        for _ in range(pairs):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_floor_sink, args=(b, layers, num_pages * page_bytes), daemon=True)
            p.start()
            self.procs.append(p)
            self.sinks.append(a)
        for conn in self.sinks:
            hello = _recv(conn, 120, "a floor sink")
            a, b = ctx.Pipe()
            p = ctx.Process(target=_floor_source, args=(b, layers, page_bytes, num_pages, hello), daemon=True)
            p.start()
            self.procs.append(p)
            self.sources.append(a)
        for conn in self.sources:
            _recv(conn, 120, "a floor source")
        self.last_wakeups = 0  # the floor processes' wake-ups in the last ``once``

    def load(self, mixes: list[list[tuple[list[int], list[int]]]]) -> tuple[int, int]:
        """Give pair ``i`` the writes of ``mixes[i]``; returns total bytes and writes."""
        if len(mixes) > len(self.sources):
            raise RuntimeError(f"{len(mixes)} (prefill, decode) pairs but {len(self.sources)} floor pairs")
        for conn, mix in zip(self.sources, mixes):
            conn.send(("load", mix))
        got = [_recv(conn, 120, "a floor source (load)") for conn in self.sources[: len(mixes)]]
        self.active = len(mixes)
        return sum(g[0] for g in got), sum(g[1] for g in got)

    def once(self) -> tuple[float, float]:
        """Seconds for the loaded pairs to move their writes, all starting together, and the CPU
        seconds the floor processes spent meanwhile (their wake-ups: ``last_wakeups``)."""
        usage = Usage([p.pid for p in self.procs])
        at = time.monotonic() + 0.05
        for conn in self.sources[: self.active]:
            conn.send(("go", at))
        spans = [_recv(conn, 300, "a floor source (go)") for conn in self.sources[: self.active]]
        cpu, self.last_wakeups = usage.spent()
        return max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans), cpu

    def close(self) -> None:
        for conn in self.sources + self.sinks:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _recv(conn: Connection, timeout: float, who: str) -> Any:
    if not conn.poll(timeout):
        raise RuntimeError(f"{who} did not answer within {timeout:g} s")
    return conn.recv()


# ----------------------------------------------------------------------------- end to end


def e2e_once(
    name: str, prefill: int, decode: int, args: argparse.Namespace, seed: int, exclude: set[int], *,
    grants: bool = True, secret: bytes | None = SECRET, control: str = "tcp",
) -> dict[str, Any]:
    """One ``demo.run``; returns its figures and the writes of every (prefill, decode, rank) pair."""
    from pdcore.tools.demo import Plan, make_requests, run

    requests = make_requests(args.requests, seed=seed, max_pages=args.max_pages, prefill=prefill, decode=decode)
    plan = Plan(
        requests=requests,
        prefill_tp=[args.tp] * prefill,
        decode_tp=[args.tp] * decode,
        layers=args.layers,
        page_bytes=args.page_bytes,
        num_pages=args.num_pages,
        window=args.window,
        verify=False,
        record_pages=True,
        prefault=not args.no_prefault,
        timeout=args.timeout,
        grants=grants,
        secret=secret,
        control=control,
    )
    sampler = CpuSampler(exclude)
    try:
        outcome = run(plan)
        returned = time.time()
    finally:
        sampler.stop()
    ok = sum(r["ok"] for r in outcome.decode.values())
    failed = sum(r["failed"] for r in outcome.decode.values())
    if outcome.errors or ok != len(requests) * args.tp:
        raise RuntimeError(f"{name}: {ok} of {len(requests) * args.tp} transfers ok, {failed} failed, errors {outcome.errors}")
    ranks = list(outcome.decode.values()) + list(outcome.prefill.values())
    logs = [r["log"] for r in ranks]
    last = max(stamp for log in logs for _, _, stamp in log)
    first = min(stamp for log in logs for _, _, stamp in log)
    tail = max(0.0, returned - last)
    seconds = outcome.seconds - tail
    scale = seconds / max(1e-9, last - first)
    nbytes = sum(r["bytes"] for r in outcome.decode.values())
    by_rid = {r.rid: r for r in requests}
    mixes: dict[tuple[int, int, int], list[tuple[list[int], list[int]]]] = {}
    for (p, rank), result in sorted(outcome.prefill.items()):
        for rid, src in result["pages"].items():
            d = by_rid[rid].decode
            mixes.setdefault((p, d, rank), []).append((src, outcome.decode[(d, rank)]["pages"][rid]))
    return {
        "seconds": seconds,
        "run_seconds": outcome.seconds,
        "tail": tail,
        "cpu": sampler.between(first, last) * scale,  # scaled to ``seconds``
        "wakeups": sampler.wakeups_between(first, last) * scale,  # likewise
        "threads": {k: (c * scale, w * scale) for k, (c, w) in sampler.threads_between(first, last).items()},  # likewise
        "bytes": nbytes,
        "requests": len(requests),
        "mixes": [mixes[k] for k in sorted(mixes)],
        # every rank's thread hand-offs (driver inputs from other threads, frames to the channel's thread)
        "handoffs": sum(r["handoffs"] for r in ranks),
        "lane_inputs": sum(r["lane_inputs"] for r in ranks),
        # every rank's control frames and the ZeroMQ messages that carried them (heartbeats aside)
        "frames": sum(r["control_sends"][0] for r in ranks),
        "messages": sum(r["control_sends"][1] for r in ranks),
    }


def bench_e2e(args: argparse.Namespace, floor: Floor, say: Any) -> list[dict[str, Any]]:
    rows = []
    for name, prefill, decode in CONFIGS:
        if name not in args.configs:
            continue
        e2e, floors, tails, runs, cpu, floor_cpu, per_run, bare, open_, handoffs = [], [], [], [], [], [], [], [], [], []
        zmq, zmq_handoffs, handed = [], [], []
        woke, floor_woke, shared = [], [], []
        threads: dict[str, tuple[float, float]] = {}  # every tcp run's, summed
        nbytes = nwrites = 0
        for k in range(args.repeats):
            say(f"{name}: e2e run {k + 1}/{args.repeats} ({args.requests} requests)")
            r = e2e_once(name, prefill, decode, args, seed=k, exclude={p.pid for p in floor.procs})
            fbytes, nwrites = floor.load(r["mixes"])
            if fbytes != r["bytes"]:
                raise RuntimeError(f"{name}: the floor replays {fbytes} bytes, the run moved {r['bytes']}")
            nbytes = r["bytes"]
            e2e.append(r["seconds"])
            cpu.append(r["cpu"])
            tails.append(r["tail"])
            runs.append(r["run_seconds"])
            handoffs.append(r["handoffs"] / r["requests"])
            handed.append(r["lane_inputs"] / r["requests"])
            shared.append(r["frames"] / max(1, r["messages"]))
            woke.append(r["wakeups"] / r["requests"])
            add_spent(threads, r["threads"])
            for _ in range(args.floor_repeats):
                seconds, used = floor.once()
                floors.append(seconds)
                floor_cpu.append(used)
                floor_woke.append(floor.last_wakeups / r["requests"])
            per_run.append(statistics.median(floors[-args.floor_repeats :]) / r["seconds"])
            say(f"{name}: the same run without grants {k + 1}/{args.repeats}")
            bare.append(e2e_once(name, prefill, decode, args, seed=k, exclude={p.pid for p in floor.procs}, grants=False)["seconds"])
            say(f"{name}: the same run without a secret {k + 1}/{args.repeats}")
            open_.append(e2e_once(name, prefill, decode, args, seed=k, exclude={p.pid for p in floor.procs}, secret=None)["seconds"])
            say(f"{name}: the same run on the zmq control plane {k + 1}/{args.repeats}")
            z = e2e_once(name, prefill, decode, args, seed=k, exclude={p.pid for p in floor.procs}, control="zmq")
            zmq.append(z["seconds"])
            zmq_handoffs.append(z["handoffs"] / z["requests"])
            say(f"{name}: e2e {nbytes / r['seconds'] / 1e9:.3f} GB/s, floor {nbytes / statistics.median(floors[-args.floor_repeats:]) / 1e9:.3f} GB/s")
        sec, fsec = statistics.median(e2e), statistics.median(floors)
        rows.append({
            "kind": "e2e",
            "config": name,
            "prefill_replicas": prefill,
            "decode_replicas": decode,
            "tp": args.tp,
            "pairs": len(r["mixes"]),
            "requests": args.requests,
            "bytes": nbytes,
            "writes": nwrites,
            "layers": args.layers,
            "page_bytes": args.page_bytes,
            "max_pages": args.max_pages,
            "window": args.window,
            "runs": args.repeats,
            "floor_runs": len(floors),
            "seconds": round(sec, 4),
            "run_seconds": round(statistics.median(runs), 4),
            "shutdown_tail_seconds": round(statistics.median(tails), 4),
            "e2e_requests_per_s": round(args.requests / sec, 1),
            "e2e_GBps": round(nbytes / sec / 1e9, 4),
            "e2e_GBps_run_seconds": round(nbytes / statistics.median(runs) / 1e9, 4),
            "floor_seconds": round(fsec, 4),
            "floor_requests_per_s": round(args.requests / fsec, 1),
            "floor_GBps": round(nbytes / fsec / 1e9, 4),
            "ratio_e2e_vs_floor": round(fsec / sec, 3),
            "ratio_per_run": [round(x, 3) for x in per_run],
            "no_grants_GBps": round(nbytes / statistics.median(bare) / 1e9, 4),
            "ratio_grants_vs_none": round(statistics.median(bare) / sec, 3),
            "open_GBps": round(nbytes / statistics.median(open_) / 1e9, 4),
            "ratio_secret_vs_open": round(statistics.median(open_) / sec, 3),
            "e2e_cpu_s_per_GB": round(statistics.median(cpu) / (nbytes / 1e9), 3),
            "floor_cpu_s_per_GB": round(statistics.median(floor_cpu) / (nbytes / 1e9), 3),
            "cpu_ratio_floor_vs_e2e": round(statistics.median(floor_cpu) / statistics.median(cpu), 3),
            "e2e_cpu_cores": round(statistics.median(c / s for c, s in zip(cpu, e2e)), 2),
            "floor_cpu_cores": round(statistics.median(c / s for c, s in zip(floor_cpu, floors)), 2),
            "handoffs_per_request": round(statistics.median(handoffs), 1),
            "handed_inputs_per_request": round(statistics.median(handed), 1),
            "zmq_GBps": round(nbytes / statistics.median(zmq) / 1e9, 4),
            "ratio_tcp_vs_zmq": round(statistics.median(zmq) / sec, 3),
            "zmq_handoffs_per_request": round(statistics.median(zmq_handoffs), 1),
            "frames_per_message": round(statistics.median(shared), 2),
            "wakeups_per_request": round(statistics.median(woke), 1),
            "floor_wakeups_per_request": round(statistics.median(floor_woke), 1),
            "threads_per_request": per_unit(threads, args.requests * args.repeats),
            "e2e_seconds_all": [round(s, 4) for s in e2e],
            "floor_seconds_all": [round(s, 4) for s in floors],
        })
    return rows


# ----------------------------------------------------------------------------- poll() with many in flight


def _sync(group: Any) -> None:
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)


def poll_rounds(n: int, rounds: int, group: Any, rank: int, world: int, ports: tuple[int, int]) -> dict[str, Any]:
    """Median µs of ``PrefillPeer.poll`` (with a secret, and without) and of the bare ``Agreement.round``,
    same workload, rotating which goes first. ``ports``: a bootstrap server with ``SECRET``, one without."""
    from pdcore import PrefillConfig, PrefillPeer
    from pdcore.core.agreement import Agreement
    from pdcore.core.table import StateTable

    far = 1e6  # no request times out during the benchmark
    table = StateTable(n, bootstrap_timeout=far, waiting_timeout=far)
    bare = Agreement(table, agreement="group")  # the gloo round the peers (same-host: shared memory) are held against
    peers: dict[str, Any] = {}
    try:
        for name, port, secret in (("peer", ports[0], SECRET), ("open", ports[1], None)):
            peers[name], _ = PrefillPeer.start(
                PrefillConfig(
                    kv_buffers=[np.zeros(16 * 4096, np.uint8)], page_bytes=4096, num_pages=16, capacity=n,
                    tp_size=world, tp_rank=rank, bootstrap_host="127.0.0.1", bootstrap_port=port,
                    bootstrap_timeout=far, waiting_timeout=far, secret=secret,
                )
            )
        load = _PollLoad(n, table, peers)
        times: dict[str, list[float]] = {name: [] for name in load.rids}
        events = 0

        def timed(name: str) -> list[Any]:
            _sync(group)
            t0 = time.perf_counter()
            out = bare.round(time.monotonic(), group) if name == "bare" else peers[name].poll(group)
            times[name].append(time.perf_counter() - t0)
            return out

        order = list(load.rids)
        for k in range(rounds):
            load.move_on()
            first = order[k % len(order)]
            got = {name: timed(name) for name in order[order.index(first):] + order[: order.index(first)]}
            events += len(got["peer"])
            load.admit_in_place(got)
        warm = rounds // 10
        t_peer, t_bare, t_open = (times[name][warm:] for name in ("peer", "bare", "open"))
        return {
            "overhead_us": statistics.median(p - b for p, b in zip(t_peer, t_bare)) * 1e6,
            "peer_us": statistics.median(t_peer) * 1e6,
            "open_us": statistics.median(t_open) * 1e6,
            "bare_us": statistics.median(t_bare) * 1e6,
            "peer_p90_us": float(np.percentile(t_peer, 90)) * 1e6,
            "bare_p90_us": float(np.percentile(t_bare, 90)) * 1e6,
            "events_per_round": events / rounds,
            "changing_per_round": load.per_round,
            "in_flight": peers["peer"].diagnostics()["table"]["tracked"],
        }
    finally:
        for peer in peers.values():
            peer.close()


class _PollLoad:
    """``poll_rounds``' workload, kept alike on each peer and the bare table: ``n`` requests in flight; per round
    1% move on (as the I/O threads would move them: not timed), and the scheduler admits a new request in
    place of each that succeeded (not timed either)."""

    def __init__(self, n: int, table: Any, peers: dict[str, Any]) -> None:
        from pdcore import BootstrapInfo, Succeeded
        from pdcore.core._spec import State, Trigger

        self.info, self.succeeded, self.trigger = BootstrapInfo, Succeeded, Trigger
        self.bootstrapped = State.BOOTSTRAPPED
        self.n, self.table, self.peers = n, table, peers
        self.serial = 0
        self.rids: dict[str, list[str]] = {name: [] for name in (*peers, "bare")}
        for _ in range(n):
            for name, peer in peers.items():
                peer.register(f"req-{self.serial}", BootstrapInfo("127.0.0.1", 1, self.serial))
                self.rids[name].append(f"req-{self.serial}")
            table.register(f"req-{self.serial}", time.monotonic())
            self.rids["bare"].append(f"req-{self.serial}")
            self.serial += 1
        self.per_round = max(1, n // 100)
        self.slots = {name: {rid: i for i, rid in enumerate(r)} for name, r in self.rids.items()}
        self.cursor = 0

    def move_on(self) -> None:
        """The I/O threads' work: the next 1% move on, those already bootstrapped land."""
        trigger, bootstrapped, table = self.trigger, self.bootstrapped, self.table
        for j in range(self.per_round):
            i = (self.cursor + j) % self.n
            for name, peer in self.peers.items():
                rid = self.rids[name][i]
                t = peer.front.table  # the I/O threads' updates, made here (the front's table: the peer's)
                t.update(rid, trigger.WRITES_LANDED if t.agreed(rid) >= bootstrapped else trigger.PEERS_CONNECTED,
                         time.monotonic())
            rid = self.rids["bare"][i]
            table.update(rid, trigger.WRITES_LANDED if table.agreed(rid) >= bootstrapped else trigger.PEERS_CONNECTED, time.monotonic())
        self.cursor += self.per_round

    def admit_in_place(self, got: dict[str, list[Any]]) -> None:
        """The scheduler admits a new request in the slot of each that succeeded."""
        for name, evs in got.items():
            for e in evs:
                if isinstance(e, self.succeeded):
                    i = self.slots[name].pop(e.rid)
                    rid = f"req-{self.serial}"
                    self.serial += 1
                    if name == "bare":
                        self.table.register(rid, time.monotonic())
                    else:
                        self.peers[name].register(rid, self.info("127.0.0.1", 1, self.serial))
                    self.rids[name][i] = rid
                    self.slots[name][rid] = i


def _poll_measure(group: Any, rank: int, world: int, n: int, rounds: int, ports: tuple[int, int]) -> dict[str, Any]:
    return poll_rounds(n, rounds, group, rank, world, ports)


def bench_poll(args: argparse.Namespace, say: Any) -> list[dict[str, Any]]:
    from pdcore.control.bootstrap import BootstrapServer

    rows = []
    for world in (1, 2):
        say(f"poll: {args.poll_requests} in flight, world {world}, {args.rounds} rounds")
        servers = [BootstrapServer(secret=SECRET), BootstrapServer()]
        ports = (servers[0].start(), servers[1].start())
        try:
            if world == 1:
                result = poll_rounds(args.poll_requests, args.rounds, None, 0, 1, ports)
            else:
                result = gloo_world(world, "pdcore-bench-pd-", _poll_measure, args.poll_requests, args.rounds, ports)
                if "error" in result:
                    raise RuntimeError(f"poll benchmark, world {world}: {result['error']}")
        finally:
            for server in servers:
                server.close()
        rows.append({
            "kind": "poll",
            "role": "prefill",
            "world": world,
            "requests": args.poll_requests,
            "in_flight": result["in_flight"],
            "changing_per_round": result["changing_per_round"],
            "events_per_round": round(result["events_per_round"], 1),
            "rounds": args.rounds,
            "peer_poll_us": round(result["peer_us"], 2),
            "bare_round_us": round(result["bare_us"], 2),
            "peer_overhead_us": round(result["overhead_us"], 2),
            "peer_vs_bare": round(result["peer_us"] / result["bare_us"], 3),
            "open_poll_us": round(result["open_us"], 2),
            "secret_vs_open": round(result["peer_us"] / result["open_us"], 3),
            "peer_poll_p90_us": round(result["peer_p90_us"], 2),
            "bare_round_p90_us": round(result["bare_p90_us"], 2),
        })
    return rows


# ----------------------------------------------------------------------------- main


def _args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the defaults that --quick changes filled in."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--quick", action="store_true", help="2 e2e runs per configuration, fewer requests and rounds")
    ap.add_argument("--requests", type=int, default=None, help="requests per e2e run (default 3000, quick 1000)")
    ap.add_argument("--repeats", type=int, default=None, help="e2e runs per configuration (default 5, quick 2)")
    ap.add_argument("--floor-repeats", type=int, default=3, help="floor runs after each e2e run")
    ap.add_argument("--tp", type=int, default=1, help="ranks per replica (prefill and decode alike)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-bytes", type=int, default=32768, help="bytes per page per layer")
    ap.add_argument("--num-pages", type=int, default=512, help="pages per rank's cache")
    ap.add_argument("--max-pages", type=int, default=16, help="pages per request: 1..this, uniform")
    ap.add_argument("--window", type=int, default=32, help="requests a decode rank keeps in flight")
    ap.add_argument("--no-prefault", action="store_true", help="leave the e2e ranks' caches untouched until written")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--poll-requests", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=None, help="poll rounds (default 2000, quick 400)")
    ap.add_argument("--configs", nargs="+", default=[c[0] for c in CONFIGS], choices=[c[0] for c in CONFIGS])
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-poll", action="store_true")
    args = ap.parse_args(argv)
    args.requests = args.requests or (1000 if args.quick else 3000)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.rounds = args.rounds or (400 if args.quick else 2000)
    return args


def _print_e2e(args: argparse.Namespace, e2e: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """The end-to-end table and its targets."""
    print(f"end to end (pdcore.tools.demo.run, verify=False, tp {args.tp}, {args.layers} layers x {args.page_bytes // 1024} KiB "
          f"pages, 1..{args.max_pages} pages/request, window {args.window}) vs the TCP transport on the same batches")
    print(f"{'config':6} {'requests':>8} {'MB':>8} {'writes':>7} {'req/s':>8} {'GB/s':>7} {'floor req/s':>11} "
          f"{'floor GB/s':>10} {'ratio':>6} {'range':>11} {'CPU s/GB':>8} {'floor':>6} {'CPU ratio':>9} {'run GB/s':>9} {'tail s':>7} "
          f"{'no-grant GB/s':>13} {'grants/none':>11} {'open GB/s':>9} {'secret/open':>11} {'hand-offs/req':>13} "
          f"{'inputs/req':>10} {'wake-ups/req':>12} {'floor':>6} {'frames/msg':>10} {'zmq GB/s':>9} {'tcp/zmq':>7} {'zmq hand-offs':>13}")
    for r in e2e:
        print(f"{r['config']:6} {r['requests']:>8} {r['bytes'] / 1e6:>8.0f} {r['writes']:>7} {r['e2e_requests_per_s']:>8.0f} "
              f"{r['e2e_GBps']:>7.3f} {r['floor_requests_per_s']:>11.0f} {r['floor_GBps']:>10.3f} "
              f"{r['ratio_e2e_vs_floor']:>6.2f} {min(r['ratio_per_run']):>5.2f}-{max(r['ratio_per_run']):<5.2f} {r['e2e_cpu_s_per_GB']:>8.2f} {r['floor_cpu_s_per_GB']:>6.2f} {r['cpu_ratio_floor_vs_e2e']:>9.2f} "
              f"{r['e2e_GBps_run_seconds']:>9.3f} {r['shutdown_tail_seconds']:>7.2f} "
              f"{r['no_grants_GBps']:>13.3f} {r['ratio_grants_vs_none']:>11.2f} "
              f"{r['open_GBps']:>9.3f} {r['ratio_secret_vs_open']:>11.2f} {r['handoffs_per_request']:>13.1f} "
              f"{r['handed_inputs_per_request']:>10.1f} {r['wakeups_per_request']:>12.1f} {r['floor_wakeups_per_request']:>6.1f} {r['frames_per_message']:>10.2f} "
              f"{r['zmq_GBps']:>9.3f} {r['ratio_tcp_vs_zmq']:>7.2f} {r['zmq_handoffs_per_request']:>13.1f}")
    for r in e2e:
        print(f"{r['config']} threads: {thread_lines(r['threads_per_request'], 'request')}")
    print(f"target: e2e/floor >= {TARGET_RATIO} -> {'met' if summary['meets_target'] else 'NOT met'}; "
          f"grants/none >= {GRANTS_TARGET} (grants cost <= 5%) -> {'met' if summary['grants_meet_target'] else 'NOT met'}; "
          f"secret/open >= {SECRET_TARGET} (authentication costs <= 3%) -> "
          f"{'met' if summary['secret_meets_target'] else 'NOT met'}")


def _print_polls(args: argparse.Namespace, polls: list[dict[str, Any]]) -> None:
    """The poll() table: the peer's poll against the bare round, with a secret and without."""
    print(f"poll() with {args.poll_requests} requests in flight, ~1% changing per round, median µs ({args.rounds} rounds)")
    print(f"{'world':>5} {'events/round':>12} {'peer poll':>10} {'bare round':>11} {'overhead':>9} {'peer/bare':>10} "
          f"{'open poll':>10} {'secret/open':>12}")
    for r in polls:
        print(f"{r['world']:>5} {r['events_per_round']:>12.1f} {r['peer_poll_us']:>10.1f} {r['bare_round_us']:>11.1f} "
              f"{r['peer_overhead_us']:>9.1f} {r['peer_vs_bare']:>9.2f}x {r['open_poll_us']:>10.1f} {r['secret_vs_open']:>11.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)

    from pdcore.core.table import IMPLEMENTATION
    from transport.plan import IMPLEMENTATION as PLAN_IMPLEMENTATION

    clock = RunClock(args.quick)
    rows: list[dict[str, Any]] = []
    if not args.skip_poll:
        rows += bench_poll(args, say)
    if not args.skip_e2e:
        pairs = max(prefill for name, prefill, _ in CONFIGS if name in args.configs) * args.tp
        say(f"starting {pairs} floor pair(s)")
        floor = Floor(pairs, args.layers, args.page_bytes, args.num_pages)
        try:
            rows += bench_e2e(args, floor, say)
        finally:
            floor.close()
    e2e = [r for r in rows if r["kind"] == "e2e"]
    summary = {
        "table_implementation": IMPLEMENTATION,
        "plan_implementation": PLAN_IMPLEMENTATION,
        "target_ratio_e2e_vs_floor": TARGET_RATIO,
        "min_ratio_e2e_vs_floor": min((r["ratio_e2e_vs_floor"] for r in e2e), default=None),
        "meets_target": all(r["ratio_e2e_vs_floor"] >= TARGET_RATIO for r in e2e) if e2e else None,
        "target_ratio_grants_vs_none": GRANTS_TARGET,
        "grants_meet_target": all(r["ratio_grants_vs_none"] >= GRANTS_TARGET for r in e2e) if e2e else None,
        "target_ratio_secret_vs_open": SECRET_TARGET,
        "secret_meets_target": all(r["ratio_secret_vs_open"] >= SECRET_TARGET for r in e2e) if e2e else None,
        "units": "GBps = 1e9 bytes/s; seconds and µs are medians; e2e seconds run from all ranks ready "
                 "to the last event (run_seconds: as run() returns, shutdown included)",
        "floor": "the TCP transport's write/completions API replaying the e2e run's coalesced batches "
                 "(one per request, hand-over order), pipelined, between two processes per (P, D) pair",
        **clock.fields(),
    }
    if args.json:
        print(json.dumps({"rows": rows, **summary}, indent=1))
        return 0
    if e2e:
        _print_e2e(args, e2e, summary)
    polls = [r for r in rows if r["kind"] == "poll"]
    if polls:
        _print_polls(args, polls)
    print(f"implementation: table {summary['table_implementation']}, plan {summary['plan_implementation']}; "
          f"{summary['seconds']} s (--json for every field)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
