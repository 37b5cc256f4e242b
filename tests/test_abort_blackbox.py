"""A cancelled request costs only itself, black box: decode aborts one of 16 requests (4 MiB) while
they are in flight, and the other 15 land whole.

Real processes, the public API only (``tests/_abort_children.py`` holds the ranks): the test
process runs the bootstrap server and spawns one prefill and one decode rank (tp 1) sharing one
connection. Prefill sends every request as soon as it is bootstrapped; decode aborts the last one
the moment bytes of another one show in its memory (so it and most of the others are still on the
wire: the test checks that its last page was still empty), and
reuses the aborted request's pages at its ``Failed`` (a canary it keeps checking). Judged from
decode's memory and both sides' events: the victim fails at decode (prefill may have finished
its writes first) and nothing lands in its pages after decode handed them back; every other request ends ``RemotePrefillDone`` /
``Succeeded`` with its bytes in place.

Over verbs this is what memory windows buy: the revoke invalidates the victim's windows only.
The fallback without them (``memory_windows=False``) cuts the queue pair and fails every request
in flight with it; this test fails there.
"""

from __future__ import annotations

import pytest

import _abort_children as kids
from _ranks import SPAWN, Ranks, exits, transport_options
from pdcore.control.bootstrap import BootstrapServer

pytestmark = pytest.mark.slow

WINDOW = 2.0  # seconds decode keeps checking the victim's reused pages
LIFETIME = 90.0
START = 60.0  # seconds for a child to come up (spawned interpreters under emulation are slow)
# Pages of 64 KiB per request: 4 MiB over tcp; 1 MiB over soft-RoCE under emulation (~35 MB/s), where
# the victim's writes queue behind the other rooms' on the one queue pair, and decode's revoke waits
# 1 s (REVOKE_WAIT) for the source to say nothing of it is in flight before it cuts the queue pair.
PER = {"tcp": 64, "verbs": 16}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport_name", ["tcp", pytest.param("verbs", marks=pytest.mark.rdma)])
def test_aborting_one_of_16_requests_in_flight_fails_only_that_one(transport_name: str) -> None:
    options = transport_options(transport_name)
    per = PER[transport_name]
    server = BootstrapServer()
    port = server.start()
    ranks = Ranks()
    try:
        ranks.start("decode", kids.run_decode, port, transport_name, options, per, WINDOW, LIFETIME)
        ranks.start("prefill", kids.run_prefill, port, transport_name, options, per, LIFETIME)
        for role in ("decode", "prefill"):
            ranks.wait_for(role, "ready", START, f"the {role} rank to start")
        decode = ranks.wait_for("decode", "done", LIFETIME + 10, "decode's report")
        prefill = ranks.wait_for("prefill", "done", LIFETIME + 10, "prefill's report")
        exits(ranks, "decode")
        exits(ranks, "prefill")
    finally:
        ranks.cleanup()
        server.close()
    others = [f"r{i}" for i in range(kids.REQUESTS) if f"r{i}" != kids.VICTIM]
    assert decode["aborted_after"] and kids.VICTIM not in decode["aborted_after"], decode
    assert len(decode["aborted_after"]) < len(others), f"every other request had landed at the abort: {decode}"
    assert decode["victim_untouched"], f"the victim had landed at the abort: it was not in flight: {decode}"
    assert decode["ends"].get(kids.VICTIM) == "Failed", decode
    assert prefill["ends"].get(kids.VICTIM) in ("Failed", "Succeeded"), prefill  # its writes may all have landed first
    assert decode["overwritten"] == 0, f"{decode['overwritten']} bytes landed in the aborted request's reused pages"
    lost = {rid: decode["ends"].get(rid) for rid in others if decode["ends"].get(rid) != "RemotePrefillDone"}
    assert not lost, f"aborting {kids.VICTIM} cost other requests: {lost}"
    assert all(decode["intact"][rid] for rid in others), {rid: decode["intact"][rid] for rid in others}
    assert all(prefill["ends"].get(rid) == "Succeeded" for rid in others), prefill["ends"]
    assert not decode["in_flight"] and not prefill["in_flight"]
    assert not [p for p in SPAWN.active_children() if p in ranks.procs.values()]
