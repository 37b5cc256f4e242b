"""Invariant: the tcp sink's loop (``_fast.SinkConn.serve``, compiled: it parses what the network sends,
without the GIL) lands no byte outside what its table allows, whatever the stream, and ends.

One buffer holds, between guard bytes, region A (no grant needed) and region B (needs a grant); grant
5 gives this connection's source the middle quarter of B, grant 6 gives all of B to another source.
Each input is the byte stream after the handshake: a helper thread sends it and closes its side,
reading the acks; ``serve()`` runs until the connection ends, a refused frame's ack worded and
served on as the transport does, and a landed frame's note checked (it came through grant 5, the
only grant this source may land through, and is at most ``MAX_NOTE`` bytes) and served on. Then every
byte outside A and grant 5's range must still be zero, and the loop must have ended (it reads to the end of the stream, or stops at a frame that breaks the
wire). Seeds are valid frames at this process's addresses, so mutations reach the checks. The loop
is compiled, which atheris does not instrument: guided by no coverage, it would shrink the corpus to
one byte; the harness's mutation loop over the seeds runs instead.
Run: python fuzz/fuzz_tcp_sink.py -max_total_time=20
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402

import _harness  # noqa: E402
from _harness import main  # noqa: E402

from transport import tcp  # noqa: E402

_harness.atheris = None  # the mutation loop (see above)

FAST = tcp._fast
ME, OTHER = b"S" * 16, b"T" * 16
GUARD, SIZE = 256, 4096
MEM = np.zeros(GUARD + SIZE + GUARD + SIZE + GUARD, np.uint8)
BASE = int(MEM.ctypes.data)
A, B = BASE + GUARD, BASE + 2 * GUARD + SIZE
GRANTED = (B + SIZE // 4, SIZE // 4)
ALLOWED = np.zeros(len(MEM), bool)
ALLOWED[A - BASE : A - BASE + SIZE] = True
ALLOWED[GRANTED[0] - BASE : GRANTED[0] - BASE + GRANTED[1]] = True

SINK = FAST.Sink()
SINK.set_regions(np.array([A, B], np.uint64), np.array([SIZE, SIZE], np.uint64), np.array([0, 1], np.uint8),
                 np.array([1, 2], np.uint64), [memoryview(MEM)[GUARD : GUARD + SIZE], memoryview(MEM)[2 * GUARD + SIZE : 2 * GUARD + 2 * SIZE]])
SINK.add_grant(5, ME, np.array([GRANTED[0]], np.uint64), np.array([GRANTED[1]], np.uint64))
SINK.add_grant(6, OTHER, np.array([B], np.uint64), np.array([SIZE], np.uint64))


def _frame(seq: int, writes: list[tuple[int, int]], grant: int = 0, note: bytes = b"") -> bytes:
    head = tcp._FRAME.pack(seq, len(writes), len(note), grant) + b"".join(struct.pack("<QQ", a, n) for a, n in writes)
    return head + note + b"".join(bytes([seq & 0xFF or 1]) * n for _, n in writes)


SEEDS = [
    _frame(1, [(A, 16)]),
    _frame(2, [(A + 100, 8), (A + SIZE - 8, 8)]) + _frame(3, []) + _frame(4, [(A, 1)]),
    _frame(5, [(GRANTED[0], 64)], grant=5),
    _frame(6, [(GRANTED[0] + GRANTED[1] - 4, 8)], grant=5),  # one past the grant: refused
    _frame(7, [(B, 8)], grant=6),  # another source's grant: refused
    _frame(8, [(B, 8)]),  # a guarded region without a grant: refused
    _frame(9, [(A + SIZE - 4, 8)]) + _frame(10, [(A, 4)]),  # past the region, then a good one
    _frame(11, [(A, 8)] * 3, grant=0) + _frame(12, [(GRANTED[0], 8)], grant=5),
    _frame(13, [(GRANTED[0], 32), (GRANTED[0] + 64, 8)], grant=5, note=b"landed") + _frame(14, [(A, 4)]),
    _frame(15, [(B, 8)], grant=6, note=b"n" * 40) + _frame(16, [(GRANTED[0], 8)], grant=5, note=b"x"),  # refused, then one
]


def test_one_input(data: bytes) -> None:
    MEM[:] = 0
    a, b = socket.socketpair()
    tcp._kernel_timeouts(b, 0.05)

    def peer() -> None:
        try:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
            while a.recv(65536):
                pass
        except OSError:
            pass

    helper = threading.Thread(target=peer, daemon=True)
    helper.start()
    conn = SINK.connection(b, b, ME, 64, 0.2)
    try:
        for _ in range(len(data) + 2):  # at most one refusal or note per byte: it must end before
            result = conn.serve()
            if result[0] == FAST.SERVE_NOTED:
                _, grant, note = result
                assert grant == 5 and 0 < len(note) <= FAST.MAX_NOTE, result
                continue
            if result[0] != FAST.SERVE_REFUSED:
                assert result[0] in (FAST.SERVE_CLOSED, FAST.SERVE_BROKEN, FAST.SERVE_STALLED), result
                break
            _, seq, code, index, count, _addr, _length, _grant, total = result
            assert code in (FAST.LAND_OUTSIDE_REGIONS, FAST.LAND_NEEDS_GRANT, FAST.LAND_GRANT_NOT_LIVE,
                            FAST.LAND_GRANT_OTHER_SOURCE, FAST.LAND_OUTSIDE_GRANT), result
            assert 0 <= index < count <= 64, result
            conn.refuse(seq, 13, b"refused", total)
        else:
            raise AssertionError("serve() did not end")
    finally:
        conn.close()
        b.close()
        helper.join(10)
        a.close()
    outside = MEM[~ALLOWED]
    assert not outside.any(), f"{int(np.count_nonzero(outside))} bytes landed outside what the table allows"


if __name__ == "__main__":
    main("tcp_sink", test_one_input, SEEDS)
