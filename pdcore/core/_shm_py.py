"""Same-host agreement through shared memory: the segment, and the pure-Python twin of the round.

When every rank of a replica runs on one host, a round is an all-reduce MIN of
the table's buffer through a shared-memory segment instead of the group's
collective. ``pdcore.core._shm`` is the compiled round (C11 ``__atomic`` builtins);
this module holds what both twins share (the layout, the segment's life, the
error messages) and the twin itself, which runs under ``PDCORE_PURE_PYTHON=1``.
``pdcore.core.table`` chooses; ``pdcore.core.agreement`` decides when to use it.

Segment layout (one file in ``/dev/shm``, created by rank 0)::

    0     header   magic "PDAGREE1", version, world, nbytes, stride, implementation
    64    control  one 64-bit word, alone on its cache line (below)
    128   ranks    per rank 64 bytes: pid (u32), state (u32: 1 attached, 2 closed)
    DATA  slots    2 parities x world slots of ``stride`` bytes (nbytes rounded up to 64)

The control word is ``gen << 34 | dead << 33 | aborted << 32 | arrived``:
``arrived`` is a bitmap of the ranks that have written their slot in round
``gen`` (world <= 32). A round is one barrier:

1. copy the local buffer into ``slots[gen & 1][rank]``;
2. arrive: compare-and-swap the word; the first rank of round ``g`` turns the
   finished word of round ``g - 1`` into ``(g, arrived = {rank})``, the others
   add their bit;
3. wait until the bitmap is full (or the word already moved on to ``g + 1``),
   then take the MIN of the ``world`` slots of parity ``g & 1`` into the
   buffer. A rank reaches round ``g + 2`` (and overwrites parity ``g & 1``)
   only after every rank arrived at ``g + 1``, so after every rank finished
   reading round ``g``: one barrier per round suffices.

Failure detection, never a hang: each rank holds an OFD write lock on byte
``LOCK_BASE + rank`` of the segment file (beyond its end; the lock is a name,
not memory). The kernel drops it when the process dies (a zombie holds no
lock), so a waiter whose missing rank's lock is free knows at once that it
exited. A rank that is alive but stops calling (SIGSTOP, a hang) is caught by
the deadline: ``timeout`` seconds after this rank arrived. The waiter that
decides swaps ``aborted`` (and ``dead``) into the word of the round, unless
the bitmap became full first. Because arrival and abort are swaps of one
word, either the round completed for everyone or it is aborted for everyone:
the ranks waiting see the flag, and a late rank's arrival sees it and fails.
Every rank then raises ``CollectiveError`` in the same round, naming the
missing ranks (from the bitmap), and the reducer stays broken (every later
round raises at once), as a failed gloo group does.

Wait: spin briefly (``SPIN_SECONDS``), then yield the core (until
``YIELD_SECONDS``: on an idle core a yield returns at once, on a busy one it
lets the rank we wait for run), then sleep in growing naps (at most
``MAX_NAP`` seconds), checking locks every ``LIVENESS_EVERY``
seconds and the deadline every pass. No step holds the GIL.

Cleanup: rank 0 unlinks the file's name as soon as every rank attached (the
memory lives on until the last rank unmaps it), so a killed rank leaks no
``/dev/shm`` entry. Should rank 0 itself die in the few milliseconds between
creating and unlinking, the next rank 0 on the host sweeps ``pdcore-agree-*``
files whose rank locks are all free and which are older than ``STALE_AFTER``.

The twins do not interoperate (the compiled one swaps the word with
``__atomic_compare_exchange``, this one takes an OFD lock on byte
``LOCK_BASE - 1`` around plain reads and writes); the header records the
implementation and ranks of one replica must agree on it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import struct
import time
import weakref
from typing import Any

import numpy as np

from .errors import CollectiveError

__all__ = [
    "ShmReducer",
    "Segment",
    "host_key",
    "MAX_WORLD",
    "PREFIX",
    "SHM_DIR",
]

SHM_DIR = "/dev/shm"
PREFIX = "pdcore-agree-"
MAGIC = b"PDAGREE1"
VERSION = 1
MAX_WORLD = 32
HEADER = struct.Struct("=8sIIQQ8s")  # magic, version, world, nbytes, stride, implementation
CONTROL = 64
RANKS = 128
RANK_INFO = struct.Struct("=II")  # pid, state
DATA_ALIGN = 64
LOCK_BASE = 1 << 30  # rank r holds byte LOCK_BASE + r; the pure twin's mutex is LOCK_BASE - 1
STALE_AFTER = 30.0
SPIN_SECONDS = 20e-6  # then yield the core until YIELD_SECONDS, then nap
YIELD_SECONDS = 300e-6
MAX_NAP = 500e-6
LIVENESS_EVERY = 1e-3

ATTACHED = 1
CLOSED = 2

GEN_SHIFT = 34
GEN_MASK = (1 << 30) - 1
ABORTED = 1 << 32
DEAD = 1 << 33
ARRIVED_MASK = (1 << 32) - 1

# status codes of a round, shared by both twins
OK = 0
TIMED_OUT = 1
EXITED = 2
LATE = 3
OUT_OF_STEP = 4

_FLOCK = struct.Struct("hhxxxxqqixxxx")  # struct flock on Linux (x86_64, aarch64)


def data_offset(world: int) -> int:
    return RANKS + 64 * world


def stride_of(nbytes: int) -> int:
    return (nbytes + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN


def segment_size(world: int, nbytes: int) -> int:
    return data_offset(world) + 2 * world * stride_of(nbytes)


def host_key() -> str:
    """Equal on two ranks only if they share a kernel and the same ``/dev/shm``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return f"no-shm:{os.getpid()}:{secrets.token_hex(8)}"  # never equal: no shared memory here
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def _lock(fd: int, offset: int, kind: int, cmd: int) -> int:
    """One OFD lock call on byte ``offset``; returns the ``l_type`` the kernel reports."""
    packed = _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0)
    out = fcntl.fcntl(fd, cmd, packed)
    return _FLOCK.unpack(out)[0]


