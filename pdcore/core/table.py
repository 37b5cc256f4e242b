"""The state table and the shared-memory reducer: compiled, or their pure twins (``_table_py``,
``_shm_py``), as ``pdcore/twins.py`` chooses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..twins import IMPLEMENTATION, load

__all__ = ["IMPLEMENTATION", "StateTable", "ShmReducer", "FINGERPRINT_BYTES"]

if TYPE_CHECKING:
    from ._shm_py import ShmReducer
    from ._table_py import StateTable
    from .twin_common import FINGERPRINT_BYTES
else:
    ShmReducer = load("pdcore.core._shm").ShmReducer
    _table = load("pdcore.core._table")
    StateTable, FINGERPRINT_BYTES = _table.StateTable, _table.FINGERPRINT_BYTES
