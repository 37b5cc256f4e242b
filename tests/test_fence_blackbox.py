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

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import time
from typing import Any

import pytest

import _fence_children as kids
from pdcore.control.bootstrap import BootstrapServer

pytestmark = pytest.mark.slow

SPAWN = mp.get_context("spawn")  # direct children of this process: the test reaps them itself

HEARTBEAT = 0.5
DEAD_AFTER = 2.0  # decode judges a silent prefill rank dead after this
FENCE_TIMEOUT = 3.0  # decode's bound on waiting for its fence
FAR = 60.0  # every timer the test does not exercise
WINDOW = 8.0  # how long decode keeps checking the canary after Failed (unless told to stop sooner)
LIFETIME = 45.0  # a child's own deadline for its whole loop
START = 30.0  # seconds for a child to come up
MiB = 1 << 20

DECODE_KNOBS = dict(heartbeat_interval=HEARTBEAT, dead_after=DEAD_AFTER, fence_timeout=FENCE_TIMEOUT,
                    bootstrap_timeout=FAR, waiting_timeout=FAR, tombstone_ttl=FAR)
PREFILL_KNOBS = dict(heartbeat_interval=HEARTBEAT, dead_after=FAR, fence_timeout=FAR,
                     bootstrap_timeout=FAR, waiting_timeout=FAR, tombstone_ttl=FAR)


def _options(transport_name: str) -> dict[str, Any]:
    """Transport options; for verbs, skip (or fail under PDCORE_REQUIRE_RDMA=1) without a device."""
    if transport_name != "verbs":
        return {}
    from transport.verbs import unavailable_reason

    device = os.environ.get("PDCORE_RDMA_DEVICE") or None
    reason = unavailable_reason(device)
    if reason is not None:
        if os.environ.get("PDCORE_REQUIRE_RDMA") == "1":
            pytest.fail(f"PDCORE_REQUIRE_RDMA=1 but the verbs transport cannot run: {reason}")
        pytest.skip(f"no verbs device: {reason}")
    return {"device": device} if device else {}


