"""Simulated ranks and replicas: the real engines and tables, over the simulated planes.

A ``SimRank`` is what a peer is in a real process, minus threads: its role's
front (``pdcore.pd.front``, ``pdcore.epd.front``: the scheduler's side, the same
object a peer drives) and engine(s) (``pdcore.protocol``) with the real compiled
table, a ``Performer`` that performs their actions on a ``SimTransport`` and a
``SimChannel``, and its registered memory (numpy). Inputs reach the engines in
event order; a paused rank keeps them until it resumes, a killed one drops them.
Each rank reads its own clock: the world's plus a skew of its own, which may jump. A ``Replica`` is a
rank's tp group: its round reduces the ranks' tables with MIN in one step (the
same encode/decode the agreement runs, the same rule for failure reasons), so
every rank of it gets the events of that round; the scheduler models
(``pdcore.sim.workload``) act on them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
from transport.plan import Layout

from ..control.bootstrap import RankRegistration, Registry
from ..control.bootstrap_schema import ENCODER, parse_parallel_info
from ..control.liveness import DeadPeer
from ..core.agreement import pick_reasons
from ..core.errors import CapacityError, PdError
from ..core.events import Failed
from ..core.table import StateTable
from ..epd.config import EncodeConfig, ReceiverConfig
from ..epd.front import EncodeFront, ReceiverFront
from ..epd.recv_table import ReceiveTable
from ..epd.sending import SendRooms
from ..node.perform import Performer
from ..pd.config import DecodeConfig, PrefillConfig
from ..pd.front import DecodeFront, PrefillFront
from ..protocol.actions import Connect, LookUp
from ..protocol.decode import DecodeEngine
from ..protocol.encode import EncodeEngine
from ..protocol.engine import EngineInputs, Services
from ..protocol.prefill import PrefillEngine
from ..protocol.receiver import ReceiverEngine
from .control import Network, SimChannel
from .data import Fabric, SimTransport
from .world import Violation, World

__all__ = ["SimRank", "Replica", "Planes"]

TICK = 0.05  # simulated seconds between a rank's ticks


class SimTable(StateTable):  # type: ignore[misc]
    """The real transfer table, recording when this rank's engine first failed each request (by a frame, a
    verdict, a refusal: anything but the table's own timers, which fire in ``encode``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed_at: dict[str, float] = {}

    def update(self, rid: str, trigger: int, now: float, reason: str = "") -> Any:
        state = super().update(rid, trigger, now, reason)
        if state == 0 and rid not in self.failed_at:
            self.failed_at[rid] = now
        return state


class Planes:
    """What every rank of a simulation shares: the world, the two planes, the bootstrap servers."""

    def __init__(self, world: World, *, heartbeat: float, dead_after: float, wire_check: bool = True) -> None:
        self.world = world
        self.fabric = Fabric(world)
        self.network = Network(world, heartbeat=heartbeat, dead_after=dead_after, wire_check=wire_check)
        self.registries: dict[tuple[str, int], Registry] = {}
        self.connect_delay = 0.001
        self.lookup_delay = 0.001
        self.faults = PlaneFaults()
        self._ports = itertools.count(20000)
        self.work_errors = 0
        self.on_landed: Any = None  # (decode rank, rid) when its engine hands a landing to the scheduler's side
        self.stats = {"lookups_timed_out": 0, "lookups_partial": 0, "lookups_failed": 0, "lookups_garbled": 0,
                      "connects_failed": 0, "inputs_refused": 0}

    def endpoint(self) -> str:
        port = next(self._ports)
        return f"tcp://10.{port // 250 % 250}.{port % 250}.1:{7000 + port % 1000}"

    def registry(self, server: tuple[str, int]) -> Registry:
        return self.registries.setdefault(server, Registry())


class PlaneFaults:
    """What the planes around the engines do wrong, by share of attempts: look-ups that time out, answer
    for some ranks only, fail, or carry a garbled shape; data connects that fail; driver inputs refused."""

    lookup_timeout = 0.0
    lookup_partial = 0.0
    lookup_error = 0.0
    lookup_garbage = 0.0
    connect_error = 0.0
    refuse_inputs = 0.0

    def any(self) -> bool:
        return any(getattr(self, name) for name in ("lookup_timeout", "lookup_partial", "lookup_error",
                                                    "lookup_garbage", "connect_error", "refuse_inputs"))


LOOKUP_SLICE = 0.05  # simulated seconds a look-up that times out takes (the driver's slice, scaled down)


class SimPerformer(Performer):
    """The simulator's performer: ``Connect`` and ``LookUp`` are answered after a simulated delay."""

    def __init__(self, rank: SimRank) -> None:
        super().__init__(rank.name, transport=rank.transport, channel=rank.channel, clock=lambda: rank.now,
                         stats={})
        self._rank = rank

    def _io(self, engine: Any, action: Connect | LookUp) -> None:
        planes = self._rank.planes
        if type(action) is Connect:
            planes.world.after(planes.connect_delay, self._connect, engine, action)
        else:
            planes.world.after(planes.lookup_delay, self._look_up, engine, action)

    def _connect(self, engine: Any, action: Connect) -> None:
        planes = self._rank.planes
        try:
            if planes.faults.connect_error and planes.world.rng.random() < planes.faults.connect_error:
                planes.stats["connects_failed"] += 1
                raise ConnectionRefusedError("connection refused (simulated)")
            handle, error = self._transport.connect(action.endpoint), ""
        except Exception as e:
            handle, error = None, f"cannot connect the transport: {e}"
        self._rank.input(engine.connected, action.token, handle, error)

    def _look_up(self, engine: Any, action: LookUp) -> None:
        """As the driver's I/O thread: only what the server says (through the client's parsing), whatever
        goes wrong on the way, answered; what the engine computes from it is its own business."""
        planes = self._rank.planes
        faults, rng, stats = planes.faults, planes.world.rng, planes.stats
        if faults.lookup_timeout and rng.random() < faults.lookup_timeout:
            stats["lookups_timed_out"] += 1  # the server did not answer within the slice: "not reachable yet"
            planes.world.after(LOOKUP_SLICE, self._rank.input, engine.looked_up, action.server, None, {}, None)
            return
        registry = planes.registries.get(action.server)
        info, ranks, error = None, {}, None
        try:
            if faults.lookup_error and rng.random() < faults.lookup_error:
                stats["lookups_failed"] += 1
                raise PdError("bootstrap GET /v1/parallel: 500 internal error (simulated)")
            if registry is not None:
                if action.shape:
                    info = registry.parallel_info()
                    if info is not None and faults.lookup_garbage and rng.random() < faults.lookup_garbage:
                        stats["lookups_garbled"] += 1
                        info = _garbled(info, rng)
                    if info is not None:  # what the client makes of the server's bytes
                        info = parse_parallel_info(ENCODER.encode(info))
                for key in action.keys:
                    if faults.lookup_partial and rng.random() < faults.lookup_partial:
                        stats["lookups_partial"] += 1
                        ranks[key] = None  # "not registered" for this one
                    else:
                        ranks[key] = registry.lookup(*key)
        except PdError as e:
            error = str(e)
        self._rank.input(engine.looked_up, action.server, info, ranks, error)

    def _result(self, fn: Callable[..., Any], *args: Any) -> None:
        self._rank.input(fn, *args)


