"""Known KV bytes for checks: what every rank holding (buffer, token, head, byte) of a request holds.

``page_content(layout, seed, first, count, pair)``: the page of page pair
``pair`` (tokens ``[pair*T, (pair+1)*T)``) holding heads ``[first,
first+count)``, per buffer, in the layout's page order, as ``(buffers,
page bytes)`` uint8. Any prefill rank that holds a head computes the same
bytes for it, so a decode rank checks exactly its heads whichever rank wrote
them; ``seed`` (per request) makes requests differ.
"""

from __future__ import annotations

import numpy as np

from .layout import KvLayout

__all__ = ["page_content"]


def page_content(layout: KvLayout, seed: int, first: int, count: int, pair: int) -> np.ndarray:
    t, b = layout.page_tokens, layout.head_bytes
    heads = np.arange(first, first + count, dtype=np.int64)
    tokens = pair * t + np.arange(t, dtype=np.int64)
    if layout.order == "hnd":
        hh, tt = heads[:, None], tokens[None, :]
    else:  # nhd, mla: tokens outermost
        tt, hh = tokens[:, None], heads[None, :]
    # (buffer*131 + token*29 + head*71 + byte*7 + (token*head) % 13 + seed*17) % 251, summed from its
    # parts taken mod 251 each (the same bytes; a page is one add of small int16 arrays, not ten int64 passes)
    per_buffer = (np.arange(layout.buffers, dtype=np.int64) * 131 % 251).astype(np.int16)
    per_slot = ((tt * 29 + hh * 71 + (tt * hh) % 13 + seed * 17) % 251).astype(np.int16)
    per_byte = (np.arange(b, dtype=np.int64) * 7 % 251).astype(np.int16)
    v = per_buffer[:, None, None, None] + per_slot[None, :, :, None] + per_byte[None, None, None, :]
    v %= 251
    return v.astype(np.uint8).reshape(layout.buffers, -1)
