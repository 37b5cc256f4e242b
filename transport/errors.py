"""The data plane's exceptions: owned here, so ``transport`` imports nothing from ``pdcore``.

``TransportBaseError`` is the base of every error a transport raises on
purpose. ``pdcore`` sits above this package and re-exports these classes
instead of defining its own: ``pdcore.core.errors.PdError`` *is*
``TransportBaseError`` (one class, two names), and ``pdcore.core.errors.StartError``,
``CapacityError`` and ``TransportError`` *are* the classes below. So
``except pdcore.PdError`` catches every transport error, and
``except pdcore.TransportError`` catches exactly what a transport raises as
``transport.errors.TransportError``.
"""

from __future__ import annotations

__all__ = ["TransportBaseError", "StartError", "CapacityError", "TransportError"]


class TransportBaseError(Exception):
    """Base of every error the data plane (and ``pdcore``, as ``pdcore.PdError``) raises on purpose."""


class StartError(TransportBaseError):
    """A peer, transport or server could not start; the message says what to fix."""


class CapacityError(TransportBaseError):
    """A bounded table or queue is full."""


class TransportError(TransportBaseError):
    """A data-plane operation failed; ``op`` names it and ``errno`` is kept when known."""

    def __init__(self, message: str, *, op: str = "", errno: int | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.errno = errno
