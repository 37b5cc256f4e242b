"""Invariant: each bootstrap parser returns a value or raises RemoteProtocolError, nothing else.

Covers the server's door (parse_registration, parse_rank_path, Registry.register)
and the client's (parse_parallel_info, parse_rank_info). A parsed registration
must register idempotently and be found again by lookup. Each input is fed
whole and split in two. Run: python fuzz/fuzz_bootstrap.py -max_total_time=20
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _harness import feed_whole_and_split, instrumented, main  # noqa: E402

with instrumented():
    from pdcore import bootstrap
    from pdcore.errors import RemoteProtocolError

SEEDS = [
    b'{"session_id":"p-0","epoch":1,"endpoint":"tcp://127.0.0.1:7000","tp_size":2,"dp_size":1,'
    b'"tp_rank":1,"dp_rank":0,"layout":{"page_size":16,"fields":[{"shape":[8,128],"x":1.5}],"n":null},'
    b'"transport":"0123456789abcdef0123456789abcdef"}',
    b'{"session_id":"p-1","epoch":0,"endpoint":"tcp://[::1]:1","tp_size":1,"dp_size":2,'
    b'"tp_rank":0,"dp_rank":1,"layout":{},"transport":"0123456789abcdef0123456789abcdef"}',
    b'{"tp_size":2,"dp_size":1,"layout":{"a":[1,2]},"registered":1,"complete":false}',
    b'{"dp_rank":0,"tp_rank":1,"endpoint":"tcp://h:5","session_id":"s","epoch":0,"transport":"0123456789abcdef0123456789abcdef"}',
    b"/v1/ranks/0/1",
    b"/v1/ranks/1023/0",
]

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


def test_one_input(data: bytes) -> None:
    feed_whole_and_split(check, data)


if __name__ == "__main__":
    main("bootstrap", test_one_input, SEEDS)
