"""The two ranks of tests/test_fence_blackbox.py, run as real processes (multiprocessing spawn).

Each child uses only pdcore's public API and reports to the test over its end of
a duplex pipe: ``(kind, payload)`` tuples, an ``("error", traceback)`` if it
raised. The test sends ``"stop"`` to end a child's loop; a closed pipe (the
test died) ends it too, and every loop has its own deadline, so a child never
outlives the test for long.

The request's KV is one cache of ``LAYERS`` buffers of ``PAGES`` pages of
``PAGE`` bytes (128 MiB) on each side, every page of it the request's. Both
sides hold that memory (prefill fills it with its pattern, decode touches every
page before it starts). The pattern never contains 0 (decode's initial bytes)
nor ``CANARY``: a non-zero byte on decode is a byte that landed, and after
``Failed`` a byte that is not ``CANARY`` is one that landed in a page decode
had handed back.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from _children_common import guarded as _guarded

LAYERS = 4
PAGE = 64 << 10
PAGES = 512
TOTAL = LAYERS * PAGES * PAGE  # 128 MiB on each side
RID = "fence-0"
ROOM = 0xFE2CE
FIRST_TOKEN = 7
CANARY = 0xA5
_BLOCK = 1 << 20


def pattern_block(layer: int) -> np.ndarray:
    """1 MiB of prefill bytes for ``layer`` (tiled over its buffer): never 0, never ``CANARY``."""
    block = np.random.default_rng(1000 + layer).integers(1, 256, _BLOCK, dtype=np.uint8)
    block[block == CANARY] = 0x5A
    return block


def kv_knobs() -> dict[str, Any]:
    """The config knob for ``$PDCORE_FENCE_KV_DEVICE`` (cpu, standin, cuda): where the KV cache lives."""
    return {"device_memory": "standin"} if os.environ.get("PDCORE_FENCE_KV_DEVICE") == "standin" else {}


def _on_device(cache: list[np.ndarray]) -> list[Any]:
    """``cache`` as the peer is given it: CUDA tensors with ``$PDCORE_FENCE_KV_DEVICE=cuda``, else itself
    (the stand-in device's memory is host memory the peer stages as it stages a GPU's)."""
    if os.environ.get("PDCORE_FENCE_KV_DEVICE") != "cuda":
        return cache
    import torch

    return [torch.from_numpy(buf).to("cuda") for buf in cache]


def _stop_requested(conn: Connection, wait: float) -> bool:
    """Wait up to ``wait`` seconds (a scheduler round) for the test's "stop"; EOF counts as stop."""
    try:
        if conn.poll(wait):
            return conn.recv() == "stop"
    except (EOFError, OSError):
        return True
    return False


# ------------------------------------------------------------------------------------------ prefill


def run_prefill(conn: Connection, port: int, transport: str, options: dict[str, Any], knobs: dict[str, Any],
                lifetime: float) -> None:
    _guarded(conn, _prefill, port, transport, options, knobs, lifetime)


def _prefill(conn: Connection, port: int, transport: str, options: dict[str, Any], knobs: dict[str, Any],
             lifetime: float) -> None:
    """Register the request; when it is Bootstrapped, send all its pages and SIGSTOP itself at once.

    The peer's driver posts the writes right after ``outbox.send``: the first part of the 128 MiB
    goes into the socket with ``MSG_DONTWAIT`` (a few MiB, what the kernel buffers take) and the rest
    is queued for the transport's sender thread. The rank watches its own metrics (public: a
    ``PrefillConfig.metrics`` registry) until ``bytes_posted`` says the transport took the writes,
    and stops the whole process then: that freezes the sender thread with most of the request still
    unsent, while the kernel still delivers what was buffered: a transfer paused in its middle.
    """
    from prometheus_client import CollectorRegistry
    from pdcore import BootstrapInfo, Bootstrapped, Failed, PrefillConfig, PrefillPeer, Succeeded

    cache = [np.empty(PAGES * PAGE, np.uint8) for _ in range(LAYERS)]
    for layer, buf in enumerate(cache):
        buf.reshape(-1, _BLOCK)[:] = pattern_block(layer)
    registry = CollectorRegistry()
    peer, outbox = PrefillPeer.start(PrefillConfig(
        kv_buffers=_on_device(cache), page_bytes=PAGE, num_pages=PAGES, transport=transport, transport_options=options,
        bootstrap_host="127.0.0.1", bootstrap_port=port, metrics=registry, **knobs, **kv_knobs()))

    def posted() -> float:
        return registry.get_sample_value("pdcore_prefill_bytes_posted_total") or 0.0
    try:
        conn.send(("ready", os.getpid()))
        peer.register(RID, BootstrapInfo("127.0.0.1", port, ROOM))
        events: list[tuple[str, str]] = []
        ended = drained = False
        until = time.monotonic() + lifetime
        while time.monotonic() < until:
            for event in peer.poll(None):
                events.append((type(event).__name__, getattr(event, "reason", "")))
                conn.send(("event", type(event).__name__))
                if isinstance(event, Bootstrapped) and event.rid == RID:
                    peer.record_usage(RID, cached_tokens=PAGES, bootstrap_logprob=-0.5)
                    conn.send(("sending", time.monotonic()))  # before: nothing between send and the stop
                    outbox.send(RID, np.arange(PAGES), FIRST_TOKEN)
                    taken = time.monotonic() + 10.0
                    while not posted() and time.monotonic() < taken:  # the driver posts it: bounded wait
                        time.sleep(0.0005)
                    os.kill(os.getpid(), signal.SIGSTOP)  # every thread freezes here, writes half-sent
                    conn.send(("resumed", time.monotonic()))
                elif isinstance(event, (Succeeded, Failed)):
                    ended = True
            if ended and not drained and not peer.has_in_flight():
                drained = True  # nothing of the request can be read from the cache or written any more
                conn.send(("drained", time.monotonic()))
            if _stop_requested(conn, 0.001):
                break
        conn.send(("done", {"events": events, "in_flight": peer.has_in_flight()}))
    finally:
        peer.close()


