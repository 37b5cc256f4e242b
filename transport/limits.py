"""Bounds of the wire's and the address space's unsigned 64-bit fields, defined once for transport/ and pdcore/.

A module of its own with no imports, so that the sans-IO role engines (which may not import threads or
sockets, even indirectly) can use the bound without pulling in the region tables.
"""

U64_MAX = (1 << 64) - 1  # the largest address, length, key or room
MAX_NOTE = 4096  # the most bytes of a note riding a batch (``Transport.write(..., note=...)``)

# The longest note a batch carries (``Transport.write(..., note=...)``; ``transport/base.py``, "Notes"): what a
# sink reads with a frame's header, so it stays small.
MAX_NOTE = 4096
