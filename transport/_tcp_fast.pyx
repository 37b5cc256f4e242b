# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True
"""Per-batch work of the TCP transport, compiled twin of ``transport._tcp_fast_py`` (same names,
signatures, results and errors; ``transport.tcp`` chooses, like ``transport.plan``).

``frame`` (source) checks a batch against the local and remote regions and builds its frame head
and payload views in one pass. ``Source`` (one
connected peer): ``post`` checks a batch the same way, takes a slot and sends the frame from the
writer's thread (head and payload as iovecs straight from registered memory), ``send_blocking`` is
the sender thread's remainder, ``acks`` the ack loop, which completes frames and queues them on
``Completions`` without the GIL. ``Sink`` and ``SinkConn`` (sink): the table of regions and live
grants every frame is checked against, and each connection's loop, which reads a frame, checks it,
receives its payload into place and acks, all without the GIL. Shared state is behind pthread
mutexes that the loops take without the GIL and Python-side calls take too. See the twin for the
contract.
"""

cimport numpy as cnp
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport EAGAIN, EINTR, ENOMEM, ETIMEDOUT, errno
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memmove, memset
from posix.mman cimport MAP_ANONYMOUS, MAP_FAILED, MAP_POPULATE, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap, munmap
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from posix.types cimport time_t
from posix.uio cimport iovec

cnp.import_array()

__all__ = [
    "ACK_SIZE",
    "FRAME_SIZE",
    "FRAME_LOCAL_OUTSIDE",
    "FRAME_OK",
    "FRAME_REMOTE_OUTSIDE",
    "FRAME_ZERO_LENGTH",
    "LAND_GRANT_NOT_LIVE",
    "LAND_GRANT_OTHER_SOURCE",
    "LAND_NEEDS_GRANT",
    "LAND_OK",
    "LAND_OUTSIDE_GRANT",
    "LAND_OUTSIDE_REGIONS",
    "SERVE_BROKEN",
    "SERVE_CLOSED",
    "SERVE_REFUSED",
    "SERVE_STALLED",
    "SERVE_STOPPED",
    "Sink",
    "SinkConn",
    "ACKS_BAD",
    "ACKS_CLOSED",
    "ACKS_FAILED",
    "ACKS_GOT",
    "ACKS_ORDER",
    "ACKS_TICK",
    "Completions",
    "MAX_MSG",
    "POST_ARRAY",
    "POST_FAILED",
    "POST_FULL",
    "POST_TOO_MANY",
    "POST_SENT",
    "POST_WAKE",
    "Source",
    "frame",
]

FRAME_SIZE = 24
ACK_SIZE = 20

cdef enum:  # a batch's checks at the source (the Python names below are these)
    _FRAME_OK = 0
    _FRAME_ZERO_LENGTH = 1
    _FRAME_LOCAL_OUTSIDE = 2
    _FRAME_REMOTE_OUTSIDE = 3

FRAME_OK = _FRAME_OK
FRAME_ZERO_LENGTH = _FRAME_ZERO_LENGTH
FRAME_LOCAL_OUTSIDE = _FRAME_LOCAL_OUTSIDE
FRAME_REMOTE_OUTSIDE = _FRAME_REMOTE_OUTSIDE

cdef enum:  # the sink's refusals (the Python names below are these)
    _LAND_OK = 0
    _LAND_OUTSIDE_REGIONS = 1
    _LAND_NEEDS_GRANT = 2
    _LAND_GRANT_NOT_LIVE = 3
    _LAND_GRANT_OTHER_SOURCE = 4
    _LAND_OUTSIDE_GRANT = 5

LAND_OK = _LAND_OK
LAND_OUTSIDE_REGIONS = _LAND_OUTSIDE_REGIONS
LAND_NEEDS_GRANT = _LAND_NEEDS_GRANT
LAND_GRANT_NOT_LIVE = _LAND_GRANT_NOT_LIVE
LAND_GRANT_OTHER_SOURCE = _LAND_GRANT_OTHER_SOURCE
LAND_OUTSIDE_GRANT = _LAND_OUTSIDE_GRANT

cdef enum:
    _HEAD = 24  # seq u64, count u32, 0 u32, grant u64
    _PAIR = 16  # addr u64, length u64
    _ACK = 20  # seq u64, status u32, errno i32, message length u32
    # The most a sink connection keeps in each of its buffers between frames (64 KiB and a little): a
    # frame of more writes (up to max_writes, 16 MiB of descriptors at the transport's default) gets a
    # header buffer of its own for as long as it is read and checked, unmapped once the frame is done,
    # so what many connections hold does not grow with the largest batch each ever received. Frames of
    # up to 4096 writes use the usual buffer and allocate nothing.
    _KEEP = 65600  # _HEAD + _AHEAD + 4096 * _PAIR


