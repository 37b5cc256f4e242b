"""The simulated world: one clock, one ordered queue of what happens next, one seeded random source.

Everything in a simulation is an event at a time on this clock: a control frame
arriving, a write landing, a completion, a look-up answer, a scheduler's round,
a fault. ``run`` takes them in time order (ties in the order they were
scheduled), so a seed replays exactly. Time moves only when the next event is
later: seconds of simulated time cost what their events cost to compute. The
last steps are kept (``trace``: each step's time, function and arguments, formatted
only when read) to say what led to a violation.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["World", "Violation"]


class Violation(AssertionError):
    """An invariant did not hold; ``str`` names it, the world's trace says what came before."""


class World:
    def __init__(self, seed: int, trace: int = 40) -> None:
        self.seed = seed
        self.now = 0.0
        self.rng = random.Random(seed)
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self._steps: deque[tuple[float, Callable[..., Any], tuple[Any, ...]]] = deque(maxlen=trace)
        self.steps = 0

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at ``when`` (never in the past)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self._seq, fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    @property
    def trace(self) -> list[str]:
        """The last steps taken, oldest first, one line each: when, what ran, with what."""
        return [f"{when:10.4f} {getattr(fn, '__qualname__', fn)}({', '.join(_short(a) for a in args)})"
                for when, fn, args in self._steps]

    def run(self, until: float, check: Callable[[], None] | None = None) -> None:
        """Take events up to time ``until``; ``check()`` after each one (raises ``Violation``)."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            self.steps += 1
            self._steps.append((when, fn, args))  # a tuple a step: formatted only if a violation reads it
            fn(*args)
            if check is not None:
                check()
        self.now = max(self.now, until)

    def pending(self) -> int:
        return len(self._heap)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
