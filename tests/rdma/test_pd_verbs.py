"""The product path on real RDMA: a prefill and a decode peer moving KV pages with RDMA WRITEs.

One prefill rank and one decode rank in this process (single-rank replicas,
so no collective and no torch), their bootstrap server, the control channel
over loopback, and the verbs transport on the soft-RoCE device: every page of
every request must land byte for byte, with the first token, and a room the
prefill side aborts must fail on both sides with the decode pages fenced.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdcore import (
    BootstrapInfo,
    Bootstrapped,
    DecodeConfig,
    DecodePeer,
    PrefillConfig,
    PrefillPeer,
    RemotePrefillDone,
)
from pdcore.control.bootstrap import BootstrapServer
from pdcore.core.deadline import Deadline

pytestmark = pytest.mark.rdma

PAGE, PAGES, LAYERS, PER_REQUEST = 8192, 48, 3, 3


def test_prefill_writes_kv_pages_into_decode_over_rdma(verbs_device: str | None) -> None:
    options = {"transport": "verbs", "transport_options": {"device": verbs_device} if verbs_device else {}}
    knobs = dict(page_bytes=PAGE, num_pages=PAGES, heartbeat_interval=0.1, dead_after=30.0, **options)
    rng = np.random.default_rng(7)
    p_cache = [rng.integers(0, 256, PAGES * PAGE, dtype=np.uint8) for _ in range(LAYERS)]
    d_cache = [np.zeros(PAGES * PAGE, np.uint8) for _ in range(LAYERS)]
    server = BootstrapServer()
    port = server.start()
    peers: list = []
    try:
        prefill, outbox = PrefillPeer.start(
            PrefillConfig(kv_buffers=p_cache, bootstrap_host="127.0.0.1", bootstrap_port=port, **knobs)
        )
        peers.append(prefill)
        decode, inbox = DecodePeer.start(DecodeConfig(kv_buffers=d_cache, **knobs))
        peers.append(decode)
        rids = [f"r{i}" for i in range(6)]
        aborted = "r5"
        for i, rid in enumerate(rids):
            info = BootstrapInfo("127.0.0.1", port, 7000 + i)
            decode.register(rid, info)
            prefill.register(rid, info)
        d_events: dict[str, list[str]] = {rid: [] for rid in rids}
        p_events: dict[str, list[str]] = {rid: [] for rid in rids}
        landed = {}
        deadline = Deadline.after(60)
        ended = lambda events: sum(e[-1:] in (["Failed"], ["Succeeded"], ["RemotePrefillDone"]) for e in events.values())  # noqa: E731
        while ended(d_events) < len(rids) or ended(p_events) < len(rids):
            assert not deadline.expired(), f"decode {d_events}, prefill {p_events}"
            for event in decode.poll():
                d_events[event.rid].append(type(event).__name__)
                i = int(event.rid[1:])
                if isinstance(event, Bootstrapped):  # destination pages: a descending run, so the plan coalesces
                    inbox.announce(event.rid, [PAGES - 1 - PER_REQUEST * i - k for k in range(PER_REQUEST)][::-1], i)
                elif isinstance(event, RemotePrefillDone):
                    landed[event.rid] = event.remote
            for event in prefill.poll():
                p_events[event.rid].append(type(event).__name__)
                i = int(event.rid[1:])
                if isinstance(event, Bootstrapped):
                    if event.rid == aborted:
                        prefill.abort_room(event.rid, 7000 + i)
                    else:
                        prefill.record_usage(event.rid, cached_tokens=i, bootstrap_logprob=-0.5)
                        outbox.send(event.rid, [PER_REQUEST * i + k for k in range(PER_REQUEST)], first_token=100 + i)
            time.sleep(0.001)
        for i, rid in enumerate(rids):
            if rid == aborted:
                assert d_events[rid] == ["Bootstrapped", "Failed"] and p_events[rid] == ["Bootstrapped", "Failed"]
                continue
            assert d_events[rid] == ["Bootstrapped", "RemotePrefillDone"] and p_events[rid] == ["Bootstrapped", "Succeeded"]
            remote = landed[rid]
            assert (remote.bootstrap_token, remote.cached_tokens, remote.request_pool_index) == (100 + i, i, i)
            src = [PER_REQUEST * i + k for k in range(PER_REQUEST)]
            dst = [PAGES - 1 - PER_REQUEST * i - k for k in range(PER_REQUEST)][::-1]
            for layer in range(LAYERS):
                got = d_cache[layer].reshape(PAGES, PAGE)[dst]
                want = p_cache[layer].reshape(PAGES, PAGE)[src]
                assert np.array_equal(got, want), f"{rid}: layer {layer} differs after the RDMA WRITEs"
        assert not prefill.has_in_flight() and not decode.has_in_flight()
    finally:
        for peer in reversed(peers):
            peer.close()
        server.close()
