"""The threaded driver: one thread runs a peer's engines; it performs their actions on the real planes.

An engine (``pdcore.protocol``) is sans-IO; this module is the other half. Every
input reaches the engines through ``submit`` (any thread: the scheduler's calls,
the control plane's frames and verdicts, the transport's completions, the I/O
threads' results), lands on one queue and is run on the driver's thread, with
``now`` appended: so no engine state is ever touched from two threads, and there
is no "queue full" path inside the protocol. After each input the driver
performs the engines' actions in order:

- ``Send`` on the control plane (never blocks; a failure with a token is fed back);
- ``Grant``, ``Revoke``, ``Disconnect``, ``Post`` on the transport, on this thread
  (a ``Revoke`` may wait up to its ``seconds`` for a write still landing into
  this rank's own memory; a ``Post`` never waits: one for a sink at its bound is
  parked for that sink and posted from its completions, ``Performer``); a
  ``Grant``'s and ``Revoke``'s outcome, and a ``Post`` that could not be
  posted, are fed back before the next action;
- ``Connect`` and ``LookUp`` on the I/O threads (they wait on other hosts), their
  results submitted back.

Inputs from other threads travel together (one lane, in the order they came): the first that finds
the lane empty puts one entry in the queue and wakes the driver; those that come before the driver
takes it join it, and the driver takes them as one hand-off, at most ``_BURST`` at a time with its
clock looked at in between. Under load they come in bursts (a transport's completions, a scheduler
round's calls), and each alone cost a queue entry, a wake-up and a hand-off. What the driver's own
thread queues (frames its plane read) keeps its own place in the queue, so an input of another thread
may run before one queued here earlier: never one it could have known of (the driver had not taken it,
so no other thread saw its effects).

Bounds: the inputs the scheduler's calls and the control plane make are counted
against ``max_inputs`` (past it ``submit`` raises ``CapacityError``, which the
caller turns into a failure of what it concerns); completions and I/O results
are bounded by their sources (the transport's in-flight bound, the I/O queue)
and always taken. ``close`` stops every thread within its deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transport.threads import named_thread

from ..control.bootstrap import BootstrapClient
from ..core.deadline import Deadline, DeadlineExceeded
from ..core.errors import CapacityError, PdError, PeerError
from ..protocol.actions import Connect, LookUp
from .perform import Performer

if TYPE_CHECKING:
    from transport.base import Transport

    from ..control.plane_base import PlaneBase

__all__ = ["Driver"]

log = logging.getLogger("pdcore.driver")

TICK = 0.05  # the longest the engines wait for their clock when idle
_IO_THREADS = 4
_BATCH = 64  # inputs taken between two passes of a plane's loop under a stream of them
_BURST = 16  # inputs of the lane taken at once (the clock is looked at between two bursts)
_LANE = ("lane",)  # the inbox's entry for the lane: a hand-off
_LANE_ON = ("lane, on",)  # the rest of a lane longer than a burst: the same hand-off, taken on
_LOOKUP_SLICE = 2.0  # seconds one bootstrap request may take on an I/O thread


class Driver(Performer):
    """Runs ``engines`` (attached with ``attach``) on one thread over ``transport`` and ``channel``."""

    def __init__(
        self,
        name: str,
        *,
        transport: Transport,
        channel: PlaneBase,
        secret: bytes | None,
        max_inputs: int,
        io_queue: int,
        stats: dict[str, int] | None = None,
    ) -> None:
        super().__init__(name, transport=transport, channel=channel, clock=time.monotonic, stats=stats)
        self.stats.setdefault("handoffs", 0)  # bursts of inputs this thread took from others (a cost metric)
        self.stats.setdefault("lane_inputs", 0)  # the inputs in them
        self._secret = secret
        self._max_inputs = max_inputs
        self._inbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._queued = 0  # bounded inputs queued (the scheduler's and the control plane's)
        self._count_lock = threading.Lock()
        self._io_items: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue(io_queue)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ident: int | None = None  # the driver thread's
        self._io_threads: list[threading.Thread] = []
        self._lane: list[tuple[Callable[..., Any], tuple[Any, ...], bool]] = []  # other threads' inputs (see above)
        self._lane_lock = threading.Lock()
        self.news = threading.Event()  # set once the driver ran an input (``PeerBase.wait_for_news``)
        # a plane whose loop this thread runs ("tcp"): it waits on the inbox's wake-ups and its sockets together
        self._serve: Callable[[float], None] | None = getattr(channel, "serve", None)
        self._wake: Callable[[], None] = lambda: None
        if self._serve is not None:
            channel.drive_externally()  # type: ignore[attr-defined]
            self._wake = channel.wake  # type: ignore[attr-defined]

    def depths(self) -> dict[str, int]:
        """Inputs and I/O items queued now (a metric)."""
        return {"inputs": self._queued, "io": self._io_items.qsize()}

    # -- any thread ---------------------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run the engine input ``fn(*args, now)`` on the driver's thread; never blocks.

        ``CapacityError`` past ``max_inputs`` queued, ``PeerError`` once closed."""
        if self._stop.is_set():
            raise PeerError(f"{self._name}: closed")
        with self._count_lock:
            if self._queued >= self._max_inputs:
                raise CapacityError(f"{self._name}: {self._queued} inputs already queued")
            self._queued += 1
        self._put((fn, args, True))

    def submit_result(self, fn: Callable[..., Any], *args: Any) -> None:
        """As ``submit``, for what the planes answer (completions, I/O results): never refused, never lost
        while the driver runs (bounded by its source: the transport's in-flight writes, the I/O queue)."""
        if not self._stop.is_set():
            self._put((fn, args, False))

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` (no ``now``, no engine) on the driver's thread, after what is queued (tests)."""
        self._put((lambda *a: fn(*a[:-1]), args, False))

    def _put(self, item: tuple[Callable[..., Any], tuple[Any, ...], bool]) -> None:
        """Into the inbox; from another thread, into the lane (the module docstring): its first input puts the
        lane's entry in the inbox and wakes the loop if it waits on a plane's sockets."""
        if threading.get_ident() == self._ident:
            self._inbox.put(item)
            return
        with self._lane_lock:
            first = not self._lane
            self._lane.append(item)
        if first:
            self._inbox.put(_LANE)
            self._wake()

    # -- start and stop -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = named_thread(self._run, f"pdcore-{self._name}-driver")
        self._io_threads = [named_thread(self._io_run, f"pdcore-{self._name}-io-{i}") for i in range(_IO_THREADS)]
        self._thread.start()
        for t in self._io_threads:
            t.start()

    def close(self, deadline: Deadline | None = None) -> None:
        """Stop the driver and the I/O threads (each within ``deadline``); idempotent."""
        self._stop.set()
        self._inbox.put(None)
        self._wake()
        for _ in self._io_threads:
            try:
                self._io_items.put_nowait(None)  # wake an idle I/O thread at once
            except queue.Full:
                break  # busy threads see the stop between items
        deadline = deadline or Deadline.after(5.0)
        for thread in (self._thread, *self._io_threads):
            if thread is not None and thread is not threading.current_thread():
                thread.join(deadline.remaining())
                if thread.is_alive():
                    raise PeerError(f"{self._name}: the {thread.name} thread did not stop by the deadline")

    def run_now(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run an engine input on the caller's thread: only when the driver's thread is not running
        (before ``start``, after ``close``), e.g. a farewell."""
        assert self._thread is None or not self._thread.is_alive()
        self.input(fn, args)

    # -- the driver's thread ------------------------------------------------------------------------

    def _run(self) -> None:
        """Inputs in arrival order; the engines' clock (``tick``) when their next deadline passes. A queued
        input is taken without asking the engines for their deadlines again: that question is asked only
        when the inbox runs dry, so under a stream of inputs a deadline waits at most ``TICK``."""
        self._ident = threading.get_ident()
        if self._serve is not None:
            self._run_serving(self._serve)
            return
        next_tick = due = time.monotonic()
        inbox = self._inbox
        while not self._stop.is_set():
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                due = min(next_tick, self._due(next_tick))
                try:
                    item = inbox.get(timeout=max(0.0, due - time.monotonic()))
                except queue.Empty:
                    item = None
            if item is not None:
                self._take(item)
            now = time.monotonic()
            if now >= due:
                self._tick_engines(now)
                next_tick = due = now + TICK  # the engines' own deadlines: asked again once the inbox is dry

    def _run_serving(self, serve: Callable[[float], None]) -> None:
        """``_run`` with a plane's loop: up to ``_BATCH`` inputs, then one pass of the plane (it sends what
        they owe its peers and reads what came), waiting in it only when the inbox is dry. The clock is
        looked at after every input, as in ``_run``."""
        next_tick = due = time.monotonic()
        inbox = self._inbox
        while not self._stop.is_set():
            waited = False
            for _ in range(_BATCH):
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    due = min(next_tick, self._due(next_tick))
                    serve(max(0.0, due - time.monotonic()))
                    waited = True
                    break
                if item is not None:
                    self._take(item)
                now = time.monotonic()
                if now >= due:
                    self._tick_engines(now)
                    next_tick = due = now + TICK
            if not waited:
                serve(0.0)
            now = time.monotonic()
            if now >= due:
                self._tick_engines(now)
                next_tick = due = now + TICK

    def _due(self, default: float) -> float:
        return min(self.next_deadline(), min((e.next_deadline() for e in self._engines), default=default))

    def _take(self, item: Any) -> None:
        self._take_item(item)
        if not self.news.is_set():  # set() takes the event's lock and notifies even when it is set already
            self.news.set()

    def _take_item(self, item: Any) -> None:
        if item is _LANE or item is _LANE_ON:
            with self._lane_lock:
                burst = self._lane[:_BURST]
                del self._lane[:_BURST]
                more = bool(self._lane)
            if item is _LANE:
                self.stats["handoffs"] += 1
            self.stats["lane_inputs"] += len(burst)
            if more:  # the rest after the clock's look (an entry of this thread's: no hand-off, no wake-up)
                self._inbox.put(_LANE_ON)
            for one in burst:
                self._take_one(one)
            return
        self._take_one(item)

    def _take_one(self, item: tuple[Callable[..., Any], tuple[Any, ...], bool]) -> None:
        fn, args, counted = item
        if counted:
            with self._count_lock:
                self._queued -= 1
        self.input(fn, args)

    def _tick_engines(self, now: float) -> None:
        self.expire(now)
        for engine in self._engines:
            self.input(engine.tick, ())

    # -- the I/O threads ----------------------------------------------------------------------------

    def _io(self, engine: Any, action: Connect | LookUp) -> None:
        fn = self._connect_io if type(action) is Connect else self._look_up_io
        try:
            self._io_items.put_nowait((fn, (engine, action)))
        except queue.Full:
            why = f"{self._io_items.maxsize} I/O items already queued"
            if isinstance(action, Connect):  # (not type() is: the checker narrows the else branch on isinstance)
                engine.connected(action.token, None, why, time.monotonic())
            else:
                engine.looked_up(action.server, None, {}, None, time.monotonic())

    def _result(self, fn: Callable[..., Any], *args: Any) -> None:
        self.submit_result(fn, *args)

    def _io_run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._io_items.get(timeout=1.0)  # close() wakes it with a None
            except queue.Empty:
                continue
            if item is None:
                continue
            try:
                item[0](*item[1])
            except Exception:
                self.stats["work_errors"] += 1
                log.exception("%s: I/O item failed", self._name)

    def _connect_io(self, engine: Any, action: Connect) -> None:
        """(Re)connect the transport to a sink; the engine adopts the outcome."""
        handle, error = None, ""
        try:
            if action.old is not None:
                self._transport.disconnect(action.old, deadline=Deadline.after(1.0))
            handle = self._transport.connect(action.endpoint, deadline=Deadline.after(action.seconds))
        except Exception as e:  # whatever it was, the rooms waiting for it must hear (else they wait forever)
            if not isinstance(e, PdError):
                log.exception("%s: connecting the transport failed unexpectedly", self._name)
            error = f"cannot connect the transport: {e}"
        self.submit_result(engine.connected, action.token, handle, error)

    def _look_up_io(self, engine: Any, action: LookUp) -> None:
        """What bootstrap ``action.server`` says of its deployment's shape and of the ranks asked for: only the
        I/O (the engine computes from it in its own input), and always an answer, whatever went wrong."""
        client = BootstrapClient(*action.server, secret=self._secret)
        info, ranks, error = None, {}, None
        try:
            if action.shape:
                info = client.parallel_info(Deadline.after(_LOOKUP_SLICE))
            for key in action.keys:
                ranks[key] = client.rank(*key, Deadline.after(_LOOKUP_SLICE))
        except (OSError, DeadlineExceeded) as e:
            log.debug("%s: bootstrap %s:%d not reachable yet: %s", self._name, *action.server, e)
        except PdError as e:
            error = str(e)
        except Exception as e:  # a bug of ours, or an answer nobody foresaw: the items that wait must hear
            log.exception("%s: looking up bootstrap %s:%d failed unexpectedly", self._name, *action.server)
            error = f"the look-up failed: {e!r}"
        self.submit_result(engine.looked_up, action.server, info, ranks, error)
