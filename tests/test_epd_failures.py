"""EPD failures end the right requests on every prefill rank, and nothing else.

Real processes only: a prefill replica of tp 2 (``replica.run_replica``, a real gloo group; the ranks
are ``_epd_children.prefill_rank``) receives image embeddings from encode ranks that run in the test
process (``_epd_children.Encoder``) or in a child process of their own (``run_encode``) when the
test kills or stops them. One bootstrap server per encode deployment and one for the prefill
deployment. Every wait has a deadline; the ranks report what they see, with monotonic times (one
clock for every process on the host), and the test judges:

1. an encode rank SIGKILLed mid-transfer: the requests waiting for it fail on every rank in the same
   round, within ``dead_after`` plus slack, naming the lost rank; another deployment's requests land;
2. ``Sender.fail``: the request fails with that reason on every rank, whether a rank asked before
   the fail or only after it;
3. ``Sender.begin`` of a room that is begun and not concluded returns False, and the holder's
   transfer is untouched;
4. a chunk that does not fit the receiver (hidden, dtype, span): that request fails naming the field,
   the encode side concludes the room, a good request of the same round lands;
5. timeouts: the receiver's ``timeout`` on every rank; the encode side's ``park_timeout``.

Where a rank's own decision matters the replica is *held* (no rounds): each rank reports its own
``poll`` codes, and once every rank decided, one ``step`` settles them. Every rank reports the same
reason for a failed request, the one of the lowest rank that failed it itself (even a rank that never
saw the failure), which is the agreement working.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from _epd_children import Child, Encoder, Replica, items, run_encode
from pdcore.control.bootstrap import BootstrapServer

HEARTBEAT = 0.25
DEAD_AFTER = 2.0  # the prefill ranks judge a silent encode rank dead after this
SLACK = 2.0  # for the heartbeat period, the worker's tick, a round, and a loaded 2-core machine
FAR = 120.0  # every timer a test does not exercise
START = 60.0  # seconds for the processes to come up (a rank imports torch)
LIFETIME = 90.0  # a child's own deadline for its whole loop

HIDDEN = 8
DTYPE = "torch.float32"
PREFILL_KNOBS = dict(heartbeat_interval=HEARTBEAT, dead_after=DEAD_AFTER)
ENCODE_KNOBS = dict(heartbeat_interval=HEARTBEAT, dead_after=10.0, park_timeout=FAR)


def receiver(**over: Any) -> dict[str, Any]:
    return {"slots": 4, "slot_rows": 16, "hidden": HIDDEN, "dtype": DTYPE, "timeout": FAR, **over}


@pytest.fixture
def servers() -> Iterator[Any]:
    """A factory of bootstrap servers (one per deployment), all closed at the end."""
    made: list[BootstrapServer] = []

    def make() -> int:
        server = BootstrapServer(host="127.0.0.1", port=0)
        made.append(server)
        return server.start()

    yield make
    for server in made:
        server.close()


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    """Whatever a test registers here is closed (replicas stopped, children reaped, peers closed)."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        try:
            if isinstance(thing, Replica):
                thing.abandon()
            else:
                thing.close()
        except Exception:
            pass


def _encoder_and_replica(servers: Any, cleanup: list[Any], **over: Any) -> tuple[int, Encoder, Replica]:
    """One encode rank (in this process) and a prefill replica (its receiver: ``receiver(**over)``), each
    with its own bootstrap server, the replica's ranks started: the encode server's port, the encoder,
    the replica."""
    pport, eport = servers(), servers()
    enc = Encoder(eport, ENCODE_KNOBS, 1 << 16)
    cleanup.append(enc)
    rep = Replica(pport, PREFILL_KNOBS, receiver(**over), lifetime=LIFETIME)
    cleanup.append(rep)
    rep.wait("ready", seconds=START, what="the prefill ranks to start")
    return eport, enc, rep


def _one(per_rank: dict[int, Any], key: str) -> Any:
    values = {r: p[key] for r, p in per_rank.items()}
    assert len(set(values.values())) == 1, f"the ranks differ on {key}: {values}"
    return next(iter(values.values()))


