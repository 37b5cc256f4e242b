"""EPD across real processes: encode deployments and a prefill replica, each rank its own process.

The parent runs the bootstrap servers (one per encode deployment, one for the
prefill replica), spawns every encode rank (``Encoder.tp`` x ``Encoder.dp``
processes per deployment; an encode rank needs no group: each serves its own
block) and runs the prefill replica through ``replica.run_replica`` (one
process per rank, a real gloo group). Nothing is shared but sockets.

- An **encode rank** is a miniature encode scheduler: for each of its rooms (the
  images of its deployment whose ``room % dp`` is its DP rank, in request
  order) it takes a free send slot of its one registered send buffer, begins
  the room, fills the slot with the image's rows (``pattern``) and sends them
  (or ``fail``\\ s the room for an ``Image(fail=True)``). A slot's rows stay
  untouched until ``concluded`` returns its room; then the slot is overwritten
  with a poison byte at once and taken by the next room, so a room that
  concluded too early shows up as wrong rows on the prefill ranks.
- A **prefill rank** stages each request before the round ``Request.stage_round``
  (the same round on every rank: rounds are collective), runs ``round`` over
  the replica's group until every request settled, checks every landed item
  against its own share (``share``) and the rows against ``pattern``, and
  releases the slots. It returns, per round in which something settled, what
  settled and what failed, so the parent can compare the ranks.

Everything is bounded by ``Cluster.timeout`` (each loop has a ``Deadline``),
and every child is joined, or killed, before ``run_cluster`` returns.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdcore.core.deadline import Deadline
from pdcore.epd.types import DTYPE_ITEMSIZE

HOST = "127.0.0.1"
POISON = 0xA5  # what a send slot holds between its room's conclusion and the next room's rows
FAIL_REASON = "the encoder could not read the image"
_MAX_ERRORS = 50  # per rank: enough to see a pattern, bounded


@dataclass(frozen=True)
class Image:
    """One multimodal item: ``rows`` rows shipped under ``room`` by encode deployment ``deployment``."""

    room: int
    rows: int
    deployment: int
    fail: bool = False  # the encode scheduler fails the room instead of sending its rows


@dataclass(frozen=True)
class Request:
    rid: str
    images: tuple[Image, ...]
    stage_round: int = 0  # every prefill rank stages it just before this round

    @property
    def fails(self) -> bool:
        return any(img.fail for img in self.images)


@dataclass(frozen=True)
class Encoder:
    """An encode deployment: ``tp`` x ``dp`` ranks behind one bootstrap server."""

    tp: int
    dp: int = 1


@dataclass(frozen=True)
class Cluster:
    encoders: tuple[Encoder, ...]
    prefill_tp: int
    shard_rows: bool
    requests: tuple[Request, ...]
    hidden: int = 12
    deepstack_width: int = 0
    dtype: str = "torch.float16"
    slots: int = 6  # receive slots per prefill rank
    slot_rows: int = 40
    send_slots: int = 2  # rooms an encode rank holds rows for at once
    timeout: float = 60.0  # every loop's deadline, the receivers' timeout and the encode ranks' park timeout

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    def rooms_of(self, deployment: int, dp_rank: int) -> list[Image]:
        """The images an encode rank of ``dp_rank`` in ``deployment`` serves, in request order."""
        dp = self.encoders[deployment].dp
        return [img for req in self.requests for img in req.images
                if img.deployment == deployment and img.room % dp == dp_rank]


# -- what the rows hold, and whose they are (computed here, independently of the library) ----------------------------


def share(rows: int, rank: int, ranks: int, sharded: bool) -> tuple[int, int]:
    """Prefill rank ``rank`` of ``ranks``: its (row_start, row_count) of an image of ``rows`` rows."""
    if not sharded:
        return 0, rows
    base, rem = divmod(rows, ranks)
    return rank * base + min(rank, rem), base + (rank < rem)


def pattern(room: int, start: int, count: int, width: int, itemsize: int, deep: bool) -> np.ndarray:
    """Rows ``[start, start + count)`` of ``room``'s image (``deep``: its deepstack rows) as raw bytes,
    shape ``(count, width * itemsize)``: each element's bits a hash of (room, row, column, deep)."""
    r = np.arange(start, start + count, dtype=np.uint64)[:, None]
    c = np.arange(width, dtype=np.uint64)[None, :]
    seed = np.full((1, 1), room * 1_000_003 + (77_777 if deep else 0), dtype=np.uint64)
    v = (seed + r * np.uint64(8191) + c * np.uint64(131)) * np.uint64(0x9E3779B97F4A7C15)  # arrays wrap silently
    v ^= v >> np.uint64(29)
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    return np.ascontiguousarray(v.astype(bits)).view(np.uint8).reshape(count, width * itemsize)


