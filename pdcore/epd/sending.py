"""An encode rank's rooms, sans-IO: which rows to write to whom, and whom to tell what.

The encode peer (``pdcore.epd.encode``) feeds this table the scheduler's calls
(``begin``, ``send``, ``fail``), the prefill ranks' frames (``ask``, ``abort``),
lost peers (``lost``), write completions (``written``) and the clock
(``expire``); each returns the actions to take, ``Write`` and ``Tell``, which
the peer performs outside the table's lock. ``now`` is an argument; nothing
here touches a socket.

A room, on this encode rank:

- **begun** (``begin``) by the scheduler; asks that arrive first are parked
  (bounded, ``park_timeout``) and adopted by ``begin``.
- It **writes** once it holds the rows (``send``) and an ask from every
  prefill rank of its block: prefill tp ``n`` over encode tp ``m`` gives each
  encode rank ``e`` the block of ranks ``[e*n/m, (e+1)*n/m)``. Before any
  byte moves, every ask is checked against the chunk (hidden, dtype, the
  image's span, deepstack width) and the shares against the image (each
  rank's ``(row_start, row_count)`` is its share: contiguous shards that tile
  the image, or full copies); a mismatch fails the room, naming the field, on
  both sides. An empty shard (0 rows) is told at once.
- It **concludes** when every write completed (each asker is told its own
  outcome) or when it fails (``fail``, an ``abort`` from an asker, a lost
  asker, a check, the park timeout): every asker is told, and so is any that
  asks later (a tombstone, ``tombstone_ttl``). A failed room with writes in
  flight concludes only when they completed: until ``concluded`` returns a
  room, its rows may still be read.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..control import wire
from ..core.errors import LocalProtocolError
from ..protocol.encode import Tell, Write
from ._recv_spec import shard
from .types import DTYPE_ITEMSIZE, EmbeddingChunk

__all__ = ["SendRooms", "Write", "Tell"]


Action = Write | Tell


@dataclass(eq=False)
class _Room:
    room: int
    deadline: float
    begun: bool = False
    chunk: EmbeddingChunk | None = None
    asks: dict[int, tuple[str, wire.EmbedAsk]] = field(default_factory=dict)  # prefill rank -> (endpoint, ask)
    writing: int = -1  # writes posted and not completed; -1 before the room started writing
    failed: str = ""
    told: set[int] = field(default_factory=set)  # prefill ranks told the room's final status


class SendRooms:
    """The rooms of one encode rank (``tp_rank`` of ``tp_size``)."""

    def __init__(
        self, *, tp_size: int, tp_rank: int, park_timeout: float, max_rooms: int, tombstone_ttl: float = 60.0
    ) -> None:
        self._tp_size = tp_size
        self._tp_rank = tp_rank
        self._park = float(park_timeout)
        self._max_rooms = max_rooms
        self._ttl = float(tombstone_ttl)
        self._rooms: dict[int, _Room] = {}  # begun, or parked asks waiting for begin
        # room -> (until, reason, unbegun): ``unbegun``, it failed before the scheduler began it (prefill gave it up)
        self._ended: OrderedDict[int, tuple[float, str, bool]] = OrderedDict()
        self._concluded: list[int] = []
        # (deadline, serial, entry) of the rooms waiting for rows or asks: the driver asks for the next deadline
        # after every input, so it must not cost a walk over every room. Stale entries (the room wrote, failed,
        # ended, or waits for a later deadline) are dropped when they reach the top or when they outnumber the rooms.
        self._waiting: list[tuple[float, int, _Room]] = []
        self._serial = itertools.count()
        self.notes = False  # an asker's success rides its write (the engine sets it from ``Services.notes``)

    @classmethod
    def of(cls, config: Any) -> SendRooms:
        """The rooms of an encode rank configured by ``config`` (``EncodeConfig``: its tp size and rank, park
        timeout, room bound and tombstone lifetime)."""
        return cls(tp_size=config.tp_size, tp_rank=config.tp_rank, park_timeout=config.park_timeout,
                   max_rooms=config.max_rooms, tombstone_ttl=config.tombstone_ttl)

    def __len__(self) -> int:
        return len(self._rooms)

    def _wait(self, entry: _Room, deadline: float) -> None:
        """``entry`` waits for its rows and asks until ``deadline``."""
        entry.deadline = deadline
        heapq.heappush(self._waiting, (deadline, next(self._serial), entry))
        if len(self._waiting) > 2 * len(self._rooms) + 64:
            self._waiting = [w for w in self._waiting if self._waits(w)]
            heapq.heapify(self._waiting)

    def _waits(self, item: tuple[float, int, _Room]) -> bool:
        deadline, _, entry = item
        return (entry.deadline == deadline and entry.writing < 0 and not entry.failed
                and self._rooms.get(entry.room) is entry)

    def next_deadline(self) -> float:
        """When ``expire`` has work: a room's park deadline, or the oldest tombstone's (inf: neither)."""
        waiting = self._waiting
        while waiting and not self._waits(waiting[0]):
            heapq.heappop(waiting)
        due = waiting[0][0] if waiting else float("inf")
        if self._ended:
            due = min(due, next(iter(self._ended.values()))[0])
        return due

    def begun(self, room: int) -> bool:
        entry = self._rooms.get(room)
        return entry is not None and entry.begun

    # -- the scheduler ----------------------------------------------------------------

    def begin(self, room: int, now: float) -> tuple[bool, list[Action]]:
        """Start a room; False when it is begun already (another request holds it) or at capacity."""
        entry = self._rooms.get(room)
        if entry is not None and entry.begun:
            return False, []
        if entry is None:
            ended = self._ended.get(room)
            if ended is not None and ended[2]:  # failed before it began (aborted by prefill): concluded at once
                self._ended[room] = (ended[0], ended[1], False)
                self._concluded.append(room)
                return True, []
            if len(self._rooms) >= self._max_rooms:
                return False, []
            entry = self._rooms[room] = _Room(room, now + self._park)
        entry.begun = True
        self._wait(entry, now + self._park)
        self._ended.pop(room, None)
        return True, self._try_write(entry, now)

    def send(self, chunk: EmbeddingChunk, now: float) -> list[Action]:
        """The begun room's rows; a room that already concluded (failed meanwhile) ignores them."""
        entry = self._rooms.get(chunk.room)
        if entry is None or not entry.begun:
            if chunk.room in self._ended:
                return []
            raise LocalProtocolError(f"send: room {chunk.room} was not begun", rooms=(chunk.room,))
        if entry.chunk is not None:
            raise LocalProtocolError(f"send: room {chunk.room} already has its rows", rooms=(chunk.room,))
        entry.chunk = chunk
        return self._try_write(entry, now)

    def fail(self, room: int, reason: str, now: float) -> list[Action]:
        entry = self._rooms.get(room)
        if entry is None or not entry.begun:
            if room in self._ended:
                return []
            raise LocalProtocolError(f"fail: room {room} was not begun", rooms=(room,))
        return self._fail(entry, reason or "failed by the encode scheduler", now)

    def concluded(self) -> list[int]:
        out, self._concluded = self._concluded, []
        return out

    # -- the prefill ranks ----------------------------------------------------------------

    def ask(self, endpoint: str, msg: wire.EmbedAsk, now: float) -> list[Action]:
        room = msg.room
        why = self._misrouted(msg)
        if why:
            return [self._tell(endpoint, room, False, why)]
        entry = self._rooms.get(room)
        if entry is None:
            ended = self._ended.get(room)
            if ended is not None:
                return [self._tell(endpoint, room, False, ended[1])]
            if len(self._rooms) >= self._max_rooms:
                return [self._tell(endpoint, room, False, f"encode rank holds {len(self._rooms)} rooms already")]
            entry = self._rooms[room] = _Room(room, now + self._park)
            self._wait(entry, entry.deadline)
        if entry.failed:
            return [self._tell(endpoint, room, False, entry.failed)]
        if entry.writing >= 0:
            return [self._tell(endpoint, room, False, f"room {room} is being written already")]
        others = [a for r, (_, a) in entry.asks.items() if r != msg.rank]
        for other in others[:1]:
            for name in ("ranks", "sharded", "rows", "hidden", "dtype", "deepstack_width"):
                mine, theirs = getattr(msg, name), getattr(other, name)
                if mine != theirs:
                    entry.asks[msg.rank] = (endpoint, msg)
                    return self._fail(
                        entry, f"prefill ranks disagree on {name}: rank {other.rank} asks {theirs!r}, "
                        f"rank {msg.rank} asks {mine!r}", now,
                    )
        entry.asks[msg.rank] = (endpoint, msg)  # a rank that asks again (restarted) replaces its ask
        return self._try_write(entry, now)

    def abort(self, endpoint: str, room: int, reason: str, now: float, asker: tuple[int, int] | None = None) -> list[Action]:
        """A prefill rank gave up on ``room``: the room fails for every asker.

        Heard from a rank that asked for it, or from a registered prefill rank of this rank's block
        (``asker``: its rank and tp size), which may not have asked yet (its item waited for a receive
        slot). A room not begun yet is remembered failed: ``begin`` concludes it at once."""
        ours = asker is not None and not self._foreign(*asker)
        why = f"aborted by prefill rank {endpoint}: {reason}"[: wire.MAX_REASON]
        entry = self._rooms.get(room)
        if entry is None:
            if ours and room not in self._ended:
                self._remember(room, why, now, unbegun=True)
            return []
        if not ours and not any(ep == endpoint for ep, _ in entry.asks.values()):
            return []
        return self._fail(entry, why, now)

    def lost(self, endpoint: str, reason: str, now: float) -> list[Action]:
        """The prefill rank at ``endpoint`` is gone: every room it asked for fails."""
        out: list[Action] = []
        for entry in [e for e in self._rooms.values() if any(ep == endpoint for ep, _ in e.asks.values())]:
            entry.asks = {r: v for r, v in entry.asks.items() if v[0] != endpoint}
            out += self._fail(entry, f"prefill rank {endpoint} lost: {reason}", now)
        return out

    def written(self, room: int, rank: int, error: str, now: float, noted: bool = False) -> list[Action]:
        """A write of ``room`` to prefill ``rank`` completed (``error`` empty) or failed; ``noted``: the asker's
        success rode it (told already, if it landed)."""
        entry = self._rooms.get(room)
        if entry is None or entry.writing <= 0:
            return []
        entry.writing -= 1
        asked = entry.asks.get(rank)
        out: list[Action] = []
        if asked is not None and rank not in entry.told:  # each asker hears one final status
            entry.told.add(rank)
            if error or not noted:
                out.append(self._tell(asked[0], room, not error, f"writing the rows failed: {error}" if error else ""))
        if error:  # the room fails: the askers not told yet hear it now, not when their own writes complete
            out += self._fail(entry, f"writing the rows to prefill rank {rank} failed: {error}", now)
        if entry.writing == 0 and self._rooms.get(room) is entry:
            self._conclude(entry, entry.failed or f"room {room} was sent already", now)
        return out

    def expire(self, now: float) -> list[Action]:
        """Rooms whose rows or asks did not all arrive in time fail; old tombstones go."""
        out: list[Action] = []
        due = []
        while self._waiting and self._waiting[0][0] <= now:
            item = heapq.heappop(self._waiting)
            if self._waits(item):
                due.append(item[2])
        for entry in due:
            if not entry.begun:
                why = f"encode rank {self._tp_rank} never began room {entry.room} within {self._park:g} s"
            elif entry.chunk is None:
                why = f"the encode scheduler handed over no rows for room {entry.room} within {self._park:g} s"
            elif not entry.asks:
                why = f"no prefill rank asked for room {entry.room} within {self._park:g} s"
            else:
                why = (f"only {len(entry.asks)} of {self._fanout(entry)} prefill ranks asked for room {entry.room} "
                       f"within {self._park:g} s")
            out += self._fail(entry, why, now)
        while self._ended:
            room, (until, _, _) = next(iter(self._ended.items()))
            if until > now:
                break
            del self._ended[room]
        return out

    # -- inside ---------------------------------------------------------------------------

    def _misrouted(self, msg: wire.EmbedAsk) -> str:
        return self._foreign(msg.rank, msg.ranks)

    def _foreign(self, rank: int, ranks: int) -> str:
        """Why prefill rank ``rank`` of ``ranks`` is not of this encode rank's block, or ''."""
        if ranks % self._tp_size:
            return f"prefill tp {ranks} is not a multiple of encode tp {self._tp_size}"
        fanout = ranks // self._tp_size
        if rank // fanout != self._tp_rank:
            return f"prefill rank {rank} of {ranks} belongs to encode rank {rank // fanout}, not to this rank {self._tp_rank}"
        return ""

    def _fanout(self, entry: _Room) -> int:
        if not entry.asks:
            return 0
        _, first = next(iter(entry.asks.values()))
        return first.ranks // self._tp_size

    def _tell(self, endpoint: str, room: int, ok: bool, reason: str) -> Tell:
        return Tell(endpoint, wire.EmbedStatus(room=room, ok=ok, rank=self._tp_rank, reason=reason[: wire.MAX_REASON]))

    def _try_write(self, entry: _Room, now: float) -> list[Action]:
        chunk = entry.chunk
        if not entry.begun or chunk is None or entry.writing >= 0 or entry.failed:
            return []
        need = self._fanout(entry)
        if need == 0 or len(entry.asks) < need:
            return []
        why = self._mismatch(chunk, [a for _, a in entry.asks.values()])
        if why:
            return self._fail(entry, why, now)
        out: list[Action] = []
        row = chunk.hidden * chunk.itemsize
        deep = chunk.deepstack_width * chunk.itemsize
        entry.writing = 0
        note = wire.encode(self._tell("", entry.room, True, "").msg) if self.notes else b""
        for endpoint, ask in entry.asks.values():
            if ask.row_count == 0:
                entry.told.add(ask.rank)
                out.append(self._tell(endpoint, entry.room, True, ""))
                continue
            batch = [(chunk.source + ask.row_start * row, ask.addr, ask.row_count * row)]
            if deep:
                batch.append((chunk.deepstack_source + ask.row_start * deep, ask.deepstack_addr, ask.row_count * deep))
            out.append(Write(entry.room, endpoint, ask.rank, tuple(batch), ask.grant, note if ask.grant else b""))
            entry.writing += 1
        if entry.writing == 0:
            self._conclude(entry, f"room {entry.room} was sent already", now)
        return out

    def _mismatch(self, chunk: EmbeddingChunk, asks: list[wire.EmbedAsk]) -> str:
        """Why the asks do not fit the chunk (naming the field), or ''."""
        for ask in sorted(asks, key=lambda a: a.rank):
            where = f"prefill rank {ask.rank} of room {chunk.room}"
            if ask.hidden != chunk.hidden:
                return f"hidden: {where} expects {ask.hidden}, the rows have {chunk.hidden}"
            if ask.dtype != chunk.dtype:
                return f"dtype: {where} expects {ask.dtype}, the rows are {chunk.dtype}"
            if ask.dtype not in DTYPE_ITEMSIZE:
                return f"dtype: {where} asks for unknown dtype {ask.dtype!r}"
            if ask.rows != chunk.rows:
                return f"span: {where} expects {ask.rows} rows, the image has {chunk.rows}"
            if ask.deepstack_width != chunk.deepstack_width:
                return f"deepstack_width: {where} expects {ask.deepstack_width}, the rows have {chunk.deepstack_width}"
            if (ask.row_start, ask.row_count) != shard(chunk.rows, ask.rank, ask.ranks, ask.sharded):
                return (f"shards: {where} asks for rows [{ask.row_start}, {ask.row_start + ask.row_count}), "
                        f"which is not its share of {chunk.rows} rows over {ask.ranks} ranks "
                        f"({'sharded' if ask.sharded else 'full copies'})")
        return ""

    def _fail(self, entry: _Room, reason: str, now: float) -> list[Action]:
        if entry.failed:
            return []
        entry.failed = reason
        untold = [(rank, endpoint) for rank, (endpoint, _) in entry.asks.items() if rank not in entry.told]
        entry.told.update(rank for rank, _ in untold)
        out: list[Action] = [self._tell(endpoint, entry.room, False, reason) for _, endpoint in untold]
        if entry.writing <= 0:  # nothing reads the rows: it concludes now (else when the writes complete)
            self._conclude(entry, reason, now)
        return out

    def _conclude(self, entry: _Room, reason: str, now: float) -> None:
        del self._rooms[entry.room]
        if entry.begun:
            self._concluded.append(entry.room)
        self._remember(entry.room, reason, now, unbegun=not entry.begun and bool(entry.failed))

    def _remember(self, room: int, reason: str, now: float, *, unbegun: bool) -> None:
        """A tombstone for ``room`` (bounded: the oldest go first)."""
        self._ended.pop(room, None)
        self._ended[room] = (now + self._ttl, reason, unbegun)
        while len(self._ended) > 4 * self._max_rooms:
            self._ended.popitem(last=False)
