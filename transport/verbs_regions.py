"""What a verbs sink opens to remote writes: its memory regions, and the memory windows bound over them.

It exists so that the device's access rules live in one place: which MR gets remote write and which
only ``IBV_ACCESS_MW_BIND``, which key names a region, and how a type 2 window is bound, invalidated
and freed on a sink queue pair. ``transport/verbs_grants.py`` decides when (a grant, a revoke, a source
that connects or goes away); ``transport/windows.py`` has what needs no device (which windows a
grant needs, the ``W``/``S`` frames, the source's table of rkeys).

Regions
-------
One memory region (MR) per ``register``, with local-write and remote-write access; with memory
windows, a region registered with ``require_grant=True`` gets local write and ``IBV_ACCESS_MW_BIND``
but no remote write, and the endpoint carries it with key 0: its own rkey opens nothing and never
leaves the sink. A region's ``key`` is the MR's rkey (for such a region, its lkey). Deregistering a
sink region revokes its rkey at once: a write still in flight into it fails with
``IBV_WC_REM_ACCESS_ERR`` (the sink's hardware checks it, not the sink's CPU). Don't deregister a
*source* region while a batch reads from it (that batch fails with a local protection error).

Memory windows
--------------
A grant is one type 2 window per contiguous range (ranges that touch inside one region are one
window; never a span over bytes the grant does not hold; at most ``max_windows`` per grant), bound
with ``IBV_WR_BIND_MW`` on the sink QP of each connection of the grant's source, so only that
source's QP can write through it. A sink QP posts nothing else: its binds and invalidations
(``IBV_WR_LOCAL_INV``) are posted and their completions reaped from the sink CQ here, in turn,
under the transport's ``_mw_lock``.

What invalidation promises on rxe (Debian 6.1 kernel), measured by
tests/rdma/test_windows_verbs.py: the responder checks the rkey of every
packet of a WRITE, not only the first, so a multi-packet WRITE under way when
the invalidation completes lands nothing more, and its source sees
``IBV_WC_REM_ACCESS_ERR``. A WRITE with a region's own rkey, an invented rkey
or a revoked window's lands nothing and fails the same way, which moves that
queue pair to the error state (an RC access error is fatal to the QP on both
sides): only a source that bypasses this code's checks loses its connection.
The one window the device cannot close is a packet already being copied when
the invalidation completes; the answer ``s`` (nothing in flight, see "Grants and
revoke" in ``transport/verbs_grants.py``) is what rules that out for a source running
this code, and the cut for any other.
rkeys are 24-bit window indices and an 8-bit key; rxe allocates indices
cyclically, so a revoked window's rkey names no live window until about
``max_mw`` windows later.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from .deadline import Deadline
from .errors import TransportError
from .regions import Region, RegionTable, buffer_span
from .verbs_device import pv, rdma_errno
from .verbs_qp import wc_status_name
from .windows import encode_windows

__all__ = ["SINK_WR", "MemoryRegions", "Window", "WindowOps", "free_windows", "probe_windows", "windows_frame"]

log = logging.getLogger("transport.verbs")

SINK_WR = 64  # send WRs of a sink QP: binds and invalidations of windows, posted and reaped in turn
#: a bound window: (MW, addr, length, rkey)
Window = tuple[Any, int, int, int]


class MemoryRegions:
    """The transport's registered regions: the table, each region's MR by key, what keeps its memory
    alive, and which regions only a grant's windows open (``guarded``)."""

    __slots__ = ("table", "mrs", "_owners", "_guarded", "_pd", "_windows", "_access")

    def __init__(self, pd: Any, windows: bool) -> None:
        e = pv.e
        self.table = RegionTable()
        self.mrs: dict[int, Any] = {}  # region key (rkey, or lkey of a guarded MR) -> MR
        self._owners: dict[int, Any] = {}  # region key -> what keeps the memory alive
        self._guarded: set[int] = set()  # keys of regions only windows open (require_grant, with windows)
        self._pd = pd
        self._windows = windows
        self._access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_MW_BIND if windows else 0)

    def register(self, buf: Any, require_grant: bool) -> Region:
        addr, length, owner = buffer_span(buf)
        if self.table.find(addr, 1) is not None or self.table.find(addr + length - 1, 1) is not None:
            raise ValueError(f"[{addr:#x}, +{length}) overlaps a registered region")
        guarded = require_grant and self._windows
        access = self._access | (0 if guarded else pv.e.IBV_ACCESS_REMOTE_WRITE)
        try:
            mr = pv.MR(self._pd, length, access, address=addr)
        except pv.Error as ex:
            raise TransportError(f"registering [{addr:#x}, +{length}) failed: {ex}", op="register", errno=rdma_errno(ex)) from ex
        # a region's key names its MR here: the rkey, or for a guarded MR (no remote access, so no
        # rkey: rxe gives them all 0) its lkey; a device's keys name one MR each
        key = mr.lkey if guarded else mr.rkey
        region = Region(addr, length, key)
        try:
            self.table.add(region)
        except ValueError:
            mr.close()
            raise
        self.mrs[key] = mr
        self._owners[key] = owner
        if guarded:
            self._guarded.add(key)
        return region

    def deregister(self, region: Region) -> None:
        if not self.table.remove(region):
            return
        mr = self._forget(region)
        if mr is not None:
            try:
                mr.close()
            except pv.Error as ex:
                raise TransportError(f"deregistering {region} failed: {ex}", op="deregister", errno=rdma_errno(ex)) from ex

    def advertised(self) -> tuple[Region, ...]:
        """The regions as the endpoint carries them: a guarded region with key 0 (no source learns its key)."""
        return tuple(Region(r.addr, r.length, 0) if r.key in self._guarded else r for r in self.table.snapshot())

    def mr_at(self, addr: int, length: int) -> Any | None:
        """The MR of the region that holds ``[addr, +length)``, or None."""
        region = self.table.find(addr, length)
        return self.mrs.get(region.key) if region is not None else None

    def close(self) -> list[Exception]:
        """Deregister every region; the errors of the MRs that could not be freed."""
        errors: list[Exception] = []
        for region in self.table.clear():
            mr = self._forget(region)
            if mr is not None:
                try:
                    mr.close()
                except pv.Error as ex:
                    errors.append(ex)
        return errors

    def _forget(self, region: Region) -> Any | None:
        self._owners.pop(region.key, None)
        self._guarded.discard(region.key)
        return self.mrs.pop(region.key, None)


