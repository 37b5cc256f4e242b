"""The data-plane interface every transport honours (``"tcp"``, ``"verbs"``, ...).

A transport moves bytes between registered memory of two processes with
one-sided writes. It knows nothing of rooms, requests or states: the PD layer
above decides *what* to write; a transport only lands bytes and says when they
landed.

Theory of operation
-------------------
1. Each side ``register``\\ s the memory it will write from or into and gets a
   :class:`Region` (address, length, and an opaque per-transport ``key``: the
   rkey for verbs, a region id for TCP).
2. The sink hands ``endpoint()`` (bytes, self-describing and versioned, listing
   every region registered so far) to the source over the control channel.
   ``connect(endpoint)`` on the source returns a :class:`PeerHandle`. A source
   that must learn of regions the sink registered later calls
   ``refresh(peer, newer_endpoint)``.
3. ``write(peer, batch, on_done)`` posts a batch of ``(local_addr,
   remote_addr, length)`` triples and returns a batch id at once. Exactly one
   completion per batch follows, from a transport thread: ``on_done(batch_id,
   None)`` when **the sink confirmed that every byte of the batch landed**, or
   ``on_done(batch_id, TransportError)`` naming the cause (peer gone, target
   outside the sink's regions, transport closed, ...). After a failed batch,
   any subset of its bytes may have landed. With ``on_done=None`` the
   completion goes to the transport's completion queue instead
   (:meth:`Transport.completions`).
4. ``close()`` fails every batch still in flight, stops every thread and frees
   every registration. It is idempotent and returns within its deadline.

Grants: the sink is the authority over its memory
-------------------------------------------------
A region registered with ``require_grant=True`` takes remote writes only
through a **grant**: ``grant(source, ranges)`` (on the sink) gives the source
transport named by its ``instance`` the right to write into ``ranges`` and
returns a :class:`Grant` whose ``key`` the sink sends to the source (over the
control channel); the source names it in ``write(..., grant=key)``.
``revoke(grant)`` takes the right back: **after it returns, no byte written
through that grant lands**, whatever the source does next (pauses, resumes,
keeps sending). Revoking is how a sink closes a fence without trusting the
source: a source's "my writes drained" is a fast path, never the guarantee.
How each transport keeps the promise:

- ``tcp``: the sink checks every write of a frame against the live grant it
  names (same source instance, every write inside the grant's ranges) before
  it lands a byte; a frame that fails the check fails its batch and lands
  nothing. ``revoke`` removes the grant, then waits for a frame landing through
  it to finish; a frame still landing at the deadline (a paused or stalled
  source) has its connection cut, and ``revoke`` returns once the sink thread
  has stopped writing into memory.
- ``verbs``: writes carry the region's rkey and the device, not the sink's
  CPU, checks them, so the grant cannot be checked per write without memory
  windows. This transport moves the sink queue pair of the grant's source to
  the error state (``revoke_method``): in-flight and later writes of that
  source fail, all of its rooms with them, and it must connect again. A
  ``revoke(..., settled=True)`` (the caller knows every write through the
  grant completed at the source, e.g. it reported success) only forgets the
  grant.

Guarantees every transport gives (the conformance suite in
``tests/transport/`` checks them):

- **Validation before memory is touched.** ``write`` raises ``TransportError``
  (``op="write"``) synchronously, posting nothing, if a local range is not
  inside one local region or a remote range is not inside one region of the
  peer's last endpoint. The *sink* checks every write again against the
  regions it has registered *now* (an endpoint may be stale): a write outside
  them fails its batch with an error completion and lands no byte of it.
- **Completion order.** Batches to one peer complete in the order they were
  posted. An empty batch is allowed; it completes after every batch posted
  before it to the same peer: it is a fence ("fence before free" relies on it).
- **Bounded in flight.** At most ``max_inflight`` batches per peer are posted
  and not yet completed (for queue-mode completions: not yet taken from the
  queue, so the queue is bounded too). ``write`` with ``deadline=None`` never
  blocks: it raises ``CapacityError`` when the peer is at its bound; with a
  ``Deadline`` it waits for a slot until then, then raises ``CapacityError``.
- **No hang on a dead peer.** A peer that disappears fails the batches in
  flight to it within ``peer_timeout`` seconds (an option of every
  transport), and later writes to it raise ``TransportError`` (``op="write"``).
- **Callbacks** run on a transport thread and must not block; they may call
  ``write`` with ``deadline=None``. A callback may run before ``write`` has
  returned the batch id: bind what you need into the callable (a closure or
  ``functools.partial``) rather than looking the id up. An exception raised by
  a callback is a bug in the caller: it is reported through
  ``threading.excepthook`` and the transport carries on.
- **Threads.** ``register``/``deregister``/``connect``/``write``/``refresh``/
  ``disconnect`` may be called from any thread.

Authentication
--------------
``secret`` (bytes, 16..4096, default None) is an option of every network
transport: the deployment secret. With it, every connection handshake is a
mutual challenge-response (HMAC-SHA256 with a key :func:`derive_key` derives
from the secret per transport, over both sides' fresh nonces, both instance
ids and the direction), so a sink serves, and a source writes to, only a peer
that proved it holds the same secret; knowing an instance id or a grant key is
not enough, and a recorded handshake does not replay (the other side's nonce is
new). A mismatch (different secrets, or a secret on one side only) makes
``connect`` raise ``TransportError(op="connect", errno=EACCES)`` whose message
starts with ``"authentication failed:"`` and names the sink's ``host:port``;
the sink counts it in ``auth_failures``, logs at most one warning per peer
host per 10 s, and frees the connection. A handshake finishes within
``min(peer_timeout, 5 s)`` or is dropped. Without a secret on either side
connections are unauthenticated, as before. Only the handshake is
authenticated, not each frame (a frame costs the same with a secret): an
attacker on the network path can still tamper with an established stream.

Errors and deadlines: this package stands alone
-----------------------------------------------
``transport`` imports nothing from ``pdcore`` (a test parses every module
here to check it, and another imports the package with pdcore absent). It
owns its errors, in ``transport.errors``: ``TransportError(message, op=...,
errno=...)`` for data plane failures, ``CapacityError`` for back-pressure,
``StartError`` when a transport cannot start, all subclasses of
``TransportBaseError``; and its deadline, ``transport.deadline.Deadline``.

How users still catch every library error as ``pdcore.PdError``: pdcore sits
above and re-exports these very classes rather than defining its own.
``pdcore.PdError`` *is* ``transport.errors.TransportBaseError`` (one class,
two names), and pdcore's ``CollectiveError``, ``ProtocolError``, ... subclass
it; ``pdcore.StartError``, ``pdcore.CapacityError`` and
``pdcore.TransportError`` *are* ``transport.errors``' classes; and
``pdcore.core.deadline.Deadline`` *is* ``transport.deadline.Deadline``. So
``except pdcore.PdError`` catches every transport error, ``except
pdcore.TransportError`` catches a transport's failures, and no error is
defined twice.
"""

