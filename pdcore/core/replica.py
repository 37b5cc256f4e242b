"""What a scheduler may pass as its replica to ``poll``/``round``: a process group, or None.

Checked at the call, so a wrong argument is a ``LocalProtocolError`` naming it, not an
``AttributeError`` from deep inside the agreement. torch is imported only when a group is
passed (a replica of one rank never needs it), and a group is checked once per peer, not
per round.
"""

from __future__ import annotations

from .errors import LocalProtocolError

__all__ = ["check_replica"]


def check_replica(replica: object, where: str) -> None:
    """``replica`` is None (one rank: no collective) or a ``torch.distributed`` process group."""
    if replica is None:
        return
    try:
        import torch.distributed as dist
    except ImportError:  # no torch, so no process group either
        dist = None  # type: ignore[assignment]
    if dist is not None and dist.is_available() and isinstance(replica, dist.ProcessGroup):
        return
    raise LocalProtocolError(
        f"{where}: replica must be the replica's torch.distributed process group (gloo, CPU) or None for a "
        f"replica of one rank, got {type(replica).__name__}"
    )
