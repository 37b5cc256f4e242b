# Included by _tcp_fast.pyx: one connected peer's batches, from ``Source.post`` (``frame``'s checks,
# a slot, the seq, and the writer that finds nobody sending sends the frame itself) through the
# sender thread's remainder (``send_blocking``) to the ack loop (``acks``, ``_acks`` without the GIL),
# which completes frames in order: into ``called`` for their callbacks, or onto ``Completions``.

cdef enum:
    _POST_SENT = 0  # posted: on the wire, or queued behind a send in progress that will take it
    _POST_WAKE = 4  # posted: the sender thread must send the rest (the socket was full)
    _POST_FULL = 5  # not posted: max_inflight batches in flight
    _POST_FAILED = 6  # not posted: the peer failed or was disconnected
    _POST_ARRAY = 7  # not posted: the batch is not a C-contiguous (n, 3) uint64 numpy array (as_batch makes one)
    _POST_TOO_MANY = 8  # not posted: more writes than max_writes
    _ACKS_GOT = 0  # acks completed batches with callbacks: callbacks() has them
    _ACKS_TICK = 1  # the read waited one kernel timeout
    _ACKS_CLOSED = 2  # the peer closed the connection, or it broke (errno in ``err``)
    _ACKS_BAD = 3  # an ack's message is longer than the bound (its length in the result)
    _ACKS_ORDER = 4  # an ack for another batch than the oldest in flight (its seq in the result)
    _ACKS_FAILED = 5  # the peer failed meanwhile (fail() completed what was left)
    _SEND_GATHER = 2048  # iovecs of queued frames taken for one send at most (sent _IOV_CHUNK at a time)
    _ACK_BUF = 65536
    _MAX_MSG = 4096

POST_SENT = _POST_SENT
POST_WAKE = _POST_WAKE
POST_FULL = _POST_FULL
POST_FAILED = _POST_FAILED
POST_ARRAY = _POST_ARRAY
POST_TOO_MANY = _POST_TOO_MANY
ACKS_GOT = _ACKS_GOT
ACKS_TICK = _ACKS_TICK
ACKS_CLOSED = _ACKS_CLOSED
ACKS_BAD = _ACKS_BAD
ACKS_ORDER = _ACKS_ORDER
ACKS_FAILED = _ACKS_FAILED
MAX_MSG = _MAX_MSG


_U64_END = 1 << 64


cdef enum:
    _SMALL_BATCH = 16  # writes a list or tuple batch may hold to be taken as it is (an EPD item's: one or two)


cdef Py_ssize_t _small_batch(object batch, uint64_t* out) except -1:
    """A ``list`` or ``tuple`` of 1 to ``_SMALL_BATCH`` ``(local, remote, length)`` triples of ``int`` (each a
    ``tuple`` or ``list``) in 0..2**64-1, copied to ``out``: how many; 0 for anything else, which then goes
    through ``as_batch`` (its conversion and its error messages). An EPD encode rank posts one triple per
    item: making a numpy array of it was a tenth of its driver's time (the pure twin's ``_small_batch``: the same rule)."""
    cdef Py_ssize_t n, i, j
    cdef object triple, v
    if type(batch) is not list and type(batch) is not tuple:
        return 0
    n = len(batch)
    if not 0 < n <= _SMALL_BATCH:
        return 0
    for i in range(n):
        triple = batch[i]
        if (type(triple) is not tuple and type(triple) is not list) or len(triple) != 3:
            return 0
        for j in range(3):
            v = triple[j]
            if type(v) is not int or v < 0 or v >= _U64_END:
                return 0
            out[3 * i + j] = v
    return n


