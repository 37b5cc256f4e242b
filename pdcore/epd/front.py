"""The scheduler's side of EPD, sans-IO: an encode rank's sender and a prefill rank's receiver.

As ``pdcore.pd.front`` for PD: the rules between the public API and the role's
engine live here once, with ``now`` passed in and the engine reached through
``submit`` (an input a scheduler's call makes: it may be refused) and
``result`` (one a round owes the engine: never refused). ``EncodePeer``'s
``Sender`` and ``PrefillPeer.embedding_receiver``'s ``Receiver`` drive them from
the scheduler's thread over the real driver; the simulator drives the same
objects.
"""

from __future__ import annotations

import dataclasses

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.errors import LocalProtocolError, PdError, PeerError, refusal
from .types import EmbeddingChunk, EmbeddingItem, LandedRequest

__all__ = ["EncodeFront", "ReceiverFront"]


class EncodeFront:
    """An encode rank's rooms as its scheduler holds them: ``begin``, ``send``, ``fail``, ``concluded``.

    ``regions`` are the send buffers as registered (a chunk's rows must lie in one of them);
    ``staged`` maps a chunk's rows in a device send buffer to their host mirror. A call the
    driver cannot take now (``CapacityError``) costs only its room: ``begin`` answers False, and a
    ``send`` or ``fail`` fails the room (through ``result``, never refused), which concludes as any."""

    ROLE = "encode"

    def __init__(self, *, engine: Any, config: Any, submit: Callable[..., None], result: Callable[..., None],
                 regions: Any, staged: Callable[[int, int], int] | None = None) -> None:
        self.engine = engine
        self.config = config
        self._submit = submit
        self._result = result
        self._regions = tuple(regions)
        self._staged = staged  # a device address -> where its bytes are staged (None: no send buffer is on a device)
        self.closed = False
        self._begun: dict[int, bool] = {}  # rooms begun and not yet handed back by concluded() -> rows sent
        self._gone: OrderedDict[int, float] = OrderedDict()  # rooms concluded() handed back -> until (late calls)
        self._concluded: deque[int] = deque()  # the engine's, not yet handed back

    def check_open(self) -> None:
        if self.closed:
            raise PeerError("encode peer: closed")

    def close(self) -> None:
        self.closed = True

    def deliver(self, kind: str, key: Any, value: Any) -> None:
        """The engine concluded a room (``Services.deliver``; the driver's thread)."""
        if kind == "concluded":
            self._concluded.append(key)

    def diagnostics(self) -> dict[str, int]:
        return {"begun": len(self._begun), "lately_concluded": len(self._gone), "concluded_untaken": len(self._concluded)}

    def _call(self, call: str, room: int, fn: Any, *args: Any) -> bool:
        """Hand a call for a room to the engine; False if it could not take it (the room then fails there)."""
        refused = refusal(self._submit, fn, *args)
        if refused is not None and call != "begin":  # the engine holds the room: it fails, and concludes
            self._result(self.engine.fail, room, f"{call}: the encode peer is overloaded: {refused}")
        return refused is None

    def _held(self, call: str, room: int, now: float) -> bool:
        """True for a room begun here and not yet handed back; False for one ``concluded`` handed back
        within ``tombstone_ttl`` (a late call does nothing); ``LocalProtocolError`` otherwise."""
        self.check_open()
        if room in self._begun:
            return True
        until = self._gone.get(room)
        if until is not None and until > now:
            return False
        raise LocalProtocolError(f"{call}: room {room} was not begun", rooms=(room,))

    def begin(self, room: int, now: float) -> bool:
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 1 << 64:
            raise LocalProtocolError(f"begin: room {room!r} is not an unsigned 64-bit integer")
        self.check_open()
        if room in self._begun or len(self._begun) >= self.config.max_rooms:
            return False
        if not self._call("begin", room, self.engine.begin, room):
            return False
        self._begun[room] = False
        self._gone.pop(room, None)
        return True

    def send(self, chunk: EmbeddingChunk, now: float) -> None:
        if type(chunk) is not EmbeddingChunk:
            raise LocalProtocolError(f"send: expected an EmbeddingChunk, got {type(chunk).__name__}")
        staged = self._staged
        if staged is not None:  # the rows are in device memory: the writes go from their host mirror
            chunk = dataclasses.replace(chunk, source=staged(chunk.source, chunk.nbytes), deepstack_source=(
                staged(chunk.deepstack_source, chunk.deepstack_nbytes) if chunk.has_deepstack else 0))
        spans = [("source", chunk.source, chunk.nbytes)]
        if chunk.has_deepstack:
            spans.append(("deepstack_source", chunk.deepstack_source, chunk.deepstack_nbytes))
        for name, addr, nbytes in spans:
            if not any(r.contains(addr, nbytes) for r in self._regions):
                raise LocalProtocolError(
                    f"send: chunk.{name} [{addr:#x}, {addr + nbytes:#x}) of room {chunk.room} is not inside "
                    "one of EncodeConfig.send_buffers", rooms=(chunk.room,)
                )
        if not self._held("send", chunk.room, now):
            return
        if self._begun[chunk.room]:
            raise LocalProtocolError(f"send: room {chunk.room} already has its rows", rooms=(chunk.room,))
        self._call("send", chunk.room, self.engine.send, chunk)
        self._begun[chunk.room] = True

    def fail(self, room: int, reason: str, now: float) -> None:
        if self._held("fail", room, now):
            self._call("fail", room, self.engine.fail, room, str(reason) or "failed by the encode scheduler")

    def concluded(self, now: float) -> list[int]:
        out = []
        until = now + self.config.tombstone_ttl
        gone = self._gone
        while self._concluded:
            room = self._concluded.popleft()
            if self._begun.pop(room, None) is not None:
                out.append(room)
                gone.pop(room, None)
                gone[room] = until
        while len(gone) > 4 * self.config.max_rooms:
            gone.popitem(last=False)
        return out


