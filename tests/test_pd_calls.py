"""The scheduler's calls on real peers (``pd_pair.Pair``: a prefill and a decode peer in this
process over real sockets): what they accept, what they refuse at the call, and that a refused
call costs nothing else.

- First-token fields travel in decode's ``RemotePrefill``: ``-inf`` and NaN logprobs arrive;
  a value the ``Status`` frame cannot carry raises at the call naming the field and its limit.
- A status that still cannot be encoded when the room lands (planted white-box, below) fails
  the room on both sides within seconds: never Succeeded on prefill and a timeout on decode.
- A call for an unknown rid raises; one racing the request's end does nothing; after
  ``close`` calls raise; a hand-over before ``Bootstrapped`` fails the room and decode hears.
- Bad buffers and a bad ``poll`` replica are ``PdError``\\ s naming the argument.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest

from pdcore import BootstrapInfo, DecodeConfig, PdError, ReceiverConfig, StartError
from pdcore.control import wire
from pdcore.core.deadline import Deadline
from pdcore.core.errors import LocalProtocolError, PeerError
from raw_control import RawControl
from pd_pair import Pair, token

pytestmark = pytest.mark.timeout(120)

I31 = 2**31 - 1


@pytest.fixture
def pair() -> Any:
    p = Pair()
    yield p
    p.close()


def _bootstrapped(pair: Pair, rid: str, room: int) -> None:
    """Register ``rid`` on both sides and run the schedulers until prefill may hand it over."""
    pair.register(rid, room)
    pair.pump(lambda: pair.seen("decode", "Bootstrapped", rid), f"{rid} bootstrapped on decode")
    pair.announce(rid)
    pair.pump(lambda: pair.seen("prefill", "Bootstrapped", rid), f"{rid} bootstrapped on prefill")


def _lands(pair: Pair, rid: str) -> None:
    pair.pump(lambda: bool(pair.ended("prefill", rid) and pair.ended("decode", rid)), f"{rid} to end on both sides")
    assert pair.ended("prefill", rid) == "Succeeded" and pair.ended("decode", rid) == "RemotePrefillDone"
    assert pair.landed_intact(rid)


# -- first-token fields ---------------------------------------------------------------------


def test_minus_inf_and_nan_logprobs_reach_decode(pair: Pair) -> None:
    """Samplers produce -inf and NaN logprobs; both reach RemotePrefillDone (before: the status failed to
    encode, prefill said Succeeded and decode waited out its waiting timeout)."""
    pair.usage.update({"ninf": (7, float("-inf")), "nan": (0, float("nan")), "low": (I31, -1e300)})
    pair.register_each(pair.usage, 10)
    pair.drive(pair.usage, timeout=15.0)
    got = {rid: pair.landed[rid] for rid in pair.usage}
    assert got["ninf"].bootstrap_logprob == float("-inf") and got["ninf"].cached_tokens == 7
    assert math.isnan(got["nan"].bootstrap_logprob)
    assert got["low"].bootstrap_logprob == -1e300 and got["low"].cached_tokens == I31
    assert all(r.bootstrap_token == token(rid) for rid, r in got.items())
    assert all(pair.ended("prefill", rid) == "Succeeded" for rid in pair.usage)


def test_usage_recorded_before_the_hand_over_rides_with_it_and_a_later_one_still_arrives(pair: Pair) -> None:
    """``record_usage`` before ``send`` hands the driver nothing of its own: the finishing hand-over carries
    it (one driver input where there were two). Layer-wise, ``finish`` carries it. A record after the
    hand-over still goes, as an input of its own. Each one's values reach decode's ``RemotePrefill``."""
    handed: list[str] = []  # the inputs this (the scheduler's) thread handed the prefill driver
    front, me = pair.prefill.front, threading.current_thread()
    submit = front._submit  # the real driver's submit, as the front was given it

    def counted(fn: Any, *args: Any) -> None:  # the real driver's submit, counted
        if threading.current_thread() is me:
            handed.append(fn.__name__)
        submit(fn, *args)

    front._submit = counted
    for i, rid in enumerate(("whole", "layers", "late")):
        _bootstrapped(pair, rid, room=40 + i)
    handed.clear()
    pair.prefill.record_usage("whole", cached_tokens=11, bootstrap_logprob=-1.5)
    assert handed == []
    pair.outbox.send("whole", pair.pages("whole", "prefill"), 5)
    assert handed == ["hand_over"]

    handed.clear()
    pages = pair.pages("layers", "prefill")
    pair.prefill.record_usage("layers", cached_tokens=22, bootstrap_logprob=-2.5)
    pair.outbox.begin("layers", pages)
    pair.outbox.layers_done("layers", 1)
    pair.outbox.finish("layers", 6)
    assert handed == ["hand_over", "hand_over", "hand_over"]

    pair.outbox.send("late", pair.pages("late", "prefill"), 7)
    handed.clear()
    pair.prefill.record_usage("late", cached_tokens=33, bootstrap_logprob=-3.5)
    assert handed == ["usage"]
    pair.pump(lambda: all(pair.ended("decode", rid) for rid in ("whole", "layers")), "whole and layers to land")
    got = {rid: (pair.landed[rid].cached_tokens, pair.landed[rid].bootstrap_logprob) for rid in ("whole", "layers")}
    assert got == {"whole": (11, -1.5), "layers": (22, -2.5)}
    assert pair.prefill.diagnostics()["front"]["usage"] <= 1  # ended rids leave nothing behind ("late" may)


def _usage(**kw: Any) -> Any:
    args = {"cached_tokens": 1, "bootstrap_logprob": -0.5, **kw}
    return lambda pair, rid: pair.prefill.record_usage(rid, **args)


def _send(first: Any = 1, cands: Any = None) -> Any:
    return lambda pair, rid: pair.outbox.send(rid, pair.pages(rid, "prefill"), first, cands)


def _finish(first: Any = 1, cands: Any = None) -> Any:
    return lambda pair, rid: pair.outbox.finish(rid, first, cands)


# (id, the bad call, what the error must name)
BAD_CALLS = [
    ("cached-too-big", _usage(cached_tokens=I31 + 1), ["cached_tokens", str(I31)]),
    ("cached-negative", _usage(cached_tokens=-1), ["cached_tokens", str(I31)]),
    ("cached-float", _usage(cached_tokens=1.5), ["cached_tokens", "int"]),
    ("logprob-plus-inf", _usage(bootstrap_logprob=float("inf")), ["bootstrap_logprob", "inf"]),
    ("logprob-str", _usage(bootstrap_logprob="-0.5"), ["bootstrap_logprob", "float"]),
    ("send-token-too-big", _send(first=I31 + 1), ["first_token", str(I31)]),
    ("send-token-negative", _send(first=-1), ["first_token", str(I31)]),
    ("send-257-candidates", _send(cands=[1] * (wire.MAX_CANDIDATES + 1)), ["spec_candidate_ids", "257", "256"]),
    ("send-candidate-too-big", _send(cands=[3, I31 + 1]), ["spec_candidate_ids[1]", str(I31)]),
    ("send-candidates-str", _send(cands="12"), ["spec_candidate_ids"]),
    ("finish-token-too-big", _finish(first=2**40), ["first_token", str(I31)]),
    ("finish-257-candidates", _finish(cands=np.arange(257)), ["spec_candidate_ids", "256"]),
]


@pytest.mark.parametrize(("call", "names"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_a_value_the_status_cannot_carry_raises_at_the_call_and_costs_nothing_else(
    pair: Pair, call: Any, names: list[str]
) -> None:
    _bootstrapped(pair, "r", room=5)
    with pytest.raises(LocalProtocolError) as info:
        call(pair, "r")
    assert all(n in str(info.value) for n in names), str(info.value)
    assert "'r'" in str(info.value)  # and the request
    pair.send("r")  # the same request, handed over properly: nothing of the bad call stuck to it
    _lands(pair, "r")
    assert pair.landed["r"].bootstrap_logprob == -0.5 and pair.landed["r"].cached_tokens == 1


def test_a_request_pool_index_the_announcement_cannot_carry_raises_at_announce(pair: Pair) -> None:
    pair.register("r", room=5)
    pair.pump(lambda: pair.seen("decode", "Bootstrapped", "r"), "r bootstrapped on decode")
    with pytest.raises(LocalProtocolError, match=f"request_pool_index {I31 + 1} is outside 0..{I31}"):
        pair.inbox.announce("r", pair.pages("r", "decode"), I31 + 1)
    pair.drive(["r"])  # announced properly now
    _lands(pair, "r")


def test_a_status_that_cannot_be_encoded_when_the_room_lands_fails_both_sides_within_seconds(pair: Pair) -> None:
    """White-box: the outbox's checks refuse every such value at the call, so the test plants one past
    them (an out-of-range candidate handed straight to the front's internal ``_hand_over``). The room's
    KV lands; the Status cannot be encoded; prefill must fail the room (not report Succeeded, which frees
    its pages) and tell decode why, well before decode's waiting timeout (30 s here)."""
    front = pair.prefill.front
    real = front._hand_over

    def planted(rid: str, pages: Any, upto: Any, finish: Any, now: float) -> None:
        real(rid, pages, upto, (finish[0], (1, I31 + 1)), now)  # past PrefillOutbox.send, which validated the call

    front._hand_over = planted  # type: ignore[method-assign]
    pair.register("bad", room=1)
    pair.register("good", room=2)
    pair.drive(["bad"], timeout=10.0)
    assert pair.ended("prefill", "bad") == "Failed" and pair.ended("decode", "bad") == "Failed"
    for side in ("prefill", "decode"):
        reason = pair.reasons[(side, "bad")]
        assert "status cannot be sent" in reason and "spec_candidate_ids" in reason, (side, reason)
    del front._hand_over  # the class's method again
    pair.drive(["good"])
    _lands(pair, "good")  # the peers serve on


# -- rids: unknown, just ended, forgotten; closed peers --------------------------------------


def _every_call(pair: Pair, rid: str) -> list[tuple[str, Any]]:
    return [
        ("send", lambda: pair.outbox.send(rid, [1], 1)),
        ("begin", lambda: pair.outbox.begin(rid, [1])),
        ("layers_done", lambda: pair.outbox.layers_done(rid, 1)),
        ("finish", lambda: pair.outbox.finish(rid, 1)),
        ("record_usage", lambda: pair.prefill.record_usage(rid, 1, -0.5)),
        ("announce", lambda: pair.inbox.announce(rid, [1], 0)),
    ]


def test_calls_for_a_rid_never_registered_raise_naming_it(pair: Pair) -> None:
    for name, call in _every_call(pair, "never"):
        with pytest.raises(LocalProtocolError, match=rf"{name}\('never'\): no such request"):
            call()
    pair.register("r", room=3)  # nothing leaked: the peers serve a request as before
    pair.drive(["r"])
    _lands(pair, "r")


def test_calls_racing_a_requests_end_do_nothing_and_a_forgotten_rid_raises() -> None:
    """A scheduler hears of an end one round late: a send/announce for a request that just ended is no
    error (it does nothing); once ``tombstone_ttl`` passed the rid is unknown again."""
    pair = Pair(tombstone_ttl=1.0)
    try:
        pair.register("a", room=1)
        pair.register("b", room=2)
        pair.drive(["a"])
        _lands(pair, "a")
        events = {side: list(evs) for side, evs in pair.events.items()}
        for _name, call in _every_call(pair, "a"):
            call()  # just ended: nothing happens
        pair.drive(["b"])
        _lands(pair, "b")
        assert all(pair.events[side][: len(evs)] == evs for side, evs in events.items())
        assert not [e for side in pair.events for e in pair.events[side] if e[1] == "a"][4:]  # no new event for a
        deadline = Deadline.after(10.0)
        while pair.prefill.front.lately_ended("a") or pair.decode.front.lately_ended("a"):  # forgotten after the ttl
            assert not deadline.expired(), "the ended rid was never forgotten"
            pair.rounds(1)
        for name, call in _every_call(pair, "a"):
            with pytest.raises(LocalProtocolError, match=rf"{name}\('a'\): no such request"):
                call()
    finally:
        pair.close()


def test_calls_on_a_closed_peer_raise_peer_error() -> None:
    pair = Pair()
    pair.register("r", room=1)
    pair.close()
    info = BootstrapInfo("127.0.0.1", pair.port, 2)
    for call in (lambda: pair.prefill.register("z", info), lambda: pair.decode.register("z", info),
                 lambda: pair.outbox.send("r", [1], 1), lambda: pair.inbox.announce("r", [1], 0),
                 lambda: pair.prefill.poll(None)):
        with pytest.raises(PeerError, match="closed"):
            call()


def test_a_hand_over_after_only_some_decode_ranks_announced_fails_the_room_on_every_rank() -> None:
    """Prefill tp 1 writes both heads to decode tp 2, so its Bootstrapped waits for two announcements.
    Its scheduler hands the request over after only decode rank 0 announced. Before, prefill wrote to
    rank 0 alone and reported Succeeded, and rank 1, announcing later, waited out its timeout (20 s
    here); now the room fails here and both decode ranks hear of it within seconds. (A hand-over
    before any announcement: tests/test_peers.py.)"""
    from test_kv_hetero import Hetero

    from pdcore.kv import KvLayout

    h = Hetero(KvLayout(order="hnd", kv_heads=2, head_bytes=64, page_tokens=4, layers=1), 1, 2)
    try:
        (prefill, outbox, _), decode = h.prefill[0], h.decode
        info = BootstrapInfo("127.0.0.1", h.port, 7)
        for peer in [prefill] + [d[0] for d in decode]:
            peer.register("r", info)
        ended: dict[tuple[str, int], str] = {}
        seen: set[tuple[str, int]] = set()

        def rounds(ranks: list[tuple[str, int, Any]]) -> None:
            for side, rank, peer in ranks:
                for event in peer.poll(None):
                    seen.add((type(event).__name__, rank) if side == "decode" else (side, rank))
                    if type(event).__name__ != "Bootstrapped":
                        ended[(side, rank)] = f"{type(event).__name__}: {getattr(event, 'reason', '')}"

        ranks = [("prefill", 0, prefill)] + [("decode", d, decode[d][0]) for d in range(2)]
        deadline = Deadline.after(10.0)
        while not {("Bootstrapped", 0), ("Bootstrapped", 1)} <= seen:
            assert not deadline.expired(), "decode never bootstrapped"
            rounds(ranks[1:])
        decode[0][1].announce("r", [0, 1], 0)
        entry = prefill._engine._by_rid["r"]
        while not entry.dsts:  # prefill adopted rank 0's announcement (white-box: rank 1 has not announced)
            assert not deadline.expired(), "prefill never took the announcement"
            rounds(ranks[1:])
        outbox.send("r", [4, 5], 3)  # too early: rank 1 has not announced
        decode[1][1].announce("r", [0, 1], 0)
        while len(ended) < 3:
            assert not deadline.expired(), f"not every rank ended the request: {ended}"
            rounds(ranks)
        assert all(v.startswith("Failed") for v in ended.values()), ended
        assert "handed over before a decode rank announced" in ended[("prefill", 0)], ended
        assert "wait for Bootstrapped" in ended[("prefill", 0)], ended
    finally:
        h.close()


# -- buffers and replicas --------------------------------------------------------------------


def _read_only() -> np.ndarray:
    a = np.zeros(4 * 4096, np.uint8)
    a.flags.writeable = False
    return a


BAD_BUFFERS = [
    ("read-only-array", _read_only, "read-only"),
    ("bytearray", lambda: bytearray(4 * 4096), "bytearray"),
    ("bytes", lambda: bytes(4 * 4096), "bytes"),
    ("not-contiguous", lambda: np.zeros((4, 2 * 4096), np.uint8)[:, ::2], "contiguous"),
    ("addr-length-pair", lambda: (4096, 4 * 4096), "tuple"),
    ("list", lambda: [0] * 16, "list"),
]


@pytest.mark.parametrize(("make", "why"), [b[1:] for b in BAD_BUFFERS], ids=[b[0] for b in BAD_BUFFERS])
def test_a_buffer_the_transport_cannot_safely_write_is_refused_naming_it(make: Any, why: str) -> None:
    good = np.zeros(4 * 4096, np.uint8)
    with pytest.raises(StartError, match=rf"DecodeConfig\.kv_buffers\[1\]: .*{why}"):
        DecodeConfig(kv_buffers=[good, make()], page_bytes=4096, num_pages=4)
    with pytest.raises(StartError, match=rf"ReceiverConfig\.buffer: .*{why}"):
        ReceiverConfig(slots=1, slot_rows=1, hidden=4, dtype="torch.float32", buffer=make())


@pytest.mark.parametrize("replica", ["group", 3, object()], ids=["str", "int", "object"])
def test_poll_refuses_a_replica_that_is_not_a_process_group(pair: Pair, replica: object) -> None:
    pair.register("r", room=1)
    for peer in (pair.prefill, pair.decode):
        with pytest.raises(LocalProtocolError, match="replica must be") as info:
            peer.poll(replica)
        assert isinstance(info.value, PdError) and type(replica).__name__ in str(info.value)
    pair.drive(["r"])  # the rounds refused changed nothing
    _lands(pair, "r")


# -- messages --------------------------------------------------------------------------------


def test_a_page_size_mismatch_names_both_sides_on_decode() -> None:
    pair = Pair(decode={"page_bytes": 2048})
    try:
        pair.register("r", room=1)
        pair.pump(lambda: bool(pair.ended("decode", "r")), "decode to fail the request")
        reason = pair.reasons[("decode", "r")]
        assert "page sizes" in reason and "prefill's [4096, 4096]" in reason and "decode's [2048, 2048]" in reason, reason
    finally:
        pair.close()


@pytest.mark.parametrize("plane", ["zmq", "tcp"])
def test_a_page_size_mismatch_names_both_sides_on_prefill(plane: str) -> None:
    """A decode rank that registers other page sizes with prefill (a raw control client plays it: a real
    decode peer refuses the pairing before it registers): the room it announces fails naming both."""
    pair = Pair(control=plane)
    sock = RawControl(pair.prefill.control_endpoint, plane, "tcp://127.0.0.1:9")
    try:
        layout = {"bases": [1 << 20, 1 << 21], "page_bytes": [2048, 2048], "num_pages": 64}
        sock.send(wire.encode(wire.Register(session_id="other", epoch=1, endpoint=b"x", regions=(), layout=layout,
                                            tp_size=1, tp_rank=0)))
        pair.register("r", room=9, decode=False)
        sock.send(wire.encode(wire.Announce(room=9, session_id="other", epoch=1, page_ids=(0,), request_pool_index=0)))
        pair.pump(lambda: bool(pair.ended("prefill", "r")), "prefill to fail the room")
        reason = pair.reasons[("prefill", "r")]
        assert "page sizes differ" in reason and "decode rank 0/1 has [2048, 2048]" in reason, reason
        assert "prefill rank 0/1 expects [4096, 4096]" in reason, reason
    finally:
        sock.close()
        pair.close()


def test_diagnostics_say_what_a_peer_holds_while_a_request_is_held_and_that_nothing_is_left_after(pair: Pair) -> None:
    """``diagnostics()`` is the read-only snapshot the metrics, demo, chaos and tests read: while decode's pages
    are granted and prefill holds the room, both sides say so; once the request ended, nothing is held."""
    pair.register("held", room=61)
    pair.pump(lambda: pair.seen("decode", "Bootstrapped", "held"), "decode to bootstrap")
    pair.announce("held")
    pair.pump(lambda: pair.seen("prefill", "Bootstrapped", "held"), "prefill to hear the announcement")
    pair.decode.quiesce()
    d, p = pair.decode.diagnostics(), pair.prefill.diagnostics()
    assert d["engines"]["decode"]["grants"] == 1 and d["front"]["live"] == 1 and d["table"]["tracked"] == 1
    assert p["engines"]["prefill"]["rooms"] == 1 and p["front"]["rooms"] == 1 and p["role"] == "prefill"
    assert d["queues"]["parked_posts"] == 0 and p["channel"]["protocol_errors"] == 0
    pair.drive(["held"])
    _lands(pair, "held")
    for peer in (pair.prefill, pair.decode):
        peer.quiesce()
        snap = peer.diagnostics()
        held = {k: v for k, v in snap["engines"][peer.ROLE].items() if v and k not in ("tombstones", "connected_peers")}
        assert not held and snap["front"]["live"] == 0 and snap["table"]["tracked"] == 0, (peer.ROLE, snap)
