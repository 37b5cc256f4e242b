"""What a transport wrapping another (``faulty:<inner>``, ``staged:<inner>``) reads through from it.

A wrapper changes how batches (or memory) travel, not who it is: its instance id,
its counters of refused handshakes and connections, its revoke method, its
grants, regions, endpoint and connections, and whether and to whom it carries
notes, are the inner transport's, passed through here so the two wrappers say
them once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from .base import Grant, NoteHandler, PeerHandle, Region, Transport, check_note
from .deadline import Deadline

__all__ = ["SpoiledGrants", "Wrapping"]


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

    @property
    def carries_notes(self) -> bool:
        """The inner transport's: a note rides the batch the wrapper hands it."""
        return self.inner.carries_notes

    def on_note(self, handler: NoteHandler | None) -> None:
        """The inner transport's sink hands the notes (a staged sink's owner still calls ``land``)."""
        self.inner.on_note(handler)

    def _check_note(self, note: Any, writes: int, grant: int) -> None:
        """``write``'s check of a note against the inner transport (``base.check_note``), before the
        wrapper does anything with the batch: it may never reach the inner transport's own check."""
        check_note(note, writes, grant, self.inner.carries_notes, self.inner.name)

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


class SpoiledGrants:
    """The grants (each under a key that also names its peer, where the record spans peers) a batch
    failed through short of the sink: no later batch through one carries its note, since the sink
    would take that note as the word that every byte written through the grant landed. Bounded:
    past ``limit`` the oldest is forgotten (a grant that old is revoked, or its room ended). Callers
    hold their own lock."""

    __slots__ = ("_keys", "_limit")

    def __init__(self, limit: int) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self._limit = limit

    def spoil(self, key: Hashable) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys
