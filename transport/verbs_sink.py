"""The verbs sink's side of the handshake: accepting a source on the listener, checking its hello
(and with a secret its proof), making its sink queue pair, and tearing that connection down again.

It exists so that what a sink lets a stranger on its listener do before it has proven anything
sits in one place, in the order it happens: nothing costs the sink a queue pair before the hello
named this transport and, with a secret, before the source proved that it holds it. It runs on the
cm thread (``transport/verbs.py``), which then watches the connection's liveness socket
(``transport/verbs_liveness.py``). The bytes are ``transport/verbs_hello.py``'s; what an ``OK``
reply carries of the grants is ``transport/verbs_grants.py``'s.
"""

from __future__ import annotations

import errno as errno_mod
import os
import selectors
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from . import verbs_hello as hello
from .base import HELLO_TIMEOUT, NONCE_BYTES
from .deadline import Deadline
from .verbs_device import pv, rdma_errno
from .verbs_liveness import receiver
from .verbs_qp import make_qp
from .verbs_regions import SINK_WR
from .verbs_state import SinkConn, VerbsState

__all__ = ["VerbsSink"]

Recv = Callable[[int], bytes]


class VerbsSink(VerbsState):
    """The sink's side of the handshake, on the cm thread (one room of ``VerbsTransport``)."""

    def _cm_accept(self) -> None:
        """The listener is readable: accept one source and answer its handshake (bounded as a whole by
        ``HELLO_TIMEOUT``); once it succeeded, watch the connection's liveness socket. An accept that
        fails for want of descriptors takes the listener out of the selector for a back-off."""
        try:
            conn, addr = self._listener.accept()
        except OSError as ex:
            delay = self._backoff.failed(ex)
            if delay is not None:  # out of descriptors: the listener stays readable, watching it would spin
                self._sel_drop(self._listener)
                self._accept_again = time.monotonic() + delay
            return
        self._backoff.succeeded()
        deadline = Deadline.after(min(HELLO_TIMEOUT, self._peer_timeout))  # the whole handshake
        recv = receiver(conn, deadline)
        try:
            heard = self._hear_source(conn, addr, recv)
            made = None if heard is None else self._sink_qp(conn, *heard)
        except (OSError, struct.error):
            conn.close()
            return
        if made is None:
            return  # answered and closed
        sink, psn, mtu = made
        try:
            if not self._welcome(sink, psn, mtu):
                return
            conn.setblocking(False)
        except (OSError, struct.error):
            self._drop_sink(sink)
            return
        self._sel.register(conn, selectors.EVENT_READ, sink)

    def _hear_source(self, conn: socket.socket, addr: Any, recv: Recv) -> tuple[hello.Hello, bytes] | None:
        """Read the source's hello; return it with its QP information (with a secret, once the source
        proved it holds it), or None once the source has been answered (refused) and ``conn`` closed."""
        prefix = recv(5)
        size = hello.hello_size(prefix)
        if size is None:
            conn.close()
            return None
        h = hello.decode_hello(prefix + recv(size - 5))
        if h.sink != self._instance:
            _answer(conn, hello.encode_reply(hello.WRONG_INSTANCE))
            return None
        key = self._key
        if key is None and h.nonce:
            self._auth.failed(addr, "the source authenticates and this sink has no secret")
            _refuse(conn, hello.AUTH_UNSUPPORTED)
            return None
        if key is not None and not h.nonce:
            self._auth.failed(addr, "the source sent no proof of the deployment secret (it has none)")
            _refuse(conn, hello.AUTH_REQUIRED)
            return None
        if key is None:
            return h, h.info
        info = self._authenticate(conn, addr, recv, key, h)
        return None if info is None else (h, info)

    def _authenticate(self, conn: socket.socket, addr: Any, recv: Recv, key: bytes, h: hello.Hello) -> bytes | None:
        """Challenge the source and check its proof: no QP, no QPN, no grant key before the source proved
        it holds the secret. Its QP information (which the proof carries), or None once refused."""
        mine = os.urandom(NONCE_BYTES)
        conn.sendall(hello.challenge(key, h, mine))
        try:
            proof = recv(hello.PROOF.size)
        except OSError as ex:
            self._auth.failed(addr, f"challenged, it sent no proof of the deployment secret ({ex})")
            conn.close()
            return None
        checked = hello.check_proof(key, h, mine, proof)
        if checked is None:
            self._auth.failed(addr, "its proof of the deployment secret is wrong")
            _refuse(conn, hello.AUTH_FAILED)
            return None
        return checked

    def _sink_qp(self, conn: socket.socket, h: hello.Hello, info: bytes) -> tuple[SinkConn, int, int] | None:
        """Make the sink QP for the source's (to RTS); the connection (not yet in ``_sinks``) with our
        PSN and the path MTU, or None once refused (at ``max_sinks``, or the device failed)."""
        qpn, psn, gid, lid, mtu = hello.QP_INFO.unpack(info)
        with self._lock:
            full = len(self._sinks) >= self._max_sinks  # only this thread adds sinks: the count holds
        if full:
            self.refused_connections += 1
            _answer(conn, hello.encode_reply(hello.TOO_MANY, qpn=min(self._max_sinks, 0xFFFFFFFF), err=errno_mod.ECONNREFUSED))
            return None
        mypsn = int.from_bytes(os.urandom(3), "little")
        path_mtu = min(mtu, self._dev.mtu)
        qp = None
        try:
            qp = make_qp(self._pd, self._sink_cq, SINK_WR)  # a sink QP posts only window binds and invalidations
            self._to_rts(qp, rqpn=qpn, rpsn=psn, lpsn=mypsn, gid=gid, lid=lid, mtu=path_mtu)
        except pv.Error as ex:
            if qp is not None:
                qp.close()
            _answer(conn, hello.encode_reply(hello.QP_FAILED, err=rdma_errno(ex) or errno_mod.EIO))
            return None
        return SinkConn(next(self._sink_ids), conn, qp, h.source), mypsn, path_mtu

    def _welcome(self, sink: SinkConn, psn: int, mtu: int) -> bool:
        """Make ``sink`` revocable, then send the ``OK`` reply with our QPN and the source's grants; False
        if the transport closed meanwhile (QP and socket closed). Revocable before the source can use
        it: in ``_sinks`` before the reply with our QPN leaves."""
        conn, qp = sink.sock, sink.qp
        with self._mw_lock:  # no grant binds, and no revoke invalidates, between the snapshot and the reply
            with self._lock:
                if self._closed:
                    qp.close()
                    conn.close()
                    return False
                self._sinks[sink.key] = sink
            # snapshot after the QP is revocable: a revoke either finds this QP or misses the snapshot
            grants = self._grant_snapshot(sink)
            conn.sendall(hello.encode_reply(hello.OK, qp.qp_num, psn, mtu) + grants)
        return True

    def _drop_sink(self, sink: SinkConn) -> None:
        """Tear an accepted source down (cm thread); a no-op for the QP if ``revoke`` took it first."""
        with self._mw_lock, self._lock:
            mine = self._sinks.get(sink.key) is sink
            if mine:
                del self._sinks[sink.key]
                self._kill_sink_qp(sink)
            self._drained.notify_all()
        self._sel_drop(sink.sock)
        sink.sock.close()
        if self._accept_again is not None:
            self._accept_again = time.monotonic()  # a descriptor is free: try the listener again now


def _answer(conn: socket.socket, reply: bytes) -> None:
    """Send the handshake's last reply and hang up."""
    conn.sendall(reply)
    conn.close()


def _refuse(conn: socket.socket, status: int) -> None:
    """Refuse an authentication (``status``): the reply, then the hang-up."""
    _answer(conn, hello.encode_reply(status, err=errno_mod.EACCES))
