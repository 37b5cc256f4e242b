"""The agreement over real torch.distributed gloo groups, one process per rank."""

from __future__ import annotations

import importlib
import time

import pytest

from replica import run_replica

pytestmark = pytest.mark.slow

TWINS = ["pdcore.core._table", "pdcore.core._table_py"]


MODES = ["shm", "group"]


def _progress_both(rank: int, world: int) -> dict:
    return {(module, mode): _progress(rank, world, module, mode) for module in TWINS for mode in MODES}


def _mismatch_both(rank: int, world: int) -> dict:
    out = {module: _mismatch(rank, world, module) for module in TWINS}
    for module in TWINS:  # the same process group: no second spawn
        for case in SAME_COUNT_CASES:
            out[(module, case)] = _same_count(rank, world, module, case)
    return out


def _progress(rank: int, world: int, module: str, mode: str) -> list:
    """Every rank registers the same 8 rids; rank k advances them on its own schedule."""
    import torch.distributed as dist

    from pdcore.core._spec import Trigger
    from pdcore.core.agreement import Agreement

    table = importlib.import_module(module).StateTable(64, bootstrap_timeout=30.0, waiting_timeout=30.0)
    agreement = Agreement(table, agreement=mode)
    rids = [f"req-{i}" for i in range(8)]
    for rid in rids:
        table.register(rid, 0.0)
    rounds = []
    for rnd in range(8):
        step = rnd - rank  # rank k lags k rounds behind the others
        for rid in table.rids():
            i = int(rid.split("-")[1])
            if i == 5 and rank == world - 1 and step == 1:
                table.update(rid, Trigger.FAIL, 1.0, f"rank {rank} lost its peer")
            elif step == 0 and i % 2:  # odd rids connect first; even ones jump straight to landed
                table.update(rid, Trigger.PEERS_CONNECTED, 1.0)
            elif step == 2:
                table.update(rid, Trigger.WRITES_LANDED, 1.0)
        events = agreement.round(1.0, dist.group.WORLD)
        rounds.append([(type(e).__name__, e.rid, getattr(e, "reason", None)) for e in events])
    return rounds


WORLDS = [2, pytest.param(4, marks=pytest.mark.long)]  # four ranks: make test-long (and CI)


