"""What every child-process module of the black-box tests shares (tests/_*_children.py).

A child reports to its test over its end of a duplex pipe; if its body raises, the test must
see the traceback (an ``("error", traceback)`` message) rather than only a dead process.
"""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection
from typing import Any


def guarded(conn: Connection, body: Any, *args: Any) -> None:
    """Run ``body(conn, *args)``; if it raises, send ``("error", traceback)`` (if the pipe still
    takes it) and re-raise, so the child still dies of it."""
    try:
        body(conn, *args)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
        raise
