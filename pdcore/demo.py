"""``python -m pdcore demo``: a full PD transfer on loopback, with real processes and real gloo groups.

The main process runs the bootstrap server(s) and watches; every rank of every
replica is its own process running a miniature scheduler loop around its peer:

- decode ranks admit requests (a window at a time), allocate pages when a
  request is ``Bootstrapped``, announce them, and on ``RemotePrefillDone``
  check every byte of every page against what the prefill rank wrote;
- prefill ranks register every request routed to them, and when it is
  ``Bootstrapped`` fill its pages with a pattern only that (request, rank) has,
  record usage and hand the pages to the outbox.

Every rank of a replica sees the same requests in the same order (as a real
scheduler's broadcast guarantees) and logs its events; the run checks that the
logs of a replica's ranks are identical. ``run()`` is also what the end-to-end
tests and ``benchmarks/pd.py`` drive, with fault injection.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import secrets
import sys
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

__all__ = ["Plan", "Request", "make_requests", "run", "main"]


@dataclass(frozen=True)
class Request:
    rid: str
    room: int
    pages: int
    prefill: int  # which prefill replica serves it
    decode: int  # which decode replica receives it


@dataclass
class Plan:
    """A run: replicas, requests, cache geometry, knobs and faults."""

    requests: list[Request]
    prefill_tp: list[int] = field(default_factory=lambda: [2])
    decode_tp: list[int] = field(default_factory=lambda: [2])
    layers: int = 4
    page_bytes: int = 16384
    num_pages: int = 512
    window: int = 32
    transport: str = "tcp"
    timeout: float = 120.0
    heartbeat_interval: float = 0.25
    dead_after: float = 2.5
    bootstrap_timeout: float = 60.0
    waiting_timeout: float = 60.0
    fence_timeout: float = 10.0
    #: replicas to kill: (role, index) -> kill once that many requests are done overall
    kill: dict[tuple[str, int], int] = field(default_factory=dict)
    #: prefill replica index -> rids it aborts (abort_room) instead of registering them
    prefill_abort: dict[int, set[str]] = field(default_factory=dict)
    #: prefill replica index -> rids it registers and aborts (abort_room) once they are Bootstrapped
    #: (the decode rank announced its pages) instead of sending them
    prefill_abort_bootstrapped: dict[int, set[str]] = field(default_factory=dict)
    #: decode replica index -> rids whose KV never comes: decode announces the pages, prefill holds the
    #: request and never sends, so decode's waiting timer (``waiting_timeout``) fails it and decode's abort
    #: fails it on prefill. (Not announcing would time nothing out: Bootstrapped carries no timer.)
    decode_stall: dict[int, set[str]] = field(default_factory=dict)
    #: seconds of "forward pass" per request on a prefill rank: it hands over at most one request per
    #: step (0: as fast as pages allow), so a run can be caught mid-transfer
    prefill_step: float = 0.0
    #: each rank waits (bounded by tombstone_ttl + 2 s) for its tombstones to expire before it reports
    #: its leftovers, so a short ``tombstone_ttl`` shows whether anything outlives its TTL
    await_tombstones: bool = False
    #: fill and check page contents (off for throughput benchmarks: then only the transfer is timed)
    verify: bool = True
    tombstone_ttl: float = 60.0
    #: each rank's result gets "pages": rid -> its page ids (prefill: source pages in hand-over order,
    #: decode: destination pages in announce order), so benchmarks can replay the same writes
    record_pages: bool = False
    #: touch every page of each rank's cache before the rank reports ready, as a resident KV cache is;
    #: otherwise the first write into each decode page also pays its page fault inside the timed run
    prefault: bool = False
    #: benchmarks only: False runs decode without data-plane grants (``unsafe_no_grants``) to show their cost
    grants: bool = True
    #: the deployment secret every rank and bootstrap server of the run holds (None: unauthenticated)
    secret: bytes | None = field(default=None, repr=False)


def make_requests(n: int, *, seed: int = 0, max_pages: int = 16, prefill: int = 1, decode: int = 1) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [
        Request(f"req-{i}", int(rng.integers(1, 1 << 62)), int(rng.integers(1, max_pages + 1)), i % prefill, i % decode)
        for i in range(n)
    ]


def pattern(rid: str, rank: int, nbytes: int) -> np.ndarray:
    """The bytes prefill rank ``rank`` writes for ``rid``: cheap, and unique per (rid, rank)."""
    seed = int.from_bytes(hashlib.blake2b(f"{rid}/{rank}".encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def first_token(rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=3).digest(), "little")


class Pages:
    """A free list of page ids: the same calls on every rank give the same pages."""

    def __init__(self, n: int) -> None:
        self._free = deque(range(n))

    def take(self, n: int) -> list[int] | None:
        if len(self._free) < n:
            return None
        return [self._free.popleft() for _ in range(n)]

    def give(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def admit(
        self, queue: deque[Request], ended: set[str], held: dict[str, list[int]]
    ) -> tuple[Request, list[int]] | None:
        """The first queued request still live, with its pages (recorded in ``held``), if they fit;
        requests that ended while they queued are dropped, as a scheduler would."""
        while queue and queue[0].rid in ended:
            queue.popleft()
        if not queue:
            return None
        got = self.take(queue[0].pages)
        if got is None:
            return None
        r = queue.popleft()
        held[r.rid] = got
        return r, got


# ------------------------------------------------------------------------------ ranks


def _join(store: str, rank: int, world: int) -> Any:
    if world == 1:
        return None
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    return dist.group.WORLD


def _cache(plan: Plan) -> list[np.ndarray]:
    bufs = [np.zeros(plan.num_pages * plan.page_bytes, np.uint8) for _ in range(plan.layers)]
    if plan.prefault:
        for buf in bufs:
            buf.fill(0)
    return bufs


def _knobs(plan: Plan) -> dict[str, Any]:
    return {
        "page_bytes": plan.page_bytes,
        "num_pages": plan.num_pages,
        "transport": plan.transport,
        "capacity": max(64, len(plan.requests)),
        "heartbeat_interval": plan.heartbeat_interval,
        "dead_after": plan.dead_after,
        "bootstrap_timeout": plan.bootstrap_timeout,
        "waiting_timeout": plan.waiting_timeout,
        "fence_timeout": plan.fence_timeout,
        "tombstone_ttl": plan.tombstone_ttl,
        "unsafe_no_grants": not plan.grants,
        "secret": plan.secret,
    }


def _leftovers(peer: Any, plan: Plan) -> dict[str, Any]:
    """What a peer still holds at the end of a run: all of it should be empty or expiring.

    ``maps`` counts the role's bookkeeping (rooms, pending announcements, requests, lookups to
    retry); with ``plan.await_tombstones`` the rank first waits for its tombstones' TTL to pass
    (no collective meanwhile: every rank of the replica left its loop in the same round).
    """
    at_end = len(peer._tombstones)
    if plan.await_tombstones:
        until = time.monotonic() + plan.tombstone_ttl + 2.0
        while len(peer._tombstones) and time.monotonic() < until:
            time.sleep(0.05)  # the worker expires tombstones on its own tick
    names = ("_rooms", "_by_rid", "_pending", "_requests", "_by_source", "_waiting")
    return {
        "in_flight": peer.has_in_flight(),
        "tracked": len(peer._table),
        "tombstones_at_end": at_end,
        "tombstones": len(peer._tombstones),
        "maps": {name[1:]: len(getattr(peer, name)) for name in names if hasattr(peer, name)},
    }


def _prefill_rank(plan: Plan, index: int, rank: int, port: int, store: str, out: Any) -> None:
    from . import BootstrapInfo, Bootstrapped, PrefillConfig, PrefillPeer

    group = _join(store, rank, plan.prefill_tp[index])
    cache = _cache(plan)
    peer, outbox = PrefillPeer.start(
        PrefillConfig(kv_buffers=cache, tp_size=plan.prefill_tp[index], tp_rank=rank,
                      bootstrap_host="127.0.0.1", bootstrap_port=port, **_knobs(plan))
    )
    out.put(("ready", "prefill", index, rank, os.getpid()))
    mine = [r for r in plan.requests if r.prefill == index]
    by_rid = {r.rid: r for r in mine}
    aborts = plan.prefill_abort.get(index, set())
    late_aborts = plan.prefill_abort_bootstrapped.get(index, set())
    stalled = {rid for rids in plan.decode_stall.values() for rid in rids}
    pages = Pages(plan.num_pages)
    held: dict[str, list[int]] = {}
    sent: dict[str, list[int]] = {}  # plan.record_pages
    log: list[tuple[str, str, float]] = []
    waiting: deque[Request] = deque()
    ended: set[str] = set()
    deadline = time.monotonic() + plan.timeout
    next_step = 0.0
    try:
        for r in mine:
            if r.rid in aborts:
                peer.abort_room(r.rid, r.room)
                log.append(("Aborted", r.rid, time.time()))
            else:
                peer.register(r.rid, BootstrapInfo("127.0.0.1", port, r.room))
        done = len(aborts)
        while done < len(mine) and time.monotonic() < deadline:
            for event in peer.poll(group):
                log.append((type(event).__name__, event.rid, time.time()))
                if isinstance(event, Bootstrapped):
                    if event.rid in late_aborts:
                        peer.abort_room(event.rid, by_rid[event.rid].room)
                        log.append(("Aborted", event.rid, time.time()))
                    elif event.rid not in stalled:  # a stalled request is held until decode gives up
                        waiting.append(by_rid[event.rid])
                else:
                    pages.give(held.pop(event.rid, []))
                    ended.add(event.rid)  # it may still wait for compute: a scheduler drops it
                    done += 1
            while time.monotonic() >= next_step:  # "compute" the prefill when pages are free
                admitted = pages.admit(waiting, ended, held)
                if admitted is None:
                    break
                r, got = admitted
                if plan.prefill_step:
                    next_step = time.monotonic() + plan.prefill_step
                if plan.record_pages:
                    sent[r.rid] = got
                if plan.verify:
                    data = pattern(r.rid, rank, r.pages * plan.page_bytes)
                    for layer, buf in enumerate(cache):
                        view = buf.reshape(plan.num_pages, plan.page_bytes)
                        view[got] = np.roll(data, layer).reshape(r.pages, plan.page_bytes)
                peer.record_usage(r.rid, cached_tokens=r.pages, bootstrap_logprob=-0.25)
                outbox.send(r.rid, got, first_token(r.rid), [first_token(r.rid) % 97])
            time.sleep(0.001)  # a real scheduler runs a forward pass here
        out.put(("done", "prefill", index, rank, {"log": log, "pages": sent, **_leftovers(peer, plan)}))
    finally:
        peer.close()


def _decode_rank(plan: Plan, index: int, rank: int, ports: list[int], store: str, out: Any) -> None:
    from . import BootstrapInfo, Bootstrapped, DecodeConfig, DecodePeer, Failed, RemotePrefillDone

    group = _join(store, rank, plan.decode_tp[index])
    cache = _cache(plan)
    peer, inbox = DecodePeer.start(DecodeConfig(kv_buffers=cache, tp_size=plan.decode_tp[index], tp_rank=rank, **_knobs(plan)))
    out.put(("ready", "decode", index, rank, os.getpid()))
    mine = [r for r in plan.requests if r.decode == index]
    by_rid = {r.rid: r for r in mine}
    pages = Pages(plan.num_pages)
    held: dict[str, list[int]] = {}
    started: dict[str, float] = {}
    log: list[tuple[str, str, float]] = []
    results: dict[str, Any] = {"ok": 0, "failed": 0, "bytes": 0, "mismatched": [], "latency": [], "tokens_bad": []}
    results["pages"] = {}  # plan.record_pages
    admit = deque(mine)
    blocked: deque[Request] = deque()
    ended: set[str] = set()
    live = 0
    deadline = time.monotonic() + plan.timeout
    last_report = 0.0
    try:
        while (admit or live) and time.monotonic() < deadline:
            while admit and live < plan.window:
                r = admit.popleft()
                peer.register(r.rid, BootstrapInfo("127.0.0.1", ports[r.prefill], r.room))
                started[r.rid] = time.monotonic()
                live += 1
            for event in peer.poll(group):
                log.append((type(event).__name__, event.rid, time.time()))
                if isinstance(event, Bootstrapped):
                    blocked.append(by_rid[event.rid])
                    continue
                live -= 1
                ended.add(event.rid)  # it may still wait for pages: a scheduler drops it
                got = held.pop(event.rid, [])
                if isinstance(event, RemotePrefillDone):
                    results["latency"].append(time.monotonic() - started[event.rid])
                    remote = event.remote
                    if remote.bootstrap_token != first_token(event.rid) or remote.request_pool_index != len(event.rid):
                        results["tokens_bad"].append(event.rid)
                    if plan.verify and not _verify(plan, cache, event.rid, rank, got):
                        results["mismatched"].append(event.rid)
                    results["ok"] += 1
                    results["bytes"] += len(got) * plan.page_bytes * plan.layers
                else:
                    assert isinstance(event, Failed)
                    results["failed"] += 1
                pages.give(got)
            while (admitted := pages.admit(blocked, ended, held)) is not None:
                r, got = admitted
                if plan.record_pages:
                    results["pages"][r.rid] = got
                inbox.announce(r.rid, got, request_pool_index=len(r.rid))
            now = time.monotonic()
            if rank == 0 and now - last_report > 0.25:
                out.put(("progress", "decode", index, rank, (results["ok"], results["failed"])))
                last_report = now
            time.sleep(0.001)
        results.update(log=log, unfinished=len(admit) + live, **_leftovers(peer, plan))
        out.put(("done", "decode", index, rank, results))
    finally:
        peer.close()


def _verify(plan: Plan, cache: list[np.ndarray], rid: str, rank: int, got: list[int]) -> bool:
    data = pattern(rid, rank, len(got) * plan.page_bytes)
    return all(
        np.array_equal(buf.reshape(plan.num_pages, plan.page_bytes)[got].reshape(-1), np.roll(data, layer))
        for layer, buf in enumerate(cache)
    )


class _ToRunner:
    """A rank's own pipe to the runner (``out.put(msg)``).

    Not one ``multiprocessing.Queue`` shared by every rank: its write lock is shared too, and a
    rank killed (``Plan.kill``) while its feeder thread held it would block every other rank's
    reports for good. A killed rank here breaks only its own pipe.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def put(self, msg: Any) -> None:
        self._conn.send(msg)


