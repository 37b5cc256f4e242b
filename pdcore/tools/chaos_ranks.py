"""A chaos run's rank processes: a miniature scheduler loop per rank (``demo.py``'s, plus canaries and self-stops).

Prefill ranks fill each request's pages with a pattern only that (request, rank) has and
hand them over; decode ranks check every byte on ``RemotePrefillDone`` and fill every page
they take back with a canary that must stay intact. Each rank reports its log to the runner.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np

from .demo import Pages, Request, _cache, _leftovers, first_token, pattern, timings
from .ranks import cause
from .chaos_plan import CANARY_DONE, CANARY_FAILED, ChaosPlan, FRESH


class CanaryPages(Pages):
    """Demo's free list, plus canaries: a page taken back is filled with a canary byte that must be
    intact when the page is taken again (and at the end); never-used pages must stay zero.

    A broken canary is compared with the prefill data of the page's past owners (the last few
    requests that held it), so the report can say whose late write it was.
    """

    HISTORY = 8

    def __init__(self, plan: ChaosPlan, cache: list[np.ndarray], rank: int) -> None:
        super().__init__(plan.num_pages)
        self._views = [buf.reshape(plan.num_pages, plan.page_bytes) for buf in cache]
        self._plan = plan
        self._rank = rank
        #: page -> (byte it must hold, how it came back)
        self.guarded: dict[int, tuple[int, str]] = {p: (FRESH, "never used") for p in range(plan.num_pages)}
        #: page -> its last owners, newest last: (rid, index of the page in that rid's pages, that rid's page count)
        self.owners: dict[int, deque[tuple[str, int, int]]] = {}
        self.violations: list[dict[str, Any]] = []

    def take(self, n: int) -> list[int] | None:
        got = super().take(n)
        if got:
            self.check(got, "when taken again")
            for p in got:
                self.guarded.pop(p, None)
        return got

    def give_back(self, pages: list[int], rid: str, how: str, byte: int) -> None:
        for view in self._views:
            view[pages] = byte
        for i, p in enumerate(pages):
            self.guarded[p] = (byte, f"{rid} {how}")
            self.owners.setdefault(p, deque(maxlen=self.HISTORY)).append((rid, i, len(pages)))
        self.give(pages)

    def check(self, pages: list[int] | None = None, when: str = "by the sweep") -> None:
        pages = list(self.guarded) if pages is None else [p for p in pages if p in self.guarded]
        if not pages:
            return
        by_byte: dict[int, list[int]] = {}
        for p in pages:
            by_byte.setdefault(self.guarded[p][0], []).append(p)
        for byte, group in by_byte.items():
            bad = np.zeros(len(group), bool)
            for view in self._views:
                bad |= (view[group] != byte).any(axis=1)
            for p in np.asarray(group)[bad].tolist():
                _, how = self.guarded.pop(p)
                self.violations.append(
                    {"page": p, "how": how, "when": when, "t": time.time(),
                     "bytes": int(sum(int((view[p] != byte).sum()) for view in self._views)),
                     "writer": self.whose(p)}
                )

    def whose(self, page: int) -> str:
        """Which past owner's prefill data the page holds (in any layer), newest first; '' if none."""
        pb = self._plan.page_bytes
        for rid, i, n in reversed(self.owners.get(page, ())):
            data = pattern(rid, self._rank, n * pb)
            for layer, view in enumerate(self._views):
                if np.array_equal(view[page], np.roll(data, layer)[i * pb : (i + 1) * pb]):
                    return rid
        return ""


def _join_group(store: str, rank: int, world: int, timeout: float) -> Any:
    if world == 1:
        return None
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )
    return dist.group.WORLD


