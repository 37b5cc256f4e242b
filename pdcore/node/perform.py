"""Performing a role engine's actions on a peer's planes: the part of a driver that is not threads.

``Performer`` runs one input (``fn(*args, now)``) and then performs the actions
of the engines it concerns, in order, on the transport and the control plane
it was given (``pdcore.protocol.actions`` says what each action is and what is
fed back). It never waits on a peer: a ``Post`` to a sink at its in-flight bound
is parked for that sink (behind the posts parked there before it) and posted
from that sink's completions; one still parked after its ``wait`` fails
(``expire``), and so do a dropped connection's. ``Connect`` and ``LookUp`` wait on other hosts, so a subclass says
where they go (``_io``); completions come back on the transport's threads, so a
subclass says how they reach the engine (``_result``). The threaded driver
(``pdcore.node.driver``) and the simulator (``pdcore.sim``) are the two
subclasses: the same code performs every action in both.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from ..core.deadline import Deadline
from ..core.errors import CapacityError, PdError
from ..protocol.actions import Connect, Disconnect, Grant, Land, LookUp, Post, Revoke, Send
from ..protocol.engine import EngineInputs

__all__ = ["Performer"]

log = logging.getLogger("pdcore.driver")


class Performer:
    """Performs the actions of ``engines`` on ``transport`` and ``channel``; ``clock()`` is ``now``."""

    def __init__(self, name: str, *, transport: Any, channel: Any, clock: Callable[[], float],
                 stats: dict[str, int] | None = None) -> None:
        self._name = name
        self._transport = transport
        self._channel = channel
        self._clock = clock
        self._engines: list[EngineInputs] = []
        self.stats = stats if stats is not None else {}  # the peer's own dict: work_errors, inputs
        self.stats.setdefault("work_errors", 0)
        self.stats.setdefault("inputs", 0)
        self.stats.setdefault("posts_parked", 0)  # posts that found their sink full (a cost metric)
        # sink handle -> the posts waiting for room there, in order: (engine, post, until)
        self._parked: dict[Any, deque[tuple[Any, Post, float]]] = {}
        self._parked_until = float("inf")  # the earliest ``until`` parked (inf: none)

    def attach(self, engine: EngineInputs) -> None:
        """Perform ``engine``'s actions too (before its first input)."""
        self._engines.append(engine)

    @property
    def engines(self) -> list[EngineInputs]:
        return list(self._engines)

    def _io(self, engine: Any, action: Connect | LookUp) -> None:
        """Do a ``Connect`` or ``LookUp`` where waiting on another host is fine; feed the outcome back."""
        raise NotImplementedError

    def _result(self, fn: Callable[..., Any], *args: Any) -> None:
        """Feed an answer of the planes (a completion) to the engine later, from any thread."""
        raise NotImplementedError

    def input(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        stats = self.stats
        stats["inputs"] += 1
        try:
            fn(*args, self._clock())
        except Exception:  # a bug of ours or an unexpected failure: logged, counted, never fatal
            stats["work_errors"] += 1
            log.exception("%s: input %s failed", self._name, getattr(fn, "__qualname__", fn))
        engine = getattr(fn, "__self__", None)
        if engine is not None and engine in self._engines:
            self.perform(engine)
            return
        for e in self._engines:
            self.perform(e)

    def perform(self, engine: Any) -> None:
        """Perform ``engine``'s actions, and those its synchronous answers add, in order."""
        while True:
            actions = engine.take_actions()
            if not actions:
                return
            for action in actions:
                try:
                    self._do(engine, action)
                except Exception:
                    self.stats["work_errors"] += 1
                    log.exception("%s: action %s failed", self._name, type(action).__name__)

    def _do(self, engine: Any, action: Any) -> None:
        kind = type(action)
        if kind is Send:
            try:
                self._channel.send(action.endpoint, action.msg)
            except PdError as e:
                log.warning("%s: cannot tell %s about %s: %s", self._name, action.endpoint, type(action.msg).__name__, e)
                if action.token is not None:
                    engine.unsent(action.token, str(e), self._clock())
        elif kind is Post:
            self._post(engine, action)
        elif kind is Grant:
            try:
                grant, error = self._transport.grant(action.source, action.ranges), None
            except (KeyError, ValueError, PdError) as e:
                grant, error = None, str(e)
            engine.granted(action.token, grant, error, self._clock())
        elif kind is Revoke:
            try:
                self._transport.revoke(action.grant, deadline=Deadline.after(action.seconds), settled=action.settled)
                error = None
            except PdError as e:
                error = str(e)
            engine.revoked(action.token, error, self._clock())
        elif kind is Disconnect:
            self._transport.disconnect(action.handle)
            self._unpark(action.handle, self._clock(), "the data connection was dropped")
        elif kind is Connect:
            self._io(engine, action)
        elif kind is LookUp:
            self._io(engine, action)
        elif kind is Land:
            try:
                self._transport.land(action.ranges, _Scattered(self, engine, action.token))
            except (ValueError, PdError) as e:  # nothing was copied: the room fails rather than waits
                engine.scattered(action.token, str(e), self._clock())
        else:
            raise TypeError(f"not an action: {action!r}")

    def _post(self, engine: Any, post: Post) -> None:
        parked = self._parked.get(post.handle)
        if parked:  # others wait for room at this sink already: behind them, so a sink's posts keep their order
            self._park(parked, engine, post)
        elif not self._try_post(engine, post):
            self._park(self._parked.setdefault(post.handle, deque()), engine, post)

    def _park(self, parked: deque[tuple[Any, Post, float]], engine: Any, post: Post) -> None:
        until = self._clock() + post.wait
        parked.append((engine, post, until))
        self._parked_until = min(self._parked_until, until)
        self.stats["posts_parked"] += 1

    def _try_post(self, engine: Any, post: Post) -> bool:
        """Post now, never waiting; False if the sink is at its in-flight bound (nothing was posted)."""
        done = _Written(self, engine, post.token, post.handle)
        try:
            self._transport.write(post.handle, post.batch, done, grant=post.grant, note=post.note)
        except CapacityError:
            return False
        except PdError as e:
            engine.written(post.token, f"posting the writes failed: {e}", self._clock())
            return True
        counts = engine.services.counts
        if counts is not None:  # counted once the transport took it (it may be on its way already)
            counts.writes_posted += len(post.batch)
            counts.bytes_posted += int(post.batch[:, 2].sum())
        return True

    def written(self, engine: Any, token: Any, handle: Any, error: str | None, now: float) -> None:
        """A posted batch completed (the driver's thread): the engine hears, and the sink has room for
        what is parked for it."""
        try:
            engine.written(token, error, now)
        finally:
            if handle in self._parked:
                self._unpark(handle, now)

    def _unpark(self, handle: Any, now: float, error: str = "") -> None:
        """Post what is parked for ``handle`` while it has room (``error``: fail it all instead)."""
        parked = self._parked.get(handle)
        while parked:
            engine, post, _until = parked[0]
            if not error and not self._try_post(engine, post):
                break
            parked.popleft()
            if error:
                engine.written(post.token, error, now)
        if not parked:
            self._parked.pop(handle, None)

    def next_deadline(self) -> float:
        """When ``expire`` has a parked post to fail (inf: none)."""
        return self._parked_until

    def expire(self, now: float) -> None:
        """Fail the posts parked past their ``wait``; their engines' actions follow."""
        if now < self._parked_until:
            return
        self._parked_until = float("inf")
        for handle in list(self._parked):
            parked = self._parked[handle]
            keep: deque[tuple[Any, Post, float]] = deque()
            for engine, post, until in parked:
                if until <= now:
                    engine.written(post.token, f"the transport had no room for {post.wait:g} s", now)
                else:
                    keep.append((engine, post, until))
                    self._parked_until = min(self._parked_until, until)
            if keep:
                self._parked[handle] = keep
            else:
                del self._parked[handle]
        for engine in self._engines:
            self.perform(engine)

    def parked(self) -> int:
        """Posts parked now, over every sink (a diagnostic)."""
        return sum(len(q) for q in self._parked.values())


class _Written:
    """A batch's completion (a transport thread): ``Performer.written`` on the driver's thread. ``token`` is
    the engine's for the batch (a prefill room's record names its rid)."""

    __slots__ = ("_performer", "_engine", "token", "_handle")

    def __init__(self, performer: Performer, engine: Any, token: Any, handle: Any) -> None:
        self._performer, self._engine, self.token, self._handle = performer, engine, token, handle

    def __call__(self, _batch: int, error: Any) -> None:
        p = self._performer
        p._result(p.written, self._engine, self.token, self._handle, None if error is None else str(error))


class _Scattered:
    """A ``Land``'s copy into device memory finished (a copier thread): ``engine.scattered`` on the driver's thread."""

    __slots__ = ("_performer", "_engine", "_token")

    def __init__(self, performer: Performer, engine: Any, token: Any) -> None:
        self._performer, self._engine, self._token = performer, engine, token

    def __call__(self, error: str | None) -> None:
        self._performer._result(self._engine.scattered, self._token, error)
