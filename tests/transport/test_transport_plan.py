"""The transfer plan: both twins (``plan_impl`` is [cython] and [python]) against the naive plan."""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import _plan_py, plan as chooser
from transport._layout import Layout, PlanError


def apply(writes: np.ndarray, src_mem: bytes, src_base: int, dst_size: int, dst_base: int) -> bytes:
    """Simulate a plan: copy each write from a source image into a destination image."""
    out = bytearray(dst_size)
    for la, ra, n in writes.tolist():
        out[ra - dst_base : ra - dst_base + n] = src_mem[la - src_base : la - src_base + n]
    return bytes(out)


@st.composite
def plan_inputs(draw: st.DrawFn) -> tuple[Layout, Layout, list[int], list[int]]:
    nbuf = draw(st.integers(1, 4))
    page_bytes = draw(st.lists(st.integers(1, 24), min_size=nbuf, max_size=nbuf))
    src_pages_n = draw(st.integers(1, 40))
    dst_pages_n = draw(st.integers(1, 40))
    n = draw(st.integers(0, min(src_pages_n, dst_pages_n)))
    # runs are common in practice: build page lists from a mix of runs and jumps
    if draw(st.booleans()):
        s0, d0 = draw(st.integers(0, src_pages_n - n)), draw(st.integers(0, dst_pages_n - n))
        sp, dp = list(range(s0, s0 + n)), list(range(d0, d0 + n))
        cut = draw(st.integers(0, n))
        sp[cut:] = draw(st.permutations(sp[cut:]))
    else:
        sp = draw(st.lists(st.integers(0, src_pages_n - 1), min_size=n, max_size=n))
        dp = draw(st.permutations(list(range(dst_pages_n))))[:n]
    # buffers laid out one after another in one address space per side, with gaps
    def bases(pages: int) -> list[int]:
        out, at = [], 4096
        for pb in page_bytes:
            out.append(at)
            at += pb * pages + draw(st.integers(0, 8))
        return out

    return Layout(bases(src_pages_n), page_bytes, src_pages_n), Layout(bases(dst_pages_n), page_bytes, dst_pages_n), sp, dp


def _extent(layout: Layout) -> int:
    return max(b + pb * layout.num_pages for b, pb in zip(layout.bases, layout.page_bytes))


@settings(max_examples=300, deadline=None)
@given(case=plan_inputs())
def test_coalesced_plan_copies_exactly_what_the_naive_plan_copies(plan_impl: ModuleType, case: tuple) -> None:
    src, dst, sp, dp = case
    coalesced = plan_impl.plan(src, dst, sp, dp)
    naive = plan_impl.naive_plan(src, dst, sp, dp)
    assert coalesced.dtype == naive.dtype == np.uint64 and coalesced.shape[1] == naive.shape[1] == 3
    assert len(coalesced) <= len(naive)
    assert len(coalesced) == len(src.bases) * plan_impl.count_runs(sp, dp)  # one write per run per buffer
    assert int(coalesced[:, 2].sum()) == int(naive[:, 2].sum())
    image = np.random.default_rng(len(sp)).integers(0, 256, _extent(src), dtype=np.uint8).tobytes()
    size = _extent(dst)
    assert apply(coalesced, image, 0, size, 0) == apply(naive, image, 0, size, 0)
    # and the twins agree exactly, write for write
    np.testing.assert_array_equal(coalesced, _plan_py.plan(src, dst, sp, dp))


@given(case=plan_inputs())
@settings(max_examples=100, deadline=None)
def test_no_two_adjacent_writes_could_have_been_one(plan_impl: ModuleType, case: tuple) -> None:
    src, dst, sp, dp = case
    w = plan_impl.plan(src, dst, sp, dp).reshape(len(src.bases), -1, 3)
    for b in range(w.shape[0]):
        for x, y in zip(w[b, :-1].tolist(), w[b, 1:].tolist()):
            assert not (x[0] + x[2] == y[0] and x[1] + x[2] == y[1]), (x, y)


def test_contiguous_pages_are_one_write_per_buffer(plan_impl: ModuleType) -> None:
    L = Layout.for_kv([1 << 20, 2 << 20], bytes_per_token=256, page_size=16, num_pages=64)
    M = Layout.for_kv([5 << 20, 6 << 20], bytes_per_token=256, page_size=16, num_pages=64)
    w = plan_impl.plan(L, M, range(10, 30), range(40, 60))
    assert w.tolist() == [
        [(1 << 20) + 10 * 4096, (5 << 20) + 40 * 4096, 20 * 4096],
        [(2 << 20) + 10 * 4096, (6 << 20) + 40 * 4096, 20 * 4096],
    ]
    assert plan_impl.plan(L, M, [], []).shape == (0, 3)