class SimRank:
    """One rank of one role (``"prefill"``, ``"decode"``, ``"encode"``) over the simulated planes."""

    def __init__(self, planes: Planes, role: str, name: str, config: Any, *, epoch: int,
                 buffers: list[np.ndarray], receiver: ReceiverConfig | None = None, endpoint: str | None = None,
                 skew: float = 0.0) -> None:
        self.planes = planes
        self.world: World = planes.world
        self.role = role
        self.name = name
        self.config = config
        self.session_id = f"{role}-{name}-{epoch}"
        self.epoch = epoch
        self.skew = skew  # this process's monotonic clock minus the world's (jumps forward, never back)
        self.endpoint = endpoint or planes.endpoint()  # a restart may come back on the same host:port
        self.transport = SimTransport(planes.fabric, name)
        self.channel = SimChannel(planes.network, self, self.endpoint)
        self.killed = self.paused = False
        self.violation: Violation | None = None  # one an invariant found inside an engine input (``_deliver``)
        self._backlog: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []  # scheduler calls made while paused
        self.buffers = buffers
        self.views = [memoryview(b) for b in buffers]  # the same bytes: slices compare and take bytes cheaply
        self.table: Any = None
        self.layout: Layout | None = None
        self.receiver: ReceiverEngine | None = None
        self.recv_table: Any = None
        self.landed: set[str] = set()  # rids whose landing the engine delivered here (decode)
        self.front: Any = None
        self.recv_front: ReceiverFront | None = None
        self.staged = planes.fabric.faults.staged  # its buffers are device memory (the transport stages them)
        regions = [self.transport.register(b, require_grant=role != "encode") for b in buffers]
        if role == "encode":
            self.engine = EncodeEngine(self._services(SendRooms.of(config)))
            self.front = EncodeFront(engine=self.engine, config=config, submit=self.submit, result=self.input,
                                     regions=self.transport.regions(), staged=self.transport.mirror_map.host if self.staged else None)
        else:
            self.table = SimTable(config.capacity, bootstrap_timeout=config.bootstrap_timeout,
                                  waiting_timeout=config.waiting_timeout)
            self.layout = Layout([r.addr for r in regions], config.page_bytes_per_buffer, config.num_pages)
            services = self._services(self.table)
            self.engine = PrefillEngine(services) if role == "prefill" else DecodeEngine(services)
            front = PrefillFront if role == "prefill" else DecodeFront
            self.front = front(table=self.table, engine=self.engine, config=config, submit=self.submit,
                               result=self.input)
        self.performer = SimPerformer(self)
        self.performer.attach(self.engine)
        if receiver is not None:
            self.recv_table = ReceiveTable(
                receiver.slots, receiver.slot_rows, max_requests=receiver.max_requests, max_items=receiver.max_items,
                rank=config.tp_rank, ranks=config.tp_size, sharded=receiver.shard_rows, timeout=receiver.timeout)
            self.slots = np.zeros(receiver.slots * receiver.slot_rows * receiver.row_bytes, np.uint8)
            region = self.transport.register(self.slots, require_grant=True)
            self.slots_addr = region.addr  # where the slots are written (their host mirror, when staged)
            self.receiver = ReceiverEngine(
                Services(config=receiver, session_id=self.session_id, epoch=epoch, table=self.recv_table,
                         endpoint=self.transport.endpoint(), staged=self.staged),
                tp_rank=config.tp_rank, tp_size=config.tp_size, slots_addr=region.addr)
            self.performer.attach(self.receiver)
            self.recv_front = ReceiverFront(table=self.recv_table, engine=self.receiver, submit=self.submit,
                                            result=self.input)
        sinks = [engine for engine in self.performer.engines if hasattr(engine, "noted")]
        if sinks:  # the statuses that ride writes go to the engine that granted them, as a peer's do
            self.transport.on_note(lambda grant, note, noted=sinks[0].noted: self.input(noted, grant, note))
        self.world.after(TICK * self.world.rng.random(), self._tick)

    def _services(self, table: Any) -> Services:
        from ..control import wire

        regions = tuple(wire.Region(addr=r.addr, length=r.length, key=r.key) for r in self.transport.regions())
        return Services(config=self.config, session_id=self.session_id, epoch=self.epoch, table=table,
                        endpoint=self.transport.endpoint(), regions=regions, layout=self.layout, deliver=self._deliver,
                        staged=self.staged, notes=self.transport.carries_notes)

    def _deliver(self, kind: str, key: Any, value: Any) -> None:
        if kind == "landed":
            self.landed.add(key)
            if self.planes.on_landed is not None:
                try:
                    self.planes.on_landed(self, key)
                except Violation as v:  # raised here, the performer would take it for the engine's bug
                    self.violation = v
        self.front.deliver(kind, key, value)

    @property
    def now(self) -> float:
        """This rank's clock."""
        return self.world.now + self.skew

    @property
    def running(self) -> bool:
        return not self.killed and not self.paused

    @property
    def engines(self) -> list[EngineInputs]:
        return self.performer.engines

    def register_with(self, server: tuple[str, int], layout: dict[str, Any], dp_rank: int = 0, dp_size: int = 1) -> None:
        cfg = self.config
        self.planes.registry(server).register(RankRegistration(
            session_id=self.session_id, epoch=self.epoch, endpoint=self.endpoint, tp_size=cfg.tp_size,
            dp_size=dp_size, tp_rank=cfg.tp_rank, dp_rank=dp_rank, layout=layout,
            transport=self.transport.instance.hex()))

    # -- inputs --------------------------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A scheduler's call on this rank's front, at this rank's clock: what it returns (None if deferred:
        a paused process's scheduler is stopped too, so the call runs, in order, when it resumes; a killed
        one's never runs). A call that raises is a violation: schedulers make only calls the API takes."""
        if self.killed:
            return None
        if self.paused:
            self._calls.append((fn, args))
            return None
        try:
            return fn(*args, self.now)
        except Violation:
            raise
        except Exception as e:
            raise Violation(f"api: {self.name}: {getattr(fn, '__qualname__', fn)}{args!r:.80} raised {e!r}") from e

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """An input a scheduler's call makes (a front's ``submit``): refused now and then when the planes
        refuse inputs (as a full driver does: ``CapacityError``)."""
        planes = self.planes
        if planes.faults.refuse_inputs and planes.world.rng.random() < planes.faults.refuse_inputs:
            planes.stats["inputs_refused"] += 1
            raise CapacityError(f"{self.name}: inputs already queued (simulated)")
        self.input(fn, *args)

    def input(self, fn: Callable[..., Any], *args: Any) -> None:
        """An engine input now (kept while paused, dropped once killed)."""
        if self.killed:
            return
        if self.paused:
            self._backlog.append((fn, args))
            return
        stats = self.performer.stats
        before = stats["work_errors"]
        self.performer.input(fn, args)
        if self.violation is not None:
            raise self.violation
        if stats["work_errors"] != before:
            self.planes.work_errors += 1
            raise Violation(f"bounds: an engine input of {self.name} raised ({getattr(fn, '__qualname__', fn)}; "
                            "see the log: --verbose)")
        if self.planes.fabric.blocked:
            raise Violation(f"bounds: {self.name}'s driver would have waited on a full sink (a write posted with a "
                            "deadline to a connection at its bound)")

    def frame(self, sender: str, msg: Any) -> None:
        engine = self.receiver if self.receiver is not None and type(msg).__name__ == "EmbedStatus" else self.engine
        self.input(engine.message, sender, msg)

    def peer_dead(self, dead: DeadPeer) -> None:
        for engine in self.engines:
            self.input(engine.peer_dead, dead.endpoint, dead.session_id, dead.epoch, dead.reason)

    def peer_back(self, endpoint: str, session_id: str, epoch: int) -> None:
        for engine in self.engines:
            back = getattr(engine, "peer_back", None)
            if back is not None:
                self.input(back, endpoint, session_id, epoch)

    def _tick(self) -> None:
        """The driver's clock: the engines tick when one of their deadlines passed (as the real driver asks
        them; a tick before that has nothing to do, by the engines' contract), parked posts expire."""
        if self.killed:
            return
        now = self.now
        if not self.paused:
            self.performer.expire(now)
        for engine in self.engines:
            if engine.next_deadline() <= now or self.paused:
                self.input(engine.tick)
        self.world.after(TICK, self._tick)

    # -- faults ----------------------------------------------------------------------------------

    def pause(self) -> None:
        self.paused = True
        self.transport.paused = True

    def resume(self) -> None:
        if self.killed or not self.paused:
            return
        self.paused = False
        self.transport.paused = False
        self.channel.liveness.pardon(self.world.now)  # we were not listening: our silence proves nothing
        self.planes.fabric.resume(self.transport)
        calls, self._calls = self._calls, []
        for fn, args in calls:
            self.call(fn, *args)
        backlog, self._backlog = self._backlog, []
        for fn, args in backlog:
            self.input(fn, *args)

    def kill(self) -> None:
        self.killed = True
        self.transport.killed = True
        self.planes.fabric.killed(self.transport)
        self._backlog, self._calls = [], []
        self.planes.network.remove(self.endpoint)


