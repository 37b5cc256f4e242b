"""The control channel's counters (``ControlChannel.stats``), in a room of their own because every
room of the channel writes some (``pdcore.control.quotas``, ``pdcore.control.pending``) and the
tests and the metrics read them all.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChannelStats"]


@dataclass
class ChannelStats:
    """Counters, written only by the I/O thread (read them from anywhere)."""

    received: int = 0
    delivered: int = 0
    sent: int = 0  # frames
    messages_sent: int = 0  # ZeroMQ messages they went in (the frames one peer is owed in a pass go in one)
    protocol_errors: int = 0
    send_failures: int = 0
    callback_errors: int = 0
    internal_errors: int = 0
    heartbeats_sent: int = 0
    peers_dead: int = 0
    auth_failures: int = 0  # handshakes that failed authentication, in either direction
    auth_refused: int = 0  # of those: clients our authentication handler refused
    superseded_frames: int = 0  # frames that arrived on a connection a newer one of the same peer replaced
    quota_drops: int = 0  # frames dropped because their sender, or all senders together, were over a byte quota
    quota_dropped_bytes: int = 0
    total_quota_drops: int = 0  # of those: dropped because all senders together were at max_bytes_total
    held_peak: int = 0  # the most wire bytes one sender ever had counted at once
    held_total_peak: int = 0  # the most wire bytes all senders together ever had counted at once
    accepted: int = 0  # connections the ROUTER accepted
    pending_peak: int = 0  # the most accepted connections at once that no frame had come on yet
    proven: int = 0  # accepted connections that a frame then came on (no longer pending)
    pending_evicted: int = 0  # of those: cut to keep at most max_pending (the oldest idle one first)
    reserve_cuts: int = 0  # pending connections whose client sent nothing, cut to give the fd reserve back
    handshake_timeouts: int = 0  # tcp plane: handshakes cut at handshake_timeout
    frames_refused: int = 0  # tcp plane: sealed frames refused (a wrong tag, seq or length), each ending its connection
    frames_truncated: int = 0  # tcp plane: connections that ended mid-frame
    connect_retries: int = 0  # connects to peers libzmq tries again (refused, or no descriptor was free)
    connects_remade: int = 0  # of those: a new DEALER's first, made again by the channel (see _dealer_handshakes)
