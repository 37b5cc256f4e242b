"""RetryRevokes: a fence whose revoke was refused is tried again, never forgotten. LandedGrants: nor is the grant
of what landed, and their number bounds new grants (``full``), not forgetting."""

from __future__ import annotations

from types import SimpleNamespace

from pdcore.protocol.revokes import RETRY, LandedGrants, RetryRevokes


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
    its failure."""
    r: RetryRevokes[int] = RetryRevokes()
    tried: dict[int, float] = {}
    step = RETRY / 2  # also how often the tick asks: a retry may come up to one step after it is owed
    for i in range(40):
        r.add(i, i * step)
        for item in r.due((i + 1) * step):
            tried[item] = (i + 1) * step
    assert set(tried) >= set(range(38)), sorted(set(range(38)) - set(tried))
    assert all(tried[i] - i * step <= RETRY + step for i in tried), tried


def test_nothing_is_dropped_however_many_fail() -> None:
    fences: RetryRevokes[int] = RetryRevokes()
    for i in range(1000):
        fences.add(i, now=0.0)
    assert fences.due(RETRY) == list(range(1000))


def test_landed_grants_are_kept_until_a_revoke_is_confirmed_and_past_the_bound_it_is_full() -> None:
    """Refused revokes of landed grants: every one is tried again, tick after tick, however many there are, until
    its revoke goes through; while ``bound`` are unconfirmed the engine is told to grant nothing new."""
    grants = [SimpleNamespace(key=k) for k in range(1, 11)]
    landed = LandedGrants(bound=4)
    for g in grants[:3]:
        landed.failed(g, now=0.0)
    assert len(landed) == 3 and not landed.full()
    landed.failed(grants[3], now=0.0)
    assert landed.full()
    for g in grants[4:]:  # asks granted before the engine saw it full land too: none is forgotten
        landed.failed(g, now=0.0)
    now = 0.0
    for _ in range(5):  # refused again and again
        now += RETRY
        due = landed.due(now)
        assert [g.key for g in due] == [g.key for g in grants]
        for g in due:
            landed.failed(g, now)
    assert len(landed) == 10 and landed.full()
    for g in grants[:7]:
        landed.confirmed(g)
    assert len(landed) == 3 and not landed.full()
    landed.confirmed(grants[0])  # confirmed twice: no harm
    assert len(landed) == 3
    assert [g.key for g in landed.due(now + RETRY)] == [8, 9, 10]  # a confirmed grant is not revoked again


def test_what_waits_for_the_bound_goes_in_order_once_a_confirmation_brings_it_under() -> None:
    grants = [SimpleNamespace(key=k) for k in range(1, 4)]
    landed: LandedGrants[str] = LandedGrants(bound=2)
    for g in grants:
        landed.failed(g, now=0.0)
    landed.wait("ask a")
    landed.wait("ask b")
    landed.wait("ask c")
    landed.keep_waiting(lambda ask: ask != "ask b")  # its request ended meanwhile
    assert landed.confirmed(grants[0]) == [] and landed.waiting() == 2  # 2 left: still at the bound
    assert landed.confirmed(grants[1]) == ["ask a", "ask c"] and landed.waiting() == 0
    assert landed.confirmed(grants[2]) == []
