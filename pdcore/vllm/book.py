"""The connector's bookkeeping, free of vLLM: what the scheduler side remembers between steps, the
plan it hands the workers each step, and what each worker does with its pdcore peer.

Why it is split off the connector: vLLM calls the connector from two places (the scheduler, and
every worker, possibly other processes), and the rules of a request's life are the part that can
be wrong; here they are plain code over a ``PrefillPeer``/``DecodePeer``, tested without vLLM.

One request, Mooncake-style (the router gives both instances the same room at once):

- decode, scheduler: ``matched`` declares the prompt but its last token as external and async
  (vLLM recomputes the last token and samples the first itself), less the blocks decode's prefix
  cache holds already; ``allocated`` puts the blocks allocated for the rest into the next
  ``StepPlan`` as a ``Load`` (prefill writes the tail of its pages into them). A prompt decode holds
  whole (but its last token) loads nothing: its room is released (``Release``: registered and
  aborted at once, so prefill hears and runs it without waiting for an announcement).
- decode, worker: ``take`` registers the load with the peer; at its ``Bootstrapped`` the blocks
  are announced; ``RemotePrefillDone`` reports it received, ``Failed`` reports it received *and*
  its blocks as load errors (vLLM's ``kv_load_failure_policy`` recomputes or fails it). A request
  vLLM gives up while loading is aborted; its blocks come back only after pdcore's fence.
- prefill, scheduler: ``admitted`` registers the request (``Register``) when it arrives, and
  ``matched`` holds it back ("ask again later") until the workers report it ready: every decode
  rank announced its blocks (pdcore's ``Bootstrapped``; a hand-over before it would fail the
  room), or it failed (then it runs, its transfer ended). Admission is bounded
  (``max_transfers`` held at once): a request past the bound is not held, and its room is
  refused (``Refuse``: the workers abort it, so decode hears at once and computes the prompt
  itself); a prompt of one token (nothing for decode to fetch) is neither held nor told. A
  request vLLM preempts after its layers began to stream is aborted (its first pass's blocks
  are gone): decode hears and recomputes. ``scheduled`` marks the step that
  completes its prompt (``streams``: its layers go as they are saved, for prompts of at least
  ``layerwise_min_pages`` pages, so the writes overlap the forward pass); ``finished`` hands over
  the first token (``Finish``) and keeps the blocks (delayed free) until the worker reports the
  transfer ended.
- prefill, worker: hands over only after ``Bootstrapped``: layer by layer if it was bootstrapped
  when the prompt's last chunk ran, else the whole request once the first token is known;
  reports a request ready (``WorkerReport``) at its ``Bootstrapped`` or ``Failed``, and sent once
  pdcore ended it (``Succeeded`` or ``Failed``) and vLLM told this worker it finished (the
  scheduler frees the blocks then).

Both sides transfer ``pages_for(prompt_tokens)`` blocks, the blocks of the prompt but its last
token: decode holds exactly those when it announces, and a block is a pdcore page, so the counts
agree without a message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import CapacityError, PdError
from ..core.events import BootstrapInfo, Bootstrapped, Failed, RemotePrefillDone, Succeeded
from .params import Transfer

__all__ = ["pages_for", "Register", "Load", "Finish", "StepPlan", "SchedulerBook", "ProducerWorker",
           "ConsumerWorker"]

log = logging.getLogger("pdcore.vllm")

SLOW_AFTER = 10.0  # seconds a transfer may wait before its worker says so (once a request), with what its rank holds
# seconds a worker whose step computes nothing waits for its peer's news before it polls: vLLM steps again at once
# while requests wait for their transfers, and each step's poll is an agreement round over the replica (on a small
# machine decode's idle steps took most of two cores from prefill's forward passes); the wait ends at the peer's
# first news, so a landing is seen as soon as without it, and a new request waits at most this long to be scheduled
IDLE_WAIT = 0.01
_NAMED = 5  # slow requests named in one line


class _Laggards:
    """Transfers that wait long, said in the log once each, with what this rank's peer holds now.

    Why: a transfer waits on things spread over processes (a look-up, the other side's announcement,
    a data connection, a frame); when one waits far longer than its peers, the line each rank writes says
    which rank waits, in which state, and what its queues and engine hold, where a stall would otherwise
    show only as a slow request. Looked at once a second at most, from the step that polls."""

    def __init__(self, peer: Any, what: str, after: float, clock: Callable[[], float]) -> None:
        self._peer, self._what, self._after, self._clock = peer, what, after, clock
        self._next = 0.0

    def check(self, waiting: Iterable[tuple[str, Any]]) -> None:
        """``waiting``: (rid, its state object with ``since``, ``told`` and ``transfer``), oldest first."""
        now = self._clock()
        if now < self._next:
            return
        self._next = now + 1.0
        late = []
        for rid, st in waiting:
            if now - st.since <= self._after:
                break  # the rest came later
            if not st.told:
                st.told = True
                late.append((rid, st))
        if not late:
            return
        named = "; ".join(f"{rid} (room {st.transfer.room}, {now - st.since:.1f} s, {self._state(rid)})"
                          for rid, st in late[:_NAMED])
        more = f" and {len(late) - _NAMED} more" if len(late) > _NAMED else ""
        log.warning("pdcore: %d %s request(s) waiting over %g s for their transfer: %s%s; this rank: %s",
                    len(late), self._what, self._after, named, more, self._digest())

    def _state(self, rid: str) -> str:
        try:
            return str(self._peer.state(rid).name)
        except Exception:  # a diagnostic: whatever it cannot read, it says so
            return "state unknown"

    def _digest(self) -> str:
        """The non-zero parts of the peer's ``diagnostics()`` that say where a transfer waits."""
        try:
            d = self._peer.diagnostics()
        except Exception as e:
            return f"diagnostics failed: {e}"
        parts = [f"queues {_nonzero(d.get('queues', {}))}"]
        for role, held in d.get("engines", {}).items():
            parts.append(f"{role} engine {_nonzero(held)}")
        channel = d.get("channel", {})
        parts.append("control " + _nonzero({k: channel.get(k, 0) for k in (
            "peers_dead", "auth_failures", "connect_retries", "send_failures", "handshake_timeouts", "frames_refused",
            "protocol_errors", "quota_drops")}))
        return ", ".join(parts)


