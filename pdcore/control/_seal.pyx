# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True
"""Sealed frames of the ``"tcp"`` control plane, compiled twin of ``pdcore.control._seal_py`` (read its docstring).

The tag is keyed BLAKE2b written out here from RFC 7693 (section 3: the compression function ``F``,
its mixing function ``G``, the parameter block's first word for a key of ``kk`` bytes and a digest of
``nn``). A connection's key block is compressed once, when its sealer or opener is made; a frame
then costs its own blocks alone (a lone ``Status``: two), no Python object but its body, and one
pass over the bytes a read brought. The twins' property tests hold each tag equal to ``hashlib``'s.

Why not a library: ``hashlib`` from here still makes a hash object per frame, the cost this module
removes; keyed BLAKE2b in OpenSSL is OpenSSL 3's ``EVP_MAC`` and libb2's or libsodium's would be a
new build dependency of the wheel, each for ~100 lines that the property tests pin to ``hashlib``.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy, memset

from ..core.errors import FrameError

__all__ = ["HEADER_BYTES", "TAG_BYTES", "MAX_KEY", "Sealer", "Opener"]

HEADER_BYTES = 12
TAG_BYTES = 16
MAX_KEY = 64

cdef enum:
    _HEAD = 12  # length u32, seq u64
    _TAG = 16
    _OVERHEAD = _HEAD + _TAG
    _BLOCK = 128

cdef uint64_t _MAX_LENGTH = 0xFFFFFFFF

cdef uint64_t _IV[8]
cdef uint8_t _SIGMA[10][16]

_IV[:] = [0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1,
          0x510E527FADE682D1, 0x9B05688C2B3E6C1F, 0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179]
for _r, _row in enumerate((
        (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        (14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3),
        (11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4),
        (7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8),
        (9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13),
        (2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9),
        (12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11),
        (13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10),
        (6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5),
        (10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0))):
    for _i, _s in enumerate(_row):
        _SIGMA[_r][_i] = _s


cdef inline uint64_t _rotr(uint64_t x, int n) noexcept nogil:
    return (x >> n) | (x << (64 - n))


cdef inline uint64_t _load64(const uint8_t* p) noexcept nogil:
    """Little-endian, whatever the host's order."""
    return (<uint64_t>p[0] | <uint64_t>p[1] << 8 | <uint64_t>p[2] << 16 | <uint64_t>p[3] << 24
            | <uint64_t>p[4] << 32 | <uint64_t>p[5] << 40 | <uint64_t>p[6] << 48 | <uint64_t>p[7] << 56)


cdef inline void _store64(uint8_t* p, uint64_t v) noexcept nogil:
    cdef int i
    for i in range(8):
        p[i] = <uint8_t>(v >> (8 * i))


cdef inline void _g(uint64_t* v, int a, int b, int c, int d, uint64_t x, uint64_t y) noexcept nogil:
    v[a] = v[a] + v[b] + x
    v[d] = _rotr(v[d] ^ v[a], 32)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 24)
    v[a] = v[a] + v[b] + y
    v[d] = _rotr(v[d] ^ v[a], 16)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 63)


cdef void _compress(uint64_t* h, const uint8_t* block, uint64_t t, bint last) noexcept nogil:
    """``F``: fold one 128-byte block into ``h``; ``t`` counts the bytes so far, this block's included
    (below 2**64: its high word is 0)."""
    cdef uint64_t v[16]
    cdef uint64_t m[16]
    cdef const uint8_t* s
    cdef int i, r
    for i in range(16):
        m[i] = _load64(block + 8 * i)
    for i in range(8):
        v[i] = h[i]
        v[i + 8] = _IV[i]
    v[12] ^= t
    if last:
        v[14] = ~v[14]
    for r in range(12):
        s = _SIGMA[r % 10]
        _g(v, 0, 4, 8, 12, m[s[0]], m[s[1]])
        _g(v, 1, 5, 9, 13, m[s[2]], m[s[3]])
        _g(v, 2, 6, 10, 14, m[s[4]], m[s[5]])
        _g(v, 3, 7, 11, 15, m[s[6]], m[s[7]])
        _g(v, 0, 5, 10, 15, m[s[8]], m[s[9]])
        _g(v, 1, 6, 11, 12, m[s[10]], m[s[11]])
        _g(v, 2, 7, 8, 13, m[s[12]], m[s[13]])
        _g(v, 3, 4, 9, 14, m[s[14]], m[s[15]])
    for i in range(8):
        h[i] ^= v[i] ^ v[i + 8]