cdef class Source:
    """One connected peer's batches, from ``post`` to their completion: their seq, the in-flight
    slots, the frames not yet sent and those awaiting acks, and the ack stream.

    Locking: the frame lists (queued, in flight, completed with a callback not yet called) and the
    failed flag are behind a pthread mutex, which the ack loop (``acks``, without the GIL) takes to
    complete frames and every other method takes to change them; the rest changes with the GIL held
    (those methods are atomic to other Python threads: Python is called out to only where nothing
    is half-changed). The syscalls (``sendmsg`` of heads and payloads straight from registered
    memory, ``recv`` of acks) run without the GIL, on what only the caller owns meanwhile: the
    frames a send is using stay referenced by it, and a socket is closed only once no send is under
    way (``close``).

    Threads: any writer (``post``; the first that finds nobody sending sends its frame itself,
    without waiting, and any queued behind it), one sender thread (``send_blocking``: what a full
    socket left over) and one ack reader (``acks``, ``callbacks``, ``idle``)."""

    cdef object sock
    cdef object ack_sock
    cdef int fd
    cdef int ack_fd
    cdef int max_inflight
    cdef Py_ssize_t max_writes
    cdef public int slots  # batches posted and not yet completed (queue mode: not yet taken)
    cdef public int waiters  # writers waiting for a slot: notify them (on_slot) when one frees
    cdef public object on_slot
    cdef public Py_ssize_t index  # the failing write of the last post refused with a FRAME_* code
    cdef public int err  # errno of the last ACKS_CLOSED
    cdef pthread_mutex_t mu
    cdef uint64_t seq
    cdef _chain unsent  # posted, not yet taken by a send: oldest first
    cdef _chain flight  # taken by a send (sent, or being sent): oldest first, acked in this order
    cdef _chain called  # completed by acks, their callbacks not yet called
    cdef Py_ssize_t nflight  # frames in unsent and flight
    cdef bint failed
    cdef bint sending  # a thread is sending (a writer, or the sender thread)
    cdef bint closing
    cdef list out  # the frames of the send in progress (or its remainder), from out_i, out_off bytes in
    cdef Py_ssize_t out_i
    cdef size_t out_off
    cdef public double last_progress  # time.monotonic() of the last byte sent or ack taken
    cdef double last_byte  # ... of the last ack byte received
    cdef iovec siov[_IOV_CHUNK]
    cdef unsigned char* abuf
    cdef size_t astart
    cdef size_t aend
    cdef uint64_t detail
    cdef object refused

    def __cinit__(self, sock not None, ack_sock not None, int max_inflight, Py_ssize_t max_writes, refused not None):
        self.sock, self.ack_sock = sock, ack_sock
        self.fd, self.ack_fd = sock.fileno(), ack_sock.fileno()
        self.max_inflight = max_inflight
        self.max_writes = max_writes
        self.refused = refused
        self.on_slot = None
        pthread_mutex_init(&self.mu, NULL)
        self.abuf = <unsigned char*>malloc(_ACK_BUF)
        if self.abuf == NULL:
            raise MemoryError()
        self.last_progress = self.last_byte = _now()

    def __dealloc__(self):
        free(self.abuf)
        pthread_mutex_destroy(&self.mu)

    @property
    def in_flight(self):
        """Batches posted and not completed (queued, being sent, or awaiting their ack)."""
        return self.nflight

    @property
    def failed(self):
        return self.failed

    def has_work(self):
        """The sender thread's cue: nobody is sending, and something is left to send."""
        return not self.sending and (self.out is not None or self.unsent.head != NULL)

    def post(self, batch, uint64_t grant, on_done, ids,
             cnp.ndarray loc_starts not None, cnp.ndarray loc_lengths not None, list loc_views not None,
             cnp.ndarray rem_starts not None, cnp.ndarray rem_lengths not None, bytes note not None=b""):
        """Check a batch (``POST_ARRAY`` unless it is a C-contiguous ``(n, 3)`` ``uint64`` numpy array or a
        small one of ``int`` triples: ``small_batch``), ``POST_TOO_MANY`` past ``max_writes``, then ``frame``'s checks and codes, the failing write's
        index in ``index``; its ``note`` as ``frame`` does, a ``ValueError``), take a slot, give it the next seq and the next batch id from ``ids`` (both
        at once: a peer's ids go up in the order its frames go out) and post it. Returns ``(code,
        batch id or None)``: ``POST_SENT``, ``POST_WAKE`` (wake the sender thread), ``POST_FULL``,
        ``POST_FAILED`` or a ``FRAME_*`` code. A writer that finds nobody sending sends it (and what
        queues behind it meanwhile) with ``MSG_DONTWAIT``, without the GIL."""
        cdef const uint64_t* w = NULL
        cdef Py_ssize_t n = 0, index = 0
        cdef _Regions r
        cdef int code
        cdef cnp.ndarray arr
        cdef _Frame f
        cdef uint64_t small[3 * _SMALL_BATCH]
        if type(batch) is not cnp.ndarray:
            n = _small_batch(batch, small)
            if n == 0:
                return _POST_ARRAY, None
            w = small
        else:
            arr = <cnp.ndarray>batch
            if (cnp.PyArray_TYPE(arr) != cnp.NPY_UINT64 or cnp.PyArray_NDIM(arr) != 2 or not cnp.PyArray_ISCARRAY_RO(arr)
                    or cnp.PyArray_DIM(arr, 1) != 3):
                return _POST_ARRAY, None
            w = <const uint64_t*>cnp.PyArray_DATA(arr)
            n = cnp.PyArray_DIM(arr, 0)
        if n > self.max_writes:
            return _POST_TOO_MANY, None
        _regions(&r, loc_starts, loc_lengths, loc_views, rem_starts, rem_lengths)
        _check_note(len(note), n, grant)
        code = _check_batch(w, n, &r, &index)
        if code:
            self.index = index
            return code, None
        if self.failed:
            return _POST_FAILED, None
        if self.slots >= self.max_inflight:
            return _POST_FULL, None
        # The slot is taken before anything that may let another thread run (an allocation, the
        # mutex): two writers never both take the last one.
        self.slots += 1
        try:
            f = _new_frame(w, n, grant, note)
        except BaseException:
            self.slots -= 1
            raise
        f.on_done = on_done
        f.keep = loc_views
        f.src = self
        f.c.obj = <PyObject*>f
        f.c.callback = on_done is not None
        if not self._line_up(f, ids):
            return _POST_FAILED, None
        if self.sending or self.out is not None:
            return _POST_SENT, f.batch_id  # the thread sending takes it next (the sender thread is awake for a remainder)
        self.sending = True
        code = self._pump(MSG_DONTWAIT | MSG_NOSIGNAL)
        self._sent()
        if code == 0 or self.failed:
            return _POST_SENT, f.batch_id  # (a batch of a peer that failed meanwhile completed with the failure)
        return _POST_WAKE, f.batch_id  # the socket is full (or broke: the sender thread meets the error too)

    cdef bint _line_up(self, _Frame f, ids) except -1:
        """Queue a built frame under the mutex, with the next seq and the next batch id from ``ids``
        given together there (a peer's ids go up in the order its frames go out). False, its slot
        given back, if the peer failed while the frame was built."""
        Py_INCREF(<PyObject*>f)  # the lists' reference
        _lock(&self.mu)
        if self.failed:  # (it failed while the frame was built)
            pthread_mutex_unlock(&self.mu)
            Py_DECREF(<PyObject*>f)
            self.slots -= 1
            return False
        try:
            batch_id = next(ids)  # (a C call for itertools.count: nothing runs meanwhile)
        except BaseException:
            pthread_mutex_unlock(&self.mu)
            Py_DECREF(<PyObject*>f)
            self.slots -= 1
            raise
        f.batch_id = batch_id
        self.seq += 1
        f.c.seq = self.seq
        _put64(<unsigned char*>f.iov[0].iov_base, self.seq)
        if self.nflight == 0:
            self.last_progress = _now()
        self.nflight += 1
        _append(&self.unsent, &f.c)
        pthread_mutex_unlock(&self.mu)
        return True

    cdef void _sent(self) noexcept:
        """A send returned: ``sending`` off; a failure or a close that came meanwhile takes effect now."""
        self.sending = False
        if self.failed:
            self.out = None
        if self.closing:
            self._close()

    cdef void _close(self) noexcept:
        try:
            self.sock.close()
            self.ack_sock.close()
        except BaseException:
            pass
        self.fd = self.ack_fd = -1

    def close(self):
        """Fail the peer (see ``fail``; call that first to complete its batches) and close its sockets, at
        once or, if a writer is sending, as its send returns: a descriptor is never closed (and maybe
        reused) under a send. Call after the sender and ack threads ended."""
        _lock(&self.mu)
        self.failed = True
        pthread_mutex_unlock(&self.mu)
        self.closing = True
        if not self.sending:
            self._close()

    cdef int _take(self) except -1:
        """Move queued frames (up to ``_SEND_GATHER`` iovecs) in line for acks, as the next send's ``out``."""
        cdef list out = []
        cdef Py_ssize_t niov = 0
        cdef _fr* f
        cdef _Frame fo
        _lock(&self.mu)
        while self.unsent.head != NULL and (not out or niov + (<_Frame>self.unsent.head.obj).niov <= _SEND_GATHER):
            f = _pop(&self.unsent)
            _append(&self.flight, f)
            fo = <_Frame>f.obj
            out.append(fo)
            niov += fo.niov
        pthread_mutex_unlock(&self.mu)
        self.out, self.out_i, self.out_off = out, 0, 0
        return 0

    cdef int _pump(self, int flags) except -2:
        """Send ``out`` and then every queued frame: 0 once all went out, ``_TICKED`` when the socket
        took no more (``MSG_DONTWAIT``, or a kernel timeout), ``_GONE`` if the peer failed meanwhile,
        else the errno. Holds ``sending``."""
        cdef Py_ssize_t n, i
        cdef size_t off, rest
        cdef ssize_t k
        cdef _Frame f
        cdef msghdr msg
        cdef int e
        cdef bint whole
        memset(&msg, 0, sizeof(msg))
        msg.msg_iov = self.siov
        while True:
            if self.failed:
                return _GONE
            if self.out is None:
                if self.unsent.head == NULL:
                    return 0
                self._take()
                if not self.out:
                    self.out = None
                    continue
            # the iovecs from out_i, out_off bytes in: up to _IOV_CHUNK of them
            n = 0
            i = self.out_i
            off = self.out_off
            while i < len(self.out) and n < _IOV_CHUNK:
                n += _fill(self.siov + n, _IOV_CHUNK - n, <_Frame>self.out[i], off, &whole)
                if not whole:
                    break
                i += 1
                off = 0
            msg.msg_iovlen = <size_t>n
            with nogil:
                k = sendmsg(self.fd, &msg, flags)
                e = errno
            if k < 0:
                if e == EINTR:
                    continue
                if e == EAGAIN:
                    return _TICKED
                return e
            if k > 0:
                self.last_progress = _now()
            rest = <size_t>k
            while rest and self.out is not None:
                f = <_Frame>self.out[self.out_i]
                if rest >= f.nbytes - self.out_off:
                    rest -= f.nbytes - self.out_off
                    self.out_i += 1
                    self.out_off = 0
                    if self.out_i == len(self.out):
                        self.out = None
                else:
                    self.out_off += rest
                    rest = 0

    def send_blocking(self):
        """The sender thread's turn: send the remainder and every queued frame, blocking in ticks of the
        socket's kernel timeout. 0 once all went out, -1 if the peer failed meanwhile, else the errno of
        a send that broke; 0 at once if another thread is sending (it sends what is left)."""
        cdef int r
        if self.sending:
            return 0
        self.sending = True
        try:
            while True:
                r = self._pump(MSG_NOSIGNAL)
                if r != _TICKED:
                    break
        finally:
            self._sent()
        return -1 if r == _GONE else r

    def acks(self, Completions queue not None):
        """The ack loop, without the GIL: receive acks and complete the frames in flight they name,
        oldest first; a batch without ``on_done`` goes to ``queue`` (keeping its slot until taken).
        Returns ``(code, detail)`` when Python has something to do: ``ACKS_GOT`` (batches with
        ``on_done`` completed: ``callbacks()`` has them), ``ACKS_TICK`` (a kernel timeout passed),
        ``ACKS_CLOSED`` (errno in ``err``), ``ACKS_BAD`` / ``ACKS_ORDER`` (the message length / seq of
        the ack that broke the stream; the acks before it completed), ``ACKS_FAILED``."""
        cdef int r
        if self.ack_fd < 0:
            return _ACKS_CLOSED, 0
        with nogil:
            r = _acks(self, queue)
        return r, self.detail

    def callbacks(self):
        """The batches with ``on_done`` that acks completed, oldest first, as ``(on_done, batch_id,
        error)``; their slots come back."""
        cdef _chain got
        _lock(&self.mu)
        got = self.called
        self.called.head = self.called.tail = NULL
        pthread_mutex_unlock(&self.mu)
        return self._calls(&got)

    cdef list _calls(self, _chain* got):
        """``(on_done, batch_id, error)`` of each frame of ``got`` (whose references this drops)."""
        cdef list out = []
        cdef _fr* f = _pop(got)
        cdef _Frame fo
        while f != NULL:
            fo = <_Frame>f.obj
            Py_DECREF(f.obj)
            out.append((fo.on_done, fo.batch_id, _error_of(f, self.refused)))
            self.slots -= 1
            f = _pop(got)
        return out

    def idle(self, double stall):
        """On a tick of the ack reader: 0, or 1 if part of an ack came and nothing more for ``stall``
        seconds, or 2 if batches are in flight and nothing progressed for ``stall`` seconds."""
        cdef double now = _now()
        if self.astart != self.aend:
            return 1 if now - self.last_byte >= stall else 0
        if self.nflight and now - self.last_progress > stall:
            return 2
        return 0

    def fail(self, Completions queue not None, error):
        """The peer failed: no more posts; every batch in flight completes with ``error``, oldest
        first: those without ``on_done`` go to ``queue``, and ``(on_done, batch_id, error)`` of the
        others is returned, after those acks completed whose callbacks were not taken yet. Idempotent:
        a second call finds nothing left."""
        cdef _chain left, queued, called
        cdef _fr* f
        cdef Py_ssize_t k = 0
        left.head = left.tail = queued.head = queued.tail = called.head = called.tail = NULL
        _lock(&self.mu)
        self.failed = True
        called = self.called
        self.called.head = self.called.tail = NULL
        _splice(&left, &self.flight)
        _splice(&left, &self.unsent)
        self.nflight = 0
        f = _pop(&left)
        while f != NULL:
            f.error = <PyObject*>error
            Py_INCREF(f.error)
            if f.callback:
                _append(&called, f)
            else:
                _append(&queued, f)
                k += 1
            f = _pop(&left)
        if k:
            _push(queue, &queued, k)  # under our mutex: after every frame the ack loop queued
        pthread_mutex_unlock(&self.mu)
        if not self.sending:
            self.out = None  # a sender holds it until its send returns
        return self._calls(&called)


