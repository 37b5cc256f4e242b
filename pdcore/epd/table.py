"""The one place that chooses the EPD receiver table: compiled (``_recv``) or its pure twin (``_recv_py``).

``PDCORE_PURE_PYTHON=1`` selects the twin, as ``pdcore.core.table`` does for the
PD table. Otherwise the compiled module is imported and an ``ImportError`` is
a broken build: it is raised, never papered over by a silent fallback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.table import IMPLEMENTATION

__all__ = ["IMPLEMENTATION", "ReceiveTable", "Ask", "FINGERPRINT_BYTES"]

if TYPE_CHECKING or IMPLEMENTATION == "python":
    from ._recv_py import FINGERPRINT_BYTES, Ask, ReceiveTable
else:
    from ._recv import FINGERPRINT_BYTES, Ask, ReceiveTable  # ImportError: run `pip install -e .` to build it