from __future__ import annotations

import abc
import bisect
import ctypes
import errno as errno_mod
import hashlib
import hmac
import logging
import os
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeAlias

import numpy as np

from .deadline import Deadline
from .errors import StartError, TransportError
from .loglimit import LogLimit

__all__ = [
    "AcceptBackoff",
    "Batch",
    "Grant",
    "Completion",
    "CompletionQueue",
    "Endpoint",
    "OnDone",
    "PeerHandle",
    "Region",
    "RegionTable",
    "Transport",
    "as_batch",
    "buffer_span",
    "check_secret",
    "decode_endpoint",
    "derive_key",
    "encode_endpoint",
]

#: A batch: a sequence of ``(local_addr, remote_addr, length)`` triples, or an
#: ``(n, 3)`` integer numpy array (the transfer plan's output is ``uint64``).
Batch: TypeAlias = "Sequence[tuple[int, int, int]] | np.ndarray"
#: ``on_done(batch_id, error)``; ``error`` is ``None`` when every byte landed.
OnDone: TypeAlias = Callable[[int, "TransportError | None"], None]

_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Region:
    """Registered memory: ``[addr, addr + length)``; ``key`` is opaque per transport."""

    addr: int
    length: int
    key: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.addr <= _U64_MAX and 0 < self.length and self.addr + self.length <= _U64_MAX + 1):
            raise ValueError(f"a region needs a non-null address and a positive length, got {self!r}")
        if not 0 <= self.key <= _U64_MAX:
            raise ValueError(f"a region key is an unsigned 64-bit value, got {self.key!r}")

    @property
    def end(self) -> int:
        return self.addr + self.length

    def contains(self, addr: int, length: int) -> bool:
        """True if ``[addr, addr + length)`` lies inside this region."""
        return self.addr <= addr and addr + length <= self.addr + self.length


