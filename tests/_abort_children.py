"""The two ranks of tests/test_abort_blackbox.py, run as real processes (multiprocessing spawn).

Public API only. Each child reports over its end of a duplex pipe: ``(kind, payload)``, or
``("error", traceback)`` if it raised; every loop has its own deadline, so a child never outlives
the test for long.

``REQUESTS`` requests of ``per`` pages of ``PAGE`` bytes (the test's choice) in one KV buffer on each
side. Prefill's buffer holds seeded random bytes that are never 0 (decode's initial bytes) nor
``CANARY``; room ``i`` reads prefill's pages ``i * per ...`` and writes decode's pages of block
``REQUESTS - 1 - i``, so a page that lands in the wrong place is caught as well as one that does
not land.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from _children_common import guarded as _guarded

PAGE = 64 << 10
REQUESTS = 16
CANARY = 0xA5
VICTIM = f"r{REQUESTS - 1}"  # sent last; decode aborts it once bytes of another request are in its memory
FIRST_ROOM = 0xAB0


def prefill_bytes(per: int) -> np.ndarray:
    data = np.random.default_rng(2024).integers(1, 256, REQUESTS * per * PAGE, dtype=np.uint8)
    data[data == CANARY] = 0x5A
    return data


def src_pages(i: int, per: int) -> list[int]:
    return list(range(i * per, (i + 1) * per))


def dst_pages(i: int, per: int) -> list[int]:
    return src_pages(REQUESTS - 1 - i, per)


def run_prefill(conn: Connection, port: int, transport: str, options: dict[str, Any], per: int, lifetime: float) -> None:
    _guarded(conn, _prefill, port, transport, options, per, lifetime)


def _prefill(conn: Connection, port: int, transport: str, options: dict[str, Any], per: int, lifetime: float) -> None:
    from pdcore import BootstrapInfo, Bootstrapped, Failed, PrefillConfig, PrefillPeer, Succeeded

    cache = [prefill_bytes(per)]
    peer, outbox = PrefillPeer.start(PrefillConfig(
        kv_buffers=cache, page_bytes=PAGE, num_pages=REQUESTS * per, transport=transport, transport_options=options,
        bootstrap_host="127.0.0.1", bootstrap_port=port, heartbeat_interval=0.5, dead_after=60.0))
    try:
        conn.send(("ready", os.getpid()))
        for i in range(REQUESTS):
            peer.register(f"r{i}", BootstrapInfo("127.0.0.1", port, FIRST_ROOM + i))
        ends: dict[str, str] = {}
        until = time.monotonic() + lifetime
        while len(ends) < REQUESTS and time.monotonic() < until:
            for event in peer.poll(None):
                if isinstance(event, Bootstrapped):
                    i = int(event.rid[1:])
                    peer.record_usage(event.rid, cached_tokens=0, bootstrap_logprob=None)
                    outbox.send(event.rid, src_pages(i, per), 100 + i)
                elif isinstance(event, (Succeeded, Failed)):
                    ends[event.rid] = type(event).__name__
            time.sleep(0.001)
        conn.send(("done", {"ends": ends, "in_flight": peer.has_in_flight()}))
    finally:
        peer.close()


def run_decode(conn: Connection, port: int, transport: str, options: dict[str, Any], per: int, window: float,
               lifetime: float) -> None:
    _guarded(conn, _decode, port, transport, options, per, window, lifetime)


def _decode(conn: Connection, port: int, transport: str, options: dict[str, Any], per: int, window: float,
            lifetime: float) -> None:
    """Announce every request; once bytes of another request are in decode's memory (seen in the memory
    itself, not in an event, which comes a round trip later), abort ``VICTIM``; check each request's bytes
    at its terminal event; on the victim's ``Failed`` reuse its pages (``CANARY``) and watch them."""
    from pdcore import BootstrapInfo, Bootstrapped, DecodeConfig, DecodePeer, Failed

    num_pages = REQUESTS * per
    want = prefill_bytes(per).reshape(num_pages, PAGE)
    cache = [np.zeros(num_pages * PAGE, np.uint8)]
    pages = cache[0].reshape(num_pages, PAGE)
    peer, inbox = DecodePeer.start(DecodeConfig(
        kv_buffers=cache, page_bytes=PAGE, num_pages=num_pages, transport=transport, transport_options=options,
        heartbeat_interval=0.5, dead_after=60.0))
    try:
        conn.send(("ready", os.getpid()))
        for i in range(REQUESTS):
            peer.register(f"r{i}", BootstrapInfo("127.0.0.1", port, FIRST_ROOM + i))
        ends: dict[str, str] = {}
        intact: dict[str, bool] = {}
        aborted_after: list[str] = []  # the requests whose first page had bytes when the victim was aborted
        victim_untouched = False  # the victim's last page was still empty then: it was in flight
        reused_at: float | None = None
        victim = pages[dst_pages(int(VICTIM[1:]), per)[0] : dst_pages(int(VICTIM[1:]), per)[-1] + 1]
        until = time.monotonic() + lifetime
        firsts = [dst_pages(i, per)[0] for i in range(REQUESTS - 1)]
        while time.monotonic() < until:
            if not aborted_after:
                aborted_after = [f"r{i}" for i, page in enumerate(firsts) if pages[page, 0]]
                if aborted_after:
                    victim_untouched = not victim[-1].any()
                    peer.abort_room(VICTIM, FIRST_ROOM + int(VICTIM[1:]))
            for event in peer.poll(None):
                i = int(event.rid[1:])
                if isinstance(event, Bootstrapped):
                    inbox.announce(event.rid, dst_pages(i, per), request_pool_index=i)
                    continue
                ends[event.rid] = type(event).__name__
                got = pages[dst_pages(i, per)[0] : dst_pages(i, per)[-1] + 1]
                intact[event.rid] = bool(np.array_equal(got, want[src_pages(i, per)[0] : src_pages(i, per)[-1] + 1]))
                if isinstance(event, Failed) and event.rid == VICTIM:
                    victim[:] = CANARY  # the scheduler hands the pages to another request
                    reused_at = time.monotonic()
            if len(ends) == REQUESTS and reused_at is not None and time.monotonic() - reused_at > window:
                break
            time.sleep(0.001)
        conn.send(("done", {
            "ends": ends, "intact": intact, "aborted_after": aborted_after, "victim_untouched": victim_untouched,
            "in_flight": peer.has_in_flight(),
            "overwritten": int(np.count_nonzero(victim != CANARY)) if reused_at is not None else None,
        }))
    finally:
        peer.close()
