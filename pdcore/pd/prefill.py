"""The prefill side: ``PrefillPeer`` (a ``TransferPeer``) and its ``PrefillOutbox``.

The protocol is ``pdcore.protocol.prefill.PrefillEngine`` (its docstring tells a room's story),
run on the peer's driver thread; the scheduler-side rules are ``pdcore.pd.front.PrefillFront``
(validating each call, registering requests with the transfer table, the hand-over's usage). This
module puts them on the real planes. A room is registered here once per live request.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..control import wire
from ..core.deadline import Deadline
from ..core.errors import LocalProtocolError, StartError
from ..protocol.prefill import PrefillEngine
from .config import PrefillConfig
from .front import PrefillFront
from .peer import PdPeer

if TYPE_CHECKING:
    from ..epd.config import ReceiverConfig
    from ..epd.receiver import Receiver

__all__ = ["PrefillPeer", "PrefillOutbox"]



class PrefillPeer(PdPeer):
    """A prefill rank's PD transfer peer."""

    ROLE = "prefill"
    _FRONT = PrefillFront
    _ENGINE = PrefillEngine

    def __init__(self, config: PrefillConfig) -> None:
        super().__init__(config)
        self._receiver: Receiver | None = None

    def _route(self, msg: wire.Message) -> Any:
        if type(msg) is wire.EmbedStatus and self._receiver is not None:
            return self._receiver.engine
        return self._engine

    @classmethod
    def start(cls, config: PrefillConfig) -> tuple[PrefillPeer, PrefillOutbox]:
        """Start the transport, register the cache, open the control socket, start the threads and
        register with the bootstrap server (retrying until ``config.start_timeout``)."""
        peer = cls(config)
        deadline = Deadline.after(config.start_timeout)
        peer._follow_epoch(deadline)
        peer._start()
        try:
            layout = {"page_bytes": list(peer._layout.page_bytes), "num_pages": peer._layout.num_pages}
            if config.kv_layout is not None:
                layout["kv"] = config.kv_layout.to_json()
            peer._register_with_bootstrap(layout, deadline)
        except BaseException:
            peer.close()
            raise
        return peer, PrefillOutbox(peer.front)

    def embedding_receiver(self, config: ReceiverConfig) -> Receiver:
        """EPD: this rank's receiver of the encode nodes' embeddings, over this peer's planes (one per peer).

        Its receive slots are registered with the transport now and for the receiver's life."""
        if self._receiver is not None:
            raise LocalProtocolError("embedding_receiver: this prefill peer has its receiver already")
        self._check_open()
        from ..epd.receiver import Receiver

        cfg, engine = self._config, self._engine
        assert engine is not None  # made at start, and the peer is open
        try:
            self._receiver = Receiver(config, transport=self._transport, driver=self._driver,
                                      services=engine.services, tp_rank=cfg.tp_rank, tp_size=cfg.tp_size,
                                      agreement=cfg.agreement, agreement_timeout=cfg.agreement_timeout)
        except (ValueError, TypeError) as e:  # the transport refused the slots' memory (overlap, ...)
            raise StartError(f"embedding_receiver: the transport refused the receive buffers: {e}") from e
        return self._receiver

    def _diagnose(self, out: dict[str, Any]) -> None:
        super()._diagnose(out)
        if self._receiver is not None:
            out["receiver"] = self._receiver.front.diagnostics()

    def close(self) -> None:
        """As ``PeerBase.close``; the receiver's agreement goes too."""
        super().close()
        if self._receiver is not None:
            self._receiver.close()

    # -- the scheduler's calls ------------------------------------------------------------

    def record_usage(self, rid: str, cached_tokens: int, bootstrap_logprob: float | None) -> None:
        """A committed prompt's usage, sent to the decode node with the first token (``Status``).

        Call it before the hand-over's ``send``/``finish``. ``cached_tokens`` is an int in
        0..2**31-1; ``bootstrap_logprob`` the first token's log-probability: a finite float,
        ``-inf`` or NaN (all reach decode's ``RemotePrefill.bootstrap_logprob``), or None.
        A value the status frame cannot carry (``+inf``, a count past 2**31-1) raises
        ``LocalProtocolError`` here, naming the field, and changes nothing. An unknown rid raises;
        one that ended here within ``tombstone_ttl`` is ignored (see ``PdFront.accepts``).
        """
        self.front.record_usage(rid, cached_tokens, bootstrap_logprob, time.monotonic())

    def abort_room(self, rid: str, room: int) -> None:
        """Fail the request holding ``room`` here (the prefill scheduler gave it up: EPD, its embeddings
        failed), or, if none is registered, answer the decode node waiting on ``room`` from a tombstone.

        Best effort: a decode rank that already announced hears now; one that announces later is
        answered from the tombstone.
        """
        self._check_open()
        self.front.abort_room(rid, room, time.monotonic())


