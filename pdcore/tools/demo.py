"""The PD demo (``python -m pdcore demo``, parsed by ``demo_cli``): a full PD transfer on loopback, with
real processes and real gloo groups.

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

import hashlib
import os
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

from .cli import report_start_failure
from .device_kv import DeviceKv, device_memory
from .progress import RunProgress
from .ranks import context, supervise

#: what the rank processes' fork server imports once (torch with them)
PRELOAD = ["pdcore.tools.demo", "pdcore.pd.prefill", "pdcore.pd.decode", "torch.distributed"]

__all__ = ["Plan", "Request", "Outcome", "make_requests", "run", "report"]


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
    control: str = "tcp"
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
    #: where the ranks' KV cache lives: "cpu", "cuda" or "standin" (``pdcore.tools.device_kv``)
    kv_device: str = "cpu"
    #: what the pages hold (``pdcore.kv.KvLayout``); None: opaque pages of ``layers`` buffers, one pattern
    #: per (request, rank), prefill and decode tp equal. With it, ``layers`` is ignored (the layout's buffers),
    #: tp sizes may differ, and every decode rank checks exactly its heads
    kv: Any = None
    #: prefill hands requests over layer by layer (``PrefillOutbox.begin``/``layers_done``/``finish``)
    layerwise: bool = False
    #: "tiny": prefill ranks compute real KV with ``pdcore.kv.tiny`` and decode ranks decode greedily from
    #: it, checking the tokens against one process's (needs ``kv``)
    model: str | None = None
    decode_steps: int = 4


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


def _page_bytes(plan: Any, tp: int) -> int:
    kv = getattr(plan, "kv", None)  # chaos plans have opaque pages
    return plan.page_bytes if kv is None else kv.page_bytes(tp)


def _buffers(plan: Any) -> int:
    kv = getattr(plan, "kv", None)
    return plan.layers if kv is None else kv.buffers


def _cache(plan: Any, tp: int = 1) -> list[np.ndarray]:
    bufs = [np.zeros(plan.num_pages * _page_bytes(plan, tp), np.uint8) for _ in range(_buffers(plan))]
    if plan.prefault:
        for buf in bufs:
            buf.fill(0)
    return bufs


def _knobs(plan: Plan, tp: int) -> dict[str, Any]:
    return {
        "page_bytes": _page_bytes(plan, tp),
        "kv_layout": plan.kv,
        "num_pages": plan.num_pages,
        "transport": plan.transport,
        "control": plan.control,
        "capacity": max(64, len(plan.requests)),
        **timings(plan),
        "unsafe_no_grants": not plan.grants,
        "secret": plan.secret,
        "device_memory": device_memory(getattr(plan, "kv_device", "cpu")),
    }


def _leftovers(peer: Any, plan: Plan) -> dict[str, Any]:
    """What a peer still holds at the end of a run: all of it should be empty or expiring.

    ``maps`` counts the role's bookkeeping (rooms, pending announcements, requests, lookups to
    retry); with ``plan.await_tombstones`` the rank first waits for its tombstones' TTL to pass
    (no collective meanwhile: every rank of the replica left its loop in the same round).
    """
    def engine() -> dict[str, int]:
        return peer.diagnostics()["engines"][peer.ROLE]

    peer.quiesce()  # the last round's ends reach the engine first
    at_end = engine()["tombstones"]
    if plan.await_tombstones:
        until = time.monotonic() + plan.tombstone_ttl + 2.0
        while engine()["tombstones"] and time.monotonic() < until:
            time.sleep(0.05)  # the driver expires tombstones on its own tick
    d = peer.diagnostics()
    maps = {k: v for k, v in d["engines"][peer.ROLE].items() if k not in ("tombstones", "connected_peers")}
    return {
        "in_flight": peer.has_in_flight(),
        "tracked": d["table"]["tracked"],
        "tombstones_at_end": at_end,
        "tombstones": d["engines"][peer.ROLE]["tombstones"],
        "maps": maps,
        "handoffs": peer.handoffs(),
        "lane_inputs": peer.stats.get("lane_inputs", 0),
        "control_sends": peer.control_sends(),
    }


def _prefill_rank(plan: Plan, index: int, rank: int, port: int, store: str, out: Any) -> None:
    from .. import BootstrapInfo, Bootstrapped, PrefillConfig, PrefillPeer

    tp = plan.prefill_tp[index]
    group = _join(store, rank, tp)
    cache = _cache(plan, tp)
    kv = DeviceKv(cache, plan.kv_device)
    peer, outbox = PrefillPeer.start(
        PrefillConfig(kv_buffers=kv.given, tp_size=tp, tp_rank=rank, bootstrap_host="127.0.0.1", bootstrap_port=port,
                      layerwise_min_pages=1 if plan.layerwise else 16, **_knobs(plan, tp))
    )
    contents = _Contents(plan, rank, tp)
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
                peer.record_usage(r.rid, cached_tokens=r.pages, bootstrap_logprob=-0.25)
                token = contents.fill(r, got, cache) if plan.verify else first_token(r.rid)
                kv.push(got, _page_bytes(plan, tp))
                if plan.layerwise:  # the forward pass fills the layers one by one: each goes as it is done
                    outbox.begin(r.rid, got)
                    for layer in range(contents.layers):
                        outbox.layers_done(r.rid, layer + 1)
                    outbox.finish(r.rid, token, [token % 97])
                else:
                    outbox.send(r.rid, got, token, [token % 97])
            time.sleep(0.001)  # a real scheduler runs a forward pass here
        out.put(("done", "prefill", index, rank, {"log": log, "pages": sent, **_leftovers(peer, plan)}))
    finally:
        peer.close()


def _decode_rank(plan: Plan, index: int, rank: int, ports: list[int], store: str, checker: Any, out: Any) -> None:
    """A decode rank's scheduler loop; ``checker(rank, tp)`` (None: ``_Contents``) makes what checks each
    landed request (``first_token(r, sent)``, ``check(r, got, cache, token, group)``)."""
    from .. import BootstrapInfo, Bootstrapped, DecodeConfig, DecodePeer, Failed, RemotePrefillDone

    tp = plan.decode_tp[index]
    group = _join(store, rank, tp)
    cache = _cache(plan, tp)
    kv = DeviceKv(cache, plan.kv_device)
    peer, inbox = DecodePeer.start(DecodeConfig(kv_buffers=kv.given, tp_size=tp, tp_rank=rank, **_knobs(plan, tp)))
    contents = _Contents(plan, rank, tp) if checker is None else checker(rank, tp)
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
                    r = by_rid[event.rid]
                    want = contents.first_token(r, remote.bootstrap_token) if plan.verify else first_token(event.rid)
                    if remote.bootstrap_token != want or remote.request_pool_index != len(event.rid):
                        results["tokens_bad"].append(event.rid)
                    if plan.verify:
                        kv.pull(got, _page_bytes(plan, tp))
                    if plan.verify and not contents.check(r, got, cache, remote.bootstrap_token, group):
                        results["mismatched"].append(event.rid)
                    results["ok"] += 1
                    results["bytes"] += len(got) * _page_bytes(plan, tp) * _buffers(plan)
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
                out.put(("progress", "decode", index, rank, (results["ok"], results["failed"], results["bytes"])))
                last_report = now
            time.sleep(0.001)
        results.update(log=log, unfinished=len(admit) + live, **_leftovers(peer, plan))
        out.put(("done", "decode", index, rank, results))
    finally:
        peer.close()


def fill_pattern(plan: Plan, cache: list[np.ndarray], key: str, rank: int, got: list[int]) -> None:
    """Opaque pages: ``pattern(key, rank)`` into ``got`` of every buffer, rolled by the buffer's index."""
    data = pattern(key, rank, len(got) * plan.page_bytes)
    for layer, buf in enumerate(cache):
        buf.reshape(plan.num_pages, plan.page_bytes)[got] = np.roll(data, layer).reshape(len(got), plan.page_bytes)


