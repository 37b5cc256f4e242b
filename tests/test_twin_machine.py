"""Hypothesis drives a replica of simulated ranks, each holding both twins.

Every rule is applied to the compiled table and to the pure twin of every rank;
the MIN of the all-reduce is computed here. The twins must never differ (states,
events with their reasons, exceptions), and the replica must keep the
agreement's invariants:

- every rank emits the same events in the same order;
- each event at most once per request; a terminal event ends the request;
- Failed is sticky on every rank;
- the agreed state is the least advanced local state (MIN), never ahead of it;
- no event before its precondition: Bootstrapped only when every rank reached
  BOOTSTRAPPED, Succeeded only when every rank reached SUCCESS, Failed only when
  some rank failed; and Bootstrapped always precedes Succeeded, even when the
  agreed value skipped states.

The capacity is drawn across the compiled decode's eight-slot word (6, 9, 17:
below one word, one word and a tail, two words and a tail), and the scheduler
rules spread live requests over the slots, so the compiled fast path that skips
unchanged words runs next to the pure twin's slot-by-slot loop. Triggers are
weighted toward the fence path (pages announced, writes posted, failures).

The number of examples follows the hypothesis profile (``tests/conftest.py``):
``HYPOTHESIS_PROFILE=ci`` runs many more. ``test_every_cell_of_the_grid`` is the
deterministic complement: every (state, trigger) cell of ``_spec``, on both
twins, in a slot of every block position.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdcore.core import _table, _table_py
from pdcore.core import _spec
from pdcore.core._spec import CODE_FAILED, CODE_FAILING, CODE_SUCCESS, Fence, State, Timer, Trigger
from pdcore.core.errors import PdError
from pdcore.core.events import Bootstrapped, Failed, Succeeded

CAPACITIES = (6, 9, 17)  # below the compiled decode's 8-slot word, one word and a tail, two and a tail
RIDS = st.sampled_from([f"r{i}" for i in range(20)])
#: The fence path (announce, post, fail) counts twice as often as the rest.
FENCE_PATH = [Trigger.PAGES_ANNOUNCED, Trigger.WRITES_POSTED, Trigger.FAIL, Trigger.ABORT]
TRIGGERS = st.sampled_from(list(Trigger) + FENCE_PATH) | st.integers(-2, 9)


def outcome(call):
    """A call's result or its exception, in a form the twins must share."""
    try:
        return ("ok", call())
    except PdError as exc:
        return ("raised", type(exc).__name__, str(exc))


def detailed(events: list) -> list:
    return [(type(e).__name__, e.rid, getattr(e, "reason", None)) for e in events]


