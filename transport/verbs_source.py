"""The verbs transport's source side: ``connect`` (the handshake, from the source), ``write`` (its
checks, the grant's windows, posting) and the completion thread that reaps what was posted.

It exists so that everything a source does to one sink (its queue pair's send side, its liveness
socket, what the sink granted it) sits with the thread that watches it make progress. The sink's
side of the handshake is ``transport/verbs_sink.py``; the send queue's own rules (signalling,
batch completion, error completions) are ``transport/verbs_qp.py``'s ("Writes and completions");
the cm thread that reads the liveness socket is in ``transport/verbs.py``.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import operator
import os
import socket
import time

from . import verbs_hello as hello
from .base import (
    NONCE_BYTES,
    Batch,
    Completion,
    OnDone,
    PeerHandle,
    RegionTable,
    as_batch,
    auth_failed,
    check_note,
    decode_endpoint,
    deliver,
    take_slot,
)
from .deadline import Deadline
from .errors import TransportError
from .limits import U64_MAX
from .verbs_device import pv, rdma_errno
from .verbs_liveness import receiver, send_frame
from .verbs_qp import SendQueue, Wr, WrBatch
from .verbs_state import VerbsPeer, VerbsState
from .windows import encode_stop

__all__ = ["VerbsSource"]

_IDLE_WAIT = 0.1  # completion thread, nothing in flight: re-check the stop flag this often


class VerbsSource(VerbsState):
    """A source's connections, writes and completions (one room of ``VerbsTransport``)."""

    def connect(self, peer_endpoint: bytes, *, deadline: Deadline) -> PeerHandle:
        self._check_open("connect")
        remote = decode_endpoint(peer_endpoint, expect=self.name)
        addr = hello.decode_address(remote.address)
        if addr.link_layer != self._dev.link_layer:
            raise TransportError(
                f"peer link layer {addr.link_layer} differs from ours ({self._dev.link_layer}): no route", op="connect"
            )
        where = f"{addr.host}:{addr.port}"
        psn = int.from_bytes(os.urandom(3), "little")
        with contextlib.ExitStack() as stack:
            try:
                sq = SendQueue(self._ctx, self._pd, self._max_send_wr)
            except pv.Error as ex:
                raise TransportError(f"creating a QP failed: {ex}", op="connect", errno=rdma_errno(ex)) from ex
            stack.callback(sq.close)
            try:
                sock = socket.create_connection((addr.host, addr.port), timeout=max(deadline.remaining(), 1e-3))
            except OSError as ex:
                raise TransportError(f"cannot reach the peer's handshake listener {where}: {ex}", op="connect", errno=ex.errno) from ex
            stack.callback(sock.close)
            recv = receiver(sock, deadline)
            info = hello.QP_INFO.pack(sq.qp.qp_num, psn, self._dev.gid, self._dev.lid, self._dev.mtu)
            try:
                reply = self._hello(sock, where, hello.Hello(remote.instance, self._instance, info=info), deadline)
            except OSError as ex:
                raise TransportError(f"handshake with {where} failed: {ex}", op="connect", errno=ex.errno) from ex
            refused = hello.refusal(reply, where)
            if refused is not None:
                raise refused
            try:
                floor, live, win = hello.read_grants(recv, where)
            except OSError as ex:
                raise TransportError(f"handshake with {where} failed: {ex}", op="connect", errno=ex.errno) from ex
            try:
                self._to_rts(sq.qp, rqpn=reply.qpn, rpsn=reply.psn, lpsn=psn, gid=addr.gid, lid=addr.lid,
                             mtu=min(reply.mtu, self._dev.mtu))
            except pv.Error as ex:
                raise TransportError(f"moving the QP to RTS failed: {ex}", op="connect", errno=rdma_errno(ex)) from ex
            sock.setblocking(False)
            peer = VerbsPeer(
                next(self._peer_ids), remote, RegionTable(remote.regions), sq=sq, sock=sock,
                grant_floor=floor, grant_live=live, win=win,
            )
            peer.last_progress = time.monotonic()
            with self._lock:
                if self._closed:
                    raise TransportError("transport is closed", op="connect")
                self._peers[peer.id] = peer
            stack.pop_all()
        self._watch(sock, peer)
        return peer

    def _hello(self, sock: socket.socket, where: str, h: hello.Hello, deadline: Deadline) -> hello.Reply:
        """Send the hello ``h`` (with a secret: without its QP information, then check the sink's challenge
        and send our proof, which carries it); return the sink's last reply."""
        recv = receiver(sock, deadline)
        key = self._key
        sock.settimeout(max(deadline.remaining(), 1e-3))
        if key is None:
            sock.sendall(hello.encode_hello(h))
            return hello.decode_reply(recv(hello.REPLY.size))
        h = hello.Hello(h.sink, h.source, os.urandom(NONCE_BYTES), h.info)
        sock.sendall(hello.encode_hello(h))
        reply = hello.decode_reply(recv(hello.REPLY.size))
        if reply.magic != hello.MAGIC or reply.version != hello.VERSION or reply.status != hello.OK:
            return reply
        proof = hello.prove(key, h, recv(hello.CHALLENGE.size))
        if proof is None:
            raise auth_failed(where, "it could not prove that it holds the deployment secret (different secrets?)")
        sock.sendall(proof)
        return hello.decode_reply(recv(hello.REPLY.size))

    def refresh(self, peer: PeerHandle, peer_endpoint: bytes) -> None:
        remote = decode_endpoint(peer_endpoint, expect=self.name)
        if remote.instance != peer.remote.instance:
            raise TransportError("refresh: the endpoint is of another transport instance", op="refresh")
        peer.remote, peer.regions = remote, RegionTable(remote.regions)

    def disconnect(self, peer: PeerHandle, *, deadline: Deadline | None = None) -> None:
        p = self._own(peer, "disconnect")
        self._fail_peer(p, TransportError("peer disconnected", op="disconnect", errno=errno_mod.ECANCELED))
        with self._lock:
            self._peers.pop(p.id, None)

    def write(self, peer: PeerHandle, batch: Batch, on_done: OnDone | None = None, *,
              deadline: Deadline | None = None, grant: int = 0, note: bytes = b"") -> int:
        """With memory windows each WRITE carries the rkey of grant ``grant``'s window that holds it (a
        write outside them fails its batch; an unknown or revoked key raises ``EACCES``; a key whose
        windows have not arrived yet waits for them, at most ``deadline`` or 1 s). Without windows
        ``grant`` is not sent (the WRITE carries the region's rkey); it must be a u64, and not a key
        the sink had revoked when this connection was made (module docstring). A non-empty ``note``
        raises: verbs carries none (``carries_notes``)."""
        if note or type(note) is not bytes:
            check_note(note, len(as_batch(batch)), grant, self.carries_notes, self.name)
        p = self._own(peer, "write")
        try:
            key = operator.index(grant)
        except TypeError:
            raise TransportError(f"a grant key is an unsigned 64-bit int, got {grant!r}", op="write") from None
        if not 0 <= key <= U64_MAX:
            raise TransportError(f"a grant key is an unsigned 64-bit value, got {grant!r}", op="write")
        if p.win is None and key and key <= p.grant_floor and key not in p.grant_live:
            raise TransportError(
                f"grant {key} was not live at the sink when this connection was made (revoked): nothing is posted",
                op="write",
                errno=errno_mod.EACCES,
            )
        wrs: list[Wr] = []
        remote = p.regions
        local = self._regions
        for la, ra, n in _rows(batch):
            loc = local.find(la, n)
            if loc is None:
                raise TransportError(f"local range [{la:#x}, +{n}) is not inside a registered region", op="write")
            rem = remote.find(ra, n)
            if rem is None:
                raise TransportError(f"remote range [{ra:#x}, +{n}) is not inside a region the peer announced", op="write")
            mr = self._mrs.get(loc.key)
            if mr is None:
                raise TransportError(f"local range [{la:#x}, +{n}) was deregistered", op="write")
            step = self._dev.max_msg  # rxe: 8 MiB; a longer message fails the QP at the sink
            for off in range(0, n, step):
                wrs.append((la + off, mr.lkey, ra + off, rem.key, min(step, n - off)))
        with p.lock:
            self._check_usable(p)
            refused = None
            if p.win is not None:
                wrs, refused = self._through_windows(p, key, wrs, deadline)
            take_slot(p, self._max_inflight, deadline, self._check_usable)
            sq = p.sq
            assert sq is not None  # set until the peer fails, and _check_usable saw it had not
            batch_id = next(self._batch_ids)
            b = WrBatch(batch_id, wrs, on_done, error=refused)
            if key and p.win is not None and refused is None:
                b.grant = key
                p.win.began(key)
            if not sq.inflight:
                p.last_progress = time.monotonic()
            sq.inflight.append(b)
            sq.unposted.append(b)
            failure = sq.post()
        if failure is not None:
            self._fail_peer(p, failure)
        else:
            with self._work:
                self._posts += 1
                self._work.notify()
        return batch_id

    def _through_windows(
        self, p: VerbsPeer, key: int, wrs: list[Wr], deadline: Deadline | None
    ) -> tuple[list[Wr], TransportError | None]:
        """``wrs`` with each remote rkey replaced by its window's (holding ``p.lock``), or why the batch fails."""
        win = p.win
        assert win is not None
        if key:
            if not win.known(key):  # the sink sent the windows before the key was announced: they are on the way
                wait = min(deadline.remaining() if deadline is not None else 1.0, self._peer_timeout)
                p.lock.wait_for(lambda: win.known(key) or p.error is not None or p.closed, timeout=wait)
                self._check_usable(p)
            if key not in win.grants:
                raise TransportError(
                    f"grant {key} is not live at the sink for this connection (revoked, not granted to this "
                    f"source, or its windows did not arrive): nothing is posted",
                    op="write",
                    errno=errno_mod.EACCES,
                )
        out = []
        for i, (la, lkey, ra, rkey, n) in enumerate(wrs):
            if key:
                windowed = win.rkey(key, ra, n)
                if windowed is None:
                    return [], TransportError(f"write {i} of {len(wrs)}: [{ra:#x}, +{n}) is outside grant {key}",
                                              op="write", errno=errno_mod.EACCES)
                rkey = windowed
            elif rkey == 0:
                return [], TransportError(f"write {i} of {len(wrs)} targets [{ra:#x}, +{n}) without a grant; its "
                                          f"region requires one", op="write", errno=errno_mod.EACCES)
            out.append((la, lkey, ra, rkey, n))
        return out, None

    def completions(self, max_items: int = 1024, *, deadline: Deadline | None = None) -> list[Completion]:
        return self._queue.get(max_items, deadline)

    # ------------------------------------------------------------------ the completion thread

    def _cq_loop(self) -> None:
        idle_polls = 0
        next_watchdog = time.monotonic()
        while not self._stop.is_set():
            with self._work:  # write() appends, then notifies under this lock: no lost wake-up
                with self._lock:
                    active = [p for p in self._peers.values() if (sq := p.sq) is not None and sq.inflight]
                if not active:
                    if not self._stop.is_set():
                        self._work.wait(_IDLE_WAIT)
                    idle_polls = 0
                    continue
                seen = self._posts
            progressed = False
            for p in active:
                progressed |= self._reap(p)
            now = time.monotonic()
            if now >= next_watchdog:
                next_watchdog = now + min(0.05, self._peer_timeout / 10)
                for p in active:
                    sq = p.sq
                    busy = sq is not None and sq.inflight and p.error is None
                    if busy and now - p.last_progress > self._peer_timeout:
                        self._fail_peer(
                            p,
                            TransportError(
                                f"no completion from the peer for {self._peer_timeout:g} s", op="write", errno=errno_mod.ETIMEDOUT
                            ),
                        )
            if progressed:
                idle_polls = 0
            else:
                idle_polls += 1
                # pyverbs 44 cannot wait for a completion event without holding the GIL: back off, but
                # wake at once when a write posts (on soft-RoCE its completion is often there already)
                if idle_polls < 8:
                    time.sleep(0)
                else:
                    with self._work:
                        if self._posts == seen and not self._stop.is_set():
                            self._work.wait(min(1e-3, 2e-5 * idle_polls))

    def _reap(self, p: VerbsPeer) -> bool:
        """Poll one peer's CQ; complete, fail and post as the completions say. True if it found any."""
        answers: list[int] = []  # grants being revoked whose last batch just completed: tell the sink
        with p.deliver:
            with p.lock:
                sq = p.sq
                if sq is None or p.error is not None:
                    return False
                found, done, failure = sq.reap()
                if found:
                    p.last_progress = time.monotonic()
                if p.win is not None:
                    answers = [b.grant for b in done if b.grant and p.win.ended(b.grant)]
            for b in done:
                self._deliver(p, b, b.error)
            for k in answers:
                self._tell(p, encode_stop(k, answer=True))
            if failure is not None:
                self._fail_peer(p, failure)
        return found or failure is not None

    @staticmethod
    def _tell(p: VerbsPeer, frame: bytes) -> None:
        """A frame to the sink on the liveness socket (lost if it is gone: then so is its QP)."""
        with p.tell:
            sock = p.sock
            if sock is not None:
                send_frame(sock, frame)

    def _deliver(self, p: VerbsPeer, b: WrBatch, error: TransportError | None) -> None:
        deliver(self._queue, p, b.batch_id, b.on_done, error)

    def _fail_peer(self, p: VerbsPeer, error: TransportError) -> None:
        """Fail every batch in flight to ``p`` (in order), tear its QP down, close its socket. Idempotent.

        The first failing batch gets ``error``; the later ones an error that names it as the cause.
        """
        with p.deliver:
            with p.lock:
                if p.error is None:
                    p.error = error
                p.closed = True
                sq, sock = p.sq, p.sock
                p.sq = p.sock = None
                items: list[WrBatch] = []
                if sq is not None:
                    items = list(sq.inflight)
                    sq.close()
                p.lock.notify_all()
            if sock is not None:
                self._unwatch(sock)
            cause = p.error
            for i, b in enumerate(items):
                err = cause if i == 0 else TransportError(
                    f"not completed: an earlier batch to this peer failed: {cause}", op=cause.op, errno=cause.errno
                )
                self._deliver(p, b, err)

    @staticmethod
    def _check_usable(p: VerbsPeer) -> None:
        if p.error is not None:
            raise TransportError(f"peer is unusable until it is connected again: {p.error}", op="write", errno=p.error.errno)
        if p.closed:
            raise TransportError("peer is disconnected", op="write", errno=errno_mod.ENOTCONN)

    def _own(self, peer: PeerHandle, op: str) -> VerbsPeer:
        if not isinstance(peer, VerbsPeer) or self._peers.get(peer.id) is not peer:
            if isinstance(peer, VerbsPeer) and peer.closed:
                return peer  # write() on it raises a clear "unusable" error; disconnect is idempotent
            raise TransportError("not a peer of this transport", op=op)
        return peer


def _rows(batch: Batch) -> list[tuple[int, int, int]] | list[list[int]]:
    """The batch's ``(local, remote, length)`` rows; plain int triples skip numpy (cheaper per small batch)."""
    if isinstance(batch, (list, tuple)):
        try:
            if all(
                type(la) is int and type(ra) is int and type(n) is int and la >= 0 and ra >= 0 and n > 0
                for la, ra, n in batch
            ):
                return list(batch)
        except (TypeError, ValueError):
            pass  # not triples: as_batch says what is wrong
    return as_batch(batch).tolist()
