"""The demos' rank processes: start them, gather what they report, and stop them, always.

Both demos (``demo`` and ``demo --epd``) run one process per rank and watch
them through one loop here: each rank has its own pipe to the runner, says
``ready`` once set up, may send ``progress``, and ends with ``done`` (its
result) or ``error`` (a cause and a traceback). A rank that fails, or exits,
before every rank is ready ends the run at once (``start_failure``); after
that, a rank that exits without a report is an error, except one the runner
killed on purpose (``kill``). Every wait is bounded: the loop ends by the
deadline, and every child is joined or killed on the way out.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .progress import RunProgress

__all__ = ["RankPipe", "Reports", "cause", "context", "rank_main", "supervise"]

#: (role, replica index, rank, (target, *args)); the rank's pipe is appended to the arguments.
Layout = list[tuple[str, int, int, tuple[Any, ...]]]


class RankPipe:
    """A rank's own pipe to the runner (``out.put(msg)``).

    Not one ``multiprocessing.Queue`` shared by every rank: its write lock is shared too, and a
    rank killed while its feeder thread held it would block every other rank's reports for good.
    A killed rank here breaks only its own pipe.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def put(self, msg: Any) -> None:
        self._conn.send(msg)


def rank_main(target: Any, *args: Any) -> None:
    """A rank process: run ``target(*args)`` (its last argument is its ``RankPipe``); report what escapes."""
    out = args[-1]
    try:
        target(*args)
    except BaseException as e:
        role = target.__name__.strip("_").removesuffix("_rank")  # "encode" / "prefill" / "decode"
        out.put(("error", role, args[1], args[2], (cause(e), traceback.format_exc())))


def cause(e: BaseException) -> str:
    """One line naming an exception: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def context(preload: list[str]) -> Any:
    """Where ranks start: a fork server that imported ``preload`` (pdcore, and so torch) once.

    A spawned rank re-imports torch, a second or more of CPU each, which dominates a run of a few
    hundred requests on a small machine; a fork of the server costs milliseconds. The server is a
    fresh single-threaded process (not a fork of this one, whose threads a fork would not carry),
    so forking it is safe. Spawn where there is no fork server. Once the process's fork server
    runs, its preload list is what it was then.
    """
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(preload)
    return ctx


@dataclass
class Reports:
    """What the ranks reported: ``results[role][(index, rank)]`` is a rank's ``done`` payload."""

    results: dict[str, dict[tuple[int, int], dict[str, Any]]]
    errors: list[str]
    #: one line per entry of ``errors`` (``errors`` holds the tracebacks)
    causes: list[str]
    #: seconds from every rank ready to the end
    seconds: float
    #: the run never started: one line naming the first rank that failed before every rank was ready
    start_failure: str | None = None
    #: (role, index) -> wall-clock time the runner killed that replica
    killed_at: dict[tuple[str, int], float] = field(default_factory=dict)


def supervise(
    ctx: Any,
    layout: Layout,
    *,
    timeout: float,
    requests: int,
    decode_tp: list[int],
    progress: RunProgress | None = None,
    kill: dict[tuple[str, int], int] | None = None,
    stop: Any = None,
    stopped_roles: frozenset[str] = frozenset(),
) -> Reports:
    """Start every rank of ``layout`` and gather their reports until each finished or ``timeout`` (+60 s).

    ``decode_tp``: ranks per decode replica (rank 0 of each reports the replica's counts).
    ``kill``: (role, index) -> kill that replica's ranks once this many requests ended.
    ``stop``: an event set once every rank whose role is not in ``stopped_roles`` finished
    (the encode ranks serve until then), and on the way out.
    """
    return _Supervisor(layout, requests=requests, decode_tp=decode_tp, progress=progress, kill=kill, stop=stop,
                       stopped_roles=stopped_roles).run(ctx, timeout)


