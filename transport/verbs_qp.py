"""The verbs transport's queue pairs: making them, moving them to RTS or to the error state, and the
send side of a source's queue pair, from posting RDMA WRITEs to reaping their completions.

It exists so that the rules of one RC queue pair's send queue (how many WRs may be outstanding,
which are signalled, when a batch counts as complete, what an error completion means) sit in one
place with the state they govern, apart from the threads, sockets and peers of
``transport/verbs_source.py``, which calls ``SendQueue.post`` from ``write`` and ``SendQueue.reap`` from
its completion thread, each under the peer's lock.

Writes and completions
----------------------
``write`` validates every write against the local regions and the peer's last
endpoint, then posts the batch as a chain of RDMA WRITE work requests (one SGE
each; a write longer than the port's ``max_msg_sz``, 8 MiB on rxe, as several:
one longer message fails the queue pair at the sink) with ``ibv_post_send``. Selective signalling: a WR is signalled if it
ends its batch, ends a post (the send queue is full), or is every
``max_send_wr // 4``-th; never more than ``max_send_wr`` WRs are outstanding on
the QP, and the rest of a long batch is posted as completions retire earlier
WRs. An empty batch posts one zero-length RDMA WRITE: the RC queue completes it
after every earlier WR, which makes it the fence the contract asks for.

The completion thread polls the CQs of the peers with work in flight
(pyverbs 44 exposes neither the completion channel's fd nor a GIL-free wait,
so it polls with a short back-off and sleeps on a condition when nothing is in
flight), retires WRs, completes batches in order and posts what waits. A
work completion with an error status fails the batch that holds that WR with
``TransportError`` naming the status (``IBV_WC_REM_ACCESS_ERR`` for a target
the sink no longer has registered, ``IBV_WC_RETRY_EXC_ERR`` for a peer that
stopped answering, ...); the QP is then in the error state, so every later
batch in flight fails too, the peer is torn down and ``write`` to it raises at
once until the caller ``connect``\\ s again. A peer with batches in flight and
no completion for ``peer_timeout`` seconds is failed the same way (``ETIMEDOUT``);
the QP's own ack timeout and retry count are set to give up well before that.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
from collections import deque
from dataclasses import dataclass
from typing import Any

from .completions import OnDone
from .errors import TransportError
from .verbs_device import Device, gid_str, pv, rdma_errno

__all__ = ["SendQueue", "WrBatch", "WrPool", "make_qp", "qp_to_error", "to_rts", "wc_status_name"]

#: one RDMA WRITE: (local addr, lkey, remote addr, rkey, length)
Wr = tuple[int, int, int, int, int]

_HOP_LIMIT = 64
_SHALLOW = 4  # batches in flight up to which every batch end is signalled (lowest latency)
_BATCHES_PER_SIGNAL = 8  # beyond that, one signalled batch end in this many


def _wc_status_names() -> dict[int, str]:
    if pv is None:
        return {}
    names = {getattr(pv.e, n): n for n in dir(pv.e) if n.startswith("IBV_WC_") and n.endswith("_ERR")}
    names[pv.e.IBV_WC_SUCCESS] = "IBV_WC_SUCCESS"
    return names


_WC_NAMES = _wc_status_names()


def wc_status_name(status: int) -> str:
    """``"IBV_WC_REM_ACCESS_ERR (remote access error)"`` for a work-completion status."""
    name = _WC_NAMES.get(status, f"IBV_WC status {status}")
    return f"{name} ({pv.status_str(status)})" if pv is not None else name


def _wc_errno(status: int) -> int:
    e = pv.e
    return {
        e.IBV_WC_REM_ACCESS_ERR: errno_mod.EFAULT,
        e.IBV_WC_LOC_PROT_ERR: errno_mod.EFAULT,
        e.IBV_WC_LOC_ACCESS_ERR: errno_mod.EFAULT,
        e.IBV_WC_RETRY_EXC_ERR: errno_mod.ETIMEDOUT,
        e.IBV_WC_RESP_TIMEOUT_ERR: errno_mod.ETIMEDOUT,
        e.IBV_WC_RNR_RETRY_EXC_ERR: errno_mod.ETIMEDOUT,
        e.IBV_WC_WR_FLUSH_ERR: errno_mod.ECANCELED,
    }.get(status, errno_mod.EIO)


# ---------------------------------------------------------------------- queue pairs


def make_qp(pd: Any, cq: Any, send_wr: int) -> Any:
    """An RC QP in the RESET state whose sends and receives complete on ``cq``; no WR is signalled unless asked."""
    cap = pv.QPCap(max_send_wr=send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    init = pv.QPInitAttr(qp_type=pv.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
    return pv.QP(pd, init)


def to_rts(
    qp: Any, dev: Device, *, rqpn: int, rpsn: int, lpsn: int, gid: bytes, lid: int, mtu: int, timeout: int, retry_cnt: int
) -> None:
    """Connect ``qp`` to the remote QP ``rqpn`` (at ``gid``/``lid``) and move it to RTS; ``timeout`` is
    the ack timeout exponent (4.096 us * 2**n) and ``retry_cnt`` the retries before it gives up."""
    e = pv.e
    attr = pv.QPAttr(port_num=dev.port, path_mtu=mtu)
    attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    attr.pkey_index = 0
    attr.dest_qp_num = rqpn
    attr.rq_psn = rpsn
    attr.sq_psn = lpsn
    attr.max_dest_rd_atomic = 1
    attr.max_rd_atomic = 1
    attr.min_rnr_timer = 12
    attr.timeout = timeout
    attr.retry_cnt = retry_cnt
    attr.rnr_retry = min(retry_cnt, 6)
    gr = pv.GlobalRoute(dgid=pv.GID(gid_str(gid)), sgid_index=dev.gid_index, hop_limit=_HOP_LIMIT)
    attr.ah_attr = pv.AHAttr(port_num=dev.port, is_global=1, dlid=lid, gr=gr)
    qp.to_rts(attr)


def qp_to_error(qp: Any) -> None:
    """Move ``qp`` to the error state (its outstanding WRs are flushed); a failure is ignored."""
    attr = pv.QPAttr(qp_state=pv.e.IBV_QPS_ERR)
    with contextlib.suppress(pv.Error):
        qp.modify(attr, pv.e.IBV_QP_STATE)


# ---------------------------------------------------------------------- a source QP's send side


@dataclass(slots=True, eq=False)
class WrBatch:
    """One ``write`` call's batch as its WRs; ``batch_id`` 0 is a bare fence WR the completion thread posted."""

    batch_id: int
    wrs: list[Wr]  # [] = fence
    on_done: OnDone | None
    posted: int = 0  # WRs of this batch posted so far
    last_wr: int = 0  # wr_id of its last WR, once all are posted
    grant: int = 0  # the grant key it writes through, counted in SourceWindows.busy (windows only)
    error: TransportError | None = None  # refused before posting: a fence WR keeps its place in the order