def holds_pattern(plan: Plan, cache: list[np.ndarray], key: str, rank: int, got: list[int]) -> bool:
    """Opaque pages: ``got`` hold what ``fill_pattern(plan, ..., key, rank, got)`` wrote."""
    data = pattern(key, rank, len(got) * plan.page_bytes)
    return all(
        np.array_equal(buf.reshape(plan.num_pages, plan.page_bytes)[got].reshape(-1), np.roll(data, layer))
        for layer, buf in enumerate(cache)
    )


class _Contents:
    """What a rank writes into a request's pages and what a decode rank checks, for each kind of run.

    - opaque pages (``plan.kv`` None): a pattern unique per (request, rank), one roll of it per buffer;
    - a KV layout: bytes that are a function of (request, buffer, token, head, byte), so any prefill rank
      holding a head writes the same bytes and each decode rank checks exactly its heads;
    - ``plan.model == "tiny"``: the KV of a tiny seeded decoder over a prompt made from the rid; the
      decode replica decodes ``decode_steps`` tokens from its heads and checks them against one process's.
    """

    def __init__(self, plan: Plan, rank: int, tp: int) -> None:
        self.plan, self.rank, self.tp = plan, rank, tp
        self.layers = plan.layers if plan.kv is None else plan.kv.layers
        self.model = None
        if plan.model == "tiny":
            import torch

            from ..kv.tiny import Tiny

            torch.set_num_threads(1)  # one rank per process on a shared machine: no intra-op thread pools
            self.model = Tiny(plan.kv, seed=7)

    def _seed(self, rid: str) -> int:
        return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=4).digest(), "little")

    def prompt(self, r: Request) -> list[int]:
        from ..kv.tiny import VOCAB

        t = self.plan.kv.page_tokens
        n = max(1, r.pages * t - self._seed(r.rid) % t)  # the last page partly filled
        return np.random.default_rng(self._seed(r.rid)).integers(0, VOCAB, n).tolist()

    def first_token(self, r: Request, sent: int) -> int:
        """The first token decode must receive (with a model, ``check`` compares it with one process's)."""
        return sent if self.model is not None else first_token(r.rid)

    def fill(self, r: Request, got: list[int], cache: list[np.ndarray]) -> int:
        """Prefill: write the request's pages; returns its first token."""
        plan = self.plan
        if plan.kv is None:
            fill_pattern(plan, cache, r.rid, self.rank, got)
            return first_token(r.rid)
        if self.model is not None:
            token, kv = self.model.prefill(self.prompt(r))
            self.model.write_pages(kv, self.rank, self.tp, got, cache)
            return token
        from ..kv.pattern import page_content

        first, count = plan.kv.heads(self.rank, self.tp)
        pb = plan.kv.page_bytes(self.tp)
        for pair, page in enumerate(got):
            content = page_content(plan.kv, self._seed(r.rid), first, count, pair)
            for b, buf in enumerate(cache):
                buf[page * pb : (page + 1) * pb] = content[b]
        return first_token(r.rid)

    def check(self, r: Request, got: list[int], cache: list[np.ndarray], token: int, group: Any) -> bool:
        """Decode: the request's pages hold what they must (with a model: they decode to the right tokens)."""
        plan = self.plan
        if plan.kv is None:
            return holds_pattern(plan, cache, r.rid, self.rank, got)
        if self.model is not None:
            prompt = self.prompt(r)
            kv = self.model.read_pages(self.rank, self.tp, got, len(prompt), cache)
            tokens = self.model.decode(kv, token, plan.decode_steps, self.rank, self.tp, group)
            return tokens == self.model.reference(prompt, plan.decode_steps)
        from ..kv.pattern import page_content

        first, count = plan.kv.heads(self.rank, self.tp)
        pb = plan.kv.page_bytes(self.tp)
        seed = self._seed(r.rid)
        for pair, page in enumerate(got):
            content = page_content(plan.kv, seed, first, count, pair)  # every buffer's page at once
            if not all(np.array_equal(buf[page * pb : (page + 1) * pb], content[b]) for b, buf in enumerate(cache)):
                return False
        return True


