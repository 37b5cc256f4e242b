"""EPD benchmark: embedding bytes per second (encode -> one prefill rank) against the TCP transport's floor,
and the receiver's poll()+settle() round against the bare agreement round.

    python benchmarks/epd.py [--quick] [--json] [--slots N] [--repeats R] [--rounds R] ...

Everything is measured in one run on this machine; each ratio compares rows
of the same run.

``throughput`` rows: an ``EncodePeer`` in this process (its deployment's
bootstrap server too) and a ``PrefillPeer`` with its ``Receiver`` in a spawned
process, over loopback. For each item size (64 KiB to 16 MiB; ``--quick``:
64 KiB, 1 MiB and 4 MiB) one run moves ``--mib`` MiB (at least ``2 x slots``
items): this process begins a room per item and hands over its rows (one
send buffer, every room reads the same ``item_bytes``; not timed), then the
prefill process stages one request per item, keeping ``2 x slots`` staged,
and runs ``Receiver.round()`` in a loop (sleeping ``--poll-interval`` when a
round hands nothing out), releasing each landed slot at once (the rows are
not copied out). Timed there, from the first ``stage`` to the last request
handed out: asks, grants, the writes, the encode rank's statuses, revokes and
rounds. Rows of ``item_bytes`` are ``hidden`` 4096 x bfloat16 (8 KiB);
``--slots`` receive slots (8) of 16 MiB each, registered once.

The floor (``floor_gbps``): the TCP transport alone through its API, between
two processes — ``benchmarks/pd.py``'s ``Floor`` (``transport.create("tcp")``,
``register``, ``connect``, ``write``, pipelined up to the transport's in-flight
bound) — moving the same items: one write of ``item_bytes`` per item, from
the same source offset, into the receive slots' layout (item ``k`` to slot
``k % slots``). Its sink registers without grants; the receiver's slots
take writes only through a grant per ask. ``ratio`` = gbps / floor_gbps;
the goal is >= 0.8 for items >= 1 MiB. Each figure is the median of
``--repeats`` timed runs (5; quick 3), the EPD and floor runs alternating
(which goes first alternates too) so load from elsewhere hits both alike.
The first run of each size is an untimed warm-up that also checks the
landed rows against the source (CRC32). ``handoffs_per_item``: the thread
hand-offs of both ranks during a timed run (``PeerBase.handoffs``: takes of
inputs from other threads by their driver threads, what queued while a driver
worked being one, plus frames handed to their control channels' threads), per item. ``cpu_us_per_item``: the CPU of both
processes per item (the prefill rank's over its timed part, the encode rank's
from its first ``begin`` to the last room's conclusion), ``floor_cpu_us_per_item``
the floor processes' over a floor run, ``cpu_ratio_floor_vs_epd`` the second
over the first: on a 2-core machine the throughput follows it, and it is the
steadier figure when the machine is loaded from elsewhere.
Both control planes in the same run: the ranks run on ``"tcp"`` (the default); a second pair of
ranks on ``"zmq"`` takes turns with them and the floor (``zmq_gbps``, ``zmq_ratio`` against the same
floor, ``zmq_handoffs_per_item``).
``frames_per_message``: both ranks' control frames over the messages that carried
them, heartbeats aside (``PeerBase.control_sends``; see ``benchmarks/control.py``).
``wakeups_per_item`` and ``floor_wakeups_per_item``: the voluntary context
switches of every thread of those processes, per item (``benchmarks/pd.py``
says what one costs). ``threads_per_item`` (a line per item size, the busiest
first): both ranks' CPU µs and wake-ups per ``"<process> <thread>"`` (``encode
encode-driver``, ``prefill tcp-sink``, ``prefill main``: the scheduler's loop) over the
timed runs (``benchmarks/_usage.py``). Units: ``gbps`` and ``floor_gbps``
are gigabits per second (1e9 bit/s).

``round`` rows: the scheduler-thread cost of the receiver's round with
``--requests`` (4,096) requests staged, one item each, every item asked
(its slot leased; the items name an encode deployment whose bootstrap
address listens and never answers, so the worker's lookups wait on an I/O
thread and nothing is sent: the landings are made as the worker would make
them, ``ReceiveTable.landed``, not timed, and a landed item leaves the
worker's lookup queue). Every round ~1% of the requests land; each round
hands them out, their slots are released and as many new requests staged
in their place (not timed); before each timed call the peer's worker is
let finish the asks of the requests just staged. Beside
it, in the same rounds, the bare agreement round of the same size:
``benchmarks/agreement.py``'s ``library_rounds`` (``Agreement.round`` on a
bare ``StateTable`` of 4,096, ~1% changing per round); the three take turns
going first. ``world`` 1: one rank, in this process: ``poll()`` then
``settle(codes)`` (the scheduler's two calls, a list in between) and
``round()`` (no collective), against the bare round without a collective.
``world`` 2 (``--skip-replica`` leaves it out): a 2-rank replica in two
processes, ``Receiver.round(group)`` against the bare ``Agreement.round``,
each through shared memory (``agreement="shm"``) and through gloo
(``"group"``); each timed call starts after a barrier. Median µs per call
(rank 0's); ``ratio`` = receiver µs / bare µs.

``--quick`` stays under 60 s on a 2-core machine (45 s measured while other
jobs kept the load average near 9). ``--json`` prints one object
``{"rows": [...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import zlib
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[0] != ROOT:  # ahead of benchmarks/, whose transport.py would shadow the package
    sys.path.insert(0, ROOT)

from benchmarks.agreement import _shm_barrier, _sync, library_rounds  # noqa: E402
from benchmarks._pipeline import RunClock, gloo_world, say  # noqa: E402
from benchmarks._usage import OwnUsage, ThreadUsage, add_spent, per_unit, thread_lines  # noqa: E402
from benchmarks.pd import Floor, _recv  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
TARGET_RATIO = 0.8  # EPD vs the transport floor, items >= 1 MiB
PAGE = 64 * KiB  # the floor's page: every item size is a whole number of them, written as one coalesced write
MAX_ITEM = 16 * MiB
HIDDEN, DTYPE, ITEMSIZE = 4096, "torch.bfloat16", 2
ROW_BYTES = HIDDEN * ITEMSIZE
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
QUICK_SIZES = (64 * KiB, 1 * MiB, 4 * MiB)


# ----------------------------------------------------------------------------- throughput: the prefill process


def _prefill_main(conn: Connection, slots: int, poll_interval: float, control: str) -> None:
    """A prefill rank with its receiver; on ``("run", rooms, rows, encode_port, check)`` receives one item per room."""
    from pdcore import EmbeddingItem, PrefillConfig, PrefillPeer, ReceiverConfig
    from pdcore.control.bootstrap import BootstrapServer

    server = BootstrapServer(host="127.0.0.1", port=0)
    port = server.start()
    slot_rows = MAX_ITEM // ROW_BYTES
    peer, _ = PrefillPeer.start(PrefillConfig(
        kv_buffers=[np.zeros(8 * 4096, np.uint8)], page_bytes=4096, num_pages=8,
        bootstrap_host="127.0.0.1", bootstrap_port=port, control=control,
    ))
    try:
        recv = peer.embedding_receiver(ReceiverConfig(
            slots=slots, slot_rows=slot_rows, hidden=HIDDEN, dtype=DTYPE, timeout=600.0, max_requests=4 * slots,
            buffer=np.ones(slots * slot_rows * ROW_BYTES, np.uint8),  # resident, as the floor sink's memory is
        ))
        conn.send("ready")
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            rooms, rows, encode_port, check = arg
            n, ahead = len(rooms), 2 * slots
            staged = done = 0
            crc = None
            handoffs, sends = peer.handoffs(), peer.control_sends()
            usage = OwnUsage()
            t0 = time.perf_counter()
            while done < n:
                while staged < n and staged - done < ahead:
                    recv.stage(f"r{rooms[staged]}", [EmbeddingItem(0, "127.0.0.1", encode_port, rooms[staged], rows)])
                    staged += 1
                landed = recv.round()
                if recv.failed():
                    raise RuntimeError(f"receiving failed: {recv.failed()[:3]}")
                for req in landed:
                    slot = req.items[0].slot
                    if check and crc is None:
                        crc = zlib.crc32(recv.rows(slot, rows))
                    recv.release([slot])
                    done += 1
                if not landed:
                    time.sleep(poll_interval)
            seconds = time.perf_counter() - t0
            cpu, woke = usage.spent()
            sent = tuple(now - then for now, then in zip(peer.control_sends(), sends))
            conn.send((seconds, crc, peer.handoffs() - handoffs, cpu, woke, sent))
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        peer.close()
        server.close()


class Epd:
    """This process's encode rank and the spawned prefill rank (both on the control plane ``control``),
    kept for the whole benchmark."""

    def __init__(self, slots: int, poll_interval: float, control: str = "tcp") -> None:
        from pdcore import EncodeConfig, EncodePeer
        from pdcore.control.bootstrap import BootstrapServer

        self.server = BootstrapServer(host="127.0.0.1", port=0)
        self.port = self.server.start()
        self.send_buffer = np.random.default_rng(0).integers(0, 256, MAX_ITEM, dtype=np.uint8)
        self.peer, self.sender = EncodePeer.start(EncodeConfig(
            send_buffers=[self.send_buffer], bootstrap_host="127.0.0.1", bootstrap_port=self.port,
            max_rooms=8192, park_timeout=600.0, control=control,
        ))
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.child = ctx.Process(target=_prefill_main, args=(child, slots, poll_interval, control), daemon=True)
        self.child.start()
        hello = _recv(self.pipe, 120, "the prefill process")
        if hello != "ready":
            raise RuntimeError(f"the prefill process did not start: {hello}")
        self.next_room = 1

    def run(self, item_bytes: int, items: int, check: bool = False) -> tuple[float, int, float, int, float, dict[str, tuple[float, float]]]:
        """Seconds for the prefill rank to receive ``items`` items of ``item_bytes`` (its own clock); the
        thread hand-offs both ranks made meanwhile (``PeerBase.handoffs``); the CPU seconds and
        wake-ups of both processes: the prefill rank's over its timed part, the encode rank's (this
        process) from its first ``begin`` to the last room's conclusion; both ranks' control frames
        per ZeroMQ message (``PeerBase.control_sends``); and both processes' CPU and wake-ups per thread
        over the same span (``ThreadUsage``)."""
        from pdcore import EmbeddingChunk

        rows = item_bytes // ROW_BYTES
        rooms = list(range(self.next_room, self.next_room + items))
        self.next_room += items
        src = int(self.send_buffer.ctypes.data)
        handoffs, sends = self.peer.handoffs(), self.peer.control_sends()
        usage, threads = OwnUsage(), ThreadUsage([os.getpid(), self.child.pid])
        for room in rooms:  # the encode scheduler: every item's rows are ready before the prefill side starts
            if not self.sender.begin(room):
                raise RuntimeError(f"encode rank refused room {room}")
            self.sender.send(EmbeddingChunk(room=room, source=src, rows=rows, hidden=HIDDEN, dtype=DTYPE, nbytes=item_bytes))
        self.pipe.send(("run", (rooms, rows, self.port, check)))
        reply = _recv(self.pipe, 600, "the prefill process (run)")
        if isinstance(reply, dict):
            raise RuntimeError(f"the prefill process failed: {reply['error']}")
        seconds, crc, prefill_handoffs, prefill_cpu, prefill_woke, prefill_sent = reply
        if check and crc != zlib.crc32(self.send_buffer[:item_bytes]):
            raise RuntimeError(f"the rows of a {item_bytes}-byte item landed different from the source")
        concluded: list[int] = []
        until = time.monotonic() + 30
        while len(concluded) < items and time.monotonic() < until:  # every room gives its send slot back
            concluded += self.sender.concluded()
            if len(concluded) < items:
                time.sleep(0.001)
        if sorted(concluded) != rooms:
            raise RuntimeError(f"{len(concluded)} of {items} rooms concluded")
        cpu, woke = usage.spent()
        cpu, woke = cpu + prefill_cpu, woke + prefill_woke
        frames, messages = (theirs + now - then for theirs, now, then in zip(prefill_sent, self.peer.control_sends(), sends))
        per_thread = threads.spent()
        return float(seconds), prefill_handoffs + self.peer.handoffs() - handoffs, cpu, woke, frames / max(1, messages), per_thread

    def close(self) -> None:
        try:
            self.pipe.send(("stop", None))
        except OSError:
            pass
        self.child.join(15)
        if self.child.is_alive():
            self.child.kill()
        self.peer.close()
        self.server.close()


def bench_throughput(args: argparse.Namespace, say: Any) -> list[dict[str, Any]]:
    sizes = QUICK_SIZES if args.quick else SIZES
    slot_pages = MAX_ITEM // PAGE
    say(f"throughput: starting the encode and prefill ranks and the floor's two processes ({args.slots} slots)")
    floor = Floor(1, 1, PAGE, args.slots * slot_pages)
    epd = zmq = None
    rows = []
    try:
        epd = Epd(args.slots, args.poll_interval)
        zmq = Epd(args.slots, args.poll_interval, "zmq")  # the same on the other control plane, taking turns
        for item_bytes in sizes:
            items = max(2 * args.slots, args.mib * MiB // item_bytes)
            pages = item_bytes // PAGE
            mix = [(list(range(pages)), list(range((k % args.slots) * slot_pages, (k % args.slots) * slot_pages + pages)))
                   for k in range(items)]
            nbytes, writes = floor.load([mix])
            if nbytes != items * item_bytes or writes != items:
                raise RuntimeError(f"the floor replays {writes} writes of {nbytes} bytes, not {items} of {item_bytes}")
            say(f"throughput: {items} items of {item_bytes // KiB} KiB, {args.repeats} runs each")
            epd.run(item_bytes, min(items, 4 * args.slots), check=True)  # warm-up, and the rows are right
            zmq.run(item_bytes, min(items, 4 * args.slots), check=True)
            floor.once()
            epd_s, floor_s, handoffs, cpu, floor_cpu, woke, floor_woke, shared = [], [], [], [], [], [], [], []
            zmq_s, zmq_handoffs = [], []
            threads: dict[str, tuple[float, float]] = {}  # every timed run's, summed
            for k in range(args.repeats):
                for who in (("epd", "zmq", "floor") if k % 2 == 0 else ("floor", "zmq", "epd")):
                    if who == "zmq":
                        seconds, n, *_ = zmq.run(item_bytes, items)
                        zmq_s.append(seconds)
                        zmq_handoffs.append(n / items)
                    elif who == "epd":
                        seconds, n, used, w, per_message, spent = epd.run(item_bytes, items)
                        add_spent(threads, spent)
                        epd_s.append(seconds)
                        shared.append(per_message)
                        handoffs.append(n / items)
                        cpu.append(used / items)
                        woke.append(w / items)
                    else:
                        seconds, used = floor.once()
                        floor_s.append(seconds)
                        floor_cpu.append(used / items)
                        floor_woke.append(floor.last_wakeups / items)
            bits = items * item_bytes * 8
            gbps, floor_gbps = bits / statistics.median(epd_s) / 1e9, bits / statistics.median(floor_s) / 1e9
            rows.append({
                "kind": "throughput", "item_bytes": item_bytes, "items": items, "bytes": items * item_bytes,
                "slots": args.slots, "gbps": round(gbps, 3), "floor_gbps": round(floor_gbps, 3),
                "ratio": round(gbps / floor_gbps, 3), "items_per_s": round(items / statistics.median(epd_s), 1),
                "floor_items_per_s": round(items / statistics.median(floor_s), 1),
                "handoffs_per_item": round(statistics.median(handoffs), 1),
                "cpu_us_per_item": round(statistics.median(cpu) * 1e6, 1),
                "floor_cpu_us_per_item": round(statistics.median(floor_cpu) * 1e6, 1),
                "cpu_ratio_floor_vs_epd": round(statistics.median(floor_cpu) / statistics.median(cpu), 3),
                "wakeups_per_item": round(statistics.median(woke), 2),
                "floor_wakeups_per_item": round(statistics.median(floor_woke), 2),
                "frames_per_message": round(statistics.median(shared), 2),
                "threads_per_item": per_unit(threads, items * args.repeats),
                "zmq_gbps": round(bits / statistics.median(zmq_s) / 1e9, 3),
                "zmq_ratio": round(bits / statistics.median(zmq_s) / 1e9 / floor_gbps, 3),
                "zmq_handoffs_per_item": round(statistics.median(zmq_handoffs), 1),
                "seconds_all": [round(s, 4) for s in epd_s], "floor_seconds_all": [round(s, 4) for s in floor_s],
            })
    finally:
        for pair in (epd, zmq):
            if pair is not None:
                pair.close()
        floor.close()
    return rows


# ----------------------------------------------------------------------------- the receiver's round


def _quiet(peer: Any) -> None:
    """Let the peer's driver finish the inputs of the requests just staged: the timed call is the scheduler's alone."""
    peer.quiesce(5.0)  # returns once every input queued before it ran


def _landed_in_engine(engine: Any, rids: list[str]) -> None:
    """White-box, on the driver's thread: no encode rank answers here, so its items are marked as needing
    no look-up in the receiver engine's own records (no input of the engine says that)."""
    for rid in rids:
        engine._items[(rid, 0)].dropped = True


