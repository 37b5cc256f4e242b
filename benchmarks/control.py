"""Control-plane benchmark: what one control message costs, in CPU and wake-ups, between two processes.

    python benchmarks/control.py [--quick] [--json] [--messages N] [--burst B] [--repeats R]

Why it exists: every transfer needs control messages (a PD request an
``Announce`` and a ``Status``, an EPD item an ask and a status) and on a small
machine their CPU competes with the data plane's copies. ``benchmarks/pd.py``
and ``benchmarks/epd.py`` show the sum; this one isolates a message, so the
per-item budget a throughput goal leaves can be set against it.

Two processes on loopback, each a control plane of the library's, both
planes in the same run (``--planes``):

- ``zmq``: a ``ControlChannel`` (its ZeroMQ I/O thread) and a worker thread
  standing in for a peer's driver: the channel's ``on_message`` hands each
  frame to the worker through a queue, as the peers do, and the worker
  answers. A message crosses the caller's ``send``, the sending control
  thread, ZeroMQ's I/O threads on both sides (CURVE with a secret), the
  receiving control thread, the hand-off to the worker.
- ``tcp``: a ``TcpPlane`` whose loop thread stands in for the driver (a
  peer's driver runs the loop): the echo's ``on_message`` answers on it. A
  message crosses the caller's hand-off to the loop, one ``send``, and the
  receiving loop (sealed frames, keyed BLAKE2b tags with a secret).

This process sends ``Status`` frames; the echo process sends each back; this
process's main thread waits for the answers.

- ``lone``: one message in flight (ping-pong): no burst shares a wake-up.
  This process's main thread sends each and waits for its answer, so on
  this side every message also crosses between the caller and the plane's
  thread (a scheduler's call to its driver, and back).
- ``relay``: one message in flight, answered on both sides by the plane's
  callback thread (where a driver reads it: the ``tcp`` plane's loop, the
  ZeroMQ channel's I/O thread): a message as one driver sends it to another,
  without the caller's hops. The main thread starts the relay and waits for
  its end.
- ``burst``: ``--burst`` messages sent back to back, then their answers
  awaited: frames to one peer in one pass of the control thread share a
  ZeroMQ message.

Each row is measured with a deployment secret (CURVE) and without. Per
message: ``cpu_us`` (user + system CPU of both processes, from ``/proc``),
``wakeups`` (voluntary context switches of every thread of both) and
``us`` (wall time; for ``lone``, half a round trip). Medians over
``--repeats`` runs taking turns.

The floor (``floor_*``, same run, same modes): the same encoded frames over
one plain blocking TCP connection on loopback, a length prefix each, the echo
process's one thread reading each and writing it back: what moving a message
between two processes costs at least (a syscall each way and one wake-up on
the receiving side). ``ratio`` = floor CPU / ours, per message.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import struct
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._pipeline import say  # noqa: E402
from benchmarks._usage import Usage  # noqa: E402
from pdcore.control import wire  # noqa: E402
from pdcore.control.channel import ControlChannel  # noqa: E402
from pdcore.control.tcp_plane import TcpPlane  # noqa: E402

PLANES = {"zmq": ControlChannel, "tcp": TcpPlane}

SECRET = b"benchmarks/control.py: a deployment secret of 32+ bytes"
_TIMEOUT = 60.0
_LEN = struct.Struct("<I")


RELAY = 1 << 40  # a room with this bit: a relay message, answered on the callback thread; the rest counts down


def _status(room: int) -> wire.Status:
    return wire.Status(room=room, state=3, rank=0, first_token=room & 0xFFFF, cached_tokens=7)


def _echo(conn: Any, secret: bytes | None, plane: str) -> None:
    """The echo process: a channel whose worker sends every Status back to its sender (on the ``tcp``
    plane its loop, the driver's thread in a peer, answers)."""
    inbox: queue.SimpleQueue[tuple[str, wire.Message] | None] = queue.SimpleQueue()

    def on_message(sender: str, msg: wire.Message) -> None:
        if type(msg) is wire.Status:
            if plane == "tcp" or msg.room & RELAY:
                channel.send(sender, msg)
            else:
                inbox.put((sender, msg))

    with PLANES[plane](on_message, session_id="echo", secret=secret) as channel:
        def worker() -> None:
            while (item := inbox.get()) is not None:
                channel.send(item[0], item[1])

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        conn.send(channel.endpoint)
        conn.recv()  # "stop"
        inbox.put(None)
        thread.join(5)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("the other end closed")
        buf += got
    return bytes(buf)


def _floor_echo(conn: Any) -> None:
    """The floor's echo process: one thread reads each length-prefixed frame and writes it back."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        conn.send(server.getsockname()[1])
        sock, _ = server.accept()
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                n = _LEN.unpack(_recv_exact(sock, _LEN.size))[0]
                sock.sendall(_LEN.pack(n) + _recv_exact(sock, n))
        except ConnectionError:
            pass


def _measure(pids: tuple[int, ...], messages: int, body: Any) -> dict[str, float]:
    """Run ``body()``; per message crossing (``2 x messages``): CPU µs and wake-ups of ``pids``, wall µs."""
    usage = Usage(pids)
    t0 = time.perf_counter()
    body()
    seconds = time.perf_counter() - t0
    cpu, woke = usage.spent()
    crossings = 2 * messages
    return {"cpu_us": cpu / crossings * 1e6, "wakeups": woke / crossings, "us": seconds / crossings * 1e6}


class Floor:
    """A plain TCP connection to an echo process: the floor of one message between two processes."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_floor_echo, args=(theirs,), daemon=True)
        self.proc.start()
        if not self.conn.poll(_TIMEOUT):
            raise RuntimeError("the floor's echo process did not start")
        self.sock = socket.create_connection(("127.0.0.1", self.conn.recv()), timeout=_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.frame = wire.encode(_status(1))
        self.run("lone", 50)

    def run(self, mode: str, messages: int, burst: int = 32) -> dict[str, float]:
        sock, out = self.sock, _LEN.pack(len(self.frame)) + self.frame

        def body() -> None:
            step = burst if mode == "burst" else 1  # (relay: its floor is the lone ping-pong)
            for start in range(0, messages, step):
                n = min(step, messages - start)
                sock.sendall(out * n)
                _recv_exact(sock, len(out) * n)

        return _measure((os.getpid(), self.proc.pid), messages, body)

    def close(self) -> None:
        self.sock.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class Pair:
    """This process's channel and an echo process, kept for the runs of one plane and secret setting."""

    def __init__(self, secret: bytes | None, plane: str) -> None:
        self.answers: queue.SimpleQueue[wire.Message] = queue.SimpleQueue()

        def on_message(sender: str, msg: wire.Message) -> None:
            if type(msg) is wire.Status:
                if msg.room & RELAY and msg.room != RELAY:
                    self.channel.send(sender, _status(msg.room - 1))  # on with the relay, from this thread
                else:
                    self.answers.put(msg)

        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_echo, args=(theirs, secret, plane), daemon=True)
        self.proc.start()
        if not self.conn.poll(_TIMEOUT):
            raise RuntimeError("the echo process did not start")
        self.peer = self.conn.recv()
        self.channel = PLANES[plane](on_message, session_id="bench", secret=secret)
        self.channel.start()
        self.run("lone", 50)  # connects, proves both ways, warms the paths

    def _answer(self) -> None:
        try:
            self.answers.get(timeout=_TIMEOUT)
        except queue.Empty:
            raise RuntimeError(f"no answer from the echo process within {_TIMEOUT:g} s") from None

    def run(self, mode: str, messages: int, burst: int = 32) -> dict[str, float]:
        """``messages`` sent and answered; per message (each way counts): CPU µs, wake-ups, wall µs."""
        def body() -> None:
            if mode == "relay":
                self.channel.send(self.peer, _status(RELAY | (messages - 1)))
                self._answer()
                return
            if mode == "lone":
                for i in range(messages):
                    self.channel.send(self.peer, _status(i))
                    self._answer()
                return
            for start in range(0, messages, burst):
                n = min(burst, messages - start)
                for i in range(n):
                    self.channel.send(self.peer, _status(start + i))
                for _ in range(n):
                    self._answer()

        return _measure((os.getpid(), self.proc.pid), messages, body)

    def close(self) -> None:
        self.channel.close()
        self.conn.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--quick", action="store_true", help="fewer messages and runs: under 30 s")
    ap.add_argument("--messages", type=int, default=None, help="messages per run (default 4000, quick 1000)")
    ap.add_argument("--burst", type=int, default=32, help="messages sent back to back in a burst run")
    ap.add_argument("--repeats", type=int, default=None, help="runs per row (default 5, quick 3)")
    ap.add_argument("--planes", default="zmq,tcp", help="control planes to measure, comma-separated (default: both)")
    args = ap.parse_args()
    planes = args.planes.split(",")
    if not set(planes) <= set(PLANES):
        ap.error(f"--planes: each one of {', '.join(PLANES)}")
    messages = args.messages or (1000 if args.quick else 4000)
    repeats = args.repeats or (3 if args.quick else 5)
    if messages < 1 or repeats < 1 or args.burst < 1:
        ap.error("--messages, --repeats and --burst must be positive")
    rows = []
    floor = Floor()
    try:
        for plane, name, secret in [(p, n, s) for p in planes for n, s in (("secret", SECRET), ("open", None))]:
            say(f"control: {plane}, {name}")
            pair = Pair(secret, plane)
            try:
                got: dict[str, list[dict[str, float]]] = {"lone": [], "relay": [], "burst": []}
                base: dict[str, list[dict[str, float]]] = {"lone": [], "relay": [], "burst": []}
                for _ in range(repeats):
                    for mode in got:  # taking turns, the floor's runs between ours
                        got[mode].append(pair.run(mode, messages, args.burst))
                        base[mode].append(floor.run(mode, messages, args.burst))
            finally:
                pair.close()
            for mode, runs in got.items():
                row = {"plane": plane, "auth": name, "mode": mode, "messages": messages}
                for key in ("cpu_us", "wakeups", "us"):
                    row[key] = statistics.median(r[key] for r in runs)
                    row["floor_" + key] = statistics.median(r[key] for r in base[mode])
                row["ratio"] = row["floor_cpu_us"] / row["cpu_us"]
                rows.append(row)
    finally:
        floor.close()
    if args.json:
        print(json.dumps({"rows": rows, "burst": args.burst, "repeats": repeats}, indent=2))
        return 0
    print(f"one control message between two processes (Status frames answered by a worker; bursts of {args.burst}),"
          " against the same frames over a plain TCP connection")
    print(f"{'plane':5s} {'auth':7s} {'mode':6s} {'CPU µs/msg':>11s} {'wake-ups/msg':>13s} {'wall µs/msg':>12s}"
          f" {'floor CPU µs':>13s} {'floor wake-ups':>15s} {'floor wall µs':>14s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['plane']:5s} {r['auth']:7s} {r['mode']:6s} {r['cpu_us']:11.1f} {r['wakeups']:13.2f} {r['us']:12.1f}"
              f" {r['floor_cpu_us']:13.1f} {r['floor_wakeups']:15.2f} {r['floor_us']:14.1f} {r['ratio']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