# ------------------------------------------------------------------------------ the run


class ReplicaLogs:
    """An outcome's check that every rank of each replica logged the same events in the same order."""

    prefill: dict[tuple[int, int], dict[str, Any]]
    decode: dict[tuple[int, int], dict[str, Any]]

    def decode_logs_agree(self) -> bool:
        return _logs_agree(self.decode)

    def prefill_logs_agree(self) -> bool:
        return _logs_agree(self.prefill)


@dataclass
class Outcome(ReplicaLogs):
    """What a run produced, per replica and rank."""

    prefill: dict[tuple[int, int], dict[str, Any]]
    decode: dict[tuple[int, int], dict[str, Any]]
    errors: list[str]
    seconds: float
    killed_at: dict[tuple[str, int], float]
    #: the run never started: one line naming the first rank that failed before every rank was ready, and why
    start_failure: str | None = None
    #: one line per entry of ``errors`` (``errors`` holds the tracebacks)
    causes: list[str] = field(default_factory=list)


def timings(plan: Any) -> dict[str, float]:
    """A plan's liveness and timeout knobs, as a peer config takes them (the demos' and chaos's plans)."""
    return {name: getattr(plan, name) for name in (
        "heartbeat_interval", "dead_after", "bootstrap_timeout", "waiting_timeout", "fence_timeout", "tombstone_ttl")}


