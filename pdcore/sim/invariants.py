"""The invariants a simulated run is judged by, on outcomes, never on a failure's wording.

A room of ``Simulation`` (``pdcore.sim.workload``; its state is set up there). ``Violation`` names
what broke; the world's trace says what came before.

- **fence**: no write lands in a decode page that is not held, right then, by
  the request whose grant the write came through, nor in a receive slot granted
  to another item since; and when a failed request's pages are handed back, no
  grant of that request is live;
- **agreement**: every rank of a replica gets the same events in the same round;
- **one end**: at most one ``Bootstrapped`` and exactly one terminal event per
  request per rank (none after it);
- **bytes**: a landed request's pages hold exactly what prefill sent, rows what
  encode sent, with the first token, usage and logprob it sent;
- **prompt**: once one side of a request ended, the other learns of it by a frame
  (its engine fails it), not by its own timer, when nothing that carries such a
  frame was lost;
- **no collateral**: in a run whose only faults befall processes (pauses, kills,
  stalls, clock jumps, exits), a request none of whose replicas was touched
  during its life lands: one rank's trouble never fails its siblings' requests;
- **liveness**: once faults stop, every request ends within its timeouts;
- **no leak**: at the end, fronts, tables, engines, grants, parked posts, slots,
  parked announcements and (after their TTL) tombstones are empty;
- **bounds**: parked announcements and tombstones within their bounds, no
  engine input that raised, no driver that would have waited on a full sink (the
  rank's input that did it raises), no scheduler call the API refused; and in a
  run without faults every request lands.

Some are checked where the outcome is seen: a refused scheduler call, an engine input that raised and a
driver's full sink in ``SimRank`` (``pdcore.sim.cluster``), an item's rows in the receivers' round
(``pdcore.sim.epd_schedulers``); the rest are here.
"""

from __future__ import annotations

import math
from typing import Any

from ..core.events import RemotePrefillDone
from ..protocol.decode import page_ranges
from .cluster import Replica, SimRank
from .faults import PROCESS_FAULTS, TIMERS
from .records import PAGES, ROW_BYTES, SLOT_ROWS, SLOTS, PdRequest
from .world import Violation


