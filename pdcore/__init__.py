"""pdcore: the transfer peer of disaggregated LLM serving.

A prefill replica writes each request's KV pages into pages a decode replica
allocated, over a swappable data plane (``transport``: TCP or RDMA verbs); the
ranks of each replica agree every round, with one all-reduce MIN, on which
transfers changed state. See README.md.

Names are imported on first use: ``import pdcore.errors`` (as the data plane
does) must not pull in torch, ZeroMQ or the peers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "IMPLEMENTATION": "table",
    "DecodeConfig": "config",
    "PeerConfig": "config",
    "PrefillConfig": "config",
    "DecodeInbox": "decode",
    "DecodePeer": "decode",
    "PrefillOutbox": "prefill",
    "PrefillPeer": "prefill",
    "TransferPeer": "_peer",
    "EncodeConfig": "epd.config",
    "ReceiverConfig": "epd.config",
    "EncodePeer": "epd.encode",
    "EmbeddingChunk": "epd.types",
    "EmbeddingItem": "epd.types",
    "EmbeddingReceiver": "epd.types",
    "EmbeddingSender": "epd.types",
    "LandedItem": "epd.types",
    "LandedRequest": "epd.types",
    "BootstrapInfo": "events",
    "Bootstrapped": "events",
    "Event": "events",
    "Failed": "events",
    "RemotePrefill": "events",
    "RemotePrefillDone": "events",
    "Succeeded": "events",
    "AuthenticationError": "auth",
    "CapacityError": "errors",
    "CollectiveError": "errors",
    "LocalProtocolError": "errors",
    "PdError": "errors",
    "PeerError": "errors",
    "ProtocolError": "errors",
    "RemoteProtocolError": "errors",
    "StartError": "errors",
    "TransportError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pdcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from ._peer import TransferPeer
    from .auth import AuthenticationError
    from .config import DecodeConfig, PeerConfig, PrefillConfig
    from .decode import DecodeInbox, DecodePeer
    from .epd.config import EncodeConfig, ReceiverConfig
    from .epd.encode import EncodePeer
    from .epd.types import (
        EmbeddingChunk,
        EmbeddingItem,
        EmbeddingReceiver,
        EmbeddingSender,
        LandedItem,
        LandedRequest,
    )
    from .errors import (
        CapacityError,
        CollectiveError,
        LocalProtocolError,
        PdError,
        PeerError,
        ProtocolError,
        RemoteProtocolError,
        StartError,
        TransportError,
    )
    from .events import BootstrapInfo, Bootstrapped, Event, Failed, RemotePrefill, RemotePrefillDone, Succeeded
    from .prefill import PrefillOutbox, PrefillPeer
    from .table import IMPLEMENTATION
