"""EPD values and the two traits of the seed (``ts_pd/control.rs``), rendered in Python.

An encode node (E) ships each multimodal item's embedding rows to the prefill
ranks (P) that wait for them; one room per item. The values here are small,
frozen and validated when built, as in ``pdcore.core.events``: a bad value raises
``ValueError`` (``TypeError`` for a value of the wrong type) naming the class
and the field. Never subclass them.

``EmbeddingReceiver`` and ``EmbeddingSender`` are ``typing.Protocol``\\ s, as
``pdcore.pd._peer.TransferPeer`` is: the prefill peer's receiver and the encode
peer's sender implement them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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

_U64 = (1 << 64) - 1
_I64 = (1 << 63) - 1

#: The receiver's per-request codes (``EmbeddingReceiver.poll``), reduced with MIN across the replica.
CODE_FAILED = 0  # failed or timed out on some rank
CODE_RECEIVING = 1
CODE_LANDED = 2

#: Bytes per element of the dtypes an embedding may travel in, by ``str(torch.dtype)``.
DTYPE_ITEMSIZE: dict[str, int] = {
    "torch.float64": 8,
    "torch.float32": 4,
    "torch.float16": 2,
    "torch.bfloat16": 2,
    "torch.float8_e4m3fn": 1,
    "torch.float8_e4m3fnuz": 1,
    "torch.float8_e5m2": 1,
    "torch.float8_e5m2fnuz": 1,
    "torch.int8": 1,
    "torch.uint8": 1,
}


def _int(owner: str, name: str, value: object, lo: int, hi: int, what: str) -> None:
    """``value`` is an ``int`` (not a bool) in ``lo..hi``, or raise naming ``owner.name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:  # type: ignore[operator]
        raise ValueError(f"{owner}.{name} {value!r} is not {what}")


def _bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool, got {type(value).__name__} {value!r}")