class Invariants:
    """The checks: agreement and one end per round, promptness, collateral damage, bytes, the fence,
    bounds, liveness and leaks."""

    # -- agreement and one end -----------------------------------------------------------------

    def _same_events(self, replica: Replica, events: list[list[Any]]) -> None:
        first = [(type(e).__name__, e.rid, getattr(e, "reason", None)) for e in events[0]]
        for rank, evs in enumerate(events[1:], 1):
            mine = [(type(e).__name__, e.rid, getattr(e, "reason", None)) for e in evs]
            if mine != first:
                raise Violation(f"agreement: {replica.name} rank {rank} got {mine}, rank 0 {first}")
        side = replica.role
        for kind, rid, _ in first:
            req = self._pd.get(rid)
            if req is None:
                raise Violation(f"one end: {replica.name} emitted {kind} for unknown {rid}")
            for rank in range(len(replica.ranks)):
                key = (side, rank)
                prev = req.ends.get(key)
                if kind == "Bootstrapped":
                    if prev is not None:
                        raise Violation(f"one end: {replica.name} rank {rank}: Bootstrapped for {rid} after {prev}")
                    req.ends[key] = "Bootstrapped"
                elif prev not in (None, "Bootstrapped"):
                    raise Violation(f"one end: {replica.name} rank {rank}: {kind} for {rid} after {prev}")
                else:
                    req.ends[key] = kind

    # -- prompt and no collateral --------------------------------------------------------------

    @property
    def lossless(self) -> bool:
        """Nothing that carries a request's end from one side to the other is lost or held in this run
        (frames dropped or cut, processes paused, look-ups failing, inputs refused: then a timer is a fair
        way to learn of the other side's end)."""
        f = self.faults
        return not (f.drop or f.partition or f.pause or f.lookup_timeout or f.lookup_partial or f.lookup_error
                    or f.lookup_garbage or f.refuse_inputs)

    def _learned_by_timer(self, req: PdRequest, replica: Replica) -> bool:
        """Whether ``replica``'s side of a failed request failed by the table's own timers: no rank's engine
        failed it first (a frame, a verdict, a refusal all do)."""
        return all(req.rid not in r.table.failed_at for r in replica.ranks)

    def _prompt(self, req: PdRequest, replica: Replica) -> None:
        """A side's end; the other side learns of it by a frame, not by its own timer (when no frame is lost)."""
        side = replica.role
        now = self.world.now
        timer = req.ends.get((side, 0)) == "Failed" and self._learned_by_timer(req, replica)
        for r in replica.ranks:
            r.table.failed_at.pop(req.rid, None)
        req.ended_at[side] = (now, timer)
        other = req.ended_at.get("decode" if side == "prefill" else "prefill")
        if other is None or not self.lossless or not timer or side in req.lost:
            return
        if side == "prefill" and req.prefill.epoch > 1 and \
                other[0] < req.prefill.started + TIMERS["dead_after"] + TIMERS["heartbeat"]:
            return  # decode may still have known the killed incarnation (its verdict comes dead_after late): it told that one
        if side == "decode" and not req.announced:
            return  # decode never had pages to announce (its pool was full): its timer is its only way
        if now - other[0] > TIMERS["dead_after"] + 0.1:
            raise Violation(f"prompt: {req.rid}'s {side} side learned only by its own timer that the other side "
                            f"ended {now - other[0]:.3f} s earlier")

    def _collateral(self, req: PdRequest) -> None:
        """A failed request that no fault touched, in a run whose faults befall processes only, is collateral
        damage: some rank's trouble failed another's request."""
        if req.early or req.aborted or req.lost or not set(self.faults.kinds()) <= PROCESS_FAULTS:
            return
        until = self.world.now
        for replica in (req.prefill, req.decode):
            if any(start <= until and req.born <= end for start, end in self._touched.get(replica.name, ())):
                return
        raise Violation(f"collateral: {req.rid} ({req.prefill.name} -> {req.decode.name}) failed though no fault "
                        f"touched its replicas during its life (born {req.born:.3f})")

    # -- bytes ---------------------------------------------------------------------------------

    def _check_landed(self, req: PdRequest, events: list[list[Any]]) -> None:
        replica = req.decode
        for rank, r in enumerate(replica.ranks):
            done = next(e for e in events[rank] if e.rid == req.rid)
            if type(done) is not RemotePrefillDone:
                raise Violation(f"bytes: {req.rid} landed on {r.name} as {type(done).__name__}, not RemotePrefillDone")
            remote = done.remote
            lp = remote.bootstrap_logprob
            same_lp = (lp is None and req.logprob is None) or (lp is not None and req.logprob is not None and (
                lp == req.logprob or (math.isnan(lp) and math.isnan(req.logprob))))
            if remote.bootstrap_token != req.first_token or remote.cached_tokens != req.cached or not same_lp:
                raise Violation(f"bytes: {req.rid} on {r.name} carried {remote}, prefill sent token "
                                f"{req.first_token}, cached {req.cached}, logprob {req.logprob}")
            self._pages_hold(req, rank, r)

    def _delivered_check(self, r: SimRank, rid: str) -> None:
        """A decode engine hands a landing to its scheduler's side only once every byte of it is in place (the
        round that reports it comes later, and late bytes could still make it in time for the check there)."""
        replica = next((rep for rep in self.decode if r in rep.ranks), None)
        req = None if replica is None else self._by_replica[replica].get(rid)
        if req is not None and req.announced:
            self._pages_hold(req, replica.ranks.index(r), r)

    def _pages_hold(self, req: PdRequest, rank: int, r: SimRank) -> None:
        """Every page of ``req`` on decode rank ``r`` (rank ``rank`` of its replica) holds what prefill sent."""
        pb = r.layout.page_bytes[0]
        for pair, page in enumerate(req.d_pages):
            want = self._content(req, rank, len(req.decode.ranks), pair)
            for b, view in enumerate(r.views):
                if view[page * pb : (page + 1) * pb] != want[b]:
                    raise Violation(f"bytes: {req.rid} on {r.name}: page {page} buffer {b} is not what prefill sent")

    # -- the fence -----------------------------------------------------------------------------

    def _granted(self, sink: Any, grant: Any) -> None:
        entry = self._sinks.get(sink)
        if entry is None:
            return
        _, replica, rank, _ = entry
        if sink.copying_into(grant.ranges):
            raise Violation(f"fence: {rank.name} granted pages (or a slot) again while landed bytes were still being "
                            f"copied into them: grant {grant.key} {grant.ranges[:2]}")
        addr = grant.ranges[0][0]
        if rank.receiver is not None and rank.slots_addr <= addr < rank.slots_addr + rank.slots.nbytes:
            slot = (addr - rank.slots_addr) // (SLOT_ROWS * ROW_BYTES)
            self._grant_owner[(sink, grant.key)] = rank.receiver._slot_owner.get(slot)
            self._slot_grant[(sink, slot)] = grant.key
        elif replica.role == "decode":
            self._grant_owner[(sink, grant.key)] = self._owner[replica][self._page_of(rank, addr)]

    def _page_of(self, rank: SimRank, addr: int) -> int:
        for base, pb in zip(rank.layout.bases, rank.layout.page_bytes):
            if base <= addr < base + pb * PAGES:
                return (addr - base) // pb
        raise Violation(f"fence: address {addr:#x} is not in {rank.name}'s cache")

    def _fence_held(self, replica: Replica, req: PdRequest) -> None:
        """A failed request's pages go back to the scheduler: none of its grants may still be live, and no copy of
        landed bytes into them may be pending (device memory)."""
        for r in replica.ranks:
            if req.d_pages and r.transport.copying_into(page_ranges(r.layout, req.d_pages)):
                raise Violation(f"fence: {req.rid}'s pages on {r.name} were handed back while landed bytes were still "
                                "being copied into them")
            for key in r.transport.live_grant_keys():
                if self._grant_owner.get((r.transport, key)) == req.rid:
                    raise Violation(f"fence: {req.rid}'s pages on {r.name} were handed back while its grant {key} "
                                    "was still live")

    def _landed_check(self, sink: Any, writes: list[list[int]], grant: int, src: Any) -> None:
        entry = self._sinks.get(sink)
        if entry is None:
            return
        _, replica, rank, _ = entry
        owner = self._grant_owner.get((sink, grant))
        for _local, remote, _length in writes:
            if rank.receiver is not None and rank.slots_addr <= remote < rank.slots_addr + rank.slots.nbytes:
                slot = (remote - rank.slots_addr) // (SLOT_ROWS * ROW_BYTES)
                if self._slot_grant.get((sink, slot)) != grant or owner is None:
                    # (a failed item's slot stays quarantined, held by nobody, until its grant's revoke is
                    # confirmed: a late write may land there; never once the slot was granted again)
                    now_owner = rank.receiver._slot_owner.get(slot)
                    raise Violation(f"fence: a write through grant {grant} landed in {rank.name}'s slot {slot}, "
                                    f"granted since by grant {self._slot_grant.get((sink, slot))} (held now by "
                                    f"{getattr(now_owner, 'rid', None)}), granted to {getattr(owner, 'rid', None)}")
            elif replica.role == "decode":
                page = self._page_of(rank, remote)
                holder = self._owner[replica][page]
                if owner is None or holder != owner:
                    raise Violation(f"fence: a write through grant {grant} (for {owner}) landed in {rank.name}'s page "
                                    f"{page}, held now by {holder}")

    # -- prompt on the encoders ----------------------------------------------------------------

    def _concluded_by_now(self, dep: int, room: int, rid: str) -> None:
        """A failed request's images are concluded on their encode ranks soon after (not at their park timeout)."""
        for r in self.encode[dep]:
            if r.running and (r, room) in self._room_slot:
                raise Violation(f"prompt: {rid} failed on prefill, yet {r.name} still holds its image's room {room} "
                                f"{TIMERS['dead_after'] + 0.1:g} s later")

    # -- bounds, liveness, leaks ---------------------------------------------------------------

    def _bounds(self, replica: Replica) -> None:
        for r in replica.ranks:
            cfg = r.config
            if replica.role == "prefill":
                parked = r.engine.held()["parked"]
                if parked > cfg.max_pending or r.engine.tombstones() > 4 * cfg.max_pending:
                    raise Violation(f"bounds: {r.name} holds {parked} parked, {r.engine.tombstones()} tombstones")

    def _liveness(self) -> None:
        late = [req for req in self._pd.values() if not self._pd_done(req)]
        if late:
            req = late[0]
            raise Violation(f"liveness: {len(late)} PD requests never ended, e.g. {req.rid} "
                            f"(born {req.born:.3f}, ends {req.ends}, lost {req.lost}, {req.prefill.name}->{req.decode.name})")
        open_epd = [req for req in self._epd.values() if not req.lost and len(req.ends) < len(req.prefill.ranks)]
        if open_epd:
            req = open_epd[0]
            raise Violation(f"liveness: {len(open_epd)} EPD requests never ended, e.g. {req.rid} {req.images}")

    def _leaks(self) -> None:
        for rep in self.prefill + self.decode:
            if rep.killed:
                continue
            for r in rep.ranks:
                held = {k: v for k, v in r.engine.held().items() if v}
                front = {k: v for k, v in r.front.diagnostics().items() if v and k != "lately_ended"}
                if len(r.table) or held or r.engine.tombstones() or front:
                    raise Violation(f"leak: {r.name} holds {len(r.table)} requests, {held}, "
                                    f"{r.engine.tombstones()} tombstones; its front {front}")
                if r.transport.live_grants():
                    raise Violation(f"leak: {r.name} still grants {r.transport.live_grants()} ranges")
                if r.performer.parked():
                    raise Violation(f"leak: {r.name} still has {r.performer.parked()} posts parked")
                if r.receiver is not None:
                    held = {k: v for k, v in r.receiver.held().items() if v}
                    if r.receiver.stats["asks"] < r.receiver.stats["landed"]:
                        raise Violation(f"bounds: {r.name} landed more items than it asked for")
                    if held or len(r.recv_table) or r.recv_table.free_slots() != SLOTS:
                        raise Violation(f"leak: {r.name}'s receiver holds {held}, {len(r.recv_table)} requests, "
                                        f"{SLOTS - r.recv_table.free_slots()} slots")
        for dep in self.encode:
            for r in dep:
                if not r.killed and (r.engine.held()["rooms"] or r.front.diagnostics()["begun"]):
                    raise Violation(f"leak: {r.name} still holds {r.engine.held()} rooms, {r.front.diagnostics()}")
