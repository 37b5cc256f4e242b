"""The simulated data plane: one-sided writes between ranks' real memory, checked at the sink like TCP.

``SimTransport`` offers what a driver performs on a transport (``register``,
``grant``, ``revoke``, ``write``, ``connect``, ``disconnect``, ``endpoint``,
``regions``) with the TCP sink's semantics, in simulated time: a batch lands
after a delay, and only if, *at landing time*, its grant is live, given to that
source, and covers every write (the grant table is ``transport.base``'s, the
same check the TCP sink makes); otherwise nothing of it lands and the source's
completion carries the refusal. ``revoke`` takes effect at once: from then on
nothing lands through the grant, which is exactly the promise fence before free
rests on. Bytes really move (between numpy buffers the engines registered), so a
landing can be checked byte for byte.

Faults (``Fabric.faults``): extra landing and completion delay, batches that
fail at the sink, a source that pauses (its batches wait, still in flight, until
it resumes: they then meet whatever grants hold then), a source killed (its
batches never land), a sink that pauses (batches to it wait, so its sources'
connections fill up to ``max_inflight`` and ``write`` refuses more with
``CapacityError``, as a real transport does), and posts, grants and revokes the
transport refuses. A ``write`` given a deadline while the connection is full
would wait on the sink: that is counted (``Fabric.blocked``), never done (the
driver must never wait on a peer). Every landing is reported to ``on_land``
before its bytes move, so the fence can be judged there.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
from transport.base import Grant, GrantTable, Region, RegionTable, as_batch
from transport.errors import CapacityError, TransportError

from .world import World

__all__ = ["Fabric", "SimTransport", "SimHandle"]


@dataclass(eq=False)
class SimHandle:
    id: int
    src: SimTransport
    dst: SimTransport
    closed: bool = False
    inflight: int = 0  # batches posted and not completed


@dataclass
class DataFaults:
    delay: float = 0.0005  # the landing delay's scale (seconds)
    jitter: float = 0.0  # extra random delay, up to this
    error: float = 0.0  # share of batches the sink refuses
    connection_drop: float = 0.0  # share of batches whose connection breaks: they fail, and so will its later ones
    refuse_post: float = 0.0  # share of writes the source's transport refuses at once
    refuse_grant: float = 0.0  # share of grants refused
    refuse_revoke: float = 0.0  # share of revokes that fail (the grant stays until one succeeds)
    max_inflight: int = 64  # batches in flight per connection before ``write`` refuses


class SimTransport:
    """One rank's transport in the simulated fabric (see the module docstring)."""

    def __init__(self, fabric: Fabric, name: str) -> None:
        self._fabric = fabric
        self.name = name
        self.instance = fabric.new_instance()
        self._regions = RegionTable()
        self._guarded: set[int] = set()  # region addrs written only through grants
        self._owners: list[Any] = []  # the registered buffers, kept alive
        self._grants = GrantTable()
        self.paused = False
        self.killed = False
        self.frozen: list[tuple[Any, ...]] = []  # batches of a paused source, waiting to go on
        fabric.transports[self.instance] = self

    # -- what a driver performs -------------------------------------------------------------

    def register(self, buf: Any, *, require_grant: bool = False) -> Region:
        arr = np.asarray(buf)
        region = Region(int(arr.ctypes.data), int(arr.nbytes), 0)
        self._regions.add(region)
        self._owners.append(arr)
        if require_grant:
            self._guarded.add(region.addr)
        return region

    def regions(self) -> tuple[Region, ...]:
        return self._regions.snapshot()

    def endpoint(self) -> bytes:
        return b"sim:" + self.instance.hex().encode()

    def grant(self, source: bytes, ranges: Any) -> Grant:
        if self._fabric.refused("refuse_grant"):
            raise TransportError("grant refused (simulated)", op="grant")
        g = self._grants.add(source, ranges)
        bad = self._regions.outside(g.ranges)
        if bad is not None:
            self._grants.pop(g.key)
            raise ValueError(f"grant range [{bad[0]:#x}, +{bad[1]}) is outside every registered region")
        self._fabric.granted(self, g)
        return g

    def revoke(self, grant: Grant, *, deadline: Any = None, settled: bool = False) -> None:
        if self._fabric.refused("refuse_revoke"):
            raise TransportError("revoke failed (simulated)", op="revoke")
        if self._grants.get(grant.key) is grant:
            self._grants.pop(grant.key)

    def connect(self, endpoint: bytes, *, deadline: Any = None) -> SimHandle:
        dst = self._fabric.by_endpoint(endpoint)
        if dst is None or dst.killed:
            raise TransportError(f"no transport at {endpoint!r}", op="connect")
        return SimHandle(next(self._fabric.ids), self, dst)

    def disconnect(self, handle: SimHandle, *, deadline: Any = None) -> None:
        handle.closed = True

    def write(self, handle: SimHandle, batch: Any, on_done: Any = None, *, deadline: Any = None, grant: int = 0) -> int:
        if handle.closed:
            raise TransportError("the connection is closed", op="write")
        fabric = self._fabric
        if handle.inflight >= fabric.faults.max_inflight:
            if deadline is not None:  # a real transport would wait here, on the sink, on the driver's thread
                fabric.blocked += 1
            raise CapacityError(f"{handle.inflight} batches still in flight to this peer")
        if fabric.refused("refuse_post"):
            raise TransportError("the write was refused (simulated)", op="write")
        rows = as_batch(batch)
        handle.inflight += 1
        batch_id = next(self._fabric.ids)
        self._fabric.send(handle, rows, on_done, batch_id, grant)
        return batch_id

    # -- the sink's side -----------------------------------------------------------------

    def live_grants(self) -> int:
        return len(self._grants._grants)

    def live_grant_keys(self) -> list[int]:
        """The keys of the grants live now (what may still be written here)."""
        return list(self._grants._grants)

    def check(self, source: bytes, writes: list[list[int]], grant: int) -> str:
        """'' if every write of ``writes`` (``[local, remote, length]``) may land here now through ``grant`` from
        ``source``; else why not."""
        for _local, remote, length in writes:
            region = self._regions.find(remote, length)
            if region is None:
                return f"[{remote:#x}, +{length}) is outside every registered region"
            if grant:
                why = self._grants.check(grant, source, remote, length)
                if why:
                    return why
            elif region.addr in self._guarded:
                return f"[{remote:#x}, +{length}) needs a grant"
        return ""


