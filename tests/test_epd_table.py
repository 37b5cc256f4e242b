"""The EPD receiver's state table and slot pool: the spec, both twins, in lockstep, and across a replica.

- the compiled grids equal ``pdcore.epd._recv_spec``, and the grids obey their rules;
- each twin refuses what it must (ids [cython] and [python]);
- a hypothesis state machine drives both twins with the same calls and checks:
  no slot leased twice, no slot reused before its fence, codes monotone,
  settle returns exactly the agreed-landed requests, both twins identical;
- several ranks reduced with numpy MIN settle identically, and a rank with a
  different staged set makes every rank raise ``CollectiveError`` in the same round.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import os
import pathlib
import random
import subprocess
import sys
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pdcore.epd import _recv_py
from pdcore.epd import _recv_spec
from pdcore.epd._recv_spec import ItemState, ItemTrigger, RequestState, RequestTrigger, SlotState, SlotTrigger
from pdcore.epd.types import EmbeddingItem, LandedItem, LandedRequest
from pdcore.core.errors import CapacityError, CollectiveError, LocalProtocolError, PdError

TWINS = {"cython": "pdcore.epd._recv", "python": "pdcore.epd._recv_py"}


@pytest.fixture(scope="module", params=[pytest.param("cython", marks=pytest.mark.compiled), "python"])
def recv(request: pytest.FixtureRequest) -> ModuleType:
    return importlib.import_module(TWINS[request.param])


def items(*rows: int, start: int = 0) -> list[EmbeddingItem]:
    return [EmbeddingItem(start + k, "encode", 8998, 1000 + start + k, r) for k, r in enumerate(rows)]


def round_(table: Any, now: float = 0.0) -> list[LandedRequest]:
    """A replica of one rank: the agreed vector is this rank's own."""
    return table.settle(table.encode(now).copy())


# -- the spec ---------------------------------------------------------------------------------------------------------


@pytest.mark.compiled
def test_compiled_grids_are_the_spec() -> None:
    from pdcore.epd import _recv

    req, item, slot, timed, drop = _recv.compiled_spec()
    as_int = lambda grid: tuple(tuple(None if c is None else int(c) for c in row) for row in grid)  # noqa: E731
    assert req == as_int(_recv_spec.REQUEST_TRANSITIONS)
    assert item == as_int(_recv_spec.ITEM_TRANSITIONS)
    assert slot == as_int(_recv_spec.SLOT_TRANSITIONS)
    assert timed == {int(s) for s in _recv_spec.REQUEST_TIMED}
    assert drop == tuple(_recv_spec.DROP_TRIGGER.get(s) for s in ItemState)


def test_request_grid_moves_forward_and_failure_is_sticky() -> None:
    for state, trigger in itertools.product(RequestState, RequestTrigger):
        new = _recv_spec.REQUEST_TRANSITIONS[state][trigger]
        if state == RequestState.FAILED or trigger != RequestTrigger.ALL_LANDED:
            assert new == RequestState.FAILED, (state, trigger)
        else:
            assert new == RequestState.LANDED
    assert _recv_spec.REQUEST_TIMED == {RequestState.RECEIVING}
    assert (_recv_spec.CODE_FAILED, _recv_spec.CODE_RECEIVING, _recv_spec.CODE_LANDED) == (0, 1, 2) and _recv_spec.PAD == 255


def test_item_grid_only_moves_forward_one_step() -> None:
    for state, trigger in itertools.product(ItemState, ItemTrigger):
        new = _recv_spec.ITEM_TRANSITIONS[state][trigger]
        if new is not None:
            assert new in (state, state + 1), (state, trigger, new)
    assert _recv_spec.ITEM_TRANSITIONS[ItemState.LANDED][ItemTrigger.LAND] == ItemState.LANDED  # a repeated landing


def test_slot_grid_quarantine_and_hold_have_one_door_each() -> None:
    grid = _recv_spec.SLOT_TRANSITIONS
    assert [t for t in SlotTrigger if grid[SlotState.FENCING][t] is not None] == [SlotTrigger.FENCED]
    assert [t for t in SlotTrigger if grid[SlotState.HELD][t] is not None] == [SlotTrigger.RELEASE]
    assert [t for t in SlotTrigger if grid[SlotState.FREE][t] is not None] == [SlotTrigger.LEASE]
    # only an asked item's slot is quarantined
    for state, trigger in _recv_spec.DROP_TRIGGER.items():
        assert (grid[SlotState.LEASED][trigger] == SlotState.FENCING) == (state in _recv_spec.ASKED)


