"""EPD: encode nodes ship image embeddings into prefill ranks' receive slots.

- ``types``: the EPD values (``EmbeddingItem``, ``LandedItem``,
  ``LandedRequest``, ``EmbeddingChunk``) and traits (``EmbeddingReceiver``,
  ``EmbeddingSender``), also importable from ``pdcore``.
- ``_recv_spec``: the receiver's states, triggers and grids: the one source of truth.
- ``table``: the chooser of the receiver's state table and slot pool, compiled
  (``_recv``) or its pure twin (``_recv_py``, ``PDCORE_PURE_PYTHON=1``).
- ``config``: ``ReceiverConfig`` and ``EncodeConfig``.
- ``receiver``: ``Receiver``, what ``PrefillPeer.embedding_receiver`` returns:
  the table plus the I/O (lookups, grants, asks, fences) over the prefill
  peer's planes.
- ``sending``: an encode rank's rooms, sans-IO (``SendRooms``); ``encode``:
  ``EncodePeer`` and its ``Sender``, which perform them.

Importing this package imports only the types: no torch, no ZeroMQ.

The receiver's table on one prefill rank, sans-IO (the peer adds the I/O)::

    table = ReceiveTable(slots=64, slot_rows=4096, rank=r, ranks=tp, sharded=True)
    table.stage(rid, items, now)              # scheduler thread, same order on every rank
    for ask in table.take_ready():            # peer: send each receive request (slot None: 0 rows)
        ...                                   #   grant the encode rank the slot, then ask
    table.landed(rid, index, now)             # peer I/O: the item's rows landed (revoke its grant)
    table.fail(rid, reason, now)              # peer I/O: the room failed / the peer is gone
    landed = Agreement(table).round(now, group)   # encode, MIN across the replica, decode
    for f in table.failed(): ...              # dropped: abort_room toward decode
    for slot in table.take_fencing(): ...     # revoke the slot's grant, then table.fenced(slot)
    table.release([it.slot for r in landed for it in r.items if it.slot is not None])  # rows copied out
"""

from __future__ import annotations

from .types import EmbeddingChunk, EmbeddingItem, EmbeddingReceiver, EmbeddingSender, LandedItem, LandedRequest

__all__ = ["EmbeddingChunk", "EmbeddingItem", "EmbeddingReceiver", "EmbeddingSender", "LandedItem", "LandedRequest"]
