from typing import Any

import numpy as np
import numpy.typing as npt

from ._layout import Layout as Layout
from ._layout import PlanError as PlanError

__all__ = ["Layout", "PlanError", "count_runs", "naive_plan", "plan"]

def count_runs(src_pages: Any, dst_pages: Any) -> int: ...
def plan(src: Layout, dst: Layout, src_pages: Any, dst_pages: Any) -> npt.NDArray[np.uint64]: ...
def naive_plan(src: Layout, dst: Layout, src_pages: Any, dst_pages: Any) -> npt.NDArray[np.uint64]: ...