def _rank_main(target: Any, *args: Any) -> None:
    out = args[-1]
    try:
        target(*args)
    except BaseException:
        out.put(("error", target.__name__, args[1], args[2], traceback.format_exc()))


# ------------------------------------------------------------------------------ the run


@dataclass
class Outcome:
    """What a run produced, per replica and rank."""

    prefill: dict[tuple[int, int], dict[str, Any]]
    decode: dict[tuple[int, int], dict[str, Any]]
    errors: list[str]
    seconds: float
    killed_at: dict[tuple[str, int], float]

    def decode_logs_agree(self) -> bool:
        return _logs_agree(self.decode)

    def prefill_logs_agree(self) -> bool:
        return _logs_agree(self.prefill)


def _logs_agree(ranks: dict[tuple[int, int], dict[str, Any]]) -> bool:
    by_replica: dict[int, list[list[tuple[str, str]]]] = {}
    for (index, _), result in sorted(ranks.items()):
        by_replica.setdefault(index, []).append([(kind, rid) for kind, rid, _ in result["log"]])
    return all(all(log == logs[0] for log in logs) for logs in by_replica.values())


def _context() -> Any:
    """Where ranks start: a fork server that imported pdcore (and so torch) once.

    A spawned rank re-imports torch, a second or more of CPU each, which dominates a run of a few
    hundred requests on a small machine; a fork of the server costs milliseconds. The server is a
    fresh single-threaded process (not a fork of this one, whose threads a fork would not carry),
    so forking it is safe. Spawn where there is no fork server.
    """
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(["pdcore.demo", "pdcore.prefill", "pdcore.decode"])  # pdcore imports lazily
    return ctx


