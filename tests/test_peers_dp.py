"""DP routing: a decode rank sends each room to the prefill DP group ``room % dp_size``.

One prefill deployment of two DP groups (one rank each) behind one bootstrap
server, one decode rank; real sockets and threads in this process. Each
prefill group registers only the rooms the router sends it; every room must
land from the right group, byte for byte.
"""

from __future__ import annotations

import time

import numpy as np

from pdcore import BootstrapInfo, Bootstrapped, DecodeConfig, DecodePeer, PrefillConfig, PrefillPeer, RemotePrefillDone
from pdcore.control.bootstrap import BootstrapServer
from pdcore.core.deadline import Deadline

PAGE, PAGES, LAYERS = 4096, 32, 2


def test_rooms_go_to_the_prefill_dp_group_of_room_mod_dp_size() -> None:
    server = BootstrapServer()
    port = server.start()
    knobs = dict(page_bytes=PAGE, num_pages=PAGES, heartbeat_interval=0.05, dead_after=30.0)
    p_caches = [[np.full(PAGES * PAGE, 10 * (g + 1) + layer, np.uint8) for layer in range(LAYERS)] for g in range(2)]
    d_cache = [np.zeros(PAGES * PAGE, np.uint8) for _ in range(LAYERS)]
    peers: list = []
    try:
        prefill = []
        for g in range(2):
            peer, outbox = PrefillPeer.start(
                PrefillConfig(kv_buffers=p_caches[g], dp_size=2, dp_rank=g,
                              bootstrap_host="127.0.0.1", bootstrap_port=port, **knobs)
            )
            peers.append(peer)
            prefill.append((peer, outbox))
        decode, inbox = DecodePeer.start(DecodeConfig(kv_buffers=d_cache, **knobs))
        peers.append(decode)

        rooms = {f"r{i}": 1000 + i for i in range(8)}
        for rid, room in rooms.items():
            decode.register(rid, BootstrapInfo("127.0.0.1", port, room))
            prefill[room % 2][0].register(rid, BootstrapInfo("127.0.0.1", port, room))
        landed: dict[str, object] = {}
        seen: list[set[str]] = [set(), set()]
        deadline = Deadline.after(20)
        while len(landed) < len(rooms):
            assert not deadline.expired(), f"only {sorted(landed)} landed; prefill groups saw {seen}"
            for event in decode.poll():
                if isinstance(event, Bootstrapped):
                    i = int(event.rid[1:])
                    inbox.announce(event.rid, [i], request_pool_index=i)
                elif isinstance(event, RemotePrefillDone):
                    landed[event.rid] = event.remote
                else:
                    raise AssertionError(f"unexpected {event}")
            for g, (peer, outbox) in enumerate(prefill):
                for event in peer.poll():
                    seen[g].add(event.rid)
                    if isinstance(event, Bootstrapped):
                        i = int(event.rid[1:])
                        outbox.send(event.rid, [PAGES - 1 - i], first_token=g)
            time.sleep(0.001)
        for rid, room in rooms.items():
            group, i = room % 2, int(rid[1:])
            assert landed[rid].bootstrap_token == group  # type: ignore[attr-defined]
            assert seen[group] >= {rid} and rid not in seen[1 - group]
            for layer in range(LAYERS):
                page = d_cache[layer].reshape(PAGES, PAGE)[i]
                assert (page == 10 * (group + 1) + layer).all(), f"{rid}: layer {layer} came from the wrong group"
    finally:
        for peer in peers:
            peer.close()
        server.close()