def _text(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a str, got {type(value).__name__} {value!r}")
    if not value:
        raise ValueError(f"{owner}.{name} is empty")


@dataclass(frozen=True, slots=True)
class EmbeddingItem:
    """One multimodal item of a request whose embedding an encode node computes.

    ``index`` is the item's position among the request's multimodal items;
    ``host``/``port`` the encode deployment's bootstrap server; ``room`` the
    room the encode node ships the item under; ``rows`` the embedding's rows
    (the item's tokens).
    """

    index: int
    host: str
    port: int
    room: int
    rows: int

    def __post_init__(self) -> None:
        _int("EmbeddingItem", "index", self.index, 0, _I64, "a position (>= 0)")
        _text("EmbeddingItem", "host", self.host)
        _int("EmbeddingItem", "port", self.port, 1, 65535, "a TCP port")
        _int("EmbeddingItem", "room", self.room, 0, _U64, "an unsigned 64-bit integer")
        _int("EmbeddingItem", "rows", self.rows, 1, _I64, "a positive number of rows")


@dataclass(frozen=True, slots=True)
class LandedItem:
    """Where one received item's rows landed on this rank, for the data plane to publish.

    ``slot`` is the receive slot holding the rows, ``None`` when this rank
    received none (an empty shard: then ``row_count`` is 0). The
    ``row_count`` rows from ``row_start`` of the image's ``rows`` are packed
    at the slot's start. ``sharded``: the rows are this rank's shard and the
    ranks rebuild the rest; otherwise they are the whole image.
    """

    index: int
    slot: int | None
    row_start: int
    row_count: int
    rows: int
    sharded: bool

    def __post_init__(self) -> None:
        _int("LandedItem", "index", self.index, 0, _I64, "a position (>= 0)")
        if self.slot is not None:
            _int("LandedItem", "slot", self.slot, 0, _I64, "a slot number (>= 0)")
        _int("LandedItem", "rows", self.rows, 1, _I64, "a positive number of rows")
        _int("LandedItem", "row_start", self.row_start, 0, self.rows, f"within the image's {self.rows} rows")
        _int("LandedItem", "row_count", self.row_count, 0, self.rows - self.row_start,
             f"a row count that fits from row {self.row_start} in {self.rows} rows")
        _bool("LandedItem", "sharded", self.sharded)
        if (self.slot is None) != (self.row_count == 0):
            raise ValueError(
                f"LandedItem.slot {self.slot!r} with row_count {self.row_count}: "
                "an empty shard has no slot, and rows need one"
            )
        if not self.sharded and (self.row_start, self.row_count) != (0, self.rows):
            raise ValueError(
                f"LandedItem.row_start/row_count ({self.row_start}, {self.row_count}) of an unsharded item "
                f"must be the whole image (0, {self.rows})"
            )


@dataclass(frozen=True, slots=True)
class LandedRequest:
    """A request whose items' embeddings all landed; ``items`` in the request's order."""

    rid: str
    items: tuple[LandedItem, ...]

    def __post_init__(self) -> None:
        _text("LandedRequest", "rid", self.rid)
        if isinstance(self.items, (str, bytes)) or not isinstance(self.items, Sequence):
            raise TypeError(f"LandedRequest.items must be a sequence of LandedItem, got {type(self.items).__name__}")
        items = tuple(self.items)
        for item in items:
            if type(item) is not LandedItem:
                raise TypeError(f"LandedRequest.items holds a {type(item).__name__}, not a LandedItem")
        for a, b in zip(items, items[1:]):
            if not a.index < b.index:
                raise ValueError(
                    f"LandedRequest.items of {self.rid!r} must be in the request's order "
                    f"(strictly increasing index), got {a.index} then {b.index}"
                )
        object.__setattr__(self, "items", items)


@dataclass(frozen=True, slots=True)
class EmbeddingChunk:
    """An encode rank's one item's embedding in its send slot, as the transfer engine reads it.

    ``source`` is the rows' address, ``rows`` the image's rows of ``hidden``
    elements of ``dtype`` (``str(torch.dtype)``), ``nbytes`` their bytes. The
    deepstack rows travel as a second buffer: ``deepstack_source`` (0 without
    deepstack), ``deepstack_width`` elements per row (0 without) and
    ``deepstack_nbytes`` (0 without) are all set or all zero.
    """

    room: int
    source: int
    rows: int
    hidden: int
    dtype: str
    nbytes: int
    deepstack_source: int = 0
    deepstack_width: int = 0
    deepstack_nbytes: int = 0

    def __post_init__(self) -> None:
        owner = "EmbeddingChunk"
        _int(owner, "room", self.room, 0, _U64, "an unsigned 64-bit integer")
        _int(owner, "source", self.source, 1, _U64, "a non-null 64-bit address")
        _int(owner, "rows", self.rows, 1, _I64, "a positive number of rows")
        _int(owner, "hidden", self.hidden, 1, _I64, "a positive number of elements per row")
        _text(owner, "dtype", self.dtype)
        itemsize = DTYPE_ITEMSIZE.get(self.dtype)
        if itemsize is None:
            raise ValueError(f"{owner}.dtype {self.dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")
        _int(owner, "nbytes", self.nbytes, 1, _U64, "a positive byte count")
        expect = self.rows * self.hidden * itemsize
        if self.nbytes != expect:
            raise ValueError(
                f"{owner}.nbytes {self.nbytes} != rows {self.rows} x hidden {self.hidden} x {itemsize} "
                f"({self.dtype}) = {expect}"
            )
        if self.source + self.nbytes - 1 > _U64:
            raise ValueError(f"{owner}.source {self.source:#x} + nbytes {self.nbytes} runs past the address space")
        _int(owner, "deepstack_source", self.deepstack_source, 0, _U64, "a 64-bit address (0 without deepstack)")
        _int(owner, "deepstack_width", self.deepstack_width, 0, _I64, "an element count (0 without deepstack)")
        _int(owner, "deepstack_nbytes", self.deepstack_nbytes, 0, _U64, "a byte count (0 without deepstack)")
        present = (self.deepstack_source != 0, self.deepstack_width != 0, self.deepstack_nbytes != 0)
        if any(present) and not all(present):
            raise ValueError(
                f"{owner}.deepstack_source/deepstack_width/deepstack_nbytes must be all set or all 0, got "
                f"{self.deepstack_source:#x}/{self.deepstack_width}/{self.deepstack_nbytes}"
            )
        if all(present):
            expect = self.rows * self.deepstack_width * itemsize
            if self.deepstack_nbytes != expect:
                raise ValueError(
                    f"{owner}.deepstack_nbytes {self.deepstack_nbytes} != rows {self.rows} x deepstack_width "
                    f"{self.deepstack_width} x {itemsize} ({self.dtype}) = {expect}"
                )
            if self.deepstack_source + self.deepstack_nbytes - 1 > _U64:
                raise ValueError(
                    f"{owner}.deepstack_source {self.deepstack_source:#x} + deepstack_nbytes "
                    f"{self.deepstack_nbytes} runs past the address space"
                )
            main = (self.source, self.source + self.nbytes)
            deep = (self.deepstack_source, self.deepstack_source + self.deepstack_nbytes)
            if main[0] < deep[1] and deep[0] < main[1]:
                raise ValueError(
                    f"{owner}.deepstack_source range [{deep[0]:#x}, {deep[1]:#x}) overlaps the main rows "
                    f"[{main[0]:#x}, {main[1]:#x})"
                )

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def has_deepstack(self) -> bool:
        return self.deepstack_width != 0


class EmbeddingReceiver(Protocol):
    """A prefill node's first stage: receiving the encode nodes' embeddings (the seed's trait).

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


class EmbeddingSender(Protocol):
    """An encode rank: sending each item's embedding to the prefill ranks that wait for it (the seed's trait)."""

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
