"""One stalled decode rank never stalls its prefill rank, black box: a room toward a healthy decode
rank is not delayed by a SIGSTOPped one.

Real processes, real signals, only the public API (``tests/_stall_children.py`` holds the ranks):
the test process runs the bootstrap server and spawns one prefill rank and two decode deployments,
``slow`` and ``ok``, each of tp 1, all over TCP. The prefill rank's transport takes at most
``MAX_INFLIGHT`` (2) unacknowledged batches per decode rank, and it would wait up to
``FENCE_TIMEOUT`` (20 s) for room to post one. A warm-up room to each deployment lands first (both
data connections are up). Then the test SIGSTOPs the slow deployment's process (its ``/proc`` state
says "T") and has prefill hand over ``SLOW_ROOMS`` (4) rooms of 4 MiB to it: two batches go out and
are never acknowledged, so the slow sink is full with two more rooms for it waiting (the prefill rank
says so from its own ``bytes_posted`` metric). Only then are ``OK_ROOMS`` (3) rooms handed over to the
healthy deployment, and each must reach prefill's ``Succeeded`` and decode's ``RemotePrefillDone``,
byte-exact, within ``BOUND`` (5 s) of its ``outbox.send``. A prefill rank whose one thread waited
for room at the stalled sink would hold them for the full ``FENCE_TIMEOUT`` (20 s) at least: this
is a liveness deadline, not a speed bound. The slow deployment stays stopped throughout the
measurement (checked); once it is resumed, its rooms land too, byte-exact.

Every other timer (death, bootstrap, waiting, the transport's ``peer_timeout``) is set far away, so
nothing but the stall can fail a room while the test runs. Synchronisation is by pipe messages with
deadlines (and, for "the slow rank is stopped", a bounded watch of its ``/proc`` state); every
child also has its own lifetime, and the ``finally`` resumes, kills and reaps whatever is left.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import _stall_children as kids
from _ranks import Ranks, exits, process_state
from pdcore.control.bootstrap import BootstrapServer

pytestmark = pytest.mark.slow

MAX_INFLIGHT = 2  # batches in flight per decode rank on the prefill rank's transport
FENCE_TIMEOUT = 20.0  # how long prefill may keep a batch for a full sink: what a waiting driver would lose
BOUND = 5.0  # hand-over -> Succeeded / RemotePrefillDone of a room to the healthy deployment, at most
HEARTBEAT = 0.5
FAR = 60.0  # every timer the test does not exercise
LIFETIME = 90.0  # a child's own deadline for its whole loop
START = 90.0  # seconds for a child to come up: a bound, not a speed (a loaded machine, or the soft-RoCE guest's emulation)
MiB = 1 << 20

PREFILL_OPTIONS = {"max_inflight": MAX_INFLIGHT, "peer_timeout": FAR}
PREFILL_KNOBS = dict(heartbeat_interval=HEARTBEAT, dead_after=FAR, fence_timeout=FENCE_TIMEOUT,
                     bootstrap_timeout=FAR, waiting_timeout=FAR, tombstone_ttl=FAR)
DECODE_KNOBS = dict(heartbeat_interval=HEARTBEAT, dead_after=FAR, fence_timeout=FAR,
                    bootstrap_timeout=FAR, waiting_timeout=FAR, tombstone_ttl=FAR)
ROOM_BYTES = kids.ROOM_PAGES * kids.PAGE
# what the transport took once the slow sink is full: both warm-up rooms and MAX_INFLIGHT slow rooms
FULL_BYTES = (2 + MAX_INFLIGHT) * ROOM_BYTES


def _failures(rids: list[str], roles: tuple[str, ...]) -> dict[tuple[str, str], str]:
    return {(role, f"failed:{rid}"): f"{role} failed room {rid}" for rid in rids for role in roles}


@pytest.mark.timeout(150)
def test_a_stopped_decode_rank_does_not_delay_rooms_to_a_healthy_one() -> None:
    assert kids.SLOW_ROOMS > MAX_INFLIGHT, "the slow sink must have more rooms than it takes"
    slow_rids = [rid for rid, _ in kids.rooms_of("slow")[1:]]
    ok_rids = [rid for rid, _ in kids.rooms_of("ok")[1:]]
    server = BootstrapServer()
    port = server.start()
    ranks = Ranks()
    t0 = time.monotonic()
    try:
        ranks.start("slow", kids.run_decode, "slow", port, DECODE_KNOBS, LIFETIME)
        ranks.start("ok", kids.run_decode, "ok", port, DECODE_KNOBS, LIFETIME)
        ranks.start("prefill", kids.run_prefill, port, PREFILL_OPTIONS, PREFILL_KNOBS, FULL_BYTES, LIFETIME)
        for role in ("slow", "ok", "prefill"):
            ranks.wait_for(role, "ready", START, f"the {role} rank to start")
        slow = ranks.procs["slow"]

        # 1. every room is bootstrapped (the announcements reached prefill); the warm-up rooms landed
        every = _failures([rid for _, rid, _ in kids.ROOMS], ("prefill", "slow", "ok"))
        ranks.wait_for("prefill", "bootstrapped", 30, "every room to be bootstrapped on prefill", unless=every)
        for role in ("slow", "ok"):
            warm = kids.WARM[role]
            report = ranks.wait_for(role, f"landed:{warm}", 20, f"the warm-up room to {role}", unless=every)
            assert not report["wrong_pages"] and report["token_ok"], f"warm-up room {warm} landed wrong: {report}"

        # 2. the slow deployment stops; prefill hands it more rooms than its sink takes
        os.kill(slow.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while (state := process_state(slow.pid)) != "T":
            assert time.monotonic() < deadline, f"the slow decode rank did not stop within 5 s (state {state!r})"
            time.sleep(0.002)  # a bounded watch of a process state, which no pipe can report
        ranks.send("prefill", "send_slow")
        ranks.wait_for("prefill", "sent_slow", 10, "prefill to hand the slow rooms over")
        full = ranks.wait_for("prefill", "sink_full", 10, "prefill's transport to take what the slow sink holds",
                              unless=_failures(slow_rids, ("prefill",)))

        # 3. the rooms to the healthy deployment: each hand-over -> Succeeded and RemotePrefillDone
        ranks.send("prefill", "send_ok")
        handed = ranks.wait_for("prefill", "sent_ok", 10, "prefill to hand the ok rooms over")
        sent, posted_before = handed["at"], handed["posted_before"]
        ok_failures = _failures(ok_rids, ("prefill", "ok"))
        landed, succeeded = {}, {}
        for rid in ok_rids:  # waited for past FENCE_TIMEOUT: a delayed room is measured, not only missed
            landed[rid] = ranks.wait_for("ok", f"landed:{rid}", FENCE_TIMEOUT + 10, f"room {rid} to land on ok",
                                         unless=ok_failures)
            succeeded[rid] = ranks.wait_for("prefill", f"succeeded:{rid}", FENCE_TIMEOUT + 10,
                                            f"prefill's Succeeded of {rid}", unless=ok_failures)
        stopped_throughout = process_state(slow.pid) == "T"
        slow_ended_early = [rid for rid in slow_rids if {f"succeeded:{rid}", f"failed:{rid}"} & set(ranks.got["prefill"])]

        # 4. the slow deployment resumes: its rooms, parked meanwhile, land too
        os.kill(slow.pid, signal.SIGCONT)
        slow_landed = {rid: ranks.wait_for("slow", f"landed:{rid}", 15, f"room {rid} to land on slow once resumed",
                                           required=False) for rid in slow_rids}

        for role in ("prefill", "slow", "ok"):
            ranks.send(role, "stop")
        reports = {role: ranks.wait_for(role, "done", 15, f"{role}'s report") for role in ("prefill", "slow", "ok")}
        for role in ("prefill", "slow", "ok"):
            exits(ranks, role)
    finally:
        ranks.cleanup()
        server.close()
    wall = time.monotonic() - t0
    ranks.assert_reaped()

    to_done = {rid: succeeded[rid] - sent[rid] for rid in ok_rids}
    to_landed = {rid: landed[rid]["at"] - sent[rid] for rid in ok_rids}
    summary = (
        "rooms to the healthy decode rank while the other was stopped, hand-over -> Succeeded: "
        + ", ".join(f"{rid} {to_done[rid]:.3f} s" for rid in ok_rids)
        + "; -> RemotePrefillDone: " + ", ".join(f"{rid} {to_landed[rid]:.3f} s" for rid in ok_rids)
        + f" (bound {BOUND:g} s, prefill's fence_timeout {FENCE_TIMEOUT:g} s); "
        f"posted when the slow sink was full: {full / MiB:.0f} MiB, before the ok rooms: {posted_before / MiB:.0f} MiB; "
        f"slow rooms landed after resuming: {sum(v is not None for v in slow_landed.values())} of {len(slow_rids)}; "
        f"prefill's queues at the end: {reports['prefill']['queues']}; wall {wall:.1f} s"
    )
    print(summary)
    assert stopped_throughout, f"the slow decode rank was not stopped throughout the measurement: {summary}"
    assert posted_before == FULL_BYTES, (
        f"the stopped rank's sink did not hold exactly {MAX_INFLIGHT} rooms when the ok rooms were handed over: {summary}")
    assert not slow_ended_early, f"slow rooms ended while their decode rank was stopped: {slow_ended_early}; {summary}"
    for rid in ok_rids:
        assert not landed[rid]["wrong_pages"] and landed[rid]["token_ok"], f"room {rid} landed wrong: {landed[rid]}"
    late = {rid: round(max(to_done[rid], to_landed[rid]), 3) for rid in ok_rids
            if max(to_done[rid], to_landed[rid]) >= BOUND}
    assert not late, f"rooms to a healthy decode rank were held up by a stopped one: {late}; {summary}"
    for rid, report in slow_landed.items():
        assert report is not None, f"room {rid} never landed on the slow rank after it resumed; {summary}"
        assert not report["wrong_pages"] and report["token_ok"], f"room {rid} landed wrong on slow: {report}"