def run(plan: Plan, *, progress: Any = None) -> Outcome:
    """Run the plan; every wait is bounded by ``plan.timeout`` (plus start-up)."""
    from .bootstrap import BootstrapServer

    ctx = _context()
    pipes: dict[Any, tuple[str, int, int]] = {}  # the runner's end of each rank's pipe
    servers = [BootstrapServer(secret=plan.secret) for _ in plan.prefill_tp]
    ports = [s.start() for s in servers]
    procs: dict[tuple[str, int], list[Any]] = {}
    results: dict[str, dict[tuple[int, int], dict[str, Any]]] = {"prefill": {}, "decode": {}}
    errors: list[str] = []
    killed_at: dict[tuple[str, int], float] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdcore-demo-") as tmp:
        for role, sizes in (("prefill", plan.prefill_tp), ("decode", plan.decode_tp)):
            for index, tp in enumerate(sizes):
                store = os.path.join(tmp, f"{role}-{index}")
                procs[(role, index)] = []
                for rank in range(tp):
                    reader, writer = ctx.Pipe(duplex=False)
                    out = _ToRunner(writer)
                    if role == "prefill":
                        args = (_prefill_rank, plan, index, rank, ports[index], store, out)
                    else:
                        args = (_decode_rank, plan, index, rank, ports, store, out)
                    p = ctx.Process(target=_rank_main, args=args, daemon=True)
                    p.start()
                    writer.close()  # the rank holds the only writer: its exit is our EOF
                    pipes[reader] = (role, index, rank)
                    procs[(role, index)].append(p)
        expected = sum(len(v) for v in procs.values())
        ready = 0
        finished = 0
        done_total = {index: 0 for index in range(len(plan.decode_tp))}
        hard_deadline = started + plan.timeout + 60.0
        try:
            inbox: deque[Any] = deque()
            while finished < expected and time.monotonic() < hard_deadline:
                if not inbox:
                    for reader in mp_connection.wait(list(pipes), timeout=0.5):
                        try:
                            inbox.append(reader.recv())
                        except (EOFError, OSError):  # the rank exited or was killed
                            del pipes[reader]
                            reader.close()
                    if not inbox:
                        if not pipes or all(not p.is_alive() for ps in procs.values() for p in ps):
                            break
                        continue
                kind, role, index, rank, payload = inbox.popleft()
                if kind == "ready":
                    ready += 1
                    if ready == expected:
                        started = time.monotonic()  # throughput counts from here, not from process start
                elif kind == "error":
                    errors.append(f"{role} {index} rank {rank}: {payload}")
                    finished += 1
                elif kind == "done":
                    results[role][(index, rank)] = payload
                    finished += 1
                elif kind == "progress":
                    done_total[index] = payload[0] + payload[1]
                    if progress is not None:
                        progress(sum(done_total.values()), len(plan.requests))
                for (krole, kindex), at in plan.kill.items():
                    if (krole, kindex) not in killed_at and sum(done_total.values()) >= at:
                        for p in procs[(krole, kindex)]:
                            p.kill()
                        killed_at[(krole, kindex)] = time.time()
                        expected -= len(procs[(krole, kindex)])
        finally:
            for ps in procs.values():
                for p in ps:
                    p.join(timeout=10)
                    if p.is_alive():
                        p.kill()
                        p.join(timeout=5)
            for s in servers:
                s.close()
            for reader in pipes:
                reader.close()
    if finished < expected:
        errors.append(f"only {finished} of {expected} ranks reported within the deadline")
    return Outcome(results["prefill"], results["decode"], errors, time.monotonic() - started, killed_at)


