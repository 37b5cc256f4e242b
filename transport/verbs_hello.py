"""The verbs transport's connection handshake, sans-IO: what a source and a sink say before a queue pair is used.

A queue pair is per peer, so its QPN and PSN cannot be in the endpoint: each ``connect`` exchanges
them over one short TCP connection to the sink's handshake listener, and that connection then stays
open as the liveness socket (``transport/verbs_liveness.py``; the frames it carries afterwards are in
``transport/windows.py``). This module holds the handshake's bytes and the checks on them, pure
functions with no socket and no pyverbs, so both sides read one definition of the wire; the
transport does the socket I/O and the queue pairs.

Endpoint: ``endpoint()`` is the common encoding of ``transport.base`` with ``address`` = ``ADDR``
(GID, LID, active MTU, link layer) followed by ``host:port`` of the transport's handshake listener,
and one ``(addr, length, rkey)`` per region.

Handshake: ``connect`` creates the source QP, then sends ``HELLO`` with QPN, PSN, GID, LID and MTU
(with a ``secret``, after a challenge-response, see below); the sink creates its QP, moves it to RTS
and answers ``REPLY`` with its own QPN and PSN; the path MTU is the smaller active MTU of the two.
An ``OK`` reply ends with ``GRANTS`` and the source's live grant keys: the sink's last issued grant
key, the count of this source's live grants and whether the sink binds memory windows, then per live
grant its key (u64), or with windows its ``W`` frame (see "Grants and revoke" in ``transport/verbs_grants.py``).
``max_sinks`` (default 1024) caps the sink QPs a transport accepts; a handshake beyond it is answered
with status ``TOO_MANY`` (and the cap in the QPN field) and the source's ``connect`` raises
``TransportError(op="connect")`` naming the cap.

Authentication
--------------
With ``secret`` (see ``transport/base.py``) the handshake starts with a mutual
challenge-response before any queue-pair information or grant key moves:
the source sends ``HELLO_AUTH`` (the two instance ids and its nonce, no QP
information); the sink answers ``REPLY`` with ``OK`` and ``CHALLENGE`` (its
nonce and ``MAC("verbs/3 sink", sink instance, source instance, source nonce,
sink nonce)``, HMAC-SHA256 with ``derive_key(secret, "verbs-hello")``); the
source checks it (else ``connect`` raises "authentication failed: host:port:
...", ``errno=EACCES``, and sends nothing more) and sends ``PROOF``:
``MAC("verbs/3 source", the same fields, its QP information)`` and that QP
information (QPN, PSN, GID, LID, MTU); only when the proof verifies does the
sink create a QP, apply the source's QP information and answer as without a
secret (``REPLY`` with its QPN and PSN, then ``GRANTS``). A mismatch is
refused with ``AUTH_REQUIRED``, ``AUTH_UNSUPPORTED`` or ``AUTH_FAILED``,
counted in ``auth_failures`` and logged (at most once per host per 10 s). The
whole handshake has ``min(peer_timeout, 5 s)``.

What a party without the secret can do now: reach the handshake listener,
learn what the endpoint already says (instance id, GID, the regions and their
rkeys, which travel over the control channel), and occupy the ``pdcore-verbs-cm``
thread, which serves handshakes one at a time, for at most ``min(peer_timeout,
5 s)`` per connection (delaying other handshakes: a denial of service, not a
write). What it cannot: make the sink create a QP or move one to RTS (so no
RC queue pair of the sink is connected to it, and the sink's device drops its
RDMA WRITEs whatever rkey they carry), learn the sink's QPN or PSN, or learn the
grant floor and live grant keys. An authenticated source gets rkeys only for
its grants' windows (without windows: for each whole region, so a grant limits
it only as "Grants and revoke" in ``transport/verbs_grants.py`` says); and the handshake
does not authenticate RoCE packets: an attacker on the network path who can forge
a live connection's QPN and PSN is out of reach of this check.
"""

from __future__ import annotations

import errno as errno_mod
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .errors import TransportError
from .secret import MAC_BYTES, NONCE_BYTES, auth_failed, hello_mac, same_mac
from .windows import FRAME_WINDOWS, MAX_FRAME_WINDOWS, WINDOWS_HEAD, WINDOWS_ROW, SourceWindows