cdef int _acks(Source s, Completions q) noexcept nogil:
    """``Source.acks`` without the GIL: complete what the acks received name, else receive more."""
    cdef ssize_t k
    cdef size_t rest
    cdef int r
    while True:
        r = _complete(s, q)
        if r >= 0:
            return r
        # receive more (making room first)
        if s.astart == s.aend:
            s.astart = s.aend = 0
        elif _ACK_BUF - s.aend < _ACK + _MAX_MSG:
            rest = s.aend - s.astart
            memmove(s.abuf, s.abuf + s.astart, rest)
            s.astart, s.aend = 0, rest
        k = recv(s.ack_fd, s.abuf + s.aend, _ACK_BUF - s.aend, 0)
        if k > 0:
            s.aend += <size_t>k
            s.last_byte = _now()
            continue
        if k == 0:
            s.err = 0
            return _ACKS_CLOSED
        if errno == EINTR:
            continue
        if errno == EAGAIN:
            return _ACKS_TICK
        s.err = errno
        return _ACKS_CLOSED


cdef int _complete(Source s, Completions q) noexcept nogil:
    """Complete the frame of every whole ack received, oldest first, under the mutex: a frame with a
    callback into ``called``, the others onto ``q`` in one push (in the same hold, so before any frame
    ``fail()`` queues after them). ``_ACKS_FAILED``, ``_ACKS_BAD`` / ``_ACKS_ORDER`` (``detail`` set),
    ``_ACKS_GOT`` if callbacks are due, else -1: no whole ack is left, receive more."""
    cdef uint64_t seq
    cdef uint32_t status, n
    cdef int32_t err
    cdef _fr* f
    cdef _chain queued
    cdef Py_ssize_t nq = 0
    cdef bint called = False
    cdef int broke = 0
    cdef double now = _now()
    queued.head = queued.tail = NULL
    pthread_mutex_lock(&s.mu)
    while s.aend - s.astart >= _ACK and not s.failed:
        seq = _get64(s.abuf + s.astart)
        status = _get32(s.abuf + s.astart + 8)
        err = <int32_t>_get32(s.abuf + s.astart + 12)
        n = _get32(s.abuf + s.astart + 16)
        if n > _MAX_MSG:
            s.detail, broke = n, _ACKS_BAD
            break
        if s.aend - s.astart < _ACK + n:
            break
        f = s.flight.head
        if f == NULL or f.seq != seq:
            s.detail, broke = seq, _ACKS_ORDER
            break
        _pop(&s.flight)
        s.nflight -= 1
        f.status, f.err = status, err
        if status and n:
            f.msg = <unsigned char*>malloc(n)
            if f.msg != NULL:
                memcpy(f.msg, s.abuf + s.astart + _ACK, n)
                f.msglen = n
        s.astart += _ACK + n
        s.last_progress = now
        if f.callback:
            _append(&s.called, f)
            called = True
        else:
            _append(&queued, f)
            nq += 1
    if nq:
        _push(q, &queued, nq)  # under our mutex: before any frame fail() queues after them
    if s.failed:
        pthread_mutex_unlock(&s.mu)
        return _ACKS_FAILED
    pthread_mutex_unlock(&s.mu)
    if broke:
        return broke
    if called:
        return _ACKS_GOT
    return -1


