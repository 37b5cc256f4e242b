# cython: annotation_typing=False
"""The EPD values (``EmbeddingItem``, ``LandedItem``, ``LandedRequest``, ``EmbeddingChunk``), one source for both twins.

Cython compiles this file, as it is, into ``pdcore.epd._types`` (setup.py), as
``pdcore.core._events_py`` is compiled into ``_events``: each value is then a
frozen extension type whose validation runs as C, ~0.6 µs to build where a
frozen slotted dataclass takes ~4.5, and the receiver's settle builds one
``LandedItem`` and one ``LandedRequest`` per landed request every round. The
annotations are left out of the compiled types (``annotation_typing=False``),
so a field holds what it was given and ``__post_init__`` alone judges it: a
float is refused, not truncated. Run as Python (``PDCORE_PURE_PYTHON=1``) the
same decorators give standard frozen dataclasses. ``types.py`` chooses the
module; import the values from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import cython

from transport.limits import U64_MAX

_I64 = (1 << 63) - 1

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


@cython.cfunc
def _int(owner: str, name: str, value: object, lo: int, hi: int, what: str) -> None:
    """``value`` is an ``int`` (not a bool) in ``lo..hi``, or raise naming ``owner.name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{owner}.{name} {value!r} is not {what}")


@cython.cfunc
def _bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool, got {type(value).__name__} {value!r}")


@cython.cfunc
def _text(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a str, got {type(value).__name__} {value!r}")
    if not value:
        raise ValueError(f"{owner}.{name} is empty")


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
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
        _int("EmbeddingItem", "room", self.room, 0, U64_MAX, "an unsigned 64-bit integer")
        _int("EmbeddingItem", "rows", self.rows, 1, _I64, "a positive number of rows")


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
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
        _int("LandedItem", "row_start", self.row_start, 0, _I64, "a row number (>= 0)")
        if self.row_start > self.rows:
            raise ValueError(f"LandedItem.row_start {self.row_start!r} is not within the image's {self.rows} rows")
        _int("LandedItem", "row_count", self.row_count, 0, _I64, "a row count (>= 0)")
        if self.row_count > self.rows - self.row_start:
            raise ValueError(f"LandedItem.row_count {self.row_count!r} is not a row count that fits from row "
                             f"{self.row_start} in {self.rows} rows")
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


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class LandedRequest:
    """A request whose items' embeddings all landed; ``items`` in the request's order."""

    rid: str
    items: tuple[LandedItem, ...]

    def __post_init__(self) -> None:
        _text("LandedRequest", "rid", self.rid)
        items = self.items
        if type(items) is not tuple:
            if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
                raise TypeError(f"LandedRequest.items must be a sequence of LandedItem, got {type(items).__name__}")
            items = tuple(items)
        for item in items:
            if type(item) is not LandedItem:
                raise TypeError(f"LandedRequest.items holds a {type(item).__name__}, not a LandedItem")
        for a, b in zip(items, items[1:]):
            if not a.index < b.index:
                raise ValueError(
                    f"LandedRequest.items of {self.rid!r} must be in the request's order "
                    f"(strictly increasing index), got {a.index} then {b.index}"
                )
        if cython.compiled:
            self.items = items  # type: ignore[misc]  # the extension type's own slot: frozen only against outside assignment
        else:
            object.__setattr__(self, "items", items)


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
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
        _int(owner, "room", self.room, 0, U64_MAX, "an unsigned 64-bit integer")
        _int(owner, "source", self.source, 1, U64_MAX, "a non-null 64-bit address")
        _int(owner, "rows", self.rows, 1, _I64, "a positive number of rows")
        _int(owner, "hidden", self.hidden, 1, _I64, "a positive number of elements per row")
        _text(owner, "dtype", self.dtype)
        itemsize = DTYPE_ITEMSIZE.get(self.dtype)
        if itemsize is None:
            raise ValueError(f"{owner}.dtype {self.dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")
        _int(owner, "nbytes", self.nbytes, 1, U64_MAX, "a positive byte count")
        expect = self.rows * self.hidden * itemsize
        if self.nbytes != expect:
            raise ValueError(
                f"{owner}.nbytes {self.nbytes} != rows {self.rows} x hidden {self.hidden} x {itemsize} "
                f"({self.dtype}) = {expect}"
            )
        if self.source + self.nbytes - 1 > U64_MAX:
            raise ValueError(f"{owner}.source {self.source:#x} + nbytes {self.nbytes} runs past the address space")
        _int(owner, "deepstack_source", self.deepstack_source, 0, U64_MAX, "a 64-bit address (0 without deepstack)")
        _int(owner, "deepstack_width", self.deepstack_width, 0, _I64, "an element count (0 without deepstack)")
        _int(owner, "deepstack_nbytes", self.deepstack_nbytes, 0, U64_MAX, "a byte count (0 without deepstack)")
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
            if self.deepstack_source + self.deepstack_nbytes - 1 > U64_MAX:
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
