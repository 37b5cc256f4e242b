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
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from transport.plan import Layout

from ..control import wire
from ..core.errors import PdError
from ..core.events import Failed, Succeeded
from .actions import Action, Connect, Send

if TYPE_CHECKING:  # the metrics' counters: their module keeps a clock, never imported here
    from ..control.metrics import Counts

__all__ = ["Engine", "EngineInputs", "Services", "Sink", "ends", "read_note",
           "Dialing", "DrivenTable", "PrefillSettings", "DecodeSettings", "ReceiverSettings", "EncodeSettings",
           "ReceivingTable", "RoomRules"]

log = logging.getLogger("pdcore.protocol")


def ends(events: Iterable[Any]) -> Iterator[tuple[str, bool, str]]:
    """``(rid, failed, reason)`` of the requests a round's events end."""
    for event in events:
        kind = type(event)
        if kind is Succeeded:
            yield event.rid, False, ""
        elif kind is Failed:
            yield event.rid, True, event.reason


def read_note(note: bytes, kind: type, room: int, success: Callable[[Any], bool]) -> tuple[Any, str]:
    """A note that rode a write into this rank's memory (``Transport.on_note``), decoded: ``(msg, "")`` when it is
    a ``kind`` of ``room`` that ``success`` accepts (the sink engines take nothing else by that path), else
    ``(None, why)``: bad input of its source, which costs that room alone."""
    try:
        msg = wire.decode(note)
    except PdError as e:
        return None, str(e)
    if type(msg) is kind and msg.room == room and success(msg):  # type: ignore[union-attr]
        return msg, ""
    return None, f"a {type(msg).__name__} of room {getattr(msg, 'room', '?')}, not room {room}'s success"


# -- what an engine is given: its role's configuration and table, as the engine reads them ------------------
#
# The role configurations (``pdcore.pd.config``, ``pdcore.epd.config``) and tables (``pdcore.core.table``,
# ``pdcore.epd.recv_table``, ``pdcore.epd.sending``) live in the role packages, which import this one; so
# each engine names what it reads of them as a Protocol here, and the real classes fit it by shape.


class Dialing(Protocol):
    """What the base engine reads of a role's configuration to connect the data plane (``_connect``)."""

    @property
    def start_timeout(self) -> float: ...


