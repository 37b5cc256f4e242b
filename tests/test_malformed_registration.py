"""A malformed registration costs only the requests that need it, from outside: real bootstrap servers over
HTTP, real peers over TCP, the public API.

The defect it guards (#37, found from outside on 721e74c): a rank registration whose layout carried a numeric
``page_bytes`` was accepted by the bootstrap server; a decode rank looking that deployment up then raised on
an I/O thread, was never answered, and every later request to that server failed at its bootstrap timeout,
even after a correct registration. Now the server refuses such a registration (400, naming the field), a
decode rank's request toward a deployment that has no complete registration fails at its own timeout
without touching any other, and once the deployment registers correctly the next request lands.
"""

from __future__ import annotations

import http.client
import json
from typing import Any

import numpy as np

from pd_pair import PAGE, PAGES, Pair
from pdcore import BootstrapInfo, Bootstrapped, Failed, PrefillConfig, PrefillPeer, RemotePrefillDone, Succeeded
from pdcore.control.bootstrap import BootstrapServer
from pdcore.core.deadline import Deadline

BOOTSTRAP_TIMEOUT = 3.0


def _put(port: int, body: dict[str, Any]) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
    try:
        conn.request("PUT", "/v1/ranks", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _until(pair: Pair, peers: dict[str, Any], done: Any, what: str, timeout: float = 15.0) -> dict[str, list[Any]]:
    """Poll ``peers`` (name -> peer; the pair's decode peer among them) and the pair's prefill peer until
    ``done(events)``; every event of ``peers`` by name."""
    events: dict[str, list[Any]] = {name: [] for name in peers}
    deadline = Deadline.after(timeout)
    while not done(events):
        assert not deadline.expired(), f"timed out waiting for {what}: {events}"
        for name, peer in peers.items():
            events[name] += peer.poll(None)
        pair.poll(("prefill",))
    return events


def test_a_malformed_registration_fails_only_the_requests_that_need_it_and_wedges_nothing() -> None:
    pair = Pair(bootstrap_timeout=BOOTSTRAP_TIMEOUT)
    other = BootstrapServer()
    other_port = other.start()
    late: PrefillPeer | None = None
    try:
        status, body = _put(other_port, {
            "session_id": "prefill-bad", "epoch": 1, "endpoint": "tcp://127.0.0.1:1", "tp_size": 1, "dp_size": 1,
            "tp_rank": 0, "dp_rank": 0, "layout": {"page_bytes": PAGE, "num_pages": PAGES}, "transport": "ab" * 16,
        })
        assert status == 400 and "page_bytes" in body, (status, body)

        # a request toward that deployment fails at its own timeout; one toward the healthy pair lands meanwhile
        pair.decode.register("needs-it", BootstrapInfo("127.0.0.1", other_port, 501))
        pair.register("bystander", 502)
        pair.drive(["bystander"])
        assert pair.ended("decode", "bystander") == "RemotePrefillDone" and pair.landed_intact("bystander")
        events = _until(pair, {"decode": pair.decode},
                        lambda ev: any(type(e) is Failed and e.rid == "needs-it" for e in ev["decode"]),
                        "the request toward the unregistered deployment to fail", timeout=BOOTSTRAP_TIMEOUT + 10)
        assert not any(type(e) is Bootstrapped and e.rid == "needs-it" for e in events["decode"])

        # the deployment registers correctly: the next request toward it lands (nothing was wedged)
        cache = [np.zeros(PAGES * PAGE, np.uint8) for _ in range(2)]
        late, outbox = PrefillPeer.start(PrefillConfig(
            kv_buffers=cache, page_bytes=PAGE, num_pages=PAGES, bootstrap_host="127.0.0.1", bootstrap_port=other_port,
            heartbeat_interval=0.05, bootstrap_timeout=30.0, waiting_timeout=30.0))
        cache[0][:PAGE] = 7
        late.register("after", BootstrapInfo("127.0.0.1", other_port, 503))
        pair.decode.register("after", BootstrapInfo("127.0.0.1", other_port, 503))
        acted: set[str] = set()

        def done(ev: dict[str, list[Any]]) -> bool:
            for side, act in (("decode", lambda: pair.inbox.announce("after", [9], 0)),
                              ("late", lambda: outbox.send("after", [0], 11))):
                if side not in acted and any(type(e) is Bootstrapped and e.rid == "after" for e in ev[side]):
                    acted.add(side)
                    act()
            return any(type(e) is RemotePrefillDone and e.rid == "after" for e in ev["decode"]) and \
                any(type(e) is Succeeded and e.rid == "after" for e in ev["late"])

        events = _until(pair, {"decode": pair.decode, "late": late}, done, "the request after the registration to land")
        assert not [e for e in events["decode"] + events["late"] if type(e) is Failed], events
        assert (pair.d_cache[0][9 * PAGE : 10 * PAGE] == 7).all()
    finally:
        if late is not None:
            late.close()
        other.close()
        pair.close()