def _state(pid: int) -> str:
    """The process's state letter from /proc ("T": stopped), "gone" once it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


class _Ranks:
    """The two children and what they reported: role -> kind -> first payload, plus the full log."""

    def __init__(self) -> None:
        self.procs: dict[str, Any] = {}
        self.pipes: dict[str, Any] = {}
        self.got: dict[str, dict[str, Any]] = {}
        self.log: list[tuple[float, str, str]] = []
        self._t0 = time.monotonic()

    def start(self, role: str, target: Any, *args: Any) -> None:
        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(target=target, args=(child, *args), name=f"fence-{role}", daemon=True)
        proc.start()
        child.close()  # the child holds the only other end: its exit is our EOF
        self.procs[role], self.pipes[role], self.got[role] = proc, parent, {}

    def send(self, role: str, msg: str) -> None:
        try:
            self.pipes[role].send(msg)
        except OSError:
            pass  # it exited already; its report (or its absence) tells

    def _receive(self, seconds: float) -> None:
        readers = {conn: role for role, conn in self.pipes.items() if not conn.closed}
        for conn in mp_connection.wait(list(readers), timeout=max(0.0, seconds)):
            role = readers[conn]
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                conn.close()
                self.log.append((time.monotonic() - self._t0, role, "EOF"))
                continue
            self.log.append((time.monotonic() - self._t0, role, kind if kind != "event" else f"event {payload}"))
            if kind == "error":
                raise AssertionError(f"the {role} child raised:\n{payload}")
            self.got[role].setdefault(kind, payload)

    def wait_for(self, role: str, kind: str, seconds: float, what: str, *, unless: dict[tuple[str, str], str] | None = None,
                 required: bool = True) -> Any:
        """The payload of ``role``'s first ``kind`` message, waiting up to ``seconds``; ``unless`` maps
        (role, kind) messages that make the wait pointless to the failure message."""
        deadline = time.monotonic() + seconds
        while kind not in self.got[role]:
            for (r, k), why in (unless or {}).items():
                if k in self.got[r]:
                    raise AssertionError(f"{why} (while waiting for {what}); log: {self.log}")
            left = deadline - time.monotonic()
            if left <= 0 or self.pipes[role].closed:
                if not required:
                    return None
                gone = "its pipe closed" if self.pipes[role].closed else f"no {kind!r} within {seconds:g} s"
                raise AssertionError(f"{role}: {gone}, waiting for {what}; log: {self.log}")
            self._receive(left)
        return self.got[role][kind]

    def cleanup(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped child gets on to its end
                except ProcessLookupError:
                    pass
                proc.kill()
            proc.join(10)
        for conn in self.pipes.values():
            conn.close()


def _exits(ranks: _Ranks, role: str, seconds: float = 15.0) -> None:
    """The child exits, cleanly, within ``seconds`` of its report (and is reaped)."""
    proc = ranks.procs[role]
    proc.join(seconds)
    assert not proc.is_alive(), f"the {role} rank did not exit within {seconds:g} s of its report"
    assert proc.exitcode == 0, f"the {role} rank exited with {proc.exitcode}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport_name", ["tcp", pytest.param("verbs", marks=pytest.mark.rdma)])
def test_decode_frees_pages_only_when_a_paused_prefill_can_no_longer_write_them(transport_name: str) -> None:
    options = _options(transport_name)
    server = BootstrapServer()
    port = server.start()
    ranks = _Ranks()
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
        while (state := _state(prefill.pid)) != "T":
            assert time.monotonic() < deadline, f"the prefill rank did not stop within 5 s (state {state!r})"
            time.sleep(0.002)  # a bounded watch of a process state, which no pipe can report
        paused_at = time.monotonic()

        # 2. decode judges it dead and hands the pages back; its scheduler reuses them (canary)
        failed = ranks.wait_for(
            "decode", "failed", DEAD_AFTER + FENCE_TIMEOUT + 10, "decode's Failed while prefill is paused",
            unless={("decode", "landed_all"): "the whole request landed before the pause: it was not mid-transfer"},
        )
        failed_after = time.monotonic() - paused_at
        assert _state(prefill.pid) == "T", "the prefill rank was not stopped when decode failed the request"

        # 3. prefill resumes mid-transfer; decode keeps checking its canary until prefill ended the
        #    request with nothing in flight, closed its peer and exited (or decode's window ends)
        os.kill(prefill.pid, signal.SIGCONT)
        ranks.wait_for("prefill", "resumed", 10, "prefill to resume")
        drained = ranks.wait_for("prefill", "drained", WINDOW, "prefill to end the request", required=False)
        ranks.send("prefill", "stop")
        prefill_report = ranks.wait_for("prefill", "done", 15, "prefill's report")
        _exits(ranks, "prefill")
        ranks.send("decode", "stop")
        decode_report = ranks.wait_for("decode", "done", 15, "decode's canary report")
        _exits(ranks, "decode")
    finally:
        ranks.cleanup()
        server.close()
    wall = time.monotonic() - t0
    leftovers = [p for p in SPAWN.active_children() if p in ranks.procs.values()]
    assert not leftovers, f"processes left over: {leftovers}"
    assert all(_state(p.pid) == "gone" for p in ranks.procs.values()), "a child is still a process (zombie?)"

    decode_events = [kind for kind, _ in decode_report["events"]]
    terminal = [kind for kind in decode_events if kind in ("Failed", "RemotePrefillDone")]
    landed = failed["landed"]
    first_seen = decode_report.get("first_seen")
    summary = (
        f"[{transport_name}] landed before Failed: {landed / MiB:.1f} of {kids.TOTAL / MiB:.0f} MiB; "
        f"Failed {failed_after:.2f} s after the pause ({failed['reason']!r}); "
        f"canary bytes overwritten: {decode_report.get('overwritten')} (per buffer {decode_report.get('per_layer')}, "
        f"first seen {'never' if first_seen is None else f'{first_seen:.2f} s after Failed'}, checked for "
        f"{decode_report.get('checked_for', 0):.2f} s); prefill drained: {drained is not None}, "
        f"prefill events: {prefill_report['events']}; decode events: {decode_events}; wall {wall:.1f} s"
    )
    print(summary)
    assert terminal == ["Failed"], f"decode must end the request exactly once, with Failed: {summary}"
    if transport_name == "tcp":  # a stopped process stops its TCP writes: the pause must split the transfer
        assert 0 < landed < kids.TOTAL, f"the pause did not fall mid-transfer: {summary}"
    assert decode_report["overwritten"] == 0, f"bytes landed in pages decode had handed back: {summary}"
