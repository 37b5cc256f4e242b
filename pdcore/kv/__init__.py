"""KV cache layouts across tensor-parallel ranks: ``KvLayout`` (heads per rank, who owes whom) and the planner.

- ``layout``: ``KvLayout`` (HND, NHD or MLA pages; heads split or replicated
  over ranks), its ``assignment`` of heads from prefill ranks to decode ranks.
- ``plan``: the coalesced writes one prefill rank owes one decode rank; the
  kernel is compiled (``_heads``) with its pure twin (``_heads_py``).
"""

from __future__ import annotations

from .layout import ORDERS, KvLayout, Segments, Share

__all__ = ["ORDERS", "KvLayout", "Segments", "Share"]
