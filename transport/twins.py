"""The one chooser of the transport's compiled modules or their pure-Python twins.

``PDCORE_PURE_PYTHON=1`` selects every twin; otherwise the compiled modules are
imported and an ``ImportError`` is a broken build, raised, never a silent
fallback. The chosen module is checked against ``TWINS`` (the names both twins
define), so a stale build fails at import naming what is missing. The same
variable chooses pdcore's twins (``pdcore/twins.py``); the transport imports
nothing of pdcore, so it reads it here too.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["IMPLEMENTATION", "TWINS", "checked_import", "load"]

#: "python" under ``PDCORE_PURE_PYTHON=1``, else "cython"; read here only, for the transport.
IMPLEMENTATION = "python" if os.environ.get("PDCORE_PURE_PYTHON") == "1" else "cython"

#: compiled module -> (its pure twin, the public names both define)
TWINS: dict[str, tuple[str, tuple[str, ...]]] = {
    "transport._plan": ("transport._plan_py", ("count_runs", "naive_plan", "plan")),
    "transport._tcp_fast": ("transport._tcp_fast_py", (
        "FRAME_SIZE", "ACK_SIZE", "FRAME_OK", "FRAME_ZERO_LENGTH", "FRAME_LOCAL_OUTSIDE", "FRAME_REMOTE_OUTSIDE", "LAND_OK",
        "LAND_OUTSIDE_REGIONS", "LAND_NEEDS_GRANT", "LAND_GRANT_NOT_LIVE", "LAND_GRANT_OTHER_SOURCE", "LAND_OUTSIDE_GRANT",
        "SERVE_REFUSED", "SERVE_CLOSED", "SERVE_BROKEN", "SERVE_STALLED",
        "SERVE_STOPPED", "SERVE_NOTED", "MAX_NOTE", "POST_SENT", "POST_WAKE", "POST_FULL", "POST_FAILED", "POST_ARRAY", "POST_TOO_MANY", "ACKS_GOT",
        "ACKS_TICK", "ACKS_CLOSED", "ACKS_BAD", "ACKS_ORDER", "ACKS_FAILED", "MAX_MSG", "frame", "Sink", "SinkConn",
        "Source", "Completions",
    )),
}


def load(compiled: str) -> ModuleType:
    """The module chosen for ``compiled`` (a key of ``TWINS``), checked to define each of its names."""
    return checked_import(compiled, *TWINS[compiled], IMPLEMENTATION)


def checked_import(compiled: str, pure: str, names: tuple[str, ...], implementation: str) -> ModuleType:
    """Import ``pure`` (``implementation`` "python") or ``compiled``; ``ImportError`` naming what it lacks of ``names``."""
    module = importlib.import_module(pure if implementation == "python" else compiled)
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise ImportError(f"{module.__name__} lacks {', '.join(missing)}: a stale build? (pip install -e . rebuilds it)")
    return module
