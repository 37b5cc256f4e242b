"""The descriptors the control channels keep for their own sockets and connects, so that a flood of
connections cannot starve a proven peer's answers.

Answers through a flood (issue #42): a channel answers a peer on a connection
of its own, a DEALER to the peer's endpoint, and making it takes descriptors:
three for its sockets (made in this thread) and one for its TCP connection
(opened by libzmq's I/O thread when it takes the connect). At the limit, that
thread accepts the flood into every descriptor the moment one is freed, so a
flood faster than this thread kept a proven peer's answers waiting for a
descriptor until they failed. So the process keeps ``FD_RESERVE`` (64)
descriptors under its hard limit that only a channel's own sockets and
connects use (``FdReserve``): ``start`` sets the soft limit of open files to
the hard limit less the reserve (once per process, logged; from a lower soft
limit that is a raise: headroom, not a bound), and a channel raises it to the
hard limit just for the moment of its connect (a ``Windows`` entry), until the
DEALER's monitor reports the connection's socket open or its try failed. libzmq
takes the connect within a pass or two of its I/O thread and accepts at most one
connection a pass, so the reserve outlasts it; what the flood took of it
meanwhile is cut as idle (``stats.reserve_cuts``), and nothing takes it back
while it is closed. ``SPARES`` (2) DEALERs are made ahead (``Spares``), so that a
connect costs one call while the reserve is open. A new DEALER whose connect
still found no descriptor is closed and made again on the channel's next pass
(on its clock, not libzmq's 100 to 200 ms retries; ``stats.connects_remade``),
its frames held meanwhile (up to the channel's ``_CONNECT_WAIT``), so none is
lost; a connection that libzmq reopens later (the peer restarted) gets the
reserve just before each retry while the peer is heard from. The channel's own
connections are never accepted by its ROUTER, so never pending, never cut. Not
covered: a newcomer's connect to a flooded channel may wait out a SYN
retransmission (1 s, then 3 s) when the flood keeps the listen backlog full;
other parts of the process may take some of the reserve while it is open.
"""

from __future__ import annotations

import errno
import logging
import resource
import threading
import time
from collections.abc import Callable
from typing import Final

import zmq

from .pending import PendingConnections

__all__ = ["FD_RESERVE", "SPARES", "FdReserve", "Spares", "Windows", "fd_reserve"]

log = logging.getLogger("pdcore.control")

FD_RESERVE: Final = 64  # descriptors kept under the hard limit, for the channels' own sockets and connections
SPARES: Final = 2  # DEALERs made ahead (three descriptors each): a connect then costs one call in the window
_WINDOW: Final = 0.2  # seconds the reserve stays open for one connect at most (it closes when the connect reports)
_SPARE_RETRY: Final = 0.01  # seconds between two tries to make a spare that found no descriptor

Dealer = tuple[zmq.Socket[bytes], zmq.Socket[bytes]]  # a DEALER not connected yet, and its monitor