# ------------------------------------------------------------------------------------------ decode


def run_decode(conn: Connection, port: int, transport: str, options: dict[str, Any], knobs: dict[str, Any],
               window: float, lifetime: float) -> None:
    _guarded(conn, _decode, port, transport, options, knobs, window, lifetime)


def _decode(conn: Connection, port: int, transport: str, options: dict[str, Any], knobs: dict[str, Any],
            window: float, lifetime: float) -> None:
    """The decode scheduler: announce the pages when Bootstrapped; on ``Failed`` take the pages back,
    fill them with ``CANARY`` at once and, still polling, keep checking that nothing overwrites them
    for ``window`` seconds or until the test says stop."""
    from pdcore import BootstrapInfo, Bootstrapped, DecodeConfig, DecodePeer, Failed, RemotePrefillDone

    cache = _on_device([np.zeros(PAGES * PAGE, np.uint8) for _ in range(LAYERS)])
    for buf in cache:
        buf.fill_(0) if hasattr(buf, "fill_") else buf.fill(0)  # resident, as a KV cache is
    peer, inbox = DecodePeer.start(DecodeConfig(
        kv_buffers=cache, page_bytes=PAGE, num_pages=PAGES, transport=transport, transport_options=options, **knobs,
        **kv_knobs()))
    pages = list(range(PAGES))  # the request's pages: all of the cache, one run per buffer
    views = [buf.reshape(PAGES, PAGE)[pages[0] : pages[-1] + 1] for buf in cache]  # those pages, no copy

    def landed() -> int:  # (numpy arrays or CUDA tensors alike)
        return sum(int((v != 0).sum()) for v in views)

    def overwritten(layer: int) -> int:
        return int((views[layer] != CANARY).sum())

    try:
        conn.send(("ready", os.getpid()))
        peer.register(RID, BootstrapInfo("127.0.0.1", port, ROOM))
        events: list[tuple[str, str]] = []
        failed_at: float | None = None
        first_seen: float | None = None  # seconds after Failed when a check first found a canary overwritten
        layer = 0
        until = time.monotonic() + lifetime
        while time.monotonic() < until:
            for event in peer.poll(None):
                events.append((type(event).__name__, getattr(event, "reason", "")))
                if isinstance(event, Bootstrapped):
                    inbox.announce(RID, pages, request_pool_index=0)
                elif isinstance(event, Failed):
                    before = landed()  # what landed before the pages came back (0 being decode's own bytes)
                    for v in views:  # the scheduler reuses the pages: here, for the canary
                        v[:] = CANARY
                    failed_at = time.monotonic()
                    conn.send(("failed", {"landed": before, "reason": event.reason}))
                elif isinstance(event, RemotePrefillDone):
                    conn.send(("landed_all", landed()))
                conn.send(("event", type(event).__name__))
            if failed_at is not None:
                if first_seen is None and overwritten(layer):  # one buffer per round, the rounds stay short
                    first_seen = time.monotonic() - failed_at
                layer = (layer + 1) % LAYERS
                if time.monotonic() - failed_at > window:
                    break
            if _stop_requested(conn, 0.001):
                break
        report: dict[str, Any] = {"events": events, "in_flight": peer.has_in_flight()}
        if failed_at is not None:
            per_layer = [overwritten(i) for i in range(LAYERS)]
            report.update(overwritten=sum(per_layer), per_layer=per_layer, first_seen=first_seen,
                          checked_for=time.monotonic() - failed_at)
        conn.send(("done", report))
    finally:
        peer.close()