class Replica:
    """A tp group of ranks of one role; ``round`` is their agreement, all ranks at once."""

    def __init__(self, name: str, role: str, ranks: list[SimRank], server: tuple[str, int] | None,
                 started: float = 0.0) -> None:
        self.name = name
        self.role = role
        self.ranks = ranks
        self.server = server
        self.killed = False
        self.started = started  # when this incarnation started (a restart: later than 0)
        self.epoch = 1

    def __repr__(self) -> str:
        return f"Replica({self.name}, {self.role}, epoch {self.epoch}{', killed' if self.killed else ''})"

    def round(self, now: float, recv: bool = False) -> list[list[Any]]:
        """Each rank's events of one agreed round (the PD table's, or the receive table's with ``recv``)."""
        tables = [r.recv_table if recv else r.table for r in self.ranks]
        bufs = [t.encode(r.now) for t, r in zip(tables, self.ranks)]  # each rank's own clock
        if len(bufs) > 1:
            agreed = np.minimum.reduce(bufs)
            for buf in bufs:
                buf[:] = agreed
        events = [t.decode() for t in tables]
        if not recv and len(events) > 1:
            failed = [i for i, e in enumerate(events[0]) if type(e) is Failed]
            if failed:
                picked = pick_reasons([[evs[i].reason for i in failed] for evs in events])
                for evs in events:
                    for i, reason in zip(failed, picked):
                        evs[i] = Failed(evs[i].rid, reason)
        return events

    def recv_failed(self) -> list[list[tuple[str, str]]]:
        """Each rank's failed receive requests of the last round, reasons agreed (as ``Receiver.round``)."""
        lists = [r.recv_table.failed() for r in self.ranks]
        if len(lists) > 1 and lists[0]:
            picked = pick_reasons([[reason for _, reason in failed] for failed in lists])
            lists = [[(rid, reason) for (rid, _), reason in zip(failed, picked)] for failed in lists]
        return lists


