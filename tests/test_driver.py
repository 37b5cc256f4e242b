"""The threaded driver's clock: the engines' deadlines are kept under a stream of inputs.

The driver asks the engines for their next deadline only when its inbox runs dry; under a stream
that never lets it run dry, the clock still runs every ``TICK``. The engine here is a counter (the
driver's contract with an engine is ``next_deadline``, ``tick``, ``take_actions`` and the inputs);
the driver, its threads and its inbox are the real ones.
"""

from __future__ import annotations

import threading
import time

from pdcore.core.deadline import Deadline
from pdcore.node.driver import TICK, Driver

STREAM = 0.5  # seconds of back-to-back inputs


class Clocked:
    """An engine whose deadline is always 5 ms away; it counts its ticks and the inputs it took."""

    def __init__(self) -> None:
        self.ticks = 0
        self.inputs = 0

    def next_deadline(self) -> float:
        return time.monotonic() + 0.005

    def tick(self, now: float) -> None:
        self.ticks += 1

    def take_actions(self) -> list[object]:
        return []

    def work(self, now: float) -> None:
        self.inputs += 1


def test_a_stream_of_inputs_does_not_stop_the_engines_clock() -> None:
    driver = Driver("clock", transport=None, channel=None, secret=None, max_inputs=1 << 20, io_queue=4)
    engine = Clocked()
    driver.attach(engine)
    driver.start()
    try:
        ready = threading.Event()
        driver.call(ready.set)
        assert ready.wait(5.0)
        before, started = engine.ticks, time.monotonic()
        until = Deadline.after(STREAM)
        submitted = 0
        while not until.expired():  # faster than the driver takes them: its inbox never runs dry
            for _ in range(64):
                driver.submit(engine.work)
            submitted += 64
        # The stream lasts until the driver took its last input (``done`` is queued behind it): a driver
        # the submitting thread starved works through a backlog after STREAM, its inbox still not dry.
        seen: list[int] = []
        done = threading.Event()
        driver.call(lambda: (seen.append(engine.ticks), done.set()))
        assert done.wait(30.0), "the driver did not take the stream's inputs"
        elapsed = time.monotonic() - started
    finally:
        driver.close(Deadline.after(5.0))
    assert engine.inputs == submitted
    during = seen[0] - before
    assert during >= elapsed / TICK / 2, f"{during} ticks in {elapsed:.2f} s of inputs (one is due every {TICK} s at most)"