def holder_gone(fd: int, offset: int) -> bool:
    """No open file description holds a lock on byte ``offset`` (its holder closed or died)."""
    return _lock(fd, offset, fcntl.F_WRLCK, fcntl.F_OFD_GETLK) == fcntl.F_UNLCK


def sweep_stale(now: float | None = None) -> list[str]:
    """Unlink ``pdcore-agree-*`` entries no rank holds any more (a rank 0 died before unlinking)."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < STALE_AFTER:
                continue
            if all(holder_gone(fd, LOCK_BASE + r) for r in range(MAX_WORLD)):
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


class Segment:
    """One rank's mapping of the replica's segment; holds the rank's liveness lock while open."""

    def __init__(self, fd: int, name: str, rank: int, world: int, nbytes: int, owner: bool) -> None:
        self.fd = fd
        self.name = name
        self.rank = rank
        self.world = world
        self.nbytes = nbytes
        self.stride = stride_of(nbytes)
        self.data = data_offset(world)
        self._owner = owner  # rank 0: unlinks the name
        self._linked = owner
        self.map = mmap.mmap(fd, segment_size(world, nbytes))
        self.view = memoryview(self.map)
        self._finalizer = weakref.finalize(self, Segment._release, self.view, self.map, fd)

    @classmethod
    def create(cls, world: int, nbytes: int, implementation: str) -> Segment:
        """Rank 0: a fresh segment with a random name, its header written and its lock held."""
        if not 2 <= world <= MAX_WORLD:
            raise ValueError(f"shared-memory agreement needs 2..{MAX_WORLD} ranks, got {world}")
        sweep_stale()
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _lock(fd, LOCK_BASE, fcntl.F_WRLCK, fcntl.F_OFD_SETLK)
            os.ftruncate(fd, segment_size(world, nbytes))
            seg = cls(fd, name, 0, world, nbytes, owner=True)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        HEADER.pack_into(seg.map, 0, MAGIC, VERSION, world, nbytes, seg.stride, implementation.encode())
        struct.pack_into("=Q", seg.map, CONTROL, (1 << world) - 1)  # round 0: finished by every rank
        seg._set_state(ATTACHED)
        return seg

    @classmethod
    def open(cls, name: str, rank: int, world: int, nbytes: int, implementation: str) -> Segment:
        """Ranks 1..world-1: map rank 0's segment, check its header, take this rank's lock."""
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"{name!r} is not a pdcore agreement segment")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size != segment_size(world, nbytes):
                raise ValueError(f"segment {name} holds {size} bytes, expected {segment_size(world, nbytes)}")
            _lock(fd, LOCK_BASE + rank, fcntl.F_WRLCK, fcntl.F_OFD_SETLK)
            seg = cls(fd, name, rank, world, nbytes, owner=False)
        except BaseException:
            os.close(fd)
            raise
        magic, version, w, n, _, impl = HEADER.unpack_from(seg.map, 0)
        expected = (MAGIC, VERSION, world, nbytes, implementation.encode().ljust(8, b"\0"))
        if (magic, version, w, n, impl) != expected:
            seg.close()
            raise ValueError(f"segment {name} header {(magic, version, w, n, impl)} is not {expected}")
        seg._set_state(ATTACHED)
        return seg

    def _set_state(self, state: int) -> None:
        RANK_INFO.pack_into(self.map, RANKS + 64 * self.rank, os.getpid(), state)

    def rank_info(self, rank: int) -> tuple[int, int]:
        return RANK_INFO.unpack_from(self.map, RANKS + 64 * rank)

    def unlink(self) -> None:
        """Remove the name (rank 0, once every rank attached); the memory stays mapped."""
        if self._linked:
            self._linked = False
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Say this rank left, unmap, drop the lock. Idempotent. Views onto ``map`` must be released first."""
        if self.closed:
            return
        try:
            self._set_state(CLOSED)
        except (ValueError, TypeError):
            pass
        self.unlink()
        self._finalizer()

    @staticmethod
    def _release(view: memoryview, mapping: mmap.mmap, fd: int) -> None:
        try:
            view.release()
            mapping.close()
        except BufferError:
            pass  # a reducer still views it (collected at exit before closing): the process's end unmaps it
        finally:
            os.close(fd)  # with the mapping's own descriptor gone too, drops the rank's lock: the others read "left"


def round_error(seg: Segment, status: int, gen: int, missing: int, timeout: float) -> CollectiveError:
    """The error of a failed round, the same text on every rank (it names the missing ranks)."""
    ranks = [r for r in range(seg.world) if missing >> r & 1]
    def who(r: int) -> str:
        pid, state = seg.rank_info(r)
        return f"rank {r} (pid {pid})" + (" closed its agreement" if state == CLOSED else "")
    names = ", ".join(who(r) for r in ranks) or "no rank"
    where = f"shared-memory agreement round {gen}"
    if status == OUT_OF_STEP:
        return CollectiveError(f"{where}: this rank {seg.rank} is out of step with the replica's rounds")
    if status == EXITED:
        return CollectiveError(f"{where}: {names} exited or left (its lock on the segment is gone); the replica stops")
    if status == LATE:
        return CollectiveError(
            f"{where}: this rank {seg.rank} arrived after the replica gave up on {names} "
            f"(not there within {timeout:g} s)"
        )
    return CollectiveError(
        f"{where}: {names} did not arrive within {timeout:g} s (stopped, hung, or no longer polling); the replica stops"
    )


class ShmReducer:
    """All-reduce MIN of one rank's buffer with the other ranks of its segment (pure-Python twin)."""

    def __init__(self, segment: Segment, timeout: float = 5.0) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._seg = segment
        self._timeout = float(timeout)
        self._gen = 0
        self._broken: CollectiveError | None = None
        self._full = (1 << segment.world) - 1

    @property
    def rounds(self) -> int:
        return self._gen

    def close(self) -> None:
        self._seg.close()

    # -- the word, under the mutex byte ------------------------------------------

    def _acquire(self, deadline: float) -> bool:
        fd = self._seg.fd
        while True:
            try:
                _lock(fd, LOCK_BASE - 1, fcntl.F_WRLCK, fcntl.F_OFD_SETLK)
                return True
            except (BlockingIOError, PermissionError):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0)

    def _release(self) -> None:
        _lock(self._seg.fd, LOCK_BASE - 1, fcntl.F_UNLCK, fcntl.F_OFD_SETLK)

    def _word(self) -> int:
        return struct.unpack_from("=Q", self._seg.map, CONTROL)[0]

    def _swap(self, fn: Any, deadline: float) -> tuple[int, int] | None:
        """Under the mutex, ``new = fn(old)`` (None: leave it); returns (old, new) or None if the mutex
        stayed held past ``deadline`` (its holder stopped)."""
        if not self._acquire(deadline):
            return None
        try:
            old = self._word()
            new = fn(old)
            if new is not None:
                struct.pack_into("=Q", self._seg.map, CONTROL, new)
            return old, old if new is None else new
        finally:
            self._release()

    # -- a round ------------------------------------------------------------------

    def allreduce_min(self, buf: np.ndarray) -> None:
        """Replace ``buf`` (uint8, ``nbytes`` long) with the MIN over every rank's ``buf`` of this round."""
        if self._broken is not None:
            raise self._broken
        seg = self._seg
        if seg.closed:
            raise CollectiveError("the shared-memory agreement is closed")
        if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.shape != (seg.nbytes,):
            raise ValueError(f"buf must be a uint8 array of {seg.nbytes} bytes")
        self._gen += 1
        parity = self._gen & 1
        base = seg.data + parity * seg.world * seg.stride
        n = seg.nbytes
        mine = base + seg.rank * seg.stride
        seg.map[mine : mine + n] = buf.tobytes()
        status, missing = self._round()
        if status != OK:
            self._broken = round_error(seg, status, self._gen, missing, self._timeout)
            raise self._broken
        # every rank's slot of this parity is written and stays so until every rank arrived at the next
        # round; the word was read under the mutex, after the writers' swaps
        slots = np.frombuffer(seg.map, dtype=np.uint8, count=seg.world * seg.stride, offset=base)
        slots = slots.reshape(seg.world, seg.stride)[:, :n]
        np.minimum.reduce(slots, axis=0, out=buf)
        del slots

    def _round(self) -> tuple[int, int]:
        """Arrive at this round's word, then wait for every rank: (status, the missing ranks' bits)."""
        g = self._gen & GEN_MASK
        bit = 1 << self._seg.rank
        started = time.monotonic()
        deadline = started + self._timeout
        status, missing = self._arrive(g, bit, deadline)
        if status != OK:
            return status, missing
        return self._wait_for_all(g, bit, started, deadline)

    def _arrive(self, g: int, bit: int, deadline: float) -> tuple[int, int]:
        """Set this rank's bit in round ``g``'s word, or open round ``g`` if the previous one is complete; a word
        in neither state means this rank came late (the round was aborted) or out of step."""
        prev = (self._gen - 1) & GEN_MASK

        def arrive(w: int) -> int | None:
            if w >> GEN_SHIFT == g and not w & ABORTED:
                return w | bit
            if w >> GEN_SHIFT == prev and w & ARRIVED_MASK == self._full and not w & ABORTED:
                return (g << GEN_SHIFT) | bit
            return None

        swapped = self._swap(arrive, deadline)
        if swapped is None:
            return TIMED_OUT, self._full & ~bit
        old, new = swapped
        if old == new:
            status = LATE if old >> GEN_SHIFT == g and old & ABORTED else OUT_OF_STEP
            return status, self._full & ~(old & ARRIVED_MASK)
        return OK, 0

    def _wait_for_all(self, g: int, bit: int, started: float, deadline: float) -> tuple[int, int]:
        """Read the word until every rank arrived at round ``g`` (OK), or it was aborted; abort it ourselves when
        an absent rank's process is gone or the deadline passed. Spin, then yield, then nap, doubling."""
        seg = self._seg
        next_liveness = started + LIVENESS_EVERY
        nap = 0.0
        while True:
            read = self._swap(lambda x: None, deadline + 1.0)  # under the mutex: plain reads raced with it
            if read is None:
                return TIMED_OUT, self._full & ~bit
            w = read[0]
            if w >> GEN_SHIFT != g or w & ARRIVED_MASK == self._full:
                return OK, 0  # everyone arrived (or the word already moved on to the next round)
            if w & ABORTED:
                return (EXITED if w & DEAD else TIMED_OUT), self._full & ~(w & ARRIVED_MASK)
            now = time.monotonic()
            gone = 0
            if now >= next_liveness:
                next_liveness = now + LIVENESS_EVERY
                absent = self._full & ~(w & ARRIVED_MASK)
                gone = sum(1 << r for r in range(seg.world) if absent >> r & 1 and holder_gone(seg.fd, LOCK_BASE + r))
            if gone or now >= deadline:
                flag = ABORTED | (DEAD if gone else 0)

                def abort(x: int) -> int | None:
                    if x >> GEN_SHIFT == g and x & ARRIVED_MASK != self._full and not x & ABORTED:
                        return x | flag
                    return None

                if self._swap(abort, now + 0.2 if now >= deadline else deadline) is None:
                    return TIMED_OUT, self._full & ~(w & ARRIVED_MASK)
                continue  # the next pass reads the outcome: aborted by us or another, or completed
            if now - started < SPIN_SECONDS:
                continue
            if now - started < YIELD_SECONDS:
                time.sleep(0)
                continue
            nap = min(MAX_NAP, nap * 2 or 20e-6)
            time.sleep(nap)
