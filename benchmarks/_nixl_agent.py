"""One NIXL agent of ``benchmarks/transport.py``'s NIXL rows, run by NIXL's own interpreter.

    <nixl venv>/bin/python benchmarks/_nixl_agent.py source|sink FD

NIXL lives in its own virtual environment (``make nixl``: ``nixl-cu12`` and
``nixl`` installed without their dependencies, so no torch and no CUDA), never
in the project's. So the benchmark (project interpreter) starts two of these
processes, a sink and a source, and drives them over the socket ``FD`` it
passed down (a ``socketpair``; pickled tuples of ints and bytes only, so the
two interpreters need not share a numpy). This file imports only the standard
library, numpy, nixl and ``_digest.py`` beside it: never pdcore or transport.

Each agent runs WITHOUT NIXL's progress thread: that thread spins a core from
the moment the agent exists, idle or not, and on a 2-core machine two of them
would eat the cores the other rows are measured on. Instead each process polls
UCX only while one of its own runs is on: the source in ``check_xfer_state``,
the sink in ``get_new_notifs``; between runs both sleep in ``recv`` on the pipe.

Commands (parent -> agent; every reply is a tuple whose first item names it,
``("error", text)`` on failure):

- both: ``("stop",)`` ends the process with ``os._exit`` (NIXL 1.5.1 crashes in
  interpreter teardown).
- sink: ``("serve", seq)`` replies ``("serving", seq)``, then polls until the
  source's notification ``end:<seq>`` arrives and replies ``("served", seq,
  polls, notifications heard)``; ``("clear", offsets, lengths)`` zeroes those destination regions;
  ``("digest", offsets, lengths)`` replies the BLAKE2b digest of them, in order.
- source: ``("src", path)`` reads the benchmark's source bytes from that file
  (the parent's buffer, written to a temporary file) into its own buffer; ``("connect", metadata, base)``
  adds the sink as a remote agent; ``("prep", src_offsets, dst_offsets,
  lengths, window)`` prepares the descriptor lists of one batch and ``window``
  transfer handles for it; ``("run", seq, nbatches)`` posts the batch
  ``nbatches`` times, at most ``window`` in flight (each handle reposted when
  it is DONE, which for UCX means flushed to the sink's memory), the last one
  on its own handle carrying the notification ``end:<seq>``, and replies
  ``("ran", seq, seconds)`` timed from the first post to the last DONE.

Offsets and lengths travel as the bytes of little-endian int64 arrays.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from _digest import regions_digest  # benchmarks/, this script's sys.path[0]

BUF_BYTES = 128 << 20  # as benchmarks/transport.py: one registered buffer per side
RUN_SECONDS = 120.0  # every wait has a deadline


def _arrays(*blobs: bytes) -> list[np.ndarray]:
    return [np.frombuffer(b, dtype="<i8") for b in blobs]


def _sink(conn: Connection, agent: Any, buf: np.ndarray) -> None:
    while True:
        msg = conn.recv()
        cmd = msg[0]
        if cmd == "stop":
            return
        if cmd == "serve":
            seq = msg[1]
            want = b"end:%d" % seq
            conn.send(("serving", seq))
            polls = heard = 0
            deadline = time.monotonic() + RUN_SECONDS
            seen = False
            while not seen:
                for notes in agent.get_new_notifs().values():  # progresses UCX: no progress thread
                    seen = seen or want in notes
                    heard += len(notes)
                polls += 1
                if not seen and polls % 1024 == 0 and time.monotonic() > deadline:
                    raise TimeoutError(f"no end:{seq} notification from the source within {RUN_SECONDS:.0f} s")
            conn.send(("served", seq, polls, heard))
        elif cmd == "clear":
            offsets, lengths = _arrays(msg[1], msg[2])
            for off, n in zip(offsets.tolist(), lengths.tolist()):
                buf[off : off + n] = 0
            conn.send(("ok",))
        elif cmd == "digest":
            offsets, lengths = _arrays(msg[1], msg[2])
            conn.send(("digest", regions_digest(buf, offsets, lengths)))
        else:
            raise ValueError(f"sink: unknown command {cmd!r}")


class _Source:
    def __init__(self, agent: Any, buf: np.ndarray) -> None:
        self.agent, self.buf = agent, buf
        self.base = int(buf.ctypes.data)
        self.remote = ""
        self.remote_base = 0
        self.handles: list[Any] = []
        self.last: Any = None
        self.dlists: list[Any] = []

    def release(self) -> None:
        for h in self.handles + ([self.last] if self.last is not None else []):
            h.release()
        for d in self.dlists:
            d.release()
        self.handles, self.last, self.dlists = [], None, []

    def prep(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, window: int) -> None:
        self.release()
        zeros = np.zeros(len(src), np.uint64)
        local = np.stack([np.uint64(self.base) + src.astype(np.uint64), lengths.astype(np.uint64), zeros], axis=1)
        remote = np.stack([np.uint64(self.remote_base) + dst.astype(np.uint64), lengths.astype(np.uint64), zeros], axis=1)
        a = self.agent
        self.dlists = [a.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM"), a.prep_xfer_dlist(self.remote, remote, "DRAM")]
        idx = np.arange(len(src), dtype=np.int32)
        # A run's last transfer carries its notification, on a handle of its own: a handle once posted with a
        # notification sends it again on every later post, even one given b"" (NIXL 1.5.1), so the others never get one.
        self.handles = [a.make_prepped_xfer("WRITE", self.dlists[0], idx, self.dlists[1], idx) for _ in range(max(1, window - 1))]
        self.last = a.make_prepped_xfer("WRITE", self.dlists[0], idx, self.dlists[1], idx)

    def run(self, seq: int, nbatches: int) -> float:
        a = self.agent
        free = list(self.handles)
        ring: collections.deque[Any] = collections.deque()
        posted = done = 0
        end = b"end:%d" % seq
        deadline = time.monotonic() + RUN_SECONDS
        checks = 0
        t0 = time.perf_counter()
        while done < nbatches:
            while posted < nbatches and (free or posted == nbatches - 1):
                posted += 1
                h = self.last if posted == nbatches else free.pop()
                if a.transfer(h, end if h is self.last else b"") == "ERR":
                    raise RuntimeError(f"transfer {posted} of run {seq} failed to post")
                ring.append(h)
            state = a.check_xfer_state(ring[0])  # the oldest; checking progresses UCX for all of them
            if state == "DONE":
                h = ring.popleft()
                if h is not self.last:
                    free.append(h)
                done += 1
            elif state == "ERR":
                raise RuntimeError(f"a transfer of run {seq} ended in ERR")
            else:
                checks += 1
                if checks % 1024 == 0 and time.monotonic() > deadline:
                    raise TimeoutError(f"run {seq}: {done} of {nbatches} batches done after {RUN_SECONDS:.0f} s")
        return time.perf_counter() - t0


def _source(conn: Connection, agent: Any, buf: np.ndarray) -> None:
    s = _Source(agent, buf)
    while True:
        msg = conn.recv()
        cmd = msg[0]
        if cmd == "stop":
            return
        if cmd == "src":
            buf[:] = np.fromfile(msg[1], np.uint8, BUF_BYTES)
            conn.send(("ok",))
        elif cmd == "connect":
            s.remote = agent.add_remote_agent(msg[1])
            if isinstance(s.remote, bytes):
                s.remote = s.remote.decode()
            s.remote_base = int(msg[2])
            conn.send(("ok", s.remote))
        elif cmd == "prep":
            src, dst, lengths = _arrays(msg[1], msg[2], msg[3])
            s.prep(src, dst, lengths, int(msg[4]))
            conn.send(("ok",))
        elif cmd == "run":
            conn.send(("ran", msg[1], s.run(int(msg[1]), int(msg[2]))))
        elif cmd == "digest":
            offsets, lengths = _arrays(msg[1], msg[2])
            conn.send(("digest", regions_digest(buf, offsets, lengths)))
        else:
            raise ValueError(f"source: unknown command {cmd!r}")


def main() -> None:
    role, fd = sys.argv[1], int(sys.argv[2])
    conn = Connection(fd)
    code = 0
    try:
        from importlib.metadata import version

        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent(f"pdcore-bench-{role}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in agent.backends:
            raise RuntimeError(f"NIXL has no UCX backend here (plugins: {agent.get_plugin_list()})")
        buf = np.zeros(BUF_BYTES, np.uint8)
        agent.register_memory([(int(buf.ctypes.data), BUF_BYTES, 0, "")], "DRAM")
        info = {"nixl": version("nixl"), "nixl_cu12": version("nixl-cu12"), "base": int(buf.ctypes.data),
                "ucx_tls": os.environ.get("UCX_TLS", ""), "ucx_net_devices": os.environ.get("UCX_NET_DEVICES", "")}
        if role == "sink":
            info["metadata"] = agent.get_agent_metadata()
        conn.send(("hello", role, info))
        (_sink if role == "sink" else _source)(conn, agent, buf)
    except EOFError:
        code = 1  # the benchmark went away: nothing to tell
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which prints why
        code = 1
        try:
            conn.send(("error", f"{role}: {type(e).__name__}: {e}"))
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NIXL 1.5.1's agents crash in interpreter teardown: skip it


if __name__ == "__main__":
    main()
