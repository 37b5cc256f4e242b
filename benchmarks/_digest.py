"""The digest every benchmark sink answers and every source checks: BLAKE2b of a buffer's regions in order.

Standard library and numpy only: NIXL's agents (``_nixl_agent.py``, run by NIXL's own
interpreter, which has neither pdcore nor transport) import it beside ours.
"""

from __future__ import annotations

import hashlib

import numpy as np


def regions_digest(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> str:
    """BLAKE2b (16 bytes, hex) of ``buf[offset : offset + length]`` for each pair, in order."""
    h = hashlib.blake2b(digest_size=16)
    view = memoryview(buf)
    for off, n in zip(offsets.tolist(), lengths.tolist()):
        h.update(view[off : off + n])
    return h.hexdigest()