cdef Py_ssize_t _fill(iovec* iov, Py_ssize_t room, _Frame f, size_t off, bint* whole) noexcept:
    """Copy ``f``'s iovecs from byte ``off`` on into ``iov`` (at most ``room``): how many; ``whole``:
    all of the rest of ``f``."""
    cdef Py_ssize_t k = 0, n = 0
    while k < f.niov and off >= f.iov[k].iov_len:
        off -= f.iov[k].iov_len
        k += 1
    while k < f.niov and n < room:
        iov[n].iov_base = <unsigned char*>f.iov[k].iov_base + off
        iov[n].iov_len = f.iov[k].iov_len - off
        off = 0
        n += 1
        k += 1
    whole[0] = k == f.niov
    return n


cdef _Frame _new_frame(const uint64_t* w, Py_ssize_t n, uint64_t grant, bytes note):
    """The frame of a checked batch: its head (seq 0 until ``_line_up``; the note at its end, so it goes
    out in the same ``sendmsg``) and, as iovecs in one allocation with it, the head and then each
    write's local range, straight from registered memory."""
    cdef size_t nnote = <size_t>len(note)
    cdef size_t heads = _HEAD + _PAIR * <size_t>n + nnote
    cdef Py_ssize_t i
    cdef _Frame f = _Frame.__new__(_Frame)
    f.iov = <iovec*>malloc(<size_t>(n + 1) * sizeof(iovec) + heads)
    if f.iov == NULL:
        raise MemoryError()
    cdef unsigned char* h = <unsigned char*>(f.iov + n + 1)
    _put_head(h, w, n, grant, <const unsigned char*><const char*>note, nnote)
    f.iov[0].iov_base = h
    f.iov[0].iov_len = heads
    f.nbytes = heads
    for i in range(n):
        f.iov[i + 1].iov_base = <void*><size_t>w[3 * i]
        f.iov[i + 1].iov_len = <size_t>w[3 * i + 2]
        f.nbytes += <size_t>w[3 * i + 2]
    f.niov = n + 1
    return f
