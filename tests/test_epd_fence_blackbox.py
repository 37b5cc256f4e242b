"""Fence before free, black box, for EPD: a prefill rank gives a failed request's receive slot to a new
request only once no byte of the failed one's encode rank can land in it any more.

Real processes, real signals, only the public API (``tests/_epd_children.py``): a prefill replica of
tp 2 over a real gloo group, a *paused* encode rank (its own process, deployment X) and a *healthy*
one (its own process, deployment Y), and one bootstrap server per deployment. Each prefill rank has
two receive slots of 32 MiB.

1. Both ranks stage ``target`` (one image of a whole slot from X), then ``probe`` (a small image
   from X). The probe's asks leave each rank after the target's, on the same control connection:
   once the probe landed on every rank, X holds the target's asks from both ranks.
2. X hands over the target's rows (every byte ``CANARY``) and SIGSTOPs itself at once: its writes
   are queued or half sent when every thread freezes.
3. The prefill ranks hear nothing from X; after ``dead_after`` the target fails on every rank (in
   one round), its slot is fenced (the grant X writes through is revoked), and ``fresh``, staged at
   once, lands in that very slot (the probe holds the other one) with Y's rows.
4. Only then is X continued: its late writes go on, through the revoked grant. The test waits until
   X reports the target's room concluded (every write of it completed), then each rank checks
   ``fresh``'s rows, still leased: they must be Y's rows exactly, with no ``CANARY`` byte.

Synchronisation is by queue and pipe messages with deadlines, plus a bounded watch of X's ``/proc``
state ("T": stopped); every child has its own lifetime, and the ``finally`` continues, kills and
reaps whatever is left.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from _epd_children import SPAWN, Child, Replica, items, run_encode, state_of
from pdcore.control.bootstrap import BootstrapServer

HEARTBEAT = 0.25
DEAD_AFTER = 2.0  # the prefill ranks judge the silent encode rank dead after this
SLACK = 2.0
FAR = 120.0
START = 60.0
LIFETIME = 90.0

HIDDEN = 4096
DTYPE = "torch.float32"
SLOT_ROWS = 2048  # 32 MiB a slot, the target's image fills one
MiB = 1 << 20
PREFILL_KNOBS = dict(heartbeat_interval=HEARTBEAT, dead_after=DEAD_AFTER)
ENCODE_KNOBS = dict(heartbeat_interval=HEARTBEAT, dead_after=10.0, park_timeout=FAR)
RECEIVER = dict(slots=2, slot_rows=SLOT_ROWS, hidden=HIDDEN, dtype=DTYPE, timeout=FAR)
SEND_BYTES = SLOT_ROWS * HIDDEN * 4 + MiB


@pytest.mark.timeout(240)
def test_a_paused_encode_ranks_late_write_never_lands_in_the_slot_of_the_request_that_reused_it() -> None:
    servers = [BootstrapServer(host="127.0.0.1", port=0) for _ in range(3)]
    pport, xport, yport = (s.start() for s in servers)
    paused = healthy = rep = None
    t0 = time.monotonic()
    try:
        paused = Child("encode-paused", run_encode, xport, ENCODE_KNOBS, SEND_BYTES, LIFETIME)
        healthy = Child("encode-healthy", run_encode, yport, ENCODE_KNOBS, SEND_BYTES, LIFETIME)
        rep = Replica(pport, PREFILL_KNOBS, RECEIVER, lifetime=LIFETIME)
        x_endpoint = paused.wait("ready", START, "the paused encode rank to start")["endpoint"]
        healthy.wait("ready", START, "the healthy encode rank to start")
        rep.wait("ready", seconds=START, what="the prefill ranks to start")
        TARGET, PROBE, FRESH = 0x6A, 0x6B, 0x6C

        # 1. the target's asks reach X (the probe, asked after them, lands)
        assert paused.call("begin", TARGET) and paused.call("begin", PROBE)
        paused.call("put", PROBE, 4, HIDDEN, DTYPE, "pattern")
        assert healthy.call("begin", FRESH)
        healthy.call("put", FRESH, SLOT_ROWS, HIDDEN, DTYPE, "pattern")  # waits for fresh's asks
        rep.send("stage", "target", items(xport, (TARGET, SLOT_ROWS)))
        rep.send("stage", "probe", items(xport, (PROBE, 4)))
        probe = rep.wait("landed", "probe", seconds=30, what="the probe to land on every rank")
        probe_slot = {r: p["items"][0][1] for r, p in probe.items()}
        assert not rep.seen("landed", "target") and not rep.seen("failed", "target")

        # 2. X hands the target's canary rows over and stops itself with its writes queued or half sent
        paused.send("put_and_stop", TARGET, SLOT_ROWS, HIDDEN, DTYPE, "canary")
        deadline = time.monotonic() + 10
        while (state := state_of(paused.pid)) != "T":
            assert time.monotonic() < deadline, f"the paused encode rank did not stop within 10 s (state {state!r})"
            time.sleep(0.002)  # a bounded watch of a process state, which no pipe can report
        paused_at = time.monotonic()

        # 3. the target fails on every rank, its slot is fenced and reused by fresh (Y's rows)
        failed = rep.wait("failed", "target", seconds=DEAD_AFTER + SLACK + 10, what="the target to fail")
        assert state_of(paused.pid) == "T", "the encode rank was not stopped when the target failed"
        rep.send("stage", "fresh", items(yport, (FRESH, SLOT_ROWS)))
        fresh = rep.wait("landed", "fresh", seconds=30, what="fresh to land in the fenced slot")
        assert state_of(paused.pid) == "T", "the encode rank was not stopped when fresh landed"
        fresh_slot = {r: p["items"][0][1] for r, p in fresh.items()}

        # 4. X goes on: its late writes through the revoked grant; then fresh's rows are checked again
        os.kill(paused.pid, signal.SIGCONT)
        paused.wait("resumed", 10, "the encode rank to resume")
        late = paused.call("concluded", TARGET, 20.0, seconds=30)
        rep.send("check", "fresh")
        checked = rep.wait("checked", "fresh", seconds=15, what="fresh's rows checked after the late write")
        results = rep.close()
        said = {}
        for child in (paused, healthy):
            child.send("stop")
            said[child.name] = child.wait("done", 15, f"{child.name} to stop")["log"]
            child.proc.join(15)
            assert child.proc.exitcode == 0, f"{child.name} exited with {child.proc.exitcode}"
    finally:
        for thing in (rep, paused, healthy):
            if thing is None:
                continue
            try:
                thing.abandon() if isinstance(thing, Replica) else thing.close()
            except Exception:
                pass
        for server in servers:
            server.close()
    wall = time.monotonic() - t0
    assert not [p for p in SPAWN.active_children() if p in (paused.proc, healthy.proc)], "children left over"
    assert state_of(paused.pid) == "gone" and state_of(healthy.pid) == "gone", "a child is still a process"

    reasons = {r: p["reason"] for r, p in failed.items()}
    target_slot = {r: 1 - probe_slot[r] for r in probe_slot}  # two slots: the probe holds the other
    before = {r: p["canary_by_slot"].get(target_slot[r], 0) for r, p in failed.items()}
    summary = (
        f"target failed {max(p['t'] for p in failed.values()) - paused_at:.2f} s after the pause "
        f"(round {[p['round'] for p in failed.values()]}): {reasons}; canary bytes in the target's slot at "
        f"the failure: {[f'{b / MiB:.1f} MiB' for b in before.values()]}; fresh in slots {fresh_slot} "
        f"(probe in {probe_slot}); the late room concluded {late['t'] and late['t'] - paused_at:.2f} s after "
        f"the pause, the encode rank said: {late['log']}; fresh after it: {checked}; wall {wall:.1f} s"
    )
    print(summary)
    print("\n".join(said["encode-paused"]))
    assert len({p["round"] for p in failed.values()}) == 1, f"the ranks failed the target in different rounds: {summary}"
    assert any(x_endpoint in why for why in reasons.values()), f"no reason names the paused encode rank: {summary}"
    assert len(set(reasons.values())) == 1, f"the ranks report different reasons: {summary}"
    assert all(DEAD_AFTER - 0.5 <= p["t"] - paused_at <= DEAD_AFTER + SLACK for p in failed.values()), summary
    assert fresh_slot == target_slot, f"fresh did not reuse the target's fenced slot: {summary}"
    assert all(p["intact"] and p["canary"] == 0 for p in fresh.values()), f"fresh landed damaged: {summary}"
    assert late["t"] is not None, f"the paused encode rank's late writes never completed: {summary}"
    assert all(p["intact"] and p["canary"] == 0 for p in checked.values()), (
        f"the paused encode rank's late write landed in the slot fresh reused: {summary}")
    assert all(not r["staged"] for r in results), results
