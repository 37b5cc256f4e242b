"""The one place that chooses between the compiled table and its pure twin.

``PDCORE_PURE_PYTHON=1`` selects the twin. Otherwise the compiled module is
imported and an ``ImportError`` is a broken build: it is raised, never papered
over by a silent fallback that would run at a fraction of the speed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

__all__ = ["IMPLEMENTATION", "StateTable", "FINGERPRINT_BYTES"]

IMPLEMENTATION = "python" if os.environ.get("PDCORE_PURE_PYTHON") == "1" else "cython"

if TYPE_CHECKING or IMPLEMENTATION == "python":
    from ._table_py import FINGERPRINT_BYTES, StateTable
else:
    from ._table import FINGERPRINT_BYTES, StateTable  # ImportError: run `pip install -e .` to build it