class Replica(RuleBasedStateMachine):
    @initialize(
        ranks=st.integers(1, 4),
        capacity=st.sampled_from(CAPACITIES),
        bootstrap=st.sampled_from([1.0, 5.0]),
        waiting=st.sampled_from([2.0, 7.0]),
    )
    def start(self, ranks: int, capacity: int, bootstrap: float, waiting: float) -> None:
        self.capacity = capacity

        def make(module):
            return module.StateTable(capacity, bootstrap_timeout=bootstrap, waiting_timeout=waiting)

        self.ranks = [(make(_table), make(_table_py)) for _ in range(ranks)]
        self.now = 0.0
        self.live: list[str] = []  # registration order, as the model sees it
        self.emitted: dict[str, list[str]] = {}  # rid -> event names in this incarnation
        self.ever_failed: set[tuple[int, str]] = set()
        self.fencing: list[list[str]] = [[] for _ in range(ranks)]

    # -- the scheduler's calls: identical on every rank -------------------------------

    @rule(rid=RIDS)
    def register(self, rid: str) -> None:
        results = {outcome(lambda t=t: t.register(rid, self.now)) for pair in self.ranks for t in pair}
        assert len(results) == 1, results
        (result,) = results
        if result[0] == "ok":
            assert rid not in self.live
            self.live.append(rid)
            self.emitted[rid] = []
        else:
            assert rid in self.live or len(self.live) == self.capacity

    @rule(data=st.data())
    def fill_and_thin(self, data) -> None:
        """The scheduler fills every free slot, then removes some requests: live slots end up
        spread over the table, in every position of the 8-slot words, with holes between."""
        for rid in [f"r{i}" for i in range(20)]:
            if len(self.live) == self.capacity:
                break
            if rid not in self.live:
                self.register(rid)
        for rid in list(self.live):
            if data.draw(st.integers(0, 2), label=f"remove {rid}?") == 0:
                self.remove(rid)

    @rule(rid=RIDS)
    def remove(self, rid: str) -> None:
        results = {outcome(lambda t=t: t.remove(rid)) for pair in self.ranks for t in pair}
        assert len(results) == 1, results
        if rid in self.live:
            self.live.remove(rid)
            self.ever_failed = {(k, r) for k, r in self.ever_failed if r != rid}

    # -- an I/O thread of one rank --------------------------------------------------------

    def pick_rid(self, data) -> str:
        """Mostly a live rid (updates of unknown rids are tested too, but rarely useful)."""
        if self.live and data.draw(st.integers(0, 9), label="live?") < 8:
            return data.draw(st.sampled_from(self.live), label="rid")
        return data.draw(RIDS, label="rid")

    @rule(data=st.data(), trigger=TRIGGERS, reason=st.sampled_from(["", "qp error", "peer lost"]))
    def update(self, data, trigger: int, reason: str) -> None:
        rid = self.pick_rid(data)
        k = data.draw(st.integers(0, len(self.ranks) - 1), label="rank")
        self.update_rank(k, rid, trigger, reason)

    @rule(data=st.data(), trigger=st.sampled_from(list(Trigger)[:4]))
    def update_everywhere(self, data, trigger: int) -> None:
        """The common case: every rank's part makes the same progress."""
        rid = self.pick_rid(data)
        for k in range(len(self.ranks)):
            self.update_rank(k, rid, trigger, "")

    def update_rank(self, k: int, rid: str, trigger: int, reason: str) -> None:
        compiled, pure = self.ranks[k]
        before = outcome(lambda: pure.state(rid))
        a = outcome(lambda: compiled.update(rid, trigger, self.now, reason))
        b = outcome(lambda: pure.update(rid, trigger, self.now, reason))
        assert a == b
        if a[0] == "ok":
            if before[1] == State.FAILED:
                assert a[1] == State.FAILED  # sticky
            if a[1] == State.FAILED:
                self.ever_failed.add((k, rid))

    @rule(data=st.data(), arm=st.sampled_from([Trigger.PAGES_ANNOUNCED, Trigger.WRITES_POSTED]))
    def fence_path(self, data, arm: int) -> None:
        """The path fence-before-free exists for: every rank arms the fence, then one rank fails."""
        if not self.live:
            return
        rid = data.draw(st.sampled_from(self.live), label="rid")
        for k in range(len(self.ranks)):
            self.update_rank(k, rid, arm, "")
        k = data.draw(st.integers(0, len(self.ranks) - 1), label="failing rank")
        self.update_rank(k, rid, data.draw(st.sampled_from([Trigger.FAIL, Trigger.ABORT]), label="how"), "qp error")

    @rule(dt=st.sampled_from([0.25, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    # -- a round -------------------------------------------------------------------------

    @rule()
    def round(self) -> None:
        agreed_before = {rid: self.ranks[0][1].agreed(rid) for rid in self.live}
        slot = {rid: self.ranks[0][1].slot(rid) for rid in self.live}
        reduced = None
        for twin in (0, 1):
            buffers = [pair[twin].encode(self.now) for pair in self.ranks]
            reduced = np.minimum.reduce([b.copy() for b in buffers])
            for b in buffers:
                b[:] = reduced
        # after the fold, before the decode: what each rank held when it reduced
        held = {rid: [(pure.state(rid), pure.fence(rid)) for _, pure in self.ranks] for rid in self.live}
        results = [[outcome(pair[twin].decode) for pair in self.ranks] for twin in (0, 1)]
        for rank_results in results:
            assert len({r[0] for r in rank_results}) == 1  # all ranks raise or none
        assert [detailed(r[1]) for r in results[0]] == [detailed(r[1]) for r in results[1]], "twins differ"
        per_rank = [r[1] for r in results[0]]
        assert all(events == per_rank[0] for events in per_rank), "ranks emitted different events"
        self.check_events(per_rank[0], {rid: int(reduced[slot[rid]]) for rid in self.live}, held, agreed_before)

    def check_events(self, events: list, code: dict, held: dict, agreed_before: dict) -> None:
        order = [e.rid for e in events]
        assert order == sorted(order, key=self.live.index), "events not in registration order"
        for event in events:
            rid = event.rid
            states = [state for state, _ in held[rid]]
            seen = self.emitted[rid]
            assert not seen or seen[-1] == "Bootstrapped", f"event after a terminal event for {rid}"
            if isinstance(event, Bootstrapped):
                assert "Bootstrapped" not in seen
                assert min(states) >= State.BOOTSTRAPPED
            elif isinstance(event, Succeeded):
                assert all(s == State.SUCCESS for s in states)
                assert seen == ["Bootstrapped"], "Succeeded without Bootstrapped before it"
            else:
                assert isinstance(event, Failed)
                # settled everywhere: every rank failed, saw the failure agreed, and closed its fence
                assert all(s == State.FAILED and f != Fence.ARMED for s, f in held[rid])
                assert agreed_before[rid] == State.FAILED
            seen.append(type(event).__name__)
        for rid in list(self.live):
            if code[rid] in (CODE_FAILED, CODE_SUCCESS):
                assert self.emitted[rid][-1] in ("Failed", "Succeeded"), f"{rid} agreed terminal, no event"
                self.live.remove(rid)
                self.ever_failed = {(k, r) for k, r in self.ever_failed if r != rid}
                continue
            assert not self.emitted[rid] or self.emitted[rid] == ["Bootstrapped"]
            for compiled, pure in self.ranks:
                assert compiled.agreed(rid) == pure.agreed(rid)
                if code[rid] == CODE_FAILING:  # the replica stops the request on every rank
                    assert pure.state(rid) == State.FAILED and pure.agreed(rid) == State.FAILED
                elif agreed_before[rid] != State.FAILED:
                    assert pure.agreed(rid) == max(State(code[rid] - 1), agreed_before[rid])
            if code[rid] - 1 >= State.BOOTSTRAPPED:
                assert self.emitted[rid] == ["Bootstrapped"]

    @rule(data=st.data())
    def close_fences(self, data) -> None:
        """A rank's I/O side drains the rids it must fence and confirms some of them."""
        k = data.draw(st.integers(0, len(self.ranks) - 1), label="rank")
        compiled, pure = self.ranks[k]
        pending = pure.take_fencing()
        assert compiled.take_fencing() == pending
        self.fencing[k].extend(pending)
        for rid in list(self.fencing[k]):
            if data.draw(st.booleans(), label=f"fence {rid}"):
                self.fencing[k].remove(rid)
                assert outcome(lambda: compiled.fenced(rid)) == outcome(lambda: pure.fenced(rid))

    # -- always ----------------------------------------------------------------------------

    @invariant()
    def twins_and_model_agree(self) -> None:
        if not hasattr(self, "ranks"):
            return
        for k, (compiled, pure) in enumerate(self.ranks):
            assert compiled.rids() == pure.rids() == self.live
            assert compiled.has_in_flight() == pure.has_in_flight() == bool(self.live)
            for rid in self.live:
                assert compiled.state(rid) == pure.state(rid)
                assert compiled.fence(rid) == pure.fence(rid)
                assert compiled.slot(rid) == pure.slot(rid) == self.ranks[0][0].slot(rid)
                if (k, rid) in self.ever_failed:
                    assert pure.state(rid) == State.FAILED

    @precondition(lambda self: hasattr(self, "ranks") and len(self.ranks) > 1)
    @rule(rid=RIDS)
    def diverge(self, rid: str) -> None:
        """One rank registers alone: the next round must raise CollectiveError on every rank."""
        lone_c, lone_p = self.ranks[-1]
        if rid in self.live or len(self.live) == self.capacity:
            return
        lone_c.register(rid, self.now)
        lone_p.register(rid, self.now)
        for twin in (0, 1):
            buffers = [pair[twin].encode(self.now) for pair in self.ranks]
            reduced = np.minimum.reduce([b.copy() for b in buffers])
            for b in buffers:
                b[:] = reduced
            raised = [outcome(pair[twin].decode)[:2] for pair in self.ranks]
            assert raised == [("raised", "CollectiveError")] * len(self.ranks)
        lone_c.remove(rid)
        lone_p.remove(rid)


# max_examples comes from the loaded profile (tests/conftest.py): 150 by default, more under HYPOTHESIS_PROFILE=ci
Replica.TestCase.settings = settings(stateful_step_count=50, deadline=None)
TestReplica = Replica.TestCase


# -- every cell of the grid, deterministically ---------------------------------------------------

#: A path of triggers from BOOTSTRAPPING to each state (each step is itself a checked cell).
PATHS = {
    State.BOOTSTRAPPING: (),
    State.BOOTSTRAPPED: (Trigger.PEERS_CONNECTED,),
    State.WAITING_FOR_INPUT: (Trigger.PEERS_CONNECTED, Trigger.PAGES_ANNOUNCED),
    State.TRANSFERRING: (Trigger.PEERS_CONNECTED, Trigger.PAGES_ANNOUNCED, Trigger.WRITES_POSTED),
    State.SUCCESS: (Trigger.PEERS_CONNECTED, Trigger.WRITES_LANDED),
    State.FAILED: (Trigger.PEERS_CONNECTED, Trigger.FAIL),
}


def model(steps: tuple) -> list[tuple[State, bool, int]]:
    """(state, fence armed, rids handed to take_fencing) after each step, read from ``_spec`` alone."""
    state, armed, fencing, out = State.BOOTSTRAPPING, False, 0, []
    for trigger in steps:
        new = _spec.TRANSITIONS[state][trigger]
        armed = armed or (trigger in _spec.ARMS_FENCE and state != State.FAILED)
        fencing += new != state and new == State.FAILED and armed
        state = new
        out.append((State(state), armed, fencing))
    return out


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_every_cell_of_the_grid(table_impl: ModuleType, capacity: int) -> None:
    """Each (state, trigger) pair of ``_spec.TRANSITIONS``, on this twin, in a slot at every
    position of an 8-slot word (first, middle, last, the tail) with the other slots live: the
    state returned and kept, the fence, the rids to fence, the byte encoded for the MIN, and the
    timer the new state carries."""
    registered = _spec.code_of(State.BOOTSTRAPPING, Fence.NONE, _spec.FREE)
    for state in State:
        for trigger in Trigger:
            steps = (*PATHS[state], trigger)
            expected = model(steps)
            assert (model(PATHS[state])[-1][0] if PATHS[state] else State.BOOTSTRAPPING) == state  # the path is right
            for slot in sorted({0, min(3, capacity - 1), min(7, capacity - 1), capacity - 1}):
                t = table_impl.StateTable(capacity, bootstrap_timeout=1.0, waiting_timeout=2.0)
                for i in range(capacity):
                    t.register(f"other{i}" if i != slot else "cell", 0.0)
                assert t.slot("cell") == slot
                for step, (trig, (want, armed, fencing)) in enumerate(zip(steps, expected)):
                    got = t.update("cell", trig, 0.0, "why")
                    where = f"{state.name} x {trigger.name}, step {step} ({Trigger(trig).name}), slot {slot} of {capacity}"
                    assert got == want == t.state("cell"), where
                    assert t.fence("cell") == (Fence.ARMED if armed else Fence.NONE), where
                want, armed, fencing = expected[-1]
                assert t.take_fencing() == ["cell"] * fencing, where
                buf = t.encode(0.0)
                assert buf[slot] == _spec.code_of(want, Fence.ARMED if armed else Fence.NONE, registered), where
                assert all(buf[i] == registered for i in range(capacity) if i != slot), where
                t.fold(0.999)  # no timer is due yet (the shortest is 1 s)
                assert t.state("cell") == want, where
                t.fold(2.0)  # every timer is due: a state that carries one times out, others stay
                timed_out = _spec.TIMERS[want] != Timer.NONE
                assert t.state("cell") == (State.FAILED if timed_out else want), where