@pytest.mark.parametrize(
    ("src_pages", "dst_pages", "match"),
    [
        ([0, 64], [0, 1], r"src_pages\[1\] = 64 is out of range"),
        ([0, 1], [-1, 1], r"dst_pages\[0\] = -1 is out of range"),
        ([0, 1, 2], [0, 1], "3 source pages but 2 destination pages"),
        ([0, 1], [5, 5], "destination page 5 appears 2 times"),
        ([[0, 1]], [[0, 1]], "1-D"),
        ([0.5], [1], "integer page ids"),
    ],
)
def test_bad_inputs_are_clear_errors(plan_impl: ModuleType, src_pages: object, dst_pages: object, match: str) -> None:
    L = Layout([4096], [64], 64)
    with pytest.raises(PlanError, match=match):
        plan_impl.plan(L, L, src_pages, dst_pages)
    with pytest.raises(PlanError, match=match):
        plan_impl.naive_plan(L, L, src_pages, dst_pages)


def test_mismatched_layouts_are_clear_errors(plan_impl: ModuleType) -> None:
    with pytest.raises(PlanError, match="2 buffers, destination 1"):
        plan_impl.plan(Layout([1, 2], [8, 8], 4), Layout([1], [8], 4), [0], [0])
    with pytest.raises(PlanError, match="buffer 1: 8 bytes per page at the source, 16"):
        plan_impl.plan(Layout([1, 99], [8, 8], 4), Layout([1, 99], [8, 16], 4), [0], [0])
    with pytest.raises(PlanError, match="one page size per buffer"):
        Layout([1, 2], [8], 4)
    with pytest.raises(PlanError, match="positive number of pages"):
        Layout([1], [8], 0)
    assert issubclass(PlanError, ValueError)


def test_twins_share_one_api() -> None:
    from transport import _plan

    for name in _plan_py.__all__:
        py, c = getattr(_plan_py, name), getattr(_plan, name)
        if name in ("Layout", "PlanError"):
            assert py is c  # defined once, in transport._layout
            continue
        py_params = list(inspect.signature(py).parameters)
        c_params = list(inspect.signature(c).parameters)
        assert py_params == c_params, name
    assert sorted(_plan_py.__all__) == sorted(_plan.__all__)
    assert chooser.IMPLEMENTATION in ("cython", "python")


@pytest.mark.parametrize(("env", "code", "expect"), [
    ({"PDCORE_PURE_PYTHON": "1"}, "import transport.plan as p; print(p.IMPLEMENTATION, p.plan.__module__)", "python transport._plan_py"),
    ({}, "import transport.plan as p; print(p.IMPLEMENTATION, p.plan.__module__)", "cython transport._plan"),
    # a broken build fails loudly instead of quietly running the pure twin
    ({}, "import sys; sys.modules['transport._plan'] = None\ntry:\n import transport.plan\nexcept ImportError:\n print('ImportError')", "ImportError"),
])
def test_the_chooser(env: dict[str, str], code: str, expect: str) -> None:
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    full_env = {k: v for k, v in os.environ.items() if k != "PDCORE_PURE_PYTHON"} | env
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=full_env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == expect


def test_stub_matches_the_twin() -> None:
    """``_plan.pyi`` declares the pure twin's public functions with the same parameters."""
    import ast
    from pathlib import Path

    stub = ast.parse((Path(_plan_py.__file__).parent / "_plan.pyi").read_text())
    declared = {n.name: [a.arg for a in n.args.args] for n in stub.body if isinstance(n, ast.FunctionDef)}
    for name in ("count_runs", "plan", "naive_plan"):
        assert declared[name] == list(inspect.signature(getattr(_plan_py, name)).parameters), name


# --------------------------------------------------------------------------- hostile layouts
# A sink's layout arrives over the control channel: its claims must not cost memory or wrap addresses.


def test_a_huge_claimed_num_pages_plans_in_o_pages_written(plan_impl: ModuleType) -> None:
    import tracemalloc

    pb = 4096
    src = Layout([1 << 20], [pb], 64)
    dst = Layout([1 << 30], [pb], 1 << 40)  # 2**40 pages claimed: 4 PiB of cache
    far = [(1 << 40) - 3, (1 << 40) - 2, (1 << 40) - 1, 7]
    tracemalloc.start()
    try:
        w = plan_impl.plan(src, dst, [0, 1, 2, 10], far)
        naive = plan_impl.naive_plan(src, dst, [0, 1, 2, 10], far)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # numpy reports its buffers to tracemalloc: O(num_pages) would be terabytes
    assert w.tolist() == [
        [(1 << 20), (1 << 30) + ((1 << 40) - 3) * pb, 3 * pb],
        [(1 << 20) + 10 * pb, (1 << 30) + 7 * pb, pb],
    ]
    assert len(naive) == 4
    with pytest.raises(PlanError, match=r"destination page 1099511627775 appears 2 times"):
        plan_impl.plan(src, dst, [0, 1], [(1 << 40) - 1] * 2)


