"""The events the state table emits, in one source for both twins.

Cython compiles this file, as it is, into ``pdcore.core._events`` (setup.py):
there each event is an extension type, frozen, built by the compiled table in
well under 0.1 µs, where a frozen slotted dataclass costs several times that;
an agreement round that ends 80 requests builds 80 of them. Run as Python (the
pure twins, ``PDCORE_PURE_PYTHON=1``) the same decorators give standard frozen
dataclasses (``import cython`` then needs Cython installed, as the ``test``
extra does). Either way: equal fields compare equal, ``hash`` follows ``==``,
assignment raises ``AttributeError``, and instances pickle. ``events.py``
chooses the module; import the events from there.
"""

import cython

#: The reason a rank gives for a failure it did not see itself.
FAILED_ELSEWHERE = "failed on another rank of the replica"


@cython.cclass
class Event:
    """Marker base of the events; dispatch on ``type(event)``."""

    __slots__ = ()


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class Bootstrapped(Event):
    """The request's peers are connected on every rank."""

    rid: str


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class Failed(Event):
    """The request's transfer failed on some rank; every rank emits it in the same round.

    ``reason`` is this rank's own explanation (a rank that did not fail locally
    only knows that another rank did), so it is left out of equality.
    """

    rid: str
    reason: str = cython.dataclasses.field(default=FAILED_ELSEWHERE, compare=False)


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class Succeeded(Event):
    """P: the request's KV reached the decode node from every rank."""

    rid: str
