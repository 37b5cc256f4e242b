"""The replica's agreement: encode the table, all-reduce MIN over the group, decode.

The table is sans-IO; this module is the only one that calls the collective.
The reduced tensor shares the table's buffer (``torch.from_numpy``), so the
only copy per round is the table's own copy of its codes. torch is imported
on the first round that has a group: a replica of one rank never needs it.
"""

from __future__ import annotations

from typing import Any

from .errors import CollectiveError
from .events import Event

__all__ = ["Agreement"]


class Agreement:
    """Runs rounds of one ``StateTable`` across a replica.

    ``replica`` is a ``torch.distributed`` process group (gloo, CPU) or ``None``
    for a replica of one rank, which skips the collective. Every rank of the
    replica must call ``round`` in the same scheduler rounds.
    """

    __slots__ = ("_table", "_tensor", "_group", "_world", "_dist")

    def __init__(self, table: Any) -> None:
        self._table = table
        self._tensor: Any = None
        self._group: object = None
        self._world = 1
        self._dist: Any = None

    def _world_size(self, replica: object) -> int:
        if replica is not self._group:
            if replica is None:
                self._world = 1
            else:
                if self._dist is None:
                    import torch
                    import torch.distributed as dist

                    self._dist = dist
                    self._tensor = torch.from_numpy(self._table.buffer)
                self._world = self._dist.get_world_size(replica)
            self._group = replica
        return self._world

    def round(self, now: float, replica: object = None) -> list[Event]:
        """One agreement round; identical events in identical order on every rank."""
        self._table.encode(now)
        if self._world_size(replica) > 1:
            dist = self._dist
            try:
                dist.all_reduce(self._tensor, op=dist.ReduceOp.MIN, group=replica)
            except RuntimeError as exc:  # gloo reports peer loss and timeouts this way
                raise CollectiveError(f"all-reduce MIN over the replica failed: {exc}") from exc
        return self._table.decode()
