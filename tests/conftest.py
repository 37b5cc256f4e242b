"""Shared fixtures: every table test runs against both twins, ids [cython] and [python].

The compiled module is imported by name, so a missing build fails the [cython]
tests instead of quietly testing Python twice. Subdirectories (transport/,
rdma/) add their own conftest.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
from hypothesis import Phase, settings

TWINS = {"cython": "pdcore.core._table", "python": "pdcore.core._table_py"}

# Hypothesis profiles; a test that sets max_examples itself keeps its own. HYPOTHESIS_PROFILE picks
# one: "default" for a developer's run, "ci" many more examples (the state machines explore more),
# "mutants" the default count, derandomized and without shrinking, so tests/mutants/run.sh kills the
# same way every run and does not spend minutes minimising a failure nobody reads.
settings.register_profile("default", max_examples=150, deadline=None)
settings.register_profile("ci", max_examples=600, deadline=None)
settings.register_profile(
    "mutants", max_examples=150, deadline=None, derandomize=True, database=None,
    phases=(Phase.explicit, Phase.generate),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session", params=[pytest.param("cython", marks=pytest.mark.compiled), "python"])
def table_impl(request: pytest.FixtureRequest) -> ModuleType:
    return importlib.import_module(TWINS[request.param])


@pytest.fixture(params=["zmq", "tcp"])
def plane(request: pytest.FixtureRequest) -> str:
    """Each control plane by name: a test that takes it runs on both."""
    return str(request.param)
