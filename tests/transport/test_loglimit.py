"""LogLimit: the one limiter behind every "warn at most every 10 s" of the transport and the control plane."""

from __future__ import annotations

import pytest

from transport.loglimit import LogLimit


def test_first_line_at_once_then_quiet_then_the_count_held_back() -> None:
    limit = LogLimit(every=10.0)
    assert limit.ready("a", now=0.0) == 0
    assert [limit.ready("a", now=t) for t in (1.0, 2.0, 9.9)] == [None, None, None]
    assert limit.ready("a", now=10.0) == 3  # three held back since the last line
    assert limit.ready("a", now=10.5) is None
    assert limit.ready("a", now=30.0) == 1


def test_keys_are_limited_apart() -> None:
    limit = LogLimit(every=10.0)
    assert limit.ready("a", now=0.0) == 0
    assert limit.ready("b", now=1.0) == 0
    assert limit.ready("a", now=2.0) is None
    assert limit.ready(None, now=2.0) == 0  # the default key: one limiter for a single source


def test_the_keys_remembered_are_bounded_and_quiet_ones_forgotten_first() -> None:
    limit = LogLimit(every=10.0, max_keys=2)
    assert limit.ready("a", now=0.0) == 0 and limit.ready("b", now=5.0) == 0
    assert limit.ready("c", now=6.0) is None  # two keys still quiet: a third is not named
    assert limit.ready("c", now=11.0) == 0  # "a"'s quiet time is over: forgotten, room for "c"
    assert limit.ready("b", now=12.0) is None  # "b" was kept, and is still within its time


@pytest.mark.parametrize("every, max_keys", [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_bad_settings_are_refused_naming_them(every: float, max_keys: int) -> None:
    with pytest.raises(ValueError, match="every .* and max_keys"):
        LogLimit(every, max_keys)
