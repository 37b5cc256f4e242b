"""The pipelined replay both transport floors use: post batches up to the in-flight bound, reap, repeat."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdcore.core.deadline import Deadline
from pdcore.core.errors import CapacityError


def post_pipelined(t: Any, peer: Any, batches: Sequence[Any], seconds: float, what: str) -> None:
    """Post every batch in order, as many in flight as the transport allows; wait for all (queue mode)."""
    posted = done = 0
    deadline = Deadline.after(seconds)
    while done < len(batches):
        while posted < len(batches):
            try:
                t.write(peer, batches[posted])
            except CapacityError:
                break
            posted += 1
        for c in t.completions(deadline=deadline):
            if c.error is not None:
                raise c.error
            done += 1
        deadline.check(what)
