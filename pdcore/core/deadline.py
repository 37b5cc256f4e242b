"""Absolute, monotonic deadlines: every blocking call in the I/O edges takes one.

The classes live in the data plane (``transport.deadline``), the bottom layer,
and are re-exported here: ``pdcore.core.deadline.Deadline is transport.deadline.Deadline``,
so one class is used everywhere. Nested deadlines combine with ``min``
(``Deadline.earliest``); the sans-IO tables never read a clock, they take
``now`` as an argument.
"""

from __future__ import annotations

from transport.deadline import Deadline, DeadlineExceeded

__all__ = ["Deadline", "DeadlineExceeded"]
