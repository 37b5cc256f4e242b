"""The control channel's ROUTER connections that no frame came on yet, and how they are cut.

Pending connections: a connection the ROUTER accepted is pending until a frame
comes on it; every channel sends a heartbeat on each connection as soon as its
DEALER's handshake succeeds, so a peer's connection stops being pending at once.
libzmq accepts whatever comes and gives a handshake ``handshake_timeout`` (5 s
here, its own default is 30 s), so before this bound a flood of idle TCP
connections used up the process's file descriptors. At most ``max_pending``
(64) connections stay pending: past that the channel cuts the oldest pending
one whose client has sent no byte yet (the kernel's ``tcp_info`` says), or the
oldest of all when each has sent something (``stats.pending_evicted``). Silent
ones go first because a flood that redials what it loses turns connections
over some twenty thousand times a second, faster than a handshake completes:
cut by age alone, a peer's handshake would be cut too. How it knows: the
ROUTER's monitor reports each accepted connection with libzmq's fd for it
(ACCEPTED) and its end (DISCONNECTED, sent before libzmq closes the fd), and a
received frame names the fd it came on (``ZMQ_SRCFD``). A fd number can be
reused, so each accepted one is recorded with its socket's inode, a record is
acted on only after the monitor was read past it (a fd reused before it was
recorded has its DISCONNECTED there), and a cut goes through a duplicate on a
descriptor number the channel reserved, whose inode and local port are checked
first: the channel never cuts a socket that is not the connection the event
named. (libzmq's ROUTER_NOTIFY and version-2 monitor events would name the peer;
they are draft API, not in the libzmq that pyzmq bundles.) This relies on one
libzmq I/O thread per context (the default): a connection's events arrive in
order, a failed handshake's right before its DISCONNECTED, so a connection the
channel cut is not counted as a failed authentication. Not covered: a flood
whose connections each send part of a handshake and stall is cut by age only;
libzmq may accept a burst between two passes of the I/O thread (the next pass
cuts it); an accept that fails for want of descriptors libzmq retries at once.

Why its own room: this is bookkeeping about libzmq's descriptors, kept beside the ROUTER but not
of it: the channel's loop asks it only whether there are too many (``crowded``), tells it what the
ROUTER's monitor and frames say, and lets it cut.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Callable, Mapping
from typing import Final

import zmq
from zmq.utils import monitor

from transport.accepting import client_spoke
from transport.loglimit import LogLimit

from .channel_stats import ChannelStats

__all__ = ["MAX_PENDING", "PendingConnections"]

log = logging.getLogger("pdcore.control")

MAX_PENDING: Final = 64  # default max_pending: connections accepted that no frame came on yet
_EVENT_BATCH: Final = 1024  # monitor events handled per wake (four of the channel's receive batches)
_EVICT_LOG_EVERY: Final = 10.0  # seconds between two warnings about cut connections


class _Pending:
    """A connection the ROUTER accepted that no frame came on yet: its socket's inode, when it was
    recorded (a sequence number), and whether its client has sent a byte (it cannot unsay it)."""

    __slots__ = ("inode", "seq", "spoke")

    def __init__(self, inode: int, seq: int) -> None:
        self.inode = inode
        self.seq = seq
        self.spoke = False


def _shut(sock: socket.socket) -> bool:
    sock.shutdown(socket.SHUT_RDWR)
    return True


def _silent(sock: socket.socket) -> bool:
    """Whether the connection's client sent no byte yet."""
    return not client_spoke(sock)


def _shut_if_silent(sock: socket.socket) -> bool:
    """Shut the connection down if its client sent no byte (True), else leave it (False)."""
    return not client_spoke(sock) and _shut(sock)


