"""The decode side: ``DecodePeer`` (a ``TransferPeer``) and its ``DecodeInbox``.

The protocol is ``pdcore.protocol.decode.DecodeEngine`` (its docstring tells a request's story,
fence before free included), run on the peer's driver thread; the scheduler-side rules are
``pdcore.pd.front.DecodeFront`` (validating each call, registering requests with the transfer table,
building ``RemotePrefillDone`` from the landing the engine delivered). This module puts them on the
real planes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..protocol.decode import DecodeEngine
from .config import DecodeConfig
from .front import DecodeFront
from .peer import PdPeer

__all__ = ["DecodePeer", "DecodeInbox"]

log = logging.getLogger("pdcore.decode")


class DecodePeer(PdPeer):
    """A decode rank's PD transfer peer."""

    ROLE = "decode"
    _FRONT = DecodeFront
    _ENGINE = DecodeEngine

    @classmethod
    def start(cls, config: DecodeConfig) -> tuple[DecodePeer, DecodeInbox]:
        """Start the transport, register the cache, open the control socket and start the threads."""
        peer = cls(config)
        peer._start()
        return peer, DecodeInbox(peer.front)

    def record_usage(self, rid: str, cached_tokens: int, bootstrap_logprob: float | None) -> None:
        """Prefill role only: usage travels from prefill to decode. Here it changes nothing."""


class DecodeInbox:
    """The decode scheduler's side: announce an admitted request's destination pages (``announce``)."""

    def __init__(self, front: DecodeFront) -> None:
        self._front = front

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
        self._front.announce(rid, page_ids, request_pool_index, time.monotonic())
