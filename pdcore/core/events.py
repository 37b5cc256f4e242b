"""What the scheduler receives: small frozen values, never subclassed.

Events compare equal across the ranks of a replica: ``Failed.reason`` is this
rank's own explanation (a rank that did not fail locally only knows that
another rank did), so it is left out of equality. The events the state table
emits (``Bootstrapped``, ``Failed``, ``Succeeded``) are compiled from
``_events_py`` (see there why); ``PDCORE_PURE_PYTHON=1`` takes that file as
Python, as ``table.py`` takes the table's pure twin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from transport.limits import U64_MAX

from ..twins import load

if TYPE_CHECKING:
    from ._events_py import FAILED_ELSEWHERE, Bootstrapped, Event, Failed, Succeeded
else:
    _events = load("pdcore.core._events")
    FAILED_ELSEWHERE, Event = _events.FAILED_ELSEWHERE, _events.Event
    Bootstrapped, Failed, Succeeded = _events.Bootstrapped, _events.Failed, _events.Succeeded

__all__ = [
    "BootstrapInfo",
    "RemotePrefill",
    "Event",
    "Bootstrapped",
    "Failed",
    "Succeeded",
    "RemotePrefillDone",
    "FAILED_ELSEWHERE",
]



@dataclass(frozen=True, slots=True)
class BootstrapInfo:
    """Where a request's peer node reaches it: the bootstrap server and the room.

    ``dp_rank`` names the prefill deployment's DP group that serves the request (DP attention routed by
    the router); None routes by room, ``room % dp_size``.
    """

    host: str
    port: int
    room: int
    dp_rank: int | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("BootstrapInfo.host is empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"BootstrapInfo.port {self.port!r} is not a TCP port")
        if not 0 <= self.room <= U64_MAX:
            raise ValueError(f"BootstrapInfo.room {self.room!r} is not an unsigned 64-bit integer")
        if self.dp_rank is not None and (isinstance(self.dp_rank, bool) or not isinstance(self.dp_rank, int)
                                         or not 0 <= self.dp_rank < 1024):
            raise ValueError(f"BootstrapInfo.dp_rank {self.dp_rank!r} is not a DP rank (0..1023) or None")


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A decode-side request whose KV landed, with what the prefill node sent along."""

    rid: str
    bootstrap_token: int
    cached_tokens: int
    bootstrap_logprob: float | None
    spec_candidate_ids: tuple[int, ...] | None
    request_pool_index: int

    def __post_init__(self) -> None:
        if self.bootstrap_token < 0:
            raise ValueError(f"RemotePrefill {self.rid!r}: a landing needs a first token, got {self.bootstrap_token}")


@dataclass(frozen=True, slots=True)
class RemotePrefillDone(Event):
    """D: the request's KV landed on every rank."""

    remote: RemotePrefill

    @property
    def rid(self) -> str:
        return self.remote.rid
