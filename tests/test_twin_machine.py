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
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdcore import _table, _table_py
from pdcore._spec import CODE_FAILED, CODE_FAILING, CODE_SUCCESS, Fence, State, Trigger
from pdcore.errors import PdError
from pdcore.events import Bootstrapped, Failed, Succeeded

CAPACITY = 6
RIDS = st.sampled_from([f"r{i}" for i in range(9)])
TRIGGERS = st.sampled_from(list(Trigger)) | st.integers(-2, 9)


def outcome(call):
    """A call's result or its exception, in a form the twins must share."""
    try:
        return ("ok", call())
    except PdError as exc:
        return ("raised", type(exc).__name__, str(exc))


def detailed(events: list) -> list:
    return [(type(e).__name__, e.rid, getattr(e, "reason", None)) for e in events]


class Replica(RuleBasedStateMachine):
    @initialize(ranks=st.integers(1, 4), bootstrap=st.sampled_from([1.0, 5.0]), waiting=st.sampled_from([2.0, 7.0]))
    def start(self, ranks: int, bootstrap: float, waiting: float) -> None:
        def make(module):
            return module.StateTable(CAPACITY, bootstrap_timeout=bootstrap, waiting_timeout=waiting)

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
            assert rid in self.live or len(self.live) == CAPACITY

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
        if rid in self.live or len(self.live) == CAPACITY:
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


Replica.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestReplica = Replica.TestCase
