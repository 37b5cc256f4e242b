"""``python -m pdcore demo --epd``: encode -> prefill -> decode on loopback, real processes, real gloo groups.

The PD demo (``pdcore.tools.demo``) with the E stage in front. The main process runs
one bootstrap server per encode deployment and per prefill replica; every rank
is its own process running a miniature scheduler loop around its peer:

- encode ranks (several deployments, each with its own bootstrap server, tp and
  dp) compute each image routed to their DP group (``room % dp``): its rows
  are a deterministic function of (room, row, column), written into a send
  slot; they ``begin`` the room, ``send`` the chunk and reuse the slot once
  ``concluded`` returns the room;
- prefill ranks stage a window of requests in their receiver (each request
  has 1..``max_images`` images, possibly from different encode deployments)
  and run ``receiver.round(group)`` every scheduler round beside the PD
  ``poll``. A landed request's rows are checked, every row, against the
  function; the request's KV pattern derives from a digest of the rows the
  rank received (full copies: of the whole image, the same on every rank;
  sharded rows: each rank hashes its share and the replica all-gathers the
  share digests, as a real replica would rebuild the image), so decode's byte
  check proves both hops. Then the request enters PD as in ``pdcore.tools.demo``.
  A request whose embeddings fail is aborted toward decode (``abort_room``);
- decode ranks run ``pdcore.tools.demo``'s decode loop, checking every page against
  the pattern derived from the digest of the rows the request *should* have
  had (``expected_key``).

Prefill replica 0 receives full copies, replica 1 sharded rows (``shard``) and
deepstack rows (``deepstack``): one run covers both modes. ``run()`` is what
``tests/test_epd_demo.py`` drives, with fault injection (``encode_hidden``,
``encode_fail``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cli import announce_and_run, int_range, page_text
from .device_kv import DeviceKv, device_memory, host_array
from . import demo
from .demo import (
    Pages,
    Plan,
    Request,
    _cache,
    _decode_rank,
    _join,
    _knobs,
    _leftovers,
    ReplicaLogs,
    fill_pattern,
    first_token,
    holds_pattern,
    make_requests,
)
from ..core.events import FAILED_ELSEWHERE
from .progress import RunProgress
from .ranks import context, supervise

__all__ = [
    "Encoder",
    "EpdOutcome",
    "EpdPlan",
    "Image",
    "Summary",
    "add_arguments",
    "expected_key",
    "image_rows",
    "main",
    "make_plan",
    "report",
    "run",
    "summarize",
]

DTYPE = "torch.float32"  # 4 bytes an element; the rows are uint32 bit patterns, compared as bytes
ITEMSIZE = 4
SHARD_MODES = ("mixed", "all", "none")


@dataclass(frozen=True)
class Image:
    """One multimodal item of a request: computed by encode deployment ``encoder`` under ``room``."""

    index: int
    encoder: int
    room: int
    rows: int


@dataclass(frozen=True)
class Encoder:
    """An encode deployment: ``tp`` x ``dp`` ranks behind its own bootstrap server."""

    tp: int
    dp: int = 1


@dataclass
class EpdPlan:
    """An EPD run: the PD plan (requests, prefill and decode replicas, knobs) plus the E stage."""

    pd: Plan
    images: dict[str, tuple[Image, ...]]
    encoders: list[Encoder] = field(default_factory=lambda: [Encoder(1, 2), Encoder(2, 1)])
    #: per prefill replica: sharded rows (each rank receives its share) or full copies
    shard: list[bool] = field(default_factory=lambda: [False, True])
    #: per prefill replica: deepstack elements per row (0: its requests' images carry none)
    deepstack: list[int] = field(default_factory=lambda: [0, 16])
    hidden: int = 64
    max_rows: int = 48
    max_images: int = 4
    #: requests a prefill replica has staged in its receiver at once
    stage_window: int = 16
    #: send slots (images in flight) per encode rank
    send_slots: int = 64
    #: ReceiverConfig.timeout: a staged request whose rows have not all landed by then fails
    embed_timeout: float = 60.0
    #: EncodeConfig.park_timeout
    park_timeout: float = 60.0
    #: fault: encode deployment -> the hidden size its chunks have (not the receivers'): its rooms fail
    encode_hidden: dict[int, int] = field(default_factory=dict)
    #: fault: rooms the encode scheduler fails (``sender.fail``) instead of sending their rows
    encode_fail: set[int] = field(default_factory=set)
    #: fault: rooms whose last row's first byte the encode rank flips before sending (the rows land, wrong)
    encode_corrupt: set[int] = field(default_factory=set)

    def slot_rows(self, index: int) -> int:
        """Rows of a receive slot on prefill replica ``index``: an image, or a rank's share of one."""
        tp = self.pd.prefill_tp[index]
        return -(-self.max_rows // tp) if self.shard[index] else self.max_rows


def make_plan(
    n: int,
    *,
    seed: int = 0,
    encoders: list[Encoder] | None = None,
    prefill_tp: int = 2,
    decode_tp: int = 2,
    shard: str = "mixed",
    deepstack: int = 16,
    hidden: int = 64,
    max_rows: int = 48,
    max_images: int = 4,
    max_pages: int = 8,
    **pd_knobs: Any,
) -> EpdPlan:
    """``n`` requests over two prefill replicas (0: full copies, 1: sharded rows, by ``shard``) and one
    decode replica; each request has 1..``max_images`` images of 1..``max_rows`` rows, each image from
    a random encode deployment; replica 1's images carry ``deepstack`` elements of deepstack rows."""
    if shard not in SHARD_MODES:
        raise ValueError(f"shard must be one of {SHARD_MODES}, got {shard!r}")
    encoders = list(encoders or [Encoder(1, 2), Encoder(2, 1)])
    requests = make_requests(n, seed=seed, max_pages=max_pages, prefill=2, decode=1)
    rng = np.random.default_rng([seed, 0xE9D])
    rooms: set[int] = set()
    images: dict[str, tuple[Image, ...]] = {}
    for r in requests:
        items = []
        for index in range(int(rng.integers(1, max_images + 1))):
            room = int(rng.integers(1, 1 << 62))
            while room in rooms:
                room = int(rng.integers(1, 1 << 62))
            rooms.add(room)
            rows = 1 if rng.random() < 0.05 else int(rng.integers(1, max_rows + 1))  # 1 row: an empty shard
            items.append(Image(index, int(rng.integers(0, len(encoders))), room, rows))
        images[r.rid] = tuple(items)
    pd = Plan(requests=requests, prefill_tp=[prefill_tp, prefill_tp], decode_tp=[decode_tp], **pd_knobs)
    return EpdPlan(
        pd=pd, images=images, encoders=encoders,
        shard={"mixed": [False, True], "all": [True, True], "none": [False, False]}[shard],
        deepstack=[0, deepstack], hidden=hidden, max_rows=max_rows, max_images=max_images,
    )


# ------------------------------------------------------------------------------ rows and digests

_MIX = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93],
                dtype=np.uint64).reshape(4, 1, 1)


