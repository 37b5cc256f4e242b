"""Real processes for the EPD failure tests (tests/test_epd_failures.py, tests/test_epd_fence_blackbox.py).

Only pdcore's public API runs here. Three kinds of process, and the test-side handles that drive them:

- **prefill ranks**: ``prefill_rank`` runs on every rank of a real gloo replica (``replica.run_replica``)
  as a prefill scheduler would: a ``PrefillPeer`` (tp = the replica's size) and its embedding
  ``Receiver``, in a loop of scheduler rounds. The test drives it with commands put on one queue that
  rank 0 reads and broadcasts to every rank at the top of each iteration, so every rank applies the
  same commands in the same iteration (they stage the same requests in the same order, as the
  receiver requires). Every rank reports what it sees on a shared queue: ``(rank, kind, payload)``.
  ``Replica`` is the test's handle: it runs the replica on a thread and waits for reports with
  deadlines.
- **encode ranks**: ``Encoder`` is one ``EncodePeer`` with a bump allocator in its send buffer; the
  test may hold one in its own process, or run one in a child (``run_encode``) driven over a pipe
  (``Child``), so it can be SIGKILLed or SIGSTOPped.

Every loop in a child has its own deadline (``lifetime``; an encode child also ends when its pipe
closes), so a child never outlives the test for long; ``run_replica`` and the handles' ``close``
kill and reap whatever is left.

Rows: the rows of room ``r`` are ``pattern(r, nbytes)``, bytes that are never 0 and never
``CANARY``; a row that lands intact equals them byte for byte.

Commands a replica understands (``Replica.send``):

- ``("stage", rid, [(index, host, port, room, rows), ...])``: ``Receiver.stage``.
- ``("hold", True|False)``: while held, no round runs; each rank reports its own ``poll`` codes
  (``"local"`` reports), so a test sees what each rank decided before the replica agrees.
- ``("step",)``: one round, even while held.
- ``("release", rid, ranks)``: the ranks in ``ranks`` release the slots of ``rid``'s landed items
  (the others keep them leased: a rank whose data plane has not copied its rows out yet).
- ``("check", rid)``: check the still-leased rows of a landed ``rid`` again (a ``"checked"`` report).
- ``("stop",)``.

Reports: ``ready`` {endpoint}, ``staged`` {rid, t}, ``local`` {rid, code, t}, ``landed`` {rid, round,
t, items: [(index, slot, row_start, row_count)], intact, canary}, ``failed`` {rid, round, t, reason,
canary_by_slot: CANARY bytes in each slot not leased, right after the round}, ``stats`` {asks, landed,
fenced} (when they change), ``checked`` {rid, intact, canary}, ``done`` {rounds, stats, staged}.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from _children_common import guarded

SPAWN = mp.get_context("spawn")
CANARY = 0xA5
HOST = "127.0.0.1"
_ROUND_PAUSE = 0.005  # seconds between scheduler rounds


def pattern(room: int, nbytes: int) -> np.ndarray:
    """The rows of ``room``: ``nbytes`` bytes, never 0, never ``CANARY``."""
    block = np.random.default_rng(room).integers(1, 256, nbytes, dtype=np.uint8)
    block[block == CANARY] = 0x5A
    return block


def state_of(pid: int) -> str:
    """The process's state letter from /proc ("T": stopped), "gone" once it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


# ------------------------------------------------------------------------------------------ encode


