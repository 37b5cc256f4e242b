"""Prometheus metrics for the peers and the bootstrap server, read at scrape time.

Nothing global: the caller passes a ``prometheus_client.CollectorRegistry``
(``TransferConfig.metrics``, ``BootstrapServer(metrics=...)``); the library adds
one collector per peer or server to it and removes it on close. The hot paths
bump plain integers and a few bucket counts (``Counts``); only a scrape calls
into ``prometheus_client``, so a peer without a registry pays nothing more.

Names carry the role (``pdcore_prefill_…``, ``pdcore_decode_…``,
``pdcore_bootstrap_…``), so one registry can hold a process's prefill peer,
decode peer and bootstrap server at once.

Why ``prometheus_client``: its text format and registry are what serving
stacks scrape; it is the optional extra ``metrics`` (``pip install
pdcore[metrics]``), imported only when a registry is given.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, Final

from ..core.errors import StartError
from ..core.events import FAILED_ELSEWHERE, Event, Failed, RemotePrefillDone, Succeeded

__all__ = ["Counts", "Buckets", "failure_cause", "PeerCollector", "BootstrapCollector", "check_registry"]

LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
ROUND_BUCKETS: Final = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)

# (cause, words that name it in a failure reason); the first match wins, so specific before general
_CAUSES: Final = (
    ("elsewhere", (FAILED_ELSEWHERE,)),
    ("authentication", ("authentication failed",)),
    ("timeout", ("timeout", "timed out")),
    ("aborted", ("abort",)),
    ("peer_lost", ("peer lost", "is dead", "restarted", "closed", "replaced")),
    ("capacity", ("quota", "full", "no room", "capacity")),
    ("protocol", ("protocol", "bad ", "malformed", "frame")),
    ("transfer", ("transfer failed", "posting", "transport", "grant", "connect")),
)


def failure_cause(reason: str) -> str:
    """A small closed set of causes for a free-text failure reason (a label must not be unbounded)."""
    text = reason.lower()
    for cause, words in _CAUSES:
        if any(word in text for word in words):
            return cause
    return "other"


class Buckets:
    """A histogram's bucket counts and sum: ``observe`` is a bisect and two additions."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, name: str, documentation: str) -> Any:
        from prometheus_client.core import HistogramMetricFamily

        cumulative, running = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            running += n
            cumulative.append((bound, running))
        return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=self.total)


class Counts:
    """What a peer counts for its metrics: written by the scheduler thread (poll, register) and the driver."""

    def __init__(self) -> None:
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (outcome, cause) -> requests
        self.latency = Buckets(LATENCY_BUCKETS)
        self.rounds = Buckets(ROUND_BUCKETS)
        self.bytes_posted = 0
        self.writes_posted = 0
        self._born: dict[str, float] = {}

    def born(self, rid: str) -> None:
        self._born[rid] = time.monotonic()

    def ended(self, events: Iterable[Event], terminal: tuple[type[Succeeded | RemotePrefillDone | Failed], ...]) -> None:
        """Count the requests ``events`` end (``terminal``: the role's success events, and Failed)."""
        now = time.monotonic()
        for event in events:
            if not isinstance(event, terminal):
                continue
            if isinstance(event, Failed):
                self.outcomes["failed", failure_cause(event.reason)] += 1
            else:
                self.outcomes["ok", ""] += 1
            start = self._born.pop(event.rid, None)
            if start is not None:
                self.latency.observe(now - start)


def check_registry(registry: object, where: str) -> None:
    """``StartError`` unless ``registry`` is a prometheus_client registry (and the extra is installed)."""
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise StartError(f"{where}: metrics need prometheus_client: pip install 'pdcore[metrics]'") from None
    if not isinstance(registry, CollectorRegistry):
        raise StartError(f"{where}: expected a prometheus_client.CollectorRegistry, got {type(registry).__name__}")


