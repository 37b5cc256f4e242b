# Included by _tcp_fast.pyx: one sink connection and its loop. ``SinkConn.serve`` runs ``_serve``
# without the GIL: read a frame's header, descriptors and note, check them against the ``Sink``
# (marking the connection landing), receive the payload straight into place, clear the mark, gather
# the ack (and return a landed frame's note before that ack goes out).
# The helpers below it are the loop's steps; each read and send waits in ticks of the socket's kernel
# timeout and ends the connection through ``_failed``.

# serve()'s results: a refused frame (the caller words the ack and calls refuse()), a landed frame's note
# (the caller hands it on, then calls serve() again, which sends its ack), or how the connection ended
cdef enum:
    _SERVE_REFUSED = 0
    _SERVE_CLOSED = 1  # the peer closed the connection, or it broke (errno in the result)
    _SERVE_BROKEN = 2  # a frame broke the wire format: the stream cannot be trusted past it
    _SERVE_STALLED = 3  # the peer sent nothing for ``stall`` seconds mid-frame (or took no ack for that long)
    _SERVE_STOPPED = 4  # the transport is closing
    _SERVE_NOTED = 5  # a frame with a note landed: its ack is queued, not yet sent

SERVE_REFUSED = _SERVE_REFUSED
SERVE_CLOSED = _SERVE_CLOSED
SERVE_BROKEN = _SERVE_BROKEN
SERVE_STALLED = _SERVE_STALLED
SERVE_STOPPED = _SERVE_STOPPED
SERVE_NOTED = _SERVE_NOTED

cdef enum:
    _ACK_GATHER = 16  # acks gathered at most under load
    _DISCARD = 65536
    _BUF = 4096  # a connection's header and ack buffers to begin with
cdef uint64_t _ACK_GATHER_BYTES = 1 << 20