@dataclass(frozen=True, slots=True)
class Grant:
    """A sink's permission for one source transport to write into ``ranges`` of the sink's regions.

    ``key`` (a non-zero u64, unique per sink) is what the source names in
    ``write(..., grant=key)``; ``source`` is the source transport's ``instance``;
    ``ranges`` are ``(addr, length)`` pairs sorted by address, not overlapping (a write must lie
    inside one of them).
    """

    key: int
    source: bytes
    ranges: tuple[tuple[int, int], ...]


def grant_ranges(ranges: Any) -> tuple[tuple[int, int], ...]:
    """Normalise grant ranges: ``(addr, length)`` pairs (or an ``(n, 2)`` int array), sorted by
    address; ``ValueError`` for an empty or wrapping range or overlapping ones. One pass: a decode
    rank grants every announced room's pages, so this runs per request."""
    rows = sorted(map(tuple, ranges.reshape(-1, 2).tolist()) if isinstance(ranges, np.ndarray) else ranges)
    if not all(type(a) is int and type(n) is int for a, n in rows):
        rows = [(int(a), int(n)) for a, n in rows]
    end = 1
    for addr, length in rows:
        if addr < end or length <= 0 or addr + length > _U64_MAX + 1:
            what = "overlap" if addr < end and addr > 0 and length > 0 else "need a non-null address and a positive length"
            raise ValueError(f"grant ranges {what}: ({addr:#x}, {length})")
        end = addr + length
    return tuple(rows)


class GrantTable:
    """A sink's live grants, by key; ``check`` is O(log ranges) per write. Callers hold their own lock."""

    def __init__(self) -> None:
        self._grants: dict[int, tuple[Grant, list[int]]] = {}
        self._keys = iter(range(1, _U64_MAX))

    def add(self, source: bytes, ranges: Any) -> Grant:
        if len(source) != 16:
            raise ValueError(f"a grant names a source transport instance of 16 bytes, got {len(source)}")
        normal = grant_ranges(ranges)
        g = Grant(next(self._keys), bytes(source), normal)
        self._grants[g.key] = (g, [a for a, _ in normal])
        return g

    def pop(self, key: int) -> Grant | None:
        entry = self._grants.pop(key, None)
        return None if entry is None else entry[0]

    def get(self, key: int) -> Grant | None:
        entry = self._grants.get(key)
        return None if entry is None else entry[0]

    def check(self, key: int, source: bytes, addr: int, length: int) -> str:
        """'' if ``[addr, addr + length)`` may be written by ``source`` through grant ``key``; else why not."""
        entry = self._grants.get(key)
        if entry is None:
            return f"grant {key} is not live at the sink (revoked, or never granted)"
        g, starts = entry
        if g.source != source:
            return f"grant {key} was given to another source"
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or addr + length > g.ranges[i][0] + g.ranges[i][1]:
            return f"[{addr:#x}, +{length}) is outside grant {key}"
        return ""

    def of_source(self, source: bytes) -> list[Grant]:
        return [g for g, _ in self._grants.values() if g.source == source]


