"""RetryRevokes: a fence whose revoke was refused is tried again, never forgotten; what nothing waits on is bounded."""

from __future__ import annotations

from pdcore.protocol.revokes import RETRY, RetryRevokes


def test_a_failed_revoke_is_due_again_retry_after_its_first_failure_and_once() -> None:
    r: RetryRevokes[str] = RetryRevokes()
    assert r.next_deadline() == float("inf") and r.due(0.0) == []
    r.add("room 1", now=1.0)
    r.add("room 1", now=1.02)  # failed twice: still one retry, owed since the first failure
    assert len(r) == 1 and r.next_deadline() == 1.0 + RETRY
    assert r.due(1.0 + RETRY / 2) == []
    assert r.due(1.0 + RETRY) == ["room 1"]
    assert len(r) == 0 and r.next_deadline() == float("inf")  # taken out: only a new failure brings it back


def test_a_stream_of_new_failures_never_postpones_the_retry_of_an_old_one() -> None:
    """Revokes failing every RETRY/2 (a flaky data plane under load): each one is tried again within RETRY of
    its failure, and, with a bound, none is dropped before it was tried again (a dropped grant stays live)."""
    r: RetryRevokes[int] = RetryRevokes(limit=4)
    tried: dict[int, float] = {}
    step = RETRY / 2  # also how often the tick asks: a retry may come up to one step after it is owed
    for i in range(40):
        r.add(i, i * step)
        for item in r.due((i + 1) * step):
            tried[item] = (i + 1) * step
    assert set(tried) >= set(range(38)), sorted(set(range(38)) - set(tried))
    assert all(tried[i] - i * step <= RETRY + step for i in tried), tried


def test_without_a_limit_nothing_is_dropped_and_with_one_the_oldest_go() -> None:
    fences: RetryRevokes[int] = RetryRevokes()
    landed: RetryRevokes[int] = RetryRevokes(limit=3)
    for i in range(10):
        fences.add(i, now=0.0)
        landed.add(i, now=0.0)
    assert fences.due(RETRY) == list(range(10))
    assert landed.due(RETRY) == [7, 8, 9]