def _settled(rep: Replica) -> dict[str, set[str]]:
    """Every rid that landed or failed, on any rank."""
    return {
        "landed": {p["rid"] for _r, p in rep.all("landed")},
        "failed": {p["rid"] for _r, p in rep.all("failed")},
    }


def _intact(landed: dict[int, Any], what: str) -> None:
    for rank, p in landed.items():
        assert p["intact"] and p["canary"] == 0, f"{what}: rank {rank}'s rows are not the encode rank's rows: {p}"


# ------------------------------------------------------------------------------------------ 1. SIGKILL


@pytest.mark.timeout(180)
def test_a_killed_encode_rank_fails_its_requests_on_every_rank_in_one_round_and_nothing_else(servers, cleanup) -> None:
    pport, e1port, e2port = servers(), servers(), servers()
    e1 = Child("encode-1", run_encode, e1port, ENCODE_KNOBS, 1 << 16, LIFETIME)
    cleanup.append(e1)
    e2 = Encoder(e2port, ENCODE_KNOBS, 1 << 16)
    cleanup.append(e2)
    rep = Replica(pport, PREFILL_KNOBS, receiver(), lifetime=LIFETIME)
    cleanup.append(rep)
    e1_endpoint = e1.wait("ready", START, "encode-1 to start")["endpoint"]
    rep.wait("ready", seconds=START, what="the prefill ranks to start")

    A1, A2, B1, B2 = 0x1A1, 0x1A2, 0x2B1, 0x2B2
    assert e1.call("begin", A1) and e1.call("begin", A2)
    e1.call("put", A1, 10, HIDDEN, DTYPE, "pattern")  # A2's rows never come: encode-1 dies first
    assert e2.begin(B1) and e2.begin(B2)
    rep.send("stage", "victim", items(e1port, (A1, 10), (A2, 12)))
    rep.send("stage", "bystander-1", items(e2port, (B1, 7)))
    rep.send("stage", "bystander-2", items(e2port, (B2, 16)))
    rep.wait("stats", where=lambda s: s["asks"] >= 4 and s["landed"] >= 1, seconds=20,
             what="every item asked and the victim's first item landed on every rank")
    assert _settled(rep) == {"landed": set(), "failed": set()}, "something settled before the kill"

    os.kill(e1.pid, signal.SIGKILL)  # mid-transfer: one of the victim's items landed, one is owed
    killed_at = time.monotonic()
    e1.proc.join(10)
    assert not e1.proc.is_alive()
    e2.put(B1, 7, HIDDEN, DTYPE)  # in flight while the victim waits for its dead encode rank

    failed = rep.wait("failed", "victim", seconds=DEAD_AFTER + SLACK + 10, what="the victim to fail")
    e2.put(B2, 16, HIDDEN, DTYPE)  # in flight while the victim's slots are fenced
    landed1 = rep.wait("landed", "bystander-1", seconds=10, what="bystander-1 to land")
    landed2 = rep.wait("landed", "bystander-2", seconds=10, what="bystander-2 to land")
    rep.send("check", "bystander-1")
    recheck = rep.wait("checked", "bystander-1", seconds=10, what="bystander-1's rows checked after the fence")
    fenced = rep.wait("stats", where=lambda s: s["fenced"] >= 2, seconds=10, what="both of the victim's slots fenced")
    results = rep.close()

    round_no = _one(failed, "round")
    after = {r: p["t"] - killed_at for r, p in failed.items()}
    reasons = {r: p["reason"] for r, p in failed.items()}
    print(f"victim failed in round {round_no}, {after} s after the kill: {reasons}; fenced {fenced}; done {results}")
    assert all(0 < a <= DEAD_AFTER + SLACK for a in after.values()), f"not within dead_after + slack: {after}"
    named = [r for r, why in reasons.items() if e1_endpoint in why]
    assert named, f"no rank's reason names the lost encode rank {e1_endpoint}: {reasons}"
    assert all(why == reasons[0] for why in reasons.values()), f"the ranks report different reasons: {reasons}"
    assert _settled(rep) == {"landed": {"bystander-1", "bystander-2"}, "failed": {"victim"}}
    _one(landed1, "round")
    _one(landed2, "round")
    _intact(landed1, "bystander-1")
    _intact(landed2, "bystander-2")
    _intact(recheck, "bystander-1 after the victim's fence")
    assert all(not r["staged"] for r in results), results
    assert [r["stats"]["fenced"] for r in results] == [2, 2], f"fenced other than the victim's two slots: {results}"


