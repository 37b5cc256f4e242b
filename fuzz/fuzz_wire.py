"""Invariant: pdcore.control.wire.decode(frame) returns a Message or raises RemoteProtocolError, nothing else.

Also: a decoded message re-encodes, and decodes back to an equal message. Each
input is fed whole and split in two, both raw and behind a valid frame header
(so mutations reach the msgpack body). Run: python fuzz/fuzz_wire.py -max_total_time=20
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _harness import feed_whole_and_split, instrumented, main  # noqa: E402

with instrumented():
    from pdcore.control import wire
    from pdcore.core.errors import RemoteProtocolError

SEEDS = [
    wire.encode(m)
    for m in (
        wire.Register(
            session_id="decode-0", epoch=3, endpoint=b"qp\x00", layout={"page": 16, "f": [{"k": [8, 1.5]}, None, True]},
            regions=(wire.Region(addr=4096, length=1 << 20, key=7),), tp_size=2, tp_rank=1,
        ),
        wire.Announce(room=2**63, session_id="decode-0", epoch=3, page_ids=(0, 1, 70000), request_pool_index=5),
        wire.Status(room=1, state=5, rank=3, first_token=9, cached_tokens=2, first_token_logprob=-1.5,
                    spec_candidate_ids=(4, 5), reason="r"),
        wire.Status(room=1, state=0, rank=0),
        wire.Abort(room=12, reason="gone"),
        wire.AbortAck(room=12, rank=1),
        wire.Heartbeat(session_id="p", epoch=1, seq=99),
        wire.EmbedRegister(session_id="prefill-1", epoch=2, endpoint=b"tcp\x00", tp_size=4, tp_rank=1),
        wire.EmbedAsk(room=5, session_id="prefill-1", epoch=2, rank=1, ranks=4, sharded=True, rows=9, row_start=3,
                      row_count=2, hidden=8, dtype="torch.float16", deepstack_width=16, addr=4096,
                      deepstack_addr=8192, grant=3),
        wire.EmbedAsk(room=5, session_id="p", epoch=0, rank=3, ranks=4, sharded=True, rows=2, row_start=2,
                      row_count=0, hidden=1, dtype="torch.int8"),
        wire.EmbedStatus(room=5, ok=False, rank=0, reason="dtype"),
    )
]  # fmt: skip


def check(frame: bytes) -> None:
    try:
        msg = wire.decode(frame)
    except RemoteProtocolError as e:
        assert all(type(r) is int and 0 <= r < 2**64 for r in e.rooms), e.rooms
        return
    again = wire.encode(msg)  # a LocalProtocolError here would mean decode let a bad message through
    # compared as bytes: a status may carry a NaN logprob, which is never == itself
    assert wire.encode(wire.decode(again)) == again, (msg, again)


def test_one_input(data: bytes) -> None:
    feed_whole_and_split(check, data)
    feed_whole_and_split(check, wire.seal(data))  # past the checksum: the body decoder itself


if __name__ == "__main__":
    main("wire", test_one_input, SEEDS + [s[7:] for s in SEEDS])
