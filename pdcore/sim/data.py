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

Staged (``DataFaults.staged``): buffers registered are device memory, as a peer
with ``device_memory`` stages them: the transport registers a host mirror of
each, a write first copies its pages from the buffer into the mirror, and a sink
copies what landed into the buffer when the engine asks (``land``), later and in
any order; ``revoke`` fails (the engine retries) while a copy into the grant's
pages is pending, as the real one waits for it.

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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transport.base import Grant, GrantTable, Region, RegionTable, as_batch
from transport.errors import CapacityError, TransportError

from ..node.device import MirrorMap
from .world import World

__all__ = ["Fabric", "SimTransport", "SimHandle"]


@dataclass(eq=False)
class SimHandle:
    id: int
    src: SimTransport
    dst: SimTransport
    closed: bool = False
    inflight: int = 0  # batches posted and not completed
    unlanded: set[int] = field(default_factory=set)  # batches posted that neither landed nor failed yet
    spoiled: set[int] = field(default_factory=set)  # grants a batch failed through: notes through them are not handed


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
    staged: bool = False  # buffers registered now are device memory: the transport stages them (as ``transport.staging``)
    copy_error: float = 0.0  # share of copies into device memory that fail
    notes: bool = False  # the transport carries notes (TCP's): a batch's note is handed to the sink once it landed


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
        # staged buffers: (mirror addr, length, mirror, the buffer's bytes); the mirror is what is registered
        self._mirrors: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self.copying: list[list[tuple[int, int]]] = []  # ranges (mirror addresses) being copied into device memory
        self.mirror_map = MirrorMap()  # a staged buffer's address -> its mirror's (an encode chunk names the buffer)
        self.note_handler: Any = None  # (grant key, note) once a batch with a note landed here
        fabric.transports[self.instance] = self

    # -- what a driver performs -------------------------------------------------------------

    def register(self, buf: Any, *, require_grant: bool = False) -> Region:
        arr = np.asarray(buf)
        self._owners.append(arr)
        if self._fabric.faults.staged:  # device memory: peers write into its host mirror, which is what is registered
            mirror = np.zeros(arr.nbytes, np.uint8)
            self._mirrors.append((int(mirror.ctypes.data), int(arr.nbytes), mirror, arr.reshape(-1).view(np.uint8)))
            self.mirror_map.add(arr, int(mirror.ctypes.data))
            arr = mirror
            self._owners.append(mirror)
        region = Region(int(arr.ctypes.data), int(arr.nbytes), 0)
        self._regions.add(region)
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
        if self.copying_into(grant.ranges):  # the real one waits for the copy, then gives up at its deadline
            raise TransportError("a copy into the grant's pages is still pending (simulated)", op="revoke")

    def connect(self, endpoint: bytes, *, deadline: Any = None) -> SimHandle:
        dst = self._fabric.by_endpoint(endpoint)
        if dst is None or dst.killed:
            raise TransportError(f"no transport at {endpoint!r}", op="connect")
        return SimHandle(next(self._fabric.ids), self, dst)

    def disconnect(self, handle: SimHandle, *, deadline: Any = None) -> None:
        handle.closed = True

    @property
    def carries_notes(self) -> bool:
        return self._fabric.faults.notes

    def on_note(self, handler: Any) -> None:
        self.note_handler = handler

    def write(self, handle: SimHandle, batch: Any, on_done: Any = None, *, deadline: Any = None, grant: int = 0,
              note: bytes = b"") -> int:
        if handle.closed:
            raise TransportError("the connection is closed", op="write")
        if note and not (self.carries_notes and grant and len(batch)):
            raise TransportError("a note rides a batch of writes through a grant, on a transport that carries notes",
                                 op="write")
        fabric = self._fabric
        if handle.inflight >= fabric.faults.max_inflight:
            if deadline is not None:  # a real transport would wait here, on the sink, on the driver's thread
                fabric.blocked += 1
            raise CapacityError(f"{handle.inflight} batches still in flight to this peer")
        if fabric.refused("refuse_post"):
            raise TransportError("the write was refused (simulated)", op="write")
        rows = as_batch(batch)
        if self._mirrors:  # the gather: the pages' bytes go into the mirror the writes read
            self._copy(rows[:, 0].tolist(), rows[:, 2].tolist(), gather=True)
        handle.inflight += 1
        batch_id = next(self._fabric.ids)
        self._fabric.send(handle, rows, on_done, batch_id, grant, note)
        return batch_id

    # -- device memory (staged) ----------------------------------------------------------

    def _copy(self, addrs: list[int], lengths: list[int], *, gather: bool) -> None:
        """Copy mirrored ranges between the buffers and their mirrors (``gather``: buffer -> mirror)."""
        for addr, length in zip(addrs, lengths):
            for mirror_addr, size, mirror, buf in self._mirrors:
                if mirror_addr <= addr and addr + length <= mirror_addr + size:
                    at = addr - mirror_addr
                    if gather:
                        mirror[at : at + length] = buf[at : at + length]
                    else:
                        buf[at : at + length] = mirror[at : at + length]
                    break

    def land(self, ranges: Any, on_done: Any) -> bool:
        """The staged transport's ``land``: copy ``ranges`` from the mirrors into device memory, later (in simulated
        time, in any order); ``on_done(None)`` or ``on_done(why)`` once. True if it answered already."""
        spans = [(int(a), int(n)) for a, n in ranges]
        if not self._mirrors:
            on_done(None)
            return True
        self.copying.append(spans)
        self._fabric.world.after(self._fabric._delay(), self._fabric.copy_in, self, spans, on_done)
        return False

    def copying_into(self, ranges: Any) -> bool:
        """Whether a copy into device memory overlapping ``ranges`` is pending."""
        return any(a < b + m and b < a + n for spans in self.copying for a, n in spans for b, m in ranges)

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
                      "posts_refused": 0, "grants_refused": 0, "revokes_refused": 0, "copied_in": 0,
                      "copies_failed": 0, "noted": 0}
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

    def send(self, handle: SimHandle, rows: np.ndarray, on_done: Any, batch_id: int, grant: int, note: bytes) -> None:
        self.stats["batches"] += 1
        handle.unlanded.add(batch_id)
        self.world.after(self._delay(), self._land, handle, rows, on_done, batch_id, grant, note)

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

    def _land(self, handle: SimHandle, rows: np.ndarray, on_done: Any, batch_id: int, grant: int, note: bytes) -> None:
        src, dst = handle.src, handle.dst
        if src.killed:
            self.stats["lost"] += 1
            handle.unlanded.discard(batch_id)
            return  # a killed process sends nothing more, and hears nothing
        if (src.paused or dst.paused) and not (handle.closed or dst.killed):  # a stopped process sends nothing,
            self.stats["frozen"] += 1  # and receives nothing (a dead one breaks the connection)
            (src if src.paused else dst).frozen.append((handle, rows, on_done, batch_id, grant, note))
            return
        if note and any(b < batch_id for b in handle.unlanded):
            # a connection lands its batches in order (TCP): a note is handed only after those before it
            self.world.after(self._delay(), self._land, handle, rows, on_done, batch_id, grant, note)
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
                if note and grant not in handle.spoiled and dst.note_handler is not None:
                    self.stats["noted"] += 1  # before the completion, as the TCP sink hands it before its ack
                    dst.note_handler(grant, note)
        handle.unlanded.discard(batch_id)
        if error is not None:
            handle.spoiled.add(grant)
        self.world.after(self._delay(), self._done, handle, on_done, batch_id, error)

    def copy_in(self, sink: SimTransport, spans: list[tuple[int, int]], on_done: Any) -> None:
        """A staged sink's copy into device memory finishes (a paused process's copies wait for it)."""
        if sink.killed:
            return
        if sink.paused:
            self.world.after(self._delay() + 0.01, self.copy_in, sink, spans, on_done)
            return
        sink.copying.remove(spans)
        if self.faults.copy_error and self.world.rng.random() < self.faults.copy_error:
            self.stats["copies_failed"] += 1
            on_done("the copy into device memory failed (simulated)")
            return
        sink._copy([a for a, _ in spans], [n for _, n in spans], gather=False)
        self.stats["copied_in"] += 1
        on_done(None)

    def _done(self, handle: SimHandle, on_done: Any, batch_id: int, error: Any) -> None:
        handle.inflight -= 1
        if on_done is not None and not handle.src.killed:
            on_done(batch_id, error)
