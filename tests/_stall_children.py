"""The three ranks of tests/test_stalled_sink_blackbox.py, run as real processes (multiprocessing spawn).

One prefill rank (tp 1) and two decode deployments of tp 1 each, ``slow`` and ``ok``, every one
using only pdcore's public API and reporting to the test over its end of a duplex pipe:
``(kind, payload)`` tuples, an ``("error", traceback)`` if it raised. The test sends commands
(``"send_slow"``, ``"send_ok"``, ``"stop"``); a closed pipe (the test died) ends a child's loop too,
and every loop has its own deadline, so a child never outlives the test for long.

Every room is ``ROOM_PAGES`` pages of ``PAGE`` bytes (4 MiB) in one KV buffer. A room's source
pages on prefill are its own (``source_pages``) and hold ``page_pattern(p)``: bytes seeded by the
page id, never 0 (decode's initial bytes), so a decode page holds the right bytes only if the right
source page landed in it. Decode announces each room's pages in reverse order (``dest_pages``), so
a write that ignored the page ids would not pass either.

The rooms (``ROOMS``, in order): to the slow deployment a warm-up room (sent at once, so the data
connection is up and proven before anything stalls) and ``SLOW_ROOMS`` rooms the test lets go with
``"send_slow"``; to the ok deployment a warm-up room and ``OK_ROOMS`` rooms it lets go with
``"send_ok"``. Prefill reports, per room, the ``time.monotonic()`` of its hand-over (``outbox.send``)
and of its ``Succeeded``; decode the time of its ``RemotePrefillDone`` and whether every page
landed byte-exact. Both clocks are the host's CLOCK_MONOTONIC: the processes share it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from _children_common import guarded as _guarded

PAGE = 1 << 20  # 1 MiB pages
ROOM_PAGES = 4  # 4 MiB a room
SLOW_ROOMS = 4  # more batches than the prefill rank's max_inflight (2) toward the stalled sink
OK_ROOMS = 3
FIRST_TOKEN_BASE = 100


def _rooms() -> list[tuple[str, str, int]]:
    """(deployment, rid, room) of every room, in the order of ``source_pages``."""
    out = [("slow", "slow-warm", 0x5100)]
    out += [("slow", f"slow-{i}", 0x5101 + i) for i in range(SLOW_ROOMS)]
    out += [("ok", "ok-warm", 0x0C00)]
    out += [("ok", f"ok-{i}", 0x0C01 + i) for i in range(OK_ROOMS)]
    return out


ROOMS = _rooms()
INDEX = {rid: k for k, (_, rid, _) in enumerate(ROOMS)}
PREFILL_PAGES = len(ROOMS) * ROOM_PAGES
WARM = {"slow": "slow-warm", "ok": "ok-warm"}


def rooms_of(deployment: str) -> list[tuple[str, int]]:
    return [(rid, room) for dep, rid, room in ROOMS if dep == deployment]


def source_pages(rid: str) -> np.ndarray:
    k = INDEX[rid]
    return np.arange(k * ROOM_PAGES, (k + 1) * ROOM_PAGES)


def dest_pages(j: int) -> list[int]:
    """The pages decode announces for its ``j``-th room: its own, in reverse order."""
    return list(range((j + 1) * ROOM_PAGES - 1, j * ROOM_PAGES - 1, -1))


def first_token(rid: str) -> int:
    return FIRST_TOKEN_BASE + INDEX[rid]


def page_pattern(page: int) -> np.ndarray:
    """Prefill's bytes of source page ``page``: seeded by the page id, never 0."""
    return np.random.default_rng(7000 + page).integers(1, 256, PAGE, dtype=np.uint8)


def _commands(conn: Connection, wait: float) -> list[str]:
    """The test's commands that arrived within ``wait`` seconds (a scheduler round); EOF is "stop"."""
    got: list[str] = []
    try:
        while conn.poll(wait if not got else 0):
            got.append(conn.recv())
    except (EOFError, OSError):
        got.append("stop")
    return got


def _noted(peer: Any, events: list[tuple[str, str, str]]) -> Iterator[tuple[Any, float]]:
    """The events of one ``peer.poll``, each with the ``time.monotonic()`` it was seen at, and noted
    in ``events`` (kind, rid, reason) for the child's final report."""
    for event in peer.poll(None):
        now = time.monotonic()
        events.append((type(event).__name__, event.rid, getattr(event, "reason", "")))
        yield event, now


# ------------------------------------------------------------------------------------------ prefill


def run_prefill(conn: Connection, port: int, options: dict[str, Any], knobs: dict[str, Any], full_bytes: int,
                lifetime: float) -> None:
    _guarded(conn, _prefill, port, options, knobs, full_bytes, lifetime)


