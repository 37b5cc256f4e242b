"""The same-host agreement through shared memory (``pdcore.core._shm`` and its twin ``pdcore.core._shm_py``).

Fast tests run the ranks as threads of this process (each rank opens the
segment itself, so each holds its own lock, as separate processes do); the
slow ones run real processes in real gloo groups, as tests/test_agreement_gloo.py
does, and kill or stop one of them. Every test checks that no ``/dev/shm``
entry is left behind.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcore.core import _shm_py
from pdcore.core.errors import CollectiveError

REDUCERS = [pytest.param("pdcore.core._shm", marks=pytest.mark.compiled, id="cython"), pytest.param("pdcore.core._shm_py", id="python")]
TWINS = [("pdcore.core._table", "pdcore.core._shm"), ("pdcore.core._table_py", "pdcore.core._shm_py")]


def _entries() -> set[str]:
    return {n for n in os.listdir(_shm_py.SHM_DIR) if n.startswith(_shm_py.PREFIX)}


@pytest.fixture(autouse=True)
def no_leftovers() -> Any:
    before = _entries()
    yield
    assert _entries() - before == set(), "a /dev/shm entry was left behind"


@pytest.fixture(params=REDUCERS)
def reducer_cls(request: pytest.FixtureRequest) -> type:
    return importlib.import_module(request.param).ShmReducer


def _ranks(reducer_cls: type, world: int, nbytes: int, timeout: float = 2.0) -> list[Any]:
    """One reducer per rank over a fresh segment, its name already unlinked (as after attach)."""
    impl = "python" if reducer_cls is _shm_py.ShmReducer else "cython"
    first = _shm_py.Segment.create(world, nbytes, impl)
    try:
        segments = [first] + [_shm_py.Segment.open(first.name, r, world, nbytes, impl) for r in range(1, world)]
    finally:
        first.unlink()
    return [reducer_cls(s, timeout) for s in segments]


def _in_threads(fns: list[Callable[[], Any]], seconds: float = 30.0) -> list[Any]:
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # the test reads it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds)
        assert not t.is_alive(), "a rank hung"
    return results


# -- ranks as threads ------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), world=st.integers(2, 4), nbytes=st.integers(1, 200), rounds=st.integers(1, 12))
def test_every_rank_gets_the_min_of_every_round(reducer_cls: type, data: st.DataObject, world: int, nbytes: int,
                                                rounds: int) -> None:
    seed = data.draw(st.integers(0, 2**32 - 1))
    inputs = np.random.default_rng(seed).integers(0, 256, size=(rounds, world, nbytes), dtype=np.uint8)
    if data.draw(st.booleans()):
        inputs[:, :, : nbytes // 2] = 255  # long runs of "free" slots, as a sparse table sends
    reducers = _ranks(reducer_cls, world, nbytes)
    try:

        def rank(r: int) -> np.ndarray:
            out = np.empty((rounds, nbytes), dtype=np.uint8)
            for k in range(rounds):
                buf = inputs[k, r].copy()
                reducers[r].allreduce_min(buf)
                out[k] = buf
            return out

        results = _in_threads([lambda r=r: rank(r) for r in range(world)])
    finally:
        for red in reducers:
            red.close()
    expected = inputs.min(axis=1)
    for r, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        assert np.array_equal(got, expected), f"rank {r}"
        assert reducers[r].rounds == rounds


def test_a_rank_that_stops_calling_fails_the_round_everywhere(reducer_cls: type) -> None:
    reducers = _ranks(reducer_cls, 3, 64, timeout=0.5)
    try:
        buf = np.zeros(64, dtype=np.uint8)
        assert all(r is None for r in _in_threads([lambda i=i: reducers[i].allreduce_min(buf.copy()) for i in range(3)]))
        started = time.monotonic()
        errors = _in_threads([lambda i=i: reducers[i].allreduce_min(buf.copy()) for i in range(2)])
        elapsed = time.monotonic() - started
        assert 0.4 < elapsed < 3.0
        for exc in errors:
            assert isinstance(exc, CollectiveError), exc
            assert "round 2" in str(exc) and "rank 2 " in str(exc) and "did not arrive within 0.5 s" in str(exc)
        with pytest.raises(CollectiveError, match=r"round 2: this rank 2 arrived after the replica gave up on rank 2"):
            reducers[2].allreduce_min(buf.copy())
        for red in reducers:  # broken for good, as a failed gloo group is
            with pytest.raises(CollectiveError, match="round 2"):
                red.allreduce_min(buf.copy())
    finally:
        for red in reducers:
            red.close()


def test_a_rank_that_left_is_named_at_once(reducer_cls: type) -> None:
    reducers = _ranks(reducer_cls, 2, 16, timeout=30.0)
    try:
        reducers[1].close()
        started = time.monotonic()
        with pytest.raises(CollectiveError, match=r"round 1: rank 1 \(pid \d+\) closed its agreement exited or left"):
            reducers[0].allreduce_min(np.zeros(16, dtype=np.uint8))
        assert time.monotonic() - started < 2.0  # the lock, not the 30 s deadline
    finally:
        reducers[0].close()
        reducers[1].close()  # idempotent


def test_bad_buffers_are_refused_before_the_round(reducer_cls: type) -> None:
    reducers = _ranks(reducer_cls, 2, 16)
    try:
        for bad in (np.zeros(15, dtype=np.uint8), np.zeros(16, dtype=np.int16), b"\0" * 16):
            with pytest.raises(ValueError):
                reducers[0].allreduce_min(bad)
        assert reducers[0].rounds == 0
    finally:
        for red in reducers:
            red.close()
    with pytest.raises(CollectiveError, match="closed"):
        reducers[0].allreduce_min(np.zeros(16, dtype=np.uint8))


def test_a_segment_whose_creator_died_before_unlinking_is_swept() -> None:
    seg = _shm_py.Segment.create(2, 8, "cython")
    name = seg.name
    seg._linked = False  # as if rank 0 died here: the name stays, no rank holds a lock
    seg.close()
    assert name in _entries()
    assert name not in _shm_py.sweep_stale()  # too young: a rank 0 may be about to take its lock
    assert name in _shm_py.sweep_stale(now=time.time() + _shm_py.STALE_AFTER + 1)
    assert name not in _entries()


def test_a_live_segment_is_not_swept() -> None:
    seg = _shm_py.Segment.create(2, 8, "cython")
    try:
        assert seg.name not in _shm_py.sweep_stale(now=time.time() + _shm_py.STALE_AFTER + 1)
    finally:
        seg.close()


# -- real processes, real gloo groups --------------------------------------------------------


def _rank_main(fn: Callable[..., Any], rank: int, world: int, store: str, args: tuple, out: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        out.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)  # no destroy_process_group: a peer may be dead or stopped


def _run(fn: Callable[..., Any], world: int, *args: Any, victim: int | None = None, timeout: float = 120.0) -> dict:
    """Results by rank. ``victim``: that rank kills or stops itself; a stopped one is continued once the
    others reported, and its result (if any) is collected too."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pdcore-shm-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world, store, args, out), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + timeout
        try:
            continued = False
            while len(results) < world:
                others = set(range(world)) - {victim}
                if victim is not None and others <= set(results) and not continued:
                    continued = True
                    if procs[victim].is_alive():
                        os.kill(procs[victim].pid, signal.SIGCONT)
                    else:
                        break  # killed: nothing more will come
                try:
                    rank, status, value = out.get(timeout=max(0.01, min(1.0, end - time.monotonic())))
                except queue.Empty:
                    if time.monotonic() >= end:
                        raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} gave no result") from None
                    continue
                assert status == "ok", f"rank {rank} failed:\n{value}"
                results[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                    p.join(timeout=5)
    return results


def _random_rounds(rank: int, world: int, rounds: int) -> dict:
    """Each twin: two tables driven alike on this rank, one agreed over gloo, one over shared memory."""
    import torch.distributed as dist

    from pdcore.core._spec import Trigger
    from pdcore.core.agreement import Agreement

    group = dist.group.WORLD
    out = {}
    for table_module, _ in TWINS:
        cls = importlib.import_module(table_module).StateTable
        tables = [cls(256, bootstrap_timeout=1e6, waiting_timeout=1e6) for _ in range(2)]
        agreements = [Agreement(tables[0], agreement="group"), Agreement(tables[1], agreement="shm", shm_timeout=20.0)]
        rng = np.random.default_rng(1000 + rank)  # each rank moves its requests its own way
        serial = 0
        same = True
        n_events = 0
        triggers = [Trigger.PEERS_CONNECTED, Trigger.WRITES_LANDED, Trigger.FAIL]
        for rnd in range(rounds):
            while len(tables[0]) < 200:  # every rank registers the same rids in the same order
                for t in tables:
                    t.register(f"r{serial}", float(rnd))
                serial += 1
            rids = tables[0].rids()
            for i in rng.choice(len(rids), size=max(1, len(rids) // 100), replace=False):
                trig = triggers[int(rng.choice(3, p=[0.45, 0.45, 0.1]))]
                for t in tables:
                    t.update(rids[i], trig, float(rnd), "random")
            events = [a.round(float(rnd), group) for a in agreements]
            same &= [(type(e).__name__, e.rid) for e in events[0]] == [(type(e).__name__, e.rid) for e in events[1]]
            n_events += len(events[0])
        out[table_module] = {"same": same, "events": n_events, "modes": [a.mode for a in agreements]}
        for a in agreements:
            a.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.long)])