class Completion(NamedTuple):
    """One batch's outcome, as taken from a completion queue."""

    batch_id: int
    error: TransportError | None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What a peer needs to reach a transport and check its addresses (decoded form of ``endpoint()``).

    ``transport`` is the transport's name; ``instance`` is 16 random bytes
    naming one transport object (a restarted process has a new one);
    ``address`` is transport-specific (TCP: ``b"host:port"``); ``regions`` is
    every region registered when the endpoint was taken, sorted by address.
    """

    transport: str
    instance: bytes
    address: bytes
    regions: tuple[Region, ...]


_EP_MAGIC = b"PDTE"
_EP_VERSION = 1
_EP_HEAD = struct.Struct("<4sBB16sI")  # magic, version, len(name), instance, len(address)
_EP_REGION = struct.Struct("<QQQ")  # addr, length, key
_EP_MAX_REGIONS = 1 << 16
_EP_MAX_ADDRESS = 4096


def encode_endpoint(ep: Endpoint) -> bytes:
    """Serialise an endpoint: ``PDTE``, version, name, instance, address, regions."""
    name = ep.transport.encode("ascii")
    if not 0 < len(name) < 256 or len(ep.instance) != 16 or len(ep.address) > _EP_MAX_ADDRESS:
        raise ValueError(f"cannot encode endpoint {ep!r}")
    if len(ep.regions) > _EP_MAX_REGIONS:
        raise ValueError(f"an endpoint holds at most {_EP_MAX_REGIONS} regions, got {len(ep.regions)}")
    parts = [_EP_HEAD.pack(_EP_MAGIC, _EP_VERSION, len(name), ep.instance, len(ep.address)), name, ep.address]
    parts.append(struct.pack("<I", len(ep.regions)))
    parts.extend(_EP_REGION.pack(r.addr, r.length, r.key) for r in ep.regions)
    return b"".join(parts)


def decode_endpoint(data: bytes, *, expect: str | None = None) -> Endpoint:
    """Parse ``endpoint()`` bytes from a peer; anything malformed raises ``TransportError(op="endpoint")``.

    ``expect`` is the transport name the caller can talk to; another name is an error.
    """

    def bad(why: str) -> TransportError:
        return TransportError(f"malformed transport endpoint: {why}", op="endpoint")

    data = bytes(data)
    if len(data) < _EP_HEAD.size:
        raise bad(f"{len(data)} bytes is shorter than the {_EP_HEAD.size}-byte header")
    magic, version, name_len, instance, addr_len = _EP_HEAD.unpack_from(data, 0)
    if magic != _EP_MAGIC:
        raise bad(f"magic {magic!r}, expected {_EP_MAGIC!r}")
    if version != _EP_VERSION:
        raise bad(f"version {version}, this build speaks version {_EP_VERSION}")
    if name_len == 0 or addr_len > _EP_MAX_ADDRESS:
        raise bad(f"name length {name_len}, address length {addr_len}")
    off = _EP_HEAD.size
    if len(data) < off + name_len + addr_len + 4:
        raise bad("truncated before the region count")
    try:
        name = data[off : off + name_len].decode("ascii")
    except UnicodeDecodeError as e:
        raise bad("transport name is not ASCII") from e
    off += name_len
    address = data[off : off + addr_len]
    off += addr_len
    (count,) = struct.unpack_from("<I", data, off)
    off += 4
    if count > _EP_MAX_REGIONS or len(data) != off + count * _EP_REGION.size:
        raise bad(f"{count} regions do not match {len(data) - off} trailing bytes")
    regions = []
    for i in range(count):
        addr, length, key = _EP_REGION.unpack_from(data, off + i * _EP_REGION.size)
        try:
            regions.append(Region(addr, length, key))
        except ValueError as e:
            raise bad(f"region {i}: {e}") from e
    regions.sort(key=lambda r: r.addr)
    for a, b in zip(regions, regions[1:]):
        if b.addr < a.end:
            raise bad(f"regions {a} and {b} overlap")
    if expect is not None and name != expect:
        raise TransportError(f"peer endpoint is for transport {name!r}, this is {expect!r}", op="endpoint")
    return Endpoint(name, instance, address, tuple(regions))


class RegionTable:
    """Non-overlapping regions sorted by address; thread-safe. ``find`` is O(log n)."""

    def __init__(self, regions: Sequence[Region] = ()) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._regions: list[Region] = []
        for r in regions:
            self.add(r)

    def add(self, region: Region) -> None:
        """Insert; raise ``ValueError`` if it overlaps a region already present."""
        with self._lock:
            i = bisect.bisect_right(self._starts, region.addr)
            if i > 0 and self._regions[i - 1].end > region.addr:
                raise ValueError(f"{region} overlaps registered {self._regions[i - 1]}")
            if i < len(self._regions) and self._regions[i].addr < region.end:
                raise ValueError(f"{region} overlaps registered {self._regions[i]}")
            self._starts.insert(i, region.addr)
            self._regions.insert(i, region)

    def remove(self, region: Region) -> bool:
        """Remove exactly this region; False if it was not present."""
        with self._lock:
            i = bisect.bisect_left(self._starts, region.addr)
            if i < len(self._regions) and self._regions[i] == region:
                del self._starts[i], self._regions[i]
                return True
            return False

    def find(self, addr: int, length: int) -> Region | None:
        """The region holding all of ``[addr, addr + length)``, or None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i >= 0 and self._regions[i].contains(addr, length):
                return self._regions[i]
            return None

    def outside(self, ranges: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
        """The first of ``ranges`` (sorted by address) that lies in no one region, or None."""
        lo = hi = 0
        for addr, length in ranges:  # consecutive ranges mostly share a region: look up only when one leaves it
            if not (lo <= addr and addr + length <= hi):
                region = self.find(addr, length)
                if region is None:
                    return addr, length
                lo, hi = region.addr, region.end
        return None

    def snapshot(self) -> tuple[Region, ...]:
        with self._lock:
            return tuple(self._regions)

    def clear(self) -> tuple[Region, ...]:
        with self._lock:
            out = tuple(self._regions)
            self._starts.clear()
            self._regions.clear()
            return out

    def __len__(self) -> int:
        return len(self._regions)


def buffer_span(buf: Any) -> tuple[int, int, Any]:
    """``(addr, length, owner)`` of a buffer to register; ``owner`` keeps the memory alive.

    Accepts a contiguous numpy array, a contiguous CPU torch tensor (duck-typed:
    ``data_ptr``/``nbytes``/``is_contiguous``/``device``; torch is never
    imported here), an ``(addr, length)`` pair of ints (the caller keeps that
    memory alive until ``deregister``), or any writable buffer-protocol object.
    """
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(x, int) for x in buf):
        addr, length = buf
        owner: Any = None
    elif isinstance(buf, np.ndarray):
        if not (buf.flags.c_contiguous or buf.flags.f_contiguous):
            raise ValueError("register needs a contiguous numpy array (np.ascontiguousarray makes one)")
        addr, length, owner = int(buf.ctypes.data), int(buf.nbytes), buf
    elif hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):
        device = getattr(getattr(buf, "device", None), "type", "cpu")
        if device != "cpu":
            raise ValueError(f"register needs a CPU tensor, got one on {device!r}")
        if not buf.is_contiguous():
            raise ValueError("register needs a contiguous tensor (.contiguous() makes one)")
        addr, owner = int(buf.data_ptr()), buf
        length = int(buf.nbytes) if hasattr(buf, "nbytes") else int(buf.numel() * buf.element_size())
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except TypeError as e:
            raise TypeError(
                f"cannot register {type(buf).__name__}: pass a numpy array, a CPU torch tensor, "
                "(addr, length), or a buffer-protocol object"
            ) from e
        addr, length, owner = int(arr.ctypes.data), int(arr.nbytes), (buf, arr)
    if addr <= 0 or length <= 0:
        raise ValueError(f"cannot register an empty or null buffer (addr={addr:#x}, length={length})")
    return addr, length, owner


