"""Device-resident KV against host KV, measured in one run: the gather into pinned memory, and PD end to end.

    python benchmarks/device_kv.py [--quick] [--kv-device cuda|standin] [--requests N] [--repeats R]

``gather`` rows: the copier a staged transport uses (``transport.device_copy``) gathers batches of
``--pages`` scattered pages of ``--page-bytes`` from a device buffer into its host mirror, one batch
after another with ``--inflight`` in flight; GB/s is gathered bytes over the wall time. The goal on a
GPU machine is at least 40 GB/s for batches of 64 pages of 64 KiB. On the stand-in device (no GPU)
the copies are CPU memcpys with injected delays: the row shows the path works, not a speed.

``e2e`` rows: ``pdcore.tools.demo.run`` (real processes, sockets, peers; contents neither filled nor
checked) with the KV cache in host memory and in device memory, alternated ``--repeats`` times in
this run; ``ratio_device_vs_host`` is the device runs' median requests/s over the host runs'. The
goal on a GPU machine is at least 0.9.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

SECRET = secrets.token_bytes(32)  # every rank of a run holds it (as a deployment would)


def _copier(kind: str) -> Any:
    from transport.device_copy import CudaCopier, StandInCopier

    return CudaCopier() if kind == "cuda" else StandInCopier(seed=1)


def bench_gather(kind: str, pages: int, page_bytes: int, batches: int, inflight: int) -> dict[str, Any]:
    """Gather ``batches`` batches of ``pages`` random pages each; GB/s over the wall time."""
    total_pages = max(4 * pages, (256 << 20) // page_bytes)
    if kind == "cuda":
        import torch

        buf: Any = torch.randint(0, 255, (total_pages * page_bytes,), dtype=torch.uint8, device="cuda")
    else:
        buf = np.random.default_rng(0).integers(0, 255, total_pages * page_bytes, dtype=np.uint8)
    copier = _copier(kind)
    mirror = copier.mirror(buf)
    rng = np.random.default_rng(1)
    plans = [[(int(p) * page_bytes, page_bytes) for p in sorted(rng.choice(total_pages, pages, replace=False))]
             for _ in range(batches)]
    slots = threading.Semaphore(inflight)
    finished = threading.Event()
    errors: list[str] = []
    left = [batches]
    lock = threading.Lock()

    def done(error: str | None) -> None:
        if error is not None:
            errors.append(error)
        slots.release()
        with lock:
            left[0] -= 1
            if left[0] == 0:
                finished.set()

    try:
        t0 = time.perf_counter()
        for spans in plans:
            if not slots.acquire(timeout=60):
                raise RuntimeError("a gather took over 60 s")
            copier.gather(buf, mirror, spans, done)
        if not finished.wait(120):
            raise RuntimeError("the gathers did not finish within 120 s")
        seconds = time.perf_counter() - t0
    finally:
        copier.unmirror(mirror)
        copier.close()
    if errors:
        raise RuntimeError(f"gathers failed: {errors[:3]}")
    last = plans[-1][0]
    src = buf[last[0]:last[0] + last[1]]
    ok = np.array_equal(mirror[last[0]:last[0] + last[1]], src.cpu().numpy() if hasattr(src, "cpu") else src)
    nbytes = batches * pages * page_bytes
    return {"device": kind, "pages": pages, "page_bytes": page_bytes, "batches": batches, "seconds": seconds,
            "GBps": nbytes / seconds / 1e9, "us_per_batch": seconds / batches * 1e6, "byte_exact": ok}


def e2e_once(kv_device: str, requests: int, seed: int, layers: int, page_bytes: int) -> float:
    """One ``demo.run`` 1P1D; requests per second."""
    from pdcore.tools.demo import Plan, make_requests, run

    reqs = make_requests(requests, seed=seed, max_pages=16, prefill=1, decode=1)
    plan = Plan(requests=reqs, prefill_tp=[1], decode_tp=[1], layers=layers, page_bytes=page_bytes, num_pages=1024,
                verify=False, prefault=True, timeout=300.0, kv_device=kv_device, secret=SECRET)
    outcome = run(plan)
    ok = sum(r["ok"] for r in outcome.decode.values())
    if outcome.errors or ok != len(reqs):
        raise RuntimeError(f"{kv_device}: {ok} of {len(reqs)} transfers ok, errors {outcome.errors}")
    stamps = [stamp for r in list(outcome.decode.values()) + list(outcome.prefill.values()) for _, _, stamp in r["log"]]
    return len(reqs) / max(1e-9, max(stamps) - min(stamps))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batches and requests (what make gpu-check runs)")
    p.add_argument("--kv-device", choices=("cuda", "standin"), default=None,
                   help="the device (default: cuda where torch sees a GPU, else standin)")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-bytes", type=int, default=64 << 10)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args(argv)
    kind = args.kv_device
    if kind is None:
        import torch

        kind = "cuda" if torch.cuda.is_available() else "standin"
    batches = 200 if args.quick else 2000
    requests = args.requests or (100 if args.quick else 400)
    repeats = args.repeats or (2 if args.quick else 3)

    g = bench_gather(kind, args.pages, args.page_bytes, batches, args.inflight)
    print(f"gather {kind}: {g['batches']} batches of {g['pages']} x {g['page_bytes'] >> 10} KiB pages: "
          f"{g['GBps']:.1f} GB/s, {g['us_per_batch']:.0f} us a batch, byte-exact {g['byte_exact']}"
          + (" (goal >= 40 GB/s)" if kind == "cuda" else " (stand-in: CPU copies with injected delays, not a speed)"))
    host: list[float] = []
    device: list[float] = []
    for i in range(repeats):  # alternated, so both see the same machine
        host.append(e2e_once("cpu", requests, i, 8, 32 << 10))
        device.append(e2e_once(kind, requests, i, 8, 32 << 10))
        print(f"e2e 1P1D run {i + 1}: host KV {host[-1]:.0f} req/s, {kind} KV {device[-1]:.0f} req/s")
    ratio = statistics.median(device) / statistics.median(host)
    print(f"e2e 1P1D {requests} requests x 8 layers x 32 KiB pages: host KV {statistics.median(host):.0f} req/s, "
          f"{kind} KV {statistics.median(device):.0f} req/s: ratio_device_vs_host {ratio:.2f}"
          + (" (goal >= 0.9)" if kind == "cuda" else ""))
    return 0 if g["byte_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
