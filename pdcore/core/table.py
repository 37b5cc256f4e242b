"""The one place that chooses between the compiled modules and their pure twins.

``PDCORE_PURE_PYTHON=1`` selects the twins (``_table_py``, ``_shm_py``).
Otherwise the compiled modules are imported and an ``ImportError`` is a broken
build: it is raised, never papered over by a silent fallback that would run at
a fraction of the speed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

__all__ = ["IMPLEMENTATION", "StateTable", "ShmReducer", "FINGERPRINT_BYTES"]

IMPLEMENTATION = "python" if os.environ.get("PDCORE_PURE_PYTHON") == "1" else "cython"

if TYPE_CHECKING or IMPLEMENTATION == "python":
    from ._shm_py import ShmReducer
    from ._table_py import FINGERPRINT_BYTES, StateTable
else:
    from ._shm import ShmReducer  # ImportError: run `pip install -e .` to build it
    from ._table import FINGERPRINT_BYTES, StateTable
