"""The table's events: the compiled module and its pure-Python source behave as one."""

from __future__ import annotations

import pickle

import pytest

from pdcore.core import _events as compiled  # ImportError: a broken build, as for the table
from pdcore.core import _events_py as pure
from pdcore.core import events
from pdcore.core.table import IMPLEMENTATION

TWINS = (compiled, pure)


@pytest.mark.parametrize("m", TWINS, ids=("compiled", "pure"))
def test_events_are_frozen_values(m) -> None:
    a, b = m.Succeeded("r1"), m.Succeeded("r1")
    assert a == b and hash(a) == hash(b) and a != m.Succeeded("r2")
    assert a != m.Bootstrapped("r1") and m.Bootstrapped("r1") != m.Failed("r1")  # the type is part of the value
    assert m.Failed("r1", "mine") == m.Failed("r1", "theirs")  # a rank's own reason is not part of it
    assert m.Failed("r1").reason == m.FAILED_ELSEWHERE == events.FAILED_ELSEWHERE
    assert isinstance(a, m.Event) and not isinstance(a, m.Failed)
    for event, field in ((a, "rid"), (m.Failed("r1", "x"), "reason")):
        with pytest.raises(AttributeError):
            setattr(event, field, "other")
    for event in (a, m.Bootstrapped("r1"), m.Failed("r1", "why")):
        back = pickle.loads(pickle.dumps(event))
        assert back == event and type(back) is type(event) and back.rid == event.rid
    assert m.Succeeded.__match_args__ == ("rid",) and m.Failed.__match_args__ == ("rid", "reason")


def test_the_twins_print_alike_and_the_library_uses_the_chosen_one() -> None:
    for name, args in (("Succeeded", ("r1",)), ("Bootstrapped", ("r1",)), ("Failed", ("r1", "why"))):
        assert repr(getattr(compiled, name)(*args)) == repr(getattr(pure, name)(*args))
    chosen = compiled if IMPLEMENTATION == "cython" else pure
    assert events.Succeeded is chosen.Succeeded and events.Event is chosen.Event
    done = events.RemotePrefillDone(events.RemotePrefill("r1", 7, 0, None, None, 0))
    assert isinstance(done, events.Event) and done.rid == "r1"
