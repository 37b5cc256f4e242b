"""The decode side: ``DecodePeer`` (a ``TransferPeer``) and its ``DecodeInbox``.

The protocol is ``pdcore.protocol.decode.DecodeEngine`` (its docstring tells a request's story,
fence before free included), run on the peer's driver thread; this module is the scheduler's side:
it validates each call, registers requests with the transfer table on the scheduler's thread, hands
the rest to the engine, and builds ``RemotePrefillDone`` from the landing the engine delivered.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..control import wire
from .peer import PdPeer, wire_int
from .config import DecodeConfig
from ..core.errors import LocalProtocolError
from ..core.events import BootstrapInfo, Event, Failed, RemotePrefill, RemotePrefillDone, Succeeded
from ..protocol.decode import DecodeEngine
from ..protocol.engine import Services

__all__ = ["DecodePeer", "DecodeInbox"]

log = logging.getLogger("pdcore.decode")


class DecodePeer(PdPeer):
    """A decode rank's PD transfer peer."""

    ROLE = "decode"
    _TERMINAL = (RemotePrefillDone, Failed)

    def __init__(self, config: DecodeConfig) -> None:
        super().__init__(config)
        self._landed: dict[str, RemotePrefill] = {}  # what the engine delivered before the table could agree

    def _make_engine(self, services: Services) -> DecodeEngine:
        return DecodeEngine(services)

    def _deliver(self, kind: str, key: Any, value: Any) -> None:
        if kind == "landed":
            self._landed[key] = value

    @classmethod
    def start(cls, config: DecodeConfig) -> tuple[DecodePeer, DecodeInbox]:
        """Start the transport, register the cache, open the control socket and start the threads."""
        peer = cls(config)
        peer._start()
        return peer, DecodeInbox(peer)

    # -- the scheduler's calls ------------------------------------------------------------

    def register(self, rid: str, bootstrap: BootstrapInfo) -> None:
        """Track an admitted request; its prefill rank is looked up off the scheduler thread. Never blocks.

        ``bootstrap`` names the prefill deployment's bootstrap server and the room, which
        the prefill side registers too: the room, not the rid, joins the two sides.
        ``PeerError`` after ``close``.
        """
        self._registered(rid)
        self._input(rid, self._engine.register, rid, bootstrap.room, (bootstrap.host, bootstrap.port), bootstrap.dp_rank)

    def record_usage(self, rid: str, cached_tokens: int, bootstrap_logprob: float | None) -> None:
        """Prefill role only: usage travels from prefill to decode. Here it changes nothing."""

    def abort_room(self, rid: str, room: int) -> None:
        """Fail ``rid`` now (its prefill rank is told, and the pages wait for the fence)."""
        self._check_open()
        if rid in self._live_rids:  # an unknown or ended rid: nothing to abort
            self._input(rid, self._engine.abort_room, rid, room)

    def _announce(self, rid: str, page_ids: tuple[int, ...], request_pool_index: int) -> None:
        self._input(rid, self._engine.announce, rid, page_ids, request_pool_index)

    def _settle(self, events: list[Event], ended: list[str]) -> list[Event]:
        if not ended:
            return events
        out: list[Event] = []
        for event in events:
            kind = type(event)
            if kind is Succeeded:
                event = RemotePrefillDone(self._landed.pop(event.rid))  # delivered before the table could land
            elif kind is Failed:
                self._landed.pop(event.rid, None)
            out.append(event)
        return out


class DecodeInbox:
    """The decode scheduler's side: announce an admitted request's destination pages (``announce``)."""

    def __init__(self, peer: DecodePeer) -> None:
        self._peer = peer

    def announce(self, rid: str, page_ids: Any, request_pool_index: int) -> None:
        """Ask ``rid``'s prefill rank to write its KV into ``page_ids`` (prompt order). Never blocks.

        Call it after ``rid``'s ``Bootstrapped`` event; earlier, a request whose prefill ranks
        are not known yet fails.
        Announce as many pages as prefill hands over, or fewer when this rank holds
        a prefix of the prompt already: prefill then writes its last ``len(page_ids)``
        pages into them; more than prefill hands over fails the room. The pages belong
        to the transfer (the prefill rank's transport is granted exactly them) until
        the request's ``RemotePrefillDone`` or ``Failed`` event.

        ``request_pool_index`` (0..2**31-1) is the scheduler's own number for the
        request, returned unchanged in ``RemotePrefill.request_pool_index``. Bad page
        ids or index raise ``LocalProtocolError`` and change nothing; an unknown rid
        raises, one that ended within ``tombstone_ttl`` does nothing
        (``PrefillOutbox`` explains why); ``PeerError`` after ``close``.
        """
        pages = tuple(map(int, page_ids.tolist() if isinstance(page_ids, np.ndarray) else page_ids))
        num_pages = self._peer._config.num_pages
        if pages and (min(pages) < 0 or max(pages) >= num_pages):
            raise LocalProtocolError(f"announce({rid!r}): page ids must be in 0..{num_pages - 1}")
        index = wire_int(f"announce({rid!r})", "request_pool_index", request_pool_index, wire.MAX_COUNT)
        if self._peer._accepts(rid, "announce"):
            self._peer._announce(rid, pages, index)