class WrPool:
    """Send WRs made once per peer and refilled in place for every post.

    Creating pyverbs objects per write is most of a single-write batch's CPU
    (each costs a logger lookup and two mallocs). Each pooled WR reads its own
    SGE: pyverbs 44 can only point ``SendWR.sg_list`` at an SGE, so the copy
    the WR was built with is freed (``close()``) and the pointer then set; at
    the end only the SGEs are closed, never the WRs again. pyverbs cannot clear
    a ``next_wr`` either, so ``tail`` is never given one: it ends every chain.
    A WR may be refilled once ``post_send`` returned (the provider copied it).
    """

    __slots__ = ("_links", "tail")

    def __init__(self) -> None:
        self._links: list[tuple[Any, Any]] = []
        self.tail = self._make()

    @staticmethod
    def _make() -> tuple[Any, Any]:
        sge = pv.SGE(0, 0, 0)
        wr = pv.SendWR(opcode=pv.e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=0)
        wr.close()
        wr.sg_list = sge
        return wr, sge

    def link(self, i: int) -> tuple[Any, Any]:
        """The ``i``-th WR of a chain, not its last (made on first use; at most ``max_send_wr - 1``)."""
        while len(self._links) <= i:
            self._links.append(self._make())
        return self._links[i]

    def close(self) -> None:
        for _wr, sge in (*self._links, self.tail):
            sge.close()
        self._links = []


