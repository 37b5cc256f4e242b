# Included by _tcp_fast.pyx: how a posted frame completes. ``_fr`` is a frame's place in line, which
# moves between the ``_chain`` lists (a source's queued, in flight and called ones; the queue's) without
# the GIL, carrying the reference to its ``_Frame``; ``Completions`` is the queue the ack loops hand the
# frames written without ``on_done`` to (``_push``), until ``take`` gives their slots back.

cdef struct _fr:
    # A posted frame as the lists hold it: the list that holds it owns one reference to its _Frame
    # (``obj``), and moving it between lists (even without the GIL) moves that reference.
    _fr* next
    uint64_t seq
    PyObject* obj
    bint callback  # completed through on_done (else through the Completions queue)
    uint32_t status  # its ack: status, errno and message (malloc'd) of a refused batch
    int32_t err
    unsigned char* msg
    uint32_t msglen
    PyObject* error  # the failure it completes with (fail()), owned


cdef class _Frame:
    """One posted batch: its head and payload as iovecs (``iov[0]`` the header and descriptors, then
    each write's local range), its place in line (``c``), and how it completes."""

    cdef _fr c
    cdef object batch_id
    cdef object on_done
    cdef object keep  # the local regions' views: the memory the iovecs point into stays alive
    cdef object src  # its Source: the slot goes back there
    cdef iovec* iov
    cdef Py_ssize_t niov
    cdef size_t nbytes

    def __dealloc__(self):
        free(self.iov)
        free(self.c.msg)
        if self.c.error != NULL:
            Py_DECREF(self.c.error)


cdef struct _chain:
    _fr* head
    _fr* tail


cdef inline void _append(_chain* c, _fr* f) noexcept nogil:
    f.next = NULL
    if c.tail == NULL:
        c.head = f
    else:
        c.tail.next = f
    c.tail = f


cdef inline _fr* _pop(_chain* c) noexcept nogil:
    cdef _fr* f = c.head
    if f != NULL:
        c.head = f.next
        if c.head == NULL:
            c.tail = NULL
        f.next = NULL
    return f


cdef inline void _splice(_chain* c, _chain* more) noexcept nogil:
    """Append all of ``more`` to ``c``; ``more`` is left empty."""
    if more.head == NULL:
        return
    if c.tail == NULL:
        c.head = more.head
    else:
        c.tail.next = more.head
    c.tail = more.tail
    more.head = more.tail = NULL


cdef class Completions:
    """The completions of batches written without ``on_done``, oldest first, across a transport's
    peers, in C behind a mutex: a source's ack loop adds to it without the GIL. A batch keeps its
    in-flight slot until ``take`` hands its completion out (the queue stays bounded by the slots).
    ``make(batch_id, error)`` builds what ``take`` returns; ``refused(status, errno, message)`` the
    error of a batch the sink refused."""

    cdef pthread_mutex_t mu
    cdef pthread_cond_t cv  # signalled on a push while someone waits
    cdef _chain done
    cdef Py_ssize_t n
    cdef int waiters
    cdef object make
    cdef object refused

    def __cinit__(self, make not None, refused not None):
        pthread_mutex_init(&self.mu, NULL)
        _cond_init(&self.cv)
        self.make, self.refused = make, refused

    def __dealloc__(self):
        cdef _fr* f = _pop(&self.done)
        while f != NULL:
            Py_DECREF(f.obj)
            f = _pop(&self.done)
        pthread_cond_destroy(&self.cv)
        pthread_mutex_destroy(&self.mu)

    def __len__(self):
        return self.n

    def take(self, Py_ssize_t max_items):
        """Up to ``max_items`` completions, oldest first; their slots go back to their peers (whose
        ``on_slot`` runs when a writer waits for one)."""
        cdef _chain got
        cdef _fr* f
        cdef Py_ssize_t k = 0
        cdef list out = []
        cdef _Frame fo
        cdef Source src
        cdef Source woken = None
        got.head = got.tail = NULL
        _lock(&self.mu)
        while k < max_items and self.done.head != NULL:
            _append(&got, _pop(&self.done))
            k += 1
        self.n -= k
        pthread_mutex_unlock(&self.mu)
        f = _pop(&got)
        while f != NULL:
            fo = <_Frame>f.obj
            Py_DECREF(f.obj)  # the list's reference: ``fo`` holds one now
            out.append(self.make(fo.batch_id, _error_of(f, self.refused)))
            src = <Source>fo.src
            src.slots -= 1
            if src.waiters and src is not woken:
                if woken is not None:
                    woken.on_slot()
                woken = src
            f = _pop(&got)
        if woken is not None:
            woken.on_slot()
        return out

    def wait(self, double seconds):
        """Wait (without the GIL) up to ``seconds`` for a completion to take; True if one is there."""
        cdef timespec at
        cdef bint any
        _deadline_at(&at, _now() + (seconds if seconds > 0 else 0))
        with nogil:
            pthread_mutex_lock(&self.mu)
            self.waiters += 1
            while self.n == 0:
                if pthread_cond_timedwait(&self.cv, &self.mu, &at) == ETIMEDOUT:
                    break
            self.waiters -= 1
            any = self.n > 0
            pthread_mutex_unlock(&self.mu)
        return any


cdef void _push(Completions q, _chain* more, Py_ssize_t k) noexcept nogil:
    """Queue ``k`` completed frames (their references move to the queue); wake the waiters."""
    pthread_mutex_lock(&q.mu)
    _splice(&q.done, more)
    q.n += k
    if q.waiters:
        pthread_cond_broadcast(&q.cv)
    pthread_mutex_unlock(&q.mu)


cdef object _error_of(_fr* f, object refused):
    """What a completed frame completes with: the failure ``fail()`` gave it, else the error
    ``refused`` words from a refusing ack's status, errno and message, else None (landed)."""
    if f.error != NULL:
        return <object>f.error
    if f.status:
        return refused(f.status, f.err, PyBytes_FromStringAndSize(<const char*>f.msg, f.msglen))
    return None
