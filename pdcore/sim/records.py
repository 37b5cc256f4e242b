"""What the simulated schedulers track per request, and the sizes of what they schedule.

A room of ``pdcore.sim.workload``: the constants every scheduler shares (a round's length, a rank's
pages, an encode rank's send slots, the poison that unwritten bytes hold), one record per PD and per
EPD request (what was sent, what each rank saw end, which sides were lost), and the bytes an image's
rows hold. The records are the simulation's memory of what it asked for: the invariants compare what
the engines did against them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from .cluster import Replica

ROUND = 0.008  # a scheduler's round
PAGES = 48  # pages per rank's cache
HIDDEN = 4
DTYPE = "torch.float16"
ROW_BYTES = HIDDEN * 2
SLOTS = 6
SLOT_ROWS = 8
SEND_SLOTS = 32  # an encode rank's send slots; its scheduler begins images first come, first served
POISON = 0xA5  # what a page or send slot holds before its bytes are written (never a page's content)


def seed_of(rid: str) -> int:
    return (zlib.crc32(rid.encode()) & 0x7FFF) + 1  # not hash(): that differs per process, a seed must replay


@dataclass(eq=False)
class PdRequest:
    rid: str
    room: int
    npages: int
    prefill: Replica
    decode: Replica
    born: float
    first_token: int
    cached: int
    logprob: float | None
    seed: int
    p_pages: list[int] = field(default_factory=list)
    d_pages: list[int] = field(default_factory=list)
    sent: bool = False  # a hand-over is scheduled
    handed: bool = False  # the hand-over began (it runs once)
    announced: bool = False
    ends: dict[tuple[str, int], str] = field(default_factory=dict)  # (side, rank) -> event name
    layer: int = 0  # layers handed over so far
    lost: set[str] = field(default_factory=set)  # sides whose replica was killed (or never held it): no end owed there
    early: bool = False
    aborted: bool = False
    faultless: bool = True
    counted: bool = False
    ended_at: dict[str, tuple[float, bool]] = field(default_factory=dict)  # side -> (when, learned by its own timer)
    usage: bool = True  # the scheduler recorded usage (it rides with the finishing hand-over)


@dataclass(eq=False)
class EpdRequest:
    rid: str
    images: list[tuple[int, int, int]]  # (room, rows, encode deployment)
    prefill: Replica
    born: float
    ends: dict[int, str] = field(default_factory=dict)  # prefill rank -> "landed" / "failed"
    lost: bool = False
    ended_at: float | None = None


def image_rows(room: int, start: int, count: int) -> np.ndarray:
    """The bytes of rows ``[start, start + count)`` of ``room``'s image (never POISON in every byte)."""
    r = np.arange(start, start + count, dtype=np.int64)[:, None]
    c = np.arange(ROW_BYTES, dtype=np.int64)[None, :]
    return ((room * 13 + r * 7 + c * 3) % 251).astype(np.uint8).reshape(-1)
