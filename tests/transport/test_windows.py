"""The device-free half of the verbs transport's memory windows (transport/windows.py).

Which windows a grant needs (never a byte outside its ranges, never across a region), the
liveness-socket frames however TCP splits them, and the source's table: the rkey of the window
holding a write, keys it must not wait for, and the stop answered only once nothing is in flight.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.windows import (
    MAX_FRAME_WINDOWS,
    FrameReader,
    SourceWindows,
    encode_stop,
    encode_windows,
    window_spans,
)


@st.composite
def regions_and_ranges(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Adjacent or spaced regions, and sorted non-overlapping ranges inside them (some touching)."""
    regions: list[tuple[int, int]] = []
    at = 4096
    for _ in range(draw(st.integers(1, 4))):
        at += draw(st.sampled_from([0, 0, 64]))  # regions often touch: a join must not cross them
        size = draw(st.integers(1, 8)) * 64
        regions.append((at, at + size))
        at += size
    ranges: list[tuple[int, int]] = []
    for lo, hi in regions:
        pos = lo
        while pos < hi and draw(st.booleans()):
            pos += draw(st.sampled_from([0, 0, 16]))
            if pos >= hi:
                break
            n = draw(st.integers(1, hi - pos))
            ranges.append((pos, n))
            pos += n
    return regions, ranges


@given(regions_and_ranges())
@settings(max_examples=300, deadline=None)
def test_windows_cover_exactly_the_granted_bytes_each_in_one_region(case: tuple) -> None:
    regions, ranges = case
    spans = window_spans(ranges, regions)
    covered = {b for a, n in ranges for b in range(a, a + n)}
    assert {b for a, n in spans for b in range(a, a + n)} == covered  # nothing more, nothing less
    for a, n in spans:
        assert any(lo <= a and a + n <= hi for lo, hi in regions), (a, n, regions)
    assert len(spans) <= len(ranges)
    # two spans that touch inside one region would have been one window
    for (a, n), (b, _m) in zip(spans, spans[1:]):
        if a + n == b:
            assert any(hi == b for _lo, hi in regions), (spans, regions)


def test_touching_ranges_are_one_window_unless_a_region_ends_between() -> None:
    regions = [(0x1000, 0x2000), (0x2000, 0x3000)]
    assert window_spans([(0x1000, 0x100), (0x1100, 0x100), (0x1300, 0x10)], regions) == [(0x1000, 0x200), (0x1300, 0x10)]
    assert window_spans([(0x1F00, 0x100), (0x2000, 0x100)], regions) == [(0x1F00, 0x100), (0x2000, 0x100)]


frames = st.lists(
    st.one_of(
        st.tuples(st.just("W"), st.integers(0, 2**64 - 1),
                  st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1)),
                           max_size=5)),
        st.tuples(st.sampled_from(["S", "s"]), st.integers(0, 2**64 - 1), st.just([])),
    ),
    max_size=8,
)


@given(frames, st.lists(st.integers(1, 40), min_size=1, max_size=30))
@settings(max_examples=300, deadline=None)
def test_frames_read_back_however_the_stream_is_split(sent: list, cuts: list[int]) -> None:
    wire = b"".join(encode_windows(k, rows) if kind == "W" else encode_stop(k, answer=kind == "s") for kind, k, rows in sent)
    reader = FrameReader()
    got = []
    at = 0
    for n in cuts * (len(wire) // max(1, sum(cuts)) + 1):
        got += reader.feed(wire[at : at + n])
        at += n
        if at >= len(wire):
            break
    got += reader.feed(wire[at:])
    assert [(k.decode(), key, list(rows)) for k, key, rows in got] == [(kind, k, [tuple(r) for r in rows]) for kind, k, rows in sent]


def test_a_byte_that_is_no_frame_and_an_oversized_grant_are_refused() -> None:
    with pytest.raises(ValueError, match="not a frame"):
        FrameReader().feed(b"X")
    with pytest.raises(ValueError, match="windows"):
        FrameReader().feed(b"W" + (7).to_bytes(8, "little") + (MAX_FRAME_WINDOWS + 1).to_bytes(4, "little"))
    r = FrameReader()
    assert r.feed(encode_stop(3) + b"R" + b"trailing") == [(b"S", 3, ()), (b"R", 0, ())]  # R ends the stream


def test_the_source_table_finds_rkeys_waits_only_for_new_keys_and_answers_a_stop_when_idle() -> None:
    w = SourceWindows(floor=10)
    assert w.known(7) and not w.known(11)  # 7 was issued before we connected and is not ours
    w.add(12, [(0x3000, 0x100, 0xB), (0x1000, 0x200, 0xA)])
    assert w.known(11) and w.known(12) and not w.known(13)  # keys arrive in order: 11 is someone else's
    assert w.rkey(12, 0x1000, 0x200) == 0xA and w.rkey(12, 0x3080, 0x80) == 0xB
    assert w.rkey(12, 0x1100, 0x101) is None and w.rkey(12, 0x2000, 1) is None and w.rkey(12, 0x10, 1) is None
    assert w.rkey(5, 0x1000, 1) is None
    w.began(12)
    w.began(12)
    assert not w.stop(12)  # two batches in flight: the answer waits
    assert w.rkey(12, 0x1000, 1) is None and w.known(12)  # no more writes through it
    assert not w.ended(12)
    assert w.ended(12)  # the last one: answer now
    assert not w.busy and not w.stopping
    assert w.stop(99) and w.known(50)  # a stop of a key never seen: answered at once, and it raises the floor
