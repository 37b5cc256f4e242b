"""The chaos runner: starts the replicas and their bootstrap servers, routes requests, injects kills and pauses.

It talks to rank 0 of each replica only; each fault is recorded as an action with its
time, so the report can say what happened when (``chaos_check``).
"""

from __future__ import annotations

import multiprocessing.connection as mp_connection
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any


from .demo import PRELOAD, Request
from .ranks import context
from .progress import RunProgress
from .chaos_plan import ChaosPlan
from .chaos_ranks import decode_rank, prefill_rank, rank_main


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
                args = (prefill_rank, self.plan, role, index, gen, rank, stack, self.ports[index], store, theirs)
            else:
                args = (decode_rank, self.plan, role, index, gen, rank, stack, self.ports, store, theirs)
            p = self.ctx.Process(target=rank_main, args=args, daemon=True, name=f"chaos-{role}-{index}-{gen}-{rank}")
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
        """Start every replica, run the faulty phase, stop and drain the survivors; the outcome."""
        plan = self.plan
        why = self._start_replicas()
        if why is not None:
            return self.abort(why)
        self.m0 = time.monotonic()
        self.t0 = time.time()
        self.started = True
        if self.progress is not None:
            self.progress.running(plan.requests)
        self.note(f"all replicas up; seed {plan.seed}")
        self._faulty_phase()
        stopping, hung = self._stop_and_drain()
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

    def _start_replicas(self) -> str | None:
        """Spawn every replica and wait (up to ``start_timeout``) for them to be up; why the run cannot start, if
        a rank raised or exited first."""
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
                return why
        return None

    def _faulty_phase(self) -> None:
        """Dispatch requests and strike faults until the phase ends (its seconds, or its requests all ended);
        then no process stays paused and nothing restarts."""
        plan = self.plan
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
            if self.progress is not None:
                self.progress.update(*self.ended)
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

    def _stop_and_drain(self) -> tuple[list[_Incarnation], list[str]]:
        """Tell every surviving replica to stop and wait for each rank's report and exit; the replicas told, and
        one line per rank that did not report or exit in time (with its threads' stacks)."""
        plan = self.plan
        stopping = [i for i in self.current.values() if not i.killed]
        for inc in stopping:
            inc.stopping = True
            self.send(inc, ("stop",))
        # every surviving rank reports within the drain plus the time it takes to start and to close
        deadline = time.monotonic() + plan.drain + plan.start_timeout + 15.0
        pending = lambda: [(i, r) for i in stopping for r in range(len(i.procs)) if r not in i.done and r not in i.errors and r not in i.exited]  # noqa: E731
        while pending() and time.monotonic() < deadline:
            self.receive(0.1)
            if self.progress is not None:
                self.progress.update(*self.ended)
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
        return stopping, hung

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
