"""The floor for the verbs benchmark: perftest's ``ib_write_bw`` on the same device and message size.

``measure(device, size, iters)`` runs an ``ib_write_bw`` server and client on this
host over ``device`` (the out-of-band exchange over 127.0.0.1, the GID index
chosen as the verbs transport chooses it, ``-x``) and returns the client's
``BW average`` in Gbit/s. Under soft-RoCE only ratios against this floor mean
anything.

    python benchmarks/_ib_write_bw.py [--device rxe0] [--size 65536] [--iters 1000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time

__all__ = ["measure", "default_device"]

_BIN = "ib_write_bw"


def default_device() -> tuple[str, int, int]:
    """``(device, port, gid_index)`` as ``transport.create("verbs")`` would choose them."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from transport.verbs import describe_device

    return describe_device()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    """True once some socket listens on ``port`` (read from /proc: connecting would use up perftest's one accept)."""
    want = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[1].endswith(want) and fields[3] == "0A":
                        return True
        except OSError:
            continue
    return False


def _parse_bw_average(out: str) -> float:
    """The ``BW average`` column of perftest's result row, in Gbit/s (from MB/sec = 2**20 B/s, or Gb/sec)."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if "BW average" in line:
            head = [t for t in line.replace("#", " ").split() if t != "BW"]  # "BW peak[..]" is one column
            col = next((k for k, t in enumerate(head) if t.startswith("average[")), 3)
            unit = head[col] if col < len(head) else "average[MB/sec]"
            for row in lines[i + 1 :]:
                cells = row.split()
                if len(cells) > col and cells[0].isdigit():
                    value = float(cells[col])
                    gbits = value if "Gb/sec" in unit else value * 2**20 * 8 / 1e9
                    if gbits <= 0:
                        raise RuntimeError(f"ib_write_bw reported no bandwidth:\n{out}")
                    return gbits
    raise RuntimeError(f"no 'BW average' row in ib_write_bw output:\n{out}")


def measure(device: str, size: int, iters: int, *, gid_index: int | None = None, ib_port: int | None = None, timeout: float = 120.0) -> float:
    """Run ib_write_bw server + client on ``device``; return the average bandwidth in Gbit/s."""
    if shutil.which(_BIN) is None:
        raise RuntimeError(f"{_BIN} not found: apt-get install perftest")
    if gid_index is None or ib_port is None:
        dev, port, gid = default_device() if device is None else _describe(device)
        gid_index = gid if gid_index is None else gid_index
        ib_port = port if ib_port is None else ib_port
    tcp_port = _free_port()
    common = [_BIN, "-d", device, "-i", str(ib_port), "-x", str(gid_index), "-s", str(size), "-n", str(iters),
              "-p", str(tcp_port), "-F"]  # MB/sec: two decimals of MB/s keep small rates nonzero
    deadline = time.monotonic() + timeout
    server = subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not _listening(tcp_port):
            if server.poll() is not None:
                raise RuntimeError(f"ib_write_bw server exited {server.returncode}:\n{server.stdout.read() if server.stdout else ''}")
            if time.monotonic() > deadline:
                raise RuntimeError("ib_write_bw server did not listen in time")
            time.sleep(0.02)  # polling a readiness condition, bounded by the deadline
        client = subprocess.run(common + ["127.0.0.1"], capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()))
        if client.returncode != 0:
            raise RuntimeError(f"ib_write_bw client exited {client.returncode}:\n{client.stdout}{client.stderr}")
        server.wait(timeout=max(1.0, deadline - time.monotonic()))
        return _parse_bw_average(client.stdout)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


def _describe(device: str) -> tuple[str, int, int]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from transport.verbs import describe_device

    return describe_device(device)


def verbs_gbits(device: str, size: int, iters: int, *, per_batch: int = 1, window: int = 64) -> float:
    """The verbs transport on the same device: ``iters`` writes of ``size`` in batches of ``per_batch``."""
    import threading

    import numpy as np

    import transport
    from pdcore.core.deadline import Deadline

    src_t = transport.create("verbs", device=device, max_inflight=window)
    dst_t = transport.create("verbs", device=device)
    try:
        slots = 64
        src, dst = np.ones(size * slots, np.uint8), np.zeros(size * slots, np.uint8)
        rs, rd = src_t.register(src), dst_t.register(dst)
        peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(30))
        nbatches = max(1, iters // per_batch)
        batches = [
            [(rs.addr + (k % slots) * size, rd.addr + (k % slots) * size, size) for k in range(i * per_batch, (i + 1) * per_batch)]
            for i in range(nbatches)
        ]
        cond = threading.Condition()
        state = {"done": 0, "error": None}

        def on_done(_bid: int, err: Exception | None) -> None:
            with cond:
                state["done"] += 1
                state["error"] = state["error"] or err
                cond.notify()

        t0 = time.monotonic()
        for b in batches:
            src_t.write(peer, b, on_done, deadline=Deadline.after(60))
        with cond:
            if not cond.wait_for(lambda: state["done"] >= nbatches, timeout=120):
                raise RuntimeError(f"only {state['done']} of {nbatches} batches completed in 120 s")
        seconds = time.monotonic() - t0
        if state["error"] is not None:
            raise RuntimeError(f"a batch failed: {state['error']}")
        return nbatches * per_batch * size * 8 / seconds / 1e9
    finally:
        src_t.close()
        dst_t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="default: the device the verbs transport would choose")
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--vs-verbs", action="store_true", help="also time the verbs transport on the same writes; print the ratio")
    args = ap.parse_args()
    device, port, gid = _describe(args.device) if args.device else default_device()
    t0 = time.monotonic()
    gbits = measure(device, args.size, args.iters, gid_index=gid, ib_port=port)
    print(f"ib_write_bw {device} port {port} gid {gid} size {args.size} iters {args.iters}: "
          f"{gbits:.3f} Gbit/s ({gbits * 1e9 / 8 / 2**20:.1f} MiB/s) in {time.monotonic() - t0:.1f}s", flush=True)
    if args.vs_verbs:
        for per_batch in (1, 16):
            t0 = time.monotonic()
            v = verbs_gbits(device, args.size, args.iters, per_batch=per_batch)
            verdict = "met" if v / gbits >= 0.8 else "NOT met"
            print(f"verbs transport, {per_batch} write(s) per batch: {v:.3f} Gbit/s = {v / gbits:.2f} x ib_write_bw "
                  f"(target >= 0.8: {verdict}) in {time.monotonic() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
