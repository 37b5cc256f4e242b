"""A prefill peer, a decode peer and their bootstrap server in this process, for white-box tests.

Real sockets and real threads (the control channel, the TCP transport, the
bootstrap server); each replica is one rank, so ``poll(None)`` skips the
collective. ``Pair.pump`` is the schedulers' loop: it polls both peers and
records their events until a condition holds, and raises naming the condition
when its deadline passes first. ``Pair.drive`` adds the schedulers' actions:
decode announces a request's pages when it is Bootstrapped, prefill fills and
sends them when it is Bootstrapped.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from pdcore import (
    BootstrapInfo,
    Bootstrapped,
    DecodeConfig,
    DecodePeer,
    Failed,
    PrefillConfig,
    PrefillPeer,
    RemotePrefillDone,
)
from pdcore.control.bootstrap import BootstrapServer
from pdcore.core.deadline import Deadline

PAGE = 4096
PAGES = 64
LAYERS = 2
PAGES_PER_REQUEST = 3


def token(rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=2).digest(), "little")


def data(rid: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, PAGES_PER_REQUEST * PAGE, dtype=np.uint8)


class Pair:
    def __init__(
        self,
        *,
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        server: dict[str, Any] | None = None,
        **common: Any,
    ):
        knobs: dict[str, Any] = dict(
            page_bytes=PAGE, num_pages=PAGES, heartbeat_interval=0.05, dead_after=30.0, fence_timeout=30.0,
            bootstrap_timeout=30.0, waiting_timeout=30.0, tombstone_ttl=30.0,
        )
        knobs.update(common)
        self.plane: str = str(common.get("control", "the default"))  # the control plane both peers run
        self.server = BootstrapServer(**(server or {}))
        self.port = self.server.start()
        self.p_cache = [np.zeros(PAGES * PAGE, np.uint8) for _ in range(LAYERS)]
        self.d_cache = [np.zeros(PAGES * PAGE, np.uint8) for _ in range(LAYERS)]
        self.prefill: PrefillPeer | None = None
        self.decode: DecodePeer | None = None
        try:
            self.prefill, self.outbox = PrefillPeer.start(
                PrefillConfig(kv_buffers=self.p_cache, bootstrap_host="127.0.0.1", bootstrap_port=self.port,
                              **{**knobs, **(prefill or {})})
            )
            self.decode, self.inbox = DecodePeer.start(DecodeConfig(kv_buffers=self.d_cache, **{**knobs, **(decode or {})}))
        except BaseException:
            self.close()
            raise
        self.events: dict[str, list[tuple[str, str]]] = {"prefill": [], "decode": []}
        self.landed: dict[str, Any] = {}
        self.reasons: dict[tuple[str, str], str] = {}  # (side, rid) -> why it failed
        self.rooms: dict[str, int] = {}
        self._slot: dict[str, int] = {}
        self._acted: dict[str, set[str]] = {"prefill": set(), "decode": set()}  # announced / sent
        self.usage: dict[str, tuple[int, float | None]] = {}  # rid -> (cached tokens, logprob) send records

    # -- the schedulers ----------------------------------------------------------------------

    def register(self, rid: str, room: int, *, prefill: bool = True, decode: bool = True) -> None:
        self.rooms[rid] = room
        self._slot.setdefault(rid, len(self._slot))
        if prefill:
            self.prefill.register(rid, BootstrapInfo("127.0.0.1", self.port, room))
        if decode:
            self.decode.register(rid, BootstrapInfo("127.0.0.1", self.port, room))

    def register_each(self, rids: Iterable[str], first_room: int) -> None:
        """Register every request of ``rids`` on both sides, in rooms ``first_room``, ``first_room + 1``, ..."""
        for i, rid in enumerate(rids):
            self.register(rid, room=first_room + i)

    def pages(self, rid: str, side: str) -> list[int]:
        """Each request's own pages: decode's at the bottom of the cache, prefill's at the top."""
        first = self._slot[rid] * PAGES_PER_REQUEST
        if side == "prefill":
            first = PAGES - PAGES_PER_REQUEST - first
        assert 0 <= first <= PAGES - PAGES_PER_REQUEST, "too many requests for the cache"
        return list(range(first, first + PAGES_PER_REQUEST))

    def announce(self, rid: str) -> None:
        self._acted["decode"].add(rid)
        self.inbox.announce(rid, self.pages(rid, "decode"), request_pool_index=self._slot[rid])

    def send(self, rid: str) -> None:
        self._acted["prefill"].add(rid)
        pages = self.pages(rid, "prefill")
        for layer, buf in enumerate(self.p_cache):
            buf.reshape(PAGES, PAGE)[pages] = np.roll(data(rid), layer).reshape(PAGES_PER_REQUEST, PAGE)
        cached, logprob = self.usage.get(rid, (1, -0.5))
        self.prefill.record_usage(rid, cached_tokens=cached, bootstrap_logprob=logprob)
        self.outbox.send(rid, pages, token(rid))

    def landed_intact(self, rid: str) -> bool:
        """Decode's pages of ``rid`` hold exactly what prefill sent."""
        pages = self.pages(rid, "decode")
        return all(
            np.array_equal(buf.reshape(PAGES, PAGE)[pages].reshape(-1), np.roll(data(rid), layer))
            for layer, buf in enumerate(self.d_cache)
        )

    # -- the loop -------------------------------------------------------------------------------

    def poll(self, sides: tuple[str, ...] = ("prefill", "decode")) -> None:
        for side, peer in (("prefill", self.prefill), ("decode", self.decode)):
            if side not in sides:
                continue
            for event in peer.poll(None):
                self.events[side].append((type(event).__name__, event.rid))
                if isinstance(event, RemotePrefillDone):
                    self.landed[event.rid] = event.remote
                elif isinstance(event, Failed):
                    self.reasons[(side, event.rid)] = event.reason
                self.on_event(side, event)

    def on_event(self, side: str, event: Any) -> None:
        """Scheduler actions; ``pump`` does none, ``drive`` sets them."""

    def pump(
        self, until: Callable[[], bool], what: str, timeout: float = 15.0, sides: tuple[str, ...] = ("prefill", "decode")
    ) -> None:
        """Poll ``sides`` (the others' schedulers run no rounds meanwhile) until ``until()``."""
        deadline = Deadline.after(timeout)
        while True:
            self.poll(sides)
            if until():
                return
            if deadline.expired():
                raise AssertionError(f"timed out after {timeout} s waiting for {what}; events: {self.events}")
            time.sleep(0.002)  # a scheduler's round

    def rounds(self, n: int) -> None:
        for _ in range(n):
            self.poll()

    def drive(self, rids: Iterable[str], timeout: float = 30.0, *, hold: Iterable[str] = ()) -> None:
        """Run the schedulers until every rid in ``rids`` ended on both sides; ``hold`` are never sent."""
        wanted = set(rids)
        held = set(hold)

        def act(side: str, event: Any) -> None:
            if isinstance(event, Bootstrapped) and event.rid in wanted:
                if side == "decode":
                    self.announce(event.rid)
                elif event.rid not in held:
                    self.send(event.rid)

        for side in ("decode", "prefill"):  # what was Bootstrapped before, while nobody acted
            for rid in sorted(wanted):
                if self.seen(side, "Bootstrapped", rid) and not self.ended(side, rid) and rid not in self._acted[side]:
                    act(side, Bootstrapped(rid))
        self.on_event = act  # type: ignore[method-assign]
        try:
            self.pump(lambda: all(self.ended(side, rid) for side in self.events for rid in wanted),
                      f"{len(wanted)} requests to end on both sides", timeout)
        finally:
            self.on_event = Pair.on_event.__get__(self)  # type: ignore[method-assign]

    # -- what happened ----------------------------------------------------------------------------

    def seen(self, side: str, kind: str, rid: str) -> bool:
        return (kind, rid) in self.events[side]

    def ended(self, side: str, rid: str) -> str | None:
        for kind, r in self.events[side]:
            if r == rid and kind in ("Succeeded", "RemotePrefillDone", "Failed"):
                return kind
        return None

    def close(self) -> None:
        for peer in (self.decode, self.prefill):
            if peer is not None:
                peer.close()
        self.server.close()


def through_worker(peer: Any, timeout: float = 10.0) -> None:
    """Return once the peer's driver ran every input queued before this call (its queue is FIFO)."""
    assert peer.quiesce(Deadline.after(timeout).remaining()), "the worker did not reach the marker in time"


def frames_in(peer: Any, n: int, what: str, timeout: float = 10.0) -> None:
    """Return once ``peer``'s control channel received ``n`` more frames (and handled all but the last)."""
    target = peer.diagnostics()["channel"]["received"] + n
    deadline = Deadline.after(timeout)
    while peer.diagnostics()["channel"]["received"] < target:
        assert not deadline.expired(), f"no {n} frames in {timeout} s: {what}"
        time.sleep(0.005)


__all__ = ["Pair", "through_worker", "frames_in", "token", "data", "Failed", "PAGES_PER_REQUEST"]
