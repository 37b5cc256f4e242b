"""``python -m pdcore chaos``: 2P(tp2) -> 2D(tp2) real processes under kills, pauses and faults,
with the invariants a scheduler relies on checked at the end.

The main process (the *runner*) runs one bootstrap server per prefill replica, routes requests
to replicas as a router would, and injects the faults; every rank of every replica is its own
process running a miniature scheduler loop (``demo.py``'s, plus what chaos needs):

- the runner talks to rank 0 of each replica only; rank 0 broadcasts new requests and the stop
  signal to its replica every round (as a real TP scheduler broadcasts its batch), so every rank
  registers the same requests in the same round;
- decode ranks allocate pages on ``Bootstrapped``, announce them, check every byte on
  ``RemotePrefillDone``, and fill every page they take back (after ``Failed`` or after the check)
  with a canary that must stay intact until the page is taken again; never-used pages must stay
  zero. A broken canary is a byte written into a page that was not lent to any transfer;
- prefill ranks fill each request's pages with a pattern only that (request, rank) has, record
  usage and hand the pages to the outbox.

Faults (all seeded from ``--seed``; a failure prints the seed to replay it):

- **kills**: every rank of a replica gets SIGKILL; the replica restarts after a moment (new
  processes, new sessions, the same bootstrap server);
- **pauses**: SIGSTOP of one rank or of a whole replica for longer than ``dead_after``, then
  SIGCONT (a paused process resumes: its in-flight writes may still land). Half of the prefill
  pauses are timed from inside: the runner arms the replica's ranks, and each stops itself
  (``SIGSTOP`` to its own pid) right after handing over a big request, so writes are still
  queued in the stopped process (a request holds up to 8 MiB per rank, more than the socket
  buffers take) and go out when it resumes, long after decode declared it dead;
- **data plane**: the ``faulty:<inner>`` transport (``transport/faulty.py``) fails a fraction of
  batches, some after their bytes landed, and delays completions;
- **control plane**: frames are dropped, delayed (per-peer order kept), duplicated or corrupted
  (bytes flipped in the encoded frame) on the way out of each rank's ``ControlChannel``.

Invariants: no process hangs (each ends within its deadline), no rank raised; every request a
surviving replica registered ends exactly once on each of its ranks, with the same events in the
same order on every rank of the replica; every ``RemotePrefillDone`` has exactly the prefill's
bytes in its pages (and the right first token); no byte lands in a page after it was handed
back (canaries); nothing is left in flight or tracked at the end, and no ``pdcore-*`` thread
outlives ``close()``.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import multiprocessing.connection as mp_connection
import os
import random
import secrets
import signal
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

from .cli import CliParser, float_range, int_range, memory_bytes, report_start_failure, transport_help, transport_name
from .demo import PRELOAD, Pages, Request, _cache, _leftovers, first_token, pattern
from .ranks import cause, context
from .progress import RunProgress

__all__ = ["ChaosPlan", "ChaosOutcome", "run", "report", "main"]

CANARY_FAILED = 0xA5  # a page handed back on Failed
CANARY_DONE = 0x5A  # a page handed back after its RemotePrefillDone was checked
FRESH = 0x00  # a page never lent to a transfer


@dataclass
class ChaosPlan:
    seed: int = 0
    seconds: float | None = 30.0  # the active phase; None: until ``requests`` were dispatched and ended
    requests: int | None = None
    prefill_tp: int = 2
    decode_tp: int = 2
    replicas: int = 2  # of each role
    layers: int = 4
    page_bytes: int = 65536
    num_pages: int = 512
    max_pages: int = 32  # up to 8 MiB per request and rank: more than a socket buffer holds
    window: int = 8  # live requests per decode replica
    transport: str = "faulty:tcp"
    fail_rate: float = 0.03  # data plane: batches failed (faulty:<inner> only)
    land_rate: float = 0.5  # of those, posted first (their bytes land)
    delay: float = 0.005  # data plane: extra completion delay, seconds (max)
    control_drop: float = 0.002
    control_delay: float = 0.02  # fraction of frames held back (up to control_max_delay s, order kept)
    control_max_delay: float = 0.2
    control_dup: float = 0.005
    control_corrupt: float = 0.002
    kills: bool = True
    pauses: bool = True
    mid_transfer: float = 0.5  # fraction of prefill pauses timed right after a handover of pages
    fault_gap: tuple[float, float] = (1.5, 4.0)  # seconds between the end of one fault and the next
    warmup: float = 2.0  # seconds of clean traffic before the first fault
    heartbeat_interval: float = 0.25
    dead_after: float = 2.0
    bootstrap_timeout: float = 8.0
    waiting_timeout: float = 8.0
    fence_timeout: float = 4.0
    tombstone_ttl: float = 30.0
    collective_timeout: float = 30.0  # gloo: longer than any pause
    drain: float = 25.0  # after stop, ranks wait this long for their requests to end
    start_timeout: float = 60.0  # a rank reports ready within this
    await_tombstones: bool = False  # (demo._leftovers reads it)
    prefault: bool = False  # (demo._cache reads it)
    max_seconds: float = 600.0  # --requests: the faulty phase ends by then whatever happens
    verbose: bool = True
    log_level: str = "ERROR"  # of the ranks' "pdcore" loggers
    #: the harness's own check: peers built with ``unsafe_no_grants`` (a fence that trusts the source),
    #: which the canary invariant must catch
    unsafe_no_grants: bool = False
    #: every rank and bootstrap server of the run holds it: chaos runs as deployed, authenticated, with a
    #: secret drawn for each plan (as the demo does), never a fixed one that would open any deployment using it
    secret: bytes | None = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    slow: float = 1.0  # every timer scaled by this (``slower``)

    def slower(self, factor: float) -> ChaosPlan:
        """The same plan with every timer scaled by ``factor`` (a slow or emulated machine)."""
        if factor == 1:
            return self
        names = ("heartbeat_interval", "dead_after", "bootstrap_timeout", "waiting_timeout", "fence_timeout",
                 "drain", "start_timeout", "collective_timeout")
        return dataclasses.replace(self, slow=self.slow * factor, **{n: getattr(self, n) * factor for n in names})

    def rank_seed(self, role: str, index: int, gen: int, rank: int, what: str) -> int:
        return zlib.crc32(f"{self.seed}/{role}/{index}/{gen}/{rank}/{what}".encode())


# ------------------------------------------------------------------------------ control-channel faults




# ------------------------------------------------------------------------------ ranks


class CanaryPages(Pages):
    """Demo's free list, plus canaries: a page taken back is filled with a canary byte that must be
    intact when the page is taken again (and at the end); never-used pages must stay zero.

    A broken canary is compared with the prefill data of the page's past owners (the last few
    requests that held it), so the report can say whose late write it was.
    """

    HISTORY = 8

    def __init__(self, plan: ChaosPlan, cache: list[np.ndarray], rank: int) -> None:
        super().__init__(plan.num_pages)
        self._views = [buf.reshape(plan.num_pages, plan.page_bytes) for buf in cache]
        self._plan = plan
        self._rank = rank
        #: page -> (byte it must hold, how it came back)
        self.guarded: dict[int, tuple[int, str]] = {p: (FRESH, "never used") for p in range(plan.num_pages)}
        #: page -> its last owners, newest last: (rid, index of the page in that rid's pages, that rid's page count)
        self.owners: dict[int, deque[tuple[str, int, int]]] = {}
        self.violations: list[dict[str, Any]] = []

    def take(self, n: int) -> list[int] | None:
        got = super().take(n)
        if got:
            self.check(got, "when taken again")
            for p in got:
                self.guarded.pop(p, None)
        return got

    def give_back(self, pages: list[int], rid: str, how: str, byte: int) -> None:
        for view in self._views:
            view[pages] = byte
        for i, p in enumerate(pages):
            self.guarded[p] = (byte, f"{rid} {how}")
            self.owners.setdefault(p, deque(maxlen=self.HISTORY)).append((rid, i, len(pages)))
        self.give(pages)

    def check(self, pages: list[int] | None = None, when: str = "by the sweep") -> None:
        pages = list(self.guarded) if pages is None else [p for p in pages if p in self.guarded]
        if not pages:
            return
        by_byte: dict[int, list[int]] = {}
        for p in pages:
            by_byte.setdefault(self.guarded[p][0], []).append(p)
        for byte, group in by_byte.items():
            bad = np.zeros(len(group), bool)
            for view in self._views:
                bad |= (view[group] != byte).any(axis=1)
            for p in np.asarray(group)[bad].tolist():
                _, how = self.guarded.pop(p)
                self.violations.append(
                    {"page": p, "how": how, "when": when, "t": time.time(),
                     "bytes": int(sum(int((view[p] != byte).sum()) for view in self._views)),
                     "writer": self._whose(p)}
                )

    def _whose(self, page: int) -> str:
        """Which past owner's prefill data the page holds (in any layer), newest first; '' if none."""
        pb = self._plan.page_bytes
        for rid, i, n in reversed(self.owners.get(page, ())):
            data = pattern(rid, self._rank, n * pb)
            for layer, view in enumerate(self._views):
                if np.array_equal(view[page], np.roll(data, layer)[i * pb : (i + 1) * pb]):
                    return rid
        return ""


