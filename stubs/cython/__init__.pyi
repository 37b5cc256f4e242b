# What the type checker needs of Cython's pure-Python mode, as the two sources compiled as they are use it
# (pdcore/core/_events_py.py, pdcore/epd/_types_py.py): run as Python, each decorator returns what it is given
# and cython.dataclasses is the standard library's dataclasses. Cython ships no stubs for the `cython` module.
from collections.abc import Callable
from typing import TypeVar

from . import dataclasses as dataclasses

_T = TypeVar("_T", bound=type)
_F = TypeVar("_F", bound=Callable[..., object])

compiled: bool

def cclass(cls: _T) -> _T: ...
def cfunc(func: _F) -> _F: ...