# ------------------------------------------------------------------------------------------ 2. Sender.fail


def _code(code: int) -> Any:
    return lambda p: p["code"] == code


def _latest(rep: Replica, kind: str, rid: str, rank: int) -> Any:
    mine = [p for r, p in rep.all(kind) if r == rank and p.get("rid") == rid]
    return mine[-1] if mine else None


def _step(rep: Replica, rid: str, kind: str, what: str) -> dict[int, Any]:
    """Every rank decided ``rid`` on its own: one round settles it; its report per rank."""
    rep.send("step")
    return rep.wait(kind, rid, seconds=15, what=what)


@pytest.mark.timeout(180)
def test_a_room_the_encode_scheduler_fails_fails_with_its_reason_on_every_rank_asked_before_or_after(
        servers, cleanup) -> None:
    eport, enc, rep = _encoder_and_replica(servers, cleanup, slots=2)
    FA, PA, BL, FC, FB = 0x2FA, 0x2BA, 0x2B1, 0x2FC, 0x2FB
    why = {FA: "why-a: the image could not be decoded", FC: "why-c: the encoder ran out of memory",
           FB: "why-b: the request was cancelled upstream"}
    rep.send("hold", True)

    # a: every rank asked before the fail. The probe pa is asked after fa on the same control
    # connections, so once pa's rows landed on every rank, the encode rank holds fa's asks.
    assert enc.begin(FA) and enc.begin(PA)
    enc.put(PA, 5, HIDDEN, DTYPE)
    rep.send("stage", "fa", items(eport, (FA, 6)))
    rep.send("stage", "pa", items(eport, (PA, 5)))
    rep.wait("local", "pa", where=_code(2), seconds=20, what="the probe to land on every rank")
    assert all(_latest(rep, "local", "fa", r)["code"] == 1 for r in range(2)), "fa ended before the fail"
    enc.fail(FA, why[FA])
    rep.wait("local", "fa", where=_code(0), seconds=10, what="every rank to hear that fa failed")
    fa = _step(rep, "fa", "failed", "fa to fail")
    pa = rep.wait("landed", "pa", seconds=5, what="the probe to land")
    assert _one(fa, "round") == _one(pa, "round")
    for rank, p in fa.items():
        assert why[FA] in p["reason"], f"rank {rank} failed fa for another reason: {p['reason']!r}"
    _intact(pa, "the probe")

    # c: rank 0 asks before the fail, rank 1 only after it (its slots are leased until it releases one)
    assert enc.begin(BL)
    enc.put(BL, 4, HIDDEN, DTYPE)
    rep.send("stage", "blk", items(eport, (BL, 4)))
    rep.wait("local", "blk", where=_code(2), seconds=20, what="blk to land (in fa's fenced slot)")
    _intact(_step(rep, "blk", "landed", "blk to land"), "blk")
    rep.send("release", "pa", [0])  # rank 0 copied pa's rows out; rank 1 still holds both its slots
    rep.wait("released", "pa", ranks=[0], seconds=10, what="rank 0 to release pa")
    asks = {r: max(p["asks"] for rr, p in rep.all("stats") if rr == r) for r in range(2)}
    assert enc.begin(FC)
    rep.send("stage", "fc", items(eport, (FC, 6)))
    rep.wait("stats", where=lambda s: s["asks"] > asks[0], ranks=[0], seconds=10, what="rank 0 to ask for fc")
    rep.wait("local", "fc", where=_code(1), ranks=[1], seconds=10, what="rank 1 to stage fc (no slot to ask with)")
    enc.fail(FC, why[FC])
    rep.wait("local", "fc", where=_code(0), ranks=[0], seconds=10, what="rank 0 to hear that fc failed")
    assert _latest(rep, "local", "fc", 1)["code"] == 1, "rank 1 settled fc on its own before it asked"
    assert max(p["asks"] for r, p in rep.all("stats") if r == 1) == asks[1], "rank 1 asked without a free slot"
    rep.send("release", "blk", [1])  # now rank 1 has a slot: it asks, after the fail
    rep.wait("stats", where=lambda s: s["asks"] > asks[1], ranks=[1], seconds=10, what="rank 1 to ask for fc")
    rep.wait("local", "fc", where=_code(0), ranks=[1], seconds=10, what="rank 1 to hear that fc failed")
    fc = _step(rep, "fc", "failed", "fc to fail")
    _one(fc, "round")
    for rank, p in fc.items():
        assert why[FC] in p["reason"], f"rank {rank} failed fc for another reason: {p['reason']!r}"

    # b: the room failed before any rank asked for it
    rep.send("release", "blk", [0])
    rep.send("release", "pa", [1])
    assert enc.begin(FB)
    enc.fail(FB, why[FB])
    rep.send("stage", "fb", items(eport, (FB, 3)))
    rep.wait("local", "fb", where=_code(0), seconds=10, what="every rank to hear that fb failed")
    fb = _step(rep, "fb", "failed", "fb to fail")
    _one(fb, "round")
    for rank, p in fb.items():
        assert why[FB] in p["reason"], f"rank {rank} failed fb for another reason: {p['reason']!r}"

    concluded = enc.wait_concluded({FA, PA, BL, FC, FB}, 10)
    assert {FA, PA, BL, FC, FB} <= set(concluded), f"the encode rank did not conclude every room: {concluded}"
    results = rep.close()
    assert _settled(rep) == {"landed": {"pa", "blk"}, "failed": {"fa", "fc", "fb"}}
    assert all(not r["staged"] for r in results), results


