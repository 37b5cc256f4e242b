"""The EPD schedulers: the encode deployments' schedulers and the prefill ranks' receivers.

A room of ``Simulation`` (``pdcore.sim.workload``; its state is set up there). The router gives a
request images, each on one encode deployment; every encode rank begins its images first come, first
served as send slots free up (``pdcore.epd.front``), writes their rows and sends them; the prefill
replica's receivers stage the request, agree each round on what landed or failed, check the rows
against what encode wrote, and release the slots.
"""

from __future__ import annotations

import numpy as np

from ..epd._recv_spec import shard
from ..epd.types import EmbeddingChunk, EmbeddingItem
from .cluster import Replica, SimRank
from .faults import TIMERS
from .records import DTYPE, HIDDEN, POISON, ROUND, ROW_BYTES, SLOT_ROWS, EpdRequest, image_rows
from .world import Violation


class EpdSchedulers:
    """The router's EPD half, the encoders' rounds and the receivers' rounds."""

    # -- admitting a request -------------------------------------------------------------------

    def _new_epd(self) -> None:
        rng = self.world.rng
        prefill = rng.choice([r for r in self.prefill if not r.killed] or [None])
        if prefill is None or prefill.ranks[0].receiver is None:
            return
        images = []
        for _ in range(rng.randint(1, 2)):
            deployment = rng.randrange(len(self.encode))
            images.append((next(self._rooms), rng.randint(1, SLOT_ROWS), deployment))
        rid = f"e{next(self._ids)}"
        req = EpdRequest(rid, images, prefill, self.world.now)
        self._epd[rid] = req
        self._epd_of[prefill][rid] = req
        self.counts["epd"] += 1
        for room, rows, dep in images:  # the encode schedulers: before or after the prefill ranks ask
            self._image_of[room] = req
            self.world.after(rng.random() * 0.03, self._encode_begin, dep, room, rows)
        items = [EmbeddingItem(index=i, host=self.servers[f"E{dep}"][0], port=self.servers[f"E{dep}"][1], room=room,
                               rows=rows) for i, (room, rows, dep) in enumerate(images)]
        for r in prefill.ranks:
            r.call(r.recv_front.stage, rid, items)

    # -- the encoders --------------------------------------------------------------------------

    def _encode_begin(self, dep: int, room: int, rows: int) -> None:
        rng = self.world.rng
        for r in self.encode[dep]:
            if not r.killed:
                self._to_begin[r].append((room, rows))
                self._encode_next(r)
        if self.faults.image_fail and rng.random() < self.faults.image_fail:
            self.fault_counts["image_fail"] += 1
            for r in self.encode[dep]:
                self.world.after(rng.random() * 0.02, self._encode_fail, r, room)

    def _encode_next(self, r: SimRank) -> None:
        """An encoder takes its images in the order they came, as send slots free up (first come, first
        served: a scheduler that let a later image take a freed slot could starve an earlier one that
        prefill already asked for, past the encode rank's begin timeout)."""
        waiting, free = self._to_begin[r], self._send_free[r]
        while waiting and free and r.running:  # a paused encoder's scheduler takes none
            self._encode_begin_one(r, *waiting.popleft())

    def _encode_begin_one(self, r: SimRank, room: int, rows: int) -> None:
        req = self._image_of.get(room)
        if req is None or req.lost or len(req.ends) == len(req.prefill.ranks):
            late = self.faults.late_image and self.world.rng.random() < self.faults.late_image
            if not late:
                return  # the router cancels the images of a request that ended before its encoder got to them
            self.fault_counts["late_image"] += 1  # ...or it does not, and the room must still conclude
        if not r.call(r.front.begin, room):
            return  # held by another request, or the rank is full (or it is paused: its scheduler is too)
        slot = self._send_free[r].pop()
        self._room_slot[(r, room)] = slot
        buf = r.buffers[0]
        start = slot * SLOT_ROWS * ROW_BYTES
        buf[start : start + rows * ROW_BYTES] = image_rows(room, 0, rows)
        chunk = EmbeddingChunk(room=room, source=buf.ctypes.data + start, rows=rows, hidden=HIDDEN, dtype=DTYPE,
                               nbytes=rows * ROW_BYTES)
        self.world.after(self.world.rng.random() * 0.01, r.call, r.front.send, chunk)

    def _encode_fail(self, r: SimRank, room: int) -> None:
        if (r, room) in self._room_slot:
            r.call(r.front.fail, room, "the encoder could not read the image")

    def _encode_round(self, dep: int) -> None:
        for r in self.encode[dep]:
            for room in r.call(r.front.concluded) or ():
                slot = self._room_slot.pop((r, room), None)
                if slot is not None:
                    start = slot * SLOT_ROWS * ROW_BYTES
                    r.buffers[0][start : start + SLOT_ROWS * ROW_BYTES] = POISON  # reused at once
                    self._send_free[r].append(slot)
            self._encode_next(r)
        self.world.after(ROUND, self._encode_round, dep)

    # -- the receivers -------------------------------------------------------------------------

    def _recv_round(self, replica: Replica, now: float) -> None:
        landed = replica.round(now, recv=True)
        failed = replica.recv_failed()
        first = ([r.rid for r in landed[0]], [rid for rid, _ in failed[0]])
        for rank in range(1, len(replica.ranks)):
            mine = ([r.rid for r in landed[rank]], [rid for rid, _ in failed[rank]])
            if mine != first:
                raise Violation(f"agreement: {replica.name} rank {rank} settled {mine}, rank 0 {first}")
        if len({tuple(reason for _, reason in f) for f in failed}) > 1:
            raise Violation(f"agreement: {replica.name} ranks report different reasons: {failed}")
        for rank, r in enumerate(replica.ranks):
            r.call(r.recv_front.after_round, landed[rank], failed[rank])
            released = []
            for landed_request in landed[rank]:
                req = self._epd[landed_request.rid]
                for item in landed_request.items:
                    if item.slot is None:
                        continue
                    room, rows, _dep = req.images[item.index]
                    start, count = shard(rows, rank, len(replica.ranks), self.shape.shard_rows)
                    if (item.row_start, item.row_count) != (start, count):
                        raise Violation(f"bytes: {req.rid} item {item.index} on {r.name} got rows "
                                        f"[{item.row_start}, +{item.row_count}), its share is [{start}, +{count})")
                    base = item.slot * SLOT_ROWS * ROW_BYTES
                    got = r.slots[base : base + count * ROW_BYTES]
                    if not np.array_equal(got, image_rows(room, start, count)):
                        raise Violation(f"bytes: {req.rid} item {item.index} on {r.name}: its rows are not encode's")
                    released.append(item.slot)
            if released:
                r.call(r.recv_front.release, released)
        for kind, names in (("landed", first[0]), ("failed", first[1])):
            for rid in names:
                req = self._epd[rid]
                for rank in range(len(replica.ranks)):
                    if rank in req.ends:
                        raise Violation(f"one end: {rid} {kind} on {replica.name} rank {rank} after {req.ends[rank]}")
                    req.ends[rank] = kind
                self._epd_of[replica].pop(rid, None)
                req.ended_at = self.world.now
                if kind == "failed" and self.lossless:
                    for room, _nrows, dep in req.images:
                        if self._restarting_encoders(dep):
                            continue  # its prefill ranks may have asked the killed incarnation: its timers conclude it
                        self.world.after(TIMERS["dead_after"] + 0.1, self._concluded_by_now, dep, room, rid)
                self.counts["lifecycles"] += 1
                self.counts[f"epd_{kind}"] += 1
                if not self.faults.any() and kind == "failed":
                    raise Violation(f"liveness: EPD {rid} failed in a run without faults: {failed[0]}")
