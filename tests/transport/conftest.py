"""Fixtures for the data-plane tests: every conformance test runs once per transport name.

The list of transports lives in ``_transport_support.TRANSPORTS``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from _transport_support import TRANSPORTS, MakeTransport, transport_maker, variant


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
        entry = getattr(getattr(item, "callspec", None), "params", {}).get("transport_variant")
        name = None if entry is None else variant(str(entry))[0]
        (drop if marker is not None and name is not None and name not in marker.args else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(params=TRANSPORTS)
def transport_variant(request: pytest.FixtureRequest) -> str:
    """An entry of ``TRANSPORTS``: ``"tcp"``, ``"tcp+secret"``, ``"verbs"``."""
    return str(request.param)


@pytest.fixture
def transport_name(transport_variant: str) -> str:
    """The registry name of the parametrised transport (``"tcp"`` for ``"tcp+secret"`` too)."""
    return variant(transport_variant)[0]


@pytest.fixture
def transport_options(transport_variant: str) -> dict[str, Any]:
    """Its constructor options (``secret`` for a ``+secret`` run): children build theirs from these."""
    return variant(transport_variant)[1]


@pytest.fixture
def make_transport(transport_name: str, transport_options: dict[str, Any]) -> Iterator[MakeTransport]:
    """Build transports of the parametrised kind; all are closed after the test, and no thread may outlive them."""
    yield from transport_maker(transport_name, {**transport_options, "peer_timeout": 5.0})


@pytest.fixture(scope="session", params=[pytest.param("cython", marks=pytest.mark.compiled), "python"])
def plan_impl(request: pytest.FixtureRequest) -> ModuleType:
    """The transfer-plan twin under test, imported by name: a missing build fails the [cython] tests."""
    name = "transport._plan" if request.param == "cython" else "transport._plan_py"
    return importlib.import_module(name)


@pytest.fixture(scope="session", params=[pytest.param("cython", marks=pytest.mark.compiled), "python"])
def fast_impl(request: pytest.FixtureRequest) -> ModuleType:
    """The TCP fast-path twin under test, imported by name: a missing build fails the [cython] tests."""
    return importlib.import_module("transport._tcp_fast" if request.param == "cython" else "transport._tcp_fast_py")
