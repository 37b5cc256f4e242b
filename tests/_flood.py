"""Floods of idle connections from real processes, and the flooded processes, for the flood tests.

- ``run_flood`` (a child): keeps ``count`` idle TCP connections to one port open, sending nothing
  (a client that never starts its handshake), and redials each one the other side drops, so the
  pressure lasts as long as the flood does.
- ``run_channel`` (a child): a control plane (``"zmq"`` or ``"tcp"``, with the deployment
  secret) that echoes every ``Abort`` back to its sender, in a process whose open-file limit is
  lowered to ``nofile`` first: the limit a flood of idle connections would exhaust. With ``slow``
  its I/O thread is slowed (see ``slow_thread``): a flood faster than the channel, on two cores.
- ``run_granting_sink`` (a child): a TCP sink (with the deployment secret) whose region needs a
  grant, in a process limited to ``nofile`` open files and slowed (``slow_process``); it grants a
  source on command and says whether a byte pattern landed.
- ``run_exhausted_sink`` (a child): a TCP sink in a process with a low open-file limit that uses
  up its last file descriptors on command, so its acceptor meets EMFILE, and frees them on command.
- ``Child``: the test's handle on one of them (spawned; commands and answers over a pipe).

Every child ends when its pipe closes (the test ended or died), so none outlives the test for long.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import resource
import selectors
import socket
import threading
import time
import traceback
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

SPAWN = mp.get_context("spawn")


def open_fds() -> int:
    """File descriptors this process holds now."""
    return len(os.listdir("/proc/self/fd"))


def cpu_seconds() -> float:
    """CPU time (user + system) this process has used so far, every thread of it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _lower_nofile(nofile: int) -> None:
    """Soft and hard limit both: nothing in the child can raise it back."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))


def _serve(conn: Connection, answer: Any) -> None:
    """Answer ``(command, *args)`` tuples with ``(command, answer(command, *args))`` until ``stop``
    or the pipe closes; an exception is sent back as ``("error", traceback)``."""
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = answer(*cmd)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            raise
        conn.send((cmd[0], result))
        if cmd[0] == "stop":
            return


def run_flood(conn: Connection, host: str, port: int, count: int) -> None:
    """Hold ``count`` idle connections to ``host:port``, redialling each one that is dropped.

    Commands: ``("stats",)`` -> counts (``live``: connected now, ``dials``, ``dropped``: closed by
    the other side, ``failed``: connects that did not complete); ``("stop",)``."""
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ, "command")
    counts: Counter[str] = Counter()
    socks: dict[socket.socket, str] = {}  # -> "connecting" or "live"

    def dial() -> None:
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        err = s.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            s.close()
            counts["failed"] += 1
            return
        counts["dials"] += 1
        socks[s] = "connecting"
        sel.register(s, selectors.EVENT_WRITE, "connecting")

    def drop(s: socket.socket, why: str) -> None:
        counts[why] += 1
        sel.unregister(s)
        del socks[s]
        s.close()

    try:
        for _ in range(count):
            dial()
        while True:
            for key, _ in sel.select(0.05):
                if key.data == "command":
                    try:
                        cmd = conn.recv()
                    except (EOFError, OSError):
                        return
                    if cmd[0] == "stop":
                        conn.send(("stop", None))
                        return
                    live = sum(1 for state in socks.values() if state == "live")
                    conn.send(("stats", {**counts, "live": live}))
                    continue
                s = key.fileobj
                assert isinstance(s, socket.socket)
                if key.data == "connecting":
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        drop(s, "failed")
                    else:
                        socks[s] = "live"
                        sel.modify(s, selectors.EVENT_READ, "live")
                    continue
                try:
                    data = s.recv(4096)  # a ZeroMQ server greets first: bytes are not a drop
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    drop(s, "dropped")
            while len(socks) < count:  # redial what was dropped (or failed)
                before = len(socks)
                dial()
                if len(socks) == before:
                    break  # no socket now (out of fds?): the next round tries again
    finally:
        for s in list(socks):
            s.close()
        sel.close()


def slow_thread(native_id: int) -> None:
    """Make one thread of this process slow: niceness 19 (the lowest weight), on one CPU only.

    On a machine with many cores a flood and libzmq's I/O thread, which accepts its connections, run
    at full speed beside a channel's Python I/O thread; on two cores the same balance comes from
    slowing that one thread, not its process (libzmq's thread would slow with it)."""
    os.setpriority(os.PRIO_PROCESS, native_id, 19)
    os.sched_setaffinity(native_id, {min(os.sched_getaffinity(0))})


def run_channel(
    conn: Connection, nofile: int, secret: bytes, options: dict[str, Any], plane: str = "zmq", slow: bool = False
) -> None:
    """A control plane (``plane``, by name) that echoes each ``Abort`` to its sender (reason
    ``"echo"``), in a process limited to ``nofile`` open files; with ``slow`` its I/O thread is slowed
    (``slow_thread``). Commands: ``("stats",)`` -> the channel's stats, its pending connections and
    this process's open fds; ``("exhaust",)`` -> how many descriptors it took to use up the soft limit (held
    to the end); ``("send", endpoint, room)`` -> an ``Abort`` of ``room`` sent to ``endpoint``; ``("stop",)``."""
    _lower_nofile(nofile)
    from dataclasses import asdict

    from pdcore.control import plane as control_plane
    from pdcore.control import wire

    def on_message(sender: str, msg: wire.Message) -> None:
        if isinstance(msg, wire.Abort):
            channel.send(sender, wire.Abort(room=msg.room, reason="echo"))

    channel = control_plane.create(plane, on_message, session_id="flooded-0", secret=secret, **options)
    endpoint = channel.start()
    if slow:
        [io_thread] = [t for t in threading.enumerate()  # the plane's loop (not the tcp plane's gatekeeper)
                       if t.name.startswith("pdcore-control-") and "-gate-" not in t.name]
        assert io_thread.native_id is not None
        slow_thread(io_thread.native_id)
    conn.send(("endpoint", endpoint))

    held: list[int] = []  # descriptors "exhaust" took: this process's other users of its limit

    def answer(cmd: str, *args: Any) -> Any:
        if cmd == "exhaust":  # take every descriptor the soft limit leaves (the reserve's are above it)
            while True:
                try:
                    held.append(os.open(os.devnull, os.O_RDONLY))
                except OSError as e:
                    if e.errno != errno.EMFILE:
                        raise
                    return len(held)
        if cmd == "send":
            channel.send(args[0], wire.Abort(room=args[1], reason="from the exhausted"))
            return None
        if cmd == "stats":
            pending = getattr(channel, "pending_connections", lambda: None)()  # None: a channel without the bound
            # counting takes a descriptor, and libzmq accepts the flood's connections up to the limit before
            # the channel cuts them: an instant at the limit is expected, a second of it is the failure
            until = time.monotonic() + 1.0
            while True:
                try:
                    fds: int | str = open_fds()
                    break
                except OSError as e:
                    if time.monotonic() > until:  # the process stays out of them: say so (a failing test's message)
                        fds = f"cannot count them: {e}"
                        break
            return {**asdict(channel.stats), "pending": pending, "fds": fds}
        channel.close()
        return None

    _serve(conn, answer)
    channel.close()


def slow_process() -> None:
    """Make this process slow (niceness 10, one CPU), its threads to come too (they inherit both)."""
    os.nice(10)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def run_granting_sink(conn: Connection, nofile: int, secret: bytes, size: int) -> None:
    """A TCP sink in a slowed process (``slow_process``) limited to ``nofile`` open files, with one
    region of ``size`` zero bytes registered with ``require_grant``. Sends ``("endpoint", bytes)``
    first. Commands: ``("grant", source instance)`` -> ``(grant key, region address)`` for the
    whole region; ``("landed", byte)`` -> whether every byte of the region is ``byte``;
    ``("stats",)`` -> the sink's counters; ``("stop",)``."""
    _lower_nofile(nofile)
    slow_process()
    import numpy as np

    import transport

    sink = transport.create("tcp", secret=secret, peer_timeout=5.0)
    dst = np.zeros(size, np.uint8)
    region = sink.register(dst, require_grant=True)
    conn.send(("endpoint", sink.endpoint()))

    def answer(cmd: str, *args: Any) -> Any:
        if cmd == "grant":
            return sink.grant(args[0], [(region.addr, size)]).key, region.addr
        if cmd == "landed":
            return bool((dst == args[0]).all())
        if cmd == "stats":
            return {name: getattr(sink, name) for name in
                    ("evicted_handshakes", "refused_connections", "auth_failures", "accept_failures")}
        sink.close()
        return None

    _serve(conn, answer)
    sink.close()


def run_exhausted_sink(conn: Connection, nofile: int, secret: bytes | None) -> None:
    """A TCP sink in a process limited to ``nofile`` open files.

    Commands: ``("exhaust",)`` opens /dev/null until EMFILE (keeping them) and returns how many;
    ``("cpu", seconds)`` waits that long (the episode measured) and returns ``(cpu seconds, wall
    seconds)`` this process used meanwhile, every thread; ``("free",)`` closes what ``exhaust``
    opened; ``("stats",)``; ``("stop",)``."""
    _lower_nofile(nofile)
    import numpy as np

    import transport

    sink = transport.create("tcp", secret=secret, peer_timeout=5.0)
    sink.register(np.zeros(4096, np.uint8))
    conn.send(("endpoint", sink.endpoint()))
    held: list[int] = []

    def answer(cmd: str, *args: Any) -> Any:
        if cmd == "exhaust":
            while True:
                try:
                    held.append(os.open(os.devnull, os.O_RDONLY))
                except OSError as e:
                    assert e.errno == errno.EMFILE, e
                    return len(held)
        if cmd == "cpu":
            cpu, wall = cpu_seconds(), time.monotonic()
            threading.Event().wait(args[0])  # the episode: how long the acceptor is watched, not a synchronisation
            return cpu_seconds() - cpu, time.monotonic() - wall
        if cmd == "free":
            while held:
                os.close(held.pop())
            return None
        if cmd == "stats":
            return {"accept_failures": getattr(sink, "accept_failures", None)}  # (no fd to list /proc with)
        sink.close()
        return None

    _serve(conn, answer)
    sink.close()


class Child:
    """The test's handle on one child process: ``call`` sends a command and waits for its answer."""

    def __init__(self, target: Any, *args: Any) -> None:
        parent, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()  # the child holds the only other end: its exit is our EOF
        self.conn = parent

    def wait(self, kind: str, seconds: float) -> Any:
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not mp_connection.wait([self.conn], timeout=left):
                raise AssertionError(f"child {self.proc.pid}: no {kind!r} within {seconds:g} s")
            try:
                got, payload = self.conn.recv()
            except (EOFError, OSError):
                raise AssertionError(f"child {self.proc.pid} ended (exit {self.proc.exitcode}), waiting for {kind!r}") from None
            if got == "error":
                raise AssertionError(f"child {self.proc.pid} raised:\n{payload}")
            if got == kind:
                return payload

    def call(self, *cmd: Any, seconds: float = 20.0) -> Any:
        self.conn.send(cmd)
        return self.wait(cmd[0], seconds)

    def close(self) -> None:
        """Stop it (politely, then by force) and reap it."""
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except (OSError, ValueError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()
        if not self.proc.is_alive():
            self.proc.close()  # its sentinel pipe
