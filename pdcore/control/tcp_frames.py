"""The ``"tcp"`` control plane's wire below ``pdcore.control.wire``, sans-IO: the handshake and sealed frames.

A rank sends on connections it dials and receives on connections it accepts
(as the ZeroMQ plane's DEALER and ROUTER). A dialled connection opens with
a handshake, then carries sealed frames one way; the listener answers the
handshake and then only its verdict.

Handshake (little-endian):

- dialer → listener, ``HELLO``: magic ``"PDCT"``, version u8, flags u8 (1: the
  dialer holds the deployment secret), its nonce [16], the length u16 and
  ascii of its own control endpoint (its identity: where answers go).
- With a secret on both sides, listener → dialer, ``CHALLENGE``: its nonce [16]
  and ``MAC("control/1 listener", endpoint, dialer nonce, listener nonce)``
  [32]; the dialer checks it (a wrong one: the listener does not hold our
  secret) and sends ``PROOF``: ``MAC("control/1 dialer", same fields)`` [32].
  Both MACs name their role, so neither can be reflected.
- listener → dialer, the verdict u8: ``OK`` or why not (``AUTH_REQUIRED``,
  ``AUTH_UNSUPPORTED``, ``AUTH_FAILED``, ``BAD_HELLO``). The dialer does not wait
  for it: its frames follow its ``PROOF`` (or ``HELLO``) at once, and a refusal
  closes the connection after the verdict.

Frames, dialer → listener: ``length u32, seq u64, tag [16], body`` where the
body is one ``wire.encode`` frame, ``seq`` counts from 0 on the connection and
``tag`` is keyed BLAKE2b over the length, seq and body, with the connection's
key ``BLAKE2b(key=derive_key(secret, "control-tcp"), dialer nonce, listener
nonce)`` (without a secret the key is the nonces' hash alone: it catches
corruption, it proves nothing). A frame whose tag is wrong (forged or
corrupted), whose seq is not the next (replayed, reordered, dropped) or whose
length is out of bounds is refused and ends the connection; a connection that
ends mid-frame is counted truncated.

What it gives up against CURVE: frames travel in clear (anyone on the path
reads them), and there is no forward secrecy (whoever learns the deployment
secret later can check recorded frames). What it keeps: only holders of the
secret connect, and no frame can be forged, replayed, reordered or cut
without the receiver refusing it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Final

from transport.secret import MAC_BYTES, NONCE_BYTES, hello_mac, same_mac

from . import wire
from ..core.errors import FrameError, LocalProtocolError
from ..twins import load

_seal = load("pdcore.control._seal")
#: ``Sealer(key).seal(body)``/``.seal_all(bodies)`` and ``Opener(key, max_body).feed(data)``: the frames'
#: twins (``pdcore.control._seal_py`` says what they do, ``_seal.pyx`` why they are compiled)
Sealer, Opener = _seal.Sealer, _seal.Opener

__all__ = [
    "MAGIC", "VERSION", "HELLO", "Hello", "HandshakeError", "FrameError", "encode_hello", "decode_hello",
    "hello_size", "challenge", "check_challenge", "proof", "check_proof", "session_key", "Sealer", "Opener",
    "OK", "AUTH_REQUIRED", "AUTH_UNSUPPORTED", "AUTH_FAILED", "BAD_HELLO", "VERDICTS", "OVERHEAD",
    "KEY_LABEL", "CHALLENGE_BYTES",
]

MAGIC: Final = b"PDCT"
VERSION: Final = 1
HELLO: Final = struct.Struct(f"<4sBB{NONCE_BYTES}sH")  # magic, version, flags, nonce, endpoint length
FLAG_AUTH: Final = 1
MAX_ENDPOINT: Final = wire.MAX_CONTROL_ENDPOINT
CHALLENGE_BYTES: Final = NONCE_BYTES + MAC_BYTES
KEY_LABEL: Final = "control-tcp"
LISTENER_ROLE: Final = b"control/1 listener"
DIALER_ROLE: Final = b"control/1 dialer"
OK: Final = 0
AUTH_REQUIRED: Final = 1  # the listener holds a secret; the dialer did not say it holds one
AUTH_UNSUPPORTED: Final = 2  # the dialer holds a secret; the listener holds none
AUTH_FAILED: Final = 3  # the dialer's proof did not verify
BAD_HELLO: Final = 4  # not a hello of this version
VERDICTS: Final = {
    AUTH_REQUIRED: "the listener requires the deployment secret and this rank has none",
    AUTH_UNSUPPORTED: "this rank holds a deployment secret and the listener has none",
    AUTH_FAILED: "the listener refused this rank's proof (a different deployment secret)",
    BAD_HELLO: "the listener did not understand the hello (another version?)",
}
OVERHEAD: Final = _seal.HEADER_BYTES + _seal.TAG_BYTES  # a sealed frame's bytes besides its body


class HandshakeError(Exception):
    """A handshake message that is malformed, or a MAC that does not verify."""


@dataclass(frozen=True)
class Hello:
    auth: bool
    nonce: bytes
    endpoint: str


def encode_hello(hello: Hello) -> bytes:
    ep = hello.endpoint.encode("ascii")
    return HELLO.pack(MAGIC, VERSION, FLAG_AUTH if hello.auth else 0, hello.nonce, len(ep)) + ep


def hello_size(prefix: bytes) -> int:
    """The whole hello's size once its fixed part (``HELLO.size`` bytes) is read; ``HandshakeError`` if it is none."""
    if len(prefix) < HELLO.size:
        raise HandshakeError(f"hello: {len(prefix)} bytes, at least {HELLO.size}")
    magic, version, _flags, _nonce, n = HELLO.unpack(prefix[: HELLO.size])
    if magic != MAGIC or version != VERSION:
        raise HandshakeError(f"not a control hello of version {VERSION}: magic {magic!r}, version {version}")
    if not 0 < n <= MAX_ENDPOINT:
        raise HandshakeError(f"hello: endpoint of {n} bytes (1..{MAX_ENDPOINT})")
    return HELLO.size + n


