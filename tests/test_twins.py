"""The compiled/pure choice is made in one module per package, against one list of names."""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
import types

import pytest

import pdcore.twins
import transport.twins

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHOOSERS = [pdcore.twins, transport.twins]


def test_only_the_two_choosers_read_the_variable() -> None:
    readers = sorted(str(p.relative_to(ROOT)) for package in ("pdcore", "transport")
                     for p in (ROOT / package).rglob("*.py*") if p.suffix in (".py", ".pyx")
                     and 'environ.get("PDCORE_PURE_PYTHON")' in p.read_text())
    assert readers == ["pdcore/twins.py", "transport/twins.py"]


@pytest.mark.parametrize("chooser", CHOOSERS, ids=lambda c: c.__name__)
def test_both_twins_of_every_pair_define_every_listed_name(chooser: types.ModuleType) -> None:
    for compiled, (pure, names) in chooser.TWINS.items():
        assert names, f"{compiled}: no names listed"
        for name in (compiled, pure):
            module = importlib.import_module(name)
            missing = [n for n in names if not hasattr(module, n)]
            assert not missing, f"{name} lacks {missing}"


@pytest.mark.parametrize("chooser", CHOOSERS, ids=lambda c: c.__name__)
def test_a_chosen_module_that_lacks_a_name_fails_at_import_naming_it(chooser: types.ModuleType,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    compiled, (pure, names) = next(iter(chooser.TWINS.items()))
    monkeypatch.setitem(chooser.TWINS, compiled, (pure, (*names, "not_there")))
    with pytest.raises(ImportError, match=r"lacks not_there: a stale build"):
        chooser.load(compiled)


@pytest.mark.parametrize("env, expected", [("1", "python"), ("", "cython")])
def test_the_variable_chooses_every_twin_of_both_packages(env: str, expected: str) -> None:
    code = ("import pdcore.core.table as t, pdcore.epd.recv_table as e, pdcore.kv.planner as k, transport.plan as p, "
            "transport.tcp as c; print(t.IMPLEMENTATION, e.IMPLEMENTATION, k.IMPLEMENTATION, p.IMPLEMENTATION, "
            "c.IMPLEMENTATION, t.StateTable.__module__.endswith('_py'), c._fast.__name__.endswith('_py'))")
    out = subprocess.run([sys.executable, "-c", code], env={"PDCORE_PURE_PYTHON": env, "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout.split()
    pure = str(expected == "python")
    assert out == [expected] * 5 + [pure, pure]
