"""The library's exceptions: one module, imported by both twins.

``ProtocolError`` is abstract (h11's split): code that checks a call made by
this process raises ``LocalProtocolError``; the one door that decodes a
peer's bytes relabels it ``RemoteProtocolError``. Each carries ``rooms``: the
rooms the error concerns, which the caller fails and nothing more.
"""

from __future__ import annotations

__all__ = [
    "PdError",
    "CollectiveError",
    "PeerError",
    "StartError",
    "CapacityError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "TransportError",
]


class PdError(Exception):
    """Base of every error this library raises on purpose."""


class CollectiveError(PdError):
    """The replica could not agree (mismatched request sets, a failed collective)."""


class PeerError(PdError):
    """The transfer peer broke: it cannot serve past this."""


class StartError(PdError):
    """A peer, transport or server could not start; the message says what to fix."""


class CapacityError(PdError):
    """A bounded table or queue is full."""


class TransportError(PdError):
    """A data-plane operation failed; ``op`` names it and ``errno`` is kept when known."""

    def __init__(self, message: str, *, op: str = "", errno: int | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.errno = errno


class ProtocolError(PdError):
    """Bad input. Abstract: raise ``LocalProtocolError`` or ``RemoteProtocolError``."""

    def __init__(self, message: str, *, rooms: tuple[int, ...] = ()) -> None:
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise LocalProtocolError or RemoteProtocolError")
        super().__init__(message)
        self.rooms = tuple(rooms)


class LocalProtocolError(ProtocolError):
    """This process asked for something the rules forbid (unknown rid, bad trigger, ...)."""


class RemoteProtocolError(ProtocolError):
    """A peer sent something malformed; only ``rooms`` are affected."""