def byte_view(addr: int, length: int, owner: Any = None) -> memoryview:
    """A writable ``memoryview`` of raw memory that keeps ``owner`` alive (every slice of it does too).

    With ``owner=None`` the caller guarantees the memory stays mapped and alive.
    """
    raw = (ctypes.c_char * length).from_address(addr)
    raw._pdcore_owner = owner  # type: ignore[attr-defined]  # a ctypes object keeps what it references
    return memoryview(raw).cast("B")


def as_batch(batch: Batch) -> np.ndarray:
    """Normalise a batch to a C-contiguous ``(n, 3)`` ``uint64`` array; lengths must be positive."""
    if isinstance(batch, np.ndarray):
        if batch.ndim != 2 or batch.shape[1] != 3:
            raise TransportError(f"a batch array has shape (n, 3), got {batch.shape}", op="write")
        if batch.dtype.kind not in "iu":
            raise TransportError(f"a batch array holds integers, got dtype {batch.dtype}", op="write")
        if batch.dtype.kind == "i" and batch.size and int(batch.min()) < 0:
            raise TransportError("a batch holds no negative addresses or lengths", op="write")
        arr = np.ascontiguousarray(batch, dtype=np.uint64)
    else:
        try:
            arr = np.array(batch, dtype=np.uint64).reshape(-1, 3) if len(batch) else np.empty((0, 3), np.uint64)
        except (ValueError, TypeError, OverflowError) as e:
            raise TransportError(f"a batch is a sequence of (local, remote, length) triples: {e}", op="write") from e
    if arr.size and int(arr[:, 2].min()) == 0:
        raise TransportError("a write in the batch has length 0", op="write")
    return arr