cdef inline int _array(cnp.ndarray a, int typenum, int ndim, const void** data, Py_ssize_t* n) except -1:
    """The data and length of a C-contiguous, aligned, native-order array of ``typenum`` and
    ``ndim`` dimensions (the last of a 2-d one must be 3); ``ValueError`` otherwise. Typed
    memoryviews would do the same at several times the cost per call, the cost that counts here."""
    if (cnp.PyArray_TYPE(a) != typenum or cnp.PyArray_NDIM(a) != ndim or not cnp.PyArray_ISCARRAY_RO(a)
            or (ndim == 2 and cnp.PyArray_DIM(a, 1) != 3)):
        raise ValueError(f"expected a contiguous {'(n, 3)' if ndim == 2 else '1-d'} array of "
                         f"{'uint8' if typenum == cnp.NPY_UINT8 else 'uint64'}, got {a.dtype} {(<object>a).shape}")
    data[0] = cnp.PyArray_DATA(a)
    n[0] = cnp.PyArray_DIM(a, 0)
    return 0


cdef inline uint64_t _get64(const unsigned char* p) noexcept nogil:
    return (<uint64_t>p[0] | <uint64_t>p[1] << 8 | <uint64_t>p[2] << 16 | <uint64_t>p[3] << 24
            | <uint64_t>p[4] << 32 | <uint64_t>p[5] << 40 | <uint64_t>p[6] << 48 | <uint64_t>p[7] << 56)


cdef inline uint32_t _get32(const unsigned char* p) noexcept nogil:
    return <uint32_t>p[0] | <uint32_t>p[1] << 8 | <uint32_t>p[2] << 16 | <uint32_t>p[3] << 24


cdef inline void _put64(unsigned char* p, uint64_t v) noexcept nogil:
    cdef int k
    for k in range(8):
        p[k] = <unsigned char>(v >> (8 * k))


cdef inline void _put32(unsigned char* p, uint32_t v) noexcept nogil:
    cdef int k
    for k in range(4):
        p[k] = <unsigned char>(v >> (8 * k))


cdef inline Py_ssize_t _find(const uint64_t* starts, const uint64_t* lengths, Py_ssize_t n,
                             uint64_t addr, uint64_t length) noexcept nogil:
    """The index of the region holding all of ``[addr, addr + length)``, or -1 (no overflow: the
    end is compared as an offset into the region)."""
    cdef Py_ssize_t lo = 0, hi = n, mid
    cdef uint64_t off
    while lo < hi:  # the first start above addr
        mid = (lo + hi) >> 1
        if starts[mid] <= addr:
            lo = mid + 1
        else:
            hi = mid
    if lo == 0:
        return -1
    off = addr - starts[lo - 1]
    if off > lengths[lo - 1] or length > lengths[lo - 1] - off:
        return -1
    return lo - 1


cdef int _check_batch(const uint64_t* w, Py_ssize_t n, const uint64_t* ls, const uint64_t* ll, Py_ssize_t nl,
                      const uint64_t* rs, const uint64_t* rl, Py_ssize_t nr, Py_ssize_t* index) noexcept nogil:
    """``FRAME_OK``, or the ``FRAME_*`` code of the first failing write (its index in ``index``): a zero
    length anywhere first; then, write by write, the local range, then the remote one."""
    cdef Py_ssize_t i
    for i in range(n):
        if w[3 * i + 2] == 0:
            index[0] = i
            return _FRAME_ZERO_LENGTH
    for i in range(n):
        if _find(ls, ll, nl, w[3 * i], w[3 * i + 2]) < 0:
            index[0] = i
            return _FRAME_LOCAL_OUTSIDE
        if _find(rs, rl, nr, w[3 * i + 1], w[3 * i + 2]) < 0:
            index[0] = i
            return _FRAME_REMOTE_OUTSIDE
    return _FRAME_OK


