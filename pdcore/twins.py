"""The one chooser of pdcore's compiled modules or their pure-Python twins.

``PDCORE_PURE_PYTHON=1`` selects every twin (``_table_py``, ...); otherwise the
compiled modules are imported, and an ``ImportError`` is a broken build: it is
raised, never papered over by a silent fallback that would run at a fraction
of the speed. Either way the chosen module is checked against ``TWINS``, the
one list of the names both twins must define, so a stale build or a twin that
lost a name fails at import naming what is missing (as pyzmq checks the
backend it selects). ``transport/twins.py`` does the same for the transport,
which imports nothing of pdcore.
"""

from __future__ import annotations

import os
from types import ModuleType

from transport.twins import checked_import

__all__ = ["IMPLEMENTATION", "TWINS", "load"]

#: "python" under ``PDCORE_PURE_PYTHON=1``, else "cython"; read here only.
IMPLEMENTATION = "python" if os.environ.get("PDCORE_PURE_PYTHON") == "1" else "cython"

#: compiled module -> (its pure twin, the public names both define)
TWINS: dict[str, tuple[str, tuple[str, ...]]] = {
    "pdcore.core._table": ("pdcore.core._table_py", ("StateTable", "FINGERPRINT_BYTES")),
    "pdcore.core._hash": ("pdcore.core.twin_common", ("rid_hash",)),  # the compiled tables' (the pure ones import it there)
    "pdcore.core._shm": ("pdcore.core._shm_py", ("ShmReducer",)),
    "pdcore.core._events": ("pdcore.core._events_py", ("FAILED_ELSEWHERE", "Bootstrapped", "Event", "Failed", "Succeeded")),
    "pdcore.epd._recv": ("pdcore.epd._recv_py", ("ReceiveTable", "Ask", "FINGERPRINT_BYTES")),
    "pdcore.epd._types": ("pdcore.epd._types_py", ("DTYPE_ITEMSIZE", "EmbeddingChunk", "EmbeddingItem", "LandedItem",
                                                   "LandedRequest")),
    "pdcore.kv._heads": ("pdcore.kv._heads_py", ("cut",)),
    "pdcore.control._seal": ("pdcore.control._seal_py", ("HEADER_BYTES", "TAG_BYTES", "MAX_KEY", "Sealer", "Opener")),
}


def load(compiled: str) -> ModuleType:
    """The module chosen for ``compiled`` (a key of ``TWINS``), checked to define each of its names."""
    return checked_import(compiled, *TWINS[compiled], IMPLEMENTATION)
