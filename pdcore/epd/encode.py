"""The encode side of EPD: ``EncodePeer`` and its ``Sender`` (an ``EmbeddingSender``).

An encode rank registers with its deployment's bootstrap server (layout
``{"role": "encode"}``) so prefill ranks find it. Each prefill rank sends it
``EmbedRegister`` once per session (where its receive slots are: the data
connection is made on an I/O thread) and ``EmbedAsk`` per item; the rooms'
logic is the sans-IO ``SendRooms`` (``pdcore.epd.sending``), and this module
performs its actions: writes through the asking rank's grant, and
``EmbedStatus`` frames. The scheduler's calls (``begin``, ``send``, ``fail``,
``concluded``) never wait on the network: writes go to the worker thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..control import wire
from ..node.base import PeerBase
from ..control.channel import DeadPeer
from ..core.deadline import Deadline
from ..core.errors import LocalProtocolError, PdError
from .config import EncodeConfig
from .sending import Action, SendRooms, Tell, Write
from .types import EmbeddingChunk

__all__ = ["EncodePeer", "Sender"]

log = logging.getLogger("pdcore.encode")

_WRITE_WAIT = 5.0  # seconds the worker waits for room in the transport before a write fails


@dataclass(eq=False)
class _Sink:
    """A prefill rank that registered with this encode rank."""

    session_id: str
    epoch: int
    endpoint: bytes
    rank: int = 0  # its tp rank of ``ranks``
    ranks: int = 1
    handle: Any = None
    connecting: bool = False
    error: str = ""
    waiting: list[Write] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return not self.connecting and self.handle is not None and not self.handle.closed


class EncodePeer(PeerBase):
    """An encode rank's EPD peer: sends each item's embedding rows to the prefill ranks that ask."""

    ROLE = "encode"

    def __init__(self, config: EncodeConfig) -> None:
        super().__init__(config)
        self._rooms = SendRooms(
            tp_size=config.tp_size,
            tp_rank=config.tp_rank,
            park_timeout=config.park_timeout,
            max_rooms=config.max_rooms,
            tombstone_ttl=config.tombstone_ttl,
        )
        self._rooms_lock = threading.Lock()
        self._sinks: dict[str, _Sink] = {}
        self.stats["aborts_before_begin"] = 0  # aborts from prefill of rooms the scheduler had not begun

    def _register_memory(self) -> None:
        for buf in self._config.send_buffers:
            self._transport.register(buf, require_grant=True)  # nobody writes into them

    @classmethod
    def start(cls, config: EncodeConfig) -> tuple[EncodePeer, Sender]:
        """Start the transport, register the send buffers, open the control socket, start the threads
        and register with the bootstrap server (retrying until ``config.start_timeout``)."""
        peer = cls(config)
        deadline = Deadline.after(config.start_timeout)
        peer._follow_epoch(deadline)
        peer._start()
        try:
            peer._register_with_bootstrap({"role": "encode"}, deadline)
        except BaseException:
            peer.close()
            raise
        return peer, Sender(peer)

    # -- the rooms' actions ---------------------------------------------------------------

    def _rooms_call(self, method: str, *args: Any) -> list[Action]:
        with self._rooms_lock:
            return getattr(self._rooms, method)(*args)  # type: ignore[no-any-return]

    def _act(self, actions: list[Action]) -> None:
        """Worker (or any thread, for ``Tell`` only): perform the rooms' actions."""
        for action in actions:
            if isinstance(action, Tell):
                self._tell(action)
            else:
                self._write(action)

    def _act_later(self, actions: list[Action]) -> None:
        """Scheduler thread: tell now, write on the worker (a write may wait for room in the transport)."""
        writes = [a for a in actions if isinstance(a, Write)]
        for action in actions:
            if isinstance(action, Tell):
                self._tell(action)
        if writes:
            try:
                self._submit(self._act, writes)
            except PdError as e:
                for w in writes:
                    self._written(w, 0, f"cannot queue the write: {e}")

    def _tell(self, tell: Tell) -> None:
        if not tell.msg.ok:
            log.info("encode peer: room %d failed toward %s: %s", tell.msg.room, tell.endpoint, tell.msg.reason)
        try:
            self._channel.send(tell.endpoint, tell.msg)
        except PdError as e:
            log.warning("encode peer: cannot tell %s about room %d: %s", tell.endpoint, tell.msg.room, e)

    def _write(self, write: Write) -> None:
        sink = self._sinks.get(write.endpoint)
        if sink is None or sink.error:
            self._written(write, 0, sink.error if sink else f"prefill rank {write.endpoint} is not registered")
            return
        if not sink.ready:
            sink.waiting.append(write)
            if not sink.connecting:
                self._connect(write.endpoint, sink)
            return
        try:
            self._transport.write(
                sink.handle,
                write.batch,
                functools.partial(self._written, write),
                deadline=Deadline.after(_WRITE_WAIT),
                grant=write.grant,
            )
        except PdError as e:
            self._written(write, 0, f"posting the writes failed: {e}")

    def _written(self, write: Write, _batch: int, error: Any) -> None:
        """Transport thread (or worker): a write completed; tell the asker, conclude the room."""
        actions = self._rooms_call("written", write.room, write.rank, str(error) if error else "", time.monotonic())
        self._act(actions)

    # -- data connections -----------------------------------------------------------------

    def _connect(self, sender: str, sink: _Sink) -> None:
        sink.connecting = True
        try:
            self._submit_io(self._connect_io, sender, sink)
        except PdError as e:
            self._connected(sender, sink, None, f"cannot queue the transport connect to {sender}: {e}")

    def _connect_io(self, sender: str, sink: _Sink) -> None:
        handle, error = None, ""
        try:
            if sink.handle is not None:
                self._transport.disconnect(sink.handle, deadline=Deadline.after(1.0))
            handle = self._transport.connect(sink.endpoint, deadline=Deadline.after(self._config.start_timeout))
        except Exception as e:  # whatever it was, the writes waiting for it must hear
            if not isinstance(e, PdError):
                log.exception("encode peer: connecting to %s failed unexpectedly", sender)
            error = f"cannot connect the transport to {sender}: {e}"
        self._from_io(self._connected, sender, sink, handle, error)

    def _connected(self, sender: str, sink: _Sink, handle: Any, error: str) -> None:
        if self._sinks.get(sender) is not sink:
            if handle is not None:
                self._transport.disconnect(handle)
            return
        sink.handle, sink.connecting = handle, False
        waiting, sink.waiting = sink.waiting, []
        for write in waiting:
            if error:
                self._written(write, 0, error)
            else:
                self._write(write)

    # -- frames from prefill ranks --------------------------------------------------------

    def _on_message(self, sender: str, msg: wire.Message) -> None:
        now = time.monotonic()
        if isinstance(msg, wire.EmbedRegister):
            self._on_register(sender, msg)
        elif isinstance(msg, wire.EmbedAsk):
            sink = self._sinks.get(sender)
            if sink is None or (sink.session_id, sink.epoch) != (msg.session_id, msg.epoch):
                self._tell(Tell(sender, wire.EmbedStatus(
                    room=msg.room, ok=False, rank=self._config.tp_rank,
                    reason=f"prefill session {msg.session_id} (epoch {msg.epoch}) asked before it registered here",
                )))
                return
            self._act(self._rooms_call("ask", sender, msg, now))
        elif isinstance(msg, wire.Abort):
            sink = self._sinks.get(sender)
            with self._rooms_lock:
                if sink is not None and not self._rooms.begun(msg.room):
                    self.stats["aborts_before_begin"] += 1
                actions = self._rooms.abort(sender, msg.room, msg.reason, now,
                                            None if sink is None else (sink.rank, sink.ranks))
            self._act(actions)
        else:
            log.warning("encode peer: unexpected %s from %s", type(msg).__name__, sender)

    def _on_register(self, sender: str, msg: wire.EmbedRegister) -> None:
        old = self._sinks.get(sender)
        if old is not None and (old.session_id, old.epoch) == (msg.session_id, msg.epoch):
            return  # idempotent
        if old is not None:
            self._lose_sink(sender, f"prefill rank {sender} re-registered (session {msg.session_id})")
        sink = _Sink(msg.session_id, msg.epoch, msg.endpoint, msg.tp_rank, msg.tp_size)
        self._sinks[sender] = sink
        self._connect(sender, sink)

    # -- failures from outside -------------------------------------------------------------

    def _peer_lost(self, dead: DeadPeer) -> None:
        self._lose_sink(dead.endpoint, dead.reason)

    def _lose_sink(self, endpoint: str, reason: str) -> None:
        sink = self._sinks.pop(endpoint, None)
        if sink is not None:
            for write in sink.waiting:
                self._written(write, 0, f"prefill rank lost: {reason}")
            sink.waiting = []
            if sink.handle is not None:
                self._transport.disconnect(sink.handle)  # fails what is in flight to it, promptly
        self._act(self._rooms_call("lost", endpoint, reason, time.monotonic()))

    def _rooms_failed(self, rooms: tuple[int, ...], reason: str) -> None:
        now = time.monotonic()
        for room in rooms:
            with self._rooms_lock:
                actions = self._rooms.fail(room, reason, now) if self._rooms.begun(room) else []
            self._act_later(actions)

    def _tick(self, now: float) -> None:
        super()._tick(now)
        self._act(self._rooms_call("expire", now))

    def _farewell(self) -> None:
        for endpoint in list(self._sinks):
            self._act(self._rooms_call("lost", endpoint, "the encode peer closed", time.monotonic()))