class Encoder:
    """One encode rank (``EncodePeer``) whose rows are cut from one send buffer, front to back."""

    def __init__(self, port: int, knobs: dict[str, Any], nbytes: int) -> None:
        from pdcore import EncodeConfig, EncodePeer

        self.buffer = np.zeros(nbytes, np.uint8)
        self.peer, self.sender = EncodePeer.start(EncodeConfig(
            send_buffers=[self.buffer], bootstrap_host=HOST, bootstrap_port=port, **knobs))
        self._next = 0
        self._concluded: dict[int, float] = {}  # room -> when concluded() first returned it

    @property
    def endpoint(self) -> str:
        return self.peer.control_endpoint

    def begin(self, room: int) -> bool:
        return self.sender.begin(room)

    def fail(self, room: int, reason: str) -> None:
        self.sender.fail(room, reason)

    def put(self, room: int, rows: int, hidden: int, dtype: str, fill: str = "pattern") -> None:
        """Write the room's rows (its pattern, or all ``CANARY``) into the send buffer and hand them over."""
        from pdcore import EmbeddingChunk
        from pdcore.epd.types import DTYPE_ITEMSIZE

        nbytes = rows * hidden * DTYPE_ITEMSIZE[dtype]
        start = self._next
        if start + nbytes > self.buffer.nbytes:
            raise ValueError(f"the send buffer of {self.buffer.nbytes} bytes has no room for {nbytes} more")
        self._next = (start + nbytes + 63) & ~63
        self.buffer[start : start + nbytes] = pattern(room, nbytes) if fill == "pattern" else CANARY
        self.sender.send(EmbeddingChunk(room=room, source=self.buffer.ctypes.data + start, rows=rows,
                                        hidden=hidden, dtype=dtype, nbytes=nbytes))

    def newly_concluded(self) -> list[int]:
        """The rooms ``concluded()`` returns now (recorded for ``concluded``)."""
        now = time.monotonic()
        rooms = self.sender.concluded()
        for room in rooms:
            self._concluded.setdefault(room, now)
        return rooms

    def concluded(self) -> dict[int, float]:
        """Every room ``concluded()`` returned so far, with when it first did."""
        self.newly_concluded()
        return dict(self._concluded)

    def wait_concluded(self, rooms: set[int] | list[int], seconds: float) -> dict[int, float]:
        """Wait (bounded) until every room of ``rooms`` concluded; returns what concluded so far."""
        deadline = time.monotonic() + seconds
        while True:
            done = self.concluded()
            if set(rooms) <= set(done) or time.monotonic() >= deadline:
                return done
            time.sleep(0.005)  # a short pause inside a deadline-bounded poll

    def close(self) -> None:
        self.peer.close()


