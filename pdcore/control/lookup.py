"""Other deployments as their bootstrap servers describe them, looked up off the worker thread.

A peer that must find the ranks of another deployment (a decode rank its
prefill ranks, a prefill rank's receiver its encode ranks) keeps one
``Deployment`` per bootstrap server: its shape (``ParallelInfo``) and the
ranks looked up so far, ``(dp rank, tp rank) -> (control endpoint, transport
instance)``. Items that need ranks not known yet wait on the deployment; one
lookup at a time runs on an I/O thread (bounded by deadlines, retried every
``_RETRY`` seconds while the server is not up, so an unreachable server
delays only the items that need it), and its result goes back to the worker,
which resumes each waiting item (``resume(item, None)``) or fails it
(``resume(item, why)``). The caller's timers bound how long an item waits.

A rank found dead (``dead``) stays dead to this peer until its deployment's
server lists it with a newer epoch (it registered again): ``verdict`` names
the verdict for the incarnation a look-up found, so the caller fails the
items that need it at once instead of waiting ``dead_after`` again per item
(the server keeps listing a rank that died without saying goodbye). The
caller looks the deployment up afresh once per item before it believes a
verdict (``forget``), so a restart is noticed by the first item after it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .bootstrap import BootstrapClient, ParallelInfo
from ..core.deadline import Deadline, DeadlineExceeded
from ..core.errors import PdError

__all__ = ["Deployment", "Lookups"]

log = logging.getLogger("pdcore.lookup")

_LOOKUP_SLICE = 2.0  # seconds one bootstrap request may take on an I/O thread
_RETRY = 0.1  # seconds between lookups of a deployment that is not up yet
_MAX_VERDICTS = 4096

Rank = tuple[str, bytes, int]  # (control endpoint, transport instance, epoch)

Key = tuple[int, int]


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
    """The deployments one peer talks to, keyed by bootstrap ``(host, port)``.

    ``keys(info, needs)`` names the ranks the waiting items need (``need_of(item)``:
    a room, say, and the DP group a router named) or raises ``PdError`` when the
    deployment cannot serve them; ``resume(item, why)`` runs on the worker once
    their lookup ended.
    """

    def __init__(
        self,
        peer: Any,
        what: str,
        keys: Callable[[ParallelInfo, set[Any]], Iterable[Key]],
        need_of: Callable[[Any], Any],
        resume: Callable[[Any, str | None], None],
    ) -> None:
        self._peer = peer
        self._what = what
        self._keys = keys
        self._need_of = need_of
        self._resume = resume
        self.deployments: dict[tuple[str, int], Deployment] = {}
        self._dead: OrderedDict[str, tuple[int, str]] = OrderedDict()  # endpoint -> (epoch found dead, verdict)

    def get(self, server: tuple[str, int]) -> Deployment:
        return self.deployments.setdefault(server, Deployment())

    def wait(self, server: tuple[str, int], item: Any) -> None:
        """Worker: ``item`` needs ranks of ``server``'s deployment not known yet."""
        deployment = self.get(server)
        deployment.waiting.append(item)
        self._look_up(server, deployment)

    def tick(self, live: Callable[[Any], bool]) -> None:
        """Worker, every tick: drop items that ended, start the next lookup where one is due."""
        for server, deployment in list(self.deployments.items()):
            deployment.waiting = [item for item in deployment.waiting if live(item)]
            self._look_up(server, deployment)

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

    def suspect(self, endpoint: str) -> bool:
        """A verdict is held against ``endpoint`` (a read, safe off the worker)."""
        return endpoint in self._dead

    def pardon(self, endpoint: str) -> None:
        """The rank at ``endpoint`` was heard from again: the verdict goes."""
        self._dead.pop(endpoint, None)

    def instance(self, endpoint: str) -> bytes:
        """The transport instance of the rank at ``endpoint`` (``KeyError`` if never looked up)."""
        for deployment in self.deployments.values():
            for rank in deployment.ranks.values():
                if rank[0] == endpoint:
                    return rank[1]
        raise KeyError(endpoint)

    def _look_up(self, server: tuple[str, int], deployment: Deployment) -> None:
        if deployment.looking or time.monotonic() < deployment.next_try or not deployment.waiting:
            return  # one lookup at a time; the tick starts the next
        deployment.looking = True
        needs = {self._need_of(item) for item in deployment.waiting}
        try:
            self._peer._submit_io(self._look_up_io, server, deployment, needs)
        except PdError as e:
            deployment.looking = False
            log.warning("%s: cannot queue a bootstrap lookup of %s:%d: %s", self._what, *server, e)

    def _look_up_io(self, server: tuple[str, int], deployment: Deployment, needs: set[Any]) -> None:
        """I/O thread: the deployment's shape and the ranks the waiting items need."""
        client = BootstrapClient(*server, secret=self._peer._secret)
        info, ranks, error = deployment.info, {}, None
        try:
            if info is None or not info.complete:
                info = client.parallel_info(Deadline.after(_LOOKUP_SLICE))
            if info is not None and info.complete:
                for key in set(self._keys(info, needs)) - set(deployment.ranks):
                    ranks[key] = client.rank(*key, Deadline.after(_LOOKUP_SLICE))
        except (OSError, DeadlineExceeded) as e:
            log.debug("%s: bootstrap %s:%d not reachable yet: %s", self._what, *server, e)
        except PdError as e:
            error = e
        self._peer._from_io(self._looked_up, server, deployment, info, ranks, error)

    def _looked_up(self, server: tuple[str, int], deployment: Deployment, info: Any, ranks: dict[Any, Any], error: Any) -> None:
        deployment.looking = False
        deployment.next_try = time.monotonic() + _RETRY
        if info is not None:
            deployment.info = info
        for key, rank in ranks.items():
            if rank is not None:
                deployment.ranks[key] = (rank.endpoint, bytes.fromhex(rank.transport), rank.epoch)
        waiting, deployment.waiting = deployment.waiting, []
        why = None if error is None else f"bootstrap {server[0]}:{server[1]}: {error}"
        for item in waiting:
            self._resume(item, why)