cdef class SinkConn:
    """One data connection past its handshake (acks go out on ``acks``, its ack connection, or the same
    socket): ``serve()`` runs its loop without the GIL until a frame is refused (the caller words the
    ack: ``refuse()``, then ``serve()`` again), a frame with a note landed (the caller hands the note on,
    then ``serve()`` again sends its ack) or the connection ends.

    Per frame: read its header, descriptors and note (one read: the note follows the descriptors); a
    note longer than ``MAX_NOTE``, or on a frame without writes or without a grant, breaks the wire
    format. Check every write (``Sink`` mutex held; on success the
    connection is marked landing through the frame's grant, into its regions); receive the payload
    straight into place (the mutex not held), with up to 40 bytes more, the next frame's header and
    first descriptor when they are already there; clear the mark (waking a revoke or deregister that
    waits for it). Acks are gathered: sent when no further frame is already waiting, or after 16
    frames or 1 MiB. Reads and sends wait in ticks of the socket's kernel timeouts; mid-frame, or
    with acks the peer does not take, ``stall`` seconds without a byte end the connection."""

    cdef Sink sink
    cdef object sock
    cdef object ack_sock
    cdef int ack_fd
    cdef _Conn c
    cdef unsigned char source[16]
    cdef uint64_t max_writes
    cdef double stall
    cdef unsigned char* hb  # the current frame's header and descriptors, as read so far
    cdef size_t hcap
    cdef unsigned char* spare  # the usual header buffer while a frame of more writes has one of its own (mapped)
    cdef size_t sparecap
    cdef size_t hlen
    cdef unsigned char tail[_AHEAD]
    cdef unsigned char* acks
    cdef size_t acap
    cdef size_t alen
    cdef int nacks
    cdef uint64_t acked_bytes
    cdef uint64_t discard  # payload bytes of a refused frame still to read and drop
    cdef unsigned char* scratch
    cdef iovec iov[_IOV_CHUNK + 1]
    cdef bint attached
    cdef bint drained  # the last payload read found nothing after it: the socket was empty then
    # what serve() reports
    cdef int err
    cdef uint64_t r_seq
    cdef uint64_t r_grant
    cdef uint64_t r_total
    cdef int r_code
    cdef Py_ssize_t r_index
    cdef Py_ssize_t r_count
    cdef size_t r_note  # a landed frame's note: where it starts in ``hb`` (past the read-ahead) and its length
    cdef size_t r_notelen

    def __cinit__(self, Sink sink not None, sock not None, acks not None, bytes source not None, uint64_t max_writes,
                  double stall):
        if len(source) != 16:
            raise ValueError(f"a source is 16 bytes, got {len(source)}")
        self.sink, self.sock, self.ack_sock = sink, sock, acks
        self.c.fd = sock.fileno()
        self.ack_fd = acks.fileno()
        memcpy(self.source, <const char*>source, 16)
        self.max_writes, self.stall = max_writes, stall
        self.hcap = _BUF
        self.hb = <unsigned char*>malloc(self.hcap)
        self.acap = _BUF
        self.acks = <unsigned char*>malloc(self.acap)
        if self.hb == NULL or self.acks == NULL:
            raise MemoryError()
        _lock(&sink.mu)
        self.c.held = _held(self)
        self.c.next = sink.conns
        if sink.conns != NULL:
            sink.conns.prev = &self.c
        sink.conns = &self.c
        self.attached = True
        pthread_mutex_unlock(&sink.mu)

    def __dealloc__(self):
        self._detach()
        if self.spare != NULL:  # ended in a big frame: hb is its mapping
            munmap(self.hb, self.hcap)
            free(self.spare)
        else:
            free(self.hb)
        free(self.acks)
        free(self.scratch)
        free(self.c.used)

    cdef void _detach(self) noexcept:
        if not self.attached:
            return
        _lock(&self.sink.mu)
        if self.c.prev != NULL:
            self.c.prev.next = self.c.next
        else:
            self.sink.conns = self.c.next
        if self.c.next != NULL:
            self.c.next.prev = self.c.prev
        self.c.prev = self.c.next = NULL
        self.attached = False
        if self.c.landing:
            self.c.landing = 0
            pthread_cond_broadcast(&self.sink.cleared)
        pthread_mutex_unlock(&self.sink.mu)

    def close(self):
        """Leave the table (call before closing the socket: a revoke cuts only attached connections)."""
        self._detach()

    def retained(self):
        """The bytes this connection's buffers hold, as its loop last said (see ``Sink.retained``)."""
        _lock(&self.sink.mu)
        n = self.c.held
        pthread_mutex_unlock(&self.sink.mu)
        return n

    def serve(self):
        """Land frames until one is refused, one with a note landed, or the connection ends. Returns
        ``(SERVE_REFUSED, seq, code, index, count, addr, length, grant, total)`` for a refused frame (its
        header, descriptors and note read, its payload not yet: ``refuse()`` drops it), ``(SERVE_NOTED,
        grant, note)`` for a frame with a note whose every byte landed (its ack queued: the next
        ``serve()`` sends it), else ``(SERVE_*, errno)``."""
        cdef int r
        cdef const unsigned char* d
        if not self.attached:
            raise ValueError("serve() on a closed connection")
        with nogil:
            r = _serve(self)
        if r == _SERVE_NOTED:  # (the note is still in hb: the payload's read-ahead ends before it)
            return r, self.r_grant, PyBytes_FromStringAndSize(<char*>self.hb + self.r_note, <Py_ssize_t>self.r_notelen)
        if r != _SERVE_REFUSED:
            return r, self.err
        d = self.hb + _HEAD + _PAIR * self.r_index
        return (_SERVE_REFUSED, self.r_seq, self.r_code, self.r_index, self.r_count, _get64(d), _get64(d + 8),
                self.r_grant, self.r_total)

    def refuse(self, uint64_t seq, int32_t err, bytes message not None, uint64_t nbytes):
        """Queue the error ack of a refused frame and drop its ``nbytes`` of payload (on the next ``serve()``)."""
        cdef size_t n = <size_t>len(message)
        if n > 0xFFFFFFFF:
            raise ValueError("an ack message is shorter than 4 GiB")
        if _ack(self, seq, 1, err, <const unsigned char*>message, n) < 0:
            raise MemoryError()
        self.discard = nbytes
        self.acked_bytes += nbytes  # counted as landed bytes are: the gather bound