def _join_group(store: str, rank: int, world: int, timeout: float) -> Any:
    if world == 1:
        return None
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )
    return dist.group.WORLD


class _Sync:
    """Rank 0 reads the runner's messages and broadcasts them to its replica, once per round."""

    def __init__(self, conn: Any, group: Any, rank: int, plan: ChaosPlan) -> None:
        self._conn, self._group, self._rank, self._plan = conn, group, rank, plan
        self.stop_at: float | None = None
        self.selfstop = -1  # rank 0: the last mask the runner sent (-1: none since the last round)
        #: this rank stops itself (SIGSTOP) right after its next big handover (armed by the runner)
        self.stop_after_handover = False

    def __call__(self) -> tuple[list[Request], bool, bool]:
        new: list[Request] = []
        stop = abandon = False
        mask = -1
        if self._rank == 0:
            while self._conn.poll():
                msg = self._conn.recv()
                if msg[0] == "add":
                    new.extend(msg[1])
                elif msg[0] == "stop" and self.stop_at is None:
                    self.stop_at = time.monotonic()
                elif msg[0] == "selfstop":
                    mask = msg[1]
            stop = self.stop_at is not None
            abandon = stop and time.monotonic() - self.stop_at > self._plan.drain  # type: ignore[operator]
        if self._group is not None:
            import torch
            import torch.distributed as dist

            head = torch.tensor([len(new), int(stop), int(abandon), mask], dtype=torch.int64)
            dist.broadcast(head, 0, group=self._group)
            if int(head[0]):
                box: list[Any] = [new if self._rank == 0 else None]
                dist.broadcast_object_list(box, 0, group=self._group)
                new = box[0]
            stop, abandon, mask = bool(head[1]), bool(head[2]), int(head[3])
        if mask >= 0:
            self.stop_after_handover = bool(mask >> self._rank & 1)
        return new, stop, abandon

    def handed_over(self, pages: int, conn: Any, who: tuple[str, int, int, int]) -> None:
        """After a handover: stop this process now if the runner asked for it (a pause mid-transfer:
        the writes just posted are still queued in this process when it stops)."""
        if self.stop_after_handover and pages * 2 >= self._plan.max_pages:
            self.stop_after_handover = False
            conn.send(("stopping", *who, pages))
            os.kill(os.getpid(), signal.SIGSTOP)


def _knobs(plan: ChaosPlan, role: str, index: int, gen: int, rank: int) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if plan.transport.startswith("faulty:"):
        options = {"seed": plan.rank_seed(role, index, gen, rank, "transport"), "fail_rate": plan.fail_rate,
                   "land_rate": plan.land_rate, "delay": plan.delay}
    control: dict[str, Any] = {}
    if any((plan.control_drop, plan.control_delay, plan.control_dup, plan.control_corrupt)):
        control = {"control": "faulty:zmq", "control_options": {
            "seed": plan.rank_seed(role, index, gen, rank, "control"), "drop": plan.control_drop,
            "delay": plan.control_delay, "max_delay": plan.control_max_delay, "dup": plan.control_dup,
            "corrupt": plan.control_corrupt}}
    return {
        "page_bytes": plan.page_bytes,
        "num_pages": plan.num_pages,
        "transport": plan.transport,
        "transport_options": options,
        **control,
        "capacity": 1024,
        "heartbeat_interval": plan.heartbeat_interval,
        "dead_after": plan.dead_after,
        "bootstrap_timeout": plan.bootstrap_timeout,
        "waiting_timeout": plan.waiting_timeout,
        "fence_timeout": plan.fence_timeout,
        "tombstone_ttl": plan.tombstone_ttl,
        **({"unsafe_no_grants": True} if plan.unsafe_no_grants else {}),
        "secret": plan.secret,
    }


def _finish(peer: Any, plan: ChaosPlan, result: dict[str, Any]) -> dict[str, Any]:
    """Leftovers before close; threads and fault counters after it.

    Bookkeeping that expires on a timer (an announcement for a room never registered here waits
    ``bootstrap_timeout``; a corrupted or late frame can leave one) is given that long to go: what
    is still there after its timeout is a leak. Every rank of the replica left its loop in the same
    round, so no collective waits meanwhile.
    """
    def maps() -> dict[str, int]:
        return peer._engine.held()  # as demo._leftovers counts them

    peer.quiesce()  # the last round's ends reach the engine first
    result["maps_at_end"] = maps()
    until = time.monotonic() + max(plan.bootstrap_timeout, plan.waiting_timeout, plan.fence_timeout) + 2.0
    while any(maps().values()) and time.monotonic() < until:
        time.sleep(0.05)
    result.update(_leftovers(peer, plan))
    transport = getattr(peer, "_transport", None)
    result["transport_faults"] = dict(getattr(transport, "stats", {}) or {})
    channel = getattr(peer, "_channel", None)
    result["control_faults"] = dict(getattr(channel, "faults", {}) or {})
    result["corrupted_still_valid"] = list(getattr(channel, "samples", []))
    result["control_stats"] = dict(vars(channel.stats)) if channel is not None else {}
    result["peer_stats"] = dict(peer.stats)
    peer.close()
    until = time.monotonic() + 3.0
    while True:
        alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("pdcore") and t.is_alive())
        if not alive or time.monotonic() > until:
            break
        time.sleep(0.05)
    result["threads_after_close"] = alive
    return result