def decode_hello(data: bytes) -> Hello:
    size = hello_size(data)
    if len(data) != size:
        raise HandshakeError(f"hello: {len(data)} bytes, expected {size}")
    _magic, _version, flags, nonce, _n = HELLO.unpack(data[: HELLO.size])
    if flags & ~FLAG_AUTH:
        raise HandshakeError(f"hello: unknown flags {flags:#x}")
    try:
        endpoint = wire.check_endpoint(data[HELLO.size:].decode("ascii"), "hello endpoint")
    except (UnicodeDecodeError, LocalProtocolError) as e:
        raise HandshakeError(f"hello: {e}") from None
    return Hello(bool(flags & FLAG_AUTH), bytes(nonce), endpoint)


def _fields(hello: Hello, listener_nonce: bytes) -> tuple[bytes, bytes, bytes]:
    return hello.endpoint.encode("ascii"), hello.nonce, listener_nonce


def challenge(key: bytes, hello: Hello, nonce: bytes) -> bytes:
    """The listener's ``CHALLENGE``: its nonce and its MAC."""
    return nonce + hello_mac(key, LISTENER_ROLE, *_fields(hello, nonce))


def check_challenge(key: bytes, hello: Hello, data: bytes) -> bytes:
    """The listener's nonce, once its MAC verifies; ``HandshakeError`` if it does not."""
    if len(data) != CHALLENGE_BYTES:
        raise HandshakeError(f"challenge: {len(data)} bytes, expected {CHALLENGE_BYTES}")
    nonce, mac = data[:NONCE_BYTES], data[NONCE_BYTES:]
    if not same_mac(mac, hello_mac(key, LISTENER_ROLE, *_fields(hello, nonce))):
        raise HandshakeError("the listener's challenge does not verify (it holds another secret)")
    return bytes(nonce)


def proof(key: bytes, hello: Hello, listener_nonce: bytes) -> bytes:
    return hello_mac(key, DIALER_ROLE, *_fields(hello, listener_nonce))


def check_proof(key: bytes, hello: Hello, listener_nonce: bytes, data: bytes) -> None:
    if len(data) != MAC_BYTES or not same_mac(data, proof(key, hello, listener_nonce)):
        raise HandshakeError("the dialer's proof does not verify (it holds another secret)")


def session_key(key: bytes | None, dialer_nonce: bytes, listener_nonce: bytes) -> bytes:
    """The frames' BLAKE2b key of one connection (fresh per connection: its nonces)."""
    return hashlib.blake2b(dialer_nonce + listener_nonce, key=key or b"", digest_size=32).digest()