def frame(cnp.ndarray batch not None, uint64_t grant, cnp.ndarray loc_starts not None,
          cnp.ndarray loc_lengths not None, list loc_views not None,
          cnp.ndarray rem_starts not None, cnp.ndarray rem_lengths not None):
    """Check a batch (a C-contiguous ``(n, 3)`` ``uint64`` array) and build what goes on the wire:
    ``(0, 0, [head, view, ...])`` or ``(FRAME_* code, index of the first failing write, None)``.
    ``Source.post`` runs the same checks and builds the same head."""
    cdef const uint64_t* w = NULL
    cdef const uint64_t* ls = NULL
    cdef const uint64_t* ll = NULL
    cdef const uint64_t* rs = NULL
    cdef const uint64_t* rl = NULL
    cdef Py_ssize_t n = 0, nl = 0, nl2 = 0, nr = 0, nr2 = 0, i, j, off, index = 0
    cdef int code
    _array(batch, cnp.NPY_UINT64, 2, <const void**>&w, &n)
    _array(loc_starts, cnp.NPY_UINT64, 1, <const void**>&ls, &nl)
    _array(loc_lengths, cnp.NPY_UINT64, 1, <const void**>&ll, &nl2)
    _array(rem_starts, cnp.NPY_UINT64, 1, <const void**>&rs, &nr)
    _array(rem_lengths, cnp.NPY_UINT64, 1, <const void**>&rl, &nr2)
    if nl2 != nl or nr2 != nr or len(loc_views) != nl:
        raise ValueError("region starts, lengths and views differ in length")
    code = _check_batch(w, n, ls, ll, nl, rs, rl, nr, &index)
    if code:
        return code, index, None
    head = PyByteArray_FromStringAndSize(NULL, _HEAD + _PAIR * n)
    cdef unsigned char* h = <unsigned char*>PyByteArray_AS_STRING(head)
    _put64(h, 0)
    _put64(h + 8, <uint64_t>n)  # count u32, then the 0 u32
    _put64(h + 16, grant)
    bufs = [memoryview(head)]
    for i in range(n):
        _put64(h + _HEAD + _PAIR * i, w[3 * i + 1])
        _put64(h + _HEAD + _PAIR * i + 8, w[3 * i + 2])
        j = _find(ls, ll, nl, w[3 * i], w[3 * i + 2])
        off = <Py_ssize_t>(w[3 * i] - ls[j])
        bufs.append(loc_views[j][off : off + <Py_ssize_t>w[3 * i + 2]])
    return FRAME_OK, 0, bufs


# ---------------------------------------------------------------------------------------- the sink


cdef extern from "<sys/socket.h>" nogil:
    cdef struct msghdr:
        void* msg_name
        unsigned int msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    ssize_t recvmsg(int fd, msghdr* msg, int flags)
    ssize_t sendmsg(int fd, const msghdr* msg, int flags)
    int shutdown(int fd, int how)
    int MSG_DONTWAIT
    int MSG_NOSIGNAL
    int SHUT_RDWR

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_mutex_init(pthread_mutex_t* m, const void* attr)
    int pthread_mutex_destroy(pthread_mutex_t* m)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_trylock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)
    int pthread_condattr_init(pthread_condattr_t* a)
    int pthread_condattr_setclock(pthread_condattr_t* a, int clock)
    int pthread_condattr_destroy(pthread_condattr_t* a)
    int pthread_cond_init(pthread_cond_t* c, const pthread_condattr_t* a)
    int pthread_cond_destroy(pthread_cond_t* c)
    int pthread_cond_broadcast(pthread_cond_t* c)
    int pthread_cond_timedwait(pthread_cond_t* c, pthread_mutex_t* m, const timespec* t)