@pytest.mark.compiled
def test_stub_names_match_the_twin() -> None:
    from pdcore.epd import _recv

    stub = ast.parse(pathlib.Path(_recv.__file__).with_name("_recv.pyi").read_text())
    (cls,) = [n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "ReceiveTable"]
    stub_names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)} - {"__init__"}
    public = {n for n in vars(_recv_py.ReceiveTable) if not n.startswith("_")} | {"__len__", "__contains__"}
    assert stub_names == public
    assert stub_names <= set(dir(_recv.ReceiveTable))


@pytest.mark.compiled
def test_the_chooser_picks_the_twin_on_request() -> None:
    code = "import pdcore.epd.recv_table as t; print(t.IMPLEMENTATION, t.ReceiveTable.__module__)"
    for env, expect in (("1", "python pdcore.epd._recv_py"), ("", "cython pdcore.epd._recv")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PDCORE_PURE_PYTHON": env},
                             capture_output=True, text=True, check=True, timeout=60).stdout
        assert out.strip() == expect


# -- each twin ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ((0, 8), {}, ValueError),
        ((1 << 17, 8), {}, ValueError),
        ((4, 0), {}, ValueError),
        ((True, 8), {}, TypeError),
        ((4, 8.0), {}, TypeError),
        ((4, 8), {"max_requests": 0}, ValueError),
        ((4, 8), {"max_items": 0}, ValueError),
        ((4, 8), {"max_requests": 1 << 20, "max_items": 1 << 10}, ValueError),
        ((4, 8), {"rank": 2, "ranks": 2}, ValueError),
        ((4, 8), {"rank": -1}, ValueError),
        ((4, 8), {"sharded": 1}, ValueError),
        ((4, 8), {"timeout": 0.0}, ValueError),
        ((4, 8), {"timeout": float("nan")}, ValueError),
    ],
)
def test_config_refusals(recv: ModuleType, args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        recv.ReceiveTable(*args, **kwargs)


def test_stage_refusals_depend_only_on_what_every_rank_holds(recv: ModuleType) -> None:
    for rank in (0, 1):
        t = recv.ReceiveTable(3, 4, max_requests=2, max_items=3, rank=rank, ranks=2, sharded=True)
        with pytest.raises(CapacityError, match="needs 5 rows"):
            t.stage("a", items(9), 0.0)  # rank 1 gets only 4 rows, yet refuses as rank 0 must
        with pytest.raises(CapacityError, match="at most 3"):
            t.stage("a", items(1, 1, 1, 1), 0.0)
        with pytest.raises(LocalProtocolError, match="non-empty str"):
            t.stage("", items(1), 0.0)
        with pytest.raises(LocalProtocolError, match="sequence"):
            t.stage("a", items(1)[0], 0.0)  # type: ignore[arg-type]
        with pytest.raises(LocalProtocolError, match="strictly increasing"):
            t.stage("a", items(1, 1)[::-1], 0.0)
        with pytest.raises(LocalProtocolError, match="not an EmbeddingItem"):
            t.stage("a", [("x",)], 0.0)  # type: ignore[list-item]
        assert len(t) == 0 and t.free_slots() == 3
        t.stage("a", items(8), 0.0)
        with pytest.raises(LocalProtocolError, match="already staged"):
            t.stage("a", items(1), 0.0)
        t.stage("b", items(1), 0.0)
        with pytest.raises(CapacityError, match="all 2 requests"):
            t.stage("c", items(1), 0.0)
    t = recv.ReceiveTable(2, 8, max_items=4)
    with pytest.raises(CapacityError, match="never hold a receive slot each"):
        t.stage("a", items(1, 1, 1), 0.0)


def test_a_request_lands_settles_and_its_slots_wait_for_release(recv: ModuleType) -> None:
    t = recv.ReceiveTable(4, 16)
    t.stage("a", items(5, 7, start=2), 0.0)
    ready = t.take_ready()
    assert ready == [recv.Ask("a", 2, 0, 0, 5), recv.Ask("a", 3, 1, 0, 7)] and t.take_ready() == []
    assert t.landed("a", 2, 0.0) == RequestState.RECEIVING
    assert t.landed("a", 2, 0.0) == RequestState.RECEIVING  # a repeated landing changes nothing
    assert t.landed("a", 3, 0.0) == RequestState.LANDED
    buf = t.encode(1.0)
    assert buf.shape == (t.max_requests + 2 * recv.FINGERPRINT_BYTES,) and list(buf[:2]) == [2, 255]
    (landed,) = t.settle(buf.copy())
    assert landed == LandedRequest("a", (LandedItem(2, 0, 0, 5, 5, False), LandedItem(3, 1, 0, 7, 7, False)))
    assert "a" not in t and t.awaiting_release() and t.failed() == []
    assert [t.slot_state(s) for s in range(4)] == [SlotState.HELD, SlotState.HELD, SlotState.FREE, SlotState.FREE]
    with pytest.raises(LocalProtocolError, match="RELEASE is not allowed in FREE"):
        t.release([0, 2])
    with pytest.raises(LocalProtocolError, match="twice"):
        t.release([0, 0])
    with pytest.raises(LocalProtocolError, match="not a slot"):
        t.release([4])
    assert t.slot_state(0) == SlotState.HELD  # all or none
    t.release([1, 0])
    assert not t.awaiting_release() and t.free_slots() == 4


def test_items_wait_for_slots_in_staging_order_and_time_out(recv: ModuleType) -> None:
    t = recv.ReceiveTable(2, 8, timeout=10.0)
    t.stage("a", items(1, 1), 0.0)
    t.stage("b", items(1, 1), 1.0)
    t.stage("c", items(1), 2.0)
    assert [(a.rid, a.slot) for a in t.take_ready()] == [("a", 0), ("a", 1)]
    assert t.item_state("b", 0) == ItemState.PENDING and t.slot_of("b", 0) is None
    for i in (0, 1):
        t.landed("a", i, 3.0)
    round_(t, 3.0)
    t.release([1])  # c is shorter, but b came first: strict FIFO
    assert [(a.rid, a.index, a.slot) for a in t.take_ready()] == [("b", 0, 1)]
    t.fold(11.5)  # b's and c's clocks started at stage, slot or no slot
    assert t.state("b") == RequestState.FAILED and "1 of 2 items still waiting" in t.reason("b")
    assert t.state("c") == RequestState.RECEIVING
    t.fold(12.0)
    assert t.state("c") == RequestState.FAILED and t.reason("c") == "timeout after 10 s (1 of 1 items still waiting for a receive slot)"
    assert round_(t, 12.0) == [] and [rid for rid, _ in t.failed()] == ["b", "c"]
    assert t.take_fencing() == [1]  # b's item 0 was asked: its slot is quarantined
    assert t.slot_state(1) == SlotState.FENCING and t.slot_state(0) == SlotState.HELD and t.free_slots() == 0


def test_a_failed_slot_is_reused_only_after_its_fence(recv: ModuleType) -> None:
    t = recv.ReceiveTable(2, 8)
    t.stage("a", items(4, 4), 0.0)
    t.take_ready()  # both asked
    t.stage("b", items(4), 0.0)
    t.fail("a", "encode room failed", 1.0)
    assert t.fail("a", "again", 1.0) == RequestState.FAILED and t.reason("a") == "encode room failed"
    assert t.landed("a", 0, 1.0) == RequestState.FAILED  # a late landing changes nothing
    round_(t)
    assert t.failed() == [("a", "encode room failed")]
    assert sorted(t.take_fencing()) == [0, 1] and t.take_fencing() == []
    assert t.item_state("b", 0) == ItemState.PENDING  # neither slot is free, nor leased
    t.fenced(0)  # the data plane revoked the encode side's grant: b's item takes the slot
    assert t.slot_of("b", 0) == 0 and t.slot_state(1) == SlotState.FENCING
    with pytest.raises(LocalProtocolError, match="FENCED is not allowed in LEASED"):
        t.fenced(0)
    with pytest.raises(LocalProtocolError, match="not a slot"):
        t.fenced(-1)
    t.fenced(1)
    assert t.free_slots() == 1


def test_an_unasked_slot_is_freed_without_a_fence(recv: ModuleType) -> None:
    t = recv.ReceiveTable(2, 8)
    t.stage("a", items(4, 4), 0.0)  # leased, never asked
    t.fail("a", "", 0.0)
    assert t.take_ready() == []  # a failed request's items are never asked
    round_(t)
    assert t.failed() == [("a", "failed")] and t.take_fencing() == [] and t.free_slots() == 2


def test_empty_shards_lease_no_slot_and_still_ask(recv: ModuleType) -> None:
    t = recv.ReceiveTable(2, 8, rank=2, ranks=3, sharded=True)
    t.stage("a", items(2, 7), 0.0)  # 2 rows over 3 ranks: rank 2 gets none; 7 rows: 3, 2, 2 from row 5
    assert t.take_ready() == [recv.Ask("a", 0, None, 2, 0), recv.Ask("a", 1, 0, 5, 2)]
    t.landed("a", 0, 0.0)
    t.landed("a", 1, 0.0)
    (landed,) = round_(t)
    assert landed.items == (LandedItem(0, None, 2, 0, 2, True), LandedItem(1, 0, 5, 2, 7, True))
    assert t.free_slots() == 1 and t.slot_state(0) == SlotState.HELD


def test_a_request_without_items_lands_at_once(recv: ModuleType) -> None:
    t = recv.ReceiveTable(1, 8)
    t.stage("a", [], 0.0)
    assert t.state("a") == RequestState.LANDED and round_(t) == [LandedRequest("a", ())]


def test_bad_calls_change_nothing(recv: ModuleType) -> None:
    t = recv.ReceiveTable(2, 8, max_requests=3)
    t.stage("a", items(4), 0.0)
    with pytest.raises(LocalProtocolError, match="not staged"):
        t.landed("zz", 0, 0.0)
    with pytest.raises(LocalProtocolError, match="no item 5"):
        t.landed("a", 5, 0.0)
    with pytest.raises(LocalProtocolError, match="no item True"):
        t.landed("a", True, 0.0)
    with pytest.raises(LocalProtocolError, match="LAND is not allowed in LEASED"):
        t.landed("a", 0, 0.0)  # nothing was asked: nothing can land
    with pytest.raises(LocalProtocolError, match="not staged"):
        t.fail("zz", "x", 0.0)
    with pytest.raises(LocalProtocolError, match="without an encode"):
        t.settle(t.buffer.copy())
    buf = t.encode(0.0).copy()
    with pytest.raises(LocalProtocolError, match="hold 2 values"):
        t.settle([1, 1])
    with pytest.raises(LocalProtocolError, match="integer vector"):
        t.settle(np.zeros(len(buf), dtype=np.float32))
    with pytest.raises(CollectiveError, match="not a MIN"):
        t.settle([2])  # above this rank's own code 1
    with pytest.raises(CollectiveError, match="not a MIN"):
        t.settle([-1])
    bad = buf.copy()
    bad[1] = 2  # a code where this rank holds no request
    with pytest.raises(CollectiveError, match="refused"):
        t.settle(bad)
    assert t.settle([1]) == [] and t.rids() == ["a"] and t.state("a") == RequestState.RECEIVING
    with pytest.raises(LocalProtocolError, match="without an encode"):
        t.settle([1])  # a settle consumes its encode


def test_a_bad_clock_fails_before_anything_changes(recv: ModuleType) -> None:
    t = recv.ReceiveTable(2, 8)
    for call in (lambda: t.stage("a", items(1), None), lambda: t.encode("soon"), lambda: t.fold(None)):
        with pytest.raises(TypeError):
            call()
    assert len(t) == 0 and t.free_slots() == 2
    t.stage("a", items(1), 0)  # an int clock is a clock
    with pytest.raises(TypeError):
        t.landed("a", 0, None)
    with pytest.raises(TypeError):
        t.fail("a", "x", None)
    assert t.state("a") == RequestState.RECEIVING


def test_a_request_staged_between_encode_and_settle_waits_for_the_next_round(recv: ModuleType) -> None:
    t = recv.ReceiveTable(2, 8)
    t.stage("a", [], 0.0)
    buf = t.encode(0.0).copy()
    t.stage("b", [], 0.0)
    assert [r.rid for r in t.settle(buf)] == ["a"] and t.rids() == ["b"]
    assert [r.rid for r in round_(t)] == ["b"]


def test_the_buffer_has_one_length_whatever_is_staged(recv: ModuleType) -> None:
    t = recv.ReceiveTable(2, 8, max_requests=7)
    lengths = {len(t.encode(0.0))}
    t.settle(t.buffer.copy())
    t.stage("a", items(1), 0.0)
    lengths.add(len(t.encode(0.0)))
    assert lengths == {7 + 2 * recv.FINGERPRINT_BYTES}


def test_the_pd_agreement_drives_the_table(recv: ModuleType) -> None:
    from pdcore.core.agreement import Agreement

    t = recv.ReceiveTable(2, 8)
    t.stage("a", items(3), 0.0)
    t.stage("b", items(3), 0.0)
    for ask in t.take_ready():
        t.landed(ask.rid, ask.index, 0.0)
        break
    agreement = Agreement(t)  # a replica of one rank: encode, no collective, decode
    try:
        assert [r.rid for r in agreement.round(1.0)] == ["a"] and t.rids() == ["b"]
        assert agreement.round(2.0) == [] and t.rids() == ["b"]
    finally:
        agreement.close()


# -- both twins in lockstep ----------------------------------------------------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


class Lockstep(RuleBasedStateMachine):
    """The same calls on the compiled table and its pure twin; the test keeps its own account of the slots."""

    @initialize(
        slots=st.integers(1, 4), slot_rows=st.integers(2, 8), ranks=st.sampled_from([1, 2, 3]),
        sharded=st.booleans(), data=st.data(),
    )
    def setup(self, slots: int, slot_rows: int, ranks: int, sharded: bool, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, ranks - 1), label="rank")
        kw: dict[str, Any] = dict(max_requests=5, max_items=3, rank=rank, ranks=ranks, sharded=sharded, timeout=10.0)
        self.tables = (importlib.import_module(TWINS["cython"]).ReceiveTable(slots, slot_rows, **kw),
                       _recv_py.ReceiveTable(slots, slot_rows, **kw))
        self.slots = slots
        self.now = 0.0
        self.serial = 0
        self.indices: dict[str, list[int]] = {}  # staged rid -> its item indices
        self.last: dict[str, RequestState] = {}  # the last state seen per rid
        self.held: set[int] = set()
        self.fencing: set[int] = set()

    def both(self, name: str, *args: Any) -> Any:
        out = []
        for table in self.tables:
            try:
                out.append(("ok", getattr(table, name)(*args)))
            except PdError as e:
                out.append(("error", type(e)))
        (ka, a), (kb, b) = out
        assert ka == kb and (_same(a, b) if ka == "ok" else a is b), (name, args, out)
        return out[1]

    def pick_rid(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.indices) + ["never-staged"]), label="rid")

    @rule(data=st.data(), n=st.integers(0, 4), fresh=st.booleans())
    def stage(self, data: st.DataObject, n: int, fresh: bool) -> None:
        if fresh or not self.indices:
            self.serial += 1
            rid = f"r{self.serial}"
        else:
            rid = self.pick_rid(data)
        gaps = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n), label="gaps")
        idx = list(itertools.accumulate(g + 1 for g in gaps))
        if data.draw(st.integers(0, 9), label="shuffle") == 0:
            idx.reverse()
        rows = data.draw(st.lists(st.integers(1, 20), min_size=n, max_size=n), label="rows")
        its = [EmbeddingItem(i, "e", 1, 7, r) for i, r in zip(idx, rows)]
        kind, _ = self.both("stage", rid, its, self.now)
        if kind == "ok":
            self.indices[rid] = idx
            self.last[rid] = RequestState.RECEIVING

    @rule()
    def ask(self) -> None:
        kind, asks = self.both("take_ready")
        assert kind == "ok"
        for a in asks:
            assert a.rid in self.indices and self.last[a.rid] != RequestState.FAILED
            assert (a.slot is None) == (a.row_count == 0)

    @rule(data=st.data())
    def land(self, data: st.DataObject) -> None:
        asked = [(rid, i) for rid, idx in self.indices.items() for i in idx
                 if self.tables[1].item_state(rid, i) == ItemState.RECEIVING]
        if asked and data.draw(st.integers(0, 4), label="land an asked item"):
            rid, index = data.draw(st.sampled_from(asked), label="asked")
        else:  # anything: an unknown rid or index, an item not asked yet, a repeat
            rid = self.pick_rid(data)
            index = data.draw(st.sampled_from(self.indices.get(rid, []) + [99]), label="index")
        self.both("landed", rid, index, self.now)

    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        self.both("fail", self.pick_rid(data), "boom", self.now)

    @rule(data=st.data())
    def fail_an_asked_request_and_settle(self, data: st.DataObject) -> None:
        """The fence path, weighted: a request whose items were asked fails, and the replica settles it."""
        self.ask()
        asked = sorted({rid for rid, idx in self.indices.items() for i in idx
                        if self.tables[1].item_state(rid, i) in (ItemState.RECEIVING, ItemState.LANDED)})
        if asked:
            self.both("fail", data.draw(st.sampled_from(asked), label="asked rid"), "encode peer lost", self.now)
        self.settle(data)

    @rule(dt=st.floats(0.0, 12.0))
    def tick(self, dt: float) -> None:
        self.now += dt
        before = [self.tables[1].state(rid) for rid in self.indices]
        self.both("fold", self.now)
        after = [self.tables[1].state(rid) for rid in self.indices]
        event(f"fold: {sum(a != b for a, b in zip(before, after))} timed out")

    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        kind, buf = self.both("encode", self.now)
        rids = self.tables[1].rids()
        own = [int(c) for c in buf[: len(rids)]]
        assert all(c == PAD for c in buf[len(rids) : self.tables[1].max_requests])
        if data.draw(st.booleans(), label="others agree"):
            agreed = buf.copy()
        else:  # other ranks of the replica are behind or failed
            agreed = buf.copy()
            for pos, c in enumerate(own):
                agreed[pos] = data.draw(st.integers(0, c), label=f"agreed {pos}")
        slots_before = {(rid, i): self.tables[1].slot_of(rid, i) for rid in rids for i in self.indices[rid]}
        how = data.draw(st.sampled_from(["settle", "settle", "unguarded", "in place"]), label="how")
        if how == "unguarded":
            agreed = list(agreed[: len(rids)])
        if how == "in place":  # the collective reduced each table's own buffer, as Agreement does
            for table in self.tables:
                table.buffer[:] = agreed
            kind, landed = self.both("decode")
        else:
            kind, landed = self.both("settle", agreed)
        assert kind == "ok"
        codes = [int(c) for c in agreed[: len(rids)]]
        assert [r.rid for r in landed] == [rid for rid, c in zip(rids, codes) if c == 2]
        kind, failed = self.both("failed")
        assert [rid for rid, _ in failed] == [rid for rid, c in zip(rids, codes) if c == 0]
        for req in landed:
            assert [it.index for it in req.items] == self.indices[req.rid]
            for it in req.items:
                assert it.slot == slots_before[(req.rid, it.index)]
                if it.slot is not None:
                    assert it.slot not in self.held
                    self.held.add(it.slot)
        for rid, c in zip(rids, codes):
            if c != 1:
                del self.indices[rid]
        kind, fencing = self.both("take_fencing")
        assert not self.fencing & set(fencing)
        event(f"settle: landed {min(len(landed), 2)}, failed {min(len(failed), 2)}, quarantined {min(len(fencing), 2)}")
        self.fencing |= set(fencing)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.held and data.draw(st.integers(0, 4), label="release held slots"):
            chosen = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=3, unique=True))
        else:  # anything: a slot not held, out of range, twice
            chosen = data.draw(st.lists(st.sampled_from(sorted(self.held) + [0, self.slots]), max_size=3), label="slots")
        kind, _ = self.both("release", chosen)
        event(f"release {kind}")
        if kind == "ok":
            self.held -= set(chosen)

    @rule(data=st.data())
    def fence(self, data: st.DataObject) -> None:
        if self.fencing and data.draw(st.integers(0, 4), label="fence a quarantined slot"):
            slot = data.draw(st.sampled_from(sorted(self.fencing)), label="slot")
        else:
            slot = data.draw(st.sampled_from(sorted(self.fencing) + [0, -1]), label="slot")
        kind, _ = self.both("fenced", slot)
        event(f"fenced {kind}")
        if kind == "ok":
            self.fencing.discard(slot)

    @invariant()
    def twins_agree_and_slots_are_sound(self) -> None:
        if not hasattr(self, "tables"):
            return
        compiled, pure = self.tables
        assert compiled.rids() == pure.rids() == list(self.indices)
        leased: list[int] = []
        for rid, idx in self.indices.items():
            state = self.both("state", rid)[1]
            previous = self.last[rid]
            assert state == previous or (previous == RequestState.RECEIVING) or state == RequestState.FAILED, (
                f"{rid}: code went from {previous} to {state}")  # monotone: 1 -> 2, anything -> 0, 0 sticky
            if previous == RequestState.FAILED:
                assert state == RequestState.FAILED
            self.last[rid] = state
            for i in idx:
                item_state = self.both("item_state", rid, i)[1]
                slot = self.both("slot_of", rid, i)[1]
                if slot is not None:
                    assert item_state != ItemState.PENDING
                    leased.append(slot)
        assert len(leased) == len(set(leased)), f"a slot leased twice: {leased}"
        states = [self.both("slot_state", s)[1] for s in range(self.slots)]
        assert {s for s in range(self.slots) if states[s] == SlotState.LEASED} == set(leased)
        assert {s for s in range(self.slots) if states[s] == SlotState.HELD} == self.held
        assert {s for s in range(self.slots) if states[s] == SlotState.FENCING} == self.fencing  # not reused before its fence
        assert self.both("free_slots")[1] == states.count(SlotState.FREE)
        assert self.both("awaiting_release")[1] == bool(self.held)


