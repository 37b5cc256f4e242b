"""Fence before free, black box: a decode rank hands a request's pages back (``Failed``) only when no
byte from the prefill side can land in them any more.

Real processes, real signals, only the public API (``tests/_fence_children.py`` holds the ranks):
the test process runs the bootstrap server and spawns one prefill and one decode rank (tp 1), with
one request of 128 MiB of KV. The prefill rank sends all of it and SIGSTOPs itself the moment
``outbox.send`` returns: its transport has pushed what the kernel's socket buffers take and queued
the rest for its sender thread, which the stop freezes. Decode stops hearing heartbeats, judges the
prefill rank dead after ``dead_after`` and emits ``Failed``; its scheduler at once reuses the pages
(fills them with a canary byte) and keeps checking them. Only then does the test SIGCONT the prefill
rank, which resumes mid-transfer with most of the request unsent. A decode rank that fenced before
it freed lets none of those bytes land: the canary must stay intact.

Synchronisation is by pipe messages with deadlines (and, for "the prefill rank is stopped", a
bounded watch of its ``/proc`` state); every child also has its own lifetime, and the ``finally``
kills and reaps whatever is left.

The transport is a parameter: ``verbs`` (marked ``rdma``) runs inside the soft-RoCE guest, where a
stopped process's posted RDMA WRITEs keep being executed by the device, so there the pause need not
leave the transfer half-done and only the canary is judged.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import _fence_children as kids
from _ranks import Ranks, exits, process_state, transport_options
from pdcore.control.bootstrap import BootstrapServer

pytestmark = pytest.mark.slow


HEARTBEAT = 0.5
DEAD_AFTER = 2.0  # decode judges a silent prefill rank dead after this
FENCE_TIMEOUT = 3.0  # decode's bound on waiting for its fence
FAR = 60.0  # every timer the test does not exercise
WINDOW = 8.0  # how long decode keeps checking the canary after Failed (unless told to stop sooner)
LIFETIME = 45.0  # a child's own deadline for its whole loop
START = 90.0  # seconds for a child to come up: a bound, not a speed (a loaded machine, or the soft-RoCE guest's emulation)
MiB = 1 << 20
#: where both ranks keep the KV cache: cpu, or (``make gpu-check``) cuda; standin runs the stand-in device
KV_DEVICE = os.environ.get("PDCORE_FENCE_KV_DEVICE", "cpu")

DECODE_KNOBS = dict(heartbeat_interval=HEARTBEAT, dead_after=DEAD_AFTER, fence_timeout=FENCE_TIMEOUT,
                    bootstrap_timeout=FAR, waiting_timeout=FAR, tombstone_ttl=FAR)
PREFILL_KNOBS = dict(heartbeat_interval=HEARTBEAT, dead_after=FAR, fence_timeout=FAR,
                     bootstrap_timeout=FAR, waiting_timeout=FAR, tombstone_ttl=FAR)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport_name", ["tcp", pytest.param("verbs", marks=pytest.mark.rdma)])
def test_decode_frees_pages_only_when_a_paused_prefill_can_no_longer_write_them(transport_name: str) -> None:
    options = transport_options(transport_name)
    server = BootstrapServer()
    port = server.start()
    ranks = Ranks()
    t0 = time.monotonic()
    try:
        ranks.start("decode", kids.run_decode, port, transport_name, options, DECODE_KNOBS, WINDOW, LIFETIME)
        ranks.start("prefill", kids.run_prefill, port, transport_name, options, PREFILL_KNOBS, LIFETIME)
        for role in ("decode", "prefill"):
            ranks.wait_for(role, "ready", START, f"the {role} rank to start")
        prefill = ranks.procs["prefill"]

        # 1. prefill sends the request's 128 MiB and stops itself while the writes stream
        ranks.wait_for("prefill", "sending", 20, "prefill to send the pages",
                       unless={("decode", "failed"): "decode failed the request before prefill sent it"})
        deadline = time.monotonic() + 5
        while (state := process_state(prefill.pid)) != "T":
            assert time.monotonic() < deadline, f"the prefill rank did not stop within 5 s (state {state!r})"
            time.sleep(0.002)  # a bounded watch of a process state, which no pipe can report
        paused_at = time.monotonic()

        # 2. decode judges it dead and hands the pages back; its scheduler reuses them (canary)
        failed = ranks.wait_for(
            "decode", "failed", DEAD_AFTER + FENCE_TIMEOUT + 10, "decode's Failed while prefill is paused",
            unless={("decode", "landed_all"): "the whole request landed before the pause: it was not mid-transfer"},
        )
        failed_after = time.monotonic() - paused_at
        assert process_state(prefill.pid) == "T", "the prefill rank was not stopped when decode failed the request"

        # 3. prefill resumes mid-transfer; decode keeps checking its canary until prefill ended the
        #    request with nothing in flight, closed its peer and exited (or decode's window ends)
        os.kill(prefill.pid, signal.SIGCONT)
        ranks.wait_for("prefill", "resumed", 10, "prefill to resume")
        drained = ranks.wait_for("prefill", "drained", WINDOW, "prefill to end the request", required=False)
        ranks.send("prefill", "stop")
        prefill_report = ranks.wait_for("prefill", "done", 15, "prefill's report")
        exits(ranks, "prefill")
        ranks.send("decode", "stop")
        decode_report = ranks.wait_for("decode", "done", 15, "decode's canary report")
        exits(ranks, "decode")
    finally:
        ranks.cleanup()
        server.close()
    wall = time.monotonic() - t0
    ranks.assert_reaped()

    decode_events = [kind for kind, _ in decode_report["events"]]
    terminal = [kind for kind in decode_events if kind in ("Failed", "RemotePrefillDone")]
    landed = failed["landed"]
    first_seen = decode_report.get("first_seen")
    summary = (
        f"[{transport_name}, KV on {KV_DEVICE}] landed before Failed: {landed / MiB:.1f} of {kids.TOTAL / MiB:.0f} MiB; "
        f"Failed {failed_after:.2f} s after the pause ({failed['reason']!r}); "
        f"canary bytes overwritten: {decode_report.get('overwritten')} (per buffer {decode_report.get('per_layer')}, "
        f"first seen {'never' if first_seen is None else f'{first_seen:.2f} s after Failed'}, checked for "
        f"{decode_report.get('checked_for', 0):.2f} s); prefill drained: {drained is not None}, "
        f"prefill events: {prefill_report['events']}; decode events: {decode_events}; wall {wall:.1f} s"
    )
    print(summary)
    assert terminal == ["Failed"], f"decode must end the request exactly once, with Failed: {summary}"
    if transport_name == "tcp" and KV_DEVICE == "cpu":  # a stopped process stops its TCP writes: the pause
        assert 0 < landed < kids.TOTAL, f"the pause did not fall mid-transfer: {summary}"  # must split the transfer
    if KV_DEVICE != "cpu":  # bytes land in host staging; device pages get them only once the room landed
        assert landed == 0, f"bytes reached device pages of a room that never landed: {summary}"
    assert decode_report["overwritten"] == 0, f"bytes landed in pages decode had handed back: {summary}"
