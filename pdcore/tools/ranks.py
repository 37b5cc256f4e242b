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
    pipes: dict[Any, tuple[str, int, int]] = {}
    procs: dict[tuple[str, int], list[Any]] = {}
    results: dict[str, dict[tuple[int, int], dict[str, Any]]] = {role: {} for role, *_ in layout}
    errors: list[str] = []
    causes: list[str] = []
    start_failure: str | None = None
    killed_at: dict[tuple[str, int], float] = {}
    expected = len(layout)
    serving = sum(role in stopped_roles for role, *_ in layout)  # ranks that run until ``stop``
    started = time.monotonic()
    ready = finished = stopped_finished = 0
    reported: set[tuple[str, int, int]] = set()
    done_total = {index: (0, 0, 0) for index in range(len(decode_tp))}  # (ok, failed, bytes) per replica

    def finish(role: str) -> None:
        nonlocal finished, stopped_finished
        finished += 1
        stopped_finished += role in stopped_roles

    def counts(index: int, ok: int, failed: int, nbytes: int) -> None:
        done_total[index] = (ok, failed, nbytes * decode_tp[index])
        if progress is not None:
            progress.update(*(sum(t[i] for t in done_total.values()) for i in range(3)))

    try:
        for role, index, rank, args in layout:
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=rank_main, args=(*args, RankPipe(writer)), daemon=True)
            p.start()
            writer.close()  # the rank holds the only writer: its exit is our EOF
            pipes[reader] = (role, index, rank)
            procs.setdefault((role, index), []).append(p)
        hard_deadline = started + timeout + 60.0
        inbox: deque[Any] = deque()
        while finished < expected and time.monotonic() < hard_deadline:
            if stop is not None and finished - stopped_finished >= expected - serving:
                stop.set()  # the others are done: the serving ranks report and leave
            if not inbox:
                for reader in mp_connection.wait(list(pipes), timeout=0.5):
                    try:
                        inbox.append(reader.recv())
                    except (EOFError, OSError):  # the rank exited or was killed
                        who = pipes.pop(reader)
                        reader.close()
                        if who in reported or who[:2] in killed_at:
                            continue
                        if ready < expected:
                            if start_failure is None:
                                start_failure = f"{who[0]} {who[1]} rank {who[2]} exited before it was ready"
                                causes.append(start_failure)
                        else:
                            errors.append(f"{who[0]} {who[1]} rank {who[2]} exited without a report")
                            causes.append(errors[-1])
                            finish(who[0])
                if start_failure is not None:
                    break
                if not inbox:
                    if not pipes:
                        break
                    if progress is not None:
                        progress.ranks_ready(ready, expected)
                    continue
            kind, role, index, rank, payload = inbox.popleft()
            if kind in ("done", "error"):
                reported.add((role, index, rank))
                finish(role)
            if kind == "ready":
                ready += 1
                if progress is not None:
                    progress.ranks_ready(ready, expected)
                if ready == expected:
                    started = time.monotonic()  # throughput counts from here, not from process start
                    if progress is not None:
                        progress.running(requests)
            elif kind == "error":
                why, trace = payload
                errors.append(f"{role} {index} rank {rank}: {trace}")
                causes.append(f"{role} {index} rank {rank}: {why}")
                if ready < expected:  # the run never started: say so once, stop the other ranks now
                    start_failure = causes[-1]
                    break
            elif kind == "done":
                results[role][(index, rank)] = payload
                if role == "decode" and rank == 0:  # its last word: the replica's final counts
                    counts(index, payload["ok"], payload["failed"], payload["bytes"])
            elif kind == "progress":
                counts(index, *payload)
            for victim, at in (kill or {}).items():
                if victim not in killed_at and sum(t[0] + t[1] for t in done_total.values()) >= at:
                    for p in procs[victim]:
                        p.kill()
                    killed_at[victim] = time.time()
                    expected -= len(procs[victim])
    finally:
        if stop is not None:
            stop.set()
        everyone = [p for ps in procs.values() for p in ps]
        if start_failure is not None:  # the others would wait for it until their own timeouts
            for p in everyone:
                p.kill()
        for p in everyone:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for reader in pipes:
            reader.close()
    if start_failure is None and finished < expected:
        errors.append(f"only {finished} of {expected} ranks reported within the deadline")
        causes.append(errors[-1])
    return Reports(results, errors, causes, time.monotonic() - started, start_failure, killed_at)