def test_a_moderately_large_num_pages_costs_no_memory_either(plan_impl: ModuleType) -> None:
    """2**27 pages would fit in RAM (1 GiB of counts): the plan must still not touch O(num_pages) memory."""
    import tracemalloc

    L = Layout([0], [64], 1 << 27)
    tracemalloc.start()
    try:
        plan_impl.plan(L, L, [5, 6], [(1 << 27) - 2, (1 << 27) - 1])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_the_last_addressable_page_plans_without_wrapping(plan_impl: ModuleType) -> None:
    top = (1 << 64) - 1
    pb = 1 << 12
    dst = Layout([top - 4 * pb], [pb], 4)  # the last page ends at 2**64 - 1 exactly
    src = Layout([0], [pb], 4)
    w = plan_impl.plan(src, dst, [0, 1], [2, 3])
    assert w.tolist() == [[0, top - 2 * pb, 2 * pb]]
    np.testing.assert_array_equal(w, _plan_py.plan(src, dst, [0, 1], [2, 3]))


@pytest.mark.parametrize(
    ("bases", "page_bytes", "num_pages", "match"),
    [
        ([0], [1], 1 << 64, r"num_pages: \d+ exceeds 2\*\*63"),
        ([0], [1], (1 << 63) + 1, r"num_pages: \d+ exceeds 2\*\*63"),
        ([0], [2], 1 << 63, r"bases\[0\] = 0x0 \+ page_bytes\[0\] = 2 x num_pages = \d+ does not fit in 64-bit"),
        ([0, (1 << 64) - 100], [64, 64], 2, r"bases\[1\] = 0x[0-9a-f]+ \+ page_bytes\[1\] = 64 x num_pages = 2 does not fit"),
        ([0], [1 << 63], 2, r"bases\[0\].*does not fit in 64-bit addresses"),
        ([0], [1 << 70], 1, r"does not fit in 64-bit addresses"),
        ([1 << 64], [1], 1, r"bases\[0\].*does not fit"),
        ([-1], [1], 1, r"bases\[0\] = -0x1"),
        ([0], [0], 1, r"page_bytes\[0\]: bytes per page must be positive"),
        ([0], [-8], 1, r"page_bytes\[0\]: bytes per page must be positive"),
        ([0], [8], -(1 << 40), r"num_pages: a layout needs a positive number of pages"),
        ([0], [8], 1.5, r"num_pages: must be an integer, got float"),
        ([0], [8], "64", r"num_pages: must be an integer, got str"),
        ([0], [8], True, r"num_pages: must be an integer, got True"),
        ([0], [8], None, r"num_pages: must be an integer, got NoneType"),
        ([0.5], [8], 4, r"bases\[0\]: must be an integer, got float"),
        ([0], ["8"], 4, r"page_bytes\[0\]: must be an integer, got str"),
        ("12", [8], 4, r"bases: must be a sequence of integers, got str"),
        ({"a": 1}, [8], 4, r"bases: must be a sequence of integers, got dict"),
        ([], [], 4, r"bases: a layout needs at least one buffer"),
    ],
)
def test_absurd_layouts_are_errors_naming_the_field(bases: Any, page_bytes: Any, num_pages: Any, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Layout(bases, page_bytes, num_pages)


def test_page_ids_past_int64_are_out_of_range_not_wrapped(plan_impl: ModuleType) -> None:
    L = Layout([0], [1], 1 << 63)  # the largest layout: page ids 0 .. 2**63 - 1
    top = np.array([(1 << 63) - 2, (1 << 63) - 1], np.uint64)
    w = plan_impl.plan(L, L, top, top)
    assert w.tolist() == [[(1 << 63) - 2, (1 << 63) - 2, 2]]
    assert plan_impl.count_runs(top.astype(np.int64), top.astype(np.int64)) == 1
    with pytest.raises(PlanError, match=r"dst_pages\[0\] = 9223372036854775808 is out of range"):
        plan_impl.plan(L, L, [0], np.array([1 << 63], np.uint64))
    with pytest.raises(PlanError, match=r"integer page ids"):
        plan_impl.plan(L, L, [0], [1 << 64])  # does not fit any integer dtype: an object array


def test_count_runs_wraps_like_numpy_at_the_int64_edges(plan_impl: ModuleType) -> None:
    """The compiled twin compares in unsigned arithmetic: no signed-overflow UB, same answer as the pure one."""
    lo, hi = -(1 << 63), (1 << 63) - 1
    for s, d in [([hi, lo], [0, 1]), ([hi - 1, hi], [hi - 1, hi]), ([lo, lo + 1], [5, 6]), ([hi, hi], [1, 2])]:
        assert plan_impl.count_runs(s, d) == _plan_py.count_runs(s, d), (s, d)
