"""The encode side of EPD: ``EncodePeer`` and its ``Sender`` (an ``EmbeddingSender``).

An encode rank registers with its deployment's bootstrap server (layout
``{"role": "encode"}``) so prefill ranks find it. Each prefill rank sends it
``EmbedRegister`` once per session and ``EmbedAsk`` per item; the protocol is
``pdcore.protocol.encode.EncodeEngine`` (over the sans-IO ``SendRooms``), run
on the peer's driver thread. The scheduler's side (``begin``, ``send``, ``fail``
and ``concluded``, checked against the rooms the scheduler holds) is
``pdcore.epd.front.EncodeFront``; this module puts both on the real planes.
"""

from __future__ import annotations

import time
from typing import Any

from ..core.deadline import Deadline
from ..node.base import PeerBase
from ..node.device import MirrorMap, stages
from ..protocol.encode import EncodeEngine
from ..protocol.engine import Services
from .config import EncodeConfig
from .front import EncodeFront
from .sending import SendRooms
from .types import EmbeddingChunk

__all__ = ["EncodePeer", "Sender"]


class EncodePeer(PeerBase):
    """An encode rank's EPD peer: sends each item's embedding rows to the prefill ranks that ask."""

    ROLE = "encode"

    def _init_state(self) -> None:
        self._table = SendRooms.of(self._config)  # the engine's table: the rooms' rules
        self.front: EncodeFront | None = None  # made with the engine
        self._mirrors = MirrorMap()  # send buffers in device memory -> where the transport stages them

    def _register_memory(self) -> None:
        for buf in self._config.send_buffers:
            region = self._transport.register(buf, require_grant=True)  # nobody writes into them
            if stages(self._transport, region):
                self._mirrors.add(buf, region.addr)  # a chunk names device rows: its bytes go from the mirror

    def _buffers(self) -> tuple[Any, ...]:
        return tuple(self._config.send_buffers)

    def _make_engine(self, services: Services) -> EncodeEngine:
        engine = EncodeEngine(services)
        assert self._driver is not None
        self.front = EncodeFront(engine=engine, config=self._config, submit=self._driver.submit,
                                 result=self._driver.submit_result, regions=self._transport.regions(),
                                 staged=self._mirrors.host if self._mirrors else None)
        return engine

    def _deliver(self, kind: str, key: Any, value: Any) -> None:
        if self.front is not None:
            self.front.deliver(kind, key, value)

    def _diagnose(self, out: dict[str, Any]) -> None:
        if self.front is not None:
            out["front"] = self.front.diagnostics()

    def close(self) -> None:
        if self.front is not None:
            self.front.close()
        super().close()

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
        assert peer.front is not None
        return peer, Sender(peer.front)


class Sender:
    """The encode scheduler's side of an ``EncodePeer`` (implements ``EmbeddingSender``)."""

    def __init__(self, front: EncodeFront) -> None:
        self._front = front

    def begin(self, room: int) -> bool:
        """``room``'s request arrived; False when another request holds the room (begun and not handed
        back by ``concluded``), ``EncodeConfig.max_rooms`` rooms are, or the peer is overloaded."""
        return self._front.begin(room, time.monotonic())

    def send(self, chunk: EmbeddingChunk) -> None:
        """Hand over a begun room's rows: written once every prefill rank of the block asked.

        The rows (and deepstack rows) must lie in the registered ``send_buffers``
        and stay unchanged until the room is returned by ``concluded``. Never blocks.
        """
        self._front.send(chunk, time.monotonic())

    def fail(self, room: int, reason: str) -> None:
        """Conclude a begun room failed; every prefill rank that asked, or asks later, hears ``reason``."""
        self._front.fail(room, reason, time.monotonic())

    def concluded(self) -> list[int]:
        """The begun rooms that concluded since the last call, sent or failed: their rows may be reused."""
        return self._front.concluded(time.monotonic())