class PrefillOutbox:
    """The model executor's side of a prefill peer: hand over a request's prefilled pages.

    Whole (``send``, after the forward pass), or layer by layer so the writes
    overlap the forward pass: ``begin`` with the pages, ``layers_done`` as each
    layer's KV is written, ``finish`` with the first token. A prompt of fewer
    than ``PrefillConfig.layerwise_min_pages`` pages is sent at ``finish``
    whatever ``layers_done`` says (short prompts lose by streaming). A room
    that fails meanwhile is fenced as any other: partially streamed layers included.

    Hand a request over only after its ``Bootstrapped`` event: a hand-over before
    every decode rank it pairs with announced the room fails the room, and every
    decode rank hears of it (one that announced at once, one that announces later
    in answer, or, past ``tombstone_ttl``, as a room never registered once
    ``bootstrap_timeout`` passed). Decode may announce fewer
    pages than are handed over (it holds a prefix already: only the tail is written,
    into the announced pages); more fails the room, naming both counts.

    Every call checks its arguments against what the status frame carries (first
    token and candidates 0..2**31-1, at most 256 candidates) and raises
    ``LocalProtocolError`` naming the field, changing nothing. A rid this peer never
    registered (or that ended more than ``tombstone_ttl`` ago) raises
    ``LocalProtocolError``; one that ended here within ``tombstone_ttl`` is a race the
    scheduler cannot avoid (it hears of the end a round later) and the call does nothing.
    After ``close`` every call raises ``PeerError``.
    """

    def __init__(self, front: PrefillFront) -> None:
        self._front = front

    def begin(self, rid: str, page_ids: Any) -> None:
        """Layer-wise: the pages (prompt order) the forward pass is filling for ``rid``. Never blocks."""
        self._front.begin(rid, page_ids, time.monotonic())

    def layers_done(self, rid: str, upto: int) -> None:
        """Layers ``[0, upto)`` of ``rid``'s pages are final: their writes may start. Never blocks."""
        self._front.layers_done(rid, upto, time.monotonic())

    def finish(self, rid: str, first_token: int, spec_candidate_ids: Any = None) -> None:
        """The forward pass is done: the remaining layers go, then the first token. Never blocks."""
        self._front.finish(rid, first_token, spec_candidate_ids, time.monotonic())

    def send(
        self, rid: str, page_ids: Any, first_token: int, spec_candidate_ids: Any = None
    ) -> None:
        """Write ``rid``'s KV ``page_ids`` (in prompt order) to its decode rank, then send the first token.

        Never blocks; the pages must stay unchanged until the request's
        ``Succeeded`` or ``Failed`` event. ``first_token`` becomes decode's
        ``RemotePrefill.bootstrap_token``; ``spec_candidate_ids`` (None, or up to 256
        token ids) its ``spec_candidate_ids``.
        """
        self._front.send(rid, page_ids, first_token, spec_candidate_ids, time.monotonic())
