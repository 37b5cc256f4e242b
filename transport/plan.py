"""The one chooser of the transfer-plan twin: ``PDCORE_PURE_PYTHON=1`` → pure Python, else compiled.

An ``ImportError`` of the compiled module is a broken build and fails loudly:
there is no silent fallback. ``IMPLEMENTATION`` names the twin in use.

    from transport.plan import Layout, plan
    writes = plan(src_layout, dst_layout, src_pages, dst_pages)   # (n, 3) uint64
    transport.write(peer, writes, on_done)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ._layout import Layout, PlanError

IMPLEMENTATION = "python" if os.environ.get("PDCORE_PURE_PYTHON") == "1" else "cython"

if TYPE_CHECKING or IMPLEMENTATION == "python":
    from ._plan_py import count_runs, naive_plan, plan
else:
    from ._plan import count_runs, naive_plan, plan  # ImportError here means a broken build

__all__ = ["IMPLEMENTATION", "Layout", "PlanError", "count_runs", "naive_plan", "plan"]
