# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True
"""Per-batch work of the TCP transport, compiled twin of ``transport._tcp_fast_py`` (same names,
signatures, results and errors; ``transport.tcp`` chooses, like ``transport.plan``).

``frame`` (source) checks a batch against the local and remote regions and builds its frame head
and payload views in one pass; ``check_frame`` (sink) checks every write of a frame against the
sink's regions and the grant before a byte lands; ``parse_acks`` (source) reads every whole ack in
a buffer. The loops run in C over the batch array and the descriptor bytes; Python objects are
made only for what the caller keeps (the head, the views, the acks). See the twin for the contract.
"""

cimport numpy as cnp
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, uint32_t, uint64_t

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
    "check_frame",
    "frame",
    "parse_acks",
]

FRAME_SIZE = 24
ACK_SIZE = 20

FRAME_OK = 0
FRAME_ZERO_LENGTH = 1
FRAME_LOCAL_OUTSIDE = 2
FRAME_REMOTE_OUTSIDE = 3

LAND_OK = 0
LAND_OUTSIDE_REGIONS = 1
LAND_NEEDS_GRANT = 2
LAND_GRANT_NOT_LIVE = 3
LAND_GRANT_OTHER_SOURCE = 4
LAND_OUTSIDE_GRANT = 5

cdef enum:
    _HEAD = 24  # seq u64, count u32, 0 u32, grant u64
    _PAIR = 16  # addr u64, length u64
    _ACK = 20  # seq u64, status u32, errno i32, message length u32


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


def frame(cnp.ndarray batch not None, uint64_t grant, cnp.ndarray loc_starts not None,
          cnp.ndarray loc_lengths not None, list loc_views not None,
          cnp.ndarray rem_starts not None, cnp.ndarray rem_lengths not None):
    """Check a batch (a C-contiguous ``(n, 3)`` ``uint64`` array) and build what goes on the wire:
    ``(0, 0, [head, view, ...])`` or ``(FRAME_* code, index of the first failing write, None)``."""
    cdef const uint64_t* w = NULL
    cdef const uint64_t* ls = NULL
    cdef const uint64_t* ll = NULL
    cdef const uint64_t* rs = NULL
    cdef const uint64_t* rl = NULL
    cdef Py_ssize_t n = 0, nl = 0, nl2 = 0, nr = 0, nr2 = 0, i, j, off
    cdef uint64_t la, ra, length
    _array(batch, cnp.NPY_UINT64, 2, <const void**>&w, &n)
    _array(loc_starts, cnp.NPY_UINT64, 1, <const void**>&ls, &nl)
    _array(loc_lengths, cnp.NPY_UINT64, 1, <const void**>&ll, &nl2)
    _array(rem_starts, cnp.NPY_UINT64, 1, <const void**>&rs, &nr)
    _array(rem_lengths, cnp.NPY_UINT64, 1, <const void**>&rl, &nr2)
    if nl2 != nl or nr2 != nr or len(loc_views) != nl:
        raise ValueError("region starts, lengths and views differ in length")
    for i in range(n):
        if w[3 * i + 2] == 0:
            return FRAME_ZERO_LENGTH, i, None
    head = PyByteArray_FromStringAndSize(NULL, _HEAD + _PAIR * n)
    cdef unsigned char* h = <unsigned char*>PyByteArray_AS_STRING(head)
    _put64(h, 0)
    _put64(h + 8, <uint64_t>n)  # count u32, then the 0 u32
    _put64(h + 16, grant)
    bufs = [memoryview(head)]
    for i in range(n):
        la = w[3 * i]
        ra = w[3 * i + 1]
        length = w[3 * i + 2]
        j = _find(ls, ll, nl, la, length)
        if j < 0:
            return FRAME_LOCAL_OUTSIDE, i, None
        if _find(rs, rl, nr, ra, length) < 0:
            return FRAME_REMOTE_OUTSIDE, i, None
        _put64(h + _HEAD + _PAIR * i, ra)
        _put64(h + _HEAD + _PAIR * i + 8, length)
        off = <Py_ssize_t>(la - ls[j])
        bufs.append(loc_views[j][off : off + <Py_ssize_t>length])
    return FRAME_OK, 0, bufs