MAGIC = b"PDTV"
MAGIC_AUTH = b"PDVA"  # the hello of a source with a secret (no QP information until both are authenticated)
VERSION = 4  # v2: the OK reply carries the grant floor and live grants; v3: authenticated; v4: memory windows
#: endpoint ``address``: GID, LID, active MTU (ibv_mtu), link layer; then ``host:port`` (ASCII)
ADDR = struct.Struct("<16sHBB")
#: source → sink: magic, version, sink instance, source instance, QPN, PSN, GID, LID, MTU
HELLO = struct.Struct("<4sB16s16sII16sHB")
#: source → sink with a secret: magic, version, sink instance, source instance, source nonce
HELLO_AUTH = struct.Struct(f"<4sB16s16s{NONCE_BYTES}s")
#: sink → source: magic, version, status, QPN, PSN, path MTU, errno (with ``TOO_MANY``, QPN = the sink's cap)
REPLY = struct.Struct("<4sBBIIBi")
#: after an ``OK`` reply to ``HELLO_AUTH``: the sink's nonce and MAC
CHALLENGE = struct.Struct(f"<{NONCE_BYTES}s{MAC_BYTES}s")
#: the source's QP information: QPN, PSN, GID, LID, MTU (``PROOF`` = the source's MAC, then this)
QP_INFO = struct.Struct("<II16sHB")
PROOF = struct.Struct(f"<{MAC_BYTES}s{QP_INFO.size}s")
KEY_LABEL = "verbs-hello"
SINK_ROLE = b"verbs/3 sink"
SOURCE_ROLE = b"verbs/3 source"
#: after an ``OK`` reply: the sink's last issued grant key, the count of this source's live grants, and
#: whether the sink binds memory windows; then per live grant its key (u64), or with windows its ``W`` frame
GRANTS = struct.Struct("<QIB")
MAX_LIVE_GRANTS = 1 << 20
OK, WRONG_INSTANCE, QP_FAILED, TOO_MANY = 0, 1, 2, 3
AUTH_REQUIRED, AUTH_UNSUPPORTED, AUTH_FAILED = 4, 5, 6  # sink has a secret / has none / the proof is wrong


@dataclass(frozen=True, slots=True)
class Address:
    """An endpoint's ``address``, decoded: the port's GID, LID, active MTU and link layer, and the
    handshake listener's host and port."""

    gid: bytes
    lid: int
    mtu: int
    link_layer: int
    host: str
    port: int


def encode_address(gid: bytes, lid: int, mtu: int, link_layer: int, hostport: str) -> bytes:
    return ADDR.pack(gid, lid, mtu, link_layer) + hostport.encode()


def decode_address(address: bytes) -> Address:
    """``TransportError(op="connect")`` if ``address`` is too short or names no ``host:port``."""
    if len(address) <= ADDR.size:
        raise TransportError(f"verbs endpoint address of {len(address)} bytes is too short", op="connect")
    gid, lid, mtu, link_layer = ADDR.unpack_from(address)
    host, _, port_s = address[ADDR.size :].decode("ascii", "replace").rpartition(":")
    try:
        port = int(port_s)
    except ValueError:
        raise TransportError(f"verbs endpoint address {address!r} has no host:port", op="connect") from None
    return Address(gid, lid, mtu, link_layer, host, port)


@dataclass(frozen=True, slots=True)
class Hello:
    """A hello: the sink instance it names, the source's instance, the source's nonce (``b""``: a
    source without a secret) and its QP information (``QP_INFO`` bytes; an authenticated hello
    leaves it out on the wire, the proof carries it)."""

    sink: bytes
    source: bytes
    nonce: bytes = b""
    info: bytes = b""


class Reply(NamedTuple):
    """A sink's ``REPLY``, unpacked."""

    magic: bytes
    version: int
    status: int
    qpn: int
    psn: int
    mtu: int
    err: int


def encode_hello(hello: Hello) -> bytes:
    if hello.nonce:
        return HELLO_AUTH.pack(MAGIC_AUTH, VERSION, hello.sink, hello.source, hello.nonce)
    return HELLO.pack(MAGIC, VERSION, hello.sink, hello.source, *QP_INFO.unpack(hello.info))


def hello_size(prefix: bytes) -> int | None:
    """The size of the hello whose first 5 bytes (magic, version) are ``prefix``; None if they are
    not a hello of this version (the sink hangs up without a word)."""
    if prefix[4] != VERSION or prefix[:4] not in (MAGIC, MAGIC_AUTH):
        return None
    return HELLO.size if prefix[:4] == MAGIC else HELLO_AUTH.size


def decode_hello(data: bytes) -> Hello:
    """A whole hello (``hello_size`` bytes); ``struct.error`` if it is not."""
    if data[:4] == MAGIC:
        _m, _v, sink, source, *info = HELLO.unpack(data)
        return Hello(sink, source, info=QP_INFO.pack(*info))
    _m, _v, sink, source, nonce = HELLO_AUTH.unpack(data)
    return Hello(sink, source, nonce)


def encode_reply(status: int, qpn: int = 0, psn: int = 0, mtu: int = 0, err: int = 0) -> bytes:
    return REPLY.pack(MAGIC, VERSION, status, qpn, psn, mtu, err)


def decode_reply(data: bytes) -> Reply:
    return Reply(*REPLY.unpack(data))