class PeerCollector:
    """The metrics of one peer; ``collect`` reads its counters (prometheus_client calls it per scrape)."""

    def __init__(self, peer: Any) -> None:
        self._peer = peer
        self._prefix = f"pdcore_{peer.ROLE}"

    def describe(self) -> list[Any]:
        return []  # names are checked against the registry at the first scrape, not at register

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        peer, p = self._peer, self._prefix
        counts: Counts = peer.counts
        requests = CounterMetricFamily(f"{p}_requests", "Requests ended, by outcome and failure cause",
                                       labels=["outcome", "cause"])
        for (outcome, cause), n in sorted(counts.outcomes.items()):
            requests.add_metric([outcome, cause], n)
        yield requests
        yield counts.latency.family(f"{p}_transfer_seconds", "From register to the request's last event")
        yield counts.rounds.family(f"{p}_agreement_round_seconds", "One poll's agreement round")
        if peer.ROLE == "prefill":
            yield CounterMetricFamily(f"{p}_bytes_posted", "Bytes of the RDMA/TCP writes posted", value=counts.bytes_posted)
            yield CounterMetricFamily(f"{p}_writes_posted", "Writes posted (after coalescing)", value=counts.writes_posted)
        d = peer.diagnostics()
        channel, transport, queues_now = d.get("channel", {}), d.get("transport", {}), d["queues"]
        yield CounterMetricFamily(f"{p}_protocol_errors", "Malformed or unexpected control frames",
                                  value=channel.get("protocol_errors", 0))
        yield CounterMetricFamily(f"{p}_auth_failures", "Handshakes that failed authentication (control and data)",
                                  value=channel.get("auth_failures", 0) + transport.get("auth_failures", 0))
        yield CounterMetricFamily(f"{p}_evicted_handshakes",
                                  "Unfinished handshakes cut to make room for newer ones (control and data)",
                                  value=channel.get("pending_evicted", 0) + transport.get("evicted_handshakes", 0))
        yield CounterMetricFamily(f"{p}_refused_connections", "Data connections refused: at the sink's cap, or too "
                                  "many handshakes", value=transport.get("refused_connections", 0))
        yield CounterMetricFamily(f"{p}_accept_failures", "Data connections not accepted for want of file "
                                  "descriptors or memory", value=transport.get("accept_failures", 0))
        yield CounterMetricFamily(f"{p}_work_errors", "Work items that raised (a bug: see the log)",
                                  value=d["stats"]["work_errors"])
        queues = GaugeMetricFamily(f"{p}_queue_depth", "Items waiting in each bounded queue", labels=["queue"])
        queues.add_metric(["work"], queues_now["inputs"])
        queues.add_metric(["io"], queues_now["io"])
        queues.add_metric(["control_out"], queues_now["control_out"])
        queues.add_metric(["parked_posts"], queues_now["parked_posts"])
        yield queues
        yield GaugeMetricFamily(f"{p}_in_flight", "Requests tracked", value=d["table"]["tracked"])
        engine = d["engines"].get(peer.ROLE, {})
        yield GaugeMetricFamily(f"{p}_connected_peers", "Peers with a data connection",
                                value=engine.get("connected_peers", 0))
        revoke = GaugeMetricFamily(f"{p}_revoke_method", "How the data plane enforces a revoke (1 for the method in use)",
                                   labels=["method"])
        revoke.add_metric([str(transport.get("revoke_method") or "unknown")], 1)
        yield revoke
        yield GaugeMetricFamily(f"{p}_memory_windows", "Memory windows bound for sources now (verbs)",
                                value=transport.get("windows_live", 0))
        device = GaugeMetricFamily(f"{p}_device_memory_path", "How device memory reaches the transport (1 for the "
                                   "path in use): host (none registered), staging (pinned host mirrors), dma-buf",
                                   labels=["path"])
        device.add_metric([str(transport.get("device_path") or "host")], 1)
        yield device


class BootstrapCollector:
    """The bootstrap server's counters and registered ranks."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._server.stats
        for name, value in vars(stats).items():
            yield CounterMetricFamily(f"pdcore_bootstrap_{name}", f"Bootstrap server: {name.replace('_', ' ')}",
                                      value=value)
        yield GaugeMetricFamily("pdcore_bootstrap_ranks", "Ranks registered", value=self._server.registered_ranks)