cdef inline size_t _held(SinkConn s) noexcept nogil:
    return (s.hcap + s.sparecap + s.acap + (_DISCARD if s.scratch != NULL else 0)
            + <size_t>s.c.capused * sizeof(uint64_t))


cdef void _tell(SinkConn s) noexcept nogil:
    """Say what the buffers hold now (after they grew or shrank: not per frame)."""
    pthread_mutex_lock(&s.sink.mu)
    s.c.held = _held(s)
    pthread_mutex_unlock(&s.sink.mu)


cdef inline void _trim(SinkConn s) noexcept nogil:
    """Between frames (``hb`` holds at most ``_AHEAD`` bytes, of the next frame; no landing mark):
    free the header buffer of a frame of more writes than the usual one holds (``_grow``), back to
    the usual one, and the landing marks' array if a frame into very many regions grew it past
    ``_KEEP`` bytes; say what the buffers hold if that changed (the marks' array may have grown).
    Neither allocates nor takes the mutex unless something changed."""
    if s.spare != NULL:
        memcpy(s.spare, s.hb, s.hlen)
        munmap(s.hb, s.hcap)  # back to the system at once, not cached by the allocator's arenas
        s.hb, s.hcap = s.spare, s.sparecap
        s.spare, s.sparecap = NULL, 0
    if <size_t>s.c.capused * sizeof(uint64_t) > _KEEP:
        pthread_mutex_lock(&s.sink.mu)  # (others read the marks under it, of a connection landing)
        free(s.c.used)
        s.c.used, s.c.capused = NULL, 0
        pthread_mutex_unlock(&s.sink.mu)
    if s.c.held != _held(s):  # only this connection's loop writes held and what it counts
        _tell(s)


cdef int _ack(SinkConn s, uint64_t seq, uint32_t status, int32_t err, const unsigned char* msg, size_t n) noexcept nogil:
    cdef size_t need = s.alen + _ACK + n
    cdef unsigned char* grown
    if need > s.acap:
        grown = <unsigned char*>realloc(s.acks, need * 2)
        if grown == NULL:
            return -1
        s.acks, s.acap = grown, need * 2
    _put64(s.acks + s.alen, seq)
    _put32(s.acks + s.alen + 8, status)
    _put32(s.acks + s.alen + 12, <uint32_t>err)
    _put32(s.acks + s.alen + 16, <uint32_t>n)
    if n:
        memcpy(s.acks + s.alen + _ACK, msg, n)
    s.alen = need
    s.nacks += 1
    return 0


cdef int _tick(SinkConn s, double last, bint idle) noexcept nogil:
    """A read or send waited one kernel timeout: 0 to go on, else how the connection ends."""
    cdef int stopped
    pthread_mutex_lock(&s.sink.mu)
    stopped = s.sink.stopped
    pthread_mutex_unlock(&s.sink.mu)
    if stopped:
        return _SERVE_STOPPED
    if not idle and _now() - last >= s.stall:
        return _SERVE_STALLED
    return 0


cdef int _failed(SinkConn s, ssize_t k, double last, bint idle) noexcept nogil:
    """After a recv or send that returned ``k`` <= 0 (the last byte moved at ``last``; ``idle``: none of
    the frame has come yet): 0 to try again (EINTR, or a tick that ``_tick`` lets go on), else how the
    connection ends: ``_tick``'s end on a tick (EAGAIN), else ``_SERVE_CLOSED`` (errno kept). Every
    read and send of the loop ends through here, so each waits and ends by the same rules."""
    if k == 0:
        s.err = 0
        return _SERVE_CLOSED
    if errno == EINTR:
        return 0
    if errno == EAGAIN:
        return _tick(s, last, idle)
    s.err = errno
    return _SERVE_CLOSED


