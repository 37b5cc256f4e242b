"""What memory windows cost on the verbs transport, as ratios measured in one run.

1. **Grant plus revoke per room**: a sink with windows binds one window per range on the queue
   pair of the connected source, and a revoke asks the source to stop, hears its answer and
   invalidates them; a sink without windows only does bookkeeping (its revoke would kill the queue
   pair, so the room is revoked ``settled``, the cheapest it can be). Printed per room, and the
   ratio.
2. **PD over verbs**: a prefill and a decode peer in this process (single-rank replicas, no torch)
   move ``--requests`` requests of ``--pages`` pages per layer, once with windows and once without,
   alternating ``--repeats`` times; the ratio of requests per second (windows / none, best of each)
   is the cost seen end to end. The goal is at least 0.95x.

Needs a verbs device (the soft-RoCE guest: ``bash ci/rxe-vm.sh .venv/bin/python benchmarks/windows.py``).

    python benchmarks/windows.py [--rooms 200] [--ranges 8] [--requests 64] [--pages 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transport  # noqa: E402
from transport.deadline import Deadline  # noqa: E402

from _pipeline import RunClock, say  # noqa: E402

PAGE = 32 << 10


def grant_revoke(windows: bool, rooms: int, ranges: int) -> float:
    """Seconds per room of grant + revoke of ``ranges`` pages apart, with a source connected."""
    src_t = transport.create("verbs")
    dst_t = transport.create("verbs", memory_windows=windows)
    try:
        buf = np.zeros(2 * ranges * PAGE, np.uint8)
        r = dst_t.register(buf, require_grant=True)
        src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
        pages = [(r.addr + 2 * i * PAGE, PAGE) for i in range(ranges)]  # apart: one window each
        t0 = time.perf_counter()
        for _ in range(rooms):
            g = dst_t.grant(src_t.instance, pages)
            dst_t.revoke(g, deadline=Deadline.after(5), settled=not windows)
        return (time.perf_counter() - t0) / rooms
    finally:
        src_t.close()
        dst_t.close()


def pd_run(windows: bool, requests: int, pages: int, layers: int) -> float:
    """Requests per second, register to the last ``RemotePrefillDone``, one prefill and one decode rank."""
    from pdcore import BootstrapInfo, Bootstrapped, DecodeConfig, DecodePeer, PrefillConfig, PrefillPeer, RemotePrefillDone
    from pdcore.control.bootstrap import BootstrapServer

    num_pages = requests * pages
    options = {"transport": "verbs", "transport_options": {"memory_windows": windows}}
    knobs = dict(page_bytes=PAGE, num_pages=num_pages, heartbeat_interval=0.5, dead_after=60.0, **options)
    p_cache = [np.random.default_rng(layer).integers(0, 256, num_pages * PAGE, dtype=np.uint8) for layer in range(layers)]
    d_cache = [np.zeros(num_pages * PAGE, np.uint8) for _ in range(layers)]
    server = BootstrapServer()
    port = server.start()
    prefill, outbox = PrefillPeer.start(PrefillConfig(kv_buffers=p_cache, bootstrap_host="127.0.0.1", bootstrap_port=port, **knobs))
    decode, inbox = DecodePeer.start(DecodeConfig(kv_buffers=d_cache, **knobs))
    try:
        t0 = time.perf_counter()
        for i in range(requests):
            info = BootstrapInfo("127.0.0.1", port, 9000 + i)
            decode.register(f"r{i}", info)
            prefill.register(f"r{i}", info)
        done = 0
        deadline = Deadline.after(300)
        while done < requests:
            if deadline.expired():
                raise RuntimeError(f"only {done} of {requests} requests landed within 300 s")
            for event in decode.poll():
                i = int(event.rid[1:])
                if isinstance(event, Bootstrapped):
                    inbox.announce(event.rid, [i * pages + k for k in range(pages)][::-1], i)
                elif isinstance(event, RemotePrefillDone):
                    done += 1
                else:
                    raise RuntimeError(f"{event.rid}: {event}")
            for event in prefill.poll():
                i = int(event.rid[1:])
                if isinstance(event, Bootstrapped):
                    prefill.record_usage(event.rid, cached_tokens=0, bootstrap_logprob=None)
                    outbox.send(event.rid, [i * pages + k for k in range(pages)], first_token=1)
            time.sleep(0.0005)
        took = time.perf_counter() - t0
        for layer in range(layers):
            if not np.array_equal(d_cache[layer].reshape(requests, pages, PAGE)[:, ::-1], p_cache[layer].reshape(requests, pages, PAGE)):
                raise RuntimeError(f"layer {layer}: the pages did not land as written")
        return requests / took
    finally:
        prefill.close()
        decode.close()
        server.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rooms", type=int, default=200)
    ap.add_argument("--ranges", type=int, default=8, help="pages apart per room: windows per grant")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--pages", type=int, default=4, help="pages per request per layer")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    clock = RunClock(quick=False)
    with_w = grant_revoke(True, args.rooms, args.ranges)
    without = grant_revoke(False, args.rooms, args.ranges)
    say(f"grant + revoke per room of {args.ranges} windows: {with_w * 1e6:.0f} us with windows, "
        f"{without * 1e6:.0f} us bookkeeping only")
    rates: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.repeats):
        for windows in (True, False) if rep % 2 == 0 else (False, True):
            rates[windows].append(pd_run(windows, args.requests, args.pages, args.layers))
            say(f"PD over verbs, windows={windows}: {rates[windows][-1]:.1f} requests/s")
    ratio = max(rates[True]) / max(rates[False])
    out: dict[str, Any] = {
        "grant_revoke_us": {"windows": round(with_w * 1e6, 1), "bookkeeping": round(without * 1e6, 1),
                            "ranges": args.ranges},
        "pd_requests_per_s": {"windows": [round(x, 2) for x in rates[True]], "none": [round(x, 2) for x in rates[False]]},
        "pd_ratio_windows_over_none": round(ratio, 3),
        **clock.fields(),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"grant+revoke per room ({args.ranges} windows): {out['grant_revoke_us']['windows']} us "
              f"(bookkeeping only: {out['grant_revoke_us']['bookkeeping']} us)")
        print(f"PD over verbs, {args.requests} requests x {args.pages} pages x {args.layers} layers of {PAGE >> 10} KiB: "
              f"windows {ratio:.2f}x of none (goal >= 0.95x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