cdef struct _Key:
    uint64_t h[8]  # the state once the key block is folded in (not the last block: a frame follows it)


cdef int _keyed(_Key* k, object key) except -1:
    cdef uint8_t block[_BLOCK]
    cdef Py_ssize_t kk
    cdef int i
    if type(key) is not bytes or not 0 < len(<bytes>key) <= MAX_KEY:
        raise ValueError(f"a frame key is 1 to {MAX_KEY} bytes")
    kk = len(<bytes>key)
    for i in range(8):
        k.h[i] = _IV[i]
    k.h[0] ^= 0x01010000 ^ (<uint64_t>kk << 8) ^ _TAG
    memset(block, 0, _BLOCK)
    memcpy(block, PyBytes_AS_STRING(key), kk)
    _compress(k.h, block, _BLOCK, False)
    return 0


cdef void _tag(const _Key* k, const uint8_t* head, const uint8_t* body, Py_ssize_t n, uint8_t* out) noexcept nogil:
    """The 16-byte tag of ``head`` (``_HEAD`` bytes) then ``body`` (``n``): a block is folded only once a
    byte after it is known to exist, so the one holding the last byte is folded as the last."""
    cdef uint64_t h[8]
    cdef uint8_t block[_BLOCK]
    cdef uint64_t t = _BLOCK  # the key block
    cdef Py_ssize_t fill = _HEAD, take
    memcpy(h, k.h, sizeof(h))
    memcpy(block, head, _HEAD)
    while n > 0:
        if fill == _BLOCK:
            t += _BLOCK
            _compress(h, block, t, False)
            fill = 0
        take = min(_BLOCK - fill, n)
        memcpy(block + fill, body, take)
        fill += take
        body += take
        n -= take
    memset(block + fill, 0, _BLOCK - fill)
    _compress(h, block, t + fill, True)
    _store64(out, h[0])
    _store64(out + 8, h[1])


cdef inline void _head(uint8_t* p, uint64_t n, uint64_t seq) noexcept nogil:
    cdef int i
    for i in range(4):
        p[i] = <uint8_t>(n >> (8 * i))
    _store64(p + 4, seq)


cdef class Sealer:
    """The dialer's side of a connection's frames: each body gets its length, seq and tag."""

    cdef _Key _k
    cdef uint64_t _seq

    def __init__(self, key):
        _keyed(&self._k, key)
        self._seq = 0

    cdef void _seal(self, uint8_t* out, const uint8_t* body, Py_ssize_t n) noexcept:
        _head(out, n, self._seq)
        self._seq += 1
        _tag(&self._k, out, body, n, out + _HEAD)

    def seal(self, bytes body not None):
        """The frame's head (length, seq, tag), to go on the wire right before ``body``."""
        cdef Py_ssize_t n = len(body)
        if <uint64_t>n > _MAX_LENGTH:
            raise ValueError(f"a frame body of {n} bytes (at most {_MAX_LENGTH})")
        head = PyBytes_FromStringAndSize(NULL, _OVERHEAD)
        self._seal(<uint8_t*>PyBytes_AS_STRING(head), <const uint8_t*>PyBytes_AS_STRING(body), n)
        return head, body

    def seal_all(self, list bodies not None):
        """``bodies`` sealed one after another, as one buffer for one ``send``."""
        cdef Py_ssize_t size = 0, n
        cdef uint8_t* p
        for body in bodies:
            if type(body) is not bytes:
                raise TypeError(f"a frame body is bytes, got {type(body).__name__}")
            n = len(<bytes>body)
            if <uint64_t>n > _MAX_LENGTH:
                raise ValueError(f"a frame body of {n} bytes (at most {_MAX_LENGTH})")
            size += _OVERHEAD + n
        out = PyBytes_FromStringAndSize(NULL, size)
        p = <uint8_t*>PyBytes_AS_STRING(out)
        for body in bodies:
            n = len(<bytes>body)
            memcpy(p + _OVERHEAD, PyBytes_AS_STRING(body), n)
            self._seal(p, p + _OVERHEAD, n)
            p += _OVERHEAD + n
        return out


