"""The KV planner, checked byte by byte: for any prefill tp / decode tp pair, HND, NHD and MLA pages,
split and replicated heads, every destination byte a decode rank should hold is written exactly once from
the right source bytes, nothing outside the announced pages is touched, and both twins plan the same writes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcore.core.errors import LocalProtocolError
from pdcore.kv import KvLayout
from pdcore.kv import _heads_py
from pdcore.kv.pattern import page_content
from pdcore.kv.planner import plan

try:
    from pdcore.kv import _heads
except ImportError:  # the pure-only run (PDCORE_PURE_PYTHON=1) may have no build
    _heads = None


def _page(layout: KvLayout, first: int, count: int, pair: int) -> np.ndarray:
    """(buffers, tokens x heads x bytes) in the layout's order for heads [first, first+count) of pair ``pair``."""
    return page_content(layout, 0, first, count, pair)


def _fill(layout: KvLayout, rank: int, tp: int, num_pages: int, pages: np.ndarray) -> np.ndarray:
    """A prefill rank's cache, (buffers, pages, page bytes): pair i's tokens [i*T, (i+1)*T) in page pages[i]."""
    first, count = layout.heads(rank, tp)
    mem = np.zeros((layout.buffers, num_pages, layout.page_bytes(tp)), np.uint8)
    for i, page in enumerate(pages):
        mem[:, page] = _page(layout, first, count, i)
    return mem


@st.composite
def cases(draw: st.DrawFn) -> tuple[KvLayout, int, int, np.ndarray, np.ndarray, int]:
    order = draw(st.sampled_from(["hnd", "nhd", "mla"]))
    h = 1 if order == "mla" else draw(st.sampled_from([1, 2, 4, 8]))
    tps = [x for x in (1, 2, 3, 4, 5, 6, 8, 16) if order == "mla" or x > h or h % x == 0]
    p_tp, d_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    layout = KvLayout(order=order, kv_heads=h, head_bytes=draw(st.sampled_from([1, 2, 6])),
                      page_tokens=draw(st.sampled_from([1, 2, 4])), layers=draw(st.integers(1, 3)),
                      fused_kv=order == "hnd" and draw(st.booleans()))  # vLLM's CPU cache: K and V in one buffer
    num_pages = draw(st.integers(1, 12))
    n = draw(st.integers(0, num_pages))
    perm = st.permutations(range(num_pages))
    src = np.array(draw(perm)[:n], np.int64)
    if draw(st.booleans()):  # runs of adjacent pages, so coalescing is exercised
        src = np.sort(src)
    dst = np.array(draw(perm)[:n], np.int64)
    if draw(st.booleans()):
        dst = np.sort(dst)
    return layout, p_tp, d_tp, src, dst, num_pages


@given(cases())
def test_every_destination_byte_written_once_from_the_right_source(case) -> None:
    layout, p_tp, d_tp, src, dst, num_pages = case
    caches = [_fill(layout, p, p_tp, num_pages, src) for p in range(p_tp)]
    for d in range(d_tp):
        first, count = layout.heads(d, d_tp)
        dst_page = layout.page_bytes(d_tp)
        stride = num_pages * dst_page
        mem = np.zeros(layout.buffers * stride, np.uint8)
        hits = np.zeros(mem.size, np.int64)
        for p in range(p_tp):
            src_page = layout.page_bytes(p_tp)
            src_stride = num_pages * src_page
            flat = caches[p].reshape(-1)
            writes = plan(layout, p_tp, p, d_tp, d, [i * src_stride for i in range(layout.buffers)],
                          [i * stride for i in range(layout.buffers)], src, dst,
                          src_num_pages=num_pages, dst_num_pages=num_pages)
            if _heads is not None:
                seg = layout.segments(p_tp, p, d_tp, d)
                if seg is not None:
                    args = ([i * src_stride for i in range(layout.buffers)], [i * stride for i in range(layout.buffers)],
                            src, dst, seg)
                    np.testing.assert_array_equal(_heads.cut(*args), _heads_py.cut(*args))
            for s, t, n in writes.tolist():
                assert n > 0
                assert s // src_stride == t // stride, "a write crosses buffers"
                assert (s + n - 1) // src_stride == s // src_stride and (t + n - 1) // stride == t // stride
                mem[t : t + n] = flat[s : s + n]
                hits[t : t + n] += 1
            assert layout.slot_writes(p_tp, p, d_tp, d, len(src)) >= len(writes) or len(src) == 0
        announced = np.zeros((layout.buffers, num_pages), bool)
        announced[:, dst] = True
        inside = np.repeat(announced.reshape(-1), dst_page)
        assert not hits[~inside].any(), "a write landed outside the announced pages"
        assert (hits[inside] == 1).all(), "a destination byte was written twice or never"
        got = mem.reshape(layout.buffers, num_pages, dst_page)
        for i, page in enumerate(dst):
            np.testing.assert_array_equal(got[:, page], _page(layout, first, count, i))