class _Sync:
    """Rank 0 reads the runner's messages and broadcasts them to its replica, once per round."""

    def __init__(self, conn: Any, group: Any, rank: int, plan: ChaosPlan) -> None:
        self._conn, self._group, self._rank, self._plan = conn, group, rank, plan
        self.stop_at: float | None = None
        self.selfstop = -1  # rank 0: the last mask the runner sent (-1: none since the last round)
        #: this rank stops itself (SIGSTOP) right after its next big handover (armed by the runner)
        self.stop_after_handover = False

    def __call__(self) -> tuple[list[Request], bool, bool]:
        new: list[Request] = []
        stop = abandon = False
        mask = -1
        if self._rank == 0:
            while self._conn.poll():
                msg = self._conn.recv()
                if msg[0] == "add":
                    new.extend(msg[1])
                elif msg[0] == "stop" and self.stop_at is None:
                    self.stop_at = time.monotonic()
                elif msg[0] == "selfstop":
                    mask = msg[1]
            stop = self.stop_at is not None
            abandon = stop and time.monotonic() - self.stop_at > self._plan.drain  # type: ignore[operator]
        if self._group is not None:
            import torch
            import torch.distributed as dist

            head = torch.tensor([len(new), int(stop), int(abandon), mask], dtype=torch.int64)
            dist.broadcast(head, 0, group=self._group)
            if int(head[0]):
                box: list[Any] = [new if self._rank == 0 else None]
                dist.broadcast_object_list(box, 0, group=self._group)
                new = box[0]
            stop, abandon, mask = bool(head[1]), bool(head[2]), int(head[3])
        if mask >= 0:
            self.stop_after_handover = bool(mask >> self._rank & 1)
        return new, stop, abandon

    def handed_over(self, pages: int, conn: Any, who: tuple[str, int, int, int]) -> None:
        """After a handover: stop this process now if the runner asked for it (a pause mid-transfer:
        the writes just posted are still queued in this process when it stops)."""
        if self.stop_after_handover and pages * 2 >= self._plan.max_pages:
            self.stop_after_handover = False
            conn.send(("stopping", *who, pages))
            os.kill(os.getpid(), signal.SIGSTOP)


def _knobs(plan: ChaosPlan, role: str, index: int, gen: int, rank: int) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if plan.transport.startswith("faulty:"):
        options = {"seed": plan.rank_seed(role, index, gen, rank, "transport"), "fail_rate": plan.fail_rate,
                   "land_rate": plan.land_rate, "delay": plan.delay}
    control: dict[str, Any] = {"control": plan.control}
    if any((plan.control_drop, plan.control_delay, plan.control_dup, plan.control_corrupt)):
        control = {"control": f"faulty:{plan.control}", "control_options": {
            "seed": plan.rank_seed(role, index, gen, rank, "control"), "drop": plan.control_drop,
            "delay": plan.control_delay, "max_delay": plan.control_max_delay, "dup": plan.control_dup,
            "corrupt": plan.control_corrupt}}
    return {
        "page_bytes": plan.page_bytes,
        "num_pages": plan.num_pages,
        "transport": plan.transport,
        "transport_options": options,
        **control,
        "capacity": 1024,
        **timings(plan),
        **({"unsafe_no_grants": True} if plan.unsafe_no_grants else {}),
        "secret": plan.secret,
    }


def _finish(peer: Any, plan: ChaosPlan, result: dict[str, Any]) -> dict[str, Any]:
    """Leftovers before close; threads and fault counters after it.

    Bookkeeping that expires on a timer (an announcement for a room never registered here waits
    ``bootstrap_timeout``; a corrupted or late frame can leave one) is given that long to go: what
    is still there after its timeout is a leak. Every rank of the replica left its loop in the same
    round, so no collective waits meanwhile.
    """
    def maps() -> dict[str, int]:  # as demo._leftovers counts them
        held = peer.diagnostics()["engines"][peer.ROLE]
        return {k: v for k, v in held.items() if k not in ("tombstones", "connected_peers")}

    peer.quiesce()  # the last round's ends reach the engine first
    result["maps_at_end"] = maps()
    until = time.monotonic() + max(plan.bootstrap_timeout, plan.waiting_timeout, plan.fence_timeout) + 2.0
    while any(maps().values()) and time.monotonic() < until:
        time.sleep(0.05)
    result.update(_leftovers(peer, plan))
    d = peer.diagnostics()
    result["transport_faults"] = d.get("transport", {}).get("faults", {})
    result["control_faults"] = d.get("control_faults", {})
    result["corrupted_still_valid"] = d.get("control_samples", [])
    result["control_stats"] = d.get("channel", {})
    result["peer_stats"] = d["stats"]
    peer.close()
    until = time.monotonic() + 3.0
    while True:
        alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("pdcore") and t.is_alive())
        if not alive or time.monotonic() > until:
            break
        time.sleep(0.05)
    result["threads_after_close"] = alive
    return result