def configs(role: str, tp: int, buffers_for: Callable[[int], list[np.ndarray]], *, page_bytes: int, num_pages: int,
            kv_layout: Any, knobs: dict[str, Any], server: tuple[str, int] | None) -> list[Any]:
    """The real config of each rank of a replica (validated as a peer's would be)."""
    out = []
    for rank in range(tp):
        if role == "prefill":
            out.append(PrefillConfig(kv_buffers=buffers_for(rank), page_bytes=page_bytes, num_pages=num_pages,
                                     tp_size=tp, tp_rank=rank, kv_layout=kv_layout, bootstrap_host=server[0],
                                     bootstrap_port=server[1], **knobs))
        elif role == "decode":
            out.append(DecodeConfig(kv_buffers=buffers_for(rank), page_bytes=page_bytes, num_pages=num_pages,
                                    tp_size=tp, tp_rank=rank, kv_layout=kv_layout, **knobs))
        else:
            out.append(EncodeConfig(send_buffers=buffers_for(rank), tp_size=tp, tp_rank=rank, bootstrap_host=server[0],
                                    bootstrap_port=server[1], **knobs))
    return out


def _garbled(info: Any, rng: Any) -> Any:
    """``info`` as a server with a bug (or an older one) might list it: a layout or shape no rank registers."""
    import msgspec

    how = rng.randrange(4)
    if how == 0:
        return msgspec.structs.replace(info, layout={**info.layout, "page_bytes": 4096})
    if how == 1:
        return msgspec.structs.replace(info, layout={**info.layout, "kv": "hnd"})
    if how == 2:
        return msgspec.structs.replace(info, dp_size=info.dp_size + 1)  # a group it lists no tp size for
    return msgspec.structs.replace(info, layout={**info.layout, "num_pages": [1]})
