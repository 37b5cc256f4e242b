"""Who is alive, sans-IO: the control channel's liveness rule (``now`` is an argument).

A peer is tracked from the first time we talk to it or hear from it; any valid
frame refreshes it; ``Heartbeat``/``Register`` tell its session and epoch. A
peer silent for ``dead_after``, or back with a newer epoch, is reported dead
once per incarnation. The control channel (``pdcore.control.channel``) applies
it on its I/O thread; the simulator (``pdcore.sim``) applies the same rule to
simulated heartbeats.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DeadPeer", "PeerLiveness"]


class DeadPeer(NamedTuple):
    """A peer incarnation that is gone: ``session_id`` is None if it never introduced itself."""

    endpoint: str
    session_id: str | None
    epoch: int | None
    reason: str


class PeerLiveness:
    """Sans-IO liveness rule, keyed by the peer's control endpoint; ``now`` is an argument.

    A peer is tracked from the first time we talk to it or hear from it; any
    valid frame from it refreshes it; ``Heartbeat``/``Register`` tell its
    session and epoch. Each incarnation is reported dead at most once.
    """

    def __init__(self, dead_after: float) -> None:
        if not dead_after > 0:
            raise ValueError(f"dead_after must be positive, got {dead_after!r}")
        self.dead_after = dead_after
        self._peers: dict[str, list[object]] = {}  # endpoint -> [session_id, epoch, last_heard]
        self._where: dict[str, str] = {}  # session_id -> endpoint

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._peers

    def track(self, endpoint: str, now: float) -> None:
        """Start the clock for a peer we talk to (no-op if already tracked)."""
        self._peers.setdefault(endpoint, [None, None, now])

    def heard(self, endpoint: str, now: float) -> None:
        entry = self._peers.setdefault(endpoint, [None, None, now])
        entry[2] = now

    def introduced(self, endpoint: str, session_id: str, epoch: int, now: float) -> list[DeadPeer]:
        """A frame naming its session and epoch; returns incarnations it replaces."""
        dead: list[DeadPeer] = []
        entry = self._peers.get(endpoint)
        if entry is not None and entry[0] is not None:
            old_session, old_epoch = entry[0], entry[1]
            assert isinstance(old_session, str) and isinstance(old_epoch, int)
            if old_session == session_id and epoch < old_epoch:
                return dead  # a late frame of an older incarnation proves nothing
            if old_session != session_id:
                dead.append(DeadPeer(endpoint, old_session, old_epoch, f"replaced by session {session_id}"))
                self._where.pop(old_session, None)
            elif epoch > old_epoch:
                dead.append(DeadPeer(endpoint, old_session, old_epoch, f"restarted (epoch {old_epoch} -> {epoch})"))
        moved_from = self._where.get(session_id)
        if moved_from is not None and moved_from != endpoint:
            old = self._peers.get(moved_from)
            if old is not None and isinstance(old[1], int) and old[1] < epoch:
                del self._peers[moved_from]
                dead.append(DeadPeer(moved_from, session_id, old[1], f"restarted at {endpoint} (epoch {epoch})"))
        self._peers[endpoint] = [session_id, epoch, now]
        self._where[session_id] = endpoint
        return dead

    def expire(self, now: float) -> list[DeadPeer]:
        """Peers silent for longer than ``dead_after``; they are forgotten."""
        limit = now - self.dead_after
        gone = [ep for ep, entry in self._peers.items() if entry[2] < limit]  # type: ignore[operator]
        out = []
        for endpoint in gone:
            session, epoch, last = self._peers.pop(endpoint)
            if session is not None and self._where.get(session) == endpoint:  # type: ignore[call-overload]
                del self._where[session]  # type: ignore[arg-type]
            out.append(
                DeadPeer(endpoint, session, epoch, f"no traffic for {now - last:.1f} s")  # type: ignore[arg-type,operator]
            )
        return out

    def heard_at(self, endpoint: str) -> float | None:
        """When the peer at ``endpoint`` was last heard (or began to be tracked); None if it is not tracked."""
        entry = self._peers.get(endpoint)
        return None if entry is None else entry[2]  # type: ignore[return-value]

    def known(self, endpoint: str) -> tuple[str | None, int | None]:
        """The session and epoch the peer at ``endpoint`` introduced (None, None if it never did)."""
        entry = self._peers.get(endpoint)
        return (None, None) if entry is None else (entry[0], entry[1])  # type: ignore[return-value]

    def pardon(self, now: float) -> None:
        """Every tracked peer counts as heard ``now``: we were not listening (a paused process)."""
        for entry in self._peers.values():
            entry[2] = now

    def forget(self, endpoint: str) -> None:
        entry = self._peers.pop(endpoint, None)
        if entry is not None and entry[0] is not None and self._where.get(entry[0]) == endpoint:  # type: ignore[call-overload]
            del self._where[entry[0]]  # type: ignore[arg-type]
