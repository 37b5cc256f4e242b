"""The role engines driven by hand, sans-IO (aioquic's tests are the model): inputs with ``now``, the actions
they emit inspected, answers fed back, the table's round read as a scheduler would.

Each test pins one defect found from outside (with real peers, sockets and processes) that the suite and
the simulator let through: a grant that outlived its fence, one prefill rank's death failing requests
toward its siblings, a failed data connect nobody told, a look-up answer that wedged its deployment, a
landing reported for pages never announced, a staged room landed twice, an EPD receiver that believed an encode rank restarted at the same
host:port had its registration, landed grants forgotten while the data plane refused their revokes (found by the
simulator). Their mutants are in ``tests/mutants/``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from transport.base import Grant

from pdcore.control import wire
from pdcore.control.bootstrap import ParallelInfo, RankInfo
from pdcore.core._spec import State
from pdcore.core.errors import LocalProtocolError
from pdcore.core.events import BootstrapInfo, Failed
from pdcore.core.table import StateTable
from pdcore.epd.config import EncodeConfig, ReceiverConfig
from pdcore.epd.recv_table import ReceiveTable
from pdcore.epd.sending import SendRooms
from pdcore.epd.types import EmbeddingChunk, EmbeddingItem
from pdcore.kv.layout import KvLayout
from pdcore.pd.config import DecodeConfig, PrefillConfig
from pdcore.pd.front import DecodeFront
from pdcore.protocol.actions import Connect, Grant as GrantAction, Land, LookUp, Post, Revoke, Send
from pdcore.protocol.decode import DecodeEngine
from pdcore.protocol.engine import Services
from pdcore.protocol.encode import EncodeEngine
from pdcore.protocol.prefill import PrefillEngine
from pdcore.protocol.receiver import ReceiverEngine
from transport.plan import Layout

SERVER = ("10.0.0.1", 9000)
LAYOUT = KvLayout(order="hnd", kv_heads=2, head_bytes=4, page_tokens=2, layers=1)
PAGES = 8


def _cache(tp: int) -> list[np.ndarray]:
    return [np.zeros(PAGES * LAYOUT.page_bytes(tp), np.uint8) for _ in range(LAYOUT.buffers)]


def _decode(tp: int = 1, staged: bool = False, max_pending: int = 4096, **services: Any) -> DecodeEngine:
    cfg = DecodeConfig(kv_buffers=_cache(tp), page_bytes=LAYOUT.page_bytes(tp), num_pages=PAGES, tp_size=tp,
                       tp_rank=0, kv_layout=LAYOUT, bootstrap_timeout=30.0, waiting_timeout=30.0,
                       max_pending=max_pending)
    table = StateTable(16, bootstrap_timeout=30.0, waiting_timeout=30.0)
    layout = Layout([b.ctypes.data for b in cfg.kv_buffers], cfg.page_bytes_per_buffer, PAGES)
    return DecodeEngine(Services(config=cfg, session_id="decode-1", epoch=1, table=table, endpoint=b"d",
                                 layout=layout, staged=staged, **services))


def _prefill(**services: Any) -> PrefillEngine:
    cfg = PrefillConfig(kv_buffers=_cache(1), page_bytes=LAYOUT.page_bytes(1), num_pages=PAGES, tp_size=1,
                        tp_rank=0, kv_layout=LAYOUT, bootstrap_timeout=30.0, waiting_timeout=30.0,
                        bootstrap_host=SERVER[0], bootstrap_port=SERVER[1])
    table = StateTable(16, bootstrap_timeout=30.0, waiting_timeout=30.0)
    layout = Layout([b.ctypes.data for b in cfg.kv_buffers], cfg.page_bytes_per_buffer, PAGES)
    return PrefillEngine(Services(config=cfg, session_id="prefill-1", epoch=1, table=table, endpoint=b"p",
                                  layout=layout, **services))


def _register_decode(engine: PrefillEngine, decode: str) -> Connect:
    """A decode rank (tp 1, ``decode``'s endpoint) registers with the prefill ``engine`` at time 0; the
    engine's one connect to it, which the test answers."""
    layout = {"bases": [0] * LAYOUT.buffers, "page_bytes": [LAYOUT.page_bytes(1)] * LAYOUT.buffers,
              "num_pages": PAGES, "kv": LAYOUT.to_json()}
    engine.message(decode, wire.Register(session_id="decode-1", epoch=1, endpoint=b"d", regions=(), layout=layout,
                                         tp_size=1, tp_rank=0), 0.0)
    (first,) = [a for a in engine.take_actions() if type(a) is Connect]
    return first


def _info(tp_sizes: tuple[int, ...], layout: dict[str, Any] | None = None) -> ParallelInfo:
    layout = layout or {"page_bytes": [LAYOUT.page_bytes(tp_sizes[0])] * LAYOUT.buffers, "num_pages": PAGES,
                        "kv": LAYOUT.to_json()}
    return ParallelInfo(dp_size=len(tp_sizes), tp_sizes=tp_sizes, layout=layout, registered=sum(tp_sizes),
                        complete=True)


def _rank(dp: int, tp: int) -> RankInfo:
    return RankInfo(dp_rank=dp, tp_rank=tp, endpoint=f"tcp://10.0.{dp}.{tp}:7000", session_id=f"prefill-{dp}-{tp}",
                    epoch=1, transport=bytes([16 * dp + tp + 1] * 16).hex())


def _round(engine: Any, now: float, rounds: int = 3) -> list[Any]:
    """A few scheduler rounds of a replica of one rank: the events its table agrees on (a failure is agreed
    in one round, fenced, and reported in a later one)."""
    table, events = engine.services.table, []
    for _ in range(rounds):
        table.encode(now)
        events += table.decode()
    return events


def _answer_lookups(engine: DecodeEngine, info: ParallelInfo, now: float) -> list[Any]:
    """Answer every ``LookUp`` the engine asks (the shape, then the ranks) from ``info``; the other actions."""
    rest: list[Any] = []
    for _ in range(4):
        actions = engine.take_actions()
        lookups = [a for a in actions if type(a) is LookUp]
        rest += [a for a in actions if type(a) is not LookUp]
        if not lookups:
            return rest
        for a in lookups:
            engine.looked_up(a.server, info if a.shape else None, {k: _rank(*k) for k in a.keys}, None, now)
    raise AssertionError("the engine kept asking")


def _bootstrapped(engine: DecodeEngine, rid: str, room: int, info: ParallelInfo, dp_rank: int | None = None) -> None:
    engine.services.table.register(rid, 0.0)
    engine.register(rid, room, SERVER, dp_rank, 0.0)
    _answer_lookups(engine, info, 0.0)
    assert engine.services.table.state(rid) == State.BOOTSTRAPPED


def test_a_grant_answered_after_another_was_refused_is_revoked_before_the_fence_closes() -> None:
    """Decode tp 1 takes both heads from prefill tp 2: two sources, two grants. The first is refused, the second
    made: the request fails, and its pages may go back only once the second grant was revoked (a write
    through it would land in pages the scheduler reused)."""
    engine = _decode()
    _bootstrapped(engine, "r", 7, _info((2,)))
    engine.announce("r", (1, 2), 0, 0.0)
    grants = [a for a in engine.take_actions() if type(a) is GrantAction]
    assert len(grants) == 2
    engine.granted(grants[0].token, None, "grant refused (as the data plane may)", 0.1)
    made = Grant(5, grants[1].source, tuple(grants[1].ranges))
    engine.granted(grants[1].token, made, None, 0.1)
    revokes = [a for a in engine.take_actions() if type(a) is Revoke]
    assert [r.grant for r in revokes] == [made], "the grant made must be revoked"
    assert not [e for e in _round(engine, 0.2) if type(e) is Failed], "pages handed back before the revoke"
    engine.revoked(revokes[0].token, None, 0.3)
    failed = [e for e in _round(engine, 0.4) if type(e) is Failed]
    assert [e.rid for e in failed] == ["r"] and "cannot grant" in failed[0].reason


def test_one_dp_groups_rank_found_dead_fails_no_request_toward_another_group() -> None:
    """A prefill deployment of two DP groups; a request bootstrapped toward group 0's rank, and group 1's rank is
    found dead before it is announced: the request is announced (granted to the transport it was bootstrapped
    with), never failed for want of a transport the look-up cache forgot with its dead sibling."""
    engine = _decode()
    info = _info((1, 1))
    _bootstrapped(engine, "healthy", 10, info, dp_rank=0)
    _bootstrapped(engine, "doomed", 11, info, dp_rank=1)
    engine.peer_dead(_rank(1, 0).endpoint, None, 1, "no traffic for 5 s", 1.0)
    engine.announce("healthy", (3,), 0, 1.0)
    grants = [a for a in engine.take_actions() if type(a) is GrantAction]
    assert [g.source for g in grants] == [bytes.fromhex(_rank(0, 0).transport)]
    assert engine.services.table.state("healthy") == State.WAITING_FOR_INPUT
    assert engine.services.table.state("doomed") == State.FAILED


def test_a_failed_data_connect_is_told_to_the_decode_rank_whose_announcement_waits_for_it() -> None:
    """Prefill adopts an announcement only once its data connection to that decode rank is up; if the connect
    fails, the room fails here, and that decode rank (not among the room's adopted announcers yet) hears it
    now: otherwise it holds its pages until its waiting timeout."""
    engine = _prefill()
    decode = "tcp://10.1.0.1:7000"
    first = _register_decode(engine, decode)
    engine.connected(first.token, None, "cannot connect the transport: refused", 0.1)  # at registration: nobody waits
    engine.services.table.register("r", 0.1)
    engine.register("r", 42, 0.1)
    engine.message(decode, wire.Announce(room=42, session_id="decode-1", epoch=1, page_ids=(0, 1),
                                         request_pool_index=0, grant=9), 0.2)
    (again,) = [a for a in engine.take_actions() if type(a) is Connect]
    engine.connected(again.token, None, "cannot connect the transport: refused again", 0.3)
    told = [a for a in engine.take_actions() if type(a) is Send and a.endpoint == decode]
    assert [(type(a.msg), a.msg.room, a.msg.state) for a in told] == [(wire.Status, 42, State.FAILED)], told
    assert "refused again" in told[0].msg.reason
    assert engine.services.table.state("r") == State.FAILED


def test_a_look_up_answer_that_breaks_the_pairing_fails_its_request_and_wedges_nothing() -> None:
    """A server lists a shape no prefill rank registers (a layout that is not even an object: a server that did
    not check what it was sent, or a client that did not check the answer; reading it raises
    ``AttributeError`` deep in the pairing). The request that needs it fails, naming the shape malformed,
    inside the engine's input; the deployment is asked again, so a request after a correct registration
    proceeds."""
    engine = _decode()
    bad = msgspec.structs.replace(_info((1,)), layout="page_bytes=4096")
    engine.services.table.register("first", 0.0)
    engine.register("first", 1, SERVER, None, 0.0)
    _answer_lookups(engine, bad, 0.0)
    failed = [e for e in _round(engine, 0.1) if type(e) is Failed]
    assert [e.rid for e in failed] == ["first"] and "malformed" in failed[0].reason, failed
    engine.settled(failed, 0.1)
    _bootstrapped(engine, "second", 2, _info((1,)))  # the corrected shape is asked for and taken


def test_a_landing_for_pages_never_announced_lands_nothing() -> None:
    """A prefill rank's ``Status(SUCCESS)`` for a room this rank bootstrapped but has not announced (nothing was
    granted: no byte can have landed) is not a landing."""
    engine = _decode()
    _bootstrapped(engine, "r", 5, _info((1,)))
    engine.message(_rank(0, 0).endpoint, wire.Status(room=5, state=State.SUCCESS, rank=0, first_token=3), 0.1)
    assert engine.services.table.state("r") == State.BOOTSTRAPPED


def test_decode_refuses_a_second_live_request_on_one_room() -> None:
    """The room joins the two sides: two live decode requests on one room would take each other's frames."""
    engine = _decode()
    table = engine.services.table
    front = DecodeFront(table=table, engine=engine, config=engine.services.config,
                        submit=lambda fn, *a: fn(*a, 0.0), result=lambda fn, *a: fn(*a, 0.0))
    front.register("a", BootstrapInfo(*SERVER, 3), 0.0)
    with pytest.raises(LocalProtocolError, match="room 3 is already held by rid 'a'"):
        front.register("b", BootstrapInfo(*SERVER, 3), 0.0)
    assert len(table) == 1 and front.diagnostics()["live"] == 1


def _landed(engine: DecodeEngine, rid: str, room: int) -> None:
    """``rid`` bootstrapped toward prefill tp 1, announced, granted, and its source's success status in."""
    _bootstrapped(engine, rid, room, _info((1,)))
    engine.announce(rid, (1,), 0, 0.1)
    (grant,) = [a for a in engine.take_actions() if type(a) is GrantAction]
    engine.granted(grant.token, Grant(1, grant.source, tuple(grant.ranges)), None, 0.1)
    engine.take_actions()
    engine.message(_rank(0, 0).endpoint, wire.Status(room=room, state=State.SUCCESS, rank=0, first_token=3), 0.2)
    assert engine.services.table.state(rid) == State.SUCCESS

def _refused_then_one_confirmed(engine: Any, keys: list[int], now: float) -> tuple[GrantAction, float]:
    """Three ticks whose revokes of the landed grants ``keys`` are all refused again (each tick retries every one
    of them: none is dropped), then a tick whose first revoke goes through: under its bound again, the engine
    grants what waited. That ``Grant`` action, and the time."""
    for _ in range(3):
        now += 0.1
        engine.tick(now)
        retried = [a for a in engine.take_actions() if type(a) is Revoke]
        assert sorted(a.grant.key for a in retried) == sorted(keys)
        for a in retried:
            engine.revoked(a.token, "revoke failed (refused)", now)
    now += 0.1
    engine.tick(now)
    retried = [a for a in engine.take_actions() if type(a) is Revoke]
    engine.revoked(retried[0].token, None, now)
    (grant,) = [a for a in engine.take_actions() if type(a) is GrantAction]
    return grant, now


def test_a_decode_rank_whose_landed_grants_revokes_keep_failing_forgets_none_and_grants_no_more_past_its_bound() -> None:
    """Decode's twin of the receiver's defect below: landed rooms' grants whose revokes keep being refused were
    kept in a list bounded at 4 x max_pending and the oldest dropped past it, live in the data plane for good.
    None may be forgotten; past the bound the next announcement's grant waits, and goes once one is confirmed."""
    engine = _decode(max_pending=1)  # the bound: 4 landed grants
    table = engine.services.table
    for i in range(4):
        rid, room = f"r{i}", 40 + i
        _bootstrapped(engine, rid, room, _info((1,)))
        engine.announce(rid, (1 + i,), 0, 0.1)
        (grant,) = [a for a in engine.take_actions() if type(a) is GrantAction]
        engine.granted(grant.token, Grant(100 + i, grant.source, tuple(grant.ranges)), None, 0.1)
        engine.take_actions()
        engine.message(_rank(0, 0).endpoint, wire.Status(room=room, state=State.SUCCESS, rank=0, first_token=3), 0.2)
        engine.settled(_round(engine, 0.3), 0.3)
        (revoke,) = [a for a in engine.take_actions() if type(a) is Revoke]
        assert revoke.token[0] == "landed" and revoke.grant.key == 100 + i
        engine.revoked(revoke.token, "revoke failed (refused)", 0.3)
    assert engine.held()["landed_grants"] == 4
    _bootstrapped(engine, "next", 50, _info((1,)))
    engine.announce("next", (6,), 0, 0.4)
    assert not [a for a in engine.take_actions() if type(a) in (GrantAction, Send)]
    assert engine.held()["waiting_announcements"] == 1 and table.state("next") == State.WAITING_FOR_INPUT
    grant, now = _refused_then_one_confirmed(engine, [100, 101, 102, 103], 0.4)
    engine.granted(grant.token, Grant(200, grant.source, tuple(grant.ranges)), None, now)
    announced = [a.msg for a in engine.take_actions() if type(a) is Send and type(a.msg) is wire.Announce]
    assert [(m.room, m.grant) for m in announced] == [(50, 200)]
    assert engine.held()["landed_grants"] == 3 and engine.held()["waiting_announcements"] == 0


def test_a_landed_room_stays_landed_whatever_its_prefill_rank_says_or_does_after() -> None:
    """Every byte and the first token are here: prefill's late word (it failed the room after a pause cost it
    another decode rank) and its death before decode's next round change nothing."""
    engine = _decode()
    _landed(engine, "late-word", 20)
    engine.message(_rank(0, 0).endpoint, wire.Status(room=20, state=State.FAILED, rank=0, reason="decode peer lost"),
                   0.3)
    _landed(engine, "lost-source", 21)
    engine.peer_dead(_rank(0, 0).endpoint, None, 1, "no traffic for 5 s", 0.4)
    assert engine.services.table.state("late-word") == State.SUCCESS
    assert engine.services.table.state("lost-source") == State.SUCCESS
    assert not [e for e in _round(engine, 0.5) if type(e) is Failed]


def test_a_repeated_landing_report_does_not_land_a_staged_room_again() -> None:
    """Device-resident pages: the room lands once its bytes were copied from host staging (``Land``, then
    ``scattered``). A duplicated ``Status`` SUCCESS that arrives after that once emitted a second ``Land``:
    a copy into pages the scheduler frees with the landing and may grant to the next request, which a revoke
    must then wait for (simulator seed 9000296)."""
    engine = _decode(staged=True)
    _bootstrapped(engine, "r", 30, _info((1,)))
    engine.announce("r", (2,), 0, 0.1)
    (grant,) = [a for a in engine.take_actions() if type(a) is GrantAction]
    engine.granted(grant.token, Grant(1, grant.source, tuple(grant.ranges)), None, 0.1)
    engine.take_actions()
    status = wire.Status(room=30, state=State.SUCCESS, rank=0, first_token=3)
    engine.message(_rank(0, 0).endpoint, status, 0.2)
    (land,) = [a for a in engine.take_actions() if type(a) is Land]
    engine.scattered(land.token, None, 0.3)
    assert engine.services.table.state("r") == State.SUCCESS
    engine.take_actions()
    engine.message(_rank(0, 0).endpoint, status, 0.4)  # the same frame, duplicated on the way
    assert not [a for a in engine.take_actions() if type(a) is Land]


def test_a_hand_over_that_waits_for_a_dropped_data_connection_resumes_once_it_is_up_again() -> None:
    """The data connection to the decode rank drops (its handle closed) after the room was bootstrapped;
    the hand-over waits for the connect made again, then posts its writes with the usage the scheduler
    recorded: the room neither fails nor loses the usage (a resumed call once lacked an argument, and the
    engine failed the room with "resuming the room failed")."""

    class Handle:
        closed = False

    engine = _prefill()
    decode = "tcp://10.1.0.1:7000"
    first = _register_decode(engine, decode)
    dropped = Handle()
    engine.connected(first.token, dropped, "", 0.1)
    engine.services.table.register("r", 0.1)
    engine.register("r", 42, 0.1)
    engine.message(decode, wire.Announce(room=42, session_id="decode-1", epoch=1, page_ids=(0, 1),
                                         request_pool_index=0, grant=9), 0.2)
    engine.take_actions()
    assert engine.services.table.state("r") == State.BOOTSTRAPPED
    dropped.closed = True  # the transport lost the connection: the next write connects again
    engine.hand_over("r", (3, 4), None, (7, None), (5, -0.5), 0.3)
    (again,) = [a for a in engine.take_actions() if type(a) is Connect]
    up = Handle()
    engine.connected(again.token, up, "", 0.4)
    posts = [a for a in engine.take_actions() if type(a) is Post]
    assert posts and all(p.handle is up for p in posts), posts
    for post in posts:
        engine.written(post.token, None, 0.5)
    told = [a.msg for a in engine.take_actions() if type(a) is Send and type(a.msg) is wire.Status]
    assert [(m.room, m.state, m.first_token, m.cached_tokens, m.first_token_logprob) for m in told] == [(42, State.SUCCESS, 7, 5, -0.5)]


# -- EPD: a prefill rank's receiver and an encode rank ----------------------------------------------------

ENCODE_SERVER = ("10.0.9.1", 9500)
ENCODER = "tcp://10.0.9.1:7000"  # the encode rank's control endpoint: a restart may come back on it
PREFILL = "tcp://10.0.1.1:7000"
ROWS, HIDDEN, DTYPE = 2, 4, "torch.float16"


class _Handle:
    closed = False


def _receiver(slots: int = 4, **services: Any) -> tuple[ReceiverEngine, Any]:
    cfg = ReceiverConfig(slots=slots, slot_rows=ROWS, hidden=HIDDEN, dtype=DTYPE, timeout=30.0)
    table = ReceiveTable(cfg.slots, cfg.slot_rows, max_requests=cfg.max_requests, max_items=cfg.max_items, rank=0,
                         ranks=1, sharded=False, timeout=cfg.timeout)
    engine = ReceiverEngine(Services(config=cfg, session_id="prefill-1", epoch=1, table=table, endpoint=b"p", **services),
                            tp_rank=0, tp_size=1, slots_addr=1 << 20)
    return engine, table


def _encoder(epoch: int, **services: Any) -> tuple[EncodeEngine, list[int]]:
    """An encode rank (tp 1), incarnation ``epoch``; the rooms it concluded, as its scheduler hears them."""
    cfg = EncodeConfig(send_buffers=[np.zeros(64, np.uint8)], tp_size=1, tp_rank=0, bootstrap_host=ENCODE_SERVER[0],
                       bootstrap_port=ENCODE_SERVER[1], park_timeout=30.0)
    concluded: list[int] = []
    engine = EncodeEngine(Services(config=cfg, session_id=f"encode-{epoch}", epoch=epoch, table=SendRooms.of(cfg),
                                   deliver=lambda kind, room, _: concluded.append(room), **services))
    return engine, concluded


def _stage(engine: ReceiverEngine, table: Any, rid: str, room: int, now: float) -> list[Any]:
    """Stage ``rid`` (one image, ``room``) and answer the look-ups and the slot's grant; the frames it sends."""
    items = [EmbeddingItem(index=0, host=ENCODE_SERVER[0], port=ENCODE_SERVER[1], room=room, rows=ROWS)]
    table.stage(rid, items, now)
    engine.staged(rid, items, now)
    info = ParallelInfo(dp_size=1, tp_sizes=(1,), layout={"role": "encode"}, registered=1, complete=True)
    rank = RankInfo(dp_rank=0, tp_rank=0, endpoint=ENCODER, session_id="encode-1", epoch=1, transport="0e" * 16)
    frames: list[Any] = []
    for key in range(1, 5):
        actions = engine.take_actions()
        frames += [a for a in actions if type(a) is Send]
        if not any(type(a) in (LookUp, GrantAction) for a in actions):
            return frames
        for a in actions:
            if type(a) is LookUp:
                engine.looked_up(a.server, info if a.shape else None, {k: rank for k in a.keys}, None, now)
            elif type(a) is GrantAction:
                engine.granted(a.token, Grant(100 * key + room, a.source, tuple(a.ranges)), None, now)
    raise AssertionError("the receiver kept asking")


def _recv_round(engine: ReceiverEngine, table: Any, now: float) -> list[tuple[str, str]]:
    """One round of a replica of one rank: the requests it settled failed (the engine hears of them)."""
    landed = table.settle(table.encode(now))
    failed = table.failed()
    engine.settled([r.rid for r in landed], failed, table.take_fencing(), now)
    return failed


def _to_encoder(encoder: EncodeEngine, frames: list[Any], now: float) -> list[Any]:
    """Deliver the receiver's ``frames`` to ``encoder`` in order; what the encoder then does."""
    for send in frames:
        assert send.endpoint == ENCODER
        encoder.message(PREFILL, send.msg, now)
    return encoder.take_actions()


def _encode_room(encoder: EncodeEngine, room: int, now: float) -> list[Any]:
    """The encode scheduler begins ``room`` and hands over its rows."""
    encoder.begin(room, now)
    encoder.send(EmbeddingChunk(room=room, source=encoder.services.config.send_buffers[0].ctypes.data, rows=ROWS,
                                hidden=HIDDEN, dtype=DTYPE, nbytes=ROWS * HIDDEN * 2), now)
    return encoder.take_actions()


def test_a_receiver_registers_again_with_an_encode_rank_heard_anew_at_the_same_endpoint() -> None:
    """The prefill rank registers with an encode rank while that one is down (killed, restarting at the same
    host:port): the frames are lost. The new incarnation introduces itself (``peer_back``) before any verdict
    against the old one came (this prefill rank never heard it). The next request must register again: the
    receiver once kept believing it was registered there, so the encode rank refused every ask of that prefill
    rank ("asked before it registered here") and ignored its aborts, holding their rooms to the park timeout
    (simulator seed 5048)."""
    receiver, table = _receiver()
    lost = _stage(receiver, table, "r1", 5, 0.0)
    assert [type(s.msg) for s in lost] == [wire.EmbedRegister, wire.EmbedAsk]  # nobody listens there
    encoder, concluded = _encoder(epoch=2)
    receiver.peer_back(ENCODER, "encode-2", 2, 0.5)
    frames = _stage(receiver, table, "r2", 6, 0.6)
    _encode_room(encoder, 6, 0.6)
    actions = _to_encoder(encoder, frames, 0.6)
    refused = [a.msg for a in actions if type(a) is Send and type(a.msg) is wire.EmbedStatus and not a.msg.ok]
    assert not refused, refused
    (connect,) = [a for a in actions if type(a) is Connect]
    encoder.connected(connect.token, _Handle(), "", 0.7)
    posts = [a for a in encoder.take_actions() if type(a) is Post]
    assert [(p.token.room, p.grant) for p in posts] == [(6, frames[-1].msg.grant)], posts


def test_a_request_whose_ask_an_encode_rank_refused_has_its_room_concluded_there_at_once() -> None:
    """The receiver's ``EmbedRegister`` is lost and its ask reaches the encode rank alone: the rank refuses it
    (it takes asks and aborts only from a prefill rank that registered there, or one that asked). The request
    fails on the prefill replica, and the encode rank, which began the room, must hear the abort now, not hold
    the room to its park timeout: the abort goes after a registration, and so does the next request's ask."""
    receiver, table = _receiver()
    encoder, concluded = _encoder(epoch=1)
    _encode_room(encoder, 5, 0.0)
    register, ask = _stage(receiver, table, "r1", 5, 0.0)
    assert type(register.msg) is wire.EmbedRegister  # lost
    (status,) = [a.msg for a in _to_encoder(encoder, [ask], 0.1) if type(a) is Send]
    assert type(status) is wire.EmbedStatus and not status.ok, status
    receiver.message(ENCODER, status, 0.2)
    assert [rid for rid, _ in _recv_round(receiver, table, 0.3)] == ["r1"]
    frames = [a for a in receiver.take_actions() if type(a) is Send]
    assert wire.Abort in [type(s.msg) for s in frames], frames
    _to_encoder(encoder, frames, 0.4)
    assert concluded == [5], f"the encode rank still holds room 5 ({encoder.held()})"
    # and the next request to that rank is not refused for the lost registration
    _encode_room(encoder, 6, 0.5)
    actions = _to_encoder(encoder, _stage(receiver, table, "r2", 6, 0.5), 0.5)
    assert not [a for a in actions if type(a) is Send and type(a.msg) is wire.EmbedStatus], actions


def test_a_receiver_whose_landed_grants_revokes_keep_failing_forgets_none_and_grants_no_more_past_its_bound() -> None:
    """Landed items' grants whose revokes the data plane keeps refusing (simulator seed 468094089: 30% of revokes
    refused while items landed fast): the receiver kept them in a list bounded at 4 x slots and dropped the oldest
    past it, which left those grants live in the data plane for good. None may be forgotten; what bounds them is
    that, while 4 x slots are unconfirmed, the next item's ask waits, and goes once a revoke is confirmed."""
    receiver, table = _receiver(slots=1)  # the bound: 4 landed grants
    bound = 4
    grants = []
    for i in range(bound):
        (ask,) = [f for f in _stage(receiver, table, f"r{i}", 10 + i, float(i)) if type(f.msg) is wire.EmbedAsk]
        receiver.message(ENCODER, wire.EmbedStatus(room=10 + i, ok=True, rank=0), float(i))
        (revoke,) = [a for a in receiver.take_actions() if type(a) is Revoke]
        assert revoke.token[0] == "landed" and revoke.grant.key == ask.msg.grant
        receiver.revoked(revoke.token, "revoke failed (refused)", float(i))
        grants.append(revoke.grant.key)
        (landed,) = table.settle(table.encode(float(i)))
        receiver.settled([landed.rid], [], table.take_fencing(), float(i))
        table.release([landed.items[0].slot])
    assert receiver.held()["landed_grants"] == bound
    # the slot is free, the next item is staged: its ask waits, with no grant made
    items = [EmbeddingItem(index=0, host=ENCODE_SERVER[0], port=ENCODE_SERVER[1], room=20, rows=ROWS)]
    table.stage("r-next", items, 5.0)
    receiver.staged("r-next", items, 5.0)
    assert not [a for a in receiver.take_actions() if type(a) in (GrantAction, Send)]
    assert receiver.held()["waiting_asks"] == 1
    grant, now = _refused_then_one_confirmed(receiver, grants, 5.0)
    assert receiver.held()["waiting_asks"] == 0 and receiver.held()["landed_grants"] == bound - 1
    receiver.granted(grant.token, Grant(999, grant.source, tuple(grant.ranges)), None, now)
    asks = [a.msg for a in receiver.take_actions() if type(a) is Send and type(a.msg) is wire.EmbedAsk]
    assert [(m.room, m.grant) for m in asks] == [(20, 999)]
