"""The library's exceptions: one module, imported by both twins.

``ProtocolError`` is abstract (h11's split): code that checks a call made by
this process raises ``LocalProtocolError``; the one door that decodes a
peer's bytes relabels it ``RemoteProtocolError``. Each carries ``rooms``: the
rooms the error concerns, which the caller fails and nothing more.

The base and the data plane's errors are defined in ``transport.errors`` (the
bottom layer, which imports nothing from pdcore) and re-exported here as the
same classes: ``PdError is transport.errors.TransportBaseError``, and
``StartError``, ``CapacityError``, ``TransportError`` are transport's own. So
``except PdError`` catches every error of the library and of its data plane.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transport.errors import CapacityError, StartError, TransportError
from transport.errors import TransportBaseError as PdError

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
    "FrameError",
    "refusal",
]


class CollectiveError(PdError):
    """The replica could not agree (mismatched request sets, a failed collective, a rank gone)."""


class PeerError(PdError):
    """The transfer peer broke: it cannot serve past this."""


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


def refusal(submit: Callable[..., object], fn: Callable[..., object], *args: Any) -> PdError | None:
    """Hand ``fn(*args)`` to ``submit`` (a driver's inbox): None once it took it, else the error it was
    refused with (its inbox full: the caller fails the request or room and goes on). A ``PeerError``
    (the peer closed) is raised: nothing can take a call after it."""
    try:
        submit(fn, *args)
    except PeerError:
        raise
    except PdError as e:
        return e
    return None


class FrameError(Exception):
    """A sealed frame of the ``"tcp"`` control plane refused (``pdcore.control.tcp_frames``): ``kind`` is
    ``"tag"`` (forged or corrupted), ``"seq"`` (replayed, reordered or one missing) or ``"length"``; the
    connection it came on must end. Returned by an opener, never raised."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