def test_shared_memory_and_gloo_agree_on_every_round(world: int) -> None:
    results = _run(_random_rounds, world, 150)
    for rank, per_twin in results.items():
        for module, r in per_twin.items():
            assert r["modes"] == ["group", "shm"], (rank, module)
            assert r["same"], f"rank {rank} ({module}): the shared-memory round gave other events than gloo"
            assert r["events"] > 100


def _mismatch(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from pdcore.core.agreement import Agreement

    out = {}
    for table_module, _ in TWINS:
        table = importlib.import_module(table_module).StateTable(32)
        agreement = Agreement(table, agreement="shm")
        for rid in ("a", "b", "c"):
            table.register(rid, 0.0)
        first = agreement.round(0.0, dist.group.WORLD)
        if rank == 1:
            table.register("only-on-rank-1", 0.0)
        try:
            agreement.round(0.0, dist.group.WORLD)
            error = None
        except CollectiveError as exc:
            error = str(exc)
        out[table_module] = {"first": first, "error": error, "mode": agreement.mode, "rids": table.rids()}
        agreement.close()
    return out


@pytest.mark.slow
def test_mismatched_registration_raises_on_every_rank_in_one_round() -> None:
    results = _run(_mismatch, 3)
    for rank, per_twin in results.items():
        for module, r in per_twin.items():
            assert r["mode"] == "shm" and r["first"] == []
            assert r["error"] is not None, f"rank {rank} ({module}) did not notice the mismatch"
            assert "different numbers of live requests" in r["error"]
            assert r["rids"] == (["a", "b", "c", "only-on-rank-1"] if rank == 1 else ["a", "b", "c"])


def _with_a_victim(world: int, how: str, timeout: float, reducer: str) -> dict:
    """What ranks 0 and 1 report when the last rank of ``world`` kills or stops itself in round 5 (``_victim``)."""
    results = _run(_victim, world, how, timeout, reducer, victim=world - 1)
    assert set(results) == {0, 1}
    return results


def _victim(rank: int, world: int, how: str, timeout: float, reducer_module: str) -> dict:
    """Rounds until round 5, when the last rank kills or stops itself before calling."""
    import torch.distributed as dist

    from pdcore.core.agreement import Agreement

    # the table's twin picks the reducer's: the pure table runs the pure round
    table = importlib.import_module({shm: tab for tab, shm in TWINS}[reducer_module]).StateTable(64)
    agreement = Agreement(table, agreement="shm", shm_timeout=timeout)
    table.register("a", 0.0)
    rounds = 0
    started = time.monotonic()
    try:
        for rnd in range(1, 100):
            if rnd == 5 and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            started = time.monotonic()
            agreement.round(0.0, dist.group.WORLD)
            rounds = rnd
        return {"error": None}
    except CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - started, "rounds": rounds, "mode": agreement.mode}