class _Supervisor:
    """One run of ``supervise``: what the ranks reported so far, and how many are ready, finished, killed."""

    def __init__(self, layout: Layout, *, requests: int, decode_tp: list[int], progress: RunProgress | None,
                 kill: dict[tuple[str, int], int] | None, stop: Any, stopped_roles: frozenset[str]) -> None:
        self.layout = layout
        self.requests = requests
        self.decode_tp = decode_tp
        self.progress = progress
        self.kill = kill or {}
        self.stop = stop
        self.stopped_roles = stopped_roles
        self.pipes: dict[Any, tuple[str, int, int]] = {}
        self.procs: dict[tuple[str, int], list[Any]] = {}
        self.results: dict[str, dict[tuple[int, int], dict[str, Any]]] = {role: {} for role, *_ in layout}
        self.errors: list[str] = []
        self.causes: list[str] = []
        self.start_failure: str | None = None
        self.killed_at: dict[tuple[str, int], float] = {}
        self.expected = len(layout)
        self.serving = sum(role in stopped_roles for role, *_ in layout)  # ranks that run until ``stop``
        self.started = time.monotonic()
        self.ready = self.finished = self.stopped_finished = 0
        self.reported: set[tuple[str, int, int]] = set()
        self.done_total = {index: (0, 0, 0) for index in range(len(decode_tp))}  # (ok, failed, bytes) per replica

    def run(self, ctx: Any, timeout: float) -> Reports:
        """Start the ranks, gather until each finished or the deadline, and always stop and join them."""
        try:
            self._start(ctx)
            self._gather(self.started + timeout + 60.0)
        finally:
            self._shut_down()
        if self.start_failure is None and self.finished < self.expected:
            self.errors.append(f"only {self.finished} of {self.expected} ranks reported within the deadline")
            self.causes.append(self.errors[-1])
        return Reports(self.results, self.errors, self.causes, time.monotonic() - self.started, self.start_failure,
                       self.killed_at)

    def _start(self, ctx: Any) -> None:
        for role, index, rank, args in self.layout:
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=rank_main, args=(*args, RankPipe(writer)), daemon=True)
            p.start()
            writer.close()  # the rank holds the only writer: its exit is our EOF
            self.pipes[reader] = (role, index, rank)
            self.procs.setdefault((role, index), []).append(p)

    def _gather(self, hard_deadline: float) -> None:
        """Take the ranks' reports one at a time until every rank finished, the run failed to start, every pipe
        closed, or the deadline; after each, kill the replicas whose turn came."""
        inbox: deque[Any] = deque()
        while self.finished < self.expected and time.monotonic() < hard_deadline:
            if self.stop is not None and self.finished - self.stopped_finished >= self.expected - self.serving:
                self.stop.set()  # the others are done: the serving ranks report and leave
            if not inbox:
                self._receive(inbox)
                if self.start_failure is not None:
                    break
                if not inbox:
                    if not self.pipes:
                        break
                    if self.progress is not None:
                        self.progress.ranks_ready(self.ready, self.expected)
                    continue
            if not self._take(*inbox.popleft()):
                break
            self._kill_due()

    def _receive(self, inbox: deque[Any]) -> None:
        """Wait up to 0.5 s for reports; a pipe at EOF is a rank that exited (or was killed)."""
        for reader in mp_connection.wait(list(self.pipes), timeout=0.5):
            try:
                inbox.append(reader.recv())
            except (EOFError, OSError):  # the rank exited or was killed
                who = self.pipes.pop(reader)
                reader.close()
                if who in self.reported or who[:2] in self.killed_at:
                    continue
                if self.ready < self.expected:
                    if self.start_failure is None:
                        self.start_failure = f"{who[0]} {who[1]} rank {who[2]} exited before it was ready"
                        self.causes.append(self.start_failure)
                else:
                    self.errors.append(f"{who[0]} {who[1]} rank {who[2]} exited without a report")
                    self.causes.append(self.errors[-1])
                    self._finish(who[0])

    def _take(self, kind: str, role: str, index: int, rank: int, payload: Any) -> bool:
        """One report; False when it ends the run (a rank failed before every rank was ready)."""
        if kind in ("done", "error"):
            self.reported.add((role, index, rank))
            self._finish(role)
        if kind == "ready":
            self.ready += 1
            if self.progress is not None:
                self.progress.ranks_ready(self.ready, self.expected)
            if self.ready == self.expected:
                self.started = time.monotonic()  # throughput counts from here, not from process start
                if self.progress is not None:
                    self.progress.running(self.requests)
        elif kind == "error":
            why, trace = payload
            self.errors.append(f"{role} {index} rank {rank}: {trace}")
            self.causes.append(f"{role} {index} rank {rank}: {why}")
            if self.ready < self.expected:  # the run never started: say so once, stop the other ranks now
                self.start_failure = self.causes[-1]
                return False
        elif kind == "done":
            self.results[role][(index, rank)] = payload
            if role == "decode" and rank == 0:  # its last word: the replica's final counts
                self._counts(index, payload["ok"], payload["failed"], payload["bytes"])
        elif kind == "progress":
            self._counts(index, *payload)
        return True

    def _finish(self, role: str) -> None:
        self.finished += 1
        self.stopped_finished += role in self.stopped_roles

    def _counts(self, index: int, ok: int, failed: int, nbytes: int) -> None:
        self.done_total[index] = (ok, failed, nbytes * self.decode_tp[index])
        if self.progress is not None:
            self.progress.update(*(sum(t[i] for t in self.done_total.values()) for i in range(3)))

    def _kill_due(self) -> None:
        """Kill each replica of ``kill`` once as many requests ended as it names (it is expected to report no more)."""
        for victim, at in self.kill.items():
            if victim not in self.killed_at and sum(t[0] + t[1] for t in self.done_total.values()) >= at:
                for p in self.procs[victim]:
                    p.kill()
                self.killed_at[victim] = time.time()
                self.expected -= len(self.procs[victim])

    def _shut_down(self) -> None:
        """Set ``stop``, kill every rank if the run never started, join the rest (killing what lingers)."""
        if self.stop is not None:
            self.stop.set()
        everyone = [p for ps in self.procs.values() for p in ps]
        if self.start_failure is not None:  # the others would wait for it until their own timeouts
            for p in everyone:
                p.kill()
        for p in everyone:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for reader in self.pipes:
            reader.close()
