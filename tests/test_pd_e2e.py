"""End-to-end: real processes, real sockets, real gloo groups (``pdcore.tools.demo.run``).

Every rank of every replica is its own process running a miniature scheduler
around its peer; the main process runs the bootstrap servers and injects the
faults (``Plan.kill``, ``Plan.prefill_abort``, ``Plan.prefill_abort_bootstrapped``,
``Plan.decode_stall``). Each rank logs its events ``(kind, rid, wall time)``;
these tests judge the logs, the verified bytes and what every peer still holds
at the end.

Timing: every wait of the runner is bounded by ``Plan.timeout``; timers the
tests do not exercise are set far beyond it (60 s), so a failure that arrives
in time can only have come from the mechanism under test. Bounds on event
times are generous (the machine is shared) and compared with those 60 s, not
with a tight budget.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from pdcore.tools.demo import Outcome, Plan, make_requests, run

pytestmark = pytest.mark.slow

SUCCESS = {"Succeeded", "RemotePrefillDone"}
TERMINAL = SUCCESS | {"Failed"}
MARGIN = 3.0  # seconds of scheduling noise allowed on top of a protocol bound


def _small(**knobs: Any) -> dict[str, Any]:
    """Cache geometry and timers shared by the tests: small pages, far-away timers."""
    base: dict[str, Any] = dict(
        layers=2,
        page_bytes=4096,
        num_pages=1024,
        timeout=60.0,
        bootstrap_timeout=60.0,
        waiting_timeout=60.0,
        fence_timeout=60.0,
        heartbeat_interval=0.25,
        dead_after=1.5,
    )
    base.update(knobs)
    return base


def _events(result: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """rid -> [(kind, wall time)] in log order."""
    out: dict[str, list[tuple[str, float]]] = {}
    for kind, rid, at in result["log"]:
        out.setdefault(rid, []).append((kind, at))
    return out


def _terminal(result: dict[str, Any]) -> dict[str, tuple[str, float]]:
    """rid -> its one terminal event; fails if any rid ended twice."""
    ends: dict[str, tuple[str, float]] = {}
    for kind, rid, at in result["log"]:
        if kind in TERMINAL:
            assert rid not in ends, f"{rid} ended twice: {ends[rid][0]} and {kind}"
            ends[rid] = (kind, at)
    return ends


def _first(result: dict[str, Any], kind: str) -> dict[str, float]:
    return {rid: at for k, rid, at in result["log"] if k == kind}


def _check_clean(outcome: Outcome, *, expect_ranks: int) -> None:
    """No rank crashed, every expected rank reported, every replica's ranks logged the same events."""
    assert not outcome.errors, "\n".join(outcome.errors)
    assert len(outcome.prefill) + len(outcome.decode) == expect_ranks
    assert outcome.prefill_logs_agree(), "prefill ranks of one replica saw different events"
    assert outcome.decode_logs_agree(), "decode ranks of one replica saw different events"
    for (index, rank), result in outcome.decode.items():
        assert result["unfinished"] == 0, f"decode {index} rank {rank}: {result['unfinished']} requests never ended"
        assert not result["mismatched"], f"decode {index} rank {rank}: bytes differ for {result['mismatched'][:5]}"
        assert not result["tokens_bad"], f"decode {index} rank {rank}: wrong first token for {result['tokens_bad'][:5]}"
    for role, ranks in (("prefill", outcome.prefill), ("decode", outcome.decode)):
        for (index, rank), result in ranks.items():
            where = f"{role} {index} rank {rank}"
            assert not result["in_flight"], f"{where}: has_in_flight() at the end"
            assert result["tracked"] == 0, f"{where}: {result['tracked']} requests still in the table"
            assert not any(result["maps"].values()), f"{where}: bookkeeping left over: {result['maps']}"


