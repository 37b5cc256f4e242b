"""The threaded driver's clock (the engines' deadlines are kept under a stream of inputs), its lane
(what other threads queue while it works is one hand-off) and its threads' names in the kernel.

The driver asks the engines for their next deadline only when its inbox runs dry; under a stream
that never lets it run dry, the clock still runs every ``TICK``. The engine here is a counter (the
driver's contract with an engine is ``next_deadline``, ``tick``, ``take_actions`` and the inputs);
the driver, its threads and its inbox are the real ones. Each input takes at least ``WORK`` of wall
time, so a tick is due after at most ``TICK / WORK`` inputs however slow the machine: the bound
counts inputs, not seconds.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdcore.control.tcp_plane import TcpPlane
from pdcore.core.deadline import Deadline
from pdcore.node.driver import TICK, Driver

WORK = 0.001  # seconds each input sleeps (at least)
STREAM = 300  # inputs queued back to back: at least 0.3 s of the driver's work


@contextlib.contextmanager
def _running(plane: str | None, engine: Any) -> Iterator[Driver]:
    """A real driver of ``engine``, on its inbox alone or running a real "tcp" plane's loop; closed after."""
    channel = None if plane is None else TcpPlane(lambda s, m: None, session_id="driver")
    driver = Driver("driver", transport=None, channel=channel, secret=None, max_inputs=1 << 20, io_queue=4)
    driver.attach(engine)
    if channel is not None:
        channel.start()
    driver.start()
    try:
        yield driver
    finally:
        driver.close(Deadline.after(5.0))
        if channel is not None:
            channel.close(Deadline.after(5.0))


class Clocked:
    """An engine whose deadline is always 5 ms away; at each tick it notes how many inputs it had taken."""

    def __init__(self) -> None:
        self.at_ticks: list[int] = []
        self.inputs = 0

    def next_deadline(self) -> float:
        return time.monotonic() + 0.005

    def tick(self, now: float) -> None:
        self.at_ticks.append(self.inputs)

    def take_actions(self) -> list[object]:
        return []

    def work(self, now: float) -> None:
        time.sleep(WORK)
        self.inputs += 1


@pytest.mark.parametrize("plane", [None, "tcp"])
def test_a_stream_of_inputs_does_not_stop_the_engines_clock(plane: str | None) -> None:
    """Without a plane the driver waits on its inbox; with the "tcp" plane it runs the plane's loop
    between inputs: either way the engines' clock goes on under a stream of inputs."""
    engine = Clocked()
    with _running(plane, engine) as driver:
        ready = threading.Event()
        driver.call(ready.set)
        assert ready.wait(5.0)
        ticks_before = len(engine.at_ticks)
        for _ in range(STREAM):  # queued in well under one input's WORK: the inbox stays full to the end
            driver.submit(engine.work)
        done = threading.Event()
        driver.call(done.set)
        assert done.wait(60.0), "the driver did not take the stream's inputs"
    assert engine.inputs == STREAM
    during = [n for n in engine.at_ticks[ticks_before:] if n < STREAM]
    bounds = [0, *during, STREAM]  # from the stream's start to its end
    most = int(TICK / WORK) + 1  # inputs of at least WORK each until a tick is due, and the one it waits behind
    gaps = [b - a for a, b in zip(bounds, bounds[1:])]
    assert max(gaps) <= most, f"ticks after inputs {during} of {STREAM}: a gap of more than {most} inputs"


class Held:
    """An engine whose one slow input holds the driver while other threads' inputs arrive; it notes them."""

    def __init__(self) -> None:
        self.busy = threading.Event()
        self.release = threading.Event()
        self.seen: list[object] = []

    def next_deadline(self) -> float:
        return time.monotonic() + 60.0

    def tick(self, now: float) -> None:
        pass

    def take_actions(self) -> list[object]:
        return []

    def hold(self, now: float) -> None:
        self.busy.set()
        assert self.release.wait(30.0)

    def note(self, what: object, now: float) -> None:
        self.seen.append(what)


@pytest.mark.parametrize("plane", [None, "tcp"])
def test_inputs_from_other_threads_while_the_driver_works_are_one_hand_off_in_their_order(plane: str | None) -> None:
    """What other threads queue while the driver works (here a thread standing in for the transport's
    completion thread, through the driver's ``_result``, the seam the transports call, then the scheduler's
    thread) costs one queue entry and one hand-off, taken in bursts (more than one here), each input
    once, in the order they came; the next input after the lane was taken starts another. The outside
    view (fewer hand-offs per request) is ``benchmarks/pd.py``'s."""
    engine = Held()
    with _running(plane, engine) as driver:
        driver.submit(engine.hold)
        assert engine.busy.wait(10.0)
        before, inputs = driver.stats["handoffs"], driver.stats["lane_inputs"]
        completions = threading.Thread(target=lambda: [driver._result(engine.note, n) for n in range(50)])
        completions.start()
        completions.join(10.0)
        driver.submit(engine.note, "scheduler")
        done = threading.Event()
        driver.call(done.set)
        engine.release.set()
        assert done.wait(10.0)
        assert engine.seen == [*range(50), "scheduler"]
        assert driver.stats["handoffs"] == before + 1, "52 inputs queued while the driver worked: one hand-off"
        assert driver.stats["lane_inputs"] == inputs + 52
        again = threading.Event()
        driver.call(again.set)
        assert again.wait(10.0)
        assert driver.stats["handoffs"] == before + 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's thread names are read from /proc")
def test_the_driver_and_its_io_threads_carry_their_names_to_the_kernel() -> None:
    """What ``top -H`` and the benchmarks' per-thread figures show: the driver's threads by role, not ``python``."""
    with _running("tcp", Clocked()):
        named = {}
        for t in threading.enumerate():
            if t.name.startswith("pdcore-driver-"):
                with open(f"/proc/self/task/{t.native_id}/comm") as f:
                    named[t.name] = f.read().rstrip("\n")
    assert named["pdcore-driver-driver"] == "driver-driver"
    io = {python: kernel for python, kernel in named.items() if python.startswith("pdcore-driver-io-")}
    assert io and all(kernel == python.removeprefix("pdcore-") for python, kernel in io.items()), io