def _prefill_rank(plan: ChaosPlan, index: int, gen: int, rank: int, port: int, store: str, conn: Any) -> None:
    from .. import BootstrapInfo, Bootstrapped, PrefillConfig, PrefillPeer

    group = _join_group(store, rank, plan.prefill_tp, plan.collective_timeout)
    cache = _cache(plan)  # type: ignore[arg-type]
    peer, outbox = PrefillPeer.start(
        PrefillConfig(kv_buffers=cache, tp_size=plan.prefill_tp, tp_rank=rank, bootstrap_host="127.0.0.1",
                      bootstrap_port=port, **_knobs(plan, "prefill", index, gen, rank))
    )
    conn.send(("ready", "prefill", index, gen, rank, os.getpid()))
    sync = _Sync(conn, group, rank, plan)
    pages = Pages(plan.num_pages)
    held: dict[str, list[int]] = {}
    live: dict[str, Request] = {}
    log: list[tuple[str, str]] = []
    waiting: deque[Request] = deque()
    ended: set[str] = set()
    abandoned = False
    try:
        while True:
            end = _news(sync, peer, live, log, lambda r: BootstrapInfo("127.0.0.1", port, r.room))
            if end:
                abandoned = end == "abandon"
                break
            for event in peer.poll(group):
                log.append(_entry(event))
                if isinstance(event, Bootstrapped):
                    if event.rid in live:
                        waiting.append(live[event.rid])
                    continue
                live.pop(event.rid, None)
                ended.add(event.rid)
                pages.give(held.pop(event.rid, []))
                if rank == 0:
                    conn.send(("ended", "prefill", index, gen, rank, (event.rid, type(event).__name__)))
            while (admitted := pages.admit(waiting, ended, held)) is not None:
                r, got = admitted
                data = pattern(r.rid, rank, r.pages * plan.page_bytes)
                for layer, buf in enumerate(cache):
                    buf.reshape(plan.num_pages, plan.page_bytes)[got] = np.roll(data, layer).reshape(r.pages, plan.page_bytes)
                peer.record_usage(r.rid, cached_tokens=r.pages, bootstrap_logprob=-0.25)
                outbox.send(r.rid, got, first_token(r.rid), [first_token(r.rid) % 97])
                sync.handed_over(r.pages, conn, ("prefill", index, gen, rank))
            time.sleep(0.002)
        result = {"log": log, "unfinished": sorted(live), "abandoned": abandoned}
        conn.send(("done", "prefill", index, gen, rank, _finish(peer, plan, result)))
    finally:
        peer.close()


def _news(sync: Any, peer: Any, live: dict[str, Request], log: list[Any], bootstrap_of: Any) -> str:
    """A round's news from the runner: register the new requests; "stop" (nothing live is left) or
    "abandon" when the rank's loop should end, else ""."""
    new, stop, abandon = sync()
    for r in new:
        peer.register(r.rid, bootstrap_of(r))
        live[r.rid] = r
        log.append(("Registered", r.rid, None))
    if stop and not live:
        return "stop"
    return "abandon" if abandon else ""


def _decode_rank(plan: ChaosPlan, index: int, gen: int, rank: int, ports: list[int], store: str, conn: Any) -> None:
    from .. import BootstrapInfo, Bootstrapped, DecodeConfig, DecodePeer, Failed, RemotePrefillDone

    group = _join_group(store, rank, plan.decode_tp, plan.collective_timeout)
    cache = _cache(plan)  # type: ignore[arg-type]
    peer, inbox = DecodePeer.start(
        DecodeConfig(kv_buffers=cache, tp_size=plan.decode_tp, tp_rank=rank, **_knobs(plan, "decode", index, gen, rank))
    )
    conn.send(("ready", "decode", index, gen, rank, os.getpid()))
    sync = _Sync(conn, group, rank, plan)
    pages = CanaryPages(plan, cache, rank)
    held: dict[str, list[int]] = {}
    live: dict[str, Request] = {}
    log: list[tuple[str, str]] = []
    blocked: deque[Request] = deque()
    ended: set[str] = set()
    mismatched: list[str] = []
    tokens_bad: list[str] = []
    reasons: Counter[str] = Counter()  # why requests failed here (shown in the report)
    abandoned = False
    next_sweep = time.monotonic() + 1.0
    try:
        while True:
            end = _news(sync, peer, live, log, lambda r: BootstrapInfo("127.0.0.1", ports[r.prefill], r.room))
            if end:
                abandoned = end == "abandon"
                break
            for event in peer.poll(group):
                log.append(_entry(event))
                if isinstance(event, Bootstrapped):
                    if event.rid in live:
                        blocked.append(live[event.rid])
                    continue
                live.pop(event.rid, None)
                ended.add(event.rid)
                got = held.pop(event.rid, [])
                if isinstance(event, RemotePrefillDone):
                    remote = event.remote
                    if remote.bootstrap_token != first_token(event.rid) or remote.request_pool_index != len(event.rid):
                        tokens_bad.append(f"{event.rid}: first token {remote.bootstrap_token} (prefill sent "
                                          f"{first_token(event.rid)}), request_pool_index {remote.request_pool_index} "
                                          f"(announced {len(event.rid)})")
                    if not _verify(plan, cache, event.rid, rank, got):
                        writers = sorted({w for w in map(pages._whose, got) if w})
                        mismatched.append(event.rid + (f" (its pages hold data of {', '.join(writers)})" if writers else ""))
                    pages.give_back(got, event.rid, "after RemotePrefillDone", CANARY_DONE)
                else:
                    assert isinstance(event, Failed)
                    reasons[event.reason[:120]] += 1
                    pages.give_back(got, event.rid, "after Failed", CANARY_FAILED)
                if rank == 0:
                    conn.send(("ended", "decode", index, gen, rank, (event.rid, type(event).__name__)))
            while (admitted := pages.admit(blocked, ended, held)) is not None:
                r, got = admitted
                inbox.announce(r.rid, got, request_pool_index=len(r.rid))
            now = time.monotonic()
            if now >= next_sweep:  # find late writes close to when they happen, not only at reuse
                pages.check(None, "by the sweep")
                next_sweep = now + 1.0
            time.sleep(0.002)
        pages.check(None, "at the end")
        result = {"log": log, "unfinished": sorted(live), "abandoned": abandoned, "mismatched": mismatched,
                  "tokens_bad": tokens_bad, "canary": pages.violations, "reasons": dict(reasons)}
        conn.send(("done", "decode", index, gen, rank, _finish(peer, plan, result)))
    finally:
        peer.close()


def _entry(event: Any) -> tuple[str, str, Any]:
    """A log entry that compares as the event does (``Failed.reason`` is left out of equality; a
    ``RemotePrefillDone`` carries its whole ``RemotePrefill``: first token, usage, candidates)."""
    remote = getattr(event, "remote", None)
    payload = None
    if remote is not None:
        payload = (remote.bootstrap_token, remote.cached_tokens, remote.bootstrap_logprob,
                   remote.spec_candidate_ids, remote.request_pool_index)
    return type(event).__name__, event.rid, payload