class FdReserve:
    """The process's soft limit of open files, kept ``FD_RESERVE`` under its hard limit and raised to it
    only while a channel makes a socket or connects: the kernel keeps the descriptors over the soft
    limit from every thread, libzmq's accepts included, so the reserve is not a race to win. One per
    process (``fd_reserve``), shared by its channels (it counts who opened it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checked = False
        self.low = 0  # the soft limit while the reserve is closed; 0: no reserve (an infinite or a tiny limit)
        self._high = 0
        self._open = 0

    def setup(self) -> None:
        """Once per process: the soft limit to ``FD_RESERVE`` under the hard limit (a raise from
        a lower one: headroom, not a bound), logged."""
        with self._lock:
            if self._checked:
                return
            self._checked = True
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if hard == resource.RLIM_INFINITY or hard < 4 * FD_RESERVE:
                self._raise(soft, hard)
                return
            low = hard - FD_RESERVE
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
            except (OSError, ValueError) as e:
                log.info("control channel: cannot set the soft limit of open files from %d to %d: %s", soft, low, e)
                return
            self.low, self._high = low, hard
        log.info(
            "control channel: this process's soft limit of open files is %d (was %d): its hard limit %d less "
            "%d kept for the control channels' own connections", low, soft, hard, FD_RESERVE,
        )

    @staticmethod
    def _raise(soft: int, hard: int) -> None:
        if soft == resource.RLIM_INFINITY or soft >= hard:
            return
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as e:
            log.info("control channel: cannot raise the soft limit of open files from %d to %d: %s", soft, hard, e)
            return
        log.info("control channel: raised this process's soft limit of open files from %d to its hard limit %d", soft, hard)

    def open(self) -> bool:
        """Open the reserve (True), or say there is none (False)."""
        with self._lock:
            if not self.low:
                return False
            self._open += 1
            if self._open == 1:
                self._set(self._high)
            return True

    def close(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._set(self.low)

    @staticmethod
    def _set(soft: int) -> None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        except (OSError, ValueError) as e:  # the hard limit was lowered under us: the reserve is gone
            log.warning("control channel: cannot set the soft limit of open files to %d: %s", soft, e)


fd_reserve = FdReserve()


class Windows:
    """One channel's openings of the reserve, by endpoint ("" while it makes a socket): each until its
    connect reports, ``_WINDOW`` at most. Once one closed, the flood may hold descriptors of the
    reserve (``taken``): the pending connections on them whose client sent nothing are cut before
    the next opening, or on the channel's next pass (``give_back``)."""

    def __init__(self, pending: PendingConnections) -> None:
        self._until: dict[str, float] = {}  # endpoint -> until when the reserve is open for its connect
        self._pending = pending
        self.taken = False  # the flood may hold descriptors of the reserve: cut them (refill)

    def busy(self) -> bool:
        """A window is open, or what the flood took of the reserve is still to be cut."""
        return bool(self._until) or self.taken

    def open(self, endpoint: str) -> None:
        if self.taken and not self._until:
            self.refill()  # what the flood holds of it first: cut now, closed by libzmq before the connect
        if endpoint not in self._until and fd_reserve.open():
            self._until[endpoint] = time.monotonic() + _WINDOW

    def close(self, endpoint: str) -> None:
        if self._until.pop(endpoint, None) is not None:
            fd_reserve.close()
            self.taken = True

    def close_all(self) -> None:
        for endpoint in list(self._until):
            self.close(endpoint)

    def expire(self, now: float) -> None:
        """Close the windows whose connect never reported (bounded)."""
        for endpoint, until in list(self._until.items()):
            if now >= until:
                self.close(endpoint)

    def give_back(self) -> None:
        """With no window open: cut what the flood took of the reserve, and look again next pass if
        connections accepted meanwhile are not read yet."""
        if self.taken and not self._until:
            self.refill()
            if not self._pending.settled():  # accepted in the window, perhaps, and not read yet
                self.taken = True

    def refill(self) -> None:
        """Cut the pending connections on descriptors of the reserve whose client sent nothing: the flood's,
        accepted while the reserve was open. Done when none is left that the monitor was read past."""
        low = fd_reserve.low
        self.taken = self._pending.cut_silent_from(low) if low else False


class Spares:
    """DEALERs made ahead with the reserve open (``make`` makes one: three descriptors), so that a
    connect costs one call while it is open; one taken is made again on the channel's next pass, and
    a try that finds no descriptor ``_SPARE_RETRY`` later."""

    def __init__(self, make: Callable[[], Dealer], windows: Windows) -> None:
        self._make = make
        self._windows = windows
        self._ready: list[Dealer] = []
        self._retry_at = 0.0  # when the next try to make a spare may be
        self.label: str | None = None  # the channel's endpoint, for the log

    def wanted(self) -> bool:
        return len(self._ready) < SPARES

    def due(self) -> bool:
        return len(self._ready) < SPARES and time.monotonic() >= self._retry_at

    def fill(self) -> None:
        """Make the spare DEALERs that were taken, with the fd reserve open."""
        while len(self._ready) < SPARES:
            self._windows.open("")
            try:
                self._ready.append(self._make())
            except zmq.ZMQError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE):
                    log.warning("control channel %s: cannot make a spare socket: %s", self.label, e)
                self._retry_at = time.monotonic() + _SPARE_RETRY
                return
            finally:
                self._windows.close("")

    def take(self) -> Dealer:
        """A spare, else one made now with the reserve open; raises ``zmq.ZMQError`` (EMFILE: none)."""
        if self._ready:
            return self._ready.pop()
        self._windows.open("")
        try:
            return self._make()
        finally:
            self._windows.close("")

    def close_all(self) -> None:
        for sock, mon in self._ready:
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)
        self._ready.clear()