def _logs_agree(ranks: dict[tuple[int, int], dict[str, Any]]) -> bool:
    by_replica: dict[int, list[list[tuple[str, str]]]] = {}
    for (index, _), result in sorted(ranks.items()):
        by_replica.setdefault(index, []).append([(kind, rid) for kind, rid, _ in result["log"]])
    return all(all(log == logs[0] for log in logs) for logs in by_replica.values())


def run(plan: Plan, *, progress: RunProgress | None = None) -> Outcome:
    """Run the plan; every wait is bounded by ``plan.timeout`` (plus start-up).

    A rank that fails before every rank is ready (its transport cannot start, say) ends the run
    at once: the other ranks are killed and ``Outcome.start_failure`` names the rank and the cause.
    ``progress`` (``pdcore.tools.progress.RunProgress``) is told about set-up and about requests as they end.
    """
    from ..control.bootstrap import BootstrapServer

    ctx = context(PRELOAD)
    expected = sum(plan.prefill_tp) + sum(plan.decode_tp)
    if progress is not None:
        progress.starting(f"{expected} ranks (prefill tp {'+'.join(map(str, plan.prefill_tp))}, "
                          f"decode tp {'+'.join(map(str, plan.decode_tp))})", expected)
    servers = [BootstrapServer(secret=plan.secret) for _ in plan.prefill_tp]
    try:
        ports = [s.start() for s in servers]
        with tempfile.TemporaryDirectory(prefix="pdcore-demo-") as tmp:
            layout = [
                ("prefill", index, rank, (_prefill_rank, plan, index, rank, ports[index], os.path.join(tmp, f"prefill-{index}")))
                for index, tp in enumerate(plan.prefill_tp) for rank in range(tp)
            ] + [
                ("decode", index, rank, (_decode_rank, plan, index, rank, ports, os.path.join(tmp, f"decode-{index}"), None))
                for index, tp in enumerate(plan.decode_tp) for rank in range(tp)
            ]
            got = supervise(ctx, layout, timeout=plan.timeout, requests=len(plan.requests), decode_tp=list(plan.decode_tp),
                            progress=progress, kill=plan.kill)
    finally:
        for s in servers:
            s.close()
    return Outcome(got.results["prefill"], got.results["decode"], got.errors, got.seconds, got.killed_at,
                   got.start_failure, got.causes)


def report(plan: Plan, outcome: Outcome, *, verbose: bool = False) -> int:
    """Print the summary table; 0 only if every request succeeded and every byte matched.

    A run that never started (``outcome.start_failure``) prints no table: one line naming the
    rank and the cause (with ``verbose``, every rank's traceback too), then ``demo: FAILED``.
    Errors of a run that started are one line each; ``verbose`` adds their tracebacks.
    """
    if outcome.start_failure is not None:
        return report_start_failure("demo", outcome.start_failure, outcome.errors, verbose=verbose)
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
    for error in outcome.errors if verbose else outcome.causes or outcome.errors:
        print(f"error: {error}", file=sys.stderr)
    good = not outcome.errors and failed == 0 and ok == expected and not mismatched and not tokens_bad and agree
    print("demo: OK" if good else "demo: FAILED")
    return 0 if good else 1