def image_rows(room: int, start: int, count: int, width: int, salt: int = 0) -> np.ndarray:
    """Rows ``start..start+count`` of ``room``'s image, ``width`` elements each: a ``(count, width)``
    uint32 array, a function of (room, row, column) only (``salt`` 1: the deepstack rows)."""
    r = np.arange(start, start + count, dtype=np.uint64).reshape(-1, 1)
    c = np.arange(width, dtype=np.uint64).reshape(1, -1)
    x = np.full((1, 1), room, dtype=np.uint64) * _MIX[0] + r * _MIX[1] + c * _MIX[2] \
        + np.full((1, 1), salt + 1, dtype=np.uint64) * _MIX[3]
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX[1]
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX[2]
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(32)).astype(np.uint32).reshape(count, width)


def share(rows: int, rank: int, ranks: int, sharded: bool) -> tuple[int, int]:
    """Prefill rank ``rank`` of ``ranks``' (row_start, row_count) of an image of ``rows`` rows."""
    if not sharded:
        return 0, rows
    base, rem = divmod(rows, ranks)
    return rank * base + min(rank, rem), base + (1 if rank < rem else 0)


def _digest(*parts: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def _expected_share_digest(plan: EpdPlan, image: Image, start: int, count: int, width: int) -> bytes:
    if count == 0:
        return _digest()
    parts = [image_rows(image.room, start, count, plan.hidden)]
    if width:
        parts.append(image_rows(image.room, start, count, width, salt=1))
    return _digest(*parts)


def _item_digest(shares: list[bytes], sharded: bool) -> bytes:
    """An image's digest from its share digests in rank order (full copies: the one rank's own)."""
    return _digest(b"".join(shares)) if sharded else shares[0]


def _kv_key(rid: str, items: list[bytes]) -> str:
    """What a request's KV pattern derives from (``pdcore.tools.demo.pattern``): the rid and its images' digests."""
    return f"{rid}#{_digest(b''.join(items)).hex()}"


def expected_key(plan: EpdPlan, request: Request) -> str:
    """The KV key of ``request`` when every rank of its prefill replica received exactly the right rows."""
    index = request.prefill
    tp, sharded, width = plan.pd.prefill_tp[index], plan.shard[index], plan.deepstack[index]
    items = []
    for image in plan.images[request.rid]:
        ranks = range(tp) if sharded else range(1)
        shares = [_expected_share_digest(plan, image, *share(image.rows, r, tp, sharded), width) for r in ranks]
        items.append(_item_digest(shares, sharded))
    return _kv_key(request.rid, items)


def expected_rows(plan: EpdPlan, request: Request) -> tuple[int, int]:
    """Rows and bytes the ranks of ``request``'s prefill replica receive together (a full copy counts on
    every rank, a shard on its own)."""
    index = request.prefill
    copies = 1 if plan.shard[index] else plan.pd.prefill_tp[index]
    rows = sum(image.rows for image in plan.images[request.rid]) * copies
    return rows, rows * (plan.hidden + plan.deepstack[index]) * ITEMSIZE


# ------------------------------------------------------------------------------ ranks


class _Pages:
    """The decode check of an EPD run (``pdcore.tools.demo._decode_rank``'s ``checker``): a request's pages
    must hold the pattern of the rows it should have had (``expected_key``), so a wrong row on a prefill
    rank shows here as a page mismatch."""

    def __init__(self, plan: EpdPlan, rank: int, tp: int) -> None:
        self.plan, self.rank = plan, rank

    def first_token(self, r: Request, sent: int) -> int:
        return first_token(r.rid)

    def check(self, r: Request, got: list[int], cache: list[np.ndarray], token: int, group: Any) -> bool:
        return holds_pattern(self.plan.pd, cache, expected_key(self.plan, r), self.rank, got)


def _encode_rank(plan: EpdPlan, index: int, rank: int, port: int, stop: Any, out: Any) -> None:
    """Encode rank ``rank`` (dp_rank * tp + tp_rank) of deployment ``index``: until the runner says stop."""
    from ..epd.config import EncodeConfig
    from ..epd.encode import EncodePeer
    from ..epd.types import EmbeddingChunk

    pd = plan.pd
    enc = plan.encoders[index]
    dp_rank, tp_rank = divmod(rank, enc.tp)
    hidden = plan.encode_hidden.get(index, plan.hidden)
    width_max = max(plan.deepstack)
    slot_main = plan.max_rows * hidden * ITEMSIZE
    slot_deep = plan.max_rows * width_max * ITEMSIZE
    main = np.zeros(plan.send_slots * slot_main, np.uint8)
    deep = np.zeros(plan.send_slots * slot_deep, np.uint8) if slot_deep else None
    sends = DeviceKv([main] + ([deep] if deep is not None else []), pd.kv_device)  # rows go from here
    peer, sender = EncodePeer.start(EncodeConfig(
        send_buffers=sends.given, bootstrap_host="127.0.0.1", bootstrap_port=port, device_memory=device_memory(pd.kv_device),
        tp_size=enc.tp, tp_rank=tp_rank, dp_size=enc.dp, dp_rank=dp_rank, park_timeout=plan.park_timeout,
        transport=pd.transport, control=pd.control, heartbeat_interval=pd.heartbeat_interval, dead_after=pd.dead_after,
        tombstone_ttl=pd.tombstone_ttl, secret=pd.secret,
    ))
    try:
        out.put(("ready", "encode", index, rank, os.getpid()))
        todo = deque((r, image) for r in pd.requests for image in plan.images[r.rid]
                     if image.encoder == index and image.room % enc.dp == dp_rank)
        total = len(todo)
        free = list(range(plan.send_slots))
        held: dict[int, int | None] = {}  # begun room -> its send slot (None: failed without rows)
        results: dict[str, Any] = {"images": total, "sent": 0, "bytes": 0, "failed": 0, "refused": [],
                                   "concluded": 0}
        deadline = time.monotonic() + pd.timeout + 30.0  # the runner's stop comes first
        while not stop.is_set() and time.monotonic() < deadline:
            for room in sender.concluded():
                slot = held.pop(room, None)
                if slot is not None:
                    free.append(slot)
                results["concluded"] += 1
            while todo and free:
                request, image = todo.popleft()
                if not sender.begin(image.room):
                    results["refused"].append(image.room)
                    continue
                if image.room in plan.encode_fail:
                    sender.fail(image.room, "injected: the encode scheduler failed the image")
                    held[image.room] = None
                    results["failed"] += 1
                    continue
                slot = free.pop()
                rows = image_rows(image.room, 0, image.rows, hidden).view(np.uint8).reshape(-1)
                at = slot * slot_main
                main[at:at + rows.size] = rows
                if image.room in plan.encode_corrupt:
                    main[at + rows.size - hidden * ITEMSIZE] ^= 0x5A
                extra: dict[str, int] = {}
                width = plan.deepstack[request.prefill]
                if width:
                    assert deep is not None
                    drows = image_rows(image.room, 0, image.rows, width, salt=1).view(np.uint8).reshape(-1)
                    dat = slot * slot_deep
                    deep[dat:dat + drows.size] = drows
                    sends.push_bytes(1, dat, drows.size)
                    extra = dict(deepstack_source=sends.address(1) + dat, deepstack_width=width,
                                 deepstack_nbytes=drows.size)
                    results["bytes"] += drows.size
                sends.push_bytes(0, at, rows.size)
                sender.send(EmbeddingChunk(room=image.room, source=sends.address(0) + at, rows=image.rows,
                                           hidden=hidden, dtype=DTYPE, nbytes=rows.size, **extra))
                held[image.room] = slot
                results["sent"] += 1
                results["bytes"] += rows.size
            stop.wait(0.002 if todo else 0.01)
        results["unconcluded"] = sorted(held) + [image.room for _, image in todo]  # held at the end, or never begun
        out.put(("done", "encode", index, rank, results))
    finally:
        peer.close()


def slot_buffers(plan: EpdPlan, index: int, kv_device: str) -> dict[str, Any]:
    """The receive slots' buffers for ``--kv-device cuda`` (CUDA tensors); none otherwise (the receiver
    makes host ones, which the stand-in device stages like device memory)."""
    if kv_device != "cuda":
        return {}
    import torch

    slots, rows = plan.stage_window * plan.max_images, plan.slot_rows(index)
    out = {"buffer": torch.zeros(slots * rows * plan.hidden * ITEMSIZE, dtype=torch.uint8, device="cuda")}
    if plan.deepstack[index]:
        out["deepstack_buffer"] = torch.zeros(slots * rows * plan.deepstack[index] * ITEMSIZE, dtype=torch.uint8,
                                              device="cuda")
    return out


def _prefill_rank(plan: EpdPlan, index: int, rank: int, port: int, encode_ports: list[int], store: str,
                  out: Any) -> None:
    from .. import BootstrapInfo, Bootstrapped, PrefillConfig, PrefillPeer
    from ..epd.config import ReceiverConfig
    from ..epd.types import EmbeddingItem

    pd = plan.pd
    tp = pd.prefill_tp[index]
    group = _join(store, rank, tp)
    cache = _cache(pd, tp)
    kv = DeviceKv(cache, pd.kv_device)
    peer, outbox = PrefillPeer.start(
        PrefillConfig(kv_buffers=kv.given, tp_size=tp, tp_rank=rank, bootstrap_host="127.0.0.1", bootstrap_port=port,
                      **_knobs(pd, tp))
    )
    try:
        receiver = peer.embedding_receiver(ReceiverConfig(
            **slot_buffers(plan, index, pd.kv_device),
            slots=plan.stage_window * plan.max_images, slot_rows=plan.slot_rows(index), hidden=plan.hidden,
            dtype=DTYPE, deepstack_width=plan.deepstack[index], shard_rows=plan.shard[index],
            timeout=plan.embed_timeout, max_items=plan.max_images,
        ))
        out.put(("ready", "prefill", index, rank, os.getpid()))
        mine = [r for r in pd.requests if r.prefill == index]
        by_rid = {r.rid: r for r in mine}
        queue = deque(mine)
        staged = 0
        keys: dict[str, str] = {}
        pages = Pages(pd.num_pages)
        held: dict[str, list[int]] = {}
        log: list[tuple[str, str, float]] = []
        waiting: deque[Request] = deque()
        ended: set[str] = set()
        results: dict[str, Any] = {"items": 0, "rows": 0, "bytes": 0, "empty_shards": 0, "rows_bad": {},
                                   "embed_failed": {}}
        done = 0
        deadline = time.monotonic() + pd.timeout
        while done < len(mine) and time.monotonic() < deadline:
            while queue and staged < plan.stage_window:  # the E stage: a window of requests at a time
                r = queue.popleft()
                receiver.stage(r.rid, [EmbeddingItem(index=image.index, host="127.0.0.1",
                                                     port=encode_ports[image.encoder], room=image.room,
                                                     rows=image.rows) for image in plan.images[r.rid]])
                staged += 1
            landed = receiver.round(group)
            for rid, reason in receiver.failed():
                staged -= 1
                done += 1
                results["embed_failed"][rid] = reason
                log.append(("EmbedFailed", rid, time.time()))
                peer.abort_room(rid, by_rid[rid].room)  # decode waits on the PD room: it fails now
            if landed:
                staged -= len(landed)
                keys.update(_take(plan, receiver, landed, index, rank, group, results))
                for req in landed:
                    log.append(("Landed", req.rid, time.time()))
                    peer.register(req.rid, BootstrapInfo("127.0.0.1", port, by_rid[req.rid].room))
            for event in peer.poll(group):
                log.append((type(event).__name__, event.rid, time.time()))
                if isinstance(event, Bootstrapped):
                    waiting.append(by_rid[event.rid])
                else:
                    pages.give(held.pop(event.rid, []))
                    ended.add(event.rid)
                    done += 1
            while (admitted := pages.admit(waiting, ended, held)) is not None:
                r, got = admitted
                fill_pattern(pd, cache, keys.pop(r.rid), rank, got)  # the KV derives from the rows that landed
                kv.push(got, pd.page_bytes)
                peer.record_usage(r.rid, cached_tokens=r.pages, bootstrap_logprob=-0.25)
                outbox.send(r.rid, got, first_token(r.rid), [first_token(r.rid) % 97])
            time.sleep(0.001)  # a real scheduler runs a forward pass here
        results.update(
            log=log, staged_at_end=len(receiver.table), awaiting_release=receiver.awaiting_release(),
            receiver=dict(receiver.stats), **_leftovers(peer, pd),
        )
        out.put(("done", "prefill", index, rank, results))
    finally:
        peer.close()


def _take(plan: EpdPlan, receiver: Any, landed: list[Any], index: int, rank: int, group: Any,
          results: dict[str, Any]) -> dict[str, str]:
    """Check every row this rank received for the landed requests, release their slots and return each
    request's KV key; with sharded rows the replica all-gathers the share digests (a collective: every
    rank lands the same requests in the same round)."""
    tp = plan.pd.prefill_tp[index]
    sharded, width = plan.shard[index], plan.deepstack[index]
    shares: list[bytes] = []
    slots: list[int] = []
    for req in landed:
        images = plan.images[req.rid]
        bad: list[str] = []
        if [it.index for it in req.items] != [image.index for image in images]:
            bad.append(f"items {[it.index for it in req.items]}, expected {len(images)}")
        for it in req.items:
            image = images[it.index] if it.index < len(images) else images[-1]
            start, count = share(image.rows, rank, tp, sharded)
            if (it.rows, it.row_start, it.row_count, it.sharded) != (image.rows, start, count, sharded):
                bad.append(f"item {it.index}: rows {it.rows} [{it.row_start}, +{it.row_count}) sharded "
                           f"{it.sharded}, expected {image.rows} [{start}, +{count}) sharded {sharded}")
            parts = []
            if it.slot is not None:
                slots.append(it.slot)
                got = host_array(receiver.rows(it.slot, it.row_count))
                want = image_rows(image.room, it.row_start, it.row_count, plan.hidden)
                if not np.array_equal(got, want.view(np.uint8).reshape(it.row_count, -1)):
                    bad.append(f"item {it.index}: main rows differ")
                parts.append(got)
                results["bytes"] += got.nbytes
                if width:
                    dgot = host_array(receiver.deepstack_rows(it.slot, it.row_count))
                    dwant = image_rows(image.room, it.row_start, it.row_count, width, salt=1)
                    if not np.array_equal(dgot, dwant.view(np.uint8).reshape(it.row_count, -1)):
                        bad.append(f"item {it.index}: deepstack rows differ")
                    parts.append(dgot)
                    results["bytes"] += dgot.nbytes
                results["rows"] += it.row_count
            else:
                results["empty_shards"] += 1
            results["items"] += 1
            shares.append(_digest(*parts))  # of the bytes that landed, not of what was expected
        if bad:
            results["rows_bad"][req.rid] = "; ".join(bad)
    if sharded and group is not None:
        import torch
        import torch.distributed as dist

        mine = torch.from_numpy(np.frombuffer(b"".join(shares), dtype=np.uint8).copy())
        gathered = [torch.empty_like(mine) for _ in range(tp)]
        dist.all_gather(gathered, mine, group=group)
        per_rank = [g.numpy().reshape(-1, 16) for g in gathered]
        by_rank = [[per_rank[r][k].tobytes() for r in range(tp)] for k in range(len(shares))]
    else:
        by_rank = [[s] for s in shares]
    receiver.release(slots)  # the rows are consumed: the slots take new receives
    keys: dict[str, str] = {}
    k = 0
    for req in landed:
        n = len(req.items)
        keys[req.rid] = _kv_key(req.rid, [_item_digest(by_rank[k + i], sharded) for i in range(n)])
        k += n
    return keys


# ------------------------------------------------------------------------------ the run


@dataclass
class EpdOutcome(ReplicaLogs):
    """What an EPD run produced, per role, replica and rank (encode ranks: dp_rank * tp + tp_rank)."""

    encode: dict[tuple[int, int], dict[str, Any]]
    prefill: dict[tuple[int, int], dict[str, Any]]
    decode: dict[tuple[int, int], dict[str, Any]]
    errors: list[str]
    seconds: float
    start_failure: str | None = None
    causes: list[str] = field(default_factory=list)


#: ``demo``'s preload and this run's: every rank joins a gloo group, and ten ranks importing torch each
#: cost more than the whole run on two cores
PRELOAD = [*demo.PRELOAD, "pdcore.tools.epd_demo", "pdcore.epd.encode", "pdcore.epd.receiver"]


def run(plan: EpdPlan, *, progress: RunProgress | None = None) -> EpdOutcome:
    """Run the plan; every wait is bounded by ``plan.pd.timeout`` (plus start-up), every child is joined
    or killed. The encode ranks serve until every prefill and decode rank reported (or the deadline)."""
    from ..control.bootstrap import BootstrapServer

    _check(plan)
    pd = plan.pd
    ctx = context(PRELOAD)
    stop = ctx.Event()
    expected = sum(e.tp * e.dp for e in plan.encoders) + sum(pd.prefill_tp) + sum(pd.decode_tp)
    if progress is not None:
        enc = " + ".join(f"tp {e.tp} x dp {e.dp}" for e in plan.encoders)
        progress.starting(f"{expected} ranks (encode {enc}, prefill tp {'+'.join(map(str, pd.prefill_tp))}, "
                          f"decode tp {'+'.join(map(str, pd.decode_tp))})", expected)
    encode_servers = [BootstrapServer(secret=pd.secret) for _ in plan.encoders]
    prefill_servers = [BootstrapServer(secret=pd.secret) for _ in pd.prefill_tp]
    try:
        encode_ports = [s.start() for s in encode_servers]
        ports = [s.start() for s in prefill_servers]
        with tempfile.TemporaryDirectory(prefix="pdcore-epd-demo-") as tmp:
            layout = [
                ("encode", index, rank, (_encode_rank, plan, index, rank, encode_ports[index], stop))
                for index, e in enumerate(plan.encoders) for rank in range(e.tp * e.dp)
            ] + [
                ("prefill", index, rank,
                 (_prefill_rank, plan, index, rank, ports[index], encode_ports, os.path.join(tmp, f"prefill-{index}")))
                for index, tp in enumerate(pd.prefill_tp) for rank in range(tp)
            ] + [
                ("decode", index, rank,
                 (_decode_rank, pd, index, rank, ports, os.path.join(tmp, f"decode-{index}"), functools.partial(_Pages, plan)))
                for index, tp in enumerate(pd.decode_tp) for rank in range(tp)
            ]
            got = supervise(ctx, layout, timeout=pd.timeout, requests=len(pd.requests), decode_tp=list(pd.decode_tp),
                            progress=progress, stop=stop, stopped_roles=frozenset({"encode"}))
    finally:
        for s in encode_servers + prefill_servers:
            s.close()
    return EpdOutcome(got.results["encode"], got.results["prefill"], got.results["decode"], got.errors,
                      got.seconds, got.start_failure, got.causes)


def _check(plan: EpdPlan) -> None:
    pd = plan.pd
    if len(plan.shard) != len(pd.prefill_tp) or len(plan.deepstack) != len(pd.prefill_tp):
        raise ValueError("EpdPlan.shard and .deepstack need one entry per prefill replica")
    for e in plan.encoders:
        for tp in pd.prefill_tp:
            if tp % e.tp:
                raise ValueError(f"encode tp {e.tp} does not divide prefill tp {tp}")
    for rid, images in plan.images.items():
        if not 1 <= len(images) <= plan.max_images or any(not 1 <= i.rows <= plan.max_rows for i in images):
            raise ValueError(f"{rid}: 1..{plan.max_images} images of 1..{plan.max_rows} rows each, got {images}")


# ------------------------------------------------------------------------------ judging


@dataclass
class Summary:
    """What a run proved, per request and in totals (``good``: everything passed)."""

    expected: set[str]
    ok: set[str]  # landed on every decode rank of its replica, every byte right
    failed: set[str]  # decode saw Failed
    embed_failed: dict[str, str]  # rid -> why its embeddings failed (prefill, E stage)
    rows_bad: dict[str, str]  # rid -> what differed on a prefill rank
    kv_mismatched: set[str]
    tokens_bad: set[str]
    images_sent: int  # encode ranks' send() calls
    images_failed: int  # encode ranks' injected fail() calls
    #: rooms an encode rank still held, never began or could not begin at the end (a failed request's image
    #: that no prefill rank asked for waits for its asks until the park timeout)
    unconcluded: set[int]
    rows_verified: int  # rows checked on prefill ranks (a full copy counts once per rank)
    rows_expected: int  # what that should be for the requests whose embeddings landed
    embed_bytes: int  # bytes of rows (and deepstack rows) that landed and were checked
    embed_bytes_expected: int
    empty_shards: int
    kv_bytes: int
    latency_ms: np.ndarray
    agree: bool
    leftovers: list[str]  # what a rank still held at the end
    errors: list[str]

    @property
    def good(self) -> bool:
        return (not self.errors and self.ok == self.expected and not self.failed and not self.embed_failed
                and not self.rows_bad and not self.kv_mismatched and not self.tokens_bad and self.agree
                and not self.unconcluded and self.rows_verified == self.rows_expected
                and self.embed_bytes == self.embed_bytes_expected and not self.leftovers)


def summarize(plan: EpdPlan, outcome: EpdOutcome) -> Summary:
    pd = plan.pd
    decode = outcome.decode
    by_replica: dict[int, list[set[str]]] = {}
    for (index, _), r in decode.items():
        by_replica.setdefault(index, []).append({rid for kind, rid, _ in r["log"] if kind == "RemotePrefillDone"})
    mismatched = {rid for r in decode.values() for rid in r["mismatched"]}
    landed = set().union(*(set.intersection(*sets) for sets in by_replica.values())) if by_replica else set()
    prefill = outcome.prefill
    reasons: dict[str, list[str]] = {}
    for _, r in sorted(prefill.items()):
        for rid, why in r["embed_failed"].items():
            reasons.setdefault(rid, []).append(why)
    # the rank that saw the failure says why; the others only FAILED_ELSEWHERE
    embed_failed = {rid: " | ".join(dict.fromkeys([w for w in whys if w != FAILED_ELSEWHERE] or whys))
                    for rid, whys in reasons.items()}
    rows_bad = {rid: why for r in prefill.values() for rid, why in r["rows_bad"].items()}
    embedded = {rid for r in prefill.values() for kind, rid, _ in r["log"] if kind == "Landed"}
    leftovers = []
    for (index, rank), r in sorted(prefill.items()):
        if r["staged_at_end"] or r["awaiting_release"] or r["in_flight"]:
            leftovers.append(f"prefill {index} rank {rank}: {r['staged_at_end']} staged, awaiting release "
                             f"{r['awaiting_release']}, in flight {r['in_flight']}")
    for (index, rank), r in sorted(decode.items()):
        if r["unfinished"]:
            leftovers.append(f"decode {index} rank {rank}: {r['unfinished']} requests never ended")
    encode = outcome.encode.values()
    by_rid = {r.rid: r for r in pd.requests}
    return Summary(
        expected={r.rid for r in pd.requests},
        ok=landed - mismatched,
        failed={rid for r in decode.values() for kind, rid, _ in r["log"] if kind == "Failed"},
        embed_failed=embed_failed,
        rows_bad=rows_bad,
        kv_mismatched=mismatched,
        tokens_bad={rid for r in decode.values() for rid in r["tokens_bad"]},
        images_sent=sum(r["sent"] for r in encode),
        images_failed=sum(r["failed"] for r in encode),
        unconcluded={room for r in encode for room in r["unconcluded"] + r["refused"]},
        rows_verified=sum(r["rows"] for r in prefill.values()),
        rows_expected=sum(expected_rows(plan, by_rid[rid])[0] for rid in embedded),
        embed_bytes=sum(r["bytes"] for r in prefill.values()),
        embed_bytes_expected=sum(expected_rows(plan, by_rid[rid])[1] for rid in embedded),
        empty_shards=sum(r["empty_shards"] for r in prefill.values()),
        kv_bytes=sum(r["bytes"] for r in decode.values()),
        latency_ms=np.array([x for r in decode.values() for x in r["latency"]] or [0.0]) * 1e3,
        agree=outcome.decode_logs_agree() and outcome.prefill_logs_agree(),
        leftovers=leftovers,
        errors=list(outcome.errors),
    )


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"


def report(plan: EpdPlan, outcome: EpdOutcome, *, verbose: bool = False) -> int:
    """Print the summary table; 0 only if every request passed both hops and every row and byte matched."""
    from .cli import report_start_failure
    import sys

    if outcome.start_failure is not None:
        return report_start_failure("demo", outcome.start_failure, outcome.errors, verbose=verbose)
    s = summarize(plan, outcome)
    pd = plan.pd
    replicas = ", ".join(
        f"P{i} tp {tp} {'sharded rows' if plan.shard[i] else 'full copies'}"
        + (f" + deepstack {plan.deepstack[i]}" if plan.deepstack[i] else "")
        for i, tp in enumerate(pd.prefill_tp)
    )
    encoders = ", ".join(f"E{i} tp {e.tp} x dp {e.dp}" for i, e in enumerate(plan.encoders))
    images = sum(len(v) for v in plan.images.values())
    rows = [
        ("requests ok", f"{len(s.ok)} / {len(s.expected)}"),
        ("requests failed (aborted toward decode)", f"{len(s.failed)} ({len(s.embed_failed)} in the E stage)"),
        ("encode deployments", encoders),
        ("prefill replicas", replicas),
        ("images sent by encode ranks", f"{s.images_sent} sends for {images} images ({s.images_failed} failed)"),
        ("encode rooms left unconcluded", str(len(s.unconcluded))),
        ("embedding rows verified on prefill", f"{s.rows_verified} of {s.rows_expected} ({s.empty_shards} empty shards)"),
        ("embedding bytes verified", f"{_size(s.embed_bytes)} of {_size(s.embed_bytes_expected)}"),
        ("embedding rows mismatched", str(len(s.rows_bad))),
        ("KV bytes verified", _size(s.kv_bytes)),
        ("KV pages mismatched", str(len(s.kv_mismatched))),
        ("throughput (KV)", f"{s.kv_bytes / outcome.seconds / 1e9:.3f} GB/s (wall {outcome.seconds:.1f} s)"),
        ("register -> RemotePrefillDone p50", f"{np.percentile(s.latency_ms, 50):.1f} ms"),
        ("register -> RemotePrefillDone p99", f"{np.percentile(s.latency_ms, 99):.1f} ms"),
        ("identical events on every rank", "yes" if s.agree else "NO"),
    ]
    kw = max(len(k) for k, _ in rows)
    vw = max(32, max(len(v) for _, v in rows))
    print("+" + "-" * (kw + 2) + "+" + "-" * (vw + 2) + "+")
    for key, value in rows:
        print(f"| {key:<{kw}} | {value:<{vw}} |")
    print("+" + "-" * (kw + 2) + "+" + "-" * (vw + 2) + "+")
    for rid, why in sorted(s.embed_failed.items())[:5]:
        print(f"error: {rid}: embeddings failed: {why}", file=sys.stderr)
    for rid, why in sorted(s.rows_bad.items())[:5]:
        print(f"error: {rid}: received rows differ: {why}", file=sys.stderr)
    for line in s.leftovers:
        print(f"error: {line}", file=sys.stderr)
    for error in outcome.errors if verbose else outcome.causes or outcome.errors:
        print(f"error: {error}", file=sys.stderr)
    print("demo: OK" if s.good else "demo: FAILED")
    return 0 if s.good else 1


# ------------------------------------------------------------------------------ CLI


def _tp_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"need comma-separated integers in 1..64, got {text!r}") from None
    if not values or not all(1 <= v <= 64 for v in values) or len(values) > 8:
        raise argparse.ArgumentTypeError(f"need 1..8 comma-separated integers in 1..64, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--epd`` options of ``python -m pdcore demo``."""
    g = p.add_argument_group("EPD (encode -> prefill -> decode; with --epd)")
    g.add_argument("--epd", action="store_true",
                   help="put encode replicas in front: each request has 1..--max-images images whose embedding rows "
                   "encode ranks write into the prefill ranks' receive slots; prefill derives the KV from the rows "
                   "it received, so decode's byte check proves both hops (without it: PD only)")
    g.add_argument("--epd-shard", choices=SHARD_MODES, default="mixed",
                   help="which of the two prefill replicas receive sharded rows (each rank its share) rather than "
                   "full copies: mixed (replica 0 full copies, replica 1 shards), all or none (default: %(default)s)")
    g.add_argument("--encode-tp", type=_tp_list, default=[1, 2], metavar="N[,N...]",
                   help="one encode deployment per entry, each with its own bootstrap server: its tp (each must "
                   "divide --prefill-tp; default: 1,2)")
    g.add_argument("--encode-dp", type=_tp_list, default=None, metavar="N[,N...]",
                   help="dp of each encode deployment (images go to DP group room %% dp; default: 2,1 with the "
                   "default --encode-tp, else 1 each)")
    g.add_argument("--max-images", type=int_range(1, 64), default=4, metavar="N",
                   help="images per request: 1..this, at random (1..64; default: %(default)s)")
    g.add_argument("--max-rows", type=int_range(1, 1 << 16), default=48, metavar="N",
                   help=f"embedding rows per image: 1..this, at random (1..{1 << 16}; default: %(default)s)")
    g.add_argument("--hidden", type=int_range(1, 1 << 16), default=64, metavar="N",
                   help=f"float32 elements per embedding row (1..{1 << 16}; default: %(default)s)")
    g.add_argument("--deepstack", type=int_range(0, 1 << 16), default=16, metavar="N",
                   help="deepstack elements per row of prefill replica 1's images (replica 0's carry none; "
                   "0: no deepstack; default: %(default)s)")


def main(args: argparse.Namespace, cli: argparse.ArgumentParser, *, secret: bytes | None, auth_note: str,
         num_pages: int) -> int:
    """``python -m pdcore demo --epd`` once ``pdcore.tools.demo.main`` parsed the line and chose the secret."""
    from ..core.table import IMPLEMENTATION

    for name, plain in (("layout", "opaque"), ("model", "none"), ("layerwise", False)):
        if getattr(args, name, plain) != plain:  # options of the PD demo the EPD run does not take
            cli.error(f"argument --{name}: the EPD run moves opaque pages; leave --{name} out with --epd")
    tps = args.encode_tp
    dps = args.encode_dp if args.encode_dp is not None else ([2, 1] if tps == [1, 2] else [1] * len(tps))
    if len(dps) != len(tps):
        cli.error(f"argument --encode-dp: {len(dps)} entries for {len(tps)} encode deployments (--encode-tp)")
    for tp in tps:
        if args.prefill_tp % tp:
            cli.error(f"argument --encode-tp: encode tp {tp} does not divide prefill tp {args.prefill_tp}")
    from .cli import memory_bytes

    ranks = 2 * args.prefill_tp + sum(tp * dp for tp, dp in zip(tps, dps))
    slots = max(EpdPlan.stage_window * args.max_images, EpdPlan.send_slots)
    need = ranks * slots * args.max_rows * (args.hidden + args.deepstack) * ITEMSIZE
    memory = memory_bytes()
    if memory is not None and need > memory // 2:
        cli.error(f"argument --max-rows/--hidden/--deepstack: {ranks} ranks x {slots} slots x {args.max_rows} rows x "
                  f"{args.hidden + args.deepstack} elements is {need / 1e9:.1f} GB of embedding buffers; this machine "
                  f"has {memory / 1e9:.1f} GB")
    plan = make_plan(
        args.requests, seed=args.seed, encoders=[Encoder(tp, dp) for tp, dp in zip(tps, dps)],
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, shard=args.epd_shard, deepstack=args.deepstack,
        hidden=args.hidden, max_rows=args.max_rows, max_images=args.max_images, max_pages=args.max_pages,
        layers=args.layers, page_bytes=args.page_bytes, num_pages=num_pages, transport=args.transport,
        control=args.control,
        timeout=args.timeout, secret=secret, kv_device=args.kv_device,
    )
    plan.embed_timeout = plan.park_timeout = max(10.0, min(60.0, args.timeout))
    encoders = " + ".join(f"tp {e.tp} x dp {e.dp}" for e in plan.encoders)
    line = (f"pdcore demo --epd: {args.requests} requests, {sum(map(len, plan.images.values()))} images; "
            f"encode {encoders} -> prefill 2 x tp {args.prefill_tp} ({args.epd_shard} sharding) -> decode tp "
            f"{args.decode_tp}, {args.layers} layers x {page_text(args.page_bytes)} pages, transport "
            f"{args.transport}, {IMPLEMENTATION} state table, {auth_note}"
            f"{'' if args.kv_device == 'cpu' else f', KV and embeddings on {args.kv_device}'}")
    return announce_and_run(line, plan, run, report, args)
