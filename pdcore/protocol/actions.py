"""What a role engine asks its driver to do: small immutable values, drained with ``take_actions``.

An engine (``pdcore.protocol``) never performs I/O. Each input it is given (a
scheduler's call, a control message, a completion, a look-up result, the
clock) appends actions here; its driver performs them in order and feeds each
outcome back as another input:

=============  =========================================  ==================================
action         the driver does                            and feeds back
=============  =========================================  ==================================
``Send``       send ``msg`` on the control plane          ``unsent(token, why)`` if ``token``
                                                          and it could not be queued
``Connect``    (re)connect the data plane to a sink,      ``connected(token, handle, error)``
               off the engine's thread
``Disconnect`` drop a data connection (fails its writes)  nothing
``Post``       post one batch of writes through a grant   ``written(token, error)``, once
               (with its ``note``, if any)
``Grant``      grant a source the right to write ranges   ``granted(token, grant, error)``,
                                                          before the next action
``Revoke``     revoke a grant; nothing lands through it   ``revoked(token, error)``, before
               once it is done                            the next action
``LookUp``     ask a bootstrap server for a deployment's  ``looked_up(server, info, ranks,
               shape and ranks, off the engine's thread   error)``
``Land``       copy landed ranges from host staging into  ``scattered(token, error)``, once
               device memory (device-resident KV only)
=============  =========================================  ==================================

A ``Grant`` or ``Revoke`` is answered before the driver performs the next
action, so an engine may emit an ``Announce`` right after the ``granted`` that
gives it its key; ``Connect`` and ``LookUp`` are answered later (they may wait
on another host). Tokens are whatever the engine needs to find its record
again; the driver never looks inside. What an engine hands the scheduler's
side (a landing's first token, a concluded room) is no action: it goes through
``Services.deliver`` at once, before the table can agree on it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..control import wire

__all__ = ["Send", "Connect", "Disconnect", "Post", "Grant", "Revoke", "LookUp", "Land", "Action"]


class Send(NamedTuple):
    """Send ``msg`` to the peer whose control endpoint is ``endpoint``."""

    endpoint: str
    msg: wire.Message
    token: Any = None  # not None: a send that cannot be queued is fed back (``unsent``)


class Connect(NamedTuple):
    """Connect the data plane to the sink at transport endpoint ``endpoint`` (dropping ``old`` first)."""

    token: Any
    endpoint: bytes
    old: Any = None
    seconds: float = 30.0  # the connect's deadline


class Disconnect(NamedTuple):
    handle: Any


class Post(NamedTuple):
    """Write ``batch`` (``(local, remote, length)`` rows) to the peer of ``handle`` through ``grant``.

    ``wait``: seconds it may stay parked while the sink is at its in-flight bound (the driver never
    waits for it: it posts it from the sink's completions, or fails it with ``written`` after that).
    ``note``: bytes the sink's engine is handed once every byte of the batch landed (``noted``), only
    where ``Services.notes`` says the transport carries them: an encoded control frame."""

    handle: Any
    batch: Any
    grant: int
    token: Any
    wait: float
    note: bytes = b""


class Grant(NamedTuple):
    """Grant the source whose transport instance is ``source`` the right to write ``ranges``."""

    token: Any
    source: bytes
    ranges: list[tuple[int, int]]


class Revoke(NamedTuple):
    """Revoke ``grant``; ``settled``: every write through it completed (nothing should be landing)."""

    token: Any
    grant: Any
    settled: bool = False
    seconds: float = 1.0  # how long a write still landing through it may take before it is cut


class LookUp(NamedTuple):
    """Ask bootstrap ``server`` for its deployment's shape (``shape``) and the ranks ``keys`` names.

    The driver only does the I/O and answers with what the server said (``looked_up``), whatever
    happened: what is computed from the answer runs in that engine input, never on an I/O thread."""

    server: tuple[str, int]
    shape: bool
    keys: frozenset[tuple[int, int]]


class Land(NamedTuple):
    """Copy ``ranges`` (``(addr, length)`` of registered memory whose bytes landed) into the device memory
    they stage (a staged transport's ``land``: ``transport.staging``). Only an engine given
    ``Services.staged`` emits it, for a room every source reported landed: the room counts as landed
    once ``scattered`` says the copy finished, and a revoke of its grant waits for the copy."""

    token: Any
    ranges: list[tuple[int, int]]


Action = Send | Connect | Disconnect | Post | Grant | Revoke | LookUp | Land
