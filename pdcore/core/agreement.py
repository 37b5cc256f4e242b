"""The replica's agreement: encode the table, all-reduce MIN across the replica, decode.

The table is sans-IO; this module is the only one that runs the reduction. Two
paths give the same MIN, the same events and the same mismatch guard:

- ``"group"``: the group's collective, ``all_reduce(MIN)`` over gloo. The
  reduced tensor shares the table's buffer (``torch.from_numpy``), so the only
  copy per round is the table's own copy of its codes.
- ``"shm"``: when every rank of the replica runs on one host, a shared-memory
  segment with a compiled MIN and barrier (``pdcore.core._shm``; the protocol is in
  ``pdcore.core._shm_py``'s docstring). A rank that dies or stops calling makes
  every other rank raise ``CollectiveError`` naming it, within ``shm_timeout``
  seconds (at once for a rank that exited), never a hang.

``agreement="auto"`` (the default) decides once, through the group, at the
first round with more than one rank: one ``all_gather_object`` of each rank's
host key (boot id and ``/dev/shm`` identity), buffer size and implementation,
carrying the name of the segment rank 0 created; then each rank attaches and a
second ``all_gather_object`` confirms it, after which rank 0 unlinks the name
(no ``/dev/shm`` entry outlives the attach, whatever crashes later). Ranks on
several hosts, or a failed attach, fall back to the group's collective;
``agreement="shm"`` raises ``CollectiveError`` on every rank instead. Ranks
whose buffers differ in size (tables of different capacity) raise
``CollectiveError`` on every rank at once: a collective over them would hang
or corrupt.

Failure reasons: a rank that failed a request itself knows why; the others only
know that another rank did (``FAILED_ELSEWHERE``). In a round that fails
requests, every rank contributes its reasons for them to one
``all_gather_object`` over the group (whichever path reduced the round: the
group is there either way) and takes, per request, the reason of the lowest
rank that failed it itself, so every rank reports the same reason in the same
round (``agree_reasons``; ``round`` applies it to its ``Failed`` events). A
round that fails nothing pays nothing for it.

torch is imported on the first round that has a group: a replica of one rank
never needs it.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from .errors import CollectiveError
from .events import FAILED_ELSEWHERE, Failed

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Agreement", "AGREEMENT_MODES", "pick_reasons"]

#: Values of ``Agreement(agreement=...)``.
AGREEMENT_MODES = ("auto", "shm", "group")

_MAX_REASON = 1024  # characters of each reason exchanged (the wire's bound on a reason too)

_Out = TypeVar("_Out")


class _Table(Protocol[_Out]):
    """What a round needs of a table: a ``StateTable`` (its rounds give ``Event``s) or an EPD ``ReceiveTable``
    (``LandedRequest``s)."""

    @property
    def buffer(self) -> np.ndarray: ...
    def encode(self, now: float) -> np.ndarray: ...
    def decode(self) -> list[_Out]: ...


class Agreement(Generic[_Out]):
    """Runs rounds of one ``StateTable`` across a replica.

    ``replica`` is a ``torch.distributed`` process group (gloo, CPU) or ``None``
    for a replica of one rank, which skips the reduction. Every rank of the
    replica must call ``round`` in the same scheduler rounds, with the same
    ``agreement`` and ``shm_timeout``.

    ``agreement``: ``"auto"`` (shared memory when every rank is on this host,
    else the group's collective), ``"shm"`` (shared memory or ``CollectiveError``)
    or ``"group"`` (always the group's collective). ``shm_timeout``: seconds a
    rank waits in a shared-memory round for the others before the round fails
    on every rank. ``close()`` releases the segment; the others then fail their
    next round naming this rank.
    """

    __slots__ = ("_table", "_tensor", "_group", "_world", "_dist", "_mode", "_want", "_timeout", "_shm")

    def __init__(self, table: _Table[_Out], *, agreement: str = "auto", shm_timeout: float = 5.0) -> None:
        if agreement not in AGREEMENT_MODES:
            raise ValueError(f"agreement must be one of {AGREEMENT_MODES}, got {agreement!r}")
        if not (isinstance(shm_timeout, (int, float)) and shm_timeout > 0 and math.isfinite(shm_timeout)):
            raise ValueError(f"shm_timeout must be a positive number of seconds, got {shm_timeout!r}")
        self._table = table
        self._tensor: Any = None
        self._group: object = None
        self._world = 1
        self._dist: Any = None
        self._want = agreement
        self._timeout = float(shm_timeout)
        self._mode = "single"
        self._shm: Any = None

    @property
    def mode(self) -> str:
        """How the last round was reduced: ``"single"`` (one rank), ``"group"`` or ``"shm"``."""
        return self._mode

    def _world_size(self, replica: object) -> int:
        if replica is not self._group:
            self._release()
            if replica is None:
                self._world = 1
                self._mode = "single"
            else:
                if self._dist is None:
                    import torch.distributed as dist

                    self._dist = dist
                self._world = self._dist.get_world_size(replica)
                self._mode = "single" if self._world == 1 else self._choose(replica)
            self._group = replica
        return self._world

    def _choose(self, replica: object) -> str:
        """Decide shm or group once per group, through the group (every rank reaches the same answer)."""
        if self._want == "group":
            return self._use_group()
        from . import _shm_py
        from ._shm_py import Segment

        dist = self._dist
        rank = dist.get_rank(replica)
        world = self._world
        nbytes = int(self._table.buffer.shape[0])
        reducer_cls = self._reducer_class()
        impl = "python" if reducer_cls is _shm_py.ShmReducer else "cython"
        segment = None
        created = ""
        if rank == 0 and world <= _shm_py.MAX_WORLD:
            try:
                segment = Segment.create(world, nbytes, impl)
                created = segment.name
            except OSError as exc:
                created = f"!{exc}"  # no /dev/shm here: the others learn it below
        try:
            offer = (_shm_py.host_key(), nbytes, impl, os.getpid(), created)
            offers: list[Any] = [None] * world
            dist.all_gather_object(offers, offer, group=replica)
            sizes = {o[1] for o in offers}
            if len(sizes) > 1:
                raise CollectiveError(
                    "ranks of the replica hold reduction buffers of different sizes "
                    f"({', '.join(f'rank {r}: {o[1]} bytes' for r, o in enumerate(offers))}): their tables must "
                    "have the same capacity"
                )
            name = offers[0][4]
            why = ""
            if world > _shm_py.MAX_WORLD:
                why = f"{world} ranks, more than the {_shm_py.MAX_WORLD} a segment serves"
            elif len({o[0] for o in offers}) > 1:
                hosts: dict[str, list[int]] = {}
                for r, o in enumerate(offers):
                    hosts.setdefault(o[0], []).append(r)
                why = "the ranks run on different hosts (or /dev/shm): " + "; ".join(
                    f"ranks {v}" for v in hosts.values()
                )
            elif len({o[2] for o in offers}) > 1:
                why = "the ranks run different implementations: " + ", ".join(
                    f"rank {r}: {o[2]}" for r, o in enumerate(offers)
                )
            elif name.startswith("!"):
                why = f"rank 0 could not create a segment: {name[1:]}"
            attached = ""
            if not why and rank != 0:
                try:
                    segment = Segment.open(name, rank, world, nbytes, impl)
                except (OSError, ValueError) as exc:
                    attached = f"{type(exc).__name__}: {exc}"
            if not why:
                results: list[Any] = [None] * world
                dist.all_gather_object(results, attached, group=replica)
                failed = [f"rank {r}: {e}" for r, e in enumerate(results) if e]
                if failed:
                    why = "attaching the segment failed on " + "; ".join(failed)
        except BaseException:
            if segment is not None:
                segment.close()
            raise
        if segment is not None:
            segment.unlink()  # rank 0: every rank attached (or gave up): the name goes now
        if why:
            if segment is not None:
                segment.close()
            if self._want == "shm":
                raise CollectiveError(f"agreement='shm' cannot run: {why}")
            return self._use_group()
        self._shm = reducer_cls(segment, self._timeout)
        return "shm"

    def _reducer_class(self) -> Any:
        """The shared-memory twin that matches the table's (the pure table runs the pure round)."""
        if type(self._table).__module__ == "pdcore.core._table_py":
            from ._shm_py import ShmReducer
        else:
            from .table import ShmReducer
        return ShmReducer

    def _use_group(self) -> str:
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(self._table.buffer)
        return "group"

    def _release(self) -> None:
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()

    def close(self) -> None:
        """Release the shared-memory segment, if any (idempotent); the next round decides again."""
        self._release()
        self._group = None
        self._world = 1
        self._mode = "single"

    def round(self, now: float, replica: object = None) -> list[_Out]:
        """One agreement round; identical events in identical order on every rank."""
        buf = self._table.encode(now)
        if self._world_size(replica) > 1:
            if self._shm is not None:
                self._shm.allreduce_min(buf)
            else:
                dist = self._dist
                try:
                    dist.all_reduce(self._tensor, op=dist.ReduceOp.MIN, group=replica)
                except RuntimeError as exc:  # gloo reports peer loss and timeouts this way
                    raise CollectiveError(f"all-reduce MIN over the replica failed: {exc}") from exc
            events: list[Any] = self._table.decode()  # a StateTable's events may hold Failed ones
            failed = [i for i, event in enumerate(events) if type(event) is Failed]
            if failed:
                reasons = self.agree_reasons(replica, [events[i].reason for i in failed])
                for i, reason in zip(failed, reasons):
                    events[i] = Failed(events[i].rid, reason)
            return events
        return self._table.decode()

    def agree_reasons(self, replica: object, reasons: list[str]) -> list[str]:
        """The replica's reasons for the requests a round failed (the same requests, in the same order, on
        every rank: call it on every rank in that round): per request, the reason of the lowest rank that
        failed it itself, else this rank's own. A replica of one rank has nothing to exchange."""
        if not reasons or self._world_size(replica) <= 1:
            return reasons
        mine = [r[:_MAX_REASON] for r in reasons]
        gathered: list[Any] = [None] * self._world
        try:
            self._dist.all_gather_object(gathered, mine, group=replica)
        except RuntimeError as exc:
            raise CollectiveError(f"exchanging failure reasons over the replica failed: {exc}") from exc
        if any(not isinstance(theirs, list) or len(theirs) != len(mine) for theirs in gathered):
            raise CollectiveError("the ranks of the replica failed different requests in one round")
        return pick_reasons(gathered)


def pick_reasons(gathered: list[list[str]]) -> list[str]:
    """Per failed request (the same ones, in the same order, in each rank's list, lowest rank first): the
    reason of the lowest rank that failed it itself, else the first rank's (``FAILED_ELSEWHERE`` there too)."""
    return [next((theirs[i] for theirs in gathered if theirs[i] != FAILED_ELSEWHERE), first)
            for i, first in enumerate(gathered[0])]
