"""The TCP transport's hello, sans-IO: how a source opens its two connections and, with a secret, proves it.

A source opens a data connection (frames go out on it) and an ack connection (the sink's
acks come back on it), both with the same random pair token: one socket per direction,
so the source's sends and its ack reader never wait for one socket's lock. Each
connection's hello is ``HELLO`` (magic ``PDTC``, version, the sink's and its own
instance id, the connection's kind and the pair token) or, holding the deployment
secret, ``HELLO_AUTH`` (magic ``PDTA``, the same and a nonce); the sink answers
``HELLO_REPLY`` with a status, and with a secret first a ``CHALLENGE`` (its nonce and
its MAC over both nonces and the hello's fields), which the source checks before it
sends its ``proof``. Both MACs name their role, so neither can be reflected. Pure
functions of bytes, so the fuzzer drives them without sockets (``fuzz/fuzz_hello.py``);
the transport's two sides (``transport/tcp_source.py``, ``transport/tcp_sink.py``) do the
socket I/O.

Wire (little-endian):

- hello, source → sink: ``"PDTC", version u8, sink instance [16], source instance [16],
  kind u8 (1 data, 2 acks), pair token [16]`` (a source without a secret), or ``"PDTA"``,
  the same fields and a source nonce [16] (a source with one);
  sink → source: a reply ``"PDTC", version u8, status u8``: 0 ok, 1 wrong instance,
  2 at its connection cap, 3 this sink needs the secret (the hello was ``PDTC``), 4 this
  sink has no secret (the hello was ``PDTA``), 5 the source's proof was wrong, 6 too many
  handshakes in progress and cut ones still ending (2 and 6 may come before the hello is
  read), 7 an ack connection no data connection of its source and pair token waits for
  (or a data connection whose pair token is in use).
- after a ``PDTA`` hello and a reply with status 0: the sink sends its nonce [16] and
  ``MAC("tcp/4 sink", sink instance, source instance, kind, pair token, source nonce, sink
  nonce)`` [32]; the source checks it (a wrong one fails ``connect``: the sink does not hold
  our secret) and sends ``MAC("tcp/4 source", same fields)`` [32]; the sink checks it and
  sends a second reply (0 ok, 2 at cap, 5 wrong proof, 7 no pair). The MAC is HMAC-SHA256
  with the key ``derive_key(secret, "tcp-hello")`` over length-prefixed fields
  (``transport.secret.hello_mac``). Frames (on a data connection) and acks (on an ack
  connection, ``transport/tcp_wire.py``) follow a reply with status 0 that is not followed
  by a challenge.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .secret import MAC_BYTES, NONCE_BYTES, hello_mac, same_mac

MAGIC = b"PDTC"
MAGIC_AUTH = b"PDTA"  # the hello of a source that authenticates: PDTC's fields, then its nonce
VERSION = 4  # v4: a data and an ack connection per source, paired by a token (v3: the authenticated hello)
PAIR_BYTES = 16
HELLO = struct.Struct(f"<4sB16s16sB{PAIR_BYTES}s")  # magic, version, sink instance, source instance, kind, pair
HELLO_AUTH = struct.Struct(f"<4sB16s16sB{PAIR_BYTES}s{NONCE_BYTES}s")  # ... and the source nonce
DATA = 1  # a hello's kind: the connection the source's frames go out on
ACKS = 2  # ... the connection the sink's acks for the data connection of the same pair come back on
HELLO_REPLY = struct.Struct("<4sBB")  # magic, version, status
CHALLENGE = struct.Struct(f"<{NONCE_BYTES}s{MAC_BYTES}s")  # sink nonce, sink MAC
OK = 0
WRONG_INSTANCE = 1
AT_CAP = 2  # hello reply status: the sink holds max_sinks connections already
AUTH_REQUIRED = 3  # the sink has a secret; the hello did not authenticate
AUTH_UNSUPPORTED = 4  # the hello authenticates; the sink has no secret
AUTH_FAILED = 5  # the source's proof did not verify
BUSY = 6  # _MAX_HELLOS connections are in their handshake already
NO_PAIR = 7  # an ack connection no data connection of its source and pair waits for (or a pair token in use)
KEY_LABEL = "tcp-hello"
SINK_ROLE = b"tcp/4 sink"
SOURCE_ROLE = b"tcp/4 source"


class HelloError(Exception):
    """Handshake bytes that are malformed or not authentic. The only error the functions below raise."""


@dataclass(frozen=True, slots=True)
class Hello:
    """A decoded hello: the sink instance it names, the source's instance, the connection's kind
    (``DATA`` or ``ACKS``) and pair token, and its nonce (``b""``: a source without a secret)."""

    sink: bytes
    source: bytes
    kind: int
    pair: bytes
    nonce: bytes = b""

    def _fields(self) -> tuple[bytes, ...]:
        """What both MACs cover besides the nonces."""
        return self.sink, self.source, bytes([self.kind]), self.pair


def encode_hello(hello: Hello) -> bytes:
    if hello.nonce:
        return HELLO_AUTH.pack(MAGIC_AUTH, VERSION, hello.sink, hello.source, hello.kind, hello.pair, hello.nonce)
    return HELLO.pack(MAGIC, VERSION, hello.sink, hello.source, hello.kind, hello.pair)


def hello_size(prefix: bytes) -> int:
    """The size of the hello whose first 5 bytes (magic, version) are ``prefix``; ``HelloError`` if
    they are not a hello of this version."""
    if len(prefix) < 5:
        raise HelloError(f"a hello starts with 5 bytes of magic and version, got {len(prefix)}")
    magic, version = bytes(prefix[:4]), prefix[4]
    if magic not in (MAGIC, MAGIC_AUTH):
        raise HelloError(f"magic {magic!r} is not a pdcore tcp hello")
    if version != VERSION:
        raise HelloError(f"hello version {version}, this build speaks version {VERSION}")
    return HELLO_AUTH.size if magic == MAGIC_AUTH else HELLO.size


def decode_hello(data: bytes) -> Hello:
    """Parse a whole hello (exactly its bytes); ``HelloError`` otherwise."""
    data = bytes(data)
    if len(data) != hello_size(data[:5]):
        raise HelloError(f"a hello of {len(data)} bytes, expected {hello_size(data[:5])}")
    if data[:4] == MAGIC_AUTH:
        _m, _v, sink, source, kind, pair, nonce = HELLO_AUTH.unpack(data)
    else:
        (_m, _v, sink, source, kind, pair), nonce = HELLO.unpack(data), b""
    if kind not in (DATA, ACKS):
        raise HelloError(f"a hello's kind is {DATA} (data) or {ACKS} (acks), got {kind}")
    return Hello(sink, source, kind, pair, nonce)


def challenge(key: bytes, hello: Hello, nonce: bytes) -> bytes:
    """What a sink sends after a status-0 reply to an authenticated ``hello``: its ``nonce`` and its MAC."""
    return CHALLENGE.pack(nonce, hello_mac(key, SINK_ROLE, *hello._fields(), hello.nonce, nonce))


def check_challenge(key: bytes, hello: Hello, data: bytes) -> tuple[bytes, bytes]:
    """Source side: check the sink's challenge to our ``hello``; return ``(sink nonce, our proof)``.

    ``HelloError`` unless ``data`` is exactly what a sink holding ``key`` sends.
    """
    data = bytes(data)
    if len(data) != CHALLENGE.size or not hello.nonce:
        raise HelloError(f"a challenge has {CHALLENGE.size} bytes, got {len(data)}")
    nonce, _mac = CHALLENGE.unpack(data)
    if not same_mac(challenge(key, hello, nonce), data):
        raise HelloError("the sink's MAC does not verify")
    return nonce, proof(key, hello, nonce)


def proof(key: bytes, hello: Hello, sink_nonce: bytes) -> bytes:
    """The source's answer to the sink's challenge (a MAC in the other direction)."""
    return hello_mac(key, SOURCE_ROLE, *hello._fields(), hello.nonce, sink_nonce)


def check_proof(key: bytes, hello: Hello, sink_nonce: bytes, data: bytes) -> None:
    """Sink side: ``HelloError`` unless ``data`` is exactly the proof of a source holding ``key``."""
    data = bytes(data)
    if len(data) != MAC_BYTES or not hello.nonce or not same_mac(proof(key, hello, sink_nonce), data):
        raise HelloError("the source's proof does not verify")