class _Records(logging.Handler):
    """Keeps the encode peer's log lines (the reasons it tells the prefill ranks)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_encode(conn: Connection, port: int, knobs: dict[str, Any], nbytes: int, lifetime: float) -> None:
    """An encode rank in its own process, driven by the test over ``conn``.

    Commands: ``("begin", room)``, ``("put", room, rows, hidden, dtype, fill)``, ``("put_and_stop", ...)``
    (hand the rows over, then SIGSTOP this whole process at once: the writes are queued or half sent;
    after SIGCONT it reports ``"resumed"``), ``("fail", room, reason)``, ``("concluded", room, seconds)``
    (wait for the room to conclude), ``("stop",)``. Each is answered with a message of its name.
    """
    guarded(conn, _encode, port, knobs, nbytes, lifetime)


def _encode(conn: Connection, port: int, knobs: dict[str, Any], nbytes: int, lifetime: float) -> None:
    records = _Records()
    for name in ("pdcore", "transport"):
        logging.getLogger(name).addHandler(records)
        logging.getLogger(name).setLevel(logging.INFO)
    enc = Encoder(port, knobs, nbytes)
    try:
        conn.send(("ready", {"pid": os.getpid(), "endpoint": enc.endpoint}))
        until = time.monotonic() + lifetime
        while time.monotonic() < until:
            try:
                if not conn.poll(min(0.05, max(0.0, until - time.monotonic()))):
                    continue
                cmd = conn.recv()
            except (EOFError, OSError):
                break
            op = cmd[0]
            if op == "begin":
                conn.send(("begin", enc.begin(cmd[1])))
            elif op == "put":
                enc.put(*cmd[1:])
                conn.send(("put", cmd[1]))
            elif op == "put_and_stop":
                enc.put(*cmd[1:])
                os.kill(os.getpid(), signal.SIGSTOP)  # every thread freezes here
                conn.send(("resumed", time.monotonic()))
            elif op == "fail":
                enc.fail(cmd[1], cmd[2])
                conn.send(("fail", cmd[1]))
            elif op == "concluded":
                room, seconds = cmd[1], cmd[2]
                done = enc.wait_concluded([room], seconds)
                lines = [line for line in records.lines if f"room {room} " in line]
                conn.send(("concluded", {"room": room, "t": done.get(room), "log": lines}))
            elif op == "stop":
                break
        conn.send(("done", {"log": records.lines}))
    finally:
        enc.close()


class Child:
    """The test's handle on one child process and its pipe (spawned, reaped by ``close``)."""

    def __init__(self, name: str, target: Any, *args: Any) -> None:
        self.name = name
        parent, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.proc.start()
        child.close()  # the child holds the only other end: its exit is our EOF
        self.conn = parent
        self.got: dict[str, list[Any]] = {}
        self.log: list[tuple[float, str]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid  # type: ignore[return-value]

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def wait(self, kind: str, seconds: float, what: str) -> Any:
        """The payload of the next unread ``kind`` message, waiting up to ``seconds``."""
        deadline = time.monotonic() + seconds
        while not self.got.get(kind):
            left = deadline - time.monotonic()
            if left <= 0 or self.conn.closed:
                raise AssertionError(f"{self.name}: no {kind!r} within {seconds:g} s, waiting for {what}; log {self.log}")
            if not mp_connection.wait([self.conn], timeout=left):
                continue
            try:
                got, payload = self.conn.recv()
            except (EOFError, OSError):
                self.conn.close()
                raise AssertionError(f"{self.name}: the pipe closed, waiting for {what}; log {self.log}") from None
            self.log.append((time.monotonic(), got))
            if got == "error":
                raise AssertionError(f"{self.name} raised:\n{payload}")
            self.got.setdefault(got, []).append(payload)
        return self.got[kind].pop(0)

    def call(self, *cmd: Any, seconds: float = 10.0) -> Any:
        self.send(*cmd)
        return self.wait(cmd[0], seconds, f"the answer to {cmd[0]!r}")

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)  # a stopped child gets on to its end
            except ProcessLookupError:
                pass
            try:
                self.conn.send(("stop",))
            except (OSError, ValueError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()


# ------------------------------------------------------------------------------------------ prefill


def prefill_rank(rank: int, world: int, port: int, knobs: dict[str, Any], receiver: dict[str, Any],
                 cmds: Any, out: Any, lifetime: float) -> dict[str, Any]:
    """One prefill rank of the replica (run by ``replica.run_replica``): a scheduler loop of rounds."""
    import torch.distributed as dist

    from pdcore import EmbeddingItem, PrefillConfig, PrefillPeer, ReceiverConfig

    def report(kind: str, payload: Any = None) -> None:
        out.put((rank, kind, payload))

    kv = np.zeros(4096 * 4, np.uint8)
    peer, _outbox = PrefillPeer.start(PrefillConfig(
        kv_buffers=[kv], page_bytes=4096, num_pages=4, tp_size=world, tp_rank=rank,
        bootstrap_host=HOST, bootstrap_port=port, **knobs))
    try:
        cfg = ReceiverConfig(**receiver)
        recv = peer.embedding_receiver(cfg)
        group = dist.group.WORLD
        staged: list[str] = []  # staging order, until settled
        rooms: dict[str, dict[int, tuple[int, int]]] = {}  # rid -> index -> (room, rows)
        leased: dict[str, list[tuple[int, int, int, int]]] = {}  # landed rid -> its items, slots not released
        held = False
        rounds = 0
        codes: dict[str, int] = {}
        stats: dict[str, int] = {}
        report("ready", {"endpoint": peer.control_endpoint})
        until = time.monotonic() + lifetime

        def check(rid: str) -> dict[str, Any]:
            intact, canary = True, 0
            for index, slot, start, count in leased[rid]:
                room, rows = rooms[rid][index]
                got = recv.rows(slot, count)
                want = pattern(room, rows * cfg.row_bytes)[start * cfg.row_bytes : (start + count) * cfg.row_bytes]
                intact = intact and np.array_equal(got.reshape(-1), want)
                canary += int(np.count_nonzero(got == CANARY))
            return {"intact": intact, "canary": canary}

        while True:
            todo: list[tuple[Any, ...]] = []
            if rank == 0:
                while True:
                    try:
                        todo.append(cmds.get_nowait())
                    except queue.Empty:
                        break
                if time.monotonic() > until:
                    todo.append(("stop", "lifetime"))
            box = [todo]
            dist.broadcast_object_list(box, src=0)
            todo = box[0]
            stop = step = False
            for cmd in todo:
                op = cmd[0]
                if op == "stage":
                    _, rid, items = cmd
                    staged_at = time.monotonic()  # before the receiver's clock starts the request's timeout
                    recv.stage(rid, [EmbeddingItem(index=i, host=h, port=p, room=r, rows=n) for i, h, p, r, n in items])
                    staged.append(rid)
                    rooms[rid] = {i: (r, n) for i, _h, _p, r, n in items}
                    report("staged", {"rid": rid, "t": staged_at})
                elif op == "hold":
                    held = bool(cmd[1])
                elif op == "step":
                    step = True
                elif op == "release":
                    _, rid, ranks = cmd
                    if rank in ranks and rid in leased:
                        recv.release([slot for _i, slot, _s, _c in leased.pop(rid)])
                        report("released", {"rid": rid})
                elif op == "check":
                    report("checked", {"rid": cmd[1], **check(cmd[1])})
                elif op == "stop":
                    stop = True
            if stop:
                break
            if held and not step:
                polled = recv.poll()
                now = time.monotonic()  # after the receiver's clock folded the deadlines
                for rid, code in zip(list(staged), polled):
                    if codes.get(rid) != code:
                        codes[rid] = code
                        report("local", {"rid": rid, "code": code, "t": now})
            else:
                landed = recv.round(group)
                rounds += 1
                now = time.monotonic()
                for req in landed:
                    items = [(it.index, it.slot, it.row_start, it.row_count) for it in req.items]
                    leased[req.rid] = [i for i in items if i[1] is not None]
                    staged.remove(req.rid)
                    report("landed", {"rid": req.rid, "round": rounds, "t": now, "items": items, **check(req.rid)})
                failed = recv.failed()
                if failed:
                    in_use = {slot for its in leased.values() for _i, slot, _s, _c in its}
                    canary_by_slot = {
                        s: int(np.count_nonzero(recv.rows(s, cfg.slot_rows) == CANARY))
                        for s in range(cfg.slots) if s not in in_use
                    }
                    for rid, reason in failed:
                        staged.remove(rid)
                        report("failed", {"rid": rid, "round": rounds, "t": now, "reason": reason,
                                          "canary_by_slot": canary_by_slot})
            if dict(recv.stats) != stats:
                stats = dict(recv.stats)
                report("stats", stats)
            time.sleep(_ROUND_PAUSE)
        result = {"rounds": rounds, "stats": dict(recv.stats), "staged": list(staged)}
        report("done", result)
        return result
    finally:
        peer.close()


class Replica:
    """The test's handle on a prefill replica (``prefill_rank`` on every rank), run on a thread."""

    def __init__(self, port: int, knobs: dict[str, Any], receiver: dict[str, Any], *, world: int = 2,
                 lifetime: float = 60.0) -> None:
        from replica import run_replica

        self.world = world
        self._cmds = SPAWN.Queue()
        self._out = SPAWN.Queue()
        self.reports: list[tuple[float, int, str, Any]] = []  # (when received, rank, kind, payload)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="replica")
        self._future: Future[list[Any]] = self._pool.submit(
            run_replica, prefill_rank, world, port, knobs, receiver, self._cmds, self._out, lifetime,
            timeout=lifetime + 60.0)
        self._closed = False

    def send(self, *cmd: Any) -> None:
        self._cmds.put(cmd)

    def _pump(self, wait: float) -> None:
        try:
            rank, kind, payload = self._out.get(timeout=max(0.0, wait))
        except queue.Empty:
            return
        self.reports.append((time.monotonic(), rank, kind, payload))
        while True:
            try:
                rank, kind, payload = self._out.get_nowait()
            except queue.Empty:
                return
            self.reports.append((time.monotonic(), rank, kind, payload))

    def seen(self, kind: str, rid: str | None = None, where: Any = None) -> dict[int, Any]:
        """Per rank, the first ``kind`` report (about ``rid``; and satisfying ``where``) so far."""
        found: dict[int, Any] = {}
        for _t, rank, k, payload in self.reports:
            if k != kind or rank in found:
                continue
            if rid is not None and not (isinstance(payload, dict) and payload.get("rid") == rid):
                continue
            if where is not None and not where(payload):
                continue
            found[rank] = payload
        return found

    def all(self, kind: str) -> list[tuple[int, Any]]:
        return [(rank, payload) for _t, rank, k, payload in self.reports if k == kind]

    def wait(self, kind: str, rid: str | None = None, *, seconds: float, what: str, where: Any = None,
             ranks: Any = None) -> dict[int, Any]:
        """Per rank of ``ranks`` (default: all), the first ``kind`` report; waits up to ``seconds``."""
        want = set(range(self.world) if ranks is None else ranks)
        deadline = time.monotonic() + seconds
        while True:
            found = self.seen(kind, rid, where)
            if want <= set(found):
                return {r: found[r] for r in sorted(want)}
            if self._future.done():
                self._pump(0.0)
                found = self.seen(kind, rid, where)
                if want <= set(found):
                    return {r: found[r] for r in sorted(want)}
                exc = self._future.exception()
                raise AssertionError(f"the replica ended while waiting for {what}: {exc}\nreports: {self._tail()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {kind!r} report from ranks {sorted(want - set(found))} within "
                                     f"{seconds:g} s, waiting for {what}\nreports: {self._tail()}")
            self._pump(min(left, 0.05))

    def _tail(self) -> list[tuple[int, str, Any]]:
        return [(rank, kind, _short(payload)) for _t, rank, kind, payload in self.reports[-40:]]

    def close(self, seconds: float = 30.0) -> list[Any]:
        """Stop every rank; their results (raises if a rank failed)."""
        if self._closed:
            return []
        self._closed = True
        self.send("stop")
        try:
            return self._future.result(timeout=seconds)
        finally:
            self._pump(0.0)
            self._pool.shutdown(wait=False)
            for q in (self._cmds, self._out):  # never wait at exit for a feeder nobody reads any more
                q.close()
                q.cancel_join_thread()

    def abandon(self) -> None:
        """Cleanup after a failed test: stop the ranks, wait (bounded) for run_replica to reap them."""
        if not self._closed:
            try:
                self.close()
            except BaseException:
                pass


def _short(payload: Any) -> Any:
    if isinstance(payload, dict):
        return {k: v for k, v in payload.items() if k != "canary_by_slot"}
    return payload


def items(port: int, *rooms_rows: tuple[int, int]) -> list[tuple[int, str, int, int, int]]:
    """A request's items: ``(room, rows)`` pairs from the encode deployment at ``port``, in order."""
    return [(i, HOST, port, room, rows) for i, (room, rows) in enumerate(rooms_rows)]


def wait_all(pred: Any, seconds: float, what: str) -> None:
    """Poll ``pred`` (bounded) until it is true."""
    deadline = time.monotonic() + seconds
    while not pred():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {seconds:g} s: {what}")
        time.sleep(0.01)


__all__ = ["CANARY", "Child", "Encoder", "Replica", "items", "pattern", "prefill_rank", "run_encode", "state_of",
           "wait_all"]