class _Idle:
    """A worker's wait on a step that computes nothing (``IDLE_WAIT``): for its peer's news, bounded."""

    def __init__(self, peer: Any, seconds: float) -> None:
        self._peer = peer
        self._seconds = seconds
        self.step = False  # this step's plan said idle
        self.waits = 0  # steps that waited (a metric the tests read)

    def wait(self, waiting: bool) -> None:
        """Before the poll of an idle step while transfers are ``waiting``: until the peer has news, or the bound."""
        if self.step and waiting and self._seconds > 0:
            self.waits += 1
            self._peer.wait_for_news(self._seconds)


def _nonzero(values: dict[str, Any]) -> str:
    kept = {k: v for k, v in values.items() if isinstance(v, (int, float)) and v}
    return str(kept) if kept else "{}"


def pages_for(prompt_tokens: int, block_size: int) -> int:
    """The blocks a transfer carries: those holding the prompt's first ``prompt_tokens - 1`` tokens."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return max(0, -(-(prompt_tokens - 1) // block_size))


@dataclass(frozen=True)
class Register:
    """Prefill: track ``rid`` for ``transfer``'s room."""

    rid: str
    transfer: Transfer


@dataclass(frozen=True)
class Load:
    """Decode: receive ``rid``'s KV into ``pages`` (prompt order) for ``transfer``'s room."""

    rid: str
    transfer: Transfer
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Finish:
    """Prefill: ``rid`` finished in vLLM: hand over ``pages`` with ``first_token``, or abort (None)."""

    rid: str
    pages: tuple[int, ...]
    first_token: int | None


@dataclass
class StepPlan:
    """What the scheduler side tells every worker for one step (pickled: workers may be processes)."""

    registers: list[Register] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    streams: dict[str, tuple[int, ...]] = field(default_factory=dict)
    finishes: list[Finish] = field(default_factory=list)
    aborts: list[tuple[str, int]] = field(default_factory=list)  # decode: (rid, room) given up while loading
    refusals: list[Register] = field(default_factory=list)  # prefill: rooms not taken (past max_transfers)
    preempted: list[str] = field(default_factory=list)  # prefill: requests vLLM preempted
    releases: list[Register] = field(default_factory=list)  # decode: rooms it needs nothing of (cached)
    idle: bool = False  # the step schedules no tokens: its workers run nothing but the poll (``IDLE_WAIT``)

    def __bool__(self) -> bool:
        return bool(self.registers or self.loads or self.streams or self.finishes or self.aborts or self.refusals
                    or self.preempted or self.releases)


