"""States, triggers and the one transition table: the single source of truth.

Rule 1: everything that decides a request's state lives in this file, in the
table where possible and in the few rules beside it where not. The compiled
table (``_table.pyx``) copies ``TRANSITIONS`` into a C array at import and the
pure twin (``_table_py.py``) reads it directly; a test checks the copy.

Rule 2: the table does not know whether it runs on P, D or E. The roles differ
only in which triggers their I/O threads fire.

Theory of operation
-------------------
Per request and per rank a state is one small integer ordered by progress
(``State``). A rank's I/O threads fire triggers; ``TRANSITIONS[state][trigger]``
is the next local state. Read the grid row by row: every live state moves only
forward (to ``max(state, target)``), ``FAIL``/``TIMEOUT``/``ABORT`` lead to
FAILED from anywhere, and FAILED is sticky (its row is all FAILED). A trigger
that names a state behind the current one is not an error: triggers race across
threads and ranks, and a late one simply changes nothing.

Timeouts are not clocks in the table: a live state may carry a timer
(``TIMERS``). Entering a state whose timer differs from the previous state's
arms it (``now + timeout``); the owner folds expiries into FAILED with
``Trigger.TIMEOUT`` *before* each reduction, so ranks that cross a deadline in
different rounds still agree (any 0 wins the MIN).

Fence before free. A failed request's memory may be reused only once no write
into or out of it can still land, on any rank. Triggers in ``ARMS_FENCE``
(destination pages announced, writes posted) arm a slot's fence; a rank whose
failed slot has an armed fence must confirm it (``Fence.DONE``: the source
acknowledged that its writes drained, or the connection is torn down) before
its failure counts as settled. A slot that never armed its fence has nothing
to wait for.

The reduction code. The replica reduces one byte per slot (``code``), not the
bare state, so that the fence rides in the same collective:

    0 FAILING  failed here or elsewhere; not yet settled on some rank
    1 FAILED   failed and settled on every rank: the Failed event
    s + 1      the live state s (BOOTSTRAPPING 2 ... SUCCESS 6)
    255 FREE   an unused slot, neutral under MIN

Every round the replica reduces the codes with MIN, so the agreed state is the
least advanced state any rank holds; any FAILING wins, and FAILED needs every
rank settled. An agreed FAILING moves every rank's local state to FAILED (it
stops work and opens its own fence if armed) without an event. Events follow
the agreed code and are emitted in progress order (``events_for``):
BOOTSTRAPPED first, even when the agreed value jumped past it, then one
terminal event (SUCCEEDED at SUCCESS, FAILED at FAILED). A terminal event frees
the request's slot on every rank in the same round, so each event is emitted
at most once.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

__all__ = [
    "State",
    "Trigger",
    "Timer",
    "EventKind",
    "TRANSITIONS",
    "TIMERS",
    "ARMS_FENCE",
    "Fence",
    "FREE",
    "CODE_FAILING",
    "CODE_FAILED",
    "CODE_SUCCESS",
    "code_of",
    "state_of_code",
    "events_for",
]


class State(IntEnum):
    """A request's progress on one rank; the value is the progress order."""

    FAILED = 0
    BOOTSTRAPPING = 1
    BOOTSTRAPPED = 2
    WAITING_FOR_INPUT = 3
    TRANSFERRING = 4
    SUCCESS = 5


STATES: tuple[State, ...] = tuple(State)  # by value: STATES[v] is State(v) without the enum's call (~1 us)
assert all(s == v for v, s in enumerate(STATES))


class Trigger(IntEnum):
    """What an I/O thread observed about a request on this rank."""

    PEERS_CONNECTED = 0  # every peer this rank needs for the request is connected
    PAGES_ANNOUNCED = 1  # D: destination pages announced to the source
    WRITES_POSTED = 2  # the source posted this rank's writes
    WRITES_LANDED = 3  # this rank's part landed (or it had nothing to move)
    FAIL = 4  # a local error (transport, protocol, peer lost)
    TIMEOUT = 5  # a deadline of TIMERS passed (fired by the fold, not by I/O)
    ABORT = 6  # the peer or the scheduler aborted the request


class Timer(IntEnum):
    NONE = 0
    BOOTSTRAP = 1  # registered, peers not yet connected
    WAITING = 2  # destination announced or writes in flight, not yet landed


