"""Accepting connections when the process has no descriptor or memory to spare: back off, never spin."""

from __future__ import annotations

import errno as errno_mod
import logging
import socket
import struct

from .loglimit import LogLimit


#: ``accept()`` errors that mean "no descriptor or memory now", not "this connection failed": the
#: connection stays queued and the listener readable, so an acceptor that retries at once spins.
OUT_OF_RESOURCES = frozenset({errno_mod.EMFILE, errno_mod.ENFILE, errno_mod.ENOBUFS, errno_mod.ENOMEM})


_TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received (u64) in Linux's struct tcp_info (4.1 and later)


def client_spoke(sock: socket.socket) -> bool:
    """Whether the client sent this server-side TCP socket any byte yet (True where the kernel cannot
    tell). A flood of idle connections never speaks; a real client sends its hello as soon as its
    connect returns, so a cap on handshakes cuts silent connections first."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BYTES_RECEIVED + 8)
    except (OSError, AttributeError):
        return True
    return len(info) < _TCPI_BYTES_RECEIVED + 8 or struct.unpack_from("=Q", info, _TCPI_BYTES_RECEIVED)[0] > 0


class AcceptBackoff:
    """How long an acceptor waits after ``accept()`` failed for want of descriptors or memory:
    ``first`` seconds, doubling up to ``most``, back to ``first`` once an accept succeeds; a warning
    at most every ``every`` seconds. Its caller waits on something a freed descriptor sets, so it
    tries again early when it can; the bound is for what it cannot see (another part of the process
    closing files). Used by one acceptor thread."""

    def __init__(
        self, what: str, logger: logging.Logger, *, first: float = 0.01, most: float = 1.0, every: float = 10.0
    ) -> None:
        self._what, self._log = what, logger
        self._first, self._most = first, most
        self._delay = first
        self._limit = LogLimit(every)
        self.count = 0  # accepts that failed for want of descriptors or memory

    def failed(self, error: OSError) -> float | None:
        """The wait before the next ``accept()``, or None if ``error`` is not a shortage (the
        connection was gone: try the next one at once)."""
        if error.errno not in OUT_OF_RESOURCES:
            return None
        self.count += 1
        delay, self._delay = self._delay, min(2 * self._delay, self._most)
        held = self._limit.ready()
        if held is not None:
            self._log.warning(
                "%s: cannot accept a connection: %s (%d times since the last warning); "
                "waiting up to %g s before each further try", self._what, error, held + 1, self._most,
            )
        return delay

    def succeeded(self) -> None:
        self._delay = self._first