cdef int _read(SinkConn s, unsigned char* into, size_t n, bint idle) noexcept nogil:
    """Receive exactly ``n`` bytes; ``idle``: none of the frame has come yet (no stall rule)."""
    cdef size_t got = 0
    cdef ssize_t k
    cdef int r
    cdef double last = _now()
    while got < n:
        k = recv(s.c.fd, into + got, n - got, 0)
        if k <= 0:
            r = _failed(s, k, last, idle and got == 0)
            if r:
                return r
            continue
        got += <size_t>k
        last = _now()
    return 0


cdef int _flush(SinkConn s) noexcept nogil:
    """Send the gathered acks."""
    cdef unsigned char* grown
    cdef size_t sent = 0
    cdef ssize_t k
    cdef int r
    cdef double last = _now()
    while sent < s.alen:
        k = send(s.ack_fd, s.acks + sent, s.alen - sent, MSG_NOSIGNAL)
        if k < 0:
            r = _failed(s, k, last, False)
            if r:
                return r
            continue
        sent += <size_t>k
        last = _now()
    s.alen = 0
    s.nacks = 0
    s.acked_bytes = 0
    if s.acap > _KEEP:  # long refusal messages gathered: back to the usual size
        grown = <unsigned char*>malloc(_BUF)
        if grown != NULL:
            free(s.acks)
            s.acks, s.acap = grown, _BUF
            _tell(s)
    return 0


cdef int _drop(SinkConn s) noexcept nogil:
    """Receive and drop the payload of a refused frame (the stream keeps its place)."""
    cdef ssize_t k
    cdef int r
    cdef double last = _now()
    if s.scratch == NULL:
        s.scratch = <unsigned char*>malloc(_DISCARD)
        if s.scratch == NULL:
            s.err = ENOMEM
            return _SERVE_CLOSED
        _tell(s)
    while s.discard:
        k = recv(s.c.fd, s.scratch, <size_t>(s.discard if s.discard < _DISCARD else _DISCARD), 0)
        if k <= 0:
            r = _failed(s, k, last, False)
            if r:
                return r
            continue
        s.discard -= <uint64_t>k
        last = _now()
    return 0


cdef void _landed(SinkConn s) noexcept nogil:
    """Clear the landing mark; wake a revoke or deregister waiting for it."""
    pthread_mutex_lock(&s.sink.mu)
    s.c.landing = 0
    s.c.nused = 0
    s.c.grant = 0
    if s.sink.waiters:
        pthread_cond_broadcast(&s.sink.cleared)
    pthread_mutex_unlock(&s.sink.mu)


cdef int _payload(SinkConn s, const unsigned char* d, Py_ssize_t count) noexcept nogil:
    """Receive the payload of a checked frame into place, with up to ``_AHEAD`` bytes after it into
    ``hb`` (``hlen`` set to how many)."""
    cdef Py_ssize_t i = 0, k, n
    cdef uint64_t off = 0, length, rem
    cdef size_t got
    cdef ssize_t r
    cdef int why
    cdef bint tail
    cdef msghdr msg
    cdef double last = _now()
    memset(&msg, 0, sizeof(msg))
    msg.msg_iov = s.iov
    s.hlen = 0
    while i < count:
        n = 0
        k = i
        while k < count and n < _IOV_CHUNK:
            length = _get64(d + _PAIR * k + 8)
            s.iov[n].iov_base = <void*><size_t>(_get64(d + _PAIR * k) + (off if k == i else 0))
            s.iov[n].iov_len = <size_t>(length - (off if k == i else 0))
            n += 1
            k += 1
        tail = k == count
        if tail:
            s.iov[n].iov_base = s.tail
            s.iov[n].iov_len = _AHEAD
            n += 1
        msg.msg_iovlen = <size_t>n
        r = recvmsg(s.c.fd, &msg, 0)
        if r <= 0:
            why = _failed(s, r, last, False)
            if why:
                return why
            continue
        last = _now()
        got = <size_t>r
        while got and i < count:
            rem = _get64(d + _PAIR * i + 8) - off
            if got >= rem:
                got -= <size_t>rem
                i += 1
                off = 0
            else:
                off += got
                got = 0
        if got:  # past the payload: the next frame's first bytes
            memcpy(s.hb, s.tail, got)
            s.hlen = got
    # A read returns what is there up to what it asks: no byte past the payload means none was
    # there (with bytes to spare it would have filled the tail).
    s.drained = s.hlen == 0
    return 0


