"""The encode side of EPD: ``EncodePeer`` and its ``Sender`` (an ``EmbeddingSender``).

An encode rank registers with its deployment's bootstrap server (layout
``{"role": "encode"}``) so prefill ranks find it. Each prefill rank sends it
``EmbedRegister`` once per session and ``EmbedAsk`` per item; the protocol is
``pdcore.protocol.encode.EncodeEngine`` (over the sans-IO ``SendRooms``), run
on the peer's driver thread. This module is the scheduler's side: ``begin``,
``send``, ``fail`` and ``concluded`` check the call against the rooms the
scheduler holds, hand it to the engine and never wait on the network.
"""

from __future__ import annotations

import collections
import time
from collections import OrderedDict
from typing import Any

from ..core.deadline import Deadline
from ..core.errors import LocalProtocolError, PdError, PeerError
from ..node.base import PeerBase
from ..protocol.encode import EncodeEngine
from ..protocol.engine import Services
from .config import EncodeConfig
from .sending import SendRooms
from .types import EmbeddingChunk

__all__ = ["EncodePeer", "Sender"]


class EncodePeer(PeerBase):
    """An encode rank's EPD peer: sends each item's embedding rows to the prefill ranks that ask."""

    ROLE = "encode"

    def _init_state(self) -> None:
        self._begun: dict[int, bool] = {}  # rooms begun and not yet handed back by concluded() -> rows sent
        self._gone: OrderedDict[int, float] = OrderedDict()  # rooms concluded() handed back -> until (late calls)
        self._concluded: collections.deque[int] = collections.deque()  # the engine's, not yet handed back
        self._table = SendRooms.of(self._config)  # the engine's table: the rooms' rules

    def _register_memory(self) -> None:
        for buf in self._config.send_buffers:
            self._transport.register(buf, require_grant=True)  # nobody writes into them

    def _make_engine(self, services: Services) -> EncodeEngine:
        return EncodeEngine(services)

    def _deliver(self, kind: str, key: Any, value: Any) -> None:
        if kind == "concluded":
            self._concluded.append(key)

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

    def _room_call(self, call: str, room: int, fn: Any, *args: Any) -> None:
        """Hand a call for a begun room to the engine; one it cannot take fails the room there."""
        try:
            self._submit(fn, *args)
        except PeerError:
            raise
        except PdError as e:
            raise LocalProtocolError(f"{call}: room {room}: the encode peer is overloaded: {e}", rooms=(room,)) from e

    def _held(self, call: str, room: int) -> bool:
        """True for a room begun here and not yet handed back; False for one ``concluded`` handed back
        within ``tombstone_ttl`` (a late call does nothing); ``LocalProtocolError`` otherwise."""
        self._check_open()
        if room in self._begun:
            return True
        until = self._gone.get(room)
        if until is not None and until > time.monotonic():
            return False
        raise LocalProtocolError(f"{call}: room {room} was not begun", rooms=(room,))


class Sender:
    """The encode scheduler's side of an ``EncodePeer`` (implements ``EmbeddingSender``)."""

    def __init__(self, peer: EncodePeer) -> None:
        self._peer = peer

    def begin(self, room: int) -> bool:
        """``room``'s request arrived; False when another request holds the room (begun and not handed
        back by ``concluded``) or ``EncodeConfig.max_rooms`` rooms are."""
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 1 << 64:
            raise LocalProtocolError(f"begin: room {room!r} is not an unsigned 64-bit integer")
        peer = self._peer
        peer._check_open()
        if room in peer._begun or len(peer._begun) >= peer._config.max_rooms:
            return False
        peer._room_call("begin", room, peer._engine.begin, room)
        peer._begun[room] = False
        peer._gone.pop(room, None)
        return True

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
        if not peer._held("send", chunk.room):
            return
        if peer._begun[chunk.room]:
            raise LocalProtocolError(f"send: room {chunk.room} already has its rows", rooms=(chunk.room,))
        peer._room_call("send", chunk.room, peer._engine.send, chunk)
        peer._begun[chunk.room] = True

    def fail(self, room: int, reason: str) -> None:
        """Conclude a begun room failed; every prefill rank that asked, or asks later, hears ``reason``."""
        peer = self._peer
        if peer._held("fail", room):
            peer._room_call("fail", room, peer._engine.fail, room, str(reason) or "failed by the encode scheduler")

    def concluded(self) -> list[int]:
        """The begun rooms that concluded since the last call, sent or failed: their rows may be reused."""
        peer = self._peer
        out = []
        until = time.monotonic() + peer._config.tombstone_ttl
        gone = peer._gone
        while peer._concluded:
            room = peer._concluded.popleft()
            if peer._begun.pop(room, None) is not None:
                out.append(room)
                gone.pop(room, None)
                gone[room] = until
        while len(gone) > 4 * peer._config.max_rooms:
            gone.popitem(last=False)
        return out