def challenge(key: bytes, hello: Hello, nonce: bytes) -> bytes:
    """What a sink holding ``key`` answers an authenticated ``hello``: an ``OK`` reply, its ``nonce`` and its MAC."""
    mac = hello_mac(key, SINK_ROLE, hello.sink, hello.source, hello.nonce, nonce)
    return encode_reply(OK) + CHALLENGE.pack(nonce, mac)


def prove(key: bytes, hello: Hello, data: bytes) -> bytes | None:
    """Source side: the ``PROOF`` to send after the sink's ``CHALLENGE`` ``data``, or None if the sink's
    MAC does not verify (it does not hold ``key``)."""
    sink_nonce, mac = CHALLENGE.unpack(data)
    if not same_mac(mac, hello_mac(key, SINK_ROLE, hello.sink, hello.source, hello.nonce, sink_nonce)):
        return None
    return PROOF.pack(_source_mac(key, hello, sink_nonce, hello.info), hello.info)


def check_proof(key: bytes, hello: Hello, sink_nonce: bytes, data: bytes) -> bytes | None:
    """Sink side: the source's QP information (``QP_INFO`` bytes) if ``data`` is the proof of a
    source holding ``key``, else None."""
    proof, info = PROOF.unpack(data)
    if not same_mac(proof, _source_mac(key, hello, sink_nonce, info)):
        return None
    return info


def _source_mac(key: bytes, hello: Hello, sink_nonce: bytes, info: bytes) -> bytes:
    return hello_mac(key, SOURCE_ROLE, hello.sink, hello.source, hello.nonce, sink_nonce, info)


#: why the sink refused to authenticate, as ``connect``'s error says it
_AUTH_REFUSED = {
    AUTH_REQUIRED: "it requires the deployment secret and this transport has none (its secret option is unset)",
    AUTH_UNSUPPORTED: "it has no deployment secret and this transport authenticates every connection",
    AUTH_FAILED: "it did not accept this transport's proof of the deployment secret",
}


def refusal(reply: Reply, where: str) -> TransportError | None:
    """What ``connect`` raises for the sink's ``reply`` (``where``: its host:port), or None for ``OK``."""
    if reply.magic != MAGIC or reply.version != VERSION:
        return TransportError(f"{where} does not speak pdcore verbs v{VERSION}", op="connect")
    status = reply.status
    if status in _AUTH_REFUSED:
        return auth_failed(where, _AUTH_REFUSED[status])
    if status == TOO_MANY:
        return TransportError(
            f"{where} refused the connection: the sink already holds its maximum of {reply.qpn} source "
            f"QPs (its max_sinks={reply.qpn}); disconnect another source there or raise max_sinks",
            op="connect",
            errno=reply.err or errno_mod.ECONNREFUSED,
        )
    if status == WRONG_INSTANCE:
        return TransportError(f"{where} is another transport instance than the endpoint names (restarted?)", op="connect")
    if status != OK:
        return TransportError(f"the peer could not set up its QP (errno {reply.err})", op="connect", errno=reply.err or None)
    return None


def encode_grant_keys(floor: int, keys: Sequence[int]) -> bytes:
    """The ``GRANTS`` part of an ``OK`` reply from a sink without memory windows: the live grants' keys."""
    return GRANTS.pack(floor, len(keys), 0) + struct.pack(f"<{len(keys)}Q", *keys)


def encode_grant_windows(floor: int, frames: Sequence[bytes]) -> bytes:
    """The ``GRANTS`` part of an ``OK`` reply from a sink with memory windows: one ``W`` frame per live grant."""
    return GRANTS.pack(floor, len(frames), 1) + b"".join(frames)


def read_grants(recv: Callable[[int], bytes], where: str) -> tuple[int, frozenset[int], SourceWindows | None]:
    """Read the ``GRANTS`` part of an ``OK`` reply through ``recv(n)`` (exactly ``n`` bytes): the grant
    floor, the live keys (without windows) and the windows (with them, else None). A malformed
    part is ``TransportError(op="connect")``; ``recv``'s own errors pass through."""
    floor, count, windowed = GRANTS.unpack(recv(GRANTS.size))
    if count > MAX_LIVE_GRANTS:
        raise TransportError(f"{where} sent {count} live grants (at most {MAX_LIVE_GRANTS})", op="connect")
    if not windowed:
        return floor, frozenset(struct.unpack(f"<{count}Q", recv(8 * count))), None
    win = SourceWindows(floor=floor)
    for _ in range(count):
        kind, key, n = WINDOWS_HEAD.unpack(recv(WINDOWS_HEAD.size))
        if kind != FRAME_WINDOWS or n > MAX_FRAME_WINDOWS:
            raise TransportError(f"{where} sent a malformed grant in its handshake", op="connect")
        body = recv(n * WINDOWS_ROW.size)
        win.add(key, [WINDOWS_ROW.unpack_from(body, i * WINDOWS_ROW.size) for i in range(n)])
    return floor, frozenset(), win