# ------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdcore demo", description="Move N requests' KV from P to D.")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--page-bytes", type=int, default=32768)
    parser.add_argument("--max-pages", type=int, default=16, help="pages per request: 1..this, at random")
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument(
        "--secret-file",
        help="the deployment secret (default: a random secret generated for this run; 'none' runs unauthenticated)",
    )
    args = parser.parse_args(argv)
    if args.prefill_tp != args.decode_tp:
        parser.error("this release pairs prefill and decode ranks one to one: --prefill-tp must equal --decode-tp")

    from .auth import load_secret
    from .errors import StartError
    from .table import IMPLEMENTATION

    if args.secret_file is None:
        secret: bytes | None = secrets.token_bytes(32)
        auth_note = "authenticated (a secret generated for this run)"
    elif args.secret_file == "none":
        secret, auth_note = None, "UNAUTHENTICATED (--secret-file none)"
    else:
        try:
            secret = load_secret(args.secret_file)
        except StartError as e:
            parser.error(str(e))
        auth_note = f"authenticated (secret from {args.secret_file})"

    plan = Plan(
        requests=make_requests(args.requests, seed=args.seed, max_pages=args.max_pages),
        prefill_tp=[args.prefill_tp],
        decode_tp=[args.decode_tp],
        layers=args.layers,
        page_bytes=args.page_bytes,
        num_pages=max(512, 4 * args.max_pages * 32),
        transport=args.transport,
        timeout=args.timeout,
        secret=secret,
    )
    print(
        f"pdcore demo: {args.requests} requests, prefill tp {args.prefill_tp} -> decode tp {args.decode_tp}, "
        f"{args.layers} layers x {args.page_bytes // 1024} KiB pages, transport {args.transport}, "
        f"{IMPLEMENTATION} state table, {auth_note}"
    )

    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(1, total)
        print(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests", end="", flush=True)

    outcome = run(plan, progress=show if sys.stdout.isatty() else None)
    print()
    return report(plan, outcome)


def report(plan: Plan, outcome: Outcome) -> int:
    """Print the summary table; 0 only if every request succeeded and every byte matched."""
    decode = outcome.decode
    landed = [{rid for kind, rid, _ in r["log"] if kind == "RemotePrefillDone"} for r in decode.values()]
    mismatched = sorted({rid for r in decode.values() for rid in r["mismatched"]})
    tokens_bad = sorted({rid for r in decode.values() for rid in r["tokens_bad"]})
    ok = len(set.intersection(*landed) - set(mismatched)) if landed else 0
    failed = len({rid for r in decode.values() for kind, rid, _ in r["log"] if kind == "Failed"})
    nbytes = sum(r["bytes"] for r in decode.values())
    latency = np.array([x for r in decode.values() for x in r["latency"]] or [0.0]) * 1e3
    expected = len(plan.requests)
    agree = outcome.decode_logs_agree() and outcome.prefill_logs_agree()
    rows = [
        ("requests ok", f"{ok} / {expected}"),
        ("requests failed", str(failed)),
        ("bytes verified", f"{nbytes / 1e6:.1f} MB"),
        ("pages mismatched", str(len(mismatched))),
        ("throughput", f"{nbytes / outcome.seconds / 1e9:.3f} GB/s (wall {outcome.seconds:.1f} s)"),
        ("register -> RemotePrefillDone p50", f"{np.percentile(latency, 50):.1f} ms"),
        ("register -> RemotePrefillDone p99", f"{np.percentile(latency, 99):.1f} ms"),
        ("identical events on every rank", "yes" if agree else "NO"),
    ]
    width = max(len(k) for k, _ in rows)
    print("+" + "-" * (width + 2) + "+" + "-" * 34 + "+")
    for key, value in rows:
        print(f"| {key:<{width}} | {value:<32} |")
    print("+" + "-" * (width + 2) + "+" + "-" * 34 + "+")
    for error in outcome.errors:
        print(f"error: {error}", file=sys.stderr)
    good = not outcome.errors and failed == 0 and ok == expected and not mismatched and not tokens_bad and agree
    print("demo: OK" if good else "demo: FAILED")
    return 0 if good else 1
