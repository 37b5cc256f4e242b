"""Shared fixtures: every table test runs against both twins, ids [cython] and [python].

The compiled module is imported by name, so a missing build fails the [cython]
tests instead of quietly testing Python twice. Subdirectories (transport/,
rdma/) add their own conftest.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

TWINS = {"cython": "pdcore._table", "python": "pdcore._table_py"}


@pytest.fixture(scope="session", params=[pytest.param("cython", marks=pytest.mark.compiled), "python"])
def table_impl(request: pytest.FixtureRequest) -> ModuleType:
    return importlib.import_module(TWINS[request.param])