@dataclass(eq=False, slots=True)
class PeerHandle:
    """A connected peer, as returned by ``connect``; pass it back to ``write``/``disconnect``.

    ``remote`` is the peer's last endpoint; ``regions`` resolves remote ranges.
    Transports may subclass to keep their own per-peer state.
    """

    id: int
    remote: Endpoint
    regions: RegionTable = field(repr=False)
    closed: bool = False


class CompletionQueue:
    """A bounded queue of completions with a deadline-aware ``get``."""

    def __init__(self, maxsize: int) -> None:
        self._items: deque[tuple[Completion, Callable[[], None]]] = deque()
        self._maxsize = maxsize
        self._cond = threading.Condition()

    def put(self, completion: Completion, release: Callable[[], None]) -> None:
        """``release`` runs when the completion is taken (it frees the batch's in-flight slot)."""
        with self._cond:
            self._items.append((completion, release))
            self._cond.notify()

    def get(self, max_items: int, deadline: Deadline | None) -> list[Completion]:
        with self._cond:
            if deadline is not None:
                self._cond.wait_for(lambda: self._items, timeout=deadline.remaining())
            out: list[Completion] = []
            releases = []
            while self._items and len(out) < max_items:
                c, r = self._items.popleft()
                out.append(c)
                releases.append(r)
        for r in releases:
            r()
        return out

    def __len__(self) -> int:
        return len(self._items)


def deliver(queue: CompletionQueue, peer: Any, batch_id: int, on_done: OnDone | None, error: TransportError | None) -> None:
    """Report one batch's completion and free its in-flight slot (``peer.slots`` under ``peer.lock``, a Condition).

    Queue mode keeps the slot until the completion is taken, so the queue stays
    bounded. A callback's exception is the caller's bug: it goes to
    ``threading.excepthook`` and the transport thread carries on.
    """

    def release() -> None:
        with peer.lock:
            peer.slots -= 1
            peer.lock.notify_all()

    if on_done is None:
        queue.put(Completion(batch_id, error), release)
        return
    release()
    call_on_done(on_done, batch_id, error)


def call_on_done(on_done: OnDone, batch_id: int, error: TransportError | None) -> None:
    """Run a completion callback on a transport thread; its exception is the caller's bug, reported
    through ``threading.excepthook``, and the thread carries on."""
    try:
        on_done(batch_id, error)
    except Exception:
        exc_type, exc, tb = sys.exc_info()
        threading.excepthook(threading.ExceptHookArgs((exc_type, exc, tb, threading.current_thread())))