def prefill_rank(plan: ChaosPlan, index: int, gen: int, rank: int, port: int, store: str, conn: Any) -> None:
    from .. import BootstrapInfo, PrefillConfig, PrefillPeer

    group = _join_group(store, rank, plan.prefill_tp, plan.collective_timeout)
    cache = _cache(plan)  # type: ignore[arg-type]
    peer, outbox = PrefillPeer.start(
        PrefillConfig(kv_buffers=cache, tp_size=plan.prefill_tp, tp_rank=rank, bootstrap_host="127.0.0.1",
                      bootstrap_port=port, **_knobs(plan, "prefill", index, gen, rank))
    )
    conn.send(("ready", "prefill", index, gen, rank, os.getpid()))
    sync = _Sync(conn, group, rank, plan)
    pages = Pages(plan.num_pages)
    held: dict[str, list[int]] = {}
    live: dict[str, Request] = {}
    log: list[tuple[str, str]] = []
    waiting: deque[Request] = deque()
    ended: set[str] = set()
    abandoned = False
    try:
        while True:
            end = _news(sync, peer, live, log, lambda r: BootstrapInfo("127.0.0.1", port, r.room))
            if end:
                abandoned = end == "abandon"
                break
            for event in _ends(peer.poll(group), live, log, waiting, ended):
                pages.give(held.pop(event.rid, []))
                if rank == 0:
                    conn.send(("ended", "prefill", index, gen, rank, (event.rid, type(event).__name__)))
            while (admitted := pages.admit(waiting, ended, held)) is not None:
                r, got = admitted
                data = pattern(r.rid, rank, r.pages * plan.page_bytes)
                for layer, buf in enumerate(cache):
                    buf.reshape(plan.num_pages, plan.page_bytes)[got] = np.roll(data, layer).reshape(r.pages, plan.page_bytes)
                peer.record_usage(r.rid, cached_tokens=r.pages, bootstrap_logprob=-0.25)
                outbox.send(r.rid, got, first_token(r.rid), [first_token(r.rid) % 97])
                sync.handed_over(r.pages, conn, ("prefill", index, gen, rank))
            time.sleep(0.002)
        result = {"log": log, "unfinished": sorted(live), "abandoned": abandoned}
        conn.send(("done", "prefill", index, gen, rank, _finish(peer, plan, result)))
    finally:
        peer.close()


def _news(sync: Any, peer: Any, live: dict[str, Request], log: list[Any], bootstrap_of: Any) -> str:
    """A round's news from the runner: register the new requests; "stop" (nothing live is left) or
    "abandon" when the rank's loop should end, else ""."""
    new, stop, abandon = sync()
    for r in new:
        peer.register(r.rid, bootstrap_of(r))
        live[r.rid] = r
        log.append(("Registered", r.rid, None))
    if stop and not live:
        return "stop"
    return "abandon" if abandon else ""


