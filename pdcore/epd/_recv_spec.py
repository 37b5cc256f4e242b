"""The EPD receiver's states, triggers and grids: the single source of truth.

Rule 1: everything that decides a staged request's, an item's or a receive
slot's state lives in this file, in the grids where possible and in the few
rules beside them where not. The compiled table (``_recv.pyx``) copies the
grids into C arrays at import; the pure twin (``_recv_py.py``) reads them
directly; a test checks the copy.

Rule 2: the table does not know which rank it runs on, nor how rows travel.
The only rank-dependent fact it holds is this rank's shard of each image,
and it checks every bound on values that are the same on every rank, so all
ranks accept or refuse the same ``stage`` call.

Theory of operation
-------------------
A prefill rank *stages* a request with its multimodal items (one room each).
Three small machines, one per level:

**Request** (``RequestState``; its value is the code the replica reduces):
``RECEIVING`` (1) until every item landed, then ``LANDED`` (2) — a
state-triggered transition (``ALL_LANDED``, fired by the table itself, h11
style). ``FAIL`` (the peer: the encode side failed the room, a peer died, a
check failed) and ``TIMEOUT`` (fired by ``fold``) lead to ``FAILED`` (0) from
anywhere, and ``FAILED`` is sticky. Only ``RECEIVING`` carries a timer, armed
at ``stage``: an item that waits for a slot waits on the same clock.

**Item** (``ItemState``): ``PENDING`` (no slot free yet) → ``LEASE`` →
``LEASED`` (a slot is its own; an empty shard leases none and gets here at
once) → ``ASK`` (the peer told the encode rank where to write: from now on
a write may land) → ``RECEIVING`` → ``LAND`` → ``LANDED``. A repeated
``LAND`` changes nothing; every other missing cell is a caller's bug and
raises ``LocalProtocolError`` naming (state, trigger). Items are leased in
staging order (strict FIFO across requests, so an early request is never
starved by later small ones); a failed request's items are neither leased
nor asked any more.

**Slot** (``SlotState``) of the pool of fixed-size receive slots cut from one
buffer registered once: ``FREE`` → ``LEASE`` → ``LEASED``. When the replica
agrees a request landed, ``HAND_OUT`` makes its slots ``HELD`` until the data
plane copied the rows out (``RELEASE`` → ``FREE``). When it agrees a request
failed, each slot is dropped by what its item reached (``DROP_TRIGGER``): an
item never asked cannot receive a byte (``DROP`` → ``FREE``); an asked one
may still receive a late write, so its slot is quarantined (``DROP_ASKED`` →
``FENCING``) until the owner closed its fence — the sender's grant for it
revoked in the data plane — and says so (``FENCED`` → ``FREE``). A
``FENCING`` slot is neither free nor leased. A missing cell is a bug and
raises ``LocalProtocolError``.

The agreement. Each round ``encode(now)`` folds deadlines, then writes one
code byte per staged request in staging order, ``PAD`` (255, neutral under
MIN) up to the configured request capacity, and the PD table's fingerprint
pair (``h`` then ``255-h``) of the staged (sequence, rid) set, salted with how
the tables split each image (``ranks``, ``sharded``: a torn flag fails the
first round, not the rows): the buffer has the same length on every rank
whatever each rank holds. The replica reduces
it with MIN; ``settle(agreed)`` checks the pair (``min(h)+min(255-h) == 255``
for every byte only if every rank holds the same set: otherwise
``CollectiveError`` on every rank, nothing changed), then acts in staging
order: 2 → the request is handed out (``LandedRequest``) and forgotten, 1 →
nothing, 0 → dropped (its slots as above). Codes only move forward locally
(1 → 2) or to 0, so the agreed code of a request is monotone too, up to its
settle.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

__all__ = [
    "RequestState",
    "RequestTrigger",
    "ItemState",
    "ItemTrigger",
    "SlotState",
    "SlotTrigger",
    "REQUEST_TRANSITIONS",
    "REQUEST_TIMED",
    "ITEM_TRANSITIONS",
    "SLOT_TRANSITIONS",
    "DROP_TRIGGER",
    "ASKED",
    "PAD",
    "ILLEGAL",
    "CODE_FAILED",
    "CODE_RECEIVING",
    "CODE_LANDED",
]


class RequestState(IntEnum):
    """A staged request on one rank; the value is its code in the reduced vector."""

    FAILED = 0  # failed or timed out here: terminal, sticky
    RECEIVING = 1  # some item has not landed
    LANDED = 2  # every item landed on this rank


class RequestTrigger(IntEnum):
    ALL_LANDED = 0  # state-triggered: the request's last item landed (fired by the table)
    FAIL = 1  # the peer failed it (room failed on the encode side, peer lost, bad check)
    TIMEOUT = 2  # its deadline passed (fired by ``fold``, never by I/O)


class ItemState(IntEnum):
    """One item of a staged request on one rank, ordered by progress."""

    PENDING = 0  # waiting for a free slot
    LEASED = 1  # has its slot (or needs none: an empty shard); the encode side not yet told
    RECEIVING = 2  # asked: the encode side knows where to write; a write may land
    LANDED = 3  # its rows landed (or, for an empty shard, the encode side confirmed)


# by value: REQUEST_STATES[v] is RequestState(v), ITEM_STATES[v] ItemState(v), without the enum's call (~1 us)
REQUEST_STATES: tuple[RequestState, ...] = tuple(RequestState)
ITEM_STATES: tuple[ItemState, ...] = tuple(ItemState)
assert all(s == v for v, s in enumerate(REQUEST_STATES)) and all(s == v for v, s in enumerate(ITEM_STATES))


class ItemTrigger(IntEnum):
    LEASE = 0  # the pool gave it a slot (or it needs none)
    ASK = 1  # the peer sent its receive request (``take_ready``)
    LAND = 2  # the rows landed


class SlotState(IntEnum):
    """One receive slot of the pool."""

    FREE = 0
    LEASED = 1  # an item of a staged request holds it
    HELD = 2  # its request settled landed: rows wait to be copied out (``release``)
    FENCING = 3  # its request settled failed after the item was asked: quarantined until ``fenced``


class SlotTrigger(IntEnum):
    LEASE = 0
    HAND_OUT = 1  # settle: the request landed on every rank
    DROP = 2  # settle: the request failed; its item was never asked, nothing can land
    DROP_ASKED = 3  # settle: the request failed after its item was asked; a late write may land
    RELEASE = 4  # the data plane copied the rows out
    FENCED = 5  # the owner closed the fence: nothing from the encode side can land any more


#: Where a trigger is not allowed.
ILLEGAL: Final = None

R, I, S = RequestState, ItemState, SlotState
_RF, _RR, _RL = R.FAILED, R.RECEIVING, R.LANDED
_IP, _IL, _IR, _ID = I.PENDING, I.LEASED, I.RECEIVING, I.LANDED
_SF, _SL, _SH, _SX = S.FREE, S.LEASED, S.HELD, S.FENCING
__ = ILLEGAL

# fmt: off
# One row per state; columns follow the trigger enum's order.
#                     ALL_LANDED  FAIL  TIMEOUT
_REQUEST_GRID = (
    (R.FAILED,    (_RF,  _RF, _RF)),
    (R.RECEIVING, (_RL,  _RF, _RF)),
    (R.LANDED,    (_RL,  _RF, _RF)),
)
#                     LEASE  ASK   LAND
_ITEM_GRID = (
    (I.PENDING,   (_IL,  __,   __ )),
    (I.LEASED,    (__,   _IR,  __ )),
    (I.RECEIVING, (__,   __,   _ID)),
    (I.LANDED,    (__,   __,   _ID)),
)
#                     LEASE  HAND_OUT  DROP  DROP_ASKED  RELEASE  FENCED
_SLOT_GRID = (
    (S.FREE,      (_SL,  __,       __,   __,         __,      __ )),
    (S.LEASED,    (__,   _SH,      _SF,  _SX,        __,      __ )),
    (S.HELD,      (__,   __,       __,   __,         _SF,     __ )),
    (S.FENCING,   (__,   __,       __,   __,         __,      _SF)),
)
# fmt: on
assert [label for label, _ in _REQUEST_GRID] == list(RequestState)
assert [label for label, _ in _ITEM_GRID] == list(ItemState)
assert [label for label, _ in _SLOT_GRID] == list(SlotState)

#: REQUEST_TRANSITIONS[state][trigger] -> next state (total: every cell is legal).
REQUEST_TRANSITIONS: Final[tuple[tuple[RequestState, ...], ...]] = tuple(t for _, t in _REQUEST_GRID)
#: ITEM_TRANSITIONS[state][trigger] -> next state, or ILLEGAL.
ITEM_TRANSITIONS: Final[tuple[tuple[ItemState | None, ...], ...]] = tuple(t for _, t in _ITEM_GRID)
#: SLOT_TRANSITIONS[state][trigger] -> next state, or ILLEGAL.
SLOT_TRANSITIONS: Final[tuple[tuple[SlotState | None, ...], ...]] = tuple(t for _, t in _SLOT_GRID)

#: The states whose deadline ``fold`` turns into TIMEOUT.
REQUEST_TIMED: Final[frozenset[RequestState]] = frozenset({R.RECEIVING})

#: Item states from which the encode side may write into the item's slot (the fence is armed).
ASKED: Final[frozenset[ItemState]] = frozenset({I.RECEIVING, I.LANDED})

#: How a failed request's leased slot is dropped, by what its item reached (PENDING holds no slot).
DROP_TRIGGER: Final[dict[ItemState, SlotTrigger]] = {
    I.LEASED: SlotTrigger.DROP,
    I.RECEIVING: SlotTrigger.DROP_ASKED,
    I.LANDED: SlotTrigger.DROP_ASKED,
}
assert all((item in ASKED) == (trig == SlotTrigger.DROP_ASKED) for item, trig in DROP_TRIGGER.items())

CODE_FAILED: Final[int] = R.FAILED
CODE_RECEIVING: Final[int] = R.RECEIVING
CODE_LANDED: Final[int] = R.LANDED
#: A position past the staged requests: neutral under MIN.
PAD: Final[int] = 255


def shard(rows: int, rank: int, ranks: int, sharded: bool) -> tuple[int, int]:
    """This rank's (row_start, row_count) of an image of ``rows``: rank r of n gets a contiguous share."""
    if not sharded:
        return 0, rows
    base, rem = divmod(rows, ranks)
    return rank * base + min(rank, rem), base + (1 if rank < rem else 0)