# -- a plan of requests -----------------------------------------------------------------------------------------------


def make_requests(
    n: int, encoders: tuple[Encoder, ...], prefill_tp: int, *, seed: int, slot_rows: int,
    failing: int = 1, first_room: int = 1000, waves: int = 3,
) -> tuple[Request, ...]:
    """``n`` requests of 1-4 images with varied row counts, deterministic in ``seed``.

    The first request is fixed: 4 images, one with fewer rows than prefill
    ranks (an empty shard when sharded), one of exactly 1 row, from both
    deployments when there are two. ``failing`` single-image requests (not the
    first) have their image failed by the encode scheduler. The requests are
    staged in ``waves`` rounds (0, 2, 4, ...).
    """
    rng = random.Random(seed)
    room = first_room
    two = len(encoders) > 1
    assert n >= 1 + failing
    reqs: list[Request] = []
    for k in range(n):
        if k == 0:
            sizes = [max(1, prefill_tp - 1), slot_rows, 1, 2 * prefill_tp + 1]
            deps = [0, 1 if two else 0, 0, 1 if two else 0]
        elif k <= failing:
            sizes, deps = [rng.randint(1, slot_rows)], [rng.randrange(len(encoders))]
        else:
            m = rng.randint(1, 4)
            sizes = [rng.choice([1, rng.randint(1, max(1, prefill_tp - 1)), rng.randint(1, slot_rows)]) for _ in range(m)]
            deps = [rng.randrange(len(encoders)) for _ in range(m)]
        images = []
        for rows, dep in zip(sizes, deps):
            images.append(Image(room=room, rows=rows, deployment=dep, fail=0 < k <= failing))
            room += rng.randint(1, 3)  # rooms of both parities: both DP groups of a dp-2 deployment get some
        reqs.append(Request(f"req{k}", tuple(images), stage_round=2 * (k * waves // n)))
    return tuple(reqs)


# -- an encode rank -------------------------------------------------------------------------------------------------


def encode_rank(cluster: Cluster, deployment: int, dp_rank: int, tp_rank: int, port: int, stop: Any) -> dict[str, Any]:
    """The encode scheduler of one rank; keeps its peer up until ``stop`` is set (the prefill side finished)."""
    from pdcore.epd.config import EncodeConfig
    from pdcore.epd.encode import EncodePeer
    from pdcore.epd.types import EmbeddingChunk

    enc = cluster.encoders[deployment]
    width, deep_width, isz = cluster.hidden, cluster.deepstack_width, cluster.itemsize
    main_bytes = cluster.slot_rows * width * isz
    deep_bytes = cluster.slot_rows * deep_width * isz
    slot_bytes = main_bytes + deep_bytes
    buf = np.full(cluster.send_slots * slot_bytes, POISON, np.uint8)
    deadline = Deadline.after(cluster.timeout)
    peer, sender = EncodePeer.start(EncodeConfig(
        send_buffers=[buf], bootstrap_host=HOST, bootstrap_port=port, tp_size=enc.tp, tp_rank=tp_rank,
        dp_size=enc.dp, dp_rank=dp_rank, park_timeout=cluster.timeout, heartbeat_interval=0.25,
        dead_after=cluster.timeout, tombstone_ttl=cluster.timeout, start_timeout=cluster.timeout,
    ))
    errors: list[str] = []
    order: list[int] = []  # rooms in the order concluded() returned them
    rooms = cluster.rooms_of(deployment, dp_rank)
    try:
        pending = deque(rooms)
        free = list(range(cluster.send_slots))
        inflight: dict[int, tuple[int, Image]] = {}  # room -> (send slot, image)

        def span(slot: int, img: Image) -> tuple[np.ndarray, np.ndarray]:
            base = slot * slot_bytes
            main = buf[base:base + img.rows * width * isz].reshape(img.rows, width * isz)
            deep = buf[base + main_bytes:base + main_bytes + img.rows * deep_width * isz].reshape(img.rows, deep_width * isz)
            return main, deep

        while pending or inflight:
            if deadline.expired():
                errors.append(f"rooms {sorted(inflight)} (+{len(pending)} not begun) did not conclude "
                              f"within {cluster.timeout} s")
                break
            busy = False
            while pending and free:
                img = pending.popleft()
                slot = free.pop()
                if not sender.begin(img.room):
                    errors.append(f"begin({img.room}) refused")
                    free.append(slot)
                    continue
                main, deep = span(slot, img)
                main[:] = pattern(img.room, 0, img.rows, width, isz, False)
                if deep_width:
                    deep[:] = pattern(img.room, 0, img.rows, deep_width, isz, True)
                inflight[img.room] = (slot, img)
                if img.fail:
                    sender.fail(img.room, FAIL_REASON)
                else:
                    addr = buf.ctypes.data + slot * slot_bytes
                    sender.send(EmbeddingChunk(
                        room=img.room, source=addr, rows=img.rows, hidden=width, dtype=cluster.dtype,
                        nbytes=main.nbytes, deepstack_source=addr + main_bytes if deep_width else 0,
                        deepstack_width=deep_width, deepstack_nbytes=deep.nbytes if deep_width else 0,
                    ))
                busy = True
            for room in sender.concluded():
                busy = True
                order.append(room)
                if room not in inflight:
                    errors.append(f"concluded() returned room {room}, which is not in flight")
                    continue
                slot, img = inflight.pop(room)
                main, deep = span(slot, img)
                if not np.array_equal(main, pattern(room, 0, img.rows, width, isz, False)) or (
                        deep_width and not np.array_equal(deep, pattern(room, 0, img.rows, deep_width, isz, True))):
                    errors.append(f"room {room}'s rows changed in the send buffer before it concluded")
                buf[slot * slot_bytes:(slot + 1) * slot_bytes] = POISON  # the rows are the scheduler's again
                free.append(slot)
            if not busy:
                time.sleep(0.002)  # a scheduler's step; the deadline bounds the loop
        # the prefill ranks may still be settling: stay up (bounded) so nobody sees this rank vanish
        if not stop.wait(max(0.0, deadline.remaining()) + 30.0):
            errors.append("the parent never said stop")
        frames = peer.control_sends()[0]
    finally:
        peer.close()
    return {"rooms": [img.room for img in rooms], "concluded": order, "errors": errors[:_MAX_ERRORS],
            "frames": frames}


def _encode_main(cluster: Cluster, deployment: int, dp_rank: int, tp_rank: int, port: int, stop: Any, out: Any) -> None:
    key = (deployment, dp_rank, tp_rank)
    try:
        out.put((key, "ok", encode_rank(cluster, deployment, dp_rank, tp_rank, port, stop)))
    except BaseException as exc:  # report, never hang the parent
        out.put((key, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# -- a prefill rank ---------------------------------------------------------------------------------------------------


def prefill_rank(rank: int, world: int, cluster: Cluster, pd_port: int, ports: list[int]) -> dict[str, Any]:
    """One rank of the prefill replica (run by ``replica.run_replica`` inside a gloo group)."""
    import torch.distributed as dist

    from pdcore.epd.config import ReceiverConfig
    from pdcore.epd.types import EmbeddingItem
    from pdcore.pd.prefill import PrefillConfig, PrefillPeer

    width, deep_width = cluster.hidden, cluster.deepstack_width
    peer, _ = PrefillPeer.start(PrefillConfig(
        kv_buffers=[np.zeros(4 * 4096, np.uint8)], page_bytes=4096, num_pages=4, bootstrap_host=HOST,
        bootstrap_port=pd_port, tp_size=world, tp_rank=rank, heartbeat_interval=0.25, dead_after=cluster.timeout,
        start_timeout=cluster.timeout, tombstone_ttl=cluster.timeout, agreement_timeout=30.0,  # a loaded machine
    ))
    rounds: list[tuple[int, list[tuple[str, tuple[tuple[Any, ...], ...]]], list[tuple[str, str]]]] = []
    errors: list[str] = []
    settled: set[str] = set()
    by_rid = {req.rid: req for req in cluster.requests}
    try:
        recv = peer.embedding_receiver(ReceiverConfig(
            slots=cluster.slots, slot_rows=cluster.slot_rows, hidden=width, dtype=cluster.dtype,
            deepstack_width=deep_width, shard_rows=cluster.shard_rows, timeout=cluster.timeout,
        ))
        waves: dict[int, list[Request]] = {}
        for req in cluster.requests:
            waves.setdefault(req.stage_round, []).append(req)
        deadline = Deadline.after(cluster.timeout)
        rnd = 0
        while len(settled) < len(cluster.requests):
            if deadline.expired():
                errors.append(f"round {rnd}: {sorted(set(by_rid) - settled)} did not settle within {cluster.timeout} s")
                break
            for req in waves.get(rnd, ()):
                recv.stage(req.rid, [EmbeddingItem(index=i, host=HOST, port=ports[img.deployment], room=img.room,
                                                   rows=img.rows) for i, img in enumerate(req.images)])
            try:
                landed = recv.round(dist.group.WORLD)
            except Exception as exc:  # a diverged rank: stop here, the parent compares what each saw
                errors.append(f"round {rnd}: {type(exc).__name__}: {exc}")
                break
            failed = recv.failed()
            if landed or failed:
                release = []
                record = []
                for req in landed:
                    items = []
                    for it in req.items:
                        items.append((it.index, it.slot is not None, it.row_start, it.row_count, it.rows, it.sharded))
                        errors += _check_item(cluster, rank, world, by_rid[req.rid], it, recv)
                        if it.slot is not None:
                            release.append(it.slot)
                    record.append((req.rid, tuple(items)))
                    want = tuple(range(len(by_rid[req.rid].images)))
                    if tuple(it.index for it in req.items) != want:
                        errors.append(f"{req.rid} landed items {[it.index for it in req.items]}, staged {list(want)}")
                rounds.append((rnd, record, [(rid, reason) for rid, reason in failed]))
                for rid in [r.rid for r in landed] + [rid for rid, _ in failed]:
                    if rid in settled:
                        errors.append(f"round {rnd}: {rid} settled twice")
                    settled.add(rid)
                recv.release(release)
            else:
                time.sleep(0.002)  # a scheduler's step; the deadline bounds the loop
            rnd += 1
        if recv.awaiting_release():
            errors.append("a slot still waits for release after every landed slot was released")
        stats = dict(recv.stats)
    finally:
        peer.close()
    return {"rounds": rounds, "errors": errors[:_MAX_ERRORS], "stats": stats}


def _check_item(cluster: Cluster, rank: int, world: int, req: Request, it: Any, recv: Any) -> list[str]:
    """Why a landed item is not exactly this rank's share of its image's rows (empty when it is)."""
    where = f"rank {rank}: {req.rid} item {it.index}"
    if not 0 <= it.index < len(req.images):
        return [f"{where}: no such item"]
    img = req.images[it.index]
    start, count = share(img.rows, rank, world, cluster.shard_rows)
    got = (it.row_start, it.row_count, it.rows, it.sharded)
    if got != (start, count, img.rows, cluster.shard_rows):
        return [f"{where}: landed (row_start, row_count, rows, sharded) {got}, "
                f"its share is {(start, count, img.rows, cluster.shard_rows)}"]
    if count == 0:
        return [] if it.slot is None else [f"{where}: an empty shard holds slot {it.slot}"]
    if it.slot is None:
        return [f"{where}: {count} rows without a slot"]
    out = []
    if not np.array_equal(recv.rows(it.slot, count), pattern(img.room, start, count, cluster.hidden, cluster.itemsize, False)):
        out.append(f"{where}: rows [{start}, {start + count}) of room {img.room} in slot {it.slot} are wrong")
    if cluster.deepstack_width and not np.array_equal(
            recv.deepstack_rows(it.slot, count),
            pattern(img.room, start, count, cluster.deepstack_width, cluster.itemsize, True)):
        out.append(f"{where}: deepstack rows [{start}, {start + count}) of room {img.room} in slot {it.slot} are wrong")
    return out


# -- the parent -------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    prefill: list[dict[str, Any]]  # per prefill rank
    encode: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)  # (deployment, dp, tp) ->
    seconds: float = 0.0


def run_cluster(cluster: Cluster) -> Outcome:
    """Run the encode deployments and the prefill replica to the end; raises naming any rank that failed."""
    from pdcore.control.bootstrap import BootstrapServer
    from replica import run_replica

    began = time.monotonic()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    out = ctx.Queue()
    servers: list[Any] = []
    procs: list[Any] = []
    encode: dict[tuple[int, int, int], tuple[str, Any]] = {}
    prefill: list[dict[str, Any]] = []
    try:
        for _ in range(1 + len(cluster.encoders)):
            servers.append(BootstrapServer(host=HOST, port=0))
        pd_port, *ports = [s.start() for s in servers]
        for d, enc in enumerate(cluster.encoders):
            for dp in range(enc.dp):
                for tp in range(enc.tp):
                    procs.append(ctx.Process(target=_encode_main, args=(cluster, d, dp, tp, ports[d], stop, out),
                                             name=f"encode-{d}-{dp}-{tp}", daemon=True))
        for p in procs:
            p.start()
        try:
            prefill = run_replica(prefill_rank, cluster.prefill_tp, cluster, pd_port, ports, timeout=cluster.timeout + 90)
        finally:
            stop.set()
            deadline = Deadline.after(30.0)
            while len(encode) < len(procs) and not deadline.expired():
                try:
                    key, status, value = out.get(timeout=max(0.01, min(1.0, deadline.remaining())))
                except queue.Empty:
                    if not any(p.is_alive() for p in procs):
                        break
                    continue
                encode[key] = (status, value)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for s in servers:
            s.close()
    errors = {k: v for k, (s, v) in encode.items() if s == "error"}
    missing = sorted(set((d, dp, tp) for d, e in enumerate(cluster.encoders) for dp in range(e.dp) for tp in range(e.tp))
                     - set(encode))
    if errors or missing:
        raise AssertionError(f"encode ranks {missing} gave no result; failed: "
                             + "\n".join(f"{k}: {v}" for k, v in sorted(errors.items())))
    return Outcome(prefill, {k: v for k, (_, v) in encode.items()}, time.monotonic() - began)


def check(cluster: Cluster, outcome: Outcome) -> None:
    """Assert everything the run promises: exact rows on every rank, identical settles, every room concluded."""
    world = cluster.prefill_tp
    for key, res in sorted(outcome.encode.items()):
        assert res["errors"] == [], (key, res["errors"])
        assert sorted(res["concluded"]) == sorted(res["rooms"]), (key, "every begun room concludes exactly once")
    for rank, res in enumerate(outcome.prefill):
        assert res["errors"] == [], (rank, res["errors"])
    # every rank settled the same requests, the same items, in the same rounds, and failed the same ones
    views = [[(rnd, [(rid, [it[0] for it in items]) for rid, items in landed], [rid for rid, _ in failed])
              for rnd, landed, failed in res["rounds"]] for res in outcome.prefill]
    for rank in range(1, world):
        assert views[rank] == views[0], f"rank {rank} settled differently from rank 0:\n{views[rank]}\n{views[0]}"
    landed = {rid: items for rnd, rec, _ in outcome.prefill[0]["rounds"] for rid, items in rec}
    failed = {rid for _, _, fl in outcome.prefill[0]["rounds"] for rid, _ in fl}
    assert failed == {req.rid for req in cluster.requests if req.fails}, failed
    assert set(landed) == {req.rid for req in cluster.requests if not req.fails}, sorted(landed)
    for req in cluster.requests:
        if req.fails:
            reasons = [reason for res in outcome.prefill for _, _, fl in res["rounds"] for rid, reason in fl if rid == req.rid]
            assert len(reasons) == world and any(FAIL_REASON in r for r in reasons), (req.rid, reasons)
            continue
        # the ranks' shares tile each image (sharded), or each holds all of it
        per_rank = [{it[0]: it for _, rec, _ in res["rounds"] for rid, items in rec if rid == req.rid for it in items}
                    for res in outcome.prefill]
        for i, img in enumerate(req.images):
            spans = [(per_rank[r][i][2], per_rank[r][i][3]) for r in range(world)]
            if cluster.shard_rows:
                assert spans[0][0] == 0 and sum(c for _, c in spans) == img.rows, (req.rid, i, spans)
                assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:])), (req.rid, i, spans)
                assert all(per_rank[r][i][1] == (spans[r][1] > 0) for r in range(world)), (req.rid, i)
            else:
                assert spans == [(0, img.rows)] * world, (req.rid, i, spans)


__all__ = ["Image", "Request", "Encoder", "Cluster", "Outcome", "share", "pattern", "make_requests", "run_cluster",
           "check", "encode_rank", "prefill_rank", "FAIL_REASON"]