def _prefill(conn: Connection, port: int, options: dict[str, Any], knobs: dict[str, Any], full_bytes: int,
             lifetime: float) -> None:
    """The prefill scheduler: register every room; send each warm-up room when it is Bootstrapped;
    say "bootstrapped" once every room is. On "send_slow" hand the slow rooms over and say
    "sink_full" once the transport took ``full_bytes`` (the warm-up rooms and as many slow rooms as
    the slow sink takes: the rest find it full); on "send_ok" hand the ok rooms over, one after the
    other, timing each hand-over."""
    from prometheus_client import CollectorRegistry
    from pdcore import BootstrapInfo, Bootstrapped, Failed, PrefillConfig, PrefillPeer, Succeeded

    cache = np.empty(PREFILL_PAGES * PAGE, np.uint8)
    pages = cache.reshape(PREFILL_PAGES, PAGE)
    for p in range(PREFILL_PAGES):
        pages[p] = page_pattern(p)
    registry = CollectorRegistry()
    peer, outbox = PrefillPeer.start(PrefillConfig(
        kv_buffers=[cache], page_bytes=PAGE, num_pages=PREFILL_PAGES, transport="tcp", transport_options=options,
        bootstrap_host="127.0.0.1", bootstrap_port=port, metrics=registry, **knobs))

    def posted() -> int:
        return int(registry.get_sample_value("pdcore_prefill_bytes_posted_total") or 0)

    def hand_over(rid: str) -> float:
        peer.record_usage(rid, cached_tokens=ROOM_PAGES, bootstrap_logprob=-0.5)
        at = time.monotonic()
        outbox.send(rid, source_pages(rid), first_token(rid))
        return at

    try:
        conn.send(("ready", os.getpid()))
        for _, rid, room in ROOMS:
            peer.register(rid, BootstrapInfo("127.0.0.1", port, room))
        events: list[tuple[str, str, str]] = []
        bootstrapped: set[str] = set()
        watching_full = False
        until = time.monotonic() + lifetime
        while time.monotonic() < until:
            for event, now in _noted(peer, events):
                if isinstance(event, Bootstrapped):
                    bootstrapped.add(event.rid)
                    if event.rid in WARM.values():
                        hand_over(event.rid)
                    if len(bootstrapped) == len(ROOMS):
                        conn.send(("bootstrapped", now))
                elif isinstance(event, Succeeded):
                    conn.send((f"succeeded:{event.rid}", now))
                elif isinstance(event, Failed):
                    conn.send((f"failed:{event.rid}", event.reason))
            if watching_full and posted() >= full_bytes:
                watching_full = False
                conn.send(("sink_full", posted()))
            stop = False
            for cmd in _commands(conn, 0.001):
                if cmd == "send_slow":
                    for rid, _ in rooms_of("slow")[1:]:
                        hand_over(rid)
                    watching_full = True
                    conn.send(("sent_slow", time.monotonic()))
                elif cmd == "send_ok":
                    before = posted()  # what the transport took so far: nothing more of the slow rooms
                    conn.send(("sent_ok", {"posted_before": before,
                                           "at": {rid: hand_over(rid) for rid, _ in rooms_of("ok")[1:]}}))
                elif cmd == "stop":
                    stop = True
            if stop:
                break
        conn.send(("done", {"events": events, "posted": posted(), "in_flight": peer.has_in_flight(),
                            "queues": dict(peer.diagnostics()["queues"])}))
    finally:
        peer.close()


# ------------------------------------------------------------------------------------------ decode


def run_decode(conn: Connection, deployment: str, port: int, knobs: dict[str, Any], lifetime: float) -> None:
    _guarded(conn, _decode, deployment, port, knobs, lifetime)


def _decode(conn: Connection, deployment: str, port: int, knobs: dict[str, Any], lifetime: float) -> None:
    """A decode scheduler of one deployment: register its rooms, announce each when Bootstrapped
    (saying "announced" once all are), and at each ``RemotePrefillDone`` note the time and check
    the room's pages byte for byte against prefill's pattern."""
    from pdcore import BootstrapInfo, Bootstrapped, DecodeConfig, DecodePeer, Failed, RemotePrefillDone

    mine = rooms_of(deployment)
    num_pages = len(mine) * ROOM_PAGES
    cache = np.zeros(num_pages * PAGE, np.uint8)
    cache.fill(0)  # resident, as a KV cache is
    pages = cache.reshape(num_pages, PAGE)
    peer, inbox = DecodePeer.start(DecodeConfig(
        kv_buffers=[cache], page_bytes=PAGE, num_pages=num_pages, transport="tcp", **knobs))
    where = {rid: j for j, (rid, _) in enumerate(mine)}

    def intact(rid: str) -> list[int]:
        """The positions in the room whose page is not its source page's bytes (empty: byte-exact)."""
        src, dst = source_pages(rid), dest_pages(where[rid])
        return [i for i in range(ROOM_PAGES) if not np.array_equal(pages[dst[i]], page_pattern(int(src[i])))]

    try:
        conn.send(("ready", os.getpid()))
        for rid, room in mine:
            peer.register(rid, BootstrapInfo("127.0.0.1", port, room))
        events: list[tuple[str, str, str]] = []
        announced = 0
        until = time.monotonic() + lifetime
        while time.monotonic() < until:
            for event, now in _noted(peer, events):
                if isinstance(event, Bootstrapped):
                    inbox.announce(event.rid, dest_pages(where[event.rid]), request_pool_index=where[event.rid])
                    announced += 1
                    if announced == len(mine):
                        conn.send(("announced", now))
                elif isinstance(event, RemotePrefillDone):
                    remote = event.remote
                    conn.send((f"landed:{remote.rid}", {
                        "at": now, "wrong_pages": intact(remote.rid),
                        "token_ok": remote.bootstrap_token == first_token(remote.rid)}))
                elif isinstance(event, Failed):
                    conn.send((f"failed:{event.rid}", event.reason))
            if "stop" in _commands(conn, 0.001):
                break
        conn.send(("done", {"events": events, "in_flight": peer.has_in_flight()}))
    finally:
        peer.close()