@pytest.mark.slow
@pytest.mark.parametrize("reducer", ["pdcore.core._shm", "pdcore.core._shm_py"])
def test_a_killed_rank_is_named_by_every_other_rank_at_once(reducer: str) -> None:
    world, timeout = 3, 5.0
    results = _with_a_victim(world, "kill", timeout, reducer)
    for rank, r in results.items():
        assert r["error"] is not None and r["mode"] == "shm"
        assert r["rounds"] == 4, r  # every survivor fails in the same round
        assert "round 5" in r["error"] and f"rank {world - 1} (pid" in r["error"] and "exited or left" in r["error"]
        assert r["seconds"] < timeout, r  # its lock went with it: no need to wait out the deadline


@pytest.mark.slow
@pytest.mark.parametrize("reducer", ["pdcore.core._shm", "pdcore.core._shm_py"])
def test_a_stopped_rank_is_named_within_the_deadline_and_fails_when_it_wakes(reducer: str) -> None:
    world, timeout = 2, 1.5
    results = _with_a_victim(world, "stop", timeout, reducer)
    survivor, woken = results[0], results[1]
    assert survivor["rounds"] == 4 and "round 5" in survivor["error"]
    assert "rank 1 (pid" in survivor["error"] and f"did not arrive within {timeout:g} s" in survivor["error"]
    assert timeout * 0.9 < survivor["seconds"] < timeout + 2.0
    assert woken["rounds"] == 4 and "round 5: this rank 1 arrived after the replica gave up on rank 1" in woken["error"]
