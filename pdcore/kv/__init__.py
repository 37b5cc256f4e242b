"""KV cache layouts across tensor-parallel ranks: ``KvLayout`` (heads per rank, who owes whom) and the planner.

- ``layout``: ``KvLayout`` (HND, NHD or MLA pages; heads split or replicated
  over ranks), its ``assignment`` of heads from prefill ranks to decode ranks.
- ``planner``: the coalesced writes one prefill rank owes one decode rank; the
  kernel is compiled (``_heads``) with its pure twin (``_heads_py``).
- ``routing``: who talks to whom between a prefill and a decode replica of
  any tp sizes, and what each writes; ``pattern``: known KV bytes every rank
  that holds a head computes alike (checks); ``tiny``: a tiny seeded decoder
  in torch whose tokens prove the bytes (the demo's ``--model tiny``, tests).
"""

from __future__ import annotations

from .layout import ORDERS, KvLayout, Segments, Share

__all__ = ["ORDERS", "KvLayout", "Segments", "Share"]
