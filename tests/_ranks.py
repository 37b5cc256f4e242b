"""Real child processes for the black-box tests: start them, hear their pipe reports with deadlines,
reap them; and the transport options of a parametrized test (verbs skips, or fails under
``PDCORE_REQUIRE_RDMA=1``, without a device)."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import time
from typing import Any

import pytest

SPAWN = mp.get_context("spawn")  # direct children of this process: the test reaps them itself


def transport_options(transport_name: str) -> dict[str, Any]:
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


def process_state(pid: int) -> str:
    """The process's state letter from /proc ("T": stopped), "gone" once it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


class Ranks:
    """The two children and what they reported: role -> kind -> first payload, plus the full log."""

    def __init__(self) -> None:
        self.procs: dict[str, Any] = {}
        self.pipes: dict[str, Any] = {}
        self.got: dict[str, dict[str, Any]] = {}
        self.log: list[tuple[float, str, str]] = []
        self._t0 = time.monotonic()

    def start(self, role: str, target: Any, *args: Any) -> None:
        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(target=target, args=(child, *args), name=f"child-{role}", daemon=True)
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

    def assert_reaped(self) -> None:
        """After ``cleanup``: no child is left, neither as a live child nor as a process (a zombie)."""
        leftovers = [p for p in SPAWN.active_children() if p in self.procs.values()]
        assert not leftovers, f"processes left over: {leftovers}"
        assert all(process_state(p.pid) == "gone" for p in self.procs.values()), "a child is still a process (zombie?)"


def exits(ranks: Ranks, role: str, seconds: float = 15.0) -> None:
    """The child exits, cleanly, within ``seconds`` of its report (and is reaped)."""
    proc = ranks.procs[role]
    proc.join(seconds)
    assert not proc.is_alive(), f"the {role} rank did not exit within {seconds:g} s of its report"
    assert proc.exitcode == 0, f"the {role} rank exited with {proc.exitcode}"