cdef int _grow(SinkConn s, size_t need) noexcept nogil:
    """Room for ``need`` bytes of header and descriptors in ``hb`` (``hlen`` of them read). Up to
    ``_KEEP``, the usual buffer grows and stays; past it the frame gets a mapping of its own, with what
    was read, and the usual one waits aside (``spare``) until ``_trim`` unmaps the big one. (Freed
    malloc memory of that size stays cached in the allocator's per-thread arenas: one big frame's
    worth for each, and there is a sink thread per connection. The mapping is populated at once:
    cheaper than faulting its pages in one by one as the descriptors arrive.)"""
    cdef unsigned char* grown
    cdef void* mapped
    if need <= s.hcap:
        return 0
    if need <= _KEEP:
        grown = <unsigned char*>realloc(s.hb, need)
    else:
        mapped = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0)
        grown = NULL if mapped == MAP_FAILED else <unsigned char*>mapped
        if grown != NULL:
            memcpy(grown, s.hb, s.hlen)
    if grown == NULL:
        s.err = ENOMEM
        return _SERVE_CLOSED
    if need > _KEEP:
        s.spare, s.sparecap = s.hb, s.hcap
    s.hb, s.hcap = grown, need
    _tell(s)  # (a big frame: what it holds until it is done)
    return 0


cdef int _serve(SinkConn s) noexcept nogil:
    """``SinkConn.serve`` without the GIL: land frame after frame. ``_SERVE_REFUSED`` (what was refused
    in the ``r_*`` fields), ``_SERVE_NOTED`` (a frame with a note landed and its ack is queued: the
    grant and where the note is in the ``r_*`` fields), or how the connection ended."""
    cdef int r, code
    cdef uint64_t seq, grant, total
    cdef uint32_t nnote
    cdef Py_ssize_t count, index = 0
    cdef size_t need
    cdef const unsigned char* d
    s.err = 0
    while True:
        r = _between(s)
        if r:
            return r
        if s.hlen < _HEAD:
            # a frame's first 40 bytes are never payload: its header and first descriptor, or (a frame
            # without writes) its header and the next frame's first bytes
            r = _read_some(s, _HEAD)
            if r:
                return r
        seq = _get64(s.hb)
        count = <Py_ssize_t>_get32(s.hb + 8)
        nnote = _get32(s.hb + 12)
        grant = _get64(s.hb + 16)
        if <uint64_t>count > s.max_writes:
            return _SERVE_BROKEN
        if nnote and (nnote > _MAX_NOTE or count == 0 or grant == 0):
            return _SERVE_BROKEN  # no source sends it: a note vouches for writes landed through a grant
        # a note follows the descriptors: read with them (a frame with one has writes, so what was read
        # ahead, at most _AHEAD bytes, ends before the note, and the payload's read-ahead leaves it be)
        need = _HEAD + _PAIR * <size_t>count + nnote
        if s.hlen < need:
            r = _grow(s, need + _AHEAD)
            if r:
                return r
            r = _read(s, s.hb + s.hlen, need - s.hlen, False)
            if r:
                return r
            s.hlen = need
        d = s.hb + _HEAD
        s.drained = False
        code = _mark(s, d, count, grant, &index)
        if code < 0:
            s.err = ENOMEM
            return _SERVE_CLOSED
        if code:
            s.r_seq, s.r_code, s.r_index, s.r_count, s.r_grant = seq, code, index, count, grant
            s.r_total = _total(d, count)
            s.hlen = 0  # a frame with writes: its descriptors end what was read ahead
            return _SERVE_REFUSED
        if count:
            total = _total(d, count)
            r = _payload(s, d, count)
            _landed(s)
            if r:
                return r
        else:
            _landed(s)
            total = 0
            s.hlen -= _HEAD  # what came after the header is the next frame's
            memmove(s.hb, s.hb + _HEAD, s.hlen)
        if _ack(s, seq, 0, 0, NULL, 0) < 0:
            s.err = ENOMEM
            return _SERVE_CLOSED
        s.acked_bytes += total
        if nnote:  # its ack waits in the queue until the caller has handed the note on
            s.r_grant, s.r_note, s.r_notelen = grant, _HEAD + _PAIR * <size_t>count, nnote
            return _SERVE_NOTED
        r = _flush_full(s)
        if r:
            return r