def probe_windows(ctx: Any, pd: Any, want: bool | None) -> tuple[bool, str]:
    """Whether this device binds type 2 memory windows (one is allocated and freed to be sure), and why not."""
    if want is False:
        return False, "memory windows are off (memory_windows=False)"
    e = pv.e
    try:
        attr = ctx.query_device()
    except pv.Error as ex:
        return False, f"query_device failed: {ex}"
    flags = attr.device_cap_flags
    type_2 = getattr(e, "IBV_DEVICE_MEM_WINDOW_TYPE_2B", 0) | getattr(e, "IBV_DEVICE_MEM_WINDOW_TYPE_2A", 0)
    if not attr.max_mw or not flags & e.IBV_DEVICE_MEM_WINDOW or not flags & type_2:
        return False, f"the device has no type 2 memory windows (max_mw {attr.max_mw})"
    try:
        pv.MW(pd, e.IBV_MW_TYPE_2).close()
    except pv.Error as ex:
        return False, f"allocating a type 2 memory window failed: {ex}"
    return True, ""


def windows_frame(key: int, made: list[Window]) -> bytes:
    """The ``W`` frame of grant ``key``'s windows bound on one connection."""
    return encode_windows(key, [(a, n, rkey) for _mw, a, n, rkey in made])


def free_windows(made: list[Window]) -> None:
    for mw, *_ in made:
        with contextlib.suppress(pv.Error):
            mw.close()  # ibv_dealloc_mw: invalidates a window still bound


