"""Invariant: the ``"tcp"`` control plane's decoders return or raise their own error, nothing else, and
accept only authentic bytes.

``decode_hello(data)`` returns a hello that re-encodes to ``data``, or raises ``HandshakeError``;
``check_challenge`` and ``check_proof`` accept only the exact MACs. An ``Opener`` fed any bytes, whole
or in two pieces, yields only bodies that a ``Sealer`` with its key sealed, in order, with no seq
skipped; a refusal is a ``FrameError`` it returns (never raises), and after it nothing more comes.
Each input is fed raw and behind a run of valid sealed frames (so mutations reach the tag and seq).
Run: python fuzz/fuzz_control_tcp.py -max_total_time=20
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import _harness  # noqa: E402
from _harness import feed_whole_and_split, main  # noqa: E402

with _harness.atheris.instrument_imports(include=["pdcore.control"]) if _harness.atheris else contextlib.nullcontext():
    from pdcore.control import tcp_frames as tf, wire
    from pdcore.control.auth import derive_key

KEY = derive_key(b"fuzz: the deployment secret....", tf.KEY_LABEL)
HELLO = tf.Hello(True, b"n" * 16, "tcp://127.0.0.1:5555")
NONCE = b"l" * 16
CHALLENGE = tf.challenge(KEY, HELLO, NONCE)
PROOF = tf.proof(KEY, HELLO, NONCE)
SESSION = tf.session_key(KEY, HELLO.nonce, NONCE)
BODIES = [b"first frame", b"", b"x" * 300]


def sealed(bodies: list[bytes]) -> bytes:
    sealer = tf.Sealer(SESSION)
    return sealer.seal_all(bodies)


SEEDS = [tf.encode_hello(HELLO), tf.encode_hello(tf.Hello(False, b"m" * 16, "tcp://[::1]:1")), CHALLENGE, PROOF,
         sealed(BODIES), sealed(BODIES)[:40]]


def check_hello(data: bytes) -> None:
    try:
        hello = tf.decode_hello(data)
    except tf.HandshakeError:
        return
    assert tf.encode_hello(hello) == data, (hello, data)


def check_macs(data: bytes) -> None:
    try:
        nonce = tf.check_challenge(KEY, HELLO, data)
    except tf.HandshakeError:
        assert data != CHALLENGE
    else:
        assert data == tf.challenge(KEY, HELLO, nonce), data
    try:
        tf.check_proof(KEY, HELLO, NONCE, data)
    except tf.HandshakeError:
        assert data != PROOF
    else:
        assert data == PROOF


def check_frames(data: bytes) -> None:
    """Whatever comes out is a prefix of what was sealed: never a forged, reordered or repeated body."""
    for pieces in ([data], [data[: len(data) // 2], data[len(data) // 2:]]):
        opener = tf.Opener(SESSION, wire.MAX_FRAME_BYTES)
        got: list[bytes] = []
        refused = False
        for piece in pieces:
            bodies, error = opener.feed(piece)
            assert not (refused and bodies), "a body after a refusal"
            got += bodies
            refused = refused or error is not None
        assert got == BODIES[: len(got)] or not got, got
        if got:
            assert sealed(got) == data[: len(sealed(got))]


def test_one_input(data: bytes) -> None:
    feed_whole_and_split(check_hello, data)
    check_macs(data)
    check_frames(data)
    valid = sealed(BODIES)
    check_frames(valid[: len(valid) - min(len(data), len(valid))] + data)  # mutations reach the later frames
    feed_whole_and_split(check_hello, tf.encode_hello(HELLO)[:6] + data)


if __name__ == "__main__":
    main("control_tcp", test_one_input, SEEDS)
