"""What the control channel's senders may hold: the per-sender and total byte quotas on delivered
frames, and the ``release()`` token of a frame a consumer holds past ``on_message``.

Quota: the wire bytes of every frame handed to ``on_message`` count against
its sender until they are released; a sender whose next frame would take it
past ``max_bytes_per_sender`` has that frame dropped (``stats.quota_drops``, a
warning per episode) and its rooms failed through ``on_rooms_failed`` with a
reason that says "quota". A sender is a routing id, which a client without the
secret picks freely, so all senders together have a bound too,
``max_bytes_total`` (default four times ``max_bytes_per_sender``): a frame that
would take the total past it is dropped the same way, whoever sent it
(``stats.total_quota_drops`` as well; the reason says "total quota"). By
default a frame is released when ``on_message`` returns. A consumer that keeps
the message past the callback (queues it for a worker) calls ``release =
channel.hold()`` inside the callback and ``release()`` once it is done with it
(any thread, idempotent), so what it holds counts too. ZeroMQ's own receive
queue per connection is bounded in frames (``RCVHWM``, derived from the
quota), so it holds at most about one quota more per connection; without a
secret nothing bounds how many connections send frames, so nor what ZeroMQ
queues for them all.

Why its own room: the counts are the one state of the channel that other threads touch (a
consumer's ``release()``, ``held_bytes()``), so they sit behind one lock here, apart from what only
the I/O thread owns.
"""

from __future__ import annotations

import logging
import threading

from . import wire
from .channel_stats import ChannelStats

__all__ = ["Quotas", "Release"]

log = logging.getLogger("pdcore.control")


class Release:
    """``release()`` for one held frame: idempotent, callable from any thread."""

    __slots__ = ("_quotas", "sender", "nbytes", "kept", "released")

    def __init__(self, quotas: Quotas, sender: str, nbytes: int) -> None:
        self._quotas, self.sender, self.nbytes = quotas, sender, nbytes
        self.kept = self.released = False  # kept: not released when on_message returns (hold())

    def __call__(self) -> None:
        self._quotas.release(self)


class Quotas:
    """The wire bytes each sender, and all senders together, have handed to ``on_message`` and not
    released; the episodes of drops over a quota (a warning each, not one per frame)."""

    def __init__(self, per_sender: int, total: int, stats: ChannelStats) -> None:
        self.per_sender = per_sender
        self.total = total
        self._stats = stats
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # sender -> wire bytes handed to on_message and not released
        self._held_total = 0  # ... all senders together
        self._over: dict[str, int] = {}  # sender -> frames dropped in its current over-quota episode
        self._over_total = 0  # frames dropped in the current episode of the total quota

    def held(self, sender: str | None = None) -> int:
        """Wire bytes counted against ``sender`` now (all senders together if None)."""
        with self._lock:
            return self._held.get(sender, 0) if sender is not None else self._held_total

    def charge(self, sender: str, nbytes: int) -> bool | None:
        """Count ``nbytes`` against ``sender`` and the total: None if both had room, else whether it
        was the total (all senders together) that had none (then nothing is counted)."""
        stats = self._stats
        with self._lock:
            held = self._held.get(sender, 0) + nbytes
            if held > self.per_sender:
                return False
            if self._held_total + nbytes > self.total:
                return True
            self._held[sender] = held
            total = self._held_total = self._held_total + nbytes
            if held > stats.held_peak:  # (every frame passes here: no max() calls, no pops of empty dicts)
                stats.held_peak = held
            if total > stats.held_total_peak:
                stats.held_total_peak = total
            dropped = self._over.pop(sender, 0) if self._over else 0
            dropped_total, self._over_total = self._over_total, 0
        if dropped:
            log.info("control channel: sender %s is back under its quota after %d dropped frames", sender, dropped)
        if dropped_total:
            log.info("control channel: back under the total quota after %d dropped frames", dropped_total)
        return None

    def release(self, token: Release) -> None:
        with self._lock:
            if token.released:
                return
            token.released = True
            self._held_total -= token.nbytes
            left = self._held.get(token.sender, 0) - token.nbytes
            if left > 0:
                self._held[token.sender] = left
            else:
                self._held.pop(token.sender, None)
                self._over.pop(token.sender, None)

    def dropped(self, sender: str, nbytes: int, msg: wire.Message, *, total: bool) -> str:
        """A frame of ``sender`` dropped over a quota (the total one if ``total``): counted, warned
        about once per episode; returns the reason its rooms fail with."""
        stats = self._stats
        stats.quota_drops += 1
        stats.quota_dropped_bytes += nbytes
        if total:
            stats.total_quota_drops += 1
            reason = (
                f"control channel: all senders together are at the total quota of {self.total} bytes held, "
                f"the {type(msg).__name__} frame of {nbytes} bytes from {sender} was dropped"
            )
        else:
            reason = (
                f"control channel: sender {sender} is over its quota of {self.per_sender} bytes held, "
                f"its {type(msg).__name__} frame of {nbytes} bytes was dropped"
            )
        with self._lock:
            if total:
                episode, self._over_total = self._over_total, self._over_total + 1
            else:
                episode = self._over.get(sender, 0)
                self._over[sender] = episode + 1
        if not episode:  # once per episode: a flood must not flood the log too
            log.warning("%s (further drops counted in stats.quota_drops)", reason)
        return reason
