"""The encode role's protocol (an encode rank sending image embeddings), sans-IO.

The rooms' rules are the engine's table (``services.table``: an encode peer's
``pdcore.epd.sending.SendRooms``): which rows to write to whom, and whom to tell
what, as the ``Write`` and ``Tell`` values defined here, the vocabulary this
engine performs (so the dependency points from ``pdcore.epd`` to this package,
never back). This engine adds what sits around them: the
prefill ranks that registered (``EmbedRegister``: where their receive slots
are; the data connection is made with ``Connect``), the writes (``Post``
through the asking rank's grant; each completion comes back as ``written``)
and the frames (``EmbedStatus``), and the rooms that concluded, delivered to the
scheduler's side (``services.deliver("concluded", room, None)``): until then a room's rows
may still be read.

Inputs: the scheduler's ``begin``, ``send``, ``fail``; the prefill ranks'
frames (``message``); ``connected``, ``written``, ``peer_dead``,
``rooms_failed``, ``tick``, ``close``; each takes ``now``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..control import wire
from ..core.errors import LocalProtocolError
from .actions import Disconnect, Post
from .engine import EncodeSettings, Engine, RoomRules, Services, Sink

__all__ = ["EncodeEngine", "Tell", "Write"]

log = logging.getLogger("pdcore.encode")

WRITE_WAIT = 5.0  # seconds a write may wait for room in the transport before it fails


class Write(NamedTuple):
    """The rooms' rules: write ``batch`` (``(source, destination, length)`` triples) to the prefill rank at
    ``endpoint`` through its ``grant``; report the completion with ``written(room, rank, error, noted)``.
    ``note``: the asker's success (an encoded ``EmbedStatus``) rides the batch (``Post.note``)."""

    room: int
    endpoint: str
    rank: int
    batch: tuple[tuple[int, int, int], ...]
    grant: int
    note: bytes = b""


class Tell(NamedTuple):
    """The rooms' rules: send ``msg`` to the prefill rank at ``endpoint``."""

    endpoint: str
    msg: wire.EmbedStatus


@dataclass(eq=False)
class _Sink(Sink):
    """A prefill rank that registered with this encode rank."""

    rank: int = 0  # its tp rank of ``ranks``
    ranks: int = 1