class _TransferSettings(Dialing, Protocol):
    @property
    def max_pending(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def kv_layout(self) -> Any: ...  # a ``pdcore.kv.KvLayout`` or None


class PrefillSettings(_TransferSettings, Protocol):
    """What ``PrefillEngine`` reads of ``PrefillConfig``."""

    @property
    def max_parked_pages(self) -> int: ...
    @property
    def max_parked_pages_total(self) -> int: ...
    @property
    def tombstone_ttl(self) -> float: ...
    @property
    def layerwise_min_pages(self) -> int: ...
    @property
    def fence_timeout(self) -> float: ...
    @property
    def bootstrap_timeout(self) -> float: ...


class DecodeSettings(_TransferSettings, Protocol):
    """What ``DecodeEngine`` reads of ``DecodeConfig``."""

    @property
    def unsafe_no_grants(self) -> bool: ...


class ReceiverSettings(Protocol):
    """What ``ReceiverEngine`` reads of ``ReceiverConfig``."""

    @property
    def slots(self) -> int: ...
    @property
    def slot_rows(self) -> int: ...
    @property
    def row_bytes(self) -> int: ...
    @property
    def deepstack_row_bytes(self) -> int: ...
    @property
    def deepstack_width(self) -> int: ...
    @property
    def shard_rows(self) -> bool: ...
    @property
    def hidden(self) -> int: ...
    @property
    def dtype(self) -> str: ...


class EncodeSettings(Dialing, Protocol):
    """What ``EncodeEngine`` reads of ``EncodeConfig``."""

    @property
    def tp_rank(self) -> int: ...


class DrivenTable(Protocol):
    """The transfer table a PD engine drives (``pdcore.core.table.StateTable``): the base engine's guarded calls."""

    def update(self, rid: str, trigger: int, now: float, reason: str = ...) -> int: ...
    def state(self, rid: str) -> int: ...
    def fenced(self, rid: str) -> None: ...


class ReceivingTable(Protocol):
    """The receive table a receiver engine drives (``pdcore.epd.recv_table.ReceiveTable``)."""

    def take_ready(self) -> list[Any]: ...  # its ``Ask`` records: rid, index, ...
    def landed(self, rid: str, index: int, now: float) -> Any: ...
    def fail(self, rid: str, reason: str, now: float) -> Any: ...
    def fenced(self, slot: int) -> None: ...


class RoomRules(Protocol):
    """An encode rank's rooms (``pdcore.epd.sending.SendRooms``): each call answers with the actions to take
    (``encode.Write``, ``encode.Tell``)."""

    def __len__(self) -> int: ...
    def next_deadline(self) -> float: ...
    def begun(self, room: int) -> bool: ...
    def begin(self, room: int, now: float) -> tuple[bool, list[Any]]: ...
    def send(self, chunk: Any, now: float) -> list[Any]: ...
    def fail(self, room: int, reason: str, now: float) -> list[Any]: ...
    def concluded(self) -> list[int]: ...
    notes: bool  # an asker's success rides its write (``encode.Write.note``): no ``EmbedStatus`` follows
    def ask(self, endpoint: str, msg: Any, now: float) -> list[Any]: ...  # a ``wire.EmbedAsk``
    def abort(self, endpoint: str, room: int, reason: str, now: float,
              asker: tuple[int, int] | None = ...) -> list[Any]: ...
    def lost(self, endpoint: str, reason: str, now: float) -> list[Any]: ...
    def written(self, room: int, rank: int, error: str, now: float, noted: bool = False) -> list[Any]: ...
    def expire(self, now: float) -> list[Any]: ...


ConfigT = TypeVar("ConfigT", covariant=True)  # what the engine reads of its role's configuration
TableT = TypeVar("TableT", covariant=True)  # the table it drives


@dataclass(frozen=True, eq=False)
class Services(Generic[ConfigT, TableT]):
    """What a role engine is given, all of it: nothing is read from another object's private state.

    ``config`` is the role's frozen configuration and ``table`` the table the engine drives (the
    transfer table, the receive table, an encode rank's rooms): each engine names the shape it reads of
    them, e.g. ``Services[DecodeSettings, DrivenTable]``; ``endpoint`` and ``regions`` describe this
    rank's data plane to its peers (what a ``Register`` carries); ``layout`` is this rank's registered
    KV cache (None for roles without one); ``counts`` the metrics the engine
    bumps (None: no registry); ``deliver(kind, key, value)`` hands a value to the scheduler's
    side at once (``"landed"``: a decode request's ``RemotePrefill``, before the table can
    agree it landed; ``"concluded"``: an encode room whose rows may be reused)."""

    config: ConfigT
    session_id: str
    epoch: int
    table: TableT
    endpoint: bytes = b""
    regions: tuple[wire.Region, ...] = ()
    layout: Layout | None = None
    counts: Counts | None = None
    stats: dict[str, int] | None = None  # the peer's counters the engine adds to (None: its own)
    deliver: Callable[[str, Any, Any], None] = lambda kind, key, value: None
    staged: bool = False  # the memory written here is device memory staged through host memory: landings are copied in (``Land``)
    notes: bool = False  # the transport carries a note with a batch (``Post.note``): a room's success rides its last write


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


class EngineInputs(Protocol):
    """What the driver (``pdcore.node``) and the simulator (``pdcore.sim``) call on every engine they run.

    The answers to an action (``granted``, ``revoked``, ``written``, ``connected``, ``looked_up``, ...)
    are not here: only the engines that emit that action take them, and the performer hands each answer to
    the engine whose action it was; ``peer_back`` is optional (``getattr``)."""

    ROLE: str

    @property
    def services(self) -> Services[Any, Any]: ...
    def take_actions(self) -> list[Action]: ...
    def next_deadline(self) -> float: ...
    def tick(self, now: float) -> None: ...
    def message(self, sender: str, msg: wire.Message, now: float) -> None: ...
    def unsent(self, token: Any, why: str, now: float) -> None: ...
    def rooms_failed(self, rooms: tuple[int, ...], reason: str, now: float) -> None: ...
    def peer_dead(self, endpoint: str, session_id: str | None, epoch: int | None, reason: str, now: float) -> None: ...
    def close(self, now: float) -> None: ...
    def held(self) -> dict[str, int]: ...
    def tombstones(self) -> int: ...
    def diagnostics(self) -> dict[str, int]: ...


class Engine(Generic[ConfigT, TableT]):
    """The base of the role engines: the action list and the table's guarded calls."""

    ROLE = "engine"

    def __init__(self, services: Services[ConfigT, TableT]) -> None:
        self.services = services
        self._config: ConfigT = services.config
        self._table: TableT = services.table
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

    def _bad_input(self) -> None:
        """A peer's input refused here (a note that is not its room's success): counted with the frames
        the control plane refused, in the peer's ``protocol_errors``."""
        stats = self.services.stats
        if stats is not None:
            stats["protocol_errors"] = stats.get("protocol_errors", 0) + 1

    def _connect(self: Engine[Dialing, Any], sender: str, sink: Sink) -> None:
        """(Re)connect the data plane to ``sink``; ``connected((sender, sink), ...)`` answers."""
        sink.connecting = True
        self._out.append(Connect((sender, sink), sink.endpoint, sink.handle, self._config.start_timeout))

    def _tell(self, endpoint: str, msg: wire.Message, token: Any = None) -> None:
        self._out.append(Send(endpoint, msg, token))

    def _fire(self: Engine[Any, DrivenTable], rid: str, trigger: int, now: float, reason: str = "") -> int | None:
        """Fire a trigger for ``rid`` if the table still tracks it; the new state, or None."""
        try:
            return int(self._table.update(rid, trigger, now, reason))
        except PdError:  # the request ended meanwhile (the scheduler's round settled it)
            return None

    def _state(self: Engine[Any, DrivenTable], rid: str) -> int | None:
        try:
            return int(self._table.state(rid))
        except PdError:
            return None

    def _fenced(self: Engine[Any, DrivenTable], rid: str) -> None:
        try:
            self._table.fenced(rid)
        except PdError:
            pass