class Fence(IntEnum):
    """Whether a slot's failure must wait for its writes to drain."""

    NONE = 0  # nothing was announced or posted: nothing can land
    ARMED = 1  # something may still land; the owner must confirm the fence
    DONE = 2  # confirmed: nothing can land any more


class EventKind(IntEnum):
    """What the agreement emits; the peers turn kinds into event objects."""

    BOOTSTRAPPED = 0
    SUCCEEDED = 1
    FAILED = 2


S = State
_F, _BI, _BD, _W, _T, _S = S.FAILED, S.BOOTSTRAPPING, S.BOOTSTRAPPED, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS

# fmt: off
# The grid, one row per state; columns follow ``Trigger`` order:
#                      PEERS_CONNECTED  PAGES_ANNOUNCED  WRITES_POSTED  WRITES_LANDED  FAIL  TIMEOUT  ABORT
_GRID = (
    (S.FAILED,            (_F,  _F,  _F,  _F,  _F, _F, _F)),
    (S.BOOTSTRAPPING,     (_BD, _W,  _T,  _S,  _F, _F, _F)),
    (S.BOOTSTRAPPED,      (_BD, _W,  _T,  _S,  _F, _F, _F)),
    (S.WAITING_FOR_INPUT, (_W,  _W,  _T,  _S,  _F, _F, _F)),
    (S.TRANSFERRING,      (_T,  _T,  _T,  _S,  _F, _F, _F)),
    (S.SUCCESS,           (_S,  _S,  _S,  _S,  _F, _F, _F)),
)
# fmt: on
assert [label for label, _ in _GRID] == list(State), "rows must follow State order"

#: TRANSITIONS[state][trigger] -> next state.
TRANSITIONS: Final[tuple[tuple[State, ...], ...]] = tuple(targets for _, targets in _GRID)

#: The timer a state carries; entering a state with a different timer re-arms it.
TIMERS: Final[tuple[Timer, ...]] = (
    Timer.NONE,  # FAILED
    Timer.BOOTSTRAP,  # BOOTSTRAPPING
    Timer.NONE,  # BOOTSTRAPPED: waiting for compute or capacity is the scheduler's business
    Timer.WAITING,  # WAITING_FOR_INPUT
    Timer.WAITING,  # TRANSFERRING: the same budget as waiting, not a fresh one
    Timer.NONE,  # SUCCESS
)

#: Triggers after which something may land in or leave the request's memory.
#: They arm the fence when fired on a live state; on FAILED they change nothing
#: (the caller sees FAILED returned and must not announce or post).
ARMS_FENCE: Final[frozenset[Trigger]] = frozenset({Trigger.PAGES_ANNOUNCED, Trigger.WRITES_POSTED})

#: A free slot's code in the reduced vector: neutral under MIN.
FREE: Final[int] = 255
CODE_FAILING: Final[int] = 0
CODE_FAILED: Final[int] = 1
CODE_SUCCESS: Final[int] = S.SUCCESS + 1


def code_of(state: int, fence: int, agreed: int) -> int:
    """The byte a rank contributes to the MIN for one live slot.

    A failed slot reports FAILED only once this rank saw the replica agree on
    FAILING (so every rank has stopped) and its own fence is not open; until
    then it reports FAILING, which holds every rank's Failed event back.
    """
    if state != S.FAILED:
        return state + 1
    return CODE_FAILED if fence != Fence.ARMED and agreed == CODE_FAILING else CODE_FAILING


def state_of_code(code: int) -> State:
    return S.FAILED if code <= CODE_FAILED else State(code - 1)


def events_for(previous: int, agreed: int) -> tuple[EventKind, ...]:
    """Events for the agreed code moving from ``previous`` to ``agreed``, in order.

    ``previous`` is the highest agreed code already acted on (BOOTSTRAPPING's at
    registration, or FAILING). Each state crossed yields its event once:
    BOOTSTRAPPED when the code first reaches or passes BOOTSTRAPPED's, then the
    terminal event. FAILING yields none: the failure is not settled yet.
    """
    if agreed == previous or agreed == CODE_FAILING:
        return ()
    if agreed == CODE_FAILED:
        return (EventKind.FAILED,)
    kinds: tuple[EventKind, ...] = ()
    if previous < S.BOOTSTRAPPED + 1 <= agreed:
        kinds = (EventKind.BOOTSTRAPPED,)
    if agreed == CODE_SUCCESS:
        kinds += (EventKind.SUCCEEDED,)
    return kinds
