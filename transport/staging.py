"""Device memory over a host transport: a wrapper that stages GPU buffers through pinned host mirrors.

Why: KV pages (PD) and receive slots (EPD) may be CUDA tensors, while ``tcp`` (and ``verbs``
without dma-buf) register CPU memory only. ``StagedTransport(inner, device=...)`` registers, for
each device buffer, a host *mirror* of its byte size with ``inner`` and returns the mirror's
:class:`Region`: every address above this layer (layouts, planners, grants, batches) is a mirror
address, so nothing above changes. Bytes move between a buffer and its mirror with a copier
(``transport.device_copy``): a source *gathers* the device bytes of a batch into the mirror before
the batch is posted; a sink *lands* what arrived, ``land(ranges, on_done)``, scattering it from the
mirror into device memory. Host memory (``device="auto"``: anything but a CUDA tensor) is registered
as it is and its batches take no copy.

By name: ``transport.create("staged:tcp", device="standin", seed=1, **tcp_options)``; the registry
hands :data:`WRAPPER_OPTIONS` to the wrapper and the rest to ``create("tcp")``.

What holds through the wrapper (``transport/base.py``'s promises):

- **Validation first.** A batch's local ranges are checked against the regions registered here and,
  for a batch that cannot be posted at once, its remote ranges against the peer's last endpoint,
  before anything is copied: ``TransportError(op="write")``, nothing posted.
- **One completion per batch, per-peer posting order.** Batches to a peer go into one queue in
  posting order. A batch's gathers may finish in any order (they do, with the stand-in copier);
  it is posted to ``inner`` only once its own gathers finished *and* every batch before it was
  posted, so the inner transport's order is the posting order. A batch whose gather failed, or
  whose inner ``write`` raised, fails with exactly one completion in its turn. Completions are
  delivered in posting order whatever thread resolves them (one deliverer per peer at a time).
- **Empty batch = fence**: it waits behind every earlier batch like any other, so it completes
  after all of them.
- **Bounded in flight**: at most ``max_inflight`` (default: the inner transport's) batches per peer
  from ``write`` until their completion was delivered (queue mode: taken); ``CapacityError`` at once
  with ``deadline=None``, else after waiting until the deadline. Since the inner transport only sees
  what this bound admitted, it never refuses for capacity.
- **Host batches bypass staging**: a batch that touches no device region, to a peer with nothing
  gathering, is posted to ``inner`` from the caller's thread (no copy, no thread hop; a completion
  callback of ours around it). Behind a batch still gathering it waits its turn like the rest.
- **Callbacks** run on an inner transport thread or a copier thread, never inside ``write``.
- **Notes** ride their batch: checked in ``write`` (against the inner transport's
  ``carries_notes``), handed to ``inner`` with the batch once it is gathered. At the sink the inner
  transport hands them (``on_note`` passes through) once the bytes are in the *mirror*: the owner
  still calls ``land`` to copy them into the device, as without a note. After a batch through a
  grant failed before it reached the inner transport (its gather failed), later batches to that
  peer through that grant go without their notes: the sink would take one as the word that every
  byte written through the grant landed.

Sink side, and the fence: bytes that reach a sink land in its *mirror*; ``land`` copies them into
the device. ``revoke(grant)`` first revokes at the inner transport (nothing more lands in the mirror
through the grant), then waits until no scatter overlapping the grant's ranges is pending: after it
returns no byte reaches the device pages of that grant, neither from the network nor from a copy.
While a revoke waits, a ``land`` overlapping its ranges is refused (``on_done`` with the reason): a
room being revoked has failed, its bytes must not land. ``land`` after ``revoke`` returned is the
caller's to avoid (the pages may belong to a new room by then). ``close`` stops the copiers
(pending copies fail), closes the inner transport and unpins the mirrors.

A source must not change device bytes a batch in flight reads (the interface's rule for host
memory, unchanged): a later gather of the same pages rewrites the mirror with what the device holds.

What is not here: dma-buf registration (``device_copy.buffer_path`` says why a buffer is staged);
a source whose gathers run while earlier batches are sent reuses one mirror, so two batches
reading the same pages must carry the same bytes (they do when the rule above is kept).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .base import (Batch, Completion, CompletionQueue, Grant, OnDone, PeerHandle, Region, Transport, as_batch,
                   call_on_done)
from .deadline import Deadline
from .device_copy import CLOSED, Copier, CudaCopier, StandInCopier, buffer_path, is_cuda_tensor
from .errors import CapacityError, StartError, TransportError
from .wrapping import SpoiledGrants, Wrapping

__all__ = ["LandDone", "StagedTransport", "WRAPPER_OPTIONS"]

#: Options of ``create("staged:<inner>", ...)`` that configure the wrapper; the others go to the inner transport.
WRAPPER_OPTIONS = ("device", "seed", "max_delay", "stand_in")
_MAX_SPOILED = 4096  # grants a peer queue remembers as spoiled (past it, the oldest is forgotten)
#: ``land``'s completion: ``None`` once every byte is in device memory, else why not.
LandDone = Callable[["str | None"], None]


@dataclass(eq=False, slots=True)
class _Device:
    """A device buffer registered through its mirror."""

    region: Region  # the mirror's region at the inner transport
    buf: Any
    mirror: np.ndarray
    copier: Copier
    path: str
    reason: str
    pending: int = 0  # gathers and scatters submitted, not yet done


@dataclass(eq=False, slots=True)
class _Entry:
    """One batch written through the wrapper, from ``write`` until its completion was delivered."""

    batch_id: int
    arr: np.ndarray
    on_done: OnDone | None
    grant: int
    note: bytes = b""  # rides the batch to the inner transport
    gathering: int = 0  # gathers not yet done
    resolved: bool = False
    error: TransportError | None = None


@dataclass(eq=False, slots=True)
class _PeerQueue:
    """One peer's batches: ``order`` until delivered, ``unposted`` until handed to the inner transport."""

    slots: int = 0
    order: deque[_Entry] = field(default_factory=deque)
    unposted: deque[_Entry] = field(default_factory=deque)
    pumping: bool = False  # a thread is posting this peer's batches (one at a time keeps the order)
    # grants a batch failed through unposted: no later note rides them
    spoiled: SpoiledGrants = field(default_factory=lambda: SpoiledGrants(_MAX_SPOILED))
    delivering: bool = False  # a thread is delivering this peer's completions