def decode_rank(plan: ChaosPlan, index: int, gen: int, rank: int, ports: list[int], store: str, conn: Any) -> None:
    from .. import BootstrapInfo, DecodeConfig, DecodePeer, Failed, RemotePrefillDone

    group = _join_group(store, rank, plan.decode_tp, plan.collective_timeout)
    cache = _cache(plan)  # type: ignore[arg-type]
    peer, inbox = DecodePeer.start(
        DecodeConfig(kv_buffers=cache, tp_size=plan.decode_tp, tp_rank=rank, **_knobs(plan, "decode", index, gen, rank))
    )
    conn.send(("ready", "decode", index, gen, rank, os.getpid()))
    sync = _Sync(conn, group, rank, plan)
    pages = CanaryPages(plan, cache, rank)
    held: dict[str, list[int]] = {}
    live: dict[str, Request] = {}
    log: list[tuple[str, str]] = []
    blocked: deque[Request] = deque()
    ended: set[str] = set()
    mismatched: list[str] = []
    tokens_bad: list[str] = []
    reasons: Counter[str] = Counter()  # why requests failed here (shown in the report)
    abandoned = False
    next_sweep = time.monotonic() + 1.0
    try:
        while True:
            end = _news(sync, peer, live, log, lambda r: BootstrapInfo("127.0.0.1", ports[r.prefill], r.room))
            if end:
                abandoned = end == "abandon"
                break
            for event in _ends(peer.poll(group), live, log, blocked, ended):
                got = held.pop(event.rid, [])
                if isinstance(event, RemotePrefillDone):
                    remote = event.remote
                    if remote.bootstrap_token != first_token(event.rid) or remote.request_pool_index != len(event.rid):
                        tokens_bad.append(f"{event.rid}: first token {remote.bootstrap_token} (prefill sent "
                                          f"{first_token(event.rid)}), request_pool_index {remote.request_pool_index} "
                                          f"(announced {len(event.rid)})")
                    if not _verify(plan, cache, event.rid, rank, got):
                        writers = sorted({w for w in map(pages.whose, got) if w})
                        mismatched.append(event.rid + (f" (its pages hold data of {', '.join(writers)})" if writers else ""))
                    pages.give_back(got, event.rid, "after RemotePrefillDone", CANARY_DONE)
                else:
                    assert isinstance(event, Failed)
                    reasons[event.reason[:120]] += 1
                    pages.give_back(got, event.rid, "after Failed", CANARY_FAILED)
                if rank == 0:
                    conn.send(("ended", "decode", index, gen, rank, (event.rid, type(event).__name__)))
            while (admitted := pages.admit(blocked, ended, held)) is not None:
                r, got = admitted
                inbox.announce(r.rid, got, request_pool_index=len(r.rid))
            now = time.monotonic()
            if now >= next_sweep:  # find late writes close to when they happen, not only at reuse
                pages.check(None, "by the sweep")
                next_sweep = now + 1.0
            time.sleep(0.002)
        pages.check(None, "at the end")
        result = {"log": log, "unfinished": sorted(live), "abandoned": abandoned, "mismatched": mismatched,
                  "tokens_bad": tokens_bad, "canary": pages.violations, "reasons": dict(reasons)}
        conn.send(("done", "decode", index, gen, rank, _finish(peer, plan, result)))
    finally:
        peer.close()


def _ends(events: Iterable[Any], live: dict[str, Request], log: list[Any], waiting: deque[Request],
          ended: set[str]) -> Iterator[Any]:
    """The events of a poll that end a request, as both ranks' loops take them: every event is
    logged; a ``Bootstrapped`` request still live joins ``waiting`` (for its pages), and any other
    event's request is no longer live but ended, and the event is handed on."""
    from .. import Bootstrapped

    for event in events:
        log.append(_entry(event))
        if isinstance(event, Bootstrapped):
            if event.rid in live:
                waiting.append(live[event.rid])
            continue
        live.pop(event.rid, None)
        ended.add(event.rid)
        yield event


def _entry(event: Any) -> tuple[str, str, Any]:
    """A log entry that compares as the event does (``Failed.reason`` is left out of equality; a
    ``RemotePrefillDone`` carries its whole ``RemotePrefill``: first token, usage, candidates)."""
    remote = getattr(event, "remote", None)
    payload = None
    if remote is not None:
        payload = (remote.bootstrap_token, remote.cached_tokens, remote.bootstrap_logprob,
                   remote.spec_candidate_ids, remote.request_pool_index)
    return type(event).__name__, event.rid, payload


def _verify(plan: ChaosPlan, cache: list[np.ndarray], rid: str, rank: int, got: list[int]) -> bool:
    if not got:
        return False
    data = pattern(rid, rank, len(got) * plan.page_bytes)
    return all(
        np.array_equal(buf.reshape(plan.num_pages, plan.page_bytes)[got].reshape(-1), np.roll(data, layer))
        for layer, buf in enumerate(cache)
    )


def rank_main(target: Any, plan: ChaosPlan, role: str, index: int, gen: int, rank: int, stack_path: str, *args: Any) -> None:
    conn = args[-1]
    logging.getLogger("pdcore").setLevel(plan.log_level)  # the peers' warnings are expected noise here
    stacks = open(stack_path, "w")  # noqa: SIM115  (lives as long as the process)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the runner asks a hung rank for its stacks
    try:
        target(plan, index, gen, rank, *args)
    except BaseException as e:
        try:
            conn.send(("error", role, index, gen, rank, (cause(e), traceback.format_exc())))
        except OSError:
            pass
