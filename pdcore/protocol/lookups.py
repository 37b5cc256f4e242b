"""Other deployments as their bootstrap servers describe them: what is known, who waits, what is dead.

Sans-IO: a decode engine (its prefill ranks) and a receiver engine (its encode
ranks) keep one ``Deployment`` per bootstrap server: its shape
(``ParallelInfo``) and the ranks looked up so far, ``(dp rank, tp rank) ->
(control endpoint, transport instance, epoch)``. Items that need ranks not
known yet wait on the deployment; one look-up at a time is out per deployment
(a ``LookUp`` action: the driver asks the server off the engine's thread and
only does the I/O), retried every ``RETRY`` seconds while the server is not
up, so an unreachable server delays only the items that need it;
``looked_up`` resumes each waiting item (``resume(item, None, now)``) or fails
it (``resume(item, why, now)``). The owner's timers bound how long an item waits.

What the server said is outside input, so everything computed from it runs
here, inside the engine's input, and always answers: a shape asked for first
(``LookUp(shape=True)``), then the ranks its waiting items need
(``keys(info, need)`` per item, ``LookUp(keys=...)``). A shape that makes
``keys`` raise anything fails only the items whose need raised it.

A rank found dead (``dead``) stays dead to this engine until its deployment's
server lists it with a newer epoch (it registered again) or the rank is heard
from again (``pardon``: a paused process that resumed): ``verdict`` names the
verdict for the incarnation a look-up found, so the owner fails the items that
need it at once instead of waiting ``dead_after`` again per item (the server
keeps listing a rank that died without saying goodbye). The owner looks the
rank up afresh once per item before it believes a verdict (``forget``), so a
restart is noticed by the first item after it. Forgetting a rank forgets that
rank only: requests toward its live siblings go on with what is cached.
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
    stale: bool = False  # a rank of it was forgotten: ask for the shape again before trusting it
    waiting: list[Any] = field(default_factory=list)

    def known(self) -> ParallelInfo | None:
        """The shape, once every rank of the deployment registered (None while it is to be asked for again)."""
        info = self.info
        return info if info is not None and info.complete and not self.stale else None


def _shape(info: ParallelInfo) -> tuple[Any, ...]:
    return info.dp_size, tuple(info.tp_sizes), info.layout


class Lookups:
    """The deployments one engine talks to, keyed by bootstrap ``(host, port)``.

    ``keys(info, need)`` names the ranks one waiting item needs (``need_of(item)``: a room,
    say, and the DP group a router named); it runs on the engine's thread, inside the input
    that brought ``info``, and whatever it raises fails that item alone. ``emit`` takes the
    ``LookUp`` actions; ``resume(item, why, now)`` runs once an item's look-up ended.
    """

    def __init__(
        self,
        keys: Callable[[ParallelInfo, Any], Iterable[Key]],
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
        for server, deployment in list(self.deployments.items()):
            if deployment.waiting:
                deployment.waiting = [item for item in deployment.waiting if live(item)]
                self._look_up(server, deployment, now)

    def next_deadline(self) -> float:
        """When ``tick`` has a look-up to start (inf: none waits)."""
        due = [d.next_try for d in self.deployments.values() if d.waiting and not d.looking]
        return min(due, default=float("inf"))

    def looked_up(self, server: tuple[str, int], info: ParallelInfo | None, ranks: dict[Key, Any],
                  error: str | None, now: float) -> None:
        """The driver's answer to a ``LookUp`` of ``server``: resume (or fail) what waited for it.

        ``info`` None and no ``error``: the server was not reachable (yet); the items wait again."""
        deployment = self.deployments.get(server)
        if deployment is None:
            return
        deployment.looking = False
        # the next look-up may go at once after one that found something; after one that found nothing (the server
        # not up, or its ranks not registered yet) it waits RETRY: an item waiting for such a rank polls, bounded
        found = (info is not None and info.complete) or any(rank is not None for rank in ranks.values())
        deployment.next_try = now if found and error is None else now + RETRY
        if error is None and info is not None:
            try:
                if deployment.info is not None and _shape(deployment.info) != _shape(info):
                    deployment.ranks = {}  # another shape: what was cached of the old one is void
                deployment.info, deployment.stale = info, False
            except Exception as e:  # a shape that cannot even be compared: the server's fault
                error = f"its parallel info is malformed: {e!r}"
        for key, rank in ranks.items():
            if rank is None:
                deployment.ranks.pop(key, None)  # not registered (any more)
                continue
            try:
                deployment.ranks[key] = (str(rank.endpoint), bytes.fromhex(rank.transport), int(rank.epoch))
            except Exception as e:
                error = error or f"rank {key} is malformed: {e!r}"
        waiting, deployment.waiting = deployment.waiting, []
        why = None if error is None else f"bootstrap {server[0]}:{server[1]}: {error}"
        deployment.looking = True  # the items that wait again gather first: one look-up asks for them all
        try:
            for item in waiting:
                self._resume(item, why, now)
        finally:
            deployment.looking = False
        self._look_up(server, deployment, now)

    def forget(self, endpoint: str) -> None:
        """The rank at ``endpoint`` is gone: look it up afresh (it may come back elsewhere, or its deployment
        with another shape). Only that rank: its siblings stay known."""
        for deployment in self.deployments.values():
            gone = [key for key, rank in deployment.ranks.items() if rank[0] == endpoint]
            for key in gone:
                del deployment.ranks[key]
            if gone:
                deployment.stale = True

    def refresh(self, server: tuple[str, int]) -> None:
        """What is cached of ``server``'s deployment let an item down (it cannot pair with that shape): the
        next item asks for the shape again, so a deployment that registers anew is seen anew."""
        deployment = self.deployments.get(server)
        if deployment is not None:
            deployment.stale = True

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

    def waiting(self) -> int:
        """Items waiting for a look-up (a bound the simulator checks)."""
        return sum(len(d.waiting) for d in self.deployments.values())

    def _look_up(self, server: tuple[str, int], deployment: Deployment, now: float) -> None:
        if deployment.looking or now < deployment.next_try or not deployment.waiting:
            return  # one look-up at a time; the tick starts the next
        info = deployment.known()
        if info is None:
            deployment.looking = True
            self._emit(LookUp(server, True, frozenset()))
            return
        missing: set[Key] = set()
        failed: list[tuple[Any, str]] = []
        for item in deployment.waiting:
            try:
                missing.update(self._keys(info, self._need_of(item)))
            except Exception as e:  # its need cannot be met by this shape (or the shape is garbage)
                failed.append((item, f"bootstrap {server[0]}:{server[1]}: {e}"))
        missing.difference_update(deployment.ranks)
        if failed:
            gone = {id(item) for item, _ in failed}
            deployment.waiting = [item for item in deployment.waiting if id(item) not in gone]
        if missing:
            deployment.looking = True
            self._emit(LookUp(server, False, frozenset(missing)))
        elif deployment.waiting:  # everything they need is known now (a rank another item asked for)
            deployment.next_try = now + RETRY  # an item that waits again waits for the next try
            waiting, deployment.waiting = deployment.waiting, []
            for item in waiting:
                self._resume(item, None, now)
        for item, why in failed:
            self._resume(item, why, now)
