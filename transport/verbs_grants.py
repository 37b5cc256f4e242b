"""The verbs sink's grants: ``grant`` and ``revoke``, the memory windows a grant opens on each
connection of its source, and the cut of a connection that must stop at once.

It exists so that the one promise a sink makes about its memory (once ``revoke`` returns, nothing
written through the grant lands) is kept in one place, by whichever means the device allows.
``transport/verbs_regions.py`` binds and invalidates the windows; ``transport/windows.py`` has
their frames; ``transport/verbs_sink.py`` accepts the connections this module cuts.

Grants and revoke
-----------------
``grant(source, ranges)`` checks that every range lies in a registered region
(``ValueError`` otherwise) and keeps the grant in a ``GrantTable``. What
enforces it depends on the device, chosen at start (``memory_windows``,
``revoke_method``; a device without type 2 windows is logged once):

**Memory windows** (``revoke_method == "memory window"``; rxe has them). A
region registered with ``require_grant=True`` is opened only by a grant's
windows, one type 2 window per contiguous range, bound on the sink QP of each
connection of the grant's source (``transport/verbs_regions.py``). Their rkeys
reach the source over the connection's liveness socket (``transport/windows.py``
has the frames): in the handshake's reply for the grants live then, and as a
``W`` frame sent before ``grant`` returns for later ones, so they are on the way
before the announcement that names the key; a ``write`` naming a key whose
windows have not arrived waits for them (at most its deadline or 1 s). Each
WRITE carries its window's rkey; a write outside the grant's windows fails its
batch before anything is posted; a key that is not this connection's (revoked,
another source's) raises ``EACCES``.

``revoke(grant)`` costs only that grant: the sink sends ``S`` key; the source
stops posting through it and answers ``s`` key once none of its batches
through it is in flight (those land first: they are before the revoke
returns); the sink then invalidates the windows with ``IBV_WR_LOCAL_INV`` and
frees them, and returns. Other grants and the queue pair carry on. A source
that does not answer by the revoke's deadline (default 1 s: paused, deaf, or
not running this code) has the windows invalidated and its queue pair cut (to
the error state, destroyed), as the fallback below does, so nothing of it
lands once ``revoke`` returns. ``revoke(..., settled=True)`` invalidates
without asking (every write through the grant completed at the source). What
the device then promises is "What invalidation promises on rxe" in
``transport/verbs_regions.py``.

**Queue pair to error** (the fallback, ``revoke_method == "queue pair to
error"``). The RDMA WRITE carries the region's rkey, and the sink's device
checks writes against the MR and nothing finer; ``require_grant`` changes
nothing on the wire. ``revoke(grant)`` forgets the grant and moves every sink
QP whose handshake named the grant's source instance to the error state and
destroys it (under the transport lock, so the cm thread never races it; the
cm thread closes the liveness sockets, which tells the source at once).
``ibv_destroy_qp`` returns only once the device has stopped using the QP, so
once ``revoke`` returns nothing more from that source lands over those QPs,
even if the source never hears of it (paused, or deaf to its liveness
socket). The price: every in-flight and later write of that source fails,
**all** of its rooms with them, and it must ``connect`` again. Its other
grants stay in the table but are useless until it reconnects; once it has,
they work again. A reconnected source could still write into a revoked
grant's ranges (the rkey covers the whole region). So that a source that was
merely paused or slow (it runs this code, unmodified) cannot do that by naming
the old key, the handshake's ``OK`` reply carries the last grant key the sink
issued and the keys of that source's live grants; on that connection
``write`` raises ``TransportError(op="write", errno=EACCES)``, posting
nothing, for a key at or below that floor that was not live (revoked, settled
or not). Keys issued later pass. The sink takes that snapshot after the new
QP is revocable, so a revoke racing the handshake either kills the new QP or
is in the snapshot. A source that does not run this code, or writes with
``grant=0``, is not held back. ``revoke(..., settled=True)`` only forgets the
grant and keeps the QPs.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import logging
from typing import Any

from . import verbs_hello as hello
from .base import Grant
from .deadline import Deadline
from .errors import TransportError
from .verbs_liveness import REVOKED, send_frame
from .verbs_regions import windows_frame
from .verbs_state import SinkConn, VerbsState
from .windows import encode_stop, window_spans

__all__ = ["VerbsGrants"]

log = logging.getLogger("transport.verbs")


class VerbsGrants(VerbsState):
    """The sink's ``grant`` and ``revoke`` (one room of ``VerbsTransport``)."""

    def grant(self, source: bytes, ranges: Any) -> Grant:
        """Record the grant; with memory windows also bind one window per contiguous range on every
        connected queue pair of ``source`` and send it their rkeys (``W``) before returning, so
        they are there before the announcement that names the key. Keys are issued and bound under
        one lock: each connection hears of its grants in key order."""
        self._check_open("grant")
        with self._mw_lock:
            with self._grant_lock:
                g = self._grants.add(bytes(source), ranges)
                self._last_grant = g.key
                bad = self._regions.outside(g.ranges)
                if bad is not None:
                    self._grants.pop(g.key)
                    raise ValueError(f"grant range [{bad[0]:#x}, +{bad[1]}) is outside every registered region")
                spans = self._spans_of(g) if self._windows else []
                if len(spans) > self._max_windows:
                    self._grants.pop(g.key)
                    raise ValueError(
                        f"a grant of {len(g.ranges)} ranges needs {len(spans)} memory windows, more than "
                        f"max_windows={self._max_windows}: grant fewer, longer ranges, or raise max_windows"
                    )
            if self._windows:
                with self._lock:
                    sinks = [c for c in self._sinks.values() if c.src == g.source]
                broken = [c for c in sinks if not self._open_windows(c, g.key, spans, send=True)]
                self._cut(broken, say=b"")
        return g

    def _grant_snapshot(self, sink: SinkConn) -> bytes:
        """For an ``OK`` reply: the last key issued and the source's live grants: their keys, or with
        memory windows the windows bound for them on this connection (``W`` frames). Under ``_mw_lock``."""
        with self._grant_lock:
            live = sorted(self._grants.of_source(sink.src), key=lambda g: g.key)[: hello.MAX_LIVE_GRANTS]
            floor = self._last_grant
        if not self._windows:
            return hello.encode_grant_keys(floor, [g.key for g in live])
        frames = []
        for g in live:
            if not self._open_windows(sink, g.key, self._spans_of(g), send=False):
                raise OSError(errno_mod.EIO, f"binding the memory windows of grant {g.key} failed")
            frames.append(windows_frame(g.key, sink.windows[g.key]))
        return hello.encode_grant_windows(floor, frames)

    def revoke(self, grant: Grant, *, deadline: Deadline | None = None, settled: bool = False) -> None:
        """Forget ``grant``; unless ``settled``, make sure nothing more lands through it once this returns.

        With memory windows: ask each connection of the source to stop (``S``), wait until it
        answered that nothing of this grant is in flight (``s``) or ``deadline`` (default 1 s) passed,
        then invalidate the grant's windows; a connection that did not answer in time, or whose
        invalidation failed, is cut (its queue pair to the error state and destroyed), as is every
        connection without windows (module docstring). Other grants and connections stay.
        Revoking a grant that is not live (revoked already, or not this transport's) does nothing.
        ``TransportError(op="revoke")`` if a queue pair could be neither moved to the error state nor
        destroyed (its windows' invalidation failed too, or it had none); calling ``revoke`` again
        tries again, that queue pair included, and raises until it is stopped. ``settled`` too.
        """
        with self._grant_lock:
            live = self._grants.get(grant.key)
            if live is None:
                live = self._unconfirmed.get(grant.key)  # a revoke that raised: try again
            if live is None or live != grant:  # keys are per sink: another sink's grant may share this one's
                return
            self._grants.pop(grant.key)
        if settled:
            failures = self._revoke_settled(live)
        elif self._windows:
            failures = self._revoke_windows(live, deadline or Deadline.after(1.0))
        else:
            failures = self._revoke_by_qp(live)
        with self._grant_lock:
            if failures:
                self._unconfirmed[grant.key] = live
            else:
                self._unconfirmed.pop(grant.key, None)
        if failures:
            raise TransportError(
                f"revoke: {len(failures)} QP(s) of the source could not be stopped: {failures[0]}", op="revoke"
            )

    def _revoke_settled(self, g: Grant) -> list[str]:
        """Every write through ``g`` completed: invalidate its windows without waiting for an answer
        (the source forgets them on ``S``; its answer is ignored); cut a connection whose invalidation
        failed, and any of the source's a cut failed for before."""
        with self._mw_lock:
            with self._lock:
                sinks = [c for c in self._sinks.values() if g.key in c.windows]
                uncut = self._uncut_of(g.source, sinks) if self._windows else []  # without: QPs stay
            for c in sinks:
                send_frame(c.sock, encode_stop(g.key))
            failed = [c for c in sinks if self._close_windows(c, g.key)]
            return self._cut([*failed, *uncut], say=b"")

    def _uncut_of(self, source: bytes, besides: list[SinkConn]) -> list[SinkConn]:
        """The connections of ``source`` a cut failed for (not in ``besides``): a revoke cuts them again,
        since what they may still land through is unknown. Under ``_lock``."""
        return [c for c in self._sinks.values() if c.uncut and c.src == source and c not in besides]

    def _revoke_windows(self, g: Grant, deadline: Deadline) -> list[str]:
        key = g.key
        with self._mw_lock:
            with self._lock:
                sinks = [c for c in self._sinks.values() if key in c.windows]
                uncut = self._uncut_of(g.source, sinks)  # their windows are gone from c.windows: not asked
                for c in sinks:
                    c.stopped.discard(key)
            mute = [c for c in sinks if not send_frame(c.sock, encode_stop(key))]
        with self._drained:
            self._drained.wait_for(
                lambda: all(key in c.stopped or self._sinks.get(c.key) is not c for c in sinks),
                timeout=deadline.remaining(),
            )
        with self._mw_lock:
            with self._lock:
                unanswered = [c for c in sinks if key not in c.stopped and c not in mute]
                for c in sinks:
                    c.stopped.discard(key)
            failed = [c for c in sinks if self._close_windows(c, key)]
            cut = list({c.key: c for c in (*mute, *unanswered, *failed, *uncut)}.values())
            if unanswered:
                log.warning("verbs transport: revoke of grant %d: %d source connection(s) did not answer within the "
                            "deadline; their queue pairs are cut", key, len(unanswered))
            return self._cut(cut, say=REVOKED)

    def _revoke_by_qp(self, g: Grant) -> list[str]:
        """The fallback without memory windows: cut every connection of the grant's source."""
        with self._lock:
            sinks = [c for c in self._sinks.values() if c.src == g.source]
        return self._cut(sinks, say=REVOKED)

    def _cut(self, sinks: list[SinkConn], *, say: bytes) -> list[str]:
        """Kill each connection's QP (to the error state, its windows freed, destroyed), tell the source
        ``say``, hang up. ``ibv_destroy_qp`` returns once the device stopped using the QP, so nothing
        more lands through it. Returns why a QP could not be stopped (that connection stays, marked
        ``uncut``, so the next revoke of its source's grants tries again)."""
        failures: list[str] = []
        victims = []
        with self._lock:  # the cm thread drops connections under this lock too: one owner per connection
            closed = self._closed
            for c in sinks:
                if self._sinks.get(c.key) is not c:
                    continue  # dropped meanwhile
                why = self._kill_sink_qp(c)
                if why:
                    c.uncut = True
                    failures.append(why)
                    continue
                del self._sinks[c.key]
                victims.append(c)
                if say:  # say why before the hang-up (the QP is dead already)
                    with contextlib.suppress(OSError):
                        c.sock.send(say)
            if victims and not closed:  # the cm thread unwatches and closes the sockets: the source sees EOF
                self._cm_pending.extend((c.sock, None) for c in victims)
            self._drained.notify_all()
        if victims:
            if closed:
                for c in victims:
                    c.sock.close()
            else:
                with contextlib.suppress(OSError):
                    self._wake_w.send(b"r")
        return failures

    # ------------------------------------------------------------------ memory windows (under _mw_lock)

    def _spans_of(self, g: Grant) -> list[tuple[int, int]]:
        """The ranges of grant ``g``'s windows (one per contiguous range within one region)."""
        return window_spans(g.ranges, [(r.addr, r.end) for r in self._regions.snapshot()])

    def _open_windows(self, c: SinkConn, key: int, spans: list[tuple[int, int]], *, send: bool) -> bool:
        """Bind grant ``key``'s windows (one per span) on ``c``'s QP (and with ``send`` tell the source:
        ``W``); False if that failed (the caller cuts the connection)."""
        made = self._mw.bind(c.qp, key, spans, self._mem)
        if made is None:
            return False
        c.windows[key] = made
        return not send or send_frame(c.sock, windows_frame(key, made))

    def _close_windows(self, c: SinkConn, key: int) -> bool:
        """Invalidate grant ``key``'s windows on ``c`` and free them; True if that failed (cut ``c``)."""
        made = c.windows.pop(key, None)
        return bool(made and self._mw.invalidate(c.qp, key, made))