class Fabric:
    """Every simulated transport, the batches in flight between them, and the data plane's faults."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.faults = DataFaults()
        self.transports: dict[bytes, SimTransport] = {}
        self.ids = itertools.count(1)
        self._instances = itertools.count(1)
        self.on_land: Any = None  # (sink, writes, grant key, source) before the bytes move; may raise
        self.on_grant: Any = None  # (sink, grant) when a sink grants
        self.stats = {"batches": 0, "landed": 0, "refused": 0, "lost": 0, "errors": 0, "dropped": 0, "frozen": 0, "full": 0,
                      "posts_refused": 0, "grants_refused": 0, "revokes_refused": 0}
        self.blocked = 0  # writes that would have waited for room at a full sink (a driver never may)

    def refused(self, what: str) -> bool:
        """Whether this attempt of ``what`` (a ``DataFaults`` share) is refused."""
        share = getattr(self.faults, what)
        if share and self.world.rng.random() < share:
            self.stats[what.replace("refuse_", "") + "s_refused"] += 1
            return True
        return False

    def new_instance(self) -> bytes:
        return next(self._instances).to_bytes(16, "little")

    def by_endpoint(self, endpoint: bytes) -> SimTransport | None:
        if not endpoint.startswith(b"sim:"):
            return None
        try:
            return self.transports.get(bytes.fromhex(endpoint[4:].decode()))
        except ValueError:
            return None

    def granted(self, sink: SimTransport, grant: Grant) -> None:
        if self.on_grant is not None:
            self.on_grant(sink, grant)

    def _delay(self) -> float:
        f = self.faults
        d = f.delay * (0.5 + self.world.rng.random())
        if f.jitter:
            d += self.world.rng.random() * f.jitter
        return d

    def send(self, handle: SimHandle, rows: np.ndarray, on_done: Any, batch_id: int, grant: int) -> None:
        self.stats["batches"] += 1
        self.world.after(self._delay(), self._land, handle, rows, on_done, batch_id, grant)

    def killed(self, transport: SimTransport) -> None:
        """A rank's process is gone: batches held for it while it was paused fail at their sources now (their
        connection breaks); those it sent itself are gone with it."""
        frozen, transport.frozen = transport.frozen, []
        for args in frozen:
            if args[0].src is not transport:
                self.world.after(self._delay(), self._land, *args)

    def resume(self, transport: SimTransport) -> None:
        """A paused rank goes on: the batches it sent, and those sent to it, land now (or are refused now)."""
        frozen, transport.frozen = transport.frozen, []
        for args in frozen:
            self.world.after(self._delay(), self._land, *args)

    def _land(self, handle: SimHandle, rows: np.ndarray, on_done: Any, batch_id: int, grant: int) -> None:
        src, dst = handle.src, handle.dst
        if src.killed:
            self.stats["lost"] += 1
            return  # a killed process sends nothing more, and hears nothing
        if (src.paused or dst.paused) and not (handle.closed or dst.killed):  # a stopped process sends nothing,
            self.stats["frozen"] += 1  # and receives nothing (a dead one breaks the connection)
            (src if src.paused else dst).frozen.append((handle, rows, on_done, batch_id, grant))
            return
        if handle.closed or dst.killed:
            error = TransportError("the connection was lost", op="write")
        elif self.faults.connection_drop and self.world.rng.random() < self.faults.connection_drop:
            self.stats["dropped"] += 1
            handle.closed = True  # as a transport's handle once its connection broke: the engine connects again
            error = TransportError("the connection broke (simulated)", op="write")
        elif self.faults.error and self.world.rng.random() < self.faults.error:
            self.stats["errors"] += 1
            error = TransportError("the sink failed the batch (simulated)", op="write")
        else:
            writes = rows.tolist()
            why = dst.check(src.instance, writes, grant)
            if why:
                self.stats["refused"] += 1
                error = TransportError(f"peer refused the batch: {why}", op="write")
            else:
                if self.on_land is not None:
                    self.on_land(dst, writes, grant, src)
                for local, remote, length in writes:  # (both ends lie in registered, live numpy buffers)
                    ctypes.memmove(remote, local, length)
                self.stats["landed"] += 1
                error = None
        self.world.after(self._delay(), self._done, handle, on_done, batch_id, error)

    def _done(self, handle: SimHandle, on_done: Any, batch_id: int, error: Any) -> None:
        handle.inflight -= 1
        if on_done is not None and not handle.src.killed:
            on_done(batch_id, error)
