"""EPD values and the two traits a scheduler programs against (receiver and sender).

An encode node (E) ships each multimodal item's embedding rows to the prefill
ranks (P) that wait for them; one room per item. The values here are small,
frozen and validated when built, as in ``pdcore.core.events``: a bad value raises
``ValueError`` (``TypeError`` for a value of the wrong type) naming the class
and the field. Never subclass them. They are compiled from ``_types_py`` (see
there why); ``PDCORE_PURE_PYTHON=1`` takes that file as Python.

``EmbeddingReceiver`` and ``EmbeddingSender`` are ``typing.Protocol``\\ s, as
``pdcore.pd.peer.TransferPeer`` is: the prefill peer's receiver and the encode
peer's sender implement them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..twins import load

__all__ = [
    "EmbeddingItem",
    "LandedItem",
    "LandedRequest",
    "EmbeddingChunk",
    "EmbeddingReceiver",
    "EmbeddingSender",
    "DTYPE_ITEMSIZE",
    "CODE_FAILED",
    "CODE_RECEIVING",
    "CODE_LANDED",
]

if TYPE_CHECKING:
    from ._types_py import DTYPE_ITEMSIZE, EmbeddingChunk, EmbeddingItem, LandedItem, LandedRequest
else:
    _types = load("pdcore.epd._types")
    DTYPE_ITEMSIZE, EmbeddingChunk, EmbeddingItem = _types.DTYPE_ITEMSIZE, _types.EmbeddingChunk, _types.EmbeddingItem
    LandedItem, LandedRequest = _types.LandedItem, _types.LandedRequest

#: The receiver's per-request codes (``EmbeddingReceiver.poll``), reduced with MIN across the replica.
CODE_FAILED = 0  # failed or timed out on some rank
CODE_RECEIVING = 1
CODE_LANDED = 2


class EmbeddingReceiver(Protocol):
    """A prefill node's first stage: receiving the encode nodes' embeddings (a trait: ``EmbeddingReceiver``).

    Every member of the replica stages the same requests in the same order and
    settles the same codes.
    """

    def stage(self, rid: str, items: Sequence[EmbeddingItem]) -> None:
        """Start receiving ``rid``'s items' embeddings; never blocks."""
        ...

    def poll(self) -> list[int]:
        """Every staged request's code on this rank, in staging order: 0 failed or timed out, 1 receiving, 2 landed."""
        ...

    def settle(self, codes: Sequence[int]) -> list[LandedRequest]:
        """Act on the replica-agreed ``codes`` (``poll`` order); the landed ones' slots stay leased until ``release``."""
        ...

    def release(self, slots: Sequence[int]) -> None:
        """The data plane copied these slots' rows out: they take new receives."""
        ...

    def awaiting_release(self) -> bool:
        """A landed slot still waits for its rows to be copied out."""
        ...

    def round(self, replica: object = None) -> list[LandedRequest]:
        """``poll`` → MIN across ``replica`` (a gloo process group, or None for one rank) → ``settle``:
        one scheduler round, with a guard that fails every rank if the ranks staged different requests."""
        ...

    def rows(self, slot: int, count: int) -> Any:
        """The first ``count`` rows of a landed ``slot`` as a ``(count, row bytes)`` uint8 array view
        (``LandedItem.slot`` and ``row_count``); copy them out before ``release``."""
        ...

    def deepstack_rows(self, slot: int, count: int) -> Any:
        """The same view of the slot's deepstack rows (``ReceiverConfig.deepstack_width`` elements a row)."""
        ...

    def failed(self) -> list[tuple[str, str]]:
        """The requests the last settle (or round) dropped as failed: ``(rid, reason)``. Their slots
        are fenced and reused by the receiver; the scheduler fails the request toward decode."""
        ...


class EmbeddingSender(Protocol):
    """An encode rank: sending each item's embedding to the prefill ranks that wait for it (a trait: ``EmbeddingSender``)."""

    def begin(self, room: int) -> bool:
        """``room``'s request arrived; False when another request holds the room."""
        ...

    def send(self, chunk: EmbeddingChunk) -> None:
        """Hand over a begun room's rows; they stay in place until the room concludes."""
        ...

    def fail(self, room: int, reason: str) -> None:
        """Conclude a begun room failed before its rows were handed over, telling the prefill ranks that asked."""
        ...

    def concluded(self) -> list[int]:
        """The begun rooms that concluded since the last call, sent or failed: their send slots take new rows."""
        ...
