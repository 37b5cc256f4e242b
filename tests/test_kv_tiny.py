"""Real KV, real attention: a tiny seeded decoder's KV, split by heads over the prefill ranks' pages, moved
by the planner's writes and rebuilt by decode ranks of another tp size, decodes greedily to exactly the
tokens of one process holding every head. A head-slicing mistake shows as wrong tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from replica import run_replica

from pdcore.kv import KvLayout
from pdcore.kv.planner import plan
from pdcore.kv.tiny import VOCAB, Tiny

PROMPT = [(7 * i + 3) % VOCAB for i in range(11)]
STEPS = 6
PAGES = 8


def _move(layout: KvLayout, p_tp: int, d_tp: int, model: Tiny) -> list[list[np.ndarray]]:
    """Prefill ranks' pages → decode ranks' pages through the planner (bytes copied as the transport would)."""
    _, kv = model.prefill(PROMPT)
    n = -(-len(PROMPT) // layout.page_tokens)
    src_pages, dst_pages = list(range(PAGES - n, PAGES)), list(range(n))[::-1]  # reversed: runs break
    src = [[np.zeros(PAGES * layout.page_bytes(p_tp), np.uint8) for _ in range(layout.buffers)] for _ in range(p_tp)]
    dst = [[np.zeros(PAGES * layout.page_bytes(d_tp), np.uint8) for _ in range(layout.buffers)] for _ in range(d_tp)]
    for p in range(p_tp):
        model.write_pages(kv, p, p_tp, src_pages, src[p])
    for d in range(d_tp):
        for p in range(p_tp):
            writes = plan(layout, p_tp, p, d_tp, d, [b.ctypes.data for b in src[p]], [b.ctypes.data for b in dst[d]],
                          src_pages, dst_pages)
            for s, t, length in writes.tolist():
                sb = next(b for b in src[p] if b.ctypes.data <= s < b.ctypes.data + b.nbytes)
                db = next(b for b in dst[d] if b.ctypes.data <= t < b.ctypes.data + b.nbytes)
                db[t - db.ctypes.data : t - db.ctypes.data + length] = sb[s - sb.ctypes.data : s - sb.ctypes.data + length]
    return [[b for b in dst[d]] + [np.array(dst_pages)] for d in range(d_tp)]


def _decode_rank(rank: int, world: int, layout: KvLayout, first: int, caches: list[list[np.ndarray]]) -> list[int]:
    import torch.distributed as dist

    model = Tiny(layout, seed=5)
    mine = caches[rank]
    pages = [int(p) for p in mine[-1]]
    kv = model.read_pages(rank, world, pages, len(PROMPT), mine[:-1])
    return model.decode(kv, first, STEPS, rank, world, dist.group.WORLD)


LONG = pytest.mark.long
# CI runs P1->D3 over 2 heads (uneven replication) and MLA P2->D4; the demo's e2e test runs the tiny model P2->D4
CASES = [pytest.param("hnd", 4, 2, 4, marks=LONG), pytest.param("nhd", 4, 4, 2, marks=LONG), ("nhd", 2, 1, 3),
         ("mla", 1, 2, 4), pytest.param("mla", 1, 4, 2, marks=LONG)]


def _id(case: object) -> str:
    o, h, p, d = getattr(case, "values", case)
    return f"{o}-H{h}-P{p}-D{d}"


@pytest.mark.slow
@pytest.mark.parametrize(("order", "heads", "p_tp", "d_tp"), CASES, ids=[_id(c) for c in CASES])
def test_split_kv_decodes_the_tokens_of_one_process(order: str, heads: int, p_tp: int, d_tp: int) -> None:
    layout = KvLayout(order=order, kv_heads=heads, head_bytes=64, page_tokens=4, layers=2)
    model = Tiny(layout, seed=5)
    want = model.reference(PROMPT, STEPS)
    first, _ = model.prefill(PROMPT)
    assert first == want[0]
    caches = _move(layout, p_tp, d_tp, model)
    got = run_replica(_decode_rank, d_tp, layout, first, caches, timeout=120)
    assert got == [want] * d_tp, f"reference {want}, ranks {got}"


def test_a_head_slicing_mistake_changes_the_tokens() -> None:
    """The check has teeth: swapping two heads' KV on one rank changes what it decodes (one process)."""
    layout = KvLayout(order="hnd", kv_heads=4, head_bytes=64, page_tokens=4, layers=2)
    model = Tiny(layout, seed=5)
    want = model.reference(PROMPT, STEPS)
    first, kv = model.prefill(PROMPT)
    assert model.decode(kv, first, STEPS, 0, 1, None) == want
    swapped = [(k[:, [1, 0, 2, 3]], v) for k, v in kv]
    assert model.decode(swapped, first, STEPS, 0, 1, None) != want


def test_pages_round_trip() -> None:
    for order in ("hnd", "nhd", "mla"):
        layout = KvLayout(order=order, kv_heads=1 if order == "mla" else 4, head_bytes=64, page_tokens=4, layers=2)
        model = Tiny(layout, seed=1)
        _, kv = model.prefill(PROMPT)
        caches: list[Any] = [np.zeros(PAGES * layout.page_bytes(2), np.uint8) for _ in range(layout.buffers)]
        model.write_pages(kv, 1, 2, [5, 2, 7], caches)
        back = model.read_pages(1, 2, [5, 2, 7], len(PROMPT), caches)
        first, count = layout.heads(1, 2)
        for (k, v), (bk, bv) in zip(kv, back):
            sel = slice(0, 1) if order == "mla" else slice(first, first + count)
            np.testing.assert_array_equal(bk, k[:, sel])
            np.testing.assert_array_equal(bv, v[:, sel])
