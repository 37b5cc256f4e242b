# Included by _tcp_fast.pyx: a batch's checks at the source, and its frame head. ``frame`` and
# ``Source.post`` read the regions, check a batch (and its note) and write its head through the same
# helpers here, so the two can never check differently.

cdef enum:  # a batch's checks at the source (the Python names below are these)
    _FRAME_OK = 0
    _FRAME_ZERO_LENGTH = 1
    _FRAME_LOCAL_OUTSIDE = 2
    _FRAME_REMOTE_OUTSIDE = 3

FRAME_OK = _FRAME_OK
FRAME_ZERO_LENGTH = _FRAME_ZERO_LENGTH
FRAME_LOCAL_OUTSIDE = _FRAME_LOCAL_OUTSIDE
FRAME_REMOTE_OUTSIDE = _FRAME_REMOTE_OUTSIDE
MAX_NOTE = _MAX_NOTE


cdef struct _Regions:
    # the local and the remote regions a batch is checked against: starts and lengths (sorted by start)
    const uint64_t* ls
    const uint64_t* ll
    Py_ssize_t nl
    const uint64_t* rs
    const uint64_t* rl
    Py_ssize_t nr


cdef int _regions(_Regions* r, cnp.ndarray loc_starts, cnp.ndarray loc_lengths, list loc_views,
                  cnp.ndarray rem_starts, cnp.ndarray rem_lengths) except -1:
    """Read the region arrays into ``r`` (``_array``'s checks); ``ValueError`` unless the local starts,
    lengths and views are as many, and the remote starts and lengths."""
    cdef Py_ssize_t nl2 = 0, nr2 = 0
    _array(loc_starts, cnp.NPY_UINT64, 1, <const void**>&r.ls, &r.nl)
    _array(loc_lengths, cnp.NPY_UINT64, 1, <const void**>&r.ll, &nl2)
    _array(rem_starts, cnp.NPY_UINT64, 1, <const void**>&r.rs, &r.nr)
    _array(rem_lengths, cnp.NPY_UINT64, 1, <const void**>&r.rl, &nr2)
    if nl2 != r.nl or nr2 != r.nr or len(loc_views) != r.nl:
        raise ValueError("region starts, lengths and views differ in length")
    return 0


cdef int _check_batch(const uint64_t* w, Py_ssize_t n, const _Regions* r, Py_ssize_t* index) noexcept nogil:
    """``FRAME_OK``, or the ``FRAME_*`` code of the first failing write (its index in ``index``): a zero
    length anywhere first; then, write by write, the local range, then the remote one."""
    cdef Py_ssize_t i
    for i in range(n):
        if w[3 * i + 2] == 0:
            index[0] = i
            return _FRAME_ZERO_LENGTH
    for i in range(n):
        if _find(r.ls, r.ll, r.nl, w[3 * i], w[3 * i + 2]) < 0:
            index[0] = i
            return _FRAME_LOCAL_OUTSIDE
        if _find(r.rs, r.rl, r.nr, w[3 * i + 1], w[3 * i + 2]) < 0:
            index[0] = i
            return _FRAME_REMOTE_OUTSIDE
    return _FRAME_OK


cdef int _check_note(Py_ssize_t nnote, Py_ssize_t n, uint64_t grant) except -1:
    """``ValueError`` unless a note of ``nnote`` bytes may ride a frame of ``n`` writes through ``grant``:
    a sink breaks the connection on any other (``transport.tcp`` words the caller's error first)."""
    if nnote == 0:
        return 0
    if nnote > _MAX_NOTE:
        raise ValueError(f"a note holds at most {_MAX_NOTE} bytes, got {nnote}")
    if n == 0:
        raise ValueError("a note rides a frame of at least one write")
    if grant == 0:
        raise ValueError("a note rides a frame through a grant (grant 0)")
    return 0


cdef void _put_head(unsigned char* h, const uint64_t* w, Py_ssize_t n, uint64_t grant,
                    const unsigned char* note, size_t nnote) noexcept nogil:
    """Write a checked batch's frame head into ``h`` (``_HEAD + _PAIR * n + nnote`` bytes): the header,
    with seq 0 (``post`` writes the seq once it has one), then each write's remote address and length,
    then the note."""
    cdef Py_ssize_t i
    _put64(h, 0)
    _put32(h + 8, <uint32_t>n)
    _put32(h + 12, <uint32_t>nnote)
    _put64(h + 16, grant)
    for i in range(n):
        _put64(h + _HEAD + _PAIR * i, w[3 * i + 1])
        _put64(h + _HEAD + _PAIR * i + 8, w[3 * i + 2])
    if nnote:
        memcpy(h + _HEAD + _PAIR * n, note, nnote)


def frame(cnp.ndarray batch not None, uint64_t grant, cnp.ndarray loc_starts not None,
          cnp.ndarray loc_lengths not None, list loc_views not None,
          cnp.ndarray rem_starts not None, cnp.ndarray rem_lengths not None, bytes note not None=b""):
    """Check a batch (a C-contiguous ``(n, 3)`` ``uint64`` array) and its ``note`` (``ValueError``: longer
    than ``MAX_NOTE``, or on a frame without writes or without a grant) and build what goes on the
    wire: ``(0, 0, [head, view, ...])`` (the note at the end of the head) or ``(FRAME_* code, index of
    the first failing write, None)``. ``Source.post`` runs the same checks and builds the same head."""
    cdef const uint64_t* w = NULL
    cdef _Regions r
    cdef Py_ssize_t n = 0, i, j, off, index = 0
    cdef Py_ssize_t nnote = len(note)
    cdef int code
    _array(batch, cnp.NPY_UINT64, 2, <const void**>&w, &n)
    _regions(&r, loc_starts, loc_lengths, loc_views, rem_starts, rem_lengths)
    _check_note(nnote, n, grant)
    code = _check_batch(w, n, &r, &index)
    if code:
        return code, index, None
    head = PyByteArray_FromStringAndSize(NULL, _HEAD + _PAIR * n + nnote)
    _put_head(<unsigned char*>PyByteArray_AS_STRING(head), w, n, grant, <const unsigned char*><const char*>note,
              <size_t>nnote)
    bufs = [memoryview(head)]
    for i in range(n):
        j = _find(r.ls, r.ll, r.nl, w[3 * i], w[3 * i + 2])
        off = <Py_ssize_t>(w[3 * i] - r.ls[j])
        bufs.append(loc_views[j][off : off + <Py_ssize_t>w[3 * i + 2]])
    return FRAME_OK, 0, bufs
