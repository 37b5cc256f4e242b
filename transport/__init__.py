"""The swappable data plane: one interface (``transport.base``), transports chosen by name.

>>> import transport
>>> t = transport.create("tcp")          # or "verbs" where pyverbs and a device exist
>>> region = t.register(numpy_array)      # doctest: +SKIP

See ``transport/base.py`` for the contract every transport honours and
``transport/plan.py`` for turning page lists into coalesced write batches.
"""

from __future__ import annotations

from .base import (
    Batch,
    Completion,
    Endpoint,
    OnDone,
    PeerHandle,
    Region,
    Transport,
    as_batch,
    decode_endpoint,
    encode_endpoint,
)
from .registry import available, create, register_transport, transport_class
from .staging import StagedTransport

__all__ = [
    "Batch",
    "Completion",
    "Endpoint",
    "OnDone",
    "PeerHandle",
    "Region",
    "StagedTransport",
    "Transport",
    "as_batch",
    "available",
    "create",
    "decode_endpoint",
    "encode_endpoint",
    "register_transport",
    "transport_class",
]