def receiver_rounds(n: int, group: Any, world: int, rank: int, ports: tuple[int, int], mode: str, call: str) -> Iterator[float]:
    """µs-timed rounds of a ``Receiver`` with ``n`` requests staged, ~1% landing per round (as ``library_rounds``).

    ``ports``: the prefill deployment's bootstrap server and the items' encode deployment's (which never
    answers: nothing is ever asked or written); ``call``: "poll+settle" (one rank) or "round"."""
    from pdcore import EmbeddingItem, PrefillConfig, PrefillPeer, ReceiverConfig

    peer, _ = PrefillPeer.start(PrefillConfig(
        kv_buffers=[np.zeros(8 * 4096, np.uint8)], page_bytes=4096, num_pages=8, tp_size=world, tp_rank=rank,
        bootstrap_host="127.0.0.1", bootstrap_port=ports[0], agreement=mode,
    ))
    try:
        recv = peer.embedding_receiver(ReceiverConfig(
            slots=n, slot_rows=1, hidden=8, dtype="torch.uint8", max_requests=n, max_items=1, timeout=1e9,
        ))
        table = recv.table
        serial = 0

        def stage() -> str:
            nonlocal serial
            serial += 1
            rid = f"req-{serial}"
            recv.stage(rid, [EmbeddingItem(0, "127.0.0.1", ports[1], serial, 1)])
            return rid

        rids = [stage() for _ in range(n)]
        index = {rid: i for i, rid in enumerate(rids)}
        per_round = max(1, n // 100)
        cursor = 0
        barrier = _shm_barrier(group, world) if mode == "shm" else None
        while True:
            now = time.monotonic()
            landing = [rids[(cursor + j) % n] for j in range(per_round)]  # the data plane's landings (not timed)
            # landed: the item no longer waits for its encode rank's look-up (the engine's own record, on its thread)
            peer.run_on_driver(_landed_in_engine, recv.engine, landing)
            for rid in landing:
                table.landed(rid, 0, now)
            cursor += per_round
            _quiet(peer)
            _sync(group, world, barrier)
            t0 = time.perf_counter()
            landed = recv.settle(recv.poll()) if call == "poll+settle" else recv.round(group if world > 1 else None)
            yield time.perf_counter() - t0
            # the data plane copies the rows out, the scheduler stages new requests in their place (not timed)
            recv.release([it.slot for req in landed for it in req.items])
            for req in landed:
                i = index.pop(req.rid)
                rids[i] = stage()
                index[rids[i]] = i
    finally:
        peer.close()


def measure_rounds(n: int, rounds: int, group: Any, world: int, rank: int, ports: dict[str, tuple[int, int]]) -> list[dict[str, Any]]:
    """Medians per (agreement, call) against the bare round of the same mode; the generators take turns."""
    if world == 1:
        pairs = [("none", "poll+settle"), ("none", "round")]
        bare = {"none": library_rounds(n, None, 1, "group")}  # one rank: no collective in either
    else:
        pairs = [("shm", "round"), ("group", "round")]
        bare = {mode: library_rounds(n, group, world, mode) for mode in ("shm", "group")}
    gens: dict[str, Iterator[float]] = {f"bare {mode}": g for mode, g in bare.items()}
    for mode, call in pairs:
        gens[f"{mode} {call}"] = receiver_rounds(n, group, world, rank, ports[f"{mode} {call}"],
                                                 "group" if mode == "none" else mode, call)
    names = list(gens)
    samples: dict[str, list[float]] = {name: [] for name in names}
    try:
        for k in range(rounds):
            first = k % len(names)
            for name in names[first:] + names[:first]:
                dt = next(gens[name])
                if k >= rounds // 10:  # warm-up
                    samples[name].append(dt)
    finally:
        for g in gens.values():
            g.close()  # type: ignore[attr-defined]
    rows = []
    for mode, call in pairs:
        mine, theirs = samples[f"{mode} {call}"], samples[f"bare {mode}"]
        us, bare_us = statistics.median(mine) * 1e6, statistics.median(theirs) * 1e6
        rows.append({
            "kind": "round", "world": world, "requests": n, "agreement": mode, "call": call, "rounds": rounds,
            "us": round(us, 2), "bare_us": round(bare_us, 2), "ratio": round(us / bare_us, 3),
            "overhead_us": round(statistics.median(a - b for a, b in zip(mine, theirs)) * 1e6, 2),
            "p90_us": round(float(np.percentile(mine, 90)) * 1e6, 2),
            "bare_p90_us": round(float(np.percentile(theirs, 90)) * 1e6, 2),
        })
    return rows


def _rounds_measure(group: Any, rank: int, world: int, n: int, rounds: int, ports: dict[str, tuple[int, int]]) -> Any:
    return measure_rounds(n, rounds, group, world, rank, ports)


def bench_rounds(args: argparse.Namespace, say: Any) -> list[dict[str, Any]]:
    from pdcore.control.bootstrap import BootstrapServer

    rows: list[dict[str, Any]] = []
    for world in (1, 2):
        if world == 2 and args.skip_replica:
            continue
        say(f"round: {args.requests} requests staged, world {world}, {args.rounds} rounds")
        keys = ["none poll+settle", "none round"] if world == 1 else ["shm round", "group round"]
        servers = [BootstrapServer(host="127.0.0.1", port=0) for _ in keys]
        # The items' encode deployment: a socket that listens and never answers, so each lookup waits out its
        # slice on an I/O thread and the asks stay unsent; nothing competes with the timed calls but the churn.
        silent = socket.create_server(("127.0.0.1", 0), backlog=1024)
        try:
            encode = silent.getsockname()[1]
            ports = {key: (server.start(), encode) for key, server in zip(keys, servers)}
            if world == 1:
                rows += measure_rounds(args.requests, args.rounds, None, 1, 0, ports)
                continue
            result = gloo_world(world, "pdcore-bench-epd-", _rounds_measure, args.requests, args.rounds, ports)
            if isinstance(result, dict):
                raise RuntimeError(f"round benchmark, world {world}: {result['error']}")
            rows += result
        finally:
            for server in servers:
                server.close()
            silent.close()
    return rows


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--quick", action="store_true", help="3 item sizes, fewer bytes and rounds: under 60 s")
    ap.add_argument("--slots", type=int, default=8, help="the receiver's slots (16 MiB each): items in flight")
    ap.add_argument("--mib", type=int, default=None, help="MiB per throughput run (default 512, quick 128)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per item size, each side (default 5, quick 3)")
    ap.add_argument("--poll-interval", type=float, default=0.0002,
                    help="seconds the prefill loop sleeps after a round that handed nothing out")
    ap.add_argument("--requests", type=int, default=4096, help="requests staged in the round rows")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per round row (default 2000, quick 300)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-rounds", action="store_true")
    ap.add_argument("--skip-replica", action="store_true", help="leave out the 2-rank round rows")
    args = ap.parse_args(argv)
    args.mib = args.mib or (128 if args.quick else 512)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.rounds = args.rounds or (300 if args.quick else 2000)

    from pdcore.epd.recv_table import IMPLEMENTATION

    clock = RunClock(args.quick)
    rows: list[dict[str, Any]] = []
    if not args.skip_throughput:
        rows += bench_throughput(args, say)
    if not args.skip_rounds:
        rows += bench_rounds(args, say)
    big = [r["ratio"] for r in rows if r["kind"] == "throughput" and r["item_bytes"] >= MiB]
    summary = {
        "table_implementation": IMPLEMENTATION,
        "units": "gbps and floor_gbps are 1e9 bit/s, medians of the timed runs; us are medians per call",
        "floor": "the TCP transport's register/connect/write between two processes (benchmarks/pd.py Floor), "
                 "one write per item into the receive slots' layout, pipelined",
        "target_ratio_ge_1MiB": TARGET_RATIO,
        "min_ratio_ge_1MiB": min(big) if big else None,
        "meets_target": all(r >= TARGET_RATIO for r in big) if big else None,
        **clock.fields(),
    }
    if args.json:
        print(json.dumps({"rows": rows, **summary}, indent=1))
        return 0
    thr = [r for r in rows if r["kind"] == "throughput"]
    if thr:
        print(f"embedding bytes, encode -> one prefill rank ({args.slots} slots, hidden {HIDDEN} {DTYPE}) vs the TCP "
              f"transport floor on the same writes; medians of {args.repeats} runs")
        print(f"{'item':>9} {'items':>6} {'MiB':>6} {'Gb/s':>8} {'floor':>8} {'ratio':>6} {'items/s':>9} {'floor items/s':>13} "
              f"{'CPU µs/item':>11} {'floor':>6} {'CPU ratio':>9} {'wake-ups/item':>13} {'floor':>6} {'hand-offs/item':>14} {'frames/msg':>10} "
              f"{'zmq Gb/s':>8} {'ratio':>6} {'hand-offs':>9}")
        for r in thr:
            print(f"{r['item_bytes'] // KiB:>6} KiB {r['items']:>6} {r['bytes'] / MiB:>6.0f} {r['gbps']:>8.2f} "
                  f"{r['floor_gbps']:>8.2f} {r['ratio']:>6.2f} {r['items_per_s']:>9.0f} {r['floor_items_per_s']:>13.0f} "
                  f"{r['cpu_us_per_item']:>11.0f} {r['floor_cpu_us_per_item']:>6.0f} {r['cpu_ratio_floor_vs_epd']:>9.2f} "
                  f"{r['wakeups_per_item']:>13.1f} {r['floor_wakeups_per_item']:>6.1f} {r['handoffs_per_item']:>14.1f} "
                  f"{r['frames_per_message']:>10.2f} {r['zmq_gbps']:>8.2f} {r['zmq_ratio']:>6.2f} "
                  f"{r['zmq_handoffs_per_item']:>9.1f}")
        for r in thr:
            print(f"{r['item_bytes'] // KiB} KiB threads: {thread_lines(r['threads_per_item'], 'item')}")
        if big:
            print(f"target: items >= 1 MiB at >= {TARGET_RATIO} x the floor -> "
                  f"{'met' if summary['meets_target'] else 'NOT met'} (min {summary['min_ratio_ge_1MiB']:.2f})")
    rnd = [r for r in rows if r["kind"] == "round"]
    if rnd:
        print(f"the receiver's round with {args.requests} requests staged, ~1% landing per round, vs the bare agreement "
              f"round of the same size; median µs ({args.rounds} rounds)")
        print(f"{'world':>5} {'agreement':>9} {'call':>12} {'µs':>9} {'bare µs':>9} {'ratio':>7} {'overhead':>9} {'p90':>9}")
        for r in rnd:
            print(f"{r['world']:>5} {r['agreement']:>9} {r['call']:>12} {r['us']:>9.1f} {r['bare_us']:>9.1f} "
                  f"{r['ratio']:>6.2f}x {r['overhead_us']:>9.1f} {r['p90_us']:>9.1f}")
    print(f"table {summary['table_implementation']}; {summary['seconds']} s (--json for every field)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
