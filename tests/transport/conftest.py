"""Fixtures for the data-plane tests: every conformance test runs once per transport name.

The list of transports lives in ``_transport_support.TRANSPORTS``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType

import pytest

from _transport_support import TRANSPORT_OPTIONS, TRANSPORTS, MakeTransport, transport_maker


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.transports("tcp")`` marks behaviour only those transports promise.

    Its runs for other transports are deselected, not skipped: they are not
    missing, they behave differently by design (a verbs sink refuses with an
    error completion that puts the queue pair in error; a stopped verbs process
    still acks writes), and tests/rdma checks that behaviour instead.
    """
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("transports")
        name = getattr(getattr(item, "callspec", None), "params", {}).get("transport_name")
        (drop if marker is not None and name is not None and name not in marker.args else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(params=TRANSPORTS)
def transport_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_transport(transport_name: str) -> Iterator[MakeTransport]:
    """Build transports of the parametrised kind; all are closed after the test, and no thread may outlive them."""
    yield from transport_maker(transport_name, {**TRANSPORT_OPTIONS.get(transport_name, {}), "peer_timeout": 5.0})


@pytest.fixture(scope="session", params=[pytest.param("cython", marks=pytest.mark.compiled), "python"])
def plan_impl(request: pytest.FixtureRequest) -> ModuleType:
    """The transfer-plan twin under test, imported by name: a missing build fails the [cython] tests."""
    name = "transport._plan" if request.param == "cython" else "transport._plan_py"
    return importlib.import_module(name)
