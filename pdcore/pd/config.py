"""Configuration of the PD peers (on ``pdcore.node.config.NodeConfig``): validated when built, so a bad
value fails at start.

Every timeout is in seconds. Defaults are those of common disaggregated deployments
(bootstrap 120 s, waiting 300 s) except where such defaults hid failures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.agreement import AGREEMENT_MODES
from ..core.errors import LocalProtocolError
from ..core.twin_common import MAX_CAPACITY
from ..kv.layout import KvLayout
from ..node.config import NodeConfig, check_registration, check_seconds, check_writable_buffer, config_error

__all__ = ["TransferConfig", "PeerConfig", "PrefillConfig", "DecodeConfig"]


@dataclass(frozen=True, kw_only=True)
class TransferConfig(NodeConfig):
    """What both PD peers need: the KV cache memory and the transfer table's knobs (and ``NodeConfig``'s).

    ``kv_buffers`` are the cache's buffers: writable, contiguous numpy arrays or
    contiguous CPU tensors (anything else is a ``StartError`` naming it: the
    transport writes into them behind Python's back), each holding at least
    ``num_pages`` pages of ``page_bytes`` bytes (one value for all buffers, or one
    per buffer). With a ``kv_layout`` they are layer-major: buffer ``2l`` is layer
    ``l``'s K, ``2l+1`` its V (MLA: buffer ``l`` is layer ``l``'s latent), the same
    order on both deployments. They are registered with the transport; the peer
    keeps them alive.

    The knobs (seconds unless said), what each bounds and what happens when it fires:

    - ``capacity`` (4096 requests): requests tracked at once, from ``register``
      until the round that reports their end; ``register`` past it raises
      ``CapacityError``. The same on every rank of a replica (it sizes the agreement).
    - ``bootstrap_timeout`` (120): ``register`` → ``Bootstrapped`` took longer: the
      request fails. On decode it bounds the bootstrap lookup and the pairing with
      the prefill ranks; on prefill it lasts until every decode rank announced the
      room, so it includes decode's wait for free pages. A prefill rank also parks an
      announcement for a room its scheduler has not registered this long, then
      tells decode "prefill never registered room".
    - ``waiting_timeout`` (300): decode, from ``announce`` until the room landed
      (so it covers prefill's queue and forward pass); prefill, from the hand-over's
      first post until every write landed. Then the request fails.
    - ``fence_timeout`` (30): how long prefill's worker waits for room in the
      transport to post a batch of writes; past it the room fails. (The fence
      itself never waits on prefill: decode revokes its grant.)
    - ``agreement_timeout`` (5): shared-memory agreement only: a rank that did not
      reach the round this long (stopped, hung, not polling) makes ``poll`` raise
      ``CollectiveError`` on every rank; gloo rounds use the group's own timeout.
    - ``max_parked_pages`` (2**20), ``max_parked_pages_total`` (2**22): page ids of announcements
      parked per sender and from all senders together; past them an announcement is refused.
    """

    kv_buffers: Sequence[Any]
    page_bytes: Sequence[int] | int
    num_pages: int
    capacity: int = 4096
    bootstrap_timeout: float = 120.0
    waiting_timeout: float = 300.0
    fence_timeout: float = 30.0
    max_parked_pages: int = 1 << 20  # page ids of announcements parked per sender (before their room registers)
    max_parked_pages_total: int = 1 << 22  # ... and from all senders together (a sender without a secret picks its id)
    #: Benchmarks only: decode takes writes without grants and closes fences without revoking, so
    #: benchmarks/pd.py can show what grants cost. Fence before free then holds for nothing.
    unsafe_no_grants: bool = False
    #: how the replica agrees each round: "auto" (shared memory when every rank is on this host, else the
    #: group's all-reduce), "shm" or "group"; a rank silent for ``agreement_timeout`` fails the round
    agreement: str = "auto"
    agreement_timeout: float = 5.0
    #: a ``prometheus_client.CollectorRegistry`` to publish this peer's metrics in (``pdcore.control.metrics``)
    metrics: Any = field(default=None, repr=False, compare=False)
    #: what the pages hold (``pdcore.kv.KvLayout``: heads, page order, MLA), the same on both deployments;
    #: None: opaque pages, and prefill and decode must have the same tp size
    kv_layout: KvLayout | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_kv_layout()
        if not self.kv_buffers:
            raise config_error(self, "kv_buffers", "at least one buffer is needed")
        for i, buf in enumerate(self.kv_buffers):
            check_writable_buffer(self, f"kv_buffers[{i}]", buf)
        if self.num_pages < 1:
            raise config_error(self, "num_pages", f"must be positive, got {self.num_pages}")
        sizes = self.page_bytes_per_buffer
        if len(sizes) != len(self.kv_buffers) or any(s < 1 for s in sizes):
            raise config_error(self, "page_bytes", f"one positive size or one per buffer ({len(self.kv_buffers)}), got {self.page_bytes}")
        if not 1 <= self.capacity <= MAX_CAPACITY:
            raise config_error(self, "capacity", f"must be in 1..{MAX_CAPACITY}, got {self.capacity}")
        check_seconds(self, ("bootstrap_timeout", "waiting_timeout", "fence_timeout", "agreement_timeout"))
        if self.agreement not in AGREEMENT_MODES:
            raise config_error(self, "agreement", f"must be one of {', '.join(map(repr, AGREEMENT_MODES))}, got {self.agreement!r}")
        for name in ("max_parked_pages", "max_parked_pages_total"):
            if getattr(self, name) < 1:
                raise config_error(self, name, f"must be positive, got {getattr(self, name)}")

    def _check_kv_layout(self) -> None:
        layout = self.kv_layout
        if layout is None:
            return
        if not isinstance(layout, KvLayout):
            raise config_error(self, "kv_layout", f"must be a pdcore.kv.KvLayout or None, got {type(layout).__name__}")
        try:
            layout.check_tp(self.tp_size, "tp_size")
        except LocalProtocolError as e:
            raise config_error(self, "kv_layout", str(e)) from None
        if len(self.kv_buffers) != layout.buffers:
            raise config_error(self, "kv_buffers", f"the kv_layout has {layout.buffers} buffers per rank, got {len(self.kv_buffers)}")
        want = layout.page_bytes(self.tp_size)
        if any(b != want for b in self.page_bytes_per_buffer):
            raise config_error(self, "page_bytes", f"the kv_layout gives {want} bytes per page on a rank of tp {self.tp_size}, "
                       f"got {self.page_bytes}")

    @property
    def page_bytes_per_buffer(self) -> tuple[int, ...]:
        if isinstance(self.page_bytes, int):
            return (self.page_bytes,) * len(self.kv_buffers)
        return tuple(int(b) for b in self.page_bytes)


PeerConfig = TransferConfig  # its name before EPD had configs of its own (PD only, as now)


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(TransferConfig):
    """A prefill rank: it registers with its deployment's bootstrap server (``bootstrap_host``,
    ``bootstrap_port``) as rank ``tp_rank`` of DP group ``dp_rank`` (of ``dp_size``); decode ranks
    find it there by the room (``room % dp_size``, or ``BootstrapInfo.dp_rank``)."""

    bootstrap_host: str
    bootstrap_port: int
    dp_size: int = 1
    dp_rank: int = 0
    #: layer-wise hand-over (``PrefillOutbox.layers_done``) starts writes early only for prompts of at least
    #: this many pages; shorter ones are sent at ``finish``
    layerwise_min_pages: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_registration(self)
        if isinstance(self.layerwise_min_pages, bool) or not isinstance(self.layerwise_min_pages, int) \
                or self.layerwise_min_pages < 0:
            raise config_error(self, "layerwise_min_pages", f"must be an int >= 0, got {self.layerwise_min_pages!r}")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(TransferConfig):
    """A decode rank: it finds each request's prefill ranks through the request's bootstrap info
    (``BootstrapInfo``: the prefill deployment's bootstrap server and the room); it registers nowhere."""
