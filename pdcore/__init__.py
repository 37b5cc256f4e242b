"""pdcore: the transfer peer of disaggregated LLM serving.

A prefill replica writes each request's KV pages into pages a decode replica
allocated, over a swappable data plane (``transport``: TCP or RDMA verbs); the
ranks of each replica agree every round, with one all-reduce MIN, on which
transfers changed state. See README.md.

Names are imported on first use: ``import pdcore.core.errors`` must not pull
in torch, ZeroMQ or the peers.

The package is layered, each layer importing only those below it:

- ``core``: the compiled state table and its pure twin, the shared-memory
  reduction, the agreement, events, errors, deadlines (sans-IO);
- ``kv``: KV layouts across tp sizes and the write planner;
- ``control``: the control plane: wire codec, control channel, bootstrap
  server and client, authentication, deployment lookups, metrics;
- ``protocol``: each role's per-request protocol as a sans-IO engine;
- ``node``: what every role's rank runs on: its configuration and peer base
  (the driver thread, transport, control channel, bootstrap registration);
- ``epd``: the encode peer and the prefill rank's embedding receiver;
- ``pd``: the prefill and decode peers and their configuration (a prefill
  peer hosts its EPD receiver: ``PrefillPeer.embedding_receiver``);
- ``sim``: the seeded simulator (``python -m pdcore simulate``);
- ``tools``: the command line (``python -m pdcore``): demo, bootstrap, chaos;
- ``vllm``: the vLLM connector and router (never imported by ``import pdcore``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "IMPLEMENTATION": "core.table",
    "DecodeConfig": "pd.config",
    "PeerConfig": "pd.config",
    "TransferConfig": "pd.config",
    "PrefillConfig": "pd.config",
    "DecodeInbox": "pd.decode",
    "DecodePeer": "pd.decode",
    "PrefillOutbox": "pd.prefill",
    "PrefillPeer": "pd.prefill",
    "TransferPeer": "pd.peer",
    "EncodeConfig": "epd.config",
    "ReceiverConfig": "epd.config",
    "EncodePeer": "epd.encode",
    "EmbeddingChunk": "epd.types",
    "EmbeddingItem": "epd.types",
    "EmbeddingReceiver": "epd.types",
    "EmbeddingSender": "epd.types",
    "LandedItem": "epd.types",
    "LandedRequest": "epd.types",
    "BootstrapInfo": "core.events",
    "Bootstrapped": "core.events",
    "Event": "core.events",
    "Failed": "core.events",
    "RemotePrefill": "core.events",
    "RemotePrefillDone": "core.events",
    "Succeeded": "core.events",
    "AuthenticationError": "control.auth",
    "CapacityError": "core.errors",
    "CollectiveError": "core.errors",
    "LocalProtocolError": "core.errors",
    "PdError": "core.errors",
    "PeerError": "core.errors",
    "ProtocolError": "core.errors",
    "RemoteProtocolError": "core.errors",
    "StartError": "core.errors",
    "TransportError": "core.errors",
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
    from .pd.peer import TransferPeer
    from .control.auth import AuthenticationError
    from .pd.config import DecodeConfig, PeerConfig, PrefillConfig, TransferConfig
    from .pd.decode import DecodeInbox, DecodePeer
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
    from .core.errors import (
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
    from .core.events import BootstrapInfo, Bootstrapped, Event, Failed, RemotePrefill, RemotePrefillDone, Succeeded
    from .pd.prefill import PrefillOutbox, PrefillPeer
    from .core.table import IMPLEMENTATION
