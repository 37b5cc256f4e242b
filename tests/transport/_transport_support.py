"""What the transport tests share (a plain module: tests/ is not a package).

``TRANSPORTS`` lists the transports the conformance suite runs on: ``"tcp"``
always, and ``"tcp+secret"`` (the same transport with the ``secret`` option:
every connection authenticated); the verbs transport appends ``"verbs"`` when
an RDMA device is present, with its options (device name, ...) in
``TRANSPORT_OPTIONS``. An entry is ``name`` or ``name+variant``: ``variant()``
splits it into the registry name and the constructor options.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import transport
from pdcore.deadline import Deadline

from pdcore.errors import TransportError
from transport.base import Transport

#: The deployment secret of the suite's authenticated runs (a test value, nothing else uses it).
TEST_SECRET = b"pdcore-tests: conformance secret"
TRANSPORTS: list[Any] = ["tcp", "tcp+secret"]
#: Per-transport constructor options the suite needs.
TRANSPORT_OPTIONS: dict[str, dict[str, Any]] = {"tcp": {}}
#: Options a ``+variant`` suffix adds.
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {"secret": {"secret": TEST_SECRET}}


def variant(entry: str) -> tuple[str, dict[str, Any]]:
    """``"tcp+secret"`` -> ``("tcp", {**TRANSPORT_OPTIONS["tcp"], "secret": TEST_SECRET})``."""
    name, _, extra = entry.partition("+")
    return name, {**TRANSPORT_OPTIONS.get(name, {}), **(VARIANT_OPTIONS[extra] if extra else {})}

MakeTransport = Callable[..., Transport]


def transport_maker(name: str, defaults: dict[str, Any]) -> Iterator[MakeTransport]:
    """Body of a fixture: build ``name`` transports (``defaults`` under each call's options), close
    them all afterwards, and fail if any thread outlives them."""
    before = set(threading.enumerate())
    made: list[Transport] = []

    def make(**options: Any) -> Transport:
        t = transport.create(name, **{**defaults, **options})
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(deadline=Deadline.after(5.0))
    leaked = [th.name for th in set(threading.enumerate()) - before if th.is_alive()]
    assert not leaked, f"threads left behind after close(): {leaked}"


class Collector:
    """Records completions from callbacks; ``wait(n)`` blocks until n arrived or ``seconds`` pass."""

    def __init__(self, seconds: float = 10.0) -> None:
        self.done: list[tuple[int, TransportError | None]] = []
        self.seconds = seconds
        self._cond = threading.Condition()

    def __call__(self, batch_id: int, error: TransportError | None) -> None:
        with self._cond:
            self.done.append((batch_id, error))
            self._cond.notify_all()

    def wait(self, n: int, seconds: float | None = None) -> list[tuple[int, TransportError | None]]:
        seconds = self.seconds if seconds is None else seconds
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.done) >= n, timeout=seconds)
            assert ok, f"only {len(self.done)} of {n} completions within {seconds} s"
            return list(self.done)