def _verify(plan: ChaosPlan, cache: list[np.ndarray], rid: str, rank: int, got: list[int]) -> bool:
    if not got:
        return False
    data = pattern(rid, rank, len(got) * plan.page_bytes)
    return all(
        np.array_equal(buf.reshape(plan.num_pages, plan.page_bytes)[got].reshape(-1), np.roll(data, layer))
        for layer, buf in enumerate(cache)
    )


def _rank_main(target: Any, plan: ChaosPlan, role: str, index: int, gen: int, rank: int, stack_path: str, *args: Any) -> None:
    conn = args[-1]
    logging.getLogger("pdcore").setLevel(plan.log_level)  # the peers' warnings are expected noise here
    stacks = open(stack_path, "w")  # noqa: SIM115  (lives as long as the process)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the runner asks a hung rank for its stacks
    try:
        target(plan, index, gen, rank, *args)
    except BaseException as e:
        try:
            conn.send(("error", role, index, gen, rank, (cause(e), traceback.format_exc())))
        except OSError:
            pass


# ------------------------------------------------------------------------------ the runner


@dataclass(eq=False)
class _Incarnation:
    role: str
    index: int
    gen: int
    procs: list[Any]
    conns: list[Any]
    stacks: list[str]
    started: float
    ready: set[int] = field(default_factory=set)
    done: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    causes: dict[int, str] = field(default_factory=dict)  # one line per entry of ``errors``
    exited: set[int] = field(default_factory=set)
    killed: bool = False
    stopping: bool = False
    live: set[str] = field(default_factory=set)  # decode: dispatched and not ended (rank 0's reports)
    dispatched: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.role[0].upper()}{self.index}.{self.gen}"

    @property
    def up(self) -> bool:
        return not self.killed and not self.stopping and len(self.ready) == len(self.procs)


@dataclass
class ChaosOutcome:
    plan: ChaosPlan
    incarnations: list[_Incarnation]
    actions: list[tuple[float, str]]
    hung: list[str]
    errors: list[str]
    seconds: float
    t0: float  # wall clock of the start, for the actions' and violations' times
    dispatched: int = 0
    #: the run never started: one line naming the first rank that failed before every replica was up, and why
    start_failure: str | None = None
    #: one line per rank that raised (``errors`` holds the tracebacks)
    causes: list[str] = field(default_factory=list)


