"""The NIXL rows' driver, on the benchmark's side: two NIXL agents in NIXL's own interpreter, run as commanded.

``benchmarks/transport.py`` (project interpreter) uses ``NixlPair``: it starts
``benchmarks/_nixl_agent.py`` twice with NIXL's interpreter (``make nixl``
puts it in ``.venv/nixl``), a sink and a source, each talking to this process
over its own ``socketpair``; hands the sink's metadata to the source; copies
its source bytes over (so NIXL moves the very bytes the floor moves); and pays
the first WRITE's connection before anything is timed. Then, per row:
``prep(...)`` once, ``run(nbatches)`` returns the seconds the source timed
from its first post to its last DONE, and ``clear`` / ``digest`` check the
sink's destination.

Every wait has a deadline; a failure raises ``NixlError`` with the agent's own
words (or the last line of its log) and the caller leaves NIXL out from there
on. ``close()`` always reaps both processes (``stop``, then kill at 5 s).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "_nixl_agent.py")
START_SECONDS = 60.0
REPLY_SECONDS = 150.0  # above the agents' own 120 s per run, so their error arrives first
NETWORK_TLS = "tcp,self"  # UCX over TCP on loopback only (without UCX_NET_DEVICES=lo it splits over the NIC too)


class NixlError(RuntimeError):
    pass


def label(tls: str) -> str:
    """The rows' name: ``nixl-ucx-tcp`` for the network transport; anything else says what it is."""
    if tls == NETWORK_TLS:
        return "nixl-ucx-tcp"
    if "shm" in tls.split(","):
        return "nixl-ucx-cma"  # UCX's shm moves DRAM to DRAM by a kernel copy (cma): not a network transport
    return f"nixl-ucx[{tls}]"


def _roomy_tmp(nbytes: int) -> str | None:
    """/dev/shm when it has room for ``nbytes`` (the source bytes pass through it once), else the usual temp dir."""
    try:
        st = os.statvfs("/dev/shm")
        return "/dev/shm" if st.f_bavail * st.f_frsize >= nbytes else None
    except OSError:
        return None


def _i64(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


class _Agent:
    def __init__(self, python: str, role: str, env: dict[str, str], log_dir: str) -> None:
        self.role = role
        self.log_path = os.path.join(log_dir, f"{role}.log")
        ours, theirs = socket.socketpair()
        self.log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                [python, AGENT, role, str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env,
                stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, cwd=HERE,
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())

    def last_log_line(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def ask(self, msg: tuple[Any, ...], want: str, seconds: float = REPLY_SECONDS) -> tuple[Any, ...]:
        try:
            if msg:
                self.conn.send(msg)
            return self.expect(want, seconds)
        except (OSError, EOFError) as e:
            raise self._gone(f"{type(e).__name__}: {e}") from None

    def expect(self, want: str, seconds: float) -> tuple[Any, ...]:
        try:
            ready = self.conn.poll(seconds)
        except (OSError, EOFError) as e:
            raise self._gone(f"{type(e).__name__}: {e}") from None
        if not ready:
            raise NixlError(f"the NIXL {self.role} did not answer within {seconds:.0f} s")
        try:
            reply = self.conn.recv()
        except (OSError, EOFError):
            raise self._gone("it closed its pipe") from None
        if reply[0] == "error":
            raise NixlError(f"the NIXL {reply[1]}")
        if reply[0] != want:
            raise NixlError(f"the NIXL {self.role} answered {reply[0]!r}, not {want!r}")
        return reply

    def _gone(self, why: str) -> NixlError:
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            pass
        tail = self.last_log_line()
        return NixlError(f"the NIXL {self.role} went away ({why}; exit {self.proc.returncode})" + (f": {tail}" if tail else ""))

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.conn.close()
        self.log.close()


class NixlPair:
    """A NIXL source and sink, each in its own process of NIXL's interpreter, 128 MiB registered on each side."""

    def __init__(self, python: str, src: np.ndarray, tls: str = NETWORK_TLS) -> None:
        if not os.access(python, os.X_OK):
            raise NixlError(f"no NIXL interpreter at {python} (make nixl installs it)")
        self.tls = tls
        self.label = label(tls)
        self.seq = 0
        self.window = 0
        self.polls = self.heard = 0  # the last run's: the sink's polls, the notifications it heard
        self.prepped: bytes = b""
        env = dict(os.environ, UCX_TLS=tls, UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"),
                   PYTHONNOUSERSITE="1")
        env.pop("PYTHONPATH", None)  # NIXL's interpreter sees its own venv only, never the project's tree
        self.dir = tempfile.mkdtemp(prefix="pdcore-nixl-", dir=_roomy_tmp(2 * src.nbytes))
        self.agents: list[_Agent] = []
        try:
            self.sink = self._start(python, "sink", env)
            self.source = self._start(python, "source", env)
            _, _, sink_info = self.sink.expect("hello", START_SECONDS)
            _, _, src_info = self.source.expect("hello", START_SECONDS)
            self.info = {k: v for k, v in sink_info.items() if k not in ("metadata", "base")}
            path = os.path.join(self.dir, "src.bin")
            src.tofile(path)
            try:
                self.source.ask(("src", path), "ok")
            finally:
                os.unlink(path)
            self.source.ask(("connect", sink_info["metadata"], sink_info["base"]), "ok")
            # The first WRITE pays the connection (16-25 ms here): paid now, outside every timed run.
            t0 = time.perf_counter()
            self.prep(np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, 4096, np.int64), 1)
            self.run(1)
            self.info["first_write_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        except OSError as e:  # cannot start the interpreter, no room for the source bytes, ...
            self.close()
            raise NixlError(f"could not start NIXL's agents: {type(e).__name__}: {e}") from e
        except BaseException:
            self.close()
            raise

    def _start(self, python: str, role: str, env: dict[str, str]) -> _Agent:
        a = _Agent(python, role, env, self.dir)
        self.agents.append(a)
        return a

    def prep(self, src_off: np.ndarray, dst_off: np.ndarray, lengths: np.ndarray, window: int) -> None:
        """Descriptor lists for one batch (offsets into the two 128 MiB buffers) and ``window`` handles."""
        blobs = (_i64(src_off), _i64(dst_off), _i64(lengths))
        key = b"".join(blobs) + window.to_bytes(4, "little")
        if key == self.prepped:
            return
        self.source.ask(("prep", *blobs, window), "ok")
        self.prepped, self.window = key, window

    def run(self, nbatches: int) -> float:
        """Post the prepared batch ``nbatches`` times (``window`` in flight); the source's own seconds."""
        self.seq += 1
        seq = self.seq
        self.sink.ask(("serve", seq), "serving")  # the sink polls from now until the run's last notification
        _, _, seconds = self.source.ask(("run", seq, nbatches), "ran")
        _, _, self.polls, self.heard = self.sink.expect("served", REPLY_SECONDS)
        return float(seconds)

    def clear(self, dst_off: np.ndarray, lengths: np.ndarray) -> None:
        self.sink.ask(("clear", _i64(dst_off), _i64(lengths)), "ok")

    def digest(self, dst_off: np.ndarray, lengths: np.ndarray) -> str:
        return str(self.sink.ask(("digest", _i64(dst_off), _i64(lengths)), "digest")[1])

    def cpu_seconds(self) -> float:
        """User + system CPU seconds used so far by both agent processes (from /proc)."""
        total = 0
        for a in self.agents:
            try:
                with open(f"/proc/{a.proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
            except (OSError, IndexError, ValueError):
                pass
        return total / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        for a in self.agents:
            a.close()
        self.agents = []
        shutil.rmtree(self.dir, ignore_errors=True)
