"""Sealed frames of the ``"tcp"`` control plane: the pure-Python twin of ``pdcore.control._seal``.

A frame on a connection is ``length u32, seq u64, tag [16], body`` (little-endian): ``seq`` counts
from 0 on the connection and ``tag`` is keyed BLAKE2b (16 bytes) over the length, the seq and the
body, keyed with the connection's key (``pdcore.control.tcp_frames``, which says why). The
``Sealer`` gives each body its head; the ``Opener`` takes bytes as they come and gives back the
bodies whose tag verifies, in order, and the refusal that stopped it.

Why twins: every control frame crosses a ``Sealer`` and an ``Opener``, and in Python they were a
fifth of a lone frame's Python on the loop (a hash object per frame, its memoryview slices). The
compiled twin computes BLAKE2b itself (RFC 7693); this one calls ``hashlib``, so the property
tests that hold the twins equal also hold the compiled BLAKE2b equal to ``hashlib``'s.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Final

from ..core.errors import FrameError

__all__ = ["HEADER_BYTES", "TAG_BYTES", "MAX_KEY", "Sealer", "Opener"]

_HEADER: Final = struct.Struct("<IQ")  # body length, seq
HEADER_BYTES: Final = _HEADER.size
TAG_BYTES: Final = 16
MAX_KEY: Final = 64  # BLAKE2b's
_OVERHEAD: Final = HEADER_BYTES + TAG_BYTES
_MAX_LENGTH: Final = 0xFFFF_FFFF


def _key(key: bytes) -> bytes:
    if type(key) is not bytes or not 0 < len(key) <= MAX_KEY:
        raise ValueError(f"a frame key is 1 to {MAX_KEY} bytes")
    return key


def _tag(key: bytes, head: bytes | memoryview, body: bytes) -> bytes:
    h = hashlib.blake2b(head, key=key, digest_size=TAG_BYTES)
    h.update(body)
    return h.digest()


class Sealer:
    """The dialer's side of a connection's frames: each body gets its length, seq and tag."""

    __slots__ = ("_key", "_seq")

    def __init__(self, key: bytes) -> None:
        self._key = _key(key)
        self._seq = 0

    def seal(self, body: bytes) -> tuple[bytes, bytes]:
        """The frame's head (length, seq, tag), to go on the wire right before ``body``."""
        if type(body) is not bytes:
            raise TypeError(f"a frame body is bytes, got {type(body).__name__}")
        if len(body) > _MAX_LENGTH:
            raise ValueError(f"a frame body of {len(body)} bytes (at most {_MAX_LENGTH})")
        head = _HEADER.pack(len(body), self._seq)
        self._seq += 1
        return head + _tag(self._key, head, body), body

    def seal_all(self, bodies: list[bytes]) -> bytes:
        """``bodies`` sealed one after another, as one buffer for one ``send``."""
        return b"".join(part for body in bodies for part in self.seal(body))


class Opener:
    """The listener's side of a connection's frames: bytes in, verified bodies out, in order."""

    __slots__ = ("_key", "_seq", "_buf", "_max")

    def __init__(self, key: bytes, max_body: int) -> None:
        self._key = _key(key)
        self._seq = 0
        self._buf = bytearray()
        self._max = max_body

    @property
    def partial(self) -> int:
        """Bytes of a frame begun and not complete (a connection ending now ends mid-frame)."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> tuple[list[bytes], FrameError | None]:
        """The bodies of the frames ``data`` completes, in order, and the refusal that stopped them (then
        the opener is spent: the connection ends, nothing after a refused frame can be trusted)."""
        buf = self._buf
        buf += data
        out: list[bytes] = []
        at, end = 0, len(buf)
        error: FrameError | None = None
        with memoryview(buf) as mv:  # released before the buffer is trimmed
            while end - at >= _OVERHEAD:
                n, seq = _HEADER.unpack_from(buf, at)
                if n > self._max:
                    error = FrameError("length", f"a frame of {n} bytes (at most {self._max})")
                    break
                body_at = at + _OVERHEAD
                if end - body_at < n:
                    break
                body = bytes(mv[body_at: body_at + n])
                if not hmac.compare_digest(_tag(self._key, mv[at: at + HEADER_BYTES], body), mv[at + HEADER_BYTES: body_at]):
                    error = FrameError("tag", f"frame {seq}: its tag does not verify (forged or corrupted)")
                    break
                if seq != self._seq:
                    error = FrameError("seq", f"frame {seq} where {self._seq} was next (replayed, reordered or one lost)")
                    break
                self._seq += 1
                out.append(body)
                at = body_at + n
        if error is not None:
            self._max = -1  # spent: every later byte is refused
            buf.clear()
        else:
            del buf[:at]
        return out, error