class ReceiverFront:
    """A prefill rank's staged EPD requests as its scheduler holds them: ``stage``, ``poll``, the settle of a
    round, ``release``. ``table`` is the rank's receive table, ``engine`` its receiver engine."""

    ROLE = "receiver"

    def __init__(self, *, table: Any, engine: Any, submit: Callable[..., None], result: Callable[..., None]) -> None:
        self.table = table
        self.engine = engine
        self._submit = submit
        self._result = result
        self._staged: set[str] = set()  # rids staged and not yet settled
        self._failed: list[tuple[str, str]] | None = None  # the last round's failures, reasons agreed

    def diagnostics(self) -> dict[str, int]:
        return {"staged": len(self._staged), "free_slots": self.table.free_slots(),
                "awaiting_release": int(self.table.awaiting_release())}

    def stage(self, rid: str, items: Any, now: float) -> None:
        if rid in self._staged:
            raise LocalProtocolError(f"rid {rid!r} is already staged")
        self.table.stage(rid, items, now)
        self._staged.add(rid)
        records = [item for item in items if isinstance(item, EmbeddingItem)]
        refused = refusal(self._submit, self.engine.staged, rid, records)
        if refused is not None:  # the driver is full: the request fails, its slots are fenced as any other
            try:
                self.table.fail(rid, f"receiver overloaded: {refused}", now)
            except PdError:
                pass

    def poll(self, now: float) -> list[int]:
        buf = self.table.encode(now)
        return buf[: len(self.table)].tolist()

    def settle(self, codes: Any) -> list[LandedRequest]:
        """One rank's settle of agreed ``codes`` (``poll`` order, or the reduced buffer of ``table.encode``)."""
        if isinstance(codes, (list, tuple)):
            try:  # codes are bytes on every rank: this is 3x faster than numpy's conversion of a list
                codes = np.frombuffer(bytes(codes), np.uint8)
            except (TypeError, ValueError):  # not bytes: the table names the code that is wrong
                codes = np.asarray(codes, dtype=np.int64)
        landed = self.table.settle(codes)
        self.after_round(landed, None, 0.0)
        return landed

    def after_round(self, landed: list[LandedRequest], failed: list[tuple[str, str]] | None, now: float) -> None:
        """The table settled a round: ``landed`` came out of it, ``failed`` are its failures with the reasons
        the replica agreed (None: this rank's own). The engine hears what ended and which slots to fence."""
        self._failed = failed
        failed = self.failed()
        fencing = self.table.take_fencing()
        for request in landed:
            self._staged.discard(request.rid)
        for rid, _ in failed:
            self._staged.discard(rid)
        if landed or failed or fencing:
            self._result(self.engine.settled, [r.rid for r in landed], list(failed), fencing)

    def release(self, slots: Any, now: float) -> None:
        self.table.release([int(s) for s in slots])
        self._result(self.engine.pump)

    def failed(self) -> list[tuple[str, str]]:
        return self._failed if self._failed is not None else self.table.failed()