# ------------------------------------------------------------------------------------------ 3. room held


@pytest.mark.timeout(180)
def test_begin_refuses_a_room_that_is_begun_and_not_concluded(servers, cleanup) -> None:
    eport, enc, rep = _encoder_and_replica(servers, cleanup, slots=3)
    R, Q, P = 0x3A, 0x3B, 0x3C

    # a room with nothing yet, then with its rows: held
    assert enc.begin(R) is True
    assert enc.begin(R) is False, "begin took a room another request holds (nothing handed over yet)"
    enc.put(R, 9, HIDDEN, DTYPE)
    assert enc.begin(R) is False, "begin took a room another request holds (rows handed over)"
    # a room the prefill ranks asked for first (parked asks, not begun): begin takes it, once
    assert enc.begin(P)
    enc.put(P, 2, HIDDEN, DTYPE)
    rep.send("stage", "r", items(eport, (R, 9)))
    rep.send("stage", "q", items(eport, (Q, 11)))
    rep.send("stage", "p", items(eport, (P, 2)))  # asked after q's asks: once p lands, q's are parked
    r = rep.wait("landed", "r", seconds=20, what="r to land")
    rep.wait("landed", "p", seconds=20, what="the probe to land")
    assert not rep.seen("landed", "q") and not rep.seen("failed", "q")
    assert enc.begin(Q) is True, "parked asks alone must not hold a room"
    assert enc.begin(Q) is False, "begin took a room another request holds (parked asks adopted)"
    enc.put(Q, 11, HIDDEN, DTYPE)
    q = rep.wait("landed", "q", seconds=20, what="q to land")
    _intact(r, "r")
    _intact(q, "q")

    # once concluded, the room takes a new request; while that one holds it, begin refuses again
    concluded = enc.wait_concluded({R, Q}, 10)
    assert {R, Q} <= set(concluded), concluded
    assert enc.begin(R) is True, "a concluded room must take a new request"
    assert enc.begin(R) is False
    enc.fail(R, "the second request was cancelled")
    assert _concluded_once(enc, R), "a failed room nobody asked for concludes at once, once"
    assert enc.begin(R) is True, "a failed (concluded) room must take a new request"
    enc.fail(R, "cleanup")
    assert _concluded_once(enc, R)
    results = rep.close()
    assert _settled(rep) == {"landed": {"r", "q", "p"}, "failed": set()}
    assert all(not res["staged"] for res in results), results


