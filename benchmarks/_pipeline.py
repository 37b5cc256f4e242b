"""What the benchmarks share: the pipelined replay both transport floors use (post batches up to the in-flight
bound, reap, repeat), a benchmark rank of a real gloo replica and the world of them, and the run's progress
lines and machine fields."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from pdcore.core.deadline import Deadline
from pdcore.core.errors import CapacityError


def say(msg: str) -> None:
    """A progress line, on stderr (stdout holds the table or the JSON)."""
    print(f"# {msg}", file=sys.stderr, flush=True)


class RunClock:
    """When a benchmark run started and how busy the machine was then; ``fields`` adds the end's."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.started = time.monotonic()
        self.load_before = os.getloadavg()

    def fields(self) -> dict[str, Any]:
        return {
            "loadavg_before": [round(x, 2) for x in self.load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
            "quick": self.quick,
            "seconds": round(time.monotonic() - self.started, 1),
        }


def post_pipelined(t: Any, peer: Any, batches: Sequence[Any], seconds: float, what: str) -> None:
    """Post every batch in order, as many in flight as the transport allows; wait for all (queue mode)."""
    posted = done = 0
    deadline = Deadline.after(seconds)
    while done < len(batches):
        while posted < len(batches):
            try:
                t.write(peer, batches[posted])
            except CapacityError:
                break
            posted += 1
        for c in t.completions(deadline=deadline):
            if c.error is not None:
                raise c.error
            done += 1
        deadline.check(what)


def gloo_rank(measure: Callable[..., Any], rank: int, world: int, store: str, out: Any, *args: Any) -> None:
    """A spawned rank: join the gloo group at ``store``, run ``measure(group, rank, world, *args)``, and put
    rank 0's result (or any rank's error) on ``out``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        result = measure(dist.group.WORLD, rank, world, *args)
        if rank == 0:
            out.put(result)
    except BaseException as e:
        out.put({"error": f"rank {rank}: {type(e).__name__}: {e}"})
        raise
    finally:
        dist.destroy_process_group()


def gloo_world(world: int, prefix: str, measure: Callable[..., Any], *args: Any) -> Any:
    """Spawn ``world`` ``gloo_rank`` processes running ``measure(group, rank, world, *args)``, meeting at a file
    store in a temporary directory named ``prefix...``; what rank 0 (or a failing rank) put, within 10 minutes.
    Every rank is joined on the way out, and killed if it lingers 30 s."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=gloo_rank, args=(measure, r, world, store, out, *args)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            return out.get(timeout=600)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
