"""Fixtures for the verbs transport on a real device (soft-RoCE ``rdma_rxe`` in CI).

Skips happen only when pyverbs or a device is genuinely absent, and the reason
says which. ``PDCORE_REQUIRE_RDMA=1`` (set by ``ci/rdma-tests.sh`` inside the
rxe guest) turns that skip into a failure, and fails the run if any
``rdma``-marked test was skipped for any reason: in CI the RDMA tests must run.
``PDCORE_RDMA_DEVICE`` picks the device (default: the first active one).

This conftest also adds ``"verbs"`` to the shared conformance suite's
transports (``tests/transport/_transport_support.TRANSPORTS``), marked
``rdma``; without a device that parameter is skipped with the reason. It takes
effect when ``tests/rdma`` is collected before ``tests/transport`` (``pytest``
with no arguments, or ``pytest tests/rdma tests/transport``); under
``PDCORE_REQUIRE_RDMA=1`` a run of ``tests/transport`` that collected no
``[verbs`` test fails.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


REQUIRE_RDMA = os.environ.get("PDCORE_REQUIRE_RDMA") == "1"
DEVICE = os.environ.get("PDCORE_RDMA_DEVICE") or None


def _reason() -> str | None:
    from transport.verbs import unavailable_reason  # the one module that imports pyverbs

    return unavailable_reason(DEVICE)


_REASON = _reason()


def _verbs_param() -> Any:
    marks = [pytest.mark.rdma]
    if _REASON is not None and not REQUIRE_RDMA:
        marks.append(pytest.mark.skip(reason=f"no verbs device: {_REASON}"))
    return pytest.param("verbs", marks=marks, id="verbs")


def _join_conformance_suite() -> None:
    here = Path(__file__).resolve().parent
    support_dir = str(here.parent / "transport")
    if support_dir not in sys.path:
        sys.path.insert(0, support_dir)
    import _transport_support as support

    if not any(getattr(p, "values", (p,))[0] == "verbs" for p in support.TRANSPORTS):
        support.TRANSPORTS.append(_verbs_param())
        support.TRANSPORT_OPTIONS.setdefault("verbs", {"device": DEVICE} if DEVICE else {})


_join_conformance_suite()


@pytest.fixture(scope="session")
def verbs_device() -> str | None:
    """The device the tests use (None = the transport's default); skips (or fails, in CI) without one."""
    if _REASON is not None:
        if REQUIRE_RDMA:
            pytest.fail(f"PDCORE_REQUIRE_RDMA=1 but the verbs transport cannot run: {_REASON}")
        pytest.skip(f"no verbs device: {_REASON}")
    return DEVICE


@pytest.fixture
def make_verbs(verbs_device: str | None) -> Iterator[Any]:
    """Build verbs transports (fast timeouts); all are closed after the test, and no thread may outlive them."""
    from _transport_support import transport_maker

    yield from transport_maker("verbs", {"peer_timeout": 5.0, **({"device": verbs_device} if verbs_device else {})})


_skipped_rdma: list[str] = []
_collected_verbs_conformance = False


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    global _collected_verbs_conformance
    _collected_verbs_conformance = any("tests/transport/" in i.nodeid and "verbs" in i.nodeid for i in items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if REQUIRE_RDMA and report.skipped and "rdma" in report.keywords:
        _skipped_rdma.append(f"{report.nodeid}: {report.longrepr}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not REQUIRE_RDMA:
        return
    problems = list(_skipped_rdma)
    args = " ".join(str(a) for a in session.config.args)
    if "tests/transport" in args and not _collected_verbs_conformance:
        problems.append("the conformance suite (tests/transport) ran without its [verbs] parameter")
    if problems:
        print("\nPDCORE_REQUIRE_RDMA=1: RDMA tests must run here, but:", *problems, sep="\n  ", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