def _all_succeeded(outcome: Outcome, plan: Plan) -> None:
    for (index, rank), result in outcome.prefill.items():
        mine = {r.rid for r in plan.requests if r.prefill == index}
        ends = _terminal(result)
        assert set(ends) == mine, f"prefill {index} rank {rank}: rooms without an end: {sorted(mine - set(ends))[:5]}"
        bad = sorted(rid for rid, (kind, _) in ends.items() if kind != "Succeeded")
        assert not bad, f"prefill {index} rank {rank}: {len(bad)} rooms did not succeed: {bad[:5]}"
    for (index, rank), result in outcome.decode.items():
        mine = [r for r in plan.requests if r.decode == index]
        assert result["ok"] == len(mine) and result["failed"] == 0, (index, rank, result["ok"], result["failed"])
        assert result["bytes"] == sum(r.pages for r in mine) * plan.page_bytes * plan.layers


# ------------------------------------------------------------------------------------- happy paths


def test_1p1d_moves_every_request_and_byte() -> None:
    plan = Plan(requests=make_requests(300, seed=1, max_pages=8), prefill_tp=[1], decode_tp=[1], **_small())
    outcome = run(plan)
    _check_clean(outcome, expect_ranks=2)
    _all_succeeded(outcome, plan)
    # each rank's log: Bootstrapped before the terminal event, once each, for every request
    for result in (*outcome.prefill.values(), *outcome.decode.values()):
        for rid, seq in _events(result).items():
            assert [kind for kind, _ in seq][0] == "Bootstrapped" and len(seq) == 2, (rid, seq)