@dataclass(eq=False, slots=True)
class _Scatter:
    """One ``land`` whose device copies are not all done."""

    ranges: tuple[tuple[int, int], ...]  # mirror addresses
    on_done: LandDone
    pending: int
    error: str | None = None


def _overlaps(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> bool:
    """Whether any range of ``a`` meets any range of ``b`` (``(addr, length)`` pairs)."""
    if not a or not b:
        return False
    starts = np.array([x for x, _ in b], np.uint64)
    ends = starts + np.array([n for _, n in b], np.uint64)
    order = np.argsort(starts)
    starts, ends = starts[order], np.maximum.accumulate(ends[order])  # running max: one look-up suffices
    for addr, length in a:
        i = int(np.searchsorted(starts, np.uint64(addr + length), side="left")) - 1  # last start below our end
        if i >= 0 and int(ends[i]) > addr:
            return True
    return False


class StagedTransport(Wrapping, Transport):
    """Wraps ``inner``; see the module docstring.

    ``device``: ``"auto"`` stages CUDA tensors (one :class:`CudaCopier` per device, built on first
    use) and registers everything else as it is; ``"standin"`` treats buffers ``stand_in(buf)``
    accepts (default: every numpy array and torch tensor) as device memory, copied by a
    :class:`StandInCopier` (``seed``, ``max_delay``: its late, out-of-order completions), for tests
    and machines without a GPU. ``max_inflight``: batches in flight per peer (default and at most:
    the inner transport's, else 64).

    Counters: ``stats`` (``gathers``, ``scatters``, ``bytes_gathered``, ``bytes_scattered``,
    ``copy_errors``), each also a property; ``device_path`` and ``paths()`` say how registered
    memory reaches the network.
    """

    name: ClassVar[str] = "staged"

    def __init__(
        self,
        inner: Transport,
        *,
        device: str = "auto",
        seed: int | None = None,
        max_delay: float = 0.002,
        stand_in: Callable[[Any], bool] | None = None,
        max_inflight: int | None = None,
    ) -> None:
        if device not in ("auto", "standin"):
            raise StartError(f"staged transport: device is 'auto' or 'standin', got {device!r}")
        # Never above the inner transport's bound: a gathered batch posted from a copier thread must find a slot.
        inner_limit = getattr(inner, "_max_inflight", None)
        limit = max_inflight if max_inflight is not None else (inner_limit or 64)
        if isinstance(inner_limit, int) and isinstance(limit, int):
            limit = min(limit, inner_limit)
        if not isinstance(limit, int) or limit < 1:
            raise StartError(f"staged transport: max_inflight must be a positive integer, got {limit!r}")
        self.inner = inner
        self._mode = device
        self._seed = seed
        self._max_delay = float(max_delay)
        self._stand_in = stand_in or _array_or_tensor
        self._max_inflight = limit
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._ids = iter(range(1, 1 << 62))
        self._queue = CompletionQueue(1 << 30)  # bounded by the in-flight slots its entries hold
        self._peers: dict[int, _PeerQueue] = {}
        self._copiers: dict[str, Copier] = {}
        self._devices: dict[Region, _Device] = {}
        self._hosts: set[Region] = set()
        # every region registered here, as sorted arrays: (starts, ends, device or None per region)
        self._snap: tuple[np.ndarray, np.ndarray, list[_Device | None]] = (
            np.empty(0, np.uint64), np.empty(0, np.uint64), [])
        self._remote: dict[int, tuple[Any, np.ndarray, np.ndarray]] = {}  # peer.id -> (endpoint, starts, ends)
        self._scatters: set[_Scatter] = set()
        self._revoking: list[tuple[tuple[int, int], ...]] = []
        self.stats = {"gathers": 0, "scatters": 0, "bytes_gathered": 0, "bytes_scattered": 0, "copy_errors": 0}

    # ------------------------------------------------------------------ pass-through

    @property
    def max_inflight(self) -> int:
        """Batches in flight per peer through this wrapper."""
        return self._max_inflight

    def disconnect(self, peer: PeerHandle, *, deadline: Deadline | None = None) -> None:
        # The inner transport fails what is posted; batches still gathering fail when their post is refused.
        self.inner.disconnect(peer, deadline=deadline)
        self._remote.pop(peer.id, None)

    def completions(self, max_items: int = 1024, *, deadline: Deadline | None = None) -> list[Completion]:
        return self._queue.get(max_items, deadline)

    # ------------------------------------------------------------------ counters and paths

    @property
    def gathers(self) -> int:
        """Gathers (device -> mirror) completed."""
        return self.stats["gathers"]

    @property
    def scatters(self) -> int:
        """Scatters (mirror -> device) completed."""
        return self.stats["scatters"]

    @property
    def bytes_gathered(self) -> int:
        return self.stats["bytes_gathered"]

    @property
    def bytes_scattered(self) -> int:
        return self.stats["bytes_scattered"]

    @property
    def copy_errors(self) -> int:
        """Gathers and scatters that failed."""
        return self.stats["copy_errors"]

    @property
    def device_path(self) -> str:
        """How registered device memory reaches the network: ``"staging"`` (or ``"dma-buf"``) when any
        device buffer is registered, else ``"host"``; ``device_path_reason`` says why not dma-buf."""
        with self._lock:
            devices = list(self._devices.values())
        return devices[0].path if devices else "host"

    @property
    def device_path_reason(self) -> str:
        """Why the device path is not dma-buf ('' when only host memory is registered)."""
        with self._lock:
            devices = list(self._devices.values())
        return devices[0].reason if devices else ""

    def paths(self) -> dict[Region, tuple[str, str]]:
        """Every region registered here: ``(path, reason)`` (``device_copy.buffer_path``)."""
        with self._lock:
            out = {r: (d.path, d.reason) for r, d in self._devices.items()}
            out.update({r: ("host", "") for r in self._hosts})
        return out

    def mirror_of(self, region: Region) -> np.ndarray | None:
        """The host mirror behind a device region (None for host memory): diagnostics and tests."""
        with self._lock:
            dev = self._devices.get(region)
        return None if dev is None else dev.mirror

    def copiers(self) -> tuple[Copier, ...]:
        """The copiers built so far (tests reach the stand-in's hooks through this)."""
        with self._lock:
            return tuple(self._copiers.values())

    def copier(self) -> Copier:
        """The stand-in copier of ``device="standin"`` (built on first use): its ``hold()`` and
        ``fail_next()`` are the tests' hooks."""
        if self._mode != "standin":
            raise ValueError("copier() is the stand-in's; device='auto' has one CudaCopier per device (copiers())")
        return self._copier_for(None)

    # ------------------------------------------------------------------ registrations

    def _is_device(self, buf: Any) -> bool:
        return bool(self._stand_in(buf)) if self._mode == "standin" else is_cuda_tensor(buf)

    def _copier_for(self, buf: Any) -> Copier:
        key = "standin" if self._mode == "standin" else str(buf.device)
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed", op="register")
            copier = self._copiers.get(key)
            if copier is None:
                if self._mode == "standin":
                    copier = StandInCopier(seed=self._seed, max_delay=self._max_delay)
                else:
                    copier = CudaCopier(buf.device)
                self._copiers[key] = copier
            return copier

    def register(self, buf: Any, *, require_grant: bool = False) -> Region:
        """Device memory: register a pinned mirror of its size with the inner transport and return the
        mirror's region (addresses above are mirror addresses). Host memory: pass through."""
        if not self._is_device(buf):
            region = self.inner.register(buf, require_grant=require_grant)
            with self._lock:
                self._hosts.add(region)
                self._resnap()
            return region
        copier = self._copier_for(buf)
        mirror = copier.mirror(buf)
        try:
            region = self.inner.register(mirror, require_grant=require_grant)
        except BaseException:
            copier.unmirror(mirror)
            raise
        path, reason = buffer_path(buf, getattr(self.inner, "name", ""), device=self._mode)
        with self._lock:
            self._devices[region] = _Device(region, buf, mirror, copier, path, reason)
            self._resnap()
        return region

    def _resnap(self) -> None:
        """Rebuild the sorted region arrays write and land look ranges up in (holds ``_lock``)."""
        items = sorted([(r, d) for r, d in self._devices.items()] + [(r, None) for r in self._hosts], key=lambda x: x[0].addr)
        self._snap = (
            np.array([r.addr for r, _ in items], np.uint64),
            np.array([r.end for r, _ in items], np.uint64),
            [d for _, d in items],
        )

    def deregister(self, region: Region, *, deadline: Deadline | None = None) -> None:
        """Wait (up to ``deadline``, default 5 s) for the region's pending copies, then forward and unpin.
        ``TransportError(op="deregister")`` if a copy is still pending then: the region stays registered
        (its device memory may still be written), retry later."""
        deadline = deadline or Deadline.after(5.0)
        with self._cond:
            dev = self._devices.get(region)
            if dev is not None and not self._cond.wait_for(lambda: dev.pending == 0, deadline.remaining()):
                raise TransportError(f"deregister: {region} still has {dev.pending} copies pending", op="deregister")
        try:
            self.inner.deregister(region, deadline=deadline)
        finally:  # the inner transport forgets the region even when a write still landed at its deadline
            with self._lock:
                self._devices.pop(region, None)
                self._hosts.discard(region)
                self._resnap()
        if dev is not None:  # only once nothing can land in the mirror any more
            dev.copier.unmirror(dev.mirror)

    def _locate(self, addrs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, list[_Device | None]] | None:
        """The index of the region holding each ``[addr, addr + length)`` and the regions' devices; None
        if one lies in no single region."""
        starts, ends, devices = self._snap
        if not len(addrs):
            return np.empty(0, np.int64), devices
        i = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
        if int(i.min()) < 0:
            return None
        stop = addrs + lengths
        if bool((stop < addrs).any()) or bool((stop > ends[i]).any()):
            return None
        return i, devices

    # ------------------------------------------------------------------ writes

    def write(self, peer: PeerHandle, batch: Batch, on_done: OnDone | None = None, *,
              deadline: Deadline | None = None, grant: int = 0, note: bytes = b"") -> int:
        arr = as_batch(batch)
        if note or type(note) is not bytes:
            self._check_note(note, len(arr), grant)
        gathers: dict[_Device, list[tuple[int, int]]] = {}
        staging = bool(self._devices) or self._mode == "standin"
        # With only host memory registered the inner transport checks what it is handed: at once for a
        # batch posted from here, by an error completion for one that queued behind a concurrent post.
        if staging:
            found = self._locate(arr[:, 0], arr[:, 2])
            if found is None:
                raise TransportError("a local range of the batch is outside every registered region", op="write")
            idx, devices = found
            for k in np.unique(idx).tolist():
                dev = devices[k]
                if dev is not None:
                    rows = arr[idx == k]
                    gathers[dev] = [(int(a) - dev.region.addr, int(n)) for a, n in zip(rows[:, 0], rows[:, 2])]
            # A batch that waits is posted from another thread: its remote ranges are checked now.
            self._check_remote(peer, arr)
        with self._cond:
            if self._closed:
                raise TransportError("transport is closed", op="write")
            p = self._peers.setdefault(peer.id, _PeerQueue())
            self._take_slot(p, deadline)
            e = _Entry(next(self._ids), arr, on_done, grant, note, gathering=len(gathers))
            p.order.append(e)
            direct = not gathers and not p.unposted and not p.pumping
            if direct:
                p.pumping = True  # we post it now; writers meanwhile queue behind it
            else:
                p.unposted.append(e)
                for dev in gathers:
                    dev.pending += 1
        if direct:
            try:
                self._post(peer, p, e)
            except BaseException:
                with self._cond:  # nothing posted: the batch never was
                    p.order.remove(e)
                    p.slots -= 1
                    p.pumping = False
                    self._cond.notify_all()
                self._pump(peer, p)
                raise
            with self._cond:
                p.pumping = False
            self._pump(peer, p)  # what queued behind it meanwhile
            return e.batch_id
        for dev, spans in gathers.items():
            nbytes = sum(n for _, n in spans)
            dev.copier.gather(dev.buf, dev.mirror, spans, functools.partial(self._gathered, peer, p, e, dev, nbytes))
        if not gathers:
            self._pump(peer, p)
        return e.batch_id

    def _check_remote(self, peer: PeerHandle, arr: np.ndarray) -> None:
        """Check the batch's remote ranges against the peer's last endpoint (its arrays cached per
        endpoint), so a bad one is a synchronous error even for a batch posted later from a copier
        thread (the inner transport checks again when posting)."""
        if not len(arr):
            return
        cached = self._remote.get(peer.id)
        if cached is None or cached[0] is not peer.remote:
            regions = peer.regions.snapshot()
            cached = (peer.remote, np.array([r.addr for r in regions], np.uint64), np.array([r.end for r in regions], np.uint64))
            self._remote[peer.id] = cached
        _, starts, ends = cached
        i = np.searchsorted(starts, arr[:, 1], side="right").astype(np.int64) - 1
        stop = arr[:, 1] + arr[:, 2]
        if not len(starts) or int(i.min()) < 0 or bool((stop < arr[:, 1]).any()) or bool((stop > ends[i]).any()):
            raise TransportError("a remote range of the batch is outside every region of the peer's endpoint", op="write")

    def _take_slot(self, p: _PeerQueue, deadline: Deadline | None) -> None:
        """One of the peer's in-flight slots (holds ``_cond``): at once, or waiting until ``deadline``."""
        limit = self._max_inflight
        if p.slots >= limit:
            if deadline is None:
                raise CapacityError(
                    f"{limit} batches already in flight to this peer "
                    "(queue-mode batches hold their slot until completions() takes them)")
            self._cond.wait_for(lambda: p.slots < limit or self._closed, timeout=deadline.remaining())
            if self._closed:
                raise TransportError("transport is closed", op="write")
            if p.slots >= limit:
                raise CapacityError(f"{limit} batches still in flight to this peer at the deadline")
        p.slots += 1

    def _post(self, peer: PeerHandle, p: _PeerQueue, e: _Entry) -> None:
        """Hand one batch to the inner transport (raises what its ``write`` raises)."""
        self.inner.write(peer, e.arr, functools.partial(self._inner_done, peer, p, e), grant=e.grant, note=e.note)

    def _inner_done(self, peer: PeerHandle, p: _PeerQueue, e: _Entry, _batch_id: int, error: TransportError | None) -> None:
        self._resolve(p, e, error)

    def _gathered(self, peer: PeerHandle, p: _PeerQueue, e: _Entry, dev: _Device, nbytes: int, error: str | None) -> None:
        """A copier finished one gather of ``e`` (any order); post what is now first and ready."""
        with self._cond:
            dev.pending -= 1
            e.gathering -= 1
            if error is None:
                self.stats["gathers"] += 1
                self.stats["bytes_gathered"] += nbytes
            else:
                self.stats["copy_errors"] += 1 if error != CLOSED else 0
                if e.error is None:
                    e.error = TransportError(f"gathering the batch from device memory failed: {error}", op="write")
            self._cond.notify_all()
        self._pump(peer, p)

    def _pump(self, peer: PeerHandle, p: _PeerQueue) -> None:
        """Post the peer's batches whose gathers are done, oldest first, stopping at one still gathering.
        One thread pumps a peer at a time: the inner transport sees the posting order."""
        with self._cond:
            if p.pumping:
                return
            p.pumping = True
        while True:
            with self._cond:
                if not p.unposted or p.unposted[0].gathering:
                    p.pumping = False
                    return
                e = p.unposted.popleft()
                error = e.error or (TransportError("transport is closed", op="write") if self._closed else None)
                if e.grant in p.spoiled:
                    e.note = b""  # an earlier batch through its grant never reached the sink
            if error is None:
                try:
                    self._post(peer, p, e)
                    continue
                except Exception as exc:
                    error = exc if isinstance(exc, TransportError) else TransportError(
                        f"posting the gathered batch failed: {exc!r}", op="write")
            if e.grant:
                with self._cond:
                    p.spoiled.spoil(e.grant)
            self._resolve(p, e, error)

    def _resolve(self, p: _PeerQueue, e: _Entry, error: TransportError | None) -> None:
        with self._cond:
            if e.resolved:
                return
            e.resolved = True
            e.error = error
        self._deliver(p)

    def _deliver(self, p: _PeerQueue) -> None:
        """Deliver the peer's resolved batches at the head of its order, in order (one deliverer at a time)."""
        with self._cond:
            if p.delivering:
                return
            p.delivering = True
        while True:
            with self._cond:
                if not p.order or not p.order[0].resolved:
                    p.delivering = False
                    return
                e = p.order.popleft()
            release = functools.partial(self._release, p)
            if e.on_done is None:
                self._queue.put(Completion(e.batch_id, e.error), release)
            else:
                release()
                call_on_done(e.on_done, e.batch_id, e.error)

    def _release(self, p: _PeerQueue) -> None:
        with self._cond:
            p.slots -= 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ sink side

    def land(self, ranges: Sequence[tuple[int, int]] | np.ndarray, on_done: LandDone) -> bool:
        """Copy ``ranges`` (``(addr, length)`` in region addresses, as written to this sink) from the
        mirrors into device memory; a room above counts as landed only after ``on_done(None)``.

        Returns at once. ``on_done(None)`` or ``on_done("why not")`` follows exactly once: from a copier
        thread once every scatter finished, or, when nothing needs copying (only host regions, no
        ranges) or the ranges overlap a grant being revoked, before ``land`` returns; the result says
        which (True: ``on_done`` already ran). A range outside every registered region is the caller's
        bug: ``ValueError``, synchronously, nothing copied and ``on_done`` not called.
        ``TransportError(op="land")`` once closed.
        """
        rows = np.asarray(ranges, dtype=np.uint64).reshape(-1, 2) if len(ranges) else np.empty((0, 2), np.uint64)
        if rows.size and int(rows[:, 1].min()) == 0:
            raise ValueError("land: a range has length 0")
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed", op="land")
        found = self._locate(rows[:, 0], rows[:, 1])
        if found is None:
            raise ValueError("land: a range is outside every registered region")
        idx, devices = found
        scatters: dict[_Device, list[tuple[int, int]]] = {}
        for k in np.unique(idx).tolist():
            dev = devices[k]
            if dev is not None:
                sel = rows[idx == k]
                scatters[dev] = [(int(a) - dev.region.addr, int(n)) for a, n in zip(sel[:, 0], sel[:, 1])]
        if not scatters:
            _call_land(on_done, None)
            return True
        device_ranges = tuple((int(a), int(n)) for a, n in rows[np.array([devices[k] is not None for k in idx.tolist()])].tolist())
        with self._cond:
            refused = any(_overlaps(device_ranges, g) for g in self._revoking)
            if not refused:
                s = _Scatter(device_ranges, on_done, len(scatters))
                self._scatters.add(s)
                for dev in scatters:
                    dev.pending += 1
        if refused:
            _call_land(on_done, "a grant over these pages is being revoked: nothing lands")
            return True
        for dev, spans in scatters.items():
            nbytes = sum(n for _, n in spans)
            dev.copier.scatter(dev.buf, dev.mirror, spans, functools.partial(self._scattered, s, dev, nbytes))
        return False

    def _scattered(self, s: _Scatter, dev: _Device, nbytes: int, error: str | None) -> None:
        with self._cond:
            dev.pending -= 1
            s.pending -= 1
            if error is None:
                self.stats["scatters"] += 1
                self.stats["bytes_scattered"] += nbytes
            else:
                self.stats["copy_errors"] += 1 if error != CLOSED else 0
                s.error = s.error or error
            last = s.pending == 0
            if last:
                self._scatters.discard(s)
            self._cond.notify_all()
        if last:
            _call_land(s.on_done, s.error)

    def revoke(self, grant: Grant, *, deadline: Deadline | None = None, settled: bool = False) -> None:
        """Revoke at the inner transport (nothing more lands in the mirror through the grant), then wait
        until no scatter overlapping the grant's ranges is pending: after this returns, no byte reaches
        the grant's device pages. ``TransportError(op="revoke")`` if one is still pending at the deadline
        (default 1 s; the caller retries: a second revoke forwards again, which is idempotent, and waits)."""
        deadline = deadline or Deadline.after(1.0)
        with self._lock:
            self._revoking.append(grant.ranges)
        try:
            self.inner.revoke(grant, deadline=deadline, settled=settled)
            with self._cond:
                idle = self._cond.wait_for(
                    lambda: not any(_overlaps(s.ranges, grant.ranges) for s in self._scatters), deadline.remaining())
            if not idle:
                raise TransportError(
                    f"revoke: a copy into the device pages of grant {grant.key} is still pending at the deadline",
                    op="revoke")
        finally:
            with self._lock:
                self._revoking.remove(grant.ranges)

    # ------------------------------------------------------------------ lifecycle

    def close(self, *, deadline: Deadline | None = None) -> None:
        """Fail what is in flight, stop the copiers (pending copies fail), close the inner transport,
        unpin the mirrors. Idempotent; ``TransportError(op="close")`` if a thread did not stop by the deadline."""
        deadline = deadline or Deadline.after(5.0)
        with self._cond:
            self._closed = True
            copiers = list(self._copiers.values())
            self._cond.notify_all()  # writers waiting for a slot
        errors: list[BaseException] = []
        for copier in copiers:  # pending gathers fail their batches, pending scatters their lands
            try:
                copier.close(deadline)
            except BaseException as e:
                errors.append(e)
        try:
            self.inner.close(deadline=deadline)  # fails every posted batch: their completions come to us
        except BaseException as e:
            errors.append(e)
        closed_error = TransportError("transport closed with the batch in flight", op="close")
        with self._cond:
            peers = list(self._peers.values())
            stuck = list(self._scatters)
            self._scatters.clear()
        for p in peers:
            with self._cond:
                left = list(p.order)
            for entry in left:  # not resolved yet: never posted, or the inner transport never answered
                self._resolve(p, entry, closed_error)
            self._deliver(p)  # resolved before and not yet delivered
        for s in stuck:  # a copier that did not stop in time left these
            _call_land(s.on_done, CLOSED)
        if not any(isinstance(e, TransportError) and e.op == "close" for e in errors):
            with self._lock:
                devices = list(self._devices.values())
            for dev in devices:
                dev.copier.unmirror(dev.mirror)
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        return f"<StagedTransport device={self._mode} devices={len(self._devices)} inner={self.inner!r}>"


def _array_or_tensor(buf: Any) -> bool:
    """The stand-in's default: numpy arrays and torch tensors are device memory."""
    return isinstance(buf, np.ndarray) or (hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"))


def _call_land(on_done: LandDone, error: str | None) -> None:
    """A land's completion; its exception is the caller's bug, reported, and the thread carries on."""
    try:
        on_done(error)
    except Exception:
        exc_type, exc, tb = sys.exc_info()
        threading.excepthook(threading.ExceptHookArgs((exc_type, exc, tb, threading.current_thread())))


WRAPPER = StagedTransport  # what ``transport.create("<prefix><inner>")`` wraps the inner transport in
