# Included by _tcp_fast.pyx: the sink's landing table. ``Sink`` holds the regions and live grants
# every frame is checked against (``_check``: the rules of ``GrantTable.check``), and the mark of each
# connection landing a frame (``_Conn``, which a ``SinkConn`` embeds), so that a revoke or deregister
# can wait for (or cut) exactly the connections writing through what it takes away.

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
        pthread_mutex_init(&self.mu, NULL)
        _cond_init(&self.cleared)
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
        cdef Py_ssize_t n = 0, n2 = 0, lo
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
        lo = _grant_at(self, key)
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


cdef Py_ssize_t _grant_at(Sink s, uint64_t key) noexcept nogil:
    """Where grant ``key`` is, or would go, in the sorted grants: the first at or above it (holds the mutex)."""
    cdef Py_ssize_t lo = 0, hi = s.ngrants, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if s.grants[mid].key < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef Py_ssize_t _grant_index(Sink s, uint64_t key) noexcept nogil:
    """The index of live grant ``key``, or -1 (holds the mutex)."""
    cdef Py_ssize_t lo = _grant_at(s, key)
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
    """``wait_grant`` and ``wait_region`` without the GIL: wait on ``cleared`` until ``_busy`` is false or
    ``seconds`` passed; True if nothing is landing then."""
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
