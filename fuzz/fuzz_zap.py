"""Invariant: pdcore.control.channel.zap_reply admits exactly the deployment's CURVE key, never raises.

The ZAP requests come from libzmq, but what they carry (the client's key, its
address) comes from whoever connected. Frames are the input split at b"|".
Run: python fuzz/fuzz_zap.py -max_total_time=20
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _harness import instrumented, main  # noqa: E402

with instrumented():
    from zmq.utils import z85

    from pdcore.control.channel import curve_keys, zap_reply

KEY = z85.decode(curve_keys(b"fuzz deployment secret!!")[0])
SEEDS = [
    b"|".join([b"1.0", b"1", b"pdcore", b"127.0.0.1", b"", b"CURVE", KEY]),
    b"|".join([b"1.0", b"2", b"pdcore", b"10.0.0.1", b"", b"NULL"]),
    b"|".join([b"1.0", b"3", b"pdcore", b"::1", b"id", b"CURVE", bytes(32)]),
]


def test_one_input(data: bytes) -> None:
    request = data.split(b"|")
    if len(request) == 7 and request[6] == b"KEY":
        request[6] = KEY  # let mutations reach the admitted path
    reply, refused = zap_reply(request, KEY)
    assert len(reply) == 6 and reply[0] == b"1.0" and all(isinstance(f, bytes) for f in reply)
    admitted = reply[2] == b"200"
    assert admitted == (refused is None)
    assert admitted == (len(request) == 7 and request[0] == b"1.0" and request[5] == b"CURVE" and request[6] == KEY)
    assert refused is None or len(refused) <= 64


if __name__ == "__main__":
    main("zap", test_one_input, SEEDS)
