"""The peers in one process (a prefill and a decode rank, real sockets and threads).

The centre is fence before free (``pdcore/core/_spec.py``): a decode room whose
pages were announced is reported ``Failed`` (its pages handed back to the
scheduler) only once decode revoked the room's grant in the data plane, so a
prefill write still in flight lands nothing afterwards. Prefill's writes are
held in flight here by wrapping its transport's ``write``, so the window in
which a wrong peer would let bytes land in handed-back pages stays open for as
long as the test looks.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from typing import Any

import pytest

from pdcore.core._spec import State
from pdcore import BootstrapInfo
from pdcore.core.deadline import Deadline
from pdcore.core.errors import PdError
from pd_pair import PAGE, Pair, through_worker, token

WAIT = 10.0  # seconds: any one wait of the relay below


@pytest.fixture
def make_pair() -> Any:
    pairs: list[Pair] = []

    def make(**knobs: Any) -> Pair:
        pairs.append(Pair(**knobs))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()


def _hold_writes(peer: Any, rid: str | None = None) -> tuple[list[tuple[Any, ...]], Any]:
    """Make ``peer``'s transport keep the batches posted for ``rid`` (None: all) in flight.

    Returns (held, release). A prefill batch's completion callback carries its room's record
    (``token``), which names the rid; other batches go through.
    """
    transport = peer._transport
    real = transport.write
    held: list[tuple[Any, ...]] = []

    def write(handle: Any, batch: Any, on_done: Any = None, **kw: Any) -> int:
        entry = getattr(on_done, "token", None)
        if rid is not None and getattr(entry, "rid", None) != rid:
            return real(handle, batch, on_done, **kw)
        held.append((handle, batch, on_done, kw))
        return -len(held)

    transport.write = write

    def release() -> None:
        del transport.write  # back to the class's method
        for handle, batch, on_done, kw in held:
            real(handle, batch, on_done, **kw)

    return held, release


def _failed(peer: Any, rid: str) -> bool:
    """The room failed on this rank (and is still tracked: its end not yet reported)."""
    try:
        return peer.state(rid) == State.FAILED
    except PdError:
        return False


def test_requests_move_and_land_intact(make_pair: Any) -> None:
    pair = make_pair()
    rids = [f"r{i}" for i in range(8)]
    pair.register_each(rids, 1000)
    pair.drive(rids)
    for rid in rids:
        assert pair.ended("prefill", rid) == "Succeeded" and pair.ended("decode", rid) == "RemotePrefillDone"
        assert pair.events["decode"].index(("Bootstrapped", rid)) < pair.events["decode"].index(("RemotePrefillDone", rid))
        assert pair.landed_intact(rid), rid
        remote = pair.landed[rid]
        assert (remote.bootstrap_token, remote.cached_tokens, remote.bootstrap_logprob) == (token(rid), 1, -0.5)
    assert not pair.prefill.has_in_flight() and not pair.decode.has_in_flight()


def test_control_sends_count_the_frames_and_the_messages_that_carried_them(make_pair: Any) -> None:
    pair = make_pair()
    before = {side: peer.control_sends() for side, peer in (("prefill", pair.prefill), ("decode", pair.decode))}
    rids = [f"c{i}" for i in range(8)]
    pair.register_each(rids, 2000)
    pair.drive(rids)
    beats = {peer: peer.diagnostics()["channel"]["heartbeats_sent"] for peer in (pair.prefill, pair.decode)}
    pair.pump(lambda: all(peer.diagnostics()["channel"]["heartbeats_sent"] >= n + 2 for peer, n in beats.items()),
              "heartbeats on both sides (every 50 ms here)")
    sent = {side: tuple(n - b for n, b in zip(peer.control_sends(), before[side]))
            for side, peer in (("prefill", pair.prefill), ("decode", pair.decode))}
    # heartbeats are not counted; a room's success rode its last write (TCP carries notes), no Status
    assert sent["prefill"] == (0, 0), sent
    assert 0 < sent["decode"][1] <= sent["decode"][0]
    assert sent["decode"][0] == len(rids) + 1, sent  # the pair's Register, an Announce a room


CANARY = 0xA5


def _fill_canary(pair: Any, rid: str) -> None:
    """What a scheduler may do with handed-back pages: reuse them (here: fill them with a canary)."""
    for buf in pair.d_cache:
        buf.reshape(-1, PAGE)[pair.pages(rid, "decode")] = CANARY


def _canary_intact(pair: Any, rid: str) -> bool:
    return all((buf.reshape(-1, PAGE)[pair.pages(rid, "decode")] == CANARY).all() for buf in pair.d_cache)


@pytest.mark.parametrize("how", ["decode-abort", "decode-timeout", "prefill-abort"])
def test_decode_hands_pages_back_only_after_revoking_and_late_writes_land_nothing(make_pair: Any, how: str) -> None:
    """A prefill write to the room is held in flight; the room fails. Decode revokes the room's grant
    and hands the pages back without waiting for prefill; prefill reports the room ended only once
    its write completed; the write, released after decode let go, lands no byte in the pages."""
    timeout = 1.0 if how == "decode-timeout" else 30.0
    pair = make_pair(decode={"waiting_timeout": timeout})
    rid, room = "victim", 4242
    bystander = "bystander"
    pair.register(rid, room)
    pair.pump(lambda: pair.seen("decode", "Bootstrapped", rid), "decode to bootstrap")
    pair.announce(rid)
    pair.pump(lambda: pair.seen("prefill", "Bootstrapped", rid), "prefill to hear the announcement")
    held, release = _hold_writes(pair.prefill, rid)
    pair.send(rid)
    pair.pump(lambda: bool(held), "prefill to post its writes")

    if how == "decode-abort":
        pair.decode.abort_room(rid, room)
    elif how == "prefill-abort":
        pair.prefill.abort_room(rid, room)
    pair.pump(lambda: bool(pair.ended("decode", rid)), "decode to fail the room", timeout=timeout + 15)
    assert pair.ended("decode", rid) == "Failed"
    # white-box: the transport's own grant record (a transport has no public question for one grant)
    assert not pair.decode._transport._grants.get(held[0][3]["grant"]), "the pages went back with the grant still live"
    _fill_canary(pair, rid)
    pair.pump(lambda: _failed(pair.prefill, rid), "prefill to fail the room")
    pair.rounds(3)
    assert not pair.ended("prefill", rid), "prefill reported the room ended with its write in flight"
    # other rooms are not held up
    pair.register(bystander, room + 1)
    pair.drive([bystander])
    assert pair.ended("decode", bystander) == "RemotePrefillDone" and pair.landed_intact(bystander)

    release()  # the write reaches decode's sink after the grant was revoked
    pair.pump(lambda: bool(pair.ended("prefill", rid)), "prefill to end the room")
    assert pair.ended("prefill", rid) == "Failed"
    assert _canary_intact(pair, rid), "a write landed in pages decode had handed back"
    assert not pair.prefill.has_in_flight() and not pair.decode.has_in_flight()


def test_decode_abort_before_any_write_is_acknowledged_at_once(make_pair: Any) -> None:
    """Nothing in flight: prefill acknowledges at once and both sides fail the room (no fence wait)."""
    pair = make_pair()
    rid, room = "early", 77
    pair.register(rid, room)
    pair.pump(lambda: pair.seen("decode", "Bootstrapped", rid), "decode to bootstrap")
    pair.announce(rid)
    pair.pump(lambda: pair.seen("prefill", "Bootstrapped", rid), "prefill to hear the announcement")
    pair.decode.abort_room(rid, room)
    pair.pump(lambda: bool(pair.ended("decode", rid)) and bool(pair.ended("prefill", rid)), "both sides to fail it")
    assert pair.ended("decode", rid) == "Failed" and pair.ended("prefill", rid) == "Failed"
    # a late hand-over of the ended room posts nothing
    held, release = _hold_writes(pair.prefill)
    pair.outbox.send(rid, pair.pages(rid, "prefill"), token(rid))
    through_worker(pair.prefill)
    assert held == []
    release()
    assert not pair.prefill.has_in_flight() and not pair.decode.has_in_flight()


def test_prefill_abort_of_an_unregistered_room_answers_the_later_announcement(make_pair: Any) -> None:
    pair = make_pair()
    rid, room = "never", 99
    pair.register(rid, room, prefill=False)
    pair.prefill.abort_room(rid, room)
    through_worker(pair.prefill)  # the tombstone is in place
    pair.pump(lambda: pair.seen("decode", "Bootstrapped", rid), "decode to bootstrap")
    pair.announce(rid)
    pair.pump(lambda: bool(pair.ended("decode", rid)), "decode to hear of the abort")
    assert pair.ended("decode", rid) == "Failed"
    assert pair.prefill.diagnostics()["engines"]["prefill"]["tombstones"] == 1 and not pair.prefill.diagnostics()["engines"]["prefill"]["parked"]


def test_tombstones_expire_after_their_ttl(make_pair: Any) -> None:
    pair = make_pair(prefill={"tombstone_ttl": 0.3})
    for i in range(5):
        pair.prefill.abort_room(f"gone{i}", 500 + i)
    through_worker(pair.prefill)
    assert pair.prefill.diagnostics()["engines"]["prefill"]["tombstones"] == 5
    pair.pump(lambda: pair.prefill.diagnostics()["engines"]["prefill"]["tombstones"] == 0, "the tombstones to expire", timeout=5.0)


def test_decode_failure_before_announcing_is_heard_by_prefill(make_pair: Any) -> None:
    """Decode knows the room's prefill rank once it is Bootstrapped; if the room fails there before
    its pages were announced (no fence, so no fence's Abort), prefill must still hear of it rather
    than hold the room until its own bootstrap timer (30 s here, beyond the wait)."""
    pair = make_pair()
    rid, room = "unannounced", 31337
    pair.register(rid, room)
    pair.pump(lambda: pair.seen("decode", "Bootstrapped", rid), "decode to bootstrap")
    pair.decode.abort_room(rid, room)
    pair.pump(lambda: bool(pair.ended("decode", rid)), "decode to fail the room")
    pair.pump(lambda: bool(pair.ended("prefill", rid)), "prefill to hear that decode failed the room", timeout=10.0)
    assert pair.ended("prefill", rid) == "Failed"
    assert not pair.prefill.has_in_flight() and not pair.decode.has_in_flight()


class _HeldServer:
    """A TCP relay in front of the bootstrap server that holds every connection until ``release()``:
    a look-up through it answers only then (loopback, threads; every wait has a deadline)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._open = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self.accepted = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def release(self) -> None:
        self._open.set()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.accepted.set()
            t = threading.Thread(target=self._relay, args=(client,), daemon=True)
            self._threads.append(t)
            t.start()

    def _relay(self, client: socket.socket) -> None:
        with client:
            if not self._open.wait(WAIT):
                return
            with socket.create_connection(("127.0.0.1", self._port), timeout=WAIT) as server:
                socks = [client, server]
                deadline = Deadline.after(WAIT)
                while socks and not deadline.expired():
                    for s in select.select(socks, [], [], 0.05)[0]:
                        data = s.recv(65536)
                        other = server if s is client else client
                        if data:
                            other.sendall(data)
                        else:
                            socks.remove(s)
                            with contextlib.suppress(OSError):
                                other.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self._open.set()
        for t in self._threads:
            t.join(WAIT)
        self._listener.close()


def test_decode_abort_before_its_look_up_answered_is_heard_by_prefill(make_pair: Any) -> None:
    """Decode's scheduler aborts a request while its look-up of the prefill deployment is on the way
    (held here at a relay until decode's round reported the room failed): decode did not know the
    room's prefill ranks when it failed the room, and must tell them once the look-up answers, or
    prefill holds the room until its own bootstrap timer (30 s here, beyond the wait).
    ``tests/test_simulate.py`` replays the seeds of the simulator that found it."""
    pair = make_pair()
    rid, room = "aborted-at-once", 31338
    held = _HeldServer(pair.port)
    try:
        pair.rooms[rid] = room
        pair.prefill.register(rid, BootstrapInfo("127.0.0.1", pair.port, room))
        pair.decode.register(rid, BootstrapInfo("127.0.0.1", held.port, room))
        assert held.accepted.wait(WAIT), "decode did not look the deployment up"
        pair.decode.abort_room(rid, room)
        pair.pump(lambda: bool(pair.ended("decode", rid)), "decode to fail the room", sides=("decode",))
        assert not pair.seen("decode", "Bootstrapped", rid)
        held.release()
        pair.pump(lambda: bool(pair.ended("prefill", rid)), "prefill to hear that decode failed the room", timeout=10.0)
    finally:
        held.close()
    assert pair.ended("prefill", rid) == "Failed"
    assert "aborted by decode" in pair.reasons[("prefill", rid)], pair.reasons
    assert not pair.prefill.has_in_flight() and not pair.decode.has_in_flight()


@pytest.mark.parametrize("when", ["before prefill's round", "after prefill's round"])
def test_a_room_prefill_failed_before_decode_announced_is_told_to_decode(make_pair: Any, when: str) -> None:
    """Prefill's scheduler hands a room over before decode announced it (a scheduler mistake): prefill
    fails the room at once. Decode's announcement that comes after must hear why, whether prefill still
    holds the failed room (its round has not run) or settled it, and decode fails within seconds
    instead of holding its pages for its waiting timeout (60 s here)."""
    pair = make_pair(decode={"waiting_timeout": 60.0})
    rid, room = "early", 4242
    pair.register(rid, room, decode=False)
    pair.send(rid)  # nobody announced the room yet
    through_worker(pair.prefill)
    assert pair.prefill.state(rid) == State.FAILED  # failed at the hand-over
    if when == "after prefill's round":
        pair.pump(lambda: bool(pair.ended("prefill", rid)), "prefill to settle the room", sides=("prefill",))
    pair.decode.register(rid, pair_info(pair, room))
    pair.pump(lambda: pair.seen("decode", "Bootstrapped", rid), "decode to bootstrap", sides=("decode",))
    pair.announce(rid)
    pair.pump(lambda: bool(pair.ended("decode", rid)), "decode to hear that prefill failed the room",
              timeout=10.0, sides=("decode",))
    assert pair.ended("decode", rid) == "Failed"
    assert "handed over before a decode rank announced" in pair.reasons[("decode", rid)], pair.reasons
    pair.pump(lambda: bool(pair.ended("prefill", rid)), "prefill to settle the room")
    assert not pair.prefill.has_in_flight() and not pair.decode.has_in_flight()


def pair_info(pair: Pair, room: int) -> Any:
    from pdcore import BootstrapInfo

    return BootstrapInfo("127.0.0.1", pair.port, room)


def test_poll_neither_raises_from_nor_waits_on_the_revoke_of_a_landed_rooms_grant(make_pair: Any) -> None:
    """A landed room's grant only goes once it settles (every byte is there); that revoke is a transport
    call and may wait for a frame still landing or fail. ``poll()`` runs on the scheduler thread: it must
    not make the call itself, so it neither raises from it nor waits on the network, and every rank
    keeps its RemotePrefillDone."""
    import threading

    from transport.errors import TransportError

    pair = make_pair()
    real = pair.decode._transport.revoke
    calls: list[tuple[Any, bool]] = []

    def failing(grant: Any, **kwargs: Any) -> Any:
        calls.append((threading.current_thread(), kwargs.get("settled", False)))
        if kwargs.get("settled"):
            raise TransportError("revoke failed (planted by the test)", op="revoke")
        return real(grant, **kwargs)

    pair.decode._transport.revoke = failing
    rids = [f"r{i}" for i in range(3)]
    for i, rid in enumerate(rids):
        pair.register(rid, 700 + i)
    pair.drive(rids)
    assert all(pair.ended("decode", rid) == "RemotePrefillDone" and pair.landed_intact(rid) for rid in rids)
    through_worker(pair.decode)
    settled = [thread for thread, was_settled in calls if was_settled]
    assert settled, "the landed rooms' grants were never revoked"
    assert threading.current_thread() not in settled, "poll() revoked a grant on the scheduler thread"
