"""CPU seconds and wake-ups of processes, read from /proc (Linux; elsewhere the readers return None).

What the benchmarks count beside their wall clock: how much CPU a run cost and how often its threads went
to sleep and were woken again (a wake-up is a hand-off to another thread or process, or a wait). ``Usage``
and ``OwnUsage`` take one reading before a timed part and the difference after it; ``CpuSampler`` samples
the ranks a run spawns, which come and go during it.

Per thread too (``ThreadUsage``, ``CpuSampler.threads_between``): pdcore's threads give the kernel their
names (``transport.threads``), so a thread is read from outside as ``"<process> <thread>"``, e.g.
``"decode tcp-sink"``: the process by its peer's driver thread (``decode-driver``: ``decode``; none:
``other``), the thread by its kernel name less a trailing ``-<number>`` (the main thread: ``main``, the
scheduler's in the ranks). /proc counts a thread's CPU in ticks (10 ms): the split is for runs of
seconds, and a thread that ends within the run counts only until the last reading that saw it.
"""

from __future__ import annotations

import os
import re
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


_NUMBERED = re.compile(r"-\d+$")


def _thread_reading(pid: int, tid: str) -> tuple[str, float, int] | None:
    """One thread's kernel name, CPU seconds and voluntary context switches so far (None if it exited)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            head, _, rest = f.read().rpartition(b")")
        fields = rest.split()
        woke = _thread_wakeups(pid, tid)
    except (OSError, IndexError, ValueError):
        return None
    if woke is None:
        return None
    name = "main" if tid == str(pid) else _NUMBERED.sub("", head.split(b"(", 1)[1].decode("utf-8", "replace"))
    return name, (int(fields[11]) + int(fields[12])) / _TICK, woke


def _readings(pid: int) -> dict[str, tuple[str, float, int]]:
    """``tid -> (name, cpu, wake-ups)`` of ``pid``'s live threads."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    return {tid: r for tid in tids if (r := _thread_reading(pid, tid)) is not None}


def _process_role(names: list[str] | set[str]) -> str:
    """What a process is, by its peer's driver thread (``prefill-driver``: ``prefill``)."""
    roles = sorted(n[: -len("-driver")] for n in names if n.endswith("-driver"))
    return roles[0] if roles else "other"


class ThreadUsage:
    """The CPU seconds and wake-ups of every thread of ``pids`` from now to ``spent()``, summed by
    ``"<process> <thread>"`` (the module's docstring says how they are named)."""

    def __init__(self, pids: list[int] | tuple[int, ...]) -> None:
        self.pids = list(pids)
        self._before = {pid: _readings(pid) for pid in self.pids}

    def spent(self) -> dict[str, tuple[float, float]]:
        out: dict[str, tuple[float, float]] = {}
        for pid in self.pids:
            now = _readings(pid)
            role = _process_role({name for name, _, _ in now.values()})
            for tid, (name, cpu, woke) in now.items():
                _, cpu0, woke0 = self._before[pid].get(tid, (name, 0.0, 0))
                key = f"{role} {name}"
                c, w = out.get(key, (0.0, 0))
                out[key] = (c + cpu - cpu0, w + woke - woke0)
        return out


def add_spent(total: dict[str, tuple[float, float]], spent: dict[str, tuple[float, float]]) -> None:
    """Add one run's per-thread ``spent`` (CPU, wake-ups) into ``total``."""
    for key, (cpu, woke) in spent.items():
        c, w = total.get(key, (0.0, 0.0))
        total[key] = (c + cpu, w + woke)


def per_unit(spent: dict[str, tuple[float, float]], units: int) -> dict[str, dict[str, float]]:
    """``spent`` per unit (request, item): µs of CPU and wake-ups, the busiest first, idle threads left out."""
    rows = sorted(spent.items(), key=lambda kv: -kv[1][0])
    return {k: {"cpu_us": round(c * 1e6 / units, 1), "wakeups": round(w / units, 2)} for k, (c, w) in rows if c or w}


def thread_lines(per: dict[str, dict[str, float]], unit: str, top: int = 8) -> str:
    """The busiest threads of ``per_unit`` on one line: ``decode tcp-sink 317 µs 0.53`` ..."""
    return "; ".join(f"{k} {v['cpu_us']:.0f} µs {v['wakeups']:.2f}" for k, v in list(per.items())[:top]) + f" (CPU, wake-ups per {unit})"


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        pass
    return out


def process_tree(pid: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """``pid`` and its live descendants, less those in ``exclude`` (and theirs)."""
    out, todo = [pid], [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in exclude and child not in out:
                out.append(child)
                todo.append(child)
    return out


class CpuSampler:
    """Samples the CPU seconds and the wake-ups of this process's descendants (the ranks) every ``period`` seconds.

    ``between(t0, t1)`` is the CPU they spent between two ``time.time()`` stamps (interpolated
    per process between samples), ``wakeups_between(t0, t1)`` their threads' voluntary context
    switches (per thread: one that exits keeps its last count; read every ``WAKEUPS_EVERY``-th
    sample, as a thread's counts cost two file reads each), ``threads_between(t0, t1)`` both per
    ``"<process> <thread>"`` (read with the wake-ups); processes in ``exclude`` (and their
    children) are left out.
    """

    WAKEUPS_EVERY = 4

    def __init__(self, exclude: set[int], period: float = 0.05) -> None:
        import threading

        self._exclude = exclude
        self._period = period
        self._series: dict[int, list[tuple[float, float]]] = {}
        self._wakeups: dict[tuple[int, str], list[tuple[float, float]]] = {}
        self._thread_cpu: dict[tuple[int, str], list[tuple[float, float]]] = {}
        self._names: dict[tuple[int, str], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        samples = 0
        while not self._stop.wait(self._period):
            samples += 1
            seen = process_tree(os.getpid(), self._exclude)[1:]
            now = time.time()
            for pid in seen:
                c = cpu_seconds(pid)
                if c is not None:
                    self._series.setdefault(pid, []).append((now, c))
                if samples % self.WAKEUPS_EVERY:
                    continue
                for tid, (name, cpu, count) in _readings(pid).items():
                    self._names[pid, tid] = name
                    self._wakeups.setdefault((pid, tid), []).append((now, float(count)))
                    self._thread_cpu.setdefault((pid, tid), []).append((now, cpu))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> float:
        return sum(_at(series, t1) - _at(series, t0) for series in self._series.values())

    def wakeups_between(self, t0: float, t1: float) -> float:
        return sum(_at(series, t1) - _at(series, t0) for series in self._wakeups.values())

    def threads_between(self, t0: float, t1: float) -> dict[str, tuple[float, float]]:
        roles: dict[int, set[str]] = {}
        for (pid, _), name in self._names.items():
            roles.setdefault(pid, set()).add(name)
        out: dict[str, tuple[float, float]] = {}
        for key, series in self._thread_cpu.items():
            name = f"{_process_role(roles[key[0]])} {self._names[key]}"
            woke = self._wakeups[key]
            c, w = out.get(name, (0.0, 0.0))
            out[name] = (c + _at(series, t1) - _at(series, t0), w + _at(woke, t1) - _at(woke, t0))
        return out


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
