"""What a transport wrapping another (``faulty:<inner>``, ``staged:<inner>``) reads through from it.

A wrapper changes how batches (or memory) travel, not who it is: its instance id,
its counters of refused handshakes and connections, its revoke method, its
grants, regions, endpoint and connections are the inner transport's, passed
through here so the two wrappers say them once.
"""

from __future__ import annotations

from typing import Any

from .base import Grant, PeerHandle, Region, Transport
from .deadline import Deadline

__all__ = ["Wrapping"]


class Wrapping:
    """A mixin ahead of ``Transport`` in a wrapper's bases; the wrapper sets ``inner``."""

    inner: Transport

    @property
    def instance(self) -> bytes:
        return self.inner.instance

    @property
    def auth_failures(self) -> int:
        """The inner transport's count of handshakes refused for authentication (its ``secret`` option)."""
        return int(getattr(self.inner, "auth_failures", 0))

    @property
    def evicted_handshakes(self) -> int:
        """The inner transport's count of unfinished handshakes it cut to make room (0 if it keeps none)."""
        return int(getattr(self.inner, "evicted_handshakes", 0))

    @property
    def refused_connections(self) -> int:
        """The inner transport's count of connections it refused."""
        return int(getattr(self.inner, "refused_connections", 0))

    @property
    def accept_failures(self) -> int:
        """The inner transport's count of accepts that failed for want of descriptors or memory."""
        return int(getattr(self.inner, "accept_failures", 0))

    @property
    def revoke_method(self) -> str:
        """The inner transport's (a revoke goes to it first)."""
        return str(getattr(self.inner, "revoke_method", "unknown"))

    @property
    def windows_live(self) -> int:
        """The inner transport's memory windows bound now (0 without them)."""
        return int(getattr(self.inner, "windows_live", 0))

    def grant(self, source: bytes, ranges: Any) -> Grant:
        return self.inner.grant(source, ranges)

    def regions(self) -> tuple[Region, ...]:
        return self.inner.regions()

    def endpoint(self) -> bytes:
        return self.inner.endpoint()

    def connect(self, peer_endpoint: bytes, *, deadline: Deadline) -> PeerHandle:
        return self.inner.connect(peer_endpoint, deadline=deadline)

    def refresh(self, peer: PeerHandle, peer_endpoint: bytes) -> None:
        self.inner.refresh(peer, peer_endpoint)