cdef int _between(SinkConn s) noexcept nogil:
    """Between frames: trim the buffers, drop a refused frame's payload, and send the gathered acks
    unless the next frame is already here (then it lands first, and its ack goes out with them).
    0, or how the connection ends."""
    cdef ssize_t k
    cdef int r
    _trim(s)  # before the acks go out: a source that has them sees what the connection keeps
    if s.discard:
        r = _drop(s)
        if r:
            return r
        r = _flush_full(s)
        if r:
            return r
    if s.nacks and s.hlen < _HEAD:  # more frames already here? then land them first, ack together
        if s.hlen == 0 and not s.drained:
            k = recv(s.c.fd, s.hb, _AHEAD, MSG_DONTWAIT)
            if k > 0:
                s.hlen = <size_t>k
            elif k == 0:
                return _SERVE_CLOSED
            elif errno != EAGAIN and errno != EINTR:
                s.err = errno
                return _SERVE_CLOSED
        if s.hlen == 0:
            return _flush(s)
    return 0


cdef int _mark(SinkConn s, const unsigned char* d, Py_ssize_t count, uint64_t grant, Py_ssize_t* index) noexcept nogil:
    """Check a frame's writes (``_check``, the ``Sink`` mutex held) and, if it may land, mark the
    connection landing through ``grant`` into the regions it writes, in the same hold: a revoke or
    deregister that finds no mark finds no frame writing. ``_check``'s result."""
    cdef int code
    pthread_mutex_lock(&s.sink.mu)
    code = _check(s.sink, d, count, grant, s.source, index, &s.c)
    if code == _LAND_OK:
        s.c.landing = 1
        s.c.grant = grant
    else:
        s.c.nused = 0
    pthread_mutex_unlock(&s.sink.mu)
    return code


cdef inline int _flush_full(SinkConn s) noexcept nogil:
    """Send the gathered acks if they reached the gather bound (16 acks, or 1 MiB acked)."""
    if s.nacks >= _ACK_GATHER or s.acked_bytes >= _ACK_GATHER_BYTES:
        return _flush(s)
    return 0


cdef int _read_some(SinkConn s, size_t want) noexcept nogil:
    """Read until ``hlen`` >= ``want`` (``want`` <= ``_AHEAD``), taking up to ``_AHEAD`` bytes; with
    nothing of the frame here yet, wait without the stall rule."""
    cdef ssize_t k
    cdef int r
    cdef double last = _now()
    while s.hlen < want:
        k = recv(s.c.fd, s.hb + s.hlen, _AHEAD - s.hlen, 0)
        if k <= 0:
            r = _failed(s, k, last, s.hlen == 0)
            if r:
                return r
            continue
        s.hlen += <size_t>k
        last = _now()
    return 0