class SchedulerBook:
    """The scheduler side's state: requests with a room, by vLLM request id (unique while live)."""

    def __init__(self, producer: bool, block_size: int, max_transfers: int = 1024) -> None:
        self.producer = producer
        self.block_size = block_size
        self.max_transfers = max_transfers
        self._plan = StepPlan()
        self._transfers: dict[str, Transfer] = {}  # producer: registered; consumer: loading
        self._prompt: dict[str, int] = {}  # producer: prompt tokens of registered requests
        self._attempted: set[str] = set()  # consumer: loaded once (a failed load is recomputed, not retried)
        self._delayed: set[str] = set()  # producer: blocks kept until the worker reports the transfer ended
        self._ready: set[str] = set()  # producer: registered requests the workers reported ready to run
        self._cached: dict[str, int] = {}  # consumer: tokens of a loading request decode's prefix cache held

    # -- decode ---------------------------------------------------------------------------

    def matched(self, rid: str, transfer: Transfer | None, prompt_tokens: int,
                computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: what decode loads (asynchronously) instead of computing;
        prefill: None (ask again later) while a registered request is not ready to run."""
        if self.producer:
            return (None, False) if rid in self._transfers and rid not in self._ready else (0, False)
        if transfer is None or rid in self._attempted:
            return 0, False
        external = prompt_tokens - 1 - computed_tokens  # (prefix-cache hits are whole blocks)
        if external > 0:
            self._cached[rid] = computed_tokens
            return external, True
        if pages_for(prompt_tokens, self.block_size):  # all cached: prefill, which holds it, hears at once
            self._attempted.add(rid)
            self._plan.releases.append(Register(rid, transfer))
        return 0, False

    def allocated(self, rid: str, transfer: Transfer | None, prompt_tokens: int, block_ids: Sequence[int],
                  external_tokens: int) -> None:
        """``update_state_after_alloc``: decode loads into the blocks; prefill registers the request."""
        if transfer is None or self.producer:
            return
        if external_tokens <= 0 or rid in self._attempted:
            return
        cached = self._cached.pop(rid, 0)
        n = pages_for(cached + external_tokens + 1, self.block_size)
        if len(block_ids) < n:
            raise RuntimeError(f"pdcore connector: request {rid!r} got {len(block_ids)} blocks for {external_tokens} "
                               f"tokens, {n} needed")
        self._attempted.add(rid)
        self._transfers[rid] = transfer
        first = cached // self.block_size
        if first:
            log.info("pdcore: request %s (room %d): %d of its %d blocks cached here, %d to load", rid, transfer.room,
                     first, n, n - first)
        self._plan.loads.append(Load(rid, transfer, tuple(int(b) for b in block_ids[first:n])))

    # -- prefill --------------------------------------------------------------------------

    def admitted(self, rid: str, transfer: Transfer | None, prompt_tokens: int) -> None:
        """``on_new_request``: prefill registers a request with a room at once (it runs once ready), unless
        there is nothing to send (a one-token prompt) or ``max_transfers`` are held (refused: decode hears)."""
        if not self.producer or transfer is None or rid in self._transfers:
            return
        if not pages_for(prompt_tokens, self.block_size):
            return  # decode holds the whole prompt but its last token already: no page to send, nobody waits
        if len(self._transfers) + len(self._delayed) >= self.max_transfers:
            log.warning("pdcore: %d transfers held (max_transfers): request %s (room %d) is served here alone",
                        self.max_transfers, rid, transfer.room)
            self._plan.refusals.append(Register(rid, transfer))
            return
        self._transfers[rid] = transfer
        self._prompt[rid] = prompt_tokens
        self._plan.registers.append(Register(rid, transfer))

    def preempted(self, rids: Iterable[str]) -> None:
        """Prefill: vLLM preempted these requests (their blocks went back; they run again from scratch)."""
        if self.producer:
            self._plan.preempted += [rid for rid in rids if rid in self._transfers]

    def scheduled(self, rid: str, block_ids: Sequence[int]) -> None:
        """Prefill: this step computes the last of ``rid``'s prompt: its layers may go as they are saved."""
        if self.producer and rid in self._transfers and rid not in self._delayed:
            n = pages_for(self._prompt[rid], self.block_size)
            if n:
                self._plan.streams[rid] = tuple(int(b) for b in block_ids[:n])

    def knows(self, rid: str) -> bool:
        """Prefill: ``rid`` was registered with the workers (``scheduled`` wants to hear of it)."""
        return rid in self._transfers

    def finished(self, rid: str, block_ids: Sequence[int], first_token: int | None) -> bool:
        """``request_finished``: whether vLLM must keep ``rid``'s blocks (True: until the worker reports it).

        Prefill: a registered request is handed over (``first_token``) or aborted (None). Decode: a
        request still loading is aborted; vLLM keeps its blocks itself until it is reported received.
        """
        transfer = self._transfers.get(rid)
        if not self.producer:
            self._attempted.discard(rid)  # it leaves vLLM: a reused id may load again
            self._cached.pop(rid, None)
            if transfer is not None:  # still loading
                del self._transfers[rid]
                self._plan.aborts.append((rid, transfer.room))
            return False
        if transfer is None:
            return False
        del self._transfers[rid]
        self._ready.discard(rid)
        prompt = self._prompt.pop(rid)
        pages = tuple(int(b) for b in block_ids[: pages_for(prompt, self.block_size)])
        self._plan.finishes.append(Finish(rid, pages, first_token))
        self._delayed.add(rid)
        return True

    # -- both -----------------------------------------------------------------------------

    def worker_output(self, finished_sending: Iterable[str] | None, finished_recving: Iterable[str] | None,
                      ready: Iterable[str] = ()) -> None:
        """``update_connector_output``: what every worker reported (vLLM aggregates the workers)."""
        for rid in ready:
            if rid in self._transfers:
                self._ready.add(rid)
        for rid in finished_sending or ():
            self._delayed.discard(rid)
        for rid in finished_recving or ():  # still attempted: a failed load is recomputed, never loaded again
            self._transfers.pop(rid, None)

    def pending_push(self) -> bool:
        """Prefill: a finished request's blocks wait for its transfer (the engine must keep stepping)."""
        return bool(self._delayed)

    def take_plan(self) -> StepPlan:
        """This step's plan; the next one starts empty."""
        plan, self._plan = self._plan, StepPlan()
        return plan


@dataclass
class _Sending:
    transfer: Transfer
    since: float = 0.0  # when the worker registered it (``_Laggards``)
    told: bool = False  # the log said it waits long
    pages: tuple[int, ...] | None = None
    first_token: int | None = None
    finished: bool = False  # vLLM sent its Finish (first token or abort)
    bootstrapped: bool = False
    begun: bool = False
    handed: bool = False
    ended: bool = False  # pdcore: Succeeded or Failed


class ProducerWorker:
    """A prefill worker's side: one ``PrefillPeer`` rank and its outbox."""

    def __init__(self, peer: Any, outbox: Any, replica: Any = None, layerwise_min_pages: int = 16, *,
                 slow_after: float = SLOW_AFTER, clock: Callable[[], float] = time.monotonic,
                 idle_wait: float = IDLE_WAIT) -> None:
        self._peer = peer
        self._clock = clock
        self._idle = _Idle(peer, idle_wait)
        self._laggards = _Laggards(peer, "prefill", slow_after, clock)
        self._outbox = outbox
        self._layerwise_min_pages = layerwise_min_pages  # shorter prompts go whole (pdcore would hold them anyway)
        self._replica = replica
        self._reqs: dict[str, _Sending] = {}
        self._streams: dict[str, tuple[int, ...]] = {}
        self._vllm_finished: set[str] = set()
        self._ready: set[str] = set()  # to report to the scheduler side (WorkerReport)
        self.counts = {"succeeded": 0, "failed": 0, "layer_by_layer": 0, "whole": 0, "refused": 0}

    def take(self, plan: StepPlan) -> None:
        """A step's plan: register new requests, note the prompts that complete, hand over finishes."""
        self._idle.step = plan.idle
        for reg in plan.refusals:  # not held here: decode hears at once (a tombstone answers its announcement)
            self._peer.abort_room(reg.rid, reg.transfer.room)
        for reg in plan.registers:
            if reg.rid in self._reqs:
                continue
            t = reg.transfer
            st = self._reqs[reg.rid] = _Sending(t, since=self._clock())
            try:
                self._peer.register(reg.rid, BootstrapInfo(t.host, t.port, t.room))
            except PdError as e:  # (never an error of the engine: this request is served here alone)
                log.warning("pdcore: prefill request %s (room %d) is served without a transfer: %s", reg.rid, t.room, e)
                st.ended = True
                self._ready.add(reg.rid)
                self.counts["refused"] += 1
                if isinstance(e, CapacityError):  # (a room held by another request is that one's to end)
                    self._peer.abort_room(reg.rid, t.room)
        for rid in plan.preempted:
            st = self._reqs.get(rid)
            if st is not None and st.begun and not st.ended:  # what streamed came from blocks vLLM took back
                log.warning("pdcore: prefill request %s (room %d) was preempted mid-transfer: aborted",
                            rid, st.transfer.room)
                self._peer.abort_room(rid, st.transfer.room)
        self._streams = {rid: pages for rid, pages in plan.streams.items()
                         if rid in self._reqs and len(pages) >= self._layerwise_min_pages}
        for fin in plan.finishes:
            st = self._reqs.get(fin.rid)
            if st is None:
                continue
            st.finished = True
            if st.ended:
                continue
            if fin.first_token is None:
                self._peer.abort_room(fin.rid, st.transfer.room)
                continue
            st.pages, st.first_token = fin.pages, fin.first_token
            self._try_hand_over(fin.rid, st)

    def layer_saved(self, layer: int) -> None:
        """Layer ``layer``'s KV of this step is in the cache: stream it for the prompts that completed."""
        for rid, pages in self._streams.items():
            st = self._reqs.get(rid)
            if st is None or st.ended or st.handed or not st.bootstrapped:
                continue
            if not st.begun:
                if layer != 0:
                    continue  # bootstrapped mid-pass: the whole request goes at its finish
                self._outbox.begin(rid, pages)
                st.begun = True
            self._outbox.layers_done(rid, layer + 1)

    def step_done(self, finished_req_ids: Iterable[str]) -> set[str]:
        """The end of a step: poll the peer; the requests whose transfer ended and vLLM finished."""
        self._streams = {}
        self._idle.wait(bool(self._reqs))
        self._vllm_finished.update(finished_req_ids)
        for event in self._peer.poll(self._replica):
            st = self._reqs.get(event.rid)
            if st is None:
                continue
            if isinstance(event, Bootstrapped):
                st.bootstrapped = True
                self._ready.add(event.rid)
                self._try_hand_over(event.rid, st)
            elif isinstance(event, (Succeeded, Failed)):
                st.ended = True
                self._ready.add(event.rid)
                if isinstance(event, Failed):
                    self.counts["failed"] += 1
                    log.warning("pdcore: prefill request %s (room %d) failed: %s", event.rid, st.transfer.room,
                                event.reason)
                else:
                    self.counts["succeeded"] += 1
                    log.info("pdcore: room %d sent (%s)", st.transfer.room,
                             "layer by layer" if st.begun else "whole, after the forward pass")
        done = {rid for rid, st in self._reqs.items() if st.ended and rid in self._vllm_finished}
        for rid in done:
            del self._reqs[rid]
            self._vllm_finished.discard(rid)
        # a request vLLM finished without ever registering it here is not ours to report
        self._vllm_finished.intersection_update(self._reqs)
        # waiting for decode's announcements (what comes after is vLLM's queue and forward pass)
        self._laggards.check((rid, st) for rid, st in self._reqs.items() if not (st.bootstrapped or st.ended))
        return done

    def take_ready(self) -> set[str]:
        """The requests that became ready to run (bootstrapped or failed) since the last call."""
        ready, self._ready = self._ready, set()
        return ready

    def pending(self) -> int:
        """Requests this worker still tracks."""
        return len(self._reqs)

    def _try_hand_over(self, rid: str, st: _Sending) -> None:
        if st.handed or not st.bootstrapped or st.first_token is None:
            return
        st.handed = True
        if st.begun:
            self.counts["layer_by_layer"] += 1
            self._outbox.finish(rid, st.first_token)
        else:
            self.counts["whole"] += 1
            assert st.pages is not None
            self._outbox.send(rid, st.pages, st.first_token)


@dataclass
class _Loading:
    transfer: Transfer
    pages: tuple[int, ...]
    index: int
    since: float = 0.0  # when the worker registered it (``_Laggards``)
    told: bool = False  # the log said it waits long
    aborted: bool = False


class ConsumerWorker:
    """A decode worker's side: one ``DecodePeer`` rank and its inbox."""

    def __init__(self, peer: Any, inbox: Any, replica: Any = None, *, slow_after: float = SLOW_AFTER,
                 clock: Callable[[], float] = time.monotonic, idle_wait: float = IDLE_WAIT) -> None:
        self._peer = peer
        self._clock = clock
        self._idle = _Idle(peer, idle_wait)
        self._laggards = _Laggards(peer, "decode", slow_after, clock)
        self._inbox = inbox
        self._replica = replica
        self._reqs: dict[str, _Loading] = {}
        self._refused: list[str] = []  # loads pdcore would not take: reported failed at the next step's end
        self._releases: set[str] = set()  # rooms released (nothing to load): their ends are nobody's business
        self._next_index = 0
        self.counts = {"landed": 0, "failed": 0, "released": 0}

    def take(self, plan: StepPlan) -> None:
        """A step's plan: register the new loads, release the rooms decode needs nothing of, abort the loads
        vLLM gave up."""
        self._idle.step = plan.idle
        for load in plan.loads:
            t = load.transfer
            self._reqs[load.rid] = _Loading(t, load.pages, self._next_index, since=self._clock())
            self._next_index = (self._next_index + 1) % (1 << 31)
            try:
                self._peer.register(load.rid, BootstrapInfo(t.host, t.port, t.room))
            except PdError as e:  # (never an error of the engine: vLLM recomputes it, by its policy)
                log.warning("pdcore: decode request %s (room %d) cannot load: %s", load.rid, t.room, e)
                self._refused.append(load.rid)
        for reg in plan.releases:
            key = f"release:{reg.rid}"
            try:
                self._peer.register(key, BootstrapInfo(reg.transfer.host, reg.transfer.port, reg.transfer.room))
            except PdError as e:  # prefill's own timer ends it then
                log.warning("pdcore: room %d of request %s cannot be released: %s", reg.transfer.room, reg.rid, e)
                continue
            self._releases.add(key)
            self.counts["released"] += 1
            self._peer.abort_room(key, reg.transfer.room)
        for rid, room in plan.aborts:
            st = self._reqs.get(rid)
            if st is not None and not st.aborted:
                st.aborted = True
                self._peer.abort_room(rid, room)

    def step_done(self) -> tuple[set[str], set[int]]:
        """The end of a step: poll the peer; the requests received (landed or failed) and the blocks
        of the failed ones (load errors: vLLM recomputes or fails them)."""
        received: set[str] = set()
        errors: set[int] = set()
        self._idle.wait(bool(self._reqs) and not self._refused)
        for rid in self._refused:
            received.add(rid)
            errors.update(self._reqs[rid].pages)
            self.counts["failed"] += 1
        self._refused = []
        for event in self._peer.poll(self._replica):
            if event.rid in self._releases:
                if not isinstance(event, Bootstrapped):
                    self._releases.discard(event.rid)
                continue
            st = self._reqs.get(event.rid)
            if st is None:
                continue
            if isinstance(event, Bootstrapped):
                self._inbox.announce(event.rid, st.pages, st.index)
            elif isinstance(event, RemotePrefillDone):
                received.add(event.rid)
                self.counts["landed"] += 1
                self.landed(event.rid, st.pages)
            elif isinstance(event, Failed):
                received.add(event.rid)
                self.counts["failed"] += 1
                if not st.aborted:
                    errors.update(st.pages)
                    log.warning("pdcore: decode request %s (room %d) failed: %s", event.rid, st.transfer.room,
                                event.reason)
        for rid in received:
            del self._reqs[rid]
        self._laggards.check((rid, st) for rid, st in self._reqs.items() if not st.aborted)
        return received, errors

    def landed(self, rid: str, pages: tuple[int, ...]) -> None:
        """Hook: ``rid``'s KV landed in ``pages`` (the end-to-end test's negative control overrides it)."""

    def pending(self) -> int:
        """Requests this worker still tracks."""
        return len(self._reqs)
