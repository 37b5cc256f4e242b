"""The transition grid obeys its own rules, and the compiled copy equals it."""

from __future__ import annotations

import itertools

from pdcore.core import _spec
from pdcore.core._spec import EventKind, State, Trigger, events_for

FAILING = {Trigger.FAIL, Trigger.TIMEOUT, Trigger.ABORT}


def test_compiled_grid_is_the_spec() -> None:
    from pdcore.core import _table

    grid, timers, arms = _table.compiled_spec()
    assert grid == tuple(tuple(int(s) for s in row) for row in _spec.TRANSITIONS)
    assert timers == tuple(int(t) for t in _spec.TIMERS)
    assert arms == {int(t) for t in _spec.ARMS_FENCE}


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


def code(state: State) -> int:
    return _spec.code_of(state, _spec.Fence.NONE, _spec.FREE)


def test_codes_keep_progress_order_and_put_failure_below_it() -> None:
    codes = [code(s) for s in State if s != State.FAILED]
    assert codes == sorted(codes) and codes[0] > _spec.CODE_FAILED > _spec.CODE_FAILING
    assert code(State.SUCCESS) == _spec.CODE_SUCCESS < _spec.FREE
    assert all(_spec.state_of_code(code(s)) == s for s in State if s != State.FAILED)


def test_a_failure_settles_only_after_the_replica_saw_it_and_the_fence_closed() -> None:
    F, Fence = State.FAILED, _spec.Fence
    assert _spec.code_of(F, Fence.NONE, code(State.BOOTSTRAPPED)) == _spec.CODE_FAILING  # not seen yet
    assert _spec.code_of(F, Fence.NONE, _spec.CODE_FAILING) == _spec.CODE_FAILED
    assert _spec.code_of(F, Fence.ARMED, _spec.CODE_FAILING) == _spec.CODE_FAILING  # fence still open
    assert _spec.code_of(F, Fence.DONE, _spec.CODE_FAILING) == _spec.CODE_FAILED


def test_events_cover_skipped_states_in_order() -> None:
    assert events_for(code(State.BOOTSTRAPPING), code(State.SUCCESS)) == (EventKind.BOOTSTRAPPED, EventKind.SUCCEEDED)
    assert events_for(code(State.BOOTSTRAPPING), code(State.TRANSFERRING)) == (EventKind.BOOTSTRAPPED,)
    assert events_for(code(State.BOOTSTRAPPED), code(State.SUCCESS)) == (EventKind.SUCCEEDED,)
    assert events_for(code(State.BOOTSTRAPPED), code(State.WAITING_FOR_INPUT)) == ()
    assert events_for(code(State.BOOTSTRAPPING), _spec.CODE_FAILING) == ()  # not settled: no event yet
    assert events_for(_spec.CODE_FAILING, _spec.CODE_FAILED) == (EventKind.FAILED,)
    assert events_for(code(State.WAITING_FOR_INPUT), _spec.CODE_FAILED) == (EventKind.FAILED,)


def test_twins_and_stub_expose_the_same_api() -> None:
    import ast
    import pathlib

    from pdcore.core import _table, _table_py

    public = lambda cls: {n for n in dir(cls) if not n.startswith("_")} | ({"__len__", "__contains__"} & set(dir(cls)))  # noqa: E731
    assert public(_table.StateTable) == public(_table_py.StateTable)
    stub = ast.parse(pathlib.Path(_table.__file__).with_name("_table.pyi").read_text())
    (cls,) = [n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "StateTable"]
    stubbed = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)} - {"__init__"}
    assert stubbed == public(_table_py.StateTable)


def test_the_chooser_follows_the_environment() -> None:
    import os
    import subprocess
    import sys

    code = "import pdcore.core.table as t; print(t.IMPLEMENTATION, t.StateTable.__module__)"
    for env, expected in (({"PDCORE_PURE_PYTHON": "1"}, "python pdcore.core._table_py"), ({}, "cython pdcore.core._table")):
        environ = {k: v for k, v in os.environ.items() if k != "PDCORE_PURE_PYTHON"} | env
        out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=60)
        assert out.stdout.split() == expected.split(), out.stderr