class _BindFailed(Exception):
    """Binding a grant's memory windows failed (the message says why)."""


class WindowOps:
    """Binds and invalidates type 2 windows on sink QPs, whose completions all arrive on the one sink CQ.

    Every call runs under the transport's ``_mw_lock``: nothing else posts on sink QPs, so every
    completion on the sink CQ is one of these.
    """

    __slots__ = ("_pd", "_cq", "_next_wr")

    def __init__(self, pd: Any, cq: Any) -> None:
        self._pd = pd
        self._cq = cq
        self._next_wr = 1  # wr_id of the next bind or invalidation

    def bind(self, qp: Any, key: int, spans: list[tuple[int, int]], regions: MemoryRegions) -> list[Window] | None:
        """Bind one window per span of grant ``key`` on ``qp``; None if that failed (logged; nothing stays bound)."""
        e = pv.e
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        made: list[Window] = []
        wrs = []
        try:
            for a, n in spans:
                mr = regions.mr_at(a, n)
                if mr is None:
                    raise _BindFailed(f"[{a:#x}, +{n}) is no longer registered")
                mw = pv.MW(self._pd, e.IBV_MW_TYPE_2)
                wr = pv.SendWR(opcode=e.IBV_WR_BIND_MW, send_flags=e.IBV_SEND_SIGNALED)
                wr.set_bind_wr(mw, pv.MWBindInfo(mr, a, n, access))
                made.append((mw, a, n, wr.rkey))
                wrs.append(wr)
            why = self._post(qp, wrs)
            if why:
                raise _BindFailed(why)
        except (pv.Error, _BindFailed) as ex:
            log.warning("verbs transport: binding %d memory window(s) of grant %d failed: %s", len(spans), key, ex)
            free_windows(made)
            return None
        return made

    def invalidate(self, qp: Any, key: int, made: list[Window]) -> bool:
        """Invalidate grant ``key``'s windows ``made`` on ``qp`` and free them; True if that failed (logged)."""
        e = pv.e
        wrs = []
        for _mw, _a, _n, rkey in made:
            wr = pv.SendWR(opcode=e.IBV_WR_LOCAL_INV, send_flags=e.IBV_SEND_SIGNALED)
            wr.imm_data = rkey  # pyverbs 44 carries invalidate_rkey in imm_data's place (one union)
            wrs.append(wr)
        try:
            why = self._post(qp, wrs)
        except pv.Error as ex:
            why = str(ex)
        free_windows(made)
        if why:
            log.warning("verbs transport: invalidating the windows of grant %d failed: %s", key, why)
        return bool(why)

    def _post(self, qp: Any, wrs: list[Any]) -> str:
        """Post ``wrs`` (signalled binds or invalidations) on a sink QP, ``SINK_WR`` at a time, and
        reap their completions from the sink CQ; '' if all succeeded, else why not."""
        deadline = Deadline.after(5.0)
        for at in range(0, len(wrs), SINK_WR):
            chunk = wrs[at : at + SINK_WR]
            first = self._next_wr
            self._next_wr += len(chunk)
            for i, wr in enumerate(chunk):
                wr.wr_id = first + i
                qp.post_send(wr)
            left = len(chunk)
            why = ""
            spins = 0
            while left:
                _n, wcs = self._cq.poll(SINK_WR)
                for wc in wcs:
                    if wc.wr_id < first:
                        continue  # of an earlier call that gave up waiting
                    left -= 1
                    if wc.status != pv.e.IBV_WC_SUCCESS and not why:
                        why = f"work completion {wc_status_name(wc.status)}"
                if not wcs:
                    if deadline.expired():
                        return f"{left} window operation(s) not completed within 5 s"
                    spins += 1
                    time.sleep(0 if spins < 64 else 1e-4)
            if why:
                return why
        return ""
