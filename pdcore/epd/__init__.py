"""EPD: encode nodes ship image embeddings into prefill ranks' receive slots.

- ``types``: the seed's values (``EmbeddingItem``, ``LandedItem``,
  ``LandedRequest``, ``EmbeddingChunk``) and traits (``EmbeddingReceiver``,
  ``EmbeddingSender``), also importable from ``pdcore``.
- ``_spec``: the receiver's states, triggers and grids: the one source of truth.
- ``table``: the chooser of the receiver's state table and slot pool, compiled
  (``_recv``) or its pure twin (``_recv_py``, ``PDCORE_PURE_PYTHON=1``).

Importing this package imports only the types: no torch, no ZeroMQ.
"""

from __future__ import annotations

from .types import (
    EmbeddingChunk,
    EmbeddingItem,
    EmbeddingReceiver,
    EmbeddingSender,
    LandedItem,
    LandedRequest,
)

__all__ = ["EmbeddingChunk", "EmbeddingItem", "EmbeddingReceiver", "EmbeddingSender", "LandedItem", "LandedRequest"]
