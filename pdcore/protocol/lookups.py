"""Other deployments as their bootstrap servers describe them: what is known, who waits, what is dead.

Sans-IO: a decode engine (its prefill ranks) and a receiver engine (its encode
ranks) keep one ``Deployment`` per bootstrap server: its shape
(``ParallelInfo``) and the ranks looked up so far, ``(dp rank, tp rank) ->
(control endpoint, transport instance, epoch)``. Items that need ranks not
known yet wait on the deployment; one look-up at a time is out per deployment
(a ``LookUp`` action: the driver asks the server off the engine's thread),
retried every ``RETRY`` seconds while the server is not up, so an unreachable
server delays only the items that need it; ``looked_up`` resumes each waiting
item (``resume(item, None, now)``) or fails it (``resume(item, why, now)``).
The owner's timers bound how long an item waits.

A rank found dead (``dead``) stays dead to this engine until its deployment's
server lists it with a newer epoch (it registered again) or the rank is heard
from again (``pardon``: a paused process that resumed): ``verdict`` names the
verdict for the incarnation a look-up found, so the owner fails the items that
need it at once instead of waiting ``dead_after`` again per item (the server
keeps listing a rank that died without saying goodbye). The owner looks the
deployment up afresh once per item before it believes a verdict (``forget``),
so a restart is noticed by the first item after it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .actions import LookUp

if TYPE_CHECKING:  # a value the look-ups carry: its module is the bootstrap's I/O, never imported here
    from ..control.bootstrap import ParallelInfo

__all__ = ["Deployment", "Lookups", "RETRY"]

RETRY = 0.1  # seconds between look-ups of a deployment that is not up yet
_MAX_VERDICTS = 4096

Key = tuple[int, int]
Rank = tuple[str, bytes, int]  # (control endpoint, transport instance, epoch)


@dataclass(eq=False)
class Deployment:
    info: ParallelInfo | None = None
    ranks: dict[Key, Rank] = field(default_factory=dict)
    next_try: float = 0.0
    looking: bool = False
    waiting: list[Any] = field(default_factory=list)

    def known(self) -> ParallelInfo | None:
        """The shape, once every rank of the deployment registered."""
        info = self.info
        return info if info is not None and info.complete else None


class Lookups:
    """The deployments one engine talks to, keyed by bootstrap ``(host, port)``.

    ``keys(info, needs)`` names the ranks the waiting items need (``need_of(item)``: a room,
    say, and the DP group a router named); it reads only configuration, so the driver may run
    it off the engine's thread, and it raises ``PdError`` when the deployment cannot serve
    them. ``emit`` takes the ``LookUp`` actions; ``resume(item, why, now)`` runs once an
    item's look-up ended.
    """

    def __init__(
        self,
        keys: Callable[[ParallelInfo, set[Any]], Iterable[Key]],
        need_of: Callable[[Any], Any],
        resume: Callable[[Any, str | None, float], None],
        emit: Callable[[LookUp], None],
    ) -> None:
        self._keys = keys
        self._need_of = need_of
        self._resume = resume
        self._emit = emit
        self.deployments: dict[tuple[str, int], Deployment] = {}
        self._dead: OrderedDict[str, tuple[int, str]] = OrderedDict()  # endpoint -> (epoch found dead, verdict)

    def get(self, server: tuple[str, int]) -> Deployment:
        return self.deployments.setdefault(server, Deployment())

    def wait(self, server: tuple[str, int], item: Any, now: float) -> None:
        """``item`` needs ranks of ``server``'s deployment not known yet."""
        deployment = self.get(server)
        deployment.waiting.append(item)
        self._look_up(server, deployment, now)

    def tick(self, now: float, live: Callable[[Any], bool]) -> None:
        """Drop waiting items that ended, start the next look-up where one is due."""
        for server, deployment in self.deployments.items():
            if deployment.waiting:
                deployment.waiting = [item for item in deployment.waiting if live(item)]
                self._look_up(server, deployment, now)

    def next_deadline(self) -> float:
        """When ``tick`` has a look-up to start (inf: none waits)."""
        due = [d.next_try for d in self.deployments.values() if d.waiting and not d.looking]
        return min(due, default=float("inf"))

    def looked_up(self, server: tuple[str, int], info: ParallelInfo | None, ranks: dict[Key, Any],
                  error: str | None, now: float) -> None:
        """The driver's answer to a ``LookUp`` of ``server``: resume (or fail) what waited for it."""
        deployment = self.deployments.get(server)
        if deployment is None:
            return
        deployment.looking = False
        deployment.next_try = now + RETRY
        if info is not None:
            deployment.info = info
        for key, rank in ranks.items():
            if rank is not None:
                deployment.ranks[key] = (rank.endpoint, bytes.fromhex(rank.transport), rank.epoch)
        waiting, deployment.waiting = deployment.waiting, []
        why = None if error is None else f"bootstrap {server[0]}:{server[1]}: {error}"
        for item in waiting:
            self._resume(item, why, now)

    def forget(self, endpoint: str) -> None:
        """A rank at ``endpoint`` is gone: look its deployment up afresh (it may come back elsewhere)."""
        for deployment in self.deployments.values():
            if any(rank[0] == endpoint for rank in deployment.ranks.values()):
                deployment.info, deployment.ranks = None, {}

    def dead(self, endpoint: str, epoch: int | None, verdict: str) -> None:
        """The rank at ``endpoint`` (incarnation ``epoch``; None: the one looked up) was found dead."""
        if epoch is None:
            epoch = next((rank[2] for d in self.deployments.values() for rank in d.ranks.values()
                          if rank[0] == endpoint), None)
        self.forget(endpoint)
        if epoch is None:
            return  # never looked up here: nothing to hold against a look-up
        self._dead.pop(endpoint, None)
        self._dead[endpoint] = (epoch, verdict)
        while len(self._dead) > _MAX_VERDICTS:
            self._dead.popitem(last=False)

    def verdict(self, endpoint: str, epoch: int) -> str | None:
        """Why the looked-up rank at ``endpoint`` (incarnation ``epoch``) is known dead, or None; a newer
        epoch (it registered again) clears the verdict."""
        entry = self._dead.get(endpoint)
        if entry is None:
            return None
        if epoch > entry[0]:
            del self._dead[endpoint]
            return None
        return f"{endpoint} was found dead ({entry[1]}) and has not registered again"

    def pardon(self, endpoint: str, epoch: int) -> None:
        """The rank at ``endpoint`` was heard from again (incarnation ``epoch``): a verdict against it,
        or an older incarnation, goes."""
        entry = self._dead.get(endpoint)
        if entry is not None and epoch >= entry[0]:
            del self._dead[endpoint]

    def instance(self, endpoint: str) -> bytes:
        """The transport instance of the rank at ``endpoint`` (``KeyError`` if never looked up)."""
        for deployment in self.deployments.values():
            for rank in deployment.ranks.values():
                if rank[0] == endpoint:
                    return rank[1]
        raise KeyError(endpoint)

    def waiting(self) -> int:
        """Items waiting for a look-up (a bound the simulator checks)."""
        return sum(len(d.waiting) for d in self.deployments.values())

    def _look_up(self, server: tuple[str, int], deployment: Deployment, now: float) -> None:
        if deployment.looking or now < deployment.next_try or not deployment.waiting:
            return  # one look-up at a time; the tick starts the next
        deployment.looking = True
        needs = {self._need_of(item) for item in deployment.waiting}
        keys = self._keys
        self._emit(LookUp(server, deployment.info, lambda info: keys(info, needs), frozenset(deployment.ranks)))
