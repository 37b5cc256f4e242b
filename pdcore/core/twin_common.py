"""What both twins of the state table share (``_table.pyx`` and ``_table_py.py``), and the EPD receive table too.

One copy, so the compiled and pure tables cannot drift apart on the checks of their
configuration, the fingerprint they put in the agreement, or the words of a mismatch.
"""

from __future__ import annotations

from transport.limits import U64_MAX

__all__ = ["FINGERPRINT_BYTES", "MAX_CAPACITY", "check_config", "describe_mismatch", "mismatch_message", "rid_hash"]

#: Bytes of the (count, hash) fingerprint; the buffer carries them twice (h, 255-h).
FINGERPRINT_BYTES = 12
MAX_CAPACITY = 1 << 20



def check_config(capacity: int, bootstrap_timeout: float, waiting_timeout: float) -> None:
    """The constructor's checks, shared by both twins."""
    if not 0 < capacity <= MAX_CAPACITY:
        raise ValueError(f"capacity must be in 1..{MAX_CAPACITY}, got {capacity!r}")
    for name, value in (("bootstrap_timeout", bootstrap_timeout), ("waiting_timeout", waiting_timeout)):
        if not value > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def rid_hash(rid: str, slot: int) -> int:
    """A process-independent 64-bit hash of (slot, rid): FNV-1a, then a splitmix64 finaliser.

    Python's ``hash(str)`` is salted per process, so it cannot be compared across ranks.
    """
    h = 0xCBF29CE484222325
    for byte in rid.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) & U64_MAX
    h = (h ^ (slot * 0x9E3779B97F4A7C15)) & U64_MAX
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & U64_MAX
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & U64_MAX
    return h ^ (h >> 31)


def describe_mismatch(mine: bytes, lowest: bytes, highest: bytes, *, agreement: str, held: str, not_same: str,
                      rule: str) -> str:
    """A refused agreement in words, as the PD and EPD tables both put it: the ranks hold different numbers
    of ``held`` requests, or as many but not the same ``not_same``; ``rule`` says what every rank must do."""
    count = int.from_bytes(mine[8:], "little")
    if lowest[8:] != highest[8:]:
        what = (
            f"the ranks hold different numbers of {held} requests (this rank {count}, replica byte-wise "
            f"min {int.from_bytes(lowest[8:], 'little')} / max {int.from_bytes(highest[8:], 'little')})"
        )
    else:
        what = f"the ranks hold {count} {held} requests each, but not the same {not_same}"
    return f"{agreement} agreement refused: {what}; this rank's fingerprint is {mine.hex()}. {rule}"


def mismatch_message(mine: bytes, lowest: bytes, highest: bytes) -> str:
    """Name what differs: the number of live requests, or which requests they are."""
    return describe_mismatch(mine, lowest, highest, agreement="replica", held="live", not_same="(slot, rid) set",
                             rule="Every rank must register and remove the same rids in the same order.")
