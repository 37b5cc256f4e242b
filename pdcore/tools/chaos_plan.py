"""A chaos run's plan: deployment, faults and timings, all seeded (``ChaosPlan``), and the canary bytes.

Every rank derives its own seeds from the plan (``rank_seed``), so a run replays from
``--seed`` (``python -m pdcore chaos``, ``pdcore/tools/chaos.py``).
"""

from __future__ import annotations

import dataclasses
import secrets
import zlib
from dataclasses import dataclass, field



CANARY_FAILED = 0xA5  # a page handed back on Failed
CANARY_DONE = 0x5A  # a page handed back after its RemotePrefillDone was checked
FRESH = 0x00  # a page never lent to a transfer


@dataclass
class ChaosPlan:
    seed: int = 0
    seconds: float | None = 30.0  # the active phase; None: until ``requests`` were dispatched and ended
    requests: int | None = None
    prefill_tp: int = 2
    decode_tp: int = 2
    replicas: int = 2  # of each role
    layers: int = 4
    page_bytes: int = 65536
    num_pages: int = 512
    max_pages: int = 32  # up to 8 MiB per request and rank: more than a socket buffer holds
    window: int = 8  # live requests per decode replica
    transport: str = "faulty:tcp"
    fail_rate: float = 0.03  # data plane: batches failed (faulty:<inner> only)
    land_rate: float = 0.5  # of those, posted first (their bytes land)
    delay: float = 0.005  # data plane: extra completion delay, seconds (max)
    control: str = "tcp"  # the control plane; with control faults, faulty:<this>
    control_drop: float = 0.002
    control_delay: float = 0.02  # fraction of frames held back (up to control_max_delay s, order kept)
    control_max_delay: float = 0.2
    control_dup: float = 0.005
    control_corrupt: float = 0.002
    kills: bool = True
    pauses: bool = True
    mid_transfer: float = 0.5  # fraction of prefill pauses timed right after a handover of pages
    fault_gap: tuple[float, float] = (1.5, 4.0)  # seconds between the end of one fault and the next
    warmup: float = 2.0  # seconds of clean traffic before the first fault
    heartbeat_interval: float = 0.25
    dead_after: float = 2.0
    bootstrap_timeout: float = 8.0
    waiting_timeout: float = 8.0
    fence_timeout: float = 4.0
    tombstone_ttl: float = 30.0
    collective_timeout: float = 30.0  # gloo: longer than any pause
    drain: float = 25.0  # after stop, ranks wait this long for their requests to end
    start_timeout: float = 60.0  # a rank reports ready within this
    await_tombstones: bool = False  # (demo._leftovers reads it)
    prefault: bool = False  # (demo._cache reads it)
    max_seconds: float = 600.0  # --requests: the faulty phase ends by then whatever happens
    verbose: bool = True
    log_level: str = "ERROR"  # of the ranks' "pdcore" loggers
    #: the harness's own check: peers built with ``unsafe_no_grants`` (a fence that trusts the source),
    #: which the canary invariant must catch
    unsafe_no_grants: bool = False
    #: every rank and bootstrap server of the run holds it: chaos runs as deployed, authenticated, with a
    #: secret drawn for each plan (as the demo does), never a fixed one that would open any deployment using it
    secret: bytes | None = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    slow: float = 1.0  # every timer scaled by this (``slower``)

    def slower(self, factor: float) -> ChaosPlan:
        """The same plan with every timer scaled by ``factor`` (a slow or emulated machine)."""
        if factor == 1:
            return self
        names = ("heartbeat_interval", "dead_after", "bootstrap_timeout", "waiting_timeout", "fence_timeout",
                 "drain", "start_timeout", "collective_timeout")
        return dataclasses.replace(self, slow=self.slow * factor, **{n: getattr(self, n) * factor for n in names})

    def rank_seed(self, role: str, index: int, gen: int, rank: int, what: str) -> int:
        return zlib.crc32(f"{self.seed}/{role}/{index}/{gen}/{rank}/{what}".encode())
