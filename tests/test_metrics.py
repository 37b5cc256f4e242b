"""Prometheus metrics of both peers and the bootstrap server, scraped over HTTP while requests move.

The scrape must add up to what the run itself counted: requests by outcome,
bytes posted, one latency observation per ended request. Real sockets; the
registry is the test's own (nothing global).
"""

from __future__ import annotations

import socket
import threading
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdcore import StartError
from pdcore.control.channel import MAX_PENDING
from pdcore.core.deadline import Deadline
from transport import tcp
from transport.base import decode_endpoint

from pd_pair import LAYERS, PAGE, PAGES_PER_REQUEST, Pair


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_scrape_adds_up_to_the_run() -> None:
    registry = CollectorRegistry()
    pair = Pair(metrics=registry, server={"metrics": registry})
    try:
        first = [f"a{i}" for i in range(3)]
        pair.register_each(first, 10)
        pair.drive(first)
        mid = scrape(pair.port)  # during the run: a second batch follows
        second = [f"b{i}" for i in range(4)]
        pair.register_each(second, 20)
        pair.register("stalled", room=99, prefill=False)  # never served: decode aborts it, a failure with its cause
        pair.decode.abort_room("stalled", 99)
        pair.drive(second)
        pair.pump(lambda: pair.ended("decode", "stalled") is not None, "the aborted request to end")
        end = scrape(pair.port)
    finally:
        pair.close()
    n1, n = len(first), len(first) + len(second)
    ok = (("cause", ""), ("outcome", "ok"))
    assert mid[("pdcore_decode_requests_total", ok)] == n1
    assert end[("pdcore_decode_requests_total", ok)] == n
    assert end[("pdcore_prefill_requests_total", ok)] == n
    assert end[("pdcore_prefill_bytes_posted_total", ())] == n * PAGES_PER_REQUEST * PAGE * LAYERS
    assert end[("pdcore_prefill_writes_posted_total", ())] >= n * LAYERS  # at least one write per buffer
    failed = {labels: v for (name, labels), v in end.items() if name == "pdcore_decode_requests_total" and labels != ok}
    assert sum(failed.values()) == 1 and dict(next(iter(failed)))["cause"] == "aborted"
    assert end[("pdcore_decode_transfer_seconds_count", ())] == n + 1
    assert end[("pdcore_prefill_transfer_seconds_count", ())] == n
    assert end[("pdcore_decode_agreement_round_seconds_count", ())] >= 1
    assert end[("pdcore_decode_protocol_errors_total", ())] == 0
    for role in ("prefill", "decode"):  # nothing flooded this run: present, and zero
        for name in ("evicted_handshakes", "refused_connections", "accept_failures"):
            assert end[(f"pdcore_{role}_{name}_total", ())] == 0, name
    assert end[("pdcore_decode_in_flight", ())] == 0
    assert end[("pdcore_prefill_connected_peers", ())] == 1
    assert end[("pdcore_decode_revoke_method", (("method", "sink check"),))] == 1  # tcp
    assert end[("pdcore_decode_memory_windows", ())] == 0
    assert end[("pdcore_decode_device_memory_path", (("path", "host"),))] == 1  # host KV: nothing staged
    assert end[("pdcore_bootstrap_ranks", ())] == 1
    assert end[("pdcore_bootstrap_busy_total", ())] == 0


def test_closed_peers_leave_the_registry_and_a_wrong_registry_is_refused() -> None:
    registry = CollectorRegistry()
    pair = Pair(metrics=registry)
    assert registry.get_sample_value("pdcore_decode_in_flight") == 0
    pair.close()
    assert registry.get_sample_value("pdcore_decode_in_flight") is None  # unregistered on close
    with pytest.raises(StartError, match="CollectorRegistry"):
        Pair(decode={"metrics": object()})


def test_cut_handshakes_show_in_the_metrics() -> None:
    """Idle connections past the handshake places of the decode peer's data sink and of its control
    channel: each cut is in ``evicted_handshakes`` (control and data together)."""
    registry = CollectorRegistry()
    pair = Pair(metrics=registry, server={"metrics": registry})
    idle: list[socket.socket] = []
    try:
        sink = pair.decode._transport  # its data endpoint: the peer does not publish it
        data = decode_endpoint(sink.endpoint()).address.decode().rpartition(":")
        control = pair.decode.control_endpoint.removeprefix("tcp://").rpartition(":")
        for (host, _, port), n in ((data, tcp._MAX_HELLOS + 3), (control, MAX_PENDING + 4)):
            idle += [socket.create_connection((host, int(port)), timeout=5) for _ in range(n)]
        deadline = Deadline.after(10)
        while sink.evicted_handshakes < 3 or pair.decode.diagnostics()["channel"]["pending_evicted"] < 4:
            assert not deadline.expired(), (sink.evicted_handshakes, pair.decode.diagnostics()["channel"])
            threading.Event().wait(0.01)  # polling counters against a deadline
        got = scrape(pair.port)
        assert got[("pdcore_decode_evicted_handshakes_total", ())] >= 7
        assert got[("pdcore_decode_refused_connections_total", ())] == 0
    finally:
        for s in idle:
            s.close()
        pair.close()