def test_2p_tp2_to_2d_tp2_moves_every_byte_with_identical_events() -> None:
    requests = make_requests(400, seed=2, max_pages=8, prefill=2, decode=2)
    assert {(r.prefill, r.decode) for r in requests} == {(0, 0), (1, 1)}  # i % 2 on both sides
    requests = [r.__class__(r.rid, r.room, r.pages, r.prefill, (i // 2) % 2) for i, r in enumerate(requests)]
    assert len({(r.prefill, r.decode) for r in requests}) == 4  # every P replica feeds every D replica
    plan = Plan(requests=requests, prefill_tp=[2, 2], decode_tp=[2, 2], **_small())
    outcome = run(plan)
    # each prefill rank writes a pattern only that (request, rank) has, and each decode rank checks
    # its own pages against its own rank's pattern: a write to the wrong rank or page is a mismatch
    _check_clean(outcome, expect_ranks=8)
    _all_succeeded(outcome, plan)


# ------------------------------------------------------------------------------------- a replica dies


def _kill_plan(role: str) -> tuple[Plan, set[str], set[str]]:
    """Two replicas of ``role`` and one of the other side, paired with both; replica 1 of ``role``
    is killed mid-run.

    Half of the victim replica's rooms are held by prefill (``decode_stall``): they are announced
    and bootstrapped on both sides but nothing is written, so when the victim dies only the
    heartbeats can end them (every other timer is 60 s away). The other half transfer normally,
    paced by ``prefill_step`` so the kill lands while they are in flight.
    """
    if role == "decode":
        requests = make_requests(80, seed=3, max_pages=4, decode=2)
        victims = {r.rid for r in requests if r.decode == 1}
        sizes = {"prefill_tp": [2], "decode_tp": [2, 2]}
    else:
        requests = make_requests(80, seed=4, max_pages=4, prefill=2)
        victims = {r.rid for r in requests if r.prefill == 1}
        sizes = {"prefill_tp": [2, 2], "decode_tp": [2]}
    held = set(sorted(victims)[::2])
    stall_index = 1 if role == "decode" else 0
    plan = Plan(
        requests=requests,
        window=len(requests),  # every request is admitted and announced at once
        prefill_step=0.03,
        kill={(role, 1): 15},
        decode_stall={stall_index: held},
        **sizes,
        **_small(),
    )
    return plan, victims, held


def _check_kill(outcome: Outcome, plan: Plan, victims: set[str], held: set[str], role: str) -> None:
    killed = (role, 1)
    assert set(outcome.killed_at) == {killed}, "the runner did not kill the replica"
    killed_at = outcome.killed_at[killed]
    survivors = outcome.prefill if role == "decode" else outcome.decode
    assert len(survivors) == 2, f"surviving ranks that reported: {sorted(survivors)}; errors: {outcome.errors}"
    bound = plan.dead_after + plan.heartbeat_interval + MARGIN
    for (index, rank), result in survivors.items():
        where = f"{'prefill' if role == 'decode' else 'decode'} {index} rank {rank}"
        ends = _terminal(result)
        bootstrapped = _first(result, "Bootstrapped")
        # every victim room ended on this rank; the held ones can only have failed
        assert victims <= set(ends), f"{where}: victim rooms never ended: {sorted(victims - set(ends))[:5]}"
        assert all(ends[rid][0] == "Failed" for rid in held), f"{where}: a held room did not fail"
        # the held victims were mid-transfer when the replica died: bootstrapped, not ended
        early = sorted(rid for rid in held if bootstrapped.get(rid, killed_at) >= killed_at or ends[rid][1] <= killed_at)
        assert not early, f"{where}: rooms were not live (bootstrapped, not ended) at the kill: {early[:5]}"
        late = {rid: round(ends[rid][1] - killed_at, 2) for rid in victims if ends[rid][0] == "Failed"}
        late = {rid: dt for rid, dt in late.items() if dt > bound}
        assert not late, f"{where}: rooms failed later than {bound:.2f} s after the kill: {late}"
        # no other room is disturbed
        others = {rid: kind for rid, (kind, _) in ends.items() if rid not in victims}
        assert others and all(kind in SUCCESS for kind in others.values()), f"{where}: {Counter(others.values())}"
    _check_clean(outcome, expect_ranks=4)
    # the survivors that were not paired with the victim moved every byte (checked per decode rank)
    if role == "decode":
        for (index, rank), result in outcome.decode.items():
            assert index == 0 and result["failed"] == 0 and result["ok"] == len(plan.requests) - len(victims)
    else:
        for (index, rank), result in outcome.prefill.items():
            assert index == 0
            assert all(kind == "Succeeded" for kind, _ in _terminal(result).values())


def test_decode_replica_killed_mid_transfer_fails_its_rooms_on_every_prefill_rank() -> None:
    plan, victims, held = _kill_plan("decode")
    outcome = run(plan)
    _check_kill(outcome, plan, victims, held, "decode")


def test_prefill_replica_killed_mid_transfer_fails_its_rooms_on_every_decode_rank() -> None:
    plan, victims, held = _kill_plan("prefill")
    outcome = run(plan)
    _check_kill(outcome, plan, victims, held, "prefill")


# ------------------------------------------------------------------------------------- injected failures

_N = 1000
_WAITING = 4.0  # decode's waiting timer in the faulty run: the only timer a stalled room can meet


@pytest.fixture(scope="module")
def faulty() -> tuple[Plan, Outcome, dict[str, set[str]]]:
    """1,000 requests through a prefill and a decode replica of two ranks; ~10 % fail on purpose.

    - ``early``: prefill aborts them (``abort_room``) before it ever registers them. Prefill
      answers decode's announcement from a tombstone, which lives ``tombstone_ttl``: they are
      taken from the first window, which decode announces at once;
    - ``late``: prefill aborts them once they are Bootstrapped (decode announced its pages);
    - ``stall``: decode announces, prefill never sends: decode's waiting timer fails them.
    """
    requests = make_requests(_N, seed=5, max_pages=4)
    rids = [r.rid for r in requests]
    window = 64
    early = set(rids[1:window:4])
    late = set(rids[2::25]) - early
    faults = {"early": early, "late": late, "stall": set(rids[3::25]) - early - late}
    plan = Plan(
        requests=requests,
        prefill_tp=[2],
        decode_tp=[2],
        window=window,
        prefill_abort={0: faults["early"]},
        prefill_abort_bootstrapped={0: faults["late"]},
        decode_stall={0: faults["stall"]},
        tombstone_ttl=5.0,
        await_tombstones=True,
        **_small(waiting_timeout=_WAITING, timeout=120.0),
    )
    return plan, run(plan), faults


def test_faulty_run_fails_exactly_the_injected_rooms(faulty: tuple[Plan, Outcome, dict[str, set[str]]]) -> None:
    plan, outcome, faults = faulty
    _check_clean(outcome, expect_ranks=4)
    injected = set().union(*faults.values())
    assert 0.08 < len(injected) / _N < 0.12
    for (index, rank), result in outcome.decode.items():
        ends = _terminal(result)
        assert set(ends) == {r.rid for r in plan.requests}
        failed = {rid for rid, (kind, _) in ends.items() if kind == "Failed"}
        assert failed == injected, (sorted(failed - injected)[:5], sorted(injected - failed)[:5])
        assert result["ok"] == _N - len(injected)
    for (index, rank), result in outcome.prefill.items():
        ends = _terminal(result)
        registered = {r.rid for r in plan.requests} - faults["early"]
        assert set(ends) == registered, "an early-aborted room was registered or a registered one never ended"
        failed = {rid for rid, (kind, _) in ends.items() if kind == "Failed"}
        assert failed == faults["late"] | faults["stall"]


def test_prefill_abort_is_heard_by_decode(faulty: tuple[Plan, Outcome, dict[str, set[str]]]) -> None:
    """An aborted room fails on decode because prefill said so, not because a timer ran out."""
    plan, outcome, faults = faulty
    _check_clean(outcome, expect_ranks=4)
    aborted_at = _first(outcome.prefill[(0, 0)], "Aborted")
    assert set(aborted_at) == faults["early"] | faults["late"]
    for (index, rank), result in outcome.decode.items():
        ends = _terminal(result)
        bootstrapped = _first(result, "Bootstrapped")
        for rid in faults["early"] | faults["late"]:
            kind, at = ends[rid]
            assert kind == "Failed"
            # decode's only timer for an announced room is _WAITING away from its announcement,
            # which follows Bootstrapped: failing sooner means it heard
            assert at - bootstrapped[rid] < _WAITING, f"decode rank {rank}: {rid} failed only by its timer"


def test_decode_timeout_fails_the_room_and_prefill_hears(faulty: tuple[Plan, Outcome, dict[str, set[str]]]) -> None:
    """A stalled room fails on decode by its waiting timer; prefill, which holds it with no timer of
    its own (Bootstrapped), fails it because decode told it (the fence's Abort)."""
    plan, outcome, faults = faulty
    _check_clean(outcome, expect_ranks=4)
    timed_out: dict[str, float] = {}  # when decode's Failed came (after prefill's AbortAck)
    armed: dict[str, float] = {}  # decode's timer cannot expire before this
    for (index, rank), result in outcome.decode.items():
        ends = _terminal(result)
        bootstrapped = _first(result, "Bootstrapped")
        for rid in faults["stall"]:
            kind, at = ends[rid]
            assert kind == "Failed"
            assert at - bootstrapped[rid] >= _WAITING - 0.1, f"decode rank {rank}: {rid} failed before its timer"
            timed_out[rid] = min(at, timed_out.get(rid, at))
            armed[rid] = min(bootstrapped[rid] + _WAITING, armed.get(rid, float("inf")))
    for (index, rank), result in outcome.prefill.items():
        ends = _terminal(result)
        for rid in faults["stall"]:
            kind, at = ends[rid]
            assert kind == "Failed", f"prefill rank {rank}: stalled {rid} ended {kind}"
            assert at >= armed[rid] - 0.1, f"prefill rank {rank}: {rid} failed before decode timed out"
            # prefill's own timers are 60 s away: it failed because decode's abort reached it
            assert at - timed_out[rid] < plan.dead_after + MARGIN


def test_no_state_leaks_after_1000_requests_with_failures(faulty: tuple[Plan, Outcome, dict[str, set[str]]]) -> None:
    plan, outcome, faults = faulty
    _check_clean(outcome, expect_ranks=4)  # in flight, tables and bookkeeping maps: all empty
    for (index, rank), result in outcome.prefill.items():
        # prefill remembered the ended rooms (so the check below is not vacuous) ...
        assert result["tombstones_at_end"] > 0, "prefill kept no tombstone for a failed room"
        # ... and forgot every one of them once tombstone_ttl passed
        assert result["tombstones"] == 0, f"prefill rank {rank}: {result['tombstones']} tombstones outlived their TTL"
    for result in outcome.decode.values():
        assert result["tombstones"] == 0
