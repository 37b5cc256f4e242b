"""Invariant: the tcp transport's hello functions return or raise HelloError, nothing else, and accept
only the exact authentic bytes.

``decode_hello(data)`` returns a hello that re-encodes to ``data`` itself, or raises ``HelloError``.
``check_challenge(key, hello, data)`` (the source checking the sink's nonce and MAC) accepts ``data``
only if it equals ``challenge(key, hello, data[:16])``; ``check_proof(key, hello, nonce, data)`` (the
sink checking the source) only if it equals ``proof(key, hello, nonce)``; the proof that
``check_challenge`` returns is always one ``check_proof`` accepts. Each input is fed whole and split,
raw and behind a valid prefix (so mutations reach the MAC comparison).
Run: python fuzz/fuzz_hello.py -max_total_time=20
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import _harness  # noqa: E402
from _harness import feed_whole_and_split, main  # noqa: E402

with _harness.atheris.instrument_imports(include=["transport"]) if _harness.atheris else contextlib.nullcontext():
    from transport import tcp_hello
    from transport.base import derive_key

KEY = derive_key(b"fuzz: the deployment secret....", "tcp-hello")
OTHER_KEY = derive_key(b"fuzz: another deployment secret", "tcp-hello")
HELLO = tcp_hello.Hello(b"K" * 16, b"S" * 16, tcp_hello.DATA, b"p" * 16, b"n" * 16)
PLAIN = tcp_hello.Hello(b"K" * 16, b"S" * 16, tcp_hello.ACKS, b"p" * 16)
SINK_NONCE = b"k" * 16
CHALLENGE = tcp_hello.challenge(KEY, HELLO, SINK_NONCE)
PROOF = tcp_hello.proof(KEY, HELLO, SINK_NONCE)

SEEDS = [
    tcp_hello.encode_hello(HELLO),
    tcp_hello.encode_hello(PLAIN),
    CHALLENGE,
    PROOF,
    tcp_hello.challenge(OTHER_KEY, HELLO, SINK_NONCE),
    b"PDTA\x04",
]


def check_hello(data: bytes) -> None:
    try:
        hello = tcp_hello.decode_hello(data)
    except tcp_hello.HelloError:
        return
    assert tcp_hello.encode_hello(hello) == data, (hello, data)
    assert len(hello.sink) == len(hello.source) == len(hello.pair) == 16 and len(hello.nonce) in (0, 16)
    assert hello.kind in (tcp_hello.DATA, tcp_hello.ACKS)


def check_challenge(data: bytes) -> None:
    for hello in (HELLO, PLAIN):
        try:
            nonce, answer = tcp_hello.check_challenge(KEY, hello, data)
        except tcp_hello.HelloError:
            assert not hello.nonce or len(data) != len(CHALLENGE) or data != tcp_hello.challenge(KEY, hello, data[:16])
            continue
        assert hello.nonce and data == tcp_hello.challenge(KEY, hello, nonce), data
        tcp_hello.check_proof(KEY, hello, nonce, answer)  # what the source answers, the sink accepts


def check_proof(data: bytes) -> None:
    try:
        tcp_hello.check_proof(KEY, HELLO, SINK_NONCE, data)
    except tcp_hello.HelloError:
        assert data != PROOF
        return
    assert data == PROOF, data


def check(data: bytes) -> None:
    check_hello(data)
    check_challenge(data)
    check_proof(data)
    with contextlib.suppress(tcp_hello.HelloError):
        assert tcp_hello.hello_size(data) in (tcp_hello.HELLO.size, tcp_hello.HELLO_AUTH.size)


def test_one_input(data: bytes) -> None:
    feed_whole_and_split(check, data)
    # behind a valid prefix: the mutation lands in the fields (the nonce, the MAC) rather than the magic
    feed_whole_and_split(check_hello, tcp_hello.encode_hello(HELLO)[:5] + data)
    feed_whole_and_split(check_challenge, CHALLENGE[: 48 - min(len(data), 48)] + data[:48])
    feed_whole_and_split(check_proof, PROOF[: 32 - min(len(data), 32)] + data[:32])


if __name__ == "__main__":
    main("hello", test_one_input, SEEDS)
