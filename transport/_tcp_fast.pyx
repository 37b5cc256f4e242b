# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True
"""Per-batch work of the TCP transport, compiled twin of ``transport._tcp_fast_py`` (same names,
signatures, results and errors; ``transport.tcp`` chooses, like ``transport.plan``).

One extension module, ``transport._tcp_fast``, written in rooms that Cython ``include``s here, in
this order (each room uses what the ones before it declare):

- ``_tcp_fast_frame.pxi``: a batch's checks at the source and its frame head (with its note); ``frame``.
- ``_tcp_fast_sink.pxi``: ``Sink``, the sink's landing table: the regions and live grants every
  frame is checked against, and the mark of each connection landing a frame.
- ``_tcp_fast_sinkconn.pxi``: ``SinkConn``, one sink connection's loop, which reads a frame, checks
  it, receives its payload into place and acks, all without the GIL.
- ``_tcp_fast_completions.pxi``: a posted frame's record, the chains it moves along, and
  ``Completions``, the queue a source's ack loop hands completed frames to without the GIL.
- ``_tcp_fast_source.pxi``: ``Source`` (one connected peer): ``post`` checks a batch, takes a slot
  and sends the frame from the writer's thread (head and payload as iovecs straight from registered
  memory), ``send_blocking`` is the sender thread's remainder, ``acks`` the ack loop.

This file holds what they share: the wire's sizes, the C declarations, the byte and region helpers.
Shared state is behind pthread mutexes that the loops take without the GIL and Python-side calls
take too. See the twin for the contract.
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
    "MAX_NOTE",
    "SERVE_BROKEN",
    "SERVE_NOTED",
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

cdef enum:  # the wire's sizes, and what both sides' I/O loops share
    _HEAD = 24  # seq u64, count u32, note length u32, grant u64 (the note follows the descriptors)
    _MAX_NOTE = 4096  # the longest note a frame carries (transport.limits.MAX_NOTE; tcp_wire checks they agree)
    _PAIR = 16  # addr u64, length u64
    _ACK = 20  # seq u64, status u32, errno i32, message length u32
    # The most a sink connection keeps in each of its buffers between frames (64 KiB and a little): a
    # frame of more writes (up to max_writes, 16 MiB of descriptors at the transport's default) gets a
    # header buffer of its own for as long as it is read and checked, unmapped once the frame is done,
    # so what many connections hold does not grow with the largest batch each ever received. Frames of
    # up to 4096 writes use the usual buffer and allocate nothing.
    _KEEP = 65600  # _HEAD + _AHEAD + 4096 * _PAIR
    _IOV_CHUNK = 512  # iovecs per recvmsg or sendmsg: below IOV_MAX (1024 on Linux)
    _AHEAD = 40  # bytes a sink may read past a payload: the next frame's header and first descriptor
    _TICKED = -1  # a blocking call waited one kernel timeout (not a SERVE_* result)
    _GONE = -3  # the peer failed while a send was under way


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


cdef extern from "Python.h":
    ctypedef struct PyObject
    void Py_INCREF(PyObject*)
    void Py_DECREF(PyObject*)


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


cdef inline void _deadline_at(timespec* ts, double at) noexcept nogil:
    """``at`` (``_now``'s clock) as the ``timespec`` a timed wait takes."""
    ts.tv_sec = <time_t>at
    ts.tv_nsec = <long>((at - <double>ts.tv_sec) * 1e9)
    if ts.tv_nsec >= 1000000000:
        ts.tv_sec += 1
        ts.tv_nsec -= 1000000000


cdef inline void _cond_init(pthread_cond_t* c) noexcept:
    """A condition variable whose timed waits read ``CLOCK_MONOTONIC`` (``_now``'s clock, which
    ``_deadline_at`` counts in), not the wall clock a setting of the time would move."""
    cdef pthread_condattr_t attr
    pthread_condattr_init(&attr)
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
    pthread_cond_init(c, &attr)
    pthread_condattr_destroy(&attr)


include "_tcp_fast_frame.pxi"
include "_tcp_fast_sink.pxi"
include "_tcp_fast_sinkconn.pxi"
include "_tcp_fast_completions.pxi"
include "_tcp_fast_source.pxi"