class PendingConnections:
    """The ROUTER's connections, keyed by libzmq's fd for each (only the I/O thread touches them): the
    pending ones oldest first, the proven ones, those cut and not yet reported gone; the ROUTER's
    monitor (``monitor``, set by the channel) that tells of them; and the two descriptors a cut
    goes through (``open_slots``)."""

    def __init__(
        self, max_pending: int, stats: ChannelStats, on_handshake_failed: Callable[[Mapping[str, object]], None],
    ) -> None:
        self.max_pending = max_pending
        self._stats = stats
        self._on_handshake_failed = on_handshake_failed
        self.monitor: zmq.Socket[bytes] | None = None
        self.label: str | None = None  # the channel's endpoint, for the log
        self.port = 0  # the ROUTER's: a socket cut must be a connection accepted on it
        self.pending: dict[int, _Pending] = {}  # fd -> accepted, no frame from it yet; oldest first
        self._proven: set[int] = set()  # fds of accepted connections a frame came on
        self._cut_fds: set[int] = set()  # fds this channel cut, until libzmq reports them gone
        self._failed_handshake: Mapping[str, object] | None = None  # a failure event, until its DISCONNECTED
        self._recorded = 0  # sequence number of the last pending connection recorded
        self._checked = 0  # ... of the last one the monitor was read to its end after: one that may be cut
        self.seen = 0  # len(pending) after the last pass that read the monitor to its end
        self._null_fd = self._slot_fd = -1  # /dev/null, and a descriptor number reserved for a cut
        self._evict_logged = LogLimit(_EVICT_LOG_EVERY)

    def open_slots(self) -> None:
        """Open /dev/null and reserve a descriptor number on it for cuts; raises ``OSError``."""
        self._null_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._slot_fd = os.dup(self._null_fd)

    def close_slots(self) -> None:
        for fd in (self._slot_fd, self._null_fd):
            if fd >= 0:
                os.close(fd)
        self._slot_fd = self._null_fd = -1

    def crowded(self) -> bool:
        """More connections pending than ``max_pending``: ``evict`` is due."""
        return len(self.pending) > self.max_pending

    def settled(self) -> bool:
        """Every pending connection recorded was recorded before the monitor was last read to its end."""
        return self._checked == self._recorded

    def note_pass(self) -> None:
        """End of a pass: what ``seen`` says, if the monitor was read to its end."""
        if self._checked == self._recorded:
            self.seen = len(self.pending)

    def read_events(self) -> None:
        """What the ROUTER's monitor reported, in order, to its end (or one batch of it)."""
        assert self.monitor is not None
        for _ in range(_EVENT_BATCH):
            try:
                event = monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                self._checked = self._recorded
                return
            kind, value = event["event"], event["value"]
            assert isinstance(value, int)
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                failure, self._failed_handshake = self._failed_handshake, None
                cut = value in self._cut_fds
                self._cut_fds.discard(value)
                self.pending.pop(value, None)
                self._proven.discard(value)
                if failure is not None and not cut:  # one we cut did not fail: it never tried
                    self._on_handshake_failed(failure)
            else:  # a failed handshake: its DISCONNECTED follows at once (one I/O thread) and names its fd
                if self._failed_handshake is not None:
                    self._on_handshake_failed(self._failed_handshake)
                self._failed_handshake = event

    def _accepted(self, fd: int) -> None:
        """A new connection at ``fd``: pending, under the inode of the socket there now. Were that
        another socket already (libzmq closed ``fd`` and it was reused), the DISCONNECTED that
        libzmq sent before closing it is in the monitor pipe, and reading on to its end drops the
        entry before any cut (``evict`` cuts only what was recorded before such a read)."""
        self._stats.accepted += 1
        self._proven.discard(fd)
        try:
            st = os.fstat(fd)
        except OSError:
            return  # closed already: its DISCONNECTED follows
        if stat.S_ISSOCK(st.st_mode):
            self._recorded += 1
            self.pending[fd] = _Pending(st.st_ino, self._recorded)
            self._stats.pending_peak = max(self._stats.pending_peak, len(self.pending))

    def heard_on(self, frame: zmq.Frame) -> None:
        """A frame came on the connection at its source fd: that connection is no longer pending."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        if fd in self._proven:
            return
        if fd not in self.pending:
            self.read_events()  # its ACCEPTED may still be unread
        if self.pending.pop(fd, None) is not None:
            self._stats.proven += 1
        self._proven.add(fd)

    def evict(self) -> None:
        """Cut pending connections until at most ``max_pending`` are left: the oldest one whose client
        has sent nothing yet, or, when every one has sent something, the oldest. Only connections
        the monitor was read to its end after (see ``_accepted``); the rest on a later pass."""
        cut = 0
        while len(self.pending) > self.max_pending:
            victim = self._oldest_silent()
            if len(self.pending) <= self.max_pending:
                break
            if victim is None:
                victim = next(iter(self.pending))
                if self.pending[victim].seq > self._checked:
                    break  # nothing that may be cut yet
            if self.cut(victim, self.pending.pop(victim).inode):
                self._cut_fds.add(victim)
                cut += 1
        self._stats.pending_evicted += cut
        if cut and self._evict_logged.ready() is not None:  # a flood must not flood the log
            log.warning(
                "control channel %s: more than %d connections that sent no frame yet: the oldest idle ones "
                "are cut (%d so far, stats.pending_evicted; %d accepted)",
                self.label, self.max_pending, self._stats.pending_evicted, self._stats.accepted,
            )

    def _oldest_silent(self) -> int | None:
        """The fd of the oldest pending connection that may be cut and whose client sent nothing; on the
        way, those found gone are dropped and those found to have spoken marked."""
        for fd, conn in list(self.pending.items()):  # oldest first
            if conn.seq > self._checked:
                break
            if conn.spoke:
                continue
            if self._found_silent(fd, conn, _silent):
                return fd
        return None

    def cut_silent_from(self, low: int) -> bool:
        """Cut the pending connections on descriptors from ``low`` on whose client sent nothing: the
        flood's, accepted while the fd reserve was open. Whether any is left that the monitor was
        not read past yet (to cut on a later pass)."""
        left = False
        cut = 0
        for fd, conn in list(self.pending.items()):
            if fd < low:
                continue
            if conn.seq > self._checked:
                left = True
                continue
            if conn.spoke:
                continue
            if self._found_silent(fd, conn, _shut_if_silent):
                del self.pending[fd]
                self._cut_fds.add(fd)
                cut += 1
        self._stats.reserve_cuts += cut
        return left

    def _found_silent(self, fd: int, conn: _Pending, probe: Callable[[socket.socket], bool]) -> bool:
        """Whether ``probe`` (through ``_through``) finds the client of the pending connection on ``fd``
        silent; one found gone is dropped, one found to have spoken marked (both are not silent)."""
        silent = self._through(fd, conn.inode, probe)
        if silent is None:  # not the socket it was: that connection is gone
            del self.pending[fd]
        elif not silent:
            conn.spoke = True
        return bool(silent)

    def short(self) -> bool:
        """Whether no file descriptor under the soft limit is free now."""
        try:
            os.close(os.dup(self._null_fd))
        except OSError:
            return True
        return False

    def cut(self, fd: int, inode: int) -> bool:
        """Shut the connection at libzmq's ``fd`` down if it is still the socket ``inode`` names (see
        ``_through``); True if it was. libzmq then reads the end of the stream and closes ``fd``."""
        return self._through(fd, inode, _shut) is True

    def _through(self, fd: int, inode: int, action: Callable[[socket.socket], bool]) -> bool | None:
        """``action`` on the socket at libzmq's ``fd`` if it is still the one ``inode`` names, a
        connection accepted on our port; None if it is not. It runs on a duplicate made on a
        descriptor number this channel reserved (``dup2`` needs no free one), so what is checked is
        what is acted on, whatever happens to ``fd`` meanwhile; the duplicate is let go at once."""
        try:
            os.dup2(fd, self._slot_fd, inheritable=False)
        except OSError:
            return None  # closed already
        try:
            st = os.fstat(self._slot_fd)
            if not stat.S_ISSOCK(st.st_mode) or st.st_ino != inode:
                return None
            sock = socket.socket(fileno=self._slot_fd)
            try:
                name = sock.getsockname()
                if not isinstance(name, tuple) or name[1] != self.port:
                    return None
                sock.getpeername()  # raises for a listening socket
                return action(sock)
            finally:
                sock.detach()
        except OSError:
            return None
        finally:
            os.dup2(self._null_fd, self._slot_fd, inheritable=False)