class Transport(abc.ABC):
    """One transport instance: its registrations, its listener, its peers and threads.

    Options common to every transport (keyword arguments of its constructor,
    passed through ``transport.create(name, **options)``):

    - ``max_inflight`` (int, default 64): batches in flight per peer.
    - ``peer_timeout`` (float seconds, default 10): a peer that makes no
      progress for this long while batches are in flight is declared dead and
      those batches fail.
    - ``secret`` (bytes of 16..4096, default None): the deployment secret; every connection
      handshake then authenticates both sides (module docstring, "Authentication"). A sink
      counts failed handshakes in ``auth_failures``.
    """

    #: Registry name (``"tcp"``, ``"verbs"``).
    name: ClassVar[str]

    @property
    @abc.abstractmethod
    def instance(self) -> bytes:
        """16 random bytes naming this transport object: what a sink names in ``grant(source, ...)``."""

    @abc.abstractmethod
    def register(self, buf: Any, *, require_grant: bool = False) -> Region:
        """Register memory (see :func:`buffer_span`); ``ValueError`` if it overlaps a registered region.

        With ``require_grant`` remote writes into it need a live :class:`Grant` (see the module docstring).
        """

    @abc.abstractmethod
    def grant(self, source: bytes, ranges: Any) -> Grant:
        """Let the source transport ``source`` (its ``instance``) write into ``ranges`` (``(addr, length)``
        pairs inside registered regions); ``ValueError`` for ranges outside them."""

    @abc.abstractmethod
    def revoke(self, grant: Grant, *, deadline: Deadline | None = None, settled: bool = False) -> None:
        """Take a grant back: once this returns, nothing written through it lands. Idempotent.

        Waits (up to ``deadline``, default 1 s) for a write landing through the
        grant to finish, then stops it by force (see the module docstring);
        ``TransportError(op="revoke")`` only if even that could not be confirmed.
        ``settled=True``: every write through the grant already completed at the
        source, so a transport may skip an expensive enforcement (verbs).
        """

    @abc.abstractmethod
    def deregister(self, region: Region, *, deadline: Deadline | None = None) -> None:
        """Forget a region. Writes into it that already started landing finish first (up to ``deadline``).

        Deregistering a region that batches in flight still *read from* is the
        caller's bug (the transport may still read it): wait for their completions.
        """

    @abc.abstractmethod
    def regions(self) -> tuple[Region, ...]:
        """The regions registered now, sorted by address."""

    @abc.abstractmethod
    def endpoint(self) -> bytes:
        """Bytes for the control channel: see :class:`Endpoint` and :func:`encode_endpoint`."""

    @abc.abstractmethod
    def connect(self, peer_endpoint: bytes, *, deadline: Deadline) -> PeerHandle:
        """Connect to the transport that produced ``peer_endpoint``; ``TransportError(op="connect")`` on failure."""

    @abc.abstractmethod
    def refresh(self, peer: PeerHandle, peer_endpoint: bytes) -> None:
        """Adopt a newer endpoint of the same peer (same ``instance``): its region list replaces the old one."""

    @abc.abstractmethod
    def disconnect(self, peer: PeerHandle, *, deadline: Deadline | None = None) -> None:
        """Close the connection; batches still in flight to it fail. Idempotent."""

    @abc.abstractmethod
    def write(
        self,
        peer: PeerHandle,
        batch: Batch,
        on_done: OnDone | None = None,
        *,
        deadline: Deadline | None = None,
        grant: int = 0,
    ) -> int:
        """Post a batch; return its id. See the module docstring for validation, order and back-pressure.

        ``grant`` is the key of the sink's :class:`Grant` the writes go through (0: none, for regions
        registered without ``require_grant``)."""

    @abc.abstractmethod
    def completions(self, max_items: int = 1024, *, deadline: Deadline | None = None) -> list[Completion]:
        """Take up to ``max_items`` queued completions (batches written with ``on_done=None``).

        With a ``deadline``, wait until at least one is there or the deadline
        passes; with ``None`` return at once (possibly an empty list).
        """

    @abc.abstractmethod
    def close(self, *, deadline: Deadline | None = None) -> None:
        """Fail batches in flight, stop every thread, free every registration. Idempotent.

        Returns within ``deadline`` (default: 5 s from now); raises
        ``TransportError(op="close")`` if a thread did not stop by then.
        """

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def new_instance_id() -> bytes:
    return os.urandom(16)


# ---------------------------------------------------------------------- authentication

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
#: bytes of a handshake nonce (each side draws its own from ``os.urandom``) and of a handshake MAC
NONCE_BYTES = 16
MAC_BYTES = 32
#: a handshake (hello to the last reply) finishes within min(peer_timeout, this) or the sink drops it
HELLO_TIMEOUT = 5.0