class Sender:
    """The encode scheduler's side of an ``EncodePeer`` (the seed's ``EmbeddingSender``)."""

    def __init__(self, peer: EncodePeer) -> None:
        self._peer = peer

    def begin(self, room: int) -> bool:
        """``room``'s request arrived; False when another request holds the room (or the peer is full)."""
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 1 << 64:
            raise LocalProtocolError(f"begin: room {room!r} is not an unsigned 64-bit integer")
        peer = self._peer
        with peer._rooms_lock:
            ok, actions = peer._rooms.begin(room, time.monotonic())
        peer._act_later(actions)
        return ok

    def send(self, chunk: EmbeddingChunk) -> None:
        """Hand over a begun room's rows: written once every prefill rank of the block asked.

        The rows (and deepstack rows) must lie in the registered ``send_buffers``
        and stay unchanged until the room is returned by ``concluded``. Never blocks.
        """
        if type(chunk) is not EmbeddingChunk:
            raise LocalProtocolError(f"send: expected an EmbeddingChunk, got {type(chunk).__name__}")
        peer = self._peer
        spans = [("source", chunk.source, chunk.nbytes)]
        if chunk.has_deepstack:
            spans.append(("deepstack_source", chunk.deepstack_source, chunk.deepstack_nbytes))
        regions = peer._transport.regions()
        for name, addr, nbytes in spans:
            if not any(r.contains(addr, nbytes) for r in regions):
                raise LocalProtocolError(
                    f"send: chunk.{name} [{addr:#x}, {addr + nbytes:#x}) of room {chunk.room} is not inside "
                    "one of EncodeConfig.send_buffers", rooms=(chunk.room,)
                )
        peer._act_later(peer._rooms_call("send", chunk, time.monotonic()))

    def fail(self, room: int, reason: str) -> None:
        """Conclude a begun room failed; every prefill rank that asked, or asks later, hears ``reason``."""
        peer = self._peer
        peer._act_later(peer._rooms_call("fail", room, str(reason), time.monotonic()))

    def concluded(self) -> list[int]:
        """The begun rooms that concluded since the last call, sent or failed: their rows may be reused."""
        peer = self._peer
        with peer._rooms_lock:
            return peer._rooms.concluded()
