"""RetryRevokes: a fence whose revoke was refused is tried again, never forgotten; what nothing waits on is bounded."""

from __future__ import annotations

from pdcore.protocol.revokes import RETRY, RetryRevokes


def test_a_failed_revoke_is_due_again_retry_after_its_last_failure_and_once() -> None:
    r: RetryRevokes[str] = RetryRevokes()
    assert r.next_deadline() == float("inf") and r.due(0.0) == []
    r.add("room 1", now=1.0)
    r.add("room 1", now=1.02)  # failed twice: still one retry, after the later failure
    assert len(r) == 1 and r.next_deadline() == 1.02 + RETRY
    assert r.due(1.02 + RETRY / 2) == []
    assert r.due(1.02 + RETRY) == ["room 1"]
    assert len(r) == 0 and r.next_deadline() == float("inf")  # taken out: only a new failure brings it back


def test_without_a_limit_nothing_is_dropped_and_with_one_the_oldest_go() -> None:
    fences: RetryRevokes[int] = RetryRevokes()
    landed: RetryRevokes[int] = RetryRevokes(limit=3)
    for i in range(10):
        fences.add(i, now=0.0)
        landed.add(i, now=0.0)
    assert fences.due(RETRY) == list(range(10))
    assert landed.due(RETRY) == [7, 8, 9]
