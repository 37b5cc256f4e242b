"""Acting out a seed's drawn faults: the network's and fabric's knobs, and what befalls processes.

A room of ``Simulation`` (``pdcore.sim.workload``; its state is set up there). ``Faults``
(``pdcore.sim.faults``) says what may go wrong and how often; here it goes wrong: partitions, pauses,
kills and restarts (at the same host:port or anew), stalled schedulers, clock jumps, and the exit of
every prefill replica once admission is over. Each process fault marks the replica it befell
(``_touch``) for as long as its effects may last, which the no-collateral invariant reads.
"""

from __future__ import annotations

from .cluster import Replica, SimRank
from .faults import TIMERS, Faults
from .records import ROUND


class FaultLoop:
    """The drawn faults applied, and the process faults struck every 50 simulated ms while faults are on."""

    # -- the knobs -----------------------------------------------------------------------------

    def _apply_faults(self, on: bool) -> None:
        f = self.faults if on else Faults(delay=self.faults.delay)
        net, fab, planes = self.planes.network.faults, self.planes.fabric.faults, self.planes.faults
        net.drop, net.duplicate, net.reorder, net.delay = f.drop, f.duplicate, f.reorder, f.delay
        fab.error, fab.jitter, fab.connection_drop = f.data_error, f.data_jitter, f.connection_drop
        fab.staged, fab.copy_error = bool(self.faults.staged), f.copy_error  # staging is the deployment's, not a fault
        fab.refuse_post, fab.refuse_grant, fab.refuse_revoke = f.refuse_post, f.refuse_grant, f.refuse_revoke
        for name in ("lookup_timeout", "lookup_partial", "lookup_error", "lookup_garbage", "connect_error",
                     "refuse_inputs"):
            setattr(planes, name, getattr(f, name))
        if not on:
            self.planes.network.cut.clear()

    # -- process faults ------------------------------------------------------------------------

    def _fault_loop(self) -> None:
        world, f = self.world, self.faults
        if world.now >= self.faults_until:
            return
        step = 0.05
        rng = world.rng
        ranks = [r for rep in self.prefill + self.decode if not rep.killed for r in rep.ranks] + \
                [r for dep in self.encode for r in dep if not r.killed]
        if f.partition and rng.random() < f.partition * step and len(ranks) > 1:
            a, b = rng.sample(ranks, 2)
            link = frozenset((a.endpoint, b.endpoint))
            self.planes.network.cut.add(link)
            self.fault_counts["partition"] += 1
            world.after(rng.choice([0.1, 1.0]), self.planes.network.cut.discard, link)
        if f.pause and rng.random() < f.pause * step and ranks:
            r = rng.choice(ranks)
            if not r.paused:
                r.pause()
                self.fault_counts["pause"] += 1
                length = rng.choice([0.05, 0.3, 1.0])
                world.after(length, r.resume)
                self._touch(r.name.split(".")[0], world.now, world.now + length + self._aftermath)
        if f.kill and rng.random() < f.kill * step:
            self._kill_one()
        if f.stall and rng.random() < f.stall * step:
            replica = rng.choice(self.prefill + self.decode)
            replica.stalled_until = world.now + rng.choice([0.2, 0.8])  # type: ignore[attr-defined]
            self.fault_counts["stall"] += 1
            self._touch(replica.name, world.now, replica.stalled_until + self._aftermath)  # type: ignore[attr-defined]
        if f.skew and rng.random() < f.skew * step and ranks:
            r = rng.choice(ranks)
            r.skew += rng.choice([0.05, 0.3, 1.0])  # its clock jumps forward (a VM paused, say)
            self.fault_counts["clock_jump"] += 1
            # every timer of a request alive now may fire that much early
            self._touch(r.name.split(".")[0], world.now - TIMERS["bootstrap"] - TIMERS["waiting"], world.now)
        world.after(step, self._fault_loop)

    @property
    def _aftermath(self) -> float:
        """How long a process's trouble may still fail requests after it ended: its peers' verdicts come
        ``dead_after`` late, and are taken back once it is heard from again."""
        return 2 * TIMERS["dead_after"] + TIMERS["heartbeat"] + 0.1

    def _touch(self, name: str, start: float, end: float) -> None:
        """A fault befell replica (or encode deployment) ``name`` from ``start``; its effects last until ``end``."""
        self._touched.setdefault(name, []).append((start, end))

    def _endpoints(self, ranks: list[SimRank]) -> list[str] | None:
        """Where a restarted incarnation listens: the host:port of the one it replaces, or anew."""
        if self.faults.same_endpoint and self.world.rng.random() < self.faults.same_endpoint:
            self.fault_counts["same_endpoint"] += 1
            return [r.endpoint for r in ranks]
        return None

    def _kill_one(self) -> None:
        rng = self.world.rng
        choices = [rep for rep in self.prefill + self.decode if not rep.killed]
        if self.encode and rng.random() < 0.3:
            dep = rng.randrange(len(self.encode))
            ranks = self.encode[dep]
            if all(not r.killed for r in ranks):
                for r in ranks:
                    r.kill()
                self.fault_counts["kill"] += 1
                later = rng.choice([0.2, 0.8])
                self.world.after(later, self._restart_encoders, dep, ranks[0].epoch + 1, self._endpoints(ranks))
                # (checked dead_after + 0.1 after a failure: the window is shifted by as much)
                self._encode_kills[dep] = (self.world.now, self.world.now + later + 2 * TIMERS["dead_after"] +
                                           TIMERS["heartbeat"] + 0.1)
            return
        if not choices:
            return
        replica = rng.choice(choices)
        replica.killed = True
        for r in replica.ranks:
            r.kill()
        self.fault_counts["kill"] += 1
        side = replica.role
        for req in list(self._by_replica[replica].values()):
            req.lost.add(side)
            if not req.counted and self._pd_done(req):
                req.counted = True
                self.counts["lifecycles"] += 1
                self.counts["pd_lost"] += 1
        self._by_replica[replica].clear()
        for req in list(self._epd_of.get(replica, {}).values()):
            req.lost = True
        if replica in self._epd_of:
            self._epd_of[replica].clear()
        self.world.after(rng.choice([0.2, 0.8]), self._restart, replica, replica.ranks[0].epoch + 1,
                         self._endpoints(replica.ranks))

    # -- the exit ------------------------------------------------------------------------------

    def _exit(self) -> None:
        """Admission is over: the decode replicas stall (a long batch) while each prefill replica exits once
        its own side of every request ended; requests that landed on decode must still land there."""
        # long enough that a prefill replica still waiting for its unannounced requests' bootstrap timers
        # exits, and is found dead, while decode has yet to agree on what landed meanwhile
        stall = TIMERS["bootstrap"] + TIMERS["dead_after"] * 2 + 0.2
        for replica in self.decode:
            replica.stalled_until = self.world.now + stall  # type: ignore[attr-defined]
            self._touch(replica.name, self.world.now, replica.stalled_until + self._aftermath)  # type: ignore[attr-defined]
        self.fault_counts["exit"] += 1
        self._exiting()

    def _exiting(self) -> None:
        waiting = False
        for replica in self.prefill:
            if replica.killed:
                continue
            if any("prefill" not in req.ended_at for req in self._by_replica[replica].values()) or \
                    self._epd_of.get(replica):
                waiting = True
                continue
            replica.killed = True
            for r in replica.ranks:
                r.kill()
            for req in self._by_replica[replica].values():
                req.lost.add("prefill")
        if waiting:
            self.world.after(ROUND, self._exiting)

    # -- restarts ------------------------------------------------------------------------------

    def _restart(self, old: Replica, epoch: int, endpoints: list[str] | None) -> None:
        index = int(old.name[1:])
        tp = len(old.ranks)
        new = self._make_replica(old.role, index, tp, epoch, endpoints)
        self._touch(new.name, self.world.now, self.world.now + self._aftermath)  # its peers may still name the old one
        group = self.prefill if old.role == "prefill" else self.decode
        group[group.index(old)] = new

    def _restarting_encoders(self, dep: int) -> bool:
        """Whether encode deployment ``dep`` was killed recently enough that a prefill rank may still name its
        killed incarnation (until found dead: ``dead_after`` after its restart at the latest). A failure then
        reaches the incarnation that was asked; the restarted one concludes such rooms by its own timers."""
        window = self._encode_kills.get(dep)
        return window is not None and window[0] <= self.world.now <= window[1]

    def _restart_encoders(self, dep: int, epoch: int, endpoints: list[str] | None) -> None:
        self.encode[dep] = self._make_encoders(dep, len(self.encode[dep]), epoch, endpoints)