class SendQueue:
    """A source QP's send side: the QP, its own CQ, the batches not yet complete and the WR accounting.

    Every method runs under the owning peer's lock, and only while that peer has not failed (the
    transport checks both). ``inflight`` holds every batch not completed, in order; ``unposted``
    those not wholly posted yet (its head may be partly posted). A wr_id at or below ``retired``
    has completed; never more than ``depth`` WRs are outstanding.
    """

    __slots__ = (
        "qp", "cq", "wrs", "depth", "signal_every", "unposted", "inflight",
        "next_wr", "retired", "since_signal", "unsignalled_batches", "last_signalled",
    )

    def __init__(self, ctx: Any, pd: Any, depth: int) -> None:
        """A QP of ``depth`` send WRs on a CQ of its own (one peer's flushes can never overrun another's
        CQ); ``pv.Error`` if the device refuses, with nothing left behind."""
        with contextlib.ExitStack() as undo:
            self.cq = pv.CQ(ctx, depth + 16)
            undo.callback(self.cq.close)
            self.qp = make_qp(pd, self.cq, depth)
            undo.callback(self.qp.close)
            self.wrs = WrPool()
            undo.pop_all()
        self.depth = depth
        self.signal_every = max(1, depth // 4)
        self.unposted: deque[WrBatch] = deque()
        self.inflight: deque[WrBatch] = deque()
        self.next_wr = 1
        self.retired = 0
        self.since_signal = 0
        self.unsignalled_batches = 0
        self.last_signalled = 0  # wr_id of the last signalled WR posted

    def close(self) -> None:
        """Free the WR pool, move the QP to the error state, destroy it and the CQ (failures ignored)."""
        self.wrs.close()
        qp_to_error(self.qp)
        with contextlib.suppress(pv.Error):
            self.qp.close()
        with contextlib.suppress(pv.Error):
            self.cq.close()

    def post(self, *, flush: bool = False) -> TransportError | None:
        """Post waiting WRs while the send queue has room; an error means: fail the peer.

        Signalling: a WR is signalled if the send queue is full after it, every ``max_send_wr // 4``-th
        WR, and at a batch end while few batches are in flight (or every ``_BATCHES_PER_SIGNAL``-th
        batch end when many are). A batch whose end is unsignalled completes when a later signalled
        WR does (an RC queue completes in order); if nothing later is signalled, ``reap`` posts a
        signalled zero-length WRITE (``flush=True``) once the CQ has caught up.
        """
        room = self.depth - (self.next_wr - 1 - self.retired)
        if room <= 0 or not (self.unposted or flush):
            return None
        signalled = pv.e.IBV_SEND_SIGNALED
        posts: list[tuple[int, int, int, int, int, int, int]] = []  # (wr_id, flags, la, lkey, ra, rkey, n)
        deep = len(self.inflight) > _SHALLOW
        if flush and not self.unposted:
            self.unposted.append(WrBatch(0, [], None))  # a bare fence WR, owned by no batch
        while self.unposted and room > 0:
            b = self.unposted[0]
            items = b.wrs or [(0, 0, 0, 0, 0)]  # the fence: one zero-length WRITE
            while b.posted < len(items) and room > 0:
                la, lkey, ra, rkey, n = items[b.posted]
                b.posted += 1
                room -= 1
                wr_id = self.next_wr
                self.next_wr += 1
                self.since_signal += 1
                last = b.posted == len(items)
                if last:
                    self.unsignalled_batches += 1
                signal = (
                    room == 0
                    or self.since_signal >= self.signal_every
                    or (last and (not deep or n == 0 or self.unsignalled_batches >= _BATCHES_PER_SIGNAL))
                )
                if signal:
                    self.since_signal = 0
                    self.unsignalled_batches = 0
                    self.last_signalled = wr_id
                posts.append((wr_id, signalled if signal else 0, la, lkey, ra, rkey, n))
                if last:
                    b.last_wr = wr_id
            if b.posted == len(items):
                self.unposted.popleft()
        pool = self.wrs
        end = len(posts) - 1
        prev = None
        for i, (wr_id, flags, la, lkey, ra, rkey, n) in enumerate(posts):
            wr, sge = pool.tail if i == end else pool.link(i)
            wr.wr_id, wr.send_flags, wr.num_sge = wr_id, flags, 1 if n else 0
            wr.set_wr_rdma(rkey, ra)
            sge.addr, sge.length, sge.lkey = la, n, lkey
            if prev is not None:
                prev.next_wr = wr
            prev = wr
        try:
            self.qp.post_send(pool.tail[0] if end == 0 else pool.link(0)[0])
        except pv.Error as ex:
            return TransportError(f"ibv_post_send failed: {ex}", op="write", errno=rdma_errno(ex))
        return None

    def reap(self) -> tuple[bool, list[WrBatch], TransportError | None]:
        """Poll the CQ once: retire WRs, take the batches now complete (in order), post what waits, and
        make an unsignalled tail complete. Returns whether any completion came, the completed
        batches, and the error that fails the peer (an error completion, or a failed poll or post)."""
        e = pv.e
        failure: TransportError | None = None
        try:
            _n, wcs = self.cq.poll(64)
        except pv.Error as ex:
            wcs = []
            failure = TransportError(f"polling the CQ failed: {ex}", op="write", errno=rdma_errno(ex))
        for wc in wcs:
            if wc.status == e.IBV_WC_SUCCESS:
                self.retired = max(self.retired, wc.wr_id)
                continue
            if wc.status != e.IBV_WC_WR_FLUSH_ERR:
                # RC completes in order: every WR before the failing one has landed
                self.retired = max(self.retired, wc.wr_id - 1)
            failure = self._wc_failure(wc.wr_id, wc.status, wc.vendor_err)
            break
        done: list[WrBatch] = []
        while self.inflight and self.inflight[0].last_wr and self.inflight[0].last_wr <= self.retired:
            done.append(self.inflight.popleft())
        if failure is None and self.unposted:
            failure = self.post()
        if failure is None and self.inflight and not self.unposted and self.retired >= self.last_signalled:
            failure = self.post(flush=True)  # the tail was unsignalled: make it complete
        return bool(wcs), done, failure

    def _wc_failure(self, wr_id: int, status: int, vendor_err: int) -> TransportError:
        which = next((b.batch_id for b in self.inflight if b.last_wr == 0 or b.last_wr >= wr_id), None)
        return TransportError(
            f"RDMA WRITE failed: work completion {wc_status_name(status)} (vendor error {vendor_err:#x}) "
            f"on QP {self.qp.qp_num}, batch {which}",
            op="write",
            errno=_wc_errno(status),
        )
