"""The transition grid obeys its own rules, and the compiled copy equals it."""

from __future__ import annotations

import itertools

from pdcore import _spec
from pdcore._spec import EventKind, State, Trigger, events_for

FAILING = {Trigger.FAIL, Trigger.TIMEOUT, Trigger.ABORT}


def test_compiled_grid_is_the_spec() -> None:
    from pdcore import _table

    grid, timers = _table.compiled_spec()
    assert grid == tuple(tuple(int(s) for s in row) for row in _spec.TRANSITIONS)
    assert timers == tuple(int(t) for t in _spec.TIMERS)


def test_every_pair_has_an_entry() -> None:
    assert len(_spec.TRANSITIONS) == len(State)
    assert all(len(row) == len(Trigger) for row in _spec.TRANSITIONS)


def test_live_states_only_move_forward_and_failures_lead_to_failed() -> None:
    for state, trigger in itertools.product(State, Trigger):
        new = _spec.TRANSITIONS[state][trigger]
        if state == State.FAILED or trigger in FAILING:
            assert new == State.FAILED, (state, trigger)
        else:
            assert new >= state, (state, trigger, new)
            assert new != State.FAILED, (state, trigger)


def test_failed_is_sticky() -> None:
    assert set(_spec.TRANSITIONS[State.FAILED]) == {State.FAILED}


def test_only_live_unfinished_states_carry_timers() -> None:
    assert _spec.TIMERS[State.FAILED] == _spec.TIMERS[State.SUCCESS] == _spec.Timer.NONE
    assert _spec.TIMERS[State.BOOTSTRAPPING] == _spec.Timer.BOOTSTRAP
    assert _spec.TIMERS[State.WAITING_FOR_INPUT] == _spec.TIMERS[State.TRANSFERRING] == _spec.Timer.WAITING


def test_events_cover_skipped_states_in_order() -> None:
    assert events_for(State.BOOTSTRAPPING, State.SUCCESS) == (EventKind.BOOTSTRAPPED, EventKind.SUCCEEDED)
    assert events_for(State.BOOTSTRAPPING, State.TRANSFERRING) == (EventKind.BOOTSTRAPPED,)
    assert events_for(State.BOOTSTRAPPED, State.SUCCESS) == (EventKind.SUCCEEDED,)
    assert events_for(State.BOOTSTRAPPING, State.FAILED) == (EventKind.FAILED,)
    assert events_for(State.WAITING_FOR_INPUT, State.FAILED) == (EventKind.FAILED,)
    assert events_for(State.BOOTSTRAPPED, State.WAITING_FOR_INPUT) == ()
