"""Absolute, monotonic deadlines: every blocking call of the data plane takes one.

Owned here so ``transport`` stands alone; ``pdcore.core.deadline`` re-exports these
classes, so one ``Deadline`` is used everywhere. Nested deadlines combine with
``min`` (``Deadline.earliest``).
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

__all__ = ["Deadline", "DeadlineExceeded"]


class DeadlineExceeded(TimeoutError):
    """A wait ran past its deadline."""


class Deadline(NamedTuple):
    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        if math.isnan(seconds) or seconds < 0:
            raise ValueError(f"a deadline needs a non-negative number of seconds, got {seconds!r}")
        return cls(time.monotonic() + seconds)

    @classmethod
    def never(cls) -> Deadline:
        return cls(math.inf)

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def earliest(self, other: Deadline) -> Deadline:
        return self if self.at <= other.at else other

    def check(self, what: str) -> None:
        """Raise ``DeadlineExceeded`` naming ``what`` if the deadline passed."""
        if self.expired():
            raise DeadlineExceeded(f"{what}: deadline passed")
