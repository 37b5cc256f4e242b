"""CPU seconds and wake-ups of processes, read from /proc (Linux; elsewhere the readers return None).

What the benchmarks count beside their wall clock: how much CPU a run cost and how often its threads went
to sleep and were woken again (a wake-up is a hand-off to another thread or process, or a wait). ``Usage``
and ``OwnUsage`` take one reading before a timed part and the difference after it; ``CpuSampler`` samples
the ranks a run spawns, which come and go during it.
"""

from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of every thread of ``pid`` so far (None if gone or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def wakeups(pid: int) -> int | None:
    """Voluntary context switches of every live thread of ``pid`` so far: each is a thread going to
    sleep to wait (a queue, a socket, a lock, a timer) and being woken again (None if gone or not Linux)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    return sum(_thread_wakeups(pid, tid) or 0 for tid in tids)


def _thread_wakeups(pid: int, tid: str) -> int | None:
    """One thread's voluntary context switches so far (None if it exited meanwhile)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        pass
    return out


class CpuSampler:
    """Samples the CPU seconds and the wake-ups of this process's descendants (the ranks) every ``period`` seconds.

    ``between(t0, t1)`` is the CPU they spent between two ``time.time()`` stamps (interpolated
    per process between samples), ``wakeups_between(t0, t1)`` their threads' voluntary context
    switches (per thread: one that exits keeps its last count; read every ``WAKEUPS_EVERY``-th
    sample, as a thread's counts cost a file read each); processes in ``exclude`` (and their
    children) are left out.
    """

    WAKEUPS_EVERY = 4

    def __init__(self, exclude: set[int], period: float = 0.05) -> None:
        import threading

        self._exclude = exclude
        self._period = period
        self._series: dict[int, list[tuple[float, float]]] = {}
        self._wakeups: dict[tuple[int, str], list[tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        samples = 0
        while not self._stop.wait(self._period):
            samples += 1
            todo, seen = [os.getpid()], set()
            while todo:
                pid = todo.pop()
                for child in _children(pid):
                    if child not in self._exclude and child not in seen:
                        seen.add(child)
                        todo.append(child)
            now = time.time()
            for pid in seen:
                c = cpu_seconds(pid)
                if c is not None:
                    self._series.setdefault(pid, []).append((now, c))
                if samples % self.WAKEUPS_EVERY:
                    continue
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for tid in tids:
                    count = _thread_wakeups(pid, tid)
                    if count is not None:
                        self._wakeups.setdefault((pid, tid), []).append((now, float(count)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> float:
        return sum(_at(series, t1) - _at(series, t0) for series in self._series.values())

    def wakeups_between(self, t0: float, t1: float) -> float:
        return sum(_at(series, t1) - _at(series, t0) for series in self._wakeups.values())


def _at(series: list[tuple[float, float]], t: float) -> float:
    if t <= series[0][0]:
        return series[0][1]
    for (ta, ca), (tb, cb) in zip(series, series[1:]):
        if ta <= t <= tb:
            return ca + (cb - ca) * (t - ta) / (tb - ta) if tb > ta else cb
    return series[-1][1]


class Usage:
    """The CPU seconds and wake-ups of ``pids`` from now to ``spent()`` (a process gone at either reading,
    or not on Linux, counts nothing)."""

    def __init__(self, pids: list[int] | tuple[int, ...]) -> None:
        self.pids = list(pids)
        self._cpu = [cpu_seconds(p) for p in self.pids]
        self._woke = [wakeups(p) for p in self.pids]

    def spent(self) -> tuple[float, int]:
        cpu1 = [cpu_seconds(p) for p in self.pids]
        woke1 = [wakeups(p) for p in self.pids]
        cpu = sum(b - a for a, b in zip(self._cpu, cpu1) if a is not None and b is not None)
        woke = sum(b - a for a, b in zip(self._woke, woke1) if a is not None and b is not None)
        return cpu, woke


class OwnUsage:
    """This process's CPU seconds (its own clock: finer than /proc's ticks) and wake-ups from now to
    ``spent()``."""

    def __init__(self) -> None:
        self._cpu, self._woke = time.process_time(), wakeups(os.getpid()) or 0

    def spent(self) -> tuple[float, int]:
        return time.process_time() - self._cpu, (wakeups(os.getpid()) or 0) - self._woke
