"""Threads the kernel knows by name (``transport.threads``): what ``top -H``, ``perf`` and the
benchmarks' per-thread figures read from ``/proc/PID/task/TID/comm``.

Read from outside the thread, as a tool reads it: a TCP transport's own threads (its acceptor, a
connected peer's sender and ack reader, the sink's reader) carry their Python names less
``pdcore-``. A peer's driver is checked in ``tests/test_driver.py``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from transport.threads import OS_NAME_BYTES, named_thread, os_name

from _transport_support import MakeTransport, granted_link, transport_maker

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's thread names are read from /proc")


def kernel_name(t: threading.Thread) -> str:
    with open(f"/proc/self/task/{t.native_id}/comm") as f:
        return f.read().rstrip("\n")


def kernel_names(prefix: str) -> dict[str, str]:
    """Python name -> kernel name of this process's live threads whose Python name starts with ``prefix`` (one
    that ends meanwhile, say an earlier test's, is left out)."""
    out = {}
    for t in threading.enumerate():
        if t.name.startswith(prefix):
            try:
                out[t.name] = kernel_name(t)
            except OSError:
                pass
    return out


@pytest.fixture
def make_tcp() -> Iterator[MakeTransport]:
    yield from transport_maker("tcp", {"peer_timeout": 5.0})


def test_the_kernel_name_is_the_python_name_less_the_prefix_cut_to_fifteen_bytes() -> None:
    assert os_name("pdcore-tcp-sink-3") == b"tcp-sink-3"
    assert os_name("pdcore-control-gate-41234") == b"control-gate-41"
    assert os_name("watch-7") == b"watch-7"  # no prefix: the name as it is
    assert all(len(os_name(n)) == OS_NAME_BYTES for n in ("x" * 40, "pdcore-" + "y" * 40, "é" * 20))


@linux_only
def test_a_named_thread_runs_its_target_under_its_name() -> None:
    seen: list[object] = []
    done = threading.Event()

    def target(a: int, b: str) -> None:
        seen.append((a, b, kernel_name(threading.current_thread())))
        done.set()

    t = named_thread(target, "pdcore-probe-1", (7, "x"))
    assert t.name == "pdcore-probe-1" and t.daemon
    t.start()
    assert done.wait(10.0)
    t.join(10.0)
    assert seen == [(7, "x", "probe-1")]


@linux_only
def test_a_tcp_transports_threads_carry_their_names_to_the_kernel(make_tcp: MakeTransport) -> None:
    src_t, dst_t = make_tcp(), make_tcp()
    granted_link(src_t, dst_t, np.ones(4096, np.uint8))  # connected: a sender, an ack reader, a sink reader
    names = kernel_names("pdcore-tcp-")
    roles = {python.rsplit("-", 1)[0] for python in names} | {python for python in names if python == "pdcore-tcp-accept"}
    assert {"pdcore-tcp-accept", "pdcore-tcp-send", "pdcore-tcp-ack", "pdcore-tcp-sink"} <= roles
    assert all(kernel == os_name(python).decode() for python, kernel in names.items()), names