cdef inline double _now() noexcept nogil:
    """``time.monotonic()``, without the GIL (the same clock)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


cdef inline void _lock(pthread_mutex_t* m) noexcept:
    """Take ``m`` from a thread holding the GIL: at once when free, else without the GIL (its holder
    never needs the GIL, and Python threads go on meanwhile)."""
    if pthread_mutex_trylock(m) != 0:
        with nogil:
            pthread_mutex_lock(m)


cdef struct _Grant:
    uint64_t key
    unsigned char source[16]
    Py_ssize_t n
    uint64_t* starts  # n starts, then n lengths, in one allocation
    uint64_t* lengths


cdef struct _Conn:
    int fd
    int landing  # a frame is landing: checked, its payload not all received yet
    uint64_t grant  # ... through this grant (0: none)
    uint64_t* used  # ... into the regions of these keys
    Py_ssize_t nused
    Py_ssize_t capused
    size_t held  # bytes its buffers hold, as its loop last said (``Sink.retained``)
    _Conn* prev
    _Conn* next


cdef int _use(_Conn* c, uint64_t key) noexcept nogil:
    """Note that the landing frame writes into region ``key`` (each key once); -1 out of memory."""
    cdef Py_ssize_t k
    cdef uint64_t* grown
    for k in range(c.nused):
        if c.used[k] == key:
            return 0
    if c.nused == c.capused:
        grown = <uint64_t*>realloc(c.used, <size_t>(2 * c.capused + 4) * sizeof(uint64_t))
        if grown == NULL:
            return -1
        c.used = grown
        c.capused = 2 * c.capused + 4
    c.used[c.nused] = key
    c.nused += 1
    return 0


cdef inline void _deadline_at(timespec* ts, double at) noexcept nogil:
    ts.tv_sec = <time_t>at
    ts.tv_nsec = <long>((at - <double>ts.tv_sec) * 1e9)
    if ts.tv_nsec >= 1000000000:
        ts.tv_sec += 1
        ts.tv_nsec -= 1000000000


cdef class Sink:
    """The sink's landing table: the regions and live grants every frame is checked against, and the
    mark of each connection landing a frame, in C behind one mutex that the connections' loops
    (``SinkConn.serve``, without the GIL) and the Python side (``set_regions``, ``add_grant``,
    ``remove_grant``, ``wait_grant``, ``cut_grant``, ``wait_region``, ``stop``) both take."""

    cdef pthread_mutex_t mu
    cdef pthread_cond_t cleared  # broadcast when a landing mark is cleared and someone waits for it
    cdef int waiters
    cdef int stopped
    cdef uint64_t* r_start
    cdef uint64_t* r_len
    cdef uint64_t* r_key
    cdef unsigned char* r_guard
    cdef Py_ssize_t nreg
    cdef _Grant** grants  # sorted by key
    cdef Py_ssize_t ngrants
    cdef Py_ssize_t capgrants
    cdef _Conn* conns
    cdef object views

    def __cinit__(self):
        cdef pthread_condattr_t attr
        pthread_mutex_init(&self.mu, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self.cleared, &attr)
        pthread_condattr_destroy(&attr)
        self.views = []

    def __dealloc__(self):
        cdef Py_ssize_t k
        for k in range(self.ngrants):
            free(self.grants[k].starts)
            free(self.grants[k])
        free(self.grants)
        free(self.r_start)
        free(self.r_len)
        free(self.r_key)
        free(self.r_guard)
        pthread_cond_destroy(&self.cleared)
        pthread_mutex_destroy(&self.mu)

    def set_regions(self, cnp.ndarray starts not None, cnp.ndarray lengths not None, cnp.ndarray guarded not None,
                    cnp.ndarray keys not None, list views not None):
        """Replace the regions frames are checked against (sorted by start, not overlapping): a frame
        checked after this sees only these."""
        cdef const uint64_t* s = NULL
        cdef const uint64_t* l = NULL
        cdef const uint64_t* k = NULL
        cdef const unsigned char* g = NULL
        cdef Py_ssize_t n = 0, n2 = 0, n3 = 0, n4 = 0
        _array(starts, cnp.NPY_UINT64, 1, <const void**>&s, &n)
        _array(lengths, cnp.NPY_UINT64, 1, <const void**>&l, &n2)
        _array(guarded, cnp.NPY_UINT8, 1, <const void**>&g, &n3)
        _array(keys, cnp.NPY_UINT64, 1, <const void**>&k, &n4)
        if n2 != n or n3 != n or n4 != n or len(views) != n:
            raise ValueError("region starts, lengths, flags, keys and views differ in length")
        cdef size_t size = <size_t>(n if n else 1) * sizeof(uint64_t)
        cdef uint64_t* ns = <uint64_t*>malloc(size)
        cdef uint64_t* nl = <uint64_t*>malloc(size)
        cdef uint64_t* nk = <uint64_t*>malloc(size)
        cdef unsigned char* ng = <unsigned char*>malloc(<size_t>(n if n else 1))
        if ns == NULL or nl == NULL or nk == NULL or ng == NULL:
            free(ns)
            free(nl)
            free(nk)
            free(ng)
            raise MemoryError()
        memcpy(ns, s, <size_t>n * sizeof(uint64_t))
        memcpy(nl, l, <size_t>n * sizeof(uint64_t))
        memcpy(nk, k, <size_t>n * sizeof(uint64_t))
        memcpy(ng, g, <size_t>n)
        _lock(&self.mu)
        ns, self.r_start = self.r_start, ns
        nl, self.r_len = self.r_len, nl
        nk, self.r_key = self.r_key, nk
        ng, self.r_guard = self.r_guard, ng
        self.nreg = n
        pthread_mutex_unlock(&self.mu)
        free(ns)
        free(nl)
        free(nk)
        free(ng)
        self.views = views

    def add_grant(self, uint64_t key, bytes source not None, cnp.ndarray starts not None, cnp.ndarray lengths not None):
        """Make grant ``key`` live: ``source`` (16 bytes) may write inside its ranges (sorted, not
        overlapping). A key already live is replaced."""
        cdef const uint64_t* s = NULL
        cdef const uint64_t* l = NULL
        cdef Py_ssize_t n = 0, n2 = 0, lo, hi, mid
        _array(starts, cnp.NPY_UINT64, 1, <const void**>&s, &n)
        _array(lengths, cnp.NPY_UINT64, 1, <const void**>&l, &n2)
        if n2 != n:
            raise ValueError("grant starts and lengths differ in length")
        if len(source) != 16:
            raise ValueError(f"a grant names a source of 16 bytes, got {len(source)}")
        cdef _Grant* g = <_Grant*>malloc(sizeof(_Grant))
        if g == NULL:
            raise MemoryError()
        g.starts = <uint64_t*>malloc(<size_t>(2 * n if n else 1) * sizeof(uint64_t))
        if g.starts == NULL:
            free(g)
            raise MemoryError()
        g.key, g.n, g.lengths = key, n, g.starts + n
        memcpy(g.source, <const char*>source, 16)
        memcpy(g.starts, s, <size_t>n * sizeof(uint64_t))
        memcpy(g.lengths, l, <size_t>n * sizeof(uint64_t))
        cdef _Grant* old = NULL
        cdef _Grant** grown
        _lock(&self.mu)
        lo, hi = 0, self.ngrants
        while lo < hi:
            mid = (lo + hi) >> 1
            if self.grants[mid].key < key:
                lo = mid + 1
            else:
                hi = mid
        if lo < self.ngrants and self.grants[lo].key == key:
            old, self.grants[lo] = self.grants[lo], g
        else:
            if self.ngrants == self.capgrants:
                grown = <_Grant**>realloc(self.grants, <size_t>(2 * self.capgrants + 16) * sizeof(_Grant*))
                if grown == NULL:
                    pthread_mutex_unlock(&self.mu)
                    free(g.starts)
                    free(g)
                    raise MemoryError()
                self.grants, self.capgrants = grown, 2 * self.capgrants + 16
            memmove(self.grants + lo + 1, self.grants + lo, <size_t>(self.ngrants - lo) * sizeof(_Grant*))
            self.grants[lo] = g
            self.ngrants += 1
        pthread_mutex_unlock(&self.mu)
        if old != NULL:
            free(old.starts)
            free(old)

    def remove_grant(self, uint64_t key):
        """Take grant ``key`` out: no frame checked from now on lands through it. True if it was live."""
        cdef _Grant* g = NULL
        _lock(&self.mu)
        cdef Py_ssize_t i = _grant_index(self, key)
        if i >= 0:
            g = self.grants[i]
            memmove(self.grants + i, self.grants + i + 1, <size_t>(self.ngrants - i - 1) * sizeof(_Grant*))
            self.ngrants -= 1
        pthread_mutex_unlock(&self.mu)
        if g == NULL:
            return False
        free(g.starts)
        free(g)
        return True

    def wait_grant(self, uint64_t key, double seconds):
        """Wait up to ``seconds`` until no connection is landing a frame through grant ``key``; True if none is."""
        cdef bint idle
        with nogil:
            idle = _wait(self, key, 0, seconds)
        return idle

    def wait_region(self, uint64_t key, double seconds):
        """Wait up to ``seconds`` until no connection is landing a frame into region ``key``; True if none is."""
        cdef bint idle
        with nogil:
            idle = _wait(self, key, 1, seconds)
        return idle

    def cut_grant(self, uint64_t key):
        """Shut down (both ways) every connection landing a frame through grant ``key`` now: its loop
        stops receiving, clears its mark and ends. Returns how many. Under the mutex, so a connection
        cut is one still marked, whose socket its owner has not closed."""
        cdef _Conn* c
        cdef int n = 0
        _lock(&self.mu)
        c = self.conns
        while c != NULL:
            if c.landing and c.grant == key:
                shutdown(c.fd, SHUT_RDWR)
                n += 1
            c = c.next
        pthread_mutex_unlock(&self.mu)
        return n

    def check(self, bytes desc not None, uint64_t grant, bytes source not None):
        """What a frame of these descriptor pairs naming ``grant`` from ``source`` would get now:
        ``(code, index of the first failing write, total payload bytes)`` (``LAND_OK``, 0, total)."""
        cdef Py_ssize_t index = 0
        cdef uint64_t total = 0
        cdef int code
        if len(source) != 16:
            raise ValueError(f"a source is 16 bytes, got {len(source)}")
        _lock(&self.mu)
        code = _check(self, <const unsigned char*>desc, len(desc) // _PAIR, grant, <const unsigned char*>source, &index, NULL)
        pthread_mutex_unlock(&self.mu)
        if code:
            return code, index, 0
        return _LAND_OK, 0, _total(<const unsigned char*>desc, len(desc) // _PAIR)

    def retained(self):
        """The bytes each attached connection holds in its own buffers (a frame's header and descriptors,
        gathered acks, a refused payload's scratch, its landing marks), as its loop last said: between
        frames, once its acks went out, at most ``_KEEP`` (64 KiB) in each, whatever the frames were;
        more only while a frame of more writes is read and checked. A list, one per connection
        (diagnostics)."""
        cdef _Conn* c
        out = []
        _lock(&self.mu)
        c = self.conns
        while c != NULL:
            out.append(c.held)
            c = c.next
        pthread_mutex_unlock(&self.mu)
        return out

    def stop(self):
        """The transport is closing: every loop ends at its next tick."""
        _lock(&self.mu)
        self.stopped = 1
        pthread_mutex_unlock(&self.mu)

    def connection(self, sock not None, acks not None, bytes source not None, uint64_t max_writes, double stall):
        """A connection past its handshake, from ``source``, and the one its acks go out on: see ``SinkConn``."""
        return SinkConn(self, sock, acks, source, max_writes, stall)


cdef Py_ssize_t _grant_index(Sink s, uint64_t key) noexcept nogil:
    cdef Py_ssize_t lo = 0, hi = s.ngrants, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if s.grants[mid].key < key:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < s.ngrants and s.grants[lo].key == key else -1


cdef bint _busy(Sink s, uint64_t key, int region) noexcept nogil:
    """Is a connection landing a frame through grant ``key`` (``region`` 0) or into region ``key``? Holds the mutex."""
    cdef _Conn* c = s.conns
    cdef Py_ssize_t k
    while c != NULL:
        if c.landing:
            if not region and c.grant == key:
                return True
            if region:
                for k in range(c.nused):
                    if c.used[k] == key:
                        return True
        c = c.next
    return False


cdef bint _wait(Sink s, uint64_t key, int region, double seconds) noexcept nogil:
    cdef timespec at
    cdef bint busy
    _deadline_at(&at, _now() + (seconds if seconds > 0 else 0))
    pthread_mutex_lock(&s.mu)
    s.waiters += 1
    while _busy(s, key, region):
        if pthread_cond_timedwait(&s.cleared, &s.mu, &at) == ETIMEDOUT:
            break
    busy = _busy(s, key, region)
    s.waiters -= 1
    pthread_mutex_unlock(&s.mu)
    return not busy


cdef uint64_t _total(const unsigned char* d, Py_ssize_t count) noexcept nogil:
    """The payload bytes of a frame: the sum of its lengths, saturated at 2**64 - 1."""
    cdef uint64_t total = 0, length
    cdef Py_ssize_t i
    for i in range(count):
        length = _get64(d + _PAIR * i + 8)
        if total + length < total:
            return <uint64_t>-1
        total += length
    return total


cdef int _check(Sink s, const unsigned char* d, Py_ssize_t count, uint64_t grant, const unsigned char* source,
                Py_ssize_t* index, _Conn* mark) noexcept nogil:
    """Check every write of a frame before any lands (holds the mutex): ``LAND_OK`` or the ``LAND_*``
    refusal of the first failing write (its index in ``index``). A write must lie inside one region;
    with grant 0 that region must not require grants; with a grant, the grant must be live, given to
    ``source``, and hold the write inside one of its ranges (``GrantTable.check``'s rules; the grant
    is looked up once, at the first write that needs it). With ``mark``, the regions written are noted
    in it (-1: out of memory)."""
    cdef Py_ssize_t i, j, last = -1
    cdef uint64_t addr, length
    cdef int state = -1
    cdef _Grant* g = NULL
    cdef Py_ssize_t gi
    for i in range(count):
        addr = _get64(d + _PAIR * i)
        length = _get64(d + _PAIR * i + 8)
        j = _find(s.r_start, s.r_len, s.nreg, addr, length) if length else -1
        if j < 0:
            index[0] = i
            return _LAND_OUTSIDE_REGIONS
        if j != last:
            if not grant and s.r_guard[j]:
                index[0] = i
                return _LAND_NEEDS_GRANT
            if mark != NULL and _use(mark, s.r_key[j]) < 0:
                index[0] = i
                return -1
            last = j
        if grant:
            if state < 0:
                gi = _grant_index(s, grant)
                if gi < 0:
                    state = _LAND_GRANT_NOT_LIVE
                else:
                    g = s.grants[gi]
                    state = _LAND_GRANT_OTHER_SOURCE if memcmp(g.source, source, 16) else _LAND_OK
            if state:
                index[0] = i
                return state
            if _find(g.starts, g.lengths, g.n, addr, length) < 0:
                index[0] = i
                return _LAND_OUTSIDE_GRANT
    return _LAND_OK


# serve()'s results: a refused frame (the caller words the ack and calls refuse()), or how the connection ended
cdef enum:
    _SERVE_REFUSED = 0
    _SERVE_CLOSED = 1  # the peer closed the connection, or it broke (errno in the result)
    _SERVE_BROKEN = 2  # a frame broke the wire format: the stream cannot be trusted past it
    _SERVE_STALLED = 3  # the peer sent nothing for ``stall`` seconds mid-frame (or took no ack for that long)
    _SERVE_STOPPED = 4  # the transport is closing

SERVE_REFUSED = _SERVE_REFUSED
SERVE_CLOSED = _SERVE_CLOSED
SERVE_BROKEN = _SERVE_BROKEN
SERVE_STALLED = _SERVE_STALLED
SERVE_STOPPED = _SERVE_STOPPED

cdef enum:
    _IOV_CHUNK = 512  # iovecs per recvmsg: below IOV_MAX (1024 on Linux)
    _AHEAD = 40  # bytes a sink may read past a payload: the next frame's header and first descriptor
    _ACK_GATHER = 16  # acks gathered at most under load
    _DISCARD = 65536
    _BUF = 4096  # a connection's header and ack buffers to begin with
    _TICKED = -1  # a blocking call waited one kernel timeout (not a SERVE_* result)
    _GONE = -3  # the peer failed while a send was under way
cdef uint64_t _ACK_GATHER_BYTES = 1 << 20


cdef class SinkConn:
    """One data connection past its handshake (acks go out on ``acks``, its ack connection, or the same
    socket): ``serve()`` runs its loop without the GIL until a frame is refused (the caller words the
    ack: ``refuse()``, then ``serve()`` again) or the connection ends.

    Per frame: read its header and descriptors; check every write (``Sink`` mutex held; on success the
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
        """Land frames until one is refused or the connection ends. Returns ``(SERVE_REFUSED, seq, code,
        index, count, addr, length, grant, total)`` for a refused frame (its header and descriptors
        read, its payload not yet: ``refuse()`` drops it), else ``(SERVE_*, errno)``."""
        cdef int r
        cdef const unsigned char* d
        if not self.attached:
            raise ValueError("serve() on a closed connection")
        with nogil:
            r = _serve(self)
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


cdef int _failed(SinkConn s, ssize_t k) noexcept nogil:
    """After a recv or send that returned ``k`` <= 0: 0 to retry now (EINTR), ``_TICKED`` on a tick
    (EAGAIN), else ``_SERVE_CLOSED`` (errno kept)."""
    if k == 0:
        s.err = 0
        return _SERVE_CLOSED
    if errno == EINTR:
        return 0
    if errno == EAGAIN:
        return _TICKED
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
            r = _failed(s, k)
            if r == _TICKED:
                r = _tick(s, last, idle and got == 0)
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
            r = _failed(s, k)
            if r == _TICKED:
                r = _tick(s, last, False)
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
            r = _failed(s, k)
            if r == _TICKED:
                r = _tick(s, last, False)
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
            why = _failed(s, r)
            if why == _TICKED:
                why = _tick(s, last, False)
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
    cdef ssize_t k
    cdef int r, code
    cdef uint64_t seq, grant, total
    cdef Py_ssize_t count, index = 0
    cdef size_t need
    cdef const unsigned char* d
    s.err = 0
    while True:
        _trim(s)  # before the acks go out: a source that has them sees what the connection keeps
        if s.discard:
            r = _drop(s)
            if r:
                return r
            if s.nacks >= _ACK_GATHER or s.acked_bytes >= _ACK_GATHER_BYTES:
                r = _flush(s)
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
                r = _flush(s)
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
        grant = _get64(s.hb + 16)
        if <uint64_t>count > s.max_writes:
            return _SERVE_BROKEN
        need = _HEAD + _PAIR * <size_t>count
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
        pthread_mutex_lock(&s.sink.mu)
        code = _check(s.sink, d, count, grant, s.source, &index, &s.c)
        if code == _LAND_OK:
            s.c.landing = 1
            s.c.grant = grant
        else:
            s.c.nused = 0
        pthread_mutex_unlock(&s.sink.mu)
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
        if s.nacks >= _ACK_GATHER or s.acked_bytes >= _ACK_GATHER_BYTES:
            r = _flush(s)
            if r:
                return r


cdef int _read_some(SinkConn s, size_t want) noexcept nogil:
    """Read until ``hlen`` >= ``want`` (``want`` <= ``_AHEAD``), taking up to ``_AHEAD`` bytes; with
    nothing of the frame here yet, wait without the stall rule."""
    cdef ssize_t k
    cdef int r
    cdef double last = _now()
    while s.hlen < want:
        k = recv(s.c.fd, s.hb + s.hlen, _AHEAD - s.hlen, 0)
        if k <= 0:
            r = _failed(s, k)
            if r == _TICKED:
                r = _tick(s, last, s.hlen == 0)
            if r:
                return r
            continue
        s.hlen += <size_t>k
        last = _now()
    return 0


# -------------------------------------------------------------------------------------- the source

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

cdef extern from "Python.h":
    ctypedef struct PyObject
    void Py_INCREF(PyObject*)
    void Py_DECREF(PyObject*)


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
        cdef pthread_condattr_t attr
        pthread_mutex_init(&self.mu, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self.cv, &attr)
        pthread_condattr_destroy(&attr)
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
            if f.error != NULL:
                error = <object>f.error
            elif f.status:
                error = self.refused(f.status, f.err, PyBytes_FromStringAndSize(<const char*>f.msg, f.msglen))
            else:
                error = None
            out.append(self.make(fo.batch_id, error))
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
             cnp.ndarray rem_starts not None, cnp.ndarray rem_lengths not None):
        """Check a batch (``POST_ARRAY`` unless it is a C-contiguous ``(n, 3)`` ``uint64`` numpy array,
        ``POST_TOO_MANY`` past ``max_writes``, then ``frame``'s checks and codes, the failing write's
        index in ``index``), take a slot, give it the next seq and the next batch id from ``ids`` (both
        at once: a peer's ids go up in the order its frames go out) and post it. Returns ``(code,
        batch id or None)``: ``POST_SENT``, ``POST_WAKE`` (wake the sender thread), ``POST_FULL``,
        ``POST_FAILED`` or a ``FRAME_*`` code. A writer that finds nobody sending sends it (and what
        queues behind it meanwhile) with ``MSG_DONTWAIT``, without the GIL."""
        cdef const uint64_t* w = NULL
        cdef const uint64_t* ls = NULL
        cdef const uint64_t* ll = NULL
        cdef const uint64_t* rs = NULL
        cdef const uint64_t* rl = NULL
        cdef Py_ssize_t n = 0, nl = 0, nl2 = 0, nr = 0, nr2 = 0, i, index = 0
        cdef int code
        cdef cnp.ndarray arr
        if type(batch) is not cnp.ndarray:
            return _POST_ARRAY, None
        arr = <cnp.ndarray>batch
        if (cnp.PyArray_TYPE(arr) != cnp.NPY_UINT64 or cnp.PyArray_NDIM(arr) != 2 or not cnp.PyArray_ISCARRAY_RO(arr)
                or cnp.PyArray_DIM(arr, 1) != 3):
            return _POST_ARRAY, None
        w = <const uint64_t*>cnp.PyArray_DATA(arr)
        n = cnp.PyArray_DIM(arr, 0)
        if n > self.max_writes:
            return _POST_TOO_MANY, None
        _array(loc_starts, cnp.NPY_UINT64, 1, <const void**>&ls, &nl)
        _array(loc_lengths, cnp.NPY_UINT64, 1, <const void**>&ll, &nl2)
        _array(rem_starts, cnp.NPY_UINT64, 1, <const void**>&rs, &nr)
        _array(rem_lengths, cnp.NPY_UINT64, 1, <const void**>&rl, &nr2)
        if nl2 != nl or nr2 != nr or len(loc_views) != nl:
            raise ValueError("region starts, lengths and views differ in length")
        code = _check_batch(w, n, ls, ll, nl, rs, rl, nr, &index)
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
        cdef _Frame f
        cdef size_t heads = _HEAD + _PAIR * <size_t>n
        try:
            f = _Frame.__new__(_Frame)
            f.iov = <iovec*>malloc(<size_t>(n + 1) * sizeof(iovec) + heads)
            if f.iov == NULL:
                raise MemoryError()
        except BaseException:
            self.slots -= 1
            raise
        cdef unsigned char* h = <unsigned char*>(f.iov + n + 1)
        _put64(h + 8, <uint64_t>n)  # count u32, then the 0 u32
        _put64(h + 16, grant)
        f.iov[0].iov_base = h
        f.iov[0].iov_len = heads
        f.nbytes = heads
        for i in range(n):
            _put64(h + _HEAD + _PAIR * i, w[3 * i + 1])
            _put64(h + _HEAD + _PAIR * i + 8, w[3 * i + 2])
            f.iov[i + 1].iov_base = <void*><size_t>w[3 * i]
            f.iov[i + 1].iov_len = <size_t>w[3 * i + 2]
            f.nbytes += <size_t>w[3 * i + 2]
        f.niov = n + 1
        f.on_done = on_done
        f.keep = loc_views
        f.src = self
        f.c.obj = <PyObject*>f
        f.c.callback = on_done is not None
        Py_INCREF(<PyObject*>f)  # the lists' reference
        _lock(&self.mu)
        if self.failed:  # (it failed while the frame was built)
            pthread_mutex_unlock(&self.mu)
            Py_DECREF(<PyObject*>f)
            self.slots -= 1
            return _POST_FAILED, None
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
        _put64(h, self.seq)
        if self.nflight == 0:
            self.last_progress = _now()
        self.nflight += 1
        _append(&self.unsent, &f.c)
        pthread_mutex_unlock(&self.mu)
        if self.sending or self.out is not None:
            return _POST_SENT, batch_id  # the thread sending takes it next (the sender thread is awake for a remainder)
        self.sending = True
        code = self._pump(MSG_DONTWAIT | MSG_NOSIGNAL)
        self._sent()
        if code == 0 or self.failed:
            return _POST_SENT, batch_id  # (a batch of a peer that failed meanwhile completed with the failure)
        return _POST_WAKE, batch_id  # the socket is full (or broke: the sender thread meets the error too)

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
            if f.error != NULL:
                error = <object>f.error
            elif f.status:
                error = self.refused(f.status, f.err, PyBytes_FromStringAndSize(<const char*>f.msg, f.msglen))
            else:
                error = None
            out.append((fo.on_done, fo.batch_id, error))
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
    """``Source.acks`` without the GIL."""
    cdef uint64_t seq
    cdef uint32_t status, n
    cdef int32_t err
    cdef ssize_t k
    cdef size_t rest
    cdef _fr* f
    cdef _chain queued
    cdef Py_ssize_t nq
    cdef bint called
    cdef int broke
    cdef double now
    while True:
        # every whole ack received: complete its frame
        queued.head = queued.tail = NULL
        nq = 0
        called = False
        broke = 0
        now = _now()
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