cdef class Opener:
    """The listener's side of a connection's frames: bytes in, verified bodies out, in order."""

    cdef _Key _k
    cdef uint64_t _seq
    cdef bytearray _buf
    cdef long long _max

    def __init__(self, key, long long max_body):
        _keyed(&self._k, key)
        self._seq = 0
        self._buf = bytearray()
        self._max = max_body

    @property
    def partial(self):
        """Bytes of a frame begun and not complete (a connection ending now ends mid-frame)."""
        return len(self._buf)

    def feed(self, data):
        """The bodies of the frames ``data`` completes, in order, and the refusal that stopped them (then
        the opener is spent: the connection ends, nothing after a refused frame can be trusted)."""
        cdef Py_buffer view
        cdef Py_ssize_t at = 0, end
        cdef const uint8_t* p
        cdef bint own
        out = []
        error = None
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            own = len(self._buf) > 0  # a frame begun before: the bytes join it, and are read from the buffer
            if own:
                self._buf += data
                p, end = <const uint8_t*><const char*>self._buf, len(self._buf)
            else:
                p, end = <const uint8_t*>view.buf, view.len
            error = self._open(p, end, &at, out)
            if error is not None:
                self._max = -1  # spent: every later byte is refused
                self._buf.clear()
            elif own:
                del self._buf[:at]
            elif at < end:
                self._buf += (<const char*>view.buf)[at:end]
        finally:
            PyBuffer_Release(&view)
        return out, error

    cdef object _open(self, const uint8_t* p, Py_ssize_t end, Py_ssize_t* at_out, list out):
        cdef Py_ssize_t at = 0, body_at
        cdef uint64_t n, seq
        cdef uint8_t tag[_TAG]
        cdef uint8_t diff
        cdef int i
        try:
            while end - at >= _OVERHEAD:
                n = <uint64_t>p[at] | <uint64_t>p[at + 1] << 8 | <uint64_t>p[at + 2] << 16 | <uint64_t>p[at + 3] << 24
                seq = _load64(p + at + 4)
                if <long long>n > self._max:
                    return FrameError("length", f"a frame of {n} bytes (at most {self._max})")
                body_at = at + _OVERHEAD
                if <uint64_t>(end - body_at) < n:
                    return None
                _tag(&self._k, p + at, p + body_at, <Py_ssize_t>n, tag)
                diff = 0
                for i in range(_TAG):  # every byte compared, whichever differs (as hmac.compare_digest)
                    diff |= tag[i] ^ p[at + _HEAD + i]
                if diff:
                    return FrameError("tag", f"frame {seq}: its tag does not verify (forged or corrupted)")
                if seq != self._seq:
                    return FrameError("seq", f"frame {seq} where {self._seq} was next (replayed, reordered or one lost)")
                self._seq += 1
                out.append(PyBytes_FromStringAndSize(<const char*>p + body_at, <Py_ssize_t>n))
                at = body_at + <Py_ssize_t>n
            return None
        finally:
            at_out[0] = at