class EncodeEngine(Engine[EncodeSettings, RoomRules]):
    """One encode rank's EPD sending protocol (``pdcore.epd.encode.EncodePeer`` drives it)."""

    ROLE = "encode"

    def __init__(self, services: Services[EncodeSettings, RoomRules]) -> None:
        super().__init__(services)
        if services.table is None:
            raise LocalProtocolError("encode engine: services.table must hold the rooms' rules (SendRooms)")
        self._rooms = services.table
        self._rooms.notes = services.notes  # an asker's success rides its write where the transport carries notes
        self._sinks: dict[str, _Sink] = {}
        self.stats = services.stats if services.stats is not None else {}
        self.stats.setdefault("aborts_before_begin", 0)  # aborts from prefill of rooms the scheduler had not begun

    def held(self) -> dict[str, int]:
        return {"rooms": len(self._rooms), "sinks": len(self._sinks)}

    def next_deadline(self) -> float:
        return self._rooms.next_deadline()

    def _act(self, actions: list[Any], now: float) -> None:
        """The rooms' actions as the driver's, and the rooms that concluded for the scheduler."""
        for action in actions:
            if type(action) is Tell:
                if not action.msg.ok:
                    log.info("encode peer: room %d failed toward %s: %s", action.msg.room, action.endpoint,
                             action.msg.reason)
                self._tell(action.endpoint, action.msg)
            else:
                self._write(action, now)
        for room in self._rooms.concluded():
            self.services.deliver("concluded", room, None)

    # -- the scheduler's calls ------------------------------------------------------------

    def begin(self, room: int, now: float) -> None:
        ok, actions = self._rooms.begin(room, now)
        if not ok:  # asks parked for other rooms fill the rank: the room concludes at once
            log.warning("encode peer: room %d concluded at begin: the rank holds %d rooms", room, len(self._rooms))
            self.services.deliver("concluded", room, None)
            return
        self._act(actions, now)

    def send(self, chunk: Any, now: float) -> None:
        try:
            self._act(self._rooms.send(chunk, now), now)
        except LocalProtocolError as e:  # ended on this thread before the scheduler heard of it
            log.debug("encode peer: %s", e)

    def fail(self, room: int, reason: str, now: float) -> None:
        try:
            self._act(self._rooms.fail(room, reason, now), now)
        except LocalProtocolError as e:
            log.debug("encode peer: %s", e)

    def close(self, now: float) -> None:
        for endpoint in list(self._sinks):
            self._act(self._rooms.lost(endpoint, "the encode peer closed", now), now)

    # -- prefill ranks' frames -----------------------------------------------------------------

    def message(self, sender: str, msg: wire.Message, now: float) -> None:
        kind = type(msg)
        if kind is wire.EmbedAsk:
            sink = self._sinks.get(sender)
            if sink is None or (sink.session_id, sink.epoch) != (msg.session_id, msg.epoch):  # type: ignore[union-attr]
                self._tell(sender, wire.EmbedStatus(
                    room=msg.room, ok=False, rank=self._config.tp_rank,  # type: ignore[union-attr]
                    reason=f"prefill session {msg.session_id} (epoch {msg.epoch}) asked before it registered here",  # type: ignore[union-attr]
                ))
                return
            self._act(self._rooms.ask(sender, msg, now), now)
        elif kind is wire.Abort:
            sink = self._sinks.get(sender)
            if sink is not None and not self._rooms.begun(msg.room):  # type: ignore[union-attr]
                self.stats["aborts_before_begin"] += 1
            self._act(self._rooms.abort(sender, msg.room, msg.reason, now,  # type: ignore[union-attr]
                                        None if sink is None else (sink.rank, sink.ranks)), now)
        elif kind is wire.EmbedRegister:
            self._on_register(sender, msg, now)  # type: ignore[arg-type]
        else:
            log.warning("encode peer: unexpected %s from %s", kind.__name__, sender)

    def _on_register(self, sender: str, msg: wire.EmbedRegister, now: float) -> None:
        old = self._sinks.get(sender)
        if old is not None and (old.session_id, old.epoch) == (msg.session_id, msg.epoch):
            return  # idempotent
        if old is not None:
            self._lose_sink(sender, f"prefill rank {sender} re-registered (session {msg.session_id})", now)
        sink = _Sink(msg.session_id, msg.epoch, msg.endpoint, rank=msg.tp_rank, ranks=msg.tp_size)
        self._sinks[sender] = sink
        self._connect(sender, sink)

    # -- data connections and writes ----------------------------------------------------------

    def connected(self, token: tuple[str, _Sink], handle: Any, error: str, now: float) -> None:
        sender, sink = token
        if self._sinks.get(sender) is not sink:
            if handle is not None:
                self._out.append(Disconnect(handle))
            return
        sink.handle, sink.connecting = handle, False
        waiting, sink.waiting = sink.waiting, []
        for write in waiting:
            if error:
                self.written(write, error, now)
            else:
                self._write(write, now)

    def _write(self, write: Write, now: float) -> None:
        sink = self._sinks.get(write.endpoint)
        if sink is None or sink.error:
            self.written(write, sink.error if sink else f"prefill rank {write.endpoint} is not registered", now)
            return
        if not sink.ready:
            sink.waiting.append(write)
            if not sink.connecting:
                self._connect(write.endpoint, sink)
            return
        self._out.append(Post(sink.handle, write.batch, write.grant, write, WRITE_WAIT, write.note))

    def written(self, write: Write, error: str | None, now: float) -> None:
        """A write completed (``error`` None) or failed: tell the asker, conclude the room."""
        self._act(self._rooms.written(write.room, write.rank, error or "", now, bool(write.note)), now)

    # -- failures from outside -------------------------------------------------------------

    def peer_dead(self, endpoint: str, session_id: str | None, epoch: int | None, reason: str, now: float) -> None:
        self._lose_sink(endpoint, reason, now)

    def _lose_sink(self, endpoint: str, reason: str, now: float) -> None:
        sink = self._sinks.pop(endpoint, None)
        if sink is not None:
            waiting, sink.waiting = sink.waiting, []
            for write in waiting:
                self.written(write, f"prefill rank lost: {reason}", now)
            if sink.handle is not None:
                self._out.append(Disconnect(sink.handle))  # fails what is in flight to it, promptly
        self._act(self._rooms.lost(endpoint, reason, now), now)

    def rooms_failed(self, rooms: tuple[int, ...], reason: str, now: float) -> None:
        for room in rooms:
            if self._rooms.begun(room):
                self._act(self._rooms.fail(room, reason, now), now)

    def tick(self, now: float) -> None:
        self._act(self._rooms.expire(now), now)
