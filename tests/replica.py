"""Run a function on every rank of a real gloo replica: one spawned process per rank.

Each rank joins a ``torch.distributed`` gloo group through a file store (no
port to race for), runs ``fn(rank, world, *args)`` and sends back its result
or its exception text. Everything is bounded: the gloo timeout, the wait for
results, and the join; a rank still alive at the end is killed and the call
fails naming it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

from pdcore.core.deadline import Deadline


def _rank_main(fn: Callable[..., Any], rank: int, world: int, store: str, env: dict, args: tuple, out: Any) -> None:
    os.environ.update(env)
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        try:
            out.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report, never hang the parent
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_replica(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, env: dict | None = None
) -> list[Any]:
    """Results of ``fn`` on ranks 0..world-1; raises if any rank failed or overran ``timeout``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    deadline = Deadline.after(timeout)
    child_env = {"GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="pdcore-gloo-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world, store, child_env, args, out), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, tuple[str, Any]] = {}
        try:
            while len(results) < world:
                try:
                    rank, status, value = out.get(timeout=max(0.01, deadline.remaining()))
                except queue.Empty:
                    missing = sorted(set(range(world)) - set(results))
                    raise TimeoutError(f"ranks {missing} gave no result within {timeout} s") from None
                results[rank] = (status, value)
        finally:
            for p in procs:
                p.join(timeout=max(0.1, min(10.0, deadline.remaining())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise AssertionError("ranks failed:\n" + "\n".join(f"rank {r}: {v}" for r, v in sorted(errors.items())))
    return [results[r][1] for r in range(world)]
