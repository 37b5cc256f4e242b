"""The encode rank's sans-IO rooms (``pdcore.epd.sending.SendRooms``): examples, and a state machine.

The machine drives one encode rank (``tp_rank`` of ``tp_size``) with what its
peer would feed it — the scheduler's ``begin``/``send``/``fail``, asks from
the prefill ranks of its block (correct, and mismatched: misrouted ranks,
disagreeing fields, wrong shares, rows of the wrong shape), ``abort``,
``lost``, write completions (ok or an error) and ``expire`` on a moving clock
— and keeps its own account of every room. It checks, after every call:

- ``begin`` answers False exactly while the room is begun (or the rank is full);
- a room writes only once it is begun, holds its rows and an ask from every
  rank of its block; each ``Write`` goes to that asker's endpoint through its
  grant, with exactly its share's byte ranges, inside the chunk; no ``Write``
  after the room failed, and a room writes once;
- a refused ask (misrouted, the room ended or failed or being written, the
  rank full) hears exactly one failed status at once and is not an asker;
  every asker of a room (not lost, not replaced by its rank's later ask) hears
  exactly one final status (ok only for rows that were written, or an empty
  share) by the time the room concludes, and never more;
- a room is in ``concluded()`` exactly once per ``begin``, only once it ended,
  and never while one of its writes is outstanding; a room that was only
  parked (asked, never begun) never is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pdcore.control import wire
from pdcore.epd._recv_py import shard
from pdcore.epd.sending import SendRooms, Tell, Write
from pdcore.epd.types import DTYPE_ITEMSIZE, EmbeddingChunk
from pdcore.core.errors import LocalProtocolError

PARK = 10.0
TTL = 30.0
ROOMS = (0, 1, 2, 3)
ITEMSIZE = DTYPE_ITEMSIZE


def source_of(room: int) -> int:
    return 0x1000_0000 + room * 0x10_0000


def ask_msg(room: int, rank: int, ranks: int, *, rows: int, hidden: int = 2, dtype: str = "torch.float32",
            sharded: bool = False, deepstack_width: int = 0, share: tuple[int, int] | None = None,
            grant: int | None = None) -> wire.EmbedAsk:
    """A valid ask, as the encode peer receives it (through the wire's decoder and its checks)."""
    start, count = share if share is not None else shard(rows, rank, ranks, sharded)
    addr = 0x7000_0000 + rank * 0x10_0000 + room * 0x1000 if count else 0
    deep = addr + 0x800 if count and deepstack_width else 0
    msg = wire.EmbedAsk(
        room=room, session_id="s", epoch=1, rank=rank, ranks=ranks, sharded=sharded, rows=rows, row_start=start,
        row_count=count, hidden=hidden, dtype=dtype, deepstack_width=deepstack_width, addr=addr,
        deepstack_addr=deep, grant=grant if grant is not None else 1000 + 64 * rank + room,
    )
    out = wire.decode(wire.encode(msg))
    assert isinstance(out, wire.EmbedAsk)
    return out


def chunk_of(room: int, rows: int, hidden: int = 2, dtype: str = "torch.float32", deepstack_width: int = 0) -> EmbeddingChunk:
    size = ITEMSIZE[dtype]
    src = source_of(room)
    return EmbeddingChunk(
        room=room, source=src, rows=rows, hidden=hidden, dtype=dtype, nbytes=rows * hidden * size,
        deepstack_source=src + 0x8_0000 if deepstack_width else 0, deepstack_width=deepstack_width,
        deepstack_nbytes=rows * deepstack_width * size,
    )


def expected_batch(chunk: EmbeddingChunk, ask: wire.EmbedAsk) -> tuple[tuple[int, int, int], ...]:
    """The asker's share's byte ranges: computed from the share it is owed, not from what it asked."""
    start, count = shard(chunk.rows, ask.rank, ask.ranks, ask.sharded)
    row, deep = chunk.hidden * chunk.itemsize, chunk.deepstack_width * chunk.itemsize
    batch = [(chunk.source + start * row, ask.addr, count * row)]
    if deep:
        batch.append((chunk.deepstack_source + start * deep, ask.deepstack_addr, count * deep))
    return tuple(batch)


def tells(actions: list[Any]) -> list[tuple[str, int, bool]]:
    return [(a.endpoint, a.msg.room, a.msg.ok) for a in actions if isinstance(a, Tell)]


# -- examples ------------------------------------------------------------------------------------------------------


def test_a_room_writes_once_every_rank_of_its_block_asked_and_its_rows_are_there() -> None:
    r = SendRooms(tp_size=2, tp_rank=1, park_timeout=PARK, max_rooms=4)  # prefill tp 4: this rank serves 2 and 3
    chunk = chunk_of(7, rows=10, deepstack_width=3)
    assert r.begin(7, 0.0) == (True, [])
    assert r.send(chunk, 0.0) == []
    a2 = ask_msg(7, 2, 4, rows=10, sharded=True, deepstack_width=3)
    assert r.ask("p2", a2, 0.0) == []  # rank 3 has not asked
    a3 = ask_msg(7, 3, 4, rows=10, sharded=True, deepstack_width=3)
    out = r.ask("p3", a3, 0.0)
    assert sorted(out) == sorted([  # 10 rows over 4 ranks: 3, 3, 2, 2, so rank 2 has rows [6, 8) and rank 3 [8, 10)
        Write(7, "p2", 2, ((chunk.source + 6 * 8, a2.addr, 16), (chunk.deepstack_source + 6 * 12, a2.deepstack_addr, 24)), a2.grant),
        Write(7, "p3", 3, ((chunk.source + 8 * 8, a3.addr, 16), (chunk.deepstack_source + 8 * 12, a3.deepstack_addr, 24)), a3.grant),
    ])
    assert r.begin(7, 0.0) == (False, [])  # begun: another request cannot take it
    assert tells(r.written(7, 2, "", 0.1)) == [("p2", 7, True)]
    assert r.concluded() == []  # rank 3's write is outstanding: the rows may still be read
    assert tells(r.written(7, 3, "", 0.2)) == [("p3", 7, True)]
    assert r.concluded() == [7] and r.concluded() == [] and len(r) == 0
    assert tells(r.ask("p2", a2, 0.3)) == [("p2", 7, False)]  # a late ask hears the room ended
    assert r.begin(7, 0.4)[0]  # the room takes a new request


def test_asks_before_begin_are_parked_and_adopted() -> None:
    r = SendRooms(tp_size=1, tp_rank=0, park_timeout=PARK, max_rooms=4)
    a = ask_msg(5, 0, 1, rows=4)
    assert r.ask("p0", a, 0.0) == [] and len(r) == 1 and not r.begun(5)
    with pytest.raises(LocalProtocolError, match="not begun"):
        r.send(chunk_of(5, 4), 0.0)
    assert r.begin(5, 1.0) == (True, [])
    (w,) = r.send(chunk_of(5, 4), 1.0)
    assert isinstance(w, Write) and w.batch == ((source_of(5), a.addr, 32),)
    r.written(5, 0, "", 1.0)
    assert r.concluded() == [5]


def test_a_parked_ask_times_out_and_the_room_was_never_begun() -> None:
    r = SendRooms(tp_size=1, tp_rank=0, park_timeout=PARK, max_rooms=4)
    r.ask("p0", ask_msg(5, 0, 1, rows=4), 0.0)
    assert r.expire(PARK - 0.1) == []
    (t,) = r.expire(PARK)
    assert t.endpoint == "p0" and not t.msg.ok and "never began room 5" in t.msg.reason
    assert r.concluded() == [] and len(r) == 0  # parked, never begun: no send slot to give back


def test_a_begun_room_without_rows_or_asks_times_out() -> None:
    r = SendRooms(tp_size=1, tp_rank=0, park_timeout=PARK, max_rooms=4)
    r.begin(1, 0.0)
    r.begin(2, 0.0)
    r.send(chunk_of(2, 3), 0.0)
    r.ask("p0", ask_msg(1, 0, 1, rows=3), 0.0)
    (t,) = r.expire(PARK)
    assert t.endpoint == "p0" and "handed over no rows for room 1" in t.msg.reason
    assert sorted(r.concluded()) == [1, 2]


@pytest.mark.parametrize(
    ("change", "field"),
    [({"hidden": 3}, "hidden"), ({"dtype": "torch.bfloat16"}, "dtype"), ({"rows": 5}, "span"),
     ({"deepstack_width": 2}, "deepstack_width"), ({"share": (1, 3)}, "shards")],
)
def test_an_ask_that_does_not_fit_the_rows_fails_the_room_naming_the_field(change: dict[str, Any], field: str) -> None:
    r = SendRooms(tp_size=1, tp_rank=0, park_timeout=PARK, max_rooms=4)
    r.begin(3, 0.0)
    r.send(chunk_of(3, 4), 0.0)
    kw: dict[str, Any] = {"rows": 4, **change}
    out = r.ask("p0", ask_msg(3, 0, 1, **kw), 0.0)
    assert [type(a) for a in out] == [Tell] and not out[0].msg.ok and out[0].msg.reason.startswith(field)
    assert r.concluded() == [3]


def test_prefill_ranks_that_disagree_fail_the_room_on_both_sides() -> None:
    r = SendRooms(tp_size=1, tp_rank=0, park_timeout=PARK, max_rooms=4)
    r.begin(3, 0.0)
    r.ask("p0", ask_msg(3, 0, 2, rows=4, hidden=2), 0.0)
    out = r.ask("p1", ask_msg(3, 1, 2, rows=4, hidden=3), 0.0)
    assert sorted(tells(out)) == [("p0", 3, False), ("p1", 3, False)]
    assert all("disagree on hidden" in a.msg.reason for a in out)
    assert r.send(chunk_of(3, 4), 0.0) == []  # the scheduler's rows after the failure are ignored
    assert r.concluded() == [3]


def test_misrouted_and_refused_asks_hear_one_failure_and_change_nothing() -> None:
    r = SendRooms(tp_size=2, tp_rank=0, park_timeout=PARK, max_rooms=1)
    for msg, why in ((ask_msg(1, 2, 4, rows=4), "belongs to encode rank 1"),
                     (ask_msg(1, 0, 3, rows=4), "not a multiple of encode tp 2")):
        (t,) = r.ask("px", msg, 0.0)
        assert t.endpoint == "px" and not t.msg.ok and why in t.msg.reason
    assert len(r) == 0
    r.begin(1, 0.0)
    (t,) = r.ask("p0", ask_msg(2, 0, 2, rows=4), 0.0)
    assert "holds 1 rooms already" in t.msg.reason and len(r) == 1
    assert r.begin(2, 0.0) == (False, [])  # full


def test_one_failed_write_fails_the_room_and_every_asker_hears_once() -> None:
    r = SendRooms(tp_size=1, tp_rank=0, park_timeout=PARK, max_rooms=4)
    r.begin(4, 0.0)
    r.send(chunk_of(4, 6), 0.0)
    r.ask("p0", ask_msg(4, 0, 3, rows=6, sharded=True), 0.0)
    r.ask("p1", ask_msg(4, 1, 3, rows=6, sharded=True), 0.0)
    writes = r.ask("p2", ask_msg(4, 2, 3, rows=6, sharded=True), 0.0)
    assert sorted(w.rank for w in writes) == [0, 1, 2]
    heard: Counter[str] = Counter()
    heard.update(ep for ep, _, _ in tells(r.written(4, 0, "", 0.0)))
    heard.update(ep for ep, _, _ in tells(r.written(4, 1, "connection reset", 0.0)))
    assert r.concluded() == []  # rank 2's write is still outstanding
    heard.update(ep for ep, _, _ in tells(r.written(4, 2, "", 0.0)))
    assert heard == Counter({"p0": 1, "p1": 1, "p2": 1})
    assert r.concluded() == [4]
    (t,) = r.ask("p1", ask_msg(4, 1, 3, rows=6, sharded=True), 1.0)
    assert "connection reset" in t.msg.reason  # the tombstone names the failure


def test_an_abort_while_writing_tells_everyone_once_and_concludes_after_the_writes() -> None:
    r = SendRooms(tp_size=1, tp_rank=0, park_timeout=PARK, max_rooms=4)
    r.begin(4, 0.0)
    r.send(chunk_of(4, 2), 0.0)
    r.ask("p0", ask_msg(4, 0, 2, rows=2), 0.0)
    assert len(r.ask("p1", ask_msg(4, 1, 2, rows=2), 0.0)) == 2
    assert sorted(tells(r.abort("p1", 4, "gave up", 0.0))) == [("p0", 4, False), ("p1", 4, False)]
    assert r.written(4, 0, "", 0.0) == [] and r.concluded() == []
    assert r.written(4, 1, "cancelled", 0.0) == []  # told already
    assert r.concluded() == [4]


def test_an_empty_share_is_told_at_once() -> None:
    r = SendRooms(tp_size=2, tp_rank=1, park_timeout=PARK, max_rooms=4)
    r.begin(9, 0.0)
    r.send(chunk_of(9, 1), 0.0)  # 1 row over 4 ranks: rank 0 has it, this encode rank's 2 and 3 have none
    r.ask("p2", ask_msg(9, 2, 4, rows=1, sharded=True), 0.0)
    assert tells(r.ask("p3", ask_msg(9, 3, 4, rows=1, sharded=True), 0.0)) == [("p2", 9, True), ("p3", 9, True)]
    assert r.concluded() == [9]


def test_a_lost_prefill_rank_fails_its_rooms_and_is_not_told() -> None:
    r = SendRooms(tp_size=1, tp_rank=0, park_timeout=PARK, max_rooms=4)
    for room in (1, 2):
        r.begin(room, 0.0)
        r.ask("p0", ask_msg(room, 0, 2, rows=2), 0.0)
        r.ask("p1", ask_msg(room, 1, 2, rows=2), 0.0)
    assert sorted(tells(r.lost("p1", "heartbeat", 0.0))) == [("p0", 1, False), ("p0", 2, False)]
    assert sorted(r.concluded()) == [1, 2]


def test_tombstones_go_after_their_ttl() -> None:
    r = SendRooms(tp_size=1, tp_rank=0, park_timeout=PARK, max_rooms=4, tombstone_ttl=TTL)
    r.begin(1, 0.0)
    r.fail(1, "no image", 0.0)
    assert r.fail(1, "again", 1.0) == [] and r.send(chunk_of(1, 2), 1.0) == []  # ended: ignored
    assert "no image" in r.ask("p0", ask_msg(1, 0, 1, rows=2), 1.0)[0].msg.reason
    r.expire(TTL)
    assert r.ask("p0", ask_msg(1, 0, 1, rows=2), TTL) == []  # forgotten: a fresh room parks the ask
    with pytest.raises(LocalProtocolError, match="not begun"):
        r.fail(2, "x", TTL)


# -- the state machine -------------------------------------------------------------------------------------------


@dataclass(eq=False)
class MRoom:
    """The test's account of one incarnation of a room on the encode rank."""

    room: int
    serial: int  # which incarnation
    deadline: float
    begun: bool = False
    chunk: EmbeddingChunk | None = None
    asks: dict[int, tuple[str, wire.EmbedAsk]] = field(default_factory=dict)
    out: set[int] | None = None  # ranks whose writes are outstanding; None before writing
    failed: bool = False


class Rooms(RuleBasedStateMachine):
    @initialize(tp=st.sampled_from([1, 2]), fanout=st.sampled_from([1, 2, 3]), sharded=st.booleans(),
                max_rooms=st.sampled_from([1, 2, 3]), data=st.data())
    def setup(self, tp: int, fanout: int, sharded: bool, max_rooms: int, data: st.DataObject) -> None:
        self.tp, self.ranks, self.sharded = tp, tp * fanout, sharded
        self.rank = data.draw(st.integers(0, tp - 1), label="tp_rank")
        self.block = list(range(self.rank * fanout, (self.rank + 1) * fanout))
        self.max_rooms = max_rooms
        self.rooms = SendRooms(tp_size=tp, tp_rank=self.rank, park_timeout=PARK, max_rooms=max_rooms, tombstone_ttl=TTL)
        self.shapes = {room: data.draw(st.tuples(st.integers(1, 7), st.integers(1, 3),
                                                 st.sampled_from(["torch.float32", "torch.bfloat16"]),
                                                 st.sampled_from([0, 2])), label=f"shape of room {room}")
                       for room in ROOMS}
        self.now = 0.0
        self.serial = 0
        self.live: dict[int, MRoom] = {}
        self.tomb: dict[int, tuple[float, bool]] = {}  # ended room -> (until, failed before begun) (order = age)
        self.expect_concluded: list[int] = []
        self.heard: Counter[tuple[int, str]] = Counter()  # (serial, endpoint) -> final statuses
        self.may_ok: set[tuple[int, str]] = set()  # (serial, endpoint) owed an ok
        self.grants = 0

    # -- the model ---------------------------------------------------------------------------------------------

    def _new(self, room: int) -> MRoom:
        self.serial += 1
        m = self.live[room] = MRoom(room, self.serial, self.now + PARK)
        return m

    def _bury(self, room: int, unbegun: bool) -> None:
        self.tomb.pop(room, None)
        self.tomb[room] = (self.now + TTL, unbegun)
        while len(self.tomb) > 4 * self.max_rooms:
            del self.tomb[next(iter(self.tomb))]

    def _conclude(self, m: MRoom, step: dict[str, Any]) -> None:
        del self.live[m.room]
        self._bury(m.room, not m.begun and m.failed)
        if m.begun:
            self.expect_concluded.append(m.room)
        step["concluded"].append(m)

    def _fail(self, m: MRoom, step: dict[str, Any], field: str = "") -> None:
        if m.failed:
            return
        m.failed = True
        step["failed"].append((m, field))
        if not m.out:
            self._conclude(m, step)

    def _mismatch(self, chunk: EmbeddingChunk, asks: list[wire.EmbedAsk]) -> str:
        for a in sorted(asks, key=lambda a: a.rank):
            if a.hidden != chunk.hidden:
                return "hidden"
            if a.dtype != chunk.dtype:
                return "dtype"
            if a.rows != chunk.rows:
                return "span"
            if a.deepstack_width != chunk.deepstack_width:
                return "deepstack_width"
            if (a.row_start, a.row_count) != shard(chunk.rows, a.rank, a.ranks, a.sharded):
                return "shards"
        return ""

    def _try_write(self, m: MRoom, step: dict[str, Any]) -> None:
        if not m.begun or m.chunk is None or m.out is not None or m.failed or not m.asks:
            return
        _, first = next(iter(m.asks.values()))
        fanout = first.ranks // self.tp  # every ask names the same prefill tp, or the room failed
        if len(m.asks) < fanout:
            return
        block = list(range(self.rank * fanout, (self.rank + 1) * fanout))
        assert sorted(m.asks) == block  # asks are all in the block: once enough, every rank of it asked
        why = self._mismatch(m.chunk, [a for _, a in m.asks.values()])
        if why:
            self._fail(m, step, why)
            return
        m.out = set()
        event(f"writes start: {len(m.asks)} askers")
        for endpoint, a in m.asks.values():
            if a.row_count == 0:
                self.may_ok.add((m.serial, endpoint))
            else:
                step["writes"][(m.room, a.rank)] = Write(m.room, endpoint, a.rank, expected_batch(m.chunk, a), a.grant)
                m.out.add(a.rank)
        if not m.out:
            self._conclude(m, step)

    def _step(self) -> dict[str, Any]:
        return {"writes": {}, "failed": [], "concluded": [], "refused": None, "touched": dict(self.live)}

    def _absorb(self, actions: list[Any], step: dict[str, Any]) -> None:
        """Check one call's actions against the account."""
        got_writes = [a for a in actions if isinstance(a, Write)]
        for w in got_writes:
            assert (w.room, w.rank) in step["writes"], f"unexpected write {w} (the room is not ready, failed, or wrote already)"
        assert sorted(got_writes) == sorted(step["writes"].values()), (got_writes, step["writes"])
        for w in got_writes:
            m = self.live.get(w.room) or next(c for c in step["concluded"] if c.room == w.room)
            assert m.chunk is not None and not m.failed
            chunk = m.chunk
            (src, _, n), *deep = w.batch
            assert chunk.source <= src and src + n <= chunk.source + chunk.nbytes
            for dsrc, _, dn in deep:
                assert chunk.deepstack_source <= dsrc and dsrc + dn <= chunk.deepstack_source + chunk.deepstack_nbytes
        statuses = [a for a in actions if isinstance(a, Tell)]
        if step["refused"] is not None:
            endpoint, room = step["refused"]
            assert [(t.endpoint, t.msg.room, t.msg.ok) for t in statuses] == [(endpoint, room, False)], statuses
            assert not got_writes
            return
        rooms_now = {**step["touched"], **{m.room: m for m in step["concluded"]}, **self.live}
        for t in statuses:
            assert t.msg.rank == self.rank
            m = rooms_now.get(t.msg.room)
            assert m is not None, f"a status for room {t.msg.room}, which the rank does not hold: {t}"
            askers = {ep for ep, _ in m.asks.values()}
            assert t.endpoint in askers, f"{t.endpoint} is told about room {m.room} but is not its asker"
            key = (m.serial, t.endpoint)
            self.heard[key] += 1
            assert self.heard[key] == 1, f"{t.endpoint} hears a second final status for room {m.room}: {t}"
            if t.msg.ok:
                assert key in self.may_ok, f"{t.endpoint} is told ok for room {m.room} without its rows written"
            else:
                assert t.msg.reason
        for m, why in step["failed"]:
            if why:  # a mismatch names the field on both sides
                for t in statuses:
                    if t.msg.room == m.room:
                        assert why in t.msg.reason, (why, t.msg.reason)
        for m in step["concluded"]:
            assert not m.out, f"room {m.room} concluded with writes outstanding"
            for endpoint, _ in m.asks.values():
                assert self.heard[(m.serial, endpoint)] == 1, f"{endpoint}, asker of room {m.room}, heard no final status"

    # -- the rules ---------------------------------------------------------------------------------------------

    @rule(room=st.sampled_from(ROOMS))
    def begin(self, room: int) -> None:
        m = self.live.get(room)
        given_up = m is None and self.tomb.get(room, (0.0, False))[1]  # prefill gave it up before it began
        expect = given_up or (not (m is not None and m.begun) and (m is not None or len(self.live) < self.max_rooms))
        ok, actions = self.rooms.begin(room, self.now)
        assert ok == expect, (room, m)
        step = self._step()
        if given_up:
            event("begin of a room prefill gave up: concluded at once")
            self.tomb[room] = (self.tomb[room][0], False)
            self.expect_concluded.append(room)
            assert actions == []
        elif ok:
            if m is None:
                m = self._new(room)
            m.begun, m.deadline = True, self.now + PARK
            self.tomb.pop(room, None)
            self._try_write(m, step)
        self._absorb(actions, step)

    @rule(room=st.sampled_from(ROOMS), data=st.data())
    def send(self, room: int, data: st.DataObject) -> None:
        rows, hidden, dtype, ds = self.shapes[room]
        kind = data.draw(st.sampled_from(["right"] * 6 + ["rows", "hidden", "dtype", "deepstack"]), label="rows sent")
        chunk = chunk_of(room, rows + (kind == "rows"), hidden + (kind == "hidden"),
                         {"torch.float32": "torch.bfloat16", "torch.bfloat16": "torch.float32"}[dtype] if kind == "dtype" else dtype,
                         (2 - ds) if kind == "deepstack" else ds)
        self._send(room, chunk)

    def _send(self, room: int, chunk: EmbeddingChunk) -> None:
        m = self.live.get(room)
        step = self._step()
        if m is None or not m.begun or m.chunk is not None:
            if m is None and room in self.tomb:
                assert self.rooms.send(chunk, self.now) == []
            else:
                with pytest.raises(LocalProtocolError):
                    self.rooms.send(chunk, self.now)
            return
        actions = self.rooms.send(chunk, self.now)
        m.chunk = chunk
        self._try_write(m, step)
        self._absorb(actions, step)

    @rule(room=st.sampled_from(ROOMS))
    def fail(self, room: int) -> None:
        m = self.live.get(room)
        step = self._step()
        if m is None or not m.begun:
            if m is None and room in self.tomb:
                assert self.rooms.fail(room, "the encoder failed", self.now) == []
            else:
                with pytest.raises(LocalProtocolError):
                    self.rooms.fail(room, "the encoder failed", self.now)
            return
        actions = self.rooms.fail(room, "the encoder failed", self.now)
        self._fail(m, step)
        self._absorb(actions, step)

    @rule(room=st.sampled_from(ROOMS), data=st.data())
    def ask(self, room: int, data: st.DataObject) -> None:
        rows, hidden, dtype, ds = self.shapes[room]
        kind = data.draw(st.sampled_from(["right"] * 12 + ["ranks", "sharded", "rows", "hidden", "dtype", "deepstack", "share"]),
                         label="ask")
        ranks = self.ranks if kind != "ranks" else data.draw(st.sampled_from([self.ranks + 1, 2 * self.ranks]), label="ranks")
        if kind != "ranks" and data.draw(st.integers(0, 4), label="in the block"):
            rank = data.draw(st.sampled_from(self.block), label="block rank")
        else:  # any rank of the replica: misrouted unless it happens to be in this rank's block
            rank = data.draw(st.integers(0, ranks - 1), label="any rank")
        sharded = self.sharded != (kind == "sharded")
        rows_asked = rows + (kind == "rows")
        share = shard(rows_asked, rank, ranks, sharded)
        if kind == "share":
            start, count = share
            share = (start, count - 1) if count > 1 else (start, count + 1) if start + count < rows_asked else (0, rows_asked)
        self.grants += 1
        msg = ask_msg(room, rank, ranks, rows=rows_asked, hidden=hidden + (kind == "hidden"),
                      dtype="torch.float16" if kind == "dtype" else dtype, sharded=sharded,
                      deepstack_width=(2 - ds) if kind == "deepstack" else ds, share=share, grant=self.grants)
        endpoint = f"p{rank}" + data.draw(st.sampled_from(["", "", "", "-restarted"]), label="endpoint")
        self._ask(endpoint, msg, kind)

    def _ask(self, endpoint: str, msg: wire.EmbedAsk, kind: str) -> None:
        room, rank, ranks = msg.room, msg.rank, msg.ranks
        step = self._step()
        m = self.live.get(room)
        fanout = ranks // self.tp
        refused = (ranks % self.tp != 0 or rank // fanout != self.rank
                   or (m is None and (room in self.tomb or len(self.live) >= self.max_rooms))
                   or (m is not None and (m.failed or m.out is not None)))
        actions = self.rooms.ask(endpoint, msg, self.now)
        event(f"ask: {kind}{', refused' if refused else ''}")
        if refused:
            step["refused"] = (endpoint, room)
            self._absorb(actions, step)
            return
        if m is None:
            m = self._new(room)
            step["touched"][room] = m
        others = [a for r, (_, a) in m.asks.items() if r != rank]
        m.asks[rank] = (endpoint, msg)  # a rank that asks again replaces its ask (and its endpoint)
        for name in ("ranks", "sharded", "rows", "hidden", "dtype", "deepstack_width"):
            if others and getattr(msg, name) != getattr(others[0], name):
                self._fail(m, step, f"disagree on {name}")
                break
        else:
            self._try_write(m, step)
        self._absorb(actions, step)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from(ROOMS), label="room")
        m = self.live.get(room)
        askers = sorted({ep for ep, _ in m.asks.values()}) if m else []
        endpoint = data.draw(st.sampled_from(askers + ["p0", "nobody"]), label="endpoint")
        # a registered prefill rank (of this rank's block or not) or one that never registered (None)
        rank = data.draw(st.sampled_from([None, *self.block, *[r for r in range(self.ranks) if r not in self.block]]),
                         label="asker rank")
        ours = rank is not None and rank in self.block
        step = self._step()
        actions = self.rooms.abort(endpoint, room, "the prefill replica gave up", self.now,
                                   None if rank is None else (rank, self.ranks))
        if m is not None and (endpoint in askers or ours):
            self._fail(m, step)
        elif m is None and ours and room not in self.tomb:
            event("abort of a room not begun, from a rank of the block")
            self._bury(room, True)
            assert actions == []
        self._absorb(actions, step)

    @rule(data=st.data())
    def lost(self, data: st.DataObject) -> None:
        askers = sorted({ep for m in self.live.values() for ep, _ in m.asks.values()})
        endpoint = data.draw(st.sampled_from(askers + ["p0", "nobody"]), label="endpoint")
        step = self._step()
        actions = self.rooms.lost(endpoint, "heartbeat timeout", self.now)
        for m in [m for m in self.live.values() if any(ep == endpoint for ep, _ in m.asks.values())]:
            m.asks = {r: v for r, v in m.asks.items() if v[0] != endpoint}  # gone: nobody tells it
            self._fail(m, step)
        self._absorb(actions, step)

    @rule(data=st.data(), error=st.sampled_from(["", "", "", "connection reset"]))
    def written(self, data: st.DataObject, error: str) -> None:
        outstanding = sorted((m.room, r) for m in self.live.values() for r in (m.out or ()))
        if not outstanding or not data.draw(st.integers(0, 5), label="complete an outstanding write"):
            # a completion for a room that is not writing (ended, parked, waiting) changes nothing
            room, rank = data.draw(st.sampled_from(ROOMS), label="room"), data.draw(st.integers(0, 3), label="rank")
            m = self.live.get(room)
            if m is None or not m.out:
                assert self.rooms.written(room, rank, error, self.now) == []
            return
        room, rank = data.draw(st.sampled_from(outstanding), label="write")
        m = self.live[room]
        event(f"write completes{' with an error' if error else ''}, {min(len(m.out or ()), 2)} outstanding"
              f"{', the room failed' if m.failed else ''}")
        step = self._step()
        actions = self.rooms.written(room, rank, error, self.now)
        assert m.out is not None
        m.out.discard(rank)
        asker = m.asks.get(rank)
        if error:
            m.failed = True
        elif asker is not None:
            self.may_ok.add((m.serial, asker[0]))
        if not m.out:
            self._conclude(m, step)
        self._absorb(actions, step)

    @rule(room=st.sampled_from(ROOMS))
    def serve(self, room: int) -> None:
        """The way to the writes: the room begins, gets its rows, and every rank of its block asks."""
        m = self.live.get(room)
        if m is None or not m.begun:
            self.begin(room)
        m = self.live.get(room)
        if m is not None and m.begun and m.chunk is None:
            self._send(room, chunk_of(room, *self.shapes[room]))
        self.whole_block(room)

    @rule(room=st.sampled_from(ROOMS))
    def whole_block(self, room: int) -> None:
        """Every rank of the block asks, as it should (the way to the writes)."""
        rows, hidden, dtype, ds = self.shapes[room]
        for rank in self.block:
            self.grants += 1
            msg = ask_msg(room, rank, self.ranks, rows=rows, hidden=hidden, dtype=dtype, sharded=self.sharded,
                          deepstack_width=ds, grant=self.grants)
            self._ask(f"p{rank}", msg, "right")

    @rule(dt=st.sampled_from([0.0, 0.5, 3.0, PARK / 2, PARK, TTL]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule()
    def expire(self) -> None:
        self._expire()

    def _expire(self) -> None:
        step = self._step()
        actions = self.rooms.expire(self.now)
        for m in [m for m in self.live.values() if m.deadline <= self.now and m.out is None and not m.failed]:
            self._fail(m, step)
        for room in [r for r, (until, _) in self.tomb.items() if until <= self.now]:
            del self.tomb[room]
        self._absorb(actions, step)

    # -- after every call ----------------------------------------------------------------------------------------

    @invariant()
    def the_rooms_match_the_account(self) -> None:
        # One expire may conclude several rooms; concluded() promises which, not in what order.
        got = self.rooms.concluded()
        assert Counter(got) == Counter(self.expect_concluded), (got, self.expect_concluded)
        self.expect_concluded = []
        assert len(self.rooms) == len(self.live)
        for room in ROOMS:
            m = self.live.get(room)
            assert self.rooms.begun(room) == (m is not None and m.begun)

    def teardown(self) -> None:
        """Complete every write and let every room time out: each begun room concludes exactly once."""
        if not hasattr(self, "rooms"):
            return
        for m in list(self.live.values()):
            for rank in sorted(m.out or ()):
                step = self._step()
                actions = self.rooms.written(m.room, rank, "", self.now)
                m.out.discard(rank)  # type: ignore[union-attr]
                if rank in m.asks:
                    self.may_ok.add((m.serial, m.asks[rank][0]))
                if not m.out:
                    self._conclude(m, step)
                self._absorb(actions, step)
        self.now += PARK
        self._expire()
        assert not self.live and len(self.rooms) == 0
        assert sorted(self.rooms.concluded()) == sorted(self.expect_concluded)


Rooms.TestCase.settings = settings(stateful_step_count=60, deadline=None)
TestRooms = Rooms.TestCase