PAD = _recv_spec.PAD
Lockstep.TestCase.settings = settings(
    stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
test_twins_in_lockstep = pytest.mark.compiled(Lockstep.TestCase)


# -- a replica of several ranks ------------------------------------------------------------------------------------------


def _replica(recv: ModuleType, ranks: int, sharded: bool, **kw: Any) -> list[Any]:
    return [recv.ReceiveTable(4, 8, max_requests=6, max_items=3, rank=r, ranks=ranks, sharded=sharded, timeout=20.0, **kw)
            for r in range(ranks)]


def _agree(tables: list[Any], now: float) -> np.ndarray:
    return np.minimum.reduce([t.encode(now).copy() for t in tables])


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("sharded", [False, True])
def test_every_rank_settles_the_same(recv: ModuleType, sharded: bool, seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.choice([2, 3, 4])
    tables = _replica(recv, ranks, sharded)
    staged: dict[str, list[EmbeddingItem]] = {}
    shares: dict[tuple[str, int], list[tuple[int, int]]] = {}
    serial = 0
    now = 0.0
    for _ in range(40):
        now += rng.uniform(0.0, 2.0)
        if len(staged) < 6 and rng.random() < 0.5:  # every rank stages the same request in the same round
            serial += 1
            rid = f"r{serial}"
            its = items(*[rng.randint(1, 8 if not sharded else 8 * ranks) for _ in range(rng.randint(0, 3))])
            for t in tables:
                t.stage(rid, its, now)
            staged[rid] = its
        for t in tables:  # each rank's I/O at its own pace
            for ask in t.take_ready():
                if rng.random() < 0.7:
                    t.landed(ask.rid, ask.index, now)
            if staged and rng.random() < 0.03:
                t.fail(rng.choice(sorted(staged)), "lost the encode peer", now)
        agreed = _agree(tables, now)
        settled = [t.settle(agreed.copy()) for t in tables]
        failed = [[rid for rid, _ in t.failed()] for t in tables]
        assert all([r.rid for r in s] == [r.rid for r in settled[0]] for s in settled), settled
        assert all(f == failed[0] for f in failed)
        for rid in failed[0]:
            del staged[rid]
        for t, landed in zip(tables, settled):
            for req in landed:
                for item in req.items:
                    shares.setdefault((req.rid, item.index), []).append((item.row_start, item.row_count))
            t.release([it.slot for req in landed for it in req.items if it.slot is not None])  # rows copied out
            for slot in t.take_fencing():
                t.fenced(slot)  # the data plane revoked the encode side's grant
        for req in settled[0]:
            del staged[req.rid]
        assert all(t.rids() == list(staged) for t in tables)
    for (rid, index), parts in shares.items():  # the ranks' shares tile the image, or each holds all of it
        assert len(parts) == ranks
        rows = parts[0][0] + parts[0][1] if not sharded else sum(c for _, c in parts)
        if sharded:
            assert sorted(parts) == parts and all(a + c == b for (a, c), (b, _) in zip(parts, parts[1:]))
            assert parts[0][0] == 0
        else:
            assert set(parts) == {(0, rows)}


@pytest.mark.parametrize("case", ["extra", "different", "order"])
def test_a_mismatched_staged_set_fails_every_rank_in_the_same_round(recv: ModuleType, case: str) -> None:
    tables = _replica(recv, 3, False)
    order = {"extra": [["a", "b"], ["a", "b"], ["a", "b", "c"]],
             "different": [["a", "b"], ["a", "c"], ["a", "b"]],
             "order": [["a", "b"], ["b", "a"], ["a", "b"]]}[case]
    for t, rids in zip(tables, order):
        for rid in rids:
            t.stage(rid, [], 0.0)  # landed at once: a mismatch must not hand anything out
    agreed = _agree(tables, 1.0)
    messages = set()
    for t in tables:
        with pytest.raises(CollectiveError) as info:
            t.settle(agreed.copy())
        messages.add("different numbers" in str(info.value))
    assert messages == {case == "extra"}
    for t, rids in zip(tables, order):  # nothing changed
        assert t.rids() == rids


@pytest.mark.parametrize("torn", [{"sharded": True}, {"ranks": 3, "rank": 1}])
def test_a_torn_split_fails_every_rank_in_the_first_round(recv: ModuleType, torn: dict[str, Any]) -> None:
    tables = [recv.ReceiveTable(4, 8, rank=r, ranks=2, sharded=False) for r in range(2)]
    tables[1] = recv.ReceiveTable(4, 8, **{"rank": 1, "ranks": 2, "sharded": False, **torn})
    agreed = _agree(tables, 0.0)  # nothing staged yet: the split alone differs
    for t in tables:
        with pytest.raises(CollectiveError, match="split the images differently"):
            t.settle(agreed.copy())


# -- a real replica: one process per rank, the PD agreement over gloo and over shared memory ----------------------------


def _epd_replica_rank(rank: int, world: int) -> dict[str, Any]:
    """Per twin and agreement mode: a few rounds of progress, then a mismatched staged order."""
    import torch.distributed as dist

    from pdcore.core.agreement import Agreement

    out: dict[str, Any] = {}
    for name, module in TWINS.items():
        recv = importlib.import_module(module)
        for mode in ("group", "shm"):
            t = recv.ReceiveTable(4, 8, rank=rank, ranks=world, sharded=True, timeout=30.0)
            agreement = Agreement(t, agreement=mode)
            rounds = []
            try:
                for rid in ("a", "b", "c"):  # two items each: a and b lease the 4 slots, c waits
                    t.stage(rid, items(5, 3), 0.0)
                for rnd in range(6):
                    t.take_ready()  # the peer asks the encode ranks
                    for rid, due in (("a", rank), ("c", 3)):  # rank k lands a's rows k rounds late
                        if rid in t and rnd >= due:
                            for i in (0, 1):
                                if t.item_state(rid, i) in (ItemState.RECEIVING, ItemState.LANDED):
                                    t.landed(rid, i, float(rnd))
                    if rnd == 1 and rank == world - 1 and "b" in t:
                        t.fail("b", f"rank {rank} lost its encode peer", float(rnd))
                    landed = agreement.round(float(rnd), dist.group.WORLD)
                    rounds.append(([(r.rid, [(i.row_start, i.row_count) for i in r.items]) for r in landed],
                                   [rid for rid, _ in t.failed()]))
                    t.release([i.slot for r in landed for i in r.items if i.slot is not None])
                    for slot in t.take_fencing():
                        t.fenced(slot)
                out[f"{name}/{mode}/rounds"] = rounds
                mismatch = recv.ReceiveTable(4, 8, rank=rank, ranks=world)
                agreement.close()
                agreement = Agreement(mismatch, agreement=mode)
                for rid in (["x", "y"] if rank == 0 else ["y", "x"]):
                    mismatch.stage(rid, [], 0.0)
                try:
                    agreement.round(0.0, dist.group.WORLD)
                    out[f"{name}/{mode}/mismatch"] = "agreed"
                except CollectiveError as exc:
                    out[f"{name}/{mode}/mismatch"] = type(exc).__name__ + (": order" if "(order, rid) set" in str(exc) else "")
                out[f"{name}/{mode}/mode"] = agreement.mode
            finally:
                agreement.close()
    return out


@pytest.mark.slow
def test_a_real_replica_settles_the_same_on_every_rank() -> None:
    from replica import run_replica

    world = 2
    per_rank = run_replica(_epd_replica_rank, world)
    for key in per_rank[0]:
        name, mode, what = key.split("/")
        values = [r[key] for r in per_rank]
        if what == "mode":
            assert set(values) == {mode}, key
        elif what == "mismatch":
            assert set(values) == {"CollectiveError: order"}, key
        else:
            rids = [[([rid for rid, _ in landed], failed) for landed, failed in rounds] for rounds in values]
            assert all(r == rids[0] for r in rids), (key, rids)
            landed_when = {rid: n for n, (landed, _) in enumerate(rids[0]) for rid in landed}
            failed_when = {rid: n for n, (_, failed) in enumerate(rids[0]) for rid in failed}
            assert landed_when == {"a": world - 1, "c": 3} and failed_when == {"b": 1}, (key, rids[0])
            shares = [dict(landed) for rounds in values for landed, _ in rounds]
            a = [s["a"] for s in shares if "a" in s]  # rank 0's share, then rank 1's: they tile each image
            assert a == [[(0, 3), (0, 2)], [(3, 2), (2, 1)]], (key, a)
    assert {key.split("/")[0] for key in per_rank[0]} == set(TWINS)