def check_secret(secret: object, where: str) -> bytes | None:
    """The ``secret`` option as bytes (None: unauthenticated); ``StartError`` naming the option, never its value."""
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise StartError(f"{where}: the secret option must be bytes, got {type(secret).__name__}")
    value = bytes(secret)
    if not MIN_SECRET_BYTES <= len(value) <= MAX_SECRET_BYTES:
        raise StartError(
            f"{where}: the secret option has {len(value)} bytes, need {MIN_SECRET_BYTES}..{MAX_SECRET_BYTES}"
        )
    return value


def derive_key(secret: bytes, label: str) -> bytes:
    """The 32-byte key of one plane, ``HMAC-SHA256(secret, "pdcore/" + label)``: the same bytes as
    ``pdcore.control.auth.derive_key`` (this package does not import it). ``"tcp-hello"``, ``"verbs-hello"``."""
    return hmac.new(secret, b"pdcore/" + label.encode(), hashlib.sha256).digest()


def hello_mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``parts``, each prefixed with its length (u64 LE), so no two part lists give
    the same input (``pdcore.control.auth.mac``'s rule). Callers put a role label first."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def auth_failed(where: str, why: str) -> TransportError:
    """A handshake that did not authenticate: what ``connect`` raises, naming the sink ``where`` (host:port)."""
    return TransportError(f"authentication failed: {where}: {why}", op="connect", errno=errno_mod.EACCES)


def same_mac(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(a, b)


class AuthFailures:
    """A sink's failed handshakes: a count, and at most one warning per peer host every ``every``
    seconds (a flood of bad handshakes cannot flood the log). Thread-safe; memory is bounded."""

    def __init__(self, what: str, logger: logging.Logger, every: float = 10.0) -> None:
        self._what, self._log = what, logger
        self._lock = threading.Lock()
        self._limit = LogLimit(every)  # per peer host
        self.count = 0

    def failed(self, peer: tuple[Any, ...] | None, why: str) -> None:
        host = str(peer[0]) if peer else "?"
        where = f"{host}:{peer[1]}" if peer and len(peer) > 1 else host
        with self._lock:
            self.count += 1
            count = self.count
        if self._limit.ready(host) is None:
            return  # counted; that host was named within the last `every` seconds (or too many hosts fail)
        self._log.warning(
            "%s: authentication failed for the connection from %s: %s (%d failed handshakes so far; "
            "further failures from %s are not logged for %g s)",
            self._what, where, why, count, host, self._limit.every,
        )


# ---------------------------------------------------------------------- accepting connections

#: ``accept()`` errors that mean "no descriptor or memory now", not "this connection failed": the
#: connection stays queued and the listener readable, so an acceptor that retries at once spins.
OUT_OF_RESOURCES = frozenset({errno_mod.EMFILE, errno_mod.ENFILE, errno_mod.ENOBUFS, errno_mod.ENOMEM})


class AcceptBackoff:
    """How long an acceptor waits after ``accept()`` failed for want of descriptors or memory:
    ``first`` seconds, doubling up to ``most``, back to ``first`` once an accept succeeds; a warning
    at most every ``every`` seconds. Its caller waits on something a freed descriptor sets, so it
    tries again early when it can; the bound is for what it cannot see (another part of the process
    closing files). Used by one acceptor thread."""

    def __init__(
        self, what: str, logger: logging.Logger, *, first: float = 0.01, most: float = 1.0, every: float = 10.0
    ) -> None:
        self._what, self._log = what, logger
        self._first, self._most = first, most
        self._delay = first
        self._limit = LogLimit(every)
        self.count = 0  # accepts that failed for want of descriptors or memory

    def failed(self, error: OSError) -> float | None:
        """The wait before the next ``accept()``, or None if ``error`` is not a shortage (the
        connection was gone: try the next one at once)."""
        if error.errno not in OUT_OF_RESOURCES:
            return None
        self.count += 1
        delay, self._delay = self._delay, min(2 * self._delay, self._most)
        held = self._limit.ready()
        if held is not None:
            self._log.warning(
                "%s: cannot accept a connection: %s (%d times since the last warning); "
                "waiting up to %g s before each further try", self._what, error, held + 1, self._most,
            )
        return delay

    def succeeded(self) -> None:
        self._delay = self._first