def _concluded_once(enc: Encoder, room: int, seconds: float = 5.0) -> bool:
    """``concluded()`` hands ``room`` back within ``seconds`` (the engine concludes it on its own thread),
    exactly once, and nothing else with it."""
    deadline = time.monotonic() + seconds
    got: list[int] = []
    while not got and time.monotonic() < deadline:
        got = enc.newly_concluded()
        time.sleep(0.005)  # a short pause inside a deadline-bounded poll
    return got == [room] and enc.newly_concluded() == []


# ------------------------------------------------------------------------------------------ 4. mismatches


@pytest.mark.timeout(180)
def test_a_chunk_that_does_not_fit_fails_only_its_request_naming_the_field(servers, cleanup) -> None:
    eport, enc, rep = _encoder_and_replica(servers, cleanup)
    H, D, S, G = 0x4A, 0x4D, 0x45, 0x46
    for room in (H, D, S, G):
        assert enc.begin(room)
    enc.put(H, 5, 2 * HIDDEN, DTYPE)  # rows of 16 elements; the receiver's have 8
    enc.put(D, 5, HIDDEN, "torch.float16")  # the receiver's are float32
    enc.put(S, 6, HIDDEN, DTYPE)  # the request's item has 5 rows
    enc.put(G, 5, HIDDEN, DTYPE)
    rep.send("hold", True)
    for rid, room in (("h", H), ("d", D), ("s", S), ("g", G)):
        rep.send("stage", rid, items(eport, (room, 5)))
    for rid in ("h", "d", "s"):
        rep.wait("local", rid, where=_code(0), seconds=20, what=f"every rank to hear that {rid} failed")
    rep.wait("local", "g", where=_code(2), seconds=20, what="the good request to land on every rank")
    rep.send("step")
    failed = {rid: rep.wait("failed", rid, seconds=15, what=f"{rid} to fail") for rid in ("h", "d", "s")}
    g = rep.wait("landed", "g", seconds=15, what="the good request to land")
    assert len({_one(p, "round") for p in failed.values()} | {_one(g, "round")}) == 1, "not settled in one round"
    _intact(g, "the good request")
    expect = {
        "h": ["hidden: ", f"expects {HIDDEN}, the rows have {2 * HIDDEN}"],
        "d": ["dtype: ", f"expects {DTYPE}, the rows are torch.float16"],
        "s": ["span: ", "expects 5 rows, the image has 6"],
    }
    for rid, per_rank in failed.items():
        for rank, p in per_rank.items():
            reason = p["reason"]
            assert all(text in reason for text in expect[rid]), f"rank {rank} failed {rid} for {reason!r}"
            others = [f for f in ("hidden: ", "dtype: ", "span: ") if f != expect[rid][0]]
            assert not any(f in reason for f in others), f"{rid}'s reason names another field: {reason!r}"
    concluded = enc.wait_concluded({H, D, S, G}, 10)
    assert {H, D, S, G} <= set(concluded), f"the encode rank did not conclude every room: {concluded}"
    results = rep.close()
    assert _settled(rep) == {"landed": {"g"}, "failed": {"h", "d", "s"}}
    assert all(not r["staged"] for r in results), results


# ------------------------------------------------------------------------------------------ 5. timeouts

