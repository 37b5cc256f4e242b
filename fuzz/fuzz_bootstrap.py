"""Invariant: each bootstrap parser returns a value or raises RemoteProtocolError, nothing else;
the request verifier returns the nonce or raises RequestAuthError, nothing else, and passes only the exact signed bytes.

Covers the server's door (parse_registration, parse_rank_path, Registry.register,
verify_request) and the client's (parse_parallel_info, parse_rank_info, the
response signature check). A parsed registration must register idempotently
and be found again by lookup. The verifier is driven two ways: the input split
into method, path, body and header (arbitrary bytes: refused unless they are a
real signature over themselves); and a request signed over input-derived parts,
which must verify once, then be a replay, and fail once any one part (or the
timestamp, outside the window) is swapped for other input bytes. Each input is
fed whole and split in two. Run: python fuzz/fuzz_bootstrap.py -max_total_time=20
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _harness import feed_whole_and_split, instrumented, main  # noqa: E402

with instrumented():
    from pdcore.control import auth, bootstrap, request_signing
    from pdcore.core.errors import RemoteProtocolError

SEEDS = [
    b'{"session_id":"p-0","epoch":1,"endpoint":"tcp://127.0.0.1:7000","tp_size":2,"dp_size":1,'
    b'"tp_rank":1,"dp_rank":0,"layout":{"page_size":16,"fields":[{"shape":[8,128],"x":1.5}],"n":null},'
    b'"transport":"0123456789abcdef0123456789abcdef"}',
    b'{"session_id":"p-1","epoch":0,"endpoint":"tcp://[::1]:1","tp_size":1,"dp_size":2,'
    b'"tp_rank":0,"dp_rank":1,"layout":{},"transport":"0123456789abcdef0123456789abcdef"}',
    b'{"tp_sizes":[2],"dp_size":1,"layout":{"a":[1,2]},"registered":1,"complete":false}',
    b'{"dp_rank":0,"tp_rank":1,"endpoint":"tcp://h:5","session_id":"s","epoch":0,"transport":"0123456789abcdef0123456789abcdef"}',
    b"/v1/ranks/0/1",
    b"/v1/ranks/1023/0",
    b"PUT\x00/v1/ranks\x00{}\x00PDCORE-HMAC-SHA256 t=1700000000000,n=" + b"0" * 32 + b",s=" + b"0" * 64,
    b"GET\x00/v1/parallel\x00\x00PDCORE-HMAC-SHA256 t=1,n=00,s=00\x00\x01\x02",
]

KEY = auth.derive_key(b"fuzz-secret-0123456789", "bootstrap")
NOW = 1_700_000_000.0  # the verifier never reads a clock: now is an argument
WINDOW = 30.0

registry = bootstrap.Registry()
calls = 0


def check(data: bytes) -> None:
    global registry, calls
    calls += 1
    if calls % 1000 == 0:
        registry = bootstrap.Registry()  # keep the conflict scan short
    try:
        reg = bootstrap.parse_registration(data)
    except RemoteProtocolError:
        pass
    else:
        fresh = bootstrap.Registry()
        assert fresh.register(reg) == "created"
        assert fresh.register(reg) == "unchanged"
        info = fresh.lookup(reg.dp_rank, reg.tp_rank)
        assert info is not None and info.endpoint == reg.endpoint
        try:
            registry.register(reg)
        except RemoteProtocolError:
            pass
    for parse in (bootstrap.parse_parallel_info, bootstrap.parse_rank_info):
        try:
            parse(data)
        except RemoteProtocolError:
            pass
    try:
        bootstrap.parse_rank_path(data.decode("latin-1"))
    except RemoteProtocolError:
        pass


def _refused(call: Callable[[], object]) -> bootstrap.RequestAuthError | None:
    """None if ``call`` verified; the error if it was refused (any other exception breaks the invariant)."""
    try:
        call()
    except bootstrap.RequestAuthError as e:
        assert str(e).startswith("authentication failed: ") and e.kind in ("missing", "malformed", "signature", "window", "replay")
        return e
    return None


def check_auth(data: bytes) -> None:
    # 1. arbitrary method, path, body and header: refused, unless the header is a signature over exactly these bytes
    method, path, body, header, *_ = [*data.split(b"\x00", 4), b"", b"", b"", b""]
    m, pth, hdr = method.decode("latin-1"), path.decode("latin-1"), header.decode("latin-1")
    nonces = bootstrap.NonceCache(capacity=4)
    nonce: list[str] = []
    error = _refused(lambda: nonce.append(bootstrap.verify_request(KEY, m, pth, body, hdr, NOW, nonces, window=WINDOW)))
    if error is None:
        t = int(hdr.split("t=", 1)[1].split(",", 1)[0])
        assert hdr == bootstrap.sign_request(KEY, m, pth, body, now=t / 1000, nonce=nonce[0])
        assert len(nonces) == 1
    else:
        assert len(nonces) == 0  # a refused request never enters the cache
    assert _refused(lambda: bootstrap.verify_request(KEY, m, pth, body, None, NOW, nonces)).kind == "missing"  # type: ignore[union-attr]
    # the client's check of an answer's signature: a bool for any header values
    assert request_signing.response_signed(KEY, "0" * 32, 200, body, [hdr]) in (True, False)
    assert not request_signing.response_signed(KEY, "0" * 32, 200, body, [hdr, hdr])

    # 2. a request signed over input-derived parts verifies once, then is a replay ...
    digest = hashlib.sha256(data).digest()
    good_nonce, skew = digest[:16].hex(), (int.from_bytes(digest[16:20], "little") % 120_001 - 60_000) / 1000
    parts = [m, pth, body]
    signed = bootstrap.sign_request(KEY, m, pth, body, now=NOW + skew, nonce=good_nonce)
    nonces = bootstrap.NonceCache()
    first = _refused(lambda: bootstrap.verify_request(KEY, *parts, signed, NOW, nonces, window=WINDOW))  # type: ignore[arg-type]
    if abs(skew) > WINDOW:
        assert first is not None and first.kind == "window" and len(nonces) == 0
    else:
        assert first is None and good_nonce in nonces
        again = _refused(lambda: bootstrap.verify_request(KEY, *parts, signed, NOW, nonces, window=WINDOW))  # type: ignore[arg-type]
        assert again is not None and again.kind == "replay"
    # ... and fails once one part is swapped for other input bytes (a fresh cache, so only the swap can refuse it)
    which = digest[20] % 4
    other = data[len(data) // 2 :]
    swapped: list[object] = [m, pth, body, signed]
    swapped[which] = other if which == 2 else other.decode("latin-1")
    result = _refused(lambda: bootstrap.verify_request(KEY, *swapped, NOW, bootstrap.NonceCache(), window=WINDOW))  # type: ignore[arg-type]
    if swapped[which] == [m, pth, body, signed][which]:
        assert (result is None) == (abs(skew) <= WINDOW)
    else:
        assert result is not None and result.kind in ("signature", "malformed", "missing"), result
    # another key never verifies it
    wrong = _refused(lambda: bootstrap.verify_request(KEY[::-1], *parts, signed, NOW, bootstrap.NonceCache()))  # type: ignore[arg-type]
    assert wrong is not None and wrong.kind == "signature"


def test_one_input(data: bytes) -> None:
    feed_whole_and_split(check, data)
    feed_whole_and_split(check_auth, data)


if __name__ == "__main__":
    main("bootstrap", test_one_input, SEEDS)
