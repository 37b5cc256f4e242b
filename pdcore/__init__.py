"""pdcore: the transfer peer of disaggregated LLM serving.

A prefill replica writes each request's KV pages into pages a decode replica
allocated, over a swappable data plane (``transport``: TCP or RDMA verbs); the
ranks of each replica agree every round, with one all-reduce MIN, on which
transfers changed state. See README.md and DESIGN.md.
"""

from .config import DecodeConfig, PeerConfig, PrefillConfig
from .decode import DecodeInbox, DecodePeer
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

__all__ = [
    "IMPLEMENTATION",
    "BootstrapInfo",
    "Bootstrapped",
    "CapacityError",
    "CollectiveError",
    "DecodeConfig",
    "DecodeInbox",
    "DecodePeer",
    "Event",
    "Failed",
    "LocalProtocolError",
    "PdError",
    "PeerConfig",
    "PeerError",
    "PrefillConfig",
    "PrefillOutbox",
    "PrefillPeer",
    "ProtocolError",
    "RemotePrefill",
    "RemotePrefillDone",
    "RemoteProtocolError",
    "StartError",
    "Succeeded",
    "TransportError",
]