class _Runner:
    def __init__(self, plan: ChaosPlan, tmp: str, progress: RunProgress | None = None) -> None:
        self.plan = plan
        self.progress = progress
        self.pages_of: dict[str, int] = {}  # rid -> its pages (for the bytes progress shows)
        self.ended = [0, 0, 0]  # on decode replicas: requests ended, of them failed, bytes landed
        self.started = False  # every replica was up once: the faulty phase began
        self.tmp = tmp
        self.rng = random.Random(plan.seed)  # requests: pages, rooms, routing
        self.fault_rng = random.Random(plan.seed ^ 0xFA17)  # the fault schedule: its own stream, so it does not
        # depend on how many requests were dispatched meanwhile (a replay gets the same faults, in time)
        self.ctx = context(["pdcore.tools.chaos", *PRELOAD])
        from ..control.bootstrap import BootstrapServer

        self.servers = [BootstrapServer(secret=plan.secret) for _ in range(plan.replicas)]
        self.ports = [s.start() for s in self.servers]
        self.incs: list[_Incarnation] = []
        self.current: dict[tuple[str, int], _Incarnation] = {}
        self.by_conn: dict[Any, tuple[_Incarnation, int]] = {}
        self.actions: list[tuple[float, str]] = []
        self.t0 = time.time()
        self.m0 = time.monotonic()
        self.timers: list[tuple[float, str, Any]] = []  # (when, what, arg)
        self.paused: dict[int, _Incarnation] = {}  # pid -> its incarnation
        #: a pause waiting for its prefill replica's next handover: (incarnation, ranks, seconds, at the latest)
        self.armed: tuple[_Incarnation, set[int], float, float] | None = None
        self.n = 0
        self.errors: list[str] = []

    def note(self, what: str) -> None:
        t = time.monotonic() - self.m0
        self.actions.append((t, what))
        if self.plan.verbose:
            print(f"  [{t:6.1f} s] {what}", flush=True)

    # -- processes

    def spawn(self, role: str, index: int) -> _Incarnation:
        old = self.current.get((role, index))
        gen = 0 if old is None else old.gen + 1
        tp = self.plan.prefill_tp if role == "prefill" else self.plan.decode_tp
        store = os.path.join(self.tmp, f"{role}-{index}-{gen}.store")
        inc = _Incarnation(role, index, gen, [], [], [], time.monotonic())
        for rank in range(tp):
            mine, theirs = self.ctx.Pipe(duplex=True)
            stack = os.path.join(self.tmp, f"{role}-{index}-{gen}-{rank}.stacks")
            if role == "prefill":
                args = (_prefill_rank, self.plan, role, index, gen, rank, stack, self.ports[index], store, theirs)
            else:
                args = (_decode_rank, self.plan, role, index, gen, rank, stack, self.ports, store, theirs)
            p = self.ctx.Process(target=_rank_main, args=args, daemon=True, name=f"chaos-{role}-{index}-{gen}-{rank}")
            p.start()
            theirs.close()
            inc.procs.append(p)
            inc.conns.append(mine)
            inc.stacks.append(stack)
            self.by_conn[mine] = (inc, rank)
        self.incs.append(inc)
        self.current[(role, index)] = inc
        return inc

    def receive(self, timeout: float) -> None:
        conns = list(self.by_conn)
        if not conns:
            time.sleep(timeout)
            return
        for conn in mp_connection.wait(conns, timeout=timeout):
            inc, rank = self.by_conn[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                inc.exited.add(rank)
                del self.by_conn[conn]
                conn.close()
                continue
            kind, payload = msg[0], msg[-1]
            if kind == "ready":
                inc.ready.add(rank)
                if inc.up:
                    self.note(f"{inc.name} ready ({time.monotonic() - inc.started:.1f} s after start)")
            elif kind == "stopping":  # a rank stopped itself right after a handover: resume it in time
                seconds = self.plan.dead_after + 1.0
                if self.armed is not None and self.armed[0] is inc:
                    seconds = self.armed[2]
                    self.armed[1].discard(rank)
                    if not self.armed[1]:
                        self.armed = None
                pid = inc.procs[rank].pid
                self.paused[pid] = inc
                self.timers.append((time.monotonic() + seconds, "resume", [pid]))
                self.note(f"SIGSTOP {inc.name} rank {rank} (pid {pid}) for {seconds:.1f} s (dead_after "
                          f"{self.plan.dead_after:g} s): it stopped itself right after handing over {payload} pages")
            elif kind == "ended" and inc.role == "decode":
                inc.live.discard(payload[0])
                self.ended[0] += 1
                if payload[1] == "Failed":
                    self.ended[1] += 1
                else:
                    plan = self.plan
                    self.ended[2] += self.pages_of.get(payload[0], 0) * plan.page_bytes * plan.layers * plan.decode_tp
            elif kind == "done":
                inc.done[rank] = payload
            elif kind == "error":
                inc.causes[rank], inc.errors[rank] = payload
                if self.started:  # before, the run ends at once and says it once (start_failure)
                    self.note(f"{inc.name} rank {rank} raised: {inc.causes[rank]}")

    def send(self, inc: _Incarnation, msg: Any) -> None:
        if inc.killed:
            return
        try:
            inc.conns[0].send(msg)
        except (OSError, BrokenPipeError, EOFError):
            pass

    # -- requests

    def dispatch(self, limit: int | None) -> None:
        plan = self.plan
        prefills = [i for (role, _), i in self.current.items() if role == "prefill" and i.up]
        if not prefills:
            return
        for (role, _), dec in list(self.current.items()):
            if role != "decode" or not dec.up:
                continue
            while len(dec.live) < plan.window and (limit is None or self.n < limit):
                pre = self.rng.choice(prefills)
                rid = f"q{self.n}"
                self.n += 1
                r = Request(rid, self.rng.randrange(1, 1 << 62), self.rng.randint(1, plan.max_pages), pre.index, dec.index)
                self.send(dec, ("add", [r]))
                self.send(pre, ("add", [r]))
                dec.live.add(rid)
                self.pages_of[rid] = r.pages
                dec.dispatched.append(rid)
                pre.dispatched.append(rid)

    # -- faults

    def fault(self) -> float:
        """Inject one fault; returns when it is over (the next may start after a gap)."""
        plan = self.plan
        now = time.monotonic()
        kinds = (["kill"] if plan.kills else []) + (["pause"] if plan.pauses else [])
        targets = [i for i in self.current.values() if i.up]
        if not kinds or not targets:
            return now
        kind = self.fault_rng.choice(kinds)
        # a paused or killed prefill rank is where late writes come from: it is chosen twice as often
        inc = self.fault_rng.choice(targets + [i for i in targets if i.role == "prefill"])
        if kind == "kill":
            for p in inc.procs:
                p.kill()
            inc.killed = True
            restart = now + self.fault_rng.uniform(0.5, 2.0)
            self.timers.append((restart, "restart", (inc.role, inc.index)))
            self.note(f"SIGKILL {inc.name} (pids {[p.pid for p in inc.procs]}); restart in {restart - now:.1f} s")
            return restart
        ranks = list(range(len(inc.procs))) if self.fault_rng.random() < 0.5 else [self.fault_rng.randrange(len(inc.procs))]
        seconds = plan.dead_after + self.fault_rng.uniform(0.5, 2.0)
        if inc.role == "prefill" and self.fault_rng.random() < plan.mid_transfer:
            # caught mid-transfer: writes still queued when it stops are what a fence must keep out
            self.armed = (inc, set(ranks), seconds, now + 2.0)
            self.send(inc, ("selfstop", sum(1 << r for r in ranks)))
            return now + 2.0 + seconds
        self.pause(inc, ranks, seconds, "")
        return now + seconds

    def pause(self, inc: _Incarnation, ranks: list[int], seconds: float, why: str) -> None:
        now = time.monotonic()
        pids = []
        for rank in ranks:
            pid = inc.procs[rank].pid
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            self.paused[pid] = inc
            pids.append(pid)
        self.timers.append((now + seconds, "resume", pids))
        which = "all ranks" if len(ranks) > 1 else f"rank {ranks[0]}"
        self.note(f"SIGSTOP {inc.name} {which} (pids {pids}) for {seconds:.1f} s (dead_after {self.plan.dead_after:g} s)"
                  + (f" {why}" if why else ""))

    def run_timers(self, final: bool = False) -> None:
        now = time.monotonic()
        due = [t for t in self.timers if final or t[0] <= now]
        for t in due:
            self.timers.remove(t)
            _, what, arg = t
            if what == "resume":
                for pid in arg:
                    self.paused.pop(pid, None)
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                self.note(f"SIGCONT pids {arg}")
            elif what == "restart" and not final:
                inc = self.spawn(*arg)
                self.note(f"restart {inc.name} (pids {[p.pid for p in inc.procs]})")

    # -- the run

    def ranks_ready(self) -> tuple[int, int]:
        incs = list(self.current.values())
        return sum(len(i.ready) for i in incs), sum(len(i.procs) for i in incs)

    def start_failure(self) -> str | None:
        """The first rank that raised or exited before every replica was up, and why."""
        for inc in self.incs:
            for rank in sorted(inc.causes):
                return f"{inc.name} rank {rank}: {inc.causes[rank]}"
            for rank in sorted(inc.exited - inc.ready - set(inc.done)):
                return f"{inc.name} rank {rank} exited before it was ready (exit code {inc.procs[rank].exitcode})"
        return None

    def abort(self, why: str) -> ChaosOutcome:
        """The run never started: kill every rank now (the others would wait for the failed one)."""
        for inc in self.incs:
            for p in inc.procs:
                p.kill()
            for p in inc.procs:
                p.join(5)
        for s in self.servers:
            s.close()
        for conn in list(self.by_conn):
            conn.close()
        errors = [f"{i.name} rank {r}: {e}" for i in self.incs for r, e in i.errors.items()]
        return ChaosOutcome(self.plan, self.incs, self.actions, [], errors, time.monotonic() - self.m0, self.t0, 0,
                            start_failure=why)

    def run(self) -> ChaosOutcome:
        plan = self.plan
        progress = self.progress
        if progress is not None:
            ranks = plan.replicas * (plan.prefill_tp + plan.decode_tp)
            progress.starting(f"{ranks} ranks ({plan.replicas} prefill and {plan.replicas} decode replicas of tp "
                              f"{plan.prefill_tp})", ranks)
        for role in ("prefill", "decode"):
            for index in range(plan.replicas):
                self.spawn(role, index)
        start_by = time.monotonic() + plan.start_timeout
        while not all(i.up for i in self.current.values()) and time.monotonic() < start_by:
            self.receive(0.1)
            if progress is not None:
                progress.ranks_ready(*self.ranks_ready())
            why = self.start_failure()
            if why is not None:
                return self.abort(why)
        self.m0 = time.monotonic()
        self.t0 = time.time()
        self.started = True
        if progress is not None:
            progress.running(plan.requests)
        self.note(f"all replicas up; seed {plan.seed}")
        phase_end = self.m0 + (plan.seconds if plan.seconds is not None else plan.max_seconds)
        next_fault = self.m0 + plan.warmup
        while True:
            now = time.monotonic()
            if now >= phase_end:
                break
            if plan.requests is not None and self.n >= plan.requests:
                if not any(i.live for i in self.current.values() if i.role == "decode" and not i.killed):
                    break
            self.receive(0.02)
            if progress is not None:
                progress.update(*self.ended)
            self.run_timers()
            if self.armed is not None and (now >= self.armed[3] or self.armed[0].killed):
                inc, ranks, seconds, _ = self.armed  # no big handover came: pause the rest from outside
                self.armed = None
                if not inc.killed:
                    self.send(inc, ("selfstop", 0))
                    self.pause(inc, sorted(ranks), seconds, "(no big handover came within 2 s)")
            self.dispatch(plan.requests)
            if now >= next_fault and not self.timers and self.armed is None:
                end = self.fault()
                next_fault = end + self.fault_rng.uniform(*plan.fault_gap)
        if self.armed is not None:
            self.send(self.armed[0], ("selfstop", 0))
            self.armed = None
        self.run_timers(final=True)  # resume every paused process; no more restarts
        self.note(f"stop: {self.n} requests dispatched")
        stopping = [i for i in self.current.values() if not i.killed]
        for inc in stopping:
            inc.stopping = True
            self.send(inc, ("stop",))
        # every surviving rank reports within the drain plus the time it takes to start and to close
        deadline = time.monotonic() + plan.drain + plan.start_timeout + 15.0
        pending = lambda: [(i, r) for i in stopping for r in range(len(i.procs)) if r not in i.done and r not in i.errors and r not in i.exited]  # noqa: E731
        while pending() and time.monotonic() < deadline:
            self.receive(0.1)
            if progress is not None:
                progress.update(*self.ended)
            self.run_timers(final=True)  # a rank that stopped itself late is resumed at once
        hung: list[str] = []
        for inc, rank in pending():
            p = inc.procs[rank]
            hung.append(f"{inc.name} rank {rank} (pid {p.pid}) did not report by its deadline{self._stacks(inc, rank)}")
        for inc in stopping:  # reported: each process must also exit
            for rank, p in enumerate(inc.procs):
                p.join(timeout=max(0.1, min(10.0, deadline + 10 - time.monotonic())))
                if p.is_alive():
                    if not any(h.startswith(f"{inc.name} rank {rank} ") for h in hung):
                        hung.append(f"{inc.name} rank {rank} (pid {p.pid}) did not exit after reporting{self._stacks(inc, rank)}")
                    p.kill()
                    p.join(5)
        for inc in stopping:
            for rank, p in enumerate(inc.procs):
                if rank not in inc.done and rank not in inc.errors and not any(h.startswith(f"{inc.name} rank {rank} ") for h in hung):
                    self.errors.append(f"{inc.name} rank {rank} (pid {p.pid}) exited with code {p.exitcode} without reporting")
        for inc in self.incs:
            for p in inc.procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        for s in self.servers:
            s.close()
        for conn in list(self.by_conn):
            conn.close()
        errors = [f"{i.name} rank {r}: {e}" for i in self.incs for r, e in i.errors.items()] + self.errors
        causes = [f"{i.name} rank {r}: {c}" for i in self.incs for r, c in i.causes.items()] + self.errors
        return ChaosOutcome(plan, self.incs, self.actions, hung, errors, time.monotonic() - self.m0, self.t0, self.n,
                            causes=causes)

    def _stacks(self, inc: _Incarnation, rank: int) -> str:
        p = inc.procs[rank]
        if not p.is_alive():
            return ""
        try:
            os.kill(p.pid, signal.SIGCONT)
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        time.sleep(1.0)
        try:
            with open(inc.stacks[rank]) as f:
                return "; its threads:\n" + f.read()[-6000:]
        except OSError:
            return ""


def run(plan: ChaosPlan, *, progress: RunProgress | None = None) -> ChaosOutcome:
    """Run the plan. A rank that raises (or exits) before every replica is up ends the run at once:
    ``ChaosOutcome.start_failure`` names it. ``progress`` is told about set-up and requests as they end."""
    with tempfile.TemporaryDirectory(prefix="pdcore-chaos-") as tmp:
        return _Runner(plan, tmp, progress).run()


# ------------------------------------------------------------------------------ the invariants


def check(outcome: ChaosOutcome) -> list[tuple[str, str, bool, list[str]]]:
    """``(invariant, figure, holds, details)`` rows."""
    rows: list[tuple[str, str, bool, list[str]]] = []
    survivors = [i for i in outcome.incarnations if not i.killed]

    rows.append(("no hang (every process ended in time)", f"{len(outcome.hung)} hung", not outcome.hung, outcome.hung))
    rows.append(("no rank raised", f"{len(outcome.errors)} errors", not outcome.errors, outcome.errors))

    once: list[str] = []
    agree: list[str] = []
    missing: list[str] = []
    for inc in survivors:
        logs = [inc.done[r]["log"] for r in sorted(inc.done)]
        for rank in sorted(inc.done):
            result = inc.done[rank]
            registered = [rid for kind, rid, _ in result["log"] if kind == "Registered"]
            ends = Counter(rid for kind, rid, _ in result["log"] if kind not in ("Registered", "Bootstrapped"))
            boots = Counter(rid for kind, rid, _ in result["log"] if kind == "Bootstrapped")
            for rid in registered:
                if ends[rid] != 1:
                    once.append(f"{inc.name} rank {rank}: {rid} ended {ends[rid]} times")
            for rid in set(ends) - set(registered):
                once.append(f"{inc.name} rank {rank}: {rid} ended but was never registered")
            for rid, n in boots.items():
                if n > 1:
                    once.append(f"{inc.name} rank {rank}: {rid} Bootstrapped {n} times")
            seen_boot: set[str] = set()
            for kind, rid, _ in result["log"]:  # a success comes after its Bootstrapped, even if the state jumped
                if kind == "Bootstrapped":
                    seen_boot.add(rid)
                elif kind in ("Succeeded", "RemotePrefillDone") and rid not in seen_boot:
                    once.append(f"{inc.name} rank {rank}: {rid} {kind} without Bootstrapped before it")
            if result.get("abandoned"):
                once.append(f"{inc.name} rank {rank}: {len(result['unfinished'])} requests had not ended "
                            f"{outcome.plan.drain:g} s after stop: {result['unfinished'][:5]}")
            lost = set(inc.dispatched) - set(registered)
            if lost:
                missing.append(f"{inc.name} rank {rank}: {len(lost)} dispatched requests never registered: {sorted(lost)[:5]}")
        if len(logs) == len(inc.procs) and any(log != logs[0] for log in logs):
            first = next(i for i, log in enumerate(logs) if log != logs[0])
            a, b = logs[0], logs[first]
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            agree.append(f"{inc.name}: rank 0 and rank {first} differ at event {at}: "
                         f"{a[at:at + 3]} vs {b[at:at + 3]}")
    rows.append(("every request ends exactly once per rank (in order)", f"{len(once) + len(missing)} violations",
                 not once and not missing, once + missing))
    rows.append(("same events (payload too), same order on every rank", f"{len(agree)} replicas differ", not agree, agree))

    decode_done = [(i, r, i.done[r]) for i in survivors if i.role == "decode" for r in sorted(i.done)]
    mism = [f"{i.name} rank {r}: {rid}" for i, r, d in decode_done for rid in d["mismatched"]]
    landed = sum(1 for _, _, d in decode_done for kind, _, _ in d["log"] if kind == "RemotePrefillDone")
    rows.append(("RemotePrefillDone pages hold exactly prefill's bytes", f"{len(mism)} of {landed} wrong", not mism, mism))
    idle = [] if landed else ["no request landed: the faults (or the machine) left nothing to check the invariants on"]
    rows.append(("transfers happened (a run that moves nothing proves nothing)", f"{landed} landed", not idle, idle))
    bad_tokens = [f"{i.name} rank {r}: {rid}" for i, r, d in decode_done for rid in d["tokens_bad"]]
    valid = [f"{i.name} rank {r} sent: {x}" for i in survivors for r, d in sorted(i.done.items())
             for x in d.get("corrupted_still_valid", [])]
    notes = ["corrupted control frames that still decoded (past the wire's checksum):"] + valid if bad_tokens and valid else []
    rows.append(("RemotePrefillDone carries prefill's first token", f"{len(bad_tokens)} wrong", not bad_tokens,
                 bad_tokens + notes))

    canary = []
    for i, r, d in decode_done:
        for v in d["canary"]:
            whose = f"; it holds {v['writer']}'s prefill data (a late write)" if v["writer"] else ""
            canary.append(f"{i.name} rank {r}: page {v['page']} (handed back: {v['how']}) had {v['bytes']} bytes "
                          f"overwritten, found {v['when']} at {v['t'] - outcome.t0:.1f} s{whose}")
    rows.append(("0 bytes written into pages handed back", f"{len(canary)} pages", not canary, canary))

    left = []
    expired = []
    for inc in survivors:
        for rank, d in sorted(inc.done.items()):
            maps = {k: v for k, v in d["maps"].items() if v}
            if d["in_flight"] or d["tracked"] or maps:
                left.append(f"{inc.name} rank {rank}: in_flight={d['in_flight']} tracked={d['tracked']} maps={maps} "
                            f"(after waiting out the timeouts; at the end: {d['maps_at_end']})")
            elif any(d["maps_at_end"].values()):
                at_end = {k: v for k, v in d["maps_at_end"].items() if v}
                expired.append(f"{inc.name} rank {rank}: at the end {at_end}, gone within its timeout (not a leak)")
            if d["threads_after_close"]:
                left.append(f"{inc.name} rank {rank}: threads alive after close(): {d['threads_after_close']}")
    rows.append(("nothing in flight, tracked or left running at the end", f"{len(left)} ranks", not left, left + expired))
    return rows


def _reasons(survivors: list[Any]) -> Counter[str]:
    out: Counter[str] = Counter()
    for inc in survivors:
        if inc.role == "decode":
            for r in sorted(inc.done)[:1]:
                out.update(inc.done[r].get("reasons", {}))
    return out


def report(outcome: ChaosOutcome, *, verbose: bool = False) -> int:
    """Print the table of figures and invariants, then ``chaos: OK`` or ``chaos: FAILED``; 0 only if all hold.

    A run that never started (``outcome.start_failure``) prints no table: one line naming the rank
    and the cause (``verbose`` adds the tracebacks). A rank that raised later is one line in the
    details of "no rank raised"; ``verbose`` shows its traceback there.
    """
    plan = outcome.plan
    if outcome.start_failure is not None:
        return report_start_failure("chaos", outcome.start_failure, outcome.errors, verbose=verbose)
    rows = check(outcome)
    if not verbose and outcome.causes:
        rows = [(name, fig, good, outcome.causes if name == "no rank raised" else details)
                for name, fig, good, details in rows]
    survivors = [i for i in outcome.incarnations if not i.killed]
    decode_logs = [i.done[r]["log"] for i in survivors if i.role == "decode" for r in sorted(i.done)[:1]]
    ok = sum(1 for log in decode_logs for k, _, _ in log if k == "RemotePrefillDone")
    failed = sum(1 for log in decode_logs for k, _, _ in log if k == "Failed")
    faults = Counter(kind.split()[0] for _, kind in outcome.actions if kind.startswith(("SIGKILL", "SIGSTOP")))
    tfaults: Counter[str] = Counter()
    cfaults: Counter[str] = Counter()
    for inc in survivors:
        for d in inc.done.values():
            tfaults.update(d.get("transport_faults", {}))
            cfaults.update(d.get("control_faults", {}))
    info = [
        ("seed", str(plan.seed)),
        ("wall", f"{outcome.seconds:.1f} s"),
        ("requests dispatched", str(outcome.dispatched)),
        ("on surviving decode replicas", f"{ok} RemotePrefillDone, {failed} Failed"),
        ("most common failure reasons", "; ".join(f"{n}x {why}" for why, n in _reasons(survivors).most_common(3)) or "-"),
        ("replica kills / pauses", f"{faults['SIGKILL']} / {faults['SIGSTOP']}"),
        ("data-plane faults (survivors)", f"{tfaults['failed_posted']} failed after posting, "
                                          f"{tfaults['failed_unposted']} before, of {tfaults['batches']} batches"),
        ("control faults (survivors)", ", ".join(f"{v} {k}" for k, v in sorted(cfaults.items())) or "none"),
    ]
    table = [(k, v, "") for k, v in info] + [(name, fig, "ok" if good else "FAILED") for name, fig, good, _ in rows]
    w0 = max(len(r[0]) for r in table)
    w1 = max(len(r[1]) for r in table)
    line = "+" + "-" * (w0 + 2) + "+" + "-" * (w1 + 2) + "+" + "-" * 8 + "+"
    print(line)
    for k, v, s in table:
        print(f"| {k:<{w0}} | {v:<{w1}} | {s:<6} |")
    print(line)
    for name, _, good, details in rows:
        if details:
            print(f"{name}:")
            for d in details[:20]:
                print(f"  - {d}")
            if len(details) > 20:
                print(f"  ... {len(details) - 20} more")
    good = all(g for _, _, g, _ in rows)
    if not good:
        print(f"replay: python -m pdcore chaos --seed {plan.seed} " + _replay_args(plan))
    print("chaos: OK" if good else "chaos: FAILED")
    return 0 if good else 1


def _replay_args(plan: ChaosPlan) -> str:
    d = ChaosPlan().slower(plan.slow)
    args = [f"--seconds {plan.seconds:g}" if plan.seconds is not None else f"--requests {plan.requests}",
            f"--transport {plan.transport}"]
    for name in ("fail_rate", "land_rate", "delay", "control_drop", "control_delay", "control_dup", "control_corrupt",
                 "dead_after", "window", "layers", "page_bytes", "num_pages", "max_pages"):
        if getattr(plan, name) != getattr(d, name):
            args.append(f"--{name.replace('_', '-')} {getattr(plan, name):g}")
    args += [f"--tp {plan.prefill_tp}"] if plan.prefill_tp != d.prefill_tp else []
    args += [f"--slow {plan.slow:g}"] if plan.slow != 1 else []
    args += ["--no-kills"] if not plan.kills else []
    args += ["--unsafe-no-grants"] if plan.unsafe_no_grants else []
    args += ["--no-pauses"] if not plan.pauses else []
    return " ".join(args)


# ------------------------------------------------------------------------------ CLI


def parser() -> CliParser:
    d = ChaosPlan()
    fraction = float_range(0.0, 1.0, what="a fraction")
    p = CliParser(
        prog="python -m pdcore chaos",
        description="2 prefill -> 2 decode replicas (tp 2 each by default) as real processes under replica kills, "
        "SIGSTOP pauses, data-plane and control-plane faults; checks the invariants a scheduler relies on and "
        "prints a table, then 'chaos: OK' or 'chaos: FAILED' (exit 0 / 1) with the command that replays the run.",
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float_range(0, 86400, lo_open=True, what="seconds"), metavar="SECONDS",
                        help=f"length of the faulty phase (0 < SECONDS <= 86400; default: {d.seconds:g} unless "
                        "--requests is given)")
    length.add_argument("--requests", type=int_range(1, 1 << 20), metavar="N",
                        help=f"dispatch this many requests (1..{1 << 20}), then stop once they ended "
                        f"(at most {d.max_seconds:g} s of faults); default: run for --seconds")
    p.add_argument("--seed", type=int_range(0, (1 << 63) - 1), default=None, metavar="N",
                   help="seeds the requests and the fault schedule (a non-negative integer; default: random, printed)")
    p.add_argument("--transport", type=transport_name, default=d.transport, metavar="NAME", help=transport_help())
    p.add_argument("--tp", type=int, default=d.prefill_tp, choices=(1, 2),
                   help="ranks per replica, prefill and decode alike (1: no torch.distributed group; default: %(default)s)")
    p.add_argument("--fail-rate", type=fraction, default=d.fail_rate, metavar="F",
                   help="data plane (faulty:<name> only): fraction of batches failed (0..1; default: %(default)s)")
    p.add_argument("--land-rate", type=fraction, default=d.land_rate, metavar="F",
                   help="of those, the fraction posted first, so their bytes land (0..1; default: %(default)s)")
    p.add_argument("--delay", type=float_range(0.0, 10.0, what="seconds"), default=d.delay, metavar="SECONDS",
                   help="data plane: max extra completion delay (0..10; default: %(default)s)")
    p.add_argument("--control-drop", type=fraction, default=d.control_drop, metavar="F",
                   help="control plane: fraction of frames dropped (0..1; default: %(default)s)")
    p.add_argument("--control-delay", type=fraction, default=d.control_delay, metavar="F",
                   help=f"control plane: fraction of frames held back up to {d.control_max_delay:g} s, per-peer order "
                   "kept (0..1; default: %(default)s)")
    p.add_argument("--control-dup", type=fraction, default=d.control_dup, metavar="F",
                   help="control plane: fraction of frames sent twice (0..1; default: %(default)s)")
    p.add_argument("--control-corrupt", type=fraction, default=d.control_corrupt, metavar="F",
                   help="control plane: fraction of frames with 1-3 bytes flipped (0..1; default: %(default)s)")
    p.add_argument("--no-kills", action="store_true", help="no SIGKILL of replicas (default: kills and restarts)")
    p.add_argument("--no-pauses", action="store_true", help="no SIGSTOP pauses of ranks (default: pauses)")
    p.add_argument("--dead-after", type=float_range(0, 3600, lo_open=True, what="seconds"), default=d.dead_after,
                   metavar="SECONDS", help=f"a peer silent this long is dead (above the {d.heartbeat_interval:g} s "
                   "heartbeat, at most 3600; scaled by --slow; default: %(default)s)")
    p.add_argument("--slow", type=float_range(0, 100, lo_open=True, what="a factor"), default=1.0, metavar="FACTOR",
                   help="scale every timer (heartbeats, dead_after, timeouts, drain) for a slow machine, "
                   "e.g. 4 under emulation (0 < FACTOR <= 100; default: %(default)s)")
    p.add_argument("--window", type=int_range(1, 1024), default=d.window, metavar="N",
                   help="live requests per decode replica (1..1024; default: %(default)s)")
    p.add_argument("--layers", type=int_range(1, 1024), default=d.layers, metavar="N",
                   help="KV cache buffers per rank (1..1024; default: %(default)s)")
    p.add_argument("--page-bytes", type=int_range(1, 64 << 20), default=d.page_bytes, metavar="BYTES",
                   help=f"bytes per page per buffer (1..{64 << 20}; default: %(default)s)")
    p.add_argument("--num-pages", type=int_range(1, 1 << 20), default=d.num_pages, metavar="N",
                   help=f"pages per buffer (1..{1 << 20}, at least --max-pages; default: %(default)s)")
    p.add_argument("--max-pages", type=int_range(1, 4096), default=d.max_pages, metavar="N",
                   help="pages per request: 1..this, at random (1..4096; default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no line per fault (default: one line per fault)")
    p.add_argument("--unsafe-no-grants", action="store_true",
                   help="check the checker: decode fences without grants; the canary row must then fail")
    p.add_argument("--log-level", type=str.upper, default=d.log_level,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   help="of the ranks' pdcore loggers; WARNING shows every fault (default: %(default)s)")
    p.add_argument("--progress", choices=("auto", "rich", "plain", "none"), default="auto",
                   help="live progress: auto (a rich bar on a terminal, plain lines every few seconds otherwise), "
                   "rich, plain or none (default: %(default)s)")
    p.add_argument("--verbose", action="store_true",
                   help="print the traceback of every rank that raised (default: one line naming the cause)")
    return p


def main(argv: list[str] | None = None) -> int:
    d = ChaosPlan()
    cli = parser()
    args = cli.parse_args(argv)
    if args.dead_after <= d.heartbeat_interval:
        cli.error(f"argument --dead-after: must be above the heartbeat interval ({d.heartbeat_interval:g} s), "
                  f"got {args.dead_after:g}")
    if args.max_pages > args.num_pages:
        cli.error(f"argument --max-pages: a request of {args.max_pages} pages would never fit in --num-pages "
                  f"{args.num_pages}")
    ranks = 2 * d.replicas * args.tp
    cache = ranks * args.layers * args.num_pages * args.page_bytes
    memory = memory_bytes()
    if memory is not None and cache > memory:
        cli.error(f"argument --page-bytes/--layers/--num-pages: {args.layers} layers x {args.num_pages} pages x "
                  f"{args.page_bytes} bytes on {ranks} ranks is {cache / 1e9:.1f} GB of KV cache; "
                  f"this machine has {memory / 1e9:.1f} GB")
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    seconds = args.seconds if args.seconds is not None else (None if args.requests is not None else d.seconds)
    plan = ChaosPlan(
        seed=seed, seconds=seconds, requests=args.requests, transport=args.transport, fail_rate=args.fail_rate,
        land_rate=args.land_rate, delay=args.delay, control_drop=args.control_drop, control_delay=args.control_delay,
        control_dup=args.control_dup, control_corrupt=args.control_corrupt, kills=not args.no_kills,
        pauses=not args.no_pauses, dead_after=args.dead_after, window=args.window, verbose=not args.quiet,
        log_level=args.log_level, layers=args.layers, page_bytes=args.page_bytes, num_pages=args.num_pages,
        max_pages=args.max_pages, unsafe_no_grants=args.unsafe_no_grants, prefill_tp=args.tp, decode_tp=args.tp,
    )
    plan = plan.slower(args.slow)
    from ..core.table import IMPLEMENTATION

    print(f"pdcore chaos: seed {seed}, {plan.replicas}P(tp{plan.prefill_tp}) -> {plan.replicas}D(tp{plan.decode_tp}), "
          f"transport {plan.transport}, dead_after {plan.dead_after:g} s, "
          + (f"{plan.seconds:g} s" if plan.seconds is not None else f"{plan.requests} requests")
          + f", {IMPLEMENTATION} state table", flush=True)
    with RunProgress("chaos", mode=args.progress) as progress:
        outcome = run(plan, progress=progress)
    return report(outcome, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