TIMEOUT = 3.0  # the receiver's
PARK = 1.0  # the short-parking encode deployment's


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_timeouts_end_the_request_on_every_rank_and_the_room_on_the_encode_rank(servers, cleanup) -> None:
    pport, eport, qport = servers(), servers(), servers()
    slow = Encoder(eport, ENCODE_KNOBS, 1 << 16)  # parks for FAR: the receiver's timeout comes first
    cleanup.append(slow)
    quick = Encoder(qport, {**ENCODE_KNOBS, "park_timeout": PARK}, 1 << 16)
    cleanup.append(quick)
    rep = Replica(pport, PREFILL_KNOBS, receiver(slots=1, timeout=TIMEOUT), lifetime=LIFETIME)
    cleanup.append(rep)
    rep.wait("ready", seconds=START, what="the prefill ranks to start")
    TA, PB, HB, PC = 0x5A, 0x5B, 0x5C, 0x5D
    rep.send("hold", True)

    # a: the encode rank never sends: every rank times the request out itself, after TIMEOUT
    assert slow.begin(TA)
    rep.send("stage", "ta", items(eport, (TA, 4)))
    staged = rep.wait("staged", "ta", seconds=10, what="ta staged")
    local = rep.wait("local", "ta", where=_code(0), seconds=TIMEOUT + SLACK + 10, what="every rank to time ta out")
    ta = _step(rep, "ta", "failed", "ta to fail")
    _one(ta, "round")
    for rank in range(2):
        waited = local[rank]["t"] - staged[rank]["t"]
        assert TIMEOUT <= waited <= TIMEOUT + SLACK, f"rank {rank} timed ta out after {waited:.2f} s"
        assert f"timeout after {TIMEOUT:g} s" in ta[rank]["reason"], ta[rank]
    done = slow.wait_concluded({TA}, 10)  # the prefill ranks told it (Abort): the room ends there too
    assert TA in done, "the encode rank did not conclude a room its prefill ranks gave up on"

    # b: nobody asks: the encode rank fails the room after PARK and concludes it; ranks that ask
    #    later hear why
    begun = time.monotonic()
    assert quick.begin(PB)
    quick.put(PB, 3, HIDDEN, DTYPE)
    done = quick.wait_concluded({PB}, PARK + SLACK + 5)
    assert PB in done, "a room nobody asked for did not conclude"
    assert PARK <= done[PB] - begun <= PARK + SLACK, f"concluded {done[PB] - begun:.2f} s after begin"
    rep.send("stage", "pb", items(qport, (PB, 3)))
    rep.wait("local", "pb", where=_code(0), seconds=10, what="every rank to hear that pb failed")
    pb = _step(rep, "pb", "failed", "pb to fail")
    for rank, p in pb.items():
        assert f"room {PB}" in p["reason"] and f"within {PARK:g} s" in p["reason"], p["reason"]

    # c: only rank 0 asks (rank 1's one slot is leased): the room fails after PARK on the encode
    #    rank, and on every prefill rank in one round (rank 1 never asked: it failed elsewhere)
    assert quick.begin(HB)
    quick.put(HB, 2, HIDDEN, DTYPE)
    rep.send("stage", "hb", items(qport, (HB, 2)))
    rep.wait("local", "hb", where=_code(2), seconds=10, what="hb to land")
    _intact(_step(rep, "hb", "landed", "hb to land"), "hb")
    rep.send("release", "hb", [0])
    rep.wait("released", "hb", ranks=[0], seconds=10, what="rank 0 to release hb")
    begun = time.monotonic()
    assert quick.begin(PC)
    quick.put(PC, 3, HIDDEN, DTYPE)
    rep.send("stage", "pc", items(qport, (PC, 3)))
    rep.wait("local", "pc", where=_code(1), ranks=[1], seconds=10, what="rank 1 to stage pc (no slot to ask with)")
    local = rep.wait("local", "pc", where=_code(0), ranks=[0], seconds=PARK + SLACK + 5, what="rank 0 to hear pc failed")
    assert _latest(rep, "local", "pc", 1)["code"] == 1
    pc = _step(rep, "pc", "failed", "pc to fail")
    _one(pc, "round")
    assert "only 1 of 2 prefill ranks asked" in pc[0]["reason"], pc[0]["reason"]
    assert pc[1]["reason"] == pc[0]["reason"], "rank 1 never asked, yet reports the replica's reason"
    assert PARK <= local[0]["t"] - begun <= PARK + SLACK
    assert PC in quick.wait_concluded({PC}, 5)
    print(f"ta: {ta}\npb: {pb}\npc: {pc}")
    results = rep.close()
    assert _settled(rep) == {"landed": {"hb"}, "failed": {"ta", "pb", "pc"}}
    assert all(not r["staged"] for r in results), results
