"""Configuration of the EPD roles, validated when built: a bad value is a ``StartError`` naming the field.

``ReceiverConfig`` shapes a prefill rank's receiver (``PrefillPeer.embedding_receiver``);
``EncodeConfig`` starts an encode rank's peer (``EncodePeer.start``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..node.config import NodeConfig, check_registration, check_seconds, check_writable_buffer, config_error
from .types import DTYPE_ITEMSIZE

__all__ = ["ReceiverConfig", "EncodeConfig"]


def _positive_int(config: object, name: str, hi: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= hi:
        raise config_error(config, name, f"must be an int in 1..{hi}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ReceiverConfig:
    """A prefill rank's receiver of image embeddings.

    ``slots`` receive slots of ``slot_rows`` rows each, a row being ``hidden``
    elements of ``dtype`` (``str(torch.dtype)``), plus ``deepstack_width``
    elements per row in a second buffer when the model has deepstack rows.
    The slots are cut from one buffer registered once for the receiver's life
    (``buffer``, or allocated here; ``deepstack_buffer`` likewise). With
    ``shard_rows`` each rank of the replica receives its contiguous share of
    every image's rows and the ranks rebuild the rest (the same value on every
    rank: a torn flag fails the first round on every rank). A staged request
    whose rows have not all landed ``timeout`` seconds after ``stage`` fails on
    every rank (``Receiver.failed``).

    Sharded, rank ``r`` of ``n`` receives rows ``[r*b + min(r, e), +b + (r < e))``
    of an image of ``rows`` rows, with ``b, e = divmod(rows, n)``: contiguous shares,
    the first ``e`` ranks one row more, an empty share (``rows < n``) no slot. So
    ``slot_rows`` must hold ``ceil(rows / n)`` rows sharded, ``rows`` unsharded, for
    the largest image; ``stage`` raises ``CapacityError`` for one that does not fit.
    ``buffer``/``deepstack_buffer``, if given, are writable contiguous numpy arrays or
    CPU tensors (the encode ranks write into them); else they are allocated here.
    """

    slots: int
    slot_rows: int
    hidden: int
    dtype: str
    deepstack_width: int = 0
    shard_rows: bool = False
    timeout: float = 300.0
    max_requests: int = 4096
    max_items: int = 64
    buffer: Any = None
    deepstack_buffer: Any = None

    def __post_init__(self) -> None:
        _positive_int(self, "slots", 1 << 16)
        _positive_int(self, "slot_rows", (1 << 62) - 1)
        _positive_int(self, "hidden", 1 << 24)
        _positive_int(self, "max_requests", 1 << 20)
        _positive_int(self, "max_items", 1 << 10)
        if self.dtype not in DTYPE_ITEMSIZE:
            raise config_error(self, "dtype", f"{self.dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")
        if isinstance(self.deepstack_width, bool) or not isinstance(self.deepstack_width, int) or self.deepstack_width < 0:
            raise config_error(self, "deepstack_width", f"must be an int >= 0, got {self.deepstack_width!r}")
        if not isinstance(self.shard_rows, bool):
            raise config_error(self, "shard_rows", f"must be a bool, got {self.shard_rows!r}")
        check_seconds(self, ("timeout",))
        if self.max_requests * self.max_items > 1 << 24:
            raise config_error(self, "max_items", f"max_requests * max_items must be at most {1 << 24}")
        if self.deepstack_buffer is not None and not self.deepstack_width:
            raise config_error(self, "deepstack_buffer", "given without a deepstack_width")
        for name in ("buffer", "deepstack_buffer"):  # the encode ranks write into them
            if getattr(self, name) is not None:
                check_writable_buffer(self, name, getattr(self, name))

    @property
    def row_bytes(self) -> int:
        return self.hidden * DTYPE_ITEMSIZE[self.dtype]

    @property
    def deepstack_row_bytes(self) -> int:
        return self.deepstack_width * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True, kw_only=True)
class EncodeConfig(NodeConfig):
    """An encode rank: the memory its embeddings are sent from, and its deployment's bootstrap server.

    ``send_buffers`` (numpy arrays or contiguous CPU tensors) are registered
    once; every ``EmbeddingChunk.source`` must lie inside one of them. A begun
    room waits ``park_timeout`` seconds for its rows and for every prefill rank
    of its block to ask (and an ask waits as long for its room to begin), then
    fails on both sides. At most ``max_rooms`` rooms are begun or parked.
    """

    send_buffers: Sequence[Any]
    bootstrap_host: str
    bootstrap_port: int
    dp_size: int = 1
    dp_rank: int = 0
    park_timeout: float = 120.0
    max_rooms: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        check_registration(self)
        if not self.send_buffers:
            raise config_error(self, "send_buffers", "at least one buffer is needed")
        check_seconds(self, ("park_timeout",))
        _positive_int(self, "max_rooms", 1 << 20)
