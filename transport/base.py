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
- ``verbs``: the device, not the sink's CPU, checks writes. With memory
  windows (``revoke_method == "memory window"``) a grant is one type 2 window
  per contiguous range, bound on the queue pair of its source, and a region
  that requires grants opens to nothing else; ``revoke`` asks the source to
  stop, waits until nothing through the grant is in flight (or cuts that
  source's queue pair at the deadline) and invalidates the windows: the
  source's other grants carry on. On a device without windows
  (``"queue pair to error"``) it moves the sink queue pair of the grant's
  source to the error state: in-flight and later writes of that source fail,
  all of its rooms with them, and it must connect again. A
  ``revoke(..., settled=True)`` (the caller knows every write through the
  grant completed at the source, e.g. it reported success) needs no wait.

Notes: a completion that rides the data path
--------------------------------------------
``write(..., grant=key, note=b"...")`` attaches a small opaque byte string, the
**note** (at most ``MAX_NOTE`` = 4096 bytes), to a batch, so that the layer
above need not send "the data landed" on the control channel after it. The sink
hands it to the handler its owner installed with ``on_note(handler)``:
``handler(grant_key, note)``, on a transport thread, under the callbacks' rules
below (must not block; an exception goes to ``threading.excepthook`` and the
transport carries on). With no handler installed a received note is dropped
(and counted, ``notes_dropped`` where the transport keeps the count).

What the sink promises: a note is handed only if **every write of its batch
landed through the batch's grant** (live, given to that connection's source,
every write inside it: the frame was accepted, as for any batch through a
grant), and **no earlier batch through the same grant on the same connection
was refused** (the sink keeps, per connection, the grants whose batches it
refused: a source whose earlier batch was refused cannot vouch for "all landed"
with a later note). It is handed **before the batch's ack is sent**: when the
source's ``on_done(batch_id, None)`` runs, the sink's handler has already
returned. A batch whose completion is an error may or may not have had its note
handed (the ack may have been lost after the note went): the layer above lives
with that. Notes are handed in the order their batches landed, per connection.

``write`` raises ``TransportError(op="write")``, posting nothing, for a note
that is not ``bytes``, and for a non-empty one that is longer than
``MAX_NOTE``, on a batch without a grant (``grant=0``), on a batch of no
writes, or on a transport whose ``carries_notes`` is False (verbs today: see
its docstring). A wrapper carries its inner transport's notes.

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
from dataclasses import dataclass, field
from typing import Any, ClassVar

# The interface's parts, each in its own module; their names are importable from here too.
from .accepting import OUT_OF_RESOURCES, AcceptBackoff
from .completions import Batch, Completion, CompletionQueue, OnDone, as_batch, call_on_done, deliver, take_slot
from .deadline import Deadline
from .endpoint import Endpoint, decode_endpoint, encode_endpoint, new_instance_id
from .notes import MAX_NOTE, NoteHandler, call_on_note, check_handler, check_note
from .regions import Grant, GrantTable, Region, RegionTable, buffer_span, byte_view, grant_ranges
from .secret import (
    HELLO_TIMEOUT,
    MAC_BYTES,
    MAX_SECRET_BYTES,
    MIN_SECRET_BYTES,
    NONCE_BYTES,
    AuthFailures,
    auth_failed,
    check_secret,
    derive_key,
    hello_mac,
    same_mac,
)

__all__ = [
    "AcceptBackoff", "AuthFailures", "Batch", "Completion", "CompletionQueue", "Endpoint", "Grant", "GrantTable",
    "HELLO_TIMEOUT", "MAC_BYTES", "MAX_NOTE", "MAX_SECRET_BYTES", "MIN_SECRET_BYTES", "NONCE_BYTES", "OUT_OF_RESOURCES",
    "NoteHandler", "OnDone", "PeerHandle", "Region", "RegionTable", "Transport", "as_batch", "auth_failed", "buffer_span",
    "byte_view", "call_on_done", "call_on_note", "check_handler", "check_note", "check_secret", "close_once", "decode_endpoint", "deliver",
    "derive_key", "encode_endpoint",
    "grant_ranges", "hello_mac", "new_instance_id", "same_mac", "take_slot",
]


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
    def write(self, peer: PeerHandle, batch: Batch, on_done: OnDone | None = None, *,
              deadline: Deadline | None = None, grant: int = 0, note: bytes = b"") -> int:
        """Post a batch; return its id. See the module docstring for validation, order and back-pressure.

        ``grant`` is the key of the sink's :class:`Grant` the writes go through (0: none, for regions
        registered without ``require_grant``). ``note`` (at most ``MAX_NOTE`` bytes; needs a grant, a
        write and ``carries_notes``) rides the batch to the sink's ``on_note`` handler, handed there
        once every byte of the batch landed and before its ack goes (module docstring, "Notes")."""

    @property
    @abc.abstractmethod
    def carries_notes(self) -> bool:
        """Whether ``write(..., note=...)`` may carry a note to the sink (else a note raises)."""

    @abc.abstractmethod
    def on_note(self, handler: NoteHandler | None) -> None:
        """Install ``handler(grant_key, note)`` for the notes that reach this sink (``None`` removes it).

        Called on a transport thread, before the note's batch is acked; it must not block, and an
        exception it raises goes to ``threading.excepthook`` (module docstring, "Notes"). On a transport
        that does not carry notes it is kept and never called."""

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


def close_once(transport: Any) -> tuple[bool, list[Any]]:
    """Mark ``transport`` closed and take its peers, under its lock: whether this close is the first
    (only the first stops the threads and frees what they use; a later one only waits for them) and
    the peers it took (each close fails what its peers still hold). Shared by the transports whose
    ``close`` starts this way (their ``_lock``, ``_closed`` and ``_peers``)."""
    with transport._lock:
        first = not transport._closed
        transport._closed = True
        peers = list(transport._peers.values())
        transport._peers.clear()
    return first, peers