def check_frame(bytes desc not None, cnp.ndarray starts not None, cnp.ndarray lengths not None,
                cnp.ndarray guarded not None, list keys not None, list views not None,
                uint64_t grant, int grant_state, cnp.ndarray grant_starts not None, cnp.ndarray grant_lengths not None):
    """Check every write of a frame before any lands: ``(0, 0, total, views, keys)`` or
    ``(LAND_* code, index of the first failing write, 0, None, None)``."""
    cdef const uint64_t* rs = NULL
    cdef const uint64_t* rl = NULL
    cdef const unsigned char* flags = NULL
    cdef const uint64_t* gs = NULL
    cdef const uint64_t* gl = NULL
    cdef Py_ssize_t nreg = 0, nreg2 = 0, nflags = 0, ng = 0, ng2 = 0, i, j, last = -1, off
    cdef Py_ssize_t count = len(desc) // _PAIR
    cdef const unsigned char* d = <const unsigned char*>desc
    cdef uint64_t addr, length, total = 0
    cdef bint overflow = False
    _array(starts, cnp.NPY_UINT64, 1, <const void**>&rs, &nreg)
    _array(lengths, cnp.NPY_UINT64, 1, <const void**>&rl, &nreg2)
    _array(guarded, cnp.NPY_UINT8, 1, <const void**>&flags, &nflags)
    _array(grant_starts, cnp.NPY_UINT64, 1, <const void**>&gs, &ng)
    _array(grant_lengths, cnp.NPY_UINT64, 1, <const void**>&gl, &ng2)
    if nreg2 != nreg or nflags != nreg or len(keys) != nreg or len(views) != nreg or ng2 != ng:
        raise ValueError("region starts, lengths, flags, keys and views differ in length")
    out = []
    used = []
    for i in range(count):
        addr = _get64(d + _PAIR * i)
        length = _get64(d + _PAIR * i + 8)
        j = _find(rs, rl, nreg, addr, length) if length else -1
        if j < 0:
            return LAND_OUTSIDE_REGIONS, i, 0, None, None
        if j != last:
            if not grant and flags[j]:
                return LAND_NEEDS_GRANT, i, 0, None, None
            key = keys[j]
            if key not in used:
                used.append(key)
            last = j
        if grant:
            if grant_state:
                return grant_state, i, 0, None, None
            if _find(gs, gl, ng, addr, length) < 0:
                return LAND_OUTSIDE_GRANT, i, 0, None, None
        off = <Py_ssize_t>(addr - rs[j])
        out.append(views[j][off : off + <Py_ssize_t>length])
        if total + length < total:
            overflow = True
        total += length
    if overflow:  # more than 2**64 bytes in one frame: only possible by writing one region many times over
        return LAND_OK, 0, sum([len(v) for v in out]), out, used
    return LAND_OK, 0, total, out, used


def parse_acks(bytearray buf not None, Py_ssize_t start, Py_ssize_t end, Py_ssize_t max_msg):
    """Every whole ack in ``buf[start:end]`` (a ``bytearray``): ``(acks, new start, bad)``, each ack
    ``(seq, status, errno, message bytes)``; ``bad`` is the length of a too-long message (parsing
    stops there), else 0."""
    cdef const unsigned char* b = <const unsigned char*>PyByteArray_AS_STRING(buf)
    cdef uint64_t seq
    cdef uint32_t status, n
    cdef int32_t err
    if start < 0 or end > len(buf) or start > end:
        raise ValueError(f"[{start}, {end}) is not inside a buffer of {len(buf)} bytes")
    out = []
    while end - start >= _ACK:
        seq = _get64(b + start)
        status = _get32(b + start + 8)
        err = <int32_t>_get32(b + start + 12)
        n = _get32(b + start + 16)
        if <Py_ssize_t>n > max_msg:
            return out, start, n
        if end - start < _ACK + <Py_ssize_t>n:
            break
        out.append((seq, status, err, PyBytes_FromStringAndSize(<const char*>(b + start + _ACK), n)))
        start += _ACK + n
    return out, start, 0
