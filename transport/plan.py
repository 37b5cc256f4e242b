"""The transfer plan: compiled (``_plan``) or its pure twin (``_plan_py``), as ``transport/twins.py`` chooses.

    from transport.plan import Layout, plan
    writes = plan(src_layout, dst_layout, src_pages, dst_pages)   # (n, 3) uint64
    transport.write(peer, writes, on_done)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._layout import Layout, PlanError
from .twins import IMPLEMENTATION, load

if TYPE_CHECKING:
    from ._plan_py import count_runs, naive_plan, plan
else:
    _plan = load("transport._plan")
    count_runs, naive_plan, plan = _plan.count_runs, _plan.naive_plan, _plan.plan

__all__ = ["IMPLEMENTATION", "Layout", "PlanError", "count_runs", "naive_plan", "plan"]