@pytest.fixture(scope="module", params=WORLDS)
def progress_runs(request: pytest.FixtureRequest) -> tuple[int, dict]:
    """Both twins in one process group per world size (one spawn, two checks)."""
    per_rank = run_replica(_progress_both, request.param)
    return request.param, {(m, mode): [r[(m, mode)] for r in per_rank] for m in TWINS for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("module", TWINS)
def test_every_rank_gets_the_same_events(progress_runs: tuple[int, dict], module: str, mode: str) -> None:
    world, runs = progress_runs
    per_rank = runs[(module, mode)]
    names = [[[(kind, rid) for kind, rid, _ in rnd] for rnd in rounds] for rounds in per_rank]
    assert all(n == names[0] for n in names), "ranks disagree"
    flat = [e for rnd in names[0] for e in rnd]
    assert len(flat) == len(set(flat)), "an event came twice"
    for i in range(8):
        rid = f"req-{i}"
        mine = [kind for kind, r in flat if r == rid]
        if i == 5:
            assert mine[-1] == "Failed"  # one rank's failure fails it everywhere
        else:
            assert mine == ["Bootstrapped", "Succeeded"], (rid, mine)
    # the lagging rank holds everyone back: nothing succeeds before the last rank lands
    first_success = min(k for k, rnd in enumerate(names[0]) if any(kind == "Succeeded" for kind, _ in rnd))
    assert first_success == world - 1 + 2
    # every rank names the cause the failing rank knows, in the same round
    reasons = {
        rank: next(reason for rnd in rounds for kind, rid, reason in rnd if kind == "Failed")
        for rank, rounds in enumerate(per_rank)
    }
    assert all(reasons[r] == f"rank {world - 1} lost its peer" for r in range(world)), reasons


def _mismatch(rank: int, world: int, module: str) -> dict:
    """Rank 1 registers one rid the others never see; the next round must raise everywhere."""
    import torch.distributed as dist

    from pdcore.core.agreement import Agreement
    from pdcore.core.errors import CollectiveError

    table = importlib.import_module(module).StateTable(32)
    agreement = Agreement(table)
    for rid in ("a", "b", "c"):
        table.register(rid, 0.0)
    first = agreement.round(0.0, dist.group.WORLD)
    if rank == 1:
        table.register("only-on-rank-1", 0.0)
    started = time.monotonic()
    try:
        agreement.round(0.0, dist.group.WORLD)
    except CollectiveError as exc:
        return {"first": first, "error": str(exc), "seconds": time.monotonic() - started, "rids": table.rids()}
    return {"first": first, "error": None}


@pytest.fixture(scope="module", params=WORLDS)
def mismatch_runs(request: pytest.FixtureRequest) -> dict:
    per_rank = run_replica(_mismatch_both, request.param, timeout=90.0)
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


@pytest.mark.parametrize("module", TWINS)
def test_mismatched_registration_raises_on_every_rank_in_one_round(mismatch_runs: dict, module: str) -> None:
    per_rank = mismatch_runs[module]
    assert all(r["first"] == [] for r in per_rank)
    for rank, r in enumerate(per_rank):
        assert r["error"] is not None, f"rank {rank} did not notice the mismatch"
        assert "different numbers of live requests" in r["error"]
        assert f"this rank {4 if rank == 1 else 3}" in r["error"]
        assert r["rids"] == (["a", "b", "c", "only-on-rank-1"] if rank == 1 else ["a", "b", "c"])  # unchanged


#: Every rank holds as many requests as the others, but not the same (slot, rid) pairs.
SAME_COUNT_CASES = {
    "other-rids": lambda rank: ["d", "e"] if rank == 0 else ["d", f"f{rank}"],
    "same-rids-other-order": lambda rank: ["d", "e"] if rank == 0 else ["e", "d"],
}


def _same_count(rank: int, world: int, module: str, case: str) -> dict:
    """Three rounds: agreed on a, b, c; then each rank registers two more rids (same count on
    every rank, different rids or order on rank 0) that every rank has landed; then one more.
    The second round must raise CollectiveError on every rank and change nothing."""
    import torch.distributed as dist

    from pdcore.core._spec import Trigger
    from pdcore.core.agreement import Agreement
    from pdcore.core.errors import CollectiveError

    table = importlib.import_module(module).StateTable(16)
    agreement = Agreement(table)
    for rid in ("a", "b", "c"):
        table.register(rid, 0.0)
    rounds: list = [[type(e).__name__ for e in agreement.round(0.0, dist.group.WORLD)]]
    for rid in SAME_COUNT_CASES[case](rank):
        table.register(rid, 0.0)
        table.update(rid, Trigger.WRITES_LANDED, 0.0)  # without the check, each would succeed now
    for _ in range(2):
        try:
            rounds.append([(type(e).__name__, e.rid) for e in agreement.round(0.0, dist.group.WORLD)])
        except CollectiveError as exc:
            rounds.append(("CollectiveError", str(exc)))
    return {"rounds": rounds, "rids": table.rids()}


@pytest.mark.parametrize("case", sorted(SAME_COUNT_CASES))
@pytest.mark.parametrize("module", TWINS)
def test_same_count_other_requests_raise_on_every_rank_in_one_round(mismatch_runs: dict, module: str, case: str) -> None:
    """A count is not an identity: ranks with as many requests but other rids (or the same rids in
    other slots) would each decode another request's agreed state. Every rank refuses, in the same round."""
    per_rank = mismatch_runs[(module, case)]
    for rank, r in enumerate(per_rank):
        first, second, third = r["rounds"]
        assert first == [], f"rank {rank}: the agreed round emitted {first}"
        assert second[0] == "CollectiveError", f"rank {rank} decoded {second} instead of refusing"
        assert "live requests each, but not the same (slot, rid) set" in second[1]
        assert third[0] == "CollectiveError", f"rank {rank}: the mismatch stays until the scheduler repairs it"
        assert r["rids"] == ["a", "b", "c", *SAME_COUNT_CASES[case](rank)]  # nothing succeeded, nothing freed
