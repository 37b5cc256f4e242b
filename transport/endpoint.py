"""A transport's endpoint: what a peer needs to reach it and check its addresses, and its byte codec.

``encode_endpoint``/``decode_endpoint``: self-describing and versioned (magic, version,
name, instance id, address, regions), bounded, and every field checked on decode
with an error that names it: the bytes come from another process.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass


from .errors import TransportError
from .regions import Region


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What a peer needs to reach a transport and check its addresses (decoded form of ``endpoint()``).

    ``transport`` is the transport's name; ``instance`` is 16 random bytes
    naming one transport object (a restarted process has a new one);
    ``address`` is transport-specific (TCP: ``b"host:port"``); ``regions`` is
    every region registered when the endpoint was taken, sorted by address.
    """

    transport: str
    instance: bytes
    address: bytes
    regions: tuple[Region, ...]


_EP_MAGIC = b"PDTE"
_EP_VERSION = 1
_EP_HEAD = struct.Struct("<4sBB16sI")  # magic, version, len(name), instance, len(address)
_EP_REGION = struct.Struct("<QQQ")  # addr, length, key
_EP_MAX_REGIONS = 1 << 16
_EP_MAX_ADDRESS = 4096


def encode_endpoint(ep: Endpoint) -> bytes:
    """Serialise an endpoint: ``PDTE``, version, name, instance, address, regions."""
    name = ep.transport.encode("ascii")
    if not 0 < len(name) < 256 or len(ep.instance) != 16 or len(ep.address) > _EP_MAX_ADDRESS:
        raise ValueError(f"cannot encode endpoint {ep!r}")
    if len(ep.regions) > _EP_MAX_REGIONS:
        raise ValueError(f"an endpoint holds at most {_EP_MAX_REGIONS} regions, got {len(ep.regions)}")
    parts = [_EP_HEAD.pack(_EP_MAGIC, _EP_VERSION, len(name), ep.instance, len(ep.address)), name, ep.address]
    parts.append(struct.pack("<I", len(ep.regions)))
    parts.extend(_EP_REGION.pack(r.addr, r.length, r.key) for r in ep.regions)
    return b"".join(parts)


def decode_endpoint(data: bytes, *, expect: str | None = None) -> Endpoint:
    """Parse ``endpoint()`` bytes from a peer; anything malformed raises ``TransportError(op="endpoint")``.

    ``expect`` is the transport name the caller can talk to; another name is an error.
    """

    def bad(why: str) -> TransportError:
        return TransportError(f"malformed transport endpoint: {why}", op="endpoint")

    data = bytes(data)
    if len(data) < _EP_HEAD.size:
        raise bad(f"{len(data)} bytes is shorter than the {_EP_HEAD.size}-byte header")
    magic, version, name_len, instance, addr_len = _EP_HEAD.unpack_from(data, 0)
    if magic != _EP_MAGIC:
        raise bad(f"magic {magic!r}, expected {_EP_MAGIC!r}")
    if version != _EP_VERSION:
        raise bad(f"version {version}, this build speaks version {_EP_VERSION}")
    if name_len == 0 or addr_len > _EP_MAX_ADDRESS:
        raise bad(f"name length {name_len}, address length {addr_len}")
    off = _EP_HEAD.size
    if len(data) < off + name_len + addr_len + 4:
        raise bad("truncated before the region count")
    try:
        name = data[off : off + name_len].decode("ascii")
    except UnicodeDecodeError as e:
        raise bad("transport name is not ASCII") from e
    off += name_len
    address = data[off : off + addr_len]
    off += addr_len
    (count,) = struct.unpack_from("<I", data, off)
    off += 4
    if count > _EP_MAX_REGIONS or len(data) != off + count * _EP_REGION.size:
        raise bad(f"{count} regions do not match {len(data) - off} trailing bytes")
    regions = []
    for i in range(count):
        addr, length, key = _EP_REGION.unpack_from(data, off + i * _EP_REGION.size)
        try:
            regions.append(Region(addr, length, key))
        except ValueError as e:
            raise bad(f"region {i}: {e}") from e
    regions.sort(key=lambda r: r.addr)
    for a, b in zip(regions, regions[1:]):
        if b.addr < a.end:
            raise bad(f"regions {a} and {b} overlap")
    if expect is not None and name != expect:
        raise TransportError(f"peer endpoint is for transport {name!r}, this is {expect!r}", op="endpoint")
    return Endpoint(name, instance, address, tuple(regions))


def new_instance_id() -> bytes:
    return os.urandom(16)
