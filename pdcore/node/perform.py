"""Performing a role engine's actions on a peer's planes: the part of a driver that is not threads.

``Performer`` runs one input (``fn(*args, now)``) and then performs the actions
of the engines it concerns, in order, on the transport and the control plane
it was given (``pdcore.protocol.actions`` says what each action is and what is
fed back). ``Connect`` and ``LookUp`` wait on other hosts, so a subclass says
where they go (``_io``); completions come back on the transport's threads, so a
subclass says how they reach the engine (``_result``). The threaded driver
(``pdcore.node.driver``) and the simulator (``pdcore.sim``) are the two
subclasses: the same code performs every action in both.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ..core.deadline import Deadline
from ..core.errors import CapacityError, PdError
from ..protocol.actions import Connect, Disconnect, Grant, LookUp, Post, Revoke, Send

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
        self._engines: list[Any] = []
        self.stats = stats if stats is not None else {}  # the peer's own dict: work_errors, inputs
        self.stats.setdefault("work_errors", 0)
        self.stats.setdefault("inputs", 0)

    def attach(self, engine: Any) -> None:
        """Perform ``engine``'s actions too (before its first input)."""
        self._engines.append(engine)

    @property
    def engines(self) -> list[Any]:
        return list(self._engines)

    def _io(self, engine: Any, action: Connect | LookUp) -> None:
        """Do a ``Connect`` or ``LookUp`` where waiting on another host is fine; feed the outcome back."""
        raise NotImplementedError

    def _result(self, fn: Callable[..., Any], *args: Any) -> None:
        """Feed an answer of the planes (a completion) to the engine later, from any thread."""
        raise NotImplementedError

    def input(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.stats["inputs"] += 1
        try:
            fn(*args, self._clock())
        except Exception:  # a bug of ours or an unexpected failure: logged, counted, never fatal
            self.stats["work_errors"] += 1
            log.exception("%s: input %s failed", self._name, getattr(fn, "__qualname__", fn))
        engine = getattr(fn, "__self__", None)
        for e in self._engines if engine is None or engine not in self._engines else (engine,):
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
        elif kind is Connect:
            self._io(engine, action)
        elif kind is LookUp:
            self._io(engine, action)
        else:
            raise TypeError(f"not an action: {action!r}")

    def _post(self, engine: Any, post: Post) -> None:
        token = post.token
        done = functools.partial(self._completed, engine, token)
        try:
            self._transport.write(post.handle, post.batch, done, deadline=Deadline.after(post.wait) if post.wait else None,
                                  grant=post.grant)
            counts = engine.services.counts
            if counts is not None:  # counted once the transport took it (it may be on its way already)
                counts.writes_posted += len(post.batch)
                counts.bytes_posted += int(post.batch[:, 2].sum())
        except CapacityError:
            engine.written(token, f"the transport had no room for {post.wait:g} s", self._clock())
        except PdError as e:
            engine.written(token, f"posting the writes failed: {e}", self._clock())

    def _completed(self, engine: Any, token: Any, _batch: int, error: Any) -> None:
        """A transport thread: a posted batch completed; the engine hears on the driver's thread."""
        self._result(engine.written, token, None if error is None else str(error))

