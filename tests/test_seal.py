"""The ``"tcp"`` control plane's sealed frames (``pdcore.control._seal`` and its pure twin).

Each twin against a reference written here from ``hashlib`` (keyed BLAKE2b over the head and the
body), and the two twins against each other on the same bytes: the compiled twin computes BLAKE2b
itself, so these are what hold it to the standard's. Hostile bytes (a bit flipped anywhere, frames
replayed, reordered or dropped, a length past the bound) are refused the same way by both, with the
bodies before the refusal and nothing after it.
"""

from __future__ import annotations

import hashlib
import importlib
import struct
from types import ModuleType

import pytest
from hypothesis import assume, given, strategies as st

from pdcore.core.errors import FrameError

TWINS = [pytest.param("pdcore.control._seal", marks=pytest.mark.compiled, id="cython"),
         pytest.param("pdcore.control._seal_py", id="python")]
MAX = 1 << 16
keys = st.binary(min_size=1, max_size=64)
# around BLAKE2b's 128-byte blocks: the head is 12 bytes, so bodies of 116 and 244 fill a block exactly
bodies = st.lists(st.one_of(st.binary(max_size=300), st.sampled_from([b"", b"x" * 115, b"x" * 116, b"x" * 117,
                                                                     b"y" * 244, b"z" * 1000])), min_size=1, max_size=5)


def reference(key: bytes, bodies: list[bytes]) -> bytes:
    """What a sealer must send: ``length u32, seq u64, tag [16], body`` each, the tag keyed BLAKE2b (hashlib)."""
    out = b""
    for seq, body in enumerate(bodies):
        head = struct.pack("<IQ", len(body), seq)
        out += head + hashlib.blake2b(head + body, key=key, digest_size=16).digest() + body
    return out


@pytest.fixture(scope="module", params=TWINS)
def seal(request: pytest.FixtureRequest) -> ModuleType:
    return importlib.import_module(request.param)


def opened(seal: ModuleType, key: bytes, data: bytes, cuts: list[int]) -> tuple[list[bytes], FrameError | None, int]:
    """``data`` fed to a fresh opener in pieces cut at ``cuts``: the bodies, the refusal, the partial bytes left."""
    opener = seal.Opener(key, MAX)
    out: list[bytes] = []
    at = 0
    for cut in sorted({min(c, len(data)) for c in cuts} | {len(data)}):
        got, error = opener.feed(memoryview(data)[at:cut])
        out += got
        at = cut
        if error is not None:
            return out, error, opener.partial
    return out, None, opener.partial


@given(key=keys, frames=bodies)
def test_a_sealer_sends_what_the_reference_seals(seal: ModuleType, key: bytes, frames: list[bytes]) -> None:
    assert seal.Sealer(key).seal_all(frames) == reference(key, frames)
    one = seal.Sealer(key)
    assert b"".join(part for body in frames for part in one.seal(body)) == reference(key, frames)


@given(key=keys, frames=bodies, cuts=st.lists(st.integers(0, 2000), max_size=6))
def test_an_opener_gives_back_every_body_in_order_however_the_bytes_are_cut(seal: ModuleType, key: bytes,
                                                                            frames: list[bytes], cuts: list[int]) -> None:
    assert opened(seal, key, reference(key, frames), cuts) == (frames, None, 0)


@given(key=keys, frames=bodies, data=st.data())
def test_a_frame_cut_short_waits_for_its_rest(seal: ModuleType, key: bytes, frames: list[bytes], data: st.DataObject) -> None:
    wire = reference(key, frames)
    last = len(wire) - (28 + len(frames[-1]))  # where the last frame begins
    end = data.draw(st.integers(last + 1, len(wire) - 1))
    got, error, partial = opened(seal, key, wire[:end], [])
    assert (got, error, partial) == (frames[:-1], None, end - last)


@given(key=keys, frames=bodies, data=st.data())
def test_a_flipped_bit_anywhere_is_refused_after_the_frames_before_it(seal: ModuleType, key: bytes, frames: list[bytes],
                                                                      data: st.DataObject) -> None:
    wire = bytearray(reference(key, frames))
    at = data.draw(st.integers(0, len(wire) - 1))
    wire[at] ^= 1 << data.draw(st.integers(0, 7))
    starts = [0]
    for body in frames:
        starts.append(starts[-1] + 28 + len(body))
    hit = max(i for i, s in enumerate(starts[:-1]) if s <= at)
    got, error, partial = opened(seal, key, bytes(wire), data.draw(st.lists(st.integers(0, len(wire)), max_size=3)))
    assert got == frames[:hit]
    if error is None:  # only a length grown past the bytes that came: that frame waits for the rest, never delivered
        assert 4 > at - starts[hit] and partial > 0
    else:
        assert error.kind in ("tag", "length") and partial == 0


@pytest.mark.parametrize("order", ["replayed", "swapped", "dropped"])
@given(key=keys, frames=st.lists(st.binary(max_size=200), min_size=3, max_size=5))
def test_frames_replayed_reordered_or_dropped_are_refused_as_out_of_sequence(seal: ModuleType, order: str, key: bytes,
                                                                             frames: list[bytes]) -> None:
    wire, one = reference(key, frames), []
    for body in frames:
        one.append(wire[:28 + len(body)])
        wire = wire[28 + len(body):]
    sent, good = {"replayed": (one[0] + one[1] + one[1], 2), "swapped": (one[1] + one[0], 0),
                  "dropped": (one[0] + one[2], 1)}[order]
    got, error, _ = opened(seal, key, sent, [])
    assert got == frames[:good] and error is not None and error.kind == "seq"


@given(key=keys, other=keys, frames=bodies)
def test_frames_sealed_with_another_key_are_refused_at_the_first(seal: ModuleType, key: bytes, other: bytes,
                                                                 frames: list[bytes]) -> None:
    assume(other != key)
    got, error, _ = opened(seal, other, reference(key, frames), [])
    assert got == [] and error is not None and error.kind == "tag"


def test_a_frame_past_the_bound_is_refused_before_its_body_comes_and_the_opener_stays_spent(seal: ModuleType) -> None:
    key = b"k" * 32
    opener = seal.Opener(key, 10)
    good = reference(key, [b"ok"])
    big = seal.Sealer(key)
    big.seal(b"ok")
    head, _ = big.seal(b"x" * 11)
    got, error = opener.feed(good + head)  # the long frame's head alone: refused on its length
    assert got == [b"ok"] and error is not None and error.kind == "length" and "11 bytes (at most 10)" in str(error)
    got, error = seal.Opener(key, 10).feed(good)
    assert got == [b"ok"] and error is None
    spent_got, spent_error = opener.feed(good)
    assert spent_got == [] and spent_error is not None and spent_error.kind == "length"


@pytest.mark.parametrize("key", [b"", b"k" * 65, "text-key", bytearray(b"k" * 32)])
def test_a_key_that_is_not_1_to_64_bytes_is_refused(seal: ModuleType, key: object) -> None:
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        seal.Sealer(key)
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        seal.Opener(key, MAX)


def test_a_body_that_is_not_bytes_is_refused(seal: ModuleType) -> None:
    with pytest.raises(TypeError):
        seal.Sealer(b"k").seal(bytearray(b"body"))
    with pytest.raises(TypeError):
        seal.Sealer(b"k").seal_all([b"ok", bytearray(b"body")])
