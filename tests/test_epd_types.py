"""The EPD values: every validation rule refuses a value that breaks it, naming the class and field."""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

import pytest

import pdcore
from pdcore.epd import types
from pdcore.epd.types import EmbeddingChunk, EmbeddingItem, LandedItem, LandedRequest

U64 = (1 << 64) - 1

ITEM = dict(index=0, host="encode-0", port=8998, room=7, rows=16)
LANDED = dict(index=1, slot=3, row_start=0, row_count=16, rows=16, sharded=False)
# 4 rows x 8 hidden x 2 bytes = 64; deepstack 4 rows x 16 x 2 = 128, after the main rows
CHUNK = dict(room=9, source=0x1000, rows=4, hidden=8, dtype="torch.bfloat16", nbytes=64,
             deepstack_source=0x2000, deepstack_width=16, deepstack_nbytes=128)
PLAIN_CHUNK = {**CHUNK, "deepstack_source": 0, "deepstack_width": 0, "deepstack_nbytes": 0}


def test_good_values_build_and_compare() -> None:
    assert EmbeddingItem(**ITEM) == EmbeddingItem(0, "encode-0", 8998, 7, 16)
    assert LandedItem(**LANDED).slot == 3
    assert EmbeddingChunk(**CHUNK).has_deepstack and EmbeddingChunk(**CHUNK).itemsize == 2
    assert not EmbeddingChunk(**PLAIN_CHUNK).has_deepstack
    assert EmbeddingChunk(9, 0x1000, 4, 8, "torch.bfloat16", 64) == EmbeddingChunk(**PLAIN_CHUNK)  # deepstack defaults
    # edge values that are valid
    EmbeddingItem(index=0, host="h", port=65535, room=U64, rows=1)
    LandedItem(index=0, slot=None, row_start=5, row_count=0, rows=5, sharded=True)  # empty shard past the end
    LandedItem(index=0, slot=0, row_start=2, row_count=3, rows=5, sharded=True)
    EmbeddingChunk(room=0, source=U64 - 63, rows=4, hidden=8, dtype="torch.bfloat16", nbytes=64)  # ends at 2**64


def test_values_are_frozen_and_hashable() -> None:
    values: list[Any] = [
        EmbeddingItem(**ITEM), LandedItem(**LANDED), LandedRequest("r", (LandedItem(**LANDED),)), EmbeddingChunk(**CHUNK)
    ]
    for value in values:
        with pytest.raises(AttributeError):  # compiled: read-only slots; pure twin: FrozenInstanceError
            setattr(value, dataclasses.fields(value)[0].name, 1)
        with pytest.raises(AttributeError):
            value.unknown = 1
        assert hash(value) == hash(dataclasses.replace(value)) and value == pickle.loads(pickle.dumps(value))


def test_the_values_are_the_compiled_ones_unless_pure() -> None:
    expected = "pdcore.epd._types_py" if os.environ.get("PDCORE_PURE_PYTHON") == "1" else "pdcore.epd._types"
    for cls in (EmbeddingItem, LandedItem, LandedRequest, EmbeddingChunk):
        assert cls.__module__ == expected


def test_landed_request_keeps_items_as_a_tuple() -> None:
    req = LandedRequest("r", [LandedItem(**LANDED), LandedItem(**{**LANDED, "index": 4})])
    assert isinstance(req.items, tuple) and [i.index for i in req.items] == [1, 4]
    assert LandedRequest("r", []).items == ()


def test_exported_from_pdcore() -> None:
    for name in ("EmbeddingItem", "LandedItem", "LandedRequest", "EmbeddingChunk", "EmbeddingReceiver", "EmbeddingSender"):
        assert getattr(pdcore, name) is getattr(types, name)
        assert name in pdcore.__all__ and name in dir(pdcore)


def test_traits_are_protocols_with_the_seeds_methods() -> None:
    assert types.EmbeddingReceiver._is_protocol  # type: ignore[attr-defined]
    assert types.EmbeddingSender._is_protocol  # type: ignore[attr-defined]
    receiver = {n for n in vars(types.EmbeddingReceiver) if not n.startswith("_")}
    sender = {n for n in vars(types.EmbeddingSender) if not n.startswith("_")}
    assert receiver == {"stage", "poll", "settle", "release", "awaiting_release", "round", "rows", "deepstack_rows",
                        "failed"}
    assert sender == {"begin", "send", "fail", "concluded"}


def test_the_receiver_implements_every_method_of_its_protocol() -> None:
    from pdcore.epd.receiver import Receiver

    for name in (n for n in vars(types.EmbeddingReceiver) if not n.startswith("_")):
        assert callable(getattr(Receiver, name, None)), name


def test_every_protocol_method_has_its_own_docstring() -> None:
    """``help(TransferPeer.register)`` showed ABCMeta's "Register a virtual subclass of an ABC"."""
    import abc
    import inspect

    from pdcore.epd.receiver import Receiver
    from pdcore.pd.peer import TransferPeer

    for proto in (TransferPeer, types.EmbeddingReceiver, types.EmbeddingSender, Receiver):
        for name in (n for n in vars(proto) if not n.startswith("_") and callable(vars(proto)[n])):
            doc = inspect.getdoc(getattr(proto, name))
            assert doc and doc != inspect.getdoc(abc.ABCMeta.register), f"{proto.__name__}.{name} has no docstring"
    assert "rows(slot, count)" in (Receiver.__doc__ or "") and "rows(item)" not in (Receiver.__doc__ or "")


BAD_ITEMS = [
    ("index", -1, ValueError), ("index", True, TypeError), ("index", 1.0, TypeError),
    ("host", "", ValueError), ("host", b"h", TypeError),
    ("port", 0, ValueError), ("port", 65536, ValueError), ("port", "8998", TypeError),
    ("room", -1, ValueError), ("room", U64 + 1, ValueError), ("room", None, TypeError),
    ("rows", 0, ValueError), ("rows", -3, ValueError), ("rows", 2.5, TypeError),
]


