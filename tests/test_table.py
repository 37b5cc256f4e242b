"""StateTable on one rank, against both twins: registry, updates, deadlines, bad input."""

from __future__ import annotations

import threading
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, strategies as st

from pdcore.core._spec import CODE_FAILING, FREE, Fence, State, Trigger
from pdcore.core.errors import CapacityError, CollectiveError, LocalProtocolError
from pdcore.core.events import FAILED_ELSEWHERE, Bootstrapped, Failed, Succeeded


def solo_round(table, now: float = 0.0) -> list:
    """A round of a one-rank replica: the reduced buffer is the encoded one."""
    table.encode(now)
    return table.decode()


def snapshot(table) -> tuple:
    return (table.rids(), [(r, table.state(r), table.agreed(r), table.slot(r)) for r in table.rids()], len(table))


def test_register_hands_out_slots_and_keeps_order(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(4)
    assert [t.register(r, 0.0) for r in "abc"] == [0, 1, 2]
    assert t.rids() == ["a", "b", "c"] and len(t) == 3 and "b" in t and t.has_in_flight()
    t.remove("b")
    assert "b" not in t and t.rids() == ["a", "c"]
    assert t.register("d", 0.0) == 1  # the freed slot is reused, deterministically
    assert t.rids() == ["a", "c", "d"]
    assert t.state("d") == State.BOOTSTRAPPING == t.agreed("d")


def test_free_slots_are_neutral_in_the_buffer(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(4)
    t.register("a", 0.0)
    buf = t.encode(0.0)
    assert buf is t.buffer and buf.dtype == np.uint8
    assert list(buf[:4]) == [State.BOOTSTRAPPING + 1, FREE, FREE, FREE]  # the reduction code of _spec
    fp = buf[4:]
    assert len(fp) == 2 * table_impl.FINGERPRINT_BYTES
    assert all(int(a) + int(b) == 255 for a, b in zip(fp[: len(fp) // 2], fp[len(fp) // 2 :]))


def test_buffer_size_never_depends_on_what_is_live(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(16)
    size = t.encode(0.0).shape
    for r in "abcdef":
        t.register(r, 0.0)
    assert t.encode(0.0).shape == size


def test_updates_only_move_forward(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    assert t.update("a", Trigger.WRITES_POSTED, 0.0) == State.TRANSFERRING
    assert t.update("a", Trigger.PEERS_CONNECTED, 0.0) == State.TRANSFERRING  # late trigger: no regression
    assert t.update("a", Trigger.WRITES_LANDED, 0.0) == State.SUCCESS


def test_failed_is_sticky_and_keeps_the_first_reason(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    assert t.update("a", Trigger.FAIL, 0.0, "qp error") == State.FAILED
    assert t.update("a", Trigger.WRITES_LANDED, 0.0) == State.FAILED
    assert t.update("a", Trigger.ABORT, 0.0, "later reason") == State.FAILED
    assert solo_round(t) == []  # the replica learns of the failure; nothing was armed
    events = solo_round(t)
    assert events == [Failed("a")] and events[0].reason == "qp error"
    assert "a" not in t and not t.has_in_flight()


def test_a_reason_that_is_not_a_str_is_kept_as_its_str(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    assert t.update("a", Trigger.FAIL, 0.0, OSError(104, "reset")) == State.FAILED  # type: ignore[arg-type]
    solo_round(t)
    events = solo_round(t)
    assert events == [Failed("a")] and events[0].reason == "[Errno 104] reset"


def test_a_failure_after_local_success_still_wins(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    t.update("a", Trigger.WRITES_LANDED, 0.0)
    t.update("a", Trigger.ABORT, 0.0, "aborted by peer")
    assert solo_round(t) == []
    assert solo_round(t) == [Failed("a")]


def test_jump_to_success_emits_bootstrapped_first(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    t.update("a", Trigger.WRITES_LANDED, 0.0)
    assert solo_round(t) == [Bootstrapped("a"), Succeeded("a")]
    assert solo_round(t) == [] and "a" not in t


def test_events_come_once_in_registration_order(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(4)
    for r in "abc":
        t.register(r, 0.0)
    t.remove("a")
    t.register("d", 0.0)  # takes slot 0, but registered after b and c
    for r in "dcb":
        t.update(r, Trigger.PEERS_CONNECTED, 0.0)
    assert solo_round(t) == [Bootstrapped("b"), Bootstrapped("c"), Bootstrapped("d")]
    assert solo_round(t) == []
    t.update("c", Trigger.PAGES_ANNOUNCED, 0.0)
    assert solo_round(t) == []  # agreed moved, but no event is owed for WAITING_FOR_INPUT
    assert t.agreed("c") == State.WAITING_FOR_INPUT


def test_bootstrap_deadline_is_folded_before_the_round(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(4, bootstrap_timeout=10.0, waiting_timeout=20.0)
    t.register("a", 0.0)
    t.register("b", 5.0)
    t.update("b", Trigger.PEERS_CONNECTED, 6.0)  # BOOTSTRAPPED carries no timer
    assert solo_round(t, 9.99) == [Bootstrapped("b")]
    assert solo_round(t, 10.0) == [] and t.state("a") == State.FAILED
    events = solo_round(t, 10.0)
    assert events == [Failed("a")] and events[0].reason == "bootstrap timeout after 10 s"
    assert solo_round(t, 1e9) == [] and t.rids() == ["b"]


def test_waiting_deadline_spans_waiting_and_transferring(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(4, bootstrap_timeout=10.0, waiting_timeout=20.0)
    t.register("a", 0.0)
    t.update("a", Trigger.PAGES_ANNOUNCED, 5.0)  # arms WAITING at 25
    t.update("a", Trigger.WRITES_POSTED, 15.0)  # TRANSFERRING shares the budget: still 25
    assert solo_round(t, 24.9) == [Bootstrapped("a")]
    assert solo_round(t, 25.0) == [] and t.take_fencing() == ["a"]  # pages were announced: fence first
    assert solo_round(t, 99.0) == []
    t.fenced("a")
    events = solo_round(t, 99.0)
    assert events == [Failed("a")] and events[0].reason == "waiting timeout after 20 s"


def test_fold_alone_fails_the_local_state(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2, bootstrap_timeout=1.0)
    t.register("a", 0.0)
    t.fold(0.5)
    assert t.state("a") == State.BOOTSTRAPPING
    t.fold(1.0)
    assert t.state("a") == State.FAILED


def test_failed_elsewhere_has_a_generic_reason(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    buf = t.encode(0.0)
    buf[0] = CODE_FAILING  # as if another rank's MIN brought a failure
    assert t.decode() == [] and t.state("a") == State.FAILED  # this rank stops too
    events = solo_round(t)
    assert events == [Failed("a")] and events[0].reason == FAILED_ELSEWHERE


# -- fence before free --------------------------------------------------------------------


def test_announced_pages_hold_the_failure_until_fenced(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(4)
    t.register("a", 0.0)
    t.register("b", 0.0)
    t.update("a", Trigger.PAGES_ANNOUNCED, 0.0)
    assert t.fence("a") == Fence.ARMED and t.fence("b") == Fence.NONE
    t.update("a", Trigger.FAIL, 0.0, "peer sent garbage")
    t.update("b", Trigger.FAIL, 0.0)
    assert t.take_fencing() == ["a"] and t.take_fencing() == []
    assert solo_round(t) == []  # the first round spreads both failures
    assert solo_round(t) == [Failed("b")]  # b had nothing to fence
    assert solo_round(t) == [] == solo_round(t)  # a waits for its fence, however many rounds pass
    assert "a" in t and "b" not in t
    t.fenced("a")
    assert solo_round(t) == [Failed("a")]
    assert not t.has_in_flight()


def test_an_agreed_failure_opens_this_ranks_fence(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    t.update("a", Trigger.WRITES_POSTED, 0.0)
    buf = t.encode(0.0)
    buf[0] = CODE_FAILING  # another rank failed
    assert t.decode() == [] and t.take_fencing() == ["a"]
    assert t.encode(0.0)[0] == CODE_FAILING  # held until this rank's writes drained
    t.fenced("a")
    assert t.encode(0.0)[0] == 1 and t.decode() == [Failed("a")]


def test_arming_triggers_on_a_failed_slot_change_nothing(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    t.update("a", Trigger.FAIL, 0.0)
    assert t.update("a", Trigger.WRITES_POSTED, 0.0) == State.FAILED  # the caller must not post
    assert t.fence("a") == Fence.NONE and t.take_fencing() == []


def test_fencing_a_live_request_is_refused(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    with pytest.raises(LocalProtocolError, match="'a' is BOOTSTRAPPING, not FAILED"):
        t.fenced("a")
    assert t.fence("a") == Fence.NONE


# -- bad input: a clear error naming the culprit, the table unchanged ------------------


def test_duplicate_rid(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    before = snapshot(t)
    with pytest.raises(LocalProtocolError, match="'a' is already registered"):
        t.register("a", 1.0)
    assert snapshot(t) == before


@pytest.mark.parametrize("rid", ["", None, 7, b"a"])
def test_rid_must_be_a_non_empty_str(table_impl: ModuleType, rid: object) -> None:
    t = table_impl.StateTable(2)
    with pytest.raises(LocalProtocolError, match="rid must be a non-empty str"):
        t.register(rid, 0.0)
    assert len(t) == 0


def test_unknown_rid(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    before = snapshot(t)
    for call in (
        lambda: t.update("zz", Trigger.FAIL, 0.0),
        lambda: t.remove("zz"),
        lambda: t.state("zz"),
    ):
        with pytest.raises(LocalProtocolError, match="'zz' is not registered"):
            call()
    assert snapshot(t) == before


@pytest.mark.parametrize("trigger", [-1, 7, 255, 1.0, "0", None])
def test_trigger_out_of_range(table_impl: ModuleType, trigger: object) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    before = snapshot(t)
    with pytest.raises(LocalProtocolError, match=f"trigger {trigger!r} for rid 'a' is not a Trigger"):
        t.update("a", trigger, 0.0)
    assert snapshot(t) == before


def test_capacity_exhausted(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(2)
    t.register("a", 0.0)
    t.register("b", 0.0)
    before = snapshot(t)
    with pytest.raises(CapacityError, match="cannot register 'c': all 2 slots are in use"):
        t.register("c", 0.0)
    assert snapshot(t) == before


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"capacity": -1}, {"capacity": 1 << 21}])
def test_bad_capacity(table_impl: ModuleType, kwargs: dict) -> None:
    with pytest.raises(ValueError, match="capacity must be in"):
        table_impl.StateTable(**kwargs)


@pytest.mark.parametrize("name", ["bootstrap_timeout", "waiting_timeout"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_bad_timeouts(table_impl: ModuleType, name: str, value: float) -> None:
    with pytest.raises(ValueError, match=name):
        table_impl.StateTable(4, **{name: value})


def test_mismatched_fingerprint_raises_and_changes_nothing(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(4)
    t.register("a", 0.0)
    t.update("a", Trigger.WRITES_LANDED, 0.0)
    buf = t.encode(0.0)
    cap = t.capacity
    buf[cap] ^= 0x01  # another rank's fingerprint differs in one byte
    before = snapshot(t)
    with pytest.raises(CollectiveError, match="not the same \\(slot, rid\\) set"):
        t.decode()
    assert snapshot(t) == before


def test_mismatched_count_is_named(table_impl: ModuleType) -> None:
    t = table_impl.StateTable(4)
    t.register("a", 0.0)
    buf = t.encode(0.0)
    buf[t.capacity + 8] = 0  # some rank holds 0 live requests: min count byte 0
    with pytest.raises(CollectiveError, match="different numbers of live requests \\(this rank 1"):
        t.decode()


# -- threads ---------------------------------------------------------------------------------


def test_updates_from_many_threads_are_not_lost(table_impl: ModuleType) -> None:
    n = 512
    t = table_impl.StateTable(n)
    rids = [f"r{i}" for i in range(n)]
    for r in rids:
        t.register(r, 0.0)
    steps = (Trigger.PEERS_CONNECTED, Trigger.PAGES_ANNOUNCED, Trigger.WRITES_POSTED, Trigger.WRITES_LANDED)
    start = threading.Barrier(4, timeout=30)

    def worker(k: int) -> None:
        start.wait()
        for i, r in enumerate(rids):
            t.update(r, steps[(i + k) % 4], 1.0)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
        assert not th.is_alive()
    # every rid saw WRITES_LANDED from some thread: max-merge keeps it whatever the order
    assert all(t.state(r) == State.SUCCESS for r in rids)
    events = solo_round(t, 1.0)
    assert events == [e for r in rids for e in (Bootstrapped(r), Succeeded(r))]


# -- the fingerprint: which requests, not only how many -----------------------------------------


def replica_round(tables: list, now: float = 0.0) -> list:
    """A round of a simulated replica: encode every rank, MIN-reduce, decode every rank.

    Each rank's outcome is its events, or ``("raised", type name, message)``."""
    buffers = [t.encode(now) for t in tables]
    reduced = np.minimum.reduce([b.copy() for b in buffers])
    for b in buffers:
        b[:] = reduced
    out = []
    for t in tables:
        try:
            out.append(t.decode())
        except CollectiveError as exc:
            out.append(("raised", type(exc).__name__, str(exc)))
    return out


@pytest.mark.parametrize(
    "rid, slot, value",
    [
        ("a", 0, 0x02C0BDBF481420F8),
        ("a", 1, 0x832BE066BD43A3B8),  # the slot is hashed in too
        ("req-0", 0, 0xAA072E09CA773097),
        ("req-0", 1, 0xE6BC657B2134621B),
        ("r", 7, 0xCCADA21307BDE96E),
        ("réq/é", 3, 0x3E8689102DB54480),  # UTF-8 bytes, not code points
    ],
)
def test_rid_hash_is_pinned(table_impl: ModuleType, rid: str, slot: int, value: int) -> None:
    """Ranks in different processes (and builds) must compute the same bits: a change here is a wire change."""
    assert table_impl.rid_hash(rid, slot) == value


@pytest.mark.compiled
@given(rid=st.text(max_size=80), slot=st.integers(0, (1 << 64) - 1))
def test_the_compiled_rid_hash_is_its_twins(rid: str, slot: int) -> None:
    """The compiled tables hash with ``pdcore.core._hash``; a rank of either build must get the same bits."""
    from pdcore.core import _hash, twin_common

    try:
        want = twin_common.rid_hash(rid, slot)
    except UnicodeEncodeError:  # a lone surrogate: neither can encode it
        with pytest.raises(UnicodeEncodeError):
            _hash.rid_hash(rid, slot)
        return
    assert _hash.rid_hash(rid, slot) == want


@pytest.mark.parametrize(
    "order, fingerprint",
    [
        ("abc", "3c057d2d779d518203000000"),
        ("cba", "af65533fce3ef0be03000000"),  # the same rids in other slots
        ("xyz", "2d2f9763e207b61a03000000"),  # as many requests, other rids
    ],
)
def test_fingerprint_bytes_are_pinned(table_impl: ModuleType, order: str, fingerprint: str) -> None:
    t = table_impl.StateTable(4)
    for rid in order:
        t.register(rid, 0.0)
    buf = t.encode(0.0)
    fp = bytes(buf[4 : 4 + table_impl.FINGERPRINT_BYTES])
    assert fp.hex() == fingerprint
    assert bytes(buf[4 + table_impl.FINGERPRINT_BYTES :]) == bytes(255 - b for b in fp)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "sets",
    [
        pytest.param(["abc", "abd"], id="one-rid-differs"),
        pytest.param(["abc", "xyz"], id="all-rids-differ"),
        pytest.param(["abc", "cba"], id="same-rids-other-order"),
        pytest.param(["abc", "bac"], id="two-swapped"),
    ],
)
def test_same_count_different_requests_raise_on_every_rank(table_impl: ModuleType, sets: list, world: int) -> None:
    """Ranks holding as many requests as each other, but not the same (slot, rid) pairs, must
    refuse the round on every rank: decoding would act on another request's state."""
    tables = [table_impl.StateTable(8) for _ in range(world)]
    for k, t in enumerate(tables):
        for rid in sets[0] if k < world - 1 else sets[1]:  # the last rank holds the other set
            t.register(rid, 0.0)
            t.update(rid, Trigger.WRITES_LANDED, 0.0)  # every rank would emit Succeeded this round
    before = [snapshot(t) for t in tables]
    outcomes = replica_round(tables)
    for k, got in enumerate(outcomes):
        assert got[:2] == ("raised", "CollectiveError"), f"rank {k} decoded {got!r}"
        assert "not the same (slot, rid) set" in got[2]
    assert [snapshot(t) for t in tables] == before  # nothing acted on


def test_same_requests_in_the_same_order_agree(table_impl: ModuleType) -> None:
    """The control case of the test above: identical registrations decode normally."""
    tables = [table_impl.StateTable(8) for _ in range(3)]
    for t in tables:
        for rid in "abc":
            t.register(rid, 0.0)
            t.update(rid, Trigger.WRITES_LANDED, 0.0)
    expected = [e for r in "abc" for e in (Bootstrapped(r), Succeeded(r))]
    assert replica_round(tables) == [expected] * 3


# -- the compiled decode's eight-slot skip ------------------------------------------------------


@pytest.mark.parametrize("capacity", [8, 9, 16, 17, 24])
def test_a_change_in_any_single_slot_is_seen(table_impl: ModuleType, capacity: int) -> None:
    """Every slot full and agreed; then exactly one slot changes. The compiled decode skips
    unchanged runs eight slots at a time: a change in any position of a block (first, middle,
    last) or of the tail must still produce its event."""
    for changed in range(capacity):
        t = table_impl.StateTable(capacity)
        rids = [f"r{i}" for i in range(capacity)]
        for rid in rids:
            t.register(rid, 0.0)
        assert solo_round(t) == []  # every slot agreed at BOOTSTRAPPING
        rid = rids[changed]
        assert t.slot(rid) == changed
        t.update(rid, Trigger.PEERS_CONNECTED, 0.0)
        assert solo_round(t) == [Bootstrapped(rid)], f"slot {changed} of {capacity}"
        assert t.agreed(rid) == State.BOOTSTRAPPED
        t.update(rid, Trigger.FAIL, 0.0, "lost")
        assert solo_round(t) == [] and solo_round(t) == [Failed(rid)], f"slot {changed} of {capacity}"
        assert rid not in t and len(t) == capacity - 1


@pytest.mark.parametrize("capacity", [9, 17, 64])
def test_changes_in_spread_slots_of_a_full_table(table_impl: ModuleType, capacity: int) -> None:
    """The first slot of every block, and the last slot, change together: each one's event comes,
    in registration order."""
    t = table_impl.StateTable(capacity)
    rids = [f"r{i}" for i in range(capacity)]
    for rid in rids:
        t.register(rid, 0.0)
    solo_round(t)
    picked = sorted({*range(0, capacity, 8), capacity - 1})
    for slot in reversed(picked):
        t.update(rids[slot], Trigger.WRITES_LANDED, 0.0)
    assert solo_round(t) == [e for slot in picked for e in (Bootstrapped(rids[slot]), Succeeded(rids[slot]))]
    assert t.rids() == [r for i, r in enumerate(rids) if i not in picked]
