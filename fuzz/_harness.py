"""Shared runner for the fuzz targets: atheris (coverage-guided) when installed, else a mutation loop.

atheris instruments the pure-Python decoders (pdcore.control.wire, pdcore.control.bootstrap);
msgspec's C core is not instrumented, so coverage comes from our validation
code around it. The fallback loop (no atheris) mutates the seeds at random; it
accepts the same ``-max_total_time=N``, ``-runs=N``, ``-seed=N`` and
``-artifact_prefix=P`` flags, so ``fuzz/run.sh`` works either way
(``PDCORE_FUZZ_NO_ATHERIS=1`` forces the loop).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

try:
    if os.environ.get("PDCORE_FUZZ_NO_ATHERIS") == "1":
        raise ImportError("atheris disabled by PDCORE_FUZZ_NO_ATHERIS=1")
    import atheris
except ImportError:  # the fallback loop below takes over
    atheris = None


@contextlib.contextmanager
def instrumented() -> Iterator[None]:
    """Import the code under test inside this block so atheris can trace it."""
    if atheris is None:
        yield
    else:
        with atheris.instrument_imports(include=["pdcore"]):
            yield


def feed_whole_and_split(check: Callable[[bytes], None], data: bytes) -> None:
    """The invariant must hold for the input whole and for both halves of a split."""
    check(data)
    if len(data) > 1:
        cut = 1 + data[-1] % (len(data) - 1)
        check(data[:cut])
        check(data[cut:])


def _flags(argv: Sequence[str]) -> dict[str, str]:
    return dict(a[1:].split("=", 1) for a in argv[1:] if a.startswith("-") and "=" in a)


def _mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[min(pos, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            buf[min(pos, len(buf) - 1)] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif op == 2:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and buf:
            del buf[pos : pos + rng.randint(1, 16)]
        elif op == 4 and buf:
            start = rng.randrange(len(buf))
            buf[pos:pos] = buf[start : start + rng.randint(1, 32)]
        elif op == 5:
            other = rng.choice(pool)
            buf[pos:] = other[rng.randrange(len(other) + 1) :]
        elif op == 6:
            del buf[pos:]
    return bytes(buf[:65536])


def _fallback(test_one_input: Callable[[bytes], None], seeds: Sequence[bytes], argv: Sequence[str]) -> None:
    flags = _flags(argv)
    max_time = float(flags.get("max_total_time", "10"))
    runs = int(flags.get("runs", "-1"))
    rng = random.Random(int(flags.get("seed", str(time.time_ns()))))
    pool = list(seeds) or [b""]
    end = time.monotonic() + max_time
    n = 0
    while time.monotonic() < end and n != runs:
        data = _mutate(rng, rng.choice(pool), pool)
        try:
            test_one_input(data)
        except BaseException:
            path = Path(f"{flags.get('artifact_prefix', '')}crash-{hashlib.sha1(data).hexdigest()}")
            path.write_bytes(data)
            traceback.print_exc()
            print(f"invariant broken by input {data[:64]!r}... saved to {path}", file=sys.stderr)
            sys.exit(1)
        n += 1
        if n % 64 == 0 and len(pool) < 4096:
            pool.append(data)
    print(f"Done {n} runs in {max_time:.0f} second(s) (random mutation loop; atheris not installed)")


def main(name: str, test_one_input: Callable[[bytes], None], seeds: Sequence[bytes]) -> None:
    for seed in seeds:  # the seeds themselves must satisfy the invariant
        test_one_input(seed)
    if atheris is None:
        _fallback(test_one_input, seeds, sys.argv)
        return
    argv = list(sys.argv)
    if not any(not a.startswith("-") for a in argv[1:]):  # no corpus dir given: a seeded one in TMPDIR
        corpus = Path(tempfile.gettempdir()) / f"pdcore-fuzz-{name}"
        corpus.mkdir(exist_ok=True)
        for seed in seeds:
            (corpus / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
        argv.append(str(corpus))
    for flag, value in (("-timeout", "10"), ("-rss_limit_mb", "2048"), ("-max_len", "65536")):
        if not any(a.startswith(flag + "=") for a in argv):
            argv.insert(1, f"{flag}={value}")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