def test_assignment_examples() -> None:
    hnd = KvLayout(order="hnd", kv_heads=2, head_bytes=4, page_tokens=2, layers=1)
    assert hnd.heads(2, 4) == (1, 1) and hnd.heads(3, 4) == (1, 1)  # tp > heads: replicated
    assert [hnd.sources(1, 4, d) for d in range(4)] == [(0,), (0,), (0,), (0,)]
    assert [hnd.sources(4, 1, 0)] == [(0, 2)]  # P4 > H2: one holder of each head writes
    assert [hnd.sources(4, 2, d) for d in range(2)] == [(0,), (3,)]  # d % (P/H) spreads the holders
    mla = KvLayout(order="mla", kv_heads=1, head_bytes=8, page_tokens=4, layers=2)
    assert [mla.sources(4, 2, d) for d in range(2)] == [(0,), (2,)]
    assert [mla.targets(4, 2, p) for p in range(4)] == [(0,), (), (1,), ()]  # ranks that owe nothing
    assert mla.buffers == 2 and hnd.buffers == 2


def test_writes_counted_against_the_per_token_slot_scheme() -> None:
    nhd = KvLayout(order="nhd", kv_heads=8, head_bytes=128, page_tokens=16, layers=4)
    hnd = KvLayout(order="hnd", kv_heads=8, head_bytes=128, page_tokens=16, layers=4)
    pages = np.arange(10)
    for layout in (nhd, hnd):
        w = plan(layout, 2, 0, 4, 1, [i << 30 for i in range(8)], [i << 30 for i in range(8)], pages, pages)
        assert layout.slot_writes(2, 0, 4, 1, 10) == 8 * 10 * 16
        assert len(w) == (8 * 10 if layout.order == "hnd" else 8 * 10 * 16)  # HND: one per buffer and page
    full = plan(hnd, 2, 1, 2, 1, [i << 30 for i in range(8)], [i << 30 for i in range(8)], pages, pages)
    assert len(full) == 8  # same tp: whole pages, one run per buffer


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [(dict(order="xyz"), "order"), (dict(kv_heads=0), "kv_heads"), (dict(order="mla", kv_heads=2), "kv_heads"),
     (dict(page_tokens=True), "page_tokens"), (dict(order="nhd", fused_kv=True), "fused_kv"),
     (dict(fused_kv=1), "fused_kv")],
)
def test_layout_rejects(kwargs: dict, field: str) -> None:
    base = dict(order="hnd", kv_heads=4, head_bytes=8, page_tokens=4, layers=2)
    with pytest.raises(LocalProtocolError, match=f"KvLayout.{field}"):
        KvLayout(**{**base, **kwargs})


def test_fused_kv_has_one_buffer_per_layer_and_survives_json() -> None:
    fused = KvLayout(order="hnd", kv_heads=2, head_bytes=256, page_tokens=32, layers=2, fused_kv=True)
    assert fused.buffers == 2 and fused.page_bytes(1) == 2 * 32 * 256 and fused.page_bytes(2) == 32 * 256
    assert KvLayout.from_json(fused.to_json()) == fused
    plain = KvLayout(order="hnd", kv_heads=2, head_bytes=256, page_tokens=32, layers=2)
    assert "fused_kv" not in plain.to_json() and KvLayout.from_json(plain.to_json()) == plain != fused


def test_tp_that_cannot_share_heads_is_refused() -> None:
    layout = KvLayout(order="hnd", kv_heads=4, head_bytes=8, page_tokens=4, layers=2)
    with pytest.raises(LocalProtocolError, match="cannot share 4 KV heads"):
        layout.heads(0, 3)
    two = KvLayout(order="nhd", kv_heads=2, head_bytes=8, page_tokens=4, layers=1)
    assert [two.heads(r, 3) for r in range(3)] == [(0, 1), (0, 1), (1, 1)]  # D3 over H2: replicated unevenly
    assert [two.sources(1, 3, d) for d in range(3)] == [(0,), (0,), (0,)]
    with pytest.raises(LocalProtocolError, match="kv_layout: unknown field"):
        KvLayout.from_json({**layout.to_json(), "x": 1})
    assert KvLayout.from_json(layout.to_json()) == layout
