"""What every role engine is: inputs as calls with ``now``, actions out, the next deadline.

An engine holds one role's per-request protocol (rooms, parking, grants and
fences, tombstones, timers, verdicts) and nothing else: no thread, lock, socket,
queue or clock. Every input is a method call whose last argument is ``now``
(seconds on the caller's monotonic clock); every output is an action
(``pdcore.protocol.actions``) the caller drains with ``take_actions`` and
performs in order, feeding outcomes back as inputs. ``next_deadline`` says
when ``tick`` has work; calling ``tick`` earlier or later only moves that
work. The compiled state table is driven from here (``update``, ``fenced``)
and reduced by the replica's agreement elsewhere; the table is the one object
an engine shares with the scheduler's thread, and each of its calls is atomic.

Two callers drive engines: the threaded driver (``pdcore.node.driver``: one
thread per peer, real control plane, bootstrap client and transport) and the
simulator (``pdcore.sim``: every engine of a deployment in one thread, a
seeded network, transport and clock).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..control import wire
from ..core.errors import PdError
from ..core.events import Failed, Succeeded
from .actions import Action, Connect, Send

__all__ = ["Engine", "Services", "Sink", "ends"]

log = logging.getLogger("pdcore.protocol")


def ends(events: Iterable[Any]) -> Iterator[tuple[str, bool, str]]:
    """``(rid, failed, reason)`` of the requests a round's events end."""
    for event in events:
        kind = type(event)
        if kind is Succeeded:
            yield event.rid, False, ""
        elif kind is Failed:
            yield event.rid, True, event.reason


@dataclass(frozen=True, eq=False)
class Services:
    """What a role engine is given, all of it: nothing is read from another object's private state.

    ``config`` is the role's frozen configuration; ``table`` the transfer (or receive) table the
    engine drives; ``endpoint`` and ``regions`` describe this rank's data plane to its peers
    (what a ``Register`` carries); ``layout`` is this rank's registered KV cache
    (``transport.plan.Layout``; None for roles without one); ``counts`` the metrics the engine
    bumps (None: no registry); ``deliver(kind, key, value)`` hands a value to the scheduler's
    side at once (``"landed"``: a decode request's ``RemotePrefill``, before the table can
    agree it landed; ``"concluded"``: an encode room whose rows may be reused)."""

    config: Any
    session_id: str
    epoch: int
    table: Any
    endpoint: bytes = b""
    regions: tuple[wire.Region, ...] = ()
    layout: Any = None
    counts: Any = None
    stats: dict[str, int] | None = None  # the peer's counters the engine adds to (None: its own)
    deliver: Callable[[str, Any, Any], None] = lambda kind, key, value: None


@dataclass(eq=False)
class Sink:
    """A peer rank this rank writes to (its data connection, and what waits for it)."""

    session_id: str
    epoch: int
    endpoint: bytes = b""  # its transport endpoint: a handle lost to a transient failure is connected again
    handle: Any = None  # the transport's PeerHandle; None while connecting
    connecting: bool = False
    error: str = ""
    waiting: list[Any] = field(default_factory=list)  # what waits for the connection

    @property
    def ready(self) -> bool:
        return not self.connecting and self.handle is not None and not self.handle.closed


class Engine:
    """The base of the role engines: the action list and the table's guarded calls."""

    ROLE = "engine"

    def __init__(self, services: Services) -> None:
        self.services = services
        self._config = services.config
        self._table = services.table
        self._out: list[Action] = []

    def held(self) -> dict[str, int]:
        """The per-request state the engine holds, by kind (all of it drains once every request ended)."""
        return {}

    def tombstones(self) -> int:
        """Rooms remembered as ended (they expire)."""
        return 0

    def diagnostics(self) -> dict[str, int]:
        """What ``held`` says, its tombstones and the peers with a data connection (read-only)."""
        return {**self.held(), "tombstones": self.tombstones(),
                "connected_peers": int(getattr(self, "connected_peers", lambda: 0)())}

    def take_actions(self) -> list[Action]:
        """Every action emitted since the last call, in order (the caller performs them)."""
        out = self._out
        if not out:
            return []
        actions = out[:]
        out.clear()  # the same list: helpers (look-ups) hold its append
        return actions

    def next_deadline(self) -> float:
        """When ``tick`` has work (inf: none until another input)."""
        return float("inf")

    def tick(self, now: float) -> None:
        """The clock: expire what is due."""

    def unsent(self, token: Any, why: str, now: float) -> None:
        """A ``Send`` with a token could not be queued."""

    def _connect(self, sender: str, sink: Sink) -> None:
        """(Re)connect the data plane to ``sink``; ``connected((sender, sink), ...)`` answers."""
        sink.connecting = True
        self._out.append(Connect((sender, sink), sink.endpoint, sink.handle, self._config.start_timeout))

    def _tell(self, endpoint: str, msg: wire.Message, token: Any = None) -> None:
        self._out.append(Send(endpoint, msg, token))

    def _fire(self, rid: str, trigger: int, now: float, reason: str = "") -> int | None:
        """Fire a trigger for ``rid`` if the table still tracks it; the new state, or None."""
        try:
            return int(self._table.update(rid, trigger, now, reason))
        except PdError:  # the request ended meanwhile (the scheduler's round settled it)
            return None

    def _state(self, rid: str) -> int | None:
        try:
            return int(self._table.state(rid))
        except PdError:
            return None

    def _fenced(self, rid: str) -> None:
        try:
            self._table.fenced(rid)
        except PdError:
            pass