@pytest.mark.parametrize(("field", "value", "error"), BAD_ITEMS)
def test_embedding_item_refuses(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"EmbeddingItem.{field}"):
        EmbeddingItem(**{**ITEM, field: value})


BAD_LANDED = [
    ({"index": -1}, ValueError, "index"),
    ({"slot": -1}, ValueError, "slot"),
    ({"slot": "3"}, TypeError, "slot"),
    ({"rows": 0, "row_count": 0, "slot": None}, ValueError, "rows"),
    ({"row_start": -1}, ValueError, "row_start"),
    ({"row_start": 17, "row_count": 0, "slot": None, "sharded": True}, ValueError, "row_start"),
    ({"row_count": -1}, ValueError, "row_count"),
    ({"row_start": 4, "row_count": 13, "sharded": True}, ValueError, "row_count"),  # 4 + 13 > 16
    ({"sharded": 1}, TypeError, "sharded"),
    ({"slot": None}, ValueError, "slot"),  # rows need a slot
    ({"row_count": 0, "row_start": 16, "sharded": True}, ValueError, "slot"),  # an empty shard has none
    ({"row_start": 0, "row_count": 8}, ValueError, "row_start/row_count"),  # unsharded but partial
    ({"row_start": 8, "row_count": 8}, ValueError, "row_start/row_count"),
]


@pytest.mark.parametrize(("change", "error", "field"), BAD_LANDED)
def test_landed_item_refuses(change: dict[str, object], error: type[Exception], field: str) -> None:
    with pytest.raises(error, match=f"LandedItem.{field}"):
        LandedItem(**{**LANDED, **change})


def test_landed_request_refuses() -> None:
    good = LandedItem(**LANDED)
    with pytest.raises(ValueError, match="LandedRequest.rid"):
        LandedRequest("", (good,))
    with pytest.raises(TypeError, match="LandedRequest.rid"):
        LandedRequest(7, (good,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LandedRequest.items"):
        LandedRequest("r", good)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LandedRequest.items"):
        LandedRequest("r", "items")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LandedRequest.items holds a dict"):
        LandedRequest("r", (LANDED,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="LandedRequest.items .* 4 then 1"):
        LandedRequest("r", (LandedItem(**{**LANDED, "index": 4}), good))
    with pytest.raises(ValueError, match="LandedRequest.items .* 1 then 1"):
        LandedRequest("r", (good, good))


BAD_CHUNKS = [
    ({"room": -1}, ValueError, "room"),
    ({"room": U64 + 1}, ValueError, "room"),
    ({"source": 0}, ValueError, "source"),
    ({"source": "0x1000"}, TypeError, "source"),
    ({"source": U64 - 62}, ValueError, "source"),  # the 64 bytes would run past 2**64
    ({"rows": 0}, ValueError, "rows"),
    ({"hidden": 0}, ValueError, "hidden"),
    ({"hidden": 8.0}, TypeError, "hidden"),
    ({"dtype": ""}, ValueError, "dtype"),
    ({"dtype": "bfloat16"}, ValueError, "dtype"),  # not str(torch.dtype)
    ({"dtype": "torch.complex64"}, ValueError, "dtype"),
    ({"dtype": None}, TypeError, "dtype"),
    ({"nbytes": 0}, ValueError, "nbytes"),
    ({"nbytes": 63}, ValueError, "nbytes"),
    ({"nbytes": 128}, ValueError, "nbytes"),
    ({"dtype": "torch.float32"}, ValueError, "nbytes"),  # 4 x 8 x 4 = 128, not 64
    ({"deepstack_source": -1}, ValueError, "deepstack_source"),
    ({"deepstack_width": -16}, ValueError, "deepstack_width"),
    ({"deepstack_nbytes": -1}, ValueError, "deepstack_nbytes"),
    ({"deepstack_source": 0}, ValueError, "all set or all 0"),
    ({"deepstack_width": 0}, ValueError, "all set or all 0"),
    ({"deepstack_nbytes": 0}, ValueError, "all set or all 0"),
    ({"deepstack_nbytes": 64}, ValueError, "deepstack_nbytes"),
    ({"deepstack_width": 8}, ValueError, "deepstack_nbytes"),  # 4 x 8 x 2 = 64, not 128
    ({"deepstack_source": U64 - 126}, ValueError, "deepstack_source .* runs past"),
    ({"deepstack_source": 0x1000 - 64}, ValueError, "overlaps the main rows"),
    ({"deepstack_source": 0x1000 + 32}, ValueError, "overlaps the main rows"),
]


@pytest.mark.parametrize(("change", "error", "field"), BAD_CHUNKS)
def test_embedding_chunk_refuses(change: dict[str, object], error: type[Exception], field: str) -> None:
    with pytest.raises(error, match=f"EmbeddingChunk.{field}" if field.isidentifier() else field):
        EmbeddingChunk(**{**CHUNK, **change})


def test_plain_chunk_refuses_deepstack_fields_on_their_own() -> None:
    for field, value in (("deepstack_source", 0x9000), ("deepstack_width", 16), ("deepstack_nbytes", 128)):
        with pytest.raises(ValueError, match="all set or all 0"):
            EmbeddingChunk(**{**PLAIN_CHUNK, field: value})


def test_every_dtype_has_its_itemsize() -> None:
    for dtype, size in types.DTYPE_ITEMSIZE.items():
        chunk = EmbeddingChunk(room=1, source=64, rows=3, hidden=5, dtype=dtype, nbytes=15 * size)
        assert chunk.itemsize == size
