"""KV layouts: writes per request by the planner against the per-token-slot scheme, heterogeneous-TP
throughput against the transport floor, and the layer-wise tail. All in one run on this machine.

    python benchmarks/kv.py [--quick] [--json]

``writes`` rows (arithmetic, no I/O): a model of ``--layers`` layers, 8 KV heads of 256 bytes (128
bf16) per token, 16 tokens per page, a request of 64 pages. For each (prefill tp, decode tp, page order)
the writes the planner posts for one request over every (prefill rank, decode rank) pair, and the
writes of the per-token-slot scheme (one per layer, K/V, page and token slot when heads are sliced, as
the peer systems post them); ``ratio`` = planner / slot scheme.

``hetero`` rows: prefill tp 2 → decode tp 4 (HND, 8 heads), every rank a real peer in this one process
(real sockets, real threads; each rank polls alone), ``--requests`` requests of 16 pages; GB/s = bytes
landed on decode / time from the first announcement to the last ``RemotePrefillDone``. The floor in the
same run: the TCP transport alone, in this process, 2 sources and 4 sinks, posting exactly the planned
batches of the same requests (one per request and pair), timed from the first post to the last
completion. Target: ratio >= 0.8 for HND. NHD is printed as it is.

``layerwise`` rows: prefill tp 1 → decode tp 1, a simulated forward pass of ``--layers`` layers at
``--layer-ms`` each (a sleep, then the layer's KV is final), a prompt of 64 pages. ``tail_ms`` is the time
from the last layer's completion (``finish``) to the decode rank's ``RemotePrefillDone``, streamed
(``layers_done`` after each layer) against sent at the end (``finish`` only), alternating, medians.
Target: streamed tail <= 2 layers' transfer time (send-at-end tail / layers) + one control round trip
(a one-page request's time from ``finish`` to ``RemotePrefillDone``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transport as transport_mod  # noqa: E402
from pdcore import BootstrapInfo, Bootstrapped, DecodeConfig, DecodePeer, PrefillConfig, PrefillPeer  # noqa: E402
from pdcore import RemotePrefillDone  # noqa: E402
from pdcore.control.bootstrap import BootstrapServer  # noqa: E402
from pdcore.core.deadline import Deadline  # noqa: E402
from pdcore.kv import KvLayout  # noqa: E402
from pdcore.kv.planner import plan  # noqa: E402
from pdcore.kv.routing import routing  # noqa: E402

HEADS, HEAD_BYTES, PAGE_TOKENS = 8, 256, 16


def layout_of(order: str, layers: int) -> KvLayout:
    return KvLayout(order=order, kv_heads=1 if order == "mla" else HEADS, head_bytes=HEAD_BYTES,
                    page_tokens=PAGE_TOKENS, layers=layers)


def bench_writes(layers: int) -> list[dict[str, Any]]:
    rows = []
    pages = np.arange(64)
    for p_tp, d_tp in ((2, 4), (4, 2), (1, 3), (4, 8), (8, 16)):
        for order in ("hnd", "nhd", "mla"):
            layout = layout_of(order, layers)
            if order != "mla" and d_tp <= HEADS and HEADS % d_tp:
                continue
            bases = [i << 32 for i in range(layout.buffers)]
            ours = slots = 0
            for d in range(d_tp):
                for p in range(p_tp):
                    ours += len(plan(layout, p_tp, p, d_tp, d, bases, bases, pages, pages))
                    slots += layout.slot_writes(p_tp, p, d_tp, d, len(pages))
            rows.append({"bench": "writes", "prefill_tp": p_tp, "decode_tp": d_tp, "order": order,
                         "planner_writes": ours, "slot_writes": slots, "ratio": ours / slots})
    return rows


# -- in-process peers ---------------------------------------------------------------------------------


class Deployment:
    """Prefill ranks and decode ranks of one layout in this process, each polled alone."""

    def __init__(self, layout: KvLayout, p_tp: int, d_tp: int, num_pages: int, **prefill: Any) -> None:
        knobs = dict(num_pages=num_pages, heartbeat_interval=0.2, dead_after=60.0, capacity=4096,
                     bootstrap_timeout=120.0, waiting_timeout=120.0)
        self.layout, self.p_tp, self.d_tp = layout, p_tp, d_tp
        self.server = BootstrapServer()
        port = self.server.start()
        self.port = port
        self.prefill = []
        self.decode = []
        for p in range(p_tp):
            cache = [np.ones(num_pages * layout.page_bytes(p_tp), np.uint8) for _ in range(layout.buffers)]
            peer, outbox = PrefillPeer.start(PrefillConfig(
                kv_buffers=cache, page_bytes=layout.page_bytes(p_tp), tp_size=p_tp, tp_rank=p, kv_layout=layout,
                bootstrap_host="127.0.0.1", bootstrap_port=port, **knobs, **prefill))
            self.prefill.append((peer, outbox, cache))
        for d in range(d_tp):
            cache = [np.ones(num_pages * layout.page_bytes(d_tp), np.uint8) for _ in range(layout.buffers)]
            peer, inbox = DecodePeer.start(DecodeConfig(
                kv_buffers=cache, page_bytes=layout.page_bytes(d_tp), tp_size=d_tp, tp_rank=d, kv_layout=layout,
                **knobs))
            self.decode.append((peer, inbox, cache))

    def close(self) -> None:
        for peer, _, _ in self.prefill + self.decode:
            peer.close()
        self.server.close()

    def poll(self) -> list[tuple[str, int, Any]]:
        out = []
        for side, ranks in (("prefill", self.prefill), ("decode", self.decode)):
            for rank, (peer, _, _) in enumerate(ranks):
                out += [(side, rank, e) for e in peer.poll(None)]
        return out

    def bootstrap(self, rids: list[str], rooms: list[int], pages: dict[str, list[int]], timeout: float = 60) -> None:
        """Register, and announce on every decode rank; returns once every prefill rank is Bootstrapped."""
        for rid, room in zip(rids, rooms):
            for peer, _, _ in self.prefill + self.decode:
                peer.register(rid, BootstrapInfo("127.0.0.1", self.port, room))
        ready: set[tuple[str, int, str]] = set()
        deadline = Deadline.after(timeout)
        while len(ready) < len(rids) * (self.p_tp + self.d_tp):
            if deadline.expired():
                raise TimeoutError(f"bootstrap: {len(ready)} of {len(rids) * (self.p_tp + self.d_tp)}")
            for side, rank, e in self.poll():
                if isinstance(e, Bootstrapped):
                    ready.add((side, rank, e.rid))
                    if side == "decode":
                        self.decode[rank][1].announce(e.rid, pages[e.rid], request_pool_index=0)

    def wait_done(self, rids: set[str], timeout: float = 120) -> float:
        """Poll until every decode rank emitted RemotePrefillDone for ``rids``; returns time.perf_counter() then."""
        done: set[tuple[int, str]] = set()
        deadline = Deadline.after(timeout)
        while len(done) < len(rids) * self.d_tp:
            if deadline.expired():
                raise TimeoutError(f"transfer: {len(done)} of {len(rids) * self.d_tp}")
            for side, rank, e in self.poll():
                if side == "decode" and isinstance(e, RemotePrefillDone) and e.rid in rids:
                    done.add((rank, e.rid))
        return time.perf_counter()


def bench_hetero(order: str, requests: int, layers: int) -> dict[str, Any]:
    layout = layout_of(order, layers)
    p_tp, d_tp, per = 2, 4, 16
    num_pages = requests * per
    dep = Deployment(layout, p_tp, d_tp, num_pages)
    try:
        rids = [f"r{i}" for i in range(requests)]
        pages = {rid: list(range(i * per, (i + 1) * per)) for i, rid in enumerate(rids)}
        dep.bootstrap(rids, list(range(requests)), pages)
        start = time.perf_counter()
        for rid in rids:
            for _, outbox, _ in dep.prefill:
                outbox.send(rid, pages[rid], first_token=1)
        end = dep.wait_done(set(rids))
        nbytes = requests * per * layout.page_bytes(d_tp) * layout.buffers * d_tp
        e2e = nbytes / (end - start) / 1e9
    finally:
        dep.close()
    return {"bench": "hetero", "order": order, "prefill_tp": p_tp, "decode_tp": d_tp, "requests": requests,
            "bytes": nbytes, "gbps": e2e * 8, "e2e_GBps": e2e, **floor_hetero(layout, p_tp, d_tp, requests, per)}


def floor_hetero(layout: KvLayout, p_tp: int, d_tp: int, requests: int, per: int) -> dict[str, Any]:
    """The TCP transport alone posting the same planned batches: 2 sources, 4 sinks, this process."""
    num_pages = requests * per
    route = routing(layout, p_tp, d_tp)
    srcs, sinks = [], []
    try:
        for p in range(p_tp):
            t = transport_mod.create("tcp", host="127.0.0.1")
            bufs = [np.ones(num_pages * layout.page_bytes(p_tp), np.uint8) for _ in range(layout.buffers)]
            srcs.append((t, [t.register(b) for b in bufs], bufs))
        for d in range(d_tp):
            t = transport_mod.create("tcp", host="127.0.0.1")
            bufs = [np.zeros(num_pages * layout.page_bytes(d_tp), np.uint8) for _ in range(layout.buffers)]
            sinks.append((t, [t.register(b) for b in bufs], bufs))
        handles = {(p, d): srcs[p][0].connect(sinks[d][0].endpoint(), deadline=Deadline.after(10))
                   for d in range(d_tp) for p in route.sources(d)}
        batches = []
        for i in range(requests):
            pg = list(range(i * per, (i + 1) * per))
            for (p, d), h in handles.items():
                w = plan(layout, p_tp, p, d_tp, d, [r.addr for r in srcs[p][1]], [r.addr for r in sinks[d][1]], pg, pg)
                batches.append((p, h, w))
        left = [len(batches)]
        done = threading.Event()

        def landed(_b: int, err: Any) -> None:
            assert err is None, err
            left[0] -= 1
            if not left[0]:
                done.set()

        start = time.perf_counter()
        for p, h, w in batches:
            srcs[p][0].write(h, w, landed, deadline=Deadline.after(60))
        assert done.wait(120), "the floor's writes did not complete"
        secs = time.perf_counter() - start
        nbytes = sum(int(w[:, 2].sum()) for _, _, w in batches)
        return {"floor_GBps": nbytes / secs / 1e9, "floor_gbps": nbytes / secs / 1e9 * 8}
    finally:
        for t, _, _ in srcs + sinks:
            t.close()


def bench_layerwise(layers: int, layer_ms: float, repeats: int) -> dict[str, Any]:
    layout = layout_of("hnd", layers)
    per = 64
    dep = Deployment(layout, 1, 1, 4 * per, layerwise_min_pages=per)
    tails: dict[str, list[float]] = {"streamed": [], "at_end": [], "rtt": []}
    try:
        n = 0
        for rep in range(repeats):
            for mode in ("streamed", "at_end", "rtt"):
                rid = f"{mode}{rep}"
                pages = list(range((n % 3) * per, (n % 3) * per + (1 if mode == "rtt" else per)))
                n += 1
                dep.bootstrap([rid], [10_000 + n], {rid: pages})
                _, outbox, _ = dep.prefill[0]
                outbox.begin(rid, pages)
                for layer in range(layers if mode != "rtt" else 0):
                    time.sleep(layer_ms / 1000)  # the layer's forward pass
                    if mode == "streamed":
                        outbox.layers_done(rid, layer + 1)
                last = time.perf_counter()
                outbox.finish(rid, first_token=1)
                tails[mode].append(dep.wait_done({rid}) - last)
    finally:
        dep.close()
    med = {k: statistics.median(v) * 1000 for k, v in tails.items()}
    per_layer = med["at_end"] / layers
    bound = 2 * per_layer + med["rtt"]
    return {"bench": "layerwise", "layers": layers, "layer_ms": layer_ms, "prompt_pages": per,
            "bytes_per_layer": 2 * per * layout.page_bytes(1), "streamed_tail_ms": med["streamed"],
            "at_end_tail_ms": med["at_end"], "rtt_ms": med["rtt"], "per_layer_ms": per_layer, "bound_ms": bound,
            "met": med["streamed"] <= bound}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-ms", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=None)
    args = ap.parse_args(argv)
    requests = args.requests or (16 if args.quick else 64)
    rows = bench_writes(args.layers)
    rows += [bench_hetero(order, requests, args.layers) for order in ("hnd", "nhd")]
    rows.append(bench_layerwise(args.layers, args.layer_ms, 3 if args.quick else 7))
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"writes per request (64 pages, {args.layers} layers, {HEADS} heads): planner vs per-token-slot scheme")
    for r in rows:
        if r["bench"] == "writes":
            print(f"  P{r['prefill_tp']}->D{r['decode_tp']} {r['order']}: {r['planner_writes']:>8} vs "
                  f"{r['slot_writes']:>8} = {r['ratio']:.4f}x")
    for r in rows:
        if r["bench"] == "hetero":
            ratio = r["e2e_GBps"] / r["floor_GBps"]
            goal = f"(target >= 0.8: {'met' if ratio >= 0.8 else 'NOT met'})" if r["order"] == "hnd" else "(printed as is)"
            print(f"hetero P2->D4 {r['order']}: {r['e2e_GBps']:.2f} GB/s vs transport floor {r['floor_GBps']:.2f} GB/s "
                  f"= {ratio:.2f}x {goal}")
    for r in rows:
        if r["bench"] == "layerwise":
            print(f"layer-wise, {r['layers']} layers x {r['layer_ms']:g} ms, {r['bytes_per_layer'] >> 20} MiB a layer: "
                  f"tail streamed {r['streamed_tail_ms']:.1f} ms vs at end {r['at_end_tail_ms']:.1f} ms; bound 2 x "
                  f"{r['per_layer_ms']:.1f} + rtt {r['rtt_ms']:.1f} = {r['bound_ms']:.1f} ms "
                  f"({'met' if r['met'] else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
